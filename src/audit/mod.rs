//! The audit log: records written atomically with the changes they describe into Consul
//! (`audit_logs/<uuid>`), shipped to SQL, queried by operators.

pub mod record;

pub use record::{AUDIT_PREFIX, AuditRecord, SCHEMA_VERSION, events};

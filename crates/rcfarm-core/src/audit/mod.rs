//! The audit log: records written atomically with the changes they describe into Consul
//! (`audit_logs/<uuid>`, a transactional outbox), shipped by one farm at a time into SQL
//! (SQLite or PostgreSQL), and queried by operators.

pub mod pace;
pub mod record;
pub mod shipper;
pub mod store;

pub use pace::{AuditPace, BACKLOG_KEY, Backlog, PaceConfig};
pub use record::{AUDIT_PREFIX, AuditRecord, SCHEMA_VERSION, events};
pub use shipper::{SHIPPER_LOCK, Shipper, ShipperConfig, ShipperStats};
pub use store::{AuditError, AuditPage, AuditQuery, AuditStore, Engine, StoredAudit};

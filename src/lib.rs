//! rcfarm: a replication-controller farm backed by Consul.
//!
//! The workspace's crates are its layers, lowest first (see `docs/architecture.md` for the
//! data path and a glossary); a crate uses only those before it:
//! - `rcfarm-consul`: the Consul client ([`consul`]: transport, KV, sessions, transactions,
//!   watches, on-demand reads) and [`util`].
//! - `rcfarm-server`: the embedded Consul-compatible server ([`server`]); the client's wire
//!   types only.
//! - `rcfarm-core`: the domain ([`labels`], [`audit`], [`rc`], [`health`], [`scheduler`],
//!   [`failsafe`], [`budget`], [`freshness`], [`task`], [`clock`]) and the farm ([`rctask`], [`roll`], [`farm`]).
//! - `rcfarm-ops`: [`api`], [`overview`], [`cli`].
//!
//! The test equipment is apart: `rcfarm-testkit` (chaos, the invariant checker, the model
//! check, the node simulator), which the tests use directly, and `rcfarm-tools` (its commands:
//! `rcfarm-tools bench|chaos|model-check|simulate-nodes`). This crate, the binaries `rcfarm`
//! and `rcctl` and the Debian package depend on neither (`scripts/module-circles`).
//!
//! This crate is the facade: it names each module where it always was (`rcfarm::consul`,
//! `rcfarm::farm`, …) for the binaries, the integration tests and the fuzz targets.

pub use rcfarm_consul as consul;
pub use rcfarm_consul::util;
pub use rcfarm_core::{
    audit, budget, clock, failsafe, farm, freshness, health, labels, rc, rctask, roll, scheduler,
    task,
};
pub use rcfarm_ops::{api, cli, overview};
pub use rcfarm_server as server;

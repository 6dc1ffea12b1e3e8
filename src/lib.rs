//! rcfarm: a replication-controller farm backed by Consul.
//!
//! Layers, lowest first; a module uses only those listed before it (see
//! `docs/architecture.md` for the data path and a glossary):
//! - base: [`util`] (Go-syntax durations, backoff, jitter).
//! - Consul client: [`consul`] (transport, KV, sessions, transactions, watches, on-demand reads).
//! - Consul server: [`server`], the embedded Consul-compatible server; it uses only the
//!   client's wire types.
//! - domain: [`labels`] (sets, selectors, store, cache), [`audit`] (records, outbox, SQL,
//!   shipper), [`rc`] (model, store, locks), [`health`], [`scheduler`], [`failsafe`], [`task`]
//!   (the per-object task handle).
//! - farm: [`rctask`] (the RC task: pure planner, fenced writes), [`roll`] (rolling updates),
//!   [`farm`] (session, watches, ownership, sweep).
//! - operator surface: [`api`] (HTTP API, metrics, status page), [`overview`], [`cli`].
//! - test kit, used by tests and by `rcfarm chaos|bench|simulate-nodes`, never by the product:
//!   [`chaos`], [`invariants`], [`simulator`].

pub mod api;
pub mod audit;
pub mod chaos;
pub mod cli;
pub mod consul;
pub mod failsafe;
pub mod farm;
pub mod health;
pub mod invariants;
pub mod labels;
pub mod overview;
pub mod rc;
pub mod rctask;
pub mod roll;
pub mod scheduler;
pub mod server;
pub mod simulator;
pub mod task;
pub mod util;

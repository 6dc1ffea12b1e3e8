//! rcfarm: a replication-controller farm backed by Consul.
//!
//! Layers, lowest first; no module reaches upward:
//! - [`util`]: durations in Go syntax, backoff.
//! - [`consul`]: the Consul HTTP client (KV, sessions, transactions, blocking-query watches).
//! - [`server`]: the embedded Consul-compatible development server.

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

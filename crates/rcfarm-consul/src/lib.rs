//! rcfarm's Consul client: KV, sessions, transactions and blocking queries over HTTP.
//!
//! Hand-rolled over `reqwest` because no crate on crates.io supports `/v1/txn`. It follows
//! `shared/CONSUL_API.md` and never depends on anything only the embedded server does, so it
//! works against real Consul clusters.
//!
//! The lowest crate of the workspace: it depends on no other rcfarm crate. [`util`] (Go-syntax
//! durations, backoff, jitter) lives here because everything above uses it too.

pub mod util;

mod answers;
mod client;
mod coalesce;
mod derived;
mod error;
mod fenced;
mod kvlist;
mod port;
mod session;
mod tls;
mod token;
mod transport;
mod tree_cache;
mod txn;
mod types;
mod verbs;
mod watch;
mod watched;

pub use answers::watch_answer_ages;
pub use client::{
    ClientStatsSnapshot, Consul, ConsulConfig, DEFAULT_MAX_CONNS, MIN_MAX_CONNS, init_tls,
    parse_go_bool, with_https,
};
pub use derived::{Derived, DerivedWatch};
pub use error::{ConsulError, Result};
pub use fenced::{BatchError, Fence, FenceError, FencedBatch, FencedTxn};
pub use kvlist::{KvEntry, KvList, KvRef};
pub use port::{Answer, Exchange, Port, PortFailure, PortFuture};
pub use session::{Session, SessionConfig};
pub use tls::{TlsConfig, tls_advice};
pub use tree_cache::{ParseFn, TreeCache, TreeState};
pub use txn::{
    Committed, KvVerb, MAX_TXN_BYTES, MAX_TXN_OPS, TxnBudget, TxnFailure, TxnOp, TxnOpError,
    TxnResponse, encoded_len, split_to_fit,
};
pub use types::{
    KvPair, QueryMeta, QueryOptions, ServiceCheck, SessionBehavior, SessionEntry, SessionId,
    SessionRequest,
};
pub use watch::{
    Demand, FastGuard, REFERENCE_READERS, Regressions, SinkWatch, Snapshot, SnapshotRx, Watch,
    WatchConfig, WatchStats, readers_scale, spawn_sink_watch, spawn_watch,
};
pub use watched::{CacheSignals, Fold, Watched};

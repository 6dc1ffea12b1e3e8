//! The RC task: keeps one RC's desires true ("meet desires"), P2's `replication_controller.go`
//! split as kube-runtime does it: a pure [`plan`] from what is observed, and a worker that
//! applies plans in fenced transactions.

mod cut;
pub mod intents;
mod outcome;
pub mod plan;
mod removals;
mod reports;
pub mod status;
mod transfer;
mod transfers;
mod worker;
mod writes;

pub use intents::{INTENT_PREFIX, IntentState, IntentView, intent_key};
pub use plan::{Action, Neighbours, Observed, Plan, Removals, Transfer, plan};
pub use status::{Condition, FarmStatus, RcScrape, RcStatus, StatusRegistry, set_condition};
pub use transfers::{
    STATUS_PREFIX, TransferReader, parse_transfers, rcfarm_status, rcfarm_status_key, stale_starts,
    status_key,
};
pub use worker::{RcState, TaskConfig, TaskContext, TaskEvent, TaskHandle, spawn};
pub use writes::pod_write_ops;

//! What an RC task's step comes to: how a write failed ([`TaskError`]), what the removal
//! budget let an action do ([`Gated`]) and what applying it led to beyond success
//! ([`Applied`]). Apart from the worker and its writes so that
//! each of those may use them without using the other.

use super::plan::Action;
use crate::consul::{ConsulError, FenceError};
use crate::rc::RcStoreError;
use crate::scheduler::SchedulerError;

#[derive(Debug, thiserror::Error)]
pub(super) enum TaskError {
    #[error("fenced: this farm no longer holds the ownership lock")]
    Fenced,
    /// The RC changed since the plan was made (the write was refused; plan again).
    #[error("the RC changed while planning; planning again")]
    Stale,
    #[error(transparent)]
    Consul(#[from] ConsulError),
    #[error("scheduler: {0}")]
    Scheduler(#[from] SchedulerError),
    /// A lock or record written through the RC store (its source kept, not flattened).
    #[error(transparent)]
    Store(#[from] RcStoreError),
    #[error("{0}")]
    Other(String),
}

impl From<FenceError> for TaskError {
    fn from(e: FenceError) -> TaskError {
        match e {
            FenceError::Fenced { .. } => TaskError::Fenced,
            FenceError::Stale { .. } => TaskError::Stale,
            FenceError::Conflict { source, .. } => TaskError::Consul(source),
            // Only a deterministic report can exist already; its callers take this as done.
            FenceError::AlreadyRecorded => TaskError::Other("the record exists already".into()),
            FenceError::Consul(e) => TaskError::Consul(e),
        }
    }
}

impl TaskError {
    /// A write that may or may not have been applied (Consul unreachable, or the answer lost).
    pub(super) fn outcome_unknown(&self) -> bool {
        matches!(self, TaskError::Consul(e) if e.is_retryable())
    }
}

/// What applying one action led to, beyond success.
pub(super) enum Applied {
    Done,
    /// The scheduler has no more nodes to give in this pass.
    AllocationExhausted,
    /// Another session holds the mutation lock.
    MutationLocked,
    /// A session (named) holds P2's node-transfer lock: transfers are frozen.
    Frozen(String),
}

/// What the budget let an action do.
pub(super) enum Gated {
    /// Apply this (perhaps fewer nodes than planned), having been granted `granted` removals.
    Go { action: Action, granted: u64 },
    /// Nothing of it may be done now: why.
    Held(String),
}

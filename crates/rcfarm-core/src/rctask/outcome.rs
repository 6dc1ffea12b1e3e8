//! What an RC task's step comes to: how a write failed ([`TaskError`]), what the removal
//! budget let an action do ([`Gated`]) and what applying it led to beyond success
//! ([`Applied`]). Apart from the worker and its writes so that
//! each of those may use them without using the other.

use std::collections::BTreeSet;

use super::plan::Action;
use crate::consul::{ConsulError, FenceError};
use crate::rc::RcStoreError;
use crate::scheduler::NodeName;
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
    /// The cluster's removal window had no room for a write's charge when it was sent
    /// (another farm spent it since the plan): nothing was written; plan again.
    #[error("{0}")]
    Held(String),
    #[error("{0}")]
    Other(String),
}

impl From<crate::failsafe::ChargeError> for TaskError {
    fn from(e: crate::failsafe::ChargeError) -> TaskError {
        match e {
            crate::failsafe::ChargeError::Held(why) => TaskError::Held(why),
            crate::failsafe::ChargeError::Fence(e) => e.into(),
            crate::failsafe::ChargeError::Read(e) => TaskError::Consul(e),
        }
    }
}

impl From<FenceError> for TaskError {
    fn from(e: FenceError) -> TaskError {
        match e {
            FenceError::Fenced { .. } => TaskError::Fenced,
            FenceError::Stale { .. } => TaskError::Stale,
            // Only `Failsafe::commit_charged` sets a charge, and it reads the key and tries
            // again before it lets this through: the plan is made again.
            FenceError::Uncharged { .. } => TaskError::Stale,
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
    /// Apply this (perhaps fewer nodes than planned), with the removals granted to it.
    Go {
        action: Action,
        removals: GrantedRemovals,
    },
    /// Nothing of it may be done now: why.
    Held(String),
}

/// The pods of an action that count against the cluster's removal window: each write charges
/// the counted pods it removes in its own transaction ([`crate::failsafe::Failsafe::commit_charged`]),
/// so nothing is granted ahead and nothing given back.
#[derive(Debug, Default)]
pub(super) struct GrantedRemovals {
    /// The nodes whose pods count against the window and are not written yet.
    counted: BTreeSet<NodeName>,
}

impl GrantedRemovals {
    pub(super) fn new(counted: impl IntoIterator<Item = NodeName>) -> Self {
        GrantedRemovals {
            counted: counted.into_iter().collect(),
        }
    }

    /// What a write of `nodes` is charged: the counted pods among them (each charged once,
    /// by the first write that carries it).
    pub(super) fn charge(&mut self, nodes: &[NodeName]) -> u64 {
        nodes.iter().filter(|n| self.counted.remove(*n)).count() as u64
    }
}

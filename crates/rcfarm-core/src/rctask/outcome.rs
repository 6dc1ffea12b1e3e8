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
    /// Apply this (perhaps fewer nodes than planned), with the removals granted to it.
    Go {
        action: Action,
        removals: GrantedRemovals,
    },
    /// Nothing of it may be done now: why.
    Held(String),
}

/// The removals an action was granted, spent as its writes commit: what it does not remove
/// goes back to the farm's budget when this is dropped (see [`crate::failsafe::Reservation`]).
#[derive(Debug, Default)]
pub(super) struct GrantedRemovals {
    reservation: Option<crate::failsafe::Reservation>,
    /// The nodes whose pods count against the budget.
    counted: BTreeSet<NodeName>,
}

impl GrantedRemovals {
    pub(super) fn new(
        reservation: crate::failsafe::Reservation,
        counted: impl IntoIterator<Item = NodeName>,
    ) -> Self {
        GrantedRemovals {
            reservation: Some(reservation),
            counted: counted.into_iter().collect(),
        }
    }

    /// A write touching `nodes` committed (or may have: its outcome is unknown): the counted
    /// pods among them are spent.
    pub(super) fn written(&mut self, nodes: &[NodeName]) {
        let n = nodes.iter().filter(|n| self.counted.remove(*n)).count() as u64;
        if let Some(r) = &mut self.reservation {
            r.spend(n);
        }
    }

    /// Settles a write of `nodes` by its result, and passes the result on: spent if it
    /// committed or may have (Consul unreachable, the answer lost); left to be given back if it
    /// was refused (stale, fenced, a conflict, too large, malformed).
    pub(super) fn settled<T>(
        &mut self,
        nodes: &[NodeName],
        result: Result<T, TaskError>,
    ) -> Result<T, TaskError> {
        if result.is_ok() || result.as_ref().is_err_and(TaskError::outcome_unknown) {
            self.written(nodes);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    //! Exact accounting: a write is charged exactly what its committed transactions removed.
    //! The failures are Consul's own answers, from the embedded server, injected between the
    //! chunks of an action as the worker commits them (`settled`, chunk after chunk, stopping
    //! at the first failure).

    use std::sync::Arc;

    use super::*;
    use crate::consul::{Fence, FencedTxn, Session, TxnOp};
    use crate::failsafe::{Failsafe, FailsafeConfig, MaxRemovals};

    fn nodes(names: &[&str]) -> Vec<NodeName> {
        names.iter().map(|n| NodeName::from(*n)).collect()
    }

    /// Each way Consul refuses a write, or leaves its outcome unknown, as the RC task sees it.
    async fn failures() -> Vec<(&'static str, TaskError, bool)> {
        let (server, consul, ours, theirs) = crate::testing::two_sessions().await;
        consul
            .txn(&[TxnOp::lock("t/lock", b"o".to_vec(), ours.id())])
            .await
            .unwrap();
        consul.kv_put("t/rc", b"1", None).await.unwrap();
        let fenced = |s: &Session| FencedTxn::fenced(Fence::new("t/lock", s.id()));
        let err = |r: Result<u64, crate::consul::FenceError>| TaskError::from(r.unwrap_err());
        let stale = err(fenced(&ours)
            .guard(TxnOp::check_index("t/rc", 999_999))
            .op(TxnOp::set("t/x", b"x".to_vec()))
            .commit(&consul)
            .await);
        let fence = err(fenced(&theirs)
            .op(TxnOp::set("t/x", b"x".to_vec()))
            .commit(&consul)
            .await);
        let conflict = err(fenced(&ours)
            .op(TxnOp::cas("t/label", b"x".to_vec(), 999_999))
            .commit(&consul)
            .await);
        let too_large = err(fenced(&ours)
            .op(TxnOp::set("t/big", vec![b'x'; 600 * 1024]))
            .commit(&consul)
            .await);
        server.shutdown().await;
        let gone = err(fenced(&ours)
            .op(TxnOp::set("t/x", b"x".to_vec()))
            .commit(&consul)
            .await);
        vec![
            ("the RC changed since the plan (stale)", stale, false),
            ("the farm lost the RC's lock (fenced)", fence, false),
            ("a label moved (conflict)", conflict, false),
            ("too large (413)", too_large, false),
            (
                "malformed (400)",
                TaskError::Consul(ConsulError::Rejected {
                    status: 400,
                    body: "failed to parse the transaction".into(),
                }),
                false,
            ),
            ("Consul unreachable: maybe applied", gone, true),
        ]
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_is_charged_exactly_what_its_committed_chunks_removed() {
        for (what, error, unknown) in failures().await {
            assert_eq!(error.outcome_unknown(), unknown, "{what}: {error}");
            let failsafe = Arc::new(Failsafe::new(
                "f",
                FailsafeConfig {
                    max_removals: MaxRemovals::Pods(10),
                    ..FailsafeConfig::default()
                },
            ));
            let used = || failsafe.status().removals_in_window;
            // Six pods to remove in three chunks of two; the second chunk fails.
            let victims = nodes(&["a", "b", "c", "d", "e", "f"]);
            let (reservation, held) = failsafe.reserve(6);
            assert!(held.is_none());
            let mut removals = GrantedRemovals::new(reservation, victims.clone());
            let mut results = vec![Ok(()), Err(error), Ok(())].into_iter();
            let mut outcome = Ok(());
            for chunk in victims.chunks(2) {
                let r = results.next().unwrap_or(Ok(()));
                if let Err(e) = removals.settled(chunk, r) {
                    outcome = Err(e);
                    break;
                }
            }
            assert!(outcome.is_err(), "{what}");
            drop(removals);
            let want = if unknown { 4 } else { 2 };
            assert_eq!(
                used(),
                want,
                "{what}: the first chunk committed (2 pods){}; the rest went back",
                if unknown {
                    ", and the second may have (2 more)"
                } else {
                    ""
                }
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_that_wrote_nothing_costs_nothing() {
        for (what, error, unknown) in failures().await {
            let failsafe = Arc::new(Failsafe::new("f", FailsafeConfig::default()));
            let (reservation, _) = failsafe.reserve(3);
            let mut removals = GrantedRemovals::new(reservation, nodes(&["a", "b", "c"]));
            assert!(
                removals
                    .settled(&nodes(&["a", "b", "c"]), Err::<(), _>(error))
                    .is_err()
            );
            drop(removals);
            assert_eq!(
                failsafe.status().removals_in_window,
                if unknown { 3 } else { 0 },
                "{what}"
            );
        }
        // An action that never wrote (allocation exhausted, the mutation lock elsewhere,
        // frozen) drops its grant unspent.
        let failsafe = Arc::new(Failsafe::new("f", FailsafeConfig::default()));
        let (reservation, _) = failsafe.reserve(1);
        drop(GrantedRemovals::new(reservation, nodes(&["a"])));
        assert_eq!(failsafe.status().removals_in_window, 0);
    }
}

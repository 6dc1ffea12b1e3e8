//! The RC task's side of [`crate::freshness`]: before it applies the first action of a plan,
//! it asks the rule which views that decision needs current to the RC version it acts on, and
//! reads those again first (then plans again from them).

use std::time::Duration;

use super::outcome::TaskError;
use super::plan::Action;
use super::worker::Worker;
use crate::freshness::{Decision, Seen, View, stale_views};
use crate::rc::Rc;
use crate::scheduler::NodeName;

/// How long a decision waits for a read of a view it needs before the pass fails (and is
/// retried with backoff): a whole tree's read, queued behind the watch's pace.
const READ_LIMIT: Duration = Duration::from_secs(30);

/// What kind of decision a plan's first action is, for the rules (none: nothing to do), with
/// the nodes whose pods the plan may take over in place.
fn decision_of(action: Option<&Action>, takeover: &[NodeName]) -> Decision {
    let Some(action) = action else {
        return Decision::Idle;
    };
    match action {
        Action::Schedule(nodes) if nodes.iter().any(|n| takeover.contains(n)) => Decision::TakeOver,
        Action::Schedule(_) | Action::Allocate(_) | Action::Repair(_) => Decision::Place,
        Action::Unschedule(_) | Action::Replace(_) => Decision::Remove,
        Action::StartTransfer { .. } => Decision::Transfer,
        Action::CompleteTransfer | Action::RollbackTransfer(_) => Decision::EndTransfer,
    }
}

impl Worker {
    /// What the task knows of each view `action` reads.
    fn seen(&self, rc: &Rc) -> [Seen; 3] {
        [
            Seen::new(View::RcRecord, rc.modify_index),
            Seen {
                // Above the RC's version only if Consul's index went back (a restored
                // server): a read made for the old store's index says nothing of the new one.
                read_for: if self.nodes_read_for > rc.modify_index {
                    0
                } else {
                    self.nodes_read_for
                },
                ..Seen::new(View::NodeLabels, self.ctx.nodes.index())
            },
            Seen {
                owed: self.ctx.pod_tickets.lock().contains_key(&self.id),
                ..Seen::new(View::PodLabels, self.ctx.pods.index())
            },
        ]
    }

    /// Reads the views the decision to take `first` (a plan's first action, from a view in
    /// which the pods on `takeover` may be taken over; none: nothing to do) needs and the
    /// task's are behind on. `true`: something was read, and the plan must be made again.
    pub(super) async fn read_stale_views(
        &mut self,
        rc: &Rc,
        first: Option<&Action>,
        takeover: &[NodeName],
    ) -> Result<bool, TaskError> {
        let decision = decision_of(first, takeover);
        let stale = stale_views(decision, rc.modify_index, &self.seen(rc));
        if stale.is_empty() {
            return Ok(false);
        }
        tracing::debug!(
            ?decision,
            ?stale,
            version = rc.modify_index,
            "reading views behind the RC before deciding"
        );
        for view in stale {
            match view {
                View::NodeLabels => self.read_nodes(rc).await?,
                View::PodLabels => self.read_owed_pods().await?,
                // The record is the change itself: never behind it. The others are no RC
                // task decision's (`freshness::RULES`).
                View::RcRecord | View::LockTree | View::Objects | View::RemovalWindow => continue,
            }
            metrics::counter!("rcfarm_decision_reads_total", "view" => view.name()).increment(1);
        }
        Ok(true)
    }

    /// Waits for a read of the node label tree sent after now: it sees every change committed
    /// before the RC version this task holds (that version was read before now).
    async fn read_nodes(&mut self, rc: &Rc) -> Result<(), TaskError> {
        if let Some(d) = self.ctx.nodes.demand() {
            let ticket = d.urge();
            tokio::time::timeout(READ_LIMIT, d.fresh(ticket))
                .await
                .map_err(|_| {
                    TaskError::Other(format!(
                        "the node label tree was not read again within {READ_LIMIT:?}"
                    ))
                })?;
        }
        self.nodes_read_for = self.nodes_read_for.max(rc.modify_index);
        Ok(())
    }

    /// Waits for the read of the pod label tree this RC's ticket names (pods another session
    /// may have written), then drops the ticket unless a newer one replaced it meanwhile.
    async fn read_owed_pods(&self) -> Result<(), TaskError> {
        let ticket = self.ctx.pod_tickets.lock().get(&self.id).copied();
        if let Some(t) = ticket {
            self.ctx.pods_fresh(t, READ_LIMIT).await?;
            let mut tickets = self.ctx.pod_tickets.lock();
            if tickets.get(&self.id) == Some(&t) {
                tickets.remove(&self.id);
            }
        }
        Ok(())
    }
}

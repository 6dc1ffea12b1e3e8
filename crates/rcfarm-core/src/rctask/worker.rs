//! The RC task: one per owned RC. It observes (from the farm's caches), plans (a pure function),
//! and applies the plan as fenced Consul transactions, each beginning with `check-session` on
//! the RC's ownership lock and carrying its audit record.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::intents::IntentView;
use super::outcome::{Applied, Gated, TaskError};
use super::plan::{Neighbours, Observed, Transfer, plan};
use super::status::StatusRegistry;
use crate::clock::Clock;
use crate::consul::{Consul, ConsulError, SessionId};
use crate::health::HealthCache;
use crate::labels::{LabelCache, LabelSet, Selector, split_pod_label_id};
use crate::rc::{DesiredState, InvalidRc, LockView, POD_ID_LABEL, RC_ID_LABEL, Rc, RcId, RcStore};
use crate::scheduler::{NodeName, NodeSet, Scheduler};
use crate::task::{Inbox, Next, PassFuture};
use crate::util::{Backoff, jitter_half};

/// Tunables of RC tasks.
#[derive(Debug, Clone)]
pub struct TaskConfig {
    /// Re-plan this often even when nothing changed.
    pub resync: Duration,
    /// Roll a node transfer back if the new pod is not healthy by then.
    pub transfer_timeout: Duration,
    /// Move pods of static-strategy RCs off ineligible nodes too (P2 moves only dynamic ones').
    pub transfer_static: bool,
    pub error_backoff_max: Duration,
    /// Actions applied in one pass before the task looks at its inputs again (a new RC
    /// version, cancellation) and starts another.
    pub max_actions_per_pass: usize,
}

/// How a pass ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pass {
    /// Nothing left to do.
    Settled,
    /// The desires cannot be met now: looked at again within seconds.
    Unmet,
    /// Removals are held (the cluster's window has no room, or the tripwire holds them): looked
    /// at again when woken (room came back, an operator released them, the tripwire let go).
    Held,
    /// The cap on actions was reached with more to do.
    Again,
}

impl Default for TaskConfig {
    fn default() -> Self {
        Self {
            resync: Duration::from_secs(30),
            transfer_timeout: Duration::from_secs(300),
            transfer_static: false,
            error_backoff_max: Duration::from_secs(30),
            max_actions_per_pass: 16,
        }
    }
}

/// What tasks of one farm share.
pub struct TaskContext {
    pub consul: Consul,
    pub farm_id: String,
    pub pods: Arc<LabelCache>,
    /// The node label tree the scheduler reads, for its index and a read sent on demand
    /// before a decision that needs it current (`crate::freshness`).
    pub nodes: Arc<LabelCache>,
    pub health: Arc<HealthCache>,
    pub scheduler: Arc<dyn Scheduler>,
    pub intents: Arc<IntentView>,
    /// Every RC's transfer in flight, read once for a burst of tasks.
    pub transfers: Arc<super::transfers::TransferReader>,
    pub status: Arc<StatusRegistry>,
    /// Sessions holding each RC's mutation lock, from the farm's watch of the lock tree.
    /// The RC lock tree, from the farm's watch (who holds each RC's mutation lock).
    pub locks: watch::Receiver<Arc<LockView>>,
    /// Every RC, from the farm's watch (a new RC reads its old RC's desired count).
    pub rcs: watch::Receiver<Option<Arc<crate::rc::RcListing>>>,
    /// The farm's removal budget and tripwire: every removal asks it first.
    pub failsafe: Arc<crate::failsafe::Failsafe>,
    /// RCs whose pods another session may have written since the pod label tree was last
    /// read (taken over from another farm, or after a farm left): the task waits for the read
    /// of that ticket ([`crate::consul::Demand`]) before its first plan.
    pub pod_tickets: parking_lot::Mutex<HashMap<RcId, u64>>,
    /// For each RC a rolling update moves replicas onto (its new RC), the RC it moves them
    /// from, per the farm's watch of `rolls/`: the only RC whose given-up pods it takes over.
    pub roll_sources: parking_lot::RwLock<Arc<HashMap<RcId, RcId>>>,
    /// Every write waits for its slot here while the audit outbox is too big.
    pub pace: Arc<crate::audit::AuditPace>,
    /// How many times the farm's watches saw Consul answer with an older state than they had
    /// seen (a store restored from a backup): what a task read before one is re-read.
    pub store_regressions: Arc<crate::consul::Regressions>,
    pub config: TaskConfig,
    pub clock: Clock,
}

impl TaskContext {
    /// Waits, up to `limit`, for a read of the pod label tree sent after `ticket`.
    pub(super) async fn pods_fresh(&self, ticket: u64, limit: Duration) -> Result<(), TaskError> {
        let Some(d) = self.pods.demand() else {
            return Ok(());
        };
        tokio::time::timeout(limit, d.fresh(ticket))
            .await
            .map_err(|_| {
                TaskError::Other(format!(
                    "the pod label tree was not read again within {limit:?}"
                ))
            })
    }
}

/// The RC as the farm last saw it.
#[derive(Debug, Clone)]
pub enum RcState {
    Valid(Arc<Rc>),
    Invalid(Arc<InvalidRc>),
    Deleted,
}

/// Why a task stopped on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskEvent {
    /// A write failed its fencing check: the farm no longer holds the RC's lock.
    Fenced(RcId),
}

/// The farm's handle on an RC task.
pub type TaskHandle = crate::task::TaskHandle<RcState>;

/// Starts the task of an RC the farm now owns with `session`.
pub fn spawn(
    ctx: Arc<TaskContext>,
    session: SessionId,
    parent: &CancellationToken,
    id: RcId,
    initial: RcState,
    events: mpsc::UnboundedSender<TaskEvent>,
) -> TaskHandle {
    let span = tracing::info_span!("rc", rc_id = %id, farm_id = %ctx.farm_id);
    crate::task::spawn(id, initial, parent, move |inbox| {
        let now = ctx.clock.now();
        // The regressions seen before the task started are behind its first read.
        let epoch = ctx.store_regressions.count();
        let mut worker = Worker {
            ctx,
            session,
            id,
            inbox,
            events,
            transfer: None,
            transfer_loaded: false,
            transfer_epoch: epoch,
            transfer_since: now,
            transfer_started: None,
            unconfirmed_alloc: None,
            unmet: None,
            frozen: None,
            invalid_reported: None,
            rejected_reported: None,
            warned: None,
            last_seen: None,
            pending_dealloc: BTreeSet::new(),
            held: (false, false),
            backoff: Backoff::new(Duration::from_millis(200), Duration::from_secs(30)),
            unmet_backoff: Backoff::new(Duration::from_millis(200), Duration::from_secs(5)),
            nodes_read_for: 0,
        };
        // `run` borrows the worker where this block keeps it: an `async fn` that takes `self`
        // by value holds two copies of it in its state (the argument and the moved-in local,
        // 520 bytes each), and a farm holds thousands of idle tasks.
        async move { worker.run().await }.instrument(span)
    })
}

pub(super) struct Worker {
    pub(super) ctx: Arc<TaskContext>,
    pub(super) session: SessionId,
    pub(super) id: RcId,
    /// The object's state as the farm last saw it, wake-ups, and the stop signal.
    pub(super) inbox: Inbox<RcState>,
    pub(super) events: mpsc::UnboundedSender<TaskEvent>,
    pub(super) transfer: Option<Transfer>,
    /// Whether `transfer` reflects the status key. Cleared after a failed pass: a transfer's
    /// start or finish may have been applied with its answer lost, and acting on the old
    /// belief would leave a stale transfer in Consul or record its end twice.
    pub(super) transfer_loaded: bool,
    /// [`TaskContext::store_regressions`] when `transfer` was read: a store gone back since
    /// may hold a transfer this task saw end (see `load_transfer`).
    pub(super) transfer_epoch: u64,
    /// The transfer must be learnt from a read sent after this (the claim, or a failed pass).
    pub(super) transfer_since: tokio::time::Instant,
    /// When the transfer in flight started, on this farm's monotonic clock (its recorded
    /// start, carried over at a takeover).
    pub(super) transfer_started: Option<tokio::time::Instant>,
    /// A node allocated for a transfer whose start had an unknown outcome: kept if the
    /// transfer turns out to be in flight, given back otherwise.
    pub(super) unconfirmed_alloc: Option<NodeName>,
    /// The unmet-desires reason last reported (so it is reported once, not every pass).
    pub(super) unmet: Option<String>,
    /// The hold of P2's node-transfer lock (session, `LockIndex`) last reported as freezing
    /// this RC's transfers.
    pub(super) frozen: Option<(Arc<str>, u64)>,
    /// The `ModifyIndex` of the invalid record last reported.
    pub(super) invalid_reported: Option<u64>,
    /// The `ModifyIndex` of the RC version whose writes Consul refused as too large or
    /// malformed (a huge manifest), last reported.
    pub(super) rejected_reported: Option<u64>,
    /// The RC version whose unusual (but served) fields were last warned about.
    pub(super) warned: Option<u64>,
    /// The desired state last seen, its index and change marker, to notice direct KV writes.
    pub(super) last_seen: Option<(u64, DesiredState, Option<String>)>,
    /// Nodes to give back to the scheduler (a deallocation that failed is retried).
    pub(super) pending_dealloc: BTreeSet<NodeName>,
    /// Whether the RC's removals are held now, and whether that episode was audited.
    pub(super) held: (bool, bool),
    /// Paces retries after failed passes (Consul trouble); reset by any pass that succeeds.
    pub(super) backoff: Backoff,
    /// Paces passes while desires cannot be met (too few nodes): short, and skipped when the
    /// RC itself changes, so an operator's fix is acted on at once.
    pub(super) unmet_backoff: Backoff,
    /// The newest RC version the node label tree was read for (a read sent after the task
    /// held that version): `crate::freshness`'s `read_for` of the node view.
    pub(super) nodes_read_for: u64,
}

/// A pass's result, with the RC version it was made for.
pub(super) struct PassOutcome {
    version: Option<u64>,
    /// `None`: the RC key was deleted.
    result: Option<Result<Pass, TaskError>>,
}

/// What a pass's result asks of the loop, before the backoffs give it durations: the RC
/// task's error policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Policy {
    /// Stop: the RC key is deleted.
    Deleted,
    /// Stop: a write failed its fence; another farm may own the RC.
    Fenced,
    /// Settled: look again at the resync, at once on a change.
    Resync,
    /// Desires unmet: at the resync, and not sooner than the unmet pacing unless the RC itself
    /// changes.
    PacedUnmet,
    /// Removals held: at the resync, and at once when the RC changes or the farm wakes the task
    /// (its failsafe look, every half second, wakes the tasks when room comes back). Not held
    /// like unmet desires: a hold would keep a woken task waiting out its pacing while the
    /// tasks that were not held take the room that came back (seen in a chaos run: an RC
    /// scaled to 0 held for 20 s across two operator releases).
    Held,
    /// The cap on actions per pass, with more to do: soon, a little later each time in a row.
    Again,
    /// The RC changed during the pass: plan again with the new version, shortly.
    Stale,
    /// Consul refused the write as too large or malformed: report it once per version, then
    /// look again now and then.
    Rejected,
    /// Anything else: back off, and learn the transfer state again.
    Backoff,
}

/// The error policy, pure: one row per kind of result in its tests.
pub(super) fn policy(result: Option<&Result<Pass, TaskError>>) -> Policy {
    match result {
        None => Policy::Deleted,
        Some(Ok(Pass::Settled)) => Policy::Resync,
        Some(Ok(Pass::Unmet)) => Policy::PacedUnmet,
        Some(Ok(Pass::Held)) => Policy::Held,
        Some(Ok(Pass::Again)) => Policy::Again,
        Some(Err(TaskError::Stale)) => Policy::Stale,
        Some(Err(TaskError::Fenced)) => Policy::Fenced,
        Some(Err(TaskError::Consul(ConsulError::Rejected { status, .. })))
            if *status == 413 || *status == 400 =>
        {
            Policy::Rejected
        }
        Some(Err(_)) => Policy::Backoff,
    }
}

impl crate::task::Reconciler for Worker {
    type State = RcState;
    type Outcome = PassOutcome;

    fn reconcile(&mut self, state: RcState) -> PassFuture<'_, PassOutcome> {
        Box::pin(async move {
            let version = match &state {
                RcState::Valid(rc) => Some(rc.modify_index),
                _ => None,
            };
            let result = match state {
                RcState::Deleted => None,
                RcState::Invalid(inv) => {
                    Some(self.report_invalid(&inv).await.map(|_| Pass::Settled))
                }
                RcState::Valid(rc) => Some(self.pass(&rc).await),
            };
            PassOutcome { version, result }
        })
    }

    async fn next(&mut self, outcome: PassOutcome) -> Next {
        let now = self.ctx.clock.now();
        let resync = jitter_half(self.ctx.config.resync * 2).min(self.ctx.config.resync * 2);
        let backoff_max = self.ctx.config.error_backoff_max;
        match policy(outcome.result.as_ref()) {
            Policy::Deleted => {
                tracing::info!("RC key deleted: stopping its task and leaving its pods");
                self.ctx.status.remove_rc(self.id);
                Next::Stop
            }
            Policy::Fenced => {
                tracing::warn!("lost the RC's ownership lock; stopping without further writes");
                let _ = self.events.send(TaskEvent::Fenced(self.id));
                Next::Stop
            }
            Policy::Resync => {
                self.backoff.reset();
                self.unmet_backoff.reset();
                Next::Requeue(resync)
            }
            Policy::PacedUnmet => {
                self.backoff.reset();
                // Node changes retrigger unmet RCs; pace them rather than loop hot.
                Next::Hold {
                    after: resync,
                    at: now + self.unmet_backoff.next_delay(),
                    change_lifts: true,
                }
            }
            Policy::Held => {
                self.backoff.reset();
                Next::Requeue(resync)
            }
            // Nothing is settled (its conditions stay as they are) and the next pass comes
            // soon, a little later each time in a row, so a plan that never settles cannot
            // hammer Consul.
            Policy::Again => Next::Requeue(self.backoff.next_delay().min(backoff_max)),
            Policy::Stale => {
                tracing::debug!(
                    "the RC changed during the pass; planning again with the new version"
                );
                Next::Requeue(Duration::from_millis(200))
            }
            Policy::Rejected => {
                let Some(Err(TaskError::Consul(ConsulError::Rejected { status, body }))) =
                    outcome.result
                else {
                    // Invariant: `policy` says Rejected only for this result.
                    unreachable!("Rejected is a refused write")
                };
                // Retrying the same write cannot help; the RC (or Consul's limits) must
                // change. Boxed, like the pass: inline, this rarely taken report's state
                // machine (a transaction in flight) made every idle task ~3 KB larger.
                match Box::pin(self.report_rejected(outcome.version, status, &body)).await {
                    Ok(()) => Next::Hold {
                        after: backoff_max,
                        at: now + backoff_max,
                        change_lifts: true,
                    },
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot report the refused write; retrying");
                        let wait = self.backoff.next_delay().min(backoff_max);
                        Next::Hold {
                            after: wait,
                            at: now + wait,
                            change_lifts: false,
                        }
                    }
                }
            }
            Policy::Backoff => {
                let e = match outcome.result {
                    Some(Err(e)) => e.to_string(),
                    _ => String::new(),
                };
                // Whatever this pass wrote last may have been applied: learn the transfer
                // state from Consul again before acting on it.
                self.transfer_loaded = false;
                self.transfer_since = now;
                let wait = self.backoff.next_delay().min(backoff_max);
                tracing::warn!(error = %e, retry_in = ?wait, "RC pass failed");
                metrics::counter!("rcfarm_rc_pass_errors_total").increment(1);
                self.set_status(|s| s.last_error = Some(e));
                Next::Hold {
                    after: wait,
                    at: now + wait,
                    change_lifts: false,
                }
            }
        }
    }

    fn inbox(&mut self) -> &mut Inbox<RcState> {
        &mut self.inbox
    }
}

impl Worker {
    async fn run(&mut self) {
        tracing::info!("RC task started");
        crate::task::drive(self).await;
        if self.held.0 {
            self.ctx
                .failsafe
                .set_held(&format!("rc:{}", self.id), false);
        }
        tracing::info!("RC task stopped");
    }

    /// Updates this RC's status, unless this task was stopped (see
    /// [`StatusRegistry::update_rc`]).
    pub(super) fn set_status(&self, f: impl FnOnce(&mut super::status::RcStatus)) {
        self.ctx
            .status
            .update_rc(self.id, &self.ctx.farm_id, &self.inbox.cancel, f);
    }

    /// One convergence pass: plan and apply until there is nothing left to do. Returns whether
    /// the desires are unmet.
    pub(super) async fn pass(&mut self, rc: &Rc) -> Result<Pass, TaskError> {
        let started = self.ctx.clock.now();
        self.set_status(|s| s.set_condition("Invalid", None));
        self.invalid_reported = None;
        self.warn_unusual(rc);
        self.notice_changes(rc).await?;
        self.load_transfer().await?;
        if let Some(node) = self.unconfirmed_alloc.take()
            && self.transfer.as_ref().map(|t| &t.new_node) != Some(&node)
        {
            self.deallocate(rc, std::slice::from_ref(&node)).await;
        }
        if self.transfer.is_none() && self.holds_mutation_lock() {
            // Left over from a transfer whose release was lost: it would block rolling updates.
            RcStore::new(self.ctx.consul.clone())
                .release_mutation(self.id, &self.session, &self.id.node_transfer_holder())
                .await?;
        }
        self.retry_deallocations(rc).await;
        self.settle_frozen(rc).await?;
        let mut allocation_exhausted = false;
        let mut mutation_locked_elsewhere = false;
        let mut frozen_by = None;
        // Until the plan is empty or held, there is more to do.
        let mut result = Ok(Pass::Again);
        let mut held = None;
        for _ in 0..self.ctx.config.max_actions_per_pass.max(1) {
            // Read again only if the store went back during the pass (else `transfer` is
            // what this pass's writes left it).
            self.load_transfer().await?;
            let mut o = self
                .observe(rc, allocation_exhausted, mutation_locked_elsewhere)
                .await?;
            if o.transfer_frozen.is_none() {
                o.transfer_frozen = frozen_by.clone();
            }
            let p = plan(&o);
            // Every decision (nothing to do included) from views current to the RC version it
            // acts on: one behind is read first, and the plan made again (`crate::freshness`).
            if self
                .read_stale_views(rc, p.actions.first(), &o.takeover)
                .await?
            {
                continue;
            }
            // Applying needs only the current pods; do not hold every eligible node's name
            // across the writes (thousands of RCs do this at once when a farm starts).
            o.eligible = NodeSet::default();
            self.publish_status(rc, &o, &p);
            let Some(action) = p.actions.first().cloned() else {
                self.settle_held(rc, &o, None).await?;
                result = self.settle_unmet(rc, p.unmet).await.map(|_| {
                    if self.unmet.is_some() {
                        Pass::Unmet
                    } else {
                        Pass::Settled
                    }
                });
                break;
            };
            let (action, mut removals) = match self.gate_removals(&o, action) {
                Gated::Go { action, removals } => (action, removals),
                Gated::Held(why) => {
                    self.settle_held(rc, &o, Some(why.clone())).await?;
                    held = Some(why);
                    break;
                }
            };
            tracing::debug!(?action, "applying");
            // Each write charges what it removes; one that finds no room when it is sent
            // writes nothing, and the RC is held as a plan without room would be.
            let applied = match self.apply(rc, &o, action, &mut removals).await {
                // Less room than the plan saw (another farm charged since): plan again on it.
                Err(TaskError::Held(_)) if self.ctx.failsafe.room().0 > 0 => continue,
                Err(TaskError::Held(why)) => {
                    self.settle_held(rc, &o, Some(why.clone())).await?;
                    held = Some(why);
                    break;
                }
                other => other?,
            };
            match applied {
                Applied::Done => {}
                Applied::AllocationExhausted => allocation_exhausted = true,
                Applied::MutationLocked => mutation_locked_elsewhere = true,
                Applied::Frozen(holder) => frozen_by = Some(holder),
            }
        }
        if held.is_some() {
            // Looked at again when the RC changes or the farm wakes the task (the window slid,
            // an operator released), and at the resync.
            result = Ok(Pass::Held);
        }
        metrics::counter!("rcfarm_converge_passes_total").increment(1);
        metrics::histogram!("rcfarm_converge_pass_seconds").record(started.elapsed().as_secs_f64());
        self.set_status(|s| {
            s.last_pass = Some(self.ctx.clock.wall());
            s.passes += 1;
            if result.is_ok() {
                s.last_error = None;
            }
        });
        result
    }

    pub(super) async fn observe<'a>(
        &self,
        rc: &'a Rc,
        allocation_exhausted: bool,
        mutation_locked_elsewhere: bool,
    ) -> Result<Observed<'a>, TaskError> {
        let own = Selector::from_equalities([(RC_ID_LABEL, self.id.to_string().as_str())]);
        let current: BTreeMap<NodeName, String> = self
            .ctx
            .pods
            .matches(&own)
            .iter()
            .filter_map(|id| {
                split_pod_label_id(id).map(|(n, p)| (NodeName::from(n), p.to_string()))
            })
            .collect();
        let eligible = self
            .ctx
            .scheduler
            .eligible_set(&rc.manifest, &rc.node_selector)
            .await?;
        let mut health: BTreeMap<NodeName, _> = self
            .ctx
            .health
            .for_pod(rc.pod_id())
            .into_iter()
            .map(|(n, h)| (NodeName::from(n), h))
            .collect();
        let health_in_use = !health.is_empty();
        if let Some(t) = &self.transfer {
            // The transfer completes on its new pod's health: a result from before the node
            // ran it (a pod of this id that ran there earlier) says nothing of it.
            let fresh = match self.ctx.health.status_with_index(rc.pod_id(), &t.new_node) {
                Some((_, hi)) => {
                    let (reality, _) = self
                        .ctx
                        .consul
                        .kv_get(
                            &format!("reality/{}/{}", t.new_node, rc.pod_id()),
                            &crate::consul::QueryOptions::default(),
                        )
                        .await?;
                    crate::health::speaks_of_reality(
                        hi,
                        reality.map(|r| r.modify_index),
                        rc.manifest.health_checked(),
                    )
                }
                None => true,
            };
            if !fresh {
                health.remove(&t.new_node);
            }
        }
        let mut bad_intents =
            self.ctx
                .intents
                .bad(rc.pod_id(), rc.manifest.digest(), current.keys().cloned());
        // A pod of this pod id missing a label the RC gives its pods (removed or changed by
        // hand) is repaired like a bad intent: both are written again.
        let want = rc.labels_for_pods();
        let want = Selector::from_equalities(want.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        for (node, pod) in &current {
            if pod != rc.pod_id() || bad_intents.contains(node) {
                continue;
            }
            let id = crate::labels::pod_label_id(node, pod);
            if self.ctx.pods.contains(&id) && !self.ctx.pods.id_matches(&id, &want) {
                bad_intents.insert(node.clone());
            }
        }
        // The labels every write planned from this view is guarded by, as seen now: the
        // RC's own pods (of any pod id) and other RCs' pods of this pod id. A node with no
        // label here is written create-only.
        let mut labels_seen: BTreeMap<String, (LabelSet, u64)> = BTreeMap::new();
        for (node, pod) in &current {
            let id = crate::labels::pod_label_id(node, pod);
            if let Some((l, i)) = self.ctx.pods.get_with_index(&id) {
                labels_seen.insert(id, (Arc::unwrap_or_clone(l), i));
            }
        }
        let extra = self.other_records(rc).await?;
        let mut nb = self.neighbours(rc, &mut labels_seen, &BTreeSet::new(), &extra);
        if !nb.unconfirmed.is_empty() {
            // A disabled RC with pods of our pod id it no longer wants, and no roll record
            // naming it: P2's `p2-rctl rolling-update` moves replicas without one, holding
            // both RCs' mutation locks. The farm's view of the lock tree may lag the roller's
            // first step: ask Consul, rather than place the new pods elsewhere.
            let confirmed = self.rolled_by_one_session(&nb.unconfirmed).await?;
            nb = self.neighbours(rc, &mut labels_seen, &confirmed, &extra);
        }
        let Neighbours {
            takeover, occupied, ..
        } = nb;
        let runs_other = current
            .iter()
            .filter(|(node, pod)| self.ctx.intents.runs_other(node, pod, rc.manifest.digest()))
            .map(|(node, _)| node.clone())
            .collect();
        let (retiring, in_roll) = {
            let sources = self.ctx.roll_sources.read();
            let retiring = rc
                .retired_by()
                .is_some_and(|roll| sources.get(&roll) == Some(&self.id));
            let in_roll = sources
                .iter()
                .find(|(new, old)| **new == self.id || **old == self.id)
                .map(|(roll, _)| format!("rolling update {roll}"));
            (retiring, in_roll)
        };
        let locked_elsewhere = mutation_locked_elsewhere
            || (self.ctx.locks.borrow().mutation(self.id).is_some() && !self.holds_mutation_lock());
        Ok(Observed {
            rc,
            current,
            eligible,
            health,
            health_in_use,
            bad_intents,
            transfer: self.transfer.clone(),
            takeover,
            occupied,
            labels_seen,
            allocation_exhausted,
            mutation_locked_elsewhere: locked_elsewhere,
            transfer_static: self.ctx.config.transfer_static,
            transfer_frozen: self
                .ctx
                .locks
                .borrow()
                .node_transfer(self.id)
                .map(|(s, _)| format!("session {s}")),
            transfer_age: self.transfer_age(),
            transfer_timeout: self.ctx.config.transfer_timeout,
            runs_other,
            retiring,
            in_roll,
        })
    }

    pub(super) fn publish_status(&self, rc: &Rc, o: &Observed<'_>, p: &super::plan::Plan) {
        let healthy = o
            .current
            .keys()
            .filter(|n| o.health.get(*n).is_some_and(|h| h.is_passing()))
            .count();
        self.set_status(|s| {
            s.pod_id = Some(rc.pod_id().to_string());
            s.selector = Some(rc.node_selector.to_string());
            s.desired = Some(rc.replicas_desired);
            s.current = o.current.len();
            s.healthy = healthy;
            s.nodes = o.current.keys().cloned().collect();
            s.disabled = rc.disabled;
            s.transfer = self.transfer.clone();
            s.set_condition(
                "Disabled",
                rc.disabled
                    .then(|| "disabled: no scheduling changes".to_string()),
            );
            s.set_condition(
                "Transferring",
                self.transfer
                    .as_ref()
                    .map(|t| format!("moving the pod on {} to {}", t.old_node, t.new_node)),
            );
            s.set_condition(
                "Waiting",
                p.waiting
                    .clone()
                    .filter(|_| !rc.disabled && self.transfer.is_none()),
            );
            s.set_condition(
                "TransferFrozen",
                o.transfer_frozen.as_ref().map(|holder| {
                    format!(
                        "{holder} holds {}: no node transfer starts, completes or rolls back",
                        self.id.node_transfer_lock_key()
                    )
                }),
            );
        });
    }

    /// Whether this task's node transfer holds the RC's mutation lock (per the farm's view).
    /// The farm's session may hold it for a rolling update instead: that is someone else.
    pub(super) fn holds_mutation_lock(&self) -> bool {
        self.ctx
            .locks
            .borrow()
            .mutation(self.id)
            .is_some_and(|(s, v)| **s == *self.session && **v == *self.id.node_transfer_holder())
    }

    /// The records of other RCs that run pods of this RC's pod id and that the farm's listing
    /// does not hold (it reads the records of the RCs the farm serves, of rolling updates and
    /// of RCs under a held mutation lock: issue 38), read from Consul. Empty unless another
    /// RC's pods share the pod id (a rolling update, usually), so most passes read nothing.
    async fn other_records(&self, rc: &Rc) -> Result<HashMap<RcId, Arc<Rc>>, TaskError> {
        let listing = self.ctx.rcs.borrow().clone();
        let mut missing: BTreeSet<RcId> = BTreeSet::new();
        for id in self
            .ctx
            .pods
            .matches(&Selector::from_equalities([(POD_ID_LABEL, rc.pod_id())]))
        {
            let Some(owner) = self
                .ctx
                .pods
                .get(&id)
                .and_then(|l| RcId::parse(l.get(RC_ID_LABEL)?).ok())
            else {
                continue;
            };
            if owner != self.id && !listing.as_ref().is_some_and(|l| l.rcs.contains_key(&owner)) {
                missing.insert(owner);
            }
        }
        if missing.is_empty() {
            return Ok(HashMap::new());
        }
        let keys: Vec<String> = missing.iter().map(|id| id.key()).collect();
        let found = self.ctx.consul.read_keys(&keys).await?;
        Ok(found
            .values()
            .filter_map(|kv| Rc::from_kv(&kv.key, kv.value_bytes(), kv.modify_index).ok())
            .map(|rc| (rc.id, Arc::new(rc)))
            .collect())
    }

    /// Where other RCs run this RC's pod id: the nodes to take over first when growing, the
    /// nodes to keep off, and every such pod's labels with their `ModifyIndex` (the writes
    /// planned from this view are guarded by them). Only a rolling update's own new RC takes
    /// pods over: an RC that is disabled and runs more pods than it wants has given those pods
    /// up to the RC a roll moves its replicas to (a roll record `rolls/<this RC>` naming it as
    /// old, or, for `p2-rctl rolling-update`, which writes no record, both RCs' mutation locks
    /// held by one session with one value). Up to that many are taken over in place (unhealthy
    /// ones first, then by name), as the roll's arithmetic assumes. Every other RC's pod of
    /// this pod id is left alone: an unrelated RC that took a roll's given-up pod (for a node
    /// transfer, say) would overwrite what the roll's new RC had just written.
    fn neighbours(
        &self,
        rc: &Rc,
        seen: &mut BTreeMap<String, (LabelSet, u64)>,
        confirmed: &BTreeSet<RcId>,
        extra: &HashMap<RcId, Arc<Rc>>,
    ) -> Neighbours {
        let me = self.id.to_string();
        // Other RCs' pods of this pod id: RC → (healthy, node).
        let mut others: BTreeMap<String, Vec<(bool, NodeName)>> = BTreeMap::new();
        for id in self
            .ctx
            .pods
            .matches(&Selector::from_equalities([(POD_ID_LABEL, rc.pod_id())]))
        {
            let Some((node, pod)) = split_pod_label_id(&id) else {
                continue;
            };
            let Some((labels, index)) = self.ctx.pods.get_with_index(&id) else {
                continue;
            };
            let owner = labels.get(RC_ID_LABEL).cloned();
            seen.insert(id.clone(), (Arc::unwrap_or_clone(labels), index));
            let Some(owner) = owner.filter(|o| *o != me) else {
                continue;
            };
            let healthy = self
                .ctx
                .health
                .status(pod, node)
                .is_some_and(|h| h.is_passing());
            others
                .entry(owner)
                .or_default()
                .push((healthy, NodeName::from(node)));
        }
        let listing = self.ctx.rcs.borrow().clone();
        let source = self.ctx.roll_sources.read().get(&self.id).copied();
        let locks = self.ctx.locks.borrow().clone();
        super::plan::neighbours(
            others,
            |owner| {
                let id = RcId::parse(owner).ok()?;
                let rc = listing
                    .as_ref()
                    .and_then(|l| l.rcs.get(&id))
                    .or_else(|| extra.get(&id))?;
                Some((id, rc.disabled, rc.replicas_desired))
            },
            |g| {
                source == Some(g)
                    || confirmed.contains(&g)
                    || locks.mutation(g).is_some_and(|theirs| {
                        locks.mutation(self.id).is_some_and(|ours| ours == theirs)
                    })
            },
        )
    }

    /// Of `givers` (disabled RCs with pods of our pod id they no longer want), those whose
    /// mutation lock and ours one session holds with one value, as Consul says now: a roller
    /// that writes no roll record moves their replicas onto us.
    async fn rolled_by_one_session(&self, givers: &[RcId]) -> Result<BTreeSet<RcId>, TaskError> {
        let keys: Vec<String> = givers
            .iter()
            .chain([&self.id])
            .map(|id| id.mutation_lock_key())
            .collect();
        let found = self.ctx.consul.read_keys(&keys).await?;
        let holder = |id: &RcId| {
            let kv = found.get(&id.mutation_lock_key())?;
            Some((kv.session.clone()?, kv.value_bytes().to_vec()))
        };
        let ours = holder(&self.id);
        Ok(givers
            .iter()
            .filter(|g| ours.is_some() && holder(g) == ours)
            .copied()
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The RC task's error policy, one row per kind of pass result.
    #[test]
    fn the_error_policy_reads_as_its_rules() {
        /// A pass's result, as the policy reads it.
        type PassResult = Option<Result<Pass, TaskError>>;
        let rejected = |status| {
            Some(Err(TaskError::Consul(ConsulError::Rejected {
                status,
                body: "too large".into(),
            })))
        };
        let rows: Vec<(&str, PassResult, Policy)> = vec![
            (
                "the RC key deleted: stop, leave its pods",
                None,
                Policy::Deleted,
            ),
            (
                "settled: next at the resync",
                Some(Ok(Pass::Settled)),
                Policy::Resync,
            ),
            (
                "unmet: paced, a change of the RC lifts the pacing",
                Some(Ok(Pass::Unmet)),
                Policy::PacedUnmet,
            ),
            (
                "removals held: at the resync, at once on a wake (room back, a release)",
                Some(Ok(Pass::Held)),
                Policy::Held,
            ),
            (
                "the cap on actions with more to do: soon, backing off (bug 23a)",
                Some(Ok(Pass::Again)),
                Policy::Again,
            ),
            (
                "the RC changed meanwhile: plan again",
                Some(Err(TaskError::Stale)),
                Policy::Stale,
            ),
            (
                "a write fenced: stop, tell the farm",
                Some(Err(TaskError::Fenced)),
                Policy::Fenced,
            ),
            (
                "a write too large: report once",
                rejected(413),
                Policy::Rejected,
            ),
            (
                "a malformed write: report once",
                rejected(400),
                Policy::Rejected,
            ),
            ("another refusal: back off", rejected(403), Policy::Backoff),
            (
                "Consul unreachable: back off",
                Some(Err(TaskError::Consul(ConsulError::Unavailable {
                    addr: "127.0.0.1:8500".into(),
                    reason: "connection refused".into(),
                }))),
                Policy::Backoff,
            ),
            (
                "anything else: back off",
                Some(Err(TaskError::Other("x".into()))),
                Policy::Backoff,
            ),
        ];
        for (rule, result, want) in rows {
            assert_eq!(policy(result.as_ref()), want, "{rule}");
        }
    }
}

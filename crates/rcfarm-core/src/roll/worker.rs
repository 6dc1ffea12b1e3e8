//! The roll task: one per claimed rolling update. It observes both RCs (their records from the
//! farm's RC watch, their pods, health, and what `reality/` says runs on those pods' nodes),
//! plans with the pure [`plan`], and applies each step as one transaction fenced by the roll's
//! lock, guarded by the versions it planned against, with its audit record.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::control::{ControlSeen, RollControl, RollFailure, control_key};
use super::plan::{
    DeadlineClock, LockState, RcCounts, RollAction, RollObserved, RollPlan, WaitKind, plan,
};
use super::record::{InvalidRoll, Roll, RollId};
use super::status::RollStatusRegistry;
use crate::audit::{AuditRecord, events};
use crate::clock::Clock;
use crate::consul::{Consul, ConsulError, FenceError, KvPair, SessionId, TxnOp};
use crate::freshness::{Decision, Seen, View, stale_views};
use crate::health::HealthCache;
use crate::labels::{LabelCache, LabelSet, LabelType, Selector, split_pod_label_id};
use crate::rc::{LockView, RC_ID_LABEL, Rc, RcId, RcListing};
use crate::rctask::IntentState;
use crate::task::{Inbox, Next, PassFuture};
use crate::util::{Backoff, format_go_duration};

/// `reality/<node>/<pod-id>`: what the node agent runs (P2's preparer writes it).
pub fn reality_key(node: &str, pod_id: &str) -> String {
    format!("reality/{node}/{pod_id}")
}

/// The roll label set when a roll starts (P2 ignores labels it does not know).
pub const STARTED_LABEL: &str = "rcfarm.io/roll-started";

/// What the values of the mutation locks a roll holds begin with.
pub const ROLL_HOLDER_PREFIX: &str = "rcfarm-roll:";

/// The digest of the manifest a `reality/` entry says runs, if it parses.
pub fn runs(entry: Option<&KvPair>) -> Option<String> {
    match IntentState::from_value(entry.map(KvPair::value_bytes)) {
        IntentState::Digest(d) => Some(d),
        _ => None,
    }
}

/// The value a roll writes into the mutation locks it holds.
pub fn roll_holder(id: RollId) -> String {
    format!("{ROLL_HOLDER_PREFIX}{id}")
}

/// Tunables of roll tasks.
#[derive(Debug, Clone)]
pub struct RollConfig {
    /// A roll that has not moved for this long is reported stalled (once).
    pub stall_after: Duration,
    /// No new pod becoming up for this long fails a roll (unless the roll says otherwise).
    pub progress_deadline: Duration,
    /// Look again this often while waiting, even if nothing changed (`reality/` is not
    /// watched).
    pub resync: Duration,
    pub error_backoff_max: Duration,
    /// Revisions kept per lineage (`--revision-history`); 0 keeps none.
    pub revision_history: usize,
    /// Revert a failed roll unless the roll says otherwise (`--roll-auto-revert`).
    pub auto_revert: bool,
}

impl Default for RollConfig {
    fn default() -> Self {
        Self {
            stall_after: Duration::from_secs(300),
            progress_deadline: Duration::from_secs(600),
            resync: Duration::from_secs(5),
            error_backoff_max: Duration::from_secs(30),
            revision_history: super::history::DEFAULT_REVISIONS,
            auto_revert: false,
        }
    }
}

/// What roll tasks of one farm share.
pub struct RollContext {
    pub consul: Consul,
    pub farm_id: String,
    pub rcs: watch::Receiver<Option<Arc<RcListing>>>,
    pub locks: watch::Receiver<Arc<LockView>>,
    pub pods: Arc<LabelCache>,
    pub health: Arc<HealthCache>,
    pub status: Arc<RollStatusRegistry>,
    /// The farm's removal budget and tripwire: a step that takes pods down asks it first.
    pub failsafe: Arc<crate::failsafe::Failsafe>,
    /// Every write waits for its slot here while the audit outbox is too big.
    pub pace: Arc<crate::audit::AuditPace>,
    pub config: RollConfig,
    pub clock: Clock,
}

/// The roll as the farm last saw it.
#[derive(Debug, Clone)]
pub enum RollState {
    Valid {
        roll: Arc<Roll>,
        /// Another roll sharing an RC goes first.
        conflict: Option<String>,
    },
    Invalid(Arc<InvalidRoll>),
    Deleted,
}

/// Why a roll task stopped on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RollEvent {
    /// A write failed its fencing check: the farm no longer holds the roll's lock.
    Fenced(RollId),
    /// The roll completed at this commit index: its record and lock are gone.
    Completed(RollId, u64),
}

impl From<crate::failsafe::ChargeError> for RollError {
    fn from(e: crate::failsafe::ChargeError) -> RollError {
        match e {
            // No room for the retirement's lost capacity now: the next plan sees it held.
            crate::failsafe::ChargeError::Held(why) => RollError::Stale(why),
            crate::failsafe::ChargeError::Fence(e) => e.into(),
            crate::failsafe::ChargeError::Read(e) => RollError::Consul(e),
        }
    }
}

impl From<FenceError> for RollError {
    fn from(e: FenceError) -> RollError {
        match e {
            FenceError::Fenced { .. } => RollError::Fenced,
            // Something moved since the plan (the roll, its control, an RC, a mutation lock):
            // look again.
            FenceError::Stale { what, .. } => RollError::Stale(what),
            // The cluster's removal window moved (only a charged commit sets a charge).
            FenceError::Uncharged { what } => RollError::Stale(what),
            FenceError::Conflict { source, .. } => RollError::Stale(match source {
                ConsulError::Conflict(errs) => errs
                    .iter()
                    .map(|x| x.what.as_str())
                    .collect::<Vec<_>>()
                    .join("; "),
                other => other.to_string(),
            }),
            FenceError::AlreadyRecorded => RollError::Other("the record exists already".into()),
            FenceError::Consul(e) => RollError::Consul(e),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub(super) enum RollError {
    #[error("fenced: this farm no longer holds the roll's lock")]
    Fenced,
    #[error("{0}; planning again")]
    Stale(String),
    #[error(transparent)]
    Consul(#[from] ConsulError),
    #[error("{0}")]
    Other(String),
}

/// The farm's handle on a roll task.
pub type RollHandle = crate::task::TaskHandle<RollState>;

/// Starts the task of a roll the farm now holds with `session`.
pub fn spawn(
    ctx: Arc<RollContext>,
    session: SessionId,
    parent: &CancellationToken,
    id: RollId,
    initial: RollState,
    events: mpsc::UnboundedSender<RollEvent>,
) -> RollHandle {
    let span = tracing::info_span!("roll", roll_id = %id, farm_id = %ctx.farm_id);
    crate::task::spawn(id, initial, parent, move |inbox| {
        let now = ctx.clock.now();
        let mut worker = Worker {
            ctx,
            session,
            id,
            inbox,
            events,
            invalid_reported: None,
            ready_since: None,
            began: now,
            last_step_at: None,
            stuck_since: None,
            alerted: None,
            lowest_healthy: None,
            deadline_spent: Duration::ZERO,
            counting_since: None,
            best_new_up: None,
            held: false,
            backoff: Backoff::new(Duration::from_millis(200), Duration::from_secs(30)),
        };
        async move { worker.run().await }.instrument(span)
    })
}

pub(super) struct Worker {
    pub(super) ctx: Arc<RollContext>,
    pub(super) session: SessionId,
    pub(super) id: RollId,
    /// The object's state as the farm last saw it, wake-ups, and the stop signal.
    pub(super) inbox: Inbox<RollState>,
    pub(super) events: mpsc::UnboundedSender<RollEvent>,
    pub(super) invalid_reported: Option<u64>,
    /// Since when a step has been safe without interruption, on the monotonic clock (the roll
    /// delay counts from here).
    pub(super) ready_since: Option<Instant>,
    /// Since when the roll has waited without moving, and what for last.
    pub(super) stuck_since: Option<Instant>,
    /// The stall reason reported, if a stall is reported.
    pub(super) alerted: Option<String>,
    pub(super) lowest_healthy: Option<u64>,
    /// The progress deadline's clock: the time since a new pod last became up (or the roll
    /// stepped, or was resumed) in which the roll could have moved and waited only for its new
    /// pods, as closed spans, and since when the current span runs. Waits on a lock, a
    /// transfer, held removals, the old RC or an operator do not count.
    pub(super) deadline_spent: Duration,
    pub(super) counting_since: Option<Instant>,
    /// The most new pods seen up.
    pub(super) best_new_up: Option<u64>,
    /// Whether the roll's steps are held by the farm's removal budget (audited once per
    /// episode).
    pub(super) held: bool,
    pub(super) backoff: Backoff,
    /// When this farm began carrying the roll out, and when it last stepped: step and
    /// completion durations as this farm saw them (a roll's records keep no start time).
    pub(super) began: Instant,
    pub(super) last_step_at: Option<Instant>,
}

/// What one look at the roll found.
pub(super) struct Observation {
    pub(super) planned: RollPlan,
    pub(super) old: Option<Arc<Rc>>,
    pub(super) new: Option<Arc<Rc>>,
    pub(super) old_counts: Option<RcCounts>,
    pub(super) new_counts: Option<RcCounts>,
    /// The mutation lock keys' indexes, for taking them only as seen.
    pub(super) mutation_index: (Option<u64>, Option<u64>),
    /// The roll's labels and their key's index.
    pub(super) labels: (LabelSet, u64),
    /// The operator's control of the roll, as read with the rest.
    pub(super) control: ControlSeen,
    /// Each pod of the new RC: node, pod id, whether it runs the new manifest.
    pub(super) new_pods: Vec<(String, String, bool)>,
    /// The roll's progress deadline.
    pub(super) deadline: Duration,
}

/// What the progress deadline decided.
enum Deadline {
    Running,
    /// The roll failed now, and stays Failed.
    Failed,
    /// The roll failed now and was replaced by its revert: this task is done.
    Reverted,
}

/// How a pass ended.
pub(super) enum Outcome {
    /// Waiting; look again after this long at the latest.
    Wait(Duration),
    /// The roll is complete and its record deleted.
    Done,
}

/// What a roll pass's result asks of the loop: the roll task's error policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Policy {
    /// Stop: the roll record is deleted.
    Deleted,
    /// Stop: the roll completed.
    Done,
    /// Stop: a write failed its fence; another farm may hold the roll.
    Fenced,
    /// Waiting: look again at the time the pass named, at once on a change.
    Wait(Duration),
    /// Something moved since the plan: plan again shortly.
    Stale,
    /// Anything else: back off.
    Backoff,
}

/// The error policy, pure: one row per kind of result in its tests.
fn policy(result: Option<&Result<Outcome, RollError>>) -> Policy {
    match result {
        None => Policy::Deleted,
        Some(Ok(Outcome::Done)) => Policy::Done,
        Some(Ok(Outcome::Wait(d))) => Policy::Wait(*d),
        Some(Err(RollError::Fenced)) => Policy::Fenced,
        Some(Err(RollError::Stale(_))) => Policy::Stale,
        Some(Err(_)) => Policy::Backoff,
    }
}

impl crate::task::Reconciler for Worker {
    type State = RollState;
    type Outcome = Option<Result<Outcome, RollError>>;

    fn reconcile(&mut self, state: RollState) -> PassFuture<'_, Self::Outcome> {
        Box::pin(async move {
            match &state {
                RollState::Deleted => None,
                RollState::Invalid(inv) => Some(
                    self.report_invalid(inv)
                        .await
                        .map(|_| Outcome::Wait(self.ctx.config.resync * 12)),
                ),
                RollState::Valid { roll, conflict } => {
                    let result = self.pass(roll, conflict.clone()).await;
                    self.ctx.status.count_pass(self.id);
                    Some(result)
                }
            }
        })
    }

    async fn next(&mut self, outcome: Self::Outcome) -> Next {
        match policy(outcome.as_ref()) {
            Policy::Deleted => {
                tracing::info!("roll record deleted: stopping");
                Next::Stop
            }
            Policy::Done => Next::Stop,
            Policy::Fenced => {
                tracing::warn!("lost the roll's lock; stopping without further writes");
                let _ = self.events.send(RollEvent::Fenced(self.id));
                Next::Stop
            }
            Policy::Wait(d) => {
                self.backoff.reset();
                Next::Requeue(d)
            }
            Policy::Stale => {
                if let Some(Err(RollError::Stale(why))) = &outcome {
                    tracing::debug!(%why, "planning again");
                }
                Next::Requeue(Duration::from_millis(100))
            }
            Policy::Backoff => {
                let e = match outcome {
                    Some(Err(e)) => e.to_string(),
                    _ => String::new(),
                };
                let wait = self
                    .backoff
                    .next_delay()
                    .min(self.ctx.config.error_backoff_max);
                tracing::warn!(error = %e, retry_in = ?wait, "roll pass failed");
                metrics::counter!("rcfarm_roll_pass_errors_total").increment(1);
                self.ctx
                    .status
                    .update(self.id, &self.ctx.farm_id, |s| s.last_error = Some(e));
                Next::Requeue(wait)
            }
        }
    }

    fn inbox(&mut self) -> &mut Inbox<RollState> {
        &mut self.inbox
    }
}

impl Worker {
    async fn run(&mut self) {
        tracing::info!("roll task started");
        crate::task::drive(self).await;
        if self.held {
            self.ctx
                .failsafe
                .set_held(&format!("roll:{}", self.id), false);
        }
        tracing::info!("roll task stopped");
    }

    /// Reports an invalid record once per version: log, metric, status, audit event. The
    /// record id is derived from key and version, so a handover does not report it twice.
    async fn report_invalid(&mut self, inv: &InvalidRoll) -> Result<(), RollError> {
        self.ctx.status.update(self.id, &self.ctx.farm_id, |s| {
            s.set_condition("Invalid", Some(inv.problem.to_string()));
        });
        if self.invalid_reported == Some(inv.modify_index) {
            return Ok(());
        }
        tracing::warn!(problem = %inv.problem, "rolling update record is invalid; not acting on it until it is fixed or deleted");
        metrics::counter!("rcfarm_roll_invalid_total", "kind" => inv.problem.kind()).increment(1);
        let audit = AuditRecord::deterministic(
            &format!("invalid:{}@{}", inv.key, inv.modify_index),
            events::ROLL_INVALID,
            json!({
                "rolling_update_id": self.id,
                "key": inv.key,
                "modify_index": inv.modify_index,
                "problem": inv.problem.to_string(),
                "farm_id": self.ctx.farm_id,
            }),
        );
        // Committed apart from `report`: that the record exists already is fine here.
        match self
            .commit_txn(self.stamped(self.held(), vec![audit]))
            .await
        {
            Ok(_) | Err(FenceError::AlreadyRecorded) => {}
            Err(e) => return Err(e.into()),
        }
        self.invalid_reported = Some(inv.modify_index);
        Ok(())
    }

    /// Plans and applies until the roll waits or is done.
    async fn pass(&mut self, roll: &Roll, conflict: Option<String>) -> Result<Outcome, RollError> {
        self.invalid_reported = None;
        self.ctx.status.update(self.id, &self.ctx.farm_id, |s| {
            s.set_condition("Invalid", None)
        });
        for _ in 0..8 {
            let o = self.observe(roll, conflict.clone()).await?;
            self.publish(roll, &o);
            self.settle_held(roll, o.planned.waiting.as_ref()).await?;
            let Some(action) = o.planned.action.clone() else {
                let waiting = o.planned.waiting.clone();
                match self.watch_deadline(roll, &o).await? {
                    Deadline::Running => {}
                    // Failed now: the next look shows it.
                    Deadline::Failed => continue,
                    // Replaced by its revert, which the farm claims as any new roll.
                    Deadline::Reverted => return Ok(Outcome::Done),
                }
                self.settle_wait(roll, waiting.as_ref()).await?;
                let delay = match &waiting {
                    Some((WaitKind::Delay, _)) => {
                        let waited = self
                            .ready_since
                            .map(|t| self.ctx.clock.now().saturating_duration_since(t))
                            .unwrap_or_default();
                        roll.update
                            .roll_delay
                            .saturating_sub(waited)
                            .max(Duration::from_millis(10))
                    }
                    _ => self.ctx.config.resync,
                };
                return Ok(Outcome::Wait(delay));
            };
            tracing::debug!(?action, "applying");
            let done = matches!(action, RollAction::Complete | RollAction::DeleteOrphan);
            // Taking the mutation locks moves nothing: a farm that takes a roll over takes them
            // first, and its progress deadline goes on from the previous owner's last step.
            let moves_pods = !matches!(action, RollAction::Lock);
            // Only a retirement's lost capacity is charged, in the retirement's own
            // transaction (see `apply`). The planner saw room for it; another farm may have
            // spent it since: then the charge is refused, and the step planned again.
            self.apply(roll, &o, action).await?;
            self.progressed(moves_pods);
            if done {
                return Ok(Outcome::Done);
            }
        }
        Ok(Outcome::Wait(Duration::ZERO))
    }

    async fn observe(
        &mut self,
        roll: &Roll,
        conflict: Option<String>,
    ) -> Result<Observation, RollError> {
        let u = &roll.update;
        let listing = self
            .ctx
            .rcs
            .borrow()
            .clone()
            .ok_or_else(|| RollError::Other("the RC view is not ready".into()))?;
        // A roll is created with its new RC in one transaction, and the watches of rolls and
        // of RCs answer apart: an RC view older than the roll is behind, not proof of absence
        // (`freshness::RULES`, `RollStep`). What it lacks is read: Consul itself is asked
        // whether a missing RC is there (an RC deleted before the roll was written is absent
        // from every view, however new); an RC it shows is guarded by its index at the write.
        let seen = [Seen::new(View::Objects, listing.index)];
        if stale_views(Decision::RollStep, roll.create_index, &seen).contains(&View::Objects) {
            for id in [u.old_rc, u.new_rc] {
                if listing.rcs.contains_key(&id) || listing.invalid.contains_key(&id.key()) {
                    continue;
                }
                let (there, _) = self
                    .ctx
                    .consul
                    .kv_get(&id.key(), &crate::consul::QueryOptions::default())
                    .await?;
                if there.is_some() {
                    return Err(RollError::Stale(format!(
                        "the RC view (index {}) is older than the rolling update (created at {})",
                        listing.index, roll.create_index
                    )));
                }
            }
        }
        let lookup = |id: RcId| -> Result<Arc<Rc>, String> {
            if let Some(rc) = listing.rcs.get(&id) {
                Ok(rc.clone())
            } else if let Some(inv) = listing.invalid.get(&id.key()) {
                Err(format!("its record is invalid: {}", inv.problem))
            } else {
                Err("does not exist".into())
            }
        };
        let old = lookup(u.old_rc);
        let new = lookup(u.new_rc);
        // The farm's RC view may lag a roll created with its RCs: a roll is deleted only for
        // an old RC that Consul itself says is absent.
        let old_missing = match &old {
            Err(_) if !listing.invalid.contains_key(&u.old_rc.key()) => self
                .ctx
                .consul
                .kv_get(&u.old_rc.key(), &crate::consul::QueryOptions::default())
                .await?
                .0
                .is_none(),
            _ => false,
        };
        // Pods of both RCs, and what their nodes run.
        let pods_of = |rc: &Rc| -> Vec<(String, String)> {
            self.ctx
                .pods
                .matches(&Selector::from_equalities([(
                    RC_ID_LABEL,
                    rc.id.to_string().as_str(),
                )]))
                .iter()
                .filter_map(|id| {
                    split_pod_label_id(id).map(|(n, p)| (n.to_string(), p.to_string()))
                })
                .collect()
        };
        let old_pods = old.as_ref().map(|rc| pods_of(rc)).unwrap_or_default();
        let new_pods = new.as_ref().map(|rc| pods_of(rc)).unwrap_or_default();
        // What the pods' nodes run, and the roll's labels, in one read.
        let labels_key = LabelType::Rolls.key(&self.id.to_string());
        let ctl_key = control_key(self.id);
        // And the RCs' node transfers in flight (P2's status keys, rcfarm's beside them).
        let status_keys = [u.old_rc, u.new_rc].map(crate::rctask::status_key);
        let keys: Vec<String> = old_pods
            .iter()
            .chain(&new_pods)
            .map(|(n, p)| reality_key(n, p))
            .chain([labels_key.clone(), ctl_key.clone()])
            .chain(status_keys.iter().cloned())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let reality = self.ctx.consul.read_keys(&keys).await?;
        let labels_in = |read: &std::collections::HashMap<String, KvPair>| {
            read.get(&labels_key)
                .map(|kv| {
                    (
                        crate::labels::parse_labels(kv.value_bytes()).unwrap_or_default(),
                        kv.modify_index,
                    )
                })
                .unwrap_or_default()
        };
        let labels = labels_in(&reality);
        // Whether the roll has started is its label, read fresh; whether someone intervened
        // since is the RCs' `disabled` flags, which the start wrote in the same transaction.
        // The RC view may not hold that write yet (the start's answer was lost, and the pass
        // after it came before the view's next answer): read apart, the two said "the old RC
        // was enabled again after the roll started" for a pass. So when the roll has started
        // and the view shows either RC otherwise than a started roll leaves it, both records
        // are read again with the label, in one transaction, and a newer version is taken
        // over the view's (the writes that follow are guarded by its index).
        let (labels, old, new) = if labels.0.contains_key(STARTED_LABEL)
            && (old.as_ref().is_ok_and(|rc| !rc.disabled)
                || new.as_ref().is_ok_and(|rc| rc.disabled))
        {
            let keys = [labels_key.clone(), u.old_rc.key(), u.new_rc.key()];
            let fresh = self.ctx.consul.read_keys(&keys).await?;
            let newer = |rc: Result<Arc<Rc>, String>| match &rc {
                Ok(seen) => match fresh.get(&seen.id.key()) {
                    Some(kv) if kv.modify_index > seen.modify_index => {
                        // A newer version that is invalid is the RC view's to bring: this
                        // pass goes on with the version it has.
                        Rc::from_kv(&kv.key, kv.value_bytes(), kv.modify_index)
                            .map(Arc::new)
                            .or(rc)
                    }
                    _ => rc,
                },
                Err(_) => rc,
            };
            (labels_in(&fresh), newer(old), newer(new))
        } else {
            (labels, old, new)
        };
        let control = reality
            .get(&ctl_key)
            .map(|kv| ControlSeen::from_entry(kv.value_bytes(), kv.modify_index))
            .unwrap_or_else(ControlSeen::absent);
        let failed = control
            .control
            .as_ref()
            .ok()
            .and_then(|c| c.failed.as_ref())
            .map(|f| f.reason.clone());
        let deadline = control
            .control
            .as_ref()
            .ok()
            .map_or(self.ctx.config.progress_deadline, |c| {
                c.progress_deadline_or(self.ctx.config.progress_deadline)
            });
        let paused = match &control.control {
            Ok(c) if c.paused => Some(c.describe()),
            Ok(_) => None,
            Err(e) => Some(format!(
                "paused: its control record {ctl_key} cannot be read ({e}); fix or delete it"
            )),
        };
        let count = |rc: &Rc, pods: &[(String, String)]| -> RcCounts {
            RcCounts::count(
                rc.replicas_desired,
                rc.disabled,
                rc.manifest.digest(),
                pods.iter().map(|(node, pod)| {
                    let real = reality.get(&reality_key(node, pod));
                    // Only a health result newer than what the node reports running speaks of
                    // the pod running there now (a pod replaced in place keeps its key).
                    let health = self
                        .ctx
                        .health
                        .status_with_index(pod, node)
                        .filter(|(_, hi)| {
                            crate::health::speaks_of_reality(
                                *hi,
                                real.map(|r| r.modify_index),
                                rc.manifest.health_checked(),
                            )
                        })
                        .map(|(h, _)| h);
                    (runs(real), health)
                }),
            )
        };
        let old_counts = old.as_ref().ok().map(|rc| count(rc, &old_pods));
        let new_counts = new.as_ref().ok().map(|rc| count(rc, &new_pods));
        // Where each new pod is and whether it runs the new manifest; its health is looked up
        // only if the roll fails (the one reader of this).
        let new_pods: Vec<(String, String, bool)> = match &new {
            Ok(rc) => new_pods
                .into_iter()
                .map(|(node, pod)| {
                    let running = runs(reality.get(&reality_key(&node, &pod)))
                        .is_some_and(|d| d == rc.manifest.digest());
                    (node, pod, running)
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        let locks = self.ctx.locks.borrow().clone();
        let holder = roll_holder(self.id);
        let lock_state = |id: RcId| match locks.mutation(id) {
            None => LockState::Free,
            Some((s, v)) if **s == *self.session && **v == *holder => LockState::Ours,
            Some((s, v)) => LockState::Elsewhere(describe_holder(&locks, s, v)),
        };
        let transfer = [
            ("old", u.old_rc, &status_keys[0]),
            ("new", u.new_rc, &status_keys[1]),
        ]
        .into_iter()
        .find_map(|(which, id, key)| {
            let t = reality
                .get(key)
                .and_then(|kv| serde_json::from_slice::<serde_json::Value>(kv.value_bytes()).ok())?
                .get("node_transfer")?
                .clone();
            let t: crate::rctask::Transfer = serde_json::from_value(t).ok()?;
            let rc = match which {
                "old" => old.as_ref().ok(),
                _ => new.as_ref().ok(),
            };
            Some(describe_transfer(
                &locks,
                which,
                id,
                &t,
                rc.map(|r| r.disabled),
            ))
        });
        let now = self.ctx.clock.now();
        let observed = RollObserved {
            update: u,
            old: old_counts.ok_or_else(|| old.clone().err().unwrap_or_default()),
            new: new_counts.ok_or_else(|| new.clone().err().unwrap_or_default()),
            old_lock: lock_state(u.old_rc),
            new_lock: lock_state(u.new_rc),
            conflict,
            transfer,
            ready_for: self
                .ready_since
                .map(|t| now.saturating_duration_since(t))
                .unwrap_or_default(),
            started: labels.0.contains_key(STARTED_LABEL),
            old_missing,
            paused,
            max_parallel: control.control.as_ref().ok().and_then(|c| c.max_parallel),
            failed,
            canary: control
                .control
                .as_ref()
                .ok()
                .and_then(RollControl::canary_pending),
            removal_room: match self.ctx.failsafe.room() {
                (u64::MAX, _) => None,
                (room, why) => Some((room, why.unwrap_or_default())),
            },
            tripped: self.ctx.failsafe.tripped(),
            old_served_by: locks
                .holders
                .get(&u.old_rc)
                .and_then(|h| h.ownership.as_ref())
                .map(|(s, name)| format!("{name}, session {s}")),
        };
        let planned = plan(&observed);
        if planned.step_ready {
            self.ready_since.get_or_insert(now);
        } else {
            self.ready_since = None;
        }
        let mutation_index = (
            locks.holders.get(&u.old_rc).and_then(|h| h.mutation_index),
            locks.holders.get(&u.new_rc).and_then(|h| h.mutation_index),
        );
        Ok(Observation {
            planned,
            old: old.ok(),
            new: new.ok(),
            old_counts,
            new_counts,
            mutation_index,
            labels,
            control,
            new_pods,
            deadline,
        })
    }

    fn publish(&mut self, roll: &Roll, o: &Observation) {
        let u = &roll.update;
        if let (Some(oc), Some(nc)) = (o.old_counts, o.new_counts) {
            // Only once the roll has started: before, the old RC's pods are not the roll's.
            if oc.disabled && !nc.disabled {
                let healthy = oc.healthy.min(oc.desired) + nc.healthy;
                self.lowest_healthy = Some(self.lowest_healthy.map_or(healthy, |l| l.min(healthy)));
            }
        }
        let lowest = self.lowest_healthy;
        self.ctx.status.update(self.id, &self.ctx.farm_id, |s| {
            s.old_rc = Some(u.old_rc);
            s.new_rc = Some(u.new_rc);
            s.desired_replicas = u.desired_replicas;
            s.minimum_replicas = u.minimum_replicas;
            s.leave_old = u.leave_old;
            s.roll_delay = format_go_duration(u.roll_delay);
            s.old = o.old_counts;
            s.new = o.new_counts;
            s.waiting = o.planned.waiting.clone();
            s.lowest_healthy = lowest;
            // A wait on a lock or a transfer in flight is shown as Blocked, with who holds it
            // and what lets it go: never as a stall or a failure.
            let condition_of = |k: WaitKind| match k {
                WaitKind::Failed => Some("Failed"),
                WaitKind::Paused => Some("Paused"),
                WaitKind::Blocked | WaitKind::Lock | WaitKind::Transfer => Some("Blocked"),
                WaitKind::RemovalsHeld => Some("RemovalsHeld"),
                _ => None,
            };
            for condition in ["Failed", "Paused", "Blocked", "RemovalsHeld"] {
                let why = o
                    .planned
                    .waiting
                    .as_ref()
                    .filter(|(k, _)| condition_of(*k) == Some(condition));
                s.set_condition(condition, why.map(|(_, why)| why.clone()));
            }
        });
    }

    /// Fails the roll when no new pod has become up for its progress deadline: its control
    /// record says so (a terminal state, kept until an operator acts) and a
    /// `ROLLING_UPDATE_FAILED` record says why, in one fenced transaction. A roll that
    /// auto-reverts is instead replaced by its revert in that transaction (see
    /// [`Worker::revert_ops`]).
    async fn watch_deadline(
        &mut self,
        roll: &Roll,
        o: &Observation,
    ) -> Result<Deadline, RollError> {
        let up = o.new_counts.map_or(0, |c| c.healthy);
        let now = self.ctx.clock.now();
        match self.best_new_up {
            // This farm's first look: the clock goes on from the progress the roll's previous
            // owner recorded, unless more new pods are up than then. (What of that time the
            // roll spent blocked is not recorded: it counts, at most one deadline.)
            None => {
                self.best_new_up = Some(up);
                self.deadline_spent = Duration::ZERO;
                self.counting_since = None;
                let recorded = o.control.control.as_ref().ok().and_then(|c| c.progress);
                if let Some(p) = recorded.filter(|p| up <= p.new_up) {
                    self.deadline_spent = self.ctx.clock.wall_since(p.at).min(o.deadline);
                }
            }
            Some(b) if up > b => {
                self.best_new_up = Some(up);
                self.restart_deadline();
            }
            Some(_) => {}
        }
        match super::plan::deadline_clock(o.planned.waiting.as_ref().map(|w| w.0), o.new_counts) {
            DeadlineClock::Restart => {
                self.restart_deadline();
                return Ok(Deadline::Running);
            }
            DeadlineClock::Pause => {
                self.pause_deadline(now);
                return Ok(Deadline::Running);
            }
            DeadlineClock::Count => {}
        }
        let why = o
            .planned
            .waiting
            .as_ref()
            .map(|w| w.1.clone())
            .unwrap_or_default();
        let since = *self.counting_since.get_or_insert(now);
        if self.deadline_spent + now.saturating_duration_since(since) < o.deadline {
            return Ok(Deadline::Running);
        }
        let deadline = format_go_duration(o.deadline);
        let wanted = o.new_counts.map_or(0, |c| c.desired);
        let reason = format!(
            "no new pod became up for {deadline} of waiting on them ({up} of the {wanted} new pods scheduled are up, the roll's target is {}): {why}",
            roll.update.desired_replicas
        );
        tracing::warn!(%reason, "rolling update failed");
        metrics::counter!("rcfarm_roll_failures_total").increment(1);
        let mut control = o.control.control.clone().unwrap_or_default();
        control.failed = Some(RollFailure {
            reason: reason.clone(),
            at: self.ctx.clock.wall(),
        });
        let reverts = control.reverts(self.ctx.config.auto_revert) && o.old.is_some();
        let mut txn = self.fence(roll, o);
        let mut audits = vec![AuditRecord::new(
            events::ROLL_FAILED,
            json!({
                "rolling_update_id": self.id,
                "old_rc": roll.update.old_rc,
                "new_rc": roll.update.new_rc,
                "reason": reason,
                "progress_deadline": deadline,
                "new_pods": self.describe_new_pods(o),
                "farm_id": self.ctx.farm_id,
                "auto_revert": reverts,
            }),
        )];
        if !reverts {
            txn.push_op(TxnOp::set(control_key(self.id), control.to_bytes()));
            self.commit(txn, audits).await?;
            return Ok(Deadline::Failed);
        }
        let (revert_ops, revert_audits) = self.revert_ops(roll, o, &control, &reason)?;
        txn.extend_ops(revert_ops);
        audits.extend(revert_audits);
        let index = self.commit(txn, audits).await?;
        tracing::warn!(revert = %roll.update.old_rc, "rolling update reverted: rolling back to the old RC");
        metrics::counter!("rcfarm_roll_reverts_total").increment(1);
        self.ctx.status.remove(self.id);
        let _ = self.events.send(RollEvent::Completed(self.id, index));
        Ok(Deadline::Reverted)
    }

    /// Each new pod in words, with what its health check says now: for a failure's record.
    fn describe_new_pods(&self, o: &Observation) -> Vec<String> {
        o.new_pods
            .iter()
            .map(|(node, pod, running)| {
                let health =
                    self.ctx
                        .health
                        .status(pod, node)
                        .map_or("no health result".to_string(), |h| {
                            let word = serde_json::to_value(h).unwrap_or_default();
                            format!("health {}", word.as_str().unwrap_or("?"))
                        });
                let runs = if *running {
                    "runs the new manifest"
                } else {
                    "not yet running the new manifest"
                };
                format!("{node}/{pod} ({runs}, {health})")
            })
            .collect()
    }

    /// Tracks how long the roll has waited; reports a stall once (log, metric, status, audit)
    /// when it waits for something that cannot come by itself, or for longer than the stall
    /// timeout.
    async fn settle_wait(
        &mut self,
        roll: &Roll,
        waiting: Option<&(WaitKind, String)>,
    ) -> Result<(), RollError> {
        let Some((kind, why)) = waiting else {
            return Ok(());
        };
        if matches!(
            kind,
            WaitKind::Delay
                | WaitKind::Paused
                | WaitKind::Failed
                | WaitKind::RemovalsHeld
                | WaitKind::Lock
                | WaitKind::Transfer
        ) {
            // Waiting on purpose, or on something named with what lets it go (Blocked): not a
            // stall.
            self.stuck_since = None;
            return Ok(());
        }
        let since = *self.stuck_since.get_or_insert_with(|| self.ctx.clock.now());
        let stalled = kind.is_stuck() || since.elapsed() >= self.ctx.config.stall_after;
        if !stalled || self.alerted.is_some() {
            if let Some(reason) = &self.alerted
                && reason != why
            {
                self.ctx.status.update(self.id, &self.ctx.farm_id, |s| {
                    s.set_condition("Stalled", Some(why.clone()))
                });
            }
            return Ok(());
        }
        tracing::warn!(reason = %why, "rolling update stalled");
        metrics::counter!("rcfarm_roll_stalls_total").increment(1);
        let audit = AuditRecord::new(
            events::ROLL_STALLED,
            json!({
                "rolling_update_id": self.id,
                "old_rc": roll.update.old_rc,
                "new_rc": roll.update.new_rc,
                "reason": why,
                "waited_seconds": since.elapsed().as_secs(),
                "farm_id": self.ctx.farm_id,
            }),
        );
        self.report(audit).await?;
        self.alerted = Some(why.clone());
        self.ctx.status.update(self.id, &self.ctx.farm_id, |s| {
            s.set_condition("Stalled", Some(why.clone()))
        });
        Ok(())
    }

    /// Reports the roll held by the farm's removal budget: metric and log, and one
    /// `REMOVALS_HELD` record per episode (none for the tripwire, which the farm reports).
    async fn settle_held(
        &mut self,
        roll: &Roll,
        waiting: Option<&(WaitKind, String)>,
    ) -> Result<(), RollError> {
        let who = format!("roll:{}", self.id);
        let why = waiting
            .filter(|(k, _)| *k == WaitKind::RemovalsHeld)
            .map(|(_, why)| why);
        match why {
            Some(why) if !self.held => {
                tracing::warn!(reason = %why, "rolling update held by the farm's removal budget");
                if !why.starts_with(crate::failsafe::TRIPPED) {
                    let audit = AuditRecord::new(
                        events::REMOVALS_HELD,
                        json!({
                            "rolling_update_id": self.id,
                            "old_rc": roll.update.old_rc,
                            "new_rc": roll.update.new_rc,
                            "farm_id": self.ctx.farm_id,
                            "reason": why,
                        }),
                    );
                    self.report(audit).await?;
                }
                self.ctx.failsafe.set_held(&who, true);
                self.held = true;
            }
            None if self.held => {
                tracing::info!("rolling update no longer held by the removal budget");
                self.ctx.failsafe.set_held(&who, false);
                self.held = false;
            }
            _ => {}
        }
        Ok(())
    }

    /// The record that a reported stall is over, carried by the transaction that moves the
    /// roll (a completion deletes the roll's lock: nothing fenced can follow it).
    pub(super) fn progress_record(&self, roll: &Roll) -> Option<AuditRecord> {
        self.alerted.as_ref()?;
        Some(AuditRecord::new(
            events::ROLL_PROGRESSING,
            json!({"rolling_update_id": self.id, "old_rc": roll.update.old_rc, "new_rc": roll.update.new_rc, "farm_id": self.ctx.farm_id}),
        ))
    }

    /// The progress deadline starts again (a new pod up, a step, a pause or a delay).
    fn restart_deadline(&mut self) {
        self.deadline_spent = Duration::ZERO;
        self.counting_since = None;
    }

    /// The progress deadline stops counting (the roll waits on something else than its new
    /// pods); what it counted stays.
    fn pause_deadline(&mut self, now: Instant) {
        if let Some(since) = self.counting_since.take() {
            self.deadline_spent += now.saturating_duration_since(since);
        }
    }

    /// The roll moved.
    fn progressed(&mut self, pods_moved: bool) {
        self.stuck_since = None;
        if pods_moved {
            self.restart_deadline();
        }
        if self.alerted.take().is_some() {
            tracing::info!("rolling update progresses again");
            self.ctx.status.update(self.id, &self.ctx.farm_id, |s| {
                s.set_condition("Stalled", None)
            });
        }
    }
}

/// Who holds an RC's mutation lock, in words an operator can act on: which roll, node transfer
/// or other session, and what lets it go.
pub(super) fn describe_holder(locks: &LockView, session: &str, value: &str) -> String {
    let farm = locks
        .holders
        .values()
        .filter_map(|h| h.ownership.as_ref())
        .find(|(s, _)| &**s == session)
        .map(|(_, name)| name.clone());
    let by = farm.map(|f| format!(" by {f}")).unwrap_or_default();
    if let Some(roll) = value.strip_prefix(ROLL_HOLDER_PREFIX) {
        format!(
            "rolling update {roll}{by} (session {session}), until it completes: `rcctl roll show {roll}`, or `rcctl roll abort {roll}` to let it go"
        )
    } else if let Some(rc) = value.strip_prefix("rc-node-transfer-") {
        format!(
            "a node transfer of RC {rc}{by} (session {session}), until the transfer ends: its new pod passes its health check, or the farm's --transfer-timeout rolls it back"
        )
    } else {
        format!(
            "session {session} (lock value {value:?}), not a farm's: a tool such as P2's `p2-rctl rolling-update` holds it until it ends; to let it go, destroy that session (`curl -X PUT $CONSUL_HTTP_ADDR/v1/session/destroy/{session}`)"
        )
    }
}

/// A node transfer in flight on one of a roll's RCs, in words: where, and what ends it.
fn describe_transfer(
    locks: &LockView,
    which: &str,
    id: RcId,
    t: &crate::rctask::Transfer,
    disabled: Option<bool>,
) -> String {
    let mut why = format!(
        "a node transfer is in flight on the {which} RC {id} ({} → {}): the roll takes the RCs' mutation locks once it ends, which it does by itself (its new pod passes its health check, or the farm's --transfer-timeout rolls it back)",
        t.old_node, t.new_node
    );
    if let Some((session, _)) = locks.node_transfer(id) {
        why.push_str(&format!(
            "; it is frozen while session {session} holds {}: release that lock, or destroy the session (`curl -X PUT $CONSUL_HTTP_ADDR/v1/session/destroy/{session}`)",
            id.node_transfer_lock_key()
        ));
    }
    if disabled == Some(true) {
        why.push_str(&format!(
            "; RC {id} is disabled, which holds the transfer where it is: `rcctl rc enable {id}`"
        ));
    }
    why
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The roll task's error policy, one row per kind of pass result.
    #[test]
    fn the_error_policy_reads_as_its_rules() {
        /// A pass's result, as the policy reads it.
        type PassResult = Option<Result<Outcome, RollError>>;
        let wait = Duration::from_secs(5);
        let rows: Vec<(&str, PassResult, Policy)> = vec![
            ("the roll record deleted: stop", None, Policy::Deleted),
            ("completed: stop", Some(Ok(Outcome::Done)), Policy::Done),
            (
                "waiting: look again when the pass said, or on a change",
                Some(Ok(Outcome::Wait(wait))),
                Policy::Wait(wait),
            ),
            (
                "a write fenced: stop, tell the farm",
                Some(Err(RollError::Fenced)),
                Policy::Fenced,
            ),
            (
                "something moved since the plan: plan again",
                Some(Err(RollError::Stale("roll".into()))),
                Policy::Stale,
            ),
            (
                "anything else: back off",
                Some(Err(RollError::Other("x".into()))),
                Policy::Backoff,
            ),
        ];
        for (rule, result, want) in rows {
            assert_eq!(policy(result.as_ref()), want, "{rule}");
        }
    }

    #[test]
    fn keys_and_holder() {
        let id = RcId::new();
        assert_eq!(reality_key("n1", "web"), "reality/n1/web");
        assert_eq!(roll_holder(id), format!("rcfarm-roll:{id}"));
        assert_ne!(roll_holder(id), id.node_transfer_holder());
    }

    #[test]
    fn intent_state_compares_manifests_by_digest() {
        let a = IntentState::from_value(Some(b"id: web\nlaunchables: {}\n"));
        let b = IntentState::from_value(Some(b"{\"id\": \"web\", \"launchables\": {}}"));
        assert_eq!(a, b);
    }
}

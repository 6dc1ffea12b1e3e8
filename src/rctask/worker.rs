//! The RC task: one per owned RC. It observes (from the farm's caches), plans (a pure function),
//! and applies the plan as fenced Consul transactions, each beginning with `check-session` on
//! the RC's ownership lock and carrying its audit record.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use serde_json::{Value, json};
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::intents::{IntentState, IntentView, intent_key};
use super::plan::{Action, Observed, Transfer, plan};
use super::status::StatusRegistry;
use crate::audit::{AuditRecord, events};
use crate::consul::{Consul, ConsulError, QueryOptions, TxnFailure, TxnOp};
use crate::health::HealthCache;
use crate::labels::{
    LabelCache, LabelSet, LabelStore, LabelType, Selector, pod_label_id, split_pod_label_id,
};
use crate::rc::{
    CHANGE_MARKER, DesiredState, InvalidRc, POD_ID_LABEL, RC_ID_LABEL, Rc, RcId, RcStore,
};
use crate::scheduler::{NodeName, NodeSet, Scheduler, SchedulerError};
use crate::util::{Backoff, jitter_half};

/// Room left in a transaction for the ownership check and audit records.
const TXN_OVERHEAD: usize = 4;

/// Tunables of RC tasks.
#[derive(Debug, Clone)]
pub struct TaskConfig {
    /// Re-plan this often even when nothing changed.
    pub resync: Duration,
    /// Roll a node transfer back if the new pod is not healthy by then.
    pub transfer_timeout: Duration,
    pub error_backoff_max: Duration,
}

impl Default for TaskConfig {
    fn default() -> Self {
        Self {
            resync: Duration::from_secs(30),
            transfer_timeout: Duration::from_secs(300),
            error_backoff_max: Duration::from_secs(30),
        }
    }
}

/// What tasks of one farm share.
pub struct TaskContext {
    pub consul: Consul,
    pub farm_id: String,
    pub pods: Arc<LabelCache>,
    pub health: Arc<HealthCache>,
    pub scheduler: Arc<dyn Scheduler>,
    pub intents: Arc<IntentView>,
    pub status: Arc<StatusRegistry>,
    /// Sessions holding each RC's mutation lock, from the farm's watch of the lock tree.
    pub mutation_locks: watch::Receiver<Arc<BTreeMap<RcId, String>>>,
    pub config: TaskConfig,
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

#[derive(Debug, thiserror::Error)]
enum TaskError {
    #[error("fenced: this farm no longer holds the ownership lock")]
    Fenced,
    /// The RC changed since the plan was made (the write was refused; plan again).
    #[error("the RC changed while planning; planning again")]
    Stale,
    #[error(transparent)]
    Consul(#[from] ConsulError),
    #[error("scheduler: {0}")]
    Scheduler(#[from] SchedulerError),
    #[error("{0}")]
    Other(String),
}

impl TaskError {
    /// A write that may or may not have been applied (Consul unreachable, or the answer lost).
    fn outcome_unknown(&self) -> bool {
        matches!(self, TaskError::Consul(e) if e.is_retryable())
    }
}

/// The farm's handle on a task.
pub struct TaskHandle {
    pub id: RcId,
    state: watch::Sender<RcState>,
    wake: Arc<Notify>,
    cancel: CancellationToken,
    join: JoinHandle<()>,
}

impl TaskHandle {
    /// Hands the task a new version of its RC (it re-plans if anything changed).
    pub fn update(&self, state: RcState) {
        let _ = self.state.send(state);
    }

    /// Asks for a new pass (something it depends on changed).
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    pub fn is_finished(&self) -> bool {
        self.join.is_finished()
    }

    /// Stops the task and waits until it can no longer write.
    pub async fn stop(self) {
        self.cancel.cancel();
        let _ = self.join.await;
    }

    /// Signals the task to stop without waiting.
    pub fn cancel(&self) {
        self.cancel.cancel();
    }
}

/// Starts the task of an RC the farm now owns with `session`.
pub fn spawn(
    ctx: Arc<TaskContext>,
    session: String,
    parent: &CancellationToken,
    id: RcId,
    initial: RcState,
    events: mpsc::UnboundedSender<TaskEvent>,
) -> TaskHandle {
    let (state_tx, state_rx) = watch::channel(initial);
    let wake = Arc::new(Notify::new());
    let cancel = parent.child_token();
    let span = tracing::info_span!("rc", rc_id = %id, farm_id = %ctx.farm_id);
    let worker = Worker {
        ctx,
        session,
        id,
        state: state_rx,
        wake: wake.clone(),
        cancel: cancel.clone(),
        events,
        transfer: None,
        transfer_loaded: false,
        unconfirmed_alloc: None,
        unmet: None,
        invalid_reported: None,
        rejected_reported: None,
        last_seen: None,
        pending_dealloc: BTreeSet::new(),
        backoff: Backoff::new(Duration::from_millis(200), Duration::from_secs(30)),
        unmet_backoff: Backoff::new(Duration::from_millis(200), Duration::from_secs(5)),
    };
    let join = tokio::spawn(worker.run().instrument(span));
    TaskHandle {
        id,
        state: state_tx,
        wake,
        cancel,
        join,
    }
}

struct Worker {
    ctx: Arc<TaskContext>,
    session: String,
    id: RcId,
    state: watch::Receiver<RcState>,
    wake: Arc<Notify>,
    cancel: CancellationToken,
    events: mpsc::UnboundedSender<TaskEvent>,
    transfer: Option<Transfer>,
    /// Whether `transfer` reflects the status key. Cleared after a failed pass: a transfer's
    /// start or finish may have been applied with its answer lost, and acting on the old
    /// belief would leave a stale transfer in Consul or record its end twice.
    transfer_loaded: bool,
    /// A node allocated for a transfer whose start had an unknown outcome: kept if the
    /// transfer turns out to be in flight, given back otherwise.
    unconfirmed_alloc: Option<NodeName>,
    /// The unmet-desires reason last reported (so it is reported once, not every pass).
    unmet: Option<String>,
    /// The `ModifyIndex` of the invalid record last reported.
    invalid_reported: Option<u64>,
    /// The `ModifyIndex` of the RC version whose writes Consul refused as too large or
    /// malformed (a huge manifest), last reported.
    rejected_reported: Option<u64>,
    /// The desired state last seen, its index and change marker, to notice direct KV writes.
    last_seen: Option<(u64, DesiredState, Option<String>)>,
    /// Nodes to give back to the scheduler (a deallocation that failed is retried).
    pending_dealloc: BTreeSet<NodeName>,
    /// Paces retries after failed passes (Consul trouble); reset by any pass that succeeds.
    backoff: Backoff,
    /// Paces passes while desires cannot be met (too few nodes): short, and skipped when the
    /// RC itself changes, so an operator's fix is acted on at once.
    unmet_backoff: Backoff,
}

/// P2's status key for an RC.
fn status_key(id: RcId) -> String {
    format!("status/replication_controllers/{id}/replication_controller")
}

impl Worker {
    async fn run(mut self) {
        tracing::info!("RC task started");
        let mut not_before: Option<Instant> = None;
        loop {
            if self.cancel.is_cancelled() {
                break;
            }
            if let Some(t) = not_before.take() {
                tokio::select! {
                    _ = self.cancel.cancelled() => break,
                    _ = tokio::time::sleep_until(t) => {}
                }
            }
            let state = self.state.borrow_and_update().clone();
            let version = match &state {
                RcState::Valid(rc) => Some(rc.modify_index),
                _ => None,
            };
            let cancel = self.cancel.clone();
            // A stopped task abandons its pass at once: whatever write is in flight is fenced,
            // and handovers must not wait for a pass to finish.
            let outcome = tokio::select! {
                _ = cancel.cancelled() => break,
                outcome = async {
                    match state {
                        RcState::Deleted => None,
                        RcState::Invalid(inv) => Some(self.report_invalid(&inv).await.map(|_| false)),
                        RcState::Valid(rc) => Some(self.pass(&rc).await),
                    }
                } => outcome,
            };
            let Some(outcome) = outcome else {
                tracing::info!("RC key deleted: stopping its task and leaving its pods");
                self.ctx.status.remove_rc(self.id);
                break;
            };
            let mut paced_for_unmet = false;
            let delay = match outcome {
                Ok(unmet) => {
                    self.backoff.reset();
                    let resync =
                        jitter_half(self.ctx.config.resync * 2).min(self.ctx.config.resync * 2);
                    if unmet {
                        // Node changes retrigger unmet RCs; pace them rather than loop hot.
                        not_before = Some(Instant::now() + self.unmet_backoff.next_delay());
                        paced_for_unmet = true;
                    } else {
                        self.unmet_backoff.reset();
                    }
                    resync
                }
                Err(TaskError::Stale) => {
                    tracing::debug!(
                        "the RC changed during the pass; planning again with the new version"
                    );
                    Duration::from_millis(200)
                }
                Err(TaskError::Fenced) => {
                    tracing::warn!("lost the RC's ownership lock; stopping without further writes");
                    let _ = self.events.send(TaskEvent::Fenced(self.id));
                    break;
                }
                Err(TaskError::Consul(ConsulError::Rejected { status, body }))
                    if status == 413 || status == 400 =>
                {
                    // Retrying the same write cannot help; the RC (or Consul's limits) must
                    // change. Report once per version and look again now and then.
                    let wait = match self.report_rejected(version, status, &body).await {
                        Ok(()) => {
                            paced_for_unmet = true;
                            self.ctx.config.error_backoff_max
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot report the refused write; retrying");
                            self.backoff
                                .next_delay()
                                .min(self.ctx.config.error_backoff_max)
                        }
                    };
                    not_before = Some(Instant::now() + wait);
                    wait
                }
                Err(e) => {
                    // Whatever this pass wrote last may have been applied: learn the transfer
                    // state from Consul again before acting on it.
                    self.transfer_loaded = false;
                    let wait = self
                        .backoff
                        .next_delay()
                        .min(self.ctx.config.error_backoff_max);
                    tracing::warn!(error = %e, retry_in = ?wait, "RC pass failed");
                    metrics::counter!("rcfarm_rc_pass_errors_total").increment(1);
                    self.ctx.status.update_rc(self.id, &self.ctx.farm_id, |s| {
                        s.last_error = Some(e.to_string())
                    });
                    not_before = Some(Instant::now() + wait);
                    wait
                }
            };
            tokio::select! {
                _ = self.cancel.cancelled() => break,
                _ = self.state.changed() => {
                    if paced_for_unmet {
                        not_before = None;
                    }
                }
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(delay) => {}
            }
        }
        tracing::info!("RC task stopped");
    }

    /// Reports an invalid record once per version: log, metric, status, audit event.
    async fn report_invalid(&mut self, inv: &InvalidRc) -> Result<(), TaskError> {
        self.ctx.status.update_rc(self.id, &self.ctx.farm_id, |s| {
            s.set_condition("Invalid", Some(inv.problem.to_string()));
        });
        if self.invalid_reported == Some(inv.modify_index) {
            return Ok(());
        }
        tracing::warn!(problem = %inv.problem, "RC record is invalid; not acting on it until it is fixed");
        metrics::counter!("rcfarm_rc_invalid_total", "kind" => inv.problem.kind()).increment(1);
        let audit = AuditRecord::deterministic(
            &format!("invalid:{}@{}", inv.key, inv.modify_index),
            events::RC_INVALID,
            json!({
                "replication_controller_id": self.id,
                "key": inv.key,
                "modify_index": inv.modify_index,
                "problem": inv.problem.to_string(),
                "farm_id": self.ctx.farm_id,
            }),
        );
        self.commit_report(audit).await?;
        self.invalid_reported = Some(inv.modify_index);
        Ok(())
    }

    /// Reports, once per RC version, that Consul refused the farm's writes for it (HTTP 413 or
    /// 400: a manifest too large for a transaction, say): log, metric, status, audit event.
    async fn report_rejected(
        &mut self,
        version: Option<u64>,
        status: u16,
        body: &str,
    ) -> Result<(), TaskError> {
        let problem = format!(
            "Consul refused the farm's write for this RC (HTTP {status}: {}); a manifest too large \
             for a Consul transaction is the usual cause: shrink it, or raise Consul's \
             txn_max_req_len and kv_max_value_size",
            body.trim()
        );
        self.ctx.status.update_rc(self.id, &self.ctx.farm_id, |s| {
            s.set_condition("Invalid", Some(problem.clone()));
            s.last_error = Some(problem.clone());
        });
        if version.is_none() || self.rejected_reported == version {
            return Ok(());
        }
        tracing::warn!(%problem, "RC cannot be served as it is");
        metrics::counter!("rcfarm_rc_invalid_total", "kind" => "rejected_by_consul").increment(1);
        let audit = AuditRecord::deterministic(
            &format!("rejected:{}@{}", self.id.key(), version.unwrap_or_default()),
            events::RC_INVALID,
            json!({
                "replication_controller_id": self.id,
                "key": self.id.key(),
                "modify_index": version,
                "problem": problem,
                "farm_id": self.ctx.farm_id,
            }),
        );
        self.commit_report(audit).await?;
        self.rejected_reported = version;
        Ok(())
    }

    /// Records a change of desired state made without rcfarm (a direct KV write).
    async fn notice_changes(&mut self, rc: &Rc) -> Result<(), TaskError> {
        let marker = rc
            .raw
            .extra
            .get(CHANGE_MARKER)
            .and_then(Value::as_str)
            .map(str::to_string);
        let desired = rc.desired();
        let seen = (rc.modify_index, desired.clone(), marker.clone());
        let Some((idx, old, old_marker)) = &self.last_seen else {
            self.last_seen = Some(seen);
            return Ok(());
        };
        if *idx >= rc.modify_index {
            return Ok(());
        }
        let changes = old.diff(&desired);
        if !changes.is_empty() && (marker.is_none() || marker == *old_marker) {
            tracing::info!(
                ?changes,
                "desired state changed outside rcfarm; recording it"
            );
            // Named after the versions it spans and written create-only: a retry after a lost
            // answer, or a failed pass, records the change once. The previous version is kept
            // until it is recorded, so a failure never loses it.
            let audit = AuditRecord::deterministic(
                &format!(
                    "{}@{idx}->{}:observed-change",
                    self.id.key(),
                    rc.modify_index
                ),
                events::RC_OBSERVED_CHANGE,
                json!({
                    "replication_controller_id": self.id,
                    "pod_id": rc.pod_id(),
                    "farm_id": self.ctx.farm_id,
                    "modify_index": rc.modify_index,
                    "changes": changes,
                }),
            );
            self.commit_report(audit).await?;
        }
        self.last_seen = Some(seen);
        Ok(())
    }

    async fn load_transfer(&mut self) -> Result<(), TaskError> {
        if self.transfer_loaded {
            return Ok(());
        }
        let (entry, _) = self
            .ctx
            .consul
            .kv_get(&status_key(self.id), &QueryOptions::default())
            .await?;
        let stored = entry.and_then(|e| {
            let v: Value = serde_json::from_slice(e.value_bytes()).ok()?;
            serde_json::from_value::<Transfer>(v.get("node_transfer")?.clone()).ok()
        });
        if let Some(t) = &stored
            && self.transfer.as_ref() != Some(t)
        {
            tracing::info!(old = %t.old_node, new = %t.new_node, "resuming a node transfer in flight");
        }
        self.transfer = stored;
        self.transfer_loaded = true;
        Ok(())
    }

    /// One convergence pass: plan and apply until there is nothing left to do. Returns whether
    /// the desires are unmet.
    async fn pass(&mut self, rc: &Rc) -> Result<bool, TaskError> {
        let started = Instant::now();
        self.ctx.status.update_rc(self.id, &self.ctx.farm_id, |s| {
            s.set_condition("Invalid", None)
        });
        self.invalid_reported = None;
        self.notice_changes(rc).await?;
        self.load_transfer().await?;
        if let Some(node) = self.unconfirmed_alloc.take()
            && self.transfer.as_ref().map(|t| &t.new_node) != Some(&node)
        {
            self.deallocate(rc, std::slice::from_ref(&node)).await;
        }
        if self.transfer.is_none()
            && self.ctx.mutation_locks.borrow().get(&self.id) == Some(&self.session)
        {
            // Left over from a transfer whose release was lost: it would block rolling updates.
            RcStore::new(self.ctx.consul.clone())
                .release_mutation(self.id, &self.session)
                .await
                .map_err(|e| TaskError::Other(e.to_string()))?;
        }
        self.retry_deallocations(rc).await;
        let mut allocation_exhausted = false;
        let mut mutation_locked_elsewhere = false;
        let mut result = Ok(false);
        for _ in 0..16 {
            let mut o = self
                .observe(rc, allocation_exhausted, mutation_locked_elsewhere)
                .await?;
            let p = plan(&o);
            // Applying needs only the current pods; do not hold every eligible node's name
            // across the writes (thousands of RCs do this at once when a farm starts).
            o.eligible = NodeSet::default();
            self.publish_status(rc, &o, &p);
            let Some(action) = p.actions.first().cloned() else {
                result = self
                    .settle_unmet(rc, p.unmet)
                    .await
                    .map(|_| self.unmet.is_some());
                break;
            };
            tracing::debug!(?action, "applying");
            match self.apply(rc, &o, action).await? {
                Applied::Done => {}
                Applied::AllocationExhausted => allocation_exhausted = true,
                Applied::MutationLocked => mutation_locked_elsewhere = true,
            }
        }
        metrics::counter!("rcfarm_converge_passes_total").increment(1);
        metrics::histogram!("rcfarm_converge_pass_seconds").record(started.elapsed().as_secs_f64());
        self.ctx.status.update_rc(self.id, &self.ctx.farm_id, |s| {
            s.last_pass = Some(Utc::now());
            s.passes += 1;
            if result.is_ok() {
                s.last_error = None;
            }
        });
        result
    }

    async fn observe<'a>(
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
        let health: BTreeMap<NodeName, _> = self
            .ctx
            .health
            .for_pod(rc.pod_id())
            .into_iter()
            .map(|(n, h)| (NodeName::from(n), h))
            .collect();
        let health_in_use = !health.is_empty();
        let bad_intents =
            self.ctx
                .intents
                .bad(rc.pod_id(), rc.manifest.digest(), current.keys().cloned());
        let held_by = self.ctx.mutation_locks.borrow().get(&self.id).cloned();
        let locked_elsewhere =
            mutation_locked_elsewhere || held_by.is_some_and(|s| s != self.session);
        Ok(Observed {
            rc,
            current,
            eligible,
            health,
            health_in_use,
            bad_intents,
            transfer: self.transfer.clone(),
            allocation_exhausted,
            mutation_locked_elsewhere: locked_elsewhere,
            now: Utc::now(),
            transfer_timeout: self.ctx.config.transfer_timeout,
        })
    }

    fn publish_status(&self, rc: &Rc, o: &Observed<'_>, p: &super::plan::Plan) {
        let healthy = o
            .current
            .keys()
            .filter(|n| o.health.get(*n).is_some_and(|h| h.is_passing()))
            .count();
        self.ctx.status.update_rc(self.id, &self.ctx.farm_id, |s| {
            s.pod_id = Some(rc.pod_id().to_string());
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
        });
    }

    /// Reports unmet desires when they start and when they clear, once each.
    async fn settle_unmet(&mut self, rc: &Rc, now: Option<String>) -> Result<(), TaskError> {
        match (&self.unmet, &now) {
            (None, Some(reason)) => {
                tracing::warn!(%reason, "desires cannot be met");
                let audit = AuditRecord::new(
                    events::RC_DESIRES_UNMET,
                    json!({"replication_controller_id": self.id, "pod_id": rc.pod_id(), "farm_id": self.ctx.farm_id, "reason": reason}),
                );
                self.commit(vec![], vec![audit]).await?;
                metrics::counter!("rcfarm_desires_unmet_total").increment(1);
            }
            (Some(_), None) => {
                tracing::info!("desires are met again");
                let audit = AuditRecord::new(
                    events::RC_DESIRES_MET,
                    json!({"replication_controller_id": self.id, "pod_id": rc.pod_id(), "farm_id": self.ctx.farm_id}),
                );
                self.commit(vec![], vec![audit]).await?;
            }
            _ => {}
        }
        self.unmet = now.clone();
        self.ctx.status.update_rc(self.id, &self.ctx.farm_id, |s| {
            s.set_condition("Unmet", now)
        });
        Ok(())
    }

    // ---- writes -----------------------------------------------------------------------------

    /// Commits a write planned against `rc`: fenced by the ownership lock, and refused if the
    /// RC record changed since it was read (so nothing is ever scheduled for a stale replica
    /// count or selector).
    async fn commit_for(
        &self,
        rc: &Rc,
        ops: Vec<TxnOp>,
        audits: Vec<AuditRecord>,
    ) -> Result<u64, TaskError> {
        let mut guarded = Vec::with_capacity(ops.len() + 1);
        guarded.push(TxnOp::check_index(rc.id.key(), rc.modify_index));
        guarded.extend(ops);
        match self.commit(guarded, audits).await {
            Err(TaskError::Consul(e))
                if e.txn_failures().any(|(i, f)| {
                    i == 1 && matches!(f, TxnFailure::IndexStale | TxnFailure::KeyMissing)
                }) =>
            {
                metrics::counter!("rcfarm_stale_plans_total").increment(1);
                Err(TaskError::Stale)
            }
            other => other,
        }
    }

    /// Commits `ops` fenced by the ownership lock, with `audits`. Returns the commit index.
    async fn commit(&self, ops: Vec<TxnOp>, audits: Vec<AuditRecord>) -> Result<u64, TaskError> {
        if self.cancel.is_cancelled() {
            // Stopped (session lost or handed over): never write again.
            return Err(TaskError::Fenced);
        }
        let mut all = Vec::with_capacity(ops.len() + audits.len() + 1);
        all.push(RcStore::ownership_check_op(self.id, &self.session));
        all.extend(ops);
        all.extend(audits.iter().map(AuditRecord::txn_op));
        match self.ctx.consul.txn(&all).await {
            Ok(resp) => Ok(resp
                .results
                .iter()
                .map(|r| r.modify_index)
                .max()
                .unwrap_or(0)),
            Err(e)
                if e.txn_failures().any(|(i, f)| {
                    i == 0 && matches!(f, TxnFailure::SessionMismatch | TxnFailure::KeyMissing)
                }) =>
            {
                metrics::counter!("rcfarm_fenced_writes_total").increment(1);
                Err(TaskError::Fenced)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Commits a report whose id is derived from what it reports ([`AuditRecord::deterministic`]):
    /// if the record exists already, an earlier owner of this RC (before a handover) made it.
    async fn commit_report(&self, audit: AuditRecord) -> Result<(), TaskError> {
        match self.commit(vec![], vec![audit]).await {
            Ok(_) => Ok(()),
            // Op 0 is the fencing check, op 1 the create-only audit record.
            Err(TaskError::Consul(e)) if AuditRecord::recorded_already(&e, 1) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Waits until the pod label cache reflects our own write, so the next plan counts it.
    async fn await_own_write(&self, index: u64) -> Result<(), TaskError> {
        if index == 0 {
            return Ok(());
        }
        tokio::time::timeout(Duration::from_secs(10), self.ctx.pods.wait_for_index(index))
            .await
            .map_err(|_| {
                TaskError::Other(
                    "the pod label cache did not catch up with our own write within 10 s".into(),
                )
            })
    }

    fn schedule_ops(&self, rc: &Rc, node: &str) -> Vec<TxnOp> {
        let pod = rc.pod_id();
        let id = pod_label_id(node, pod);
        let (existing, index) = self
            .ctx
            .pods
            .get_with_index(&id)
            .map(|(l, i)| ((*l).clone(), i))
            .unwrap_or_default();
        vec![
            TxnOp::set(intent_key(node, pod), rc.manifest.raw().as_bytes().to_vec()),
            LabelStore::apply_op(
                LabelType::Pod,
                &id,
                &existing,
                index,
                &rc.labels_for_pods(),
                &[],
            ),
        ]
    }

    fn unschedule_ops(&self, rc: &Rc, node: &str, pod: &str) -> Vec<TxnOp> {
        let id = pod_label_id(node, pod);
        let mut ops = vec![TxnOp::delete(intent_key(node, pod))];
        if let Some((existing, index)) = self.ctx.pods.get_with_index(&id) {
            let mut remove: Vec<String> = rc.pod_labels.keys().cloned().collect();
            remove.push(POD_ID_LABEL.to_string());
            remove.push(RC_ID_LABEL.to_string());
            ops.push(LabelStore::apply_op(
                LabelType::Pod,
                &id,
                &existing,
                index,
                &LabelSet::new(),
                &remove,
            ));
        }
        ops
    }

    /// P2's RETARGET record: the full node set after the change.
    fn retarget(&self, rc: &Rc, nodes: &BTreeSet<NodeName>) -> AuditRecord {
        AuditRecord::new(
            events::RC_RETARGET,
            json!({
                "pod_id": rc.pod_id(),
                "availability_zone": rc.pod_labels.get("availability_zone").cloned().unwrap_or_default(),
                "cluster_name": rc.pod_labels.get("cluster_name").cloned().unwrap_or_default(),
                "nodes": nodes,
                "replication_controller_id": self.id,
                "farm_id": self.ctx.farm_id,
            }),
        )
    }

    fn transfer_details(
        &self,
        rc: &Rc,
        t: &Transfer,
        replicas: u64,
    ) -> serde_json::Map<String, Value> {
        let v = json!({
            "node_transfer_id": t.id,
            "replication_controller_id": self.id,
            "pod_id": rc.pod_id(),
            "availability_zone": rc.pod_labels.get("availability_zone").cloned().unwrap_or_default(),
            "cluster_name": rc.pod_labels.get("cluster_name").cloned().unwrap_or_default(),
            "replication_controller_node_selector": rc.node_selector.to_string(),
            "old_node": t.old_node,
            "new_node": t.new_node,
            "replica_count": replicas,
            "farm_id": self.ctx.farm_id,
        });
        match v {
            Value::Object(m) => m,
            _ => serde_json::Map::new(),
        }
    }

    async fn apply(
        &mut self,
        rc: &Rc,
        o: &Observed<'_>,
        action: Action,
    ) -> Result<Applied, TaskError> {
        let mut nodes: BTreeSet<NodeName> = o.current.keys().cloned().collect();
        match action {
            Action::Schedule(targets) => self.write_pods(rc, o, &targets, false).await,
            Action::Replace(targets) => self.write_pods(rc, o, &targets, false).await,
            Action::Repair(targets) => self.write_pods(rc, o, &targets, true).await,
            Action::Unschedule(targets) => {
                for chunk in targets.chunks((crate::consul::MAX_TXN_OPS - TXN_OVERHEAD) / 2) {
                    let mut ops = Vec::new();
                    for node in chunk {
                        let pod = o
                            .current
                            .get(node)
                            .map(String::as_str)
                            .unwrap_or(rc.pod_id());
                        ops.extend(self.unschedule_ops(rc, node, pod));
                        nodes.remove(node);
                    }
                    let idx = self
                        .commit_for(rc, ops, vec![self.retarget(rc, &nodes)])
                        .await?;
                    for node in chunk {
                        self.ctx.intents.remove(node, rc.pod_id());
                    }
                    tracing::info!(nodes = ?chunk, "unscheduled");
                    metrics::counter!("rcfarm_pods_unscheduled_total")
                        .increment(chunk.len() as u64);
                    self.await_own_write(idx).await?;
                    self.deallocate(rc, chunk).await;
                }
                Ok(Applied::Done)
            }
            Action::Allocate(n) => match self
                .ctx
                .scheduler
                .allocate_nodes(&rc.manifest, &rc.node_selector, n, false)
                .await
            {
                Ok(got) => {
                    tracing::info!(wanted = n, got = ?got, "allocated nodes");
                    Ok(if got.len() < n {
                        Applied::AllocationExhausted
                    } else {
                        Applied::Done
                    })
                }
                Err(SchedulerError::AllocationUnsupported(why)) => {
                    tracing::debug!(%why, "allocation unsupported");
                    Ok(Applied::AllocationExhausted)
                }
                Err(e) => Err(e.into()),
            },
            Action::StartTransfer { old, new } => self.start_transfer(rc, o, old, new).await,
            Action::CompleteTransfer => self.finish_transfer(rc, o, None).await,
            Action::RollbackTransfer(reason) => self.finish_transfer(rc, o, Some(reason)).await,
        }
    }

    /// Writes intent and labels on `targets` (replacing pods of an older pod id in place). A
    /// repair changes no node set, so it is audited as a repair, not a retarget.
    async fn write_pods(
        &mut self,
        rc: &Rc,
        o: &Observed<'_>,
        targets: &[NodeName],
        repair: bool,
    ) -> Result<Applied, TaskError> {
        let mut nodes: BTreeSet<NodeName> = o.current.keys().cloned().collect();
        // Up to four ops per node (a replacement removes the old pod's intent and labels).
        for chunk in targets.chunks((crate::consul::MAX_TXN_OPS - TXN_OVERHEAD) / 4) {
            let mut ops = Vec::new();
            for node in chunk {
                if let Some(old_pod) = o.current.get(node).filter(|p| p.as_str() != rc.pod_id()) {
                    ops.extend(self.unschedule_ops(rc, node, old_pod));
                }
                ops.extend(self.schedule_ops(rc, node));
                nodes.insert(node.clone());
            }
            let audit = if repair {
                AuditRecord::new(
                    events::RC_REPAIRED,
                    json!({
                        "replication_controller_id": self.id,
                        "pod_id": rc.pod_id(),
                        "farm_id": self.ctx.farm_id,
                        "nodes": chunk,
                        "reason": "intent missing or different from the manifest",
                    }),
                )
            } else {
                self.retarget(rc, &nodes)
            };
            let idx = self.commit_for(rc, ops, vec![audit]).await?;
            for node in chunk {
                self.ctx.intents.set(
                    node,
                    rc.pod_id(),
                    IntentState::Digest(rc.manifest.digest().to_string()),
                );
            }
            tracing::info!(nodes = ?chunk, repair, "scheduled");
            metrics::counter!("rcfarm_pods_scheduled_total").increment(chunk.len() as u64);
            self.await_own_write(idx).await?;
        }
        Ok(Applied::Done)
    }

    async fn start_transfer(
        &mut self,
        rc: &Rc,
        o: &Observed<'_>,
        old: NodeName,
        new: Option<NodeName>,
    ) -> Result<Applied, TaskError> {
        let (new, allocated) = match new {
            Some(n) => (n, false),
            None => match self
                .ctx
                .scheduler
                .allocate_nodes(&rc.manifest, &rc.node_selector, 1, true)
                .await
            {
                Ok(mut got) if !got.is_empty() => (got.remove(0), true),
                Ok(_) | Err(SchedulerError::AllocationUnsupported(_)) => {
                    return Ok(Applied::AllocationExhausted);
                }
                Err(e) => return Err(e.into()),
            },
        };
        let store = RcStore::new(self.ctx.consul.clone());
        if !store
            .acquire_mutation(
                self.id,
                &self.session,
                &format!("rc-node-transfer-{}", self.id),
            )
            .await
            .map_err(|e| TaskError::Other(e.to_string()))?
        {
            if allocated {
                self.deallocate(rc, std::slice::from_ref(&new)).await;
            }
            return Ok(Applied::MutationLocked);
        }
        let t = Transfer {
            old_node: old.clone(),
            new_node: new.clone(),
            id: uuid::Uuid::new_v4().to_string(),
            started_at: Utc::now(),
        };
        let mut nodes: BTreeSet<NodeName> = o.current.keys().cloned().collect();
        nodes.insert(new.clone());
        let mut ops = vec![
            TxnOp::check_session(self.id.mutation_lock_key(), &self.session),
            TxnOp::cas(
                status_key(self.id),
                serde_json::to_vec(&json!({"node_transfer": t})).unwrap_or_default(),
                0,
            ),
        ];
        ops.extend(self.schedule_ops(rc, &new));
        let start = AuditRecord::new(
            events::NODE_TRANSFER_START,
            Value::Object(self.transfer_details(rc, &t, rc.replicas_desired)),
        );
        match self
            .commit_for(rc, ops, vec![start, self.retarget(rc, &nodes)])
            .await
        {
            Ok(idx) => {
                tracing::info!(%old, %new, "node transfer started");
                self.ctx.intents.set(
                    &new,
                    rc.pod_id(),
                    IntentState::Digest(rc.manifest.digest().to_string()),
                );
                self.transfer = Some(t);
                self.await_own_write(idx).await?;
                Ok(Applied::Done)
            }
            Err(e) if e.outcome_unknown() => {
                // The transfer may be in flight: keep the mutation lock and the node until the
                // next pass has re-read the status key (the failed pass makes it; its start
                // gives back what turns out unused).
                if allocated {
                    self.unconfirmed_alloc = Some(new);
                }
                Err(e)
            }
            Err(e) => {
                let _ = store.release_mutation(self.id, &self.session).await;
                if allocated {
                    self.deallocate(rc, std::slice::from_ref(&new)).await;
                }
                Err(e)
            }
        }
    }

    /// Completes (`rollback: None`) or rolls back a transfer in one transaction.
    async fn finish_transfer(
        &mut self,
        rc: &Rc,
        o: &Observed<'_>,
        rollback: Option<String>,
    ) -> Result<Applied, TaskError> {
        let Some(t) = self.transfer.clone() else {
            return Ok(Applied::Done);
        };
        let store = RcStore::new(self.ctx.consul.clone());
        // A transfer resumed after a farm change needs the mutation lock again.
        let held = self.ctx.mutation_locks.borrow().get(&self.id).cloned();
        if held.as_deref() != Some(self.session.as_str())
            && !store
                .acquire_mutation(
                    self.id,
                    &self.session,
                    &format!("rc-node-transfer-{}", self.id),
                )
                .await
                .map_err(|e| TaskError::Other(e.to_string()))?
        {
            return Ok(Applied::MutationLocked);
        }
        let drop_node = if rollback.is_some() {
            &t.new_node
        } else {
            &t.old_node
        };
        let mut nodes: BTreeSet<NodeName> = o.current.keys().cloned().collect();
        let mut ops = vec![TxnOp::delete(status_key(self.id))];
        if let Some(pod) = o.current.get(drop_node) {
            ops.extend(self.unschedule_ops(rc, drop_node, pod));
            nodes.remove(drop_node);
        }
        let mut details = self.transfer_details(rc, &t, rc.replicas_desired);
        let event = match &rollback {
            Some(reason) => {
                details.insert("rollback_reason".into(), json!(reason));
                events::NODE_TRANSFER_ROLLBACK
            }
            None => events::NODE_TRANSFER_COMPLETION,
        };
        let idx = self
            .commit_for(
                rc,
                ops,
                vec![
                    AuditRecord::new(event, Value::Object(details)),
                    self.retarget(rc, &nodes),
                ],
            )
            .await?;
        match &rollback {
            Some(reason) => {
                tracing::warn!(old = %t.old_node, new = %t.new_node, %reason, "node transfer rolled back")
            }
            None => tracing::info!(old = %t.old_node, new = %t.new_node, "node transfer completed"),
        }
        self.ctx.intents.remove(drop_node, rc.pod_id());
        self.transfer = None;
        let _ = store.release_mutation(self.id, &self.session).await;
        self.await_own_write(idx).await?;
        self.deallocate(rc, std::slice::from_ref(drop_node)).await;
        Ok(Applied::Done)
    }

    /// Gives nodes back to the scheduler; failures are kept and retried on later passes.
    async fn deallocate(&mut self, rc: &Rc, nodes: &[NodeName]) {
        for attempt in 0..3u32 {
            match self
                .ctx
                .scheduler
                .deallocate_nodes(&rc.node_selector, nodes)
                .await
            {
                Ok(()) => {
                    for n in nodes {
                        self.pending_dealloc.remove(n);
                    }
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, ?nodes, attempt, "deallocation failed; retrying");
                    tokio::time::sleep(Duration::from_millis(200 << attempt)).await;
                }
            }
        }
        self.pending_dealloc.extend(nodes.iter().cloned());
    }

    async fn retry_deallocations(&mut self, rc: &Rc) {
        if !self.pending_dealloc.is_empty() {
            let nodes: Vec<NodeName> = self.pending_dealloc.iter().cloned().collect();
            self.deallocate(rc, &nodes).await;
        }
    }
}

/// What applying one action led to, beyond success.
enum Applied {
    Done,
    /// The scheduler has no more nodes to give in this pass.
    AllocationExhausted,
    /// Another session holds the mutation lock.
    MutationLocked,
}

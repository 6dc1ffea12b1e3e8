//! The roll task's writes: each a transaction fenced by the roll's lock and the roll record's
//! version, carrying its audit record; then a wait until the farm's views show it.

use std::time::Duration;

use serde_json::{Value, json};

use super::control::{CANARY_PAUSER, Progress, RollControl, control_key};
use super::history::{self, History, HistorySeen, Revision, history_key};
use super::plan::RollAction;
use super::record::{Roll, Update, roll_key, roll_lock_key};
use super::store::{completion_details, creation_ops};
use super::worker::{Observation, RollError, RollEvent, STARTED_LABEL, Worker, roll_holder};
use crate::audit::{AuditRecord, events};
use crate::consul::{Fence, FenceError, FencedTxn, TxnOp};
use crate::labels::{LabelSet, LabelStore, LabelType};
use crate::rc::{Mutation, Rc, RcStore};

impl Worker {
    /// The checks every write of the roll begins with: this farm holds the roll's lock (op 0),
    /// the roll is the version planned against (op 1; an abort deletes it), and its control is
    /// as read (op 2: a pause written since fails the write).
    pub(super) fn fence(&self, roll: &Roll, o: &Observation) -> FencedTxn {
        self.held()
            .guard(TxnOp::check_index(roll_key(self.id), roll.modify_index))
            .guard(o.control.guard(self.id))
    }

    /// A transaction fenced by the roll's lock alone: a report still proves we hold the roll.
    pub(super) fn held(&self) -> FencedTxn {
        FencedTxn::fenced(Fence::new(roll_lock_key(self.id), &self.session))
    }

    pub(super) async fn apply(
        &mut self,
        roll: &Roll,
        o: &Observation,
        action: RollAction,
    ) -> Result<(), RollError> {
        let u = &roll.update;
        if action == RollAction::DeleteOrphan {
            return self.delete_orphan(roll, o).await;
        }
        let (Some(old), Some(new)) = (o.old.clone(), o.new.clone()) else {
            return Err(RollError::Other("an RC of the roll is missing".into()));
        };
        let mut ops = Vec::new();
        let mut guards = Vec::new();
        let checks = [
            TxnOp::check_session(u.old_rc.mutation_lock_key(), &self.session),
            TxnOp::check_session(u.new_rc.mutation_lock_key(), &self.session),
        ];
        let rewrite = |rc: &Rc, m: &[Mutation], audit: &AuditRecord| {
            RcStore::rewrite_op(rc, m, &audit.id.to_string())
                .map_err(|e| RollError::Other(e.to_string()))
        };
        let base = json!({
            "rolling_update_id": self.id,
            "old_rc": u.old_rc,
            "new_rc": u.new_rc,
            "pod_id": new.pod_id(),
            "farm_id": self.ctx.farm_id,
        });
        let details = |extra: Value| -> Value {
            let mut m = base.as_object().cloned().unwrap_or_default();
            if let Value::Object(e) = extra {
                m.extend(e);
            }
            Value::Object(m)
        };
        let counts = json!({"old": o.old_counts, "new": o.new_counts});
        // A step records the roll's progress in its control (guarded by the fence): a farm
        // that takes the roll over counts the progress deadline from it.
        let progress = |ops: &mut Vec<TxnOp>| {
            let mut control = o.control.control.clone().unwrap_or_default();
            control.progress = Some(Progress {
                at: self.ctx.clock.wall(),
                new_up: o.new_counts.map_or(0, |c| c.healthy),
            });
            ops.push(TxnOp::set(control_key(self.id), control.to_bytes()));
        };
        let (mut audits, wait_locks) = match &action {
            RollAction::Lock => {
                let holder = roll_holder(self.id);
                for (id, seen) in [
                    (u.old_rc, o.mutation_index.0),
                    (u.new_rc, o.mutation_index.1),
                ] {
                    let held = self
                        .ctx
                        .locks
                        .borrow()
                        .mutation(id)
                        .is_some_and(|(s, v)| **s == *self.session && **v == *holder);
                    if !held {
                        ops.extend(RcStore::mutation_lock_ops(id, &self.session, &holder, seen));
                    }
                }
                (vec![], true)
            }
            RollAction::Start {
                disable_old,
                enable_new,
                adopt,
            } => {
                let audit = AuditRecord::new(
                    events::ROLL_STARTED,
                    details(
                        json!({"disabled_old": disable_old, "enabled_new": enable_new, "adopted": adopt, "counts": counts, "desired_replicas": u.desired_replicas, "minimum_replicas": u.minimum_replicas}),
                    ),
                );
                guards.extend(checks);
                let (labels, index) = &o.labels;
                let started: LabelSet = [(
                    STARTED_LABEL.to_string(),
                    self.ctx.clock.wall().to_rfc3339(),
                )]
                .into();
                ops.push(LabelStore::apply_op(
                    LabelType::Rolls,
                    &self.id.to_string(),
                    labels,
                    *index,
                    &started,
                    &[],
                ));
                let mut old_changes = Vec::new();
                let mut new_changes = Vec::new();
                if *disable_old {
                    old_changes.push(Mutation::Disable);
                }
                if *enable_new {
                    new_changes.push(Mutation::Enable);
                }
                if *adopt > 0 {
                    old_changes.push(Mutation::AddReplicas(-(*adopt as i64)));
                    new_changes.push(Mutation::AddReplicas(*adopt as i64));
                }
                if !old_changes.is_empty() {
                    ops.push(rewrite(&old, &old_changes, &audit)?);
                }
                if !new_changes.is_empty() {
                    ops.push(rewrite(&new, &new_changes, &audit)?);
                }
                (vec![audit], false)
            }
            RollAction::Step {
                add,
                remove,
                old_to,
            } => {
                let audit = AuditRecord::new(
                    events::ROLL_STEP,
                    details(json!({
                        "action": "transfer",
                        "replicas_added": add,
                        "replicas_removed": remove,
                        "old_replicas": {"old": old.replicas_desired, "new": old_to},
                        "new_replicas": {"old": new.replicas_desired, "new": new.replicas_desired + add},
                        "counts": counts,
                        "minimum_replicas": u.minimum_replicas,
                    })),
                );
                guards.extend(checks);
                progress(&mut ops);
                ops.push(rewrite(&old, &[Mutation::SetReplicas(*old_to)], &audit)?);
                ops.push(rewrite(
                    &new,
                    &[Mutation::AddReplicas(*add as i64)],
                    &audit,
                )?);
                (vec![audit], false)
            }
            RollAction::RetireOld { old_to, charge } => {
                let audit = AuditRecord::new(
                    events::ROLL_STEP,
                    details(json!({
                        "action": "retire_old",
                        "old_replicas": {"old": old.replicas_desired, "new": old_to},
                        "counts": counts,
                        // The old RC's pods no new pod replaced: charged to this farm's
                        // removal budget here, not again by the old RC's task.
                        "lost_capacity": charge,
                        "reason": "the new RC is complete; the old RC removes the pods it did not hand over",
                    })),
                );
                guards.extend(checks);
                ops.push(rewrite(
                    &old,
                    &[Mutation::Retire {
                        roll: self.id,
                        replicas: *old_to,
                    }],
                    &audit,
                )?);
                (vec![audit], false)
            }
            RollAction::Complete => {
                let (labels, _) = LabelStore::new(self.ctx.consul.clone())
                    .get(LabelType::Rolls, &self.id.to_string())
                    .await
                    .map_err(|e| RollError::Other(e.to_string()))?;
                let mut completion =
                    completion_details(self.id, &labels, Some(new.pod_id()), true, false);
                completion.insert("farm_id".into(), json!(self.ctx.farm_id));
                completion.insert("old_rc_deleted".into(), json!(!u.leave_old));
                completion.insert("counts".into(), counts.clone());
                ops.push(TxnOp::delete_cas(roll_key(self.id), roll.modify_index));
                ops.push(LabelStore::delete_op(
                    LabelType::Rolls,
                    &self.id.to_string(),
                ));
                guards.extend(checks);
                ops.push(TxnOp::delete(u.new_rc.mutation_lock_key()));
                ops.push(TxnOp::delete(u.old_rc.mutation_lock_key()));
                let mut audits = vec![AuditRecord::new(
                    events::ROLL_COMPLETION,
                    Value::Object(completion),
                )];
                if !u.leave_old {
                    ops.push(TxnOp::delete_cas(old.id.key(), old.modify_index));
                    // The old RC's transfer status (P2's and rcfarm's) goes with it.
                    ops.push(TxnOp::delete_tree(old.id.status_prefix()));
                    ops.push(LabelStore::delete_op(
                        LabelType::ReplicationController,
                        &old.id.to_string(),
                    ));
                    audits.push(AuditRecord::new(
                        events::RC_DELETED,
                        json!({
                            "replication_controller_id": old.id,
                            "pod_id": old.pod_id(),
                            "actor": format!("rcfarm rolling update {} (farm {})", self.id, self.ctx.farm_id),
                            "replicas_desired": old.replicas_desired,
                            "forced": false,
                        }),
                    ));
                }
                ops.extend(self.history_ops(roll, o, &old).await?);
                ops.push(TxnOp::delete(control_key(self.id)));
                // Our own lock last: the farm sees the roll and its lock go together.
                ops.push(TxnOp::delete(roll_lock_key(self.id)));
                (audits, false)
            }
            RollAction::CanaryPause { up } => {
                // An unreadable control pauses the roll before it can plan this.
                let mut control = o.control.control.clone().unwrap_or_default();
                control.paused = true;
                control.paused_by = Some(CANARY_PAUSER.to_string());
                control.paused_at = Some(self.ctx.clock.wall());
                // Its promotion gives it another deadline.
                control.progress = None;
                ops.push(TxnOp::set(control_key(self.id), control.to_bytes()));
                let audit = AuditRecord::new(
                    events::ROLL_PAUSED,
                    details(json!({
                        "actor": CANARY_PAUSER,
                        "reason": format!("its {} canary pods are up; it waits to be promoted (rcctl roll promote {})", control.canary.unwrap_or_default(), self.id),
                        "canary": control.canary,
                        "canary_pods_up": up,
                        "counts": counts,
                    })),
                );
                (vec![audit], false)
            }
            // Invariant: returned above, before the RCs are needed.
            RollAction::DeleteOrphan => unreachable!("applied by delete_orphan"),
        };
        audits.extend(self.progress_record(roll));
        let txn = self.fence(roll, o).guards(guards).ops(ops);
        // A retirement charges the old RC's lost capacity to the cluster's removal window in
        // this same transaction: it commits if and only if it is charged.
        let charge = match &action {
            RollAction::RetireOld { charge, .. } => *charge,
            _ => 0,
        };
        let index = self.commit_charged(txn, audits, charge).await?;
        match &action {
            RollAction::Step {
                add,
                remove,
                old_to,
            } => {
                tracing::info!(
                    add,
                    remove,
                    old_to,
                    "moved replicas from the old RC to the new one"
                );
                metrics::counter!("rcfarm_roll_steps_total").increment(1);
                let since = self.last_step_at.unwrap_or(self.began);
                metrics::histogram!("rcfarm_roll_step_duration_seconds")
                    .record(since.elapsed().as_secs_f64());
                self.last_step_at = Some(self.ctx.clock.now());
                self.ready_since = None;
                self.ctx.status.update(self.id, &self.ctx.farm_id, |s| {
                    s.steps += 1;
                    s.last_step = Some(self.ctx.clock.wall());
                });
            }
            RollAction::Start { .. } => tracing::info!(
                "rolling update started: the old RC is disabled, the new one enabled"
            ),
            RollAction::Lock => tracing::debug!("took both RCs' mutation locks"),
            RollAction::CanaryPause { up } => {
                tracing::info!(up, "canary up: the roll pauses until promoted");
                metrics::counter!("rcfarm_roll_canary_pauses_total").increment(1);
                // Nothing the farm's views show changed; the next look reads the control.
                return Ok(());
            }
            RollAction::RetireOld { old_to, charge } => {
                tracing::info!(
                    old_to,
                    charge,
                    "the new RC is complete; the old RC removes its leftover pods"
                )
            }
            // Invariant: returned at the top of `apply`.
            RollAction::DeleteOrphan => unreachable!("applied by delete_orphan"),
            RollAction::Complete => {
                tracing::info!(old_deleted = !u.leave_old, "rolling update complete");
                metrics::counter!("rcfarm_roll_completions_total").increment(1);
                metrics::histogram!("rcfarm_roll_duration_seconds")
                    .record(self.began.elapsed().as_secs_f64());
                self.ctx.status.remove(self.id);
                let _ = self.events.send(RollEvent::Completed(self.id, index));
                return Ok(());
            }
        }
        self.await_views(index, wait_locks).await
    }

    /// The completion's history writes: the old RC becomes the newest revision of the new
    /// RC's lineage (see [`super::history`]), guarded by the versions read here.
    async fn history_ops(
        &self,
        roll: &Roll,
        o: &Observation,
        old: &Rc,
    ) -> Result<Vec<TxnOp>, RollError> {
        let u = &roll.update;
        let keys = [history_key(u.old_rc), history_key(u.new_rc)];
        let found = self.ctx.consul.read_keys(&keys).await?;
        let seen = |k: &str| {
            found.get(k).map(|kv| HistorySeen {
                history: History::parse(kv.value_bytes()),
                index: kv.modify_index,
            })
        };
        let (old_seen, new_seen) = (seen(&keys[0]), seen(&keys[1]));
        for (k, s) in keys.iter().zip([&old_seen, &new_seen]) {
            if let Some(HistorySeen {
                history: Err(e), ..
            }) = s
            {
                tracing::warn!(key = %k, error = %e, "a revision history cannot be read; it is replaced");
            }
        }
        let rev = Revision::of(
            old,
            u,
            o.control.control.as_ref().ok(),
            self.ctx.clock.wall(),
        );
        Ok(history::completion_ops(
            u.old_rc,
            u.new_rc,
            old_seen.as_ref(),
            new_seen.as_ref(),
            rev,
            self.ctx.config.revision_history,
        ))
    }

    /// What replaces a failed roll O → N by its revert N → O (nomad#14200: under the failed
    /// roll's minimum and pace): the failed roll's record, labels, control, its mutation locks
    /// and own lock go; `rolls/<O>` (P2's format: P2's tools read it), its labels and its
    /// control (same max-parallel and progress deadline, `revert_of`, never reverted itself)
    /// come, with P2's completion and creation records and `ROLLING_UPDATE_REVERTED`. The old
    /// RC still exists (disabled, with the pods it kept), so rolling onto it brings its
    /// manifest back; whichever farm serves the new roll claims it as any other.
    pub(super) fn revert_ops(
        &self,
        roll: &Roll,
        o: &Observation,
        failed: &RollControl,
        reason: &str,
    ) -> Result<(Vec<TxnOp>, Vec<AuditRecord>), RollError> {
        let u = &roll.update;
        let Some(old) = o.old.clone() else {
            return Err(RollError::Other("the old RC of the roll is missing".into()));
        };
        let revert = Update {
            old_rc: u.new_rc,
            new_rc: u.old_rc,
            desired_replicas: u.desired_replicas,
            minimum_replicas: u.minimum_replicas,
            // The failed RC goes at the end, as any replaced RC.
            leave_old: false,
            roll_delay: u.roll_delay,
        };
        revert.check_new().map_err(RollError::Other)?;
        let actor = format!(
            "rcfarm auto-revert of rolling update {} (farm {})",
            self.id, self.ctx.farm_id
        );
        // The way back gets at least the farm's own deadline (--roll-progress-deadline): the
        // failed roll's may be one chosen to give up on a new version fast, and the revert
        // goes back to pods that ran before. A revert that failed on a short deadline (a
        // partition delaying health by seconds, seen in the chaos with 3 s) stays Failed,
        // never reverted, with the service half rolled back.
        let farm_default = self.ctx.config.progress_deadline;
        let deadline = failed.progress_deadline_or(farm_default).max(farm_default);
        let control = RollControl {
            max_parallel: failed.max_parallel,
            progress_deadline: Some(crate::util::format_go_duration(deadline)),
            created_by: Some(actor.clone()),
            auto_revert: Some(false),
            revert_of: Some(self.id),
            ..Default::default()
        };
        // The revert takes the RCs' mutation locks again under its own name.
        let mut ops = self.removal_ops(roll);
        // The record (create-only), its labels and P2's creation record.
        ops.extend(creation_ops(&revert, &old, &LabelSet::new(), &actor));
        ops.push(TxnOp::set(control_key(revert.id()), control.to_bytes()));
        ops.push(TxnOp::delete(roll_lock_key(self.id)));
        let (labels, _) = &o.labels;
        let mut completion = completion_details(
            self.id,
            labels,
            o.new.as_ref().map(|rc| rc.pod_id()),
            false,
            false,
        );
        completion.insert("farm_id".into(), json!(self.ctx.farm_id));
        completion.insert("old_rc".into(), json!(u.old_rc));
        completion.insert("new_rc".into(), json!(u.new_rc));
        completion.insert(
            "reason".into(),
            json!(format!(
                "failed ({reason}); reverted by rolling update {}",
                revert.id()
            )),
        );
        let mut audits = vec![AuditRecord::new(
            events::ROLL_COMPLETION,
            Value::Object(completion),
        )];
        audits.push(AuditRecord::new(
            events::ROLL_REVERTED,
            json!({
                "failed_rolling_update_id": self.id,
                "rolling_update_id": revert.id(),
                "old_rc": revert.old_rc,
                "new_rc": revert.new_rc,
                "auto": true,
                "reason": reason,
                "desired_replicas": revert.desired_replicas,
                "minimum_replicas": revert.minimum_replicas,
                "max_parallel": control.max_parallel,
                "progress_deadline": control.progress_deadline,
                "pod_id": old.pod_id(),
                "actor": actor,
                "farm_id": self.ctx.farm_id,
            }),
        ));
        Ok((ops, audits))
    }

    /// Deletes a roll whose old RC does not exist, as P2's roll farm does (`validateRoll`, then
    /// `mustDeleteRU`): the record, its labels, the RCs' mutation locks this roll holds and its
    /// own lock, in one transaction fenced by the roll's lock, with a `ROLLING_UPDATE_COMPLETION`
    /// record (`succeeded` and `canceled`, P2's values for it, and why). The new RC is left as
    /// it is.
    async fn delete_orphan(&mut self, roll: &Roll, o: &Observation) -> Result<(), RollError> {
        let u = &roll.update;
        let (labels, _) = &o.labels;
        let mut details = completion_details(
            self.id,
            labels,
            o.new.as_ref().map(|rc| rc.pod_id()),
            true,
            true,
        );
        let reason = format!(
            "old RC {} does not exist: the roll is deleted and the new RC {} left as it is, as P2's roll farm does",
            u.old_rc, u.new_rc
        );
        details.insert("farm_id".into(), json!(self.ctx.farm_id));
        details.insert("old_rc".into(), json!(u.old_rc));
        details.insert("new_rc".into(), json!(u.new_rc));
        details.insert("reason".into(), json!(reason));
        let txn = self
            .fence(roll, o)
            .ops(self.removal_ops(roll))
            .op(TxnOp::delete(roll_lock_key(self.id)));
        let audits = vec![AuditRecord::new(
            events::ROLL_COMPLETION,
            Value::Object(details),
        )];
        let index = self.commit(txn, audits).await?;
        tracing::warn!(%reason, "rolling update deleted");
        self.ctx.status.remove(self.id);
        let _ = self.events.send(RollEvent::Completed(self.id, index));
        Ok(())
    }

    /// Removes the roll without completing it: its record (as planned against), labels and
    /// control, and the RCs' mutation locks this roll holds (each checked as ours). Its own
    /// lock is the caller's to delete, last.
    fn removal_ops(&self, roll: &Roll) -> Vec<TxnOp> {
        let u = &roll.update;
        let mut ops = vec![
            TxnOp::delete_cas(roll_key(self.id), roll.modify_index),
            LabelStore::delete_op(LabelType::Rolls, &self.id.to_string()),
            TxnOp::delete(control_key(self.id)),
        ];
        let holder = roll_holder(self.id);
        for id in [u.old_rc, u.new_rc] {
            let ours = self
                .ctx
                .locks
                .borrow()
                .mutation(id)
                .is_some_and(|(s, v)| **s == *self.session && **v == *holder);
            if ours {
                ops.push(TxnOp::check_session(id.mutation_lock_key(), &self.session));
                ops.push(TxnOp::delete(id.mutation_lock_key()));
            }
        }
        ops
    }

    /// Waits until the farm's views show our own write, so the next plan counts it.
    pub(super) async fn await_views(&self, index: u64, locks: bool) -> Result<(), RollError> {
        let mut rcs = self.ctx.rcs.clone();
        let mut lock_view = self.ctx.locks.clone();
        let wait = async {
            if locks {
                let _ = lock_view.wait_for(|v| v.index >= index).await;
            } else {
                let _ = rcs
                    .wait_for(|l| l.as_ref().is_some_and(|l| l.index >= index))
                    .await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .map_err(|_| {
                RollError::Other(
                    "the farm's view did not catch up with our own write within 10 s".into(),
                )
            })
    }

    /// Commits `txn` (from [`Worker::fence`] or [`Worker::held`]) with `audits`.
    pub(super) async fn commit(
        &self,
        txn: FencedTxn,
        audits: Vec<AuditRecord>,
    ) -> Result<u64, RollError> {
        self.commit_charged(txn, audits, 0).await
    }

    /// [`Worker::commit`] charged `charge` removals in the cluster's window, in the same
    /// transaction, at the moment it is sent (after the audit pacer's wait).
    pub(super) async fn commit_charged(
        &self,
        txn: FencedTxn,
        audits: Vec<AuditRecord>,
        charge: u64,
    ) -> Result<u64, RollError> {
        let txn = self.stamped(txn, audits);
        // Before the cancellation check: a roll handed over while it waited writes nothing.
        self.ctx.pace.admit().await;
        if self.inbox.cancel.is_cancelled() {
            return Err(RollError::Fenced);
        }
        let consul = &self.ctx.consul;
        let send = |t: FencedTxn| {
            let consul = consul.clone();
            async move { t.commit(&consul).await.map(|i| (i, i)) }
        };
        let r = self
            .ctx
            .failsafe
            .commit_charged(consul, charge, txn, send)
            .await;
        if let Err(crate::failsafe::ChargeError::Fence(FenceError::Fenced { .. })) = r {
            metrics::counter!("rcfarm_fenced_writes_total").increment(1);
        }
        Ok(r?)
    }

    /// `txn` with `audits` as its records, stamped now: every record a roll commits is
    /// stamped here.
    pub(super) fn stamped(&self, txn: FencedTxn, audits: Vec<AuditRecord>) -> FencedTxn {
        let now = self.ctx.clock.wall();
        txn.records(audits.into_iter().map(|a| a.at(now).txn_op()))
    }

    /// Commits `audit`, a report, under the roll's lock.
    pub(super) async fn report(&self, audit: AuditRecord) -> Result<u64, RollError> {
        self.commit(self.held(), vec![audit]).await
    }

    pub(super) async fn commit_txn(&self, txn: FencedTxn) -> Result<u64, FenceError> {
        // Before the cancellation check: a roll handed over while it waited writes nothing.
        self.ctx.pace.admit().await;
        if self.inbox.cancel.is_cancelled() {
            return Err(FenceError::Fenced {
                key: roll_lock_key(self.id),
            });
        }
        let r = txn.commit(&self.ctx.consul).await;
        if let Err(FenceError::Fenced { .. }) = r {
            metrics::counter!("rcfarm_fenced_writes_total").increment(1);
        }
        r
    }
}

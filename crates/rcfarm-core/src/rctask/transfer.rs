//! Node transfers: moving a pod off a node it should no longer be on, under the RC's mutation
//! lock, with its state in P2's status key so whichever farm serves the RC next resumes it.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use super::intents::IntentState;
use super::outcome::{Applied, GrantedRemovals, TaskError};
use super::plan::{Action, Observed, Transfer};
use super::transfers::status_key;
use super::worker::Worker;
use crate::audit::{AuditRecord, events};
use crate::consul::TxnOp;
use crate::rc::{Rc, RcStore};
use crate::scheduler::{NodeName, SchedulerError};

impl Worker {
    /// Learns the RC's transfer in flight from Consul, unless `transfer` already reflects it.
    /// It does not once a watch of this farm has seen the store go back since it was read: a
    /// store restored from a backup can hold a transfer this task saw end (its status key,
    /// its old pod and its new one back), which nobody else will end while this task serves
    /// the RC (the restore chaos: "a transfer is in flight" to the end, and the rolling update
    /// waiting on it with it).
    pub(super) async fn load_transfer(&mut self) -> Result<(), TaskError> {
        // Read before the listing is sent: a regression seen after it makes another read.
        let epoch = self.ctx.store_regressions.count();
        if self.transfer_loaded && self.transfer_epoch == epoch {
            return Ok(());
        }
        if self.transfer_epoch != epoch {
            // A listing sent before the watch saw the store go back may be the old store's.
            self.transfer_since = self.ctx.clock.now();
            self.transfer_epoch = epoch;
        }
        let (stored, stale_start) = self
            .ctx
            .transfers
            .transfer(self.id, self.transfer_since)
            .await?;
        if let Some(index) = stale_start {
            // Left by a farm of the previous release that ended a transfer this release
            // started (it deletes P2's key only): gone with the transfer it recorded.
            self.commit(
                vec![TxnOp::delete_cas(
                    super::transfers::rcfarm_status_key(self.id),
                    index,
                )],
                vec![],
            )
            .await?;
        }
        let recorded = stored.as_ref().is_some_and(|t| t.started_at.is_some());
        let stored = Transfer::resumed(stored, self.transfer.as_ref(), self.ctx.clock.wall());
        let same = |a: &Option<Transfer>, b: &Option<Transfer>| {
            a.as_ref().map(|t| &t.id) == b.as_ref().map(|t| &t.id)
        };
        if let Some(t) = &stored
            && !same(&self.transfer, &stored)
        {
            tracing::info!(old = %t.old_node, new = %t.new_node, "resuming a node transfer in flight");
            // Timed on this farm's monotonic clock from its recorded start: a wall-clock
            // step later moves nothing, and only the takeover itself reads the calendar.
            let ran = t
                .started_at
                .map(|at| self.ctx.clock.wall_since(at))
                .unwrap_or_default()
                .min(self.ctx.config.transfer_timeout);
            let now = self.ctx.clock.now();
            self.transfer_started = Some(now.checked_sub(ran).unwrap_or(now));
            if !recorded {
                // Started by P2 (no start recorded anywhere): record when this farm first saw
                // it, so a handover does not start its timeout again.
                self.commit(
                    vec![TxnOp::set(
                        super::transfers::rcfarm_status_key(self.id),
                        super::transfers::rcfarm_status(t),
                    )],
                    vec![],
                )
                .await?;
            }
        }
        if stored.is_none() {
            self.transfer_started = None;
        }
        self.transfer = stored;
        self.transfer_loaded = true;
        Ok(())
    }

    /// How long the transfer in flight has run (monotonic).
    pub(super) fn transfer_age(&self) -> Duration {
        self.transfer_started
            .map(|s| self.ctx.clock.now().saturating_duration_since(s))
            .unwrap_or_default()
    }

    pub(super) fn transfer_details(
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

    pub(super) async fn start_transfer(
        &mut self,
        rc: &Rc,
        o: &Observed<'_>,
        old: NodeName,
        new: Option<NodeName>,
    ) -> Result<Applied, TaskError> {
        // The mutation lock is ours (`apply` took it: a start is what waits for a lock).
        let store = RcStore::new(self.ctx.consul.clone());
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
                    let _ = store
                        .release_mutation(self.id, &self.session, &self.id.node_transfer_holder())
                        .await;
                    return Ok(Applied::AllocationExhausted);
                }
                Err(e) => return Err(e.into()),
            },
        };
        let t = Transfer {
            old_node: old.clone(),
            new_node: new.clone(),
            id: uuid::Uuid::new_v4().to_string(),
            started_at: Some(self.ctx.clock.wall()),
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
            TxnOp::set(
                super::transfers::rcfarm_status_key(self.id),
                super::transfers::rcfarm_status(&t),
            ),
        ];
        ops.extend(self.schedule_ops(rc, &new, o));
        let start = AuditRecord::new(
            events::NODE_TRANSFER_START,
            Value::Object(self.transfer_details(rc, &t, rc.replicas_desired)),
        );
        match self
            .commit_for(rc, ops, vec![start, self.retarget(rc, &nodes)])
            .await
        {
            Ok(_) => {
                tracing::info!(%old, %new, "node transfer started");
                self.ctx.intents.set(
                    &new,
                    rc.pod_id(),
                    IntentState::Digest(rc.manifest.digest().to_string()),
                );
                self.transfer = Some(t);
                self.transfer_started = Some(self.ctx.clock.now());
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
                let _ = store
                    .release_mutation(self.id, &self.session, &self.id.node_transfer_holder())
                    .await;
                if allocated {
                    self.deallocate(rc, std::slice::from_ref(&new)).await;
                }
                Err(e)
            }
        }
    }

    /// Takes the RC's mutation lock for what `action` starts, when it needs it
    /// ([`super::plan::needs_mutation_lock`]): `None` when the action may go ahead (the lock
    /// ours, or not needed), else what stops it now. The farm's view of the lock tree may lag:
    /// P2's node-transfer lock is read from Consul itself first (rcfarm does not take it, as
    /// P2's farm does not).
    pub(super) async fn lock_for(&self, action: &Action) -> Result<Option<Applied>, TaskError> {
        if !super::plan::needs_mutation_lock(action) {
            return Ok(None);
        }
        if let Some(holder) = self.node_transfer_holder().await? {
            return Ok(Some(Applied::Frozen(holder)));
        }
        if self.holds_mutation_lock() {
            return Ok(None);
        }
        let took = RcStore::new(self.ctx.consul.clone())
            .acquire_mutation(self.id, &self.session, &self.id.node_transfer_holder())
            .await?;
        Ok((!took).then_some(Applied::MutationLocked))
    }

    /// Who holds P2's node-transfer lock, read from Consul now.
    async fn node_transfer_holder(&self) -> Result<Option<String>, TaskError> {
        let (entry, _) = self
            .ctx
            .consul
            .kv_get(
                &self.id.node_transfer_lock_key(),
                &crate::consul::QueryOptions::default(),
            )
            .await?;
        Ok(entry
            .and_then(|e| e.session)
            .map(|s| format!("session {s}")))
    }

    /// Reports, once per hold, that P2's node-transfer lock freezes this RC's transfers, and
    /// once that the hold ended: log, audit record (named after the hold, so a farm that takes
    /// the RC over does not record it again). The condition is shown by `publish_status`.
    pub(super) async fn settle_frozen(&mut self, rc: &Rc) -> Result<(), TaskError> {
        let now = self.ctx.locks.borrow().node_transfer(self.id).cloned();
        if now == self.frozen {
            return Ok(());
        }
        let key = self.id.node_transfer_lock_key();
        let details = |(session, lock_index): &(Arc<str>, u64)| {
            json!({
                "replication_controller_id": self.id,
                "pod_id": rc.pod_id(),
                "farm_id": self.ctx.farm_id,
                "lock": key,
                "session": session,
                "lock_index": lock_index,
                "transfer_in_flight": self.transfer.as_ref().map(|t| json!({"old_node": t.old_node, "new_node": t.new_node})),
            })
        };
        if let Some(ended) = &self.frozen {
            tracing::info!(session = %ended.0, "node transfers unfrozen: the node-transfer lock was released");
            self.commit_report(AuditRecord::deterministic(
                &format!("{key}@{}:{}:unfrozen", ended.1, ended.0),
                events::NODE_TRANSFER_UNFROZEN,
                details(ended),
            ))
            .await?;
            self.frozen = None;
        }
        if let Some(held) = &now {
            tracing::warn!(session = %held.0, lock = %key, "node transfers frozen: another session holds the node-transfer lock");
            self.commit_report(AuditRecord::deterministic(
                &format!("{key}@{}:{}:frozen", held.1, held.0),
                events::NODE_TRANSFER_FROZEN,
                details(held),
            ))
            .await?;
        }
        self.frozen = now;
        Ok(())
    }

    /// Completes (`rollback: None`) or rolls back a transfer in one transaction, fenced by the
    /// RC's ownership lock and guarded by its version like every write of the task. It never
    /// takes the mutation lock: a transfer took it to start, and what is in flight ends
    /// without waiting for a lock it no longer holds (a rolling update that took it after a
    /// handover waits for this end; see docs/architecture.md, "Locks").
    pub(super) async fn finish_transfer(
        &mut self,
        rc: &Rc,
        o: &Observed<'_>,
        rollback: Option<String>,
        removals: &mut GrantedRemovals,
    ) -> Result<Applied, TaskError> {
        let Some(t) = self.transfer.clone() else {
            return Ok(Applied::Done);
        };
        let store = RcStore::new(self.ctx.consul.clone());
        let drop_node = if rollback.is_some() {
            &t.new_node
        } else {
            &t.old_node
        };
        let mut nodes: BTreeSet<NodeName> = o.current.keys().cloned().collect();
        let mut ops = vec![
            TxnOp::delete(status_key(self.id)),
            TxnOp::delete(super::transfers::rcfarm_status_key(self.id)),
        ];
        if let Some(pod) = o.current.get(drop_node) {
            ops.extend(self.unschedule_ops(rc, drop_node, pod, o));
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
        let charge = removals.charge(std::slice::from_ref(drop_node));
        self.commit_charged(
            rc,
            ops,
            vec![
                AuditRecord::new(event, Value::Object(details)),
                self.retarget(rc, &nodes),
            ],
            charge,
        )
        .await?;
        // P2 kept a histogram of transfer durations.
        metrics::histogram!(
            "rcfarm_transfer_duration_seconds",
            "outcome" => if rollback.is_some() { "rolled_back" } else { "completed" }
        )
        .record(self.transfer_age().as_secs_f64());
        match &rollback {
            Some(reason) => {
                tracing::warn!(old = %t.old_node, new = %t.new_node, %reason, "node transfer rolled back")
            }
            None => tracing::info!(old = %t.old_node, new = %t.new_node, "node transfer completed"),
        }
        self.ctx.intents.remove(drop_node, rc.pod_id());
        self.transfer = None;
        self.transfer_started = None;
        if self.holds_mutation_lock() {
            let _ = store
                .release_mutation(self.id, &self.session, &self.id.node_transfer_holder())
                .await;
        }
        self.deallocate(rc, std::slice::from_ref(drop_node)).await;
        Ok(Applied::Done)
    }

    /// Gives nodes back to the scheduler; failures are kept and retried on later passes.
    pub(super) async fn deallocate(&mut self, rc: &Rc, nodes: &[NodeName]) {
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

    pub(super) async fn retry_deallocations(&mut self, rc: &Rc) {
        if !self.pending_dealloc.is_empty() {
            let nodes: Vec<NodeName> = self.pending_dealloc.iter().cloned().collect();
            self.deallocate(rc, &nodes).await;
        }
    }
}

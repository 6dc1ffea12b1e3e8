//! Node transfers: moving a pod off a node it should no longer be on, under the RC's mutation
//! lock, with its state in P2's status key so whichever farm serves the RC next resumes it.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{Value, json};

use super::intents::IntentState;
use super::outcome::{Applied, TaskError};
use super::plan::{Observed, Transfer};
use super::transfers::status_key;
use super::worker::Worker;
use crate::audit::{AuditRecord, events};
use crate::consul::TxnOp;
use crate::rc::{Rc, RcStore};
use crate::scheduler::{NodeName, SchedulerError};

impl Worker {
    pub(super) async fn load_transfer(&mut self) -> Result<(), TaskError> {
        if self.transfer_loaded {
            return Ok(());
        }
        let stored = self
            .ctx
            .transfers
            .transfer(self.id, self.transfer_since)
            .await?;
        let stored = Transfer::resumed(stored, self.transfer.as_ref(), self.ctx.clock.wall());
        if let Some(t) = &stored
            && self.transfer.as_ref() != Some(t)
        {
            tracing::info!(old = %t.old_node, new = %t.new_node, "resuming a node transfer in flight");
        }
        self.transfer = stored;
        self.transfer_loaded = true;
        Ok(())
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
        // The farm's view of the lock tree may lag: read P2's node-transfer lock itself before
        // anything is allocated or written (rcfarm does not take it, as P2's farm does not).
        if let Some(holder) = self.node_transfer_holder().await? {
            return Ok(Applied::Frozen(holder));
        }
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
            .acquire_mutation(self.id, &self.session, &self.id.node_transfer_holder())
            .await?
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
            Ok(_) => {
                tracing::info!(%old, %new, "node transfer started");
                self.ctx.intents.set(
                    &new,
                    rc.pod_id(),
                    IntentState::Digest(rc.manifest.digest().to_string()),
                );
                self.transfer = Some(t);
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
        let details = |(session, lock_index): &(String, u64)| {
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

    /// Completes (`rollback: None`) or rolls back a transfer in one transaction.
    pub(super) async fn finish_transfer(
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
        if !self.holds_mutation_lock()
            && !store
                .acquire_mutation(self.id, &self.session, &self.id.node_transfer_holder())
                .await?
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
        self.commit_for(
            rc,
            ops,
            vec![
                AuditRecord::new(event, Value::Object(details)),
                self.retarget(rc, &nodes),
            ],
        )
        .await?;
        // P2 kept a histogram of transfer durations; a transfer P2 started without a start time
        // counts from when this task first read it.
        let took = t
            .started_at
            .and_then(|s| (self.ctx.clock.wall() - s).to_std().ok())
            .unwrap_or_default();
        metrics::histogram!(
            "rcfarm_transfer_duration_seconds",
            "outcome" => if rollback.is_some() { "rolled_back" } else { "completed" }
        )
        .record(took.as_secs_f64());
        match &rollback {
            Some(reason) => {
                tracing::warn!(old = %t.old_node, new = %t.new_node, %reason, "node transfer rolled back")
            }
            None => tracing::info!(old = %t.old_node, new = %t.new_node, "node transfer completed"),
        }
        self.ctx.intents.remove(drop_node, rc.pod_id());
        self.transfer = None;
        let _ = store
            .release_mutation(self.id, &self.session, &self.id.node_transfer_holder())
            .await;
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

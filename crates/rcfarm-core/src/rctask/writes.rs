//! The RC task's writes: every one a transaction fenced by the RC's ownership lock and
//! guarded by the RC record's index, carrying its audit record.

use std::collections::BTreeSet;

use serde_json::json;

use super::intents::{IntentState, intent_key};
use super::outcome::{Applied, GrantedRemovals, TaskError};
use super::plan::{Action, Observed};
use super::worker::Worker;
use crate::audit::{AuditRecord, events};
use crate::consul::{FenceError, FencedTxn, TxnBudget, TxnOp};
use crate::failsafe::ChargeError;
use crate::labels::{LabelSet, LabelStore, LabelType, pod_label_id};
use crate::rc::{POD_ID_LABEL, RC_ID_LABEL, Rc, RcStore};
use crate::scheduler::{NodeName, SchedulerError};

/// Room left in a transaction for the ownership check and audit records.
const TXN_OVERHEAD: usize = 4;

/// Body bytes kept free for the checks [`Worker::commit_for`] adds (two ops with a key and a
/// session or index each) beside the audit record, whose size is reckoned apart.
const CHECKS_BYTES: usize = 1024;

/// The ops that write a pod of `rc` on `node` (its intent, and its labels guarded by the
/// label as the plan saw it in `labels_seen`, by pod label id; create-only where it saw none).
/// The intent key is shared by every RC with this pod id, and the label says which RC the pod
/// is: a label that changed since the plan (another RC took the node, or the pod) fails the
/// whole write, intent included.
pub fn pod_write_ops(
    rc: &Rc,
    node: &str,
    labels_seen: &std::collections::BTreeMap<String, (LabelSet, u64)>,
) -> Vec<TxnOp> {
    let pod = rc.pod_id();
    let id = pod_label_id(node, pod);
    let (existing, index) = labels_seen.get(&id).cloned().unwrap_or_default();
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

impl Worker {
    /// Commits a write planned against `rc`: fenced by the ownership lock, and refused if the
    /// RC record changed since it was read (so nothing is ever scheduled for a stale replica
    /// count or selector).
    pub(super) async fn commit_for(
        &self,
        rc: &Rc,
        ops: Vec<TxnOp>,
        audits: Vec<AuditRecord>,
    ) -> Result<u64, TaskError> {
        self.commit_charged(rc, ops, audits, 0).await
    }

    /// [`Worker::commit_for`] of a write that removes `charge` counted pods: the charge is
    /// made in the cluster's removal window in the same transaction (see
    /// [`crate::failsafe::Failsafe::commit_charged`]); without room, [`TaskError::Held`].
    pub(super) async fn commit_charged(
        &self,
        rc: &Rc,
        ops: Vec<TxnOp>,
        audits: Vec<AuditRecord>,
        charge: u64,
    ) -> Result<u64, TaskError> {
        let txn = self
            .fenced()
            .guard(TxnOp::check_index(rc.id.key(), rc.modify_index))
            .ops(ops)
            .records(self.records(audits));
        match self.commit_txn(txn, charge).await {
            Err(ChargeError::Fence(FenceError::Stale { .. })) => {
                metrics::counter!("rcfarm_stale_plans_total").increment(1);
                Err(TaskError::Stale)
            }
            other => other.map_err(TaskError::from),
        }
    }

    /// Commits `ops` fenced by the ownership lock, with `audits`. Returns the commit index.
    pub(super) async fn commit(
        &self,
        ops: Vec<TxnOp>,
        audits: Vec<AuditRecord>,
    ) -> Result<u64, TaskError> {
        let txn = self.fenced().ops(ops).records(self.records(audits));
        Ok(self.commit_txn(txn, 0).await?)
    }

    /// The records' ops, each stamped now.
    fn records(&self, audits: Vec<AuditRecord>) -> impl Iterator<Item = TxnOp> {
        let now = self.ctx.clock.wall();
        audits.into_iter().map(move |a| a.at(now).txn_op())
    }

    /// A transaction fenced by this RC's ownership lock.
    fn fenced(&self) -> FencedTxn {
        FencedTxn::fenced(RcStore::ownership_fence(self.id, &self.session))
    }

    /// Commits `txn`, charged `charge` removals in the cluster's window. The charge is made
    /// after the audit pacer's wait, at the moment of sending: a write paced for minutes is
    /// charged in the window it lands in.
    async fn commit_txn(&self, txn: FencedTxn, charge: u64) -> Result<u64, ChargeError> {
        // Before the cancellation check: a task handed over while it waited writes nothing.
        self.ctx.pace.admit().await;
        if self.inbox.cancel.is_cancelled() {
            // Stopped (session lost or handed over): never write again.
            return Err(ChargeError::Fence(FenceError::Fenced {
                key: self.id.ownership_lock_key(),
            }));
        }
        // The pod label ops, kept for the cache, at their position among the writes.
        let pod_prefix = LabelType::Pod.prefix();
        let (label_at, label_ops): (Vec<usize>, Vec<TxnOp>) = txn
            .write_ops()
            .iter()
            .enumerate()
            .filter(|(_, op)| op.key.starts_with(&pod_prefix))
            .map(|(i, op)| (i, op.clone()))
            .unzip();
        let consul = &self.ctx.consul;
        let send = |t: FencedTxn| {
            let consul = consul.clone();
            async move {
                let c = t.commit_coalesced(&consul).await?;
                let index = c.index;
                Ok((c, index))
            }
        };
        match self
            .ctx
            .failsafe
            .commit_charged(consul, charge, txn, send)
            .await
        {
            Ok(committed) => {
                // The next plan counts what we wrote: the pod label tree is read on demand,
                // not after each of our writes.
                self.ctx.pods.apply_own(&committed, &label_ops);
                Ok(committed.index)
            }
            Err(ChargeError::Fence(e)) => {
                if matches!(e, FenceError::Fenced { .. }) {
                    metrics::counter!("rcfarm_fenced_writes_total").increment(1);
                    return Err(e.into());
                }
                // Someone else changed one of our pods' labels, or our write may have been
                // applied with its answer lost (and so not applied to the cache): the next
                // plan waits for the tree as it is now.
                let failed_labels: Vec<String> = match &e {
                    FenceError::Conflict { ops, .. } => ops
                        .iter()
                        .filter_map(|(i, _)| label_at.iter().position(|p| p == i))
                        .map(|j| label_ops[j].key.clone())
                        .collect(),
                    _ => Vec::new(),
                };
                let label_failed = !failed_labels.is_empty();
                // The store does not hold what the cache recorded for these labels: believe
                // the next read of the tree rather than our own earlier write.
                self.ctx.pods.forget_own(&failed_labels);
                if (label_failed || e.is_retryable())
                    && let Some(d) = self.ctx.pods.demand()
                {
                    let ticket = d.urge();
                    self.ctx.pod_tickets.lock().insert(self.id, ticket);
                }
                Err(e.into())
            }
            Err(e) => Err(e),
        }
    }

    /// Commits a report whose id is derived from what it reports ([`AuditRecord::deterministic`]):
    /// if the record exists already, an earlier owner of this RC (before a handover) made it.
    pub(super) async fn commit_report(&self, audit: AuditRecord) -> Result<(), TaskError> {
        match self
            .commit_txn(self.fenced().records(self.records(vec![audit])), 0)
            .await
        {
            Ok(_) | Err(ChargeError::Fence(FenceError::AlreadyRecorded)) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Writes a pod of `rc` on `node`, guarded by what the plan `o` saw ([`pod_write_ops`]):
    /// a refused write makes the task plan again from what is there now.
    pub(super) fn schedule_ops(&self, rc: &Rc, node: &str, o: &Observed<'_>) -> Vec<TxnOp> {
        pod_write_ops(rc, node, &o.labels_seen)
    }

    /// Removes the pod `pod` of `rc` from `node`: its intent, and its labels guarded by the
    /// label as the plan saw it (so a pod another RC took over since is left alone).
    pub(super) fn unschedule_ops(
        &self,
        rc: &Rc,
        node: &str,
        pod: &str,
        o: &Observed<'_>,
    ) -> Vec<TxnOp> {
        let id = pod_label_id(node, pod);
        let mut ops = vec![TxnOp::delete(intent_key(node, pod))];
        // A pod is the RC's because its label says so: the plan saw one (a pod without a label
        // is no pod of any RC's, and is not written here).
        if let Some((existing, index)) = o.labels_seen.get(&id) {
            let mut remove: Vec<String> = rc.pod_labels.keys().cloned().collect();
            remove.push(POD_ID_LABEL.to_string());
            remove.push(RC_ID_LABEL.to_string());
            ops.push(LabelStore::apply_op(
                LabelType::Pod,
                &id,
                existing,
                *index,
                &LabelSet::new(),
                &remove,
            ));
        }
        ops
    }

    /// P2's RETARGET record: the full node set after the change.
    pub(super) fn retarget(&self, rc: &Rc, nodes: &BTreeSet<NodeName>) -> AuditRecord {
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

    /// Applies `action`, each write charging the counted pods of `removals` it removes.
    pub(super) async fn apply(
        &mut self,
        rc: &Rc,
        o: &Observed<'_>,
        action: Action,
        removals: &mut GrantedRemovals,
    ) -> Result<Applied, TaskError> {
        if let Some(stopped) = self.lock_for(&action).await? {
            return Ok(stopped);
        }
        let mut nodes: BTreeSet<NodeName> = o.current.keys().cloned().collect();
        match action {
            Action::Schedule(targets) => self.write_pods(rc, o, &targets, false, removals).await,
            Action::Replace(targets) => self.write_pods(rc, o, &targets, false, removals).await,
            Action::Repair(targets) => self.write_pods(rc, o, &targets, true, removals).await,
            Action::Unschedule(targets) => {
                let per_node: Vec<Vec<TxnOp>> = targets
                    .iter()
                    .map(|node| {
                        let pod = o
                            .current
                            .get(node)
                            .map(String::as_str)
                            .unwrap_or(rc.pod_id());
                        self.unschedule_ops(rc, node, pod, o)
                    })
                    .collect();
                // The node set only shrinks: its record is biggest before the first batch.
                let budget =
                    self.budget(rc, &nodes, (crate::consul::MAX_TXN_OPS - TXN_OVERHEAD) / 2);
                for run in crate::consul::split_to_fit(&per_node, budget) {
                    let chunk = &targets[run.clone()];
                    let ops = per_node[run].concat();
                    for node in chunk {
                        nodes.remove(node);
                    }
                    let charge = removals.charge(chunk);
                    self.commit_charged(rc, ops, vec![self.retarget(rc, &nodes)], charge)
                        .await?;
                    for node in chunk {
                        self.ctx.intents.remove(node, rc.pod_id());
                    }
                    tracing::info!(nodes = ?chunk, "unscheduled");
                    metrics::counter!("rcfarm_pods_unscheduled_total")
                        .increment(chunk.len() as u64);
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
            Action::CompleteTransfer => self.finish_transfer(rc, o, None, removals).await,
            Action::RollbackTransfer(reason) => {
                self.finish_transfer(rc, o, Some(reason), removals).await
            }
        }
    }

    /// What one of this RC's pod writes may carry: `nodes_per_txn` nodes, and a body under
    /// Consul's limit with room for the checks and for a retarget record of `largest` (each
    /// manifest is written once per node: with big manifests, fewer nodes per transaction).
    fn budget(&self, rc: &Rc, largest: &BTreeSet<NodeName>, nodes_per_txn: usize) -> TxnBudget {
        let audit = self.retarget(rc, largest).txn_op().encoded_len();
        TxnBudget {
            groups: nodes_per_txn,
            ops: crate::consul::MAX_TXN_OPS - TXN_OVERHEAD,
            bytes: crate::consul::MAX_TXN_BYTES.saturating_sub(audit + CHECKS_BYTES),
        }
    }

    /// Writes intent and labels on `targets` (replacing pods of an older pod id in place). A
    /// repair changes no node set, so it is audited as a repair, not a retarget.
    pub(super) async fn write_pods(
        &mut self,
        rc: &Rc,
        o: &Observed<'_>,
        targets: &[NodeName],
        repair: bool,
        removals: &mut GrantedRemovals,
    ) -> Result<Applied, TaskError> {
        let mut nodes: BTreeSet<NodeName> = o.current.keys().cloned().collect();
        // Up to four ops per node (a replacement removes the old pod's intent and labels).
        let per_node: Vec<Vec<TxnOp>> = targets
            .iter()
            .map(|node| {
                let mut ops = Vec::new();
                if let Some(old_pod) = o.current.get(node).filter(|p| p.as_str() != rc.pod_id()) {
                    ops.extend(self.unschedule_ops(rc, node, old_pod, o));
                }
                ops.extend(self.schedule_ops(rc, node, o));
                ops
            })
            .collect();
        // The node set only grows: its record is biggest after the last batch.
        let after: BTreeSet<NodeName> = nodes.iter().chain(targets).cloned().collect();
        let budget = self.budget(rc, &after, (crate::consul::MAX_TXN_OPS - TXN_OVERHEAD) / 4);
        for run in crate::consul::split_to_fit(&per_node, budget) {
            let chunk = &targets[run.clone()];
            let ops = per_node[run].concat();
            nodes.extend(chunk.iter().cloned());
            let audit = if repair {
                AuditRecord::new(
                    events::RC_REPAIRED,
                    json!({
                        "replication_controller_id": self.id,
                        "pod_id": rc.pod_id(),
                        "farm_id": self.ctx.farm_id,
                        "nodes": chunk,
                        "reason": "intent missing or different from the manifest, or labels missing or changed",
                    }),
                )
            } else {
                self.retarget(rc, &nodes)
            };
            let charge = removals.charge(chunk);
            self.commit_charged(rc, ops, vec![audit], charge).await?;
            for node in chunk {
                self.ctx.intents.set(
                    node,
                    rc.pod_id(),
                    IntentState::Digest(rc.manifest.digest().to_string()),
                );
            }
            tracing::info!(nodes = ?chunk, repair, "scheduled");
            metrics::counter!("rcfarm_pods_scheduled_total").increment(chunk.len() as u64);
        }
        Ok(Applied::Done)
    }
}

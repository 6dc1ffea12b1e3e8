//! The pool scheduler: a pool of spare nodes (nodes whose labels match the pool selector, by
//! default `rcfarm.io/pool=spare`) that RCs with the dynamic strategy can be given.
//!
//! - A pool node is never eligible just because its labels match an RC's selector: it is
//!   eligible for an RC only through a reservation made by `allocate_nodes`. Nodes outside the
//!   pool are eligible as with the label scheduler.
//! - Reservations live in Consul, `scheduler/pool/reservations/<node>` = `{"slots": [...]}`,
//!   each slot naming the pod id and node selector it was allocated for. Every change is a CAS
//!   on the key's `ModifyIndex`, so farms racing for the same node never both get the slot.
//! - A node holds up to `capacity` slots, at most one per pod id.
//! - `deallocate_nodes` frees the slots on those nodes allocated under that selector whose pod
//!   is no longer scheduled there (checked against Consul, not a cache). A slot whose pod never
//!   appeared is reclaimed once it is older than `reservation_ttl` (its allocator died).

use crate::clock::Clock;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::{NodeName, Scheduler, SchedulerError};
use crate::consul::{Consul, QueryOptions, TreeCache, TxnFailure, TxnOp, WatchConfig};
use crate::labels::{LabelCache, LabelType, Selector, pod_label_id};
use crate::rc::Manifest;

pub const RESERVATIONS_PREFIX: &str = "scheduler/pool/reservations/";

#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Which nodes form the pool.
    pub pool_selector: Selector,
    /// Pods (of different RCs) a pool node can host.
    pub capacity: usize,
    /// A slot whose pod never got scheduled is free again after this long.
    pub reservation_ttl: Duration,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            pool_selector: Selector::from_equalities([("rcfarm.io/pool", "spare")]),
            capacity: 1,
            reservation_ttl: Duration::from_secs(600),
        }
    }
}

/// The reservations of one node.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeReservations {
    pub slots: Vec<Slot>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Slot {
    pub pod_id: String,
    pub node_selector: String,
    pub allocated_at: DateTime<Utc>,
}

pub struct PoolScheduler {
    consul: Consul,
    nodes: Arc<LabelCache>,
    pods: Arc<LabelCache>,
    reservations: TreeCache<NodeReservations>,
    config: PoolConfig,
    memo: super::label::SelectorMemo,
    /// Stamps reservations, and ages them (other farms read the stamps: wall time).
    clock: Clock,
}

impl PoolScheduler {
    /// `nodes` and `pods` are watched caches of `labels/node/` and `labels/pod/`; the scheduler
    /// adds one blocking query of its own, on the reservations.
    pub fn new(
        consul: &Consul,
        nodes: Arc<LabelCache>,
        pods: Arc<LabelCache>,
        config: PoolConfig,
        watch: WatchConfig,
    ) -> Self {
        let parse = Arc::new(|_: &str, v: &[u8]| -> Result<NodeReservations, String> {
            serde_json::from_slice(v).map_err(|e| format!("not a reservation record: {e}"))
        });
        let reservations = TreeCache::spawn(consul, RESERVATIONS_PREFIX, watch, parse);
        Self {
            consul: consul.clone(),
            nodes,
            pods,
            reservations,
            config,
            memo: Default::default(),
            clock: Clock::system(),
        }
    }

    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    pub async fn synced(&self) {
        self.reservations.synced().await;
        self.nodes.synced().await;
    }

    fn is_pool_node(&self, node: &str) -> bool {
        self.nodes
            .get(node)
            .is_some_and(|l| self.config.pool_selector.matches(&*l))
    }

    fn key(node: &str) -> String {
        format!("{RESERVATIONS_PREFIX}{node}")
    }

    /// Reads a node's reservations straight from Consul, with the index to CAS against.
    async fn read(&self, node: &str) -> Result<(NodeReservations, u64), SchedulerError> {
        let (e, _) = self
            .consul
            .kv_get(&Self::key(node), &QueryOptions::default())
            .await?;
        match e {
            None => Ok((NodeReservations::default(), 0)),
            Some(e) => {
                // A corrupt record is treated as full: better to skip the node than to
                // overwrite someone's reservation.
                let r = serde_json::from_slice(e.value_bytes()).map_err(|err| {
                    SchedulerError::Other(format!("{}: corrupt reservation record: {err}", e.key))
                })?;
                Ok((r, e.modify_index))
            }
        }
    }

    /// Writes a node's reservations if still at `index`; `Ok(None)` if someone got in first.
    async fn write(
        &self,
        node: &str,
        r: &NodeReservations,
        index: u64,
    ) -> Result<Option<u64>, SchedulerError> {
        // An emptied node keeps its key (`{"slots":[]}`): a write, unlike a delete, reports the
        // index the reservation cache must reach before callers see the change.
        let body = serde_json::to_vec(r).map_err(|e| SchedulerError::Other(e.to_string()))?;
        let op = TxnOp::cas(Self::key(node), body, index);
        match self.consul.txn(&[op]).await {
            Ok(resp) => Ok(Some(resp.results.first().map_or(index, |e| e.modify_index))),
            Err(e) if e.failed_at(0, TxnFailure::IndexStale) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Whether the pod a slot was made for is scheduled on the node. With `cached`, the cache
    /// may answer yes cheaply (keeping a slot a little longer is safe); a no is always
    /// confirmed with Consul, since freeing a slot in use would overbook the node. Deallocation
    /// asks Consul only: the pod it follows was unscheduled a moment ago.
    async fn pod_present(
        &self,
        node: &str,
        pod_id: &str,
        cached: bool,
    ) -> Result<bool, SchedulerError> {
        let id = pod_label_id(node, pod_id);
        if cached && self.pods.contains(&id) {
            return Ok(true);
        }
        let key = LabelType::Pod.key(&id);
        Ok(self
            .consul
            .kv_get(&key, &QueryOptions::default())
            .await?
            .0
            .is_some())
    }

    fn is_young(&self, s: &Slot) -> bool {
        let ttl = chrono::Duration::from_std(self.config.reservation_ttl)
            .unwrap_or(chrono::Duration::MAX);
        self.clock.wall() - s.allocated_at < ttl
    }

    /// Slots that still count: young enough that their pod may yet come, or in use.
    async fn live_slots(
        &self,
        node: &str,
        r: &NodeReservations,
    ) -> Result<Vec<Slot>, SchedulerError> {
        let mut live = Vec::new();
        for s in &r.slots {
            if self.is_young(s) || self.pod_present(node, &s.pod_id, true).await? {
                live.push(s.clone());
            }
        }
        Ok(live)
    }

    /// Per the cache, a node whose slots are all taken and none reclaimable: not worth a read.
    fn looks_full(&self, node: &str) -> bool {
        self.reservations.get(node).is_some_and(|r| {
            r.slots.len() >= self.config.capacity.max(1) && r.slots.iter().all(|s| self.is_young(s))
        })
    }

    /// Tries to reserve a slot on `node`; the new `ModifyIndex` if this call got it.
    async fn reserve(
        &self,
        node: &str,
        pod_id: &str,
        selector: &str,
    ) -> Result<Option<u64>, SchedulerError> {
        for _ in 0..5 {
            let (current, index) = self.read(node).await?;
            let mut live = self.live_slots(node, &current).await?;
            if live.len() >= self.config.capacity.max(1) || live.iter().any(|s| s.pod_id == pod_id)
            {
                return Ok(None);
            }
            live.push(Slot {
                pod_id: pod_id.to_string(),
                node_selector: selector.to_string(),
                allocated_at: self.clock.wall(),
            });
            if let Some(idx) = self
                .write(node, &NodeReservations { slots: live }, index)
                .await?
            {
                return Ok(Some(idx));
            }
        }
        Ok(None)
    }

    /// Nodes reserved for this pod id and selector.
    fn reserved_for(&self, pod_id: &str, selector: &str) -> Vec<NodeName> {
        self.reservations
            .all()
            .into_iter()
            .filter(|(_, r)| {
                r.slots
                    .iter()
                    .any(|s| s.pod_id == pod_id && s.node_selector == selector)
            })
            .map(|(node, _)| NodeName::from(node))
            .collect()
    }

    /// How many slots are taken on each node, per the cache (for spreading allocations).
    fn used(&self, node: &str) -> usize {
        self.reservations.get(node).map_or(0, |r| r.slots.len())
    }
}

#[async_trait]
impl Scheduler for PoolScheduler {
    async fn eligible_nodes(
        &self,
        manifest: &Manifest,
        selector: &Selector,
    ) -> Result<Vec<NodeName>, SchedulerError> {
        if !self.nodes.is_synced() || !self.reservations.is_synced() {
            return Err(SchedulerError::NotReady);
        }
        let mut out: BTreeSet<NodeName> = super::label::matching(&self.nodes, &self.memo, selector)
            .iter()
            .filter(|n| !self.is_pool_node(n))
            .cloned()
            .collect();
        let sel = selector.to_string();
        out.extend(
            self.reserved_for(manifest.pod_id(), &sel)
                .into_iter()
                .filter(|n| self.nodes.contains(n)),
        );
        Ok(out.into_iter().collect())
    }

    async fn allocate_nodes(
        &self,
        manifest: &Manifest,
        selector: &Selector,
        count: usize,
        force: bool,
    ) -> Result<Vec<NodeName>, SchedulerError> {
        if !self.nodes.is_synced() || !self.reservations.is_synced() {
            return Err(SchedulerError::NotReady);
        }
        let pool = super::label::matching(&self.nodes, &self.memo, &self.config.pool_selector);
        let matching: Vec<&NodeName> = pool
            .iter()
            .filter(|n| self.nodes.id_matches(n, selector))
            .collect();
        // Least-used first, then by name: spread RCs over the pool, deterministically.
        let mut ordered: Vec<&NodeName> = matching.clone();
        if force {
            // Forced: any pool node will do once the matching ones run out.
            ordered.extend(pool.iter().filter(|n| !matching.contains(n)));
        }
        ordered.sort_by_key(|n| (!matching.contains(n), self.used(n), (*n).clone()));
        let sel = selector.to_string();
        let already: BTreeSet<NodeName> = self
            .reserved_for(manifest.pod_id(), &sel)
            .into_iter()
            .collect();
        let mut got = Vec::new();
        let mut last_index = 0;
        for node in ordered {
            if got.len() >= count {
                break;
            }
            if already.contains(node) || self.looks_full(node) {
                continue;
            }
            if let Some(idx) = self.reserve(node, manifest.pod_id(), &sel).await? {
                last_index = last_index.max(idx);
                got.push(node.clone());
            }
        }
        if last_index > 0 {
            // Make the new reservations visible to the next `eligible_nodes` call.
            let _ = tokio::time::timeout(
                Duration::from_secs(5),
                self.reservations.wait_for_index(last_index),
            )
            .await;
        }
        tracing::info!(pod_id = manifest.pod_id(), selector = %sel, wanted = count, allocated = ?got, "pool allocation");
        Ok(got)
    }

    async fn deallocate_nodes(
        &self,
        selector: &Selector,
        nodes: &[NodeName],
    ) -> Result<(), SchedulerError> {
        let sel = selector.to_string();
        let mut last_index = 0;
        for node in nodes {
            for attempt in 0..5 {
                let (current, index) = self.read(node).await?;
                let mut keep = Vec::new();
                for s in &current.slots {
                    let ours = s.node_selector == sel;
                    if !ours || self.pod_present(node, &s.pod_id, false).await? {
                        keep.push(s.clone());
                    }
                }
                if keep.len() == current.slots.len() {
                    break;
                }
                if let Some(idx) = self
                    .write(node, &NodeReservations { slots: keep }, index)
                    .await?
                {
                    last_index = last_index.max(idx);
                    break;
                }
                if attempt == 4 {
                    return Err(SchedulerError::Other(format!(
                        "reservations of {node} kept changing; deallocation not done"
                    )));
                }
            }
        }
        if last_index > 0 {
            let _ = tokio::time::timeout(
                Duration::from_secs(5),
                self.reservations.wait_for_index(last_index),
            )
            .await;
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "pool"
    }
}

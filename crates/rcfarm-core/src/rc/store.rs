//! The RC store over `replication_controllers/<uuid>`: create, read, watch, mutate with CAS,
//! delete; and the ownership and mutation locks under `lock/replication_controllers/`.
//!
//! Every write is one transaction that also carries its audit record, so the record exists if
//! and only if the change does. Mutations read the record, change it, and write it back with a
//! CAS on its `ModifyIndex`, retrying a bounded number of times if another writer got in first.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::model::{
    AllocationStrategy, InvalidRc, RC_LOCK_PREFIX, RC_PREFIX, RawRc, Rc, RcId, RcProblem,
};
use crate::audit::{AuditRecord, events};
use crate::consul::{
    Consul, ConsulError, Fence, KvEntry, KvPair, QueryOptions, SessionId, TxnFailure, TxnOp,
    WatchConfig,
};
use crate::labels::{LabelSet, LabelStore, LabelType, LabelsError, Selector};

#[derive(Debug, thiserror::Error)]
pub enum RcStoreError {
    #[error(transparent)]
    Consul(#[from] ConsulError),
    #[error("replication controller {0} does not exist")]
    NotFound(RcId),
    #[error(transparent)]
    Invalid(#[from] InvalidRc),
    /// The change would make the RC invalid.
    #[error("refusing the change: {0}")]
    BadChange(RcProblem),
    #[error("{0}")]
    Refused(String),
    #[error(
        "replication controller {id} kept changing under us; gave up after {attempts} attempts"
    )]
    Contended { id: RcId, attempts: u32 },
    #[error(transparent)]
    Labels(#[from] LabelsError),
}

/// What to create.
#[derive(Debug, Clone)]
pub struct NewRc {
    pub manifest: String,
    pub node_selector: String,
    pub pod_labels: LabelSet,
    pub replicas_desired: u64,
    pub strategy: AllocationStrategy,
    /// The RC's own labels (matched by farms' `--rc-selector`).
    pub rc_labels: LabelSet,
    pub disabled: bool,
}

/// A change to an RC's desired state.
#[derive(Debug, Clone, PartialEq)]
pub enum Mutation {
    SetReplicas(u64),
    /// Adds (or with a negative count removes) replicas; never below 0.
    AddReplicas(i64),
    Enable,
    Disable,
    SetManifest(String),
    SetNodeSelector(String),
    SetPodLabels(LabelSet),
    SetStrategy(AllocationStrategy),
    /// A rolling update's retirement of its old RC: enabled at `replicas`, marked as retired by
    /// `roll` ([`super::RETIRE_MARKER`]).
    Retire {
        roll: RcId,
        replicas: u64,
    },
}

impl Mutation {
    fn apply(&self, raw: &mut RawRc) {
        // The retirement mark holds only for the record as the roll wrote it.
        raw.extra.remove(super::RETIRE_MARKER);
        match self {
            Mutation::Retire { roll, replicas } => {
                raw.replicas_desired = Some(*replicas as i64);
                raw.disabled = false;
                raw.extra.insert(
                    super::RETIRE_MARKER.to_string(),
                    json!({"roll": roll, "replicas": replicas}),
                );
            }
            Mutation::SetReplicas(n) => raw.replicas_desired = Some(*n as i64),
            Mutation::AddReplicas(d) => {
                let cur = raw.replicas_desired.unwrap_or(0).max(0);
                raw.replicas_desired = Some(cur.saturating_add(*d).max(0));
            }
            Mutation::Enable => raw.disabled = false,
            Mutation::Disable => raw.disabled = true,
            Mutation::SetManifest(m) => raw.manifest = Arc::from(m.as_str()),
            Mutation::SetNodeSelector(s) => raw.node_selector = s.clone(),
            Mutation::SetPodLabels(l) => raw.pod_labels = Some(l.clone()),
            Mutation::SetStrategy(s) => raw.allocation_strategy = s.as_str().to_string(),
        }
    }
}

/// The outcome of a write: the RC as written, the ops of the transaction, and whether it was
/// sent (not for a dry run).
#[derive(Debug, Clone)]
pub struct Written {
    pub rc: Option<Rc>,
    pub ops: Vec<TxnOp>,
    pub committed: bool,
}

/// Valid RCs and the invalid records beside them.
#[derive(Debug, Clone, Default)]
pub struct RcListing {
    pub index: u64,
    pub rcs: BTreeMap<RcId, Arc<Rc>>,
    pub invalid: BTreeMap<String, InvalidRc>,
}

/// One RC's record as a listing holds it.
#[derive(Debug, Clone, Copy)]
pub enum ListedRc<'a> {
    Valid(&'a Arc<Rc>),
    Invalid(&'a InvalidRc),
}

impl ListedRc<'_> {
    /// The record's `ModifyIndex`: what a task was last handed.
    pub fn modify_index(&self) -> u64 {
        match self {
            ListedRc::Valid(rc) => rc.modify_index,
            ListedRc::Invalid(inv) => inv.modify_index,
        }
    }
}

impl RcListing {
    /// RC `id`'s record, valid or not, if this listing holds a read of it (a farm's listing
    /// holds only the RCs it has a use for: `None` is not "deleted").
    pub fn record(&self, id: &RcId) -> Option<ListedRc<'_>> {
        match self.rcs.get(id) {
            Some(rc) => Some(ListedRc::Valid(rc)),
            None => self.invalid.get(&id.key()).map(ListedRc::Invalid),
        }
    }

    /// Pod ids that more than one valid RC carries (a rolling update's old and new RC), each
    /// with those RCs. Usually empty: a farm asks it whenever its claim inputs change and some
    /// RC is held elsewhere, where looking up the pod id of every RC another farm holds was a
    /// fifth of the work.
    pub fn shared_pod_ids(&self) -> BTreeMap<&str, Vec<RcId>> {
        let mut first: HashMap<&str, RcId> = HashMap::with_capacity(self.rcs.len());
        let mut shared: BTreeMap<&str, Vec<RcId>> = BTreeMap::new();
        for (id, rc) in &self.rcs {
            match first.entry(rc.pod_id()) {
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(*id);
                }
                std::collections::hash_map::Entry::Occupied(o) => shared
                    .entry(rc.pod_id())
                    .or_insert_with(|| vec![*o.get()])
                    .push(*id),
            }
        }
        shared
    }
}

/// A summary of a raw record's operator-facing fields, for audit diffs (the manifest by digest).
fn summary(raw: &RawRc) -> Value {
    json!({
        "manifest_sha256": hex::encode(Sha256::digest(raw.manifest.as_bytes())),
        "node_selector": raw.node_selector,
        "pod_labels": raw.pod_labels,
        "replicas_desired": raw.replicas_desired,
        "disabled": raw.disabled,
        "allocation_strategy": raw.allocation_strategy,
    })
}

fn diff(old: &Value, new: &Value) -> serde_json::Map<String, Value> {
    let mut out = serde_json::Map::new();
    if let (Value::Object(o), Value::Object(n)) = (old, new) {
        for (k, nv) in n {
            let ov = o.get(k).cloned().unwrap_or(Value::Null);
            if &ov != nv {
                out.insert(k.clone(), json!({"old": ov, "new": nv}));
            }
        }
    }
    out
}

/// A lock's holder: its session and the value it wrote. Both are shared with every other lock
/// of the same session and value in one view: a cluster's locks name a handful of sessions, and
/// a copy of each per RC cost every farm ~120-140 B per RC of the cluster (of the lock view's
/// ~500 B: ~25 MB at a million pods).
pub type Holder = (Arc<str>, Arc<str>);

/// Who holds an RC's locks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LockHolders {
    /// Session and value of the ownership lock, if held.
    pub ownership: Option<Holder>,
    pub mutation: Option<Holder>,
    /// The mutation lock key's `ModifyIndex` while the key exists (held or not): taking the
    /// lock only at that index (or only while absent) is how one session's two users of the
    /// lock (a node transfer, a rolling update) keep from taking it from each other.
    pub mutation_index: Option<u64>,
    /// Session and `LockIndex` of P2's node-transfer lock (`<id>/node_transfer`), if held:
    /// whoever holds it freezes the RC's node transfers.
    pub node_transfer: Option<(Arc<str>, u64)>,
}

/// The RC lock tree as a farm's tasks see it: who holds what, at which index.
#[derive(Debug, Clone, Default)]
pub struct LockView {
    pub index: u64,
    pub holders: BTreeMap<RcId, LockHolders>,
    /// Keys under the lock prefix that are not RC locks (reported, ignored).
    pub garbage: Vec<String>,
}

/// The RC lock tree, watched and parsed once per change: a farm keeps this one copy, not the
/// answer's entries beside it (20,000 RCs: ~7 MB of `KvPair`s per farm).
pub type LockWatch = crate::consul::DerivedWatch<LockView>;

impl LockView {
    pub fn parse<E: KvEntry>(index: u64, entries: impl IntoIterator<Item = E>) -> LockView {
        let (holders, garbage) = parse_locks(entries);
        LockView {
            index,
            holders,
            garbage,
        }
    }

    /// Session and value of an RC's mutation lock, if held.
    pub fn mutation(&self, id: RcId) -> Option<&Holder> {
        self.holders.get(&id).and_then(|h| h.mutation.as_ref())
    }

    /// Session and `LockIndex` of an RC's node-transfer lock, if held.
    pub fn node_transfer(&self, id: RcId) -> Option<&(Arc<str>, u64)> {
        self.holders.get(&id).and_then(|h| h.node_transfer.as_ref())
    }
}

/// Reads and writes RCs.
#[derive(Debug, Clone)]
pub struct RcStore {
    consul: Consul,
    retries: u32,
}

impl RcStore {
    pub fn new(consul: Consul) -> Self {
        Self {
            consul,
            retries: 10,
        }
    }

    /// Waits before retry `attempt` (0: no wait), jittered so racing writers spread out.
    async fn pause(attempt: u32) {
        if attempt > 0 {
            let step = std::time::Duration::from_millis(5 * (1 << attempt.min(6)));
            tokio::time::sleep(crate::util::jitter_half(step)).await;
        }
    }

    pub fn consul(&self) -> &Consul {
        &self.consul
    }

    /// Creates an RC, its labels and its audit record in one transaction.
    pub async fn create(
        &self,
        new: NewRc,
        actor: &str,
        dry_run: bool,
    ) -> Result<Written, RcStoreError> {
        crate::labels::validate_labels(&new.rc_labels)
            .map_err(|e| RcStoreError::Refused(format!("RC label: {e}")))?;
        let id = RcId::new();
        let raw = RawRc {
            id: id.to_string(),
            manifest: new.manifest.into(),
            node_selector: new.node_selector,
            pod_labels: Some(new.pod_labels),
            replicas_desired: Some(new.replicas_desired as i64),
            disabled: new.disabled,
            allocation_strategy: new.strategy.as_str().to_string(),
            extra: Default::default(),
        };
        let mut rc = Rc::from_raw(id, raw, 0).map_err(RcStoreError::BadChange)?;
        let mut rc_labels = new.rc_labels;
        rc_labels.insert(super::POD_ID_LABEL.to_string(), rc.pod_id().to_string());
        let audit = AuditRecord::new(
            events::RC_CREATED,
            json!({
                "replication_controller_id": id,
                "pod_id": rc.pod_id(),
                "actor": actor,
                "rc": summary(&rc.raw),
                "rc_labels": rc_labels,
            }),
        );
        rc.raw.extra.insert(
            super::CHANGE_MARKER.to_string(),
            json!(audit.id.to_string()),
        );
        let ops = vec![
            TxnOp::cas(id.key(), rc.raw.to_json(), 0),
            LabelStore::set_op(
                LabelType::ReplicationController,
                &id.to_string(),
                &rc_labels,
            ),
            audit.txn_op(),
        ];
        if dry_run {
            return Ok(Written {
                rc: Some(rc),
                ops,
                committed: false,
            });
        }
        let resp = self.consul.txn(&ops).await?;
        let mut rc = rc;
        rc.modify_index = resp.results.first().map_or(0, |r| r.modify_index);
        Ok(Written {
            rc: Some(rc),
            ops,
            committed: true,
        })
    }

    /// Reads one RC: `None` if absent, `Invalid` if it cannot be acted on.
    pub async fn get(&self, id: RcId) -> Result<Option<Rc>, RcStoreError> {
        let (entry, _) = self
            .consul
            .kv_get(&id.key(), &QueryOptions::default())
            .await?;
        match entry {
            None => Ok(None),
            Some(e) => Ok(Some(Rc::from_kv(&e.key, e.value_bytes(), e.modify_index)?)),
        }
    }

    /// Every RC; invalid records are listed apart, never failing the list.
    pub async fn list(&self) -> Result<RcListing, RcStoreError> {
        let (entries, meta) = self
            .consul
            .kv_list(RC_PREFIX, &QueryOptions::default())
            .await?;
        let mut listing = RcListing {
            index: meta.index,
            ..Default::default()
        };
        for e in entries {
            match Rc::from_kv(&e.key, e.value_bytes(), e.modify_index) {
                Ok(rc) => {
                    listing.rcs.insert(rc.id, Arc::new(rc));
                }
                Err(inv) => {
                    listing.invalid.insert(e.key.clone(), inv);
                }
            }
        }
        Ok(listing)
    }

    /// Watches the RC lock tree.
    pub fn watch_locks(&self, config: WatchConfig) -> LockWatch {
        LockWatch::spawn(&self.consul, RC_LOCK_PREFIX, config, |index, entries, _| {
            LockView::parse(index, entries.iter())
        })
    }

    /// Reads, changes and writes back an RC with a CAS, and its audit record, in one
    /// transaction; retried when another writer got in first.
    pub async fn mutate(
        &self,
        id: RcId,
        m: &Mutation,
        actor: &str,
        dry_run: bool,
    ) -> Result<Written, RcStoreError> {
        for attempt in 0..self.retries {
            Self::pause(attempt).await;
            let (entry, _) = self
                .consul
                .kv_get(&id.key(), &QueryOptions::default())
                .await?;
            let entry = entry.ok_or(RcStoreError::NotFound(id))?;
            let old = RawRc::from_json(entry.value_bytes()).map_err(|problem| {
                RcStoreError::Invalid(InvalidRc {
                    key: entry.key.clone(),
                    modify_index: entry.modify_index,
                    problem,
                })
            })?;
            let mut new = old.clone();
            m.apply(&mut new);
            let mut rc =
                Rc::from_raw(id, new, entry.modify_index).map_err(RcStoreError::BadChange)?;
            let changes = diff(&summary(&old), &summary(&rc.raw));
            let audit = AuditRecord::new(
                events::RC_MODIFIED,
                json!({
                    "replication_controller_id": id,
                    "pod_id": rc.pod_id(),
                    "actor": actor,
                    "changes": changes,
                }),
            );
            // The record names the audit record of its last change made through rcfarm.
            rc.raw.extra.insert(
                super::CHANGE_MARKER.to_string(),
                json!(audit.id.to_string()),
            );
            let mut ops = vec![TxnOp::cas(id.key(), rc.raw.to_json(), entry.modify_index)];
            // The RC's own `pod_id` label follows its manifest.
            let old_pod = super::Manifest::parse(&old.manifest)
                .ok()
                .map(|m| m.pod_id().to_string());
            if old_pod.as_deref() != Some(rc.pod_id()) {
                let store = LabelStore::new(self.consul.clone());
                let (labels, index) = store
                    .get(LabelType::ReplicationController, &id.to_string())
                    .await?;
                let set: LabelSet =
                    [(super::POD_ID_LABEL.to_string(), rc.pod_id().to_string())].into();
                ops.push(LabelStore::apply_op(
                    LabelType::ReplicationController,
                    &id.to_string(),
                    &labels,
                    index,
                    &set,
                    &[],
                ));
            }
            ops.push(audit.txn_op());
            if dry_run || changes.is_empty() {
                return Ok(Written {
                    rc: Some(rc),
                    ops,
                    committed: false,
                });
            }
            match self.consul.txn(&ops).await {
                Ok(resp) => {
                    let mut rc = rc;
                    rc.modify_index = resp.results.first().map_or(0, |r| r.modify_index);
                    return Ok(Written {
                        rc: Some(rc),
                        ops,
                        committed: true,
                    });
                }
                Err(e) if e.txn_failures().any(|(_, f)| f == TxnFailure::IndexStale) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(RcStoreError::Contended {
            id,
            attempts: self.retries,
        })
    }

    /// The op that rewrites `rc` with `mutations` applied, CAS on the version read, for a
    /// transaction of someone else's (a rolling update's step). `change_id` names the audit
    /// record of the transaction, so the owning farm knows the change is recorded already.
    pub fn rewrite_op(
        rc: &Rc,
        mutations: &[Mutation],
        change_id: &str,
    ) -> Result<TxnOp, RcStoreError> {
        let mut raw = rc.raw.clone();
        for m in mutations {
            m.apply(&mut raw);
        }
        raw.extra
            .insert(super::CHANGE_MARKER.to_string(), json!(change_id));
        let new = Rc::from_raw(rc.id, raw, rc.modify_index).map_err(RcStoreError::BadChange)?;
        Ok(TxnOp::cas(rc.id.key(), new.raw.to_json(), rc.modify_index))
    }

    /// The nodes where a pod of RC `id` runs (its label names the RC), for pods of `pod_id`
    /// (every pod id when `None`: the record cannot be read).
    pub async fn pod_nodes(
        &self,
        id: RcId,
        pod_id: Option<&str>,
    ) -> Result<Vec<String>, RcStoreError> {
        let prefix = LabelType::Pod.prefix();
        let (keys, _) = self
            .consul
            .kv_keys(&prefix, None, &QueryOptions::default())
            .await?;
        let candidates: Vec<String> = keys
            .into_iter()
            .filter(|k| {
                k.strip_prefix(&prefix)
                    .and_then(crate::labels::split_pod_label_id)
                    .is_some_and(|(_, p)| pod_id.is_none_or(|want| p == want))
            })
            .collect();
        let me = id.to_string();
        let found = self.consul.read_keys(&candidates).await?;
        let mut nodes: Vec<String> = found
            .values()
            .filter(|kv| {
                crate::labels::parse_labels(kv.value_bytes())
                    .ok()
                    .and_then(|l| l.get(super::RC_ID_LABEL).cloned())
                    .is_some_and(|rc| rc == me)
            })
            .filter_map(|kv| {
                kv.key
                    .strip_prefix(&prefix)
                    .and_then(crate::labels::split_pod_label_id)
                    .map(|(n, _)| n.to_string())
            })
            .collect();
        nodes.sort();
        Ok(nodes)
    }

    /// Deletes an RC and its labels, and returns with the write the nodes where its pods are
    /// left running (only with `force`). Refused while it still wants replicas or still has
    /// pods, unless forced: deleting an RC never unschedules its pods, so an operator scales
    /// it to 0 and waits for its pods to go first (a pod left behind is managed by nothing).
    pub async fn delete(
        &self,
        id: RcId,
        force: bool,
        actor: &str,
        dry_run: bool,
    ) -> Result<(Written, Vec<String>), RcStoreError> {
        for attempt in 0..self.retries {
            Self::pause(attempt).await;
            let (entry, _) = self
                .consul
                .kv_get(&id.key(), &QueryOptions::default())
                .await?;
            let entry = entry.ok_or(RcStoreError::NotFound(id))?;
            let raw = RawRc::from_json(entry.value_bytes()).ok();
            let replicas = raw.as_ref().and_then(|r| r.replicas_desired);
            let pod_id = raw
                .as_ref()
                .and_then(|r| super::Manifest::parse(&r.manifest).ok())
                .map(|m| m.pod_id().to_string());
            // Counted after the record was read: the delete is guarded by that version, so a
            // scale-up meanwhile fails it and it is counted again.
            let left = self.pod_nodes(id, pod_id.as_deref()).await?;
            if !force && (replicas != Some(0) || !left.is_empty()) {
                let why = match replicas {
                    Some(0) => format!(
                        "it still has {} pod{} (on {}): its replicas are 0, but they are not all removed yet",
                        left.len(),
                        if left.len() == 1 { "" } else { "s" },
                        left.join(", ")
                    ),
                    Some(n) => format!("it has {n} desired replicas"),
                    None => {
                        "its record cannot be read, so its replica count is unknown".to_string()
                    }
                };
                return Err(RcStoreError::Refused(format!(
                    "not deleting replication controller {id}: {why}. Scale it to 0 and wait for its pods to go (rcctl rc scale {id} 0 --wait), then delete it; or pass --force to delete it now and leave its pods running, managed by nothing"
                )));
            }
            let audit = AuditRecord::new(
                events::RC_DELETED,
                json!({
                    "replication_controller_id": id,
                    "pod_id": pod_id,
                    "actor": actor,
                    "replicas_desired": replicas,
                    "forced": force,
                    "pods_left": left,
                }),
            );
            let ops = vec![
                TxnOp::delete_cas(id.key(), entry.modify_index),
                LabelStore::delete_op(LabelType::ReplicationController, &id.to_string()),
                // Its node transfer's status, P2's and rcfarm's, goes with it.
                TxnOp::delete_tree(id.status_prefix()),
                audit.txn_op(),
            ];
            if dry_run {
                return Ok((
                    Written {
                        rc: None,
                        ops,
                        committed: false,
                    },
                    left,
                ));
            }
            match self.consul.txn(&ops).await {
                Ok(_) => {
                    return Ok((
                        Written {
                            rc: None,
                            ops,
                            committed: true,
                        },
                        left,
                    ));
                }
                Err(e) if e.failed_at(0, TxnFailure::IndexStale) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(RcStoreError::Contended {
            id,
            attempts: self.retries,
        })
    }

    // ---- locks ------------------------------------------------------------------------------

    /// Takes the ownership lock with `session`; the value names the holder. `false` if another
    /// session holds it (or it is in a lock-delay).
    pub async fn acquire_ownership(
        &self,
        id: RcId,
        session: &str,
        holder: &str,
    ) -> Result<bool, RcStoreError> {
        Ok(self
            .consul
            .kv_acquire(&id.ownership_lock_key(), holder.as_bytes(), session, None)
            .await?)
    }

    /// Gives the ownership lock up by deleting its key, only if `session` holds it (as P2's
    /// unlock does). No lock-delay applies, so another farm can take it at once.
    pub async fn release_ownership(&self, id: RcId, session: &str) -> Result<bool, RcStoreError> {
        self.release(&id.ownership_lock_key(), session).await
    }

    /// Takes the mutation lock for `holder` (node transfers; rolling updates hold it too),
    /// unless someone else has it: another session, or this same session for another holder
    /// (a farm's node transfer and its rolling update share the farm's session). `true` if
    /// `holder` holds it now.
    pub async fn acquire_mutation(
        &self,
        id: RcId,
        session: &str,
        holder: &str,
    ) -> Result<bool, RcStoreError> {
        let key = id.mutation_lock_key();
        let (entry, _) = self.consul.kv_get(&key, &QueryOptions::default()).await?;
        let seen = match &entry {
            Some(e) if e.session.is_some() => {
                return Ok(
                    e.session.as_deref() == Some(session) && e.value_bytes() == holder.as_bytes()
                );
            }
            Some(e) => Some(e.modify_index),
            None => None,
        };
        match self
            .consul
            .txn(&Self::mutation_lock_ops(id, session, holder, seen))
            .await
        {
            Ok(_) => Ok(true),
            Err(ConsulError::Conflict(_)) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Transaction ops that take the mutation lock for `holder` only if the key is as last
    /// seen: free at index `seen`, or absent (`None`). A plain lock op would succeed over the
    /// same session's other holder.
    pub fn mutation_lock_ops(
        id: RcId,
        session: &str,
        holder: &str,
        seen: Option<u64>,
    ) -> Vec<TxnOp> {
        let key = id.mutation_lock_key();
        let guard = match seen {
            Some(index) => TxnOp::check_index(key.clone(), index),
            // Create-only: fails if the key appeared meanwhile.
            None => TxnOp::cas(key.clone(), holder.as_bytes().to_vec(), 0),
        };
        vec![guard, TxnOp::lock(key, holder.as_bytes().to_vec(), session)]
    }

    /// Gives the mutation lock up if `session` holds it for `holder` (and not for another of
    /// its users). `true` if it was released.
    pub async fn release_mutation(
        &self,
        id: RcId,
        session: &str,
        holder: &str,
    ) -> Result<bool, RcStoreError> {
        let key = id.mutation_lock_key();
        let (entry, _) = self.consul.kv_get(&key, &QueryOptions::default()).await?;
        match entry {
            Some(e) => self.release_held_mutation(&e, session, holder).await,
            None => Ok(false),
        }
    }

    /// Deletes the mutation lock entry `e` (as read) if `session` holds it for `holder`,
    /// fenced by the session and the index read. `true` if it was released.
    async fn release_held_mutation(
        &self,
        e: &KvPair,
        session: &str,
        holder: &str,
    ) -> Result<bool, RcStoreError> {
        if e.session.as_deref() != Some(session) || e.value_bytes() != holder.as_bytes() {
            return Ok(false);
        }
        match self
            .consul
            .txn(&[
                TxnOp::check_session(e.key.clone(), session),
                TxnOp::check_index(e.key.clone(), e.modify_index),
                TxnOp::delete(e.key.clone()),
            ])
            .await
        {
            Ok(_) => Ok(true),
            Err(ConsulError::Conflict(_)) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Gives up every node-transfer mutation lock `session` holds among `ids`, reading the lock
    /// tree once: a farm handing 7,000 RCs over asked for each lock with a GET of its own
    /// (seconds of a shutdown) although only RCs with a transfer in flight hold one. The number
    /// released.
    pub async fn release_transfer_mutations(
        &self,
        ids: &[RcId],
        session: &str,
    ) -> Result<usize, RcStoreError> {
        if ids.is_empty() {
            return Ok(0);
        }
        let (entries, _) = self
            .consul
            .kv_list(RC_LOCK_PREFIX, &QueryOptions::default())
            .await?;
        let wanted: std::collections::HashMap<String, RcId> =
            ids.iter().map(|id| (id.mutation_lock_key(), *id)).collect();
        let mut released = 0;
        for e in entries {
            if let Some(id) = wanted.get(&e.key)
                && self
                    .release_held_mutation(&e, session, &id.node_transfer_holder())
                    .await?
            {
                released += 1;
            }
        }
        Ok(released)
    }

    async fn release(&self, key: &str, session: &str) -> Result<bool, RcStoreError> {
        Ok(self.consul.release_lock(key, session).await?)
    }

    /// The fence of every RC task write: the RC's ownership lock, held by `session`.
    pub fn ownership_fence(id: RcId, session: &SessionId) -> Fence {
        Fence::new(id.ownership_lock_key(), session)
    }

    /// Who holds which lock, for every RC with a lock key.
    pub async fn lock_holders(
        &self,
    ) -> Result<(BTreeMap<RcId, LockHolders>, Vec<String>), RcStoreError> {
        let (entries, _) = self
            .consul
            .kv_list(RC_LOCK_PREFIX, &QueryOptions::default())
            .await?;
        Ok(parse_locks(&entries))
    }
}

/// Parses the lock tree: holders per RC, and the keys that are not RC locks (reported, ignored).
pub fn parse_locks<E: KvEntry>(
    entries: impl IntoIterator<Item = E>,
) -> (BTreeMap<RcId, LockHolders>, Vec<String>) {
    let entries = entries.into_iter();
    // Gathered in a list and built in one go: a map filled one insert at a time in key order
    // leaves its nodes half empty (12.7 MB for 20,000 RCs' locks, against ~3 MB built whole),
    // and every farm keeps this map for the whole cluster.
    let mut out: Vec<(RcId, LockHolders)> = Vec::with_capacity(entries.size_hint().0);
    let mut garbage = Vec::new();
    let mut shared: std::collections::HashSet<Arc<str>> = std::collections::HashSet::new();
    let mut share = |s: &str| -> Arc<str> {
        if let Some(a) = shared.get(s) {
            return a.clone();
        }
        let a: Arc<str> = Arc::from(s);
        shared.insert(a.clone());
        a
    };
    for e in entries {
        let key = e.key();
        let Some(rest) = key.strip_prefix(RC_LOCK_PREFIX) else {
            garbage.push(key.to_string());
            continue;
        };
        let (id_text, suffix) = match rest.split_once('/') {
            Some((id, s)) => (id, Some(s)),
            None => (rest, None),
        };
        let Ok(id) = RcId::parse(id_text) else {
            garbage.push(key.to_string());
            continue;
        };
        let holder = e
            .session()
            .map(|s| (share(s), share(&String::from_utf8_lossy(&e.value()))));
        // What this key says; an RC's keys are merged below.
        let mut entry = LockHolders::default();
        match suffix {
            None => entry.ownership = holder,
            Some("update") => {
                entry.mutation = holder;
                entry.mutation_index = Some(e.modify_index());
            }
            Some("node_transfer") => {
                entry.node_transfer = e.session().map(|s| (share(s), e.lock_index()));
            }
            // P2's lock held while a rolling update is created: not ours to interpret.
            Some("update_creation") => {}
            Some(_) => garbage.push(key.to_string()),
        }
        out.push((id, entry));
    }
    // Sorted (Consul lists keys in order already), an RC's keys are neighbours.
    out.sort_by_key(|(id, _)| *id);
    let mut merged: Vec<(RcId, LockHolders)> = Vec::with_capacity(out.len());
    for (id, h) in out {
        match merged.last_mut() {
            Some((last, m)) if *last == id => {
                if h.ownership.is_some() {
                    m.ownership = h.ownership;
                }
                if h.mutation_index.is_some() {
                    m.mutation = h.mutation;
                    m.mutation_index = h.mutation_index;
                }
                if h.node_transfer.is_some() {
                    m.node_transfer = h.node_transfer;
                }
            }
            _ => merged.push((id, h)),
        }
    }
    (merged.into_iter().collect(), garbage)
}

/// Parses a snapshot of the RC tree, reusing the previous listing's parse of unchanged keys.
pub fn parse_listing<E: KvEntry>(
    index: u64,
    entries: impl IntoIterator<Item = E>,
    prev: Option<&RcListing>,
) -> RcListing {
    let mut listing = RcListing {
        index,
        ..Default::default()
    };
    // Equal node selectors are one parse: RCs mostly share a few (every farm lists every RC).
    let mut selectors: HashMap<String, Arc<Selector>> = HashMap::new();
    for rc in prev.iter().flat_map(|p| p.rcs.values()) {
        if !selectors.contains_key(&rc.raw.node_selector) {
            selectors.insert(rc.raw.node_selector.clone(), rc.node_selector.clone());
        }
    }
    // Gathered and built in one go, not one insert at a time in key order (see `parse_locks`).
    let entries = entries.into_iter();
    let mut rcs: Vec<(RcId, Arc<Rc>)> = Vec::with_capacity(entries.size_hint().0);
    for e in entries {
        let (key, modify_index) = (e.key(), e.modify_index());
        if let Some(prev) = prev {
            if let Some(Ok(id)) = RcId::from_key(key)
                && let Some(rc) = prev.rcs.get(&id)
                && rc.modify_index == modify_index
            {
                rcs.push((id, rc.clone()));
                continue;
            }
            if let Some(inv) = prev.invalid.get(key)
                && inv.modify_index == modify_index
            {
                listing.invalid.insert(key.to_string(), inv.clone());
                continue;
            }
        }
        match Rc::from_kv(key, &e.value(), modify_index) {
            Ok(mut rc) => {
                match selectors.get(&rc.raw.node_selector) {
                    Some(shared) => rc.node_selector = shared.clone(),
                    None => {
                        selectors.insert(rc.raw.node_selector.clone(), rc.node_selector.clone());
                    }
                }
                rcs.push((rc.id, Arc::new(rc)));
            }
            Err(inv) => {
                listing.invalid.insert(key.to_string(), inv);
            }
        }
    }
    listing.rcs = rcs.into_iter().collect();
    listing
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_keys_parse_and_garbage_is_set_aside() {
        let id = RcId::new();
        let kv = |key: String, session: Option<&str>| KvPair {
            key,
            session: session.map(str::to_string),
            value: Some(b"farm-a".to_vec()),
            ..Default::default()
        };
        let entries = vec![
            kv(id.ownership_lock_key(), Some("s1")),
            kv(id.mutation_lock_key(), Some("s2")),
            kv(format!("{RC_LOCK_PREFIX}{id}/update_creation"), Some("s3")),
            KvPair {
                lock_index: 4,
                ..kv(id.node_transfer_lock_key(), Some("s5"))
            },
            kv(format!("{RC_LOCK_PREFIX}not-a-uuid"), Some("s4")),
            kv(format!("{RC_LOCK_PREFIX}{id}/weird"), None),
        ];
        let (holders, garbage) = parse_locks(&entries);
        let h = &holders[&id];
        assert_eq!(h.ownership, Some(("s1".into(), "farm-a".into())));
        assert_eq!(h.mutation, Some(("s2".into(), "farm-a".into())));
        assert_eq!(h.node_transfer, Some(("s5".into(), 4)));
        assert_eq!(garbage.len(), 2);
        // A released node-transfer lock (the key stays, without a session) freezes nothing.
        let (holders, _) = parse_locks(&[kv(id.node_transfer_lock_key(), None)]);
        assert_eq!(holders[&id].node_transfer, None);
    }

    #[test]
    fn an_rcs_locks_are_merged_whatever_their_order() {
        let (a, b) = (RcId::new(), RcId::new());
        let kv = |key: String, session: &str, index: u64| KvPair {
            key,
            session: Some(session.to_string()),
            value: Some(b"v".to_vec()),
            modify_index: index,
            ..Default::default()
        };
        // Not in key order, and each RC's two locks apart.
        let entries = vec![
            kv(b.mutation_lock_key(), "sb-m", 7),
            kv(a.ownership_lock_key(), "sa", 1),
            kv(b.ownership_lock_key(), "sb", 2),
            kv(a.mutation_lock_key(), "sa-m", 9),
        ];
        let (holders, garbage) = parse_locks(&entries);
        assert!(garbage.is_empty());
        assert_eq!(holders.len(), 2);
        for (id, own, m, idx) in [(a, "sa", "sa-m", 9), (b, "sb", "sb-m", 7)] {
            let h = &holders[&id];
            assert_eq!(h.ownership, Some((own.into(), "v".into())));
            assert_eq!(h.mutation, Some((m.into(), "v".into())));
            assert_eq!(h.mutation_index, Some(idx));
        }
    }

    #[test]
    fn a_listing_holds_equal_node_selectors_once() {
        let record = |id: RcId, i: usize, sel: &str, index: u64| KvPair {
            key: id.key(),
            value: Some(
                json!({"id": id.to_string(), "manifest": format!("id: p{i}\nlaunchables: {{}}\n"),
                    "node_selector": sel, "replicas_desired": 1})
                .to_string()
                .into_bytes(),
            ),
            modify_index: index,
            ..Default::default()
        };
        let ids: Vec<RcId> = (0..4).map(|_| RcId::new()).collect();
        let first = vec![
            record(ids[0], 0, "env=prod", 1),
            record(ids[1], 1, "env=prod", 2),
            record(ids[2], 2, "env=dev", 3),
        ];
        let l1 = parse_listing(3, &first, None);
        let sel = |l: &RcListing, i: usize| l.rcs[&ids[i]].node_selector.clone();
        assert!(Arc::ptr_eq(&sel(&l1, 0), &sel(&l1, 1)));
        assert!(!Arc::ptr_eq(&sel(&l1, 0), &sel(&l1, 2)));
        assert_eq!(sel(&l1, 2).to_string(), "env=dev");
        // A later answer's new RC shares the selector parsed in an earlier one.
        let mut second = first.clone();
        second.push(record(ids[3], 3, "env=dev", 4));
        let l2 = parse_listing(4, &second, Some(&l1));
        assert!(Arc::ptr_eq(&sel(&l2, 3), &sel(&l1, 2)));
    }

    /// Only pod ids more than one valid RC carries, each with every RC that carries it.
    #[test]
    fn shared_pod_ids_are_those_of_several_rcs() {
        let record = |id: RcId, pod: &str| KvPair {
            key: id.key(),
            value: Some(
                json!({"id": id.to_string(), "manifest": format!("id: {pod}\nlaunchables: {{}}\n"),
                    "node_selector": "", "replicas_desired": 1})
                .to_string()
                .into_bytes(),
            ),
            modify_index: 1,
            ..Default::default()
        };
        let ids: Vec<RcId> = (0..5).map(|_| RcId::new()).collect();
        let mut entries = vec![
            record(ids[0], "web"),
            record(ids[1], "db"),
            record(ids[2], "web"),
            record(ids[3], "web"),
            record(ids[4], "cache"),
        ];
        // Invalid (no replicas): not in the listing's RCs, so it shares nothing.
        entries.push(KvPair {
            value: Some(
                json!({"id": ids[4].to_string(), "manifest": "id: db\nlaunchables: {}\n"})
                    .to_string()
                    .into_bytes(),
            ),
            key: RcId::new().key(),
            ..entries[1].clone()
        });
        let listing = parse_listing(1, &entries, None);
        let shared = listing.shared_pod_ids();
        assert_eq!(shared.keys().copied().collect::<Vec<_>>(), vec!["web"]);
        let mut web = shared["web"].clone();
        web.sort();
        let mut want = vec![ids[0], ids[2], ids[3]];
        want.sort();
        assert_eq!(web, want);
        assert!(
            parse_listing(1, &entries[..2], None)
                .shared_pod_ids()
                .is_empty()
        );
    }

    #[test]
    fn add_replicas_floors_at_zero() {
        let mut raw = RawRc {
            id: String::new(),
            manifest: "".into(),
            node_selector: String::new(),
            pod_labels: None,
            replicas_desired: Some(2),
            disabled: false,
            allocation_strategy: String::new(),
            extra: Default::default(),
        };
        Mutation::AddReplicas(-5).apply(&mut raw);
        assert_eq!(raw.replicas_desired, Some(0));
        Mutation::AddReplicas(3).apply(&mut raw);
        assert_eq!(raw.replicas_desired, Some(3));
    }
}

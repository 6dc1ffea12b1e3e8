//! A label tree kept in memory by one blocking query, with an index from `key=value` to ids, so
//! selector queries are answered without asking Consul.
//!
//! Each snapshot from Consul is the whole tree; only entries whose `ModifyIndex` changed are
//! re-parsed, and subscribers get the list of ids that changed (with old and new labels) to
//! decide whom to wake. Malformed entries are reported per key and left out; they never stop
//! the cache.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ops::Bound;
use std::sync::Arc;

use tokio::sync::{broadcast, watch};

use super::compact::CompactLabels;
use super::selector::{LabelLookup, Requirement, Selector};
use super::store::{LabelSet, LabelType, parse_entry};
use crate::consul::{
    Committed, Consul, Demand, Fold, KvList, KvPair, KvVerb, TxnOp, WatchConfig, Watched,
};

/// One id whose labels changed.
#[derive(Debug, Clone)]
pub struct LabelChange {
    pub id: String,
    pub old: Option<Arc<LabelSet>>,
    pub new: Option<Arc<LabelSet>>,
}

/// The changes one snapshot brought.
#[derive(Debug, Clone, Default)]
pub struct LabelChanges {
    pub index: u64,
    pub changes: Vec<LabelChange>,
}

#[derive(Debug, Clone)]
struct Cached {
    labels: Arc<CompactLabels>,
    modify_index: u64,
}

/// The ids that carry one label value. Most values are on a few ids (the pods of one RC carry
/// its id and pod id), so a short list is kept at its exact size: a B-tree set's first node is
/// ~190 bytes whatever it holds, and at 100,000 pods there are 40,000 such sets in every farm.
/// Past `IdSet::FEW` ids (a label every pod carries) a hash set keeps removal cheap.
#[derive(Debug)]
enum IdSet {
    Few(Vec<Arc<str>>),
    Many(HashSet<Arc<str>>),
}

impl Default for IdSet {
    fn default() -> Self {
        IdSet::Few(Vec::new())
    }
}

impl IdSet {
    const FEW: usize = 32;

    fn insert(&mut self, id: Arc<str>) {
        match self {
            IdSet::Few(v) => {
                if v.contains(&id) {
                    return;
                }
                if v.len() < Self::FEW {
                    // Kept exact: one reallocation to one more, not a doubling.
                    v.reserve_exact(1);
                    v.push(id);
                } else {
                    let mut set: HashSet<Arc<str>> = v.drain(..).collect();
                    set.insert(id);
                    *self = IdSet::Many(set);
                }
            }
            IdSet::Many(set) => {
                set.insert(id);
            }
        }
    }

    fn remove(&mut self, id: &str) {
        match self {
            IdSet::Few(v) => {
                if let Some(i) = v.iter().position(|x| &**x == id) {
                    v.swap_remove(i);
                    v.shrink_to_fit();
                }
            }
            IdSet::Many(set) => {
                set.remove(id);
                if set.len() <= Self::FEW / 2 {
                    *self = IdSet::Few(set.drain().collect());
                }
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn len(&self) -> usize {
        match self {
            IdSet::Few(v) => v.len(),
            IdSet::Many(set) => set.len(),
        }
    }

    fn iter(&self) -> Box<dyn Iterator<Item = &Arc<str>> + '_> {
        match self {
            IdSet::Few(v) => Box::new(v.iter()),
            IdSet::Many(set) => Box::new(set.iter()),
        }
    }
}

/// Which entries a cache keeps (those it is asked about); the others are left out as they
/// arrive, and dropped when they stop being wanted at the next answer.
#[derive(Clone)]
pub struct Keep(pub Arc<KeepFn>);

/// Whether an entry's labels are wanted.
pub type KeepFn = dyn Fn(&dyn LabelLookup) -> bool + Send + Sync;

/// A change before its label sets are expanded: id, old, new.
type RawChange = (
    String,
    Option<Arc<CompactLabels>>,
    Option<Arc<CompactLabels>>,
);

impl std::fmt::Debug for Keep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keep(..)")
    }
}

/// Sized for 100,000 pods per farm: an id is allocated once and shared by the entry and the
/// index, and equal label sets (every pod of an RC carries the same labels) are one allocation.
#[derive(Debug, Default)]
struct State {
    index: u64,
    synced: bool,
    /// Sorted, so scans come out in id order.
    entries: BTreeMap<Arc<str>, Cached>,
    /// key → value → ids.
    inverted: HashMap<String, HashMap<String, IdSet>>,
    /// Every distinct label set held, to share equal ones.
    interned: HashSet<Arc<CompactLabels>>,
    /// Malformed keys: key → (ModifyIndex, reason).
    errors: BTreeMap<String, (u64, String)>,
    /// Ids this process wrote (or deleted) itself, at the commit index of the write, until a
    /// snapshot that includes the write arrives: an older snapshot must not undo them.
    local: HashMap<Arc<str>, u64>,
    keep: Option<Keep>,
}

impl State {
    fn unindex(&mut self, id: &str, labels: &CompactLabels) {
        for (k, v) in labels.iter() {
            if let Some(values) = self.inverted.get_mut(k) {
                if let Some(ids) = values.get_mut(v) {
                    ids.remove(id);
                    if ids.is_empty() {
                        values.remove(v);
                    }
                }
                if values.is_empty() {
                    self.inverted.remove(k);
                }
            }
        }
    }

    fn reindex(&mut self, id: &Arc<str>, labels: &CompactLabels) {
        for (k, v) in labels.iter() {
            let values = match self.inverted.get_mut(k) {
                Some(values) => values,
                None => self.inverted.entry(k.to_string()).or_default(),
            };
            let ids = match values.get_mut(v) {
                Some(ids) => ids,
                None => values.entry(v.to_string()).or_default(),
            };
            ids.insert(id.clone());
        }
    }

    /// The shared copy of `labels`.
    fn intern(&mut self, labels: &LabelSet) -> Arc<CompactLabels> {
        let labels = CompactLabels::new(labels);
        if let Some(shared) = self.interned.get(&labels) {
            return shared.clone();
        }
        let shared = Arc::new(labels);
        self.interned.insert(shared.clone());
        shared
    }

    /// Applies a full snapshot; returns what changed.
    fn apply(&mut self, t: LabelType, index: u64, entries: &KvList) -> LabelChanges {
        let prefix = t.prefix();
        if index < self.index {
            // An answer older than one already applied is taken as the truth only when the
            // store went back (a restored or emptied Consul: the watch resets): our own writes
            // recorded at later indexes may be gone with it.
            self.local.clear();
        }
        let mut seen: BTreeSet<&str> = BTreeSet::new();
        let mut changes = Vec::new();
        let mut errors = BTreeMap::new();
        let mut added = 0usize;
        for e in entries.iter() {
            let key = e.key();
            let id = key.strip_prefix(prefix.as_str()).unwrap_or(key);
            // Our own write is newer than this snapshot: keep ours (the snapshot's tree index
            // is at least every index in it, so it holds our write iff it is not below it).
            if self.local.get(id).is_some_and(|l| *l > index) {
                continue;
            }
            if let Some(c) = self.entries.get(id)
                && c.modify_index == e.modify_index()
            {
                if self.keep.as_ref().is_none_or(|k| (k.0)(&*c.labels)) {
                    seen.insert(id);
                }
                continue;
            }
            if let Some((idx, reason)) = self.errors.get(key)
                && *idx == e.modify_index()
            {
                errors.insert(key.to_string(), (*idx, reason.clone()));
                continue;
            }
            match parse_entry(t, &prefix, &e) {
                Ok(l) if self.keep.as_ref().is_some_and(|k| !(k.0)(&l.labels)) => {}
                Ok(l) => {
                    seen.insert(id);
                    if !self.entries.contains_key(id) {
                        added += 1;
                    }
                    changes.extend(self.put(id, &l.labels, l.modify_index));
                }
                Err(reason) => {
                    if !self.errors.contains_key(key) {
                        tracing::warn!(key = %key, %reason, "ignoring malformed labels");
                    }
                    errors.insert(key.to_string(), (e.modify_index(), reason));
                }
            }
        }
        let gone: Vec<Arc<str>> = self
            .entries
            .keys()
            .filter(|id| !seen.contains(&***id))
            .filter(|id| self.local.get(&***id).is_none_or(|l| *l <= index))
            .cloned()
            .collect();
        self.local.retain(|_, l| *l > index);
        for id in gone {
            changes.extend(self.remove(&id));
        }
        let changes = self.expand(changes);
        if added > self.entries.len() / 8 {
            // Keys come in order, and a B-tree filled one insert at a time in order leaves its
            // nodes half empty; built whole it packs them (100,000 pods: ~2.5 MB less per farm).
            self.entries = std::mem::take(&mut self.entries).into_iter().collect();
        }
        self.errors = errors;
        self.index = index;
        self.synced = true;
        LabelChanges { index, changes }
    }

    /// Stops preferring this process's own writes of `ids` to what the watch answers: Consul
    /// refused a write guarded by the index one of them recorded, so the store no longer
    /// holds it (another writer changed the key, or the store went back in time: restored
    /// from a backup, where our write at an index the restored store has not reached would
    /// otherwise be kept over every answer until the store's index passes it).
    fn forget_own(&mut self, ids: &[&str]) {
        for id in ids {
            self.local.remove(*id);
        }
    }

    /// Stops preferring any of this process's own writes to what the watch answers.
    fn forget_all_own(&mut self) {
        self.local.clear();
    }

    /// Applies this process's own committed write at `index`: `(id, labels or None if the
    /// key was deleted)`. Returns what changed.
    fn apply_own(&mut self, writes: Vec<(String, Option<LabelSet>, u64)>) -> LabelChanges {
        let mut changes = Vec::new();
        for (id, labels, index) in writes {
            changes.extend(match &labels {
                Some(l) => self.put(&id, l, index),
                None => self.remove(&id),
            });
            // The newest write wins when one id is written twice before a snapshot.
            let l = self.local.entry(Arc::from(id.as_str())).or_insert(index);
            *l = (*l).max(index);
        }
        LabelChanges {
            index: self.index,
            changes: self.expand(changes),
        }
    }

    /// Sets an id's labels and `ModifyIndex`, reindexing it; the change, if its labels changed.
    fn put(&mut self, id: &str, labels: &LabelSet, modify_index: u64) -> Option<RawChange> {
        let new = self.intern(labels);
        // Keep the id already allocated (the index shares it).
        let key: Arc<str> = match self.entries.get_key_value(id) {
            Some((k, _)) => k.clone(),
            None => Arc::from(id),
        };
        let old = self
            .entries
            .insert(
                key.clone(),
                Cached {
                    labels: new.clone(),
                    modify_index,
                },
            )
            .map(|c| c.labels);
        if old.as_deref() == Some(&*new) {
            return None;
        }
        if let Some(o) = &old {
            self.unindex(id, o);
        }
        self.reindex(&key, &new);
        Some((id.to_string(), old, Some(new)))
    }

    /// Forgets an id; the change, if it was held.
    fn remove(&mut self, id: &str) -> Option<RawChange> {
        let c = self.entries.remove(id)?;
        self.unindex(id, &c.labels);
        Some((id.to_string(), Some(c.labels), None))
    }

    /// Subscribers get plain label sets, each distinct one expanded once; label sets no entry
    /// holds any more are forgotten.
    fn expand(&mut self, changes: Vec<RawChange>) -> Vec<LabelChange> {
        let mut expanded: HashMap<*const CompactLabels, Arc<LabelSet>> = HashMap::new();
        // A set can lose its last entry only in a change that took it away (its `old`): only
        // those are looked at, not every interned set (a walk of all of them per write made a
        // farm's own label writes quadratic in the cluster's RCs).
        let mut released: HashMap<*const CompactLabels, Arc<CompactLabels>> = HashMap::new();
        let mut expand = |l: Option<Arc<CompactLabels>>| {
            l.map(|l| {
                expanded
                    .entry(Arc::as_ptr(&l))
                    .or_insert_with(|| Arc::new(l.to_set()))
                    .clone()
            })
        };
        let changes: Vec<LabelChange> = changes
            .into_iter()
            .map(|(id, old, new)| {
                if let Some(o) = &old {
                    released.entry(Arc::as_ptr(o)).or_insert_with(|| o.clone());
                }
                LabelChange {
                    id,
                    old: expand(old),
                    new: expand(new),
                }
            })
            .collect();
        for l in released.into_values() {
            // Held by the interned set and by `l` alone: no entry holds it any more.
            if Arc::strong_count(&l) == 2 {
                self.interned.remove(&l);
            }
        }
        changes
    }

    /// The id sets an indexed requirement draws from (their union holds every id it can
    /// match), or `None` if the index cannot narrow it.
    fn sources<'a>(&'a self, r: &'a Requirement) -> Option<Vec<&'a IdSet>> {
        let by_value = self.inverted.get(r.key());
        match r {
            Requirement::Exists(_) => {
                Some(by_value.map(|m| m.values().collect()).unwrap_or_default())
            }
            _ => r.required_values().map(|values| {
                values
                    .iter()
                    .filter_map(|v| by_value.and_then(|m| m.get(*v)))
                    .collect()
            }),
        }
    }

    fn matches(&self, selector: &Selector) -> Vec<String> {
        // Draw candidates from the most selective indexed requirement and check each against
        // the whole selector; scan everything when nothing narrows it enough.
        let mut best: Option<(usize, Vec<&IdSet>)> = None;
        for r in selector.requirements() {
            if let Some(sets) = self.sources(r) {
                let size: usize = sets.iter().map(|s| s.len()).sum();
                if best.as_ref().is_none_or(|(b, _)| size < *b) {
                    best = Some((size, sets));
                }
            }
        }
        let check = |id: &str| {
            self.entries
                .get(id)
                .is_some_and(|c| selector.matches(&*c.labels))
        };
        match best {
            Some((0, _)) => Vec::new(),
            Some((size, sets)) if size * 2 <= self.entries.len() => {
                let mut out: Vec<String> = sets
                    .into_iter()
                    .flat_map(IdSet::iter)
                    .filter(|id| check(id))
                    .map(|id| id.to_string())
                    .collect();
                out.sort_unstable();
                out
            }
            _ => self
                .entries
                .iter()
                .filter(|(_, c)| selector.matches(&*c.labels))
                .map(|(id, _)| id.to_string())
                .collect(),
        }
    }

    /// Ids in `[from, ..)` with a prefix, in order (pods of one node: `<node>/`).
    fn ids_with_prefix(&self, prefix: &str) -> Vec<String> {
        self.entries
            .range::<str, _>((Bound::Included(prefix), Bound::Unbounded))
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, _)| k.to_string())
            .collect()
    }
}

/// What a [`LabelCache`] folds each answer into: its tree's labels and their index.
struct LabelTree {
    label_type: LabelType,
    state: State,
}

impl Fold for LabelTree {
    type Changes = LabelChanges;

    fn fold(&mut self, index: u64, entries: &KvList) -> Option<LabelChanges> {
        let c = self.state.apply(self.label_type, index, entries);
        (!c.changes.is_empty()).then_some(c)
    }

    fn index(&self) -> u64 {
        self.state.index
    }
}

/// A watched label tree: a [`Fold`] over the one watched cache ([`Watched`]).
pub struct LabelCache {
    label_type: LabelType,
    watched: Watched<LabelTree>,
    /// How the tree is read, if on demand.
    demand: Option<Arc<Demand>>,
}

/// The labels a committed transaction wrote among `ops` (deleted: `None`), each with its key's
/// `ModifyIndex` after the commit: the key's own as Consul answered, which a write that
/// changed nothing left where it was on Consul 1.x, so that a CAS planned from the cache
/// names the index Consul holds.
fn own_writes(
    label_type: LabelType,
    committed: &Committed,
    ops: &[TxnOp],
) -> Vec<(String, Option<LabelSet>, u64)> {
    let prefix = label_type.prefix();
    ops.iter()
        .filter_map(|op| {
            let id = op.key.strip_prefix(prefix.as_str())?;
            match op.verb {
                KvVerb::Set | KvVerb::Cas => {
                    let modify_index = committed.modify_index(&op.key).unwrap_or(committed.index);
                    let kv = KvPair {
                        key: op.key.clone(),
                        value: op.value.clone(),
                        modify_index,
                        ..Default::default()
                    };
                    // What does not parse is left to the next answer to report.
                    let l = parse_entry(label_type, &prefix, &kv).ok()?;
                    Some((id.to_string(), Some(l.labels), modify_index))
                }
                KvVerb::Delete | KvVerb::DeleteCas => Some((id.to_string(), None, committed.index)),
                _ => None,
            }
        })
        .collect()
}

impl LabelCache {
    /// Starts watching `labels/<type>/` with one blocking query.
    pub fn spawn(consul: &Consul, label_type: LabelType, config: WatchConfig) -> LabelCache {
        Self::spawn_keeping(consul, label_type, config, None)
    }

    /// Like [`LabelCache::spawn`], holding only the entries `keep` wants.
    pub fn spawn_keeping(
        consul: &Consul,
        label_type: LabelType,
        config: WatchConfig,
        keep: Option<Keep>,
    ) -> LabelCache {
        let tree = LabelTree {
            label_type,
            state: State {
                keep,
                ..Default::default()
            },
        };
        let demand = config.demand.clone();
        LabelCache {
            label_type,
            watched: Watched::spawn(consul, label_type.prefix(), config, tree),
            demand,
        }
    }

    /// Applies a transaction this process committed at `index` (its ops on this tree; the
    /// others are ignored), so that its own writes are seen at once, before any answer of the
    /// watch, and an answer older than the write does not undo them.
    pub fn apply_own(&self, committed: &Committed, ops: &[TxnOp]) {
        let writes = own_writes(self.label_type, committed, ops);
        if writes.is_empty() || committed.index == 0 {
            return;
        }
        let c = self.watched.write().state.apply_own(writes);
        if !c.changes.is_empty() {
            self.watched.changed(c);
        }
    }

    /// Believes the watch again about these keys ([`State::forget_own`]): a write guarded by
    /// the index the cache held for them was refused.
    pub fn forget_own(&self, keys: &[String]) {
        let prefix = self.label_type.prefix();
        let ids: Vec<&str> = keys
            .iter()
            .filter_map(|k| k.strip_prefix(prefix.as_str()))
            .collect();
        if !ids.is_empty() {
            self.watched.write().state.forget_own(&ids);
        }
    }

    /// Believes the watch again about every key: the store went back in time (seen on another
    /// tree first), so writes of ours it recorded may be gone, and an answer read since, at an
    /// index above the restored store's yet below those writes, must not be overruled by them.
    pub fn forget_all_own(&self) {
        self.watched.write().state.forget_all_own();
    }

    /// How the tree is read, if on demand.
    pub fn demand(&self) -> Option<&Arc<Demand>> {
        self.demand.as_ref()
    }

    pub fn label_type(&self) -> LabelType {
        self.label_type
    }

    /// Ids whose labels match, sorted.
    pub fn matches(&self, selector: &Selector) -> Vec<String> {
        self.watched.read().state.matches(selector)
    }

    pub fn get(&self, id: &str) -> Option<Arc<LabelSet>> {
        self.watched
            .read()
            .state
            .entries
            .get(id)
            .map(|c| Arc::new(c.labels.to_set()))
    }

    pub fn contains(&self, id: &str) -> bool {
        self.watched.read().state.entries.contains_key(id)
    }

    /// Whether `id` is held and its labels match `selector`.
    pub fn id_matches(&self, id: &str, selector: &Selector) -> bool {
        self.watched
            .read()
            .state
            .entries
            .get(id)
            .is_some_and(|c| selector.matches(&*c.labels))
    }

    /// Labels and the key's `ModifyIndex` (for a CAS that must fail if the key moved on).
    pub fn get_with_index(&self, id: &str) -> Option<(Arc<LabelSet>, u64)> {
        self.watched
            .read()
            .state
            .entries
            .get(id)
            .map(|c| (Arc::new(c.labels.to_set()), c.modify_index))
    }

    pub fn len(&self) -> usize {
        self.watched.read().state.entries.len()
    }

    /// Each value label `key` takes, with how many entries carry it (from the index: no scan).
    pub fn value_counts(&self, key: &str) -> Vec<(String, usize)> {
        self.watched
            .read()
            .state
            .inverted
            .get(key)
            .map(|values| {
                values
                    .iter()
                    .map(|(v, ids)| (v.clone(), ids.len()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Ids starting with `prefix`, sorted (for pods: `"<node>/"` lists a node's pods).
    pub fn ids_with_prefix(&self, prefix: &str) -> Vec<String> {
        self.watched.read().state.ids_with_prefix(prefix)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every id and its labels, sorted by id.
    pub fn all(&self) -> Vec<(String, Arc<LabelSet>)> {
        let tree = self.watched.read();
        tree.state
            .entries
            .iter()
            .map(|(k, c)| (k.to_string(), Arc::new(c.labels.to_set())))
            .collect()
    }

    /// Malformed keys and why.
    pub fn errors(&self) -> Vec<(String, String)> {
        self.watched
            .read()
            .state
            .errors
            .iter()
            .map(|(k, (_, r))| (k.clone(), r.clone()))
            .collect()
    }

    /// The Consul index of the snapshot the cache holds.
    pub fn index(&self) -> u64 {
        self.watched.read().state.index
    }

    pub fn is_synced(&self) -> bool {
        self.watched.read().state.synced
    }

    /// Waits for the first snapshot.
    pub async fn synced(&self) {
        self.watched.synced().await
    }

    /// Waits until the cache reflects Consul index `index` or later.
    pub async fn wait_for_index(&self, index: u64) {
        self.watched.wait_for_index(index).await
    }

    /// Bumps on every applied snapshot that changed something.
    pub fn subscribe_version(&self) -> watch::Receiver<u64> {
        self.watched.subscribe()
    }

    /// The ids each snapshot changed. A receiver that lags gets `Lagged` and should re-read
    /// everything.
    pub fn subscribe_changes(&self) -> broadcast::Receiver<Arc<LabelChanges>> {
        self.watched.subscribe_changes()
    }

    pub fn watch_stats(&self) -> &Arc<crate::consul::WatchStats> {
        self.watched.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl State {
        fn apply_pairs(&mut self, t: LabelType, index: u64, pairs: &[KvPair]) -> LabelChanges {
            self.apply(t, index, &KvList::from_pairs(pairs))
        }
    }

    fn kv(key: &str, value: &str, idx: u64) -> KvPair {
        KvPair {
            key: key.into(),
            value: Some(value.as_bytes().to_vec()),
            modify_index: idx,
            ..Default::default()
        }
    }

    #[test]
    fn applies_snapshots_incrementally() {
        let mut st = State::default();
        let c = st.apply_pairs(
            LabelType::Node,
            5,
            &[
                kv("labels/node/a", r#"{"env":"prod"}"#, 1),
                kv("labels/node/b", r#"{"env":"dev"}"#, 2),
            ],
        );
        assert_eq!(c.changes.len(), 2);
        let sel = Selector::parse("env=prod").unwrap();
        assert_eq!(st.matches(&sel), ["a"]);
        // Same indexes: no changes. b changes, a goes away, c is malformed.
        let c = st.apply_pairs(
            LabelType::Node,
            7,
            &[
                kv("labels/node/b", r#"{"env":"prod"}"#, 6),
                kv("labels/node/c", "[", 7),
            ],
        );
        let ids: Vec<_> = c.changes.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["b", "a"]);
        assert_eq!(st.matches(&sel), ["b"]);
        assert_eq!(st.errors.len(), 1);
        assert!(
            !st.inverted["env"].contains_key("dev"),
            "old index entries removed"
        );
    }

    fn labels(pairs: &[(&str, &str)]) -> LabelSet {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// The process's own writes are seen at once, and an answer older than a write (sent
    /// before it committed) undoes neither a write nor a delete; one that includes it wins.
    #[test]
    fn own_writes_survive_older_answers() {
        let mut st = State::default();
        let p = LabelType::Pod;
        st.apply_pairs(p, 10, &[kv("labels/pod/n1/web", r#"{"rc":"a"}"#, 10)]);
        let c = st.apply_own(vec![
            ("n2/web".into(), Some(labels(&[("rc", "a")])), 12),
            ("n1/web".into(), None, 12),
        ]);
        assert_eq!(c.changes.len(), 2);
        let sel = Selector::parse("rc=a").unwrap();
        assert_eq!(st.matches(&sel), ["n2/web"]);
        // An answer from before the write: n1 still there, n2 not yet.
        let c = st.apply_pairs(p, 11, &[kv("labels/pod/n1/web", r#"{"rc":"a"}"#, 10)]);
        assert!(c.changes.is_empty(), "{:?}", c.changes);
        assert_eq!(st.matches(&sel), ["n2/web"]);
        assert_eq!(st.index, 11);
        // The answer that includes the write (its index is the write's).
        st.apply_pairs(p, 12, &[kv("labels/pod/n2/web", r#"{"rc":"a"}"#, 12)]);
        assert!(st.local.is_empty());
        assert_eq!(st.matches(&sel), ["n2/web"]);
        // Later, someone deletes n2 behind our back: believed.
        let c = st.apply_pairs(p, 13, &[]);
        assert_eq!(c.changes.len(), 1);
        assert!(st.matches(&sel).is_empty());
    }

    /// A store restored from a backup lacks our writes made after it, at indexes it has not
    /// reached: once a guarded write of ours is refused, or an answer older than one applied
    /// comes (the watch reset), the cache believes the store again instead of holding our
    /// write until the store's index passes it (seen: a farm's every write refused as stale
    /// after a restore, for over 90 s).
    #[test]
    fn own_writes_a_restored_store_lost_are_forgotten() {
        let mut st = State::default();
        let p = LabelType::Pod;
        let sel = Selector::parse("rc=a").unwrap();
        st.apply_pairs(p, 40, &[kv("labels/pod/n1/web", r#"{"rc":"a"}"#, 40)]);
        st.apply_own(vec![
            ("n1/web".into(), Some(labels(&[("rc", "b")])), 60),
            ("n2/web".into(), Some(labels(&[("rc", "a")])), 61),
        ]);
        // The restored store, written to since, at 52: both our writes held (we cannot tell).
        st.apply_pairs(p, 52, &[kv("labels/pod/n1/web", r#"{"rc":"a"}"#, 40)]);
        assert_eq!(st.matches(&sel), ["n2/web"]);
        // Our write guarded by n1's index 60 refused: n1 is believed at the next answer.
        st.forget_own(&["n1/web"]);
        st.apply_pairs(p, 53, &[kv("labels/pod/n1/web", r#"{"rc":"a"}"#, 40)]);
        assert_eq!(st.matches(&sel), ["n1/web", "n2/web"]);
        assert_eq!(st.entries.get("n1/web").unwrap().modify_index, 40);
        // An answer older than one applied (the watch reset on a store gone back): all ours
        // are forgotten.
        st.apply_pairs(p, 45, &[kv("labels/pod/n1/web", r#"{"rc":"a"}"#, 40)]);
        assert!(st.local.is_empty());
        assert_eq!(st.matches(&sel), ["n1/web"]);
    }

    /// A write that changed nothing keeps its key's `ModifyIndex` on Consul 1.x (and says so in
    /// its answer): the cache takes the key's index from the answer, not the commit's, so a
    /// CAS planned from it names the index Consul holds, and a later answer corrects nothing.
    #[test]
    fn an_own_write_that_changed_nothing_keeps_the_keys_index() {
        let key = "labels/pod/n1/web";
        let value = br#"{"rc":"a"}"#.to_vec();
        let ops = [
            TxnOp::check_session("lock/x", "s"),
            TxnOp::cas(key, value.clone(), 10),
            TxnOp::set("intent/n1/web", b"m".to_vec()),
        ];
        let at = |results: &[(&str, u64)], index| {
            let results: Vec<KvPair> = results
                .iter()
                .map(|(k, i)| KvPair {
                    key: k.to_string(),
                    modify_index: *i,
                    ..Default::default()
                })
                .collect();
            own_writes(LabelType::Pod, &Committed::of(index, &ops, &results), &ops)
        };
        // Consul 1.x's answer: the unchanged label at its old index, the intent at the commit's.
        let w = at(&[(key, 10), ("intent/n1/web", 15)], 15);
        assert_eq!(w, vec![("n1/web".into(), Some(labels(&[("rc", "a")])), 10)]);
        let mut st = State::default();
        st.apply_pairs(LabelType::Pod, 12, &[kv(key, r#"{"rc":"a"}"#, 10)]);
        st.apply_own(w);
        // A later answer, whose tree index is below the commit's, agrees: nothing is held back.
        st.apply_pairs(LabelType::Pod, 12, &[kv(key, r#"{"rc":"a"}"#, 10)]);
        assert_eq!(st.entries.get("n1/web").unwrap().modify_index, 10);
        assert!(st.local.is_empty(), "{:?}", st.local);
        // Consul 0.7's answer: every key at the commit index.
        let w = at(&[(key, 16), ("intent/n1/web", 16)], 16);
        assert_eq!(w[0].2, 16);
    }

    /// What the filter does not want is left out as it arrives, and dropped when it stops
    /// being wanted, even unchanged.
    #[test]
    fn a_filtered_cache_holds_only_what_it_keeps() {
        let wanted = Arc::new(parking_lot::RwLock::new(BTreeSet::from(["a".to_string()])));
        let w = wanted.clone();
        let mut st = State {
            keep: Some(Keep(Arc::new(move |l: &dyn LabelLookup| {
                l.label("rc").is_some_and(|rc| w.read().contains(rc))
            }))),
            ..Default::default()
        };
        let p = LabelType::Pod;
        let tree = [
            kv("labels/pod/n1/web", r#"{"rc":"a"}"#, 1),
            kv("labels/pod/n2/api", r#"{"rc":"b"}"#, 2),
        ];
        st.apply_pairs(p, 2, &tree);
        assert_eq!(st.entries.len(), 1);
        wanted.write().insert("b".into());
        wanted.write().remove("a");
        let c = st.apply_pairs(p, 2, &tree);
        assert_eq!(c.changes.len(), 2);
        assert_eq!(
            st.entries.keys().map(|k| k.to_string()).collect::<Vec<_>>(),
            ["n2/api"]
        );
    }

    #[test]
    fn equal_label_sets_are_held_once_and_forgotten_when_unused() {
        let mut st = State::default();
        let pods: Vec<KvPair> = (0..5)
            .map(|i| {
                kv(
                    &format!("labels/pod/node{i}/web"),
                    r#"{"pod_id":"web","replication_controller_id":"rc-1"}"#,
                    i + 1,
                )
            })
            .chain([kv(
                "labels/pod/node0/db",
                r#"{"pod_id":"db","replication_controller_id":"rc-2"}"#,
                9,
            )])
            .collect();
        st.apply_pairs(LabelType::Pod, 9, &pods);
        assert_eq!(st.entries.len(), 6);
        assert_eq!(st.interned.len(), 2, "five equal sets are one");
        let a = &st.entries["node0/web"].labels;
        let b = &st.entries["node4/web"].labels;
        assert!(Arc::ptr_eq(a, b));
        // The index shares the entry's id allocation.
        let (key, _) = st.entries.get_key_value("node0/db").unwrap();
        let indexed = st.inverted["pod_id"]["db"].iter().next().unwrap();
        assert!(Arc::ptr_eq(key, indexed));
        // The db pod goes: its set is forgotten; relabelled web pods stay shared.
        let relabelled: Vec<KvPair> = (0..5)
            .map(|i| {
                kv(
                    &format!("labels/pod/node{i}/web"),
                    r#"{"pod_id":"web","replication_controller_id":"rc-3"}"#,
                    20 + i,
                )
            })
            .collect();
        let c = st.apply_pairs(LabelType::Pod, 30, &relabelled);
        assert_eq!(c.changes.len(), 6);
        assert_eq!(st.interned.len(), 1);
        let sel = Selector::parse("replication_controller_id=rc-3").unwrap();
        assert_eq!(st.matches(&sel).len(), 5);
        assert!(
            st.matches(&Selector::parse("pod_id=db").unwrap())
                .is_empty()
        );
        assert!(!st.inverted["replication_controller_id"].contains_key("rc-1"));
    }

    /// Only the sets a change took away are looked at; each goes once its last entry does,
    /// also when one batch of own writes moves an id twice.
    #[test]
    fn own_writes_forget_the_sets_they_leave_unheld() {
        let mut st = State::default();
        let (a, b, c) = (
            labels(&[("rc", "a")]),
            labels(&[("rc", "b")]),
            labels(&[("rc", "c")]),
        );
        st.apply_own(vec![
            ("n1/web".into(), Some(a.clone()), 2),
            ("n2/web".into(), Some(a.clone()), 2),
        ]);
        assert_eq!(st.interned.len(), 1);
        // n1 leaves `a`, which n2 still holds; within the same batch n2 goes through `b` to `c`.
        st.apply_own(vec![
            ("n1/web".into(), Some(b.clone()), 3),
            ("n3/web".into(), Some(b), 3),
            ("n3/web".into(), Some(c.clone()), 4),
        ]);
        assert_eq!(st.interned.len(), 3, "a (n2), b (n1), c (n3)");
        st.apply_own(vec![("n2/web".into(), None, 5)]);
        assert_eq!(st.interned.len(), 2, "a had only n2 left");
        st.apply_own(vec![
            ("n1/web".into(), Some(c), 6),
            ("n3/web".into(), None, 6),
        ]);
        let held: Vec<LabelSet> = st.interned.iter().map(|l| l.to_set()).collect();
        assert_eq!(
            held,
            [labels(&[("rc", "c")])],
            "b left with n1, c stays with it"
        );
    }

    #[test]
    fn id_sets_grow_into_hash_sets_and_shrink_back() {
        let ids: Vec<Arc<str>> = (0..40).map(|i| Arc::from(format!("id{i:02}"))).collect();
        let mut set = IdSet::default();
        for id in ids.iter().chain(&ids) {
            set.insert(id.clone());
        }
        assert!(matches!(set, IdSet::Many(_)), "past {} ids", IdSet::FEW);
        assert_eq!(set.len(), 40, "each id once");
        for id in &ids[..30] {
            set.remove(id);
        }
        set.remove("never there");
        let IdSet::Few(v) = &set else {
            panic!("back to a list at {} ids", set.len());
        };
        assert_eq!(v.capacity(), v.len());
        let mut left: Vec<&str> = set.iter().map(|id| &**id).collect();
        left.sort_unstable();
        let want: Vec<&str> = ids[30..].iter().map(|id| &**id).collect();
        assert_eq!(left, want);
        for id in &ids[30..] {
            set.remove(id);
        }
        assert!(set.is_empty());
    }

    #[test]
    fn selector_queries_use_every_operator() {
        let mut st = State::default();
        let entries: Vec<KvPair> = (0..50)
            .map(|i| {
                kv(
                    &format!("labels/node/n{i:02}"),
                    &format!(r#"{{"rack":"r{}","gpu":"{}"}}"#, i % 5, i % 2 == 0),
                    i + 1,
                )
            })
            .collect();
        st.apply_pairs(LabelType::Node, 100, &entries);
        let q = |s: &str| st.matches(&Selector::parse(s).unwrap()).len();
        assert_eq!(q(""), 50);
        assert_eq!(q("rack=r1"), 10);
        assert_eq!(q("rack in (r1,r2),gpu=true"), 10);
        assert_eq!(q("rack notin (r1,r2)"), 30);
        assert_eq!(q("rack!=r1,gpu=true"), 20);
        assert_eq!(q("gpu"), 50);
        assert_eq!(q("!gpu"), 0);
        assert_eq!(q("missing"), 0);
        assert_eq!(q("rack=nowhere,gpu"), 0);
        let sorted = st.matches(&Selector::parse("rack=r0").unwrap());
        let mut s2 = sorted.clone();
        s2.sort();
        assert_eq!(sorted, s2);
    }
}

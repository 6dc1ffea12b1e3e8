//! A KV tree kept in memory by one blocking query, each entry parsed by the caller's function.
//! Unchanged entries (same `ModifyIndex`) are not parsed again; entries that do not parse are
//! reported per key and left out.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use parking_lot::RwLock;
use tokio::sync::watch;

use super::client::Consul;
use super::types::KvPair;
use super::watch::{SinkWatch, WatchConfig, WatchStats};

/// Parses one entry: `(key without the prefix, value)`.
pub type ParseFn<T> = Arc<dyn Fn(&str, &[u8]) -> Result<T, String> + Send + Sync>;

struct State<T> {
    index: u64,
    synced: bool,
    entries: BTreeMap<String, (Arc<T>, u64)>,
    errors: BTreeMap<String, (u64, String)>,
    /// Suffixes changed by the last snapshot.
    last_changed: Arc<BTreeSet<String>>,
}

/// What a watched cache tells its readers after each answer: a version bumped on the first
/// answer and on every change, and the index it holds. Only waiters for an index wake when
/// nothing changed: a subscriber of the version (the farm's claim loop) would redo its work for
/// every answer.
pub struct CacheSignals {
    version: watch::Sender<u64>,
    applied: watch::Sender<u64>,
}

impl CacheSignals {
    /// The signals, and receivers of the version and of the index applied.
    pub fn new() -> (CacheSignals, watch::Receiver<u64>, watch::Receiver<u64>) {
        let (version, version_rx) = watch::channel(0);
        let (applied, applied_rx) = watch::channel(0);
        (CacheSignals { version, applied }, version_rx, applied_rx)
    }

    /// After an answer at `index` was applied; `changed` if it changed the cache's content.
    pub fn applied(&self, index: u64, changed: bool) {
        if changed || *self.version.borrow() == 0 {
            self.version.send_modify(|n| *n += 1);
        }
        self.applied
            .send_if_modified(|i| std::mem::replace(i, index) != index);
    }

    /// After a change that came from no answer (the process's own write, applied directly).
    pub fn changed(&self) {
        self.version.send_modify(|n| *n += 1);
    }
}

/// A parsed, watched tree.
pub struct TreeCache<T> {
    prefix: String,
    state: Arc<RwLock<State<T>>>,
    version: watch::Receiver<u64>,
    /// The index of the last answer applied.
    applied: watch::Receiver<u64>,
    /// The suffixes each snapshot changed, for consumers that must not miss one (a `watch`
    /// keeps only the latest).
    changes: tokio::sync::broadcast::Sender<Arc<BTreeSet<String>>>,
    watch: SinkWatch,
}

impl<T: Send + Sync + 'static> TreeCache<T> {
    pub fn spawn(
        consul: &Consul,
        prefix: impl Into<String>,
        config: WatchConfig,
        parse: ParseFn<T>,
    ) -> TreeCache<T> {
        let prefix = prefix.into();
        let state = Arc::new(RwLock::new(State {
            index: 0,
            synced: false,
            entries: BTreeMap::new(),
            errors: BTreeMap::new(),
            last_changed: Arc::default(),
        }));
        let (signals, version, applied) = CacheSignals::new();
        let (changes, _) = tokio::sync::broadcast::channel(1024);
        let ctx = changes.clone();
        let st = state.clone();
        let p = prefix.clone();
        let watch = consul.sink_prefix(prefix.clone(), config, move |index, entries| {
            let changed = apply(&st, &p, index, &entries, &parse);
            drop(entries);
            if changed {
                let _ = ctx.send(st.read().last_changed.clone());
            }
            signals.applied(index, changed);
        });
        TreeCache {
            prefix,
            state,
            version,
            applied,
            changes,
            watch,
        }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The entry at `prefix + suffix`.
    pub fn get(&self, suffix: &str) -> Option<Arc<T>> {
        self.state
            .read()
            .entries
            .get(suffix)
            .map(|(v, _)| v.clone())
    }

    pub fn get_with_index(&self, suffix: &str) -> Option<(Arc<T>, u64)> {
        self.state.read().entries.get(suffix).cloned()
    }

    /// Entries whose suffix starts with `sub`, in key order.
    pub fn range(&self, sub: &str) -> Vec<(String, Arc<T>)> {
        self.state
            .read()
            .entries
            .range(sub.to_string()..)
            .take_while(|(k, _)| k.starts_with(sub))
            .map(|(k, (v, _))| (k.clone(), v.clone()))
            .collect()
    }

    pub fn all(&self) -> Vec<(String, Arc<T>)> {
        self.range("")
    }

    pub fn len(&self) -> usize {
        self.state.read().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn errors(&self) -> Vec<(String, String)> {
        self.state
            .read()
            .errors
            .iter()
            .map(|(k, (_, r))| (k.clone(), r.clone()))
            .collect()
    }

    pub fn index(&self) -> u64 {
        self.state.read().index
    }

    pub fn is_synced(&self) -> bool {
        self.state.read().synced
    }

    /// The suffixes the latest snapshot changed.
    pub fn last_changed(&self) -> Arc<BTreeSet<String>> {
        self.state.read().last_changed.clone()
    }

    pub async fn synced(&self) {
        let mut v = self.version.clone();
        let _ = v.wait_for(|n| *n > 0).await;
    }

    /// Waits until the cache holds a snapshot at `index` or later.
    pub async fn wait_for_index(&self, index: u64) {
        let mut v = self.applied.clone();
        let _ = v.wait_for(|_| self.state.read().index >= index).await;
    }

    /// Bumps whenever a snapshot changed something.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.clone()
    }

    /// Every snapshot's changed suffixes, in order (a lagging receiver is told it missed some).
    pub fn subscribe_changes(&self) -> tokio::sync::broadcast::Receiver<Arc<BTreeSet<String>>> {
        self.changes.subscribe()
    }

    pub fn stats(&self) -> &Arc<WatchStats> {
        self.watch.stats()
    }
}

fn apply<T>(
    state: &RwLock<State<T>>,
    prefix: &str,
    index: u64,
    entries: &[KvPair],
    parse: &ParseFn<T>,
) -> bool {
    let mut st = state.write();
    let mut next = BTreeMap::new();
    let mut errors = BTreeMap::new();
    let mut changed = BTreeSet::new();
    for e in entries {
        let suffix = e.key.strip_prefix(prefix).unwrap_or(&e.key).to_string();
        if let Some((v, idx)) = st.entries.get(&suffix)
            && *idx == e.modify_index
        {
            next.insert(suffix, (v.clone(), *idx));
            continue;
        }
        if let Some((idx, r)) = st.errors.get(&e.key)
            && *idx == e.modify_index
        {
            errors.insert(e.key.clone(), (*idx, r.clone()));
            continue;
        }
        match parse(&suffix, e.value_bytes()) {
            Ok(v) => {
                changed.insert(suffix.clone());
                next.insert(suffix, (Arc::new(v), e.modify_index));
            }
            Err(reason) => {
                if st.entries.contains_key(&suffix) {
                    changed.insert(suffix.clone());
                }
                tracing::warn!(key = %e.key, %reason, "ignoring malformed entry");
                errors.insert(e.key.clone(), (e.modify_index, reason));
            }
        }
    }
    for k in st.entries.keys() {
        if !next.contains_key(k) {
            changed.insert(k.clone());
        }
    }
    let any = !changed.is_empty();
    st.entries = next;
    st.errors = errors;
    st.index = index;
    st.synced = true;
    st.last_changed = Arc::new(changed);
    any
}

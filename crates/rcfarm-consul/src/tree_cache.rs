//! A KV tree kept in memory by one blocking query, each entry parsed by the caller's function:
//! a [`Fold`] over the one watched cache ([`Watched`]). Unchanged entries (same `ModifyIndex`)
//! are not parsed again; entries that do not parse are reported per key and left out.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tokio::sync::watch;

use super::client::Consul;
use super::kvlist::KvList;
use super::watch::{WatchConfig, WatchStats};
use super::watched::{Fold, Watched};

/// Parses one entry: `(key without the prefix, value)`.
pub type ParseFn<T> = Arc<dyn Fn(&str, &[u8]) -> Result<T, String> + Send + Sync>;

/// What a [`TreeCache`] keeps: each entry parsed, and the entries that do not parse.
pub struct TreeState<T> {
    prefix: String,
    parse: ParseFn<T>,
    index: u64,
    synced: bool,
    entries: BTreeMap<String, (Arc<T>, u64)>,
    errors: BTreeMap<String, (u64, String)>,
    /// Suffixes changed by the last snapshot.
    last_changed: Arc<BTreeSet<String>>,
}

impl<T: Send + Sync + 'static> Fold for TreeState<T> {
    /// The suffixes an answer changed.
    type Changes = BTreeSet<String>;

    fn fold(&mut self, index: u64, entries: &KvList) -> Option<BTreeSet<String>> {
        let changed = apply(self, index, entries);
        (!changed.is_empty()).then_some(changed)
    }

    fn index(&self) -> u64 {
        self.index
    }
}

/// A parsed, watched tree.
pub struct TreeCache<T: Send + Sync + 'static> {
    prefix: String,
    watched: Watched<TreeState<T>>,
}

impl<T: Send + Sync + 'static> TreeCache<T> {
    pub fn spawn(
        consul: &Consul,
        prefix: impl Into<String>,
        config: WatchConfig,
        parse: ParseFn<T>,
    ) -> TreeCache<T> {
        let prefix = prefix.into();
        let state = TreeState {
            prefix: prefix.clone(),
            parse,
            index: 0,
            synced: false,
            entries: BTreeMap::new(),
            errors: BTreeMap::new(),
            last_changed: Arc::default(),
        };
        TreeCache {
            watched: Watched::spawn(consul, prefix.clone(), config, state),
            prefix,
        }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn get(&self, suffix: &str) -> Option<Arc<T>> {
        self.watched
            .read()
            .entries
            .get(suffix)
            .map(|(v, _)| v.clone())
    }

    /// The entry and its `ModifyIndex` (for a check-and-set against it).
    pub fn get_with_index(&self, suffix: &str) -> Option<(Arc<T>, u64)> {
        self.watched.read().entries.get(suffix).cloned()
    }

    /// Entries whose suffix starts with `sub`.
    pub fn range(&self, sub: &str) -> Vec<(String, Arc<T>)> {
        self.watched
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
        self.watched.read().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keys that did not parse, with why.
    pub fn errors(&self) -> Vec<(String, String)> {
        self.watched
            .read()
            .errors
            .iter()
            .map(|(k, (_, e))| (k.clone(), e.clone()))
            .collect()
    }

    pub fn index(&self) -> u64 {
        self.watched.read().index
    }

    pub fn is_synced(&self) -> bool {
        self.watched.read().synced
    }

    /// The suffixes the latest snapshot changed.
    pub fn last_changed(&self) -> Arc<BTreeSet<String>> {
        self.watched.read().last_changed.clone()
    }

    pub async fn synced(&self) {
        self.watched.synced().await
    }

    /// Waits until the cache holds a snapshot at `index` or later.
    pub async fn wait_for_index(&self, index: u64) {
        self.watched.wait_for_index(index).await
    }

    /// Bumps whenever a snapshot changed something.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.watched.subscribe()
    }

    /// Every snapshot's changed suffixes, in order (a lagging receiver is told it missed some).
    pub fn subscribe_changes(&self) -> tokio::sync::broadcast::Receiver<Arc<BTreeSet<String>>> {
        self.watched.subscribe_changes()
    }

    pub fn stats(&self) -> &Arc<WatchStats> {
        self.watched.stats()
    }
}

/// Folds an answer in; the suffixes it changed.
fn apply<T>(st: &mut TreeState<T>, index: u64, entries: &KvList) -> BTreeSet<String> {
    let mut next = BTreeMap::new();
    let mut errors = BTreeMap::new();
    let mut changed = BTreeSet::new();
    for e in entries.iter() {
        let (key, modify_index) = (e.key(), e.modify_index());
        let suffix = key
            .strip_prefix(st.prefix.as_str())
            .unwrap_or(key)
            .to_string();
        if let Some((v, idx)) = st.entries.get(&suffix)
            && *idx == modify_index
        {
            next.insert(suffix, (v.clone(), *idx));
            continue;
        }
        if let Some((idx, r)) = st.errors.get(key)
            && *idx == modify_index
        {
            errors.insert(key.to_string(), (*idx, r.clone()));
            continue;
        }
        match (st.parse)(&suffix, &e.value().unwrap_or_default()) {
            Ok(v) => {
                changed.insert(suffix.clone());
                next.insert(suffix, (Arc::new(v), modify_index));
            }
            Err(reason) => {
                if st.entries.contains_key(&suffix) {
                    changed.insert(suffix.clone());
                }
                tracing::warn!(key = %key, %reason, "ignoring malformed entry");
                errors.insert(key.to_string(), (modify_index, reason));
            }
        }
    }
    for k in st.entries.keys() {
        if !next.contains_key(k) {
            changed.insert(k.clone());
        }
    }
    st.entries = next;
    st.errors = errors;
    st.index = index;
    st.synced = true;
    st.last_changed = Arc::new(changed.clone());
    changed
}

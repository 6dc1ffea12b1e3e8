//! The one watched cache: a prefix kept by one blocking query and folded, answer by answer,
//! into the form its user reads ([`Fold`]). [`crate::TreeCache`] (parsed entries), the label
//! cache (labels with a selector index) and [`crate::DerivedWatch`] (a derived listing) are
//! each a [`Fold`] over this.
//!
//! What its readers get, the same for every cache: a version bumped on the first answer and on
//! every change (`subscribe`), waits for the first answer (`synced`) or for an index
//! (`wait_for_index`), and each change in order (`subscribe_changes`).
//!
//! **Ended** means one thing: the cache was dropped. A watch never ends on its own: errors are
//! retried with backoff for ever (and counted in its [`WatchStats`]). When the cache is dropped
//! its query stops, and every `subscribe` receiver's `changed()` returns `Err`, which its
//! reader must take as "stop" (never as "changed": that would spin).

use std::sync::Arc;

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use tokio::sync::{broadcast, watch};

use super::client::Consul;
use super::kvlist::KvList;
use super::watch::{SinkWatch, WatchConfig, WatchStats};

/// What a watched cache keeps, and how an answer changes it.
pub trait Fold: Send + Sync + 'static {
    /// What one answer (or one own write) changed, for `subscribe_changes`.
    type Changes: Send + Sync + 'static;

    /// Folds the whole answer at `index` in; what it changed, if anything.
    fn fold(&mut self, index: u64, entries: &KvList) -> Option<Self::Changes>;

    /// The index of the last answer (or own write) folded in.
    fn index(&self) -> u64;
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

/// A prefix watched and folded into `F` (see the module doc).
pub struct Watched<F: Fold> {
    state: Arc<RwLock<F>>,
    version: watch::Receiver<u64>,
    /// The index of the last answer applied.
    applied: watch::Receiver<u64>,
    /// Each change, for readers that must not miss one (a `watch` keeps only the latest).
    changes: broadcast::Sender<Arc<F::Changes>>,
    signals: Arc<CacheSignals>,
    watch: SinkWatch,
}

impl<F: Fold> Watched<F> {
    /// Starts the blocking query of `prefix`, folding each answer into `fold`.
    pub fn spawn(
        consul: &Consul,
        prefix: impl Into<String>,
        config: WatchConfig,
        fold: F,
    ) -> Watched<F> {
        let state = Arc::new(RwLock::new(fold));
        let (signals, version, applied) = CacheSignals::new();
        let signals = Arc::new(signals);
        let (changes, _) = broadcast::channel(1024);
        let (st, tx, sig) = (state.clone(), changes.clone(), signals.clone());
        let watch = consul.sink_prefix(prefix, config, move |index, entries| {
            let c = st.write().fold(index, &entries);
            // The raw answer goes before anyone is woken: only the folded form is kept.
            drop(entries);
            let changed = c.is_some();
            if let Some(c) = c {
                let _ = tx.send(Arc::new(c));
            }
            sig.applied(index, changed);
        });
        Watched {
            state,
            version,
            applied,
            changes,
            signals,
            watch,
        }
    }

    pub fn read(&self) -> RwLockReadGuard<'_, F> {
        self.state.read()
    }

    /// For a change the process made itself (its own write, applied before the watch shows
    /// it); tell readers with [`Watched::changed`].
    pub fn write(&self) -> RwLockWriteGuard<'_, F> {
        self.state.write()
    }

    /// Tells readers of a change made through [`Watched::write`].
    pub fn changed(&self, changes: F::Changes) {
        let _ = self.changes.send(Arc::new(changes));
        self.signals.changed();
    }

    /// Waits for the first answer.
    pub async fn synced(&self) {
        let mut v = self.version.clone();
        let _ = v.wait_for(|n| *n > 0).await;
    }

    /// Waits until the cache holds an answer (or own write) at `index` or later.
    pub async fn wait_for_index(&self, index: u64) {
        let mut v = self.applied.clone();
        let _ = v.wait_for(|_| self.state.read().index() >= index).await;
    }

    /// Bumps on the first answer and whenever one changed something.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.clone()
    }

    /// Each change, in order (a lagging receiver is told it missed some).
    pub fn subscribe_changes(&self) -> broadcast::Receiver<Arc<F::Changes>> {
        self.changes.subscribe()
    }

    pub fn stats(&self) -> &Arc<WatchStats> {
        self.watch.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::ConsulConfig;

    /// Counts entries; a change is a different count.
    struct Count {
        index: u64,
        n: usize,
    }

    impl Fold for Count {
        type Changes = usize;
        fn fold(&mut self, index: u64, entries: &KvList) -> Option<usize> {
            self.index = index;
            let before = std::mem::replace(&mut self.n, entries.len());
            (before != self.n).then_some(self.n)
        }
        fn index(&self) -> u64 {
            self.index
        }
    }

    /// An address nothing listens on: the watch fails and retries, and never ends by itself.
    #[tokio::test]
    async fn ended_means_dropped_and_readers_see_it() {
        let consul = Consul::new(ConsulConfig::new("http://127.0.0.1:1")).unwrap();
        let w = Watched::spawn(
            &consul,
            "x/",
            WatchConfig::default(),
            Count { index: 0, n: 0 },
        );
        let mut version = w.subscribe();
        let errors =
            tokio::time::timeout(std::time::Duration::from_millis(300), version.changed()).await;
        assert!(errors.is_err(), "a failing query does not end the cache");
        drop(w);
        let ended = tokio::time::timeout(std::time::Duration::from_secs(5), version.changed())
            .await
            .expect("readers learn the cache ended");
        assert!(ended.is_err(), "ended: the sender is gone, not a change");
    }
}

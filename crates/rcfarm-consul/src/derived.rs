//! A prefix watched and folded into a derived value: a [`Fold`] over the one watched cache.

use std::sync::Arc;

use tokio::sync::watch;

use super::client::Consul;
use super::kvlist::KvList;
use super::watch::{WatchConfig, WatchStats};
use super::watched::{Fold, Watched};

/// A prefix watched and folded into a derived value (a parsed listing), each snapshot derived
/// with the previous result at hand so unchanged entries are not parsed again: a [`Fold`] over
/// the one watched cache ([`Watched`]). Readers get the latest value through a channel.
pub struct DerivedWatch<L: Send + Sync + 'static> {
    rx: watch::Receiver<Option<Arc<L>>>,
    watched: Watched<Derived<L>>,
}

/// The derivation a [`DerivedWatch`] runs on each answer.
type DeriveFn<L> = Box<dyn Fn(u64, &KvList, Option<&L>) -> L + Send + Sync>;

/// What a [`DerivedWatch`] keeps: the derived value (in its channel) and its answer's
/// fingerprint.
pub struct Derived<L> {
    tx: watch::Sender<Option<Arc<L>>>,
    prev: Option<(Arc<L>, u64)>,
    derive: DeriveFn<L>,
    index: u64,
}

impl<L: Send + Sync + 'static> Fold for Derived<L> {
    type Changes = ();

    fn fold(&mut self, index: u64, entries: &KvList) -> Option<()> {
        self.index = index;
        // Every write under the prefix moves some entry's ModifyIndex (a lock taken or
        // released included), so equal digests mean an answer with nothing new in it:
        // subscribers are not woken for it.
        let digest = entries.digest();
        if self.prev.as_ref().is_some_and(|(_, d)| *d == digest) {
            return None;
        }
        let value = Arc::new((self.derive)(
            index,
            entries,
            self.prev.as_ref().map(|(l, _)| &**l),
        ));
        self.prev = Some((value.clone(), digest));
        let _ = self.tx.send(Some(value));
        Some(())
    }

    fn index(&self) -> u64 {
        self.index
    }
}

impl<L: Send + Sync + 'static> DerivedWatch<L> {
    /// Watches `prefix`; `derive(index, entries, previous)` builds each value.
    pub fn spawn(
        consul: &Consul,
        prefix: impl Into<String>,
        config: WatchConfig,
        derive: impl Fn(u64, &KvList, Option<&L>) -> L + Send + Sync + 'static,
    ) -> DerivedWatch<L> {
        let (tx, rx) = watch::channel(None);
        let fold = Derived {
            tx,
            prev: None,
            derive: Box::new(derive),
            index: 0,
        };
        DerivedWatch {
            rx,
            watched: Watched::spawn(consul, prefix, config, fold),
        }
    }

    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<L>>> {
        self.rx.clone()
    }

    pub fn latest(&self) -> Option<Arc<L>> {
        self.rx.borrow().clone()
    }

    pub fn stats(&self) -> &Arc<WatchStats> {
        self.watched.stats()
    }
}

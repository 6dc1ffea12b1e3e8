//! Who is blocked on what: blocking queries register here and are woken only by changes under
//! their own prefix (or to their own key, or to the session table).
//!
//! A commit looks up, for each changed key, only the prefix lengths that some waiter registered,
//! so a write costs a few hash lookups however many queries are blocked.

use std::collections::{BTreeMap, HashMap};

use tokio::sync::oneshot;

/// What a blocked query waits for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum WatchTarget {
    Key(String),
    Prefix(String),
    Sessions,
}

#[derive(Default)]
pub struct Waiters {
    next_id: u64,
    keys: HashMap<String, Vec<(u64, oneshot::Sender<()>)>>,
    prefixes: HashMap<String, Vec<(u64, oneshot::Sender<()>)>>,
    /// How many registered prefixes have each length, so commits probe only those lengths.
    prefix_lengths: BTreeMap<usize, usize>,
    sessions: Vec<(u64, oneshot::Sender<()>)>,
}

impl Waiters {
    /// Registers a waiter; the returned id lets it deregister if it gives up first.
    pub fn register(&mut self, target: &WatchTarget) -> (u64, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        self.next_id += 1;
        let id = self.next_id;
        match target {
            WatchTarget::Key(k) => self.keys.entry(k.clone()).or_default().push((id, tx)),
            WatchTarget::Prefix(p) => {
                let bucket = self.prefixes.entry(p.clone()).or_default();
                if bucket.is_empty() {
                    *self.prefix_lengths.entry(p.len()).or_default() += 1;
                }
                bucket.push((id, tx));
            }
            WatchTarget::Sessions => self.sessions.push((id, tx)),
        }
        (id, rx)
    }

    /// Removes a waiter that timed out or whose request was dropped.
    pub fn deregister(&mut self, target: &WatchTarget, id: u64) {
        match target {
            WatchTarget::Key(k) => {
                if let Some(b) = self.keys.get_mut(k) {
                    b.retain(|(i, _)| *i != id);
                    if b.is_empty() {
                        self.keys.remove(k);
                    }
                }
            }
            WatchTarget::Prefix(p) => {
                if let Some(b) = self.prefixes.get_mut(p) {
                    b.retain(|(i, _)| *i != id);
                    if b.is_empty() {
                        self.prefixes.remove(p);
                        self.drop_length(p.len());
                    }
                }
            }
            WatchTarget::Sessions => self.sessions.retain(|(i, _)| *i != id),
        }
    }

    fn drop_length(&mut self, len: usize) {
        if let Some(n) = self.prefix_lengths.get_mut(&len) {
            *n -= 1;
            if *n == 0 {
                self.prefix_lengths.remove(&len);
            }
        }
    }

    /// Wakes every waiter interested in `key`.
    pub fn key_changed(&mut self, key: &str) {
        if let Some(b) = self.keys.remove(key) {
            fire(b);
        }
        let lengths: Vec<usize> = self
            .prefix_lengths
            .range(..=key.len())
            .map(|(l, _)| *l)
            .collect();
        for len in lengths {
            if !key.is_char_boundary(len) {
                continue;
            }
            if let Some(b) = self.prefixes.remove(&key[..len]) {
                fire(b);
                self.drop_length(len);
            }
        }
    }

    pub fn sessions_changed(&mut self) {
        fire(std::mem::take(&mut self.sessions));
    }

    /// Wakes every blocked query (they evaluate again, and block again if nothing changed).
    pub fn wake_all(&mut self) {
        for (_, b) in self.keys.drain().chain(self.prefixes.drain()) {
            fire(b);
        }
        self.prefix_lengths.clear();
        self.sessions_changed();
    }

    /// Blocked queries right now (for metrics and tests).
    pub fn count(&self) -> usize {
        self.keys.values().map(Vec::len).sum::<usize>()
            + self.prefixes.values().map(Vec::len).sum::<usize>()
            + self.sessions.len()
    }
}

fn fire(waiters: Vec<(u64, oneshot::Sender<()>)>) {
    for (_, tx) in waiters {
        let _ = tx.send(());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wakes_only_matching_prefixes() {
        let mut w = Waiters::default();
        let (_, mut a) = w.register(&WatchTarget::Prefix("rc/".into()));
        let (_, mut b) = w.register(&WatchTarget::Prefix("labels/".into()));
        let (_, mut c) = w.register(&WatchTarget::Key("rc/1".into()));
        let (_, mut d) = w.register(&WatchTarget::Prefix("".into()));
        w.key_changed("rc/2");
        assert!(a.try_recv().is_ok());
        assert!(b.try_recv().is_err());
        assert!(c.try_recv().is_err());
        assert!(d.try_recv().is_ok());
        w.key_changed("rc/1");
        assert!(c.try_recv().is_ok());
        assert_eq!(w.count(), 1);
    }

    #[test]
    fn deregistered_waiters_leave_no_trace() {
        let mut w = Waiters::default();
        let t = WatchTarget::Prefix("x/".into());
        let (id, _rx) = w.register(&t);
        w.deregister(&t, id);
        assert_eq!(w.count(), 0);
        assert!(w.prefix_lengths.is_empty());
    }

    #[test]
    fn multibyte_keys_do_not_panic() {
        let mut w = Waiters::default();
        let (_, mut rx) = w.register(&WatchTarget::Prefix("é".into()));
        let (_, _rx2) = w.register(&WatchTarget::Prefix("a".into()));
        w.key_changed("éa");
        assert!(rx.try_recv().is_ok());
        w.key_changed("\u{1F600}");
    }
}

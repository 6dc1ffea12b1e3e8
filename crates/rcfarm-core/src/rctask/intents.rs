//! What the farm last read of the intents of its pods, for the consistency check: a missing
//! intent, or one that differs from the manifest, is rewritten by the owning RC task.
//!
//! The farm fills it by reading intents in batched read-only transactions (a sweep), tasks
//! update it when they write; reading every intent of every pod on every pass, as P2 does,
//! would cost a request per pod per pass.

use std::collections::{BTreeSet, HashMap};

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::RwLock;

use crate::rc::Manifest;
use crate::scheduler::NodeName;

/// An intent as last read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IntentState {
    Missing,
    /// The manifest digest of a parseable intent.
    Digest(String),
    Unparseable,
}

impl IntentState {
    pub fn from_value(value: Option<&[u8]>) -> IntentState {
        match value {
            None => IntentState::Missing,
            Some(v) => match std::str::from_utf8(v)
                .ok()
                .and_then(|s| Manifest::parse(s).ok())
            {
                Some(m) => IntentState::Digest(m.digest().to_string()),
                None => IntentState::Unparseable,
            },
        }
    }
}

/// `intent/<node>/<pod-id>`.
/// The tree of pod intents (P2's `intent/<node>/<pod id>`).
pub const INTENT_PREFIX: &str = "intent/";

pub fn intent_key(node: &str, pod_id: &str) -> String {
    format!("{INTENT_PREFIX}{node}/{pod_id}")
}

/// What the farm knows of one intent: what it was last read as or written as (`None`: the
/// task removed it), and when (a tick of the view's own clock).
#[derive(Debug)]
struct Entry {
    state: Option<IntentState>,
    at: u64,
}

/// Invariant: an entry a task wrote is replaced only by a later write of its own or by a read
/// that began after it ([`IntentView::read_ticket`]). A sweep's read that began before a
/// task's write and ended after it would otherwise put the older intent back: the RC then
/// sees its own new pod's intent as the old manifest, rewrites it (a repair), and counts that
/// rewrite as a removal, since the node is believed to run another manifest (seen once under
/// load: a roll's new RC held by the removal window it had no reason to touch).
///
/// Kept by pod id, then node, and looked up by `&str`: a sweep at a million pods records
/// 333,000 intents a farm, and a map keyed by `(node, pod id)` built two strings for each
/// lookup and compared whole keys (about 8 % of a converging farm's samples there).
#[derive(Debug, Default)]
pub struct IntentView {
    entries: RwLock<Entries>,
    clock: AtomicU64,
}

/// Pod id → node → what was last read or written there.
type Entries = HashMap<String, HashMap<NodeName, Entry>>;

/// Sets `node`'s entry for `pod_id` to `entry`, unless `stays` says the one there stays.
fn put(
    e: &mut Entries,
    node: &str,
    pod_id: &str,
    entry: Entry,
    stays: impl FnOnce(&Entry) -> bool,
) {
    let nodes = match e.get_mut(pod_id) {
        Some(nodes) => nodes,
        None => e.entry(pod_id.to_string()).or_default(),
    };
    match nodes.get_mut(node) {
        Some(old) if stays(old) => {}
        Some(old) => *old = entry,
        None => {
            nodes.insert(NodeName::from(node), entry);
        }
    }
}

impl IntentView {
    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// A task's own write of the intent.
    pub fn set(&self, node: &str, pod_id: &str, state: IntentState) {
        let at = self.tick();
        let entry = Entry {
            state: Some(state),
            at,
        };
        put(&mut self.entries.write(), node, pod_id, entry, |_| false);
    }

    /// A task's own removal of the intent.
    pub fn remove(&self, node: &str, pod_id: &str) {
        let at = self.tick();
        let entry = Entry { state: None, at };
        put(&mut self.entries.write(), node, pod_id, entry, |_| false);
    }

    /// Taken before a read of intents begins: what it read is recorded with it
    /// ([`IntentView::set_read`]).
    pub fn read_ticket(&self) -> u64 {
        self.tick()
    }

    /// What a read that began at `ticket` found, unless the intent was written (or read by a
    /// read that began) since.
    pub fn set_read(&self, node: &str, pod_id: &str, state: IntentState, ticket: u64) {
        let entry = Entry {
            state: Some(state),
            at: ticket,
        };
        put(&mut self.entries.write(), node, pod_id, entry, |old| {
            old.at > ticket
        });
    }

    /// The nodes (of `nodes`) whose intent for `pod_id` was read as missing or different from
    /// `digest`. Nodes never read are not reported.
    pub fn bad(
        &self,
        pod_id: &str,
        digest: &str,
        nodes: impl IntoIterator<Item = NodeName>,
    ) -> BTreeSet<NodeName> {
        let e = self.entries.read();
        let Some(of_pod) = e.get(pod_id) else {
            return BTreeSet::new();
        };
        nodes
            .into_iter()
            .filter(|n| match of_pod.get(&**n).and_then(|x| x.state.as_ref()) {
                Some(IntentState::Digest(d)) => d != digest,
                Some(_) => true,
                None => false,
            })
            .collect()
    }

    /// Whether `node`'s intent for `pod_id` was read as another manifest than `digest` (a
    /// rewrite replaces the pod that runs there).
    pub fn runs_other(&self, node: &str, pod_id: &str, digest: &str) -> bool {
        matches!(
            self.entries.read().get(pod_id).and_then(|nodes| nodes.get(node)),
            Some(Entry { state: Some(IntentState::Digest(d)), .. }) if d != digest
        )
    }

    /// Keeps only the `(node, pod id)` pairs `keep` answers `true` for (the pods the farm
    /// still owns).
    pub fn retain(&self, keep: impl Fn(&str, &str) -> bool) {
        self.entries.write().retain(|pod_id, nodes| {
            nodes.retain(|node, _| keep(node, pod_id));
            !nodes.is_empty()
        });
    }

    pub fn len(&self) -> usize {
        self.entries.read().values().map(HashMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_missing_and_different_intents_only() {
        let v = IntentView::default();
        let m = Manifest::parse("id: web\n").unwrap();
        v.set("a", "web", IntentState::Digest(m.digest().into()));
        v.set("b", "web", IntentState::Missing);
        v.set(
            "c",
            "web",
            IntentState::from_value(Some(b"id: web\nother: 1\n")),
        );
        v.set("d", "web", IntentState::from_value(Some(b"{{{")));
        let bad = v.bad(
            "web",
            m.digest(),
            ["a", "b", "c", "d", "e"].map(NodeName::from),
        );
        assert_eq!(
            bad,
            ["b", "c", "d"].map(NodeName::from).into_iter().collect()
        );
        assert_eq!(
            IntentState::from_value(Some(b"id: web\n# reformatted\n")),
            IntentState::Digest(m.digest().into())
        );
    }

    /// A sweep of every pod the farm serves forgets the others, node by node.
    #[test]
    fn retain_keeps_only_the_pairs_asked_for() {
        let v = IntentView::default();
        for (node, pod) in [("a", "web"), ("b", "web"), ("a", "db"), ("c", "cache")] {
            v.set(node, pod, IntentState::Missing);
        }
        assert_eq!(v.len(), 4);
        v.retain(|node, pod| (node, pod) == ("a", "web") || pod == "db");
        assert_eq!(v.len(), 2);
        let all = ["a", "b", "c"].map(NodeName::from);
        assert_eq!(v.bad("web", "x", all.clone()), [NodeName::from("a")].into());
        assert_eq!(v.bad("db", "x", all.clone()), [NodeName::from("a")].into());
        assert!(v.bad("cache", "x", all).is_empty(), "forgotten");
        v.retain(|_, _| false);
        assert!(v.is_empty());
    }

    /// A read that began before a task's own write does not put the older intent back; one
    /// that began after it does (an operator may have changed it since).
    #[test]
    fn a_read_older_than_a_write_does_not_undo_it() {
        let v = IntentView::default();
        let (old, new) = (
            Manifest::parse("id: web\nversion: old\n").unwrap(),
            Manifest::parse("id: web\nversion: new\n").unwrap(),
        );
        let before = v.read_ticket();
        v.set("a", "web", IntentState::Digest(new.digest().into()));
        v.remove("b", "web");
        v.set_read("a", "web", IntentState::Digest(old.digest().into()), before);
        v.set_read("b", "web", IntentState::Digest(old.digest().into()), before);
        assert!(v.bad("web", new.digest(), [NodeName::from("a")]).is_empty());
        assert!(!v.runs_other("a", "web", new.digest()));
        assert!(
            !v.runs_other("b", "web", new.digest()),
            "removed, not read since"
        );

        let after = v.read_ticket();
        v.set_read("a", "web", IntentState::Digest(old.digest().into()), after);
        assert!(v.runs_other("a", "web", new.digest()));
        // An older read finishing last does not undo a newer read either.
        v.set_read("a", "web", IntentState::Missing, before);
        assert!(v.runs_other("a", "web", new.digest()));
    }
}

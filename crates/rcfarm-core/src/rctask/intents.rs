//! What the farm last read of the intents of its pods, for the consistency check: a missing
//! intent, or one that differs from the manifest, is rewritten by the owning RC task.
//!
//! The farm fills it by reading intents in batched read-only transactions (a sweep), tasks
//! update it when they write; reading every intent of every pod on every pass, as P2 does,
//! would cost a request per pod per pass.

use std::collections::{BTreeMap, BTreeSet};

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

#[derive(Debug, Default)]
pub struct IntentView {
    entries: RwLock<BTreeMap<(String, String), IntentState>>,
}

impl IntentView {
    pub fn set(&self, node: &str, pod_id: &str, state: IntentState) {
        self.entries
            .write()
            .insert((node.to_string(), pod_id.to_string()), state);
    }

    pub fn remove(&self, node: &str, pod_id: &str) {
        self.entries
            .write()
            .remove(&(node.to_string(), pod_id.to_string()));
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
        nodes
            .into_iter()
            .filter(|n| match e.get(&(n.to_string(), pod_id.to_string())) {
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
            self.entries.read().get(&(node.to_string(), pod_id.to_string())),
            Some(IntentState::Digest(d)) if d != digest
        )
    }

    /// Keeps only the given `(node, pod)` pairs (the pods the farm still owns).
    pub fn retain(&self, keep: &BTreeSet<(String, String)>) {
        self.entries.write().retain(|k, _| keep.contains(k));
    }

    pub fn len(&self) -> usize {
        self.entries.read().len()
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
}

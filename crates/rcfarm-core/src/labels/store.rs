//! P2's label store: `labels/<type>/<id>` holds a flat JSON object of string labels.
//!
//! Writes are read-modify-write with CAS on the key's `ModifyIndex` (bounded retries), or
//! transaction ops so a label change can join another transaction (an RC's scheduling write).

use std::collections::BTreeMap;

use crate::consul::{Consul, ConsulError, KvEntry, KvPair, QueryOptions, TxnFailure, TxnOp};

/// A label map.
pub type LabelSet = BTreeMap<String, String>;

/// The label trees P2 defines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LabelType {
    Node,
    Pod,
    ReplicationController,
    PodClusters,
    Rolls,
}

impl LabelType {
    pub const ALL: [LabelType; 5] = [
        LabelType::Node,
        LabelType::Pod,
        LabelType::ReplicationController,
        LabelType::PodClusters,
        LabelType::Rolls,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            LabelType::Node => "node",
            LabelType::Pod => "pod",
            LabelType::ReplicationController => "replication_controller",
            LabelType::PodClusters => "pod_clusters",
            LabelType::Rolls => "rolls",
        }
    }

    pub fn parse(s: &str) -> Option<LabelType> {
        LabelType::ALL.into_iter().find(|t| t.as_str() == s)
    }

    /// `labels/<type>/`.
    pub fn prefix(self) -> String {
        format!("labels/{}/", self.as_str())
    }

    /// `labels/<type>/<id>`.
    pub fn key(self, id: &str) -> String {
        format!("labels/{}/{}", self.as_str(), id)
    }
}

impl std::fmt::Display for LabelType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The id of a pod's label entry: `<node>/<pod-id>`.
pub fn pod_label_id(node: &str, pod_id: &str) -> String {
    format!("{node}/{pod_id}")
}

/// Splits a pod label id into node and pod id.
pub fn split_pod_label_id(id: &str) -> Option<(&str, &str)> {
    id.split_once('/')
        .filter(|(n, p)| !n.is_empty() && !p.is_empty() && !p.contains('/'))
}

#[derive(Debug, thiserror::Error)]
pub enum LabelsError {
    #[error(transparent)]
    Consul(#[from] ConsulError),
    #[error("{key}: {reason}")]
    Malformed { key: String, reason: String },
    #[error("{key} kept changing under us; gave up after {attempts} attempts")]
    Contended { key: String, attempts: u32 },
    #[error("{0}")]
    Invalid(String),
}

/// Parses a label value: a JSON object of strings. An empty value is an empty set.
pub fn parse_labels(value: &[u8]) -> Result<LabelSet, String> {
    if value.iter().all(u8::is_ascii_whitespace) {
        return Ok(LabelSet::new());
    }
    let v: serde_json::Value =
        serde_json::from_slice(value).map_err(|e| format!("not JSON: {e}"))?;
    match v {
        serde_json::Value::Null => Ok(LabelSet::new()),
        serde_json::Value::Object(m) => m
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => Ok((k, s)),
                other => Err(format!("label {k:?} is {other}, not a string")),
            })
            .collect(),
        other => Err(format!(
            "labels must be a JSON object of strings, found {}",
            json_kind(&other)
        )),
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// Encodes labels as P2 does: a JSON object with sorted keys.
pub fn encode_labels(labels: &LabelSet) -> Vec<u8> {
    // A BTreeMap of strings always serializes.
    serde_json::to_vec(labels).unwrap_or_else(|_| b"{}".to_vec())
}

/// Validates label keys and values with Kubernetes' rules (what selectors can match).
pub fn validate_labels(labels: &LabelSet) -> Result<(), String> {
    for (k, v) in labels {
        super::selector::validate_key(k)?;
        super::selector::validate_value(v)?;
    }
    Ok(())
}

/// One entry of a label tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Labeled {
    pub id: String,
    pub labels: LabelSet,
    pub modify_index: u64,
}

/// Reads and writes label maps.
#[derive(Debug, Clone)]
pub struct LabelStore {
    consul: Consul,
    retries: u32,
}

impl LabelStore {
    pub fn new(consul: Consul) -> Self {
        Self {
            consul,
            retries: 10,
        }
    }

    /// The labels of one object and the key's `ModifyIndex` (0 if absent; absent = no labels).
    pub async fn get(&self, t: LabelType, id: &str) -> Result<(LabelSet, u64), LabelsError> {
        let key = t.key(id);
        let (entry, _) = self.consul.kv_get(&key, &QueryOptions::default()).await?;
        match entry {
            None => Ok((LabelSet::new(), 0)),
            Some(e) => {
                let labels = parse_labels(e.value_bytes())
                    .map_err(|reason| LabelsError::Malformed { key, reason })?;
                Ok((labels, e.modify_index))
            }
        }
    }

    /// Every entry of a tree; malformed entries are returned apart, never failing the list.
    pub async fn list(
        &self,
        t: LabelType,
    ) -> Result<(Vec<Labeled>, Vec<LabelsError>), LabelsError> {
        let (entries, _) = self
            .consul
            .kv_list(&t.prefix(), &QueryOptions::default())
            .await?;
        Ok(parse_tree(t, &entries))
    }

    /// Replaces the whole map if the key is still at `index` (0: only if absent).
    pub async fn set_cas(
        &self,
        t: LabelType,
        id: &str,
        labels: &LabelSet,
        index: u64,
    ) -> Result<bool, LabelsError> {
        validate_labels(labels).map_err(LabelsError::Invalid)?;
        Ok(self
            .consul
            .kv_cas(&t.key(id), &encode_labels(labels), index, None)
            .await?)
    }

    /// Replaces the whole map unconditionally.
    pub async fn set(&self, t: LabelType, id: &str, labels: &LabelSet) -> Result<(), LabelsError> {
        validate_labels(labels).map_err(LabelsError::Invalid)?;
        self.consul
            .kv_put(&t.key(id), &encode_labels(labels), None)
            .await?;
        Ok(())
    }

    /// Sets some labels and removes others, keeping the rest: read, change, CAS, retried a
    /// bounded number of times when another writer gets in between. Returns the new map.
    pub async fn apply(
        &self,
        t: LabelType,
        id: &str,
        set: &LabelSet,
        remove: &[String],
    ) -> Result<LabelSet, LabelsError> {
        validate_labels(set).map_err(LabelsError::Invalid)?;
        let key = t.key(id);
        let mut backoff = crate::util::Backoff::new(
            std::time::Duration::from_millis(5),
            std::time::Duration::from_millis(200),
        );
        for attempt in 0..self.retries {
            if attempt > 0 {
                // Spread the losers of a race out so they do not collide again.
                tokio::time::sleep(backoff.next_delay()).await;
            }
            let (current, index) = self.get(t, id).await?;
            let next = merged(&current, set, remove);
            if next == current && index != 0 {
                return Ok(next);
            }
            let ops = [mutation_op(&key, &next, index)];
            match self.consul.txn(&ops).await {
                Ok(_) => return Ok(next),
                Err(e) if e.failed_at(0, TxnFailure::IndexStale) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(LabelsError::Contended {
            key,
            attempts: self.retries,
        })
    }

    /// Deletes an object's labels.
    pub async fn remove_all(&self, t: LabelType, id: &str) -> Result<(), LabelsError> {
        self.consul.kv_delete(&t.key(id)).await?;
        Ok(())
    }

    /// A transaction op replacing the whole map.
    pub fn set_op(t: LabelType, id: &str, labels: &LabelSet) -> TxnOp {
        TxnOp::set(t.key(id), encode_labels(labels))
    }

    /// A transaction op deleting the object's labels.
    pub fn delete_op(t: LabelType, id: &str) -> TxnOp {
        TxnOp::delete(t.key(id))
    }

    /// P2's `mutateLabelsTxn`: the op that turns the map read at `index` into `current` with
    /// `set` applied and `remove` removed, failing the transaction if the key changed since.
    pub fn apply_op(
        t: LabelType,
        id: &str,
        current: &LabelSet,
        index: u64,
        set: &LabelSet,
        remove: &[String],
    ) -> TxnOp {
        mutation_op(&t.key(id), &merged(current, set, remove), index)
    }
}

fn merged(current: &LabelSet, set: &LabelSet, remove: &[String]) -> LabelSet {
    let mut next = current.clone();
    for k in remove {
        next.remove(k);
    }
    next.extend(set.iter().map(|(k, v)| (k.clone(), v.clone())));
    next
}

/// CAS to the new map, or delete-cas when it became empty (P2 removes empty label keys).
fn mutation_op(key: &str, next: &LabelSet, index: u64) -> TxnOp {
    if next.is_empty() {
        TxnOp::delete_cas(key, index)
    } else {
        TxnOp::cas(key, encode_labels(next), index)
    }
}

/// Parses a tree listing into entries and per-key errors.
pub fn parse_tree(t: LabelType, entries: &[KvPair]) -> (Vec<Labeled>, Vec<LabelsError>) {
    let prefix = t.prefix();
    let mut ok = Vec::with_capacity(entries.len());
    let mut bad = Vec::new();
    for e in entries {
        match parse_entry(t, &prefix, e) {
            Ok(l) => ok.push(l),
            Err(reason) => bad.push(LabelsError::Malformed {
                key: e.key.clone(),
                reason,
            }),
        }
    }
    (ok, bad)
}

pub(crate) fn parse_entry(t: LabelType, prefix: &str, e: &impl KvEntry) -> Result<Labeled, String> {
    let id = e
        .key()
        .strip_prefix(prefix)
        .ok_or_else(|| format!("not under {prefix}"))?;
    if id.is_empty() {
        return Err("empty id".into());
    }
    if t == LabelType::Pod && split_pod_label_id(id).is_none() {
        return Err(format!(
            "malformed pod label id {id:?}: expected <node>/<pod-id>"
        ));
    }
    let labels = parse_labels(&e.value())?;
    Ok(Labeled {
        id: id.to_string(),
        labels,
        modify_index: e.modify_index(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects_label_values() {
        assert_eq!(
            parse_labels(br#"{"a":"1"}"#)
                .unwrap()
                .get("a")
                .map(String::as_str),
            Some("1")
        );
        assert!(parse_labels(b"").unwrap().is_empty());
        assert!(parse_labels(b"null").unwrap().is_empty());
        assert!(parse_labels(b"[1]").unwrap_err().contains("JSON object"));
        assert!(
            parse_labels(br#"{"a":1}"#)
                .unwrap_err()
                .contains("not a string")
        );
        assert!(parse_labels(b"{").unwrap_err().contains("not JSON"));
    }

    #[test]
    fn pod_label_ids() {
        assert_eq!(split_pod_label_id("n1/web"), Some(("n1", "web")));
        assert_eq!(split_pod_label_id("n1"), None);
        assert_eq!(split_pod_label_id("n1/a/b"), None);
        assert_eq!(pod_label_id("n1", "web"), "n1/web");
    }

    #[test]
    fn mutation_ops_cas_or_delete_when_empty() {
        let current: LabelSet = [("a".to_string(), "1".to_string())].into();
        let op = LabelStore::apply_op(
            LabelType::Node,
            "n",
            &current,
            7,
            &LabelSet::new(),
            &["a".into()],
        );
        assert_eq!(op, TxnOp::delete_cas("labels/node/n", 7));
        let set: LabelSet = [("b".to_string(), "2".to_string())].into();
        let op = LabelStore::apply_op(LabelType::Node, "n", &current, 7, &set, &[]);
        assert_eq!(
            op,
            TxnOp::cas("labels/node/n", br#"{"a":"1","b":"2"}"#.to_vec(), 7)
        );
    }
}

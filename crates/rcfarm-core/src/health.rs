//! Pod health as P2's preparer reports it: `health/<pod-id>/<node>` holds a JSON result whose
//! `Status` is `passing`, `warning`, `unknown` or `critical` (P2 writes Go field names; a
//! lower-case `status` is accepted too).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::consul::{Consul, TreeCache, WatchConfig};

pub const HEALTH_PREFIX: &str = "health/";

/// A pod's health, best first (P2's order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HealthStatus {
    Passing,
    Warning,
    Unknown,
    Critical,
}

impl HealthStatus {
    /// P2's `ToHealthState`: anything unrecognised is unknown.
    pub fn parse(s: &str) -> HealthStatus {
        match s {
            "passing" => HealthStatus::Passing,
            "warning" => HealthStatus::Warning,
            "critical" => HealthStatus::Critical,
            _ => HealthStatus::Unknown,
        }
    }

    pub fn is_passing(self) -> bool {
        self == HealthStatus::Passing
    }
}

/// Parses one health value.
pub fn parse_health(value: &[u8]) -> Result<HealthStatus, String> {
    let v: serde_json::Value =
        serde_json::from_slice(value).map_err(|e| format!("not JSON: {e}"))?;
    let obj = v
        .as_object()
        .ok_or("a health result must be a JSON object")?;
    let status = obj
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("status"))
        .map(|(_, v)| v)
        .ok_or("the health result has no Status")?;
    let s = status.as_str().ok_or("Status must be a string")?;
    Ok(HealthStatus::parse(s))
}

/// Whether a health result (its key's `ModifyIndex`) speaks of what the node runs now (the
/// `ModifyIndex` of `reality/<node>/<pod-id>`, absent if the node reports nothing): only a
/// result written after the reality it is about counts, so a pod replaced in place is not taken
/// for up on the result of the pod it replaced. A pod whose manifest has no status port
/// (`checked` false) is never checked by P2's preparer, which writes "passing" once and never
/// again: its result counts as P2's own roll farm counts it.
pub fn speaks_of_reality(health_index: u64, reality_index: Option<u64>, checked: bool) -> bool {
    !checked || reality_index.is_some_and(|r| health_index > r)
}

/// The health tree, watched with one blocking query.
pub struct HealthCache {
    tree: TreeCache<HealthStatus>,
}

impl HealthCache {
    pub fn spawn(consul: &Consul, config: WatchConfig) -> HealthCache {
        let parse = Arc::new(
            |suffix: &str, value: &[u8]| -> Result<HealthStatus, String> {
                match suffix.split_once('/') {
                    Some((pod, node))
                        if !pod.is_empty() && !node.is_empty() && !node.contains('/') =>
                    {
                        parse_health(value)
                    }
                    _ => Err(format!(
                        "expected health/<pod-id>/<node>, found health/{suffix}"
                    )),
                }
            },
        );
        HealthCache {
            tree: TreeCache::spawn(consul, HEALTH_PREFIX, config, parse),
        }
    }

    /// The health of a pod on one node, if reported.
    pub fn status(&self, pod_id: &str, node: &str) -> Option<HealthStatus> {
        self.tree.get(&format!("{pod_id}/{node}")).map(|s| *s)
    }

    /// The health of a pod on one node with its key's `ModifyIndex`, if reported.
    pub fn status_with_index(&self, pod_id: &str, node: &str) -> Option<(HealthStatus, u64)> {
        self.tree
            .get_with_index(&format!("{pod_id}/{node}"))
            .map(|(s, i)| (*s, i))
    }

    /// Every reported result of a pod, by node.
    pub fn for_pod(&self, pod_id: &str) -> BTreeMap<String, HealthStatus> {
        let sub = format!("{pod_id}/");
        self.tree
            .range(&sub)
            .into_iter()
            .map(|(k, v)| (k[sub.len()..].to_string(), *v))
            .collect()
    }

    pub fn tree(&self) -> &TreeCache<HealthStatus> {
        &self.tree
    }

    /// Every snapshot's changed `<pod-id>/<node>` suffixes, in order.
    pub fn subscribe_changes(
        &self,
    ) -> tokio::sync::broadcast::Receiver<Arc<std::collections::BTreeSet<String>>> {
        self.tree.subscribe_changes()
    }
}

/// The pod ids among changed `<pod-id>/<node>` suffixes.
pub fn changed_pods(
    keys: &std::collections::BTreeSet<String>,
) -> std::collections::BTreeSet<String> {
    keys.iter()
        .filter_map(|k| k.split_once('/').map(|(p, _)| p.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_p2_and_lowercase_results() {
        let p2 = br#"{"Id":"web","Node":"n1","Service":"web","Status":"passing","Time":"2019-01-01T00:00:00Z"}"#;
        assert_eq!(parse_health(p2), Ok(HealthStatus::Passing));
        assert_eq!(
            parse_health(br#"{"status":"critical"}"#),
            Ok(HealthStatus::Critical)
        );
        assert_eq!(
            parse_health(br#"{"status":"sideways"}"#),
            Ok(HealthStatus::Unknown)
        );
        assert!(parse_health(b"[]").is_err());
        assert!(parse_health(br#"{"Status":3}"#).is_err());
        assert!(parse_health(b"{").is_err());
        assert!(HealthStatus::Passing < HealthStatus::Critical);
    }
}

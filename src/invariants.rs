//! An observer of every committed write (the embedded server's commit log) that checks the
//! farms' promises, for tests and the chaos run:
//!
//! - **fencing**: every write to a pod's intent or labels carries a `check-session` on the lock
//!   of the RC the pod belongs to, by the session holding that lock at that moment;
//! - **never too many pods**: no write raises an RC's pod count above its desired count (+1
//!   while its node-transfer status key exists).
//!
//! It also counts scheduling transactions and audit records, to check that every committed
//! change reached the audit log.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde_json::Value;

use crate::audit::{AUDIT_PREFIX, AuditRecord, events};
use crate::labels::parse_labels;
use crate::rc::{RC_ID_LABEL, RC_LOCK_PREFIX, RC_PREFIX};
use crate::server::{Change, LoggedCommit};

/// A broken promise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub index: u64,
    pub what: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "at index {}: {}", self.index, self.what)
    }
}

/// Replays commits in order.
#[derive(Debug, Default)]
pub struct Observer {
    kv: HashMap<String, Vec<u8>>,
    sessions: HashMap<String, String>,
    /// RC id → pod label keys carrying it.
    pods: HashMap<String, BTreeSet<String>>,
    pub violations: Vec<Violation>,
    /// Fenced commits that touched pods.
    pub fenced_writes: u64,
    /// Commits that carried a `REPLICATION_CONTROLLER_RETARGET` record.
    pub retarget_commits: u64,
    /// The ids of every audit record ever written.
    pub audit_ids: BTreeSet<String>,
    pub commits: u64,
}

fn pod_key(k: &str) -> Option<(&str, &str)> {
    let rest = k
        .strip_prefix("intent/")
        .or_else(|| k.strip_prefix("labels/pod/"))?;
    rest.split_once('/')
}

impl Observer {
    fn rc_of_pod(&self, node: &str, pod: &str) -> Option<String> {
        let l = self.kv.get(&format!("labels/pod/{node}/{pod}"))?;
        parse_labels(l).ok()?.get(RC_ID_LABEL).cloned()
    }

    fn desired(&self, rc: &str) -> i64 {
        self.kv
            .get(&format!("{RC_PREFIX}{rc}"))
            .and_then(|v| serde_json::from_slice::<Value>(v).ok())
            .and_then(|v| v["replicas_desired"].as_i64())
            .unwrap_or(0)
    }

    fn count(&self, rc: &str) -> usize {
        self.pods.get(rc).map_or(0, BTreeSet::len)
    }

    fn set(&mut self, key: &str, value: Option<(&[u8], Option<&String>)>) {
        if key.starts_with("labels/pod/") {
            if let Some(old) = self
                .kv
                .get(key)
                .and_then(|v| parse_labels(v).ok())
                .and_then(|l| l.get(RC_ID_LABEL).cloned())
                && let Some(s) = self.pods.get_mut(&old)
            {
                s.remove(key);
            }
            if let Some(new) = value
                .and_then(|(v, _)| parse_labels(v).ok())
                .and_then(|l| l.get(RC_ID_LABEL).cloned())
            {
                self.pods.entry(new).or_default().insert(key.to_string());
            }
        }
        match value {
            Some((v, session)) => {
                self.kv.insert(key.to_string(), v.to_vec());
                match session {
                    Some(s) => self.sessions.insert(key.to_string(), s.clone()),
                    None => self.sessions.remove(key),
                };
            }
            None => {
                self.kv.remove(key);
                self.sessions.remove(key);
            }
        }
    }

    /// Checks and applies one commit.
    pub fn observe(&mut self, c: &LoggedCommit) {
        self.commits += 1;
        let pod_keys: Vec<(String, String)> = c
            .changes
            .iter()
            .filter_map(|ch| match ch {
                Change::Put(k, _) | Change::Delete(k) => {
                    pod_key(k).map(|(n, p)| (n.to_string(), p.to_string()))
                }
                _ => None,
            })
            .collect();
        let mut touched: BTreeSet<String> = pod_keys
            .iter()
            .filter_map(|(n, p)| self.rc_of_pod(n, p))
            .collect();
        let before: BTreeMap<String, usize> = touched
            .iter()
            .map(|rc| (rc.clone(), self.count(rc)))
            .collect();
        let holders: HashMap<String, String> = if pod_keys.is_empty() {
            HashMap::new()
        } else {
            self.sessions
                .iter()
                .filter(|(k, _)| k.starts_with(RC_LOCK_PREFIX))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        };
        for ch in &c.changes {
            match ch {
                Change::Put(k, e) => {
                    if let Some(id) = k.strip_prefix(AUDIT_PREFIX) {
                        self.audit_ids.insert(id.to_string());
                        if AuditRecord::from_kv(k, &e.value)
                            .is_ok_and(|r| r.event_type == events::RC_RETARGET)
                        {
                            self.retarget_commits += 1;
                        }
                    }
                    self.set(k, Some((&e.value, e.session.as_ref())));
                }
                Change::Delete(k) => self.set(k, None),
                Change::DeleteTree(p) => {
                    let keys: Vec<String> = self
                        .kv
                        .keys()
                        .filter(|k| k.starts_with(p.as_str()))
                        .cloned()
                        .collect();
                    for k in keys {
                        self.set(&k, None);
                    }
                }
                _ => {}
            }
        }
        touched.extend(pod_keys.iter().filter_map(|(n, p)| self.rc_of_pod(n, p)));
        if touched.is_empty() {
            return;
        }
        if c.checks.is_empty() {
            self.violations.push(Violation {
                index: c.index,
                what: format!("unfenced write to the pods of {touched:?}"),
            });
            return;
        }
        self.fenced_writes += 1;
        for rc in &touched {
            let lock = format!("{RC_LOCK_PREFIX}{rc}");
            let Some((_, session)) = c.checks.iter().find(|(k, _)| k == &lock) else {
                self.violations.push(Violation {
                    index: c.index,
                    what: format!("write to the pods of {rc} not fenced by its lock"),
                });
                continue;
            };
            if holders.get(&lock) != Some(session) {
                self.violations.push(Violation {
                    index: c.index,
                    what: format!(
                        "write to {rc} by session {session}, which did not hold its lock"
                    ),
                });
            }
            let after = self.count(rc);
            let was = before.get(rc).copied().unwrap_or(0);
            let transfer = self.kv.contains_key(&format!(
                "status/replication_controllers/{rc}/replication_controller"
            ));
            let limit = self.desired(rc).max(0) as usize + usize::from(transfer);
            if after > was && after > limit {
                self.violations.push(Violation {
                    index: c.index,
                    what: format!(
                        "{rc} raised to {after} pods, desired {} (transfer in flight: {transfer})",
                        self.desired(rc)
                    ),
                });
            }
        }
    }

    /// Observes a whole log.
    pub fn replay(log: &[LoggedCommit]) -> Observer {
        let mut o = Observer::default();
        for c in log {
            o.observe(c);
        }
        o
    }

    /// Current pods per RC id (label keys carrying the RC's id).
    pub fn pods_of(&self, rc: &str) -> usize {
        self.count(rc)
    }
}

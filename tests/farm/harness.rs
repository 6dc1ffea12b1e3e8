//! A cluster for farm tests: the embedded server in this process (recording every commit), real
//! `rcfarm serve` processes around it, and helpers to set up nodes and RCs and to check what
//! the farms did.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rcfarm::consul::{Consul, QueryOptions};
use rcfarm::labels::{LabelSet, LabelStore, LabelType, parse_labels, split_pod_label_id};
use rcfarm::rc::{RcId, RcStore};
use rcfarm::server::{Change, EmbeddedServer, LoggedCommit, ServerConfig};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::common::{client, init_tracing};

pub const BIN: &str = env!("CARGO_BIN_EXE_rcfarm");
/// Session TTL the test farms use (the server accepts down to 1 s).
pub const TTL: Duration = Duration::from_secs(2);

pub struct FarmProc {
    pub id: String,
    pub child: Child,
    pub pid: u32,
    pub log: Arc<Mutex<String>>,
}

pub struct Cluster {
    pub server: EmbeddedServer,
    pub consul: Consul,
    pub farms: Vec<FarmProc>,
    /// The SQLite audit database every farm of the cluster ships to.
    pub audit_db: String,
    _dir: tempfile::TempDir,
}

pub fn signal(pid: u32, sig: &str) {
    let st = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .expect("kill runs");
    assert!(st.success(), "kill -{sig} {pid}");
}

impl Cluster {
    pub async fn start() -> Cluster {
        init_tracing();
        let server = EmbeddedServer::start(ServerConfig {
            session_ttl_min: Duration::from_secs(1),
            record_commits: true,
            ..ServerConfig::ephemeral()
        })
        .await
        .unwrap();
        let consul = client(&server);
        let dir = tempfile::tempdir().unwrap();
        let audit_db = format!("sqlite://{}", dir.path().join("audit.db").display());
        Cluster {
            server,
            consul,
            farms: Vec::new(),
            audit_db,
            _dir: dir,
        }
    }

    /// Starts `rcfarm serve --farm-id <id>` with short timers, plus `extra` flags.
    pub async fn spawn_farm(&mut self, id: &str, extra: &[&str]) -> usize {
        let mut cmd = Command::new(BIN);
        cmd.args(["serve", "--consul", &self.server.url(), "--farm-id", id])
            .args([
                "--session-ttl",
                "2s",
                "--lock-delay",
                "500ms",
                "--resync-interval",
                "1s",
            ])
            .args([
                "--consistency-interval",
                "1s",
                "--claim-grace",
                "1s",
                "--watch-wait",
                "30s",
            ])
            .args(["--audit-db", &self.audit_db])
            .args(["--http", "127.0.0.1:0"])
            .args(extra)
            .env("RUST_LOG", "info,rcfarm=debug")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().expect("rcfarm serve starts");
        let pid = child.id().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let sink = log.clone();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        tokio::spawn(async move {
            while let Ok(Some(l)) = lines.next_line().await {
                let mut s = sink.lock();
                s.push_str(&l);
                s.push('\n');
            }
        });
        self.farms.push(FarmProc {
            id: id.to_string(),
            child,
            pid,
            log,
        });
        self.farms.len() - 1
    }

    pub fn farm_log(&self, i: usize) -> String {
        self.farms[i].log.lock().clone()
    }

    pub async fn label_node(&self, node: &str, labels: &[(&str, &str)]) {
        let l: LabelSet = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LabelStore::new(self.consul.clone())
            .set(LabelType::Node, node, &l)
            .await
            .unwrap();
    }

    /// Writes an RC the way a P2 tool (or `curl -X PUT`) would: the raw JSON record.
    pub async fn put_rc(
        &self,
        id: RcId,
        pod_id: &str,
        selector: &str,
        replicas: i64,
        strategy: &str,
    ) {
        let record = serde_json::json!({
            "id": id.to_string(),
            "manifest": format!("id: {pod_id}\nlaunchables:\n  app:\n    launchable_type: hoist\n"),
            "node_selector": selector,
            "pod_labels": {"availability_zone": "az1", "cluster_name": "test"},
            "replicas_desired": replicas,
            "disabled": false,
            "allocation_strategy": strategy,
        });
        self.consul
            .kv_put(&id.key(), record.to_string().as_bytes(), None)
            .await
            .unwrap();
    }

    /// Rewrites one field of a stored RC record directly in KV.
    pub async fn patch_rc(&self, id: RcId, field: &str, value: Value) {
        let (e, _) = self
            .consul
            .kv_get(&id.key(), &QueryOptions::default())
            .await
            .unwrap();
        let mut v: Value = serde_json::from_slice(e.unwrap().value_bytes()).unwrap();
        v[field] = value;
        self.consul
            .kv_put(&id.key(), v.to_string().as_bytes(), None)
            .await
            .unwrap();
    }

    /// Audit records of one type, wherever they are now: shipped to SQL or still in the Consul
    /// outbox (by id, so a record in both counts once). Details only.
    pub async fn audit_events(&self, event_type: &str) -> Vec<Value> {
        let mut by_id: BTreeMap<String, Value> = BTreeMap::new();
        if let Ok(store) = rcfarm::audit::AuditStore::connect(&self.audit_db).await {
            let q = rcfarm::audit::AuditQuery {
                event_type: Some(event_type.to_string()),
                limit: Some(1000),
                ..Default::default()
            };
            for r in store.query(&q).await.unwrap().records {
                by_id.insert(r.id.clone(), r.details);
            }
            store.close().await;
        }
        let (entries, _) = self
            .consul
            .kv_list("audit_logs/", &QueryOptions::default())
            .await
            .unwrap();
        for e in entries {
            if let Ok(r) = rcfarm::audit::AuditRecord::from_kv(&e.key, e.value_bytes())
                && r.event_type == event_type
            {
                by_id.insert(r.id.to_string(), r.event_details);
            }
        }
        by_id.into_values().collect()
    }

    /// RC → session holding its ownership lock.
    pub async fn owners(&self) -> BTreeMap<RcId, String> {
        let (holders, _) = RcStore::new(self.consul.clone())
            .lock_holders()
            .await
            .unwrap();
        holders
            .into_iter()
            .filter_map(|(id, h)| h.ownership.map(|(s, _)| (id, s)))
            .collect()
    }

    /// Session → farm id, from the farm registry.
    pub async fn farm_sessions(&self) -> BTreeMap<String, String> {
        let (entries, _) = self
            .consul
            .kv_list("rcfarm/farms/", &QueryOptions::default())
            .await
            .unwrap();
        entries
            .iter()
            .filter(|e| e.session.is_some())
            .filter_map(|e| {
                let v: Value = serde_json::from_slice(e.value_bytes()).ok()?;
                Some((
                    v["session"].as_str()?.to_string(),
                    v["farm_id"].as_str()?.to_string(),
                ))
            })
            .collect()
    }

    /// RC → farm id owning it.
    pub async fn owner_farms(&self) -> BTreeMap<RcId, String> {
        let sessions = self.farm_sessions().await;
        self.owners()
            .await
            .into_iter()
            .filter_map(|(rc, s)| sessions.get(&s).map(|f| (rc, f.clone())))
            .collect()
    }

    /// RC → the nodes its pods are on (pods with an intent and labels).
    pub async fn placements(&self) -> BTreeMap<RcId, BTreeSet<String>> {
        let (labels, _) = self
            .consul
            .kv_list("labels/pod/", &QueryOptions::default())
            .await
            .unwrap();
        let (intents, _) = self
            .consul
            .kv_keys("intent/", None, &QueryOptions::default())
            .await
            .unwrap();
        let intents: BTreeSet<String> = intents.into_iter().collect();
        let mut out: BTreeMap<RcId, BTreeSet<String>> = BTreeMap::new();
        for e in labels {
            let id = e.key.trim_start_matches("labels/pod/");
            let Some((node, pod)) = split_pod_label_id(id) else {
                continue;
            };
            let Ok(l) = parse_labels(e.value_bytes()) else {
                continue;
            };
            let Some(Ok(rc)) = l.get("replication_controller_id").map(|v| RcId::parse(v)) else {
                continue;
            };
            if intents.contains(&format!("intent/{node}/{pod}")) {
                out.entry(rc).or_default().insert(node.to_string());
            }
        }
        out
    }

    /// Waits until `check` holds, or fails the test with `what` and the farms' logs' tails.
    pub async fn wait_for<F, Fut>(&self, timeout: Duration, what: &str, mut check: F) -> Duration
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let started = Instant::now();
        loop {
            if check().await {
                return started.elapsed();
            }
            if started.elapsed() > timeout {
                let logs: Vec<String> = (0..self.farms.len())
                    .map(|i| {
                        let l = self.farm_log(i);
                        let tail: Vec<&str> = l.lines().rev().take(30).collect();
                        format!(
                            "--- farm {} ---\n{}",
                            self.farms[i].id,
                            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                        )
                    })
                    .collect();
                panic!(
                    "timed out after {timeout:?} waiting for {what}\n{}",
                    logs.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Replays every committed write and checks the farms' promises:
    /// - every write to a pod's intent or labels is fenced by a `check-session` on the lock of
    ///   the RC the pod belongs to, held by that session at that moment;
    /// - no write raises an RC's pod count above its desired count (+1 while its transfer
    ///   status key exists).
    ///
    /// `unfenced_ok` lets a test exempt its own direct writes. Returns the number of fenced
    /// scheduling commits checked.
    pub fn check_invariants(&self, unfenced_ok: impl Fn(&LoggedCommit) -> bool) -> usize {
        let mut kv: HashMap<String, Vec<u8>> = HashMap::new();
        let mut sessions: HashMap<String, String> = HashMap::new();
        let mut checked = 0;
        let rc_of_pod = |kv: &HashMap<String, Vec<u8>>, node: &str, pod: &str| -> Option<String> {
            let l = kv.get(&format!("labels/pod/{node}/{pod}"))?;
            parse_labels(l)
                .ok()?
                .get("replication_controller_id")
                .cloned()
        };
        let count = |kv: &HashMap<String, Vec<u8>>, rc: &str| -> usize {
            kv.iter()
                .filter(|(k, v)| {
                    k.starts_with("labels/pod/")
                        && parse_labels(v)
                            .ok()
                            .and_then(|l| l.get("replication_controller_id").cloned())
                            .as_deref()
                            == Some(rc)
                })
                .count()
        };
        let desired = |kv: &HashMap<String, Vec<u8>>, rc: &str| -> i64 {
            kv.get(&format!("replication_controllers/{rc}"))
                .and_then(|v| serde_json::from_slice::<Value>(v).ok())
                .and_then(|v| v["replicas_desired"].as_i64())
                .unwrap_or(0)
        };
        for c in self.server.commit_log() {
            // Which RCs' pods this commit touches (by the labels before and after).
            let mut touched: BTreeSet<String> = BTreeSet::new();
            let pod_keys: Vec<(String, String)> = c
                .changes
                .iter()
                .filter_map(|ch| match ch {
                    Change::Put(k, _) | Change::Delete(k) => Some(k.clone()),
                    _ => None,
                })
                .filter_map(|k| {
                    let rest = k
                        .strip_prefix("intent/")
                        .or_else(|| k.strip_prefix("labels/pod/"))?;
                    let (n, p) = rest.split_once('/')?;
                    Some((n.to_string(), p.to_string()))
                })
                .collect();
            for (n, p) in &pod_keys {
                if let Some(rc) = rc_of_pod(&kv, n, p) {
                    touched.insert(rc);
                }
            }
            let before: BTreeMap<String, usize> = touched
                .iter()
                .map(|rc| (rc.clone(), count(&kv, rc)))
                .collect();
            // The lock holders at the moment of the commit (before its own changes).
            let holders: HashMap<String, String> = if pod_keys.is_empty() {
                HashMap::new()
            } else {
                sessions
                    .iter()
                    .filter(|(k, _)| k.starts_with("lock/replication_controllers/"))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect()
            };
            for ch in &c.changes {
                match ch {
                    Change::Put(k, e) => {
                        kv.insert(k.clone(), e.value.to_vec());
                        match &e.session {
                            Some(s) => sessions.insert(k.clone(), s.clone()),
                            None => sessions.remove(k),
                        };
                    }
                    Change::Delete(k) => {
                        kv.remove(k);
                        sessions.remove(k);
                    }
                    Change::DeleteTree(p) => {
                        kv.retain(|k, _| !k.starts_with(p.as_str()));
                        sessions.retain(|k, _| !k.starts_with(p.as_str()));
                    }
                    _ => {}
                }
            }
            for (n, p) in &pod_keys {
                if let Some(rc) = rc_of_pod(&kv, n, p) {
                    touched.insert(rc);
                }
            }
            if touched.is_empty() {
                continue;
            }
            if c.checks.is_empty() {
                assert!(
                    unfenced_ok(&c),
                    "unfenced write to pods of {touched:?} at index {}: {:?}",
                    c.index,
                    c.changes
                );
                continue;
            }
            checked += 1;
            for rc in &touched {
                let lock = format!("lock/replication_controllers/{rc}");
                let check = c.checks.iter().find(|(k, _)| k == &lock);
                let check = check.unwrap_or_else(|| {
                    panic!(
                        "write to pods of {rc} at index {} not fenced by its lock: {:?}",
                        c.index, c.checks
                    )
                });
                let held = holders.get(&lock).cloned();
                assert_eq!(
                    held.as_deref(),
                    Some(check.1.as_str()),
                    "write at {} by a session not holding the lock of {rc}",
                    c.index
                );
                let after = count(&kv, rc);
                let was = before.get(rc).copied().unwrap_or(0);
                let transfer = kv.contains_key(&format!(
                    "status/replication_controllers/{rc}/replication_controller"
                ));
                let limit = desired(&kv, rc) as usize + usize::from(transfer);
                assert!(
                    after <= was || after <= limit,
                    "write at {} raised {rc} to {after} pods (desired {}, transfer {transfer})",
                    c.index,
                    desired(&kv, rc)
                );
            }
        }
        checked
    }
}

/// Sets up `n` nodes `node-00…` with `zone=z<i%zones>` and `env=prod`.
pub async fn nodes(c: &Cluster, n: usize, zones: usize) {
    for i in 0..n {
        let zone = format!("z{}", i % zones);
        c.label_node(&format!("node-{i:02}"), &[("env", "prod"), ("zone", &zone)])
            .await;
    }
}

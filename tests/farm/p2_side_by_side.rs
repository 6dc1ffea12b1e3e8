//! P2's own farm (`p2-rctl-server`, square/p2 at 8223eb18) and rcfarm's, each on a fresh real
//! Consul 0.7 agent, run through the same scenarios with default options; then what each left
//! in Consul (intents, pod labels, RC and roll records, which locks are held) is compared.
//! Audit records, rcfarm's registry and status keys are not compared (they differ by design:
//! see docs/switching-from-p2.md); every difference found is printed, and only the documented
//! ones are allowed.
//!
//! Skipped loudly without `RCFARM_TEST_CONSUL_BIN` or P2's binaries.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rcfarm::consul::QueryOptions;
use rcfarm::rc::RcId;
use rcfarm::rctask::IntentState;
use rcfarm_testkit::chaos::agent::AgentConfig;
use serde_json::{Value, json};
use tokio::process::{Child, Command};

use crate::harness::{Backend, Cluster};

/// One of P2's binaries, if it is where CI keeps them (`../shared/p2/`).
pub fn p2_bin(name: &str) -> Option<PathBuf> {
    let p = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/p2")).join(name);
    if p.is_file() {
        Some(p)
    } else {
        eprintln!(
            "SKIPPED (P2 part): P2's {name} is not at {} because it is not installed here (CI has it)",
            p.display()
        );
        None
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Which {
    P2,
    Rcfarm,
}

/// A farm of either kind around a fresh real Consul.
struct Run {
    c: Cluster,
    p2: Option<(Child, Arc<Mutex<String>>)>,
}

impl Run {
    async fn start(consul: &std::path::Path) -> Run {
        let c = Cluster::start_real(AgentConfig::dev(consul, "p2-side-by-side")).await;
        Run { c, p2: None }
    }

    async fn spawn(&mut self, which: Which) {
        match which {
            Which::Rcfarm => {
                self.c.spawn_farm("rcfarm", &[]).await;
            }
            Which::P2 => {
                let mut child = Command::new(p2_bin("p2-rctl-server").expect("checked"))
                    .args(["--consul", &self.c.server.addr().to_string()])
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .kill_on_drop(true)
                    .spawn()
                    .expect("p2-rctl-server starts");
                let log = crate::harness::capture_stderr(&mut child);
                self.p2 = Some((child, log));
            }
        }
    }

    fn p2_log(&self) -> String {
        self.p2
            .as_ref()
            .map(|(_, l)| l.lock().clone())
            .unwrap_or_default()
    }

    /// Whether P2's farm process has exited (it panics on some inputs).
    fn p2_exited(&mut self) -> Option<std::process::ExitStatus> {
        self.p2
            .as_mut()
            .and_then(|(c, _)| c.try_wait().ok().flatten())
    }

    /// What a farm leaves that operators and node agents read, normalised: manifests by digest,
    /// labels as maps, RC records by their P2 fields, locks as held or free.
    async fn snapshot(&self) -> BTreeMap<String, String> {
        let (entries, _) = self
            .c
            .consul
            .kv_list("", &QueryOptions::default())
            .await
            .unwrap();
        let mut out = BTreeMap::new();
        for e in entries {
            let k = e.key.clone();
            let v = if k.starts_with("intent/") {
                format!("{:?}", IntentState::from_value(Some(e.value_bytes())))
            } else if k.starts_with("labels/") {
                serde_json::from_slice::<BTreeMap<String, String>>(e.value_bytes())
                    .map(|m| format!("{m:?}"))
                    .unwrap_or_else(|_| "unparseable".into())
            } else if k.starts_with("replication_controllers/") {
                let r: Value = serde_json::from_slice(e.value_bytes()).unwrap_or_default();
                json!({
                    "manifest": format!("{:?}", IntentState::from_value(r["manifest"].as_str().map(str::as_bytes))),
                    "node_selector": r["node_selector"], "pod_labels": r["pod_labels"],
                    "replicas_desired": r["replicas_desired"], "disabled": r["disabled"],
                    "allocation_strategy": r["allocation_strategy"],
                })
                .to_string()
            } else if k.starts_with("rolls/") {
                String::from_utf8_lossy(e.value_bytes()).into_owned()
            } else if k.starts_with("lock/") {
                if e.session.is_some() { "held" } else { "free" }.to_string()
            } else {
                // audit_logs/, rcfarm/, status/: not compared.
                continue;
            };
            out.insert(k, v);
        }
        out
    }

    /// Audit records by type, wherever they are (P2's stay in `audit_logs/`; rcfarm ships its
    /// own to SQL by default).
    async fn audit_types(&self) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for t in rcfarm::audit::events::ALL {
            let n = self.c.audit_events(t).await.len();
            if n > 0 {
                out.insert(t.to_string(), n);
            }
        }
        out
    }
}

/// Keys whose normalised values differ between the two snapshots.
fn differences(
    p2: &BTreeMap<String, String>,
    rcfarm: &BTreeMap<String, String>,
) -> BTreeSet<String> {
    p2.keys()
        .chain(rcfarm.keys())
        .filter(|k| p2.get(*k) != rcfarm.get(*k))
        .cloned()
        .collect()
}

fn manifest(pod: &str, v: u32) -> String {
    format!(
        "id: {pod}\nlaunchables:\n  app:\n    launchable_type: hoist\n    location: https://example.com/{pod}-{v}.tar.gz\n"
    )
}

/// Writes an RC record as P2's tools do (P2 parses manifests strictly: a location is needed).
async fn put_rc(c: &Cluster, id: RcId, pod: &str, v: u32, replicas: i64, strategy: &str) {
    let record = json!({
        "id": id.to_string(), "manifest": manifest(pod, v), "node_selector": "env=prod",
        "pod_labels": {"availability_zone": "az1", "cluster_name": "test"},
        "replicas_desired": replicas, "disabled": false, "allocation_strategy": strategy,
    });
    c.consul
        .kv_put(&id.key(), record.to_string().as_bytes(), None)
        .await
        .unwrap();
}

/// Rewrites an RC record unchanged: Consul 0.7 bumps its index, which is what makes P2's RC
/// watch run a pass (P2 does not watch node labels).
async fn touch(c: &Cluster, id: RcId) {
    let (e, _) = c
        .consul
        .kv_get(&id.key(), &QueryOptions::default())
        .await
        .unwrap();
    c.consul
        .kv_put(&id.key(), e.unwrap().value_bytes(), None)
        .await
        .unwrap();
}

/// Three `env=prod` nodes, and a pod label of another pod: P2's farm schedules nothing while
/// `labels/pod/` is empty.
async fn common_setup(c: &Cluster) {
    for n in ["node-a", "node-b", "node-c"] {
        c.label_node(n, &[("env", "prod")]).await;
    }
    c.consul
        .kv_put(
            "labels/pod/node-z/other",
            br#"{"pod_id":"other","replication_controller_id":"00000000-0000-4000-8000-000000000000"}"#,
            None,
        )
        .await
        .unwrap();
}

fn set(nodes: &[&str]) -> BTreeSet<String> {
    nodes.iter().map(|s| s.to_string()).collect()
}

/// What one run of a scenario left and said.
struct Outcome {
    before: BTreeMap<String, String>,
    after: BTreeMap<String, String>,
    audit: BTreeMap<String, usize>,
    notes: Vec<String>,
}

/// The fixed ids of a scenario, so both farms' snapshots name the same keys.
struct Ids {
    rc: RcId,
    new: RcId,
    ghost: RcId,
}

async fn scenario(name: &str, consul: &std::path::Path, which: Which, ids: &Ids) -> Outcome {
    let mut r = Run::start(consul).await;
    common_setup(&r.c).await;
    let mut notes = Vec::new();
    let c = &r.c;
    match name {
        "a" | "b" | "b-unlocked" => {
            let strategy = if name == "a" {
                "static_strategy"
            } else {
                "dynamic_strategy"
            };
            put_rc(c, ids.rc, "web", 1, 2, strategy).await;
        }
        _ => {
            // A served RC (P2's farm will not start with none wanting replicas), the new RC
            // of a roll whose old RC was deleted, and a roll whose new RC is missing.
            put_rc(c, ids.rc, "keep", 1, 2, "static_strategy").await;
            put_rc(c, ids.new, "web", 2, 0, "static_strategy").await;
            let gone = RcId::new();
            for (roll, old, new) in [(ids.new, gone, ids.new), (ids.ghost, ids.rc, ids.ghost)] {
                let rec = json!({"OldRC": old.to_string(), "NewRC": new.to_string(),
                    "DesiredReplicas": 2, "MinimumReplicas": 1, "LeaveOld": false, "RollDelay": 0});
                c.consul
                    .kv_put(&format!("rolls/{roll}"), rec.to_string().as_bytes(), None)
                    .await
                    .unwrap();
            }
        }
    }
    r.spawn(which).await;
    let c = &r.c;
    let rc = ids.rc;
    c.wait_for(
        Duration::from_secs(40),
        "two pods on node-a and node-b",
        || async move { c.placements().await.get(&rc) == Some(&set(&["node-a", "node-b"])) },
    )
    .await;
    let before = r.snapshot().await;
    match name {
        "a" => {
            r.c.label_node("node-a", &[("env", "drained")]).await;
            touch(&r.c, ids.rc).await;
        }
        "b" | "b-unlocked" => {
            if name == "b" {
                crate::p2_behaviour::freeze(&r.c, ids.rc).await;
            }
            r.c.label_node("node-a", &[("env", "drained")]).await;
            touch(&r.c, ids.rc).await;
        }
        _ => {}
    }
    // P2 acts on the RC change at once; rcfarm within its 1 s resync. Then both are idle.
    tokio::time::sleep(Duration::from_secs(8)).await;
    if let Some(status) = r.p2_exited() {
        let log = r.p2_log();
        let panic = log
            .lines()
            .skip_while(|l| !l.starts_with("panic:"))
            .take(6)
            .collect::<Vec<_>>()
            .join(" | ");
        notes.push(format!("P2's farm exited ({status}): {panic}"));
    }
    if which == Which::P2 {
        let log = r.p2_log();
        for needle in [
            "RU was invalid, deleting",
            "Expected RC",
            "Caught panic in roll farm",
        ] {
            if let Some(l) = log.lines().find(|l| l.contains(needle)) {
                notes.push(format!("P2 logged: {}", &l[..l.len().min(220)]));
            }
        }
    }
    let after = r.snapshot().await;
    let audit = r.audit_types().await;
    Outcome {
        before,
        after,
        audit,
        notes,
    }
}

/// Runs `name` with both farms and checks that they leave the same, up to `allowed`.
async fn compare(name: &str, what: &str, ids: &Ids, allowed: &[String]) -> (Outcome, Outcome) {
    let Some(Backend::Real(consul)) = Backend::real() else {
        unreachable!("checked by the caller")
    };
    let p2 = scenario(name, &consul, Which::P2, ids).await;
    let rf = scenario(name, &consul, Which::Rcfarm, ids).await;
    println!("=== scenario ({name}) {what}");
    for (who, o) in [("P2", &p2), ("rcfarm", &rf)] {
        let changed = differences(&o.before, &o.after);
        println!("{who}: keys changed by the scenario: {changed:?}");
        println!("{who}: audit records written, by type: {:?}", o.audit);
        for n in &o.notes {
            println!("{who}: {n}");
        }
    }
    let diff = differences(&p2.after, &rf.after);
    for k in &diff {
        println!(
            "DIFFERENCE {k}: P2 {:?}, rcfarm {:?}",
            p2.after.get(k),
            rf.after.get(k)
        );
    }
    let unexpected: Vec<&String> = diff.iter().filter(|k| !allowed.contains(k)).collect();
    assert!(
        unexpected.is_empty(),
        "({name}) P2 and rcfarm left different keys: {unexpected:?}"
    );
    (p2, rf)
}

fn fresh_ids() -> Ids {
    Ids {
        rc: RcId::new(),
        new: RcId::new(),
        ghost: RcId::new(),
    }
}

/// Neither farm wrote an intent or a pod label during the scenario.
fn assert_no_pod_writes(outcomes: [&Outcome; 2]) {
    for o in outcomes {
        let changed = differences(&o.before, &o.after);
        assert!(
            changed
                .iter()
                .all(|k| !k.starts_with("intent/") && !k.starts_with("labels/pod/")),
            "{changed:?}"
        );
    }
}

fn prerequisites() -> bool {
    let consul = Backend::real().is_some();
    let p2 = p2_bin("p2-rctl-server").is_some();
    if !(consul && p2) {
        eprintln!(
            "SKIPPED: P2's farm and rcfarm side by side need real Consul (RCFARM_TEST_CONSUL_BIN) and P2's p2-rctl-server"
        );
    }
    consul && p2
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_rcs_node_relabelled() {
    if !prerequisites() {
        return;
    }
    let ids = fresh_ids();
    let (p2, rf) = compare(
        "a",
        "a node relabelled under a static RC (and the RC touched, so P2 runs a pass)",
        &ids,
        &[],
    )
    .await;
    // Neither moved the pod off node-a, nor wrote any intent or pod label.
    assert_no_pod_writes([&p2, &rf]);
    for o in [&p2, &rf] {
        assert!(o.after.contains_key("intent/node-a/web"));
        assert!(
            o.notes.iter().all(|n| !n.contains("exited")),
            "{:?}",
            o.notes
        );
    }
    assert_eq!(rf.audit.get("NODE_TRANSFER_START"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_node_transfer_lock_on_a_dynamic_rc() {
    if !prerequisites() {
        return;
    }
    let ids = fresh_ids();
    let (p2, rf) = compare(
        "b",
        "P2's node_transfer lock held by another session, a dynamic RC's node relabelled",
        &ids,
        &[],
    )
    .await;
    assert_no_pod_writes([&p2, &rf]);
    // P2 alone, without the lock: its farm behaves the same (it never reads the lock).
    let Some(Backend::Real(consul)) = Backend::real() else {
        unreachable!("checked above")
    };
    let unlocked = scenario("b-unlocked", &consul, Which::P2, &fresh_ids()).await;
    println!(
        "P2 without the node_transfer lock, same scenario: {:?}",
        unlocked.notes
    );
    if p2.notes.iter().any(|n| n.contains("exited")) {
        println!(
            "NOTE: P2's farm does not read the node_transfer lock (LockForNodeTransfer is never called by it); \
             at this commit it dies on any dynamic RC with a pod on an ineligible node (p2-rctl-server passes \
             no ServiceDiscoveryChecker: nil pointer in canNodeTransfer), lock or not: it wrote nothing because \
             it crashed. rcfarm wrote nothing because the lock freezes the RC's transfers."
        );
    }
    assert_eq!(rf.audit.get("NODE_TRANSFER_FROZEN"), Some(&1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rc_deleted_under_a_roll() {
    if !prerequisites() {
        return;
    }
    let ids = fresh_ids();
    // rcfarm claims the roll whose new RC is missing (to report it once, fenced); P2 never
    // locks it and logs an error on every pass of its roll watch.
    let allowed = vec![format!("lock/rolls/{}", ids.ghost)];
    let (p2, rf) = compare(
        "c",
        "a roll whose old RC was deleted, and one whose new RC is missing",
        &ids,
        &allowed,
    )
    .await;
    for o in [&p2, &rf] {
        assert!(
            !o.after.contains_key(&format!("rolls/{}", ids.new)),
            "deleted"
        );
        assert!(
            o.after.contains_key(&format!("rolls/{}", ids.ghost)),
            "left"
        );
        assert!(o.after.contains_key(&ids.new.key()), "new RC left");
    }
    // P2's roll farm validates a roll before running it, so it can delete this one although it
    // panics on every roll it runs at this commit.
    assert!(
        p2.notes
            .iter()
            .any(|n| n.contains("RU was invalid, deleting")),
        "{:?}",
        p2.notes
    );
    assert_eq!(rf.audit.get("ROLLING_UPDATE_COMPLETION"), Some(&1));
    println!(
        "NOTE: P2's roll farm panics on every roll it runs at this commit (no Consul client in its \
         UpdateFactory), so a roll in progress whose RC is then deleted cannot be run on P2's farm; \
         it validates a roll before running it, which is what deletes one whose old RC is missing \
         (compared above). Its source (pkg/roll/farm.go: validateRoll, mustDeleteRU) deletes \
         rolls/<id> and labels/rolls/<id> in one transaction, with no audit record from \
         p2-rctl-server (ShouldCreateAuditLogRecords is off); rcfarm deletes the same keys, its \
         locks, and records ROLLING_UPDATE_COMPLETION."
    );
}

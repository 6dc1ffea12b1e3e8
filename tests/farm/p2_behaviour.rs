//! P2's behaviour unless asked otherwise: static RCs' pods stay on nodes that stop matching
//! (`--transfer-static` moves them), P2's node-transfer lock freezes transfers, the audit outbox
//! can be left to another consumer (`--audit-shipping off`), a roll whose old RC is gone is
//! deleted as P2's roll farm deletes it, and `rcctl rc set-strategy` is P2's `update-strategy`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use rcfarm::audit::events;
use rcfarm::consul::{QueryOptions, SessionRequest};
use rcfarm::rc::RcId;
use serde_json::{Value, json};

use crate::harness::{Backend, Cluster};
use crate::on_both_backends;

const RCCTL: &str = env!("CARGO_BIN_EXE_rcctl");

/// The HTTP API of the live farm `farm_id`, as it announces itself in the registry.
pub async fn farm_api(c: &Cluster, farm_id: &str) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (entries, _) = c
            .consul
            .kv_list("rcfarm/farms/", &QueryOptions::default())
            .await
            .unwrap();
        for e in entries.iter().filter(|e| e.session.is_some()) {
            let v: Value = serde_json::from_slice(e.value_bytes()).unwrap_or_default();
            if v["farm_id"] == farm_id
                && let Some(h) = v["http"].as_str()
            {
                return h.to_string();
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "farm {farm_id} never registered with its HTTP address"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs a command to its end: whether it succeeded, its exit code, and its stdout and stderr.
async fn run(cmd: &mut tokio::process::Command) -> (Option<i32>, String) {
    let out = cmd.output().await.unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

pub async fn get_json(url: &str) -> Value {
    reqwest::get(url).await.unwrap().json().await.unwrap()
}

/// The conditions the farm at `api` shows for `id` (`/v1/rcs`).
async fn conditions(api: &str, id: RcId) -> Vec<String> {
    let v = get_json(&format!("{api}/v1/rcs")).await;
    v["rcs"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| r["id"] == id.to_string())
        .map(|r| {
            r["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// `ModifyIndex` of every key under `intent/` and `labels/pod/`: what a farm's pod writes change.
pub async fn pod_writes(c: &Cluster) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for prefix in ["intent/", "labels/pod/"] {
        let (entries, _) = c
            .consul
            .kv_list(prefix, &QueryOptions::default())
            .await
            .unwrap();
        out.extend(entries.into_iter().map(|e| (e.key, e.modify_index)));
    }
    out
}

/// Takes P2's node-transfer lock of `id` with a session of its own, as an outside tool would
/// (P2's `LockForNodeTransfer`); returns the session.
pub async fn freeze(c: &Cluster, id: RcId) -> String {
    let holder = c
        .consul
        .session_create(&SessionRequest {
            name: Some("freeze-tool".into()),
            ttl: Some(Duration::from_secs(120)),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(
        c.consul
            .kv_acquire(&id.node_transfer_lock_key(), b"freeze", &holder, None)
            .await
            .unwrap()
    );
    holder
}

fn set(nodes: &[&str]) -> BTreeSet<String> {
    nodes.iter().map(|s| s.to_string()).collect()
}

/// Nodes `node-a`, `node-b`, `node-c` with `env=prod`, and one RC of two replicas on them.
async fn three_nodes_and_an_rc(c: &Cluster, strategy: &str) -> RcId {
    for n in ["node-a", "node-b", "node-c"] {
        c.label_node(n, &[("env", "prod")]).await;
    }
    let id = RcId::new();
    c.put_rc(id, "web", "env=prod", 2, strategy).await;
    let cr = c;
    c.wait_for(
        Duration::from_secs(30),
        "on node-a and node-b",
        || async move { cr.placements().await.get(&id) == Some(&set(&["node-a", "node-b"])) },
    )
    .await;
    id
}

on_both_backends!(a_static_rcs_pod_stays_on_a_node_that_stops_matching_unless_transfer_static);
async fn a_static_rcs_pod_stays_on_a_node_that_stops_matching_unless_transfer_static(b: Backend) {
    let mut c = Cluster::start_on(&b).await;
    c.spawn_farm("p2-like", &[]).await;
    let id = three_nodes_and_an_rc(&c, "static_strategy").await;
    let api = farm_api(&c, "p2-like").await;
    let before = pod_writes(&c).await;
    c.label_node("node-a", &[("env", "drained")]).await;
    // Several passes: P2 writes nothing for a static RC here.
    c.passes(&[id], 3).await;
    assert_eq!(
        pod_writes(&c).await,
        before,
        "no intent or pod label written"
    );
    assert_eq!(
        c.placements().await.get(&id),
        Some(&set(&["node-a", "node-b"]))
    );
    assert!(c.audit_events(events::NODE_TRANSFER_START).await.is_empty());
    let conds = conditions(&api, id).await;
    assert!(
        conds
            .iter()
            .any(|c| c.starts_with("Waiting") && c.contains("--transfer-static")),
        "{conds:?}"
    );
    // The same RC served by a farm with --transfer-static: the pod moves to node-c.
    crate::harness::signal(c.farms[0].pid, "TERM");
    c.spawn_farm("mover", &["--transfer-static"]).await;
    let cr = &c;
    c.wait_for(Duration::from_secs(30), "moved to node-c", || async move {
        cr.placements().await.get(&id) == Some(&set(&["node-b", "node-c"]))
    })
    .await;
    assert_eq!(
        c.audit_events(events::NODE_TRANSFER_COMPLETION).await.len(),
        1
    );
    c.check_invariants(|_| false);
}

on_both_backends!(a_held_node_transfer_lock_freezes_a_dynamic_rcs_transfers);
async fn a_held_node_transfer_lock_freezes_a_dynamic_rcs_transfers(b: Backend) {
    let mut c = Cluster::start_on(&b).await;
    c.spawn_farm("f1", &[]).await;
    let id = three_nodes_and_an_rc(&c, "dynamic_strategy").await;
    let api = farm_api(&c, "f1").await;
    // An outside tool freezes the RC's transfers as P2's LockForNodeTransfer does.
    let holder = freeze(&c, id).await;
    let key = id.node_transfer_lock_key();
    let cr = &c;
    let (apir, holderr) = (&api, &holder);
    let frozen = c
        .wait_for(
            Duration::from_secs(20),
            "TransferFrozen shown",
            || async move {
                conditions(apir, id)
                    .await
                    .iter()
                    .any(|c| c.starts_with("TransferFrozen") && c.contains(holderr.as_str()))
            },
        )
        .await;
    println!("FIGURE TransferFrozen shown {frozen:?} after the lock was taken");
    let before = pod_writes(&c).await;
    c.label_node("node-a", &[("env", "drained")]).await;
    c.passes(&[id], 3).await;
    assert_eq!(pod_writes(&c).await, before, "frozen: nothing moves");
    // rcctl shows it too (from Consul's lock tree).
    let (_, out, _) = c.rcctl(&["--json", "rc", "list"]).await;
    let listed: Value = serde_json::from_str(&out).unwrap();
    let line = listed.to_string();
    assert!(line.contains("TransferFrozen"), "{line}");
    // Audited once, although the RC was planned many times meanwhile.
    let frozen_records = c.audit_events(events::NODE_TRANSFER_FROZEN).await;
    assert_eq!(frozen_records.len(), 1, "{frozen_records:?}");
    assert_eq!(frozen_records[0]["session"], json!(holder));
    assert_eq!(frozen_records[0]["lock"], json!(key));
    assert!(
        c.audit_events(events::NODE_TRANSFER_UNFROZEN)
            .await
            .is_empty()
    );
    // rcfarm does not take P2's node-transfer lock itself: the key is the tool's alone.
    assert!(c.consul.kv_release(&key, b"", &holder, None).await.unwrap());
    c.wait_for(
        Duration::from_secs(30),
        "moved to node-c once released",
        || async move { cr.placements().await.get(&id) == Some(&set(&["node-b", "node-c"])) },
    )
    .await;
    let (after, _) = c
        .consul
        .kv_get(&key, &QueryOptions::default())
        .await
        .unwrap();
    assert_eq!(after.and_then(|e| e.session), None);
    c.wait_for(
        Duration::from_secs(10),
        "unfreeze recorded once",
        || async move { cr.audit_events(events::NODE_TRANSFER_UNFROZEN).await.len() == 1 },
    )
    .await;
    assert_eq!(c.audit_events(events::NODE_TRANSFER_FROZEN).await.len(), 1);
    assert!(
        !conditions(&farm_api(&c, "f1").await, id)
            .await
            .iter()
            .any(|c| c.starts_with("TransferFrozen"))
    );
    c.check_invariants(|_| false);
}

/// Audit records with `--audit-shipping off`: written into Consul as ever, never shipped, and
/// the farm (its API and status page) and rcctl say where they go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_shipping_off_leaves_records_in_consul_and_ships_nothing() {
    let mut c = Cluster::start().await;
    let dir = tempfile::tempdir().unwrap();
    // Set from the config file, as any option can be.
    let toml = dir.path().join("farm.toml");
    std::fs::write(&toml, "audit-shipping = \"off\"\ntransfer-static = false\n").unwrap();
    c.spawn_farm("keeper", &["--config", toml.to_str().unwrap()])
        .await;
    let id = three_nodes_and_an_rc(&c, "static_strategy").await;
    let api = farm_api(&c, "keeper").await;
    let farms = get_json(&format!("{api}/v1/farms")).await;
    assert_eq!(farms["this_farm"]["audit_shipping"], json!(false));
    let where_to = farms["this_farm"]["audit_destination"].as_str().unwrap();
    assert!(
        where_to.contains("left in Consul audit_logs/ for an external consumer")
            && where_to.contains("--audit-shipping off"),
        "{where_to}"
    );
    assert_eq!(farms["farms"][0]["audit_shipping"], json!(false));
    let page = reqwest::get(format!("{api}/"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains("audit-where") && page.contains("audit_destination"));
    // Well past the shipper's interval: the records are still in the outbox, SQL has none.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (outbox, _) = c
        .consul
        .kv_list("audit_logs/", &QueryOptions::default())
        .await
        .unwrap();
    let retargets = outbox
        .iter()
        .filter(|e| {
            rcfarm::audit::AuditRecord::from_kv(&e.key, e.value_bytes())
                .is_ok_and(|r| r.event_type == events::RC_RETARGET)
        })
        .count();
    assert!(retargets >= 1, "P2's records stay in audit_logs/");
    let store = rcfarm::audit::AuditStore::connect(&c.audit_db)
        .await
        .unwrap();
    let shipped = store
        .query(&rcfarm::audit::AuditQuery {
            limit: Some(1000),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(shipped.records.is_empty(), "{:?}", shipped.records);
    store.close().await;
    assert!(
        !c.farm_log(0).contains("audit shipper"),
        "no shipper runs:\n{}",
        c.farm_log(0)
    );
    // rcctl says where records go.
    for args in [
        vec!["audit", "--audit-db", c.audit_db.as_str()],
        vec!["farms"],
    ] {
        let (code, text) = run(tokio::process::Command::new(RCCTL)
            .args(["--consul", &c.server.url()])
            .args(&args))
        .await;
        assert_eq!(code, Some(0), "{args:?}: {text}");
        assert!(
            text.contains("left in Consul audit_logs/ for an external consumer")
                && text.contains("keeper"),
            "{args:?}: {text}"
        );
    }
    let _ = id;
}

#[tokio::test]
async fn audit_shipping_and_transfer_static_refuse_bad_values_naming_the_option() {
    for (args, needle) in [
        (
            vec!["serve", "--audit-shipping", "sometimes"],
            "--audit-shipping",
        ),
        (
            vec!["serve", "--transfer-static=maybe"],
            "--transfer-static",
        ),
    ] {
        let out = tokio::process::Command::new(crate::harness::BIN)
            .args(&args)
            .output()
            .await
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

on_both_backends!(a_roll_whose_old_rc_is_deleted_is_deleted_as_p2s_roll_farm_does);
async fn a_roll_whose_old_rc_is_deleted_is_deleted_as_p2s_roll_farm_does(b: Backend) {
    let mut c = Cluster::start_on(&b).await;
    c.spawn_farm("f1", &["--roll-resync", "200ms"]).await;
    let old = three_nodes_and_an_rc(&c, "static_strategy").await;
    let new = RcId::new();
    c.put_rc(new, "web", "env=prod", 0, "static_strategy").await;
    c.patch_rc(
        new,
        "manifest",
        Cluster::manifest("web", 2).replace("\\n", "\n").into(),
    )
    .await;
    // P2's record, as `p2-rctl schedule-update` writes it.
    let roll = json!({"OldRC": old.to_string(), "NewRC": new.to_string(),
        "DesiredReplicas": 2, "MinimumReplicas": 2, "LeaveOld": false, "RollDelay": 0});
    c.consul
        .kv_put(&format!("rolls/{new}"), roll.to_string().as_bytes(), None)
        .await
        .unwrap();
    // Nothing reports health: the roll starts (old RC disabled), then waits.
    let cr = &c;
    c.wait_for(Duration::from_secs(30), "the roll started", || async move {
        let (e, _) = cr
            .consul
            .kv_get(&old.key(), &QueryOptions::default())
            .await
            .unwrap();
        e.is_some_and(|e| e.value_str().unwrap_or("").contains("\"disabled\":true"))
    })
    .await;
    // The old RC is deleted under the roll (as `rcctl rc delete --force` would).
    let new_before = c
        .consul
        .kv_get(&new.key(), &QueryOptions::default())
        .await
        .unwrap()
        .0
        .unwrap();
    c.consul.kv_delete(&old.key()).await.unwrap();
    c.wait_for(Duration::from_secs(20), "the roll deleted", || async move {
        cr.count_prefix(&format!("rolls/{new}")).await == 0
            && cr.count_prefix(&format!("labels/rolls/{new}")).await == 0
            && cr.count_prefix(&format!("lock/rolls/{new}")).await == 0
    })
    .await;
    // The new RC is left as it is, and its mutation lock (the roll's) is given back.
    let (new_after, _) = c
        .consul
        .kv_get(&new.key(), &QueryOptions::default())
        .await
        .unwrap();
    assert_eq!(new_after.unwrap().value, new_before.value);
    let (m, _) = c
        .consul
        .kv_get(&new.mutation_lock_key(), &QueryOptions::default())
        .await
        .unwrap();
    assert_eq!(m.and_then(|e| e.session), None);
    // The old RC's pods are left, as deleting an RC leaves them.
    assert_eq!(c.placements().await.get(&old).map(|p| p.len()), Some(2));
    let done = c.audit_events(events::ROLL_COMPLETION).await;
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0]["succeeded"], true);
    assert_eq!(done[0]["canceled"], true);
    assert!(
        done[0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("does not exist")),
        "{done:?}"
    );

    // A roll whose new RC is missing is left alone, as P2 leaves it (reported, not deleted).
    let ghost = RcId::new();
    let roll = json!({"OldRC": new.to_string(), "NewRC": ghost.to_string(),
        "DesiredReplicas": 1, "MinimumReplicas": 0, "LeaveOld": false, "RollDelay": 0});
    c.consul
        .kv_put(&format!("rolls/{ghost}"), roll.to_string().as_bytes(), None)
        .await
        .unwrap();
    c.wait_for(Duration::from_secs(20), "reported stalled", || async move {
        cr.audit_events(events::ROLL_STALLED)
            .await
            .iter()
            .any(|d| d["rolling_update_id"] == json!(ghost.to_string()))
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(c.count_prefix(&format!("rolls/{ghost}")).await, 1);
    assert_eq!(c.audit_events(events::ROLL_COMPLETION).await.len(), 1);
    c.check_invariants(|_| false);
}

/// `rcctl rc set-strategy`: P2's `p2-rctl update-strategy` (the record's `allocation_strategy`
/// rewritten with a CAS), with a dry run, an audit record, and clear errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rcctl_rc_set_strategy_rewrites_the_strategy_as_p2_does() {
    let c = Cluster::start().await;
    let url = c.server.url();
    let id = RcId::new();
    c.put_rc(id, "web", "env=prod", 2, "static").await;
    // A manifest P2 parses (it wants a location), so that P2's tool can read the RC back.
    c.patch_rc(
        id,
        "manifest",
        Cluster::manifest("web", 1).replace("\\n", "\n").into(),
    )
    .await;
    let read = || async {
        let (e, _) = c
            .consul
            .kv_get(&id.key(), &QueryOptions::default())
            .await
            .unwrap();
        let e = e.unwrap();
        (
            serde_json::from_slice::<Value>(e.value_bytes()).unwrap(),
            e.modify_index,
        )
    };
    let rcctl = |args: Vec<String>| {
        let url = url.clone();
        async move {
            tokio::process::Command::new(RCCTL)
                .args(["--consul", &url])
                .args(&args)
                .output()
                .await
                .unwrap()
        }
    };
    let (record, index) = read().await;
    // A dry run prints the CAS write and sends nothing.
    let out = rcctl(vec![
        "rc".into(),
        "set-strategy".into(),
        id.to_string(),
        "dynamic".into(),
        "--dry-run".into(),
    ])
    .await;
    assert!(out.status.success());
    let dry = String::from_utf8_lossy(&out.stdout);
    assert!(
        dry.contains("cas") && dry.contains(&index.to_string()),
        "{dry}"
    );
    assert_eq!(read().await.1, index);
    // P2's spelling is accepted too.
    let out = rcctl(vec![
        "rc".into(),
        "set-strategy".into(),
        id.to_string(),
        "dynamic_strategy".into(),
    ])
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (after, new_index) = read().await;
    assert!(new_index > index);
    assert_eq!(after["allocation_strategy"], "dynamic_strategy");
    for field in [
        "id",
        "manifest",
        "node_selector",
        "pod_labels",
        "replicas_desired",
        "disabled",
    ] {
        assert_eq!(after[field], record[field], "{field} unchanged");
    }
    let modified = c.audit_events(events::RC_MODIFIED).await;
    assert_eq!(modified.len(), 1);
    assert_eq!(
        modified[0]["changes"]["allocation_strategy"],
        json!({"old": "static", "new": "dynamic_strategy"})
    );
    assert!(
        modified[0]["actor"]
            .as_str()
            .is_some_and(|a| a.starts_with("rcctl:"))
    );
    // Bad input: an unknown strategy is a usage mistake (2), an unknown RC a failure (1);
    // neither writes anything.
    let out = rcctl(vec![
        "rc".into(),
        "set-strategy".into(),
        id.to_string(),
        "sometimes".into(),
    ])
    .await;
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("sometimes"));
    let out = rcctl(vec![
        "rc".into(),
        "set-strategy".into(),
        RcId::new().to_string(),
        "static".into(),
    ])
    .await;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not exist"));
    assert_eq!(read().await.1, new_index);
    // P2's own tool reads the record back with the strategy written.
    if let Some(p2) = crate::p2_side_by_side::p2_bin("p2-rctl") {
        let (code, text) = run(tokio::process::Command::new(p2)
            .args(["--consul", &c.server.addr().to_string(), "get"])
            .arg(id.to_string()))
        .await;
        assert_eq!(code, Some(0), "{text}");
        assert!(text.contains("dynamic_strategy"), "{text}");
    }
}

on_both_backends!(a_transfer_in_flight_is_neither_completed_nor_rolled_back_while_frozen);
async fn a_transfer_in_flight_is_neither_completed_nor_rolled_back_while_frozen(b: Backend) {
    let mut c = Cluster::start_on(&b).await;
    c.spawn_farm("f1", &["--transfer-timeout", "3s"]).await;
    let id = three_nodes_and_an_rc(&c, "dynamic_strategy").await;
    let api = farm_api(&c, "f1").await;
    // Health is in use: the new pod (on node-c) never passes, so the transfer waits for it.
    for n in ["node-a", "node-b"] {
        c.consul
            .kv_put(&format!("health/web/{n}"), br#"{"Status":"passing"}"#, None)
            .await
            .unwrap();
    }
    c.label_node("node-a", &[("env", "drained")]).await;
    let cr = &c;
    c.wait_for(Duration::from_secs(20), "transfer started (+1 pod)", || async move {
        cr.placements().await.get(&id) == Some(&set(&["node-a", "node-b", "node-c"]))
    })
    .await;
    let holder = freeze(&c, id).await;
    let key = id.node_transfer_lock_key();
    let apir = &api;
    c.wait_for(
        Duration::from_secs(10),
        "TransferFrozen shown",
        || async move {
            conditions(apir, id)
                .await
                .iter()
                .any(|c| c.starts_with("TransferFrozen"))
        },
    )
    .await;
    // Past the transfer timeout: frozen, nothing is rolled back (or completed).
    let before = pod_writes(&c).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(pod_writes(&c).await, before);
    assert!(
        c.audit_events(events::NODE_TRANSFER_ROLLBACK)
            .await
            .is_empty()
    );
    assert!(
        c.audit_events(events::NODE_TRANSFER_COMPLETION)
            .await
            .is_empty()
    );
    let frozen = c.audit_events(events::NODE_TRANSFER_FROZEN).await;
    assert_eq!(frozen.len(), 1);
    assert_eq!(frozen[0]["transfer_in_flight"]["new_node"], json!("node-c"));
    // Released: the timed-out transfer is rolled back.
    assert!(c.consul.kv_release(&key, b"", &holder, None).await.unwrap());
    c.wait_for(
        Duration::from_secs(20),
        "rolled back once released",
        || async move {
            cr.audit_events(events::NODE_TRANSFER_ROLLBACK)
                .await
                .iter()
                .any(|d| {
                    d["rollback_reason"]
                        .as_str()
                        .is_some_and(|r| r.contains("not healthy"))
                })
        },
    )
    .await;
    c.check_invariants(|_| false);
}

//! Convergence: many RCs over several farms, and every kind of desired-state change.

use std::collections::BTreeMap;
use std::time::Duration;

use rcfarm::audit::events;
use rcfarm::consul::QueryOptions;
use rcfarm::rc::RcId;
use serde_json::json;

use crate::harness::{Backend, Cluster, nodes, rcs};
use crate::{on_both_backends, on_every_backend};

on_every_backend!(three_farms_converge_fifty_p2_rcs_balanced);
async fn three_farms_converge_fifty_p2_rcs_balanced(b: Backend) {
    let mut c = Cluster::start_on(&b).await;
    nodes(&c, 30, 3).await;
    for f in ["f1", "f2", "f3"] {
        c.spawn_farm(f, &[]).await;
    }
    // 50 RCs written as P2 tools write them, 1-4 replicas over one zone or everywhere.
    let mut want: BTreeMap<RcId, usize> = BTreeMap::new();
    let started = std::time::Instant::now();
    for i in 0..50 {
        let id = RcId::new();
        let replicas = 1 + i % 4;
        let selector = if i % 2 == 0 {
            format!("zone=z{}", i % 3)
        } else {
            "env=prod".to_string()
        };
        c.put_rc(
            id,
            &format!("app-{i}"),
            &selector,
            replicas as i64,
            "static_strategy",
        )
        .await;
        want.insert(id, replicas);
    }
    let want2 = want.clone();
    let took = c
        .wait_for(Duration::from_secs(60), "50 RCs converged", || {
            let want = want2.clone();
            let c = &c;
            async move {
                let p = c.placements().await;
                want.iter()
                    .all(|(id, n)| p.get(id).map_or(0, |s| s.len()) == *n)
            }
        })
        .await;
    println!(
        "FIGURE convergence of 50 RCs (125 pods) over 3 farms: {:.2} s from the first PUT ({:.2} s after the last)",
        started.elapsed().as_secs_f64(),
        took.as_secs_f64()
    );

    // Every RC owned by exactly one farm (one lock, one holder), balanced. Farms that started
    // together may still be handing RCs over to reach their fair share: an RC released by one
    // farm and not yet claimed by the next has no owner for a moment, so this waits.
    c.wait_for(Duration::from_secs(20), "balanced ownership", || {
        let c = &c;
        async move {
            let owners = c.owner_farms().await;
            let mut per: BTreeMap<String, usize> = BTreeMap::new();
            for f in owners.values() {
                *per.entry(f.clone()).or_default() += 1;
            }
            let (max, min) = (
                per.values().max().copied().unwrap_or(0),
                per.values().min().copied().unwrap_or(0),
            );
            owners.len() == 50 && per.len() == 3 && min > 0 && max as f64 / min as f64 <= 1.5
        }
    })
    .await;
    // Each pod on a node matching its RC's selector, never two pods of one RC on a node.
    let placements = c.placements().await;
    for (id, ns) in &placements {
        assert_eq!(ns.len(), want[id]);
    }
    if let Some(checked) = c.check_invariants(|_| false) {
        assert!(checked >= 50, "scheduling commits checked: {checked}");
    }
}

on_both_backends!(every_kind_of_desired_state_change);
async fn every_kind_of_desired_state_change(b: Backend) {
    let mut c = Cluster::start_on(&b).await;
    nodes(&c, 6, 2).await; // node-00,02,04 in z0; 01,03,05 in z1
    // Static RCs' pods move off nodes that stop matching only with --transfer-static.
    c.spawn_farm("solo", &["--transfer-static"]).await;
    let id = RcId::new();
    c.put_rc(id, "web", "zone=z0", 2, "static_strategy").await;
    let cr = &c;
    let on = move |want: &'static [&'static str]| async move { placed(cr, id).await == want };
    let t = Duration::from_secs(20);
    c.wait_for(t, "2 pods in z0", || on(&["node-00", "node-02"]))
        .await;

    // Scale up: the next eligible node by name.
    c.patch_rc(id, "replicas_desired", json!(3)).await;
    c.wait_for(t, "scaled to 3", || on(&["node-00", "node-02", "node-04"]))
        .await;

    // A node loses its label: with the count right, its pod moves to an eligible node.
    c.label_node("node-02", &[("env", "prod"), ("zone", "z9")])
        .await;
    c.label_node("node-06", &[("env", "prod"), ("zone", "z0")])
        .await;
    c.wait_for(t, "pod moved off the relabelled node", || {
        on(&["node-00", "node-04", "node-06"])
    })
    .await;

    // Scale down removes ineligible pods first: make node-06 ineligible, then scale to 2.
    c.patch_rc(id, "disabled", json!(true)).await;
    c.passes(&[id], 2).await;
    c.label_node("node-06", &[("env", "prod"), ("zone", "z8")])
        .await;
    c.patch_rc(id, "replicas_desired", json!(2)).await;
    c.passes(&[id], 3).await;
    assert!(
        on(&["node-00", "node-04", "node-06"]).await,
        "disabled: no scheduling changes"
    );
    c.patch_rc(id, "disabled", json!(false)).await;
    c.wait_for(t, "scale-down removed the ineligible pod first", || {
        on(&["node-00", "node-04"])
    })
    .await;

    // Node selector change: pods move to the new zone, one at a time.
    c.patch_rc(id, "node_selector", json!("zone=z1")).await;
    c.wait_for(t, "moved to z1", || on(&["node-01", "node-03"]))
        .await;

    // Replicas 0 unschedules everything; deleting the key then stops the task.
    c.patch_rc(id, "replicas_desired", json!(0)).await;
    c.wait_for(t, "no pods", || on(&[])).await;
    c.patch_rc(id, "replicas_desired", json!(1)).await;
    c.wait_for(t, "one pod", || on(&["node-01"])).await;
    c.consul.kv_delete(&id.key()).await.unwrap();
    c.wait_for(t, "lock released after deletion", || {
        let c = &c;
        async move { !c.owners().await.contains_key(&id) }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        on(&["node-01"]).await,
        "deleting the RC key leaves its pods"
    );

    // Direct KV changes were noticed and recorded as observed changes.
    let observed = c.audit_events(events::RC_OBSERVED_CHANGE).await;
    assert!(observed.len() >= 6, "observed changes: {}", observed.len());
    assert!(
        observed
            .iter()
            .any(|d| d["changes"]["node_selector"] == json!({"old": "zone=z0", "new": "zone=z1"}))
    );
    let transfers = c.audit_events(events::NODE_TRANSFER_COMPLETION).await.len();
    assert!(transfers >= 3, "moves are node transfers: {transfers}");
    c.check_invariants(|_| false);
}

on_both_backends!(an_invalid_rc_is_reported_and_the_others_are_served);
async fn an_invalid_rc_is_reported_and_the_others_are_served(b: Backend) {
    let mut c = Cluster::start_on(&b).await;
    nodes(&c, 3, 1).await;
    c.spawn_farm("f1", &[]).await;
    let good = RcId::new();
    c.put_rc(good, "good", "env=prod", 2, "static_strategy")
        .await;
    let bad = RcId::new();
    c.consul.kv_put(&bad.key(), br#"{"id": "oops", "manifest": "id: x", "node_selector": "a in", "replicas_desired": 1}"#, None).await.unwrap();
    let missing = RcId::new();
    c.consul
        .kv_put(
            &missing.key(),
            format!(r#"{{"id":"{missing}","manifest":"id: m\n","node_selector":""}}"#).as_bytes(),
            None,
        )
        .await
        .unwrap();
    c.consul
        .kv_put("replication_controllers/not-a-uuid", b"{}", None)
        .await
        .unwrap();
    c.wait_for(Duration::from_secs(20), "good RC served", || {
        let c = &c;
        async move {
            c.placements()
                .await
                .get(&good)
                .is_some_and(|s| s.len() == 2)
        }
    })
    .await;
    c.wait_for(Duration::from_secs(20), "invalid RCs reported", || {
        let c = &c;
        async move {
            let invalid: Vec<String> = c
                .audit_events(events::RC_INVALID)
                .await
                .iter()
                .map(|d| d["problem"].as_str().unwrap_or("").to_string())
                .collect();
            // The two claimable ones, and the key that names no RC (recorded once).
            invalid.len() == 3
                && invalid.iter().any(|p| p.contains("replicas_desired"))
                && invalid.iter().any(|p| p.contains("not a UUID"))
        }
    })
    .await;
    assert!(
        !c.placements().await.contains_key(&bad) && !c.placements().await.contains_key(&missing)
    );
    // Reported once, not every pass.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let n = c.audit_events(events::RC_INVALID).await.len();
    assert_eq!(n, 3);
    // Fixing it brings it into service.
    c.put_rc(missing, "m", "env=prod", 1, "").await;
    c.wait_for(Duration::from_secs(20), "fixed RC served", || {
        let c = &c;
        async move {
            c.placements()
                .await
                .get(&missing)
                .is_some_and(|s| s.len() == 1)
        }
    })
    .await;
}

#[tokio::test]
async fn a_cluster_without_any_pod_labels_schedules() {
    // P2 deadlocks here: listing an empty labels/pod/ tree is an error for it.
    let mut c = Cluster::start().await;
    nodes(&c, 2, 1).await;
    c.spawn_farm("f1", &[]).await;
    let id = RcId::new();
    c.put_rc(id, "first", "env=prod", 2, "static_strategy")
        .await;
    c.wait_for(Duration::from_secs(20), "first pods", || {
        let c = &c;
        async move { c.placements().await.get(&id).is_some_and(|s| s.len() == 2) }
    })
    .await;
}

on_both_backends!(unmet_desires_alert_once_when_they_start_and_once_when_they_clear);
async fn unmet_desires_alert_once_when_they_start_and_once_when_they_clear(b: Backend) {
    let mut c = Cluster::start_on(&b).await;
    nodes(&c, 2, 1).await;
    c.spawn_farm("f1", &[]).await;
    let id = RcId::new();
    c.put_rc(id, "big", "env=prod", 3, "static_strategy").await;
    wait_events(&c, events::RC_DESIRES_UNMET, "unmet reported").await;
    c.passes(&[id], 3).await;
    assert_eq!(
        count_events(&c, events::RC_DESIRES_UNMET).await,
        1,
        "one alert, not one per pass"
    );
    assert_eq!(
        c.placements().await[&id].len(),
        2,
        "scheduled what it could"
    );
    c.label_node("node-99", &[("env", "prod")]).await;
    wait_events(&c, events::RC_DESIRES_MET, "met again").await;
    assert_eq!(c.placements().await[&id].len(), 3);
}

/// A pass that reaches its cap of applied actions with more to do goes on soon and settles
/// what it had not (a regression: it reported "met", kept a stale Unmet and waited for the
/// resync). One action per pass and an hour's resync make any pass cut short visible.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_cut_short_by_its_action_cap_goes_on_and_settles() {
    let mut c = Cluster::start().await;
    nodes(&c, 2, 1).await;
    c.spawn_farm(
        "f1",
        &[
            "--max-actions-per-pass",
            "1",
            "--resync-interval",
            "1h",
            "--consistency-interval",
            "1h",
        ],
    )
    .await;
    let id = RcId::new();
    c.put_rc(id, "big", "env=prod", 3, "static_strategy").await;
    wait_events(&c, events::RC_DESIRES_UNMET, "unmet reported").await;
    // One more node: one action (schedule on it) fills the RC; the pass that applies it is
    // cut short there, and the one after it finds the desires met.
    c.label_node("node-99", &[("env", "prod")]).await;
    wait_events(&c, events::RC_DESIRES_MET, "met again").await;
    assert_eq!(c.placements().await[&id].len(), 3);
}

on_both_backends!(an_intent_deleted_by_hand_is_rewritten);
async fn an_intent_deleted_by_hand_is_rewritten(b: Backend) {
    let mut c = Cluster::start_on(&b).await;
    nodes(&c, 2, 1).await;
    c.spawn_farm("f1", &[]).await;
    let id = RcId::new();
    c.put_rc(id, "web", "env=prod", 2, "static_strategy").await;
    c.wait_for(Duration::from_secs(20), "scheduled", || {
        let c = &c;
        async move { c.placements().await.get(&id).is_some_and(|s| s.len() == 2) }
    })
    .await;
    c.consul.kv_delete("intent/node-00/web").await.unwrap();
    c.consul
        .kv_put(
            "intent/node-01/web",
            b"id: web\nlaunchables: {}\ntampered: true\n",
            None,
        )
        .await
        .unwrap();
    c.wait_for(Duration::from_secs(20), "intents repaired", || {
        let c = &c;
        async move {
            let a = c
                .consul
                .kv_get("intent/node-00/web", &QueryOptions::default())
                .await
                .unwrap()
                .0;
            let b = c
                .consul
                .kv_get("intent/node-01/web", &QueryOptions::default())
                .await
                .unwrap()
                .0;
            a.is_some() && b.is_some_and(|e| !e.value_str().unwrap_or("").contains("tampered"))
        }
    })
    .await;
    c.check_invariants(|commit| commit.changes.len() == 1);
}

async fn placed(c: &Cluster, id: RcId) -> Vec<String> {
    c.placements()
        .await
        .get(&id)
        .map(|s| s.iter().cloned().collect())
        .unwrap_or_default()
}

async fn count_events(c: &Cluster, event: &str) -> usize {
    c.audit_events(event).await.len()
}

/// Waits (up to 20 s) for the first audit record of `event`.
async fn wait_events(c: &Cluster, event: &str, what: &str) {
    c.wait_for(Duration::from_secs(20), what, || async move {
        count_events(c, event).await == 1
    })
    .await;
}

on_both_backends!(a_farm_converging_a_burst_of_rcs_stays_within_its_connection_bound);
/// 600 RCs arrive at once: the farm's tasks all want Consul together, and each request used to
/// open its own connection (hundreds per farm). They now queue for the farm's 32.
async fn a_farm_converging_a_burst_of_rcs_stays_within_its_connection_bound(b: Backend) {
    use rcfarm::consul::TxnOp;
    use rcfarm_testkit::chaos::procfs::connections_to;

    let mut c = Cluster::start_on(&b).await;
    nodes(&c, 20, 2).await;
    let i = c.spawn_farm("bound", &[]).await;
    let pid = c.farms[i].pid;
    let port = c.server.addr().port();
    let n = 600;
    let ops: Vec<TxnOp> = (0..n)
        .map(|k| {
            let id = RcId::new();
            let record = json!({
                "id": id.to_string(), "manifest": format!("id: burst-{k}\nlaunchables: {{}}\n"),
                "node_selector": "env=prod", "pod_labels": {}, "replicas_desired": 2,
                "disabled": false, "allocation_strategy": "static_strategy",
            });
            TxnOp::cas(id.key(), record.to_string().into_bytes(), 0)
        })
        .collect();
    let stop = tokio_util::sync::CancellationToken::new();
    let sampler = {
        let stop = stop.clone();
        tokio::task::spawn_blocking(move || {
            let mut peak = 0;
            while !stop.is_cancelled() {
                peak = peak.max(connections_to(pid, port));
                std::thread::sleep(Duration::from_millis(5));
            }
            peak
        })
    };
    for chunk in ops.chunks(60) {
        c.consul.txn(chunk).await.unwrap();
    }
    c.wait_for(Duration::from_secs(120), "600 RCs × 2 placed", || async {
        c.count_prefix("intent/").await == 2 * n && c.count_prefix("labels/pod/").await == 2 * n
    })
    .await;
    stop.cancel();
    let peak = sampler.await.unwrap();
    eprintln!("peak connections of the farm to Consul while converging 600 RCs: {peak}");
    assert!(
        peak >= 2,
        "the sampler saw no connection at all ({peak}): is /proc readable?"
    );
    assert!(
        peak <= 32,
        "the farm held {peak} connections to Consul (bound: 32)"
    );
    if let crate::harness::Server::Embedded(s) = &c.server {
        assert_eq!(s.stats().conns_refused, 0, "the server refused connections");
    }
}

on_every_backend!(a_farm_reads_the_records_of_the_rcs_it_serves_only);
/// Issue 38: claims come from the RC tree's keys; a farm reads the records of the RCs it
/// serves only. Here a farm whose `--rc-selector` matches no RC reads the keys and no record,
/// while the farm serving every RC reads theirs.
async fn a_farm_reads_the_records_of_the_rcs_it_serves_only(b: Backend) {
    let mut c = Cluster::start_on(&b).await;
    nodes(&c, 6, 1).await;
    c.spawn_farm("all", &[]).await;
    c.spawn_farm("none", &["--rc-selector", "team=nobody"])
        .await;
    let ids = rcs(&c, 30, 1).await;
    let (cr, idr) = (&c, &ids);
    c.wait_for(
        Duration::from_secs(60),
        "30 RCs placed",
        move || async move {
            let p = cr.placements().await;
            idr.iter().all(|id| p.get(id).is_some_and(|s| s.len() == 1))
        },
    )
    .await;
    let bytes = |metrics: &str, watch: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| {
                l.starts_with("rcfarm_consul_watch_answer_bytes_total")
                    && l.contains(&format!("watch=\"{watch}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let (records, keys) = (
        "records:replication_controllers/",
        "keys:replication_controllers/",
    );
    let all = c.metrics("all").await;
    let none = c.metrics("none").await;
    assert!(bytes(&all, records) > 0.0, "{all}");
    assert!(bytes(&none, keys) > 0.0, "{none}");
    assert_eq!(bytes(&none, records), 0.0, "{none}");
    // It still sees every RC (its gauge counts the keys) and serves none.
    assert!(none.contains("rcfarm_rcs 30"), "{none}");
    assert!(none.contains("rcfarm_owned_rcs 0"), "{none}");
    assert_eq!(
        c.owner_farms()
            .await
            .values()
            .filter(|f| *f == "all")
            .count(),
        30
    );
}

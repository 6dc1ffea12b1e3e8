//! Failsafes (issue 20, item 8): a bulk edit scaling every RC to 0 removes nothing for the
//! confirmation window (or until an operator releases it); a farm removes at most `--max-removals` pods per window, reports
//! `RemovalsHeld`, and goes on when an operator runs `rcctl farm release-removals`; a roll
//! under a small budget still completes, its holds not counted toward its progress deadline.

use std::time::{Duration, Instant};

use rcfarm::consul::{QueryOptions, TxnOp};
use rcfarm::rc::RcId;
use serde_json::Value;

use crate::harness::{Backend, Cluster, nodes, rcs};
use crate::on_every_backend;
use crate::p2_behaviour::{farm_api, get_json};

/// Pods placed (intent and labels) per RC.
async fn placed(c: &Cluster, id: RcId) -> usize {
    c.placements().await.get(&id).map_or(0, |s| s.len())
}

/// Rewrites `replicas_desired` of every RC in one transaction: a bulk edit.
async fn scale_all_at_once(c: &Cluster, ids: &[RcId], replicas: u64) {
    let mut ops = Vec::new();
    for id in ids {
        let body = c.patched_rc(*id, "replicas_desired", replicas.into()).await;
        ops.push(TxnOp::set(id.key(), body));
    }
    c.consul.txn(&ops).await.unwrap();
}

/// The farm's view of itself (`/v1/farms`, `this_farm`).
async fn this_farm(api: &str) -> Value {
    get_json(&format!("{api}/v1/farms")).await["this_farm"].clone()
}

/// A farm f1 with `--failsafe-confirm confirm` and two RCs of `replicas` pods each, placed;
/// the RCs and the farm's HTTP API.
async fn two_rcs_placed(
    backend: &Backend,
    replicas: usize,
    confirm: &str,
) -> (Cluster, Vec<RcId>, String) {
    let mut c = Cluster::start_on(backend).await;
    nodes(&c, replicas * 2, 1).await;
    c.spawn_farm("f1", &["--failsafe-confirm", confirm]).await;
    let ids = rcs(&c, 2, replicas as i64).await;
    let (cr, idr) = (&c, &ids);
    c.wait_for(
        Duration::from_secs(20),
        "both RCs placed",
        move || async move {
            placed(cr, idr[0]).await == replicas && placed(cr, idr[1]).await == replicas
        },
    )
    .await;
    let api = farm_api(&c, "f1").await;
    (c, ids, api)
}

on_every_backend!(a_bulk_edit_to_zero_removes_nothing_until_confirmed);
async fn a_bulk_edit_to_zero_removes_nothing_until_confirmed(backend: Backend) {
    const CONFIRM: Duration = Duration::from_secs(5);
    let (c, ids, api) = two_rcs_placed(&backend, 2, "5s").await;
    let (cr, idr, apir) = (&c, &ids, &api);

    scale_all_at_once(&c, &ids, 0).await;
    let edited = Instant::now();
    c.wait_for(
        Duration::from_secs(10),
        "FailsafeTripped",
        move || async move {
            let f = this_farm(apir).await;
            f["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["kind"] == "FailsafeTripped")
                && f["failsafe"]["tripped"]
                    .as_str()
                    .is_some_and(|w| w.contains("every RC this farm serves went to 0 replicas"))
        },
    )
    .await;
    let tripped = c.audit_events("FAILSAFE_TRIPPED").await;
    assert_eq!(tripped.len(), 1, "{tripped:?}");
    assert_eq!(tripped[0]["farm_id"], "f1");
    assert_eq!(placed(&c, ids[0]).await + placed(&c, ids[1]).await, 4);

    // Seen for the confirmation window: the operator meant it.
    c.wait_for(
        Duration::from_secs(20),
        "every pod removed",
        move || async move { placed(cr, idr[0]).await + placed(cr, idr[1]).await == 0 },
    )
    .await;
    assert!(
        edited.elapsed() >= CONFIRM - Duration::from_millis(500),
        "pods went {:?} after the edit, within the {CONFIRM:?} confirmation window",
        edited.elapsed()
    );
    let cleared = c.audit_events("FAILSAFE_CLEARED").await;
    assert!(
        cleared.iter().any(|d| d["reason"]
            .as_str()
            .is_some_and(|r| r.contains("confirmed"))),
        "{cleared:?}"
    );
    assert!(this_farm(&api).await["failsafe"]["tripped"].is_null());
    assert!(c.farm_log(0).contains("FAILSAFE TRIPPED"));
}

on_every_backend!(max_removals_holds_until_released);
async fn max_removals_holds_until_released(backend: Backend) {
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 6, 1).await;
    c.spawn_farm(
        "f1",
        &["--max-removals", "2", "--max-removals-window", "10m"],
    )
    .await;
    let id = rcs(&c, 1, 6).await[0];
    let cr = &c;
    c.wait_for(
        Duration::from_secs(20),
        "6 pods placed",
        move || async move { placed(cr, id).await == 6 },
    )
    .await;
    let api = farm_api(&c, "f1").await;
    let apir = &api;

    c.patch_rc(id, "replicas_desired", 0.into()).await;
    c.wait_for(
        Duration::from_secs(15),
        "RemovalsHeld",
        move || async move {
            let v = get_json(&format!("{apir}/v1/rcs")).await;
            v["rcs"].as_array().into_iter().flatten().any(|r| {
                r["id"] == id.to_string()
                    && r["conditions"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|c| c.as_str().is_some_and(|c| c.starts_with("RemovalsHeld")))
            })
        },
    )
    .await;
    // Two removed, no more (the window is 10 minutes).
    c.passes(&[id], 3).await;
    assert_eq!(placed(&c, id).await, 4);
    let held = c.audit_events("REMOVALS_HELD").await;
    assert_eq!(held.len(), 1, "once per episode: {held:?}");
    assert_eq!(held[0]["replication_controller_id"], id.to_string());
    assert!(
        held[0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("rcctl farm release-removals")),
        "{held:?}"
    );
    let metrics = reqwest::get(format!("{api}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("rcfarm_removals_held 1"), "{metrics}");
    let (code, out, err) = c.rcctl(&["rc", "list"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("RemovalsHeld"), "{out}");

    // A farm that is not live: a usage error, nothing written.
    let (code, _, err) = c.rcctl(&["farm", "release-removals", "nosuch"]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no live farm \"nosuch\""), "{err}");
    assert_eq!(c.count_prefix("rcfarm/failsafe/").await, 0);

    let (code, out, err) = c.rcctl(&["farm", "release-removals", "f1"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("farm f1: removals released"), "{out}");
    c.wait_for(
        Duration::from_secs(15),
        "2 more removed",
        move || async move { placed(cr, id).await == 2 },
    )
    .await;
    let released = c.audit_events("REMOVALS_RELEASED").await;
    assert_eq!(released.len(), 1, "{released:?}");
    assert_eq!(released[0]["farm_id"], "f1");
    assert!(
        released[0]["actor"]
            .as_str()
            .is_some_and(|a| a.starts_with("rcctl:"))
    );
    c.passes(&[id], 3).await;
    assert_eq!(placed(&c, id).await, 2, "the new window's budget is 2");

    // Without a farm id: every live farm.
    let (code, _, err) = c.rcctl(&["farm", "release-removals"]).await;
    assert_eq!(code, 0, "{err}");
    c.wait_for(
        Duration::from_secs(15),
        "every pod removed",
        move || async move { placed(cr, id).await == 0 },
    )
    .await;
    c.wait_for(
        Duration::from_secs(10),
        "RemovalsHeld cleared",
        move || async move {
            let v = get_json(&format!("{apir}/v1/rcs")).await;
            !v.to_string().contains("RemovalsHeld")
        },
    )
    .await;
}

on_every_backend!(a_roll_replaces_pods_whatever_the_budget_and_pays_only_for_capacity_it_loses);
async fn a_roll_replaces_pods_whatever_the_budget_and_pays_only_for_capacity_it_loses(
    backend: Backend,
) {
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 6, 1).await;
    let _sim = c.simulate(6, 0.0);
    // A deadline shorter than the window: were a hold counted, the roll would fail.
    c.spawn_farm(
        "f1",
        &[
            "--roll-resync",
            "300ms",
            "--max-removals",
            "2",
            "--max-removals-window",
            "10m",
            "--roll-progress-deadline",
            "3s",
        ],
    )
    .await;
    let ids = rcs(&c, 2, 2).await;
    let (old, spender) = (ids[0], ids[1]);
    c.patch_rc(old, "replicas_desired", 4.into()).await;
    let cr = &c;
    c.wait_for(Duration::from_secs(20), "both RCs up", move || async move {
        cr.all_up(old, 4).await && cr.all_up(spender, 2).await
    })
    .await;
    let api = farm_api(&c, "f1").await;
    // A scale-down spends the whole budget: two pods gone with nothing in their place.
    c.patch_rc(spender, "replicas_desired", 0.into()).await;
    c.wait_for(
        Duration::from_secs(15),
        "the budget spent",
        move || async move { placed(cr, spender).await == 0 },
    )
    .await;
    assert_eq!(this_farm(&api).await["failsafe"]["removals_in_window"], 2);

    // A roll replaces every pod under its minimum (0 here: all four at once): nothing is lost,
    // nothing is charged, nothing waits for the window.
    let roll = c.start_roll(old, 0, Duration::ZERO).await;
    c.wait_for(
        Duration::from_secs(30),
        "the roll completes",
        move || async move { c_roll_done(cr, roll, old).await && cr.all_up(roll, 4).await },
    )
    .await;
    let steps = c.audit_events("ROLLING_UPDATE_STEP").await;
    let removed: u64 = steps
        .iter()
        .filter_map(|s| s["replicas_removed"].as_u64())
        .sum();
    assert_eq!(removed, 4, "{steps:#?}");
    assert!(c.audit_events("ROLLING_UPDATE_FAILED").await.is_empty());
    assert!(c.audit_events("ROLLING_UPDATE_STALLED").await.is_empty());
    assert!(
        c.audit_events("REMOVALS_HELD").await.is_empty(),
        "neither the roll nor its RCs were held"
    );
    assert_eq!(this_farm(&api).await["failsafe"]["removals_in_window"], 2);

    // A roll onto fewer replicas loses capacity: the old pods beyond the new count go with
    // nothing in their place. They are charged when the roll retires its old RC, and held
    // while the window has no room.
    let shrink = c.start_roll_to(roll, 3, Some(2), 0, Duration::ZERO).await;
    let apir = &api;
    c.wait_for(
        Duration::from_secs(30),
        "the shrinking roll held at its retirement",
        move || async move {
            let v = get_json(&format!("{apir}/v1/rolls/{shrink}")).await;
            v.to_string().contains("RemovalsHeld")
        },
    )
    .await;
    let held = c.audit_events("REMOVALS_HELD").await;
    assert!(
        held.iter()
            .any(|h| h["rolling_update_id"] == shrink.to_string()),
        "{held:?}"
    );
    assert!(c.audit_events("ROLLING_UPDATE_FAILED").await.is_empty());
    let (code, _, err) = c.rcctl(&["farm", "release-removals", "f1"]).await;
    assert_eq!(code, 0, "{err}");
    c.wait_for(
        Duration::from_secs(30),
        "the shrinking roll completes",
        move || async move { c_roll_done(cr, shrink, roll).await && cr.all_up(shrink, 2).await },
    )
    .await;
    let retired: Vec<Value> = c
        .audit_events("ROLLING_UPDATE_STEP")
        .await
        .into_iter()
        .filter(|s| s["action"] == "retire_old" && s["rolling_update_id"] == shrink.to_string())
        .collect();
    let lost: u64 = retired
        .iter()
        .filter_map(|s| s["lost_capacity"].as_u64())
        .sum();
    assert_eq!(lost, 2, "{retired:#?}");
    assert_eq!(
        this_farm(&api).await["failsafe"]["removals_in_window"],
        2,
        "the two lost pods, charged once (by the roll, not again by the old RC)"
    );
    assert!(c.audit_events("ROLLING_UPDATE_FAILED").await.is_empty());
    c.check_invariants(|_| false);
}

/// The roll's record and its old RC are gone.
async fn c_roll_done(c: &Cluster, roll: RcId, old: RcId) -> bool {
    let q = QueryOptions::default();
    c.consul
        .kv_get(&rcfarm::roll::roll_key(roll), &q)
        .await
        .unwrap()
        .0
        .is_none()
        && c.consul.kv_get(&old.key(), &q).await.unwrap().0.is_none()
}

on_every_backend!(a_release_ends_a_pending_confirmation);
async fn a_release_ends_a_pending_confirmation(backend: Backend) {
    let (c, ids, api) = two_rcs_placed(&backend, 1, "10m").await;
    let (cr, idr, apir) = (&c, &ids, &api);
    scale_all_at_once(&c, &ids, 0).await;
    c.wait_for(
        Duration::from_secs(10),
        "FailsafeTripped",
        move || async move { this_farm(apir).await["failsafe"]["tripped"].is_string() },
    )
    .await;
    c.passes(&ids, 3).await;
    assert_eq!(placed(&c, ids[0]).await + placed(&c, ids[1]).await, 2);
    // The operator meant it: no need to wait ten minutes.
    let (code, _, err) = c.rcctl(&["farm", "release-removals", "f1"]).await;
    assert_eq!(code, 0, "{err}");
    c.wait_for(
        Duration::from_secs(15),
        "every pod removed",
        move || async move { placed(cr, idr[0]).await + placed(cr, idr[1]).await == 0 },
    )
    .await;
    assert!(this_farm(&api).await["failsafe"]["tripped"].is_null());
    assert!(c.farm_log(0).contains("removals released by an operator"));
}

/// Eleven RCs holding 24 pods, every one set to 0 the way a script writes it (one KV PUT per
/// RC), on `farms` farms with the default flags: the cluster's window (`--max-removals 20%`
/// of 24 pods: its floor of 5) lets at most 5 pods go in 15 s, however many farms share the
/// work (issue 45: each farm used to spend its own 5).
async fn a_bulk_edit_one_put_per_rc_is_limited_for_the_cluster(backend: Backend, farms: usize) {
    let mut c = Cluster::start_on(&backend).await;
    let (ids, _sim) = crate::brakes::twenty_four_pods(&mut c, farms, 11).await;
    for id in &ids {
        c.patch_rc(*id, "replicas_desired", 0.into()).await;
    }
    tokio::time::sleep(Duration::from_secs(15)).await;
    let removed = 24 - crate::brakes::pods_of(&c, &ids).await;
    // Read before the first assertion, so that a breach shows the limit and the served counts
    // it was charged under (seen once in CI under load: 6 removed on three farms).
    let w = c.removal_window().await.expect("the window key exists");
    assert!(
        removed <= 5,
        "{removed} pods removed within 15 s by {farms} farms; the window: {w:?}"
    );
    // Each pod counted once in the base of the percentage, handovers and all (before the farm
    // giving RCs back wrote its smaller count first, a handover could count them twice, and
    // the peak kept that sum: a limit of 6 on 24 pods, seen once in CI).
    println!("removed {removed}; the window: {w:?}");
    if w.peak > 24 {
        if c.is_real() {
            // No commit log on real Consul: the farms' own account of their sessions, claims
            // and handovers.
            for f in 0..farms {
                let log = c.farm_log(f);
                let told = ["session", "claim", "handing", "removal window", "serving"];
                println!("f{f}:");
                for line in log.lines().filter(|l| told.iter().any(|t| l.contains(t))) {
                    println!("  {line}");
                }
            }
        } else {
            println!("{}", window_history(&c));
        }
    }
    assert!(w.peak <= 24, "a peak above the 24 pods: {w:?}");
    let now = chrono::Utc::now().timestamp();
    let st = w.recorded_settings().expect("the farms wrote the window");
    assert_eq!(w.limit, Some(5), "the limit charged under: {w:?}");
    assert_eq!(
        w.spent(st, now),
        removed as u64,
        "the key counts exactly the removals made: {w:?}"
    );
    // Every farm reports the same window.
    for f in 0..farms {
        let api = farm_api(&c, &format!("f{f}")).await;
        let fs = this_farm(&api).await["failsafe"].clone();
        assert_eq!(fs["removal_limit"], 5, "f{f}: {fs}");
    }
    c.check_invariants(|_| false);
}

/// The embedded server's commits that tell how the window's counts came to be (to read after
/// a failure): every write of the window key with its counts, every RC lock taken or given
/// back, and every session that ended, by farm.
fn window_history(c: &Cluster) -> String {
    use rcfarm::server::Change;
    let log = c.server.commit_log();
    let mut farm_of: std::collections::HashMap<String, String> = Default::default();
    let mut out = String::from("the window's history (index: what changed):\n");
    let Some(t0) = log.first().map(|c| c.at) else {
        return out;
    };
    for commit in &log {
        let mut lines = Vec::new();
        for ch in &commit.changes {
            match ch {
                Change::Put(k, e) if k.starts_with("rcfarm/farms/") => {
                    if let (Some(s), Ok(v)) =
                        (&e.session, serde_json::from_slice::<Value>(&e.value))
                    {
                        let f = v["farm_id"].as_str().unwrap_or("?").to_string();
                        farm_of.insert(s.clone(), f.clone());
                        lines.push(format!("{f} registered (session {s:.8})"));
                    }
                }
                Change::Put(k, e) if k == rcfarm::budget::BUDGET_KEY => {
                    let w = rcfarm::budget::Window::parse(&e.value);
                    lines.push(match w {
                        Ok(w) => format!(
                            "window: farms {:?}, peak {}, limit {:?}, spent {:?}",
                            w.farms
                                .iter()
                                .map(|(f, s)| (f.as_str(), s.pods))
                                .collect::<Vec<_>>(),
                            w.peak,
                            w.limit,
                            w.buckets
                        ),
                        Err(e) => format!("window unreadable: {e}"),
                    });
                }
                Change::Put(k, e) if k.starts_with("lock/") && !k.contains("mutation") => {
                    let who = e.session.as_ref().map_or("released".to_string(), |s| {
                        farm_of.get(s).cloned().unwrap_or_else(|| format!("{s:.8}"))
                    });
                    lines.push(format!("{k}: {who}"));
                }
                Change::SessionDestroy(s) => {
                    let f = farm_of.get(s).cloned().unwrap_or_else(|| format!("{s:.8}"));
                    lines.push(format!("session of {f} ended"));
                }
                _ => {}
            }
        }
        if !lines.is_empty() {
            let ms = commit.at.duration_since(t0).as_millis();
            out.push_str(&format!(
                "{} (+{ms} ms): {}\n",
                commit.index,
                lines.join("; ")
            ));
        }
    }
    out
}

on_every_backend!(a_bulk_edit_one_put_per_rc_removes_at_most_5_on_one_farm);
async fn a_bulk_edit_one_put_per_rc_removes_at_most_5_on_one_farm(backend: Backend) {
    a_bulk_edit_one_put_per_rc_is_limited_for_the_cluster(backend, 1).await
}

on_every_backend!(a_bulk_edit_one_put_per_rc_removes_at_most_5_on_two_farms);
async fn a_bulk_edit_one_put_per_rc_removes_at_most_5_on_two_farms(backend: Backend) {
    a_bulk_edit_one_put_per_rc_is_limited_for_the_cluster(backend, 2).await
}

on_every_backend!(a_bulk_edit_one_put_per_rc_removes_at_most_5_on_three_farms);
async fn a_bulk_edit_one_put_per_rc_removes_at_most_5_on_three_farms(backend: Backend) {
    a_bulk_edit_one_put_per_rc_is_limited_for_the_cluster(backend, 3).await
}

on_every_backend!(a_restart_of_every_farm_gives_no_fresh_window);
/// The window lives in Consul: farms killed and started again mid-window find it spent.
async fn a_restart_of_every_farm_gives_no_fresh_window(backend: Backend) {
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 6, 1).await;
    let _sim = c.simulate(6, 0.0);
    for f in ["f0", "f1"] {
        c.spawn_farm(f, &crate::brakes::DEFAULTS).await;
    }
    let ids = rcs(&c, 2, 2).await;
    let (big, small) = (ids[0], ids[1]);
    c.patch_rc(big, "replicas_desired", 6.into()).await;
    let cr = &c;
    c.wait_for(
        Duration::from_secs(30),
        "8 pods placed",
        move || async move { placed(cr, big).await == 6 && placed(cr, small).await == 2 },
    )
    .await;
    // One RC scaled to 0 (an operator's act, not a bulk edit): 5 of its 6 pods go.
    c.patch_rc(big, "replicas_desired", 0.into()).await;
    c.wait_for(
        Duration::from_secs(20),
        "5 pods removed",
        move || async move { placed(cr, big).await == 1 },
    )
    .await;
    for f in &c.farms {
        crate::harness::signal(f.pid, "KILL");
    }
    c.farms.clear();
    for f in ["f0", "f1"] {
        c.spawn_farm(f, &crate::brakes::DEFAULTS).await;
    }
    let cr = &c;
    c.passes(&[big, small], 3).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        placed(&c, big).await,
        1,
        "farms started again removed more within the window"
    );
    let api = farm_api(&c, "f0").await;
    let fs = this_farm(&api).await["failsafe"].clone();
    assert_eq!(fs["removals_in_window"], 5, "{fs}");
    assert!(fs["room_at"].is_string(), "{fs}");
    // An operator's release empties the cluster's window: the last pod goes.
    let (code, _, err) = c.rcctl(&["farm", "release-removals"]).await;
    assert_eq!(code, 0, "{err}");
    c.wait_for(
        Duration::from_secs(20),
        "the last pod removed",
        move || async move { placed(cr, big).await == 0 },
    )
    .await;
    let released = c.audit_events("REMOVALS_RELEASED").await;
    assert!(
        released.iter().any(|r| r["cluster_removals_released"] == 5),
        "{released:?}"
    );
}

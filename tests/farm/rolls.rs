//! Rolling updates carried out by real farm processes, with the node simulator playing P2's
//! preparer: in-place replacement under the minimum, handover and resumption, stalls, bad
//! records, and rolls written by P2's own `p2-rctl`.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use rcfarm::consul::QueryOptions;
use rcfarm::rc::{RcId, RcStore};
use rcfarm::roll::{RollStore, StartRoll, roll_key, roll_lock_key};
use serde_json::Value;

use crate::harness::{Backend, Cluster, nodes, rcs, signal};
use crate::on_both_backends;

/// Farm flags for roll tests: a short resync and stall timeout.
pub(crate) const ROLL_FLAGS: [&str; 4] = ["--roll-resync", "300ms", "--roll-stall-after", "3s"];

async fn start_roll(c: &Cluster, old: RcId, minimum: u64, delay: Duration) -> RcId {
    c.start_roll(old, minimum, delay).await
}

/// The session holding a roll's lock.
async fn roll_holder(c: &Cluster, id: RcId) -> Option<String> {
    c.consul
        .kv_get(&roll_lock_key(id), &QueryOptions::default())
        .await
        .unwrap()
        .0
        .and_then(|e| e.session)
}

pub(crate) async fn roll_exists(c: &Cluster, id: RcId) -> bool {
    c.consul
        .kv_get(&roll_key(id), &QueryOptions::default())
        .await
        .unwrap()
        .0
        .is_some()
}

/// What an RC wants now (`None`: it is gone).
pub(crate) async fn desired_of(c: &Cluster, id: RcId) -> Option<u64> {
    RcStore::new(c.consul.clone())
        .get(id)
        .await
        .unwrap()
        .map(|rc| rc.replicas_desired)
}

/// Waits until the audit log holds `n` records of `event`.
pub(crate) async fn audited(c: &Cluster, event: &str, n: usize) {
    c.wait_for(Duration::from_secs(10), event, move || async move {
        c.audit_events(event).await.len() == n
    })
    .await;
}

/// Each `rcctl roll start OLD -f MANIFEST ARGS…` is a usage mistake: exit 2 saying `says`.
async fn refused_starts(c: &Cluster, old: &str, manifest: &str, cases: &[(Vec<&str>, &str)]) {
    for (args, says) in cases {
        let mut a = vec!["roll", "start", old, "-f", manifest];
        a.extend(args);
        let (code, out, err) = c.rcctl(&a).await;
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// Waits until the roll is gone, the old RC deleted and the new one runs `n` pods, all up.
pub(crate) async fn completed(c: &Cluster, roll: RcId, old: RcId, n: usize, timeout: Duration) {
    c.wait_for(timeout, "the roll completes", move || async move {
        !roll_exists(c, roll).await
            && RcStore::new(c.consul.clone())
                .get(old)
                .await
                .unwrap()
                .is_none()
            && c.all_up(roll, n).await
    })
    .await;
}

/// A cluster of `n` simulated healthy nodes, farm f1 with the roll flags, and one RC of
/// `replicas` pods all up; the simulator's stop token and the RC.
async fn rolling_cluster(
    backend: &Backend,
    n: usize,
    replicas: usize,
) -> (Cluster, tokio_util::sync::CancellationToken, RcId) {
    rolling_cluster_failing(backend, n, replicas, None).await
}

/// [`rolling_cluster`] whose nodes never make pods of manifests containing `fail` healthy.
pub(crate) async fn rolling_cluster_failing(
    backend: &Backend,
    n: usize,
    replicas: usize,
    fail: Option<&str>,
) -> (Cluster, tokio_util::sync::CancellationToken, RcId) {
    let mut c = Cluster::start_on(backend).await;
    nodes(&c, n, 1).await;
    let sim = match fail {
        Some(pattern) => c.simulate_failing(n, pattern),
        None => c.simulate(n, 0.0),
    };
    c.spawn_farm("f1", &ROLL_FLAGS).await;
    let old = rcs(&c, 1, replicas as i64).await[0];
    let cr = &c;
    c.wait_for(
        Duration::from_secs(30),
        "the old RC up",
        move || async move { cr.all_up(old, replicas).await },
    )
    .await;
    (c, sim, old)
}

on_both_backends!(a_roll_replaces_pods_in_place_and_never_takes_them_below_the_minimum);
async fn a_roll_replaces_pods_in_place_and_never_takes_them_below_the_minimum(backend: Backend) {
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 6, 1).await;
    let _sim = c.simulate(6, 0.0);
    c.spawn_farm("f1", &ROLL_FLAGS).await;
    c.spawn_farm("f2", &ROLL_FLAGS).await;
    let old = rcs(&c, 1, 4).await[0];
    let cr = &c;
    c.wait_for(
        Duration::from_secs(30),
        "the old RC up",
        move || async move { cr.all_up(old, 4).await },
    )
    .await;
    let before = c.placements().await[&old].clone();

    let roll = start_roll(&c, old, 3, Duration::ZERO).await;
    completed(&c, roll, old, 4, Duration::from_secs(60)).await;

    // In place: the new RC's pods are where the old one's were.
    assert_eq!(c.placements().await[&roll], before);
    let new_rc = RcStore::new(c.consul.clone())
        .get(roll)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(new_rc.replicas_desired, 4);
    assert!(!new_rc.disabled);
    // The mutation locks are given back.
    for id in [old, roll] {
        assert!(
            c.consul
                .kv_get(&id.mutation_lock_key(), &QueryOptions::default())
                .await
                .unwrap()
                .0
                .is_none()
        );
    }
    let lowest = c.roll_lowest_up().get(&roll.to_string()).copied();
    assert!(lowest.is_some_and(|l| l >= 3), "lowest pods up {lowest:?}");
    if let Some(steps) = c.roll_steps() {
        assert!(steps >= 3, "start, steps and completion: {steps}");
    }

    // The audit trail: P2's creation and completion records, the start, each step.
    audited(&c, "ROLLING_UPDATE_COMPLETION", 1).await;
    let creation = c.audit_events("ROLLING_UPDATE_CREATION").await;
    assert_eq!(creation.len(), 1);
    assert_eq!(creation[0]["rolling_update_id"], roll.to_string());
    assert_eq!(creation[0]["pod_id"], "svc-0");
    let completion = &c.audit_events("ROLLING_UPDATE_COMPLETION").await[0];
    assert_eq!(completion["succeeded"], true);
    assert_eq!(completion["canceled"], false);
    assert_eq!(completion["pod_id"], "svc-0");
    assert_eq!(c.audit_events("ROLLING_UPDATE_STARTED").await.len(), 1);
    let steps = c.audit_events("ROLLING_UPDATE_STEP").await;
    let moved: u64 = steps
        .iter()
        .map(|s| s["replicas_added"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(moved, 4, "{steps:#?}");
    assert!(
        steps
            .iter()
            .all(|s| s["replicas_added"].as_u64() <= Some(1)),
        "one at a time with a minimum of 3 of 4"
    );
    let deleted = c.audit_events("REPLICATION_CONTROLLER_DELETED").await;
    assert_eq!(deleted.len(), 1);
    assert_eq!(deleted[0]["replication_controller_id"], old.to_string());
    // A roll that completes deletes its own lock: no farm warns it lost it (a regression:
    // "no longer holding the lock of one of our rolling updates" on every completion).
    for i in 0..2 {
        let log = c.farm_log(i);
        assert!(
            !log.contains("holds the lock of one of our")
                && !log.contains("no longer holding the lock"),
            "farm {i} warned of a lock lost:\n{log}"
        );
    }
}

on_both_backends!(a_roll_that_grows_takes_over_only_what_the_old_rc_gives_up);
async fn a_roll_that_grows_takes_over_only_what_the_old_rc_gives_up(backend: Backend) {
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 5, 1).await;
    let _sim = c.simulate(5, 0.0);
    c.spawn_farm("f1", &ROLL_FLAGS).await;
    let old = rcs(&c, 1, 2).await[0];
    let cr = &c;
    c.wait_for(
        Duration::from_secs(30),
        "the old RC up",
        move || async move { cr.all_up(old, 2).await },
    )
    .await;
    let before = c.placements().await[&old].clone();
    let roll = RollStore::new(c.consul.clone())
        .start(
            StartRoll {
                old_rc: old,
                manifest: Cluster::manifest("svc-0", 2),
                desired: Some(4),
                minimum: Some(2),
                leave_old: false,
                roll_delay: Duration::ZERO,
            },
            "test",
            false,
        )
        .await
        .unwrap()
        .update
        .new_rc;
    completed(&c, roll, old, 4, Duration::from_secs(60)).await;
    let after = c.placements().await[&roll].clone();
    assert!(
        before.is_subset(&after),
        "{before:?} replaced in place within {after:?}"
    );
    // P2's arithmetic lets the first step add the two extra replicas and take one old pod:
    // only one old pod may go down at once, so the minimum of 2 holds.
    let lowest = c.roll_lowest_up().get(&roll.to_string()).copied();
    assert!(lowest.is_some_and(|l| l >= 2), "lowest pods up {lowest:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_roll_from_an_rc_short_of_pods_counts_what_it_has_and_keeps_its_bound() {
    // Three nodes; the old RC wants four pods and runs three. Disabled by the roll, it will
    // never make up the fourth: the roll counts three, and never raises old + new above
    // its target (the observer checks every step).
    let mut c = Cluster::start().await;
    nodes(&c, 3, 1).await;
    let _sim = c.simulate(3, 0.0);
    c.spawn_farm("f1", &ROLL_FLAGS).await;
    let old = rcs(&c, 1, 4).await[0];
    let cr = &c;
    c.wait_for(
        Duration::from_secs(30),
        "three of four pods up",
        move || async move {
            cr.placements()
                .await
                .get(&old)
                .is_some_and(|p| p.len() == 3)
                && !cr
                    .audit_events("REPLICATION_CONTROLLER_DESIRES_UNMET")
                    .await
                    .is_empty()
        },
    )
    .await;
    let roll = RollStore::new(c.consul.clone())
        .start(
            StartRoll {
                old_rc: old,
                manifest: Cluster::manifest("svc-0", 2),
                desired: Some(3),
                minimum: Some(2),
                leave_old: false,
                roll_delay: Duration::ZERO,
            },
            "test",
            false,
        )
        .await
        .unwrap()
        .update
        .new_rc;
    completed(&c, roll, old, 3, Duration::from_secs(60)).await;
    let steps = c.audit_events("ROLLING_UPDATE_STEP").await;
    let first = steps
        .iter()
        .find(|s| s["old_replicas"]["old"] == 4)
        .expect("the first step started from the old RC's 4");
    assert_eq!(
        first["old_replicas"]["new"].as_u64().unwrap()
            + first["replicas_removed"].as_u64().unwrap(),
        3,
        "{first:#}"
    );
    let lowest = c.roll_lowest_up().get(&roll.to_string()).copied();
    assert!(lowest.is_some_and(|l| l >= 2), "lowest pods up {lowest:?}");
}

on_both_backends!(a_roll_is_resumed_by_another_farm_after_its_farm_is_killed_or_stopped);
async fn a_roll_is_resumed_by_another_farm_after_its_farm_is_killed_or_stopped(backend: Backend) {
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 6, 1).await;
    let _sim = c.simulate(6, 0.0);
    c.spawn_farm("f1", &ROLL_FLAGS).await;
    c.spawn_farm("f2", &ROLL_FLAGS).await;
    let ids: [RcId; 2] = rcs(&c, 2, 5).await.try_into().unwrap();
    let cr = &c;
    c.wait_for(Duration::from_secs(30), "both RCs up", move || async move {
        cr.all_up(ids[0], 5).await && cr.all_up(ids[1], 5).await
    })
    .await;
    // Two rolls, a second between steps: long enough to interrupt.
    let rolls = [
        start_roll(&c, ids[0], 4, Duration::from_secs(1)).await,
        start_roll(&c, ids[1], 4, Duration::from_secs(1)).await,
    ];
    // Each roll is under way (a step taken) before its farm goes.
    c.wait_for(
        Duration::from_secs(30),
        "both rolls under way",
        move || async move {
            let mut ok = true;
            for r in rolls {
                let n = RcStore::new(cr.consul.clone())
                    .get(r)
                    .await
                    .unwrap()
                    .unwrap();
                ok &= n.replicas_desired >= 1 && roll_holder(cr, r).await.is_some();
            }
            ok
        },
    )
    .await;
    let s0 = roll_holder(&c, rolls[0]).await.unwrap();
    let f0 = c.farm_sessions().await[&s0].clone();
    let idx = c.farms.iter().position(|f| f.id == f0).unwrap();
    // The farm carrying the first roll dies without a word.
    signal(c.farms[idx].pid, "KILL");
    completed(&c, rolls[0], ids[0], 5, Duration::from_secs(60)).await;
    // Restart it; stop the farm carrying the second roll gracefully.
    c.spawn_farm(&format!("{f0}-again"), &ROLL_FLAGS).await;
    if let Some(s1) = roll_holder(&c, rolls[1]).await
        && let Some(f1) = c.farm_sessions().await.get(&s1).cloned()
        && let Some(i) = c.farms.iter().position(|f| f.id == f1)
    {
        signal(c.farms[i].pid, "TERM");
    }
    completed(&c, rolls[1], ids[1], 5, Duration::from_secs(60)).await;
    let claimed = c.audit_events("ROLLING_UPDATE_CLAIMED").await;
    assert!(
        claimed.len() >= 3,
        "each roll claimed, one of them again after its farm died: {claimed:#?}"
    );
    let lowest_up = c.roll_lowest_up();
    for r in rolls {
        let lowest = lowest_up.get(&r.to_string()).copied();
        assert!(
            lowest.is_some_and(|l| l >= 4),
            "{r}: lowest pods up {lowest:?}"
        );
    }
    assert_eq!(c.audit_events("ROLLING_UPDATE_COMPLETION").await.len(), 2);
}

on_both_backends!(a_roll_that_cannot_progress_says_why_once_and_resumes_when_fixed);
async fn a_roll_that_cannot_progress_says_why_once_and_resumes_when_fixed(backend: Backend) {
    let (c, sim, old) = rolling_cluster(&backend, 4, 3).await;
    let cr = &c;
    // From now on every new pod fails its health check; the running ones stay up.
    sim.cancel();
    let failing = c.simulate(4, 1.0);
    let roll = start_roll(&c, old, 2, Duration::ZERO).await;
    c.wait_for(
        Duration::from_secs(30),
        "a stall reported",
        move || async move { !cr.audit_events("ROLLING_UPDATE_STALLED").await.is_empty() },
    )
    .await;
    // It took the one step the minimum allows, then waits, saying so once.
    c.roll_passes(roll, 5).await;
    let stalls = c.audit_events("ROLLING_UPDATE_STALLED").await;
    assert_eq!(stalls.len(), 1, "{stalls:#?}");
    assert!(
        stalls[0]["reason"].as_str().unwrap().contains("health"),
        "{stalls:#?}"
    );
    let new = RcStore::new(c.consul.clone())
        .get(roll)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        new.replicas_desired, 1,
        "no step beyond what the minimum allows"
    );
    let log = c.farm_log(0);
    assert!(log.contains("rolling update stalled"), "{log}");
    // The farm's API says what the roll waits for, and that it stalled.
    let base = c.farm_http("f1").await;
    rcfarm::consul::init_tls();
    let body: Value = reqwest::get(format!("{base}/v1/rolls/{roll}"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let conditions = body["roll"]["conditions"].to_string();
    assert!(conditions.contains("Stalled"), "{body:#}");
    assert!(
        body["roll"]["waiting"].as_str().unwrap().contains("health"),
        "{body:#}"
    );
    assert_eq!(body["roll"]["new"]["desired"], 1, "{body:#}");
    // Healthy pods again: the roll progresses (said once) and completes.
    failing.cancel();
    let _sim = c.simulate(4, 0.0);
    completed(&c, roll, old, 3, Duration::from_secs(60)).await;
    // Every stall reported is reported over (a slow machine may stall it again between steps).
    let progressing = c.audit_events("ROLLING_UPDATE_PROGRESSING").await.len();
    assert!(progressing >= 1);
    let stalls = c.audit_events("ROLLING_UPDATE_STALLED").await;
    assert_eq!(stalls.len(), progressing, "{stalls:#?}\n{}", c.farm_log(0));
    c.check_invariants(|_| false);
}

on_both_backends!(bad_roll_records_are_reported_once_and_never_acted_on);
async fn bad_roll_records_are_reported_once_and_never_acted_on(backend: Backend) {
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 4, 1).await;
    let _sim = c.simulate(4, 0.0);
    c.spawn_farm("f1", &ROLL_FLAGS).await;
    c.spawn_farm("f2", &ROLL_FLAGS).await;
    let ids: [RcId; 3] = rcs(&c, 3, 1).await.try_into().unwrap();
    // The stuck roll's new RC wants nothing yet (else the roll would be done at once).
    c.patch_rc(ids[2], "replicas_desired", 0.into()).await;
    let (a, b) = (RcId::new(), RcId::new());
    let cr = &c;
    c.wait_for(Duration::from_secs(30), "the RCs up", move || async move {
        cr.all_up(ids[0], 1).await && cr.all_up(ids[1], 1).await
    })
    .await;
    let put = |key: String, v: String| async move {
        cr.consul.kv_put(&key, v.as_bytes(), None).await.unwrap();
    };
    put(roll_key(a), "{not json".into()).await;
    put(
        roll_key(b),
        format!(
            r#"{{"OldRC":"{}","NewRC":"{b}","MinimumReplicas":0}}"#,
            ids[0]
        ),
    )
    .await;
    put("rolls/not-a-uuid".into(), "{}".into()).await;
    // Minimum unreachable: 1 of 1 must stay healthy. Hand-written (creation refuses it).
    put(
        roll_key(ids[2]),
        format!(
            r#"{{"OldRC":"{}","NewRC":"{}","DesiredReplicas":1,"MinimumReplicas":1,"LeaveOld":false,"RollDelay":0}}"#,
            ids[1], ids[2]
        ),
    )
    .await;
    c.wait_for(Duration::from_secs(30), "the reports", move || async move {
        cr.audit_events("ROLLING_UPDATE_INVALID").await.len() >= 3
            && !cr.audit_events("ROLLING_UPDATE_STALLED").await.is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let invalid = c.audit_events("ROLLING_UPDATE_INVALID").await;
    assert_eq!(
        invalid.len(),
        3,
        "once each, whatever the farms: {invalid:#?}"
    );
    let problems: BTreeSet<String> = invalid
        .iter()
        .map(|r| r["problem"].as_str().unwrap().to_string())
        .collect();
    assert!(
        problems.iter().any(|p| p.contains("not JSON")),
        "{problems:?}"
    );
    assert!(
        problems.iter().any(|p| p.contains("DesiredReplicas")),
        "{problems:?}"
    );
    assert!(
        problems.iter().any(|p| p.contains("roll key")),
        "{problems:?}"
    );
    let stalls = c.audit_events("ROLLING_UPDATE_STALLED").await;
    assert_eq!(stalls.len(), 1);
    assert!(
        stalls[0]["reason"].as_str().unwrap().contains("minimum"),
        "{stalls:#?}"
    );
    // Nothing was done to the RCs of the bad records; the stuck roll started but took no step.
    let store = RcStore::new(c.consul.clone());
    assert!(!store.get(ids[0]).await.unwrap().unwrap().disabled);
    assert_eq!(
        store.get(ids[2]).await.unwrap().unwrap().replicas_desired,
        0
    );
    assert_eq!(
        store.get(ids[1]).await.unwrap().unwrap().replicas_desired,
        1
    );
    assert!(
        store.get(ids[1]).await.unwrap().unwrap().disabled,
        "started: the old RC disabled"
    );
    for i in 0..2 {
        assert!(!c.farm_log(i).contains("panicked"));
        assert!(
            c.farm_log(i).contains("rolling update record is invalid")
                || c.farm_log(1 - i)
                    .contains("rolling update record is invalid")
        );
    }
    // Aborting the stuck roll frees both RCs' mutation locks and leaves the RCs as they are.
    RollStore::new(c.consul.clone())
        .abort(ids[2], "test", false)
        .await
        .unwrap();
    let cr = &c;
    c.wait_for(
        Duration::from_secs(10),
        "the mutation locks freed",
        move || async move {
            let mut free = true;
            for id in [ids[1], ids[2]] {
                free &= cr
                    .consul
                    .kv_get(&id.mutation_lock_key(), &QueryOptions::default())
                    .await
                    .unwrap()
                    .0
                    .and_then(|e| e.session)
                    .is_none();
            }
            free
        },
    )
    .await;
    for i in 0..2 {
        assert!(
            c.farms[i].child.try_wait().unwrap().is_none(),
            "farm {i} runs"
        );
    }
    let aborted = c.audit_events("ROLLING_UPDATE_COMPLETION").await;
    assert_eq!(aborted.len(), 1);
    assert_eq!(aborted[0]["canceled"], true);
    assert_eq!(aborted[0]["succeeded"], false);
    c.check_invariants(|_| false);
}

/// P2's binaries, if they are where CI keeps them.
fn p2_rctl() -> Option<PathBuf> {
    let p = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/p2/p2-rctl"));
    if p.exists() {
        Some(p)
    } else {
        eprintln!(
            "SKIPPED: P2's p2-rctl is not at {} (CI has it); this test checks rolls P2 writes",
            p.display()
        );
        None
    }
}

async fn p2(args: &[&str], consul: &str) -> (bool, String) {
    let out = tokio::process::Command::new(p2_rctl().unwrap())
        .arg("--consul")
        .arg(consul)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

on_both_backends!(a_roll_scheduled_by_p2s_own_schedule_update_is_carried_out);
async fn a_roll_scheduled_by_p2s_own_schedule_update_is_carried_out(backend: Backend) {
    if p2_rctl().is_none() {
        return;
    }
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 4, 1).await;
    let _sim = c.simulate(4, 0.0);
    c.spawn_farm("f1", &ROLL_FLAGS).await;
    let consul = c.server.addr().to_string();
    // Both RCs written by P2's own tool, with the allocation strategy it writes verbatim.
    let dir = tempfile::tempdir().unwrap();
    let mut ids = Vec::new();
    for v in [1, 2] {
        let m = dir.path().join(format!("v{v}.yaml"));
        std::fs::write(&m, Cluster::manifest("web", v).replace("\\n", "\n")).unwrap();
        let (ok, err) = p2(
            &[
                "create",
                "--manifest",
                m.to_str().unwrap(),
                "--node-selector",
                "env=prod",
                "--availability-zone",
                "az1",
                "--cluster-name",
                "c1",
                "--allocation-strategy",
                "static",
            ],
            &consul,
        )
        .await;
        assert!(ok, "{err}");
        let id = err
            .split("id=")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .unwrap();
        ids.push(RcId::parse(id).unwrap());
    }
    let (ok, err) = p2(
        &["set-replicas", "--yes", &ids[0].to_string(), "3"],
        &consul,
    )
    .await;
    assert!(ok, "{err}");
    let (old, cr) = (ids[0], &c);
    c.wait_for(
        Duration::from_secs(30),
        "P2's RC served and up",
        move || async move { cr.all_up(old, 3).await },
    )
    .await;
    let (ok, err) = p2(
        &[
            "schedule-update",
            "--old",
            &ids[0].to_string(),
            "--new",
            &ids[1].to_string(),
            "--desired",
            "3",
            "--minimum",
            "2",
        ],
        &consul,
    )
    .await;
    assert!(ok, "{err}");
    completed(&c, ids[1], ids[0], 3, Duration::from_secs(60)).await;
    let completion = c.audit_events("ROLLING_UPDATE_COMPLETION").await;
    assert_eq!(completion.len(), 1);
    assert_eq!(completion[0]["succeeded"], true);
    // P2 put no labels on the roll: the pod id comes from the new RC.
    assert_eq!(completion[0]["pod_id"], "web");
    assert!(
        c.audit_events("REPLICATION_CONTROLLER_INVALID")
            .await
            .is_empty()
    );
    c.check_invariants(|_| false);
}

on_both_backends!(p2s_own_rolling_update_cli_completes_against_rcfarms_farms);
async fn p2s_own_rolling_update_cli_completes_against_rcfarms_farms(backend: Backend) {
    if p2_rctl().is_none() {
        return;
    }
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 4, 1).await;
    let _sim = c.simulate(4, 0.0);
    c.spawn_farm("f1", &ROLL_FLAGS).await;
    c.spawn_farm("f2", &ROLL_FLAGS).await;
    let store = RcStore::new(c.consul.clone());
    let ids: [RcId; 2] = rcs(&c, 2, 3).await.try_into().unwrap();
    // Two versions of one pod: the new RC takes the old one's pods over.
    for (id, v) in [(ids[0], 1), (ids[1], 2)] {
        c.patch_rc(
            id,
            "manifest",
            Cluster::manifest("web", v).replace("\\n", "\n").into(),
        )
        .await;
    }
    c.patch_rc(ids[1], "replicas_desired", 0.into()).await;
    let (old, cr) = (ids[0], &c);
    c.wait_for(
        Duration::from_secs(30),
        "the old RC up",
        move || async move { cr.all_up(old, 3).await },
    )
    .await;
    // P2's roller, run inside the CLI: it holds both RCs' mutation locks with its own session,
    // disables the old RC, and moves the replica counts; rcfarm's RC tasks do the rest.
    let consul = c.server.addr().to_string();
    let out = tokio::time::timeout(
        Duration::from_secs(90),
        tokio::process::Command::new(p2_rctl().unwrap())
            .args(["--consul", &consul, "rolling-update"])
            .args(["--old", &ids[0].to_string(), "--new", &ids[1].to_string()])
            .args(["--desired", "3", "--minimum", "2"])
            .output(),
    )
    .await
    .unwrap_or_else(|_| {
        panic!(
            "p2-rctl rolling-update finishes; farm logs:\n{}\n{}",
            c.farm_log(0),
            c.farm_log(1)
        )
    })
    .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("msg=Done"), "{log}");
    assert!(
        store.get(ids[0]).await.unwrap().is_none(),
        "P2 deleted the old RC"
    );
    assert!(c.all_up(ids[1], 3).await);
    c.check_invariants(|_| false);
}

on_both_backends!(a_paused_roll_takes_no_step_keeps_its_lock_and_resumes_from_the_counts);
async fn a_paused_roll_takes_no_step_keeps_its_lock_and_resumes_from_the_counts(backend: Backend) {
    let (c, _sim, old) = rolling_cluster(&backend, 5, 4).await;
    let cr = &c;
    // One pod at a time, a second apart: time to pause it half-way.
    let roll = start_roll(&c, old, 3, Duration::from_secs(1)).await;
    let desired = |id: RcId| desired_of(cr, id);
    c.wait_for(
        Duration::from_secs(30),
        "the first step",
        move || async move { desired(roll).await.is_some_and(|d| d >= 1) },
    )
    .await;
    let id = roll.to_string();
    let (code, out, err) = c.rcctl(&["roll", "pause", &id]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("paused"), "{out}");
    // From here no step commits: what the RCs want now is what they want until the resume.
    let at_pause = (desired(old).await, desired(roll).await);
    let holder = roll_holder(&c, roll).await;
    assert!(holder.is_some());
    c.roll_passes(roll, 5).await;
    assert_eq!((desired(old).await, desired(roll).await), at_pause);
    assert!(roll_exists(&c, roll).await);
    assert_eq!(roll_holder(&c, roll).await, holder, "the lock is kept");
    let (code, out, _) = c.rcctl(&["--json", "roll", "show", &id]).await;
    assert_eq!(code, 0);
    let shown: Value = serde_json::from_str(&out).unwrap();
    let conditions = shown.to_string();
    assert!(conditions.contains("Paused: paused by rcctl:"), "{out}");
    // Pausing again writes nothing.
    let (code, out, _) = c.rcctl(&["roll", "pause", &id]).await;
    assert_eq!(code, 0);
    assert!(out.contains("already paused by rcctl:"), "{out}");
    // A roll without a canary has nothing to promote: a usage mistake, nothing written.
    let control = c
        .consul
        .kv_get(&format!("rcfarm/rolls/{id}"), &QueryOptions::default())
        .await
        .unwrap()
        .0
        .unwrap();
    let (code, _, err) = c.rcctl(&["roll", "promote", &id]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("has no canary"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let after = c
        .consul
        .kv_get(&format!("rcfarm/rolls/{id}"), &QueryOptions::default())
        .await
        .unwrap()
        .0
        .unwrap();
    assert_eq!(after.modify_index, control.modify_index);

    let (code, out, err) = c.rcctl(&["roll", "resume", &id]).await;
    assert_eq!(code, 0, "{out}{err}");
    completed(&c, roll, old, 4, Duration::from_secs(60)).await;
    assert_eq!(
        c.count_prefix("rcfarm/rolls/").await,
        0,
        "the control goes with the roll"
    );
    let lowest = c.roll_lowest_up().get(&id).copied();
    assert!(lowest.is_none_or(|l| l >= 3), "lowest pods up {lowest:?}");

    // Audited once each, with who did it.
    c.wait_for(
        Duration::from_secs(10),
        "the audit records",
        move || async move { cr.audit_events("ROLLING_UPDATE_RESUMED").await.len() == 1 },
    )
    .await;
    let paused = c.audit_events("ROLLING_UPDATE_PAUSED").await;
    assert_eq!(paused.len(), 1, "{paused:?}");
    assert!(paused[0]["actor"].as_str().unwrap().starts_with("rcctl:"));
    assert_eq!(paused[0]["rolling_update_id"], id);

    // The roll is gone: pausing it is a usage mistake, and nothing is written.
    let (code, _, err) = c.rcctl(&["roll", "pause", &id]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains(&format!("no rolling update {id}")), "{err}");
    assert_eq!(c.count_prefix("rcfarm/rolls/").await, 0);
    c.check_invariants(|_| false);
}

on_both_backends!(max_parallel_and_max_unavailable_pace_a_roll_started_by_rcctl);
async fn max_parallel_and_max_unavailable_pace_a_roll_started_by_rcctl(backend: Backend) {
    let (c, _sim, old) = rolling_cluster(&backend, 4, 4).await;
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("v2.yaml");
    std::fs::write(&manifest, Cluster::manifest("svc-0", 2)).unwrap();
    let (m, id) = (manifest.to_str().unwrap(), old.to_string());

    // Mistakes: exit 2, nothing written.
    refused_starts(
        &c,
        &id,
        m,
        &[
            (
                vec!["--max-unavailable", "150%"],
                "a percentage of at most 100%",
            ),
            (vec!["--max-unavailable", "10%"], "that is 0 of 4 pods"),
            (
                vec!["--max-unavailable", "many"],
                "give a number of pods (2) or a percentage",
            ),
            (vec!["--max-parallel", "0"], "--max-parallel 0"),
            (
                vec!["--max-unavailable", "1", "--minimum", "2"],
                "cannot be used with",
            ),
        ],
    )
    .await;
    assert_eq!(c.count_prefix("rolls/").await, 0);

    // 100% unavailable is a minimum of 0, which alone would replace all four pods in one step;
    // --max-parallel 1 replaces them one at a time.
    let (code, out, err) = c
        .rcctl(&[
            "roll",
            "start",
            &id,
            "-f",
            m,
            "--max-unavailable",
            "100%",
            "--max-parallel",
            "1",
        ])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    let roll = RcId::parse(out.trim()).unwrap();
    let stored = RollStore::new(c.consul.clone())
        .list()
        .await
        .unwrap()
        .rolls
        .get(&roll)
        .unwrap()
        .update
        .minimum_replicas;
    assert_eq!(stored, 0, "P2's field holds the converted minimum");
    completed(&c, roll, old, 4, Duration::from_secs(60)).await;
    audited(&c, "ROLLING_UPDATE_COMPLETION", 1).await;
    let steps = c.audit_events("ROLLING_UPDATE_STEP").await;
    let added: Vec<u64> = steps
        .iter()
        .filter_map(|s| s["replicas_added"].as_u64())
        .collect();
    assert_eq!(added.iter().sum::<u64>(), 4, "{steps:#?}");
    assert!(added.iter().all(|a| *a <= 1), "one pod per step: {added:?}");
}

on_both_backends!(a_roll_whose_new_pods_never_pass_fails_at_its_deadline_and_stops);
async fn a_roll_whose_new_pods_never_pass_fails_at_its_deadline_and_stops(backend: Backend) {
    // Version 9 of any manifest never passes its health check: a bad deploy.
    let (c, _sim, old) = rolling_cluster_failing(&backend, 4, 3, Some("-9.tar.gz")).await;
    let cr = &c;
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("v9.yaml");
    std::fs::write(&manifest, Cluster::manifest("svc-0", 9)).unwrap();
    let m = manifest.to_str().unwrap();

    // --wait ends as soon as the roll fails, with its own exit code and the reason.
    let started = std::time::Instant::now();
    let (code, out, err) = c
        .rcctl(&[
            "roll",
            "start",
            &old.to_string(),
            "-f",
            m,
            "--progress-deadline",
            "3s",
            "--wait",
            "--timeout",
            "120s",
        ])
        .await;
    assert_eq!(code, 3, "{out}{err}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "not at the timeout"
    );
    assert!(err.contains("failed: no new pod became up for 3s"), "{err}");
    assert!(err.contains("rcctl roll resume"), "{err}");
    let roll = RcId::parse(out.lines().next().unwrap().trim()).unwrap();
    println!("--wait: {}", err.lines().last().unwrap_or_default());

    // Failed is terminal and kept visible: no further step, the roll and its lock stay.
    let desired = |id: RcId| desired_of(cr, id);
    let at_failure = (desired(old).await, desired(roll).await);
    c.roll_passes(roll, 5).await;
    assert_eq!((desired(old).await, desired(roll).await), at_failure);
    assert!(roll_exists(&c, roll).await);
    assert!(roll_holder(&c, roll).await.is_some());
    let (code, out, _) = c
        .rcctl(&["--json", "roll", "show", &roll.to_string()])
        .await;
    assert_eq!(code, 0);
    assert!(out.contains("Failed: no new pod became up for 3s"), "{out}");
    let failed = c.audit_events("ROLLING_UPDATE_FAILED").await;
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0]["progress_deadline"], "3s");
    let pods = failed[0]["new_pods"].to_string();
    assert!(
        pods.contains("health critical"),
        "which pods, what their health says: {pods}"
    );
    // The old pods kept the roll's minimum the whole time.
    let lowest = c.roll_lowest_up().get(&roll.to_string()).copied();
    assert!(lowest.is_none_or(|l| l >= 2), "lowest pods up {lowest:?}");

    // A resume gives it another deadline (it fails again: nothing got better); an abort ends it.
    let (code, out, _) = c.rcctl(&["roll", "resume", &roll.to_string()]).await;
    assert_eq!(code, 0, "{out}");
    audited(&c, "ROLLING_UPDATE_FAILED", 2).await;
    let (code, _, err) = c.rcctl(&["roll", "abort", &roll.to_string()]).await;
    assert_eq!(code, 0, "{err}");
    assert!(!roll_exists(&c, roll).await);
    assert_eq!(c.count_prefix("rcfarm/rolls/").await, 0);
    c.check_invariants(|_| false);
}

on_both_backends!(a_canary_roll_replaces_k_pods_pauses_and_goes_on_when_promoted);
async fn a_canary_roll_replaces_k_pods_pauses_and_goes_on_when_promoted(backend: Backend) {
    let (c, _sim, old) = rolling_cluster(&backend, 5, 5).await;
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("v2.yaml");
    std::fs::write(&manifest, Cluster::manifest("svc-0", 2)).unwrap();
    let (m, id) = (manifest.to_str().unwrap(), old.to_string());

    // Mistakes: exit 2, nothing written.
    refused_starts(
        &c,
        &id,
        m,
        &[
            (
                vec!["--canary", "5"],
                "--canary 5: a canary must be smaller",
            ),
            (
                vec!["--canary", "7"],
                "--canary 7: a canary must be smaller",
            ),
        ],
    )
    .await;
    assert_eq!(c.count_prefix("rolls/").await, 0);
    assert_eq!(c.count_prefix("rcfarm/rolls/").await, 0);

    // A minimum of 0 would replace all five at once; the canary replaces two, and --wait
    // returns once they are up.
    let (code, out, err) = c
        .rcctl(&[
            "roll",
            "start",
            &id,
            "-f",
            m,
            "--minimum",
            "0",
            "--canary",
            "2",
            "--wait",
            "--timeout",
            "60s",
        ])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains("canary up after"), "{err}");
    let roll = RcId::parse(out.lines().next().unwrap().trim()).unwrap();
    let rid = roll.to_string();
    assert!(
        c.all_up(roll, 2).await,
        "both canary pods run the new manifest and pass"
    );
    // Paused for its canary: no further step, shown as such, audited with the farm as actor.
    c.roll_passes(roll, 5).await;
    assert_eq!(desired_of(&c, roll).await, Some(2));
    assert_eq!(desired_of(&c, old).await, Some(3));
    let (code, out, _) = c.rcctl(&["--json", "roll", "show", &rid]).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("Paused (canary): its 2 canary pods are up"),
        "{out}"
    );
    let (code, out, _) = c.rcctl(&["roll", "list"]).await;
    assert_eq!(code, 0);
    assert!(out.contains("Paused (canary)"), "{out}");
    let paused = c.audit_events("ROLLING_UPDATE_PAUSED").await;
    assert_eq!(paused.len(), 1, "{paused:?}");
    assert_eq!(paused[0]["actor"], "canary");
    assert_eq!(paused[0]["canary_pods_up"], 2);
    let metrics = c.metrics("f1").await;
    assert!(
        metrics.lines().any(|l| l == "rcfarm_rolls_paused 1"),
        "{metrics}"
    );

    // Resume is not how a canary goes on; promote is. A roll without a canary has nothing
    // to promote.
    let (code, _, err) = c.rcctl(&["roll", "resume", &rid]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("rcctl roll promote"), "{err}");
    let (code, _, err) = c.rcctl(&["roll", "promote", &old.to_string()]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no rolling update"), "{err}");

    let (code, out, err) = c
        .rcctl(&["roll", "promote", &rid, "--wait", "--timeout", "60s"])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("promoted"), "{out}");
    assert!(err.contains("rolling update complete"), "{err}");
    completed(&c, roll, old, 5, Duration::from_secs(30)).await;
    audited(&c, "ROLLING_UPDATE_PROMOTED", 1).await;
    let promoted = c.audit_events("ROLLING_UPDATE_PROMOTED").await;
    assert!(promoted[0]["actor"].as_str().unwrap().starts_with("rcctl:"));
    assert_eq!(promoted[0]["canary_was_up"], true);
    // The canary's two pods in one step, then (a minimum of 0) the other three in one.
    let steps = c.audit_events("ROLLING_UPDATE_STEP").await;
    let mut added: Vec<u64> = steps
        .iter()
        .filter_map(|s| s["replicas_added"].as_u64())
        .filter(|a| *a > 0)
        .collect();
    added.sort();
    assert_eq!(added, vec![2, 3], "{steps:#?}");
    c.check_invariants(|_| false);
}

on_both_backends!(a_rolling_restart_replaces_every_pod_with_the_same_manifest_through_a_roll);
async fn a_rolling_restart_replaces_every_pod_with_the_same_manifest_through_a_roll(
    backend: Backend,
) {
    let (c, _sim, old) = rolling_cluster(&backend, 4, 3).await;
    let before = RcStore::new(c.consul.clone())
        .get(old)
        .await
        .unwrap()
        .unwrap();

    // Mistakes: exit 2, nothing written.
    let missing = RcId::new().to_string();
    let (code, _, err) = c.rcctl(&["rc", "restart", &missing]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("does not exist"), "{err}");
    let (code, _, err) = c
        .rcctl(&["rc", "restart", &old.to_string(), "--canary", "3"])
        .await;
    assert_eq!(code, 2, "{err}");
    assert_eq!(c.count_prefix("rolls/").await, 0);

    let (code, out, err) = c
        .rcctl(&[
            "rc",
            "restart",
            &old.to_string(),
            "--max-parallel",
            "1",
            "--wait",
            "--timeout",
            "60s",
        ])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    let roll = RcId::parse(out.lines().next().unwrap().trim()).unwrap();
    completed(&c, roll, old, 3, Duration::from_secs(30)).await;
    let after = RcStore::new(c.consul.clone())
        .get(roll)
        .await
        .unwrap()
        .unwrap();
    // The same pod, selector and labels; to P2's preparer a new manifest (its SHA changed).
    assert_eq!(after.pod_id(), before.pod_id());
    assert_eq!(
        after.node_selector.to_string(),
        before.node_selector.to_string()
    );
    assert_eq!(after.pod_labels, before.pod_labels);
    assert_ne!(after.manifest.digest(), before.manifest.digest());
    assert!(
        after.manifest.raw().contains("rcfarm_restarted_at:"),
        "{}",
        after.manifest.raw()
    );
    // Every pod was replaced, one at a time, never below the default minimum (desired − 1).
    let steps = c.audit_events("ROLLING_UPDATE_STEP").await;
    let added: u64 = steps
        .iter()
        .filter_map(|s| s["replicas_added"].as_u64())
        .sum();
    assert_eq!(added, 3, "{steps:#?}");
    let lowest = c.roll_lowest_up().get(&roll.to_string()).copied();
    assert!(lowest.is_none_or(|l| l >= 2), "lowest pods up {lowest:?}");
    c.check_invariants(|_| false);
}

/// Starts a roll of `old` (pod `svc-0`) onto version 9 of its manifest (which the simulator
/// of [`rolling_cluster_failing`] with `-9.tar.gz` never passes), with `deadline`.
pub(crate) async fn start_bad_roll(c: &Cluster, old: RcId, deadline: &str) -> RcId {
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("v9.yaml");
    std::fs::write(&manifest, Cluster::manifest("svc-0", 9)).unwrap();
    let (code, out, err) = c
        .rcctl(&[
            "roll",
            "start",
            &old.to_string(),
            "-f",
            manifest.to_str().unwrap(),
            "--progress-deadline",
            deadline,
        ])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    RcId::parse(out.trim()).unwrap()
}

on_both_backends!(a_handover_does_not_postpone_a_rolls_progress_deadline);
async fn a_handover_does_not_postpone_a_rolls_progress_deadline(backend: Backend) {
    // Version 9 never passes: the roll must fail about its deadline after its step, even
    // though its farm stops half-way and another farm carries it on.
    let (mut c, _sim, old) = rolling_cluster_failing(&backend, 4, 3, Some("-9.tar.gz")).await;
    c.spawn_farm("f2", &ROLL_FLAGS).await;
    let roll = start_bad_roll(&c, old, "8s").await;
    audited(&c, "ROLLING_UPDATE_STEP", 1).await;
    let stepped = std::time::Instant::now();
    // Half-way to the deadline, the roll's farm stops: the other one takes the roll over.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let holder = roll_holder(&c, roll).await.expect("the roll is held");
    let owner = c.farm_sessions().await[&holder].clone();
    let i = c.farms.iter().position(|f| f.id == owner).unwrap();
    signal(c.farms[i].pid, "TERM");
    let cr = &c;
    c.wait_for(
        Duration::from_secs(30),
        "the roll fails",
        move || async move { cr.audit_events("ROLLING_UPDATE_FAILED").await.len() == 1 },
    )
    .await;
    let after = stepped.elapsed().as_secs_f64();
    let failed = c.audit_events("ROLLING_UPDATE_FAILED").await;
    assert_ne!(
        failed[0]["farm_id"], owner,
        "failed by the farm that took it over"
    );
    println!("failed {after:.1} s after its step was seen (deadline 8 s, handover at 4 s)");
    // Counting the deadline from the handover would fail it 12 s or more after the step.
    assert!(after < 11.0, "failed {after:.1} s after its step");
}

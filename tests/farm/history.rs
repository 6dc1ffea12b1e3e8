//! Revision history, undo and auto-revert (issue 20, items 5 and 6), carried out by real farm
//! processes with the node simulator.

use std::time::Duration;

use rcfarm::rc::{RcId, RcStore};
use serde_json::Value;

use crate::harness::{Backend, Cluster, nodes};
use crate::on_every_backend;
use crate::rolls::{
    ROLL_FLAGS, audited, completed, desired_of, roll_exists, rolling_cluster_failing,
};

/// `rcctl --json rc history RC`: its revisions.
async fn revisions(c: &Cluster, rc: RcId) -> Vec<Value> {
    let (code, out, err) = c.rcctl(&["--json", "rc", "history", &rc.to_string()]).await;
    assert_eq!(code, 0, "{out}{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    v["revisions"].as_array().unwrap().clone()
}

/// The raw manifest of an RC.
async fn manifest_of(c: &Cluster, rc: RcId) -> String {
    RcStore::new(c.consul.clone())
        .get(rc)
        .await
        .unwrap()
        .unwrap()
        .manifest
        .raw()
        .to_string()
}

/// Runs `rcctl` expecting a usage error saying `says`, and checks nothing was written: no
/// roll, and the same RCs.
async fn refused(c: &Cluster, args: &[&str], says: &str) {
    let rcs_before = c.count_prefix("replication_controllers/").await;
    let (code, out, err) = c.rcctl(args).await;
    assert_eq!(code, 2, "{args:?}: {out}{err}");
    assert!(err.contains(says), "{args:?}: {err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert_eq!(c.count_prefix("rolls/").await, 0, "{args:?} wrote a roll");
    assert_eq!(
        c.count_prefix("replication_controllers/").await,
        rcs_before,
        "{args:?} wrote an RC"
    );
}

on_every_backend!(a_completed_roll_leaves_a_revision_and_undo_rolls_back_to_it);
async fn a_completed_roll_leaves_a_revision_and_undo_rolls_back_to_it(backend: Backend) {
    let (c, _sim, old) = rolling_cluster_failing(&backend, 4, 3, None).await;
    let original = manifest_of(&c, old).await;
    let dir = tempfile::tempdir().unwrap();
    let v2 = dir.path().join("v2.yaml");
    std::fs::write(&v2, Cluster::manifest("svc-0", 2)).unwrap();
    let id = old.to_string();

    // No history yet: listed as none; an undo is a usage error that writes nothing.
    let (code, out, _) = c.rcctl(&["rc", "history", &id]).await;
    assert_eq!(code, 0);
    assert!(out.contains("no revisions"), "{out}");
    refused(&c, &["roll", "undo", &id], "has no revision history").await;

    // A roll with its pace (a minimum of 0, one pod per step): the old RC becomes revision 1 of the new RC's lineage.
    let (code, out, err) = c
        .rcctl(&[
            "roll",
            "start",
            &id,
            "-f",
            v2.to_str().unwrap(),
            "--max-unavailable",
            "100%",
            "--max-parallel",
            "1",
            "--wait",
            "--timeout",
            "60s",
        ])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    let new = RcId::parse(out.trim()).unwrap();
    completed(&c, new, old, 3, Duration::from_secs(30)).await;
    let revs = revisions(&c, new).await;
    assert_eq!(revs.len(), 1, "{revs:#?}");
    let r = &revs[0];
    assert_eq!(r["revision"], 1);
    assert_eq!(r["rc_id"], id);
    assert_eq!(r["roll"], new.to_string());
    assert_eq!(r["manifest"], original);
    assert_eq!(r["node_selector"], "env=prod");
    assert_eq!(r["pod_labels"]["cluster_name"], "test");
    assert_eq!(r["replicas"], 3);
    assert_eq!(
        (r["minimum_replicas"].clone(), r["max_parallel"].clone()),
        (0.into(), 1.into())
    );
    assert!(r["by"].as_str().unwrap().starts_with("rcctl:"), "{r}");
    let (code, table, _) = c.rcctl(&["rc", "history", &new.to_string()]).await;
    assert_eq!(code, 0);
    assert!(table.contains(&id) && table.contains("rcctl:"), "{table}");
    // The old RC's key is gone with it: one document per lineage.
    assert_eq!(c.count_prefix("rcfarm/history/").await, 1);

    // A revision that does not exist: says which do, writes nothing.
    refused(
        &c,
        &["roll", "undo", &new.to_string(), "--to-revision", "7"],
        "has no revision 7; its revisions are 1",
    )
    .await;

    // Undo: an ordinary roll back to revision 1's manifest, under the same pace.
    let (code, out, err) = c
        .rcctl(&[
            "roll",
            "undo",
            &new.to_string(),
            "--wait",
            "--timeout",
            "60s",
        ])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains("back to revision 1"), "{err}");
    let undone = RcId::parse(out.lines().next().unwrap().trim()).unwrap();
    completed(&c, undone, new, 3, Duration::from_secs(30)).await;
    assert_eq!(manifest_of(&c, undone).await, original);
    let steps = c.audit_events("ROLLING_UPDATE_STEP").await;
    let undo_steps: Vec<u64> = steps
        .iter()
        .filter(|s| s["rolling_update_id"] == undone.to_string())
        .filter_map(|s| s["replicas_added"].as_u64())
        .collect();
    assert!(
        !undo_steps.is_empty() && undo_steps.iter().all(|a| *a <= 1),
        "the undo keeps the pace (a minimum of 0 alone would move all 3 at once): {undo_steps:?}"
    );
    let revs = revisions(&c, undone).await;
    let lineage: Vec<(u64, String)> = revs
        .iter()
        .map(|r| {
            (
                r["revision"].as_u64().unwrap(),
                r["rc_id"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(lineage, vec![(1, id.clone()), (2, new.to_string())]);
    assert_eq!(c.count_prefix("rcfarm/history/").await, 1);
    c.check_invariants(|_| false);

    // An RC already in a roll is not undone: usage error, nothing more written.
    let (code, out, err) = c
        .rcctl(&[
            "roll",
            "start",
            &undone.to_string(),
            "-f",
            v2.to_str().unwrap(),
            "--roll-delay",
            "1h",
        ])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    let rcs = c.count_prefix("replication_controllers/").await;
    let (code, _, err) = c.rcctl(&["roll", "undo", &undone.to_string()]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("already in rolling update"), "{err}");
    assert_eq!(c.count_prefix("rolls/").await, 1);
    assert_eq!(c.count_prefix("replication_controllers/").await, rcs);
}

on_every_backend!(a_failed_roll_is_reverted_by_its_farm_and_a_failed_revert_stays_failed);
async fn a_failed_roll_is_reverted_by_its_farm_and_a_failed_revert_stays_failed(backend: Backend) {
    // Manifests whose artifact ends in 9.tar.gz (versions 9 and 19) never pass; the farm
    // reverts failed rolls by default.
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 4, 1).await;
    let _sim = c.simulate_failing(4, "9.tar.gz");
    let mut flags = ROLL_FLAGS.to_vec();
    // A revert's deadline is the longer of the failed roll's and the farm's: 3 s here, so
    // that a revert that cannot succeed either fails within the test.
    flags.extend(["--roll-auto-revert", "--roll-progress-deadline", "3s"]);
    c.spawn_farm("f1", &flags).await;
    let old = crate::harness::rcs(&c, 1, 3).await[0];
    let original = manifest_of(&c, old).await;
    let cr = &c;
    c.wait_for(
        Duration::from_secs(30),
        "the old RC up",
        move || async move { cr.all_up(old, 3).await },
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: String| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    let bad0 = file("svc-0-v9.yaml", Cluster::manifest("svc-0", 9));

    // A bad deploy (the farm's default says revert): it fails, and its farm rolls back.
    let (code, out, err) = c
        .rcctl(&[
            "roll",
            "start",
            &old.to_string(),
            "-f",
            &bad0,
            "--progress-deadline",
            "3s",
            "--wait",
            "--timeout",
            "60s",
        ])
        .await;
    // --wait ends with the failure's exit code, saying it was reverted.
    assert_eq!(code, 3, "{out}{err}");
    assert!(err.contains("failed and its farm reverted it"), "{err}");
    let bad = RcId::parse(out.lines().next().unwrap().trim()).unwrap();
    // The revert is the roll bad → old, named by the old RC; it completes: every pod back on
    // the old manifest, the bad RC gone.
    completed(&c, old, bad, 3, Duration::from_secs(40)).await;
    assert_eq!(manifest_of(&c, old).await, original);
    let failed = c.audit_events("ROLLING_UPDATE_FAILED").await;
    assert_eq!(failed.len(), 1, "{failed:#?}");
    assert_eq!(failed[0]["rolling_update_id"], bad.to_string());
    assert_eq!(failed[0]["auto_revert"], true);
    let reverted = c.audit_events("ROLLING_UPDATE_REVERTED").await;
    assert_eq!(reverted.len(), 1, "{reverted:#?}");
    let r = &reverted[0];
    assert_eq!(r["failed_rolling_update_id"], bad.to_string());
    assert_eq!(r["rolling_update_id"], old.to_string());
    assert_eq!(
        (r["old_rc"].clone(), r["new_rc"].clone()),
        (bad.to_string().into(), old.to_string().into())
    );
    assert_eq!(r["auto"], true);
    assert_eq!(
        (
            r["minimum_replicas"].clone(),
            r["progress_deadline"].clone()
        ),
        (2.into(), "3s".into())
    );
    // Both rolls ended in P2's records: the failed one not succeeded, the revert succeeded.
    let ends = c.audit_events("ROLLING_UPDATE_COMPLETION").await;
    let ended = |id: RcId| {
        ends.iter()
            .find(|e| e["rolling_update_id"] == id.to_string())
            .map(|e| e["succeeded"].clone())
    };
    assert_eq!(ended(bad), Some(Value::Bool(false)), "{ends:#?}");
    assert_eq!(ended(old), Some(Value::Bool(true)), "{ends:#?}");
    // The failed RC is revision 1 of the old RC's lineage now.
    let revs = revisions(&c, old).await;
    assert_eq!(revs.len(), 1, "{revs:#?}");
    assert_eq!(revs[0]["rc_id"], bad.to_string());
    assert!(
        revs[0]["by"].as_str().unwrap().contains("auto-revert"),
        "{revs:#?}"
    );

    // A revert that fails too stays Failed: an RC whose own manifest never passes, rolled
    // (asking for it explicitly) onto another that never passes either. Minimum 0: with its
    // old pods never up, a roll under a minimum could take no step at all, and a roll that
    // could not move has not failed (its deadline counts only time spent waiting on new pods).
    let broken = file("svc-1-v19.yaml", Cluster::manifest("svc-1", 19));
    let bad1 = file("svc-1-v9.yaml", Cluster::manifest("svc-1", 9));
    let (code, out, err) = c
        .rcctl(&[
            "rc",
            "create",
            "-f",
            &broken,
            "--node-selector",
            "env=prod",
            "--replicas",
            "2",
        ])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    let first = RcId::parse(out.trim()).unwrap();
    let (code, out, err) = c
        .rcctl(&[
            "roll",
            "start",
            &first.to_string(),
            "-f",
            &bad1,
            "--minimum",
            "0",
            "--progress-deadline",
            "2s",
            "--auto-revert",
        ])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    let second = RcId::parse(out.trim()).unwrap();
    audited(&c, "ROLLING_UPDATE_FAILED", 3).await;
    let (code, out, _) = c
        .rcctl(&["--json", "roll", "show", &first.to_string()])
        .await;
    assert_eq!(code, 0, "{out}");
    // The revert's deadline: the farm's 3 s, longer than the failed roll's 2 s.
    assert!(out.contains("Failed: no new pod became up for 3s"), "{out}");
    assert!(
        out.contains(&format!(
            "Reverting: rolls back the failed rolling update {second}"
        )),
        "{out}"
    );
    // Well past another deadline: still one revert each, the revert kept, nothing reverted
    // back and forth.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let reverted = c.audit_events("ROLLING_UPDATE_REVERTED").await;
    assert_eq!(reverted.len(), 2, "{reverted:#?}");
    assert_eq!(c.audit_events("ROLLING_UPDATE_FAILED").await.len(), 3);
    assert!(roll_exists(&c, first).await && !roll_exists(&c, second).await);
    assert_eq!(c.count_prefix("rolls/").await, 1);
    let control: Value = serde_json::from_slice(
        c.consul
            .kv_get(&format!("rcfarm/rolls/{first}"), &Default::default())
            .await
            .unwrap()
            .0
            .unwrap()
            .value_bytes(),
    )
    .unwrap();
    assert_eq!(control["revert_of"], second.to_string(), "{control}");
    assert!(control["failed"].is_object(), "{control}");
    assert!(
        desired_of(&c, second).await.is_some(),
        "the failed RC stays until an operator acts"
    );
    c.check_invariants(|_| false);
}

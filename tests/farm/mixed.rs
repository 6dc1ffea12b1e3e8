//! Farms of the previous release beside this one's, as operators upgrade them: one at a time.
//! What one version writes in Consul (a transfer's start, a retired RC's marker, a roll's
//! steps) the other reads, and an operator's ordinary day runs across the mix, each step
//! carried by the other version than the one before.
//!
//! The previous release's `rcfarm` comes from `RCFARM_TEST_PREVIOUS_BIN` (`scripts/previous-release`
//! builds the commit `.ci/previous-release` names and prints its path); without it these tests
//! say so and pass.

use std::time::Duration;

use rcfarm::rc::RcId;

use crate::brakes::{
    a_transfer_in_flight_from, bad_deploy_reverted, create_web, day_manifests, deploy, intents,
    scale_to_zero_and_delete,
};
use crate::harness::{Backend, Cluster, nodes, signal};
use crate::rolls::{ROLL_FLAGS, roll_exists};
use crate::{on_both_backends, on_every_backend};

fn previous_bin() -> Option<String> {
    match std::env::var("RCFARM_TEST_PREVIOUS_BIN") {
        Ok(p) if std::path::Path::new(&p).is_file() => Some(p),
        Ok(p) => {
            eprintln!(
                "SKIPPED: RCFARM_TEST_PREVIOUS_BIN={p} is no file: no farm of the previous release to run beside this one"
            );
            None
        }
        Err(_) => {
            eprintln!(
                "SKIPPED: set RCFARM_TEST_PREVIOUS_BIN to the previous release's rcfarm to run farms of both releases side by side"
            );
            None
        }
    }
}

/// Starts farm `id` from `bin` with the roll test flags.
async fn spawn(c: &mut Cluster, bin: &str, id: &str) -> usize {
    let url = c.server.url();
    c.spawn_farm_from(bin, id, &url, &ROLL_FLAGS, &[]).await
}

/// Stops farm `i` with SIGTERM (it hands over what it serves) and waits for it to exit.
async fn stop(c: &mut Cluster, i: usize) {
    signal(c.farms[i].pid, "TERM");
    let _ = tokio::time::timeout(Duration::from_secs(15), c.farms[i].child.wait()).await;
}

fn first_line((code, out, err): (i32, String, String)) -> String {
    assert_eq!(code, 0, "{out}{err}");
    out.lines().next().unwrap_or_default().trim().to_string()
}

/// Waits until `rc` runs `replicas` pods that are up, each asking for `artifact`, with no roll
/// left.
async fn settled_on(c: &Cluster, rc: RcId, replicas: usize, artifact: &str, what: &str) {
    let artifact = format!("{artifact}.tar.gz");
    let a = &artifact;
    c.wait_for(Duration::from_secs(60), what, move || async move {
        c.count_prefix("rolls/").await == 0
            && c.all_up(rc, replicas).await
            && intents(c, rc).await.iter().all(|m| m.contains(a.as_str()))
    })
    .await;
}

on_every_backend!(an_operators_day_across_an_upgrade);
/// Create, two deploys, a bad deploy reverted, an undo, a scale to 0 and a delete, on a farm of
/// each release; before each step the farm that carried the last one stops, so that each step
/// is taken over or carried by the other release.
async fn an_operators_day_across_an_upgrade(backend: Backend) {
    let Some(previous) = previous_bin() else {
        return;
    };
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 6, 2).await;
    let _sim = c.simulate_failing(6, "broken");
    let this = crate::harness::BIN;
    let mut old = spawn(&mut c, &previous, "old").await;
    let mut new = spawn(&mut c, this, "new").await;
    let dir = tempfile::tempdir().unwrap();
    let [v1, v2, v3, bad] = day_manifests(dir.path());
    let first = first_line(create_web(&c, &v1, 4).await);
    let rc = RcId::parse(&first).unwrap();
    settled_on(&c, rc, 4, "web-1", "4 pods of v1 up").await;

    // The first deploy, on the previous release alone.
    stop(&mut c, new).await;
    let second = first_line(deploy(&c, &first, &v2, &[]).await);
    let rc2 = RcId::parse(&second).unwrap();
    settled_on(&c, rc2, 4, "web-2", "the previous release rolled onto v2").await;
    assert!(!roll_exists(&c, rc2).await);

    // The second deploy, on this release alone: it reads what the previous one left.
    new = spawn(&mut c, this, "new").await;
    stop(&mut c, old).await;
    let third = first_line(deploy(&c, &second, &v3, &[]).await);
    let good = RcId::parse(&third).unwrap();
    settled_on(&c, good, 4, "web-3", "this release rolled onto v3").await;

    // A bad deploy with both releases running: it fails and is reverted by whichever carries it.
    old = spawn(&mut c, &previous, "old").await;
    bad_deploy_reverted(&c, &third, &bad).await;
    settled_on(&c, good, 4, "web-3", "back on v3").await;

    // Undo, on the previous release alone: back to v2 (revision 2; revision 3 is the bad
    // deploy the revert replaced, which a plain undo passes over only when this release
    // completed the revert: the previous one does not mark it).
    stop(&mut c, new).await;
    let undone = first_line(
        c.rcctl(&[
            "roll",
            "undo",
            &third,
            "--to-revision",
            "2",
            "--wait",
            "--timeout",
            "90s",
        ])
        .await,
    );
    let undone = RcId::parse(&undone).unwrap();
    settled_on(&c, undone, 4, "web-2", "undone onto v2").await;

    // Scale to 0 and delete, on this release alone.
    spawn(&mut c, this, "new").await;
    stop(&mut c, old).await;
    scale_to_zero_and_delete(&c, undone).await;
    c.check_invariants(|_| false);
}

on_every_backend!(a_node_transfer_crosses_releases_both_ways);
/// A node transfer started by one release and ended by the other: the previous release's
/// start (P2's status key only) is resumed and timed out by this one, and this one's start
/// (P2's key and rcfarm's own) is resumed and rolled back by the previous one (a release that
/// leaves rcfarm's key behind has it deleted by this one when it next takes the RC).
async fn a_node_transfer_crosses_releases_both_ways(backend: Backend) {
    let Some(previous) = previous_bin() else {
        return;
    };
    for (starts, ends) in [
        (previous.as_str(), crate::harness::BIN),
        (crate::harness::BIN, previous.as_str()),
    ] {
        let mut flags = ROLL_FLAGS.to_vec();
        flags.extend(["--transfer-timeout", "6s"]);
        // No new pod passes once the transfer has started, so it can only time out and roll
        // back.
        let (mut c, o) = a_transfer_in_flight_from(&backend, starts, "starts", &flags, &[]).await;
        let url = c.server.url();
        signal(c.farms[0].pid, "KILL");
        let previous_ends = ends != crate::harness::BIN;
        if previous_ends {
            // Its node eligible again, the transfer is rolled back and none follows: what the
            // previous release leaves of it then stays for this release to clean.
            c.label_node("node-00", &[("env", "prod")]).await;
        }
        c.spawn_farm_from(ends, "ends", &url, &flags, &[]).await;
        let cr = &c;
        c.wait_for(
            Duration::from_secs(45),
            "the other release rolled the transfer back",
            // (On a timeout it starts the move again at once, as P2's farm would: the record
            // is the proof.)
            move || async move {
                cr.audit_events("NODE_TRANSFER_ROLLBACK")
                    .await
                    .iter()
                    .any(|r| r["farm_id"] == "ends")
            },
        )
        .await;
        if previous_ends {
            // A release from before rcfarm's start key (5509f94) deleted P2's key only, leaving
            // rcfarm's, naming the transfer that ended: it misleads nobody (it names that
            // transfer's id), and this release's farm deletes it when it takes the RC over.
            // Releases since delete both.
            let ours = rcfarm::rctask::rcfarm_status_key(o);
            c.wait_for(
                Duration::from_secs(15),
                "P2's key gone",
                move || async move { !cr.transfer_in_flight(o).await },
            )
            .await;
            let left = c.count_prefix(&ours).await;
            println!("the previous release left {left} rcfarm start key(s) behind");
            assert!(left <= 1);
            signal(c.farms[1].pid, "KILL");
            c.spawn_farm_from(crate::harness::BIN, "cleans", &url, &flags, &[])
                .await;
            let (cr, ours) = (&c, ours.as_str());
            c.wait_for(
                Duration::from_secs(45),
                "the stale start key deleted by this release",
                move || async move { cr.count_prefix(ours).await == 0 },
            )
            .await;
            assert!(!c.transfer_in_flight(o).await, "no transfer was needed");
        }
        c.check_invariants(|_| false);
    }
}

on_every_backend!(the_clusters_removal_window_beside_a_farm_of_the_previous_release);
/// Issue 45 across an upgrade. A farm of a release before the cluster's window (e5f34ad) keeps
/// its own budget in memory and never writes the key: a bulk edit written one PUT per RC on
/// the mix removes at most the new farm's cluster limit plus the old farm's own (5 + 5 on the
/// defaults), and the key holds the new farm's removals within its limit. A farm of a release
/// with the window (9b6bfac on) charges the same key: the mix removes at most the cluster's 5,
/// and its count and the new farm's are both kept (9b6bfac writes its count without the session
/// that releases from 38c1fcd on record with each; either is read).
async fn the_clusters_removal_window_beside_a_farm_of_the_previous_release(backend: Backend) {
    let Some(previous) = previous_bin() else {
        return;
    };
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 6, 2).await;
    let _sim = c.simulate(6, 0.0);
    let url = c.server.url();
    c.spawn_farm_from(&previous, "old", &url, &crate::brakes::DEFAULTS, &[])
        .await;
    c.spawn_farm("new", &crate::brakes::DEFAULTS).await;
    let ids = crate::harness::rcs(&c, 12, 2).await;
    let (cr, idr) = (&c, &ids);
    c.wait_for(
        Duration::from_secs(60),
        "24 pods placed, both farms serving",
        move || async move {
            let p = cr.placements().await;
            let owners: std::collections::BTreeSet<String> =
                cr.owner_farms().await.into_values().collect();
            idr.iter()
                .map(|id| p.get(id).map_or(0, |s| s.len()))
                .sum::<usize>()
                == 24
                && owners.len() == 2
        },
    )
    .await;
    // One of the new farm's RCs first, alone, until the key holds its charge: 15 s after the
    // bulk edit written all at once, a loaded machine once found no charge yet, which showed
    // nothing about whether the new farm charges the cluster's key.
    let first = *c
        .owner_farms()
        .await
        .iter()
        .find(|(_, farm)| *farm == "new")
        .expect("the new farm serves an RC")
        .0;
    c.patch_rc(first, "replicas_desired", 0.into()).await;
    c.wait_for(
        Duration::from_secs(60),
        "the new farm charges its first removal to the cluster's key",
        move || async move {
            cr.removal_window()
                .await
                .is_some_and(|w| w.buckets.iter().any(|b| b.1 > 0))
        },
    )
    .await;
    for id in ids.iter().filter(|id| **id != first) {
        c.patch_rc(*id, "replicas_desired", 0.into()).await;
    }
    // Time for the farms to remove what they would; the bounds below hold at every moment, so
    // a slow machine only makes them easier to meet, never fail.
    tokio::time::sleep(Duration::from_secs(15)).await;
    let p = c.placements().await;
    let removed = 24
        - ids
            .iter()
            .map(|id| p.get(id).map_or(0, |s| s.len()))
            .sum::<usize>();
    assert!(
        removed <= 10,
        "{removed} removed: more than the new farm's cluster limit and the old farm's own"
    );
    let w = c
        .removal_window()
        .await
        .expect("the new farm charged the key");
    let spent: u64 = w.buckets.iter().map(|b| b.1).sum();
    assert!(
        (1..=5).contains(&spent),
        "the new farm's removals, within the cluster's limit: {w:?}"
    );
    // A previous release with the window charges the same key: one cluster limit, and each
    // release keeps the other's count (9b6bfac drops the new one's session when it rewrites
    // the key: the count is then kept while its farm is live).
    if let Some(old) = w.farms.get("old") {
        assert!(
            removed <= 5,
            "{removed} removed under one cluster limit: {w:?}"
        );
        // 9b6bfac writes no session with its count; 38c1fcd and later write the old farm's
        // own: never another farm's.
        if let Some(session) = &old.session {
            let sessions = c.farm_sessions().await;
            assert_eq!(
                sessions.get(session).map(String::as_str),
                Some("old"),
                "the old farm's count carries a session that is not its own: {w:?}, registry {sessions:?}"
            );
        }
        assert!(w.farms.contains_key("new"), "{w:?}");
    }
}

on_both_backends!(a_farm_of_the_previous_release_holds_every_farm_to_rule_1);
/// The previous release offers rule 1 (9b6bfac by default; e5f34ad published no rule, which
/// reads as 1): this release's farms beside it compute rule 1, and move to rule 2 together
/// once it is gone.
async fn a_farm_of_the_previous_release_holds_every_farm_to_rule_1(backend: Backend) {
    let Some(previous) = previous_bin() else {
        return;
    };
    crate::assignment::the_oldest_rule_offered_is_every_farms(backend, &previous, &[]).await;
}

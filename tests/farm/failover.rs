//! Farms dying, stopping, stalling and joining: RCs keep being served, by exactly one farm,
//! and a farm that lost its session never writes again.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use rcfarm::consul::QueryOptions;
use rcfarm::rc::RcId;
use serde_json::json;

use crate::harness::{Backend, Cluster, TTL, nodes, rcs, signal};
use crate::{on_both_backends, on_every_backend};

async fn all_owned_by(c: &Cluster, ids: &[RcId], farms: &[&str]) -> bool {
    let owners = c.owner_farms().await;
    ids.iter()
        .all(|id| owners.get(id).is_some_and(|f| farms.contains(&f.as_str())))
}

on_every_backend!(kill_9_a_farm_and_its_rcs_are_served_again_within_two_ttls);
async fn kill_9_a_farm_and_its_rcs_are_served_again_within_two_ttls(b: Backend) {
    let mut c = Cluster::start_on(&b).await;
    nodes(&c, 4, 1).await;
    // f1 must own something to be worth killing.
    c.farms_sharing(3, 12, 1).await;
    let cr = &c;
    let owners = c.owner_farms().await;
    let victims: Vec<RcId> = owners
        .iter()
        .filter(|(_, f)| f.as_str() == "f1")
        .map(|(id, _)| *id)
        .collect();
    assert!(!victims.is_empty(), "f1 owns something: {owners:?}");

    // Nothing changes in Consul after the kill: the others must notice on their own.
    signal(c.farms[0].pid, "KILL");
    let killed = Instant::now();
    let vr = &victims;
    let took = c
        .wait_for(
            Duration::from_secs(20),
            "f1's RCs taken over",
            move || async move { all_owned_by(cr, vr, &["f2", "f3"]).await },
        )
        .await;
    println!(
        "FIGURE kill -9 failover: {:.2} s with a {} s session TTL",
        took.as_secs_f64(),
        TTL.as_secs()
    );
    assert!(
        killed.elapsed() <= TTL * 2 + Duration::from_secs(4),
        "within 2×TTL plus a little: {:?}",
        killed.elapsed()
    );
    // And they keep converging: scale a victim up.
    c.patch_rc(victims[0], "replicas_desired", json!(3)).await;
    let v0 = victims[0];
    c.wait_for(
        Duration::from_secs(20),
        "taken-over RC scales",
        move || async move { cr.placements().await.get(&v0).is_some_and(|s| s.len() == 3) },
    )
    .await;
    c.check_invariants(|_| false);
}

on_both_backends!(sigterm_hands_over_within_about_a_second);
async fn sigterm_hands_over_within_about_a_second(b: Backend) {
    let mut c = Cluster::start_on(&b).await;
    nodes(&c, 3, 1).await;
    let ids = c.farms_sharing(2, 10, 1).await;
    let cr = &c;
    let owners = c.owner_farms().await;
    let victims: Vec<RcId> = owners
        .iter()
        .filter(|(_, f)| f.as_str() == "f1")
        .map(|(id, _)| *id)
        .collect();
    assert!(!victims.is_empty());
    signal(c.farms[0].pid, "TERM");
    let vr = &victims;
    let took = c
        .wait_for(
            Duration::from_secs(10),
            "handover to f2",
            move || async move { all_owned_by(cr, vr, &["f2"]).await },
        )
        .await;
    println!(
        "FIGURE SIGTERM handover: {:.3} s for {} RCs",
        took.as_secs_f64(),
        victims.len()
    );
    assert!(took <= Duration::from_secs(3), "about a second: {took:?}");
    let status = tokio::time::timeout(Duration::from_secs(10), c.farms[0].child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0), "exit 0 after a graceful shutdown");
    let log = c.farm_log(0);
    assert!(log.contains("handed every RC over"), "{log}");
    // Its session is gone (destroyed, not left to expire).
    let (sessions, _) = c
        .consul
        .session_list(&QueryOptions::default())
        .await
        .unwrap();
    assert_eq!(
        sessions
            .iter()
            .filter(|s| s.name.starts_with("rcfarm:f1:"))
            .count(),
        0
    );
    let _ = ids;
    c.check_invariants(|_| false);
}

on_both_backends!(a_stalled_farm_past_its_session_expiry_writes_nothing_and_rejoins);
async fn a_stalled_farm_past_its_session_expiry_writes_nothing_and_rejoins(b: Backend) {
    let mut c = Cluster::start_on(&b).await;
    nodes(&c, 4, 1).await;
    let ids = c.farms_sharing(2, 8, 1).await;
    let cr = &c;
    let victims: Vec<RcId> = c
        .owner_farms()
        .await
        .into_iter()
        .filter(|(_, f)| f == "f1")
        .map(|(id, _)| id)
        .collect();
    assert!(!victims.is_empty());
    let f1_session: String = c
        .farm_sessions()
        .await
        .into_iter()
        .find(|(_, f)| f == "f1")
        .map(|(s, _)| s)
        .unwrap();

    signal(c.farms[0].pid, "STOP");
    let vr = &victims;
    c.wait_for(
        Duration::from_secs(20),
        "f2 took over",
        move || async move { all_owned_by(cr, vr, &["f2"]).await },
    )
    .await;
    // While f1 sleeps, its RCs change: when it wakes it must not act on them.
    for id in &victims {
        c.patch_rc(*id, "replicas_desired", json!(2)).await;
    }
    // (Real Consul keeps no commit log: there Consul's own check-session refuses such a write,
    // and the farm's log below shows it noticed.)
    let cut = (!c.is_real()).then(|| c.server.commit_log().last().map_or(0, |x| x.index));
    signal(c.farms[0].pid, "CONT");
    // f1 notices its session is gone and comes back with a new one.
    let old_session = f1_session.clone();
    c.wait_for(
        Duration::from_secs(20),
        "f1 rejoined with a new session",
        move || {
            let old = old_session.clone();
            async move {
                cr.farm_sessions()
                    .await
                    .iter()
                    .any(|(s, f)| f == "f1" && *s != old)
            }
        },
    )
    .await;
    let ir = &ids;
    c.wait_for(
        Duration::from_secs(30),
        "everything converged",
        move || async move {
            let p = cr.placements().await;
            ir.iter()
                .all(|id| p.get(id).map_or(0, |s| s.len()) == if vr.contains(id) { 2 } else { 1 })
        },
    )
    .await;
    // No write after the stall was made under f1's old session.
    if let Some(cut) = cut {
        let old = c
            .server
            .commit_log()
            .into_iter()
            .filter(|x| x.index > cut)
            .filter(|x| x.checks.iter().any(|(_, s)| *s == f1_session))
            .count();
        assert_eq!(old, 0, "commits under f1's old session after it stalled");
    }
    let log = c.farm_log(0);
    assert!(
        log.contains("session lost"),
        "f1 noticed: {}",
        log.lines().rev().take(20).collect::<Vec<_>>().join("\n")
    );
    c.check_invariants(|_| false);
}

on_both_backends!(farms_joining_late_get_their_fair_share_handed_over);
async fn farms_joining_late_get_their_fair_share_handed_over(b: Backend) {
    let mut c = Cluster::start_on(&b).await;
    nodes(&c, 3, 1).await;
    c.spawn_farm("f1", &[]).await;
    let ids = rcs(&c, 24, 1).await;
    let cr = &c;
    c.wait_for(Duration::from_secs(30), "f1 owns all", move || async move {
        let o = cr.owner_farms().await;
        o.len() == 24 && o.values().all(|f| f == "f1")
    })
    .await;
    c.spawn_farm("f2", &[]).await;
    c.spawn_farm("f3", &[]).await;
    let cr = &c;
    let took = c
        .wait_for(
            Duration::from_secs(30),
            "fair shares after two farms joined",
            move || async move {
                let o = cr.owner_farms().await;
                let mut per: BTreeMap<&str, usize> = BTreeMap::new();
                for f in o.values() {
                    *per.entry(f.as_str()).or_default() += 1;
                }
                o.len() == 24 && per.len() == 3 && per.values().all(|n| *n == 8)
            },
        )
        .await;
    println!(
        "FIGURE rebalance after 2 farms joined 1: {:.2} s (24 RCs)",
        took.as_secs_f64()
    );
    c.spawn_farm("f4", &[]).await;
    let cr = &c;
    c.wait_for(
        Duration::from_secs(30),
        "fair shares with a fourth farm",
        move || async move {
            let o = cr.owner_farms().await;
            let mut per: BTreeMap<&str, usize> = BTreeMap::new();
            for f in o.values() {
                *per.entry(f.as_str()).or_default() += 1;
            }
            o.len() == 24 && per.len() == 4 && per.values().all(|n| *n == 6)
        },
    )
    .await;
    // Throughout, every pod stayed where it was (handovers move ownership, not pods) and every
    // write was fenced by the lock of the farm holding it.
    let p = c.placements().await;
    assert!(ids.iter().all(|id| p.get(id).is_some_and(|s| s.len() == 1)));
    if let Some(checked) = c.check_invariants(|_| false) {
        assert!(checked >= 24);
    }
}

#[tokio::test]
async fn open_blocking_queries_do_not_grow_with_the_number_of_rcs() {
    let mut c = Cluster::start().await;
    nodes(&c, 2, 1).await;
    c.spawn_farm("solo", &[]).await;
    let mut ids = Vec::new();
    let mut figures = Vec::new();
    for target in [50usize, 500] {
        while ids.len() < target {
            let id = RcId::new();
            c.put_rc(
                id,
                &format!("p{}", ids.len()),
                "env=prod",
                0,
                "static_strategy",
            )
            .await;
            ids.push(id);
        }
        let cr = &c;
        c.wait_for(Duration::from_secs(60), "all claimed", move || async move {
            cr.owners().await.len() == target
        })
        .await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let blocked = c.server.embedded().stats().blocked_queries;
        figures.push((target, blocked));
    }
    println!("FIGURE open blocking queries for one farm: {figures:?}");
    // The farm's watches (RCs, their labels, locks, rolls and their locks, pods, nodes, health,
    // farms, the audit shipper's lock, operators' releases of held removals): a fixed set, of
    // which the pod labels and the lock tree are read on demand (no query open between reads).
    for (rcs, open) in &figures {
        assert!(*open <= 12, "a handful at {rcs} RCs: {open}");
        assert!(*open >= 9, "every other watch open at {rcs} RCs: {open}");
    }
}

on_both_backends!(node_transfer_with_the_pool_scheduler);
async fn node_transfer_with_the_pool_scheduler(b: Backend) {
    let mut c = Cluster::start_on(&b).await;
    c.label_node("fixed-1", &[("env", "prod")]).await;
    c.label_node("fixed-2", &[("env", "prod")]).await;
    c.label_node("spare-1", &[("env", "prod"), ("rcfarm.io/pool", "spare")])
        .await;
    c.label_node("spare-2", &[("env", "prod"), ("rcfarm.io/pool", "spare")])
        .await;
    c.spawn_farm("f1", &["--scheduler", "pool", "--transfer-timeout", "20s"])
        .await;
    let id = RcId::new();
    c.put_rc(id, "dyn", "env=prod", 2, "dynamic_strategy").await;
    let cr = &c;
    let want = |nodes: &'static [&'static str]| async move {
        let got: BTreeSet<String> = cr.placements().await.get(&id).cloned().unwrap_or_default();
        got == nodes.iter().map(|s| s.to_string()).collect()
    };
    c.wait_for(Duration::from_secs(20), "on the fixed nodes", || {
        want(&["fixed-1", "fixed-2"])
    })
    .await;
    // Health is in use for this pod: both pass.
    for n in ["fixed-1", "fixed-2"] {
        c.consul
            .kv_put(&format!("health/dyn/{n}"), br#"{"Status":"passing"}"#, None)
            .await
            .unwrap();
    }
    // fixed-2 leaves: the pod moves to a pool node allocated for it, after it is healthy.
    c.label_node("fixed-2", &[("env", "drained")]).await;
    c.wait_for(Duration::from_secs(20), "transfer started (+1 pod)", || {
        want(&["fixed-1", "fixed-2", "spare-1"])
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        want(&["fixed-1", "fixed-2", "spare-1"]).await,
        "waits for the new pod's health"
    );
    c.consul
        .kv_put("health/dyn/spare-1", br#"{"Status":"passing"}"#, None)
        .await
        .unwrap();
    c.wait_for(Duration::from_secs(20), "transfer completed", || {
        want(&["fixed-1", "spare-1"])
    })
    .await;
    let (res, _) = c
        .consul
        .kv_get(
            "scheduler/pool/reservations/spare-1",
            &QueryOptions::default(),
        )
        .await
        .unwrap();
    assert!(
        res.unwrap()
            .value_str()
            .unwrap()
            .contains("\"pod_id\":\"dyn\"")
    );
    // Scale up: allocation from the pool.
    c.patch_rc(id, "replicas_desired", json!(3)).await;
    c.wait_for(Duration::from_secs(20), "scaled onto the pool", || {
        want(&["fixed-1", "spare-1", "spare-2"])
    })
    .await;
    // Scale down: the freed pool node's slot is given back.
    c.patch_rc(id, "replicas_desired", json!(2)).await;
    c.wait_for(Duration::from_secs(20), "scaled down", || {
        want(&["fixed-1", "spare-1"])
    })
    .await;
    c.wait_for(Duration::from_secs(10), "slot freed", move || async move {
        let (e, _) = cr
            .consul
            .kv_get(
                "scheduler/pool/reservations/spare-2",
                &QueryOptions::default(),
            )
            .await
            .unwrap();
        e.is_some_and(|e| !e.value_str().unwrap_or("").contains("dyn"))
    })
    .await;
    c.check_invariants(|_| false);
}

on_both_backends!(a_stray_mutation_lock_must_not_block_the_next_owner_forever);
/// A mutation lock left behind by a farm that stopped serving an RC mid-transfer (a handover,
/// fencing, or an acquire that landed after its task stopped) must not keep the RC's next
/// owner from ever moving a pod (chaos found an RC stuck this way). The farm whose session
/// holds it without serving the RC frees it, and so does a task with no transfer in flight.
async fn a_stray_mutation_lock_must_not_block_the_next_owner_forever(b: Backend) {
    let mut c = Cluster::start_on(&b).await;
    nodes(&c, 4, 1).await;
    c.farms_sharing(2, 6, 1).await;
    let cr = &c;
    let owners = c.owner_farms().await;
    let of = |farm: &str| *owners.iter().find(|(_, f)| f.as_str() == farm).unwrap().0;
    let (served_by_f2, served_by_f1) = (of("f2"), of("f1"));
    let f1_session = c
        .farm_sessions()
        .await
        .into_iter()
        .find(|(_, f)| f == "f1")
        .unwrap()
        .0;
    // f1's session takes both mutation locks, as a late request of a stopped task would.
    for id in [served_by_f2, served_by_f1] {
        assert!(
            c.consul
                .kv_acquire(
                    &id.mutation_lock_key(),
                    b"rc-node-transfer",
                    &f1_session,
                    None
                )
                .await
                .unwrap()
        );
    }
    let s1 = f1_session.clone();
    c.wait_for(
        Duration::from_secs(10),
        "f1 frees the mutation locks",
        move || {
            let s1 = s1.clone();
            async move {
                let mut free = true;
                for id in [served_by_f2, served_by_f1] {
                    let (e, _) = cr
                        .consul
                        .kv_get(&id.mutation_lock_key(), &QueryOptions::default())
                        .await
                        .unwrap();
                    free &= e.and_then(|e| e.session).as_deref() != Some(s1.as_str());
                }
                free
            }
        },
    )
    .await;
    // And f2 moves the pod of its RC off a node that stops matching (a dynamic RC's: a
    // static one's stays, as in P2).
    c.patch_rc(
        served_by_f2,
        "allocation_strategy",
        json!("dynamic_strategy"),
    )
    .await;
    let node = c.placements().await[&served_by_f2]
        .iter()
        .next()
        .unwrap()
        .clone();
    c.label_node(&node, &[("env", "drained")]).await;
    c.wait_for(
        Duration::from_secs(20),
        "the pod moved to an eligible node",
        move || {
            let node = node.clone();
            async move {
                cr.placements()
                    .await
                    .get(&served_by_f2)
                    .is_some_and(|p| p.len() == 1 && !p.contains(&node))
            }
        },
    )
    .await;
    c.check_invariants(|_| false);
}

/// A raft leader election shorter than the session TTL: renewals fail while there is no
/// leader, and the new leader restarts every session's timer, so the farm's session holds and
/// it must keep every RC (it used to give its session up after one TTL without a renewal, and
/// every RC changed hands). Real Consul only: the embedded server has no elections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_election_shorter_than_the_ttl_moves_no_rc() {
    let Some(crate::harness::Backend::Real(bin)) = Backend::real() else {
        return;
    };
    let mut cc = rcfarm_testkit::chaos::agent::ConsulCluster::start(&bin, 3, 1)
        .await
        .unwrap();
    let client = cc.clients.pop().unwrap();
    let mut c = Cluster::around_agent(client);
    nodes(&c, 10, 2).await;
    // The harness's 2-s TTL: a loopback election takes longer (about 3 s), so renewals fail
    // for more than a TTL.
    let ids = c.farms_sharing(2, 12, 2).await;
    c.wait_for(
        Duration::from_secs(60),
        "12 RCs placed, 6 per farm",
        || async {
            let mut per: BTreeMap<String, usize> = BTreeMap::new();
            for s in c.owners().await.into_values() {
                *per.entry(s).or_default() += 1;
            }
            c.count_prefix("intent/").await == 24 && per.len() == 2 && per.values().all(|n| *n == 6)
        },
    )
    .await;
    let before = c.owners().await;

    let leader = cc.leader().await.expect("a leader");
    let killed_at = Instant::now();
    cc.servers[leader].kill().await;
    let mut new_leader = None;
    while killed_at.elapsed() < Duration::from_secs(30) {
        if let Some(l) = cc.leader().await
            && l != leader
        {
            new_leader = Some(l);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let election = killed_at.elapsed();
    assert!(new_leader.is_some(), "no new leader within 30 s");
    eprintln!("new raft leader {election:?} after SIGKILL of the old one");

    // Past 2×TTL after the election, and a while more.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let after = c.owners().await;
    assert_eq!(
        before, after,
        "RCs changed hands over an election of {election:?} (session TTL {TTL:?})"
    );
    let doubted = (0..2)
        .filter(|i| c.farm_log(*i).contains("in doubt"))
        .count();
    eprintln!("farms whose session was in doubt during the election: {doubted} of 2");
    for i in 0..2 {
        assert!(
            !c.farm_log(i).contains("session lost"),
            "farm {i} lost its session:\n{}",
            c.farm_log(i)
        );
    }
    // And the farms still act: a scale-up is carried out.
    c.patch_rc(ids[0], "replicas_desired", json!(3)).await;
    c.wait_for(
        Duration::from_secs(30),
        "the scale-up after the election",
        || async { c.count_prefix("intent/").await == 25 },
    )
    .await;
    c.check_invariants(|_| false);
}

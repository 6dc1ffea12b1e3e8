//! Consul in trouble: the server down for longer than the session TTL and back (with its data
//! and without), and a farm talking to Consul through a proxy that delays and cuts requests.
//! Farms stop acting on lost sessions, reconnect, re-claim and converge, and no write is ever
//! made by a farm that does not hold the RC's lock.

use std::collections::BTreeSet;
use std::time::Duration;

use rcfarm::rc::RcId;
use rcfarm::server::LoggedCommit;
use rcfarm_testkit::chaos::proxy::{FaultyProxy, ProxyFaults};
use rcfarm_testkit::invariants::Observer;
use serde_json::json;

use crate::harness::{Backend, Cluster, TTL, nodes, rcs};
use crate::on_both_backends;

/// Every RC owned by one of `farms` (by registry) and placed on `replicas` nodes.
async fn converged(c: &Cluster, ids: &[RcId], farms: &[&str], replicas: usize) -> bool {
    let owners = c.owner_farms().await;
    let placements = c.placements().await;
    ids.iter().all(|id| {
        owners.get(id).is_some_and(|f| farms.contains(&f.as_str()))
            && placements.get(id).is_some_and(|p| p.len() == replicas)
    })
}

pub(crate) fn assert_no_violations(logs: &[&[LoggedCommit]]) -> u64 {
    let mut o = Observer::default();
    for log in logs {
        for c in *log {
            o.observe(c);
        }
    }
    assert!(
        o.violations.is_empty(),
        "broken promises: {:#?}",
        o.violations
    );
    o.fenced_writes
}

/// Checks every promise: on the embedded server, from the commit logs of `before` (a server
/// that was replaced) and of the current one; on real Consul, from outside. Returns the
/// fenced writes checked (embedded only).
fn assert_no_violations_in(c: &Cluster, before: &[LoggedCommit]) -> Option<u64> {
    if c.is_real() {
        c.check_invariants(|_| false);
        return None;
    }
    Some(assert_no_violations(&[before, &c.server.commit_log()]))
}

fn assert_running(c: &mut Cluster) {
    for f in &mut c.farms {
        assert!(
            f.child.try_wait().unwrap().is_none(),
            "farm {} exited while Consul was down",
            f.id
        );
    }
}

on_both_backends!(consul_down_past_the_ttl_and_back_with_its_data_dir);
async fn consul_down_past_the_ttl_and_back_with_its_data_dir(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let (mut c, config) = Cluster::start_persistent(&backend, dir.path()).await;
    nodes(&c, 4, 1).await;
    // Both farms serving (not one that converged everything while the other was still
    // starting): the test is about farms that lose Consul mid-service. Their TTL is longer
    // than the other tests': a restarted Consul gives each session 2×TTL to renew, and with
    // 2 s a farm on a loaded 2-core machine once missed that 4 s window (the test needed a CI
    // retry); 6 s gives 12 s, still well short of what production TTLs give.
    let ids = c
        .farms_sharing_with(2, 6, 2, &["--session-ttl", "6s"])
        .await;
    let placed = c.placements().await;
    let sessions_before: BTreeSet<String> = c.owners().await.into_values().collect();

    // Down past one TTL, so that both farms are in doubt when it comes back.
    let before = c.restart_server(Duration::from_secs(9), config).await;
    assert_running(&mut c);

    // The old sessions came back with the data, their timers restarted (as a new Consul leader
    // does): the farms, in doubt while Consul was away, renew them and keep every RC.
    let (cr, idr) = (&c, &ids);
    let took = c
        .wait_for(
            Duration::from_secs(30),
            "convergence after the restart",
            move || async move { converged(cr, idr, &["f1", "f2"], 2).await },
        )
        .await;
    let sessions_after: BTreeSet<String> = c.owners().await.into_values().collect();
    assert_eq!(
        sessions_after,
        sessions_before,
        "the RCs kept their owners; farm logs:\n{}\n---\n{}",
        c.farm_log(0),
        c.farm_log(1)
    );
    for i in 0..2 {
        let log = c.farm_log(i);
        assert!(log.contains("in doubt"), "farm {i} noticed: {log}");
        assert!(
            !log.contains("session lost"),
            "farm {i} gave its session up: {log}"
        );
    }
    // The pods survived with the data, untouched.
    assert_eq!(c.placements().await, placed, "no pod moved");
    let fenced = assert_no_violations_in(&c, &before);
    // A restarted Consul 0.7 server may answer a renewal with 404 before it has applied its
    // log again (rcfarm_consul::session): say when this run saw it.
    let behind = (0..2)
        .filter(|i| c.farm_log(*i).contains("still applying its log"))
        .count();
    println!(
        "converged {took:?} after the restart, same sessions; {fenced:?} fenced writes; {behind} farm(s) heard a 404 from a server still applying its log"
    );
}

on_both_backends!(consul_down_past_the_ttl_and_back_empty);
async fn consul_down_past_the_ttl_and_back_empty(backend: Backend) {
    // A dev agent keeps nothing: it comes back empty.
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 4, 1).await;
    // Both farms serving (not one that converged everything while the other was still
    // starting): the test is about farms that lose Consul mid-service.
    let ids = c.farms_sharing(2, 6, 2).await;

    let before = c.restart_server(TTL * 3, Cluster::server_config()).await;
    assert_running(&mut c);

    // A new, empty Consul: the farms register again with new sessions and write nothing else.
    let cr = &c;
    c.wait_for(
        Duration::from_secs(30),
        "both farms registered again",
        move || async move { cr.farm_sessions().await.len() == 2 },
    )
    .await;
    tokio::time::sleep(TTL).await;
    let (pods, _) = c
        .consul
        .kv_keys("intent/", None, &Default::default())
        .await
        .unwrap();
    assert!(
        pods.is_empty(),
        "nothing to schedule, nothing written: {pods:?}"
    );

    // The operator restores nodes and RCs (same ids): the farms claim and schedule them.
    nodes(&c, 4, 1).await;
    for (i, id) in ids.iter().enumerate() {
        c.put_rc(*id, &format!("svc-{i}"), "env=prod", 2, "static_strategy")
            .await;
    }
    let (cr, idr) = (&c, &ids);
    c.wait_for(
        Duration::from_secs(30),
        "convergence on the new server",
        move || async move { converged(cr, idr, &["f1", "f2"], 2).await },
    )
    .await;
    if c.is_real() {
        c.check_invariants(|_| false);
    } else {
        assert_no_violations(&[&before]);
        let fenced = assert_no_violations(&[&c.server.commit_log()]);
        assert!(fenced > 0, "the new server saw scheduling writes");
    }
}

on_both_backends!(a_farm_behind_a_lossy_slow_proxy_never_writes_without_its_lock);
async fn a_farm_behind_a_lossy_slow_proxy_never_writes_without_its_lock(backend: Backend) {
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 6, 1).await;
    // Chunks delayed up to 1.5 s (renewals are due every TTL/2 = 1 s) and 5% of them cut
    // mid-request: the farm behind it loses its session now and then, and retries writes whose
    // fate it cannot know.
    let proxy = FaultyProxy::start(
        c.server.addr(),
        ProxyFaults {
            max_delay: Duration::from_millis(1500),
            drop_per_mille: 50,
        },
    )
    .await
    .unwrap();
    c.spawn_farm_via("slow", &proxy.url(), &[]).await;
    c.spawn_farm("direct", &[]).await;
    let ids = rcs(&c, 8, 2).await;
    // Scale RCs up and down for a while, through both farms.
    for round in 0..20 {
        let id = ids[round % ids.len()];
        c.patch_rc(id, "replicas_desired", json!((round % 4) as i64))
            .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Cuts are random (5% of chunks): keep changing RCs until some connections were cut.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut round = 0;
    while proxy
        .stats()
        .dropped
        .load(std::sync::atomic::Ordering::Relaxed)
        < 3
        && std::time::Instant::now() < deadline
    {
        let id = ids[round % ids.len()];
        c.patch_rc(id, "replicas_desired", json!((round % 4) as i64))
            .await;
        round += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for id in &ids {
        c.patch_rc(*id, "replicas_desired", json!(2)).await;
    }
    // The faults stop; everything converges, by whichever farm.
    proxy.set_faults(ProxyFaults {
        max_delay: Duration::ZERO,
        drop_per_mille: 0,
    });
    let (cr, idr) = (&c, &ids);
    c.wait_for(Duration::from_secs(30), "convergence", move || async move {
        converged(cr, idr, &["slow", "direct"], 2).await
    })
    .await;
    let stats = proxy.stats();
    let dropped = stats.dropped.load(std::sync::atomic::Ordering::Relaxed);
    assert!(dropped > 0, "the proxy cut connections");
    let fenced = assert_no_violations_in(&c, &[]);
    println!("{dropped} connections cut; {fenced:?} fenced writes checked");
}

/// A farm talking to Consul through a proxy with no random faults (the test arms targeted
/// ones), serving one new RC of one replica on `selector`.
async fn lossy_farm_serving(c: &mut Cluster, selector: &str) -> (FaultyProxy, RcId) {
    let proxy = FaultyProxy::start(
        c.server.addr(),
        ProxyFaults {
            max_delay: Duration::ZERO,
            drop_per_mille: 0,
        },
    )
    .await
    .unwrap();
    c.spawn_farm_via("lossy", &proxy.url(), &["--transfer-static"])
        .await;
    let id = RcId::new();
    c.put_rc(id, "web", selector, 1, "static_strategy").await;
    (proxy, id)
}

/// Checks that the proxy's targeted fault struck exactly once and that the farm noticed (a
/// pass failed); returns the farm's log.
fn faulted_once(proxy: &FaultyProxy, c: &Cluster, what: &str) -> String {
    let dropped = proxy
        .stats()
        .dropped
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(dropped, 1, "{what}");
    let log = c.farm_log(0);
    assert!(log.contains("RC pass failed"), "{log}");
    log
}

on_both_backends!(a_transfer_started_with_its_answer_lost_is_finished_not_forgotten);
/// A node transfer whose start reached Consul but whose answer was lost (the farm sees a write
/// of unknown fate) is finished from what Consul holds, not forgotten: the status key must not
/// keep a transfer that no one will ever complete, and the move is recorded once.
async fn a_transfer_started_with_its_answer_lost_is_finished_not_forgotten(backend: Backend) {
    let mut c = Cluster::start_on(&backend).await;
    c.label_node("node-a", &[("env", "prod"), ("zone", "a")])
        .await;
    c.label_node("node-b", &[("env", "prod"), ("zone", "c")])
        .await;
    let (proxy, id) = lossy_farm_serving(&mut c, "zone=a").await;
    let on = |node: &'static str| {
        let c = &c;
        move || async move { c.placements().await.get(&id) == Some(&BTreeSet::from([node.to_string()])) }
    };
    c.wait_for(Duration::from_secs(30), "the pod on node-a", on("node-a"))
        .await;

    // The first transaction that touches the RC's status key is a transfer's start.
    proxy.lose_answers_to(b"\"Key\":\"status/replication_controllers/", 1);
    c.label_node("node-b", &[("env", "prod"), ("zone", "a")])
        .await;
    c.label_node("node-a", &[("env", "prod"), ("zone", "b")])
        .await;
    let status_key = format!("status/replication_controllers/{id}/replication_controller");
    let (cr, sk) = (&c, &status_key);
    c.wait_for(
        Duration::from_secs(30),
        "the pod moved to node-b and no transfer left in the status key",
        move || async move {
            on("node-b")().await
                && cr
                    .consul
                    .kv_get(sk, &Default::default())
                    .await
                    .unwrap()
                    .0
                    .is_none()
        },
    )
    .await;
    let log = faulted_once(&proxy, &c, "the start's answer was lost");
    assert!(log.contains("resuming a node transfer in flight"), "{log}");
    let of_rc = |events: Vec<serde_json::Value>| {
        events
            .iter()
            .filter(|d| d["replication_controller_id"] == json!(id.to_string()))
            .count()
    };
    let (cr, ev) = (&c, &of_rc);
    c.wait_for(
        Duration::from_secs(10),
        "one transfer start and one completion recorded",
        move || async move {
            ev(cr
                .audit_events(rcfarm::audit::events::NODE_TRANSFER_START)
                .await)
                == 1
                && ev(cr
                    .audit_events(rcfarm::audit::events::NODE_TRANSFER_COMPLETION)
                    .await)
                    == 1
        },
    )
    .await;
    let (cr, lock) = (&c, id.mutation_lock_key());
    let lock = &lock;
    c.wait_for(
        Duration::from_secs(10),
        "the mutation lock given back",
        move || async move {
            cr.consul
                .kv_get(lock, &Default::default())
                .await
                .unwrap()
                .0
                .and_then(|e| e.session)
                .is_none()
        },
    )
    .await;
    assert_no_violations_in(&c, &[]);
}

on_both_backends!(an_observed_change_whose_record_failed_is_recorded_on_the_next_pass);
/// A direct KV change to an RC whose audit record could not be written (the request never
/// reached Consul) is recorded by the next pass, once: a failed write loses no record.
async fn an_observed_change_whose_record_failed_is_recorded_on_the_next_pass(backend: Backend) {
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 3, 1).await;
    let (proxy, id) = lossy_farm_serving(&mut c, "env=prod").await;
    let placed = |n: usize| {
        let c = &c;
        move || async move { c.placements().await.get(&id).map_or(0, BTreeSet::len) == n }
    };
    c.wait_for(Duration::from_secs(30), "one pod", placed(1))
        .await;

    // The next write fenced by this RC's ownership lock is the observed change's record.
    let check = format!("\"Key\":\"{}\"", id.ownership_lock_key());
    proxy.refuse_requests_with(check.as_bytes(), 1);
    c.patch_rc(id, "replicas_desired", json!(2)).await;
    c.wait_for(Duration::from_secs(30), "two pods", placed(2))
        .await;
    faulted_once(&proxy, &c, "the record's first write was refused");
    let (cr, rc) = (&c, json!(id.to_string()));
    let rc = &rc;
    c.wait_for(
        Duration::from_secs(10),
        "the observed change recorded once",
        move || async move {
            let observed: Vec<serde_json::Value> = cr
                .audit_events(rcfarm::audit::events::RC_OBSERVED_CHANGE)
                .await
                .into_iter()
                .filter(|d| d["replication_controller_id"] == *rc)
                .collect();
            observed.len() == 1
                && observed[0]["changes"]["replicas_desired"] == json!({"old": 1, "new": 2})
        },
    )
    .await;
    assert_no_violations_in(&c, &[]);
}

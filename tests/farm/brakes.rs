//! Brakes that never jam (issue 36): what is in flight ends without a lock it does not hold, a
//! roll waits for a node transfer rather than taking the locks under it, a transfer never takes
//! a pod another RC gave up to its roll, a roll waiting on someone else says who and is not
//! failed for it, and operators' ordinary work runs on the default flags.

use std::time::Duration;

use rcfarm::consul::{QueryOptions, SessionId, SessionRequest, TxnOp};
use rcfarm::rc::RcId;
use rcfarm::rctask::status_key;
use serde_json::Value;

use crate::harness::{Backend, Cluster, nodes};
use crate::on_every_backend;
use crate::p2_behaviour::{farm_api, get_json};
use crate::rolls::{ROLL_FLAGS, completed, roll_exists};

/// Nodes with a pod of `id`.
async fn placed(c: &Cluster, id: RcId) -> usize {
    c.placements().await.get(&id).map_or(0, |s| s.len())
}

async fn transfer_in_flight(c: &Cluster, id: RcId) -> bool {
    c.transfer_in_flight(id).await
}

/// A session of the test's own (an outside tool: P2's roller, an operator's lock).
async fn outside_session(c: &Cluster) -> SessionId {
    c.consul
        .session_create(&SessionRequest {
            name: Some("outside tool".into()),
            ttl: Some(Duration::from_secs(60)),
            lock_delay: Some(Duration::ZERO),
            ..SessionRequest::default()
        })
        .await
        .unwrap()
        .into()
}

/// Who holds `key`, as Consul says.
async fn holder(c: &Cluster, key: &str) -> Option<String> {
    c.consul
        .kv_get(key, &QueryOptions::default())
        .await
        .unwrap()
        .0
        .and_then(|e| e.session)
}

/// A dynamic RC `web` of 2 pods on four `env=prod` nodes, up; then the simulated nodes stop
/// (no new pod ever passes its health check) and node-00 leaves `env=prod`: farm `farm`
/// starts moving the pod on node-00 to node-02, and the move stays in flight.
async fn a_transfer_in_flight(backend: &Backend, farm: &str) -> (Cluster, RcId) {
    let mut flags = ROLL_FLAGS.to_vec();
    flags.extend(["--transfer-timeout", "10m"]);
    a_transfer_in_flight_with(backend, farm, &flags, &[]).await
}

/// [`a_transfer_in_flight`], its farm run with `flags` and `env`.
pub(crate) async fn a_transfer_in_flight_with(
    backend: &Backend,
    farm: &str,
    flags: &[&str],
    env: &[(&str, &str)],
) -> (Cluster, RcId) {
    a_transfer_in_flight_from(backend, crate::harness::BIN, farm, flags, env).await
}

/// [`a_transfer_in_flight_with`], its farm run from the binary `bin` (another release's).
pub(crate) async fn a_transfer_in_flight_from(
    backend: &Backend,
    bin: &str,
    farm: &str,
    flags: &[&str],
    env: &[(&str, &str)],
) -> (Cluster, RcId) {
    let mut c = Cluster::start_on(backend).await;
    let o = a_transfer_in_flight_on(&mut c, bin, farm, flags, env).await;
    (c, o)
}

/// [`a_transfer_in_flight_from`] on the cluster `c` (one that keeps its data, say).
pub(crate) async fn a_transfer_in_flight_on(
    c: &mut Cluster,
    bin: &str,
    farm: &str,
    flags: &[&str],
    env: &[(&str, &str)],
) -> RcId {
    nodes(c, 4, 1).await;
    let sim = c.simulate(4, 0.0);
    let url = c.server.url();
    c.spawn_farm_from(bin, farm, &url, flags, env).await;
    let o = RcId::new();
    c.put_rc(o, "web", "env=prod", 2, "dynamic_strategy").await;
    let cr = &c;
    c.wait_for(
        Duration::from_secs(30),
        "the RC's two pods up",
        move || async move { cr.all_up(o, 2).await },
    )
    .await;
    sim.cancel();
    tokio::time::sleep(Duration::from_millis(500)).await;
    c.label_node("node-00", &[("env", "retired")]).await;
    c.wait_for(
        Duration::from_secs(30),
        "a node transfer in flight, its new pod placed",
        move || async move { transfer_in_flight(cr, o).await && placed(cr, o).await == 3 },
    )
    .await;
    o
}

on_every_backend!(a_resumed_transfer_ends_while_a_roller_holds_the_rcs_mutation_lock);
/// The cycle behind the real-Consul chaos stall: a transfer in flight, its farm gone (its
/// session, and the mutation lock with it), a roller taking the RC's mutation lock and
/// retiring the RC (0 replicas). The RC's new owner resumes the transfer, which must roll back,
/// and does so without the lock the roller holds; then the RC removes its pods.
async fn a_resumed_transfer_ends_while_a_roller_holds_the_rcs_mutation_lock(backend: Backend) {
    let (mut c, o) = a_transfer_in_flight(&backend, "f1").await;
    crate::harness::signal(c.farms[0].pid, "KILL");
    // The roller (P2's `p2-rctl rolling-update` holds both RCs' mutation locks so) takes the
    // lock once the dead farm's session is gone.
    let roller = outside_session(&c).await;
    let other = RcId::new();
    let (cr, rr) = (&c, &roller);
    c.wait_for(
        Duration::from_secs(30),
        "the roller holds the mutation locks",
        move || async move {
            cr.consul
                .txn(&[
                    TxnOp::lock(o.mutation_lock_key(), b"p2-roller".to_vec(), rr),
                    TxnOp::lock(other.mutation_lock_key(), b"p2-roller".to_vec(), rr),
                ])
                .await
                .is_ok()
        },
    )
    .await;
    assert!(transfer_in_flight(&c, o).await, "still in flight");
    // Retired by the roller: enabled, 0 replicas.
    c.patch_rc(o, "replicas_desired", 0.into()).await;
    let mut flags = ROLL_FLAGS.to_vec();
    flags.extend(["--transfer-timeout", "10m"]);
    c.spawn_farm("f2", &flags).await;
    let cr = &c;
    c.wait_for(
        Duration::from_secs(40),
        "the transfer rolled back and every pod of the retired RC gone",
        move || async move { !transfer_in_flight(cr, o).await && placed(cr, o).await == 0 },
    )
    .await;
    assert_eq!(
        holder(&c, &o.mutation_lock_key()).await.as_deref(),
        Some(roller.as_str()),
        "the rollback took no lock: the roller still holds it"
    );
    let rollbacks = c.audit_events("NODE_TRANSFER_ROLLBACK").await;
    assert!(
        rollbacks
            .iter()
            .any(|r| r["replication_controller_id"] == o.to_string()
                && r["rollback_reason"]
                    .as_str()
                    .is_some_and(|w| w.contains("replicas changed"))),
        "{rollbacks:#?}"
    );
    c.check_invariants(|_| false);
}

on_every_backend!(a_roll_waits_for_a_transfer_in_flight_to_end_then_completes);
/// A roll started while a node transfer is in flight on its old RC (resumed by another farm
/// after the one that started it stopped) takes no mutation lock until the transfer ends: it
/// shows Blocked, saying where the transfer goes and what ends it, without a stall or a
/// failure; once the new pod passes, the transfer completes and the roll goes on to the end.
async fn a_roll_waits_for_a_transfer_in_flight_to_end_then_completes(backend: Backend) {
    let (mut c, o) = a_transfer_in_flight(&backend, "f1").await;
    crate::harness::signal(c.farms[0].pid, "TERM");
    let mut flags = ROLL_FLAGS.to_vec();
    flags.extend([
        "--transfer-timeout",
        "10m",
        "--roll-progress-deadline",
        "2s",
        "--roll-auto-revert",
    ]);
    c.spawn_farm("f2", &flags).await;
    let api = farm_api(&c, "f2").await;
    let new = c.start_roll(o, 1, Duration::ZERO).await;
    let apir = &api;
    c.wait_for(
        Duration::from_secs(30),
        "the roll blocked by the transfer",
        move || async move {
            let v = get_json(&format!("{apir}/v1/rolls/{new}")).await;
            v.to_string()
                .contains("a node transfer is in flight on the old RC")
        },
    )
    .await;
    let v = get_json(&format!("{api}/v1/rolls/{new}")).await;
    let blocked: Vec<String> = v["roll"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c.as_str().map(str::to_string))
        .filter(|c| c.starts_with("Blocked"))
        .collect();
    assert!(
        blocked
            .iter()
            .any(|b| b.contains("node-00 → node-02") && b.contains("--transfer-timeout")),
        "{v:#}"
    );
    // Well past the progress deadline: waiting on a transfer is neither a stall nor a failure.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(c.audit_events("ROLLING_UPDATE_FAILED").await.is_empty());
    assert!(c.audit_events("ROLLING_UPDATE_STALLED").await.is_empty());
    assert!(
        holder(&c, &o.mutation_lock_key()).await.is_none() || !transfer_in_flight(&c, o).await,
        "no roll took the lock under the transfer"
    );
    // The nodes come back: the transfer's new pod passes, the transfer completes, the roll
    // takes over.
    let _sim = c.simulate(4, 0.0);
    completed(&c, new, o, 2, Duration::from_secs(60)).await;
    assert!(c.audit_events("ROLLING_UPDATE_FAILED").await.is_empty());
    c.check_invariants(|_| false);
}

on_every_backend!(a_transfer_never_takes_a_pod_another_rc_gave_up_to_its_roll);
/// The fencing violation of chaos seed 5550123: an RC needing a node for a transfer took a pod
/// that a roll's old RC had given up to the roll's new RC. Now only the roll's new RC takes
/// such pods over; the transfer waits for a free node.
async fn a_transfer_never_takes_a_pod_another_rc_gave_up_to_its_roll(backend: Backend) {
    let mut c = Cluster::start_on(&backend).await;
    // node-00 and node-01 run the old RC O; X (the same pod id, its own selector) runs on
    // node-03, the one node of its selector left free.
    for n in ["node-00", "node-01"] {
        c.label_node(n, &[("env", "prod"), ("team", "x")]).await;
    }
    c.label_node("node-03", &[("team", "x")]).await;
    let _sim = c.simulate(4, 0.0);
    c.spawn_farm("f1", &["--transfer-static"]).await;
    let (o, n, x) = (RcId::new(), RcId::new(), RcId::new());
    c.put_rc(o, "web", "env=prod", 2, "static_strategy").await;
    let cr = &c;
    c.wait_for(
        Duration::from_secs(30),
        "O up on node-00 and node-01",
        move || async move { cr.all_up(o, 2).await },
    )
    .await;
    c.put_rc(x, "web", "team=x", 1, "static_strategy").await;
    c.wait_for(
        Duration::from_secs(30),
        "X on node-03",
        move || async move {
            cr.placements()
                .await
                .get(&x)
                .is_some_and(|s| s.iter().any(|p| p.contains("node-03")))
        },
    )
    .await;
    // A roll O → N that no farm carries (an outside session holds its lock): O disabled with
    // one pod it no longer wants, given up to N, which wants one.
    c.put_rc(n, "web", "env=prod", 0, "static_strategy").await;
    let outside = outside_session(&c).await;
    let roll = serde_json::json!({
        "OldRC": o.to_string(), "NewRC": n.to_string(), "DesiredReplicas": 2,
        "MinimumReplicas": 0, "LeaveOld": false, "RollDelay": 0,
    });
    c.consul
        .txn(&[
            TxnOp::set(format!("rolls/{n}"), roll.to_string().into_bytes()),
            TxnOp::lock(format!("lock/rolls/{n}"), b"outside".to_vec(), &outside),
        ])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    // The roll's first step, as one transaction: O disabled at 1, N at 1.
    let mut old =
        serde_json::from_slice::<Value>(&c.patched_rc(o, "disabled", true.into()).await).unwrap();
    old["replicas_desired"] = 1.into();
    let ops = [
        TxnOp::set(o.key(), old.to_string().into_bytes()),
        TxnOp::set(n.key(), c.patched_rc(n, "replicas_desired", 1.into()).await),
    ];
    c.consul.txn(&ops).await.unwrap();
    // And X's node leaves X's selector: X must move, and the only other nodes of its selector
    // are O's.
    c.label_node("node-03", &[]).await;
    c.wait_for(
        Duration::from_secs(30),
        "N took one of O's pods over, in place",
        move || async move {
            cr.placements().await.get(&n).is_some_and(|s| {
                s.len() == 1
                    && s.iter()
                        .all(|p| p.contains("node-00") || p.contains("node-01"))
            })
        },
    )
    .await;
    c.passes(&[x], 3).await;
    let placements = c.placements().await;
    assert!(
        placements
            .get(&x)
            .is_some_and(|s| s.len() == 1 && s.iter().all(|p| p.contains("node-03"))),
        "X stays where it is, waiting for a free node: {placements:?}"
    );
    assert!(
        c.audit_events("NODE_TRANSFER_START").await.is_empty(),
        "no transfer onto a given-up pod"
    );
    c.check_invariants(|_| false);
}

/// The farm's own defaults for what the harness turns off elsewhere (`--max-removals`,
/// `--failsafe-confirm`): an operator's ordinary day runs on these.
pub(crate) const DEFAULTS: [&str; 4] = ["--max-removals", "20%", "--failsafe-confirm", "2m"];

/// Writes a manifest file `name` for pod `web` whose artifact is `artifact`.
pub(crate) fn manifest_file(dir: &std::path::Path, name: &str, artifact: &str) -> String {
    let p = dir.join(name);
    std::fs::write(
        &p,
        format!(
            "id: web\nlaunchables:\n  app:\n    launchable_type: hoist\n    location: https://example.com/{artifact}.tar.gz\n"
        ),
    )
    .unwrap();
    p.to_str().unwrap().to_string()
}

/// An operator's day's manifests: v1, v2, v3 (artifacts `web-1`…`web-3`) and a bad one
/// (`web-broken`, which the simulated nodes never report healthy).
pub(crate) fn day_manifests(dir: &std::path::Path) -> [String; 4] {
    [
        manifest_file(dir, "v1.yaml", "web-1"),
        manifest_file(dir, "v2.yaml", "web-2"),
        manifest_file(dir, "v3.yaml", "web-3"),
        manifest_file(dir, "bad.yaml", "web-broken"),
    ]
}

/// `rcctl rc create -f MANIFEST --node-selector env=prod --replicas N`.
pub(crate) async fn create_web(
    c: &Cluster,
    manifest: &str,
    replicas: u32,
) -> (i32, String, String) {
    let n = replicas.to_string();
    c.rcctl(&[
        "rc",
        "create",
        "-f",
        manifest,
        "--node-selector",
        "env=prod",
        "--replicas",
        &n,
    ])
    .await
}

/// `rcctl roll start FROM -f MANIFEST --minimum 3 [EXTRA] --wait`: an operator's deploy.
pub(crate) async fn deploy(
    c: &Cluster,
    from: &str,
    manifest: &str,
    extra: &[&str],
) -> (i32, String, String) {
    let mut args = vec!["roll", "start", from, "-f", manifest, "--minimum", "3"];
    args.extend(extra);
    args.extend(["--wait", "--timeout", "120s"]);
    c.rcctl(&args).await
}

/// A bad deploy with `--progress-deadline 5s --auto-revert`: it fails at its deadline
/// (`--wait` exits 3) and says it was reverted.
pub(crate) async fn bad_deploy_reverted(c: &Cluster, from: &str, bad: &str) {
    let (code, out, err) = deploy(
        c,
        from,
        bad,
        &["--progress-deadline", "5s", "--auto-revert"],
    )
    .await;
    assert_eq!(code, 3, "the bad deploy fails at its deadline: {out}{err}");
    assert!(err.contains("reverted"), "{err}");
}

/// Scales `rc` to 0 (waiting for its pods to go), deletes it, and checks that nothing of it is
/// left in Consul.
pub(crate) async fn scale_to_zero_and_delete(c: &Cluster, rc: RcId) {
    let id = rc.to_string();
    let (code, out, err) = c
        .rcctl(&["rc", "scale", &id, "0", "--wait", "--timeout", "60s"])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = c.rcctl(&["rc", "delete", &id]).await;
    assert_eq!(code, 0, "deleted once its pods are gone: {out}{err}");
    for prefix in [
        "intent/",
        "labels/pod/",
        "rolls/",
        "replication_controllers/",
        "status/",
    ] {
        assert_eq!(
            c.count_prefix(prefix).await,
            0,
            "nothing left under {prefix}"
        );
    }
}

/// What every pod of `rc` asks its node to run, as (node, manifest text).
pub(crate) async fn intents(c: &Cluster, rc: RcId) -> Vec<String> {
    let mut out = Vec::new();
    for node in c.placements().await.get(&rc).into_iter().flatten() {
        let (e, _) = c
            .consul
            .kv_get(&format!("intent/{node}/web"), &QueryOptions::default())
            .await
            .unwrap();
        out.push(
            String::from_utf8_lossy(
                e.map(|e| e.value_bytes().to_vec())
                    .unwrap_or_default()
                    .as_slice(),
            )
            .to_string(),
        );
    }
    out
}

on_every_backend!(two_deploys_then_a_bad_one_reverted_on_the_default_flags);
/// An operator's ordinary day on two farms with the default flags: a canary deploy,
/// promoted; a second deploy; then a bad one with `--auto-revert`. The bad deploy fails at its
/// deadline, its farm reverts it, and within 30 s of the failure the RC runs the last good
/// manifest again with no roll left. Then an undo (back to the deploy before, passing over
/// the reverted one), a scale to 0 and a delete. Nothing was held by the removal budget.
async fn two_deploys_then_a_bad_one_reverted_on_the_default_flags(backend: Backend) {
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 6, 2).await;
    let _sim = c.simulate_failing(6, "broken");
    let mut flags = ROLL_FLAGS.to_vec();
    flags.extend(DEFAULTS);
    c.spawn_farm("f1", &flags).await;
    c.spawn_farm("f2", &flags).await;
    let dir = tempfile::tempdir().unwrap();
    let [v1, v2, v3, bad] = day_manifests(dir.path());
    let ok = |(code, out, err): (i32, String, String)| {
        assert_eq!(code, 0, "{out}{err}");
        out.lines().next().unwrap_or_default().trim().to_string()
    };
    let rc = ok(create_web(&c, &v1, 4).await);
    let first = RcId::parse(&rc).unwrap();
    let cr = &c;
    c.wait_for(Duration::from_secs(30), "4 pods up", move || async move {
        cr.all_up(first, 4).await
    })
    .await;
    // A canary deploy, promoted.
    let second = ok(deploy(&c, &rc, &v2, &["--canary", "1"]).await);
    ok(
        c.rcctl(&["roll", "promote", &second, "--wait", "--timeout", "90s"])
            .await,
    );
    // An ordinary deploy.
    let third = ok(deploy(&c, &second, &v3, &[]).await);
    let good = RcId::parse(&third).unwrap();
    c.wait_for(
        Duration::from_secs(30),
        "the second deploy's old RC gone",
        move || async move { !roll_exists(cr, good).await },
    )
    .await;
    // A bad deploy.
    bad_deploy_reverted(&c, &third, &bad).await;
    // The way back is not held to the bad deploy's 5 s: it gets the farm's own deadline
    // (--roll-progress-deadline, 10 minutes by default).
    let reverts = c.audit_events("ROLLING_UPDATE_REVERTED").await;
    assert_eq!(reverts.len(), 1, "{reverts:?}");
    assert_eq!(reverts[0]["progress_deadline"], "10m0s", "{:?}", reverts[0]);
    let failed_at = std::time::Instant::now();
    c.wait_for(
        Duration::from_secs(30),
        "back on the last good manifest, no roll left",
        move || async move {
            cr.count_prefix("rolls/").await == 0
                && cr.all_up(good, 4).await
                && intents(cr, good)
                    .await
                    .iter()
                    .all(|m| m.contains("web-3.tar.gz"))
        },
    )
    .await;
    eprintln!("reverted within {:.1?} of the failure", failed_at.elapsed());
    assert!(
        c.audit_events("REMOVALS_HELD").await.is_empty(),
        "no roll or RC of the day was held by the removal budget"
    );
    let failed = c.audit_events("ROLLING_UPDATE_FAILED").await;
    assert_eq!(failed.len(), 1, "only the bad deploy failed: {failed:#?}");

    // The rest of the day: an undo goes back past the reverted deploy to v2, then the RC is
    // scaled to 0 and deleted, still on the default flags.
    let (code, out, err) = c.rcctl(&["rc", "history", &third]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("(failed, reverted)"), "{out}");
    let (code, out, err) = c
        .rcctl(&["roll", "undo", &third, "--wait", "--timeout", "90s"])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains("back to revision 2"), "{err}");
    let undone = RcId::parse(out.lines().next().unwrap().trim()).unwrap();
    c.wait_for(
        Duration::from_secs(30),
        "undone onto v2",
        move || async move {
            cr.count_prefix("rolls/").await == 0
                && cr.all_up(undone, 4).await
                && intents(cr, undone)
                    .await
                    .iter()
                    .all(|m| m.contains("web-2.tar.gz"))
        },
    )
    .await;
    scale_to_zero_and_delete(&c, undone).await;
    assert!(
        c.audit_events("REMOVALS_HELD").await.is_empty(),
        "nothing of the day was held by the removal budget"
    );
    c.check_invariants(|_| false);
}

on_every_backend!(a_roll_waiting_on_a_lock_says_who_holds_it_and_is_not_failed_for_it);
/// A roll whose RC's mutation lock another tool holds shows Blocked, naming the session and
/// how to let it go; the wait counts toward neither its stall timeout nor its progress
/// deadline; released, the roll completes.
async fn a_roll_waiting_on_a_lock_says_who_holds_it_and_is_not_failed_for_it(backend: Backend) {
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 3, 1).await;
    let _sim = c.simulate(3, 0.0);
    c.spawn_farm(
        "f1",
        &[
            "--roll-resync",
            "300ms",
            "--roll-stall-after",
            "2s",
            "--roll-progress-deadline",
            "2s",
            "--roll-auto-revert",
        ],
    )
    .await;
    let old = crate::harness::rcs(&c, 1, 2).await[0];
    let cr = &c;
    c.wait_for(Duration::from_secs(30), "the RC up", move || async move {
        cr.all_up(old, 2).await
    })
    .await;
    let outside = outside_session(&c).await;
    c.consul
        .txn(&[TxnOp::lock(
            old.mutation_lock_key(),
            b"a tool".to_vec(),
            &outside,
        )])
        .await
        .unwrap();
    let new = c.start_roll(old, 1, Duration::ZERO).await;
    let api = farm_api(&c, "f1").await;
    let apir = &api;
    let sid = outside.to_string();
    let sidr = &sid;
    c.wait_for(
        Duration::from_secs(20),
        "Blocked, naming the session and the way out",
        move || async move {
            let v = get_json(&format!("{apir}/v1/rolls/{new}")).await;
            v["roll"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c.as_str())
                .any(|c| {
                    c.starts_with("Blocked")
                        && c.contains(sidr.as_str())
                        && c.contains("session/destroy")
                })
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let v = get_json(&format!("{api}/v1/rolls/{new}")).await;
    assert!(!v.to_string().contains("Stalled"), "{v:#}");
    assert!(c.audit_events("ROLLING_UPDATE_FAILED").await.is_empty());
    assert!(c.audit_events("ROLLING_UPDATE_STALLED").await.is_empty());
    c.consul
        .txn(&[TxnOp::unlock(
            old.mutation_lock_key(),
            b"".to_vec(),
            &outside,
        )])
        .await
        .unwrap();
    completed(&c, new, old, 2, Duration::from_secs(60)).await;
    c.check_invariants(|_| false);
}

on_every_backend!(an_rc_with_pods_is_not_deleted_and_pods_left_by_force_are_marked);
/// `rcctl rc delete` refuses while the RC still has pods (its replicas 0 but a removal held),
/// naming them and the way out; `--force` deletes it and says which pods it leaves running;
/// `rcctl node list`, `/v1/rcs` and the farm's `rcfarm_orphaned_pods` show them.
async fn an_rc_with_pods_is_not_deleted_and_pods_left_by_force_are_marked(backend: Backend) {
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 3, 1).await;
    let _sim = c.simulate(3, 0.0);
    c.spawn_farm(
        "f1",
        &["--max-removals", "1", "--max-removals-window", "10m"],
    )
    .await;
    let id = crate::harness::rcs(&c, 1, 2).await[0];
    let cr = &c;
    c.wait_for(Duration::from_secs(30), "2 pods up", move || async move {
        cr.all_up(id, 2).await
    })
    .await;
    let rid = id.to_string();
    let (code, _, err) = c.rcctl(&["rc", "scale", &rid, "0"]).await;
    assert_eq!(code, 0, "{err}");
    c.wait_for(
        Duration::from_secs(20),
        "one pod removed, the other held",
        move || async move { placed(cr, id).await == 1 },
    )
    .await;
    let (code, _, err) = c.rcctl(&["rc", "delete", &rid]).await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("it still has 1 pod") && err.contains("rc scale") && err.contains("--force"),
        "{err}"
    );
    assert!(RcStoreExt::exists(&c, id).await, "nothing was deleted");
    let (code, out, err) = c.rcctl(&["rc", "delete", &rid, "--force"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("left running") && out.contains("ORPHANED"),
        "{out}"
    );
    let (code, out, err) = c.rcctl(&["node", "list"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.lines()
            .any(|l| l.contains("ORPHANED") && l.contains(&rid)),
        "{out}"
    );
    let api = farm_api(&c, "f1").await;
    let v = get_json(&format!("{api}/v1/rcs")).await;
    assert_eq!(v["orphaned_pods"][0]["rc_id"], rid, "{v:#}");
    c.wait_for(
        Duration::from_secs(30),
        "the farm counts the pod whose RC is gone",
        move || async move { cr.metrics("f1").await.contains("rcfarm_orphaned_pods 1") },
    )
    .await;
}

/// Whether an RC's key exists.
struct RcStoreExt;

impl RcStoreExt {
    async fn exists(c: &Cluster, id: RcId) -> bool {
        c.consul
            .kv_get(&id.key(), &QueryOptions::default())
            .await
            .unwrap()
            .0
            .is_some()
    }
}

/// `n` RCs (5 to 12) holding 24 pods between them on 6 nodes, served by `farms` farms on the
/// default flags, placed; the RCs, and the simulator to keep while the test runs.
pub(crate) async fn twenty_four_pods(
    c: &mut Cluster,
    farms: usize,
    n: usize,
) -> (Vec<RcId>, tokio_util::sync::CancellationToken) {
    nodes(c, 6, 2).await;
    let sim = c.simulate(6, 0.0);
    for f in 0..farms {
        c.spawn_farm(&format!("f{f}"), &DEFAULTS).await;
    }
    let ids = crate::harness::rcs(c, n, 2).await;
    // 2 pods each, and one more on the first 24 - 2n.
    for id in &ids[..24 - 2 * n] {
        c.patch_rc(*id, "replicas_desired", 3.into()).await;
    }
    let (cr, idr) = (&*c, &ids);
    c.wait_for(
        Duration::from_secs(60),
        "24 pods placed",
        move || async move { pods_of(cr, idr).await == 24 },
    )
    .await;
    (ids, sim)
}

/// Pods placed for `ids`, in all.
pub(crate) async fn pods_of(c: &Cluster, ids: &[RcId]) -> usize {
    let p = c.placements().await;
    ids.iter().map(|id| p.get(id).map_or(0, |s| s.len())).sum()
}

/// Ten RCs with 24 pods on `farms` farms with the default flags, then every RC set to 0 in one
/// transaction: the bulk edit the tripwire exists for. At most 5 pods go in 15 s.
async fn a_bulk_edit_is_held(backend: Backend, farms: usize) {
    let mut c = Cluster::start_on(&backend).await;
    let (ids, _sim) = twenty_four_pods(&mut c, farms, 10).await;
    let mut ops = Vec::new();
    for id in &ids {
        ops.push(TxnOp::set(
            id.key(),
            c.patched_rc(*id, "replicas_desired", 0.into()).await,
        ));
    }
    c.consul.txn(&ops).await.unwrap();
    tokio::time::sleep(Duration::from_secs(15)).await;
    let left = pods_of(&c, &ids).await;
    assert!(left >= 19, "{} pods removed within 15 s", 24 - left);
}

on_every_backend!(a_bulk_edit_to_zero_is_held_on_one_farm);
async fn a_bulk_edit_to_zero_is_held_on_one_farm(backend: Backend) {
    a_bulk_edit_is_held(backend, 1).await
}

on_every_backend!(a_bulk_edit_to_zero_is_held_on_three_farms);
async fn a_bulk_edit_to_zero_is_held_on_three_farms(backend: Backend) {
    a_bulk_edit_is_held(backend, 3).await
}

on_every_backend!(a_health_result_older_than_what_the_node_runs_does_not_count);
/// A health result counts for a roll only when it is newer than the reality write it is about:
/// a pod replaced in place keeps its health key, and a "passing" written for the pod it
/// replaced says nothing of the new one. Here the test plays the node agent by hand.
async fn a_health_result_older_than_what_the_node_runs_does_not_count(backend: Backend) {
    let mut c = Cluster::start_on(&backend).await;
    c.label_node("node-00", &[("env", "prod")]).await;
    c.spawn_farm("f1", &ROLL_FLAGS).await;
    // A pod P2's preparer checks (it has a status port).
    let manifest = |v: &str| {
        format!(
            "id: web\nstatus_port: 8080\nlaunchables:\n  app:\n    launchable_type: hoist\n    location: https://example.com/web-{v}.tar.gz\n"
        )
    };
    let old = RcId::new();
    let record = serde_json::json!({
        "id": old.to_string(), "manifest": manifest("1"), "node_selector": "env=prod",
        "pod_labels": {}, "replicas_desired": 1, "disabled": false,
        "allocation_strategy": "static_strategy",
    });
    c.consul
        .kv_put(&old.key(), record.to_string().as_bytes(), None)
        .await
        .unwrap();
    let cr = &c;
    let intent = || async move {
        cr.consul
            .kv_get("intent/node-00/web", &QueryOptions::default())
            .await
            .unwrap()
            .0
            .map(|e| String::from_utf8_lossy(e.value_bytes()).to_string())
    };
    c.wait_for(
        Duration::from_secs(20),
        "the pod scheduled",
        move || async move { intent().await.is_some() },
    )
    .await;
    // The node runs it and finds it healthy.
    let run = |text: String| async move {
        cr.consul
            .kv_put("reality/node-00/web", text.as_bytes(), None)
            .await
            .unwrap();
    };
    // (Each result says when it was taken: Consul ≥ 1.x skips a write of an identical value.)
    let pass = |at: u32| async move {
        cr.consul
            .kv_put(
                "health/web/node-00",
                format!(r#"{{"Status":"passing","Output":"check {at}"}}"#).as_bytes(),
                None,
            )
            .await
            .unwrap();
    };
    run(intent().await.unwrap()).await;
    pass(1).await;
    // A roll onto version 2, no minimum: the new RC replaces the pod in place.
    let pod_manifest = manifest("2");
    let new = rcfarm::roll::RollStore::new(c.consul.clone())
        .start(
            rcfarm::roll::StartRoll {
                old_rc: old,
                manifest: pod_manifest.clone(),
                desired: None,
                minimum: Some(0),
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
    c.wait_for(
        Duration::from_secs(20),
        "the new intent on the node",
        move || async move { intent().await.is_some_and(|m| m.contains("web-2")) },
    )
    .await;
    // The node runs the new manifest; the health key still says "passing" from before.
    run(intent().await.unwrap()).await;
    let api = farm_api(&c, "f1").await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let v = get_json(&format!("{api}/v1/rolls/{new}")).await;
    assert_eq!(
        v["roll"]["new"]["healthy"], 0,
        "a health result older than the reality it is about counts for nothing: {v:#}"
    );
    assert!(
        roll_exists(&c, new).await,
        "the roll waits for a fresh result"
    );
    // A result written after it: the pod is up, the roll completes.
    pass(2).await;
    c.wait_for(
        Duration::from_secs(30),
        "the roll completes",
        move || async move { !roll_exists(cr, new).await },
    )
    .await;
}

on_every_backend!(leftovers_are_pruned_and_reported_once);
/// What is never pruned grows for ever: a garbage key under a lock prefix is reported once
/// while it is there (and again if it comes back), whatever else changes; a completed roll
/// deletes its old RC's transfer status keys with the RC.
async fn leftovers_are_pruned_and_reported_once(backend: Backend) {
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 3, 1).await;
    let _sim = c.simulate(3, 0.0);
    c.spawn_farm("f1", &ROLL_FLAGS).await;
    for k in [
        "lock/replication_controllers/not-an-rc",
        "lock/rolls/not-a-roll",
    ] {
        c.consul.kv_put(k, b"x", None).await.unwrap();
    }
    let old = crate::harness::rcs(&c, 1, 2).await[0];
    let cr = &c;
    c.wait_for(Duration::from_secs(30), "the RC up", move || async move {
        cr.all_up(old, 2).await
    })
    .await;
    // Status keys beside the RC's (what P2 and earlier farms leave behind).
    let p2_status = status_key(old);
    c.consul
        .kv_put(&p2_status, br#"{"node_transfer":null}"#, None)
        .await
        .unwrap();
    c.consul
        .kv_put(
            &format!("status/replication_controllers/{old}/rcfarm"),
            b"{}",
            None,
        )
        .await
        .unwrap();
    // Many changes of the lock tree: a roll, its locks, its completion.
    let new = c.start_roll(old, 1, Duration::ZERO).await;
    completed(&c, new, old, 2, Duration::from_secs(60)).await;
    let log = c.farm_log(0);
    for (key, why) in [
        ("lock/replication_controllers/not-an-rc", "not an RC lock"),
        ("lock/rolls/not-a-roll", "not a roll lock"),
    ] {
        let times = log
            .lines()
            .filter(|l| l.contains(key) && l.contains(why))
            .count();
        assert_eq!(times, 1, "{key} reported once, not {times} times:\n{log}");
    }
    assert_eq!(
        c.count_prefix(&format!("status/replication_controllers/{old}/"))
            .await,
        0,
        "the completed roll deleted its old RC's status keys"
    );
}

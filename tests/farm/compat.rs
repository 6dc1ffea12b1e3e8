//! The farm on both emulations of the embedded server (`--compat 0.7|1.x`) where Consul
//! versions differ in ways the farm must cope with: transaction size limits (200 KB manifests)
//! and Consul 0.7's stale answers after an election (hashicorp/consul#2644).

use std::collections::BTreeMap;
use std::time::Duration;

use rcfarm::audit::events;
use rcfarm::rc::RcId;
use rcfarm::server::Compat;
use serde_json::json;

use crate::harness::{Backend, Cluster, nodes};
use crate::on_every_backend;

/// A P2 manifest of about `kib` KiB (a comment makes up the size).
fn big_manifest(pod_id: &str, kib: usize) -> String {
    format!(
        "id: {pod_id}\nlaunchables:\n  app:\n    launchable_type: hoist\n    location: https://example.com/{pod_id}.tar.gz\n# {}\n",
        "x".repeat(kib * 1024)
    )
}

// Each pod write carries the manifest (base64: ~273 KiB for 200 KiB), so two pods in one
// transaction would pass Consul's 512 KiB (1.x: `txn_max_req_len` on the body; 0.7: the sum of
// the values): the farm must cut its writes by size, and no RC may be refused with a 413.
on_every_backend!(rcs_with_200_kb_manifests_converge_without_a_413);
async fn rcs_with_200_kb_manifests_converge_without_a_413(b: Backend) {
    let mut c = Cluster::start_on(&b).await;
    nodes(&c, 4, 1).await;
    c.spawn_farm("f1", &[]).await;
    c.spawn_farm("f2", &[]).await;
    let mut want = Vec::new();
    for i in 0..4 {
        let id = RcId::new();
        let record = json!({
            "id": id.to_string(),
            "manifest": big_manifest(&format!("big-{i}"), 200),
            "node_selector": "env=prod",
            "pod_labels": {},
            "replicas_desired": 3,
            "disabled": false,
            "allocation_strategy": "static_strategy",
        });
        assert!(
            c.consul
                .kv_put(&id.key(), record.to_string().as_bytes(), None)
                .await
                .unwrap()
        );
        want.push(id);
    }
    let cr = &c;
    let wr = &want;
    c.wait_for(
        Duration::from_secs(90),
        "4 RCs with 200 KB manifests on 3 nodes each",
        move || async move {
            let p = cr.placements().await;
            wr.iter().all(|id| p.get(id).is_some_and(|s| s.len() == 3))
        },
    )
    .await;
    for i in 0..c.farms.len() {
        let log = c.farm_log(i);
        let refused: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("HTTP 413") || l.to_ascii_lowercase().contains("too large"))
            .take(5)
            .collect();
        assert!(
            refused.is_empty(),
            "farm {} met a 413:\n{}",
            c.farms[i].id,
            refused.join("\n")
        );
    }
    assert!(c.audit_events(events::RC_INVALID).await.is_empty());
    // The intents are the whole manifests.
    let (intents, _) = c
        .consul
        .kv_list("intent/", &Default::default())
        .await
        .unwrap();
    assert_eq!(intents.len(), 12);
    assert!(intents.iter().all(|e| e.value_bytes().len() > 200 * 1024));
    c.check_invariants(|_| false);
}

/// Consul < 0.8.5 answered reads from a leader still replaying its log after an election: an
/// older state at a lower index (hashicorp/consul#2644). The farms' watches must hold their
/// view (`WatchConfig::regression_grace`) rather than act on it. Here the old state still has a
/// third farm that has since stopped and handed its RCs over, holding its locks: believed, the
/// other two would see their fair share shrink and hand RCs back and forth. No pod may move, no
/// RC change hands, nothing be written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_answers_after_an_election_move_nothing_on_consul_0_7() {
    let mut c = Cluster::start_on(&Backend::Embedded(Compat::V0_7)).await;
    nodes(&c, 4, 1).await;
    let ids = c.farms_sharing(3, 9, 2).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    // What a replaying leader will show: three farms, each with its RCs.
    let checkpoint = c.server.embedded().in_process().checkpoint();
    crate::harness::signal(c.farms[2].pid, "TERM");
    let cr = &c;
    let idr = &ids;
    c.wait_for(
        Duration::from_secs(20),
        "f3's RCs handed over to f1 and f2",
        move || async move { cr.placed_and_shared(idr, 2, 2).await },
    )
    .await;
    // Let the handovers settle.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let placed = c.placements().await;
    let owners: BTreeMap<RcId, String> = c.owner_farms().await;
    assert_eq!(owners.len(), ids.len());
    let commits_before = c.server.commit_log().len();

    // Every farm's watches ask again at once and get the old state, until 300 answers are
    // given (about a second of the farms' asking: well inside the 5-s grace).
    let server = c.server.embedded().in_process();
    server.serve_stale(checkpoint, 300).unwrap();
    let started = std::time::Instant::now();
    while server.stale_answers_left() > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "the farms stopped asking: {} stale answers left",
            server.stale_answers_left()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Anything misread would be acted on at the next pass (each within a resync: 1 s here).
    c.passes(&ids, 3).await;

    let held: usize = (0..c.farms.len())
        .map(|i| {
            c.farm_log(i)
                .matches("Consul answered with an older state than already seen")
                .count()
        })
        .sum();
    assert!(held > 0, "no watch saw the stale answers");
    assert_eq!(c.placements().await, placed, "pods moved");
    assert_eq!(c.owner_farms().await, owners, "RCs changed hands");
    let written: Vec<String> = c.server.commit_log()[commits_before..]
        .iter()
        .flat_map(|commit| commit.changes.iter().map(|ch| format!("{ch:?}")))
        .filter(|ch| !ch.contains("audit_logs/"))
        .collect();
    assert!(
        written.is_empty(),
        "writes after the stale answers: {written:#?}"
    );
    c.check_invariants(|_| false);
}

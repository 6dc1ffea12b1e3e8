//! Changes made behind the farm's back, to pods it serves. A farm reads the pod label tree on
//! demand (its own writes it applies as it commits them), so nothing but its periodic read
//! (every `--consistency-interval`) and its intent sweep tells it of these: each test edits one
//! thing by hand, as an operator or another tool would, and waits for the farm to repair it.

use std::time::Duration;

use rcfarm::consul::QueryOptions;
use rcfarm::labels::{LabelSet, encode_labels, parse_labels};
use rcfarm::rc::RcId;

use crate::harness::{Backend, Cluster, nodes};
use crate::on_both_backends;

/// The farm reads the pod labels every 2 s here: slower than the harness's 1 s, and long
/// enough that nothing else (its own writes, a claim) explains a repair.
const EVERY: &str = "2s";

/// A cluster with one farm serving one RC of 2 replicas on 5 nodes, converged.
async fn served(b: &Backend) -> (Cluster, RcId) {
    let mut c = Cluster::start_on(b).await;
    nodes(&c, 5, 1).await;
    c.spawn_farm("f1", &["--consistency-interval", EVERY]).await;
    let id = RcId::new();
    c.put_rc(id, "web", "env=prod", 2, "static_strategy").await;
    wait_placed(&c, id, 2, "scheduled").await;
    (c, id)
}

async fn wait_placed(c: &Cluster, id: RcId, n: usize, what: &str) {
    c.wait_for(Duration::from_secs(30), what, || async move {
        c.placements().await.get(&id).map_or(0, |s| s.len()) == n
    })
    .await;
}

async fn pod_labels(c: &Cluster, node: &str) -> Option<LabelSet> {
    let (e, _) = c
        .consul
        .kv_get(&format!("labels/pod/{node}/web"), &QueryOptions::default())
        .await
        .unwrap();
    e.map(|e| parse_labels(e.value_bytes()).unwrap())
}

async fn put_pod_labels(c: &Cluster, node: &str, labels: &LabelSet) {
    c.consul
        .kv_put(
            &format!("labels/pod/{node}/web"),
            &encode_labels(labels),
            None,
        )
        .await
        .unwrap();
}

async fn a_node_of(c: &Cluster, id: RcId) -> String {
    c.placements().await[&id].iter().next().unwrap().clone()
}

on_both_backends!(a_pod_label_key_deleted_by_hand_is_repaired);
/// Its pod's labels gone, a pod is no longer the RC's: the farm makes up the replica.
async fn a_pod_label_key_deleted_by_hand_is_repaired(b: Backend) {
    let (c, id) = served(&b).await;
    let node = a_node_of(&c, id).await;
    c.consul
        .kv_delete(&format!("labels/pod/{node}/web"))
        .await
        .unwrap();
    assert_eq!(c.placements().await[&id].len(), 1);
    wait_placed(&c, id, 2, "the RC's second pod back").await;
}

on_both_backends!(a_pod_relabelled_to_another_rc_by_hand_is_replaced);
/// A pod handed to another RC by hand (its `replication_controller_id` changed) is that RC's
/// now: the farm schedules a replacement and leaves the relabelled pod alone.
async fn a_pod_relabelled_to_another_rc_by_hand_is_replaced(b: Backend) {
    let (c, id) = served(&b).await;
    let node = a_node_of(&c, id).await;
    let other = RcId::new();
    let mut labels = pod_labels(&c, &node).await.unwrap();
    labels.insert("replication_controller_id".into(), other.to_string());
    put_pod_labels(&c, &node, &labels).await;
    wait_placed(&c, id, 2, "a replacement for the relabelled pod").await;
    let placed = c.placements().await;
    assert!(!placed[&id].contains(&node), "{placed:?}");
    assert_eq!(
        pod_labels(&c, &node).await.unwrap()["replication_controller_id"],
        other.to_string(),
        "the relabelled pod is left to its new RC"
    );
}

on_both_backends!(a_pod_added_for_the_rc_by_hand_is_removed);
/// A third pod labelled as the RC's by hand (intent and labels on another node) makes one too
/// many: the farm unschedules one.
async fn a_pod_added_for_the_rc_by_hand_is_removed(b: Backend) {
    let (c, id) = served(&b).await;
    let placed = c.placements().await[&id].clone();
    let spare = (0..5)
        .map(|i| format!("node-{i:02}"))
        .find(|n| !placed.contains(n))
        .unwrap();
    let labels = pod_labels(&c, placed.iter().next().unwrap()).await.unwrap();
    let (intent, _) = c
        .consul
        .kv_get(
            &format!("intent/{}/web", placed.iter().next().unwrap()),
            &QueryOptions::default(),
        )
        .await
        .unwrap();
    c.consul
        .kv_put(
            &format!("intent/{spare}/web"),
            intent.unwrap().value_bytes(),
            None,
        )
        .await
        .unwrap();
    put_pod_labels(&c, &spare, &labels).await;
    assert_eq!(c.placements().await[&id].len(), 3);
    wait_placed(&c, id, 2, "the extra pod removed").await;
}

on_both_backends!(a_pod_label_removed_by_hand_is_put_back);
/// A label the RC gives its pods (`pod_labels`), removed from one pod by hand: the pod is
/// still the RC's, and the farm labels it again.
async fn a_pod_label_removed_by_hand_is_put_back(b: Backend) {
    let (c, id) = served(&b).await;
    let node = a_node_of(&c, id).await;
    let mut labels = pod_labels(&c, &node).await.unwrap();
    assert_eq!(labels.remove("cluster_name").as_deref(), Some("test"));
    put_pod_labels(&c, &node, &labels).await;
    let (c, node) = (&c, node.as_str());
    c.wait_for(
        Duration::from_secs(30),
        "the label put back",
        || async move {
            pod_labels(c, node)
                .await
                .is_some_and(|l| l.get("cluster_name").map(String::as_str) == Some("test"))
        },
    )
    .await;
    assert_eq!(c.placements().await[&id].len(), 2);
}

crate::on_every_backend!(a_pod_repaired_under_an_unchanged_label_can_still_be_removed);
/// An intent edited by hand is repaired with its pod's label, which has not changed: Consul
/// 1.x keeps that label's `ModifyIndex` (0.7 moves it). The farm must cache the index Consul
/// answered for the key, not the transaction's, or every later write guarded by that label
/// (here the scale-down that removes the pod) names an index Consul never gave it, and fails
/// for ever. Found as an undo that never started, in the mixed-release test.
async fn a_pod_repaired_under_an_unchanged_label_can_still_be_removed(b: Backend) {
    let (c, id) = served(&b).await;
    // The scale-down removes the highest-named node's pod: repair that one.
    let node = c.placements().await[&id]
        .iter()
        .next_back()
        .unwrap()
        .clone();
    let key = format!("intent/{node}/web");
    let labels_before = c
        .consul
        .kv_get(&format!("labels/pod/{node}/web"), &QueryOptions::default())
        .await
        .unwrap()
        .0
        .unwrap();
    c.consul
        .kv_put(&key, b"id: web\nedited: by hand\n", None)
        .await
        .unwrap();
    let (cr, k) = (&c, key.as_str());
    c.wait_for(
        Duration::from_secs(30),
        "the intent repaired",
        move || async move {
            let (e, _) = cr.consul.kv_get(k, &QueryOptions::default()).await.unwrap();
            e.is_some_and(|e| !String::from_utf8_lossy(e.value_bytes()).contains("by hand"))
        },
    )
    .await;
    let labels_after = c
        .consul
        .kv_get(&format!("labels/pod/{node}/web"), &QueryOptions::default())
        .await
        .unwrap()
        .0
        .unwrap();
    assert_eq!(
        labels_after.value_bytes(),
        labels_before.value_bytes(),
        "the label was rewritten unchanged"
    );
    c.patch_rc(id, "replicas_desired", 1.into()).await;
    wait_placed(&c, id, 1, "the repaired pod removed by the scale-down").await;
    assert!(
        !c.placements().await[&id].contains(&node),
        "the highest-named node's pod went"
    );
}

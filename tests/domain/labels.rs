use std::sync::Arc;
use std::time::Duration;

use rcfarm::consul::WatchConfig;
use rcfarm::labels::{LabelCache, LabelSet, LabelStore, LabelType, LabelsError, Selector};

use crate::common::{client, eventually, server};

fn set(pairs: &[(&str, &str)]) -> LabelSet {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[tokio::test]
async fn get_set_apply_remove() {
    let s = server().await;
    let store = LabelStore::new(client(&s));
    let (empty, idx) = store.get(LabelType::Node, "n1").await.unwrap();
    assert!(empty.is_empty() && idx == 0, "absent means no labels");
    store
        .set(
            LabelType::Node,
            "n1",
            &set(&[("env", "prod"), ("rack", "r1")]),
        )
        .await
        .unwrap();
    let after = store
        .apply(
            LabelType::Node,
            "n1",
            &set(&[("gpu", "true")]),
            &["rack".into()],
        )
        .await
        .unwrap();
    assert_eq!(after, set(&[("env", "prod"), ("gpu", "true")]));
    let (read, idx) = store.get(LabelType::Node, "n1").await.unwrap();
    assert_eq!(read, after);
    assert!(idx > 0);
    // Removing the last labels deletes the key, as P2 does.
    store
        .apply(
            LabelType::Node,
            "n1",
            &LabelSet::new(),
            &["env".into(), "gpu".into()],
        )
        .await
        .unwrap();
    assert!(
        client(&s)
            .kv_get("labels/node/n1", &Default::default())
            .await
            .unwrap()
            .0
            .is_none()
    );
    let err = store
        .set(LabelType::Node, "n1", &set(&[("bad key", "x")]))
        .await
        .unwrap_err();
    assert!(matches!(err, LabelsError::Invalid(_)), "{err}");
}

#[tokio::test]
async fn two_writers_racing_on_one_map_exactly_one_cas_wins_and_apply_merges() {
    let s = server().await;
    let store = LabelStore::new(client(&s));
    store
        .set(LabelType::Node, "race", &set(&[("a", "0")]))
        .await
        .unwrap();
    let (_, idx) = store.get(LabelType::Node, "race").await.unwrap();
    let (one, two) = (set(&[("a", "1")]), set(&[("a", "2")]));
    let (r1, r2) = tokio::join!(
        store.set_cas(LabelType::Node, "race", &one, idx),
        store.set_cas(LabelType::Node, "race", &two, idx),
    );
    assert_eq!(
        [r1.unwrap(), r2.unwrap()].iter().filter(|w| **w).count(),
        1,
        "exactly one CAS wins"
    );

    // Concurrent read-modify-writes of different keys all land (the losers retry).
    let mut tasks = Vec::new();
    for i in 0..10 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            store
                .apply(
                    LabelType::Node,
                    "race",
                    &set(&[(&format!("k{i}"), "v")]),
                    &[],
                )
                .await
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let (labels, _) = store.get(LabelType::Node, "race").await.unwrap();
    assert_eq!(labels.len(), 11, "{labels:?}");
}

#[tokio::test]
async fn cache_answers_selectors_and_follows_changes() {
    let s = server().await;
    let c = client(&s);
    let store = LabelStore::new(c.clone());
    let cache = LabelCache::spawn(&c, LabelType::Node, WatchConfig::default());
    tokio::time::timeout(Duration::from_secs(5), cache.synced())
        .await
        .unwrap();
    assert!(
        cache.matches(&Selector::everything()).is_empty(),
        "an empty tree is an empty answer"
    );

    for i in 0..20 {
        let l = set(&[
            ("rack", &format!("r{}", i % 4)),
            ("env", if i < 10 { "prod" } else { "dev" }),
        ]);
        store
            .set(LabelType::Node, &format!("n{i:02}"), &l)
            .await
            .unwrap();
    }
    eventually(Duration::from_secs(5), "20 nodes cached", || {
        let n = cache.len();
        async move { (n == 20).then_some(()) }
    })
    .await;
    let mut changes = cache.subscribe_changes();
    let sel = Selector::parse("env=prod,rack in (r0,r1)").unwrap();
    assert_eq!(
        cache.matches(&sel),
        ["n00", "n01", "n04", "n05", "n08", "n09"]
    );

    store
        .apply(LabelType::Node, "n00", &set(&[("env", "dev")]), &[])
        .await
        .unwrap();
    let ch = tokio::time::timeout(Duration::from_secs(5), changes.recv())
        .await
        .unwrap()
        .unwrap();
    let ids: Vec<_> = ch.changes.iter().map(|c| c.id.as_str()).collect();
    assert!(ids.contains(&"n00"), "{ids:?}");
    let change = ch.changes.iter().find(|c| c.id == "n00").unwrap();
    assert_eq!(change.old.as_ref().unwrap()["env"], "prod");
    assert_eq!(change.new.as_ref().unwrap()["env"], "dev");
    assert_eq!(cache.matches(&sel), ["n01", "n04", "n05", "n08", "n09"]);
}

#[tokio::test]
async fn malformed_label_entries_are_reported_and_skipped() {
    let s = server().await;
    let c = client(&s);
    c.kv_put("labels/node/good", br#"{"env":"prod"}"#, None)
        .await
        .unwrap();
    c.kv_put("labels/node/bad-json", b"{not json", None)
        .await
        .unwrap();
    c.kv_put("labels/node/not-object", b"[1,2]", None)
        .await
        .unwrap();
    c.kv_put("labels/node/not-strings", br#"{"a":1}"#, None)
        .await
        .unwrap();
    c.kv_put("labels/pod/no-slash", br#"{"a":"b"}"#, None)
        .await
        .unwrap();
    c.kv_put("labels/pod/n1/web", br#"{"pod_id":"web"}"#, None)
        .await
        .unwrap();

    let store = LabelStore::new(c.clone());
    let (ok, bad) = store.list(LabelType::Node).await.unwrap();
    assert_eq!(
        ok.iter().map(|l| l.id.as_str()).collect::<Vec<_>>(),
        ["good"]
    );
    assert_eq!(bad.len(), 3);
    let nodes = LabelCache::spawn(&c, LabelType::Node, WatchConfig::default());
    let pods = LabelCache::spawn(&c, LabelType::Pod, WatchConfig::default());
    nodes.synced().await;
    pods.synced().await;
    assert_eq!(nodes.matches(&Selector::everything()), ["good"]);
    assert_eq!(nodes.errors().len(), 3);
    assert_eq!(pods.matches(&Selector::everything()), ["n1/web"]);
    assert!(
        pods.errors()[0].1.contains("<node>/<pod-id>"),
        "{:?}",
        pods.errors()
    );

    // Fixing an entry brings it in; the cache never stopped.
    c.kv_put("labels/node/bad-json", br#"{"env":"prod"}"#, None)
        .await
        .unwrap();
    eventually(Duration::from_secs(5), "fixed entry", || {
        let m = nodes.matches(&Selector::parse("env=prod").unwrap());
        async move { (m.len() == 2).then_some(()) }
    })
    .await;
    assert_eq!(nodes.errors().len(), 2);
}

#[tokio::test]
async fn ten_thousand_nodes_from_the_cache() {
    let s = server().await;
    let c = client(&s);
    // Write in transactions of 64 to keep the test quick.
    let ops: Vec<_> = (0..10_000)
        .map(|i| {
            LabelStore::set_op(
                LabelType::Node,
                &format!("node-{i:05}"),
                &set(&[
                    ("rack", &format!("r{}", i % 100)),
                    ("zone", &format!("z{}", i % 3)),
                    ("pool", if i % 10 == 0 { "spare" } else { "main" }),
                ]),
            )
        })
        .collect();
    for chunk in ops.chunks(64) {
        c.txn(chunk).await.unwrap();
    }
    let cache = Arc::new(LabelCache::spawn(
        &c,
        LabelType::Node,
        WatchConfig::default(),
    ));
    eventually(Duration::from_secs(20), "10,000 nodes cached", || {
        let n = cache.len();
        async move { (n == 10_000).then_some(()) }
    })
    .await;
    let requests = c.stats().requests;
    let m = cache.matches(&Selector::parse("rack=r7,zone=z1").unwrap());
    assert_eq!(m.len(), 34);
    assert!(m.iter().all(|n| n.ends_with('7')));
    assert_eq!(
        cache
            .matches(&Selector::parse("pool!=spare,zone notin (z0,z2)").unwrap())
            .len(),
        3000
    );
    assert_eq!(
        cache
            .matches(&Selector::parse("rack in (r1,r2),!missing").unwrap())
            .len(),
        200
    );
    assert_eq!(c.stats().requests, requests, "no Consul request per query");
}

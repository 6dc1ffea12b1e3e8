use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use rcfarm::consul::WatchConfig;
use rcfarm::health::{HealthCache, HealthStatus};
use rcfarm::labels::{LabelCache, LabelSet, LabelStore, LabelType, Selector};
use rcfarm::rc::Manifest;
use rcfarm::scheduler::{LabelScheduler, PoolConfig, PoolScheduler, Scheduler, SchedulerError};

use crate::common::{client, eventually, server};

fn set(pairs: &[(&str, &str)]) -> LabelSet {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn strs(v: Vec<rcfarm::scheduler::NodeName>) -> Vec<String> {
    v.iter().map(|n| n.to_string()).collect()
}

fn manifest(id: &str) -> Manifest {
    Manifest::parse(&format!("id: {id}\n")).unwrap()
}

async fn caches(c: &rcfarm::consul::Consul) -> (Arc<LabelCache>, Arc<LabelCache>) {
    let nodes = Arc::new(LabelCache::spawn(
        c,
        LabelType::Node,
        WatchConfig::default(),
    ));
    let pods = Arc::new(LabelCache::spawn(c, LabelType::Pod, WatchConfig::default()));
    nodes.synced().await;
    pods.synced().await;
    (nodes, pods)
}

#[tokio::test]
async fn label_scheduler_matches_labels_and_cannot_allocate() {
    let s = server().await;
    let c = client(&s);
    let store = LabelStore::new(c.clone());
    for (n, env) in [("b", "prod"), ("a", "prod"), ("c", "dev")] {
        store
            .set(LabelType::Node, n, &set(&[("env", env)]))
            .await
            .unwrap();
    }
    let (nodes, _) = caches(&c).await;
    eventually(Duration::from_secs(5), "nodes", || {
        let n = nodes.len();
        async move { (n == 3).then_some(()) }
    })
    .await;
    let sched = LabelScheduler::new(nodes);
    let sel = Selector::parse("env=prod").unwrap();
    assert_eq!(
        strs(sched.eligible_nodes(&manifest("web"), &sel).await.unwrap()),
        ["a", "b"]
    );
    let err = sched
        .allocate_nodes(&manifest("web"), &sel, 2, false)
        .await
        .unwrap_err();
    assert!(matches!(err, SchedulerError::AllocationUnsupported(_)));
    assert!(err.to_string().contains("--scheduler pool"), "{err}");
}

async fn pool_setup(c: &rcfarm::consul::Consul, spare: usize) {
    let store = LabelStore::new(c.clone());
    for i in 0..spare {
        store
            .set(
                LabelType::Node,
                &format!("spare-{i:02}"),
                &set(&[("rcfarm.io/pool", "spare"), ("env", "prod")]),
            )
            .await
            .unwrap();
    }
    store
        .set(LabelType::Node, "fixed-1", &set(&[("env", "prod")]))
        .await
        .unwrap();
}

#[tokio::test]
async fn pool_nodes_become_eligible_only_through_allocation_and_free_on_deallocate() {
    let s = server().await;
    let c = client(&s);
    pool_setup(&c, 3).await;
    let (nodes, pods) = caches(&c).await;
    eventually(Duration::from_secs(5), "nodes", || {
        let n = nodes.len();
        async move { (n == 4).then_some(()) }
    })
    .await;
    let pool = PoolScheduler::new(
        &c,
        nodes,
        pods,
        PoolConfig::default(),
        WatchConfig::default(),
    );
    pool.synced().await;
    let sel = Selector::parse("env=prod").unwrap();
    let web = manifest("web");
    assert_eq!(
        strs(pool.eligible_nodes(&web, &sel).await.unwrap()),
        ["fixed-1"],
        "pool nodes need a reservation"
    );
    let got = strs(pool.allocate_nodes(&web, &sel, 2, false).await.unwrap());
    assert_eq!(got, ["spare-00", "spare-01"]);
    assert_eq!(
        strs(pool.eligible_nodes(&web, &sel).await.unwrap()),
        ["fixed-1", "spare-00", "spare-01"]
    );
    // Another RC's pod gets what is left; capacity 1 means one pod id per node.
    let api = manifest("api");
    assert_eq!(
        strs(pool.allocate_nodes(&api, &sel, 5, false).await.unwrap()),
        ["spare-02"]
    );
    assert!(
        strs(
            pool.allocate_nodes(&manifest("third"), &sel, 1, false)
                .await
                .unwrap()
        )
        .is_empty()
    );

    pool.deallocate_nodes(&sel, &["spare-00".into()])
        .await
        .unwrap();
    assert_eq!(
        strs(pool.eligible_nodes(&web, &sel).await.unwrap()),
        ["fixed-1", "spare-01"]
    );
    assert_eq!(
        strs(
            pool.allocate_nodes(&manifest("third"), &sel, 1, false)
                .await
                .unwrap()
        ),
        ["spare-00"]
    );

    // A slot whose pod is scheduled is not freed by deallocation.
    LabelStore::new(c.clone())
        .set(LabelType::Pod, "spare-01/web", &set(&[("pod_id", "web")]))
        .await
        .unwrap();
    pool.deallocate_nodes(&sel, &["spare-01".into()])
        .await
        .unwrap();
    assert!(strs(pool.eligible_nodes(&web, &sel).await.unwrap()).contains(&"spare-01".to_string()));
}

#[tokio::test]
async fn concurrent_allocation_from_several_farms_never_gives_a_slot_twice() {
    let s = server().await;
    let c = client(&s);
    pool_setup(&c, 10).await;
    // Four schedulers, as four farms would have, each with its own caches.
    let mut scheds = Vec::new();
    for _ in 0..4 {
        let (nodes, pods) = caches(&c).await;
        eventually(Duration::from_secs(5), "nodes", || {
            let n = nodes.len();
            async move { (n == 11).then_some(()) }
        })
        .await;
        let p = Arc::new(PoolScheduler::new(
            &c,
            nodes,
            pods,
            PoolConfig::default(),
            WatchConfig::default(),
        ));
        p.synced().await;
        scheds.push(p);
    }
    let sel = Selector::parse("env=prod").unwrap();
    let mut tasks = Vec::new();
    for (i, p) in scheds.iter().enumerate() {
        for j in 0..4 {
            let p = p.clone();
            let sel = sel.clone();
            // 16 different pods each wanting 2 nodes: 32 wanted, 10 slots.
            tasks.push(tokio::spawn(async move {
                let m = manifest(&format!("pod-{i}-{j}"));
                (
                    m.pod_id().to_string(),
                    strs(p.allocate_nodes(&m, &sel, 2, false).await.unwrap()),
                )
            }));
        }
    }
    let mut given: Vec<String> = Vec::new();
    for t in tasks {
        let (_, nodes) = t.await.unwrap();
        given.extend(nodes);
    }
    let unique: BTreeSet<&String> = given.iter().collect();
    assert_eq!(
        given.len(),
        unique.len(),
        "a slot was handed out twice: {given:?}"
    );
    assert_eq!(given.len(), 10, "every slot was handed out");
    // What Consul holds agrees.
    let (entries, _) = c
        .kv_list("scheduler/pool/reservations/", &Default::default())
        .await
        .unwrap();
    let slots: usize = entries
        .iter()
        .map(|e| {
            serde_json::from_slice::<rcfarm::scheduler::NodeReservations>(e.value_bytes())
                .unwrap()
                .slots
                .len()
        })
        .sum();
    assert_eq!(slots, 10);
}

#[tokio::test]
async fn forced_allocation_falls_back_to_any_pool_node() {
    let s = server().await;
    let c = client(&s);
    let store = LabelStore::new(c.clone());
    store
        .set(
            LabelType::Node,
            "spare-x",
            &set(&[("rcfarm.io/pool", "spare"), ("env", "dev")]),
        )
        .await
        .unwrap();
    let (nodes, pods) = caches(&c).await;
    eventually(Duration::from_secs(5), "node", || {
        let n = nodes.len();
        async move { (n == 1).then_some(()) }
    })
    .await;
    let pool = PoolScheduler::new(
        &c,
        nodes,
        pods,
        PoolConfig::default(),
        WatchConfig::default(),
    );
    pool.synced().await;
    let sel = Selector::parse("env=prod").unwrap();
    assert!(
        strs(
            pool.allocate_nodes(&manifest("web"), &sel, 1, false)
                .await
                .unwrap()
        )
        .is_empty()
    );
    assert_eq!(
        strs(
            pool.allocate_nodes(&manifest("web"), &sel, 1, true)
                .await
                .unwrap()
        ),
        ["spare-x"]
    );
}

#[tokio::test]
async fn health_is_read_from_p2_results() {
    let s = server().await;
    let c = client(&s);
    c.kv_put("health/web/n1", br#"{"Id":"web","Node":"n1","Service":"web","Status":"passing","Time":"2020-01-01T00:00:00Z"}"#, None).await.unwrap();
    c.kv_put("health/web/n2", br#"{"status":"critical"}"#, None)
        .await
        .unwrap();
    c.kv_put("health/web/n3", b"garbage", None).await.unwrap();
    c.kv_put("health/api/n1", br#"{"Status":"warning"}"#, None)
        .await
        .unwrap();
    let h = HealthCache::spawn(&c, WatchConfig::default());
    h.tree().synced().await;
    assert_eq!(h.status("web", "n1"), Some(HealthStatus::Passing));
    assert_eq!(h.status("web", "n2"), Some(HealthStatus::Critical));
    assert_eq!(
        h.status("web", "n3"),
        None,
        "garbage is reported, not guessed"
    );
    assert_eq!(h.for_pod("web").len(), 2);
    assert_eq!(h.tree().errors().len(), 1);
    assert_eq!(h.status("api", "n1"), Some(HealthStatus::Warning));
}

//! The bad-input tour: everything malformed an operator or another program can put into Consul,
//! all at once, with two farms running. Each is reported (once), skipped, and every good RC is
//! served regardless.

use std::collections::BTreeMap;
use std::time::Duration;

use rcfarm::audit::{AuditStore, events};
use rcfarm::rc::RcId;
use rcfarm::server::ServerConfig;
use serde_json::{Value, json};

use crate::harness::{Backend, Cluster, nodes};
use crate::on_both_backends;

fn record(id: &str, extra: Value) -> Vec<u8> {
    let mut v = json!({
        "id": id,
        "manifest": "id: app\nlaunchables: {}\n",
        "node_selector": "env=prod",
        "pod_labels": {},
        "replicas_desired": 1,
        "disabled": false,
        "allocation_strategy": "static_strategy",
    });
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v.to_string().into_bytes()
}

on_both_backends!(every_malformed_input_is_reported_once_and_skipped_while_the_rest_is_served);
async fn every_malformed_input_is_reported_once_and_skipped_while_the_rest_is_served(
    backend: Backend,
) {
    // Embedded: values up to 1.25 MiB are accepted, so an RC with a 1 MiB manifest can be
    // stored; the transaction writing its pod carries the manifest base64-encoded (1.33 MiB),
    // over Consul 1.x's transaction limit (the larger of kv_max_value_size and
    // txn_max_req_len): the farm cannot write that pod and must say so. Real Consul 0.7 limits
    // each value to 512 KiB and a transaction only by its decoded values, so there such an RC
    // cannot be stored at all (checked below) and any RC that can be stored can be scheduled.
    let mut c = match &backend {
        Backend::Embedded(compat) => {
            Cluster::start_with(ServerConfig {
                kv_max_value_size: 1280 << 10,
                compat: *compat,
                ..Cluster::server_config()
            })
            .await
        }
        Backend::Real(_) => Cluster::start_on(&backend).await,
    };
    nodes(&c, 3, 1).await;
    let kv = |k: String, v: Vec<u8>| {
        let consul = c.consul.clone();
        async move { consul.kv_put(&k, &v, None).await.unwrap() }
    };

    // Node labels that are not a map of strings.
    kv("labels/node/array-node".into(), b"[1,2]".to_vec()).await;
    kv("labels/node/string-node".into(), b"\"env=prod\"".to_vec()).await;
    kv("labels/node/number-node".into(), br#"{"env": 5}"#.to_vec()).await;
    kv(
        "labels/node/truncated-node".into(),
        br#"{"env": "pr"#.to_vec(),
    )
    .await;
    // Pod labels with garbage.
    kv("labels/pod/node-00/junk".into(), b"}{".to_vec()).await;

    let good: Vec<RcId> = (0..3).map(|_| RcId::new()).collect();
    for (i, id) in good.iter().enumerate() {
        c.put_rc(*id, &format!("good-{i}"), "env=prod", 2, "static_strategy")
            .await;
    }
    // A good RC whose RC labels are garbage, and one whose lock key holds a value but no
    // session (someone PUT it by hand).
    kv(
        format!("labels/replication_controller/{}", good[0]),
        b"not json".to_vec(),
    )
    .await;
    kv(
        format!("lock/replication_controllers/{}", good[1]),
        b"by hand".to_vec(),
    )
    .await;

    // The bad RC records, by what is wrong with them.
    let mut bad: BTreeMap<&str, (String, &str)> = BTreeMap::new();
    let mut put_bad = |name: &'static str, key: String, value: Vec<u8>, says: &'static str| {
        bad.insert(name, (key.clone(), says));
        kv(key, value)
    };
    put_bad(
        "not-a-uuid key",
        "replication_controllers/not-a-uuid".into(),
        record("not-a-uuid", json!({})),
        "not a valid RC key",
    )
    .await;
    let (a, b) = (RcId::new(), RcId::new());
    put_bad(
        "wrong id",
        a.key(),
        record(&b.to_string(), json!({})),
        "but the key says",
    )
    .await;
    let t = RcId::new();
    let truncated = record(&t.to_string(), json!({}));
    put_bad(
        "truncated JSON",
        t.key(),
        truncated[..truncated.len() / 2].to_vec(),
        "not JSON",
    )
    .await;
    let s = RcId::new();
    put_bad(
        "selector syntax",
        s.key(),
        record(&s.to_string(), json!({"node_selector": "env in (prod"})),
        "node_selector",
    )
    .await;
    let l = RcId::new();
    put_bad(
        "pod labels not a map",
        l.key(),
        record(&l.to_string(), json!({"pod_labels": [1, 2]})),
        "pod_labels",
    )
    .await;
    let o = RcId::new();
    put_bad("not an object", o.key(), b"[]".to_vec(), "JSON object").await;
    let n = RcId::new();
    put_bad(
        "negative replicas",
        n.key(),
        record(&n.to_string(), json!({"replicas_desired": -3})),
        "0 or more",
    )
    .await;
    let m = RcId::new();
    put_bad(
        "manifest not YAML",
        m.key(),
        record(&m.to_string(), json!({"manifest": "id: [unclosed"})),
        "manifest",
    )
    .await;
    let big = RcId::new();
    let huge = format!(
        "id: big\nlaunchables: {{}}\nconfig:\n  blob: \"{}\"\n",
        "x".repeat(1 << 20)
    );
    let huge_record = record(&big.to_string(), json!({"manifest": huge}));
    if c.is_real() {
        let refused = c.consul.kv_put(&big.key(), &huge_record, None).await;
        assert!(
            refused
                .as_ref()
                .is_err_and(|e| e.to_string().contains("413")),
            "real Consul refuses a 1 MiB value: {refused:?}"
        );
    } else {
        put_bad("1 MiB manifest", big.key(), huge_record, "HTTP 413").await;
    }

    // Garbage under the lock prefix and in the audit outbox.
    kv(
        "lock/replication_controllers/not-a-uuid".into(),
        b"x".to_vec(),
    )
    .await;
    kv(
        format!("lock/replication_controllers/{}/junk", good[2]),
        b"x".to_vec(),
    )
    .await;
    let garbage_audit = uuid::Uuid::new_v4();
    kv(
        format!("audit_logs/{garbage_audit}"),
        b"{\"event_type\": 7".to_vec(),
    )
    .await;
    kv("audit_logs/not-a-uuid".into(), b"{}".to_vec()).await;

    c.spawn_farm("f1", &[]).await;
    c.spawn_farm("f2", &[]).await;

    // The good RCs are served.
    let (cr, gr) = (&c, &good);
    c.wait_for(
        Duration::from_secs(30),
        "good RCs served",
        move || async move {
            let p = cr.placements().await;
            gr.iter().all(|id| p.get(id).is_some_and(|n| n.len() == 2))
        },
    )
    .await;

    // Every bad RC is reported, each exactly once although two farms see them.
    let br = &bad;
    c.wait_for(
        Duration::from_secs(30),
        "every bad RC reported",
        move || async move {
            let reported = cr.audit_events(events::RC_INVALID).await;
            br.values()
                .all(|(key, _)| reported.iter().any(|d| d["key"] == key.as_str()))
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let reported = c.audit_events(events::RC_INVALID).await;
    for (what, (key, says)) in &bad {
        let mine: Vec<&Value> = reported
            .iter()
            .filter(|d| d["key"] == key.as_str())
            .collect();
        assert_eq!(mine.len(), 1, "{what} reported once: {mine:#?}");
        let problem = mine[0]["problem"].as_str().unwrap();
        assert!(
            problem.contains(says),
            "{what}: {problem:?} should say {says:?}"
        );
    }
    assert_eq!(
        reported.len(),
        bad.len(),
        "nothing else reported: {reported:#?}"
    );

    // Nothing was scheduled for them; the good ones are intact.
    let placements = c.placements().await;
    for id in [a, b, t, s, l, o, n, m, big] {
        assert!(!placements.contains_key(&id), "{id} has no pods");
    }
    let owners = c.owner_farms().await;
    for id in &good {
        assert!(owners.contains_key(id), "{id} is owned");
    }

    // Garbage audit records end up as dead letters, and the outbox drains.
    let cr = &c;
    c.wait_for(
        Duration::from_secs(30),
        "outbox drained",
        move || async move { cr.count_prefix("audit_logs/").await == 0 },
    )
    .await;
    let store = AuditStore::connect(&c.audit_db).await.unwrap();
    assert_eq!(
        crate::common::dead_letter_keys(&store).await,
        vec![
            format!("audit_logs/{garbage_audit}"),
            "audit_logs/not-a-uuid".to_string()
        ]
    );

    // The farms are alive, said what they skipped, and never panicked.
    for i in 0..2 {
        assert!(
            c.farms[i].child.try_wait().unwrap().is_none(),
            "farm {i} is running"
        );
        let log = c.farm_log(i);
        assert!(!log.contains("panicked"), "farm {i} panicked:\n{log}");
    }
    let logs = c.farm_log(0) + &c.farm_log(1);
    for needle in ["not an RC lock", "names no RC", "array-node"] {
        assert!(logs.contains(needle), "the farms logged {needle:?}");
    }
    c.check_invariants(|_| false);
}

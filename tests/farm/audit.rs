//! The audit log end to end: after farms are killed at random while RCs change, every
//! committed scheduling transaction has exactly one RETARGET record in SQL, and the Consul
//! outbox drains to empty.

use std::collections::BTreeSet;
use std::time::Duration;

use rand::Rng;
use rcfarm::audit::{AuditQuery, AuditRecord, AuditStore, events};
use rcfarm::consul::QueryOptions;
use rcfarm::rc::RcId;
use rcfarm::server::Change;
use serde_json::json;

use crate::harness::{Cluster, nodes, signal};

#[tokio::test]
async fn retarget_records_match_scheduling_commits_after_random_kills() {
    let mut c = Cluster::start().await;
    nodes(&c, 8, 2).await;
    for f in ["f1", "f2", "f3"] {
        c.spawn_farm(f, &[]).await;
    }
    let mut ids = Vec::new();
    for i in 0..12 {
        let id = RcId::new();
        c.put_rc(
            id,
            &format!("a{i}"),
            if i % 2 == 0 { "zone=z0" } else { "env=prod" },
            1 + (i % 3),
            "static_strategy",
        )
        .await;
        ids.push(id);
    }
    let mut rng = rand::rng();
    for round in 0..4 {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        for _ in 0..4 {
            let id = ids[rng.random_range(0..ids.len())];
            c.patch_rc(id, "replicas_desired", json!(rng.random_range(0..4)))
                .await;
        }
        // Kill a farm at random and start it again.
        let victim = rng.random_range(0..c.farms.len());
        if c.farms[victim].child.try_wait().unwrap().is_none() {
            signal(c.farms[victim].pid, "KILL");
        }
        let id = c.farms[victim].id.clone();
        c.spawn_farm(&format!("{id}-r{round}"), &[]).await;
    }
    // Let everything converge and the outbox drain.
    let cr = &c;
    c.wait_for(
        Duration::from_secs(60),
        "outbox drained after convergence",
        move || async move {
            let (keys, _) = cr
                .consul
                .kv_keys("audit_logs/", None, &QueryOptions::default())
                .await
                .unwrap();
            let owners = cr.owner_farms().await;
            keys.is_empty() && owners.len() == 12
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    c.wait_for(
        Duration::from_secs(30),
        "outbox empty again",
        move || async move {
            cr.consul
                .kv_keys("audit_logs/", None, &QueryOptions::default())
                .await
                .unwrap()
                .0
                .is_empty()
        },
    )
    .await;

    // Committed scheduling transactions: fenced commits that write intents and carry a
    // RETARGET record (repairs carry REPAIRED instead).
    let mut scheduling: BTreeSet<String> = BTreeSet::new();
    for commit in c.server.commit_log() {
        if commit.checks.is_empty() {
            continue;
        }
        let touches_intents = commit.changes.iter().any(
            |ch| matches!(ch, Change::Put(k, _) | Change::Delete(k) if k.starts_with("intent/")),
        );
        for ch in &commit.changes {
            if let Change::Put(k, e) = ch
                && k.starts_with("audit_logs/")
                && let Ok(r) = AuditRecord::from_kv(k, &e.value)
                && r.event_type == events::RC_RETARGET
            {
                assert!(
                    touches_intents,
                    "a RETARGET record without a scheduling change at {}",
                    commit.index
                );
                scheduling.insert(r.id.to_string());
            }
        }
    }
    let store = AuditStore::connect(&c.audit_db).await.unwrap();
    let in_sql = store
        .count(&AuditQuery {
            event_type: Some(events::RC_RETARGET.into()),
            ..Default::default()
        })
        .await
        .unwrap();
    println!(
        "FIGURE {} scheduling transactions committed, {in_sql} RETARGET records in SQL",
        scheduling.len()
    );
    assert_eq!(in_sql as usize, scheduling.len());
    assert!(in_sql >= 12);
    c.check_invariants(|_| false);
}

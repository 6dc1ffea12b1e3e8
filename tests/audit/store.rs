use std::collections::BTreeSet;
use std::time::Duration;

use chrono::{DateTime, Utc};
use rcfarm::audit::{AuditError, AuditQuery, AuditRecord, AuditStore, events};
use serde_json::json;

use crate::db::TestDb;

fn at(secs: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_700_000_000 + secs, 0).unwrap()
}

/// Record `i` of a fixed set: RCs r0..r4, farms f0/f1, pods p0..p2, nodes n0..n5.
fn record(i: i64) -> AuditRecord {
    let ev = [
        events::RC_RETARGET,
        events::RC_CLAIMED,
        events::NODE_TRANSFER_START,
    ][i.rem_euclid(3) as usize];
    let details = match ev {
        events::RC_RETARGET => {
            json!({"replication_controller_id": format!("r{}", i % 5), "pod_id": format!("p{}", i % 3), "farm_id": format!("f{}", i % 2), "nodes": [format!("n{}", i % 6), format!("n{}", (i + 1) % 6)]})
        }
        events::NODE_TRANSFER_START => {
            json!({"replication_controller_id": format!("r{}", i % 5), "pod_id": format!("p{}", i % 3), "farm_id": format!("f{}", i % 2), "old_node": format!("n{}", i % 6), "new_node": "n9"})
        }
        _ => {
            json!({"replication_controller_id": format!("r{}", i % 5), "farm_id": format!("f{}", i % 2)})
        }
    };
    let mut r = AuditRecord::new(ev, details);
    r.timestamp = at(i);
    r
}

async fn check_filters_and_paging(url: &str) {
    let store = AuditStore::connect(url).await.unwrap();
    let records: Vec<AuditRecord> = (0..60).map(record).collect();
    assert_eq!(store.insert(&records, "f0").await.unwrap(), 60);
    assert_eq!(
        store.insert(&records, "f1").await.unwrap(),
        0,
        "the same records twice are stored once"
    );
    let all = AuditQuery::default();
    assert_eq!(store.count(&all).await.unwrap(), 60);

    let count = |q: AuditQuery| {
        let store = store.clone();
        async move { store.count(&q).await.unwrap() }
    };
    let expect = |f: &dyn Fn(&AuditRecord) -> bool| records.iter().filter(|r| f(r)).count() as u64;
    assert_eq!(
        count(AuditQuery {
            rc_id: Some("r1".into()),
            ..Default::default()
        })
        .await,
        expect(&|r| r.event_details["replication_controller_id"] == "r1")
    );
    assert_eq!(
        count(AuditQuery {
            event_type: Some(events::RC_RETARGET.into()),
            ..Default::default()
        })
        .await,
        20
    );
    assert_eq!(
        count(AuditQuery {
            pod_id: Some("p2".into()),
            ..Default::default()
        })
        .await,
        expect(&|r| r.event_details["pod_id"] == "p2")
    );
    assert_eq!(
        count(AuditQuery {
            farm_id: Some("f1".into()),
            ..Default::default()
        })
        .await,
        30
    );
    let n3 = expect(&|r| {
        r.event_details["nodes"]
            .as_array()
            .is_some_and(|a| a.iter().any(|n| n == "n3"))
            || r.event_details["old_node"] == "n3"
    });
    assert_eq!(
        count(AuditQuery {
            node: Some("n3".into()),
            ..Default::default()
        })
        .await,
        n3
    );
    assert_eq!(
        count(AuditQuery {
            node: Some("n9".into()),
            ..Default::default()
        })
        .await,
        20,
        "new_node is indexed too"
    );
    assert_eq!(
        count(AuditQuery {
            since: Some(at(10)),
            until: Some(at(20)),
            ..Default::default()
        })
        .await,
        10
    );
    assert_eq!(
        count(AuditQuery {
            rc_id: Some("r0".into()),
            event_type: Some(events::RC_RETARGET.into()),
            since: Some(at(30)),
            ..Default::default()
        })
        .await,
        expect(&|r| r.event_type == events::RC_RETARGET
            && r.event_details["replication_controller_id"] == "r0"
            && r.timestamp >= at(30))
    );

    // Paging: newest first, every record exactly once.
    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let page = store
            .query(&AuditQuery {
                limit: Some(7),
                cursor: cursor.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        seen.extend(page.records.iter().map(|r| (r.timestamp, r.id.clone())));
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(seen.len(), 60);
    assert!(seen.windows(2).all(|w| w[0].0 >= w[1].0), "newest first");
    assert_eq!(
        seen.iter()
            .map(|s| s.1.clone())
            .collect::<BTreeSet<_>>()
            .len(),
        60
    );
    let first = store
        .query(&AuditQuery {
            limit: Some(1),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(first.records[0].timestamp, at(59));
    assert_eq!(first.records[0].shipped_by.as_deref(), Some("f0"));
    assert!(matches!(
        store
            .query(&AuditQuery {
                limit: Some(0),
                ..Default::default()
            })
            .await,
        Err(AuditError::BadQuery(_))
    ));
    assert!(matches!(
        store
            .query(&AuditQuery {
                cursor: Some("garbage".into()),
                ..Default::default()
            })
            .await,
        Err(AuditError::BadQuery(_))
    ));

    // Retention.
    assert_eq!(store.prune(at(30)).await.unwrap(), 30);
    assert_eq!(store.count(&all).await.unwrap(), 30);
    assert_eq!(
        count(AuditQuery {
            node: Some("n9".into()),
            ..Default::default()
        })
        .await,
        10,
        "node rows pruned with their events"
    );
}

async fn check_paging_under_concurrent_inserts(url: &str) {
    let store = AuditStore::connect(url).await.unwrap();
    let base: Vec<AuditRecord> = (0..200).map(|i| record(i * 10)).collect();
    store.insert(&base, "f0").await.unwrap();
    let writer = {
        let store = store.clone();
        tokio::spawn(async move {
            for round in 0..20 {
                // Newer and older records, and some at exactly the same instants.
                let batch: Vec<AuditRecord> = (0..10)
                    .map(|j| record(round * 100 + j * 10 + [5, -3000, 0][(j % 3) as usize]))
                    .collect();
                store.insert(&batch, "f1").await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    let mut seen: Vec<(DateTime<Utc>, String)> = Vec::new();
    let mut cursor = None;
    loop {
        let page = store
            .query(&AuditQuery {
                limit: Some(13),
                cursor: cursor.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        seen.extend(page.records.iter().map(|r| (r.timestamp, r.id.clone())));
        tokio::time::sleep(Duration::from_millis(3)).await;
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    writer.await.unwrap();
    let ids: BTreeSet<&String> = seen.iter().map(|s| &s.1).collect();
    assert_eq!(ids.len(), seen.len(), "no record shown twice");
    for r in &base {
        assert!(
            ids.contains(&r.id.to_string()),
            "a record present before paging began was skipped"
        );
    }
    assert!(
        seen.windows(2).all(|w| w[0].0 >= w[1].0),
        "order kept across pages"
    );
}

async fn check_refuses_newer_schema(url: &str, engine_sql: &str) {
    let store = AuditStore::connect(url).await.unwrap();
    assert_eq!(store.schema_version().await.unwrap(), 1);
    sqlx::any::install_default_drivers();
    let (_, normalized) = rcfarm::audit::store::parse_url(url).unwrap();
    let pool = sqlx::AnyPool::connect(&normalized).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(engine_sql))
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
    store.close().await;
    let err = AuditStore::connect(url).await.unwrap_err();
    assert!(
        matches!(
            err,
            AuditError::SchemaTooNew {
                found: 99999,
                known: 1,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("upgrade rcfarm"), "{err}");
}

const SQLITE_FUTURE: &str = "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) VALUES (99999, 'from the future', TRUE, X'00', 0)";
const PG_FUTURE: &str = "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) VALUES (99999, 'from the future', TRUE, '\\x00'::bytea, 0)";

#[tokio::test]
async fn sqlite_filters_and_paging() {
    let db = TestDb::sqlite();
    check_filters_and_paging(&db.url).await;
}

#[tokio::test]
async fn postgres_filters_and_paging() {
    let Some(db) = TestDb::postgres("postgres_filters_and_paging").await else {
        return;
    };
    check_filters_and_paging(&db.url).await;
}

#[tokio::test]
async fn sqlite_paging_is_stable_under_concurrent_inserts() {
    let db = TestDb::sqlite();
    check_paging_under_concurrent_inserts(&db.url).await;
}

#[tokio::test]
async fn postgres_paging_is_stable_under_concurrent_inserts() {
    let Some(db) = TestDb::postgres("postgres_paging_is_stable_under_concurrent_inserts").await
    else {
        return;
    };
    check_paging_under_concurrent_inserts(&db.url).await;
}

#[tokio::test]
async fn sqlite_refuses_a_newer_schema() {
    let db = TestDb::sqlite();
    check_refuses_newer_schema(&db.url, SQLITE_FUTURE).await;
}

#[tokio::test]
async fn postgres_refuses_a_newer_schema() {
    let Some(db) = TestDb::postgres("postgres_refuses_a_newer_schema").await else {
        return;
    };
    check_refuses_newer_schema(&db.url, PG_FUTURE).await;
}

#[tokio::test]
async fn sqlite_uses_wal_and_creates_its_directory() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("deep/er/audit.db");
    let url = format!("sqlite://{}", path.display());
    let store = AuditStore::connect(&url).await.unwrap();
    store.insert(&[record(1)], "f").await.unwrap();
    assert!(path.exists());
    assert!(
        dir.path().join("deep/er/audit.db-wal").exists()
            || dir.path().join("deep/er/audit.db-shm").exists(),
        "WAL mode"
    );
}

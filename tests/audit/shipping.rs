use std::collections::BTreeSet;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rcfarm::audit::{
    AuditPace, AuditQuery, AuditRecord, AuditStore, BACKLOG_KEY, Backlog, PaceConfig, SHIPPER_LOCK,
    Shipper, ShipperConfig, events,
};
use rcfarm::consul::{Consul, QueryOptions, SessionRequest, TxnOp};
use rcfarm::server::{EmbeddedServer, ServerConfig};
use serde_json::json;
use tokio::io::AsyncBufReadExt;
use tokio_util::sync::CancellationToken;

use crate::common::{client, eventually, server_with};
use crate::db::TestDb;

const BIN: &str = env!("CARGO_BIN_EXE_rcfarm");

fn test_server_config() -> ServerConfig {
    ServerConfig {
        session_ttl_min: Duration::from_secs(1),
        ..ServerConfig::ephemeral()
    }
}

async fn test_server() -> EmbeddedServer {
    server_with(test_server_config()).await
}

/// Writes `n` records into the outbox, as farms do (64 per transaction).
async fn write_outbox(c: &Consul, n: usize, rcs: usize) -> Vec<AuditRecord> {
    let records: Vec<AuditRecord> = (0..n)
        .map(|i| {
            AuditRecord::new(
                events::RC_RETARGET,
                json!({"replication_controller_id": format!("rc-{}", i % rcs), "pod_id": "web", "farm_id": "f", "nodes": [format!("n{}", i % 7)]}),
            )
        })
        .collect();
    for chunk in records.chunks(64) {
        let ops: Vec<TxnOp> = chunk.iter().map(AuditRecord::txn_op).collect();
        c.txn(&ops).await.unwrap();
    }
    records
}

async fn outbox_len(c: &Consul) -> usize {
    c.kv_keys("audit_logs/", None, &QueryOptions::default())
        .await
        .unwrap()
        .0
        .len()
}

fn shipper(c: &Consul, store: &Arc<AuditStore>, session: &str, farm: &str) -> Shipper {
    Shipper {
        consul: c.clone(),
        store: store.clone(),
        session: session.into(),
        farm_id: farm.to_string(),
        clock: rcfarm::clock::Clock::system(),
        config: ShipperConfig {
            batch: 500,
            wait: Duration::from_secs(5),
            ..ShipperConfig::default()
        },
        stats: Arc::default(),
        pace: Arc::default(),
    }
}

async fn ship_many(url: &str, n: usize) {
    let s = test_server().await;
    let c = client(&s);
    let started = Instant::now();
    write_outbox(&c, n, 100).await;
    let wrote = started.elapsed();
    let store = Arc::new(AuditStore::connect(url).await.unwrap());
    let session = c.session_create(&SessionRequest::default()).await.unwrap();
    let stop = CancellationToken::new();
    let task = tokio::spawn(shipper(&c, &store, &session, "f1").run(stop.clone()));
    let started = Instant::now();
    // Watch the SQL side: listing 100,000 outbox keys over and over would slow the shipper.
    let sr = &store;
    eventually(
        Duration::from_secs(300),
        "every record in SQL",
        || async move {
            let n_sql = sr.count(&AuditQuery::default()).await.unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
            (n_sql == n as u64).then_some(())
        },
    )
    .await;
    let shipped = started.elapsed();
    let cr = &c;
    eventually(
        Duration::from_secs(60),
        "the outbox drained",
        || async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            (outbox_len(cr).await == 0).then_some(())
        },
    )
    .await;
    println!(
        "FIGURE shipped {n} records to SQL in {:.2} s, outbox empty after {:.2} s (outbox written in {:.2} s)",
        shipped.as_secs_f64(),
        started.elapsed().as_secs_f64(),
        wrote.as_secs_f64()
    );
    assert_eq!(store.count(&AuditQuery::default()).await.unwrap(), n as u64);
    let by_rc = store
        .count(&AuditQuery {
            rc_id: Some("rc-7".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(by_rc, (n / 100) as u64);
    let page = store
        .query(&AuditQuery {
            rc_id: Some("rc-7".into()),
            limit: Some(10),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(page.records.len(), 10);
    assert!(
        page.records
            .iter()
            .all(|r| r.rc_id.as_deref() == Some("rc-7"))
    );
    let by_node = store
        .count(&AuditQuery {
            node: Some("n3".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(by_node, (0..n).filter(|i| i % 7 == 3).count() as u64);
    stop.cancel();
    task.await.unwrap();
}

#[tokio::test]
async fn sqlite_ships_and_queries_100k_records() {
    let db = TestDb::sqlite();
    ship_many(&db.url, 100_000).await;
}

#[tokio::test]
async fn postgres_ships_and_queries_100k_records() {
    let Some(db) = TestDb::postgres("postgres_ships_and_queries_100k_records").await else {
        return;
    };
    ship_many(&db.url, 100_000).await;
}

#[tokio::test]
async fn two_shippers_racing_only_one_ships_and_the_other_takes_over() {
    let db = TestDb::sqlite();
    let s = test_server().await;
    let c = client(&s);
    let store = Arc::new(AuditStore::connect(&db.url).await.unwrap());
    let a = c
        .session_create(&SessionRequest {
            lock_delay: Some(Duration::ZERO),
            ..Default::default()
        })
        .await
        .unwrap();
    let b = c
        .session_create(&SessionRequest {
            lock_delay: Some(Duration::ZERO),
            ..Default::default()
        })
        .await
        .unwrap();
    let (stop_a, stop_b) = (CancellationToken::new(), CancellationToken::new());
    let ta = tokio::spawn(shipper(&c, &store, &a, "farm-a").run(stop_a.clone()));
    let tb = tokio::spawn(shipper(&c, &store, &b, "farm-b").run(stop_b.clone()));
    let mut written = 0;
    for _ in 0..10 {
        written += write_outbox(&c, 50, 5).await.len();
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let cr = &c;
    eventually(Duration::from_secs(30), "drained", || async move {
        (outbox_len(cr).await == 0).then_some(())
    })
    .await;
    let holder = c
        .kv_get(SHIPPER_LOCK, &QueryOptions::default())
        .await
        .unwrap()
        .0
        .unwrap();
    let holder_farm = holder.value_str().unwrap().to_string();
    let page = store
        .query(&AuditQuery {
            limit: Some(1000),
            ..Default::default()
        })
        .await
        .unwrap();
    let shippers: BTreeSet<String> = page
        .records
        .iter()
        .filter_map(|r| r.shipped_by.clone())
        .collect();
    assert_eq!(
        shippers,
        BTreeSet::from([holder_farm.clone()]),
        "only the lock holder shipped"
    );
    assert_eq!(
        store.count(&AuditQuery::default()).await.unwrap(),
        written as u64
    );

    // The holder's session dies: the other takes over and ships what comes next.
    let (dead, dead_stop, other) = if holder_farm == "farm-a" {
        (&a, &stop_a, "farm-b")
    } else {
        (&b, &stop_b, "farm-a")
    };
    dead_stop.cancel();
    c.session_destroy(dead).await.unwrap();
    written += write_outbox(&c, 100, 5).await.len();
    eventually(
        Duration::from_secs(30),
        "the other shipper took over",
        || async move { (outbox_len(cr).await == 0).then_some(()) },
    )
    .await;
    let page = store
        .query(&AuditQuery {
            limit: Some(100),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(
        page.records
            .iter()
            .all(|r| r.shipped_by.as_deref() == Some(other))
    );
    assert_eq!(
        store.count(&AuditQuery::default()).await.unwrap(),
        written as u64,
        "nothing lost, nothing twice"
    );
    stop_a.cancel();
    stop_b.cancel();
    let _ = (ta.await, tb.await);
}

/// The shipper reads the outbox by prefix, in groups cut from its listing: with groups of 2,
/// keys that extend another key (down to a key `audit_logs/` itself) are read one by one and
/// those that extend them split further, and every record, good or garbage, is shipped once
/// and deleted. On the embedded server and on real Consul 0.7.
async fn an_outbox_of_odd_keys_is_read_by_prefix_and_drained(c: Consul) {
    let db = TestDb::sqlite();
    let good = write_outbox(&c, 40, 3).await;
    let odd = [
        "audit_logs/",
        "audit_logs/x",
        "audit_logs/xa",
        "audit_logs/xb",
        "audit_logs/xbc",
    ];
    for k in odd {
        c.kv_put(k, b"{}", None).await.unwrap();
    }
    let store = Arc::new(AuditStore::connect(&db.url).await.unwrap());
    let session = c.session_create(&SessionRequest::default()).await.unwrap();
    let stop = CancellationToken::new();
    let mut sh = shipper(&c, &store, &session, "f");
    sh.config.group = 2;
    sh.config.batch = 7;
    let t = tokio::spawn(sh.run(stop.clone()));
    let cr = &c;
    eventually(Duration::from_secs(30), "drained", || async move {
        (outbox_len(cr).await == 0).then_some(())
    })
    .await;
    stop.cancel();
    t.await.unwrap();
    let ids: BTreeSet<String> = store
        .query(&AuditQuery {
            limit: Some(1_000),
            ..Default::default()
        })
        .await
        .unwrap()
        .records
        .into_iter()
        .map(|r| r.id)
        .collect();
    let want: BTreeSet<String> = good.iter().map(|r| r.id.to_string()).collect();
    assert_eq!(ids, want, "every good record");
    assert_eq!(
        store.count(&AuditQuery::default()).await.unwrap(),
        good.len() as u64,
        "each once"
    );
    assert_eq!(
        crate::common::dead_letter_keys(&store).await,
        odd.map(String::from),
        "every odd key once"
    );
}

#[tokio::test]
async fn an_outbox_of_odd_keys_is_read_by_prefix_and_drained_embedded() {
    let s = test_server().await;
    an_outbox_of_odd_keys_is_read_by_prefix_and_drained(client(&s)).await;
}

#[tokio::test]
async fn an_outbox_of_odd_keys_is_read_by_prefix_and_drained_on_real_consul() {
    let Some(bin) = crate::common::real_consul_bin() else {
        return;
    };
    let agent = rcfarm_testkit::chaos::agent::ConsulAgent::start(
        rcfarm_testkit::chaos::agent::AgentConfig::dev(&bin, "odd-keys"),
    )
    .await
    .unwrap();
    agent
        .wait_ready(true, Duration::from_secs(30))
        .await
        .unwrap();
    an_outbox_of_odd_keys_is_read_by_prefix_and_drained(
        Consul::new(agent.client_config()).unwrap(),
    )
    .await;
}

#[tokio::test]
async fn garbage_in_the_outbox_is_kept_as_dead_letters_and_drained() {
    let db = TestDb::sqlite();
    let s = test_server().await;
    let c = client(&s);
    let good = write_outbox(&c, 10, 2).await;
    c.kv_put("audit_logs/not-a-uuid", b"{}", None)
        .await
        .unwrap();
    c.kv_put(
        &format!("audit_logs/{}", uuid::Uuid::new_v4()),
        b"\x00\x01garbage",
        None,
    )
    .await
    .unwrap();
    let store = Arc::new(AuditStore::connect(&db.url).await.unwrap());
    let session = c.session_create(&SessionRequest::default()).await.unwrap();
    let stop = CancellationToken::new();
    let t = tokio::spawn(shipper(&c, &store, &session, "f").run(stop.clone()));
    let cr = &c;
    eventually(Duration::from_secs(30), "drained", || async move {
        (outbox_len(cr).await == 0).then_some(())
    })
    .await;
    assert_eq!(
        store.count(&AuditQuery::default()).await.unwrap(),
        good.len() as u64
    );
    let dead = store.dead_letters().await.unwrap();
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert!(dead.iter().any(|(k, _)| k == "audit_logs/not-a-uuid"));
    stop.cancel();
    t.await.unwrap();
}

/// An outbox past `--audit-outbox-slow` that the shipper drains (SQL is up and keeps up) is
/// published as draining, and paces no farm; the first count, before anything shipped, does.
#[tokio::test]
async fn an_outbox_past_the_mark_that_drains_is_published_as_draining_and_not_paced() {
    let db = TestDb::sqlite();
    let s = test_server().await;
    let c = client(&s);
    write_outbox(&c, 5_000, 10).await;
    let store = Arc::new(AuditStore::connect(&db.url).await.unwrap());
    let session = c.session_create(&SessionRequest::default()).await.unwrap();
    let pace = Arc::new(AuditPace::new(PaceConfig {
        slow_at: 1_500,
        per_second: 1.0,
    }));
    let mut sh = shipper(&c, &store, &session, "f");
    // Ship 1,000 (or a quarter of the outbox) between listings, so that some listings find it
    // past the mark and smaller than the one before.
    sh.config.pass = 1_000;
    sh.config.batch = 250;
    sh.pace = pace.clone();
    let stop = CancellationToken::new();
    let t = tokio::spawn(sh.run(stop.clone()));
    let mut index = 0;
    let mut seen: Vec<Backlog> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen.last().is_none_or(|b| b.records > 0) {
        assert!(
            Instant::now() < deadline,
            "the outbox did not drain: {seen:?}"
        );
        let (e, meta) = c
            .kv_get(
                BACKLOG_KEY,
                &QueryOptions::blocking(index, Duration::from_secs(5)),
            )
            .await
            .unwrap();
        index = meta.index;
        if let Some(e) = e {
            let b: Backlog = serde_json::from_slice(e.value_bytes()).unwrap();
            if !b.draining && b.records >= 1_500 && seen.iter().any(|s| s.draining) {
                panic!("past the mark and not draining after it drained: {seen:?} then {b:?}");
            }
            if b.draining && b.records >= 1_500 {
                // Told to the shipper's own farm before it is published.
                assert!(!pace.slowed(), "draining but paced: {b:?}");
            }
            seen.push(b);
        }
    }
    let first = &seen[0];
    assert_eq!(
        (first.records, first.draining),
        (5_000, false),
        "the first count, before anything shipped: {seen:?}"
    );
    assert!(
        seen.iter().any(|b| b.draining && b.records >= 1_500),
        "a count past the mark while draining: {seen:?}"
    );
    assert_eq!(store.count(&AuditQuery::default()).await.unwrap(), 5_000);
    stop.cancel();
    t.await.unwrap();
}

/// A farm process that crashes between storing a batch in SQL and deleting it from Consul
/// leaves the batch in both; the next shipper stores nothing twice and drains the outbox.
#[tokio::test]
async fn a_shipper_crash_between_insert_and_delete_duplicates_nothing() {
    let db = TestDb::sqlite();
    let s = test_server().await;
    let c = client(&s);
    let records = write_outbox(&c, 300, 10).await;
    let (mut crasher, crash_log) = spawn_farm(&s.url(), "crasher", &db.url, true);
    let status = tokio::time::timeout(Duration::from_secs(60), crasher.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(!status.success(), "the failpoint aborts the process");
    let cl = &crash_log;
    eventually(
        Duration::from_secs(10),
        "the failpoint's last words",
        || async move {
            cl.lock()
                .contains("aborting between the SQL insert and the Consul delete")
                .then_some(())
        },
    )
    .await;
    let store = AuditStore::connect(&db.url).await.unwrap();
    assert_eq!(
        store.count(&AuditQuery::default()).await.unwrap(),
        300,
        "the batch reached SQL"
    );
    assert_eq!(
        outbox_len(&c).await,
        300,
        "and nothing was deleted from Consul"
    );

    let (mut survivor, log) = spawn_farm(&s.url(), "survivor", &db.url, false);
    assert_drains(&c, &log).await;
    assert_eq!(
        store.count(&AuditQuery::default()).await.unwrap(),
        records.len() as u64,
        "no duplicates"
    );
    let page = store
        .query(&AuditQuery {
            limit: Some(1000),
            ..Default::default()
        })
        .await
        .unwrap();
    let ids: BTreeSet<&String> = page.records.iter().map(|r| &r.id).collect();
    assert_eq!(ids.len(), 300);
    assert!(
        page.records
            .iter()
            .all(|r| r.shipped_by.as_deref() == Some("crasher")),
        "stored once, by the first shipper"
    );
    let _ = survivor.start_kill();
}

/// Starts a farm process that ships to `db`; its log is collected (a full pipe would stall it)
/// so that a failing wait can show it. With `crash`, it aborts after its first SQL insert.
fn spawn_farm(
    consul: &str,
    id: &str,
    db: &str,
    crash: bool,
) -> (tokio::process::Child, Arc<parking_lot::Mutex<String>>) {
    let mut cmd = tokio::process::Command::new(BIN);
    cmd.args(["serve", "--consul", consul, "--farm-id", id])
        .args(["--session-ttl", "2s", "--lock-delay", "0s"])
        .args(["--audit-db", db, "--http", "off"])
        .args(["--max-removals", "100000", "--failsafe-confirm", "0s"])
        .env("RUST_LOG", "info,rcfarm::audit::shipper=debug")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    if crash {
        cmd.env(rcfarm::audit::shipper::FAILPOINT_ENV, "1");
    }
    let mut child = cmd.spawn().unwrap();
    let log = Arc::new(parking_lot::Mutex::new(String::new()));
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let sink = log.clone();
    tokio::spawn(async move {
        while let Ok(Some(l)) = lines.next_line().await {
            sink.lock().push_str(&(l + "\n"));
        }
    });
    (child, log)
}

/// Waits up to 60 s for the outbox to be empty; fails with the shipping farm's log if not.
async fn assert_drains(c: &Consul, log: &parking_lot::Mutex<String>) {
    let drained = tokio::time::timeout(Duration::from_secs(60), async {
        while outbox_len(c).await != 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(
        drained.is_ok(),
        "the outbox was not drained in 60 s ({} left); the shipping farm's log:\n{}",
        outbox_len(c).await,
        log.lock()
    );
}

/// A farm ready to write SQL before it has a Consul session (Consul still starting) ships
/// once it gets one. (Its database handle was once dropped when nothing listened for it yet,
/// and such a farm never shipped; under load, that was a race any farm could lose.)
#[tokio::test]
async fn a_farm_whose_database_is_ready_before_its_session_still_ships() {
    let db = TestDb::sqlite();
    // A free port with nothing listening on it yet.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (mut farm, log) = spawn_farm(&format!("http://{addr}"), "early", &db.url, false);
    let l = &log;
    let seen = tokio::time::timeout(Duration::from_secs(30), async move {
        loop {
            let text = l.lock().clone();
            if text.contains("audit database ready")
                && (text.contains("cannot create a Consul session")
                    || text.contains("cannot check the farm's access to Consul"))
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(
        seen.is_ok(),
        "the farm waits for Consul with its database ready; its log:\n{}",
        log.lock()
    );
    let s = server_with(ServerConfig {
        listen: addr,
        ..test_server_config()
    })
    .await;
    let c = client(&s);
    let records = write_outbox(&c, 50, 5).await;
    assert_drains(&c, &log).await;
    let store = AuditStore::connect(&db.url).await.unwrap();
    assert_eq!(
        store.count(&AuditQuery::default()).await.unwrap(),
        records.len() as u64
    );
    let _ = farm.start_kill();
}

//! A sick audit database: PostgreSQL stopped for a minute (behind a slow link all along),
//! SQLite on a full file system, and an outbox past `--audit-outbox-slow` pacing the farms'
//! writes. Farms go on serving RCs throughout; records wait in Consul's outbox and drain when
//! the database is back: every record the farms committed is in SQL, once.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rcfarm::audit::{AuditQuery, AuditRecord, AuditStore};
use rcfarm::consul::{Consul, QueryOptions};
use rcfarm::rc::RcId;
use rcfarm::server::Change;
use rcfarm_testkit::chaos::proxy::{FaultyProxy, ProxyFaults};
use rcfarm_testkit::fullfs::SmallFs;
use rcfarm_testkit::postgres::PrivatePostgres;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::harness::{Backend, Cluster, nodes};

pub(crate) async fn outbox(c: &Consul) -> Vec<String> {
    c.kv_keys("audit_logs/", None, &QueryOptions::default())
        .await
        .map(|(k, _)| k)
        .unwrap_or_default()
}

/// A PostgreSQL of the test's own, or `None` after saying loudly why the test is skipped.
pub(crate) fn private_postgres() -> Option<PrivatePostgres> {
    match PrivatePostgres::start() {
        Ok(pg) => Some(pg),
        Err(e) => {
            eprintln!("SKIPPED: no PostgreSQL of the test's own to stop and start: {e}");
            None
        }
    }
}

/// Waits until farms f1 and f2 both pace (`paced`) or both do not.
async fn farms_paced(c: &Cluster, paced: bool, within: Duration, what: &str) -> Duration {
    let want = format!("rcfarm_audit_paced {}", u8::from(paced));
    let want = want.as_str();
    c.wait_for(within, what, move || async move {
        let mut all = true;
        for f in ["f1", "f2"] {
            all &= c.metrics(f).await.contains(want);
        }
        all
    })
    .await
}

/// Drains the outbox, stops the outbox watch, and checks SQL (see [`assert_all_in_sql_once`]):
/// how long the drain took and the rows in SQL.
async fn drain_and_check(
    c: &Cluster,
    within: Duration,
    what: &str,
    stop: &CancellationToken,
    seen: &Mutex<BTreeSet<String>>,
) -> (Duration, u64) {
    let took = drained(c, within, what).await;
    stop.cancel();
    let committed = committed_records(c);
    let seen = seen.lock().clone();
    (took, assert_all_in_sql_once(c, &seen, committed).await)
}

/// Every record id that shows in the outbox, read every 200 ms until `stop` (records that come
/// and go between two reads are not seen: on the embedded server the commit log has them all).
fn watch_outbox(c: &Consul, stop: &CancellationToken) -> Arc<Mutex<BTreeSet<String>>> {
    let seen = Arc::new(Mutex::new(BTreeSet::new()));
    let (c, stop, s) = (c.clone(), stop.clone(), seen.clone());
    tokio::spawn(async move {
        while !stop.is_cancelled() {
            let keys = outbox(&c).await;
            s.lock().extend(
                keys.iter()
                    .map(|k| k.trim_start_matches("audit_logs/").to_string()),
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    seen
}

/// Every id in SQL, and how many rows (the same when nothing is stored twice).
pub(crate) async fn sql_ids(url: &str) -> (BTreeSet<String>, u64) {
    let store = AuditStore::connect(url).await.unwrap();
    let rows = store.count(&AuditQuery::default()).await.unwrap();
    let mut ids = BTreeSet::new();
    let mut q = AuditQuery {
        limit: Some(1000),
        ..Default::default()
    };
    loop {
        let page = store.query(&q).await.unwrap();
        ids.extend(page.records.into_iter().map(|r| r.id));
        match page.next_cursor {
            Some(cur) => q.cursor = Some(cur),
            None => break,
        }
    }
    store.close().await;
    (ids, rows)
}

/// Records committed so far, from the embedded server's commit log (none on real Consul).
fn committed_records(c: &Cluster) -> Option<BTreeSet<String>> {
    if c.is_real() {
        return None;
    }
    let mut ids = BTreeSet::new();
    for commit in c.server.commit_log() {
        for ch in &commit.changes {
            if let Change::Put(k, e) = ch
                && let Ok(r) = AuditRecord::from_kv(k, &e.value)
            {
                ids.insert(r.id.to_string());
            }
        }
    }
    Some(ids)
}

/// Sets every RC of `ids` to `replicas` and waits until the farms placed them.
pub(crate) async fn scale_all(c: &Cluster, ids: &[RcId], replicas: usize, what: &str) {
    for id in ids {
        c.patch_rc(*id, "replicas_desired", json!(replicas)).await;
    }
    let idr = ids;
    c.wait_for(Duration::from_secs(40), what, move || async move {
        let placed = c.placements().await;
        idr.iter()
            .all(|id| placed.get(id).map_or(0, |p| p.len()) == replicas)
    })
    .await;
}

/// The outbox empties (the farms may still write a record now and then: empty once is enough).
pub(crate) async fn drained(c: &Cluster, within: Duration, what: &str) -> Duration {
    let consul = c.consul.clone();
    c.wait_for(within, what, move || {
        let consul = consul.clone();
        async move { outbox(&consul).await.is_empty() }
    })
    .await
}

/// What is in SQL after a drain: everything seen in the outbox and everything committed before
/// the drain, each once.
async fn assert_all_in_sql_once(
    c: &Cluster,
    seen: &BTreeSet<String>,
    committed: Option<BTreeSet<String>>,
) -> u64 {
    let (ids, rows) = sql_ids(&c.audit_db).await;
    assert_eq!(rows as usize, ids.len(), "a record stored twice");
    let missing: Vec<&String> = seen.difference(&ids).collect();
    assert!(
        missing.is_empty(),
        "{} records seen in the outbox are not in SQL, e.g. {:?}",
        missing.len(),
        missing.iter().take(3).collect::<Vec<_>>()
    );
    if let Some(committed) = committed {
        let missing: Vec<&String> = committed.difference(&ids).collect();
        assert!(
            missing.is_empty(),
            "{} committed records are not in SQL, e.g. {:?}",
            missing.len(),
            missing.iter().take(3).collect::<Vec<_>>()
        );
    }
    rows
}

/// Long enough for the shipper's retries to reach their 30-s cap (the delays, from 200 ms
/// doubling with jitter, add up to 26–51 s before it), so that PostgreSQL comes back while the
/// shipper may wait its longest; a longer outage only repeats that wait.
const OUTAGE: Duration = Duration::from_secs(60);

/// PostgreSQL, behind a link that delays every chunk up to 300 ms, is stopped for a minute
/// while the RCs change every few seconds: the farms keep placing pods, the outbox grows in
/// Consul, and after PostgreSQL is back it drains with every record in SQL once.
async fn postgres_stopped_for_a_minute(backend: Backend) {
    let Some(pg) = private_postgres() else {
        return;
    };
    let slow = FaultyProxy::start(
        pg.addr(),
        ProxyFaults {
            max_delay: Duration::from_millis(300),
            drop_per_mille: 0,
        },
    )
    .await
    .unwrap();
    let mut c = Cluster::start_on(&backend).await;
    c.audit_db = format!("postgres://postgres@{}/postgres", slow.addr());
    nodes(&c, 6, 2).await;
    let ids = c.farms_sharing(2, 4, 2).await;
    drained(
        &c,
        Duration::from_secs(60),
        "the first records shipped over the slow link",
    )
    .await;
    let stop = CancellationToken::new();
    let seen = watch_outbox(&c.consul, &stop);

    pg.stop().unwrap();
    let outage = Instant::now();
    let mut round = 0;
    let mut sizes = Vec::new();
    while outage.elapsed() < OUTAGE {
        round += 1;
        let replicas = 1 + round % 3;
        scale_all(
            &c,
            &ids,
            replicas,
            &format!("placed at {replicas} with PostgreSQL stopped"),
        )
        .await;
        sizes.push(outbox(&c.consul).await.len());
        tokio::time::sleep(Duration::from_secs(4)).await;
    }
    let waiting = outbox(&c.consul).await.len();
    println!(
        "FIGURE {round} rounds of changes placed with PostgreSQL stopped for {:.0} s; outbox sizes {sizes:?}",
        outage.elapsed().as_secs_f64()
    );
    assert!(
        waiting >= 4 * round / 2,
        "the outbox holds the outage's records ({waiting} after {round} rounds)"
    );

    pg.resume().unwrap();
    let (took, rows) = drain_and_check(
        &c,
        Duration::from_secs(120),
        "the outbox drained after PostgreSQL came back",
        &stop,
        &seen,
    )
    .await;
    println!(
        "FIGURE {waiting} records waited in Consul; drained {:.1} s after PostgreSQL came back; {rows} records in SQL, each once",
        took.as_secs_f64()
    );
    c.check_invariants(|_| false);
}
crate::on_both_backends!(postgres_stopped_for_a_minute);

/// Past `--audit-outbox-slow`, each farm commits at most `--audit-outbox-pace` RC writes a
/// second: the outbox grows at farms × pace, not with the churn (which writes several records
/// a second for each RC here). Once SQL is back the outbox drains, the pace lifts, and every
/// RC ends as last desired.
async fn an_outbox_past_the_mark_paces_the_farms(backend: Backend) {
    let Some(pg) = private_postgres() else {
        return;
    };
    let mut c = Cluster::start_on(&backend).await;
    c.audit_db = pg.url();
    nodes(&c, 6, 2).await;
    const FARMS: usize = 2;
    const PACE: f64 = 1.0;
    let ids = c
        .farms_sharing_with(
            FARMS,
            12,
            1,
            &["--audit-outbox-slow", "40", "--audit-outbox-pace", "1"],
        )
        .await;
    drained(&c, Duration::from_secs(60), "the first records shipped").await;
    pg.stop().unwrap();

    // Churn: every RC toggles between 1 and 2 replicas, a round a second, until the end.
    let churn_stop = CancellationToken::new();
    let churn = {
        let (consul, stop, ids) = (c.consul.clone(), churn_stop.clone(), ids.clone());
        let records: Vec<(RcId, Vec<u8>)> = rc_bodies(&c, &ids).await;
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.is_cancelled() {
                n += 1;
                for (id, body) in &records {
                    let mut v: serde_json::Value = serde_json::from_slice(body).unwrap();
                    v["replicas_desired"] = json!(1 + n % 2);
                    let _ = consul
                        .kv_put(&id.key(), v.to_string().as_bytes(), None)
                        .await;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            n
        })
    };
    let cr = &c;
    farms_paced(
        &c,
        true,
        Duration::from_secs(90),
        "both farms pacing (rcfarm_audit_paced 1)",
    )
    .await;
    let (n0, t0) = (outbox(&c.consul).await.len(), Instant::now());
    tokio::time::sleep(Duration::from_secs(15)).await;
    let (n1, window) = (outbox(&c.consul).await.len(), t0.elapsed());
    let allowed = (FARMS as f64 * PACE * window.as_secs_f64()).ceil() as usize + 4;
    println!(
        "FIGURE paced: {} records in {:.1} s with {FARMS} farms at {PACE}/s (allowed {allowed})",
        n1 - n0,
        window.as_secs_f64()
    );
    assert!(
        n1 - n0 <= allowed,
        "the outbox grew by {} records in {window:?}, more than {FARMS} farms at {PACE} a second",
        n1 - n0
    );
    churn_stop.cancel();
    let rounds = churn.await.unwrap();
    let last = (1 + rounds % 2) as usize;

    pg.resume().unwrap();
    drained(&c, Duration::from_secs(120), "the outbox drained").await;
    let idr = &ids;
    c.wait_for(
        Duration::from_secs(60),
        "no farm paced after the drain, and every RC as last desired",
        move || async move {
            let mut ok = true;
            for f in ["f1", "f2"] {
                ok &= cr.metrics(f).await.contains("rcfarm_audit_paced 0");
            }
            let placed = cr.placements().await;
            ok && idr
                .iter()
                .all(|id| placed.get(id).map_or(0, |p| p.len()) == last)
        },
    )
    .await;
    c.check_invariants(|_| false);
}
crate::on_both_backends!(an_outbox_past_the_mark_paces_the_farms);

/// Each RC's stored record, to rewrite with new replica counts.
async fn rc_bodies(c: &Cluster, ids: &[RcId]) -> Vec<(RcId, Vec<u8>)> {
    let mut out = Vec::new();
    for id in ids {
        out.push((*id, c.patched_rc(*id, "replicas_desired", json!(1)).await));
    }
    out
}

/// SQLite on a file system with no room left: the shipper cannot store, records wait in Consul
/// while the farms go on placing pods, and once there is room again they drain, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_on_a_full_file_system_keeps_records_in_consul() {
    let fs = match SmallFs::mount("4m") {
        Ok(fs) => fs,
        Err(e) => {
            eprintln!("SKIPPED: {e}");
            return;
        }
    };
    // Room for the database and its first records only: SQLite reuses the pages it has, so
    // a disk filled later would take writes for a long while.
    let filled = fs.fill_but(256 * 1024);
    let mut c = Cluster::start().await;
    c.audit_db = format!("sqlite://{}", fs.path().join("audit.db").display());
    nodes(&c, 6, 2).await;
    let ids = c.farms_sharing(2, 4, 2).await;
    let stop = CancellationToken::new();
    let seen = watch_outbox(&c.consul, &stop);
    let mut rounds = 0;
    let waiting = loop {
        rounds += 1;
        let replicas = 1 + rounds % 3;
        scale_all(
            &c,
            &ids,
            replicas,
            &format!("round {rounds} placed with the disk filling up"),
        )
        .await;
        let waiting = outbox(&c.consul).await.len();
        let logs: String = (0..c.farms.len()).map(|i| c.farm_log(i)).collect();
        if waiting >= 8 && logs.contains("audit shipping failed") {
            break waiting;
        }
        assert!(
            rounds < 200,
            "SQLite never ran out of room ({waiting} records waiting after {rounds} rounds)"
        );
    };
    // The farms go on: a few more rounds, all placed, while records wait.
    for _ in 0..3 {
        rounds += 1;
        scale_all(&c, &ids, 1 + rounds % 3, "placed with the disk full").await;
    }
    let waiting_more = outbox(&c.consul).await.len();
    assert!(
        waiting_more > waiting,
        "records of the changes made with the disk full wait in Consul ({waiting} then {waiting_more})"
    );
    fs.free();
    let (took, rows) = drain_and_check(
        &c,
        Duration::from_secs(90),
        "the outbox drained once there was room",
        &stop,
        &seen,
    )
    .await;
    println!(
        "FIGURE filled {filled} bytes; SQLite full after {rounds} rounds; {waiting_more} records waited; drained {:.1} s after room was made; {rows} in SQL, each once",
        took.as_secs_f64()
    );
    c.check_invariants(|_| false);
}

/// 55,000 records wait in the outbox (what farms would write over a long outage) with the farms
/// on their default flags: past the default mark (50,000) both pace, they still place what is
/// asked of them, and once PostgreSQL is back the outbox drains, every record in SQL once, and
/// the pace lifts.
async fn fifty_five_thousand_waiting_records_pace_the_farms_on_the_defaults(backend: Backend) {
    let Some(pg) = private_postgres() else {
        return;
    };
    let mut c = Cluster::start_on(&backend).await;
    c.audit_db = pg.url();
    nodes(&c, 4, 2).await;
    let ids = c.farms_sharing(2, 4, 1).await;
    drained(&c, Duration::from_secs(60), "the first records shipped").await;
    pg.stop().unwrap();
    let consul_rss_before = consul_rss(&c);
    const WAITING: usize = 55_000;
    let written = Instant::now();
    let mut ids_written = BTreeSet::new();
    let records: Vec<AuditRecord> = (0..WAITING)
        .map(|i| {
            AuditRecord::new(
                rcfarm::audit::events::RC_RETARGET,
                json!({"replication_controller_id": format!("rc-{}", i % 2000), "pod_id": "web",
                       "farm_id": "f1", "availability_zone": "z0", "cluster_name": "c",
                       "nodes": [format!("node-{:02}", i % 7), format!("node-{:02}", i % 5)]}),
            )
        })
        .collect();
    for chunk in records.chunks(64) {
        let ops: Vec<rcfarm::consul::TxnOp> = chunk.iter().map(AuditRecord::txn_op).collect();
        c.consul.txn(&ops).await.unwrap();
        ids_written.extend(chunk.iter().map(|r| r.id.to_string()));
    }
    let bytes: usize = records
        .iter()
        .map(|r| r.txn_op().value.map_or(0, |v| v.len()))
        .sum();
    println!(
        "FIGURE wrote {WAITING} records ({:.1} MiB, {} B each on average) into the outbox in {:.1} s",
        bytes as f64 / (1024.0 * 1024.0),
        bytes / WAITING,
        written.elapsed().as_secs_f64()
    );
    if let (Some(before), Some(after)) = (consul_rss_before, consul_rss(&c)) {
        println!(
            "FIGURE real Consul's RSS {before} MiB before, {after} MiB with the records waiting"
        );
    }
    let paced_after = farms_paced(
        &c,
        true,
        Duration::from_secs(90),
        "both farms pacing on the default mark",
    )
    .await;
    // Paced, not stopped: what is asked is still done.
    scale_all(&c, &ids, 2, "placed at 2 while paced").await;
    let paced_writes: u64 = {
        let mut n = 0;
        for f in ["f1", "f2"] {
            n += metric(&c.metrics(f).await, "rcfarm_audit_paced_writes_total");
        }
        n
    };
    assert!(paced_writes > 0, "the farms' writes waited for their slots");
    pg.resume().unwrap();
    let took = drained(&c, Duration::from_secs(180), "55,000 records drained").await;
    farms_paced(
        &c,
        false,
        Duration::from_secs(30),
        "the pace lifted on both farms",
    )
    .await;
    let rows = assert_all_in_sql_once(&c, &ids_written, committed_records(&c)).await;
    println!(
        "FIGURE paced {:.1} s after the records were written ({paced_writes} writes paced); drained {:.1} s after PostgreSQL came back; {rows} records in SQL, each once",
        paced_after.as_secs_f64(),
        took.as_secs_f64()
    );
    c.check_invariants(|_| false);
}
crate::on_both_backends!(fifty_five_thousand_waiting_records_pace_the_farms_on_the_defaults);

/// A counter's value on a /metrics page (0 when absent).
fn metric(page: &str, name: &str) -> u64 {
    page.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
        .unwrap_or(0.0) as u64
}

/// The real Consul agent's resident memory in MiB (`None` on the embedded server).
fn consul_rss(c: &Cluster) -> Option<u64> {
    let crate::harness::Server::Real(agent) = &c.server else {
        return None;
    };
    let status = std::fs::read_to_string(format!("/proc/{}/status", agent.pid()?)).ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib / 1024)
}

//! `rcfarm-tools bench outbox`: how fast one farm's audit shipper empties a full outbox into
//! SQL, with nothing else running. Issue 46 asks that the outbox be shipped as fast as it
//! fills, at least 20,000 records a second; in `bench farm` the farms fill it far slower than
//! that, so the figure there is the fill rate, not what the shipper could do. Here the outbox
//! is filled first (records shaped as the farms write them, create-only, 63 a transaction),
//! then one real `rcfarm serve` starts with an empty SQLite file (or `--db`, SQLite or
//! PostgreSQL) and ships it.

use std::time::{Duration, Instant};

use serde_json::json;

use super::farm::{
    FarmProc, ServerArgs, Target, failed, farm_counter, peak_rss_kib, ship_stages, spawn_farms,
    total, wait_until, work_dir,
};
use crate::audit::{AUDIT_PREFIX, AuditQuery, AuditRecord, AuditStore, events};
use crate::consul::{Consul, ConsulConfig, MAX_TXN_OPS, TxnOp};
use crate::{CliError, parse_duration_flag};

#[derive(Debug, Clone, clap::Args)]
pub struct BenchOutboxArgs {
    /// Records in the outbox when the farm starts.
    #[arg(long, default_value_t = 200_000)]
    pub records: usize,
    #[command(flatten)]
    pub server: ServerArgs,
    /// Keep the farm's log and the audit database in this directory instead of a temporary
    /// one that is removed at the end.
    #[arg(long)]
    pub log_dir: Option<std::path::PathBuf>,
    /// The audit database the farm ships to (its `--audit-db`): `sqlite://PATH` or
    /// `postgres://USER@HOST/DB`. Default: a fresh SQLite file in the log directory. Records
    /// already there are counted first, and only the new ones are checked.
    #[arg(long)]
    pub db: Option<String>,
    /// Give up on the outbox draining after this long (the figures so far are printed).
    #[arg(long, default_value = "300s", value_parser = parse_duration_flag)]
    pub timeout: Duration,
}

/// A record as a converging farm writes most of them: an RC's claim or its RETARGET, naming
/// the RC, the pod and a node (the shape of the million-pod run's outbox).
fn record(i: usize) -> AuditRecord {
    let rc = i / 2;
    let (ev, details) = if i.is_multiple_of(2) {
        (
            events::RC_CLAIMED,
            json!({"replication_controller_id": format!("rc-{rc:06}"), "farm_id": "bench-0"}),
        )
    } else {
        (
            events::RC_RETARGET,
            json!({
                "replication_controller_id": format!("rc-{rc:06}"),
                "pod_id": format!("pod-{rc:06}"),
                "nodes": [format!("node-{:05}", rc % 100_000)],
            }),
        )
    };
    AuditRecord::new(ev, details)
}

/// Records the farms say they shipped.
async fn shipped(scraper: &reqwest::Client, farms: &[FarmProc]) -> usize {
    total(&farm_counter(scraper, farms, "rcfarm_audit_shipped_total", "").await) as usize
}

/// Records in the audit database at `db` (creating its schema if it is new).
async fn sql_count(db: &str) -> Result<u64, CliError> {
    let store = AuditStore::connect(db).await.map_err(failed)?;
    let n = store.count(&AuditQuery::default()).await.map_err(failed)?;
    store.close().await;
    Ok(n)
}

pub async fn run(args: BenchOutboxArgs) -> Result<(), CliError> {
    if args.records == 0 {
        return Err(CliError::Usage(
            "--records must be at least 1: the benchmark times the outbox's draining".into(),
        ));
    }
    let (_tmp, dir) = work_dir(args.log_dir.as_deref())?;
    let target = Target::start(&args.server, &dir).await?;
    let result = measure(&args, &target, &dir).await;
    target.shutdown().await;
    result
}

async fn measure(
    args: &BenchOutboxArgs,
    target: &Target,
    dir: &std::path::Path,
) -> Result<(), CliError> {
    let consul = Consul::new(ConsulConfig::new(target.url())).map_err(failed)?;
    let db = args
        .db
        .clone()
        .unwrap_or_else(|| format!("sqlite://{}", dir.join("audit.db").display()));
    println!(
        "rcfarm-tools bench outbox: {} records, {} server, one farm shipping to {}",
        args.records,
        target.name(),
        crate::audit::store::redact(&db)
    );

    // Fill: create-only writes as the farms make them, 8 transactions at a time.
    let filled_in = Instant::now();
    let per_txn = MAX_TXN_OPS - 1;
    let mut next = 0usize;
    while next < args.records {
        let mut sends = Vec::new();
        for _ in 0..8 {
            if next >= args.records {
                break;
            }
            let end = (next + per_txn).min(args.records);
            let ops: Vec<TxnOp> = (next..end).map(|i| record(i).txn_op()).collect();
            next = end;
            let consul = consul.clone();
            sends.push(async move { consul.txn(&ops).await });
        }
        for r in futures::future::join_all(sends).await {
            r.map_err(failed)?;
        }
    }
    let fill = filled_in.elapsed().as_secs_f64();
    println!(
        "outbox filled: {} records in {fill:.1} s ({:.0} records/s written)",
        args.records,
        args.records as f64 / fill.max(0.001)
    );
    let stored_before = sql_count(&db).await?;
    let cpu_before = target.cpu();

    // One farm: it takes the shipper lock and ships.
    let started = Instant::now();
    let farms = spawn_farms(
        &target.url(),
        1,
        Duration::from_secs(5),
        dir,
        &["--audit-db", &db],
        args.server.farm_bin.as_deref(),
    )
    .await?;
    let scraper = reqwest::Client::new();
    // When the first records were seen stored, and how many: the rate is over what was shipped
    // after that (the shipper's own start, its lock and first listing, is before it).
    let mut first_at: Option<(Duration, usize)> = None;
    let drained = loop {
        tokio::time::sleep(Duration::from_millis(80)).await;
        let n = shipped(&scraper, &farms).await;
        if n > 0 && first_at.is_none() {
            first_at = Some((started.elapsed(), n));
        }
        if n >= args.records {
            break Ok(());
        }
        if started.elapsed() > args.timeout {
            break Err(failed(format!(
                "timed out after {:?} waiting for the outbox to drain",
                args.timeout
            )));
        }
    };
    let since_start = started.elapsed();
    let n = shipped(&scraper, &farms).await;
    // Deletes follow the SQL commit: wait for the last batch's.
    if drained.is_ok() {
        let _ = wait_until(Duration::from_secs(30), "the last deletes", || async {
            target.count(&consul, AUDIT_PREFIX).await == 0
        })
        .await;
    }
    let left = target.count(&consul, AUDIT_PREFIX).await;
    let emptied = started.elapsed();
    // Shipped after the first sighting, over the time since.
    let from_first = first_at
        .filter(|&(_, at)| at < n)
        .map(|(t, at)| (since_start.saturating_sub(t), n - at));
    let rate = from_first.map(|(d, k)| k as f64 / d.as_secs_f64().max(0.001));
    println!(
        "shipped: {n} of {} records{}",
        args.records,
        match &drained {
            Ok(_) => String::new(),
            Err(e) => format!(" ({e})"),
        }
    );
    println!(
        "from the farm's exec: {:.2} s ({:.0} records/s); after the first batch stored: {}",
        since_start.as_secs_f64(),
        n as f64 / since_start.as_secs_f64().max(0.001),
        from_first.zip(rate).map_or(
            "n/a (all shipped before the first look)".into(),
            |((d, k), rate)| format!(
                "{k} records in {:.2} s ({rate:.0} records/s)",
                d.as_secs_f64()
            )
        ),
    );
    println!(
        "outbox empty after {:.2} s: {left} records left",
        emptied.as_secs_f64()
    );
    println!(
        "stages (seconds in all, times): {}",
        ship_stages(&scraper, &farms).await
    );
    let farm = farms.first().map(|f| f.pid);
    let farm_cpu = farm.and_then(crate::chaos::procfs::cpu_time);
    let server_cpu = match (cpu_before, target.cpu()) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    let secs = |d: Option<Duration>| d.map_or("n/a".into(), |d| format!("{:.1}", d.as_secs_f64()));
    println!(
        "farm CPU-s {}, server CPU-s while shipping {}, farm RSS peak {} MiB",
        secs(farm_cpu),
        secs(server_cpu),
        farm.and_then(peak_rss_kib)
            .map_or("n/a".into(), |k| format!("{:.0}", k as f64 / 1024.0)),
    );
    for mut f in farms {
        let _ = f.child.kill().await;
    }

    // What SQL gained: every record once.
    let stored = sql_count(&db).await?.saturating_sub(stored_before);
    println!("SQL holds {stored} records more");
    let json = json!({
        "records": args.records,
        "server": target.name(),
        "fill_s": fill,
        "shipped": n,
        "left": left,
        "from_exec_s": since_start.as_secs_f64(),
        "from_first_batch_s": from_first.map(|(d, _)| d.as_secs_f64()),
        "records_per_s": rate,
        "stored": stored,
        "farm_cpu_s": farm_cpu.map(|d| d.as_secs_f64()),
        "server_cpu_s": server_cpu.map(|d| d.as_secs_f64()),
    });
    println!("figures: {json}");
    drained?;
    if left > 0 || stored != args.records as u64 {
        return Err(failed(format!(
            "the outbox did not ship whole: {left} records left in Consul, {stored} of {} in SQL",
            args.records
        )));
    }
    Ok(())
}

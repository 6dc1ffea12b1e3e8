//! `rcfarm-tools bench audit`: query latency of the audit log over many records, on SQLite or
//! PostgreSQL.

use std::time::{Duration, Instant};

use chrono::Utc;
use serde_json::json;

use crate::CliError;
use crate::audit::{AuditQuery, AuditRecord, AuditStore, events};

#[derive(Debug, clap::Args)]
pub struct BenchAuditArgs {
    /// The database: sqlite://PATH (a fresh file is best) or postgres://USER@HOST/DB.
    #[arg(long)]
    pub db: String,
    /// Records to load (skipped if the database already holds at least this many).
    #[arg(long, default_value_t = 1_000_000)]
    pub records: usize,
    /// Distinct RCs the records belong to.
    #[arg(long, default_value_t = 2_000)]
    pub rcs: usize,
    /// Queries per measurement.
    #[arg(long, default_value_t = 200)]
    pub queries: usize,
}

/// Builds the i-th query of a measurement.
type QueryMaker<'a> = Box<dyn Fn(usize) -> AuditQuery + 'a>;

fn failed(e: impl std::fmt::Display) -> CliError {
    CliError::Failed(e.to_string())
}

pub async fn run(args: BenchAuditArgs) -> Result<(), CliError> {
    let store = AuditStore::connect(&args.db).await.map_err(failed)?;
    let have = store.count(&AuditQuery::default()).await.map_err(failed)? as usize;
    let started = Instant::now();
    if have < args.records {
        let base = Utc::now() - chrono::Duration::days(30);
        // In the shipper's batches, so that the load time is the shipper's SQL rate.
        let per_batch = crate::audit::ShipperConfig::default().batch;
        let mut batch = Vec::with_capacity(per_batch);
        for i in have..args.records {
            let rc = i % args.rcs;
            let ev = if i % 10 == 0 {
                events::RC_CLAIMED
            } else {
                events::RC_RETARGET
            };
            let mut r = AuditRecord::new(
                ev,
                json!({
                    "replication_controller_id": format!("rc-{rc:05}"),
                    "pod_id": format!("pod-{rc:05}"),
                    "farm_id": format!("farm-{}", i % 5),
                    "nodes": [format!("node-{:04}", i % 3000), format!("node-{:04}", (i + 7) % 3000)],
                }),
            );
            // Spread over 30 days, in order.
            r.timestamp = base
                + chrono::Duration::milliseconds((i as i64) * 2_592_000_000 / args.records as i64);
            batch.push(r);
            if batch.len() == per_batch {
                store.insert(&batch, "bench").await.map_err(failed)?;
                batch.clear();
            }
        }
        store.insert(&batch, "bench").await.map_err(failed)?;
    }
    // After a bulk load, give the planner statistics (autovacuum would, in time).
    store.analyze().await.map_err(failed)?;
    let total = store.count(&AuditQuery::default()).await.map_err(failed)?;
    println!(
        "rcfarm-tools bench audit: {} ({:?}), {total} records over {} RCs (loaded in {:.1} s), {} queries per row",
        store.url(),
        store.engine(),
        args.rcs,
        started.elapsed().as_secs_f64(),
        args.queries
    );
    println!();
    println!("| query | rows | p50 ms | p99 ms |");
    println!("|---|---|---|---|");
    let rc = |i: usize| format!("rc-{:05}", (i * 7919) % args.rcs);
    let cases: Vec<(&str, QueryMaker<'_>)> = vec![
        (
            "by RC id, newest 50",
            Box::new(move |i| AuditQuery {
                rc_id: Some(rc(i)),
                limit: Some(50),
                ..Default::default()
            }),
        ),
        (
            "by RC id + event type, newest 50",
            Box::new(move |i| AuditQuery {
                rc_id: Some(rc(i)),
                event_type: Some(events::RC_RETARGET.into()),
                limit: Some(50),
                ..Default::default()
            }),
        ),
        (
            "by RC id, last 24 h",
            Box::new(move |i| AuditQuery {
                rc_id: Some(rc(i)),
                since: Some(Utc::now() - chrono::Duration::days(1)),
                limit: Some(50),
                ..Default::default()
            }),
        ),
        (
            "by node, newest 50",
            Box::new(|i| AuditQuery {
                node: Some(format!("node-{:04}", (i * 31) % 3000)),
                limit: Some(50),
                ..Default::default()
            }),
        ),
        (
            "by farm, newest 50",
            Box::new(|i| AuditQuery {
                farm_id: Some(format!("farm-{}", i % 5)),
                limit: Some(50),
                ..Default::default()
            }),
        ),
        (
            "everything, newest 50",
            Box::new(|_| AuditQuery {
                limit: Some(50),
                ..Default::default()
            }),
        ),
    ];
    for (name, make) in &cases {
        let mut samples = Vec::with_capacity(args.queries);
        let mut rows = 0;
        for i in 0..args.queries {
            let q = make(i);
            let t = Instant::now();
            rows = store.query(&q).await.map_err(failed)?.records.len();
            samples.push(t.elapsed());
        }
        samples.sort();
        let at = |p: f64| samples[((samples.len() - 1) as f64 * p) as usize];
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "| {name} | {rows} | {:.2} | {:.2} |",
            ms(at(0.5)),
            ms(at(0.99))
        );
    }
    // Paging deep into one RC's history with cursors.
    let mut samples = Vec::new();
    let mut cursor = None;
    for _ in 0..10 {
        let t = Instant::now();
        let page = store
            .query(&AuditQuery {
                rc_id: Some(rc(1)),
                limit: Some(50),
                cursor: cursor.clone(),
                ..Default::default()
            })
            .await
            .map_err(failed)?;
        samples.push(t.elapsed());
        cursor = page.next_cursor;
        if cursor.is_none() {
            break;
        }
    }
    let max = samples.iter().max().copied().unwrap_or_default();
    println!(
        "| by RC id, pages 1-{} via cursor | 50 each | max {:.2} | |",
        samples.len(),
        max.as_secs_f64() * 1e3
    );
    store.close().await;
    Ok(())
}

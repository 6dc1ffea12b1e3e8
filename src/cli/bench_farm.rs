//! `rcfarm bench farm`: F real farm processes against the embedded server, M labelled nodes,
//! N RCs × R replicas. Reports convergence time and throughput, Consul requests and
//! transactions per pod, the latency from an RC change to the farm's write, graceful handover
//! and kill -9 failover times, idle blocking queries and request rate per farm, and RSS.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::process::{Child, Command};

use super::{CliError, parse_duration_flag};
use crate::consul::{Consul, ConsulConfig, QueryOptions, TxnOp};
use crate::labels::{LabelSet, LabelStore, LabelType};
use crate::rc::{RcId, parse_locks};
use crate::server::{Change, EmbeddedServer, ServerConfig};

#[derive(Debug, Clone, clap::Args)]
pub struct BenchFarmArgs {
    #[arg(long, default_value_t = 1)]
    pub farms: usize,
    #[arg(long, default_value_t = 200)]
    pub rcs: usize,
    #[arg(long, default_value_t = 5)]
    pub replicas: usize,
    #[arg(long, default_value_t = 200)]
    pub nodes: usize,
    /// Session TTL of the farms (the failover measurement waits 2×TTL).
    #[arg(long, default_value = "5s", value_parser = parse_duration_flag)]
    pub session_ttl: Duration,
    /// RC changes to time, one at a time.
    #[arg(long, default_value_t = 50)]
    pub changes: usize,
    /// How long to watch the idle farms.
    #[arg(long, default_value = "30s", value_parser = parse_duration_flag)]
    pub idle: Duration,
    /// Give up on convergence after this long.
    #[arg(long, default_value = "300s", value_parser = parse_duration_flag)]
    pub timeout: Duration,
}

pub(super) fn failed(e: impl std::fmt::Display) -> CliError {
    CliError::Failed(e.to_string())
}

pub(super) struct FarmProc {
    pub child: Child,
    pub pid: u32,
    pub session: Option<String>,
}

/// Starts `n` farms (`bench-0` …) against `consul`, logging to `dir`, and waits until they
/// registered.
pub(super) async fn spawn_farms(
    consul_url: &str,
    n: usize,
    ttl: Duration,
    dir: &std::path::Path,
    extra: &[&str],
) -> Result<Vec<FarmProc>, CliError> {
    let exe = std::env::current_exe().map_err(failed)?;
    let audit_db = format!("sqlite://{}", dir.join("audit.db").display());
    let ttl = format!("{}ms", ttl.as_millis());
    let mut farms: Vec<FarmProc> = Vec::new();
    for i in 0..n {
        let log = std::fs::File::create(dir.join(format!("farm-{i}.log"))).map_err(failed)?;
        let child = Command::new(&exe)
            .args([
                "serve",
                "--consul",
                consul_url,
                "--farm-id",
                &format!("bench-{i}"),
            ])
            .args([
                "--http",
                "off",
                "--audit-db",
                &audit_db,
                "--session-ttl",
                &ttl,
            ])
            .args(["--lock-delay", "500ms", "--watch-wait", "60s"])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .kill_on_drop(true)
            .spawn()
            .map_err(failed)?;
        let pid = child.id().unwrap_or(0);
        farms.push(FarmProc {
            child,
            pid,
            session: None,
        });
    }
    let c = Consul::new(ConsulConfig::new(consul_url)).map_err(failed)?;
    wait_until(Duration::from_secs(60), "farms registered", || {
        let c = c.clone();
        async move {
            c.kv_keys(
                crate::farm::registry::FARMS_PREFIX,
                None,
                &QueryOptions::default(),
            )
            .await
            .map(|(k, _)| k.len() == n)
            .unwrap_or(false)
        }
    })
    .await?;
    Ok(farms)
}

/// Fills in each farm's session from the registry.
async fn farm_sessions(consul: &Consul, farms: &mut [FarmProc]) -> Result<(), CliError> {
    let (entries, _) = consul
        .kv_list(
            crate::farm::registry::FARMS_PREFIX,
            &QueryOptions::default(),
        )
        .await
        .map_err(failed)?;
    for f in crate::farm::registry::live_farms(&entries) {
        if let Some(i) = f
            .farm_id
            .strip_prefix("bench-")
            .and_then(|i| i.parse::<usize>().ok())
            && let Some(p) = farms.get_mut(i)
        {
            p.session = Some(f.session);
        }
    }
    Ok(())
}

pub(super) fn rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

pub(super) fn signal(pid: u32, sig: &str) {
    let _ = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status();
}

pub(super) async fn wait_until<F, Fut>(
    timeout: Duration,
    what: &str,
    mut f: F,
) -> Result<Duration, CliError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t = Instant::now();
    loop {
        if f().await {
            return Ok(t.elapsed());
        }
        if t.elapsed() > timeout {
            return Err(CliError::Failed(format!(
                "timed out after {timeout:?} waiting for {what}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// RC → owning session.
async fn owners(c: &Consul) -> Result<BTreeMap<RcId, String>, CliError> {
    let (entries, _) = c
        .kv_list(crate::rc::RC_LOCK_PREFIX, &QueryOptions::default())
        .await
        .map_err(failed)?;
    Ok(parse_locks(&entries)
        .0
        .into_iter()
        .filter_map(|(id, h)| h.ownership.map(|(s, _)| (id, s)))
        .collect())
}

pub(super) fn pct(v: &mut [Duration], q: f64) -> f64 {
    v.sort();
    v.get(((v.len().max(1) - 1) as f64 * q) as usize)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

pub async fn run(args: BenchFarmArgs) -> Result<(), CliError> {
    let dir = tempfile::tempdir().map_err(failed)?;
    let server = EmbeddedServer::start(ServerConfig {
        session_ttl_min: Duration::from_secs(1),
        record_commits: true,
        ..ServerConfig::ephemeral()
    })
    .await
    .map_err(failed)?;
    let consul = Consul::new(ConsulConfig::new(server.url())).map_err(failed)?;

    // Nodes.
    let label_ops: Vec<TxnOp> = (0..args.nodes)
        .map(|i| {
            let l: LabelSet = [
                ("env".to_string(), "prod".to_string()),
                ("zone".to_string(), format!("z{}", i % 4)),
            ]
            .into();
            LabelStore::set_op(LabelType::Node, &format!("node-{i:05}"), &l)
        })
        .collect();
    for chunk in label_ops.chunks(64) {
        consul.txn(chunk).await.map_err(failed)?;
    }

    // Farms.
    let mut farms = spawn_farms(
        &server.url(),
        args.farms,
        args.session_ttl,
        dir.path(),
        &["--resync-interval", "30s", "--consistency-interval", "60s"],
    )
    .await?;
    farm_sessions(&consul, &mut farms).await?;

    // RCs, written as P2 tools do (raw records), 21 per transaction.
    let ids: Vec<RcId> = (0..args.rcs).map(|_| RcId::new()).collect();
    let mut ops = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let record = json!({
            "id": id.to_string(), "manifest": format!("id: bench-{i}\nlaunchables: {{}}\n"), "node_selector": "env=prod",
            "pod_labels": {}, "replicas_desired": args.replicas, "disabled": false, "allocation_strategy": "static_strategy",
        });
        ops.push(TxnOp::cas(id.key(), record.to_string().into_bytes(), 0));
    }
    let pods = args.rcs * args.replicas;
    let before = server.stats();
    let t0 = Instant::now();
    for chunk in ops.chunks(63) {
        consul.txn(chunk).await.map_err(failed)?;
    }
    let srv = &server;
    let converge = wait_until(args.timeout, "convergence", || async move {
        srv.count_prefix("intent/") == pods && srv.count_prefix("labels/pod/") == pods
    })
    .await?
    .max(t0.elapsed());
    let after = server.stats();
    let requests_per_pod = (after.requests - before.requests) as f64 / pods as f64;
    let txns_per_pod = (after.txns - before.txns) as f64 / pods as f64;

    // Change → write latency, one change at a time.
    let mut latencies = Vec::new();
    for (k, &id) in ids.iter().enumerate().take(args.changes) {
        let (e, _) = consul
            .kv_get(&id.key(), &QueryOptions::default())
            .await
            .map_err(failed)?;
        let Some(e) = e else { continue };
        let mut v: serde_json::Value = serde_json::from_slice(e.value_bytes()).map_err(failed)?;
        v["replicas_desired"] = json!(args.replicas + 1);
        let sent = Instant::now();
        let resp = consul
            .txn(&[TxnOp::cas(
                id.key(),
                v.to_string().into_bytes(),
                e.modify_index,
            )])
            .await
            .map_err(failed)?;
        let index = resp.results.first().map_or(0, |r| r.modify_index);
        let prefix = "intent/".to_string();
        let pod = format!("/bench-{k}");
        let srv = &server;
        let written = wait_until(Duration::from_secs(30), "the farm's write", || {
            let (prefix, pod) = (prefix.clone(), pod.clone());
            async move {
                srv.commit_log().iter().rev().take_while(|c| c.index > index).any(|c| {
                    c.changes.iter().any(|ch| matches!(ch, Change::Put(key, _) if key.starts_with(&prefix) && key.ends_with(&pod)))
                })
            }
        })
        .await;
        if written.is_ok()
            && let Some(c) = server.commit_log().iter().find(|c| {
                c.index > index && c.changes.iter().any(|ch| matches!(ch, Change::Put(key, _) if key.starts_with("intent/") && key.ends_with(&pod)))
            })
        {
            latencies.push(c.at.saturating_duration_since(sent));
        }
    }

    // Idle: let the outbox drain, then watch.
    wait_until(
        Duration::from_secs(120),
        "the audit outbox to drain",
        || async move { srv.count_prefix("audit_logs/") == 0 },
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle0 = server.stats();
    tokio::time::sleep(args.idle).await;
    let idle1 = server.stats();
    let idle_rpm =
        (idle1.requests - idle0.requests) as f64 / args.farms as f64 / args.idle.as_secs_f64()
            * 60.0;
    let blocking = idle1.blocked_queries as f64 / args.farms as f64;
    let rss: Vec<u64> = farms.iter().filter_map(|f| rss_kib(f.pid)).collect();
    let rss_mib = rss.iter().sum::<u64>() as f64 / rss.len().max(1) as f64 / 1024.0;
    let rss_per_rc_kib = rss.iter().sum::<u64>() as f64 / args.rcs as f64;

    // Handover and failover need another farm to take over.
    let (mut handover, mut failover) = (None, None);
    if args.farms >= 2 {
        let gone = farms[0].session.clone().unwrap_or_default();
        signal(farms[0].pid, "TERM");
        let c = consul.clone();
        let n = args.rcs;
        handover = Some(
            wait_until(Duration::from_secs(60), "handover", || {
                let (c, gone) = (c.clone(), gone.clone());
                async move {
                    owners(&c)
                        .await
                        .is_ok_and(|o| o.len() == n && o.values().all(|s| *s != gone))
                }
            })
            .await?,
        );
        let _ = farms[0].child.wait().await;
        let gone = farms[1].session.clone().unwrap_or_default();
        signal(farms[1].pid, "KILL");
        let c = consul.clone();
        failover = Some(
            wait_until(
                args.session_ttl * 4 + Duration::from_secs(30),
                "kill -9 failover",
                || {
                    let (c, gone) = (c.clone(), gone.clone());
                    async move {
                        owners(&c)
                            .await
                            .is_ok_and(|o| o.len() == n && o.values().all(|s| *s != gone))
                    }
                },
            )
            .await?,
        );
    }
    for f in &mut farms {
        let _ = f.child.start_kill();
    }

    let secs =
        |d: Option<Duration>| d.map_or("n/a".to_string(), |d| format!("{:.2}", d.as_secs_f64()));
    println!(
        "| {} | {}×{} | {} | {:.2} | {:.0} | {:.2} | {:.3} | {:.1} / {:.1} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} |",
        args.farms,
        args.rcs,
        args.replicas,
        args.nodes,
        converge.as_secs_f64(),
        pods as f64 / converge.as_secs_f64(),
        requests_per_pod,
        txns_per_pod,
        pct(&mut latencies.clone(), 0.5),
        pct(&mut latencies, 0.99),
        secs(handover),
        secs(failover),
        blocking,
        idle_rpm,
        rss_mib,
        rss_per_rc_kib,
    );
    server.shutdown().await;
    Ok(())
}

/// The header of the table rows `run` prints.
pub fn header() -> &'static str {
    "| farms | RCs×replicas | nodes | converge s | pods/s | Consul req/pod | txn/pod | change→write p50 / p99 ms | SIGTERM handover s | kill -9 failover s | idle blocking queries/farm | idle req/min/farm | RSS MiB/farm | RSS KiB/RC |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
}

//! `rcfarm-tools bench consul`: throughput and wake-up latency of the embedded server, measured from a
//! real client against a real `rcfarm consul-dev` process, in memory and with `--data-dir`.

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::consul::{Consul, ConsulConfig, QueryOptions, TxnOp};
use crate::{CliError, parse_duration_flag};

#[derive(Debug, clap::Args)]
pub struct BenchConsulArgs {
    /// How long each throughput phase runs.
    #[arg(long, default_value = "5s", value_parser = parse_duration_flag)]
    pub duration: Duration,
    /// Concurrent writers in the throughput phases.
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// Operations per transaction in the txn phase.
    #[arg(long, default_value_t = 10)]
    pub txn_ops: usize,
    /// Size of each value written.
    #[arg(long, default_value_t = 256)]
    pub value_size: usize,
    /// Blocked watchers in the wake-up phase.
    #[arg(long, default_value_t = 1000)]
    pub watchers: usize,
    /// Wake-up rounds (one write each) to measure.
    #[arg(long, default_value_t = 20)]
    pub rounds: usize,
    /// Run only one mode: `memory` or `data-dir` (default: both).
    #[arg(long)]
    pub only: Option<String>,
}

/// Latency percentiles of a sample.
struct Percentiles {
    p50: Duration,
    p99: Duration,
    max: Duration,
}

fn percentiles(mut v: Vec<Duration>) -> Percentiles {
    v.sort();
    let at = |q: f64| {
        v.get(((v.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or_default()
    };
    Percentiles {
        p50: at(0.5),
        p99: at(0.99),
        max: v.last().copied().unwrap_or_default(),
    }
}

fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1000.0)
}

async fn spawn_server(data_dir: Option<&std::path::Path>) -> Result<(Child, String), CliError> {
    let exe = crate::rcfarm_beside("")?;
    let mut cmd = Command::new(exe);
    cmd.args([
        "consul-dev",
        "--listen",
        "127.0.0.1:0",
        "--max-txn-ops",
        "64",
    ]);
    if let Some(d) = data_dir {
        cmd.arg("--data-dir").arg(d);
    }
    cmd.env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    let mut child = cmd
        .spawn()
        .map_err(|e| CliError::Failed(format!("cannot start consul-dev: {e}")))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| CliError::Failed("no stdout".into()))?;
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .map_err(|_| CliError::Failed("consul-dev did not start in 30 s".into()))?
        .map_err(|e| CliError::Failed(e.to_string()))?
        .ok_or_else(|| CliError::Failed("consul-dev exited at start".into()))?;
    let url = line
        .strip_prefix("consul-dev listening on ")
        .ok_or_else(|| CliError::Failed(format!("unexpected consul-dev output: {line}")))?
        .to_string();
    Ok((child, url))
}

fn client(url: &str) -> Result<Consul, CliError> {
    Consul::new(ConsulConfig {
        timeout: Duration::from_secs(60),
        ..ConsulConfig::new(url)
    })
    .map_err(|e| CliError::Failed(e.to_string()))
}

/// Runs `op(worker, seq)` from `concurrency` workers for `duration`; returns ops and latencies.
async fn throughput<F, Fut>(
    concurrency: usize,
    duration: Duration,
    op: F,
) -> (u64, Vec<Duration>, u64)
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let op = Arc::new(op);
    let deadline = Instant::now() + duration;
    let mut tasks = Vec::new();
    for w in 0..concurrency {
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut errors = 0u64;
            let mut seq = 0u64;
            while Instant::now() < deadline {
                let t = Instant::now();
                if op(w, seq).await {
                    lat.push(t.elapsed());
                } else {
                    errors += 1;
                }
                seq += 1;
            }
            (lat, errors)
        }));
    }
    let mut all = Vec::new();
    let mut errors = 0;
    for t in tasks {
        if let Ok((l, e)) = t.await {
            all.extend(l);
            errors += e;
        }
    }
    (all.len() as u64, all, errors)
}

struct ModeResult {
    mode: &'static str,
    put_ops: f64,
    put: Percentiles,
    txn_rate: f64,
    txn: Percentiles,
    errors: u64,
    wake_all: Percentiles,
    wake_one: Percentiles,
}

async fn run_mode(args: &BenchConsulArgs, mode: &'static str) -> Result<ModeResult, CliError> {
    let dir = tempfile::tempdir().map_err(|e| CliError::Failed(e.to_string()))?;
    let data_dir = (mode == "data-dir").then(|| dir.path().to_path_buf());
    let (mut child, url) = spawn_server(data_dir.as_deref()).await?;
    let c = client(&url)?;
    let value = Arc::new(vec![b'v'; args.value_size]);

    // KV PUT throughput.
    let cc = c.clone();
    let v = value.clone();
    let (puts, put_lat, put_err) = throughput(args.concurrency, args.duration, move |w, seq| {
        let c = cc.clone();
        let v = v.clone();
        async move {
            c.kv_put(&format!("bench/put/{w}/{}", seq % 1000), &v, None)
                .await
                .is_ok()
        }
    })
    .await;

    // Transaction throughput.
    let cc = c.clone();
    let v = value.clone();
    let n = args.txn_ops;
    let (txns, txn_lat, txn_err) = throughput(args.concurrency, args.duration, move |w, seq| {
        let c = cc.clone();
        let v = v.clone();
        async move {
            let ops: Vec<TxnOp> = (0..n)
                .map(|i| TxnOp::set(format!("bench/txn/{w}/{}/{i}", seq % 100), v.to_vec()))
                .collect();
            c.txn(&ops).await.is_ok()
        }
    })
    .await;

    let wake_all = wake_latency(&c, args.watchers, args.rounds, true).await?;
    let wake_one = wake_latency(&c, args.watchers, args.rounds, false).await?;
    let _ = child.start_kill();
    let _ = child.wait().await;
    Ok(ModeResult {
        mode,
        put_ops: puts as f64 / args.duration.as_secs_f64(),
        put: percentiles(put_lat),
        txn_rate: txns as f64 / args.duration.as_secs_f64(),
        txn: percentiles(txn_lat),
        errors: put_err + txn_err,
        wake_all,
        wake_one,
    })
}

/// Wake-up latency with `watchers` blocked queries: from the moment a write is sent to the
/// moment each woken watcher has its answer (so it includes the write itself). `shared`: all watch one prefix and every
/// write wakes all of them; otherwise each watches its own prefix and a write wakes one.
async fn wake_latency(
    c: &Consul,
    watchers: usize,
    rounds: usize,
    shared: bool,
) -> Result<Percentiles, CliError> {
    let base = if shared {
        "bench/wake-all/"
    } else {
        "bench/wake-one/"
    };
    let mut samples = Vec::new();
    for round in 0..rounds {
        let prefix_of = |w: usize| {
            if shared {
                base.to_string()
            } else {
                format!("{base}{w}/")
            }
        };
        let target = round % watchers;
        let key = format!("{}k", prefix_of(target));
        c.kv_put(&key, format!("{round}").as_bytes(), None)
            .await
            .map_err(|e| CliError::Failed(e.to_string()))?;
        let (_, meta) = c
            .kv_get(&key, &QueryOptions::default())
            .await
            .map_err(|e| CliError::Failed(e.to_string()))?;
        let sent_at: Arc<Mutex<Option<Instant>>> = Arc::default();
        let mut tasks = Vec::new();
        for w in 0..watchers {
            let c = c.clone();
            let prefix = prefix_of(w);
            let sent_at = sent_at.clone();
            tasks.push(tokio::spawn(async move {
                let r = c
                    .kv_list(
                        &prefix,
                        &QueryOptions::blocking(meta.index, Duration::from_secs(30)),
                    )
                    .await;
                let done = Instant::now();
                match (r, *sent_at.lock()) {
                    (Ok((_, m)), Some(at)) if m.index > meta.index => {
                        Some(done.saturating_duration_since(at))
                    }
                    _ => None,
                }
            }));
        }
        // Let every watcher reach the server and block.
        tokio::time::sleep(Duration::from_millis(if watchers > 100 {
            700
        } else {
            100
        }))
        .await;
        let changed = format!("{round}-changed");
        *sent_at.lock() = Some(Instant::now());
        c.kv_put(&key, changed.as_bytes(), None)
            .await
            .map_err(|e| CliError::Failed(e.to_string()))?;
        if shared {
            for t in tasks {
                if let Ok(Some(d)) = t.await {
                    samples.push(d);
                }
            }
        } else {
            // Only the target wakes; the others time out. Cancel them.
            let mut tasks = tasks;
            let t = tasks.swap_remove(target);
            if let Ok(Some(d)) = t.await {
                samples.push(d);
            }
            for t in tasks {
                t.abort();
            }
        }
    }
    Ok(percentiles(samples))
}

pub async fn run(args: BenchConsulArgs) -> Result<(), CliError> {
    let modes: Vec<&'static str> = match args.only.as_deref() {
        None => vec!["memory", "data-dir"],
        Some("memory") => vec!["memory"],
        Some("data-dir") => vec!["data-dir"],
        Some(other) => {
            return Err(CliError::Usage(format!(
                "--only {other:?}: use memory or data-dir"
            )));
        }
    };
    println!(
        "rcfarm-tools bench consul: {} writers, {}-byte values, {} ops per txn, {} s per phase, {} watchers × {} rounds",
        args.concurrency,
        args.value_size,
        args.txn_ops,
        args.duration.as_secs_f64(),
        args.watchers,
        args.rounds
    );
    println!();
    println!(
        "| mode | KV PUT/s | PUT p50 ms | PUT p99 ms | txn/s ({} ops) | txn p50 ms | txn p99 ms | wake all {} p50/p99/max ms | wake one of {} p50/p99 ms | errors |",
        args.txn_ops, args.watchers, args.watchers
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for mode in modes {
        let r = run_mode(&args, mode).await?;
        println!(
            "| {} | {:.0} | {} | {} | {:.0} | {} | {} | {} / {} / {} | {} / {} | {} |",
            r.mode,
            r.put_ops,
            ms(r.put.p50),
            ms(r.put.p99),
            r.txn_rate,
            ms(r.txn.p50),
            ms(r.txn.p99),
            ms(r.wake_all.p50),
            ms(r.wake_all.p99),
            ms(r.wake_all.max),
            ms(r.wake_one.p50),
            ms(r.wake_one.p99),
            r.errors
        );
    }
    Ok(())
}

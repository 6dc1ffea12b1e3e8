//! `rcfarm-tools bench farm`: F real farm processes against the embedded server, M labelled nodes,
//! N RCs × R replicas. Reports convergence time and throughput, Consul requests and
//! transactions per pod, the latency from an RC change to the farm's write, graceful handover
//! and kill -9 failover times, idle blocking queries and request rate per farm, and RSS.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::process::{Child, Command};

use crate::chaos::agent::{AgentConfig, ConsulAgent};
use crate::chaos::procfs as bench_probe;
use crate::consul::{Consul, ConsulConfig, QueryOptions, TxnOp};
use crate::labels::{LabelSet, LabelStore, LabelType};
use crate::rc::{RcId, parse_locks};
use crate::server::{Change, EmbeddedServer, ServerConfig};
use crate::{CliError, parse_duration_flag};

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
    #[command(flatten)]
    pub server: ServerArgs,
    /// Keep the farms' logs (and the audit database) in this directory instead of a temporary
    /// one that is removed at the end.
    #[arg(long)]
    pub log_dir: Option<std::path::PathBuf>,
    /// The farms' `--consul-max-conns` (0: their default).
    #[arg(long, default_value_t = 0)]
    pub consul_max_conns: usize,
    /// Give up on convergence after this long.
    #[arg(long, default_value = "300s", value_parser = parse_duration_flag)]
    pub timeout: Duration,
    /// Start no farm: write every pod's intent and labels straight from the benchmark, with
    /// the ops a farm commits per RC (RC index check, intents, labels, audit record), from one
    /// client per farm with a farm's connections and batching. How fast Consul itself takes
    /// this load: the floor under the farms' convergence time.
    #[arg(long)]
    pub floor: bool,
    /// Write every RC and every pod (intents and labels, as farms leave them) before any farm
    /// starts, then start the farms on that full cluster: the case of every farm restarted for
    /// an upgrade. Reports how long until every RC is held, and each farm's RSS steady (after
    /// `--idle`) and at its peak.
    #[arg(long, conflicts_with = "floor")]
    pub prewritten: bool,
    /// Write every RC (and no pod) before any farm starts, then start the farms: farms
    /// (re)started on a cluster that holds its RCs, as at every upgrade. Reports the time from
    /// the farms' exec until every pod's intent and labels are written, and each farm's RSS
    /// steady (after `--idle`) and at its peak.
    #[arg(long, conflicts_with_all = ["floor", "prewritten"])]
    pub restart: bool,
    /// With `--restart`: run P2's farm (`p2-rctl-server`, for example
    /// `../shared/p2/p2-rctl-server`) instead of rcfarm's, timed by the same harness on the
    /// same cluster. It serves no metrics: bytes read are not reported for it.
    #[arg(long, requires = "restart", conflicts_with = "farm_bin")]
    pub p2_farm_bin: Option<std::path::PathBuf>,
    /// Also print each run's figures on stdout as one line `figures: {JSON}`, for scripts.
    #[arg(long)]
    pub json: bool,
    /// Run the benchmark once per farm count given (`--compare 3,6`), back to back with the
    /// other flags, and print the scale-out table: bytes read, CPU-seconds of the farms and of
    /// Consul, wall time and RSS per farm, each as a ratio to the first count's.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["floor", "prewritten", "restart"])]
    pub compare: Vec<usize>,
}

/// Which Consul a benchmark starts, and the `rcfarm` its farms run.
#[derive(Debug, Clone, clap::Args)]
pub struct ServerArgs {
    /// Run against a real Consul agent (`consul agent -dev`) started from this binary instead
    /// of the embedded server.
    #[arg(long)]
    pub consul_bin: Option<std::path::PathBuf>,
    /// Run the embedded server as a process of its own (`rcfarm consul-dev`, the farms'
    /// binary) instead of inside this one, so that its RSS and CPU are reported apart from
    /// the writer's. (`bench farm` then does not measure the change → write latencies: they
    /// read the in-process server's commit log.)
    #[arg(long, conflicts_with = "consul_bin")]
    pub server_process: bool,
    /// The `rcfarm` the farms run (default: the one beside `rcfarm-tools`). `scripts/bench-guard`
    /// times two builds' farms with one harness: this build's benchmark and each build's
    /// `rcfarm serve`.
    #[arg(long)]
    pub farm_bin: Option<std::path::PathBuf>,
}

/// What one run measured, for `--compare` and `--json`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Figures {
    pub farms: usize,
    /// From the first RC written until every pod was written (`--restart`: from the farms'
    /// exec; `--prewritten`: until every RC was held).
    pub converge: f64,
    /// How long the benchmark's writer took to write the RCs.
    pub written_in: f64,
    /// Bytes read by all farms' watches (and the record reads that stand in for them).
    pub mib_read: f64,
    pub farm_cpu: f64,
    /// Consul's CPU while converging (real Consul), or this process's (the embedded server
    /// and the writer).
    pub consul_cpu: Option<f64>,
    /// Steady RSS (MiB) of the farms that do not ship the audit log.
    pub rss: Vec<f64>,
    /// Peak RSS over steady of those farms.
    pub peak_ratio: Vec<f64>,
    /// Peak RSS (MiB) of those farms.
    pub peak_rss: Vec<f64>,
    /// From an RC change to the farm's write, 99th percentile (embedded server only).
    pub change_p99_ms: Option<f64>,
    /// The server's RSS (MiB) at the end and at its peak, when it ran as a process of its own
    /// (`--server-process`).
    pub server_rss: Option<f64>,
    pub server_peak_rss: Option<f64>,
}

impl Figures {
    /// `figures: {JSON}` on stdout, with `--json`.
    fn print_json(&self, args: &BenchFarmArgs) {
        if args.json {
            println!(
                "figures: {}",
                serde_json::to_string(self).unwrap_or_default()
            );
        }
    }
}

pub(super) fn failed(e: impl std::fmt::Display) -> CliError {
    CliError::Failed(e.to_string())
}

pub(super) struct FarmProc {
    pub child: Child,
    pub pid: u32,
    pub session: Option<String>,
    /// Where the farm serves `/metrics`.
    pub metrics: String,
}

impl FarmProc {
    /// Starts `cmd` with its stderr in `log`, killed when dropped.
    fn spawn(cmd: &mut Command, log: std::fs::File, metrics: String) -> Result<Self, CliError> {
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .kill_on_drop(true)
            .spawn()
            .map_err(failed)?;
        Ok(FarmProc {
            pid: child.id().unwrap_or(0),
            child,
            session: None,
            metrics,
        })
    }
}

fn free_port() -> Result<u16, CliError> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(failed)?;
    Ok(l.local_addr().map_err(failed)?.port())
}

/// The `rcfarm` the farms (and a `--server-process` server) run: `--farm-bin`, or the one
/// beside `rcfarm-tools`.
fn farm_exe(farm_bin: Option<&std::path::Path>) -> Result<std::path::PathBuf, CliError> {
    match farm_bin {
        Some(b) => Ok(b.to_path_buf()),
        None => crate::rcfarm_beside(" or pass --farm-bin PATH"),
    }
}

/// Starts `n` farms (`bench-0` …) against `consul`, logging to `dir`, and waits until they
/// registered. They ship the audit log to `dir/audit.db` unless `extra` names an
/// `--audit-db` of its own.
pub(super) async fn spawn_farms(
    consul_url: &str,
    n: usize,
    ttl: Duration,
    dir: &std::path::Path,
    extra: &[&str],
    farm_bin: Option<&std::path::Path>,
) -> Result<Vec<FarmProc>, CliError> {
    let exe = farm_exe(farm_bin)?;
    let audit_db = format!("sqlite://{}", dir.join("audit.db").display());
    let ttl = format!("{}ms", ttl.as_millis());
    let mut farms: Vec<FarmProc> = Vec::new();
    for i in 0..n {
        let log = std::fs::File::create(dir.join(format!("farm-{i}.log"))).map_err(failed)?;
        let http = format!("127.0.0.1:{}", free_port()?);
        let mut cmd = Command::new(&exe);
        cmd.args([
            "serve",
            "--consul",
            consul_url,
            "--farm-id",
            &format!("bench-{i}"),
        ])
        .args(["--http", &http, "--session-ttl", &ttl]);
        if !extra.contains(&"--audit-db") {
            cmd.args(["--audit-db", &audit_db]);
        }
        cmd.args(["--lock-delay", "500ms"])
            // Benchmarks measure how fast farms converge, not their blast-radius limit.
            .args(["--max-removals", "off", "--failsafe-confirm", "0s"])
            .args(extra)
            .env(
                "RUST_LOG",
                std::env::var("RCFARM_BENCH_FARM_LOG").unwrap_or_else(|_| "warn".into()),
            );
        farms.push(FarmProc::spawn(
            &mut cmd,
            log,
            format!("http://{http}/metrics"),
        )?);
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

/// Starts `n` of P2's farms (`p2-rctl-server --consul HOST:PORT`) logging to `dir`. They
/// register nowhere this harness reads, so nothing is awaited.
fn spawn_p2_farms(
    bin: &std::path::Path,
    port: u16,
    n: usize,
    dir: &std::path::Path,
) -> Result<Vec<FarmProc>, CliError> {
    let mut farms = Vec::new();
    for i in 0..n {
        let log = std::fs::File::create(dir.join(format!("p2-farm-{i}.log"))).map_err(failed)?;
        let mut cmd = Command::new(bin);
        cmd.args(["--consul", &format!("127.0.0.1:{port}")]);
        farms.push(FarmProc::spawn(&mut cmd, log, String::new())?);
    }
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
            p.session = Some(f.session.into());
        }
    }
    Ok(())
}

pub(super) fn rss_kib(pid: u32) -> Option<u64> {
    proc_status_kib(pid, "VmRSS:")
}

/// The process's highest RSS so far.
pub(super) fn peak_rss_kib(pid: u32) -> Option<u64> {
    proc_status_kib(pid, "VmHWM:")
}

fn proc_status_kib(pid: u32, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with(field))?
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
        .filter_map(|(id, h)| h.ownership.map(|(s, _)| (id, s.to_string())))
        .collect())
}

pub(super) fn pct(v: &mut [Duration], q: f64) -> f64 {
    v.sort();
    v.get(((v.len().max(1) - 1) as f64 * q) as usize)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// The embedded server run as a process of its own (`rcfarm consul-dev`, `--server-process`).
pub(super) struct ServerProc {
    child: Child,
    pid: u32,
    url: String,
    port: u16,
}

impl ServerProc {
    /// Starts `rcfarm consul-dev` on a free port, its log in `dir/server.log`, and waits for
    /// the line that says where it listens.
    async fn start(
        farm_bin: Option<&std::path::Path>,
        dir: &std::path::Path,
    ) -> Result<Self, CliError> {
        use tokio::io::AsyncBufReadExt as _;
        let exe = farm_exe(farm_bin)?;
        let log = std::fs::File::create(dir.join("server.log")).map_err(failed)?;
        let mut child = Command::new(&exe)
            .args(["consul-dev", "--listen", "127.0.0.1:0"])
            .args(["--session-ttl-min", "1s"])
            .env(
                "RUST_LOG",
                std::env::var("RCFARM_BENCH_FARM_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| failed(format!("cannot start {} consul-dev: {e}", exe.display())))?;
        let pid = child.id().unwrap_or(0);
        let Some(out) = child.stdout.take() else {
            return Err(failed("consul-dev's stdout was not piped"));
        };
        let mut lines = tokio::io::BufReader::new(out).lines();
        let first = tokio::time::timeout(Duration::from_secs(30), async {
            while let Ok(Some(l)) = lines.next_line().await {
                if let Some(url) = l.strip_prefix("consul-dev listening on ") {
                    return Some(url.trim().to_string());
                }
            }
            None
        })
        .await;
        let Ok(Some(url)) = first else {
            return Err(failed(format!(
                "{} consul-dev did not say where it listens within 30 s (its log: {})",
                exe.display(),
                dir.join("server.log").display()
            )));
        };
        let port = url
            .rsplit(':')
            .next()
            .and_then(|p| p.trim_end_matches('/').parse().ok())
            .ok_or_else(|| failed(format!("consul-dev said an address without a port: {url}")))?;
        // Its stdout is read no further: drained in the background so that it never blocks.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(ServerProc {
            child,
            pid,
            url,
            port,
        })
    }

    /// Prints its RSS now and at its peak in MiB (`missing` where the process is gone), and
    /// returns them in KiB.
    fn report_rss(&self, missing: &str) -> (Option<u64>, Option<u64>) {
        let (now, peak) = (rss_kib(self.pid), peak_rss_kib(self.pid));
        let mib =
            |k: Option<u64>| k.map_or(missing.into(), |k| format!("{:.0}", k as f64 / 1024.0));
        eprintln!(
            "the server's RSS now / at its peak (its own process), MiB: {} / {}",
            mib(now),
            mib(peak),
        );
        (now, peak)
    }
}

/// The Consul a benchmark runs against.
pub(super) enum Target {
    Embedded(EmbeddedServer),
    Process(ServerProc),
    Real(Box<ConsulAgent>),
}

impl Target {
    /// The embedded server in this process, or as `rcfarm consul-dev` of `--farm-bin` with
    /// `--server-process`, or a real agent of `--consul-bin`.
    pub(super) async fn start(
        args: &ServerArgs,
        dir: &std::path::Path,
    ) -> Result<Target, CliError> {
        if args.server_process {
            return Ok(Target::Process(
                ServerProc::start(args.farm_bin.as_deref(), dir).await?,
            ));
        }
        Ok(match &args.consul_bin {
            None => Target::Embedded(
                EmbeddedServer::start(ServerConfig {
                    session_ttl_min: Duration::from_secs(1),
                    record_commits: true,
                    ..ServerConfig::ephemeral()
                })
                .await
                .map_err(failed)?,
            ),
            Some(bin) => {
                let mut cfg = AgentConfig::dev(bin, "bench");
                cfg.session_ttl_min = Duration::from_secs(1);
                Target::Real(Box::new(ConsulAgent::start(cfg).await.map_err(failed)?))
            }
        })
    }

    pub(super) fn url(&self) -> String {
        match self {
            Target::Embedded(s) => s.url(),
            Target::Process(p) => p.url.clone(),
            Target::Real(a) => a.http_url(),
        }
    }

    fn port(&self) -> u16 {
        match self {
            Target::Embedded(s) => s.addr().port(),
            Target::Process(p) => p.port,
            Target::Real(a) => a.ports.http,
        }
    }

    pub(super) fn name(&self) -> &'static str {
        match self {
            Target::Embedded(_) => "embedded",
            Target::Process(_) => "embedded (own process)",
            Target::Real(_) => "consul",
        }
    }

    /// CPU time of the Consul process (the embedded server shares this process).
    pub(super) fn cpu(&self) -> Option<Duration> {
        match self {
            Target::Embedded(_) => None,
            Target::Process(p) => bench_probe::cpu_time(p.pid),
            Target::Real(a) => bench_probe::cpu_time(a.pid()?),
        }
    }

    pub(super) async fn count(&self, consul: &Consul, prefix: &str) -> usize {
        match self {
            Target::Embedded(s) => s.count_prefix(prefix),
            Target::Process(_) | Target::Real(_) => consul
                .kv_keys(prefix, None, &QueryOptions::default())
                .await
                .map_or(0, |(k, _)| k.len()),
        }
    }

    /// Whether every one of `pods` pods has its intent and labels (beside `other_labels` pod
    /// labels of no RC's). A count walks every key under the prefix (Consul's listing over
    /// HTTP, or the embedded server in this process): every 20 ms it would be a load of its
    /// own (at 400,000 pods on the embedded server, a tenth of the machine taken from the
    /// farms it times), so above 10,000 pods it is polled every 250 ms (±0.25 s). Over HTTP
    /// each poll is two whole key listings (some 60 MiB of JSON at a million pods, built by
    /// the server whose memory is measured), so above 200,000 pods it polls every second
    /// (±1 s).
    async fn every_pod_written(&self, consul: &Consul, pods: usize, other_labels: usize) -> bool {
        let over_http = !matches!(self, Target::Embedded(_));
        if over_http && pods > 200_000 {
            tokio::time::sleep(Duration::from_millis(980)).await;
        } else if pods > 10_000 {
            tokio::time::sleep(Duration::from_millis(230)).await;
        }
        self.count(consul, "intent/").await == pods
            && self.count(consul, "labels/pod/").await == pods + other_labels
    }

    pub(super) async fn shutdown(self) {
        match self {
            Target::Embedded(s) => s.shutdown().await,
            Target::Process(mut p) => {
                let _ = p.child.start_kill();
                let _ = p.child.wait().await;
            }
            Target::Real(mut a) => a.kill().await,
        }
    }
}

/// Sum over the farms of a counter, by label value.
pub(super) async fn farm_counter(
    http: &reqwest::Client,
    farms: &[FarmProc],
    metric: &str,
    label: &str,
) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for f in farms {
        if let Some(m) = bench_probe::scrape_counter(http, &f.metrics, metric, label).await {
            for (k, v) in m {
                *out.entry(k).or_insert(0.0) += v;
            }
        }
    }
    out
}

/// Bytes of the farms' watch answers (and of the record reads that stand in for one), by watch.
async fn watch_bytes(http: &reqwest::Client, farms: &[FarmProc]) -> BTreeMap<String, f64> {
    farm_counter(
        http,
        farms,
        "rcfarm_consul_watch_answer_bytes_total",
        "watch",
    )
    .await
}

/// The audit shipper's time by stage, summed over the farms: `list S N, read S N, …` (seconds
/// in all, times).
pub(super) async fn ship_stages(http: &reqwest::Client, farms: &[FarmProc]) -> String {
    let metric = "rcfarm_audit_ship_stage_seconds";
    let sum = farm_counter(http, farms, &format!("{metric}_sum"), "stage").await;
    let count = farm_counter(http, farms, &format!("{metric}_count"), "stage").await;
    ["list", "read", "store", "delete"]
        .iter()
        .map(|k| {
            format!(
                "{k} {:.2} {:.0}",
                sum.get(*k).copied().unwrap_or(0.0),
                count.get(*k).copied().unwrap_or(0.0)
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

pub(super) fn total(m: &BTreeMap<String, f64>) -> f64 {
    m.values().fold(0.0, |a, v| a + v)
}

pub async fn run(args: BenchFarmArgs) -> Result<(), CliError> {
    if args.compare.is_empty() {
        let fig = run_once(&args).await?;
        fig.print_json(&args);
        Ok(())
    } else {
        compare(&args).await
    }
}

/// `--compare`: one run per farm count, then the table.
async fn compare(args: &BenchFarmArgs) -> Result<(), CliError> {
    let mut runs = Vec::new();
    for &f in &args.compare {
        let a = BenchFarmArgs {
            farms: f,
            compare: Vec::new(),
            ..args.clone()
        };
        let fig = run_once(&a).await?;
        eprintln!("F = {f}: {fig:?}");
        fig.print_json(args);
        runs.push(fig);
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    let row = |name: &str, unit: &str, get: &dyn Fn(&Figures) -> Option<f64>, goal: &str| {
        let vals: Vec<Option<f64>> = runs.iter().map(get).collect();
        let cells: Vec<String> = vals
            .iter()
            .map(|v| v.map_or("n/a".into(), |v| format!("{v:.2}{unit}")))
            .collect();
        let ratio = match (
            vals.first().copied().flatten(),
            vals.last().copied().flatten(),
        ) {
            (Some(a), Some(b)) if a > 0.0 => format!("{:.2}×", b / a),
            _ => "n/a".into(),
        };
        println!("| {name} | {} | {ratio} | {goal} |", cells.join(" | "));
    };
    println!(
        "\n| {} {}×{} on {} nodes | {} | ratio | goal |\n|---|{}---|---|",
        if args.server.consul_bin.is_some() {
            "real Consul,"
        } else if args.server.server_process {
            "embedded (own process),"
        } else {
            "embedded,"
        },
        args.rcs,
        args.replicas,
        args.nodes,
        runs.iter()
            .map(|r| format!("F = {}", r.farms))
            .collect::<Vec<_>>()
            .join(" | "),
        "---|".repeat(runs.len()),
    );
    row("converge", " s", &|r| Some(r.converge), "≤ 1.15×");
    row("RCs written in", " s", &|r| Some(r.written_in), "");
    row("MiB read by all farms", "", &|r| Some(r.mib_read), "≤ 1.2×");
    row(
        "farms' CPU-seconds, all farms",
        "",
        &|r| Some(r.farm_cpu),
        "≤ 1.1×",
    );
    let consul = if args.server.consul_bin.is_some() {
        "Consul CPU-seconds"
    } else if args.server.server_process {
        "the server's CPU-seconds"
    } else {
        "this process's CPU-seconds (embedded server and writer)"
    };
    row(consul, "", &|r| r.consul_cpu, "≤ 1.1×");
    row(
        "steady RSS per non-shipping farm, mean",
        " MiB",
        &|r| Some(mean(&r.rss)),
        "≤ 0.6×",
    );
    row(
        "worst peak / steady",
        "",
        &|r| Some(max(&r.peak_ratio)),
        "≤ 1.25 each",
    );
    Ok(())
}

/// Where a benchmark keeps its logs and audit database: `log_dir`, or a temporary directory
/// removed when the returned guard is dropped.
pub(super) fn work_dir(
    log_dir: Option<&std::path::Path>,
) -> Result<(tempfile::TempDir, std::path::PathBuf), CliError> {
    let tmp = tempfile::tempdir().map_err(failed)?;
    let dir = match log_dir {
        Some(d) => {
            std::fs::create_dir_all(d).map_err(failed)?;
            d.to_path_buf()
        }
        None => tmp.path().to_path_buf(),
    };
    Ok((tmp, dir))
}

/// One run of the benchmark with `args.farms` farms.
async fn run_once(args: &BenchFarmArgs) -> Result<Figures, CliError> {
    let args = args.clone();
    let (_tmp, dir) = work_dir(args.log_dir.as_deref())?;
    let target = Target::start(&args.server, &dir).await?;
    let consul = Consul::new(ConsulConfig::new(target.url())).map_err(failed)?;
    let scraper = reqwest::Client::new();

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

    if args.floor {
        return floor(&args, target, &consul)
            .await
            .map(|_| Figures::default());
    }
    if args.prewritten || args.restart {
        return started_on_a_full_cluster(&args, target, &consul, &dir).await;
    }

    // Farms.
    let max_conns = args.consul_max_conns.to_string();
    let mut extra = vec!["--resync-interval", "30s", "--consistency-interval", "60s"];
    if args.consul_max_conns > 0 {
        extra.extend(["--consul-max-conns", &max_conns]);
    }
    let mut farms = spawn_farms(
        &target.url(),
        args.farms,
        args.session_ttl,
        dir.as_path(),
        &extra,
        args.server.farm_bin.as_deref(),
    )
    .await?;
    farm_sessions(&consul, &mut farms).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_idle: Vec<u64> = farms.iter().filter_map(|f| rss_kib(f.pid)).collect();

    // RCs, written as P2 tools do (raw records), 63 per transaction.
    let ids: Vec<RcId> = (0..args.rcs).map(|_| RcId::new()).collect();
    let ops: Vec<TxnOp> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| rc_record(*id, i, args.replicas))
        .collect();
    let pods = args.rcs * args.replicas;
    let req0 = farm_counter(&scraper, &farms, "rcfarm_consul_requests_total", "endpoint").await;
    let cpu0 = target.cpu();
    let farm_cpu_start: Vec<Option<Duration>> =
        farms.iter().map(|f| bench_probe::cpu_time(f.pid)).collect();
    let own_cpu0 = bench_probe::cpu_time(std::process::id());
    let t0 = Instant::now();
    for chunk in ops.chunks(63) {
        consul.txn(chunk).await.map_err(failed)?;
    }
    let written_in = t0.elapsed().as_secs_f64();
    eprintln!(
        "the {} RCs were written in {written_in:.2} s (while the farms worked)",
        args.rcs,
    );

    // Connections, sampled while the farms converge.
    let sampling = tokio_util::sync::CancellationToken::new();
    let pids: Vec<u32> = farms.iter().map(|f| f.pid).collect();
    let port = target.port();
    let sampler = {
        let stop = sampling.clone();
        let pids = pids.clone();
        tokio::task::spawn_blocking(move || {
            let mut peak = vec![0usize; pids.len()];
            while !stop.is_cancelled() {
                let now = bench_probe::connections_of(&pids, port);
                for (p, n) in peak.iter_mut().zip(now) {
                    *p = (*p).max(n);
                }
                // A farm's connections last at least a request; 50 ms catches its peak without
                // the sampler competing with the farms for the machine.
                std::thread::sleep(Duration::from_millis(50));
            }
            peak
        })
    };
    // The sampler runs on a blocking thread, which the runtime waits for at exit: it must
    // stop on every return, an early one included, or the benchmark never exits.
    let _stop_sampling = sampling.clone().drop_guard();
    let (tgt, c) = (&target, &consul);
    let converge = match wait_until(args.timeout, "convergence", || {
        tgt.every_pod_written(c, pods, 0)
    })
    .await
    {
        Ok(d) => d.max(t0.elapsed()),
        Err(e) => {
            so_far(&target, &consul, &scraper, &farms, pods).await;
            return Err(e);
        }
    };
    let consul_cpu = match (cpu0, target.cpu()) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    let own_cpu = match (own_cpu0, bench_probe::cpu_time(std::process::id())) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    eprintln!(
        "converged: every pod's intent and labels written {:.2} s from the start",
        converge.as_secs_f64()
    );
    let mut figures = Figures {
        farms: args.farms,
        converge: converge.as_secs_f64(),
        written_in,
        consul_cpu: consul_cpu.or(own_cpu).map(|d| d.as_secs_f64()),
        ..Default::default()
    };
    let farm_cpu: Vec<f64> = farms
        .iter()
        .zip(&farm_cpu_start)
        .filter_map(|(f, c0)| {
            Some(
                bench_probe::cpu_time(f.pid)?
                    .saturating_sub((*c0)?)
                    .as_secs_f64(),
            )
        })
        .collect();
    figures.farm_cpu = farm_cpu.iter().sum();
    eprintln!(
        "farms' CPU while converging: {:.1} s in all ({} s each)",
        farm_cpu.iter().sum::<f64>(),
        farm_cpu
            .iter()
            .map(|c| format!("{c:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let req1 = farm_counter(&scraper, &farms, "rcfarm_consul_requests_total", "endpoint").await;
    let by_endpoint: Vec<String> = req1
        .iter()
        .map(|(k, v)| format!("{k} {:.0}", v - req0.get(k).copied().unwrap_or(0.0)))
        .collect();
    let watch_bytes = watch_bytes(&scraper, &farms).await;
    let watch_answers = farm_counter(
        &scraper,
        &farms,
        "rcfarm_consul_watch_answers_total",
        "watch",
    )
    .await;
    figures.mib_read = total(&watch_bytes) / (1 << 20) as f64;
    eprintln!(
        "watch answers of all farms until converged (count, MiB): {}",
        watch_answers
            .iter()
            .map(|(k, n)| format!(
                "{k} {n:.0} {:.1}",
                watch_bytes.get(k).copied().unwrap_or(0.0) / (1 << 20) as f64
            ))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let conflicts =
        total(&farm_counter(&scraper, &farms, "rcfarm_claim_conflicts_total", "").await);
    let handovers = total(&farm_counter(&scraper, &farms, "rcfarm_rcs_released_total", "").await);
    eprintln!(
        "claim transactions refused (a lock held already): {conflicts:.0}; RCs handed over: {handovers:.0}"
    );
    let converge_requests = total(&req1) - total(&req0);
    let requests_per_rc = converge_requests / args.rcs as f64;

    // Change → write latency, one change at a time (the embedded server's commit log shows
    // when the write landed).
    let mut latencies = Vec::new();
    if let Target::Embedded(server) = &target {
        for (k, &id) in ids.iter().enumerate().take(args.changes) {
            let (e, _) = consul
                .kv_get(&id.key(), &QueryOptions::default())
                .await
                .map_err(failed)?;
            let Some(e) = e else { continue };
            let mut v: serde_json::Value =
                serde_json::from_slice(e.value_bytes()).map_err(failed)?;
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
            let pod = format!("/bench-{k}");
            let is_write = |c: &crate::server::LoggedCommit| {
                c.index > index
                    && c.changes.iter().any(|ch| {
                        matches!(ch, Change::Put(key, _) if key.starts_with("intent/") && key.ends_with(&pod))
                    })
            };
            let written = wait_until(Duration::from_secs(30), "the farm's write", || async {
                server
                    .commit_log()
                    .iter()
                    .rev()
                    .take_while(|c| c.index > index)
                    .any(is_write)
            })
            .await;
            if written.is_ok()
                && let Some(c) = server.commit_log().iter().find(|c| is_write(c))
            {
                latencies.push(c.at.saturating_duration_since(sent));
            }
        }
    }

    if !latencies.is_empty() {
        figures.change_p99_ms = Some(pct(&mut latencies.clone(), 0.99));
    }

    // Idle: let the outbox drain, then watch. A backlog that does not drain in time is
    // reported, not fatal: the idle figures that follow then include its shipping.
    let backlog = tgt.count(c, "audit_logs/").await;
    match wait_until(
        Duration::from_secs(120),
        "the audit outbox to drain",
        || async move { tgt.count(c, "audit_logs/").await == 0 },
    )
    .await
    {
        Ok(d) => eprintln!(
            "audit outbox: {backlog} records left at convergence, shipped in {:.1} s after",
            d.as_secs_f64()
        ),
        Err(e) => eprintln!(
            "audit outbox: {backlog} records left at convergence, {} still left: {e}",
            tgt.count(c, "audit_logs/").await
        ),
    }
    // The goal is the outbox shipped as fast as it fills: every record shipped so far over
    // the time from the first RC written until the outbox was empty (or now, if it is not).
    let shipped = total(&farm_counter(&scraper, &farms, "rcfarm_audit_shipped_total", "").await);
    let since_start = t0.elapsed().as_secs_f64();
    eprintln!(
        "audit records shipped to SQL: {shipped:.0} in {since_start:.1} s from the start ({:.0} records/s)",
        shipped / since_start.max(0.001)
    );
    // Where the shipper's time went, stage by stage (only the shipping farm has any).
    eprintln!(
        "audit shipping by stage (seconds in all, times): {}",
        ship_stages(&scraper, &farms).await
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    sampling.cancel();
    let peak_conns = sampler.await.map_err(failed)?;
    let idle_by0 = farm_counter(&scraper, &farms, "rcfarm_consul_requests_total", "endpoint").await;
    let idle_req0 = total(&idle_by0);
    let farm_cpu0: Vec<Option<Duration>> =
        farms.iter().map(|f| bench_probe::cpu_time(f.pid)).collect();
    let consul_idle0 = target.cpu();
    tokio::time::sleep(args.idle).await;
    let idle_by1 = farm_counter(&scraper, &farms, "rcfarm_consul_requests_total", "endpoint").await;
    let idle_req1 = total(&idle_by1);
    let idle_by_endpoint: Vec<String> = idle_by1
        .iter()
        .map(|(k, v)| format!("{k} {:.0}", v - idle_by0.get(k).copied().unwrap_or(0.0)))
        .collect();
    let idle_rps = (idle_req1 - idle_req0) / args.farms as f64 / args.idle.as_secs_f64();
    let farm_cpu_pct: Vec<f64> = farms
        .iter()
        .zip(&farm_cpu0)
        .filter_map(|(f, c0)| {
            let d = bench_probe::cpu_time(f.pid)?.saturating_sub((*c0)?);
            Some(d.as_secs_f64() / args.idle.as_secs_f64() * 100.0)
        })
        .collect();
    let consul_idle_pct = match (consul_idle0, target.cpu()) {
        (Some(a), Some(b)) => {
            Some(b.saturating_sub(a).as_secs_f64() / args.idle.as_secs_f64() * 100.0)
        }
        _ => None,
    };
    let idle_conns = bench_probe::connections_of(&pids, port);
    let time_wait = bench_probe::time_wait_to(port);
    let losses = total(&farm_counter(&scraper, &farms, "rcfarm_session_losses_total", "").await);
    let rss: Vec<u64> = farms.iter().filter_map(|f| rss_kib(f.pid)).collect();
    let rss_mib = rss.iter().sum::<u64>() as f64 / rss.len().max(1) as f64 / 1024.0;
    let above_idle = rss
        .iter()
        .sum::<u64>()
        .saturating_sub(rss_idle.iter().sum::<u64>());
    let rss_per_rc_kib = above_idle as f64 / args.rcs as f64;
    let peak_rss: Vec<String> = farms
        .iter()
        .filter_map(|f| peak_rss_kib(f.pid))
        .map(|k| format!("{:.0}", k as f64 / 1024.0))
        .collect();
    eprintln!(
        "farms' anonymous RSS now (RssAnon: without the mapped binary), MiB: {}",
        farms
            .iter()
            .filter_map(|f| proc_status_kib(f.pid, "RssAnon:"))
            .map(|k| format!("{:.0}", k as f64 / 1024.0))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let shippers = farm_gauges(&scraper, &farms, "rcfarm_audit_shipper").await;
    for (f, shipping) in farms.iter().zip(&shippers) {
        if !shipping && let (Some(now), Some(peak)) = (rss_kib(f.pid), peak_rss_kib(f.pid)) {
            figures.rss.push(now as f64 / 1024.0);
            figures.peak_rss.push(peak as f64 / 1024.0);
            figures.peak_ratio.push(peak as f64 / now.max(1) as f64);
        }
    }
    eprintln!(
        "farms' RSS now / at their peak (VmHWM), MiB: {} / {}",
        rss.iter()
            .map(|k| format!("{:.0}", *k as f64 / 1024.0))
            .collect::<Vec<_>>()
            .join(", "),
        peak_rss.join(", ")
    );
    if let Target::Process(p) = &target {
        // Issue 46: "the server ≤ 1.5 GiB", measured on its own process.
        let (now, peak) = p.report_rss("n/a");
        figures.server_rss = now.map(|k| k as f64 / 1024.0);
        figures.server_peak_rss = peak.map(|k| k as f64 / 1024.0);
    }
    if matches!(target, Target::Embedded(_)) {
        // The embedded server lives in this process with the writer: this process's figures
        // bound the server's from above (issue 46: "the server ≤ 1.5 GiB"; `--server-process`
        // measures it alone).
        let me = std::process::id();
        eprintln!(
            "this process's RSS now / at its peak (embedded server and writer), MiB: {} / {}",
            rss_kib(me).map_or("n/a".into(), |k| format!("{:.0}", k as f64 / 1024.0)),
            peak_rss_kib(me).map_or("n/a".into(), |k| format!("{:.0}", k as f64 / 1024.0)),
        );
    }

    // Handover and failover need another farm to take over. One that times out is reported
    // with the row (n/a) and fails the run after it (the error printed at exit): the figures
    // so far are not lost.
    let (mut handover, mut failover) = (None, None);
    let mut timed_out = None;
    'takeovers: {
        if args.farms < 2 {
            break 'takeovers;
        }
        let before_handover =
            total(&farm_counter(&scraper, &farms[1..], "rcfarm_rc_pass_errors_total", "").await);
        let gone = farms[0].session.clone().unwrap_or_default();
        signal(farms[0].pid, "TERM");
        let n = args.rcs;
        let survivors = &farms[1..];
        let limit = Duration::from_secs(60);
        match moved_from(c, &scraper, survivors, n, &gone, limit, "handover").await {
            Ok(d) => handover = Some(d),
            Err(e) => {
                // Farm 0 may still be handing over: no kill -9 of another on top of it.
                timed_out = Some(e);
                break 'takeovers;
            }
        }
        let _ = farms[0].child.wait().await;
        // The new owners' first passes follow the handover by a moment: a pass planned
        // without the pods the old owner wrote has every write refused.
        let settle = Duration::from_secs(3);
        tokio::time::sleep(settle).await;
        let after =
            total(&farm_counter(&scraper, &farms[1..], "rcfarm_rc_pass_errors_total", "").await);
        println!(
            "RC passes failed by the SIGTERM handover's new owners ({} s after it; before it: {:.0}): {:.0}",
            settle.as_secs(),
            before_handover,
            after - before_handover
        );
        // A kill -9 needs a third farm to take over: with two, the one left is the one killed
        // (the failover is then n/a, not a timeout).
        if args.farms < 3 {
            break 'takeovers;
        }
        let gone = farms[1].session.clone().unwrap_or_default();
        signal(farms[1].pid, "KILL");
        let limit = args.session_ttl * 4 + Duration::from_secs(30);
        let survivors = &farms[2..];
        match moved_from(c, &scraper, survivors, n, &gone, limit, "kill -9 failover").await {
            Ok(d) => failover = Some(d),
            Err(e) => timed_out = Some(e),
        }
    }
    for f in &mut farms {
        let _ = f.child.start_kill();
    }

    let secs =
        |d: Option<Duration>| d.map_or("n/a".to_string(), |d| format!("{:.2}", d.as_secs_f64()));
    let list = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.0}"))
            .collect::<Vec<_>>()
            .join("/")
    };
    let ints = |v: &[usize]| {
        v.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join("/")
    };
    let lat = if latencies.is_empty() {
        "n/a".to_string()
    } else {
        format!(
            "{:.1} / {:.1}",
            pct(&mut latencies.clone(), 0.5),
            pct(&mut latencies, 0.99)
        )
    };
    eprintln!(
        "requests while converging, by endpoint: {}",
        by_endpoint.join(", ")
    );
    eprintln!(
        "requests of all farms while idle for {:?}, by endpoint: {}",
        args.idle,
        idle_by_endpoint.join(", ")
    );
    println!(
        "| {} | {} | {}×{} | {} | {:.2} | {:.0} | {:.2} | {} | {} | {} | {} | {} | {:.2} | {} | {} | {:.0} | {:.1} | {} | {:.0} |",
        target.name(),
        args.farms,
        args.rcs,
        args.replicas,
        args.nodes,
        converge.as_secs_f64(),
        pods as f64 / converge.as_secs_f64(),
        requests_per_rc,
        lat,
        secs(handover),
        secs(failover),
        ints(&peak_conns),
        ints(&idle_conns),
        idle_rps,
        list(&farm_cpu_pct),
        match (consul_cpu, consul_idle_pct) {
            (Some(c), Some(i)) => format!("{:.1} s / {i:.1} %", c.as_secs_f64()),
            _ => "n/a".into(),
        },
        rss_mib,
        rss_per_rc_kib,
        time_wait,
        losses,
    );
    target.shutdown().await;
    match timed_out {
        Some(e) => Err(e),
        None => Ok(figures),
    }
}

/// Waits until the `n` RCs are held, none by the session `gone`: the lock tree says so, read
/// once the `survivors` say they serve `n` RCs between them (`rcfarm_owned_rcs`, set after
/// each reconcile's claims). The lock tree is the proof; the farms' gauges only say when to
/// look. Read every 20 ms, the lock tree (34-45 MB at 200,000 RCs) made this wait a third
/// whole-tree reader, back to back, on the server being measured.
async fn moved_from(
    c: &Consul,
    http: &reqwest::Client,
    survivors: &[FarmProc],
    n: usize,
    gone: &str,
    limit: Duration,
    what: &str,
) -> Result<Duration, CliError> {
    wait_until(limit, what, || async move {
        let owned = total(&farm_counter(http, survivors, "rcfarm_owned_rcs", "").await);
        owned >= n as f64
            && owners(c)
                .await
                .is_ok_and(|o| o.len() == n && o.values().all(|s| s != gone))
    })
    .await
}

/// What a run that timed out got to: pods written, and each farm's CPU, RSS and bytes read.
async fn so_far(
    target: &Target,
    consul: &Consul,
    http: &reqwest::Client,
    farms: &[FarmProc],
    pods: usize,
) {
    let cpu: f64 = farms
        .iter()
        .filter_map(|f| bench_probe::cpu_time(f.pid))
        .map(|d| d.as_secs_f64())
        .sum();
    let rss: Vec<String> = farms
        .iter()
        .map(|f| {
            let mib =
                |k: Option<u64>| k.map_or("gone".into(), |k| format!("{:.0}", k as f64 / 1024.0));
            format!("{} / {}", mib(rss_kib(f.pid)), mib(peak_rss_kib(f.pid)))
        })
        .collect();
    println!(
        "| {} | timed out | {} farms | intents {} and pod labels {} of {pods} | farms' CPU {cpu:.1} s | RSS now / peak MiB: {} | MiB read {:.0} |",
        target.name(),
        farms.len(),
        target.count(consul, "intent/").await,
        target.count(consul, "labels/pod/").await,
        rss.join(", "),
        total(&watch_bytes(http, farms).await) / (1 << 20) as f64,
    );
    if let Target::Process(p) = target {
        p.report_rss("gone");
    }
}

/// Whether each farm's gauge `metric` is non-zero.
async fn farm_gauges(http: &reqwest::Client, farms: &[FarmProc], metric: &str) -> Vec<bool> {
    let mut out = Vec::new();
    for f in farms {
        let v = bench_probe::scrape_counter(http, &f.metrics, metric, "")
            .await
            .is_some_and(|m| m.values().sum::<f64>() > 0.0);
        out.push(v);
    }
    out
}

/// `--prewritten`: every RC and pod written, then the farms started on the full cluster, timed
/// until every RC is held. `--restart`: every RC written (no pod), then the farms started,
/// timed from their exec until every pod is written.
async fn started_on_a_full_cluster(
    args: &BenchFarmArgs,
    target: Target,
    consul: &Consul,
    dir: &std::path::Path,
) -> Result<Figures, CliError> {
    let pods = args.rcs * args.replicas;
    let mut ops = Vec::new();
    for n in 0..args.rcs {
        let id = RcId::new();
        ops.push(vec![rc_record(id, n, args.replicas)]);
        if args.restart {
            continue;
        }
        let pod = format!("bench-{n}");
        let labels: LabelSet = [
            (crate::rc::POD_ID_LABEL.to_string(), pod.clone()),
            (crate::rc::RC_ID_LABEL.to_string(), id.to_string()),
        ]
        .into();
        let mut pod_ops = Vec::new();
        for r in 0..args.replicas {
            let node = format!("node-{:05}", (n * args.replicas + r) % args.nodes.max(1));
            pod_ops.push(TxnOp::set(
                crate::rctask::intent_key(&node, &pod),
                bench_manifest(n).into_bytes(),
            ));
            pod_ops.push(LabelStore::set_op(
                LabelType::Pod,
                &crate::labels::pod_label_id(&node, &pod),
                &labels,
            ));
        }
        ops.push(pod_ops);
    }
    let t = Instant::now();
    let mut batch: Vec<TxnOp> = Vec::new();
    for group in ops {
        if batch.len() + group.len() > 63 {
            consul.txn(&batch).await.map_err(failed)?;
            batch.clear();
        }
        batch.extend(group);
    }
    // P2's farm schedules nothing while `labels/pod/` is empty, so a restart run writes one
    // pod label of no RC's, for every build alike: the same cluster for P2's farm and rcfarm's.
    let other_labels = usize::from(args.restart);
    if args.restart {
        let labels: LabelSet = [(crate::rc::POD_ID_LABEL.to_string(), "other".to_string())].into();
        batch.push(LabelStore::set_op(
            LabelType::Pod,
            &crate::labels::pod_label_id("bench-other-node", "other"),
            &labels,
        ));
    }
    if !batch.is_empty() {
        consul.txn(&batch).await.map_err(failed)?;
    }
    eprintln!(
        "{} RCs and {} pods written in {:.1} s, before any farm",
        args.rcs,
        if args.restart { 0 } else { pods },
        t.elapsed().as_secs_f64()
    );
    let extra = ["--resync-interval", "30s", "--consistency-interval", "60s"];
    let scraper = reqwest::Client::new();
    let cpu0 = target.cpu();
    let t0 = Instant::now();
    let mut farms = match &args.p2_farm_bin {
        Some(bin) => spawn_p2_farms(bin, target.port(), args.farms, dir)?,
        None => {
            spawn_farms(
                &target.url(),
                args.farms,
                args.session_ttl,
                dir,
                &extra,
                args.server.farm_bin.as_deref(),
            )
            .await?
        }
    };
    let n = args.rcs;
    let c = consul.clone();
    let held = if args.restart {
        match wait_until(args.timeout, "every pod written", || {
            target.every_pod_written(consul, pods, other_labels)
        })
        .await
        {
            Ok(d) => d,
            Err(e) => {
                so_far(&target, consul, &scraper, &farms, pods).await;
                return Err(e);
            }
        }
    } else {
        wait_until(args.timeout, "every RC held", || {
            let c = c.clone();
            async move { owners(&c).await.is_ok_and(|o| o.len() == n) }
        })
        .await?
    }
    .max(t0.elapsed());
    let consul_cpu = match (cpu0, target.cpu()) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a).as_secs_f64()),
        _ => None,
    };
    tokio::time::sleep(args.idle).await;
    let intents = target.count(consul, "intent/").await;
    let shippers = farm_gauges(&scraper, &farms, "rcfarm_audit_shipper").await;
    let mut figures = Figures {
        farms: args.farms,
        converge: held.as_secs_f64(),
        consul_cpu,
        ..Default::default()
    };
    let mut cells = Vec::new();
    for (f, shipping) in farms.iter().zip(&shippers) {
        let (Some(now), Some(peak)) = (rss_kib(f.pid), peak_rss_kib(f.pid)) else {
            continue;
        };
        let ratio = peak as f64 / now.max(1) as f64;
        cells.push(format!(
            "{:.0} / {:.0}{}",
            now as f64 / 1024.0,
            peak as f64 / 1024.0,
            if *shipping { " (ships)" } else { "" }
        ));
        // All of it: the farms were started for this run, and the time runs from their exec.
        if let Some(cpu) = bench_probe::cpu_time(f.pid) {
            figures.farm_cpu += cpu.as_secs_f64();
        }
        if !shipping {
            figures.rss.push(now as f64 / 1024.0);
            figures.peak_rss.push(peak as f64 / 1024.0);
            figures.peak_ratio.push(ratio);
        }
    }
    let bytes = watch_bytes(&scraper, &farms).await;
    figures.mib_read = total(&bytes) / (1 << 20) as f64;
    if args.p2_farm_bin.is_none() {
        let requests =
            farm_counter(&scraper, &farms, "rcfarm_consul_requests_total", "endpoint").await;
        let answers = farm_counter(
            &scraper,
            &farms,
            "rcfarm_consul_watch_answers_total",
            "watch",
        )
        .await;
        let list = |m: &BTreeMap<String, f64>, f: &dyn Fn(&str, f64) -> String| {
            m.iter()
                .map(|(k, v)| f(k, *v))
                .collect::<Vec<_>>()
                .join(", ")
        };
        eprintln!(
            "farms' Consul requests by endpoint: {}",
            list(&requests, &|k, v| format!("{k} {v:.0}"))
        );
        eprintln!(
            "watch answers (count, MiB): {}",
            list(&answers, &|k, v| format!(
                "{k} {v:.0} {:.1}",
                bytes.get(k).copied().unwrap_or(0.0) / (1 << 20) as f64
            ))
        );
    }
    let (mode, until) = if args.p2_farm_bin.is_some() {
        (
            "restart, P2's farm",
            "every pod written from the farms' exec in",
        )
    } else if args.restart {
        ("restart", "every pod written from the farms' exec in")
    } else {
        ("prewritten", "every RC held in")
    };
    println!(
        "| {} | {mode}, {} farms | {}×{} | {} | {until} {:.2} s | intents after: {intents} of {pods} | RSS steady / peak MiB: {} | worst peak/steady {:.2} | farms' CPU {:.1} s | Consul CPU {} | MiB read {:.0} |",
        target.name(),
        args.farms,
        args.rcs,
        args.replicas,
        args.nodes,
        figures.converge,
        cells.join(", "),
        figures.peak_ratio.iter().copied().fold(0.0, f64::max),
        figures.farm_cpu,
        consul_cpu.map_or("n/a".into(), |c| format!("{c:.1} s")),
        figures.mib_read,
    );
    for f in &mut farms {
        let _ = f.child.start_kill();
    }
    target.shutdown().await;
    Ok(figures)
}

/// The header of the table rows `run` prints.
pub fn header() -> &'static str {
    "| Consul | farms | RCs×replicas | nodes | converge s | pods/s | Consul req/RC | change→write p50 / p99 ms | SIGTERM handover s | kill -9 failover s | peak conns/farm | idle conns/farm | idle req/s/farm | idle CPU %/farm | Consul CPU converging / idle | RSS MiB/farm | RSS KiB/owned RC above idle | TIME-WAIT | session losses |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
}

/// The manifest of the benchmark's `i`th RC.
fn bench_manifest(i: usize) -> String {
    format!("id: bench-{i}\nlaunchables: {{}}\n")
}

/// The benchmark's `i`th RC record, created as P2's tools write it (raw JSON, create-only).
fn rc_record(id: RcId, i: usize, replicas: usize) -> TxnOp {
    let record = json!({
        "id": id.to_string(), "manifest": bench_manifest(i), "node_selector": "env=prod",
        "pod_labels": {}, "replicas_desired": replicas, "disabled": false, "allocation_strategy": "static_strategy",
    });
    TxnOp::cas(id.key(), record.to_string().into_bytes(), 0)
}

/// `--floor`: the farms' writes without the farms (see [`BenchFarmArgs::floor`]).
async fn floor(args: &BenchFarmArgs, target: Target, consul: &Consul) -> Result<(), CliError> {
    let rcs: Vec<(RcId, String)> = (0..args.rcs)
        .map(|i| (RcId::new(), bench_manifest(i)))
        .collect();
    let records: Vec<TxnOp> = rcs
        .iter()
        .enumerate()
        .map(|(i, (id, _))| rc_record(*id, i, args.replicas))
        .collect();
    for chunk in records.chunks(63) {
        consul.txn(chunk).await.map_err(failed)?;
    }
    let (entries, _) = consul
        .kv_list(crate::rc::RC_PREFIX, &QueryOptions::default())
        .await
        .map_err(failed)?;
    let index: BTreeMap<&str, u64> = entries
        .iter()
        .map(|e| (e.key.as_str(), e.modify_index))
        .collect();
    // What a farm commits for a new RC: its record's index checked, an intent and a label
    // entry per pod, and the audit record (the ownership check is a check on one more key).
    let mut writes = Vec::new();
    for (n, (id, manifest)) in rcs.iter().enumerate() {
        let key = id.key();
        let mut ops = vec![TxnOp::check_index(
            key.clone(),
            index.get(key.as_str()).copied().unwrap_or(0),
        )];
        let pod = format!("bench-{n}");
        let labels: LabelSet = [
            (crate::rc::POD_ID_LABEL.to_string(), pod.clone()),
            (crate::rc::RC_ID_LABEL.to_string(), id.to_string()),
        ]
        .into();
        for r in 0..args.replicas {
            let node = format!("node-{:05}", (n * args.replicas + r) % args.nodes.max(1));
            ops.push(TxnOp::set(
                crate::rctask::intent_key(&node, &pod),
                manifest.as_bytes().to_vec(),
            ));
            ops.push(LabelStore::set_op(
                LabelType::Pod,
                &crate::labels::pod_label_id(&node, &pod),
                &labels,
            ));
        }
        ops.push(
            crate::audit::AuditRecord::new(
                crate::audit::events::RC_RETARGET,
                json!({ "replication_controller_id": id.to_string(), "pod_id": pod }),
            )
            .txn_op(),
        );
        writes.push(ops);
    }
    let clients: Vec<Consul> = (0..args.farms.max(1))
        .map(|_| {
            let mut cfg = ConsulConfig::new(target.url());
            if args.consul_max_conns > 0 {
                cfg.max_conns = args.consul_max_conns;
            }
            Consul::new(cfg).map_err(failed)
        })
        .collect::<Result<_, _>>()?;
    let pods = args.rcs * args.replicas;
    let cpu0 = target.cpu();
    let t0 = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (n, ops) in writes.into_iter().enumerate() {
        let c = clients[n % clients.len()].clone();
        tasks.spawn(async move { c.txn_coalesced(ops).await });
    }
    while let Some(r) = tasks.join_next().await {
        r.map_err(failed)?.map_err(failed)?;
    }
    let took = t0.elapsed();
    let consul_cpu = match (cpu0, target.cpu()) {
        (Some(a), Some(b)) => format!("{:.1} s", b.saturating_sub(a).as_secs_f64()),
        _ => "n/a".into(),
    };
    let txns: u64 = clients.iter().map(|c| c.stats().txns).sum();
    println!(
        "| {} | floor: {} clients, no farm | {}×{} | {} | {:.2} | {:.0} | {:.3} txn/pod ({txns}) | Consul CPU {consul_cpu} |",
        target.name(),
        clients.len(),
        args.rcs,
        args.replicas,
        args.nodes,
        took.as_secs_f64(),
        pods as f64 / took.as_secs_f64(),
        txns as f64 / pods as f64,
    );
    target.shutdown().await;
    Ok(())
}

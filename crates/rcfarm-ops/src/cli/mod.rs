//! Command-line front ends of `rcfarm` and `rcctl`. The binaries in `bin/` only call
//! [`rcfarm_main`] and [`rcctl_main`].

mod bench_audit;
mod bench_consul;
mod bench_farm;
mod bench_rolls;
mod bench_selectors;
mod chaos;
mod check_config;
mod config;
mod connection;
mod consul_dev;
mod logging;
mod model_check;
mod rcctl;
mod serve;
mod simulate;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

pub use logging::{LogFormat, init_logging};

/// How a command ended badly: a usage mistake (exit 2) or a failed operation (exit 1).
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Failed(String),
    /// A rolling update followed with `--wait` failed (exit 3, distinct from a command that
    /// failed to do what it was asked).
    #[error("{0}")]
    RollFailed(String),
}

impl CliError {
    pub fn exit_code(&self) -> ExitCode {
        match self {
            CliError::Usage(_) => ExitCode::from(2),
            CliError::Failed(_) => ExitCode::from(1),
            CliError::RollFailed(_) => ExitCode::from(3),
        }
    }
}

/// Parses a Go-style duration (`500ms`, `10s`, `1m30s`) for a flag.
pub fn parse_duration_flag(s: &str) -> Result<Duration, String> {
    let d = crate::util::parse_go_duration(s)
        .map_err(|e| format!("{e} (use a unit: 500ms, 10s, 1m30s)"))?;
    if d.negative {
        return Err("must not be negative".into());
    }
    Ok(Duration::from_nanos(d.nanos))
}

/// Parses `key=value` arguments (labels), naming the flag in errors.
pub fn parse_pairs(args: &[String], what: &str) -> Result<crate::labels::LabelSet, CliError> {
    let mut out = crate::labels::LabelSet::new();
    for a in args {
        let (k, v) = a.split_once('=').ok_or_else(|| {
            CliError::Usage(format!(
                "{what} {a:?}: expected KEY=VALUE, e.g. team=payments"
            ))
        })?;
        crate::labels::selector::validate_key(k)
            .map_err(|e| CliError::Usage(format!("{what} {a:?}: {e}")))?;
        crate::labels::selector::validate_value(v)
            .map_err(|e| CliError::Usage(format!("{what} {a:?}: {e}")))?;
        out.insert(k.to_string(), v.to_string());
    }
    Ok(out)
}

#[derive(Debug, Parser)]
#[command(
    name = "rcfarm",
    version,
    about = "A replication-controller farm backed by Consul"
)]
pub(crate) struct RcfarmCli {
    /// Log format: `text` for people, `json` for log collectors. Filter with RUST_LOG.
    #[arg(long, global = true, env = "RCFARM_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: RcfarmCommand,
}

#[derive(Debug, Subcommand)]
enum RcfarmCommand {
    /// Run a farm: claim RCs from Consul and keep their desires true.
    Serve(serve::ServeArgs),
    /// Everything on one machine: the embedded Consul-compatible server and a farm.
    Dev(serve::DevArgs),
    /// Run the embedded Consul-compatible development server alone.
    ConsulDev(consul_dev::ConsulDevArgs),
    /// Measure; prints figures (not a test).
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Crash, stall and restart farms while RCs change; check every promise (exit 1 if broken).
    Chaos(chaos::ChaosArgs),
    /// Explore interleavings of farms, locks and faults over rcfarm's own decision cores;
    /// check every promise and that every world converges (exit 1 with a counterexample).
    ModelCheck(model_check::ModelCheckArgs),
    /// Play P2's preparer for a set of nodes: run their intents (reality/) and report health.
    SimulateNodes(simulate::SimulateArgs),
    /// Check a `serve --config` TOML file: every mistake with its line, exit 2 if any.
    CheckConfig(check_config::CheckConfigArgs),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// KV and transaction throughput, blocking-query wake-up latency of the embedded server.
    Consul(bench_consul::BenchConsulArgs),
    /// Label selector queries over a watched cache of many nodes.
    Selectors(bench_selectors::BenchSelectorsArgs),
    /// Audit log query latency over many records (SQLite or PostgreSQL).
    Audit(bench_audit::BenchAuditArgs),
    /// Farms converging many RCs: throughput, latency, failover, idle cost, memory.
    Farm(bench_farm::BenchFarmArgs),
    /// Farms carrying out many concurrent rolling updates, with simulated nodes.
    Rolls(bench_rolls::BenchRollsArgs),
}

/// `rcfarm`'s main.
pub fn rcfarm_main() -> ExitCode {
    let args = match config::expand(std::env::args_os().collect()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("rcfarm: {e}");
            return e.exit_code();
        }
    };
    let cli = RcfarmCli::parse_from(args);
    init_logging(cli.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("rcfarm: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            RcfarmCommand::Serve(args) => serve::serve(args).await,
            RcfarmCommand::Dev(args) => serve::dev(args).await,
            RcfarmCommand::ConsulDev(args) => consul_dev::run(args).await,
            RcfarmCommand::Bench(BenchCommand::Consul(args)) => bench_consul::run(args).await,
            RcfarmCommand::Bench(BenchCommand::Selectors(args)) => bench_selectors::run(args).await,
            RcfarmCommand::Bench(BenchCommand::Audit(args)) => bench_audit::run(args).await,
            RcfarmCommand::Chaos(args) => chaos::run(args).await,
            RcfarmCommand::ModelCheck(args) => model_check::run(&args),
            RcfarmCommand::SimulateNodes(args) => simulate::run(args).await,
            RcfarmCommand::CheckConfig(args) => check_config::run(&args),
            RcfarmCommand::Bench(BenchCommand::Rolls(args)) => {
                println!("{}", bench_rolls::header());
                bench_rolls::run(args).await
            }
            RcfarmCommand::Bench(BenchCommand::Farm(args)) => {
                println!("{}", bench_farm::header());
                bench_farm::run(args).await
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rcfarm: {e}");
            e.exit_code()
        }
    }
}

/// Signals that end a long-running command gracefully.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// `rcctl`'s main.
pub fn rcctl_main() -> ExitCode {
    let cli = rcctl::RcctlCli::parse();
    logging::init_logging_with_default(LogFormat::Text, "warn");
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("rcctl: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(rcctl::run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rcctl: {e}");
            e.exit_code()
        }
    }
}

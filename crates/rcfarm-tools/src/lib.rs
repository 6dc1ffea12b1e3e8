//! `rcfarm-tools`: the test equipment's commands, apart from the product. Benchmarks
//! ([`bench`]), the chaos run ([`chaos_run`]), the model check ([`model_check`]) and simulated
//! nodes ([`simulate`]), over the test kit (`rcfarm-testkit`). The Debian package ships `rcfarm` and `rcctl`
//! only; no product crate depends on this one or on the test kit (`scripts/module-circles`).
//!
//! The benchmarks are here, not in `rcfarm`: they write synthetic RCs, pods and nodes into the
//! Consul they are pointed at, start Consul agents and farm processes, and two of them need the
//! node simulator and the invariant checker. None of that belongs in a production farm's binary,
//! where one mistyped address would load a real cluster.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use rcfarm_consul as consul;
use rcfarm_consul::util;
use rcfarm_core::{audit, farm, health, labels, rc, rctask, roll};
use rcfarm_ops::cli::{
    CliError, LogFormat, init_logging, init_logging_with_default, parse_duration_flag, parse_pairs,
    run_command, shutdown_signal,
};
use rcfarm_server as server;
use rcfarm_testkit::{chaos, invariants, model, simulator};

pub mod bench;
pub mod chaos_run;
pub mod model_check;
pub mod simulate;

#[derive(Debug, Parser)]
#[command(
    name = "rcfarm-tools",
    version,
    about = "rcfarm's test equipment: benchmarks, chaos, the model check, simulated nodes"
)]
struct ToolsCli {
    /// Log format: `text` for people, `json` for log collectors. Filter with RUST_LOG.
    #[arg(long, global = true, env = "RCFARM_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: ToolsCommand,
}

#[derive(Debug, Subcommand)]
enum ToolsCommand {
    /// Measure; prints figures (not a test).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Crash, stall and restart farms while RCs change; check every promise (exit 1 if broken).
    Chaos(chaos_run::ChaosArgs),
    /// Explore interleavings of farms, locks and faults over rcfarm's own decision cores;
    /// check every promise and that every world converges (exit 1 with a counterexample).
    ModelCheck(model_check::ModelCheckArgs),
    /// Play P2's preparer for a set of nodes: run their intents (reality/) and report health.
    SimulateNodes(simulate::SimulateArgs),
}

/// `rcfarm-tools`' main.
pub fn main() -> ExitCode {
    let cli = ToolsCli::parse();
    match cli.command {
        // The real model runs thousands of farms through faults on purpose: their logs only
        // when RUST_LOG asks (what the check found is printed).
        ToolsCommand::ModelCheck(_) => init_logging_with_default(cli.log_format, "off"),
        _ => init_logging(cli.log_format),
    }
    run_command("rcfarm-tools", async {
        match cli.command {
            ToolsCommand::Bench(command) => bench::run(command).await,
            ToolsCommand::Chaos(args) => chaos_run::run(args).await,
            ToolsCommand::ModelCheck(args) => model_check::run(&args),
            ToolsCommand::SimulateNodes(args) => simulate::run(args).await,
        }
    })
}

/// The `rcfarm` the tools start farms (and `consul-dev`) with: the one beside this binary, as
/// cargo and the walkthrough put them. `alternative` says how else to name one.
fn rcfarm_beside(alternative: &str) -> Result<PathBuf, CliError> {
    let me = std::env::current_exe()
        .map_err(|e| CliError::Failed(format!("cannot find rcfarm-tools' own path: {e}")))?;
    let farm = me.with_file_name("rcfarm");
    if farm.is_file() {
        Ok(farm)
    } else {
        Err(CliError::Usage(format!(
            "no rcfarm beside rcfarm-tools ({}): build both (cargo build --workspace --bins){alternative}",
            farm.display()
        )))
    }
}

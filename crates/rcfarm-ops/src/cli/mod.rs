//! Command-line front ends of `rcfarm` and `rcctl`. The binaries in `bin/` only call
//! [`rcfarm_main`] and [`rcctl_main`].

mod check_config;
mod config;
mod connection;
mod consul_dev;
mod logging;
mod rcctl;
mod serve;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

pub use connection::ConsulArgs;
pub use logging::{LogFormat, init_logging, init_logging_with_default};

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
    /// Check a `serve --config` TOML file: every mistake with its line, exit 2 if any.
    CheckConfig(check_config::CheckConfigArgs),
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
    let cli = match RcfarmCli::try_parse_from(&args) {
        Ok(cli) => cli,
        Err(e) => {
            if let Some(moved) = moved_to_tools(&args) {
                eprintln!("rcfarm: {moved}");
                return ExitCode::from(2);
            }
            e.exit()
        }
    };
    init_logging(cli.log_format);
    run_command("rcfarm", async {
        match cli.command {
            RcfarmCommand::Serve(args) => serve::serve(args).await,
            RcfarmCommand::Dev(args) => serve::dev(args).await,
            RcfarmCommand::ConsulDev(args) => consul_dev::run(args).await,
            RcfarmCommand::CheckConfig(args) => check_config::run(&args),
        }
    })
}

/// Runs a command on a multi-thread runtime and turns its end into the exit status; an error
/// is printed as `program: error`.
pub fn run_command(
    program: &str,
    command: impl std::future::Future<Output = Result<(), CliError>>,
) -> ExitCode {
    run_on(
        program,
        tokio::runtime::Builder::new_multi_thread(),
        command,
    )
}

/// [`run_command`] on the runtime `builder` makes.
fn run_on(
    program: &str,
    mut builder: tokio::runtime::Builder,
    command: impl std::future::Future<Output = Result<(), CliError>>,
) -> ExitCode {
    let runtime = match builder.enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{program}: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{program}: {e}");
            e.exit_code()
        }
    }
}

/// The test equipment's commands, which `rcfarm` no longer has: where they went, for an
/// operator's script or habit that still calls them here.
fn moved_to_tools(args: &[std::ffi::OsString]) -> Option<String> {
    let words: Vec<&str> = args.iter().skip(1).filter_map(|a| a.to_str()).collect();
    // The first word that is neither a flag nor the value of the one global flag that takes one.
    let command = words
        .iter()
        .enumerate()
        .find(|(i, w)| !w.starts_with('-') && (*i == 0 || words[i - 1] != "--log-format"))
        .map(|(_, w)| w)?;
    let moved = match *command {
        "bench" | "chaos" | "model-check" | "simulate-nodes" => command.to_string(),
        "dev" if words.iter().any(|w| w.starts_with("--simulate-nodes")) => {
            return Some(
                "`rcfarm dev --simulate-nodes N` moved to the test tools: run `rcfarm dev`, and \
                 beside it `rcfarm-tools simulate-nodes --nodes N` (its flags, such as \
                 --fail-manifests and --labels, go there too)"
                    .into(),
            );
        }
        _ => return None,
    };
    Some(format!(
        "`rcfarm {moved}` moved to the test tools, which the package does not ship: run \
         `rcfarm-tools {moved} …` (from a checkout: cargo run --release --bin rcfarm-tools -- {moved} …)"
    ))
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
    // One thread: a command line makes a few requests and exits.
    run_on(
        "rcctl",
        tokio::runtime::Builder::new_current_thread(),
        rcctl::run(cli),
    )
}

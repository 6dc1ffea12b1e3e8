//! `rcctl`: the operator CLI over the same KV API the farms use.
//!
//! Exit codes: 0 ok, 1 the operation failed, 2 a usage mistake.

mod audit;
mod farm;
mod node;
mod output;
mod rc;
mod roll;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use super::{CliError, parse_duration_flag};
use crate::consul::{Consul, ConsulError};
use crate::overview::Overview;

#[derive(Debug, Parser)]
#[command(
    name = "rcctl",
    version,
    about = "Operate rcfarm: replication controllers, nodes, farms and the audit log"
)]
pub struct RcctlCli {
    #[command(flatten)]
    connection: super::connection::ConsulArgs,
    /// Machine-readable JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Replication controllers.
    #[command(subcommand)]
    Rc(RcCommand),
    /// Rolling updates: move an RC's replicas onto a new manifest without dropping below a
    /// minimum of healthy pods.
    #[command(subcommand)]
    Roll(roll::RollCommand),
    /// Node labels.
    #[command(subcommand)]
    Node(NodeCommand),
    /// Query the audit log (SQL), or prune it.
    Audit(audit::AuditArgs),
    /// Live farms, their fair share and the RCs they hold.
    Farms,
    /// Tell farms something: `release-removals` after a blast-radius hold or a tripped
    /// failsafe.
    #[command(subcommand)]
    Farm(farm::FarmCommand),
    /// Check that Consul answers and has a leader.
    Ping,
}

/// `--dry-run` for every write.
#[derive(Debug, Clone, Copy, Args)]
struct DryRun {
    /// Print the Consul transaction that would be sent, and send nothing.
    #[arg(long)]
    dry_run: bool,
}

#[derive(Debug, Subcommand)]
enum RcCommand {
    /// Create an RC from a pod manifest (YAML or JSON; `-` reads standard input).
    Create {
        /// The pod manifest file (its `id` is the pod id).
        #[arg(short = 'f', long = "manifest")]
        manifest: PathBuf,
        /// Which nodes may run the pods (Kubernetes label selector syntax).
        #[arg(long, default_value = "")]
        node_selector: String,
        #[arg(long, default_value_t = 0)]
        replicas: u64,
        /// Labels put on every pod (repeat: --pod-label team=payments --pod-label tier=web).
        #[arg(long = "pod-label")]
        pod_labels: Vec<String>,
        /// Labels of the RC itself (matched by farms' --rc-selector).
        #[arg(long = "rc-label")]
        rc_labels: Vec<String>,
        #[arg(long, value_enum, default_value = "static")]
        strategy: rc::StrategyArg,
        /// Create it disabled (no scheduling until `rcctl rc enable`).
        #[arg(long)]
        disabled: bool,
        #[command(flatten)]
        dry: DryRun,
    },
    /// List RCs: desired and current pods, owner farm, conditions.
    List {
        /// Only RCs whose own labels match.
        #[arg(short = 'l', long = "selector", default_value = "")]
        selector: String,
    },
    /// Everything about one RC: record, pods, owner, recent audit events.
    Show {
        id: String,
        /// Where to read audit events (as the farms' --audit-db).
        #[arg(long, env = "RCFARM_AUDIT_DB", hide_env_values = true)]
        audit_db: Option<crate::audit::store::DbUrl>,
    },
    /// The revisions of an RC's lineage: each RC a completed roll replaced on the way to
    /// this one (newest last), for `rcctl roll undo`.
    History { id: String },
    /// Set the desired replica count.
    Scale {
        id: String,
        replicas: u64,
        /// Wait until the farm has converged, showing progress.
        #[arg(long)]
        wait: bool,
        /// Give up waiting after this long (exit 1).
        #[arg(long, default_value = "5m", value_parser = parse_duration_flag)]
        timeout: Duration,
        #[command(flatten)]
        dry: DryRun,
    },
    /// Resume scheduling.
    Enable {
        id: String,
        #[command(flatten)]
        dry: DryRun,
    },
    /// Stop all scheduling changes (pods stay as they are).
    Disable {
        id: String,
        #[command(flatten)]
        dry: DryRun,
    },
    /// Delete an RC (refused while it wants replicas: scale it to 0 first, or --force).
    Delete {
        id: String,
        /// Delete even with replicas desired; its pods are left running, unmanaged.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        dry: DryRun,
    },
    /// Replace the pod manifest.
    SetManifest {
        id: String,
        #[arg(short = 'f', long = "manifest")]
        manifest: PathBuf,
        #[command(flatten)]
        dry: DryRun,
    },
    /// Replace the node selector.
    SetSelector {
        id: String,
        selector: String,
        #[command(flatten)]
        dry: DryRun,
    },
    /// Set the allocation strategy (P2's `p2-rctl update-strategy`): writes
    /// `static_strategy` or `dynamic_strategy` into the record.
    SetStrategy {
        id: String,
        #[arg(value_enum)]
        strategy: rc::StrategyArg,
        #[command(flatten)]
        dry: DryRun,
    },
    /// Replace every pod with the same manifest, through a rolling update with all its
    /// guarantees (minimum, pace, canary, deadline). P2's preparer relaunches a pod when its
    /// manifest's SHA changes: the new RC's manifest carries `config.rcfarm_restarted_at`
    /// (the time), which changes the SHA and nothing else P2 reads. Prints the roll's id.
    Restart {
        id: String,
        #[command(flatten)]
        opts: roll::RollOpts,
        #[command(flatten)]
        wait: roll::WaitOpts,
        #[command(flatten)]
        dry: DryRun,
    },
}

#[derive(Debug, Subcommand)]
enum NodeCommand {
    /// Set labels (`k=v`) and remove them (`k-`) on a node.
    Label {
        node: String,
        #[arg(required = true)]
        changes: Vec<String>,
        #[command(flatten)]
        dry: DryRun,
    },
    /// List nodes and their labels.
    List {
        #[arg(short = 'l', long = "selector", default_value = "")]
        selector: String,
    },
}

/// Shared by every command.
pub(crate) struct Ctx {
    pub consul: Consul,
    pub json: bool,
}

impl Ctx {
    /// The overview from Consul, with each owning farm's own view of its RCs' conditions
    /// (`Unmet`, `Waiting`, errors) when its HTTP API answers.
    pub async fn overview(&self) -> Result<Overview, CliError> {
        let mut ov = Overview::load(&self.consul).await.map_err(consul_failed)?;
        for farm in ov.farms.clone() {
            let Some(base) = farm.http.as_deref() else {
                continue;
            };
            let Some(body) = self.farm_get(&format!("{base}/v1/rcs")).await else {
                continue;
            };
            for remote in body["rcs"].as_array().into_iter().flatten() {
                let Some(id) = remote["id"].as_str() else {
                    continue;
                };
                if let Some(r) = ov.rcs.iter_mut().find(|r| {
                    r.id == id && r.owner_session.as_deref() == Some(farm.session.as_str())
                }) && let Some(conds) = remote["conditions"].as_array()
                {
                    r.conditions = conds
                        .iter()
                        .filter_map(|c| c.as_str().map(str::to_string))
                        .collect();
                }
            }
        }
        Ok(ov)
    }

    /// The live farms (as the registry in Consul lists them).
    pub async fn overview_farms(&self) -> Result<Vec<crate::farm::registry::FarmInfo>, CliError> {
        let (entries, _) = self
            .consul
            .kv_list(crate::farm::registry::FARMS_PREFIX, &Default::default())
            .await
            .map_err(consul_failed)?;
        Ok(crate::farm::registry::live_farms(&entries))
    }

    /// A farm's JSON answer, if it answers within 2 s (a farm's own view is a bonus: its
    /// absence never fails a command).
    pub async fn farm_get(&self, url: &str) -> Option<serde_json::Value> {
        crate::consul::init_tls();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .ok()?;
        http.get(url).send().await.ok()?.json().await.ok()
    }
}

/// A manifest file's text (`-`: standard input), refused unless it parses.
pub(crate) fn read_manifest(path: &std::path::Path) -> Result<String, CliError> {
    let mut text = String::new();
    if path.as_os_str() == "-" {
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut text).map_err(|e| {
            CliError::Usage(format!("cannot read the manifest from standard input: {e}"))
        })?;
    } else {
        text = std::fs::read_to_string(path).map_err(|e| {
            CliError::Usage(format!("cannot read the manifest {}: {e}", path.display()))
        })?;
    }
    crate::rc::Manifest::parse(&text)
        .map_err(|e| CliError::Usage(format!("{}: {e}", path.display())))?;
    Ok(text)
}

pub(crate) fn parse_id(id: &str) -> Result<crate::rc::RcId, CliError> {
    crate::rc::RcId::parse(id)
        .map_err(|e| CliError::Usage(format!("RC id {e}; list them with `rcctl rc list`")))
}

/// Who rcctl says made a change, in audit records.
pub(crate) fn rc_actor() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "unknown".into());
    let host = hostname::get()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_default();
    format!("rcctl:{user}@{host}")
}

/// A Consul error, with what to do about it.
pub(crate) fn consul_failed(e: ConsulError) -> CliError {
    if let (Some(tls), ConsulError::Unavailable { addr, .. }) = (e.tls_problem(), &e) {
        let hint = crate::consul::tls_advice(tls);
        return CliError::Failed(format!("cannot talk TLS to Consul at {addr}: {tls}{hint}"));
    }
    if let ConsulError::Conflict(errs) = &e
        && !errs.is_empty()
        && errs.iter().all(|o| o.what.contains("Permission denied"))
    {
        return CliError::Failed(format!(
            "Consul denied the change: {} (the ACL token may not write these keys; a read-only \
             token, as deploy/consul/rcctl-readonly.*.hcl grants, cannot change anything)",
            errs[0].what
        ));
    }
    let hint = match &e {
        ConsulError::Unavailable { .. } => " (is Consul running? set --consul or CONSUL_HTTP_ADDR)",
        _ => "",
    };
    CliError::Failed(format!("{e}{hint}"))
}

pub async fn run(cli: RcctlCli) -> Result<(), CliError> {
    let cfg = cli.connection.to_config()?;
    let consul = Consul::new(cfg).map_err(|e| CliError::Usage(e.to_string()))?;
    let ctx = Ctx {
        consul,
        json: cli.json,
    };
    match cli.command {
        Command::Rc(c) => rc::run(&ctx, c).await,
        Command::Roll(c) => roll::run(&ctx, c).await,
        Command::Node(c) => node::run(&ctx, c).await,
        Command::Audit(a) => audit::run(&ctx, a).await,
        Command::Farms => rc::farms(&ctx).await,
        Command::Farm(c) => farm::run(&ctx, c).await,
        Command::Ping => {
            let leader = ctx.consul.leader().await.map_err(consul_failed)?;
            if leader.is_empty() {
                return Err(CliError::Failed(format!(
                    "Consul at {} answers but has no leader; wait for the cluster to elect one",
                    ctx.consul.address()
                )));
            }
            if ctx.json {
                output::json(&serde_json::json!({"consul": ctx.consul.address(), "leader": leader}))
            } else {
                println!("Consul at {} is up; leader {leader}", ctx.consul.address());
                Ok(())
            }
        }
    }
}

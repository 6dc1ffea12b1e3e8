//! `rcfarm serve` (a farm daemon) and `rcfarm dev` (server and farm in one process).

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::consul_dev::{self, ConsulDevArgs};
use super::{CliError, parse_duration_flag, shutdown_signal};
use crate::consul::ConsulConfig;
use crate::consul::WatchConfig;
use crate::farm::{Farm, FarmConfig, SchedulerKind};
use crate::labels::Selector;
use crate::rctask::TaskConfig;
use crate::scheduler::PoolConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SchedulerChoice {
    /// Eligible nodes are those whose labels match; no allocation.
    Label,
    /// Label matching plus a pool of spare nodes allocated to dynamic-strategy RCs.
    Pool,
}

/// Options of a farm.
#[derive(Debug, Clone, clap::Args)]
pub struct FarmArgs {
    /// This farm's name: shown in logs, status and audit records, and used for fair-share
    /// placement (keep it stable across restarts).
    #[arg(long, env = "RCFARM_FARM_ID")]
    pub farm_id: Option<String>,
    /// Serve only RCs whose own labels (labels/replication_controller/<id>) match.
    #[arg(long, env = "RCFARM_RC_SELECTOR", default_value = "")]
    pub rc_selector: String,
    #[arg(long, env = "RCFARM_SCHEDULER", value_enum, default_value = "label")]
    pub scheduler: SchedulerChoice,
    /// With --scheduler pool: the node labels marking the pool of spare nodes.
    #[arg(
        long,
        env = "RCFARM_POOL_SELECTOR",
        default_value = "rcfarm.io/pool=spare"
    )]
    pub pool_selector: String,
    /// With --scheduler pool: pods (of different RCs) one pool node can host.
    #[arg(long, env = "RCFARM_POOL_CAPACITY", default_value_t = 1)]
    pub pool_capacity: usize,
    /// Consul session TTL; the farm renews at TTL/2 and gives up after one TTL without success.
    #[arg(long, env = "RCFARM_SESSION_TTL", default_value = "15s", value_parser = parse_duration_flag)]
    pub session_ttl: Duration,
    /// Lock-delay of the session: how long an RC's lock stays untakable after the farm dies.
    #[arg(long, env = "RCFARM_LOCK_DELAY", default_value = "1s", value_parser = parse_duration_flag)]
    pub lock_delay: Duration,
    /// Re-plan every RC this often even without changes.
    #[arg(long, env = "RCFARM_RESYNC_INTERVAL", default_value = "30s", value_parser = parse_duration_flag)]
    pub resync_interval: Duration,
    /// Read every owned pod's intent this often, to repair missing or altered ones.
    #[arg(long, env = "RCFARM_CONSISTENCY_INTERVAL", default_value = "60s", value_parser = parse_duration_flag)]
    pub consistency_interval: Duration,
    /// Roll a node transfer back if the new pod is not healthy by then.
    #[arg(long, env = "RCFARM_TRANSFER_TIMEOUT", default_value = "5m", value_parser = parse_duration_flag)]
    pub transfer_timeout: Duration,
    /// How long an unheld RC waits for its assigned farm before any farm with room takes it.
    #[arg(long, env = "RCFARM_CLAIM_GRACE", default_value = "3s", value_parser = parse_duration_flag)]
    pub claim_grace: Duration,
    /// The `wait` of the farm's blocking queries.
    #[arg(long, env = "RCFARM_WATCH_WAIT", default_value = "5m", value_parser = parse_duration_flag)]
    pub watch_wait: Duration,
    /// Where farms ship the audit log: `sqlite://PATH` (one machine; farms on it share the
    /// file) or `postgres://USER@HOST/DB` (farms on several machines). Default: audit.db in
    /// --state-dir.
    #[arg(long, env = "RCFARM_AUDIT_DB")]
    pub audit_db: Option<String>,
    /// Directory for the farm's local state (the default SQLite audit database).
    #[arg(long, env = "RCFARM_STATE_DIR", default_value = "rcfarm-data")]
    pub state_dir: std::path::PathBuf,
}

impl FarmArgs {
    pub fn to_config(
        &self,
        consul: ConsulConfig,
        default_id: &str,
    ) -> Result<FarmConfig, CliError> {
        let rc_selector = Selector::parse(&self.rc_selector)
            .map_err(|e| CliError::Usage(format!("--rc-selector: {e}")))?;
        let scheduler = match self.scheduler {
            SchedulerChoice::Label => SchedulerKind::Label,
            SchedulerChoice::Pool => SchedulerKind::Pool(PoolConfig {
                pool_selector: Selector::parse(&self.pool_selector)
                    .map_err(|e| CliError::Usage(format!("--pool-selector: {e}")))?,
                capacity: self.pool_capacity.max(1),
                ..PoolConfig::default()
            }),
        };
        if self.session_ttl < Duration::from_secs(1) {
            return Err(CliError::Usage(
                "--session-ttl must be at least 1s (Consul's own minimum is 10s)".into(),
            ));
        }
        let farm_id = self
            .farm_id
            .clone()
            .unwrap_or_else(|| default_id.to_string());
        if farm_id.is_empty() || farm_id.contains(['/', ' ']) {
            return Err(CliError::Usage(format!(
                "--farm-id {farm_id:?}: use a non-empty name without '/' or spaces"
            )));
        }
        let mut c = FarmConfig::new(farm_id, consul);
        c.rc_selector = rc_selector;
        c.scheduler = scheduler;
        c.session_ttl = self.session_ttl;
        c.lock_delay = self.lock_delay;
        c.task = TaskConfig {
            resync: self.resync_interval,
            transfer_timeout: self.transfer_timeout,
            ..TaskConfig::default()
        };
        c.consistency_interval = self.consistency_interval;
        c.claim_grace = self.claim_grace;
        c.watch = WatchConfig {
            wait: self.watch_wait,
            ..WatchConfig::default()
        };
        let audit_db = match &self.audit_db {
            Some(u) => u.clone(),
            None => format!("sqlite://{}", self.state_dir.join("audit.db").display()),
        };
        crate::audit::store::parse_url(&audit_db)
            .map_err(|e| CliError::Usage(format!("--audit-db: {e}")))?;
        c.audit_db = Some(audit_db);
        Ok(c)
    }
}

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Consul's HTTP address.
    #[arg(
        long,
        env = "CONSUL_HTTP_ADDR",
        default_value = "http://127.0.0.1:8500"
    )]
    pub consul: String,
    /// ACL token for Consul.
    #[arg(long, env = "CONSUL_HTTP_TOKEN", hide_env_values = true)]
    pub consul_token: Option<String>,
    #[command(flatten)]
    pub farm: FarmArgs,
}

fn default_farm_id() -> String {
    hostname::get()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "farm".into())
}

async fn run_farm(config: FarmConfig, shutdown: CancellationToken) -> Result<(), CliError> {
    let farm = Farm::new(config).map_err(|e| CliError::Usage(e.to_string()))?;
    farm.run(shutdown)
        .await
        .map_err(|e| CliError::Failed(e.to_string()))
}

pub async fn serve(args: ServeArgs) -> Result<(), CliError> {
    let consul = ConsulConfig::new(args.consul.clone()).with_token(args.consul_token.clone());
    let config = args.farm.to_config(consul, &default_farm_id())?;
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("signal received: handing RCs over and stopping");
        s.cancel();
    });
    run_farm(config, shutdown).await
}

#[derive(Debug, clap::Args)]
pub struct DevArgs {
    #[command(flatten)]
    pub server: ConsulDevArgs,
    #[command(flatten)]
    pub farm: FarmArgs,
}

/// The embedded server and one farm in one process: everything on one machine.
pub async fn dev(args: DevArgs) -> Result<(), CliError> {
    let server = consul_dev::start(&args.server).await?;
    let consul = ConsulConfig::new(server.url()).with_token(args.server.acl_token.clone());
    let config = args.farm.to_config(consul, "dev")?;
    tracing::info!(
        "rcfarm dev: farm {:?} serving RCs from {}. Try: CONSUL_HTTP_ADDR={} rcctl rc list",
        config.farm_id,
        server.url(),
        server.url()
    );
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        s.cancel();
    });
    let result = run_farm(config, shutdown).await;
    server.shutdown().await;
    result
}

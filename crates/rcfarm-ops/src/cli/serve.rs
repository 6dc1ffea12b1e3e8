//! `rcfarm serve` (a farm daemon) and `rcfarm dev` (server and farm in one process).

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::connection::ConsulArgs;
use super::consul_dev::{self, ConsulDevArgs};
use super::{CliError, parse_duration_flag, shutdown_signal};
use crate::consul::ConsulConfig;
use crate::consul::WatchConfig;
use crate::farm::{Farm, FarmConfig, SchedulerKind};
use crate::labels::Selector;
use crate::rctask::TaskConfig;
use crate::roll::RollConfig;
use crate::scheduler::PoolConfig;

/// `--audit-shipping`: whether this farm ships the audit outbox to SQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AuditShipping {
    /// Ship records from Consul's `audit_logs/` to --audit-db and delete them from Consul.
    #[value(alias = "true")]
    On,
    /// Write records into `audit_logs/` only and leave them there for another consumer (as
    /// P2's farm does).
    #[value(alias = "false")]
    Off,
}

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
    /// Read the pod label tree and every owned pod's intent at least this often, to repair
    /// what was changed behind the farm's back (it reads the labels sooner when it takes RCs
    /// over or a rolling update runs).
    #[arg(long, env = "RCFARM_CONSISTENCY_INTERVAL", default_value = "60s", value_parser = parse_duration_flag)]
    pub consistency_interval: Duration,
    /// Actions an RC task applies in one pass before it looks at its inputs again (tests
    /// lower it to exercise passes cut short; not a setting).
    #[arg(long, hide = true, default_value_t = 16)]
    pub max_actions_per_pass: usize,
    /// Roll a node transfer back if the new pod is not healthy by then.
    #[arg(long, env = "RCFARM_TRANSFER_TIMEOUT", default_value = "5m", value_parser = parse_duration_flag)]
    pub transfer_timeout: Duration,
    /// Also move pods of static-strategy RCs off nodes that no longer match (node transfers).
    /// Off by default, as P2: a static RC leaves such a pod where it is.
    #[arg(
        long,
        env = "RCFARM_TRANSFER_STATIC",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub transfer_static: bool,
    /// How long an unheld RC waits for its assigned farm before any farm with room takes it.
    #[arg(long, env = "RCFARM_CLAIM_GRACE", default_value = "3s", value_parser = parse_duration_flag)]
    pub claim_grace: Duration,
    /// The newest rule this farm offers for assigning RCs to farms: 1 (each farm first keeps
    /// what it holds up to its fair share, the rest by score under the shares: exactly
    /// balanced, and every release before this option) or 2 (by score alone, whoever holds
    /// what: farms agree on it whatever their views of the lock tree, with far fewer refused
    /// claims and lock-tree reads while many RCs are claimed, but loads balanced by the hash
    /// only). Live farms use the oldest rule any of them offers: rule 2 takes effect once
    /// every live farm offers it, and a farm of an older release holds all of them to rule 1.
    #[arg(long, env = "RCFARM_ASSIGNMENT_RULE", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=2))]
    pub assignment_rule: u32,
    /// Report a rolling update stalled (log, metric, audit record, status) when it has not
    /// moved for this long (at once when it can never move as things are).
    #[arg(long, env = "RCFARM_ROLL_STALL_AFTER", default_value = "5m", value_parser = parse_duration_flag)]
    pub roll_stall_after: Duration,
    /// A rolling update with no new pod becoming up for this long Fails (a terminal state,
    /// kept until an operator resumes or aborts it); a roll's own --progress-deadline wins.
    #[arg(long, env = "RCFARM_ROLL_PROGRESS_DEADLINE", default_value = "10m", value_parser = parse_duration_flag)]
    pub roll_progress_deadline: Duration,
    /// Revisions kept per lineage (the chain of RCs that rolls connected): each RC a roll
    /// replaces leaves one at `rcfarm/history/<rc-id>`, for `rcctl rc history` and
    /// `rcctl roll undo`. 0 keeps none.
    #[arg(long, env = "RCFARM_REVISION_HISTORY", default_value_t = crate::roll::DEFAULT_REVISIONS)]
    pub revision_history: usize,
    /// Revert a rolling update that Fails (roll back to its old RC, under its minimum and
    /// pace) unless the roll says otherwise (`rcctl roll start --auto-revert[=false]`). A
    /// revert that fails stays Failed.
    #[arg(
        long,
        env = "RCFARM_ROLL_AUTO_REVERT",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub roll_auto_revert: bool,
    /// Look at a waiting rolling update this often even without changes (what nodes run,
    /// `reality/`, is not watched).
    #[arg(long, env = "RCFARM_ROLL_RESYNC", default_value = "5s", value_parser = parse_duration_flag)]
    pub roll_resync: Duration,
    /// Blast-radius limit for the whole cluster: the most pods all farms together remove
    /// (unschedule or replace) per --max-removals-window, across RCs, rolling updates and node
    /// transfers, counted in one Consul key (rcfarm/removals/window) each removal charges in its
    /// own transaction: a number, a percentage of the pods the farms serve (at least 5), or off.
    /// Give every farm the same value. Past it, removals wait (RemovalsHeld) for the window, or
    /// for `rcctl farm release-removals`.
    #[arg(long, env = "RCFARM_MAX_REMOVALS", default_value = "20%", value_parser = parse_max_removals)]
    pub max_removals: crate::failsafe::MaxRemovals,
    /// The sliding window --max-removals counts over (the same on every farm).
    #[arg(long, env = "RCFARM_MAX_REMOVALS_WINDOW", default_value = "5m", value_parser = parse_duration_flag)]
    pub max_removals_window: Duration,
    /// When the RC tree goes empty, or every RC to 0 replicas, remove nothing until that has
    /// been seen for this long (FailsafeTripped); 0s turns this guard off.
    #[arg(long, env = "RCFARM_FAILSAFE_CONFIRM", default_value = "2m", value_parser = parse_duration_flag)]
    pub failsafe_confirm: Duration,
    /// Most TCP connections this farm opens to Consul (one is kept for session renewals; the
    /// rest are shared, blocking queries included). Consul 1.x refuses a client's connection
    /// beyond `limits.http_max_conns_per_client` (200 by default).
    #[arg(long, env = "RCFARM_CONSUL_MAX_CONNS", default_value_t = crate::consul::DEFAULT_MAX_CONNS)]
    pub consul_max_conns: usize,
    /// The `wait` of the farm's blocking queries.
    #[arg(long, env = "RCFARM_WATCH_WAIT", default_value = "5m", value_parser = parse_duration_flag)]
    pub watch_wait: Duration,
    /// The longest pause between two reads of a big tree by a blocking query (the pause is
    /// 400 ms per MiB of the last answer, up to this). Longer batches more changes into each
    /// re-read of a big pod tree, sparing Consul's CPU; shorter sees changes sooner.
    #[arg(long, env = "RCFARM_WATCH_MAX_PACE", default_value = "1s", value_parser = parse_duration_flag)]
    pub watch_max_pace: Duration,
    /// Where farms ship the audit log: `sqlite://PATH` (one machine; farms on it share the
    /// file) or `postgres://USER@HOST/DB` (farms on several machines). Default: audit.db in
    /// --state-dir.
    #[arg(long, env = "RCFARM_AUDIT_DB", hide_env_values = true)]
    pub audit_db: Option<crate::audit::store::DbUrl>,
    /// `on`: ship audit records from Consul's audit_logs/ to --audit-db (one farm at a time)
    /// and delete them from Consul. `off`: leave them in audit_logs/ for another consumer, as
    /// P2's farm does (no SQL database is opened unless --audit-db is given, for queries).
    #[arg(long, env = "RCFARM_AUDIT_SHIPPING", value_enum, default_value = "on")]
    pub audit_shipping: AuditShipping,
    /// Records waiting in Consul's audit_logs/ past which every farm paces its RC and roll
    /// writes to --audit-outbox-pace while the outbox is not draining (SQL away, or slower than
    /// the farms), so that it cannot grow fast enough to endanger Consul (0: never). The count
    /// is the shipping farm's.
    #[arg(long, env = "RCFARM_AUDIT_OUTBOX_SLOW", default_value_t = 50_000)]
    pub audit_outbox_slow: u64,
    /// Record-carrying RC and roll writes per second per farm while the outbox is past
    /// --audit-outbox-slow. Claims and operators' writes are never paced.
    #[arg(long, env = "RCFARM_AUDIT_OUTBOX_PACE", default_value_t = 5.0, value_parser = parse_pace)]
    pub audit_outbox_pace: f64,
    /// Directory for the farm's local state (the default SQLite audit database).
    #[arg(long, env = "RCFARM_STATE_DIR", default_value = "rcfarm-data")]
    pub state_dir: std::path::PathBuf,
    /// Serve health probes, /metrics, the JSON API and the status page here ("off" for none).
    #[arg(long, env = "RCFARM_HTTP", default_value = "127.0.0.1:8791")]
    pub http: String,
    /// A TOML file with any of these options (keys are the long names: session-ttl = "15s").
    /// Flags and environment variables override it.
    #[arg(long, env = "RCFARM_CONFIG")]
    pub config: Option<std::path::PathBuf>,
}

/// A positive number of writes per second.
fn parse_pace(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!(
            "{s:?} is not a pace: give writes per second, a number above 0 such as 10 or 0.5"
        )),
    }
}

impl FarmArgs {
    /// The HTTP address, or `None` for "off".
    fn http_addr(&self) -> Result<Option<std::net::SocketAddr>, CliError> {
        if self.http == "off" || self.http.is_empty() {
            return Ok(None);
        }
        self.http.parse().map(Some).map_err(|_| {
            CliError::Usage(format!(
                "--http {:?}: give an address like 127.0.0.1:8791, or off",
                self.http
            ))
        })
    }
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
        if self.consul_max_conns < crate::consul::MIN_MAX_CONNS {
            return Err(CliError::Usage(format!(
                "--consul-max-conns {}: a farm needs at least {} (about a dozen blocking queries each hold one)",
                self.consul_max_conns,
                crate::consul::MIN_MAX_CONNS
            )));
        }
        let consul = ConsulConfig {
            max_conns: self.consul_max_conns,
            ..consul
        };
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
            transfer_static: self.transfer_static,
            max_actions_per_pass: self.max_actions_per_pass,
            ..TaskConfig::default()
        };
        c.consistency_interval = self.consistency_interval;
        c.roll = RollConfig {
            stall_after: self.roll_stall_after,
            progress_deadline: self.roll_progress_deadline,
            resync: self.roll_resync.max(Duration::from_millis(100)),
            revision_history: self.revision_history,
            auto_revert: self.roll_auto_revert,
            ..RollConfig::default()
        };
        if self.max_removals_window.is_zero() {
            return Err(CliError::Usage(
                "--max-removals-window must be longer than 0s (for no limit: --max-removals off)"
                    .into(),
            ));
        }
        c.failsafe = crate::failsafe::FailsafeConfig {
            max_removals: self.max_removals,
            window: self.max_removals_window,
            confirm: self.failsafe_confirm,
        };
        c.claim_grace = self.claim_grace;
        c.assignment_rule = crate::farm::claims::Rule::from_published(self.assignment_rule);
        c.watch = WatchConfig {
            wait: self.watch_wait,
            max_pace: self.watch_max_pace,
            ..WatchConfig::default()
        };
        c.audit_shipping = self.audit_shipping == AuditShipping::On;
        c.audit_pace = crate::audit::PaceConfig {
            slow_at: self.audit_outbox_slow,
            per_second: self.audit_outbox_pace,
        };
        let audit_db = match &self.audit_db {
            Some(u) => Some(u.clone()),
            // Not shipping, nothing would fill a default database: open none.
            None if !c.audit_shipping => None,
            None => Some(crate::audit::store::DbUrl::new(format!(
                "sqlite://{}",
                self.state_dir.join("audit.db").display()
            ))),
        };
        if let Some(url) = &audit_db {
            crate::audit::store::parse_url(url.expose())
                .map_err(|e| CliError::Usage(format!("--audit-db: {e}")))?;
        }
        c.audit_db = audit_db;
        Ok(c)
    }
}

#[derive(Debug, clap::Args)]
#[command(args_override_self = true)]
pub struct ServeArgs {
    #[command(flatten)]
    pub connection: ConsulArgs,
    #[command(flatten)]
    pub farm: FarmArgs,
}

fn parse_max_removals(s: &str) -> Result<crate::failsafe::MaxRemovals, String> {
    s.parse()
}

fn default_farm_id() -> String {
    hostname::get()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "farm".into())
}

/// Runs a farm (and its HTTP server) until `shutdown`.
async fn run_farm(
    mut config: FarmConfig,
    http: Option<std::net::SocketAddr>,
    shutdown: CancellationToken,
) -> Result<(), CliError> {
    let metrics = install_metrics();
    // Bind before the farm registers, so it announces the address actually served (port 0).
    let listener = match http {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| CliError::Failed(format!("--http {addr}: cannot listen: {e}")))?,
        ),
        None => None,
    };
    if let Some(l) = &listener {
        let local = l
            .local_addr()
            .map_err(|e| CliError::Failed(e.to_string()))?;
        config.http = Some(format!("http://{local}"));
        tracing::info!("HTTP API, /metrics and the status page on http://{local}/");
    }
    let farm = Farm::new(config).map_err(|e| CliError::Usage(e.to_string()))?;
    if let Some(listener) = listener {
        let state = crate::api::ApiState {
            consul: farm.consul().clone(),
            status: farm.status(),
            rolls: farm.roll_status(),
            ready: farm.ready(),
            audit: farm.audit_store(),
            shipper: farm.shipper_stats(),
            metrics,
        };
        let app = crate::api::router(state);
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let r = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await;
            if let Err(e) = r {
                tracing::error!(error = %e, "HTTP server stopped");
            }
        });
    }
    farm.run(shutdown)
        .await
        .map_err(|e| CliError::Failed(e.to_string()))
}

/// The process-wide Prometheus recorder (every `metrics::` call in the library lands in it).
fn install_metrics() -> Option<metrics_exporter_prometheus::PrometheusHandle> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let buckets = [
        0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ];
    // Node transfers wait for a new pod to be healthy (minutes); rolls take minutes to hours.
    let slow = [
        1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0,
    ];
    let builder = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("rcfarm_converge_pass_seconds".into()),
            &buckets,
        )
        .ok()?
        .set_buckets_for_metric(
            Matcher::Full("rcfarm_consul_request_duration_seconds".into()),
            &buckets,
        )
        .ok()?
        .set_buckets_for_metric(
            Matcher::Full("rcfarm_audit_ship_stage_seconds".into()),
            &buckets,
        )
        .ok()?
        .set_buckets_for_metric(Matcher::Prefix("rcfarm_transfer_".into()), &slow)
        .ok()?
        .set_buckets_for_metric(Matcher::Prefix("rcfarm_roll_".into()), &slow)
        .ok()?;
    match builder.install_recorder() {
        Ok(h) => {
            crate::api::describe_metrics();
            Some(h)
        }
        Err(e) => {
            tracing::warn!(error = %e, "metrics recorder not installed");
            None
        }
    }
}

/// What `serve` checks of its options before it connects to anything, and what they make: the
/// farm's configuration and the HTTP address. `rcfarm check-config` runs the same.
pub(super) fn prepare(
    args: &ServeArgs,
) -> Result<(FarmConfig, Option<std::net::SocketAddr>), CliError> {
    let consul = args.connection.to_config()?;
    let config = args.farm.to_config(consul, &default_farm_id())?;
    let http = args.farm.http_addr()?;
    Ok((config, http))
}

pub async fn serve(args: ServeArgs) -> Result<(), CliError> {
    let (config, http) = prepare(&args)?;
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("signal received: handing RCs over and stopping");
        s.cancel();
    });
    run_farm(config, http, shutdown).await
}

#[derive(Debug, clap::Args)]
#[command(args_override_self = true)]
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
    let http = args.farm.http_addr()?;
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
    let result = run_farm(config, http, shutdown).await;
    server.shutdown().await;
    result
}

//! The farm: holds a Consul session, claims its fair share of the RCs with their ownership
//! locks, runs one task per claimed RC, and hands RCs over when farms come and go.
//!
//! A handful of blocking queries feed it, whatever the number of RCs: the RC tree, the lock
//! tree, the farm registry, the label trees (RCs, nodes, pods), health, and the pool scheduler's
//! reservations. Changes are dispatched to the tasks they concern.

mod access;
pub mod claims;
pub mod decide;
mod failsafe;
mod ownership;
mod rcs;
pub mod registry;
mod rolls;
mod shipping;
pub mod sweep;
mod unclaimable;

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::audit::{AuditStore, ShipperConfig, ShipperStats};
use crate::clock::Clock;
use crate::consul::{
    Consul, ConsulConfig, ConsulError, Demand, FastGuard, KvPair, Session, SessionBehavior,
    SessionConfig, TxnOp, Watch, WatchConfig,
};
use crate::health::HealthCache;
use crate::labels::{LabelCache, LabelType, Selector};
use crate::rc::{LockView, LockWatch, RcId, RcKeysWatch, RcRecords, RcStore};
use crate::rctask::{IntentView, StatusRegistry, TaskConfig, TaskContext, TaskEvent};
use crate::roll::{
    ROLL_LOCK_PREFIX, RollConfig, RollContext, RollEvent, RollStatusRegistry, RollStore, RollWatch,
};
use crate::scheduler::{LabelScheduler, PoolConfig, PoolScheduler, Scheduler};
use crate::util::{Backoff, jitter_half};
use ownership::{ClaimFarm, Rules as ClaimRules};
use rcs::{LocksTx, OwnedRcs, RcKind};
use registry::{FARMS_PREFIX, FarmInfo};
use rolls::{OwnedRolls, RollDispatch, RollKind};

/// Keys under the lock prefixes that are no lock, reported once each while they are there.
#[derive(Debug, Default)]
struct GarbageReported {
    rcs: BTreeSet<String>,
    rolls: BTreeSet<String>,
}

/// Which scheduler the farm uses.
#[derive(Debug, Clone)]
pub enum SchedulerKind {
    Label,
    Pool(PoolConfig),
}

/// Everything a farm needs to know.
#[derive(Debug, Clone)]
pub struct FarmConfig {
    pub farm_id: String,
    pub consul: ConsulConfig,
    pub session_ttl: Duration,
    /// Small: fencing, not lock-delay, keeps a stalled farm from writing.
    pub lock_delay: Duration,
    pub rc_selector: Selector,
    pub scheduler: SchedulerKind,
    pub task: TaskConfig,
    /// How often the farm reads its pods' intents to repair missing or altered ones.
    pub consistency_interval: Duration,
    /// How long an RC nobody holds waits for the farm it is assigned to before any farm with
    /// room takes it.
    pub claim_grace: Duration,
    /// How far over its fair share a farm may go to take RCs nobody else takes.
    pub share_slack: usize,
    /// The newest assignment rule this farm offers (`--assignment-rule`; see
    /// `registry::agreed_rule`).
    pub assignment_rule: claims::Rule,
    pub watch: WatchConfig,
    /// Announced in the farm registry (for `rcctl farms` and the status page).
    pub http: Option<String>,
    /// Where the audit log is shipped (`sqlite://…` or `postgres://…`); `None`: this farm
    /// does not ship (records wait in Consul for a farm that does).
    pub audit_db: Option<crate::audit::store::DbUrl>,
    /// `false` (`--audit-shipping off`): never ship, even with `audit_db`: records are left in
    /// Consul's `audit_logs/` for another consumer, as P2's farm leaves them.
    pub audit_shipping: bool,
    pub shipper: ShipperConfig,
    /// When the outbox is too big for Consul's good, and how slow the farm then goes
    /// (`--audit-outbox-slow`, `--audit-outbox-pace`).
    pub audit_pace: crate::audit::PaceConfig,
    pub roll: RollConfig,
    /// The removal budget and the RC tree tripwire (`--max-removals`, `--failsafe-confirm`).
    pub failsafe: crate::failsafe::FailsafeConfig,
    /// What time it is, for everything the farm runs.
    pub clock: Clock,
}

impl FarmConfig {
    pub fn new(farm_id: impl Into<String>, consul: ConsulConfig) -> Self {
        FarmConfig {
            farm_id: farm_id.into(),
            consul,
            session_ttl: Duration::from_secs(15),
            lock_delay: Duration::from_secs(1),
            rc_selector: Selector::everything(),
            scheduler: SchedulerKind::Label,
            task: TaskConfig::default(),
            consistency_interval: Duration::from_secs(60),
            claim_grace: Duration::from_secs(3),
            share_slack: 1,
            assignment_rule: claims::Rule::DEFAULT,
            watch: WatchConfig::default(),
            http: None,
            audit_db: None,
            audit_shipping: true,
            shipper: ShipperConfig::default(),
            audit_pace: crate::audit::PaceConfig::default(),
            roll: RollConfig::default(),
            failsafe: crate::failsafe::FailsafeConfig::default(),
            clock: Clock::system(),
        }
    }

    /// Whether the farm schedules from a pool (which counts every pod on a node).
    pub fn pool_scheduler(&self) -> bool {
        matches!(self.scheduler, SchedulerKind::Pool(_))
    }

    /// Whether this farm ships the audit outbox to SQL.
    pub fn ships_audit(&self) -> bool {
        self.audit_shipping && self.audit_db.is_some()
    }

    /// Where this farm's audit records end up, in a sentence for operators.
    pub fn audit_destination(&self) -> String {
        match (&self.audit_db, self.audit_shipping) {
            (Some(db), true) => format!(
                "audit records are shipped from Consul audit_logs/ to {db} (one farm ships at a time)"
            ),
            (_, false) => "audit records are left in Consul audit_logs/ for an external consumer (this farm: --audit-shipping off)".to_string(),
            (None, true) => "audit records wait in Consul audit_logs/ for a farm that ships them (this farm has no --audit-db)".to_string(),
        }
    }

    pub fn session_name(&self) -> String {
        format!("rcfarm:{}:{}", self.farm_id, hostname())
    }
}

fn hostname() -> String {
    hostname::get()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "unknown-host".into())
}

#[derive(Debug, thiserror::Error)]
pub enum FarmError {
    #[error(transparent)]
    Consul(#[from] ConsulError),

    /// At start, Consul refused what the farm needs with the token it was given (or without
    /// one); the farm stopped before creating a session or claiming anything.
    #[error(
        "Consul refused {}: {detail}. The farm needs {needs}",
        .token.as_deref().unwrap_or(
            "requests without an ACL token (Consul's anonymous token); give one with --consul-token-file / CONSUL_HTTP_TOKEN_FILE, or --consul-token / CONSUL_HTTP_TOKEN"
        )
    )]
    AclRefused {
        /// Which token was refused, in words (none: the anonymous token).
        token: Option<String>,
        detail: String,
        needs: String,
    },

    /// At start, no TLS connection to Consul could be made: its certificate was not trusted,
    /// it refused ours (or wanted one), or the port does not speak TLS.
    #[error("cannot talk TLS to Consul at {addr}: {detail}{}", crate::consul::tls_advice(.detail))]
    Tls { addr: String, detail: String },
}

fn apply_roll_event(rolls: &mut OwnedRolls, ev: RollEvent) {
    match ev {
        RollEvent::Fenced(id) => rolls.fenced(id),
        RollEvent::Completed(id, index) => rolls.finished(id, index),
    }
}

/// What serving under one session works with.
struct Serving<'a> {
    session: &'a Session,
    info: &'a FarmInfo,
    ctx: Arc<TaskContext>,
    roll_ctx: Arc<RollContext>,
    locks_tx: LocksTx,
}

/// Why serving under one session ended.
enum Ended {
    Shutdown,
    SessionLost(String),
}

/// The farm's watched view of Consul.
struct Views {
    /// Every RC key (claims and the emptied-tree tripwire need no more of the tree).
    rc_keys: RcKeysWatch,
    /// The records of the RCs this farm serves or is about to, of rolling updates' RCs and of
    /// RCs under a held mutation lock, read when the keys' index moves (see `rc::records`).
    records: RcRecords,
    locks: LockWatch,
    farms: Watch<Vec<KvPair>>,
    rolls: RollWatch,
    roll_locks: Watch<Vec<KvPair>>,
    rc_labels: Arc<LabelCache>,
    nodes: Arc<LabelCache>,
    /// Keeps the node tree read after every change as before, while letting a decision ask
    /// for a read sent now (`crate::freshness`: a removal from a node view behind the RC write).
    _nodes_every_change: FastGuard,
    pods: Arc<LabelCache>,
    health: Arc<HealthCache>,
    /// This farm's release key (`rcctl farm release-removals`).
    release: Watch<Option<KvPair>>,
    /// The cluster's removal window (`crate::budget`): what every farm's removals charged.
    window: Watch<Option<KvPair>>,
}

/// A running farm.
pub struct Farm {
    config: FarmConfig,
    consul: Consul,
    status: Arc<StatusRegistry>,
    roll_status: Arc<RollStatusRegistry>,
    ready: watch::Sender<bool>,
    audit: watch::Sender<Option<Arc<AuditStore>>>,
    shipper_stats: Arc<ShipperStats>,
    /// Paces RC and roll writes while the audit outbox is too big.
    pace: Arc<crate::audit::AuditPace>,
    /// Unclaimable RC keys already reported, with the version reported.
    unclaimable_reported: parking_lot::Mutex<HashMap<String, u64>>,
    /// Keys under the lock prefix that are not RC locks, already logged.
    garbage_locks_reported: parking_lot::Mutex<GarbageReported>,
    /// Kept across sessions: removals made before a session loss still count.
    failsafe: Arc<crate::failsafe::Failsafe>,
    failsafe_seen: parking_lot::Mutex<failsafe::FailsafeSeen>,
    /// What claims need of the pod label tree (reset with each session).
    pod_freshness: parking_lot::Mutex<rcs::PodFreshness>,
    /// The live farms, which pace their watches together (see `WatchConfig::readers`).
    readers: Arc<std::sync::atomic::AtomicUsize>,
    /// When the RC lock tree is read.
    lock_demand: Arc<Demand>,
    /// The last reconcile's inputs, reused while they are unchanged.
    claim_inputs: parking_lot::Mutex<Option<Arc<rcs::ClaimInputs>>>,
    /// Which pods the pod label cache keeps.
    pod_interest: Arc<parking_lot::RwLock<rcs::PodInterest>>,
    /// How many times a watch was answered with an older state than it had seen, and how
    /// many of those the RC reconcile has acted on (see `reconcile_rcs`).
    store_regressions: Arc<crate::consul::Regressions>,
    regressions_acted: std::sync::atomic::AtomicU64,
    /// The assignment rule of the last RC reconcile (0 before the first), to log its changes.
    rule_in_use: std::sync::atomic::AtomicU32,
}

/// The longest the RC lock tree goes unread while it changes and nothing asks for it (a
/// claim rush: each batch of claims changes it, and every farm re-reading 1.5 MiB at 20,000
/// RCs for each was most of what the farms read from Consul after the pod labels), with three
/// farms; with more it grows as their watches' pace does.
const LOCK_TREE_IDLE: Duration = Duration::from_secs(2);

/// How often a farm counts the pods whose RC is gone (`rcfarm_orphaned_pods`): a walk of the
/// pod cache's index of RC ids, for an alert that waits 15 minutes.
const ORPHAN_COUNT_EVERY: Duration = Duration::from_secs(10);

/// How much slower than other watches the RC keys are read, per MiB of answer.
const KEYS_PACE_FACTOR: u32 = 4;

/// How long after a farm left every change of the lock tree is read.
const HANDOVER_FAST: Duration = Duration::from_secs(15);

impl Farm {
    pub fn new(config: FarmConfig) -> Result<Farm, FarmError> {
        let consul = Consul::new(config.consul.clone())?;
        Ok(Farm::with_consul(config, consul))
    }

    /// A farm whose every request goes through `consul` (one built with [`Consul::over`]
    /// reaches an in-memory Consul); `config.consul` then only names it.
    pub fn with_consul(config: FarmConfig, consul: Consul) -> Farm {
        let status = Arc::new(StatusRegistry::default());
        status.update_farm(|f| {
            f.farm_id = config.farm_id.clone();
            f.session_name = config.session_name();
            f.audit_shipping = config.ships_audit();
            f.audit_destination = config.audit_destination();
        });
        let (ready, _) = watch::channel(false);
        let (audit, _) = watch::channel(None);
        let failsafe = Arc::new(
            crate::failsafe::Failsafe::new(config.farm_id.clone(), config.failsafe)
                .with_clock(config.clock),
        );
        let readers = Arc::new(std::sync::atomic::AtomicUsize::new(1));
        let pace = Arc::new(crate::audit::AuditPace::new(config.audit_pace));
        Farm {
            failsafe,
            failsafe_seen: parking_lot::Mutex::default(),
            pod_freshness: parking_lot::Mutex::default(),
            readers: readers.clone(),
            lock_demand: Demand::shared(LOCK_TREE_IDLE, Some(readers)),
            claim_inputs: parking_lot::Mutex::default(),
            pod_interest: Arc::default(),
            store_regressions: Arc::default(),
            regressions_acted: Default::default(),
            rule_in_use: Default::default(),
            config,
            consul,
            status,
            roll_status: Arc::default(),
            ready,
            audit,
            shipper_stats: Arc::default(),
            pace,
            unclaimable_reported: parking_lot::Mutex::default(),
            garbage_locks_reported: parking_lot::Mutex::default(),
        }
    }

    /// The audit database, once connected.
    pub fn audit_store(&self) -> watch::Receiver<Option<Arc<AuditStore>>> {
        self.audit.subscribe()
    }

    pub fn shipper_stats(&self) -> Arc<ShipperStats> {
        self.shipper_stats.clone()
    }

    pub fn status(&self) -> Arc<StatusRegistry> {
        self.status.clone()
    }

    /// What this farm reports about the rolling updates it carries out.
    pub fn roll_status(&self) -> Arc<RollStatusRegistry> {
        self.roll_status.clone()
    }

    pub fn consul(&self) -> &Consul {
        &self.consul
    }

    /// True once the farm holds a session and its views have synced.
    pub fn ready(&self) -> watch::Receiver<bool> {
        self.ready.subscribe()
    }

    /// Runs until `shutdown`: then stops tasks, releases every lock, destroys the session.
    /// Fails at start, having done nothing, if Consul refuses the farm's ACL token or its TLS.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<(), FarmError> {
        // The audit database does not depend on Consul: connect it while Consul is checked.
        self.connect_audit(&shutdown);
        self.read_backlog(&shutdown);
        if !self.check_access(&shutdown).await? {
            return Ok(());
        }
        let cfg = &self.config;
        // For the alert on transfers running past it.
        metrics::gauge!("rcfarm_transfer_timeout_seconds")
            .set(cfg.task.transfer_timeout.as_secs_f64());
        let mut w = cfg.watch.clone();
        w.readers = Some(self.readers.clone());
        w.regressions = Some(self.store_regressions.clone());
        let pod_demand = Demand::new(cfg.consistency_interval);
        let node_demand = Demand::new(cfg.consistency_interval);
        // The pool scheduler counts every pod on a node, whoever wrote it.
        let pool = cfg.pool_scheduler();
        let _pool_reads_every_change = pool.then(|| pod_demand.fast());
        self.pod_interest.write().everything = pool;
        let views = Views {
            // Each answer of the keys costs a read of the records of every RC this farm serves
            // too (a keys answer cannot say which changed): paced as an answer four times its
            // size (20,000 RCs: one a second at most; 200: every 20 ms).
            rc_keys: RcKeysWatch::spawn(
                &self.consul,
                WatchConfig {
                    pace_per_mib: w.pace_per_mib * KEYS_PACE_FACTOR,
                    ..w.clone()
                },
            ),
            records: RcRecords::new(self.consul.clone()),
            // Read on demand too: claims of RCs assigned to this farm need no view of the
            // others' (a claim of a held lock just fails), so during a claim rush the tree is
            // read every `LOCK_TREE_IDLE`, and at once when a farm comes or goes, a claim
            // finds a lock held, or a rolling update is in flight.
            locks: RcStore::new(self.consul.clone())
                .watch_locks(w.clone().on_demand(self.lock_demand.clone())),
            farms: self.consul.watch_prefix(FARMS_PREFIX, w.clone()),
            rolls: RollStore::new(self.consul.clone()).watch(w.clone()),
            roll_locks: self.consul.watch_prefix(ROLL_LOCK_PREFIX, w.clone()),
            rc_labels: Arc::new(LabelCache::spawn(
                &self.consul,
                LabelType::ReplicationController,
                w.clone(),
            )),
            nodes: Arc::new(LabelCache::spawn(
                &self.consul,
                LabelType::Node,
                w.clone().on_demand(node_demand.clone()),
            )),
            _nodes_every_change: node_demand.fast(),
            // Read on demand: this farm's own pod writes are applied as it commits them, so
            // it reads the whole tree only when it takes RCs over from another session, while
            // rolling updates run, when a write finds a label changed behind its back, and
            // at least once per consistency interval (see `rcs::PodFreshness`).
            pods: Arc::new(LabelCache::spawn_keeping(
                &self.consul,
                LabelType::Pod,
                w.clone().on_demand(pod_demand.clone()),
                Some(crate::labels::Keep({
                    let interest = self.pod_interest.clone();
                    Arc::new(move |l| interest.read().keep(l))
                })),
            )),
            health: Arc::new(HealthCache::spawn(&self.consul, w.clone())),
            release: self
                .consul
                .watch_key(crate::failsafe::release_key(&cfg.farm_id), w.clone()),
            window: self.consul.watch_key(crate::budget::BUDGET_KEY, w.clone()),
        };
        let scheduler: Arc<dyn Scheduler> = match &cfg.scheduler {
            SchedulerKind::Label => Arc::new(LabelScheduler::new(views.nodes.clone())),
            SchedulerKind::Pool(pc) => Arc::new(
                PoolScheduler::new(
                    &self.consul,
                    views.nodes.clone(),
                    views.pods.clone(),
                    pc.clone(),
                    w.clone(),
                )
                .with_clock(cfg.clock),
            ),
        };
        tracing::info!(farm_id = %cfg.farm_id, scheduler = scheduler.name(), rc_selector = %cfg.rc_selector, "farm starting");
        let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
        // Until the first session: what Consul refuses then is a setup mistake.
        let mut started = false;
        loop {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            let session = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                s = self.open_session() => s,
            };
            let (session, info) = match session {
                Ok(s) => s,
                Err(e) => {
                    if !started && let Some(fatal) = self.fatal_at_start(&e) {
                        return Err(fatal);
                    }
                    let wait = backoff.next_delay();
                    tracing::warn!(error = %e, retry_in = ?wait, "cannot create a Consul session");
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(()),
                        _ = tokio::time::sleep(wait) => continue,
                    }
                }
            };
            backoff.reset();
            started = true;
            self.failsafe.set_session(session.id());
            let (locks_tx, locks_rx) = watch::channel(Arc::new(LockView::default()));
            let roll_ctx = Arc::new(RollContext {
                consul: self.consul.clone(),
                farm_id: cfg.farm_id.clone(),
                rcs: views.records.subscribe(),
                locks: locks_rx.clone(),
                pods: views.pods.clone(),
                health: views.health.clone(),
                status: self.roll_status.clone(),
                failsafe: self.failsafe.clone(),
                pace: self.pace.clone(),
                config: cfg.roll.clone(),
                clock: cfg.clock,
            });
            let ctx = Arc::new(TaskContext {
                consul: self.consul.clone(),
                farm_id: cfg.farm_id.clone(),
                pods: views.pods.clone(),
                nodes: views.nodes.clone(),
                health: views.health.clone(),
                scheduler: scheduler.clone(),
                intents: Arc::new(IntentView::default()),
                transfers: Arc::new(crate::rctask::TransferReader::new(self.consul.clone())),
                status: self.status.clone(),
                locks: locks_rx,
                rcs: views.records.subscribe(),
                failsafe: self.failsafe.clone(),
                pod_tickets: Default::default(),
                roll_sources: Default::default(),
                pace: self.pace.clone(),
                store_regressions: self.store_regressions.clone(),
                config: cfg.task.clone(),
                clock: cfg.clock,
            });
            let shipper_stop = session.lost().child_token();
            let shipper = self.spawn_shipper(&session, shipper_stop.clone());
            let ended = self
                .serve(
                    &views,
                    &Serving {
                        session: &session,
                        info: &info,
                        ctx,
                        roll_ctx,
                        locks_tx,
                    },
                    &shutdown,
                )
                .await;
            // Stored even when nobody listens, so a later subscriber is not told "ready".
            self.ready.send_replace(false);
            // The shipper gives its lock back before the session goes.
            shipper_stop.cancel();
            if let Some(h) = shipper {
                let _ = tokio::time::timeout(Duration::from_secs(10), h).await;
            }
            match ended {
                Ended::Shutdown => {
                    let _ = session.destroy().await;
                    tracing::info!("farm stopped; session destroyed");
                    return Ok(());
                }
                Ended::SessionLost(reason) => {
                    metrics::counter!("rcfarm_session_losses_total").increment(1);
                    self.status.update_farm(|f| {
                        f.session = None;
                        f.session_losses += 1;
                    });
                    self.status.clear_rcs();
                    self.roll_status.clear();
                    self.failsafe.clear_held();
                    let wait = jitter_half(Duration::from_secs(2));
                    tracing::warn!(%reason, retry_in = ?wait, "session lost: every RC task stopped; starting over with a new session");
                    // We gave up on it after one TTL without renewal, but Consul may still
                    // honour it (up to 2×TTL, or again after a restart that reset its timer):
                    // destroying it frees our locks for whoever comes next, us included.
                    let _ = tokio::time::timeout(Duration::from_secs(2), session.destroy()).await;
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(()),
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }
    }

    async fn open_session(&self) -> Result<(Session, FarmInfo), ConsulError> {
        let cfg = &self.config;
        let session = Session::create(
            &self.consul,
            &SessionConfig {
                name: cfg.session_name(),
                ttl: cfg.session_ttl,
                lock_delay: cfg.lock_delay,
                behavior: SessionBehavior::Delete,
            },
        )
        .await?;
        let info = FarmInfo {
            farm_id: cfg.farm_id.clone(),
            hostname: hostname(),
            session: session.id().clone(),
            session_name: cfg.session_name(),
            rc_selector: cfg.rc_selector.to_string(),
            pid: std::process::id(),
            started_at: cfg.clock.wall(),
            http: cfg.http.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            audit_shipping: cfg.audit_shipping,
            assignment_rule: cfg.assignment_rule.number(),
        };
        let body = serde_json::to_vec(&info).unwrap_or_default();
        let registered = self
            .consul
            .kv_acquire(&info.key(), &body, session.id(), None)
            .await;
        let failed = match registered {
            Ok(true) => None,
            // Another session holds this farm's registry key: a second farm with the same id.
            Ok(false) => Some(ConsulError::Config(format!(
                "could not register {}: another live farm holds it (is a second farm running with --farm-id {}? give each farm its own id)",
                info.key(),
                cfg.farm_id
            ))),
            Err(e) => Some(e),
        };
        if let Some(e) = failed {
            // Never a session without the registration that tells other farms about it.
            let _ = tokio::time::timeout(Duration::from_secs(2), session.destroy()).await;
            return Err(e);
        }
        self.status
            .update_farm(|f| f.session = Some(session.id().to_string()));
        Ok((session, info))
    }

    /// Before anything else: checks that Consul lets the farm's token do what the farm does
    /// (see [`access`]), retrying while Consul is unavailable. `false`: shut down meanwhile.
    async fn check_access(&self, shutdown: &CancellationToken) -> Result<bool, FarmError> {
        let pool = self.config.pool_scheduler();
        let ships_audit = self.config.ships_audit();
        let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
        loop {
            let checked = tokio::select! {
                _ = shutdown.cancelled() => return Ok(false),
                r = access::check(&self.consul, pool, ships_audit) => r,
            };
            let e = match checked {
                Ok(()) => return Ok(true),
                Err(e) => e,
            };
            if let Some(fatal) = self.fatal_at_start(&e) {
                return Err(fatal);
            }
            let wait = backoff.next_delay();
            tracing::warn!(error = %e, retry_in = ?wait, "cannot check the farm's access to Consul");
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(false),
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Errors that retrying cannot mend, when they happen before the farm first served: a
    /// refused ACL token, a TLS certificate not trusted.
    fn fatal_at_start(&self, e: &ConsulError) -> Option<FarmError> {
        if let ConsulError::PermissionDenied(detail) = e {
            let detail = if detail.contains("ACL not found") {
                format!("{detail} (Consul knows no such token)")
            } else {
                detail.clone()
            };
            return Some(FarmError::AclRefused {
                token: self.config.consul.token_origin(),
                detail,
                needs: access::needs(self.config.pool_scheduler(), self.config.ships_audit()),
            });
        }
        e.tls_problem().map(|detail| FarmError::Tls {
            addr: self.consul.address().to_string(),
            detail: detail.to_string(),
        })
    }

    async fn serve(&self, views: &Views, sv: &Serving<'_>, shutdown: &CancellationToken) -> Ended {
        let session = sv.session;
        let lost = session.lost().clone();
        let mut doubt_rx = session.doubt();
        let (ev_tx, mut ev_rx) = mpsc::unbounded_channel::<TaskEvent>();
        let (roll_ev_tx, mut roll_ev_rx) = mpsc::unbounded_channel::<RollEvent>();
        let mut owned = OwnedRcs::new(RcKind {
            farm_id: self.config.farm_id.clone(),
            status: self.status.clone(),
            failsafe: self.failsafe.clone(),
        });
        let mut rolls = OwnedRolls::new(RollKind {
            farm_id: self.config.farm_id.clone(),
            status: self.roll_status.clone(),
        });
        let mut roll_dispatch = RollDispatch::default();
        let mut rc_rx = views.rc_keys.subscribe();
        let mut lock_rx = views.locks.subscribe();
        let mut farm_rx = views.farms.subscribe();
        let mut rolls_rx = views.rolls.subscribe();
        let mut roll_lock_rx = views.roll_locks.subscribe();
        let mut rc_label_rx = views.rc_labels.subscribe_version();
        let mut pod_changes = views.pods.subscribe_changes();
        let mut node_changes = views.nodes.subscribe_changes();
        let mut health_changes = views.health.subscribe_changes();
        let mut release_rx = views.release.subscribe();
        let mut window_rx = views.window.subscribe();
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut next_sweep = self.config.clock.now() + Duration::from_secs(1);
        let mut next_orphans = self.config.clock.now();
        // RCs taken over from another session, whose intents are swept soon (once the read of
        // the pod labels their claim asked for is in).
        let mut taken_over: BTreeSet<RcId> = BTreeSet::new();
        let mut last_sweep: Option<Instant> = None;

        // A new session: what the last one wrote with its answer lost is learnt from a read.
        *self.pod_freshness.lock() =
            rcs::PodFreshness::new(views.pods.demand(), self.status.farm().session_losses > 0);
        let mut roll_fast: Option<(FastGuard, FastGuard)> = None;
        let mut awaited = rcs::AwaitedHandovers::new(HANDOVER_FAST);
        if self.farms_changed(views).changed {
            awaited.farms_changed(self.config.clock.now());
        }
        // A farm that leaves gives its locks back over seconds (a transaction per few dozen
        // RCs): for a while every change of the lock tree is read, so they are taken at once.
        let mut handover_fast: Option<(FastGuard, Instant)> = None;
        tracing::info!(session = %session.id(), "serving");
        // Claims are reconsidered when what they depend on changes (RCs or rolls, locks,
        // farms, RC labels, a task stopping) and on each tick; pod, node and health changes
        // only wake the tasks they concern.
        let (mut dirty, mut dirty_rolls) = (true, true);
        Self::publish_roll_sources(&sv.ctx, views.rolls.latest().as_deref());
        loop {
            // The records of what this farm reads, brought to the latest keys (the tree
            // changed), or to what it now serves, rolls or sees locked.
            let keys_index = rc_rx.borrow().as_ref().map(|k| k.index);
            if keys_index.is_some()
                && (dirty || dirty_rolls || views.records.latest().map(|l| l.index) != keys_index)
            {
                let interest = self.record_interest(views, owned.tasks.keys().copied());
                if self.sync_records(views, &interest).await {
                    dirty = true;
                    if let Some(listing) = views.records.latest() {
                        self.dispatch_rcs_to_rolls(
                            &rolls,
                            views.rolls.latest().as_deref(),
                            &listing,
                            &mut roll_dispatch,
                        );
                    }
                }
            }
            let ready = keys_index.is_some()
                && views.records.latest().is_some()
                && lock_rx.borrow().is_some()
                && farm_rx.borrow().is_some()
                && rolls_rx.borrow().is_some()
                && roll_lock_rx.borrow().is_some()
                && views.nodes.is_synced()
                && views.pods.is_synced()
                && views.rc_labels.is_synced()
                && views.health.tree().is_synced()
                && release_rx.borrow().is_some()
                && window_rx.borrow().is_some();
            // In doubt, what the farm holds is kept but nothing is claimed or given up: a
            // claim could not commit anyway, and a release would hand RCs over for nothing if
            // the session holds (see consul::session).
            let in_doubt = *doubt_rx.borrow_and_update();
            if handover_fast
                .as_ref()
                .is_some_and(|(_, until)| self.config.clock.now() >= *until)
            {
                handover_fast = None;
            }
            // Rolling updates move pods between RCs that other farms may own: while any is in
            // flight, every change to the pod label tree is read.
            let rolling = views.rolls.latest().is_some_and(|l| !l.rolls.is_empty());
            if rolling != roll_fast.is_some() {
                // Kept before the read the guard asks for, so that read brings every pod.
                self.pod_interest.write().everything = rolling || self.config.pool_scheduler();
                roll_fast = match views.pods.demand() {
                    Some(d) if rolling => Some((d.fast(), self.lock_demand.fast())),
                    _ => None,
                };
            }
            if ready {
                // Before claims and tasks act on a new listing: a tree just emptied or zeroed
                // must trip the failsafe before any task sees it.
                self.watch_failsafe(views, sv, &owned, &rolls).await;
            }
            if ready && dirty && !in_doubt {
                dirty = false;
                let locks_before = sv.locks_tx.borrow().clone();
                let claimed = self
                    .reconcile_rcs(
                        views,
                        session,
                        sv.info,
                        &sv.ctx,
                        &mut owned,
                        &ev_tx,
                        &sv.locks_tx,
                    )
                    .await;
                let locks_after = sv.locks_tx.borrow().clone();
                if !Arc::ptr_eq(&locks_before, &locks_after) {
                    self.dispatch_locks_to_rolls(
                        &rolls,
                        views.rolls.latest().as_deref(),
                        &locks_before,
                        &locks_after,
                    );
                }
                // Swept once the read of the pod labels their claim asked for is in.
                taken_over.extend(claimed);
                let inputs = self.claim_inputs.lock().clone();
                awaited.update(
                    inputs,
                    &self.config.farm_id,
                    session.id(),
                    &self.lock_demand,
                    self.config.clock.now(),
                );
            }
            if ready && dirty_rolls && !in_doubt {
                dirty_rolls = false;
                // News from roll tasks first: a task that ended because its roll completed
                // must not be started again from a view that still shows the roll.
                while let Ok(ev) = roll_ev_rx.try_recv() {
                    apply_roll_event(&mut rolls, ev);
                }
                self.reconcile_rolls(
                    views,
                    session,
                    sv.info,
                    &sv.roll_ctx,
                    &mut rolls,
                    &roll_ev_tx,
                )
                .await;
            }
            if ready {
                let _ = self.ready.send_if_modified(|r| {
                    let changed = *r == in_doubt;
                    *r = !in_doubt;
                    changed
                });
                self.status.update_farm(|f| f.synced = true);
            }
            if ready && self.config.clock.now() >= next_orphans {
                metrics::gauge!("rcfarm_orphaned_pods").set(Self::orphaned_pods(views) as f64);
                next_orphans = self.config.clock.now() + ORPHAN_COUNT_EVERY;
            }
            if ready && !in_doubt && self.config.clock.now() >= next_sweep {
                self.sweep(views, &sv.ctx, &owned, None).await;
                next_sweep = self.config.clock.now()
                    + jitter_half(self.config.consistency_interval * 2)
                        .min(self.config.consistency_interval * 2);
                taken_over.clear();
            }
            // Taken-over RCs' intents: claims come in rounds while a dead farm's RCs are taken
            // over, so these sweeps are at most one every 2 s (the tick looks again), and each
            // reads only what was taken over since the last.
            let pods_known = views.pods.demand().is_none_or(|d| {
                let tickets = sv.ctx.pod_tickets.lock();
                taken_over
                    .iter()
                    .filter_map(|id| tickets.get(id))
                    .all(|t| d.is_fresh(*t))
            });
            if ready
                && !in_doubt
                && !taken_over.is_empty()
                && pods_known
                && last_sweep.is_none_or(|t: Instant| t.elapsed() >= Duration::from_secs(2))
            {
                last_sweep = Some(self.config.clock.now());
                let only = std::mem::take(&mut taken_over);
                self.sweep(views, &sv.ctx, &owned, Some(&only)).await;
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => {
                    self.hand_over(sv, &mut owned, &mut rolls, views).await;
                    return Ended::Shutdown;
                }
                _ = lost.cancelled() => {
                    // Stop every task at once; their writes are fenced anyway, but they must
                    // not even try.
                    owned.cancel_all();
                    rolls.cancel_all();
                    return Ended::SessionLost(session.loss_reason().unwrap_or_default());
                }
                r = doubt_rx.changed() => {
                    if r.is_err() { return Ended::SessionLost("session renewer ended".into()); }
                    let in_doubt = *doubt_rx.borrow();
                    self.status.update_farm(|f| f.session_in_doubt = in_doubt);
                    dirty = true;
                    dirty_rolls = true;
                }
                Some(ev) = ev_rx.recv() => {
                    let TaskEvent::Fenced(id) = ev;
                    owned.fenced(id);
                    dirty = true;
                }
                Some(ev) = roll_ev_rx.recv() => {
                    apply_roll_event(&mut rolls, ev);
                    dirty_rolls = true;
                }
                r = rc_rx.changed() => {
                    if r.is_err() { return Ended::SessionLost("RC watch ended".into()); }
                    // The records are read at the top of the loop.
                    dirty = true;
                }
                r = lock_rx.changed() => {
                    if r.is_err() { return Ended::SessionLost("lock watch ended".into()); }
                    dirty = true;
                }
                r = farm_rx.changed() => {
                    if r.is_err() { return Ended::SessionLost("farm watch ended".into()); }
                    let change = self.farms_changed(views);
                    if change.left {
                        handover_fast = Some((self.lock_demand.fast(), self.config.clock.now() + HANDOVER_FAST));
                    }
                    if change.changed {
                        awaited.farms_changed(self.config.clock.now());
                    }
                    dirty = true;
                    dirty_rolls = true;
                }
                r = rolls_rx.changed() => {
                    if r.is_err() { return Ended::SessionLost("roll watch ended".into()); }
                    Self::publish_roll_sources(&sv.ctx, views.rolls.latest().as_deref());
                    dirty_rolls = true;
                }
                r = release_rx.changed() => {
                    if r.is_err() { return Ended::SessionLost("release watch ended".into()); }
                }
                r = window_rx.changed() => {
                    if r.is_err() { return Ended::SessionLost("removal window watch ended".into()); }
                }
                r = roll_lock_rx.changed() => {
                    if r.is_err() { return Ended::SessionLost("roll lock watch ended".into()); }
                    dirty_rolls = true;
                }
                r = rc_label_rx.changed() => {
                    // An ended watch answers at once, for ever: ignored, it made this loop spin.
                    if r.is_err() { return Ended::SessionLost("RC label watch ended".into()); }
                    dirty = true;
                    dirty_rolls = true;
                }
                c = pod_changes.recv() => {
                    self.dispatch_pods_to_rolls(&rolls, views.rolls.latest().as_deref(), &c);
                    self.dispatch_pod_changes(&owned, c);
                }
                c = node_changes.recv() => self.dispatch_node_changes(&owned, views, c),
                c = health_changes.recv() => {
                    let pods = match c {
                        Ok(keys) => Some(crate::health::changed_pods(&keys)),
                        // Missed some: every task looks again.
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => None,
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                            return Ended::SessionLost("health watch ended".into());
                        }
                    };
                    self.dispatch_health_changes(&owned, views, pods.as_ref());
                    self.dispatch_health_to_rolls(&rolls, views, pods.as_ref());
                }
                _ = tick.tick() => {
                    dirty = true;
                    dirty_rolls = true;
                }
                // RCs left between farms settle sooner than the tick.
                _ = tokio::time::sleep_until(owned.recheck_at().unwrap_or(next_sweep)), if owned.recheck_at().is_some() => {
                    owned.recheck_due();
                    dirty = true;
                }
                // Only while a sweep can run: in doubt (or not synced) a sweep past due would
                // answer at once, every time, and the loop would spin until the doubt ends.
                _ = tokio::time::sleep_until(next_sweep), if ready && !in_doubt => {}
            }
        }
    }

    /// The farm registry changed (or is first seen by this session). Returns whether a farm
    /// left since it was last seen.
    /// Pods whose label names an RC that no longer exists (deleted with `--force`, by P2's
    /// CLI or a KV write): nothing manages them. Every farm sees them (its pod cache leaves out
    /// only pods of RCs other farms hold), so the alert takes the max over farms.
    fn orphaned_pods(views: &Views) -> usize {
        let Some(keys) = views.rc_keys.latest() else {
            return 0;
        };
        views
            .pods
            .value_counts(crate::rc::RC_ID_LABEL)
            .into_iter()
            .filter(|(rc, _)| match RcId::parse(rc) {
                Ok(id) => !keys.ids.contains(&id),
                // Not an RC id at all: no RC of rcfarm's manages it, but it is no RC's left
                // behind either.
                Err(_) => false,
            })
            .map(|(_, n)| n)
            .sum()
    }

    /// Tells the RC tasks which RC each rolling update moves replicas from, by its new RC:
    /// only that RC's given-up pods are taken over (see `rctask::worker`'s `neighbours`).
    fn publish_roll_sources(ctx: &TaskContext, rolls: Option<&crate::roll::RollListing>) {
        let sources: HashMap<RcId, RcId> = rolls
            .map(|l| {
                l.rolls
                    .values()
                    .map(|r| (r.update.new_rc, r.update.old_rc))
                    .collect()
            })
            .unwrap_or_default();
        if **ctx.roll_sources.read() != sources {
            *ctx.roll_sources.write() = Arc::new(sources);
        }
    }

    fn farms_changed(&self, views: &Views) -> rcs::FarmsChange {
        let Some(snap) = views.farms.latest() else {
            return rcs::FarmsChange {
                changed: false,
                left: false,
            };
        };
        let farms = registry::live_farms(&snap.value);
        self.failsafe
            .set_live_farms(registry::sessions_by_farm(&farms), snap.index);
        let live: BTreeSet<String> = farms.into_iter().map(|f| f.session.into()).collect();
        self.readers
            .store(live.len().max(1), std::sync::atomic::Ordering::Relaxed);
        // Locks are about to be given back, or to be taken.
        self.lock_demand.urge();
        self.pod_freshness
            .lock()
            .farms_seen(live, views.pods.demand())
    }

    fn claim_farm<'a>(&'a self, session: &'a Session) -> ClaimFarm<'a> {
        ClaimFarm {
            consul: &self.consul,
            session,
            farm_id: &self.config.farm_id,
            clock: self.config.clock,
            rules: ClaimRules {
                // The farm an RC is assigned to sees it up to a watch pace late, and the pace
                // grows with the farms (see `WatchConfig::readers`): so does the grace, or
                // farms would take each other's new RCs in a rush and hand them back.
                grace: self
                    .config
                    .claim_grace
                    .mul_f64(crate::consul::readers_scale(Some(&self.readers)).max(1.0)),
                slack: self.config.share_slack,
            },
        }
    }

    /// Graceful shutdown: stop tasks, leave the registry, release every lock.
    async fn hand_over(
        &self,
        sv: &Serving<'_>,
        owned: &mut OwnedRcs,
        rolls: &mut OwnedRolls,
        views: &Views,
    ) {
        let (session, info) = (sv.session, sv.info);
        let started = self.config.clock.now();
        let _ = self
            .consul
            .txn(&[
                TxnOp::check_session(info.key(), session.id()),
                TxnOp::delete(info.key()),
            ])
            .await;
        let locks = sv.locks_tx.borrow().clone();
        self.hand_over_rolls(session, rolls, views.rolls.latest().as_deref(), &locks)
            .await;
        let farm = self.claim_farm(session);
        let ids = owned.hand_over(&farm).await;
        // Mutation locks of transfers in flight: the next owner resumes them. If this fails the
        // locks go with the session, destroyed next.
        if let Err(e) = RcStore::new(self.consul.clone())
            .release_transfer_mutations(&ids, session.id())
            .await
        {
            tracing::warn!(error = %e, "could not release transfer locks; they go with the session");
        }
        self.status.clear_rcs();
        tracing::info!(released = ids.len(), took = ?started.elapsed(), "handed every RC over");
    }
}

//! The farm: holds a Consul session, claims its fair share of the RCs with their ownership
//! locks, runs one task per claimed RC, and hands RCs over when farms come and go.
//!
//! A handful of blocking queries feed it, whatever the number of RCs: the RC tree, the lock
//! tree, the farm registry, the label trees (RCs, nodes, pods), health, and the pool scheduler's
//! reservations. Changes are dispatched to the tasks they concern.

pub mod claims;
pub mod registry;
pub mod sweep;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::audit::{AuditRecord, AuditStore, Shipper, ShipperConfig, ShipperStats, events};
use crate::consul::{
    Consul, ConsulConfig, ConsulError, KvPair, MAX_TXN_OPS, Session, SessionBehavior,
    SessionConfig, TxnOp, Watch, WatchConfig,
};
use crate::health::HealthCache;
use crate::labels::{LabelCache, LabelChanges, LabelSet, LabelType, Selector};
use crate::rc::{InvalidRc, RC_ID_LABEL, RcId, RcListing, RcStore, RcWatch, parse_locks};
use crate::rctask::{
    IntentView, RcState, StatusRegistry, TaskConfig, TaskContext, TaskEvent, TaskHandle,
};
use crate::scheduler::{LabelScheduler, PoolConfig, PoolScheduler, Scheduler};
use crate::util::{Backoff, jitter_half};
use claims::assign;
use registry::{FARMS_PREFIX, FarmInfo};

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
    pub watch: WatchConfig,
    /// Announced in the farm registry (for `rcctl farms` and the status page).
    pub http: Option<String>,
    /// Where the audit log is shipped (`sqlite://…` or `postgres://…`); `None`: this farm
    /// does not ship (records wait in Consul for a farm that does).
    pub audit_db: Option<String>,
    pub shipper: ShipperConfig,
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
            watch: WatchConfig::default(),
            http: None,
            audit_db: None,
            shipper: ShipperConfig::default(),
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
}

/// Why serving under one session ended.
enum Ended {
    Shutdown,
    SessionLost(String),
}

/// The farm's watched view of Consul.
struct Views {
    rcs: RcWatch,
    locks: Watch<Vec<KvPair>>,
    farms: Watch<Vec<KvPair>>,
    rc_labels: Arc<LabelCache>,
    nodes: Arc<LabelCache>,
    pods: Arc<LabelCache>,
    health: Arc<HealthCache>,
}

/// A running farm.
pub struct Farm {
    config: FarmConfig,
    consul: Consul,
    status: Arc<StatusRegistry>,
    ready: watch::Sender<bool>,
    audit: watch::Sender<Option<Arc<AuditStore>>>,
    shipper_stats: Arc<ShipperStats>,
    /// Unclaimable RC keys already reported, with the version reported.
    unclaimable_reported: parking_lot::Mutex<HashMap<String, u64>>,
    /// Keys under the lock prefix that are not RC locks, already logged.
    garbage_locks_reported: parking_lot::Mutex<BTreeSet<String>>,
}

/// What the farm owns under its current session.
struct Owned {
    tasks: BTreeMap<RcId, TaskHandle>,
    /// Lock-tree index at which we claimed each RC; until the watch shows that index, a
    /// missing lock in the view is the watch lagging, not a loss.
    claimed_at: HashMap<RcId, u64>,
    /// When each unheld RC was first seen unheld (for the grace rule).
    unheld_since: HashMap<RcId, Instant>,
    /// The RC versions handed to tasks.
    sent: HashMap<RcId, u64>,
}

impl Farm {
    pub fn new(config: FarmConfig) -> Result<Farm, FarmError> {
        let consul = Consul::new(config.consul.clone())?;
        let status = Arc::new(StatusRegistry::default());
        status.update_farm(|f| {
            f.farm_id = config.farm_id.clone();
            f.session_name = config.session_name();
        });
        let (ready, _) = watch::channel(false);
        let (audit, _) = watch::channel(None);
        Ok(Farm {
            config,
            consul,
            status,
            ready,
            audit,
            shipper_stats: Arc::default(),
            unclaimable_reported: parking_lot::Mutex::default(),
            garbage_locks_reported: parking_lot::Mutex::default(),
        })
    }

    /// The audit database, once connected.
    pub fn audit_store(&self) -> watch::Receiver<Option<Arc<AuditStore>>> {
        self.audit.subscribe()
    }

    pub fn shipper_stats(&self) -> Arc<ShipperStats> {
        self.shipper_stats.clone()
    }

    /// Connects to the audit database in the background, retrying: a farm serves RCs whether
    /// or not SQL is reachable (records wait in the Consul outbox).
    fn connect_audit(&self, shutdown: &CancellationToken) {
        let Some(url) = self.config.audit_db.clone() else {
            return;
        };
        let tx = self.audit.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
            loop {
                match AuditStore::connect(&url).await {
                    Ok(store) => {
                        tracing::info!(db = %store.url(), "audit database ready");
                        // `send_replace`, not `send`: with no receiver at this moment (no HTTP
                        // server, and the shipper not yet subscribed because the session is
                        // still being opened) `send` would drop the store, and this farm would
                        // never ship.
                        tx.send_replace(Some(Arc::new(store)));
                        return;
                    }
                    Err(e) => {
                        let wait = backoff.next_delay();
                        tracing::warn!(error = %e, retry_in = ?wait, "audit database unavailable; records wait in Consul");
                        tokio::select! {
                            _ = shutdown.cancelled() => return,
                            _ = tokio::time::sleep(wait) => {}
                        }
                    }
                }
            }
        });
    }

    /// Runs the shipper under `session` until `stop`.
    fn spawn_shipper(
        &self,
        session: &Session,
        stop: CancellationToken,
    ) -> Option<tokio::task::JoinHandle<()>> {
        self.config.audit_db.as_ref()?;
        let mut store_rx = self.audit.subscribe();
        let consul = self.consul.clone();
        let session_id = session.id().to_string();
        let farm_id = self.config.farm_id.clone();
        let config = self.config.shipper.clone();
        let stats = self.shipper_stats.clone();
        Some(tokio::spawn(async move {
            let store = tokio::select! {
                _ = stop.cancelled() => return,
                s = store_rx.wait_for(Option::is_some) => match s {
                    Ok(s) => s.clone(),
                    Err(_) => return,
                },
            };
            let Some(store) = store else { return };
            Shipper {
                consul,
                store,
                session: session_id,
                farm_id,
                config,
                stats,
            }
            .run(stop)
            .await;
        }))
    }

    pub fn status(&self) -> Arc<StatusRegistry> {
        self.status.clone()
    }

    pub fn consul(&self) -> &Consul {
        &self.consul
    }

    /// True once the farm holds a session and its views have synced.
    pub fn ready(&self) -> watch::Receiver<bool> {
        self.ready.subscribe()
    }

    /// Runs until `shutdown`: then stops tasks, releases every lock, destroys the session.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<(), FarmError> {
        let cfg = &self.config;
        let w = cfg.watch.clone();
        let views = Views {
            rcs: RcStore::new(self.consul.clone()).watch(w.clone()),
            locks: self
                .consul
                .watch_prefix(crate::rc::RC_LOCK_PREFIX, w.clone()),
            farms: self.consul.watch_prefix(FARMS_PREFIX, w.clone()),
            rc_labels: Arc::new(LabelCache::spawn(
                &self.consul,
                LabelType::ReplicationController,
                w.clone(),
            )),
            nodes: Arc::new(LabelCache::spawn(&self.consul, LabelType::Node, w.clone())),
            pods: Arc::new(LabelCache::spawn(&self.consul, LabelType::Pod, w.clone())),
            health: Arc::new(HealthCache::spawn(&self.consul, w.clone())),
        };
        let scheduler: Arc<dyn Scheduler> = match &cfg.scheduler {
            SchedulerKind::Label => Arc::new(LabelScheduler::new(views.nodes.clone())),
            SchedulerKind::Pool(pc) => Arc::new(PoolScheduler::new(
                &self.consul,
                views.nodes.clone(),
                views.pods.clone(),
                pc.clone(),
                w.clone(),
            )),
        };
        tracing::info!(farm_id = %cfg.farm_id, scheduler = scheduler.name(), rc_selector = %cfg.rc_selector, "farm starting");
        self.connect_audit(&shutdown);
        let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
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
                    let wait = backoff.next_delay();
                    tracing::warn!(error = %e, retry_in = ?wait, "cannot create a Consul session");
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(()),
                        _ = tokio::time::sleep(wait) => continue,
                    }
                }
            };
            backoff.reset();
            let (mutation_tx, mutation_rx) = watch::channel(Arc::new(BTreeMap::new()));
            let ctx = Arc::new(TaskContext {
                consul: self.consul.clone(),
                farm_id: cfg.farm_id.clone(),
                pods: views.pods.clone(),
                health: views.health.clone(),
                scheduler: scheduler.clone(),
                intents: Arc::new(IntentView::default()),
                status: self.status.clone(),
                mutation_locks: mutation_rx,
                config: cfg.task.clone(),
            });
            let shipper_stop = session.lost().child_token();
            let shipper = self.spawn_shipper(&session, shipper_stop.clone());
            let ended = self
                .serve(&views, &session, &info, ctx, mutation_tx, &shutdown)
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
            session: session.id().to_string(),
            session_name: cfg.session_name(),
            rc_selector: cfg.rc_selector.to_string(),
            pid: std::process::id(),
            started_at: Utc::now(),
            http: cfg.http.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
        };
        let body = serde_json::to_vec(&info).unwrap_or_default();
        if !self
            .consul
            .kv_acquire(&info.key(), &body, session.id(), None)
            .await?
        {
            let _ = session.destroy().await;
            return Err(ConsulError::Rejected {
                status: 0,
                body: format!("could not register {}", info.key()),
            });
        }
        self.status
            .update_farm(|f| f.session = Some(session.id().to_string()));
        Ok((session, info))
    }

    async fn serve(
        &self,
        views: &Views,
        session: &Session,
        info: &FarmInfo,
        ctx: Arc<TaskContext>,
        mutation_tx: watch::Sender<Arc<BTreeMap<RcId, String>>>,
        shutdown: &CancellationToken,
    ) -> Ended {
        let lost = session.lost().clone();
        let (ev_tx, mut ev_rx) = mpsc::unbounded_channel::<TaskEvent>();
        let mut owned = Owned {
            tasks: BTreeMap::new(),
            claimed_at: HashMap::new(),
            unheld_since: HashMap::new(),
            sent: HashMap::new(),
        };
        let mut rc_rx = views.rcs.subscribe();
        let mut lock_rx = views.locks.subscribe();
        let mut farm_rx = views.farms.subscribe();
        let mut rc_label_rx = views.rc_labels.subscribe_version();
        let mut pod_changes = views.pods.subscribe_changes();
        let mut node_changes = views.nodes.subscribe_changes();
        let mut health_rx = views.health.tree().subscribe();
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut next_sweep = Instant::now() + Duration::from_secs(1);
        let mut sweep_soon = false;

        tracing::info!(session = %session.id(), "serving");
        // Claims are reconsidered when what they depend on changes (RCs, locks, farms, RC
        // labels, a task stopping) and on each tick; pod, node and health changes only wake
        // the tasks they concern.
        let mut dirty = true;
        loop {
            let ready = rc_rx.borrow().is_some()
                && lock_rx.borrow().is_some()
                && farm_rx.borrow().is_some()
                && views.nodes.is_synced()
                && views.pods.is_synced()
                && views.rc_labels.is_synced()
                && views.health.tree().is_synced();
            if ready && dirty {
                dirty = false;
                let claimed = self
                    .reconcile(views, session, info, &ctx, &mut owned, &ev_tx, &mutation_tx)
                    .await;
                sweep_soon |= claimed;
                let _ = self.ready.send_if_modified(|r| {
                    let changed = !*r;
                    *r = true;
                    changed
                });
                self.status.update_farm(|f| f.synced = true);
            }
            if ready && (sweep_soon || Instant::now() >= next_sweep) {
                self.sweep(views, &ctx, &owned).await;
                next_sweep = Instant::now()
                    + jitter_half(self.config.consistency_interval * 2)
                        .min(self.config.consistency_interval * 2);
                sweep_soon = false;
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => {
                    self.hand_over(session, info, &mut owned).await;
                    return Ended::Shutdown;
                }
                _ = lost.cancelled() => {
                    // Stop every task at once; their writes are fenced anyway, but they must
                    // not even try.
                    for (_, t) in std::mem::take(&mut owned.tasks) {
                        t.cancel();
                    }
                    return Ended::SessionLost(session.loss_reason().unwrap_or_default());
                }
                Some(ev) = ev_rx.recv() => {
                    let TaskEvent::Fenced(id) = ev;
                    if let Some(t) = owned.tasks.remove(&id) {
                        t.cancel();
                    }
                    owned.claimed_at.remove(&id);
                    self.status.remove_rc(id);
                    dirty = true;
                }
                r = rc_rx.changed() => {
                    if r.is_err() { return Ended::SessionLost("RC watch ended".into()); }
                    dirty = true;
                }
                r = lock_rx.changed() => {
                    if r.is_err() { return Ended::SessionLost("lock watch ended".into()); }
                    dirty = true;
                }
                r = farm_rx.changed() => {
                    if r.is_err() { return Ended::SessionLost("farm watch ended".into()); }
                    dirty = true;
                }
                _ = rc_label_rx.changed() => dirty = true,
                c = pod_changes.recv() => self.dispatch_pod_changes(&owned, c),
                c = node_changes.recv() => self.dispatch_node_changes(&owned, views, c),
                _ = health_rx.changed() => {
                    let changed = views.health.changed_pods();
                    if let Some(listing) = views.rcs.latest() {
                        for t in owned.tasks.values() {
                            if listing.rcs.get(&t.id).is_some_and(|rc| changed.iter().any(|p| p == rc.pod_id())) {
                                t.wake();
                            }
                        }
                    }
                }
                _ = tick.tick() => dirty = true,
                _ = tokio::time::sleep_until(next_sweep) => {}
            }
        }
    }

    fn dispatch_pod_changes(
        &self,
        owned: &Owned,
        c: Result<Arc<LabelChanges>, tokio::sync::broadcast::error::RecvError>,
    ) {
        match c {
            Ok(ch) => {
                let mut woken = BTreeSet::new();
                for change in &ch.changes {
                    for labels in [&change.old, &change.new].into_iter().flatten() {
                        if let Some(Ok(id)) = labels.get(RC_ID_LABEL).map(|v| RcId::parse(v))
                            && woken.insert(id)
                            && let Some(t) = owned.tasks.get(&id)
                        {
                            t.wake();
                        }
                    }
                }
            }
            // Missed some: wake everyone.
            Err(_) => owned.tasks.values().for_each(TaskHandle::wake),
        }
    }

    fn dispatch_node_changes(
        &self,
        owned: &Owned,
        views: &Views,
        c: Result<Arc<LabelChanges>, tokio::sync::broadcast::error::RecvError>,
    ) {
        let Some(listing) = views.rcs.latest() else {
            return;
        };
        match c {
            Ok(ch) => {
                for t in owned.tasks.values() {
                    let Some(rc) = listing.rcs.get(&t.id) else {
                        continue;
                    };
                    let affected = ch.changes.iter().any(|change| {
                        [&change.old, &change.new]
                            .into_iter()
                            .flatten()
                            .any(|l| rc.node_selector.matches(&**l))
                    });
                    // Pool membership also moves eligibility of dynamic RCs.
                    if affected || rc.strategy == crate::rc::AllocationStrategy::Dynamic {
                        t.wake();
                    }
                }
            }
            Err(_) => owned.tasks.values().for_each(TaskHandle::wake),
        }
    }

    /// Decides what to claim and release, starts and stops tasks, and hands RCs their updates.
    /// Returns whether it claimed something.
    #[allow(clippy::too_many_arguments)]
    async fn reconcile(
        &self,
        views: &Views,
        session: &Session,
        info: &FarmInfo,
        ctx: &Arc<TaskContext>,
        owned: &mut Owned,
        ev_tx: &mpsc::UnboundedSender<TaskEvent>,
        mutation_tx: &watch::Sender<Arc<BTreeMap<RcId, String>>>,
    ) -> bool {
        let Some(listing) = views.rcs.latest() else {
            return false;
        };
        let Some(lock_snap) = views.locks.latest() else {
            return false;
        };
        let Some(farm_snap) = views.farms.latest() else {
            return false;
        };
        let sid = session.id();
        let (holders, garbage) = parse_locks(&lock_snap.value);
        {
            let mut seen = self.garbage_locks_reported.lock();
            seen.retain(|k| garbage.contains(k));
            for key in garbage {
                if seen.insert(key.clone()) {
                    tracing::warn!(%key, "a key under the lock prefix is not an RC lock; ignoring it");
                }
            }
        }
        let mutation: BTreeMap<RcId, String> = holders
            .iter()
            .filter_map(|(id, h)| h.mutation.as_ref().map(|(s, _)| (*id, s.clone())))
            .collect();
        if **mutation_tx.borrow() != mutation {
            let changed: Vec<RcId> = owned
                .tasks
                .keys()
                .filter(|id| mutation_tx.borrow().get(id) != mutation.get(id))
                .copied()
                .collect();
            let _ = mutation_tx.send(Arc::new(mutation));
            for id in changed {
                if let Some(t) = owned.tasks.get(&id) {
                    t.wake();
                }
            }
        }

        self.report_unclaimable(&listing).await;

        // Every RC key that names an RC, valid or not (an invalid one is still claimed, so that
        // exactly one farm reports it).
        let all_ids: BTreeSet<RcId> = listing
            .rcs
            .keys()
            .copied()
            .chain(
                listing
                    .invalid
                    .keys()
                    .filter_map(|k| RcId::from_key(k).and_then(Result::ok)),
            )
            .collect();
        let rc_labels: BTreeMap<RcId, LabelSet> = all_ids
            .iter()
            .map(|id| {
                (
                    *id,
                    views
                        .rc_labels
                        .get(&id.to_string())
                        .map(|l| (*l).clone())
                        .unwrap_or_default(),
                )
            })
            .collect();
        let mut farms = registry::live_farms(&farm_snap.value);
        if !farms.iter().any(|f| f.session == sid) {
            // Our own registration not in the view yet: count ourselves anyway.
            farms.push(info.clone());
        }
        let assignment = assign(&rc_labels, &registry::views(&farms));
        let mine = assignment.of(&self.config.farm_id);
        let cap = assignment
            .cap
            .get(&self.config.farm_id)
            .copied()
            .unwrap_or(0);
        let matching: BTreeSet<RcId> = rc_labels
            .iter()
            .filter(|(_, l)| self.config.rc_selector.matches(*l))
            .map(|(id, _)| *id)
            .collect();

        // What we hold, per the view or per our own recent claims.
        let held_by_us = |id: &RcId| {
            holders
                .get(id)
                .and_then(|h| h.ownership.as_ref())
                .is_some_and(|(s, _)| s == sid)
        };
        let held_by_anyone = |id: &RcId| holders.get(id).is_some_and(|h| h.ownership.is_some());
        for (id, idx) in owned.claimed_at.clone() {
            if lock_snap.index >= idx {
                owned.claimed_at.remove(&id);
            }
        }
        // Tasks whose RC we no longer hold, or that ended: stop them.
        let gone: Vec<RcId> = owned
            .tasks
            .iter()
            .filter(|(id, t)| {
                t.is_finished()
                    || (!held_by_us(id) && !owned.claimed_at.contains_key(*id))
                    || !all_ids.contains(*id)
            })
            .map(|(id, _)| *id)
            .collect();
        let mut released_deleted = Vec::new();
        for id in gone {
            if let Some(t) = owned.tasks.remove(&id) {
                let deleted = !all_ids.contains(&id);
                if deleted {
                    t.update(RcState::Deleted);
                    released_deleted.push(id);
                } else if !t.is_finished() {
                    tracing::warn!(rc_id = %id, "no longer holding the ownership lock; stopping the task");
                }
                t.stop().await;
                self.status.remove_rc(id);
            }
            owned.sent.remove(&id);
        }
        // A deleted RC's lock is given back (its pods are left alone).
        if !released_deleted.is_empty() {
            let held: Vec<RcId> = released_deleted
                .into_iter()
                .filter(|id| held_by_us(id))
                .collect();
            self.release(session, &held, "replication controller deleted")
                .await;
        }

        // Claim: what is assigned to us and free; and, after a grace period, what nobody takes.
        let now = Instant::now();
        owned
            .unheld_since
            .retain(|id, _| all_ids.contains(id) && !held_by_anyone(id));
        let held_count = owned.tasks.len();
        let mut to_claim = Vec::new();
        for id in &matching {
            if held_by_anyone(id) || owned.tasks.contains_key(id) {
                continue;
            }
            let since = *owned.unheld_since.entry(*id).or_insert(now);
            let waited = now.duration_since(since);
            let ours = mine.contains(id);
            let room = held_count + to_claim.len() < cap + self.config.share_slack;
            if ours
                || (waited >= self.config.claim_grace && room)
                || waited >= self.config.claim_grace * 3
            {
                to_claim.push(*id);
            }
        }
        let claimed = if to_claim.is_empty() {
            Vec::new()
        } else {
            self.claim(session, &to_claim).await
        };
        for (id, index) in &claimed {
            owned.claimed_at.insert(*id, *index);
            owned.unheld_since.remove(id);
        }

        // Start tasks for what we hold and have no task for (claimed now, or held after a
        // restart of the loop).
        for id in all_ids
            .iter()
            .filter(|id| held_by_us(id) || owned.claimed_at.contains_key(id))
        {
            if owned.tasks.contains_key(id) {
                continue;
            }
            let state = rc_state(&listing, *id);
            let t = crate::rctask::spawn(
                ctx.clone(),
                sid.to_string(),
                session.lost(),
                *id,
                state,
                ev_tx.clone(),
            );
            owned.tasks.insert(*id, t);
        }

        // Hand over what is assigned elsewhere: only RCs we hold per the view (never one just
        // claimed), and only while the farm it is assigned to is live.
        let excess: Vec<RcId> = owned
            .tasks
            .keys()
            .filter(|id| !mine.contains(id) && held_by_us(id) && !owned.claimed_at.contains_key(id))
            .filter(|id| {
                assignment
                    .owner
                    .get(id)
                    .is_some_and(|f| f != &self.config.farm_id)
                    || !matching.contains(id)
            })
            .copied()
            .collect();
        if !excess.is_empty() {
            tracing::info!(
                count = excess.len(),
                "handing RCs over to the farms they are assigned to"
            );
            for id in &excess {
                if let Some(t) = owned.tasks.remove(id) {
                    t.stop().await;
                }
                owned.sent.remove(id);
                self.status.remove_rc(*id);
            }
            self.release(session, &excess, "handed over for fair share")
                .await;
        }

        // A mutation lock our session holds on an RC we do not serve would stop its owner from
        // ever moving a pod (it waits for "another session"). It happens when a task is stopped
        // mid-transfer (handover, fencing, deletion), when the release request is lost, or when
        // an acquire sent by a task just stopped lands late; the lock tree's change brings us
        // back here. The transfer itself, if one is in flight, is resumed by the owner.
        let stray: Vec<RcId> = holders
            .iter()
            .filter(|(id, h)| {
                h.mutation.as_ref().is_some_and(|(s, _)| s == sid) && !owned.tasks.contains_key(id)
            })
            .map(|(id, _)| *id)
            .collect();
        if !stray.is_empty() {
            let store = RcStore::new(self.consul.clone());
            for id in stray {
                match store.release_mutation(id, sid).await {
                    Ok(_) => {
                        tracing::info!(rc_id = %id, "released the mutation lock of an RC this farm no longer serves")
                    }
                    Err(e) => {
                        tracing::warn!(rc_id = %id, error = %e, "cannot release a stray mutation lock; will retry")
                    }
                }
            }
        }

        // Hand tasks the RC versions they have not seen.
        for (id, t) in &owned.tasks {
            let version = listing
                .rcs
                .get(id)
                .map(|r| r.modify_index)
                .or_else(|| listing.invalid.get(&id.key()).map(|i| i.modify_index));
            if let Some(v) = version
                && owned.sent.get(id) != Some(&v)
            {
                t.update(rc_state(&listing, *id));
                owned.sent.insert(*id, v);
            }
        }

        let owned_n = owned.tasks.len();
        metrics::gauge!("rcfarm_owned_rcs").set(owned_n as f64);
        metrics::gauge!("rcfarm_fair_share").set(cap as f64);
        metrics::gauge!("rcfarm_live_farms").set(farms.len() as f64);
        self.status.update_farm(|f| {
            f.owned = owned_n;
            f.fair_share = cap;
            f.live_farms = farms.iter().map(|f| f.farm_id.clone()).collect();
            f.matching_rcs = matching.len();
            f.invalid_rcs = listing.invalid.len();
        });
        !claimed.is_empty()
    }

    /// Takes ownership locks in batched transactions (a lock and its audit record per RC);
    /// ops that fail (someone else was faster) are dropped and the rest retried once.
    async fn claim(&self, session: &Session, ids: &[RcId]) -> Vec<(RcId, u64)> {
        let mut got = Vec::new();
        for chunk in ids.chunks(MAX_TXN_OPS / 2) {
            let mut batch: Vec<RcId> = chunk.to_vec();
            for _ in 0..2 {
                if batch.is_empty() {
                    break;
                }
                let mut ops = Vec::new();
                for id in &batch {
                    ops.push(TxnOp::lock(
                        id.ownership_lock_key(),
                        session.name().as_bytes().to_vec(),
                        session.id(),
                    ));
                    ops.push(
                        AuditRecord::new(
                            events::RC_CLAIMED,
                            json!({"replication_controller_id": id, "farm_id": self.config.farm_id, "session": session.id(), "session_name": session.name()}),
                        )
                        .txn_op(),
                    );
                }
                match self.consul.txn(&ops).await {
                    Ok(resp) => {
                        let index = resp
                            .results
                            .iter()
                            .map(|r| r.modify_index)
                            .max()
                            .unwrap_or(0);
                        tracing::info!(count = batch.len(), "claimed RCs");
                        got.extend(batch.iter().map(|id| (*id, index)));
                        break;
                    }
                    Err(ConsulError::Conflict(errs)) => {
                        let failed: BTreeSet<usize> = errs.iter().map(|e| e.op_index / 2).collect();
                        batch = batch
                            .into_iter()
                            .enumerate()
                            .filter(|(i, _)| !failed.contains(i))
                            .map(|(_, id)| id)
                            .collect();
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "claiming RCs failed");
                        break;
                    }
                }
            }
        }
        got
    }

    /// Gives ownership locks up (delete if still ours), with an audit record each.
    async fn release(&self, session: &Session, ids: &[RcId], reason: &str) {
        for chunk in ids.chunks(MAX_TXN_OPS / 3) {
            let mut ops = Vec::new();
            for id in chunk {
                let key = id.ownership_lock_key();
                ops.push(TxnOp::check_session(key.clone(), session.id()));
                ops.push(TxnOp::delete(key));
                ops.push(
                    AuditRecord::new(
                        events::RC_RELEASED,
                        json!({"replication_controller_id": id, "farm_id": self.config.farm_id, "session": session.id(), "session_name": session.name(), "reason": reason}),
                    )
                    .txn_op(),
                );
            }
            if let Err(e) = self.consul.txn(&ops).await {
                // Some lock was not ours any more: release one by one.
                tracing::debug!(error = %e, "batched release failed; releasing one by one");
                let store = RcStore::new(self.consul.clone());
                for id in chunk {
                    let _ = store.release_ownership(*id, session.id()).await;
                }
            }
        }
    }

    /// Graceful shutdown: stop tasks, leave the registry, release every lock.
    async fn hand_over(&self, session: &Session, info: &FarmInfo, owned: &mut Owned) {
        let started = Instant::now();
        let ids: Vec<RcId> = owned.tasks.keys().copied().collect();
        let tasks = std::mem::take(&mut owned.tasks);
        for t in tasks.values() {
            t.cancel();
        }
        for (_, t) in tasks {
            let _ = tokio::time::timeout(Duration::from_secs(10), t.stop()).await;
        }
        let _ = self
            .consul
            .txn(&[
                TxnOp::check_session(info.key(), session.id()),
                TxnOp::delete(info.key()),
            ])
            .await;
        self.release(session, &ids, "farm shutting down").await;
        // Mutation locks of transfers in flight: the next owner resumes them.
        let store = RcStore::new(self.consul.clone());
        for id in &ids {
            let _ = store.release_mutation(*id, session.id()).await;
        }
        self.status.clear_rcs();
        tracing::info!(released = ids.len(), took = ?started.elapsed(), "handed every RC over");
    }

    /// Reads the intents of every owned pod and wakes the tasks that have something to repair.
    async fn sweep(&self, views: &Views, ctx: &Arc<TaskContext>, owned: &Owned) {
        let mut pods = BTreeSet::new();
        for id in owned.tasks.keys() {
            let sel = Selector::from_equalities([(RC_ID_LABEL, id.to_string().as_str())]);
            for pid in views.pods.matches(&sel) {
                if let Some((n, p)) = crate::labels::split_pod_label_id(&pid) {
                    pods.insert((n.to_string(), p.to_string()));
                }
            }
        }
        match sweep::sweep(&self.consul, &ctx.intents, &pods).await {
            Ok(n) => {
                tracing::debug!(intents = n, "consistency sweep done");
                if let Some(listing) = views.rcs.latest() {
                    for t in owned.tasks.values() {
                        if let Some(rc) = listing.rcs.get(&t.id) {
                            let nodes = pods
                                .iter()
                                .filter(|(_, p)| p == rc.pod_id())
                                .map(|(n, _)| crate::scheduler::NodeName::from(n.as_str()));
                            if !ctx
                                .intents
                                .bad(rc.pod_id(), rc.manifest.digest(), nodes)
                                .is_empty()
                            {
                                t.wake();
                            }
                        }
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "consistency sweep failed"),
        }
    }
}

impl Farm {
    /// Reports records under the RC prefix whose key names no RC (`replication_controllers/x`):
    /// no lock can be taken on them, so every farm sees them. Each farm logs each version once;
    /// the audit record has an id derived from key and version, written create-only, so there
    /// is one record per version however many farms notice.
    async fn report_unclaimable(&self, listing: &RcListing) {
        let due: Vec<(&String, &InvalidRc)> = {
            let mut reported = self.unclaimable_reported.lock();
            reported.retain(|k, _| listing.invalid.contains_key(k));
            listing
                .invalid
                .iter()
                .filter(|(k, inv)| {
                    !matches!(RcId::from_key(k), Some(Ok(_)))
                        && reported.get(*k) != Some(&inv.modify_index)
                })
                .collect()
        };
        for (key, inv) in due {
            tracing::warn!(%key, problem = %inv.problem, "a record under the RC prefix names no RC; no farm will serve it");
            metrics::counter!("rcfarm_rc_invalid_total", "kind" => inv.problem.kind()).increment(1);
            let audit = AuditRecord::deterministic(
                &format!("{key}@{}", inv.modify_index),
                events::RC_INVALID,
                json!({
                    "key": key,
                    "modify_index": inv.modify_index,
                    "problem": inv.problem.to_string(),
                    "farm_id": self.config.farm_id,
                }),
            );
            match self.consul.txn(&[audit.txn_op()]).await {
                Ok(_) => {}
                // Another farm recorded it first.
                Err(e) if AuditRecord::recorded_already(&e, 0) => {}
                Err(e) => {
                    tracing::warn!(%key, error = %e, "cannot record the invalid RC key; will retry");
                    continue;
                }
            }
            self.unclaimable_reported
                .lock()
                .insert(key.clone(), inv.modify_index);
        }
    }
}

fn rc_state(listing: &RcListing, id: RcId) -> RcState {
    if let Some(rc) = listing.rcs.get(&id) {
        RcState::Valid(rc.clone())
    } else if let Some(inv) = listing.invalid.get(&id.key()) {
        RcState::Invalid(Arc::new(inv.clone()))
    } else {
        RcState::Deleted
    }
}

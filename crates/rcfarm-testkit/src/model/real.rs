//! The model check on the real code: the production farm loop, RC workers and roll workers
//! ([`crate::farm::Farm`]), several of them, over an in-memory Consul
//! ([`crate::server::InProcess`]) that each farm reaches through the Consul client's
//! [`crate::consul::Port`], on one thread under tokio's paused clock.
//!
//! Nothing of the farm is re-implemented here: the world only decides each request's fate
//! through the port, from a seed:
//! - every request is delayed on its way and its answer on the way back (so answers come late,
//!   and a read's answer can describe a state older than a watch's answer that arrived first);
//! - a write may be applied and its answer lost (an unknown outcome);
//! - a farm may be cut off for a while (its requests are refused; past twice its session's
//!   TTL the server ends its session and the farm must start again), or restarted;
//! - under Consul 0.7 (half the worlds), a newly elected leader answers a run of reads from an
//!   older state than the farms have seen (hashicorp/consul#2644).
//!
//! The script is an operator's day in miniature on the smallest world that holds a roll and a
//! transfer together: three nodes, two farms, an RC `O` of two pods beside an RC `X` of one,
//! a node of `O`'s relabelled out of its selector (a node transfer), a roll of `O` to `N`
//! started while that transfer may be in flight, faults throughout. Then the faults stop, and
//! the world must converge: the roll done, `N`'s two pods on eligible nodes, `X`'s pod up, no
//! transfer left and no mutation lock held. The committed writes are replayed through the
//! invariant checker ([`crate::invariants::Observer`]): one writer per RC, fencing, rolls'
//! minimum.
//!
//! Under a paused clock on one thread the runtime only moves time when every task waits, so a
//! seed replays the same interleaving but for what is drawn at random outside the seed
//! (session and RC ids, and the assignment of RCs to farms that follows from them).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio_util::sync::CancellationToken;

use rcfarm_core::clock::Clock;

use crate::consul::{Consul, ConsulConfig, Exchange, Port, PortFailure, PortFuture};
use crate::farm::{Farm, FarmConfig};
use crate::invariants::Observer;
use crate::labels::{LabelSet, LabelStore, LabelType};
use crate::rc::{AllocationStrategy, NewRc, RC_ID_LABEL, RcId, RcStore};
use crate::roll::{ROLL_PREFIX, RollStore, StartRoll};
use crate::server::{InProcess, ServerConfig};
use crate::simulator::{NodeSimulator, SimConfig};

/// One run of the real world.
#[derive(Debug, Clone)]
pub struct RealConfig {
    pub seed: u64,
    /// Faults (late answers, lost answers, cut-off and restarted farms) while the script runs.
    pub faults: bool,
    /// How long (simulated) the world has to converge once the faults stop.
    pub settle: Duration,
    pub script: Script,
}

/// What the world goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Script {
    /// The operator's day in miniature (the module's doc), faults drawn from the seed.
    Day,
    /// One farm serving one RC, its link cut for this long once the RC is up and the farm's
    /// next consistency sweep is due, then back: past a TTL without a renewal the session is
    /// in doubt, and the farm must wait that out (not spin) and serve on.
    CutOff(Duration),
}

impl Default for RealConfig {
    fn default() -> Self {
        RealConfig {
            seed: 1,
            faults: true,
            settle: Duration::from_secs(600),
            script: Script::Day,
        }
    }
}

/// What a run found.
#[derive(Debug, Clone)]
pub struct RealOutcome {
    pub seed: u64,
    /// `None` when the world converged, else what was still not settled at the end.
    pub unsettled: Option<String>,
    /// Broken promises found in the committed writes.
    pub violations: Vec<String>,
    /// The faults and steps, in order, with their simulated times.
    pub events: Vec<String>,
    /// Simulated time from the first farm's start to convergence (or the end).
    pub simulated: Duration,
    pub commits: usize,
    pub requests: u64,
}

impl RealOutcome {
    pub fn ok(&self) -> bool {
        self.unsettled.is_none() && self.violations.is_empty()
    }

    /// A world that ended before its checks, and why.
    fn cut_short(seed: u64, why: String, simulated: Duration) -> RealOutcome {
        RealOutcome {
            seed,
            unsettled: Some(why),
            violations: Vec::new(),
            events: Vec::new(),
            simulated,
            commits: 0,
            requests: 0,
        }
    }
}

/// The network between the farms and the in-memory Consul: one per client, sharing the
/// server and the seeded dice.
struct Net {
    server: InProcess,
    dice: Mutex<StdRng>,
    /// Most delay of a request or its answer, each way.
    max_delay: Duration,
    /// Per mille of writes whose answer is lost after they applied.
    lose: std::sync::atomic::AtomicU32,
    requests: std::sync::atomic::AtomicU64,
}

struct Link {
    net: Arc<Net>,
    /// Cut off: every request refused.
    cut: Arc<AtomicBool>,
    /// Slow: each way takes up to [`SLOW`] (a farm starved of CPU, a Consul server slow to
    /// answer): what it reads is old by the time it acts on it. Bits: [`WATCHES`] (blocking
    /// reads), [`CALLS`] (everything else).
    slow: Arc<AtomicU8>,
    /// The farms' links are faulted; the operator's is not.
    faulted: bool,
}

impl Net {
    fn roll(&self, per_mille: u32) -> bool {
        self.dice.lock().random_range(0..1000) < per_mille
    }

    fn delay(&self, slow: bool) -> Duration {
        let most = if slow { SLOW } else { self.max_delay };
        let ms = most.as_millis() as u64;
        if ms == 0 {
            return Duration::ZERO;
        }
        Duration::from_millis(self.dice.lock().random_range(0..=ms))
    }
}

impl Port for Link {
    fn call(&self, request: Exchange) -> PortFuture {
        let net = self.net.clone();
        let cut = self.cut.clone();
        let slow = self.slow.clone();
        let faulted = self.faulted;
        Box::pin(async move {
            net.requests.fetch_add(1, Ordering::Relaxed);
            if !faulted {
                return Port::call(&net.server, request).await;
            }
            let kind = if request.path_and_query.contains("index=") {
                WATCHES
            } else {
                CALLS
            };
            let slowed = || slow.load(Ordering::Relaxed) & kind != 0;
            tokio::time::sleep(net.delay(slowed())).await;
            if cut.load(Ordering::Relaxed) {
                return Err(PortFailure::NotSent("cut off by the model".into()));
            }
            let write = request.method != reqwest::Method::GET;
            let answer = Port::call(&net.server, request).await?;
            tokio::time::sleep(net.delay(slowed())).await;
            if (write && net.roll(net.lose.load(Ordering::Relaxed))) || cut.load(Ordering::Relaxed)
            {
                return Err(PortFailure::Lost("answer lost by the model".into()));
            }
            Ok(answer)
        })
    }
}

/// [`Link::slow`]'s bit for blocking reads: the farm's views lag.
const WATCHES: u8 = 1;
/// [`Link::slow`]'s bit for every other request: reads and writes sent now answer late.
const CALLS: u8 = 2;

/// The most a slow link takes each way.
const SLOW: Duration = Duration::from_millis(2500);

/// A farm of the world, running.
struct Running {
    cancel: CancellationToken,
    cut: Arc<AtomicBool>,
    slow: Arc<AtomicU8>,
    task: tokio::task::JoinHandle<()>,
}

struct World {
    net: Arc<Net>,
    /// The operator's and the observer's client: never faulted.
    operator: Consul,
    farms: BTreeMap<String, Running>,
    events: Vec<String>,
    started: tokio::time::Instant,
    /// The farms' `consistency_interval`, when not the default.
    consistency: Option<Duration>,
    /// The state a replaying leader will answer from ([`Step::ServeStale`]).
    checkpoint: Option<crate::server::StaleCheckpoint>,
}

const ADDRESS: &str = "http://in-memory-consul:8500";

/// A client whose requests go through `link`, each timing out after `timeout`.
fn connect(link: Link, timeout: Duration) -> Consul {
    let cfg = ConsulConfig {
        timeout,
        ..ConsulConfig::new(ADDRESS)
    };
    // The address is a constant that parses, and no TLS file is named: building cannot fail.
    Consul::over(cfg, Arc::new(link)).expect("an in-memory client builds")
}

impl World {
    /// A world on a fresh in-memory Consul (its reaper running), no farm yet.
    fn new(
        cfg: &RealConfig,
        compat: crate::server::Compat,
    ) -> (World, InProcess, tokio::task::JoinHandle<()>) {
        let server = InProcess::new(ServerConfig {
            record_commits: true,
            compat,
            ..ServerConfig::ephemeral()
        });
        let reaper = server.spawn_reaper();
        let net = Arc::new(Net {
            server: server.clone(),
            dice: Mutex::new(StdRng::seed_from_u64(cfg.seed)),
            max_delay: if cfg.faults {
                Duration::from_millis(40)
            } else {
                Duration::ZERO
            },
            lose: Default::default(),
            requests: Default::default(),
        });
        let w = World {
            operator: connect(
                Link {
                    net: net.clone(),
                    cut: Arc::default(),
                    slow: Arc::default(),
                    faulted: false,
                },
                ConsulConfig::default().timeout,
            ),
            net,
            farms: BTreeMap::new(),
            events: Vec::new(),
            started: tokio::time::Instant::now(),
            consistency: None,
            checkpoint: None,
        };
        (w, server, reaper)
    }

    /// The node simulator on `nodes` (labelled `pool=a`), over the operator's client.
    fn simulate(
        &self,
        seed: u64,
        nodes: &[String],
        startup: Duration,
        stop: &CancellationToken,
    ) -> Result<tokio::task::JoinHandle<Result<(), crate::simulator::SimError>>, String> {
        let sim = NodeSimulator::new(
            self.operator.clone(),
            SimConfig {
                nodes: nodes.to_vec(),
                labels: labels(&[("pool", "a")]),
                startup,
                seed,
                ..SimConfig::default()
            },
        )
        .map_err(|e| format!("simulator: {e}"))?;
        Ok(tokio::spawn(sim.run(stop.clone())))
    }

    fn note(&mut self, what: impl Into<String>) {
        let at = self.started.elapsed();
        let what = what.into();
        tracing::info!(at = ?at, "model: {what}");
        self.events
            .push(format!("{:>8.3}s {what}", at.as_secs_f64()));
    }

    fn start_farm(&mut self, id: &str) {
        let cut = Arc::new(AtomicBool::new(false));
        let slow = Arc::new(AtomicU8::new(0));
        let mut config = FarmConfig::new(id, ConsulConfig::new(ADDRESS));
        config.clock =
            Clock::paused_at(chrono::DateTime::UNIX_EPOCH + chrono::Duration::days(20_000));
        config.claim_grace = Duration::from_secs(1);
        if let Some(every) = self.consistency {
            config.consistency_interval = every;
        }
        let link = Link {
            net: self.net.clone(),
            cut: cut.clone(),
            slow: slow.clone(),
            faulted: true,
        };
        let farm = Farm::with_consul(config, connect(link, Duration::from_secs(5)));
        let cancel = CancellationToken::new();
        let stop = cancel.clone();
        let name = id.to_string();
        let task = tokio::task::spawn_local(async move {
            if let Err(e) = farm.run(stop).await {
                tracing::warn!(farm = %name, error = %e, "model farm stopped");
            }
        });
        self.farms.insert(
            id.to_string(),
            Running {
                cancel,
                cut,
                slow,
                task,
            },
        );
        self.note(format!("{id} started"));
    }

    /// Stops a farm as an operator's restart does (its locks released if it can reach
    /// Consul), waiting at most a minute.
    async fn stop_farm(&mut self, id: &str) {
        if let Some(r) = self.farms.remove(id) {
            r.cancel.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(60), r.task).await;
            self.note(format!("{id} stopped"));
        }
    }

    fn cut(&mut self, id: &str, cut: bool) {
        if let Some(r) = self.farms.get(id) {
            r.cut.store(cut, Ordering::Relaxed);
            self.note(format!(
                "{id} {}",
                if cut { "cut off" } else { "reconnected" }
            ));
        }
    }

    /// The farm whose session holds `rc`'s ownership lock.
    fn serving(&self, rc: RcId) -> Option<&'static str> {
        let session = self.net.server.get(&rc.ownership_lock_key())?.session?;
        let info = self
            .net
            .server
            .get(&format!("{}{session}", crate::farm::registry::FARMS_PREFIX))?
            .value?;
        let info: serde_json::Value = serde_json::from_slice(&info).ok()?;
        ["f1", "f2"]
            .into_iter()
            .find(|f| info.get("farm_id").and_then(|v| v.as_str()) == Some(*f))
    }

    /// RC id → nodes of its pods, from the pod labels.
    fn placements(&self) -> BTreeMap<String, BTreeSet<String>> {
        let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for kv in self.net.server.list(&LabelType::Pod.prefix()) {
            let Some(rest) = kv.key.strip_prefix(&LabelType::Pod.prefix()) else {
                continue;
            };
            let node = rest.split('/').next().unwrap_or_default().to_string();
            let labels = crate::labels::parse_labels(kv.value.as_deref().unwrap_or_default())
                .unwrap_or_default();
            if let Some(rc) = labels.get(RC_ID_LABEL) {
                out.entry(rc.clone()).or_default().insert(node);
            }
        }
        out
    }

    /// What is not settled yet, or `None`.
    fn unsettled(&self, rcs: &[(RcId, usize)], nodes: &BTreeSet<String>) -> Option<String> {
        let placed = self.placements();
        let mut why = Vec::new();
        for (rc, want) in rcs {
            let on = placed.get(&rc.to_string()).cloned().unwrap_or_default();
            if on.len() != *want || !on.is_subset(nodes) {
                why.push(format!(
                    "RC {rc} has pods on {on:?}, wants {want} on {nodes:?}"
                ));
            }
        }
        if !self.net.server.list(ROLL_PREFIX).is_empty() {
            why.push("a roll is still recorded".into());
        }
        for kv in self.net.server.list(crate::rctask::STATUS_PREFIX) {
            why.push(format!("a transfer is still recorded: {}", kv.key));
        }
        for kv in self.net.server.list(crate::rc::RC_LOCK_PREFIX) {
            if kv.key.ends_with("/update") && kv.session.is_some() {
                why.push(format!(
                    "the mutation lock {} is held by session {:?}",
                    kv.key, kv.session
                ));
            }
        }
        (!why.is_empty()).then(|| why.join("; "))
    }

    /// Stops the farms and the server, and replays every committed write through the
    /// invariant checker.
    async fn end(
        mut self,
        cfg: &RealConfig,
        server: InProcess,
        reaper: tokio::task::JoinHandle<()>,
        unsettled: Option<String>,
        simulated: Duration,
    ) -> RealOutcome {
        let farms: Vec<String> = self.farms.keys().cloned().collect();
        for f in farms {
            self.stop_farm(&f).await;
        }
        server.shutdown();
        let _ = reaper.await;
        let log = server.commit_log();
        let observer = Observer::replay(&log);
        let mut violations: Vec<String> =
            observer.violations.iter().map(|v| v.to_string()).collect();
        violations.extend(interventions_reported(&log));
        RealOutcome {
            seed: cfg.seed,
            unsettled,
            violations,
            events: self.events,
            simulated,
            commits: log.len(),
            requests: self.net.requests.load(Ordering::Relaxed),
        }
    }

    /// Creates a dynamic RC on the `pool=a` nodes, as `actor`.
    async fn create_rc(&self, manifest: &str, replicas: u64, actor: &str) -> Result<RcId, String> {
        let new = NewRc {
            manifest: manifest.into(),
            node_selector: "pool=a".into(),
            pod_labels: LabelSet::new(),
            replicas_desired: replicas,
            strategy: AllocationStrategy::Dynamic,
            rc_labels: LabelSet::new(),
            disabled: false,
        };
        match RcStore::new(self.operator.clone())
            .create(new, actor, false)
            .await
        {
            Ok(written) => written
                .rc
                .map(|r| r.id)
                .ok_or_else(|| format!("{manifest:?} was not created")),
            Err(e) => Err(format!("creating {manifest:?}: {e}")),
        }
    }

    async fn wait_until(&self, within: Duration, done: impl Fn(&World) -> bool) -> bool {
        let end = tokio::time::Instant::now() + within;
        while tokio::time::Instant::now() < end {
            if done(self) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        done(self)
    }
}

/// Rolls that reported an operator's intervention (an RC of theirs disabled or enabled by
/// someone else once they started). Nobody in these worlds touches a roll's RCs but the roll:
/// such a report read the roll's label and its RCs' flags from views of different ages.
fn interventions_reported(log: &[crate::server::LoggedCommit]) -> Vec<String> {
    use crate::audit::{AUDIT_PREFIX, AuditRecord, events};
    use crate::server::Change;
    let mut out = Vec::new();
    for commit in log {
        for ch in &commit.changes {
            let Change::Put(k, e) = ch else { continue };
            if !k.starts_with(AUDIT_PREFIX) {
                continue;
            }
            let Ok(r) = AuditRecord::from_kv(k, &e.value) else {
                continue;
            };
            let reason = r.event_details["reason"].as_str().unwrap_or_default();
            if r.event_type == events::ROLL_STALLED
                && (reason.contains("was enabled again") || reason.contains("was disabled"))
            {
                out.push(format!(
                    "commit {}: a roll reported an intervention nobody made: {reason}",
                    commit.index
                ));
            }
        }
    }
    out
}

fn labels(pairs: &[(&str, &str)]) -> LabelSet {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Runs one seed on a thread and runtime of its own (paused clock), for at most `wall` of real
/// time. A world whose clock stops is a task that never waits (a loop that spins: under a
/// paused clock time moves only when every task waits), reported with the simulated time it
/// stopped at; its thread is left behind.
pub fn run_guarded(cfg: &RealConfig, wall: Duration) -> RealOutcome {
    let (tx, rx) = std::sync::mpsc::channel();
    let clock = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let spawned = {
        let (cfg, clock) = (cfg.clone(), clock.clone());
        std::thread::Builder::new()
            .name(format!("model-seed-{}", cfg.seed))
            .spawn(move || {
                let _ = tx.send(run_with(&cfg, clock));
            })
    };
    let stuck = |why: String| {
        let simulated = Duration::from_millis(clock.load(Ordering::Relaxed));
        RealOutcome::cut_short(cfg.seed, why, simulated)
    };
    if let Err(e) = spawned {
        return stuck(format!("cannot start a thread: {e}"));
    }
    match rx.recv_timeout(wall) {
        Ok(out) => out,
        Err(_) => stuck(format!(
            "the world's clock stopped at {:.1} s (simulated) and {wall:?} of real time went by: \
             a task that never waits (a loop that spins)",
            clock.load(Ordering::Relaxed) as f64 / 1000.0
        )),
    }
}

/// Runs one seed on a runtime of its own (one thread, paused clock), keeping `clock` at the
/// world's simulated time for the watchdog.
fn run_with(cfg: &RealConfig, clock: Arc<std::sync::atomic::AtomicU64>) -> RealOutcome {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build();
    match rt {
        // The farm's loop is not `Send`: everything runs on this thread, as `rcfarm` runs it.
        Ok(rt) => tokio::task::LocalSet::new().block_on(&rt, async {
            // The simulated time, for a watchdog on another thread (it stops when the world
            // stops waiting).
            let ticker = tokio::spawn(async move {
                let start = tokio::time::Instant::now();
                loop {
                    clock.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            });
            let out = run_on(cfg).await;
            ticker.abort();
            out
        }),
        Err(e) => RealOutcome::cut_short(
            cfg.seed,
            format!("cannot build a runtime: {e}"),
            Duration::ZERO,
        ),
    }
}

async fn run_on(cfg: &RealConfig) -> RealOutcome {
    match cfg.script {
        Script::Day => day(cfg).await,
        Script::CutOff(cut) => cut_off(cfg, cut).await,
    }
}

async fn day(cfg: &RealConfig) -> RealOutcome {
    let mut dice = StdRng::seed_from_u64(cfg.seed ^ 0x5eed);
    // Half the worlds answer as Consul 0.7, whose leader may answer from an older state
    // after an election (the stale-answer fault below).
    let compat = if dice.random_bool(0.5) {
        crate::server::Compat::V0_7
    } else {
        crate::server::Compat::V1
    };
    let (mut w, server, reaper) = World::new(cfg, compat);
    w.note(format!("the server answers as Consul {compat}"));
    let net = w.net.clone();
    // The deploy: rcfarm's roll of O to N, or (half the seeds) P2's roller's, started while
    // O's transfer is in flight (its new pod slow to start) and the farm serving O restarts.
    let by_p2 = dice.random_bool(0.5);
    let nodes = SimConfig::named("n", 3);
    let stop_sim = CancellationToken::new();
    let startup = Duration::from_millis(if by_p2 {
        dice.random_range(3000..8000)
    } else {
        dice.random_range(500..8000)
    });
    let sim_task = match w.simulate(cfg.seed, &nodes, startup, &stop_sim) {
        Ok(t) => t,
        Err(e) => return failed(cfg, &w, e),
    };
    for f in ["f1", "f2"] {
        w.start_farm(f);
    }
    let created = async {
        let o = w
            .create_rc("id: svc\nlaunchables: {}\n", 2, "model")
            .await?;
        let x = w
            .create_rc("id: other\nlaunchables: {}\n", 1, "model")
            .await?;
        Ok::<_, String>((o, x))
    }
    .await;
    let (o, x) = match created {
        Ok(ids) => ids,
        Err(e) => return failed(cfg, &w, e),
    };
    w.note(format!("created O = {o} (2 pods), X = {x} (1 pod)"));
    let all: BTreeSet<String> = nodes.iter().cloned().collect();
    // Up and reporting their health (so that a transfer waits for its new pod's).
    if !w
        .wait_until(Duration::from_secs(120), |w| {
            w.unsettled(&[(o, 2), (x, 1)], &all).is_none()
                && w.net.server.list("health/").len() >= 3
        })
        .await
    {
        return failed(cfg, &w, "O and X never came up".into());
    }
    w.note("O and X up");

    // Faults from here on.
    if cfg.faults {
        net.lose.store(dice.random_range(0..80), Ordering::Relaxed);
    }
    // One of O's nodes relabelled out of the selector: O moves that pod (a node transfer).
    let o_nodes = w
        .placements()
        .get(&o.to_string())
        .cloned()
        .unwrap_or_default();
    let Some(gone) = o_nodes
        .iter()
        .nth(dice.random_range(0..o_nodes.len().max(1)))
        .cloned()
    else {
        return failed(cfg, &w, "O has no node".into());
    };
    let mut scheduled: Vec<(Duration, Step)> = vec![(Duration::ZERO, Step::Relabel)];
    if by_p2 {
        scheduled.push((Duration::ZERO, Step::AwaitTransfer(o)));
        if cfg.faults {
            scheduled.push((Duration::ZERO, Step::RestartServing(o)));
        }
        scheduled.push((
            Duration::from_millis(dice.random_range(0..1500)),
            Step::P2Roll,
        ));
    } else {
        scheduled.push((
            Duration::from_millis(dice.random_range(0..4000)),
            Step::Roll,
        ));
    }
    if cfg.faults {
        for _ in 0..dice.random_range(1..4) {
            let at = Duration::from_millis(dice.random_range(0..20_000));
            let farm = if dice.random_bool(0.5) { "f1" } else { "f2" };
            let step = match dice.random_range(0..4) {
                0 => Step::Restart(farm),
                1 => Step::Slow(
                    farm,
                    dice.random_range(1..=3),
                    Duration::from_millis(dice.random_range(2000..15_000)),
                ),
                2 => Step::Cut(farm, Duration::from_millis(dice.random_range(500..8000))),
                // Past twice the session TTL: the session ends under the farm.
                _ => Step::Cut(farm, Duration::from_secs(dice.random_range(31..45))),
            };
            scheduled.push((at, step));
        }
        // A Consul 0.7 leader elected anew answers reads from the state it has replayed so
        // far (hashicorp/consul#2644): reads older than what the farms saw, for a while.
        if compat.is_0_7() && dice.random_bool(0.5) {
            let at = Duration::from_millis(dice.random_range(0..8000));
            scheduled.push((at, Step::Checkpoint));
            scheduled.push((
                at + Duration::from_millis(dice.random_range(1000..10_000)),
                Step::ServeStale(dice.random_range(5..60)),
            ));
        }
    }
    scheduled.sort_by_key(|(at, _)| *at);
    let mut t0 = tokio::time::Instant::now();
    let mut reconnect: Vec<(tokio::time::Instant, &str)> = Vec::new();
    let mut n = None;
    let mut p2 = None;
    for (at, step) in scheduled {
        tokio::time::sleep_until(t0 + at).await;
        reconnect.retain(|(when, f)| {
            if *when <= tokio::time::Instant::now() {
                if let Some(r) = w.farms.get(*f) {
                    r.cut.store(false, Ordering::Relaxed);
                    r.slow.store(0, Ordering::Relaxed);
                }
                w.events.push(format!("         {f} healed"));
                false
            } else {
                true
            }
        });
        match step {
            Step::Relabel => {
                let store = LabelStore::new(w.operator.clone());
                if let Err(e) = store
                    .set(LabelType::Node, &gone, &labels(&[("pool", "gone")]))
                    .await
                {
                    return failed(cfg, &w, format!("relabelling {gone}: {e}"));
                }
                w.note(format!("{gone} relabelled out of O's selector"));
            }
            Step::Roll => {
                let started = RollStore::new(w.operator.clone())
                    .start(
                        StartRoll {
                            old_rc: o,
                            manifest: "id: svc\nlaunchables: {}\nconfig: {v: 2}\n".into(),
                            desired: None,
                            minimum: Some(1),
                            leave_old: false,
                            roll_delay: Duration::ZERO,
                        },
                        "model",
                        false,
                    )
                    .await;
                match started {
                    Ok(r) => {
                        w.note(format!("roll of O to N = {} started", r.update.new_rc));
                        n = Some(r.update.new_rc);
                    }
                    Err(e) => return failed(cfg, &w, format!("starting the roll: {e}")),
                }
            }
            Step::Restart(f) => {
                w.stop_farm(f).await;
                w.start_farm(f);
            }
            Step::Cut(f, d) => {
                w.cut(f, true);
                reconnect.push((tokio::time::Instant::now() + d, f));
            }
            Step::AwaitTransfer(rc) => {
                let key = crate::rctask::status_key(rc);
                let seen = w
                    .wait_until(Duration::from_secs(10), |w| {
                        w.net.server.get(&key).is_some()
                    })
                    .await;
                w.note(if seen {
                    "O's transfer recorded"
                } else {
                    "O recorded no transfer within 10 s"
                });
                t0 = tokio::time::Instant::now();
            }
            Step::P2Roll => {
                let created = w
                    .create_rc("id: svc\nlaunchables: {}\nconfig: {v: 2}\n", 0, "p2-rctl")
                    .await;
                match created {
                    Ok(new) => {
                        w.note(format!("P2's roller rolls O to N = {new}"));
                        n = Some(new);
                        p2 = Some(tokio::task::spawn_local(p2_roll(
                            w.operator.clone(),
                            server.clone(),
                            o,
                            new,
                        )));
                    }
                    Err(e) => return failed(cfg, &w, e),
                }
            }
            Step::Checkpoint => {
                w.checkpoint = Some(server.checkpoint());
                w.note("the state as it is now kept for a replaying leader");
            }
            Step::ServeStale(answers) => {
                if let Some(cp) = w.checkpoint.take() {
                    match server.serve_stale(cp, answers) {
                        Ok(()) => w.note(format!(
                            "a new leader answers the next {answers} reads from the kept state"
                        )),
                        Err(e) => return failed(cfg, &w, format!("serve_stale: {e}")),
                    }
                }
            }
            Step::RestartServing(rc) => {
                if let Some(f) = w.serving(rc) {
                    w.stop_farm(f).await;
                    w.start_farm(f);
                }
            }
            Step::Slow(f, bits, d) => {
                if let Some(r) = w.farms.get(f) {
                    r.slow.store(bits, Ordering::Relaxed);
                }
                w.note(format!(
                    "{f} slow ({})",
                    match bits {
                        WATCHES => "its watches",
                        CALLS => "its calls",
                        _ => "everything",
                    }
                ));
                reconnect.push((tokio::time::Instant::now() + d, f));
            }
        }
    }
    // The faults stop.
    if let Some(when) = reconnect.iter().map(|(t, _)| *t).max() {
        tokio::time::sleep_until(when).await;
    }
    for f in ["f1", "f2"] {
        if w.farms
            .get(f)
            .is_some_and(|r| r.cut.load(Ordering::Relaxed))
        {
            w.cut(f, false);
        }
        if let Some(r) = w.farms.get(f) {
            r.slow.store(0, Ordering::Relaxed);
        }
    }
    net.lose.store(0, Ordering::Relaxed);
    w.note("faults stopped");
    let Some(n) = n else {
        return failed(cfg, &w, "the roll never started".into());
    };
    let eligible: BTreeSet<String> = all.iter().filter(|n| **n != gone).cloned().collect();
    let want = [(n, 2), (o, 0), (x, 1)];
    let converged = w
        .wait_until(cfg.settle, |w| w.unsettled(&want, &eligible).is_none())
        .await;
    let simulated = w.started.elapsed();
    let unsettled = if converged {
        w.note("converged");
        None
    } else {
        let sessions = w
            .operator
            .session_list(&Default::default())
            .await
            .map(|(l, _)| {
                l.into_iter()
                    .map(|s| format!("{:?}", s))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_else(|e| e.to_string());
        let roll_locks: Vec<String> = server
            .list(crate::roll::ROLL_LOCK_PREFIX)
            .into_iter()
            .map(|kv| format!("{} held by {:?}", kv.key, kv.session))
            .collect();
        w.unsettled(&want, &eligible)
            .map(|u| format!("{u}\n  sessions: {sessions}\n  roll locks: {roll_locks:?}"))
    };
    if let Some(p2) = p2 {
        p2.abort();
    }
    stop_sim.cancel();
    let _ = sim_task.await;
    w.end(cfg, server, reaper, unsettled, simulated).await
}

async fn cut_off(cfg: &RealConfig, cut: Duration) -> RealOutcome {
    let (mut w, server, reaper) = World::new(cfg, crate::server::Compat::V1);
    // A sweep due every second or two, so that one is past due when the session goes in doubt.
    w.consistency = Some(Duration::from_secs(1));
    let nodes = SimConfig::named("n", 2);
    let stop_sim = CancellationToken::new();
    let sim_task = match w.simulate(cfg.seed, &nodes, Duration::from_millis(500), &stop_sim) {
        Ok(t) => t,
        Err(e) => return failed(cfg, &w, e),
    };
    w.start_farm("f1");
    let id = match w.create_rc("id: svc\nlaunchables: {}\n", 1, "model").await {
        Ok(id) => id,
        Err(e) => return failed(cfg, &w, e),
    };
    let all: BTreeSet<String> = nodes.iter().cloned().collect();
    let want = [(id, 1)];
    if !w
        .wait_until(Duration::from_secs(60), |w| {
            w.unsettled(&want, &all).is_none()
        })
        .await
    {
        return failed(cfg, &w, "the RC never came up".into());
    }
    w.note("the RC is up");
    tokio::time::sleep(Duration::from_secs(3)).await;
    w.cut("f1", true);
    tokio::time::sleep(cut).await;
    w.cut("f1", false);
    let converged = w
        .wait_until(cfg.settle, |w| w.unsettled(&want, &all).is_none())
        .await;
    let simulated = w.started.elapsed();
    let unsettled = (!converged).then(|| w.unsettled(&want, &all)).flatten();
    stop_sim.cancel();
    let _ = sim_task.await;
    w.end(cfg, server, reaper, unsettled, simulated).await
}

/// P2's roller (`pkg/roll`), as far as rcfarm sees it: it takes the old and the new RC's
/// mutation locks one at a time under a session of its own, without a look at rcfarm's
/// transfer records, moves the replicas over, and lets go once the old RC's pods are gone.
async fn p2_roll(consul: Consul, server: InProcess, old: RcId, new: RcId) {
    let session = loop {
        match crate::consul::Session::create(
            &consul,
            &crate::consul::SessionConfig {
                name: "p2-rctl-server".into(),
                ttl: Duration::from_secs(15),
                lock_delay: Duration::from_secs(1),
                behavior: Default::default(),
            },
        )
        .await
        {
            Ok(s) => break s,
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    };
    let id = session.id().to_string();
    let rcs = RcStore::new(consul.clone());
    let holder = "p2 roll";
    for rc in [old, new] {
        while !matches!(rcs.acquire_mutation(rc, &id, holder).await, Ok(true)) {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        tracing::info!(%rc, "model: P2's roller took the mutation lock");
    }
    for (rc, to) in [(new, 2), (old, 0)] {
        while rcs
            .mutate(rc, &crate::rc::Mutation::SetReplicas(to), "p2-rctl", false)
            .await
            .is_err()
        {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    let old_key = old.to_string();
    loop {
        let gone = !server.list(&LabelType::Pod.prefix()).iter().any(|kv| {
            crate::labels::parse_labels(kv.value.as_deref().unwrap_or_default())
                .is_ok_and(|l| l.get(RC_ID_LABEL) == Some(&old_key))
        });
        if gone {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for rc in [old, new] {
        let _ = rcs.release_mutation(rc, &id, holder).await;
    }
    let _ = session.destroy().await;
}

/// A step of the script.
#[derive(Debug, Clone, Copy)]
enum Step {
    Relabel,
    Roll,
    P2Roll,
    /// Waits (at most 10 s) until the RC records a node transfer; from then on the steps'
    /// times count from the end of that wait.
    AwaitTransfer(RcId),
    Restart(&'static str),
    Cut(&'static str, Duration),
    /// Slows a farm's link (bits of [`Link::slow`]) for a while.
    Slow(&'static str, u8, Duration),
    /// Restarts the farm serving the RC.
    RestartServing(RcId),
    /// Keeps the state as it is now, for [`Step::ServeStale`].
    Checkpoint,
    /// The next this many reads (KV and sessions, not transactions) answered from the kept
    /// state, as by a Consul 0.7 leader still replaying its log.
    ServeStale(usize),
}

fn failed(cfg: &RealConfig, w: &World, why: String) -> RealOutcome {
    RealOutcome {
        events: w.events.clone(),
        requests: w.net.requests.load(Ordering::Relaxed),
        ..RealOutcome::cut_short(cfg.seed, why, w.started.elapsed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seeds from `RCFARM_MODEL_FIRST` (default 1), `RCFARM_MODEL_SEEDS` of them (default 40).
    fn seeds() -> std::ops::Range<u64> {
        let var = |name: &str, default: u64| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(default)
        };
        let first = var("RCFARM_MODEL_FIRST", 1);
        first..first + var("RCFARM_MODEL_SEEDS", 40)
    }

    #[test]
    fn the_real_farms_converge_through_faults_and_keep_every_promise() {
        if let Ok(filter) = std::env::var("RCFARM_MODEL_LOG") {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                .try_init();
        }
        let started = std::time::Instant::now();
        let (mut simulated, mut requests, mut failed) = (Duration::ZERO, 0, Vec::new());
        let range = seeds();
        for seed in range.clone() {
            let out = run_guarded(
                &RealConfig {
                    seed,
                    ..RealConfig::default()
                },
                Duration::from_secs(120),
            );
            simulated += out.simulated;
            requests += out.requests;
            if !out.ok() {
                eprintln!(
                    "seed {seed}:\n{}\nunsettled: {:?}\nviolations: {:#?}",
                    out.events.join("\n"),
                    out.unsettled,
                    out.violations
                );
                failed.push(seed);
            }
        }
        eprintln!(
            "{} seeds, {:.0} s simulated, {requests} requests, in {:.1} s",
            range.end - range.start,
            simulated.as_secs_f64(),
            started.elapsed().as_secs_f64()
        );
        assert!(failed.is_empty(), "seeds that failed: {failed:?}");
    }

    /// Cut off for 25 s: renewals fail, the session is in doubt from a TTL (15 s) after the
    /// last renewal until the link is back, and Consul keeps it (2×TTL). A farm loop that
    /// spins while in doubt stops the paused clock, which the watchdog reports.
    #[test]
    fn a_farm_cut_off_past_its_ttl_waits_and_serves_on() {
        for seed in 1..=3 {
            let out = run_guarded(
                &RealConfig {
                    seed,
                    faults: false,
                    settle: Duration::from_secs(120),
                    script: Script::CutOff(Duration::from_secs(25)),
                },
                Duration::from_secs(60),
            );
            assert!(
                out.ok(),
                "seed {seed}: {:?} {:?}\n{}",
                out.unsettled,
                out.violations,
                out.events.join("\n")
            );
        }
    }
}

//! The chaos run: farms killed, stalled, stopped and restarted while RCs and node labels change,
//! with an observer checking every committed write. Used by `rcfarm-tools chaos` and the tests.
//!
//! The embedded server runs in this process and records every commit; farms are real
//! `rcfarm serve` processes (one optionally behind a [`proxy::FaultyProxy`]). Checked:
//! - no write from a session that does not hold the RC's lock, and every pod write fenced;
//! - never more pods than desired (+1 while a transfer is in flight);
//! - after the chaos stops, every RC converges within 2×TTL plus a margin;
//! - every committed audit record reaches SQL, once, and the outbox drains;
//! - rolling updates (started and aborted by the chaos, carried out under the faults, with the
//!   node simulator playing every node): every step fenced by the roll's lock, old + new desired
//!   within the roll's bound, never a farm write that takes the pods up below the minimum, and
//!   every roll that can complete (enough eligible nodes) completes after the faults stop.

pub mod agent;
mod backend;
mod check;
pub mod clock;
mod mutate;
pub mod partition;
pub mod procfs;
pub mod proxy;
pub mod sickdb;

use backend::Backend;
pub use backend::ChaosConsul;
pub use check::{not_converged, rolls_not_done};
use check::{release_rolls, shipper_diagnosis};
use mutate::{mutate, new_rc, node_labels};

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

use crate::audit::{AuditQuery, AuditStore, events};
use crate::consul::{Consul, ConsulConfig};
use crate::invariants::{Observer, Violation};
use crate::labels::{LabelStore, LabelType};
use crate::rc::RcStore;
use crate::simulator::{NodeSimulator, SimConfig};
use proxy::{FaultyProxy, ProxyFaults};

/// The farms' blast-radius limit in a chaos run: removals per window, checked by the observer.
const CHAOS_MAX_REMOVALS: u64 = 8;
const CHAOS_REMOVALS_WINDOW: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct ChaosConfig {
    /// The `rcfarm` binary to run farms with.
    pub farm_binary: PathBuf,
    pub duration: Duration,
    pub farms: usize,
    pub nodes: usize,
    pub rcs: usize,
    pub session_ttl: Duration,
    pub seed: u64,
    /// Convergence after the chaos must happen within 2×TTL plus this.
    pub settle_margin: Duration,
    /// Put the first farm behind a proxy that delays and drops requests.
    pub proxy: Option<ProxyFaults>,
    /// Farm logs go here.
    pub log_dir: PathBuf,
    /// The Consul to run against.
    pub consul: ChaosConsul,
    /// Fault the farms (kill, stop, terminate, restart).
    pub farm_faults: bool,
    /// Fault Consul servers too (a cluster of 3 or more only).
    pub consul_faults: bool,
    /// Cut the network between Consul agents (a cluster started with `partitions`).
    pub partition_faults: bool,
    /// Step farms' wall clocks an hour either way, or run them 10 % fast (libfaketime).
    pub clock_faults: bool,
    /// Stop the audit database (a PostgreSQL of the run's own, behind a proxy) for a while, or
    /// slow it down.
    pub audit_db_faults: bool,
    /// Take a cold backup of every Consul server and, later, restore every server from it: the
    /// store goes back in time under the running farms (a cluster of 3 or more only).
    pub restore_faults: bool,
    /// Run the farms on their default failsafe (`--max-removals 20%` per 5 minutes, the
    /// tripwire confirming for 2 minutes) instead of the run's tight, quick one (8 per 10 s,
    /// tripwire off); after the faults the run releases held removals (every 5 s) as an
    /// operator would.
    pub default_failsafe: bool,
    /// Change RCs and node labels, start and abort rolls, while faulting.
    pub mutations: bool,
}

/// What happened and what was found.
#[derive(Debug, Default)]
pub struct ChaosReport {
    pub ran_for: Duration,
    pub faults: BTreeMap<&'static str, u64>,
    pub mutations: BTreeMap<&'static str, u64>,
    pub mutation_errors: u64,
    pub commits: u64,
    pub fenced_writes: u64,
    pub violations: Vec<Violation>,
    pub converged_after: Option<Duration>,
    pub unconverged: Vec<String>,
    pub audit_written: u64,
    pub audit_in_sql: u64,
    pub retargets_committed: u64,
    pub retargets_in_sql: u64,
    pub proxy: Option<(u64, u64, u64)>,
    /// RCs the convergence check found unconverged before any farm ran (all of them).
    pub unconverged_at_start: usize,
    pub rcs_at_start: usize,
    /// Why the outbox did not drain, if it did not: what is left and who holds the shipper lock.
    pub drain_problem: Option<String>,
    /// How long the outbox took to drain after the convergence check.
    pub drained_after: Duration,
    /// Audit records still in `audit_logs/` at the end (not lost: not shipped yet).
    pub outbox_left: u64,
    /// Commits that carried a roll's start, step or completion.
    pub roll_steps: u64,
    /// Roll steps checked against their roll's pause and failure (the observer's).
    pub roll_steps_braked_checked: u64,
    /// Rolls completed (`ROLLING_UPDATE_COMPLETION` records, succeeded).
    pub rolls_completed: u64,
    /// Rolls the chaos aborted.
    pub rolls_aborted: u64,
    /// Rolls started onto a manifest the nodes never make healthy.
    pub rolls_bad: u64,
    /// Failed rolls the farms reverted (`ROLLING_UPDATE_REVERTED`; never a revert's revert).
    pub rolls_reverted: u64,
    /// Removals the farms committed, and the most by one session within a window (the
    /// observer's, against the farms' `--max-removals`).
    pub removals: Option<(u64, u64)>,
    /// Rolls left paused, waiting for promotion, or failed when the faults stopped: the run
    /// resumes, promotes or aborts them, as an operator would, before waiting for the rest.
    pub rolls_released: u64,
    /// Rolls that did not complete after the faults stopped, with why.
    pub rolls_unfinished: Vec<String>,
    /// With the default failsafe: how many farms' removals the run released after the faults.
    pub removal_releases: Option<u64>,
    /// Rolls onto a good manifest (pods that pass) found Failed: a fault turned a healthy roll
    /// into a failed one.
    pub good_rolls_failed: Vec<String>,
    /// Rolls left that cannot complete as the nodes are labelled (too few eligible nodes).
    pub rolls_impossible: usize,
    /// How long the last roll took to complete after the faults stopped.
    pub rolls_done_after: Option<Duration>,
    /// The smallest margin seen above a roll's minimum (pods up − minimum), over all rolls.
    pub roll_min_margin: Option<i64>,
    /// Which Consul: "embedded", "real agent", "real cluster of N servers".
    pub backend: String,
    /// Raft elections (term increases) seen, on real Consul.
    pub elections: Option<u64>,
    /// Times an RC's ownership lock went from one session to another (outside observer).
    pub handovers: Option<u64>,
    /// Audit records seen in the outbox but not found in SQL (outside observer), not counting
    /// those a restore of the store took before they were shipped.
    pub audit_missing: u64,
    /// Audit records seen in the outbox before a restore, gone with it before they were
    /// shipped (Consul's backup did not hold them).
    pub audit_lost_to_restore: u64,
    /// Records in SQL that Consul never committed (embedded server: its whole commit log).
    pub audit_unknown: u64,
    /// Records (and RETARGET records) committed between the replay and the reads of SQL.
    pub audit_written_late: u64,
    pub retargets_committed_late: u64,
    /// Snapshots the outside observer took and how many reads failed.
    pub external_snapshots: Option<(u64, u64)>,
    /// Answers the outside observer held back as older than one it had seen.
    pub stale_snapshots: u64,
    /// Pod writes the outside observer placed under a live session's hold of their RC's lock
    /// at their commit, and those it could not place (the lock changed between snapshots).
    pub pod_writes_checked: Option<(u64, u64)>,
    /// Restores of the whole store the outside observer was told of.
    pub restores: u64,
    /// Batches of the node simulator's reports (reality, health) that failed and were written
    /// again: a pod's health lost this way would hold a roll back.
    pub sim_write_failures: u64,
}

impl ChaosReport {
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
            && self.rolls_unfinished.is_empty()
            && self.good_rolls_failed.is_empty()
            && self.unconverged_at_start == self.rcs_at_start
            && self.converged_after.is_some()
            && self.audit_missing == 0
            && self.drain_problem.is_none()
            && if self.external_snapshots.is_some() {
                // From outside, records that came and went between two snapshots are not
                // seen: what was seen must be in SQL.
                self.audit_in_sql + self.audit_lost_to_restore >= self.audit_written
                    && self.retargets_in_sql >= self.retargets_committed
            } else {
                // Every record committed by the replay is in SQL once, and nothing else but
                // what was committed before SQL was read.
                self.audit_unknown == 0
                    && (self.audit_written..=self.audit_written + self.audit_written_late)
                        .contains(&self.audit_in_sql)
                    && (self.retargets_committed
                        ..=self.retargets_committed + self.retargets_committed_late)
                        .contains(&self.retargets_in_sql)
            }
    }

    pub fn summary(&self) -> String {
        let mut s = String::new();
        let total = |m: &BTreeMap<&str, u64>| m.values().sum::<u64>();
        s.push_str(&format!(
            "chaos ran for {:.0} s on {}\n",
            self.ran_for.as_secs_f64(),
            self.backend
        ));
        s.push_str(&format!(
            "faults injected: {} {:?}\n",
            total(&self.faults),
            self.faults
        ));
        s.push_str(&format!(
            "mutations: {} {:?} ({} refused or contended)\n",
            total(&self.mutations),
            self.mutations,
            self.mutation_errors
        ));
        if let Some((c, d, l)) = self.proxy {
            s.push_str(&format!(
                "proxy: {c} connections, {l} chunks delayed, {d} connections cut mid-request\n"
            ));
        }
        match self.external_snapshots {
            Some((snaps, errors)) => s.push_str(&format!(
                "observed from outside: {snaps} snapshots of the whole KV store (consistent reads; {errors} failed, {} older than one seen held back)\n",
                self.stale_snapshots
            )),
            None => s.push_str(&format!(
                "commits observed: {}, fenced pod writes checked: {}\n",
                self.commits, self.fenced_writes
            )),
        }
        if let Some((under, unplaced)) = self.pod_writes_checked {
            s.push_str(&format!(
                "pod writes checked against their RC's lock at their commit: {under} made under a live session's lock; {unplaced} fell where the snapshots do not say (one made under a free lock is a violation, listed below)\n"
            ));
        }
        if self.sim_write_failures > 0 {
            s.push_str(&format!(
                "node simulator: {} batches of pod reports failed and were written again\n",
                self.sim_write_failures
            ));
        }
        if self.restores > 0 {
            s.push_str(&format!(
                "the whole store restored from a backup {} times\n",
                self.restores
            ));
        }
        if let Some(e) = self.elections {
            s.push_str(&format!("Consul elections (raft term increases): {e}\n"));
        }
        if let Some(h) = self.handovers {
            s.push_str(&format!(
                "RC handovers (ownership lock changed session): {h}\n"
            ));
        }
        s.push_str(&format!(
            "checker self-test: {} of {} RCs unconverged before the farms started\n",
            self.unconverged_at_start, self.rcs_at_start
        ));
        s.push_str(&format!(
            "converged after the chaos (and a final kill -9): {}\n",
            match self.converged_after {
                Some(d) => format!("yes, in {:.1} s", d.as_secs_f64()),
                None => format!("NO: {:?}", self.unconverged),
            }
        ));
        s.push_str(&format!(
            "audit records {}: {}, in SQL: {}{}\n",
            if self.external_snapshots.is_some() {
                "seen in the outbox"
            } else {
                "committed"
            },
            self.audit_written,
            self.audit_in_sql,
            match (
                self.audit_missing,
                self.audit_unknown,
                self.audit_written_late
            ) {
                (0, 0, 0) if self.audit_lost_to_restore > 0 => format!(
                    " ({} seen before a restore went with it, unshipped: the backup did not hold them)",
                    self.audit_lost_to_restore
                ),
                (0, 0, 0) => String::new(),
                (0, 0, late) => format!(" ({late} more committed before SQL was read)"),
                (missing, unknown, _) => format!(
                    ", {missing} committed but MISSING from SQL, {unknown} in SQL never committed"
                ),
            }
        ));
        s.push_str(&format!(
            "RETARGET records committed: {}, in SQL: {}\n",
            self.retargets_committed, self.retargets_in_sql
        ));
        match &self.drain_problem {
            Some(p) => s.push_str(&format!("audit outbox NOT drained: {p}\n")),
            None => s.push_str(&format!(
                "audit outbox drained in {:.1} s\n",
                self.drained_after.as_secs_f64()
            )),
        }
        s.push_str(&format!(
            "rolling updates: {} completed, {} aborted, {} bad deploys ({} reverted by their farm), {} released at the end (paused or canary rolls let go, failed ones aborted, bad deploys' RCs removed), {} commits of steps ({} steps checked: none while paused or failed); closest a farm's write took pods up to a minimum: {}\n",
            self.rolls_completed,
            self.rolls_aborted,
            self.rolls_bad,
            self.rolls_reverted,
            self.rolls_released,
            self.roll_steps,
            self.roll_steps_braked_checked,
            self.roll_min_margin.map_or(
                "not measured (no commit log on real Consul: steps and reverts counted from SQL)"
                    .to_string(),
                |m| m.to_string()
            )
        ));
        if self.rolls_unfinished.is_empty() {
            s.push_str(&format!(
                "every roll that could complete did{}{}\n",
                self.rolls_done_after
                    .map(|d| format!(", {:.1} s after the faults stopped", d.as_secs_f64()))
                    .unwrap_or_default(),
                if self.rolls_impossible > 0 {
                    format!(
                        " ({} left with too few eligible nodes)",
                        self.rolls_impossible
                    )
                } else {
                    String::new()
                }
            ));
        } else {
            s.push_str(&format!(
                "rolls NOT completed: {:?}\n",
                self.rolls_unfinished
            ));
        }
        if self.good_rolls_failed.is_empty() {
            s.push_str("no roll onto a good manifest failed\n");
        } else {
            s.push_str(&format!(
                "rolls onto a good manifest FAILED: {:?}\n",
                self.good_rolls_failed
            ));
        }
        match (self.removals, self.removal_releases) {
            (Some((seen, most)), None) => s.push_str(&format!(
                "removals: {seen}, at most {most} by all farms within {}s (the cluster's limit {CHAOS_MAX_REMOVALS} per {}s)\n",
                CHAOS_REMOVALS_WINDOW.as_secs() - 2,
                CHAOS_REMOVALS_WINDOW.as_secs()
            )),
            (removals, Some(released)) => s.push_str(&format!(
                "default failsafe (20 % of the cluster's pods, at least 5, per 5 min, for all farms together; tripwire on): {}; {released} releases after the faults\n",
                removals.map_or("removals not counted".to_string(), |(seen, most)| format!(
                    "removals {seen}, at most {most} by all farms within a window"
                ))
            )),
            (None, None) => {}
        }
        s.push_str(&format!("violations: {}\n", self.violations.len()));
        for v in self.violations.iter().take(10) {
            s.push_str(&format!("  {v}\n"));
        }
        s
    }
}

struct Farm {
    id: String,
    child: Option<Child>,
    pid: u32,
}

struct Cluster {
    cfg: ChaosConfig,
    backend: Backend,
    consul: Consul,
    audit_db: String,
    proxy: Option<FaultyProxy>,
    farms: Vec<Farm>,
    /// The farms' fake wall clocks, with clock faults.
    clocks: Option<clock::FarmClocks>,
}

fn signal(pid: u32, sig: &str) {
    let _ = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status();
}

impl Cluster {
    fn start_farm(&mut self, i: usize) -> Result<(), String> {
        let consul = match (&self.proxy, i) {
            (Some(p), 0) => p.url(),
            _ => format!("http://{}", self.backend.farm_addr(i)),
        };
        let id = self.farms[i].id.clone();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.cfg.log_dir.join(format!("{id}.log")))
            .map_err(|e| e.to_string())?;
        let ttl = format!("{}ms", self.cfg.session_ttl.as_millis());
        let clock_env = self.clocks.as_ref().map(|c| c.env(&id)).unwrap_or_default();
        let child = Command::new(&self.cfg.farm_binary)
            .envs(clock_env)
            .args([
                "serve",
                "--consul",
                &consul,
                "--farm-id",
                &id,
                "--http",
                "off",
                "--audit-db",
                &self.audit_db,
            ])
            .args([
                "--session-ttl",
                &ttl,
                "--lock-delay",
                "500ms",
                "--resync-interval",
                "1s",
            ])
            .args([
                "--consistency-interval",
                "2s",
                "--claim-grace",
                "1s",
                "--watch-wait",
                "30s",
                "--roll-resync",
                "500ms",
            ])
            // The check expects every pod on an eligible node, static RCs' too.
            .arg("--transfer-static")
            // A blast-radius limit the observer checks (it holds now and then, and the run
            // still converges: its window is short); the tripwire (which holds for minutes)
            // is off. Or the farms' defaults, as a new user runs them.
            .args(if self.cfg.default_failsafe {
                Vec::new()
            } else {
                vec![
                    "--max-removals".to_string(),
                    CHAOS_MAX_REMOVALS.to_string(),
                    "--max-removals-window".to_string(),
                    crate::util::format_go_duration(CHAOS_REMOVALS_WINDOW),
                    "--failsafe-confirm".to_string(),
                    "0s".to_string(),
                ]
            })
            .env("RUST_LOG", "info")
            .current_dir(&self.cfg.log_dir)
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start a farm: {e}"))?;
        self.farms[i].pid = child.id().unwrap_or(0);
        self.farms[i].child = Some(child);
        Ok(())
    }

    async fn reap(&mut self, i: usize, within: Duration) {
        if let Some(mut c) = self.farms[i].child.take()
            && tokio::time::timeout(within, c.wait()).await.is_err()
        {
            let _ = c.start_kill();
            let _ = c.wait().await;
        }
    }
}

/// How long the audit outbox may take to drain into SQL after the chaos.
const DRAIN_LIMIT: Duration = Duration::from_secs(150);

/// Runs the chaos and reports.
pub async fn run(cfg: ChaosConfig) -> Result<ChaosReport, String> {
    let started = Instant::now();
    let backend = Backend::start(&cfg.consul, cfg.farms).await?;
    let consul = Consul::new(ConsulConfig::new(backend.url())).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(&cfg.log_dir).map_err(|e| e.to_string())?;
    let sick_db = if cfg.audit_db_faults {
        Some(sickdb::SickDb::start().await?)
    } else {
        None
    };
    let audit_db = match &sick_db {
        Some(db) => db.url(),
        None => format!("sqlite://{}", cfg.log_dir.join("audit.db").display()),
    };
    let proxy = match cfg.proxy {
        Some(f) => Some(
            FaultyProxy::start(backend.farm_addr(0), f)
                .await
                .map_err(|e| e.to_string())?,
        ),
        None => None,
    };
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let labels = LabelStore::new(consul.clone());
    for i in 0..cfg.nodes {
        labels
            .set(
                LabelType::Node,
                &format!("node-{i:02}"),
                &node_labels(&mut rng),
            )
            .await
            .map_err(|e| e.to_string())?;
    }
    // Every node runs its pods and reports health, so rolls can be carried out.
    let sim_stop = CancellationToken::new();
    let sim = NodeSimulator::new(
        consul.clone(),
        SimConfig {
            nodes: (0..cfg.nodes).map(|i| format!("node-{i:02}")).collect(),
            startup: Duration::from_millis(300),
            fail_manifests: Some(mutate::FAILING_BUILD.to_string()),
            // A restored store takes reports written since the backup (or puts back older
            // ones): nodes report again, or a pod left without health holds its roll for ever.
            anti_entropy: Some(Duration::from_secs(5)),
            ..SimConfig::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let sim_stats = sim.stats();
    tokio::spawn(sim.run(sim_stop.clone()));
    let store = RcStore::new(consul.clone());
    for i in 0..cfg.rcs {
        store
            .create(new_rc(&mut rng, i), "chaos", false)
            .await
            .map_err(|e| e.to_string())?;
    }
    // The convergence check must see that nothing is owned yet, or it could not see anything.
    let unconverged_at_start = not_converged(&consul, &BTreeSet::new()).await.len();
    let farms = (0..cfg.farms)
        .map(|i| Farm {
            id: format!("chaos-{i}"),
            child: None,
            pid: 0,
        })
        .collect();
    let clocks = if cfg.clock_faults {
        Some(clock::FarmClocks::new(&cfg.log_dir)?)
    } else {
        None
    };
    let mut cl = Cluster {
        cfg: cfg.clone(),
        backend,
        consul: consul.clone(),
        audit_db,
        proxy,
        farms,
        clocks,
    };
    for i in 0..cfg.farms {
        cl.start_farm(i)?;
    }

    let report = Arc::new(Mutex::new(ChaosReport::default()));
    let stop = CancellationToken::new();
    let mutator = cfg.mutations.then(|| {
        tokio::spawn(mutate(
            consul.clone(),
            cfg.seed.wrapping_add(1),
            cfg.rcs,
            cfg.nodes,
            report.clone(),
            stop.clone(),
        ))
    });

    // Faults, one at a time, every 2-5 s: on a farm, on a Consul server, or on the network
    // between Consul agents.
    let deadline = started + cfg.duration;
    let server_faults = cfg.consul_faults && cl.backend.faults_servers();
    let partition_faults = cfg.partition_faults && cl.backend.partitions();
    if cfg.partition_faults && !partition_faults {
        return Err("partition faults need a cluster started with partitions (ChaosConsul::Cluster { partitions: true, .. })".into());
    }
    if cfg.restore_faults && !cl.backend.restores() {
        return Err(
            "restore faults need a Consul cluster of 3 or more servers (their data is on disk)"
                .into(),
        );
    }
    let mut restore_plan = if cfg.restore_faults {
        restore_schedule(started, cfg.duration)
    } else {
        VecDeque::new()
    };
    let backup_dir = cfg.log_dir.join("consul-backup");
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(rng.random_range(2000..5000))).await;
        if Instant::now() >= deadline {
            break;
        }
        if let Some(&(at, restore)) = restore_plan.front()
            && Instant::now() >= at
        {
            restore_plan.pop_front();
            let kind = cl.backend.backup_or_restore(&backup_dir, restore).await?;
            tracing::info!(kind, "the whole store backed up or restored");
            *report.lock().faults.entry(kind).or_default() += 1;
            continue;
        }
        // (Without clock faults or partitions, the choice draws what it always drew: a seed
        // replays as before.)
        if let Some(db) = &sick_db
            && (!(cfg.farm_faults || server_faults || partition_faults || cfg.clock_faults)
                || rng.random_bool(0.25))
        {
            let kind = db.fault(&mut rng).await?;
            *report.lock().faults.entry(kind).or_default() += 1;
            continue;
        }
        if let Some(clocks) = &cl.clocks
            && (!(cfg.farm_faults || server_faults || partition_faults) || rng.random_bool(0.4))
        {
            let ids: Vec<String> = cl.farms.iter().map(|f| f.id.clone()).collect();
            let kind = clocks.fault(&ids, &mut rng).await;
            *report.lock().faults.entry(kind).or_default() += 1;
            continue;
        }
        if partition_faults && (!(cfg.farm_faults || server_faults) || rng.random_bool(0.4)) {
            if let Some(kind) = cl.backend.partition_fault(&mut rng).await {
                *report.lock().faults.entry(kind).or_default() += 1;
            }
            continue;
        }
        let on_server = server_faults && (!cfg.farm_faults || rng.random_bool(0.4));
        if on_server {
            if let Some(kind) = cl.backend.server_fault(&mut rng).await {
                *report.lock().faults.entry(kind).or_default() += 1;
            }
            continue;
        }
        if !cfg.farm_faults {
            continue;
        }
        farm_fault(&mut cl, &mut rng, &report).await?;
    }
    stop.cancel();
    if let Some(m) = mutator {
        let _ = m.await;
    }
    if cfg.farm_faults {
        // A last crash, not restarted: convergence below includes the survivors taking its RCs.
        let last = rng.random_range(0..cl.farms.len());
        signal(cl.farms[last].pid, "CONT");
        signal(cl.farms[last].pid, "KILL");
        cl.reap(last, Duration::from_secs(5)).await;
        *report.lock().faults.entry("final-sigkill").or_default() += 1;
    }
    let ran_for = started.elapsed();

    // Convergence: every RC as desired, within 2×TTL plus the margin.
    let quiet = Instant::now();
    let limit = cfg.session_ttl * 2 + cfg.settle_margin;
    // The operator's part, while waiting (see `Operator`).
    // Removals held by the cluster's window after the faults are released as an operator
    // would, on either budget: the quick one (8 per 10 s for all farms) can hold a backlog
    // longer than the margin (seed 4242001 ended unconverged on it).
    let mut operator = Operator {
        releases_removals: true,
        next_release: Duration::from_secs(5),
        ..Operator::default()
    };
    let mut unconverged = Vec::new();
    let mut converged_after = None;
    while quiet.elapsed() < limit {
        let running: BTreeSet<u32> = cl
            .farms
            .iter()
            .filter(|f| f.child.is_some())
            .map(|f| f.pid)
            .collect();
        // The operator's part starts here: a bad deploy's pods never converge.
        operator.act(&cl, quiet.elapsed()).await;
        unconverged = not_converged(&cl.consul, &running).await;
        if unconverged.is_empty() {
            converged_after = Some(quiet.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Every roll that can complete does.
    let mut rolls_unfinished = Vec::new();
    let mut rolls_impossible = 0;
    let mut rolls_done_after = None;
    let rolls_limit = cfg.session_ttl * 2 + cfg.settle_margin + Duration::from_secs(20);
    while quiet.elapsed() < limit + rolls_limit {
        operator.act(&cl, quiet.elapsed()).await;
        (rolls_unfinished, rolls_impossible) = rolls_not_done(&cl.consul).await;
        if rolls_unfinished.is_empty() {
            rolls_done_after = Some(quiet.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The audit outbox drains into SQL.
    let drained = Instant::now();
    let outbox = async || {
        cl.backend
            .count_prefix(&cl.consul, crate::audit::AUDIT_PREFIX)
            .await
            .unwrap_or(usize::MAX)
    };
    // Generous: the promise is that nothing is lost or stored twice, not how fast; a slow
    // drain is reported as a figure (one loaded run once needed about a minute).
    // The farms run on and may write a record just after the outbox was seen empty (a claim
    // of the last killed farm's RCs): drained is when it was seen empty, not a second read.
    let mut left = outbox().await;
    while left > 0 && drained.elapsed() < DRAIN_LIMIT {
        tokio::time::sleep(Duration::from_millis(200)).await;
        left = outbox().await;
    }
    let drained_after = drained.elapsed();
    let drain_problem = if left > 0 {
        Some(shipper_diagnosis(&cl.consul, left).await)
    } else {
        None
    };
    // What was written, before SQL is read: a record the farms write after this is not
    // expected in SQL yet.
    let replayed = cl.backend.embedded().map(|server| {
        let mut o = if cfg.default_failsafe {
            Observer::with_default_failsafe()
        } else {
            Observer::with_removal_limit(CHAOS_MAX_REMOVALS, CHAOS_REMOVALS_WINDOW)
        };
        for c in &server.commit_log() {
            o.observe(c);
        }
        o
    });
    let seen = cl.backend.observer().map(|o| o.report());
    let sql = AuditStore::connect(&cl.audit_db)
        .await
        .map_err(|e| e.to_string())?;
    let audit_in_sql = sql
        .count(&AuditQuery::default())
        .await
        .map_err(|e| e.to_string())?;
    let retargets_in_sql = sql
        .count(&AuditQuery {
            event_type: Some(events::RC_RETARGET.into()),
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    let completions = sql
        .query(&AuditQuery {
            event_type: Some(events::ROLL_COMPLETION.into()),
            limit: Some(1000),
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?
        .records;
    let rolls_completed = completions
        .iter()
        .filter(|r| r.details["succeeded"] == true)
        .count() as u64;
    // Counted from SQL too, for a run on real Consul (no commit log to replay).
    let mut counted = Vec::new();
    for t in [events::ROLL_STEP, events::ROLL_REVERTED] {
        counted.push(
            sql.count(&AuditQuery {
                event_type: Some(t.into()),
                ..Default::default()
            })
            .await
            .map_err(|e| e.to_string())?,
        );
    }
    let (steps_in_sql, reverts_in_sql) = (counted[0], counted[1]);
    let sql_ids = all_ids(&sql).await?;
    sql.close().await;
    // What was written by the time SQL was read: a farm may still write (and its shipper ship)
    // a record between the replay above and the reads of SQL.
    let later = cl
        .backend
        .embedded()
        .map(|server| Observer::replay(&server.commit_log()));

    let mut r = std::mem::take(&mut *report.lock());
    r.ran_for = ran_for;
    r.unconverged_at_start = unconverged_at_start;
    r.rcs_at_start = cfg.rcs;
    r.converged_after = converged_after;
    r.unconverged = unconverged;
    r.audit_in_sql = audit_in_sql;
    r.retargets_in_sql = retargets_in_sql;
    r.drain_problem = drain_problem;
    r.drained_after = drained_after;
    r.outbox_left = left as u64;
    r.rolls_completed = rolls_completed;
    r.rolls_unfinished = rolls_unfinished;
    r.rolls_released = operator.rolls_released;
    r.good_rolls_failed = operator.good_rolls_failed.into_iter().collect();
    r.removal_releases = cfg.default_failsafe.then_some(operator.removal_releases);
    r.rolls_impossible = rolls_impossible;
    r.rolls_done_after = rolls_done_after;
    r.backend = match &cfg.consul {
        ChaosConsul::Embedded => "the embedded server".into(),
        ChaosConsul::Agent(_) => "a real Consul agent".into(),
        ChaosConsul::Cluster {
            servers,
            partitions,
            ..
        } => format!(
            "a real Consul cluster of {servers} servers and a client agent per farm{}",
            if *partitions {
                ", each agent on its own address, partitioned by nftables"
            } else {
                ""
            }
        ),
    };
    if let Some(observer) = replayed {
        r.commits = observer.commits;
        r.fenced_writes = observer.fenced_writes;
        r.violations = observer.violations.clone();
        r.audit_written = observer.audit_ids.len() as u64;
        r.audit_missing = observer.audit_ids.difference(&sql_ids).count() as u64;
        if let Some(later) = &later {
            r.audit_unknown = sql_ids.difference(&later.audit_ids).count() as u64;
            r.audit_written_late = later.audit_ids.len() as u64 - r.audit_written;
            r.retargets_committed_late = later.retarget_commits - observer.retarget_commits;
        }
        r.retargets_committed = observer.retarget_commits;
        r.roll_steps = observer.roll_steps;
        r.roll_steps_braked_checked = observer.roll_control_checked;
        r.rolls_reverted = observer.reverts;
        r.removals = Some((observer.removals_seen, observer.removals_max_per_window));
        r.roll_min_margin = observer.roll_min_margin();
    }
    if let Some(seen) = seen {
        r.roll_steps = steps_in_sql;
        r.rolls_reverted = reverts_in_sql;
        r.violations = seen.violations;
        r.audit_written = seen.audit_ids.len() as u64;
        let missing: Vec<&String> = seen.audit_ids.difference(&sql_ids).collect();
        r.audit_lost_to_restore = missing
            .iter()
            .filter(|id| seen.audit_restored_away.contains(id.as_str()))
            .count() as u64;
        r.audit_missing = missing.len() as u64 - r.audit_lost_to_restore;
        // RETARGET records a restore took with it unshipped are lost to the restore, as the
        // other records are (seed 4245101 on a 3-server cluster: 30 of 226).
        let retargets_restored_away = seen
            .retarget_ids
            .iter()
            .filter(|id| !sql_ids.contains(*id) && seen.audit_restored_away.contains(id.as_str()))
            .count() as u64;
        r.retargets_committed = seen.retarget_ids.len() as u64 - retargets_restored_away;
        r.handovers = Some(seen.handovers);
        // Without a commit log the removals are what the window key was charged.
        r.removals = Some((seen.window_charged, seen.window_most));
        r.external_snapshots = Some((seen.snapshots, seen.errors));
        r.stale_snapshots = seen.stale_snapshots;
        r.pod_writes_checked = Some((seen.pod_writes_under_lock, seen.pod_writes_unplaced));
        r.restores = seen.restores;
    }
    r.elections = cl.backend.elections();
    r.sim_write_failures = sim_stats.lock().write_failures;
    // Only now: what the farms record as they shut down is not part of the run.
    for i in 0..cl.farms.len() {
        signal(cl.farms[i].pid, "CONT");
        signal(cl.farms[i].pid, "TERM");
        cl.reap(i, Duration::from_secs(15)).await;
    }
    sim_stop.cancel();
    r.proxy = cl.proxy.as_ref().map(|p| {
        let s = p.stats();
        use std::sync::atomic::Ordering::Relaxed;
        (
            s.connections.load(Relaxed),
            s.dropped.load(Relaxed),
            s.delayed.load(Relaxed),
        )
    });
    cl.backend.shutdown().await;
    Ok(r)
}

/// The operator's part while the run waits for convergence: paused rolls resumed, canaries
/// promoted, failed rolls aborted (a bad deploy fails at its deadline, after the faults stopped,
/// too) and the RCs of aborted bad deploys removed; removals held by the cluster's window
/// released once the run has waited 5 s, and every 5 s after.
#[derive(Default)]
struct Operator {
    releases_removals: bool,
    next_release: Duration,
    removal_releases: u64,
    rolls_released: u64,
    good_rolls_failed: BTreeSet<String>,
}

impl Operator {
    async fn act(&mut self, cl: &Cluster, waited: Duration) {
        if self.releases_removals && waited >= self.next_release {
            self.removal_releases += release_removals(&cl.consul, &cl.farms).await;
            self.next_release = waited + Duration::from_secs(5);
        }
        let (released, good_failed) = release_rolls(&cl.consul).await;
        self.rolls_released += released;
        self.good_rolls_failed.extend(good_failed);
    }
}

/// Releases every farm's held removals, as `rcctl farm release-removals` does; how many
/// releases committed.
async fn release_removals(consul: &Consul, farms: &[Farm]) -> u64 {
    let mut n = 0;
    // The cluster's window first (farms of this release); the farms' own keys end pending
    // confirmations (and release farms of earlier releases, which keep their own budget).
    if let Ok((op, _)) = crate::failsafe::release_window_op(consul, "chaos").await
        && consul.txn(&[op]).await.is_ok()
    {
        n += 1;
    }
    for f in farms {
        let rel = crate::failsafe::Release {
            by: "chaos".into(),
            at: chrono::Utc::now(),
        };
        if consul
            .kv_put(&crate::failsafe::release_key(&f.id), &rel.to_bytes(), None)
            .await
            .is_ok()
        {
            n += 1;
        }
    }
    n
}

/// One fault on a random farm: SIGKILL and restart, SIGSTOP past its session's expiry,
/// SIGTERM and restart later, or a quick restart.
async fn farm_fault(
    cl: &mut Cluster,
    rng: &mut StdRng,
    report: &Mutex<ChaosReport>,
) -> Result<(), String> {
    let i = rng.random_range(0..cl.farms.len());
    let kind = ["sigkill", "sigstop", "sigterm", "restart"][rng.random_range(0..4)];
    *report.lock().faults.entry(kind).or_default() += 1;
    let pid = cl.farms[i].pid;
    match kind {
        "sigkill" => {
            signal(pid, "KILL");
            cl.reap(i, Duration::from_secs(5)).await;
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..2000))).await;
            cl.start_farm(i)?;
        }
        "sigstop" => {
            // Past the session's expiry: the others take over, and the stalled farm must
            // not write when it wakes.
            signal(pid, "STOP");
            tokio::time::sleep(cl.cfg.session_ttl * 5 / 2).await;
            signal(pid, "CONT");
        }
        "sigterm" => {
            signal(pid, "TERM");
            cl.reap(i, Duration::from_secs(15)).await;
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..2000))).await;
            cl.start_farm(i)?;
        }
        _ => {
            signal(pid, "TERM");
            cl.reap(i, Duration::from_secs(15)).await;
            cl.start_farm(i)?;
        }
    }
    Ok(())
}

/// Every audit record id in SQL.
async fn all_ids(sql: &AuditStore) -> Result<BTreeSet<String>, String> {
    let mut ids = BTreeSet::new();
    let mut q = AuditQuery {
        limit: Some(1000),
        ..Default::default()
    };
    loop {
        let page = sql.query(&q).await.map_err(|e| e.to_string())?;
        ids.extend(page.records.into_iter().map(|r| r.id));
        match page.next_cursor {
            Some(c) => q.cursor = Some(c),
            None => return Ok(ids),
        }
    }
}

/// When a run backs the whole store up and restores it (`true`): at fixed points, not drawn,
/// so a seed's other faults are drawn as without them. One backup and restore per 4 minutes
/// of run (at least one): the backup a quarter into its span, the restore past the half, so
/// the store goes back over a stretch of work (claims, rolls, audit records).
fn restore_schedule(started: Instant, duration: Duration) -> VecDeque<(Instant, bool)> {
    let pairs = (duration.as_secs() / 240).max(1) as u32;
    let span = duration / pairs;
    (0..pairs)
        .flat_map(|k| {
            let from = started + span * k;
            [(from + span / 4, false), (from + span * 3 / 5, true)]
        })
        .collect()
}

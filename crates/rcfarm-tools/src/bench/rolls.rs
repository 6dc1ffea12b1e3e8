//! `rcfarm-tools bench rolls`: F farm processes carry out N concurrent rolling updates of R replicas
//! each, against the embedded server, with the node simulator starting pods in a given time.
//! Reports the time until every roll completed, the farms' Consul requests per roll step, and
//! the lowest count of pods up seen per roll (from the commit log) against its minimum.

use std::time::{Duration, Instant};

use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::farm::{failed, spawn_farms, wait_until};
use crate::consul::{Consul, ConsulConfig, TxnOp};
use crate::invariants::Observer;
use crate::labels::{LabelSet, LabelStore, LabelType};
use crate::rc::RcId;
use crate::roll::{ControlChange, RollControl, RollStore, StartRoll};
use crate::server::{EmbeddedServer, ServerConfig};
use crate::simulator::{NodeSimulator, SimConfig};
use crate::{CliError, parse_duration_flag};

#[derive(Debug, Clone, clap::Args)]
pub struct BenchRollsArgs {
    #[arg(long, default_value_t = 3)]
    pub farms: usize,
    #[arg(long, default_value_t = 200)]
    pub rolls: usize,
    #[arg(long, default_value_t = 5)]
    pub replicas: u64,
    /// Healthy pods each roll keeps (default: one below the replicas).
    #[arg(long)]
    pub minimum: Option<u64>,
    #[arg(long, default_value_t = 100)]
    pub nodes: usize,
    /// How long a simulated pod takes to start and pass its health check.
    #[arg(long, default_value = "500ms", value_parser = parse_duration_flag)]
    pub startup: Duration,
    #[arg(long, default_value = "10s", value_parser = parse_duration_flag)]
    pub session_ttl: Duration,
    #[arg(long, default_value = "600s", value_parser = parse_duration_flag)]
    pub timeout: Duration,
    /// Start every roll with a canary of K pods, wait until every canary is up and paused,
    /// then promote them all at once; reports the canary phase and the promotion apart.
    #[arg(long, value_name = "K")]
    pub canary: Option<u64>,
    /// Bad deploys: every roll goes onto a manifest the nodes never make healthy, with
    /// --auto-revert and this progress deadline; reports the time from the rolls' creation
    /// until every old pod is back up (against the deadline plus one roll).
    #[arg(long, value_name = "DEADLINE", value_parser = parse_duration_flag)]
    pub failing: Option<Duration>,
}

fn manifest(i: usize, v: u32) -> String {
    format!(
        "id: roll-{i}\nlaunchables:\n  app:\n    launchable_type: hoist\n    location: https://example.com/roll-{i}-v{v}.tar.gz\n"
    )
}

/// What the manifests of `--failing` deploys carry: the simulator never makes them healthy.
const NEVER_HEALTHY: &str = "never-healthy";

/// How many pods pass their health check (`health/`).
async fn passing(consul: &Consul) -> usize {
    let q = crate::consul::QueryOptions::default();
    match consul.kv_list(crate::health::HEALTH_PREFIX, &q).await {
        Ok((entries, _)) => entries
            .iter()
            .filter(|e| crate::health::parse_health(e.value_bytes()).is_ok_and(|h| h.is_passing()))
            .count(),
        Err(_) => 0,
    }
}

pub async fn run(args: BenchRollsArgs) -> Result<(), CliError> {
    let minimum = args.minimum.unwrap_or(args.replicas.saturating_sub(1));
    if minimum >= args.replicas {
        return Err(CliError::Usage("--minimum must be below --replicas".into()));
    }
    let dir = tempfile::tempdir().map_err(failed)?;
    let server = EmbeddedServer::start(ServerConfig {
        session_ttl_min: Duration::from_secs(1),
        record_commits: true,
        ..ServerConfig::ephemeral()
    })
    .await
    .map_err(failed)?;
    let consul = Consul::new(ConsulConfig::new(server.url())).map_err(failed)?;
    let nodes: Vec<String> = (0..args.nodes).map(|i| format!("node-{i:05}")).collect();
    let label: LabelSet = [("env".to_string(), "prod".to_string())].into();
    let ops: Vec<TxnOp> = nodes
        .iter()
        .map(|n| LabelStore::set_op(LabelType::Node, n, &label))
        .collect();
    for chunk in ops.chunks(64) {
        consul.txn(chunk).await.map_err(failed)?;
    }
    let sim = NodeSimulator::new(
        consul.clone(),
        SimConfig {
            nodes: nodes.clone(),
            startup: args.startup,
            fail_manifests: args.failing.map(|_| NEVER_HEALTHY.to_string()),
            ..SimConfig::default()
        },
    )
    .map_err(failed)?;
    let sim_stats = sim.stats();
    let stop = CancellationToken::new();
    tokio::spawn(sim.run(stop.clone()));
    let mut farms = spawn_farms(
        &server.url(),
        args.farms,
        args.session_ttl,
        dir.path(),
        &["--roll-resync", "5s"],
        None,
    )
    .await?;

    // The RCs to roll, written as P2 tools do, and up.
    let ids: Vec<RcId> = (0..args.rolls).map(|_| RcId::new()).collect();
    let ops: Vec<TxnOp> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let record = json!({
                "id": id.to_string(), "manifest": manifest(i, 1), "node_selector": "env=prod",
                "pod_labels": {}, "replicas_desired": args.replicas, "disabled": false,
                "allocation_strategy": "static_strategy",
            });
            TxnOp::cas(id.key(), record.to_string().into_bytes(), 0)
        })
        .collect();
    for chunk in ops.chunks(63) {
        consul.txn(chunk).await.map_err(failed)?;
    }
    let pods = args.rolls * args.replicas as usize;
    let srv = &server;
    let st = &sim_stats;
    wait_until(args.timeout, "the RCs up", || async move {
        st.lock().started as usize >= pods && srv.count_prefix("reality/") == pods
    })
    .await?;

    // The rolls, all at once, through a client of their own (to count what creation costs).
    let creator = Consul::new(ConsulConfig::new(server.url())).map_err(failed)?;
    let store = RollStore::new(creator.clone()).with_control(RollControl {
        canary: args.canary,
        auto_revert: args.failing.map(|_| true),
        progress_deadline: args.failing.map(crate::util::format_go_duration),
        ..Default::default()
    });
    let mut rolls = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let w = store
            .start(
                StartRoll {
                    old_rc: *id,
                    manifest: match args.failing {
                        Some(_) => {
                            manifest(i, 2).replace("tar.gz", &format!("{NEVER_HEALTHY}.tar.gz"))
                        }
                        None => manifest(i, 2),
                    },
                    desired: None,
                    minimum: Some(minimum),
                    leave_old: false,
                    roll_delay: Duration::ZERO,
                },
                "bench",
                false,
            )
            .await
            .map_err(failed)?;
        rolls.push(w.update.new_rc);
    }
    let t0 = Instant::now();
    let creation_requests = creator.stats().requests;
    let before = server.stats().requests;
    let sim_before = sim_stats.lock().clone();
    // Canaries: every roll paused with its canary up, then all promoted at once.
    let canary = match args.canary {
        Some(k) => {
            let c = &creator;
            let n = args.rolls;
            let up = wait_until(args.timeout, "every canary up and paused", || async move {
                canaries_paused(c).await == n
            })
            .await?;
            let promoting = Instant::now();
            let promotions = rolls.iter().map(|id| {
                let store = store.clone();
                async move {
                    store
                        .change_control(*id, ControlChange::Promote, "bench", false)
                        .await
                }
            });
            for r in futures::future::join_all(promotions).await {
                r.map_err(failed)?;
            }
            Some((k, up, promoting.elapsed(), promoting))
        }
        None => None,
    };
    let done = wait_until(args.timeout, "every roll complete", || async move {
        srv.count_prefix("rolls/") == 0 && srv.count_prefix(crate::rc::RC_PREFIX) == args.rolls
    })
    .await?;
    // And every new pod up (the last step's pods may still be starting); after bad deploys,
    // every pod back on the old manifest and passing.
    match args.failing {
        None => {
            wait_until(args.timeout, "every new pod up", || async move {
                st.lock().started as usize >= 2 * pods
            })
            .await?;
        }
        Some(_) => {
            let c = &creator;
            wait_until(args.timeout, "every old pod back up", || async move {
                passing(c).await == pods
            })
            .await?;
        }
    }
    let all_up = t0.elapsed();
    let sim_after = sim_stats.lock().clone();
    let farm_requests = (server.stats().requests - before)
        - (sim_after.requests - sim_before.requests)
        - (sim_after.watch_queries - sim_before.watch_queries);

    let observer = Observer::replay(&server.commit_log());
    let steps = observer.roll_steps;
    let lowest: Vec<usize> = rolls
        .iter()
        .filter_map(|r| observer.roll_lowest_up.get(&r.to_string()).copied())
        .collect();
    let min_lowest = lowest.iter().min().copied().unwrap_or(0);
    let below = lowest.iter().filter(|l| (**l as u64) < minimum).count();
    let rss: Vec<u64> = farms
        .iter()
        .filter_map(|f| super::farm::rss_kib(f.pid))
        .collect();
    stop.cancel();
    for f in &mut farms {
        let _ = f.child.start_kill();
    }
    if !observer.violations.is_empty() {
        return Err(CliError::Failed(format!(
            "{} broken promises, first: {}",
            observer.violations.len(),
            observer.violations[0]
        )));
    }
    println!(
        "| {} | {}×{} | {} | {} | {:.0} ms | {:.1} | {:.1} | {} | {:.1} | {:.1} | {} (min {}) | {} | {:.0} |",
        args.farms,
        args.rolls,
        args.replicas,
        minimum,
        args.nodes,
        args.startup.as_secs_f64() * 1e3,
        done.as_secs_f64(),
        all_up.as_secs_f64(),
        steps,
        farm_requests as f64 / steps.max(1) as f64,
        creation_requests as f64 / args.rolls as f64,
        min_lowest,
        minimum,
        below,
        rss.iter().sum::<u64>() as f64 / rss.len().max(1) as f64 / 1024.0,
    );
    if let Some(deadline) = args.failing {
        let reverted = observer.reverts;
        println!(
            "bad deploys: {} rolls onto a never-healthy manifest with --auto-revert and a {} deadline; {reverted} reverted by their farms; every roll gone {:.1} s and every old pod back up {:.1} s after the rolls were written (deadline + one roll: compare with a plain run's \"all new pods up\")",
            args.rolls,
            crate::util::format_go_duration(deadline),
            done.as_secs_f64(),
            all_up.as_secs_f64(),
        );
        if reverted != args.rolls as u64 {
            return Err(CliError::Failed(format!(
                "{reverted} of {} bad deploys were reverted",
                args.rolls
            )));
        }
    }
    if let Some((k, up, promote, promoted_at)) = canary {
        println!(
            "canary {k} of {}: every canary up and paused {:.1} s after the rolls were written; {} promotions took {:.2} s; every roll done {:.1} s and every new pod up {:.1} s after the promotions",
            args.replicas,
            up.as_secs_f64(),
            args.rolls,
            promote.as_secs_f64(),
            (done.saturating_sub(promoted_at - t0)).as_secs_f64(),
            (all_up.saturating_sub(promoted_at - t0)).as_secs_f64(),
        );
    }
    server.shutdown().await;
    Ok(())
}

/// How many rolls are paused with their canary up.
async fn canaries_paused(consul: &Consul) -> usize {
    let q = crate::consul::QueryOptions::default();
    match consul.kv_list(crate::roll::CONTROL_PREFIX, &q).await {
        Ok((entries, _)) => entries
            .iter()
            .filter(|e| RollControl::parse(e.value_bytes()).is_ok_and(|c| c.canary_paused()))
            .count(),
        Err(_) => 0,
    }
}

/// The header of the table rows `run` prints.
pub fn header() -> &'static str {
    "| farms | rolls×replicas | minimum | nodes | pod start-up | all rolls done s | all new pods up s | roll commits (start, steps, completion) | farm requests per roll commit | requests per roll creation | lowest pods up in any roll | rolls below their minimum | RSS MiB/farm |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
}

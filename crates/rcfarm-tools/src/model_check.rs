//! `rcfarm-tools model-check`: random schedules of two farms, three RCs and four nodes under faults,
//! over rcfarm's own decision cores (see `rcfarm_testkit::model`). Prints what it explored;
//! exits 1 with a shrunk counterexample when a promise breaks or a world does not converge.

use crate::CliError;
use crate::model::explore::{Explore, explore};
use crate::model::{Config, Mutant, Setup, check_parallel};

#[derive(Debug, Clone, clap::Args)]
pub struct ModelCheckArgs {
    /// How many schedules to explore.
    #[arg(long, default_value_t = 1_000_000)]
    pub schedules: u64,
    /// Seed of the schedules (the same seed explores the same schedules).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// At most this many events (farm passes, commits, faults…) before the faults stop.
    #[arg(long, default_value_t = 60)]
    pub max_events: usize,
    /// Threads to explore on (default: every core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Break one of rcfarm's rules as it was before issue 36, to see the check find what it
    /// causes: finish-needs-lock (a node transfer's end takes the mutation lock), any-takeover
    /// (any RC takes a disabled RC's surplus pods), labels-at-commit (pod labels guarded at
    /// commit, not as planned); or issue 45's: blind-charge (a removal charges the cluster's
    /// window without checking its room, as if room seen at planning were granted); or a lock
    /// leak: keeps-transfer-lock (a node transfer's end leaves the mutation lock held); or one
    /// per promise: uncharged-scale-down (the budget), ignores-minimum (a roll's minimum),
    /// unguarded-rc-writes (an RC's count), deadline-always-counts (no roll fails with its new
    /// pods up), reverts-a-revert (no revert of a revert).
    #[arg(long, value_parser = parse_mutant)]
    pub mutant: Option<Mutant>,
    /// Keep going after a counterexample (each is shrunk and printed).
    #[arg(long)]
    pub all: bool,
    /// Instead of random schedules: every interleaving of the smallest world (two farms, the
    /// roll's two RCs and X, three nodes) up to this many events, with state hashing, for
    /// each of its four setups (the roll there or started later, a good or a bad deploy).
    #[arg(long, value_name = "DEPTH")]
    pub explore: Option<usize>,
    /// With --explore: fair schedules run from every state reached after the faults stop
    /// (each shuffled differently; 0: no liveness check).
    #[arg(long, default_value_t = 1)]
    pub fair_schedules: u64,
    /// Instead of the decision cores: the real farms (farm loop, RC and roll workers, the
    /// Consul client) over an in-memory Consul under a paused clock, one seed per world
    /// (`--schedules` seeds from `--seed`), with late and lost answers, farms cut off, slowed
    /// and restarted, and P2's roller (see `rcfarm_testkit::model::real`). `--mutant` does not
    /// apply: the code run is the product's.
    #[arg(long, conflicts_with_all = ["explore", "mutant"])]
    pub real: bool,
    /// With --real: the most real time one world may take before it counts as stuck.
    #[arg(long, default_value = "120s", value_parser = crate::parse_duration_flag)]
    pub world_timeout: std::time::Duration,
}

fn parse_mutant(s: &str) -> Result<Mutant, String> {
    match s {
        "finish-needs-lock" => Ok(Mutant::FinishNeedsLock),
        "any-takeover" => Ok(Mutant::AnyTakeover),
        "labels-at-commit" => Ok(Mutant::LabelsGuardedAtCommit),
        "blind-charge" => Ok(Mutant::BlindCharge),
        "keeps-transfer-lock" => Ok(Mutant::KeepsTransferLock),
        "uncharged-scale-down" => Ok(Mutant::UnchargedScaleDown),
        "ignores-minimum" => Ok(Mutant::IgnoresMinimum),
        "unguarded-rc-writes" => Ok(Mutant::UnguardedRcWrites),
        "deadline-always-counts" => Ok(Mutant::DeadlineAlwaysCounts),
        "reverts-a-revert" => Ok(Mutant::RevertsARevert),
        other => Err(format!(
            "{other:?}: one of finish-needs-lock, any-takeover, labels-at-commit, blind-charge, \
             keeps-transfer-lock, uncharged-scale-down, ignores-minimum, unguarded-rc-writes, \
             deadline-always-counts, reverts-a-revert"
        )),
    }
}

/// `--explore DEPTH`: the smallest world's four setups, one after the other.
fn run_explore(args: &ModelCheckArgs, depth: usize) -> Result<(), CliError> {
    let mut found = false;
    for (roll_later, bad_deploy) in [(false, false), (false, true), (true, false), (true, true)] {
        let setup = Setup::plain(1, bad_deploy, true, roll_later);
        let mut cfg = Explore::smallest(setup, depth);
        cfg.mutant = args.mutant;
        cfg.fair_schedules = args.fair_schedules;
        println!(
            "explore: the roll {}, {} deploy, every interleaving of {} events to depth {depth}{}",
            if roll_later {
                "started later"
            } else {
                "there from the start"
            },
            if bad_deploy { "a bad" } else { "a good" },
            cfg.alphabet.len(),
            args.mutant
                .map(|m| format!(", mutant {m:?}"))
                .unwrap_or_default()
        );
        let r = explore(&cfg);
        println!("  {}", r.summary());
        if let Some((what, path, state)) = &r.counterexample {
            found = true;
            println!("  counterexample: {what}");
            for (i, e) in path.iter().enumerate() {
                println!("    {:>3}. {e:?}", i + 1);
            }
            println!("  state:\n    {}", state.replace("\n  ", "\n    "));
        }
    }
    verdict(!found, "the exploration found a counterexample (above)")
}

/// Every mode's last line: `result: OK`, or a failure naming what was found above it.
fn verdict(ok: bool, failure: &str) -> Result<(), CliError> {
    if ok {
        println!("result: OK");
        Ok(())
    } else {
        Err(CliError::Failed(failure.into()))
    }
}

/// `--real` in a build without the real model.
#[cfg(not(feature = "real-model"))]
fn run_real(_: &ModelCheckArgs, _: usize) -> Result<(), CliError> {
    Err(CliError::Usage(
        "--real runs the farms under tokio's paused clock, which this build leaves out (it \
         would turn tokio's test-util on in the product's binaries built beside it); build the \
         tools with it: cargo run --release -p rcfarm-tools --features real-model -- \
         model-check --real"
            .into(),
    ))
}

/// `--real`: seeds run on `threads` threads, each world on a thread of its own.
#[cfg(feature = "real-model")]
fn run_real(args: &ModelCheckArgs, threads: usize) -> Result<(), CliError> {
    use crate::model::real::{RealConfig, run_guarded};
    let started = std::time::Instant::now();
    println!(
        "model check on the real farms: {} seeds from {}, {threads} thread(s)",
        args.schedules, args.seed
    );
    let next = std::sync::atomic::AtomicU64::new(args.seed);
    let end = args.seed.saturating_add(args.schedules);
    let results = parking_lot::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            scope.spawn(|| {
                loop {
                    let seed = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if seed >= end {
                        return;
                    }
                    let cfg = RealConfig {
                        seed,
                        ..RealConfig::default()
                    };
                    let out = run_guarded(&cfg, args.world_timeout);
                    if !out.ok() {
                        println!(
                            "seed {seed}: NOT OK\n{}\n  unsettled: {}\n  violations: {:?}",
                            out.events.join("\n"),
                            out.unsettled.as_deref().unwrap_or("-"),
                            out.violations
                        );
                    }
                    results.lock().push(out);
                }
            });
        }
    });
    let results = results.into_inner();
    let failed: Vec<u64> = results.iter().filter(|o| !o.ok()).map(|o| o.seed).collect();
    let simulated: f64 = results.iter().map(|o| o.simulated.as_secs_f64()).sum();
    let requests: u64 = results.iter().map(|o| o.requests).sum();
    let commits: usize = results.iter().map(|o| o.commits).sum();
    println!(
        "{} worlds, {simulated:.0} s simulated, {requests} requests, {commits} commits checked, in {:.1} s; {} failed{}",
        results.len(),
        started.elapsed().as_secs_f64(),
        failed.len(),
        if failed.is_empty() {
            String::new()
        } else {
            format!(": seeds {failed:?}")
        }
    );
    verdict(
        failed.is_empty(),
        "a world broke a promise or did not converge (above)",
    )
}

pub fn run(args: &ModelCheckArgs) -> Result<(), CliError> {
    if let Some(depth) = args.explore {
        return run_explore(args, depth);
    }
    if args.schedules == 0 {
        return Err(CliError::Usage("--schedules must be at least 1".into()));
    }
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if args.real {
        return run_real(args, threads);
    }
    let cfg = Config {
        schedules: args.schedules,
        seed: args.seed,
        max_events: args.max_events,
        mutant: args.mutant,
        stop_at_first: !args.all,
        ..Config::default()
    };
    println!(
        "model check: {} schedules of up to {} events, seed {}, {threads} thread(s){}",
        cfg.schedules,
        cfg.max_events,
        cfg.seed,
        args.mutant
            .map(|m| format!(", mutant {m:?}"))
            .unwrap_or_default()
    );
    let report = check_parallel(&cfg, threads);
    println!("{}", report.summary());
    for c in &report.counterexamples {
        println!("{c}");
    }
    verdict(
        report.ok(),
        "the model check found a counterexample (above)",
    )
}

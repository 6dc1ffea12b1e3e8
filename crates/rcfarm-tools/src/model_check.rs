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
    if found {
        Err(CliError::Failed(
            "the exploration found a counterexample (above)".into(),
        ))
    } else {
        println!("result: OK");
        Ok(())
    }
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
    if report.ok() {
        println!("result: OK");
        Ok(())
    } else {
        Err(CliError::Failed(
            "the model check found a counterexample (above)".into(),
        ))
    }
}

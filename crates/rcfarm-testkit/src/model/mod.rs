//! A model check of rcfarm's coordination over its real decision cores: the RC planner
//! (`rctask::plan`, with what counts as a removal and which action needs a lock), the roll
//! planner and its deadline (`roll::plan`), the ownership decisions (`farm::decide` with the
//! claim assignment), and the cluster's removal window (`budget::Window`: one KV key that
//! every removal charges in its own transaction, committing if and only if it is charged),
//! driven by a simulated KV with sessions, ownership, mutation and node-transfer locks and
//! that window ([`world`]).
//!
//! A small world: two farms; three RCs of one pod id (a rolling update's old RC O and new RC N,
//! and an unrelated RC X); four nodes whose agents run what the intents ask and report health.
//! A schedule is a random interleaving of the farms' passes (each plans one write, kept
//! pending), commits of pending writes (refused when their fence or guards no longer hold),
//! node agents, time, and faults: session losses and crashes, handovers, nodes made ineligible
//! or sick, edits of X's replicas, pauses and promotions, P2's roller holding both RCs'
//! mutation locks (or taking them one at a time), P2's node-transfer lock, and operators
//! disabling or enabling the roll's RCs by hand. Each commit is checked:
//!
//! - only an RC's own task writes its pods (the roll's new RC taking over what the roll's old
//!   RC gave up is the one exception), and no RC is raised above its count;
//! - no farm write takes a started roll's pods that are up below its minimum;
//! - within any window of `BUDGET_WINDOW` ticks, all farms together (every process of each)
//!   take at most `BUDGET_LIMIT` pods away, as the checker sees them leave the KV at each
//!   commit (not as charged);
//! - no roll fails while all its scheduled new pods are up, and no revert is reverted.
//!
//! Then the faults stop (operators release what they held and undo their enables and
//! disables, nodes heal), and the farms run on,
//! fairly: every world must converge (the roll done, every RC at its count, nothing in
//! flight, no lock left held). One that does not is a deadlock (a lock waited for by something
//! that holds what the holder waits for), or a lock leak if the RCs settled with a lock still
//! held. The counterexample is shrunk to the faults it needs.
//!
//! Each promise is shown broken by a [`Mutant`] (the rule it rests on broken in the model, in a
//! test build only): `tests::each_promise_is_shown_broken`. Beside the random schedules,
//! [`explore`] walks every interleaving of the smallest world to a depth.

pub mod explore;
#[cfg(any(test, feature = "paused-clock"))]
pub mod real;
pub mod world;

use std::time::Instant as StdInstant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::farm::claims::Rule;
use world::{FARMS, Holder, NODES, Session, Which};
pub use world::{Mutant, Setup, World};

/// How to check.
#[derive(Debug, Clone)]
pub struct Config {
    pub schedules: u64,
    pub seed: u64,
    /// At most this many events before the faults stop.
    pub max_events: usize,
    /// Rounds of fair running allowed to converge after the faults stop.
    pub calm_rounds: usize,
    /// Break one of rcfarm's rules (the code before a fix), to see the checker find it.
    pub mutant: Option<Mutant>,
    /// Stop at the first counterexample.
    pub stop_at_first: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            schedules: 10_000,
            seed: 1,
            max_events: 60,
            calm_rounds: 120,
            mutant: None,
            stop_at_first: true,
        }
    }
}

/// One step of a schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    Farm(usize),
    RcPass(usize, Which),
    RollPass(usize),
    /// The oldest pending write of a farm (in flight: commits or is refused).
    Commit(usize),
    NodeActs(usize),
    NodePasses(usize),
    Tick,
    // Faults.
    LoseSession(usize),
    Crash(usize),
    HandOverRc(usize, Which),
    HandOverRoll(usize),
    Ineligible(usize),
    Eligible(usize),
    Sick(usize),
    Heal(usize),
    EditX(u64),
    Pause,
    Resume,
    Promote,
    StartRoll,
    P2Holds,
    /// P2's roller takes one RC's mutation lock (it takes them one at a time: between the two,
    /// it holds one and waits for the other).
    P2Takes(Which),
    P2Releases,
    Freeze(Which),
    Thaw(Which),
    /// An operator disables or enables one of the roll's RCs by hand, outside the roll.
    Flip(Which),
}

impl Event {
    fn is_fault(self) -> bool {
        !matches!(
            self,
            Event::Farm(_)
                | Event::RcPass(..)
                | Event::RollPass(_)
                | Event::Commit(_)
                | Event::NodeActs(_)
                | Event::NodePasses(_)
                | Event::Tick
        )
    }
}

/// A schedule that broke a promise or did not converge, shrunk.
#[derive(Debug, Clone)]
pub struct Counterexample {
    pub setup: Setup,
    /// What was wrong.
    pub what: String,
    /// The events before the faults stopped, each with what it did.
    pub trace: Vec<String>,
    /// The world when it was found.
    pub state: String,
    /// What each task waited for then.
    pub waits: Vec<String>,
}

impl std::fmt::Display for Counterexample {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "counterexample: {}", self.what)?;
        writeln!(
            f,
            "setup: canary {:?}, auto-revert {}, X wants {}, bad deploy {}",
            self.setup.canary, self.setup.auto_revert, self.setup.x_replicas, self.setup.bad_deploy
        )?;
        writeln!(f, "trace ({} events):", self.trace.len())?;
        for (i, t) in self.trace.iter().enumerate() {
            writeln!(f, "  {:>3}. {t}", i + 1)?;
        }
        writeln!(f, "state:\n  {}", self.state)?;
        if !self.waits.is_empty() {
            writeln!(f, "waiting:")?;
            for w in &self.waits {
                writeln!(f, "  {w}")?;
            }
        }
        Ok(())
    }
}

/// What a check did.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub schedules: u64,
    pub events: u64,
    pub commits: u64,
    pub refused: u64,
    pub converged: u64,
    pub rolls_completed: u64,
    pub reverts: u64,
    pub transfers: u64,
    pub seconds: f64,
    pub counterexamples: Vec<Counterexample>,
}

impl Report {
    pub fn ok(&self) -> bool {
        self.counterexamples.is_empty()
    }

    pub fn summary(&self) -> String {
        format!(
            "{} schedules, {} events ({} commits, {} refused), {} converged after their faults, {} rolls completed ({} by a revert), {} node transfers started; {} counterexample(s); {:.1} s",
            self.schedules,
            self.events,
            self.commits,
            self.refused,
            self.converged,
            self.rolls_completed,
            self.reverts,
            self.transfers,
            self.counterexamples.len(),
            self.seconds
        )
    }
}

/// Every event of a world, faults included.
fn events() -> Vec<Event> {
    let mut v = vec![
        Event::Tick,
        Event::Pause,
        Event::Resume,
        Event::Promote,
        Event::StartRoll,
    ];
    v.extend([
        Event::P2Holds,
        Event::P2Takes(Which::O),
        Event::P2Takes(Which::N),
        Event::P2Releases,
    ]);
    for f in 0..FARMS {
        v.extend([
            Event::Farm(f),
            Event::RollPass(f),
            Event::Commit(f),
            Event::LoseSession(f),
            Event::Crash(f),
            Event::HandOverRoll(f),
        ]);
        for w in Which::ALL {
            v.extend([Event::RcPass(f, w), Event::HandOverRc(f, w)]);
        }
    }
    for n in 0..NODES {
        v.extend([
            Event::NodeActs(n),
            Event::NodePasses(n),
            Event::Ineligible(n),
            Event::Eligible(n),
            Event::Sick(n),
            Event::Heal(n),
        ]);
    }
    for d in 0..=2 {
        v.push(Event::EditX(d));
    }
    for w in Which::ALL {
        v.extend([Event::Freeze(w), Event::Thaw(w)]);
    }
    v.extend([Event::Flip(Which::O), Event::Flip(Which::N)]);
    v
}

/// What one event does to a world (`None`: nothing).
pub fn apply(w: &mut World, e: Event) -> Option<String> {
    match e {
        Event::Farm(f) => w.farm_pass(f),
        Event::RcPass(f, rc) => w.rc_pass(f, rc),
        Event::RollPass(f) => w.roll_pass(f),
        Event::Commit(f) => {
            let i = w.pending.iter().position(|p| p.farm == f)?;
            Some(w.commit(i))
        }
        Event::NodeActs(n) => w.node_acts(n),
        Event::NodePasses(n) => w.node_passes(n),
        Event::Tick => {
            w.now += 1;
            Some(format!("tick {}", w.now))
        }
        Event::LoseSession(f) => {
            w.lose_session(f, false);
            Some(format!("f{f} loses its session"))
        }
        Event::Crash(f) => {
            w.lose_session(f, true);
            Some(format!("f{f} crashes and restarts"))
        }
        Event::HandOverRc(f, rc) => w.farms[f]
            .tasks
            .contains_key(&rc)
            .then(|| format!("f{f}: {}", w.hand_over_rc(f, rc))),
        Event::HandOverRoll(f) => w.farms[f]
            .roll_task
            .is_some()
            .then(|| format!("f{f}: {}", w.hand_over_roll(f))),
        Event::Ineligible(n) | Event::Eligible(n) => {
            let to = matches!(e, Event::Eligible(_));
            (w.kv.nodes[n].eligible != to).then(|| {
                w.kv.nodes[n].eligible = to;
                format!("n{n} {}", if to { "eligible" } else { "ineligible" })
            })
        }
        Event::Sick(n) | Event::Heal(n) => {
            let sick = matches!(e, Event::Sick(_));
            (w.kv.nodes[n].sick != sick).then(|| {
                w.kv.nodes[n].sick = sick;
                if sick && w.kv.nodes[n].health.is_some() {
                    let v = w.kv.index + 1;
                    w.kv.index = v;
                    w.kv.nodes[n].health = Some((false, v));
                }
                format!("n{n} {}", if sick { "sick" } else { "heals" })
            })
        }
        Event::EditX(d) => {
            let r = w.kv.rcs.get_mut(&Which::X)?;
            if r.desired == d {
                return None;
            }
            r.desired = d;
            r.retire = None;
            w.kv.index += 1;
            r.version = w.kv.index;
            Some(format!("an operator scales X to {d}"))
        }
        Event::Pause | Event::Resume | Event::Promote => {
            let r = w.kv.roll.as_mut()?;
            let changed = match e {
                Event::Pause if !r.paused && !r.failed => {
                    r.paused = true;
                    true
                }
                Event::Resume if (r.paused && r.canary.is_none()) || r.failed => {
                    r.paused = false;
                    r.failed = false;
                    true
                }
                Event::Promote if r.canary.is_some() => {
                    r.canary = None;
                    r.paused = false;
                    true
                }
                _ => false,
            };
            if !changed {
                return None;
            }
            w.kv.index += 1;
            r.control_version = w.kv.index;
            Some(format!("an operator: {e:?}"))
        }
        Event::StartRoll => w
            .start_roll()
            .then(|| "an operator starts the roll O → N".to_string()),
        Event::P2Holds => {
            if w.kv.mut_lock.contains_key(&Which::O) || w.kv.mut_lock.contains_key(&Which::N) {
                return None;
            }
            for rc in [Which::O, Which::N] {
                w.kv.mut_lock
                    .insert(rc, (Session::OUTSIDE, Holder::P2Roller));
            }
            w.kv.index += 1;
            Some("P2's roller holds O's and N's mutation locks".into())
        }
        Event::P2Takes(rc) => {
            if w.kv.mut_lock.contains_key(&rc) {
                return None;
            }
            w.kv.mut_lock
                .insert(rc, (Session::OUTSIDE, Holder::P2Roller));
            w.kv.index += 1;
            Some(format!("P2's roller takes {rc:?}'s mutation lock"))
        }
        Event::P2Releases => {
            let before = w.kv.mut_lock.len();
            w.kv.mut_lock.retain(|_, (_, h)| *h != Holder::P2Roller);
            (w.kv.mut_lock.len() != before).then(|| "P2's roller lets go".to_string())
        }
        Event::Freeze(rc) => {
            if w.kv.nt_lock.contains_key(&rc) {
                return None;
            }
            w.kv.nt_lock.insert(rc, Session::OUTSIDE);
            Some(format!("an operator freezes {rc:?}'s node transfers"))
        }
        Event::Thaw(rc) => {
            w.kv.nt_lock
                .remove(&rc)
                .map(|_| format!("the freeze of {rc:?} is released"))
        }
        Event::Flip(rc) => {
            let r = w.kv.rcs.get_mut(&rc)?;
            let before = r.disabled;
            r.disabled = !before;
            w.kv.index += 1;
            r.version = w.kv.index;
            let to = r.disabled;
            w.flipped
                .entry(rc)
                .and_modify(|(_, left)| *left = to)
                .or_insert((before, to));
            Some(format!(
                "an operator {} {rc:?}",
                if to { "disables" } else { "enables" }
            ))
        }
    }
}

/// The operators undo their enables and disables: a roll's RCs as the roll left them once it
/// started (the old RC disabled unless it retires its pods, the new one enabled), any other
/// as it was before, unless a write since the operator's made its flag what it is.
fn undo_flips(w: &mut World) {
    let started =
        w.kv.roll
            .as_ref()
            .filter(|r| r.started)
            .map(|r| (r.old, r.new));
    for (rc, (before, left)) in std::mem::take(&mut w.flipped) {
        let Some(r) = w.kv.rcs.get_mut(&rc) else {
            continue;
        };
        let want = match started {
            Some((old, _)) if old == rc => r.retire.is_none(),
            Some((_, new)) if new == rc => false,
            _ if r.disabled == left => before,
            _ => continue,
        };
        if r.disabled != want {
            r.disabled = want;
            w.kv.index += 1;
            r.version = w.kv.index;
        }
    }
}

/// Whether the world is where it should end up: with no lock left held ([`locks_left`]).
fn converged(w: &World) -> bool {
    locks_left(w).is_empty() && settled(w)
}

/// The locks still held once the faults have stopped and the operators let go: a mutation lock
/// (a transfer's, a roll's) or a node-transfer freeze. Held at the end, each blocks the next
/// transfer or roll of its RC for ever, however converged the pods look (a lock leak).
fn locks_left(w: &World) -> Vec<String> {
    let mutation =
        w.kv.mut_lock
            .iter()
            .map(|(rc, (s, h))| format!("{rc:?}'s mutation lock ({h:?}, {})", s.name()));
    let frozen =
        w.kv.nt_lock
            .iter()
            .map(|(rc, s)| format!("{rc:?}'s node_transfer lock ({})", s.name()));
    mutation.chain(frozen).collect()
}

/// Whether the RCs and the roll are where they should end up, locks aside.
fn settled(w: &World) -> bool {
    w.kv.roll.is_none()
        && w.pending.is_empty()
        && (0..FARMS).all(|f| w.farms[f].roll_task.is_none())
        && w.kv.transfer.is_empty()
        && w.kv.rcs.iter().all(|(rc, r)| {
            w.kv.own_lock.contains_key(rc)
                && (r.disabled
                    || (w.kv.pods_of(*rc).len() as u64 == r.desired
                        && w.kv.pods_of(*rc).iter().all(|n| {
                            w.kv.nodes[*n].pod.is_some_and(|p| p.intent == *rc)
                                && w.kv.nodes[*n].eligible
                        })))
        })
}

/// The faults stop: operators let go of what they held and undo their enables and disables,
/// paused or failed rolls are resumed, canaries promoted, nodes heal and are eligible again.
fn calm(w: &mut World) {
    // A roll meant to come later comes now if it did not.
    if w.setup.roll_later && !w.rolled {
        w.start_roll();
    }
    w.kv.mut_lock.retain(|_, (_, h)| *h != Holder::P2Roller);
    w.kv.nt_lock.clear();
    undo_flips(w);
    for n in &mut w.kv.nodes {
        n.sick = false;
        n.eligible = true;
    }
    if let Some(r) = w.kv.roll.as_mut() {
        r.paused = false;
        r.failed = false;
        r.canary = None;
        w.kv.index += 1;
        r.control_version = w.kv.index;
    }
}

/// The process events of a world of `nodes` nodes, in a fair round.
fn round(rng: &mut StdRng, nodes: usize) -> Vec<Event> {
    let mut v = Vec::new();
    for f in 0..FARMS {
        v.push(Event::Farm(f));
        v.push(Event::RollPass(f));
        v.push(Event::Commit(f));
        v.push(Event::Commit(f));
        for rc in Which::ALL {
            v.push(Event::RcPass(f, rc));
        }
    }
    for n in 0..nodes {
        v.push(Event::NodeActs(n));
        v.push(Event::NodePasses(n));
    }
    // Shuffled: each round interleaves the processes differently.
    for i in (1..v.len()).rev() {
        let j = rng.random_range(0..=i);
        v.swap(i, j);
    }
    v.push(Event::Tick);
    v
}

/// What went wrong in a schedule, the trace up to the faults' end, and the world then.
type Failure = (String, Vec<String>, World);

/// Runs one schedule: `faults` as given (or drawn from `rng` when `None`), then calm. `Err`
/// with what went wrong and the trace.
fn run_schedule(
    setup: Setup,
    mutant: Option<Mutant>,
    faults: Option<&[Event]>,
    rng: &mut StdRng,
    cfg: &Config,
    stats: &mut Report,
) -> (Vec<Event>, Result<(), Failure>) {
    let mut w = World::new(setup, mutant);
    let all = events();
    let mut script = Vec::new();
    let mut trace = Vec::new();
    let drawn: Vec<Event>;
    let faults = match faults {
        Some(f) => f,
        None => {
            let n = rng.random_range(0..=cfg.max_events);
            drawn = (0..n)
                .map(|_| {
                    // Two thirds process events, a third faults; among faults, those that
                    // start transfers and handovers often.
                    if rng.random_range(0..3) == 0 {
                        let faults: Vec<Event> =
                            all.iter().copied().filter(|e| e.is_fault()).collect();
                        match rng.random_range(0..4) {
                            0 => Event::Ineligible(rng.random_range(0..NODES)),
                            1 => {
                                let f = rng.random_range(0..FARMS);
                                match rng.random_range(0..3) {
                                    0 => Event::LoseSession(f),
                                    1 => Event::HandOverRoll(f),
                                    _ => Event::HandOverRc(f, Which::ALL[rng.random_range(0..3)]),
                                }
                            }
                            _ => faults[rng.random_range(0..faults.len())],
                        }
                    } else if rng.random_range(0..6) == 0 {
                        // Time passes often enough for timeouts and deadlines to matter.
                        Event::Tick
                    } else {
                        let procs: Vec<Event> =
                            all.iter().copied().filter(|e| !e.is_fault()).collect();
                        procs[rng.random_range(0..procs.len())]
                    }
                })
                .collect();
            &drawn
        }
    };
    for e in faults {
        stats.events += 1;
        script.push(*e);
        if let Some(did) = apply(&mut w, *e) {
            count(stats, &did);
            trace.push(did);
        }
        if !w.broken.is_empty() {
            let what = w.broken[0].0.clone();
            return (script, Err((what, trace, w)));
        }
    }
    trace.push("--- the faults stop: operators let go, nodes heal ---".into());
    match converge(&mut w, 7, cfg.calm_rounds, stats) {
        Ok(()) => {
            stats.converged += 1;
            (script, Ok(()))
        }
        Err(what) => (script, Err((what, trace, w))),
    }
}

/// Stops the faults in `w` and runs the farms fairly (each round shuffled by an RNG seeded
/// with `seed`) until the world converges: `Err` with what went wrong if a promise breaks or
/// it does not converge within `rounds` (a deadlock, or a lock leak if the RCs settled with a
/// lock still held).
pub fn converge(w: &mut World, seed: u64, rounds: usize, stats: &mut Report) -> Result<(), String> {
    converge_remembering(w, seed, rounds, stats, None)
}

/// [`converge`], remembering in `known` the states (as [`explore::fingerprint`]s, at the
/// start of each fair round) from which a fair schedule converged, and taking a state already
/// there as converged: the schedule that got there, followed by the one that converged from
/// there, is a fair schedule that converges.
pub(crate) fn converge_remembering(
    w: &mut World,
    seed: u64,
    rounds: usize,
    stats: &mut Report,
    known: Option<&mut std::collections::HashSet<u128>>,
) -> Result<(), String> {
    calm(w);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut passed = Vec::new();
    let converges = 'rounds: {
        for _ in 0..rounds {
            operators_answer_a_failed_roll(w);
            if let Some(k) = known.as_deref() {
                let fp = explore::fingerprint(w);
                if k.contains(&fp) {
                    break 'rounds true;
                }
                passed.push(fp);
            }
            for e in round(&mut rng, w.nodes()) {
                stats.events += 1;
                if let Some(did) = apply(w, e) {
                    count(stats, &did);
                }
                if let Some(b) = w.broken.first() {
                    return Err(b.0.clone());
                }
            }
            if converged(w) {
                break 'rounds true;
            }
        }
        false
    };
    if converges {
        if let Some(k) = known {
            k.extend(passed);
        }
        return Ok(());
    }
    Err(if settled(w) {
        format!(
            "a lock left held {rounds} fair rounds after the faults stopped, with every RC \
             settled: {}",
            locks_left(w).join(", ")
        )
    } else {
        format!("no convergence within {rounds} fair rounds after the faults stopped: a deadlock")
    })
}

/// A failed roll waits for an operator, who resumes it (another deadline), or aborts a bad
/// deploy that does not revert itself (`rcctl roll abort`: both RCs left as they are).
fn operators_answer_a_failed_roll(w: &mut World) {
    if w.kv.roll.as_ref().is_some_and(|r| r.failed) {
        if w.setup.bad_deploy && w.kv.roll.as_ref().is_some_and(|r| r.new == Which::N) {
            w.kv.roll = None;
            w.kv.roll_lock = None;
            w.kv.index += 1;
        } else if let Some(r) = w.kv.roll.as_mut() {
            r.failed = false;
            w.kv.index += 1;
            r.control_version = w.kv.index;
        }
    }
}

fn count(stats: &mut Report, did: &str) {
    if did.starts_with("committed") {
        stats.commits += 1;
        if did.contains("Complete") {
            stats.rolls_completed += 1;
        }
        if did.contains("reverted") {
            stats.reverts += 1;
        }
        if did.contains("StartTransfer") {
            stats.transfers += 1;
        }
    } else if did.starts_with("refused") {
        stats.refused += 1;
    }
}

/// What each task waits for in `w`, for a counterexample.
fn waits(w: &World) -> Vec<String> {
    let mut out = Vec::new();
    for (f, farm) in w.farms.iter().enumerate() {
        for rc in farm.tasks.keys() {
            out.push(format!("f{f} serves {rc:?}"));
        }
        if farm.roll_task.is_some() {
            out.push(format!("f{f} carries the roll out"));
        }
    }
    for p in &w.pending {
        out.push(format!("pending: {}", p.what));
    }
    out
}

/// Shrinks a failing script: drops events one at a time while the schedule still fails the
/// same way.
fn shrink(
    setup: Setup,
    mutant: Option<Mutant>,
    script: Vec<Event>,
    kind: &str,
    cfg: &Config,
) -> Vec<Event> {
    let same = |s: &[Event]| {
        let mut stats = Report::default();
        let mut rng = StdRng::seed_from_u64(0);
        match run_schedule(setup, mutant, Some(s), &mut rng, cfg, &mut stats).1 {
            Err((what, _, _)) => kind_of(&what) == kind,
            Ok(()) => false,
        }
    };
    let mut script = script;
    let mut i = 0;
    while i < script.len() {
        let mut shorter = script.clone();
        shorter.remove(i);
        if same(&shorter) {
            script = shorter;
        } else {
            i += 1;
        }
    }
    script
}

/// The kind of a failure, to shrink towards the same one.
fn kind_of(what: &str) -> &'static str {
    if what.starts_with("no convergence") {
        "deadlock"
    } else if what.starts_with("a lock left held") {
        "lock leak"
    } else if what.contains("not fenced") {
        "fencing"
    } else if what.contains("minimum") {
        "minimum"
    } else if what.contains("removed") {
        "budget"
    } else if what.contains("raised") {
        "too many"
    } else if what.contains("failed with all") {
        "failed while up"
    } else if what.contains("revert was reverted") {
        "revert of a revert"
    } else {
        "other"
    }
}

/// Checks `cfg.schedules` random schedules on `threads` threads (each its own share of the
/// schedule seeds: the same seed checks the same schedules however many threads run them).
pub fn check_parallel(cfg: &Config, threads: usize) -> Report {
    let started = StdInstant::now();
    let threads = threads.max(1) as u64;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let reports: Vec<Report> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let stop = &stop;
                scope.spawn(move || check_range(cfg, t, threads, stop))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect()
    });
    let mut report = Report::default();
    for r in reports {
        report.schedules += r.schedules;
        report.events += r.events;
        report.commits += r.commits;
        report.refused += r.refused;
        report.converged += r.converged;
        report.rolls_completed += r.rolls_completed;
        report.reverts += r.reverts;
        report.transfers += r.transfers;
        report.counterexamples.extend(r.counterexamples);
    }
    report.seconds = started.elapsed().as_secs_f64();
    report
}

/// Checks `cfg.schedules` random schedules.
pub fn check(cfg: &Config) -> Report {
    let started = StdInstant::now();
    let mut report = check_range(cfg, 0, 1, &std::sync::atomic::AtomicBool::new(false));
    report.seconds = started.elapsed().as_secs_f64();
    report
}

/// The schedules `first`, `first + step`, … below `cfg.schedules`.
fn check_range(
    cfg: &Config,
    first: u64,
    step: u64,
    stop: &std::sync::atomic::AtomicBool,
) -> Report {
    use std::sync::atomic::Ordering::Relaxed;
    let mut report = Report::default();
    for i in (first..cfg.schedules).step_by(step as usize) {
        if stop.load(Relaxed) {
            break;
        }
        let mut rng = StdRng::seed_from_u64(cfg.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i);
        let setup = Setup {
            canary: (rng.random_range(0..3) == 0).then_some(1),
            auto_revert: rng.random_bool(0.5),
            x_replicas: rng.random_range(0..=2),
            bad_deploy: rng.random_range(0..3) == 0,
            roll_later: rng.random_bool(0.5),
            // By the schedule's number, not the generator: the schedules of a seed stay the
            // ones they were before rule 2, half of them now under each rule.
            rule: if i % 2 == 0 {
                Rule::Score
            } else {
                Rule::HoldersFirst
            },
        };
        report.schedules += 1;
        let (script, result) = run_schedule(setup, cfg.mutant, None, &mut rng, cfg, &mut report);
        if let Err((what, _, _)) = result {
            let kind = kind_of(&what);
            let script = shrink(setup, cfg.mutant, script, kind, cfg);
            let mut stats = Report::default();
            let mut rng = StdRng::seed_from_u64(0);
            let (_, again) =
                run_schedule(setup, cfg.mutant, Some(&script), &mut rng, cfg, &mut stats);
            let (what, trace, world) = match again {
                Err(e) => e,
                // Shrinking keeps failing scripts only: a pass here would be a bug in it.
                Ok(()) => (
                    what,
                    vec!["(the shrunk schedule passed)".into()],
                    World::new(setup, cfg.mutant),
                ),
            };
            report.counterexamples.push(Counterexample {
                setup,
                what,
                trace,
                state: world.describe(),
                waits: waits(&world),
            });
            if cfg.stop_at_first {
                stop.store(true, Relaxed);
                break;
            }
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checker has teeth: each rule broken as it was before issue 36's fixes is found.
    #[test]
    fn the_checker_finds_the_old_bugs() {
        // Seeds that reach each bug within a bounded run (the schedules of a seed are fixed).
        for (mutant, kind, seed, schedules) in [
            (Mutant::FinishNeedsLock, "deadlock", 1, 5_000),
            (Mutant::AnyTakeover, "fencing", 15, 5_000),
            (Mutant::LabelsGuardedAtCommit, "fencing", 3, 5_000),
        ] {
            let r = check_parallel(
                &Config {
                    schedules,
                    seed,
                    mutant: Some(mutant),
                    ..Config::default()
                },
                2,
            );
            assert!(
                r.counterexamples
                    .first()
                    .is_some_and(|c| kind_of(&c.what) == kind),
                "{mutant:?}: {}\n{}",
                r.summary(),
                r.counterexamples
                    .first()
                    .map(|c| c.to_string())
                    .unwrap_or_default()
            );
        }
    }

    /// The bounded run of the suite (the long one: `rcfarm-tools model-check`, 1,000,000 schedules).
    #[test]
    fn no_schedule_breaks_a_promise_or_deadlocks() {
        let schedules = std::env::var("RCFARM_MODEL_SCHEDULES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(20_000);
        let r = check_parallel(
            &Config {
                schedules,
                seed: 36,
                ..Config::default()
            },
            2,
        );
        assert!(
            r.ok(),
            "{}\n{}",
            r.summary(),
            r.counterexamples
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join("\n")
        );
        assert_eq!(r.converged, schedules, "{}", r.summary());
        // The schedules reach what they are meant to explore.
        assert!(
            r.reverts > 0 && r.transfers > 0 && r.refused > 0,
            "{}",
            r.summary()
        );
    }

    /// A lock left held is not convergence, however settled the RCs: a world that converged
    /// is no longer converged once a mutation lock is left in it, and the checker finds the
    /// leak of a transfer's end that keeps its lock (`Mutant::KeepsTransferLock`) as a lock
    /// leak, not only where the leaked lock then blocks a roll (a deadlock).
    #[test]
    fn a_lock_left_held_is_a_lock_leak() {
        let mut w = World::new(Setup::plain(1, false, false, false), None);
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..Config::default().calm_rounds {
            if converged(&w) {
                break;
            }
            for e in round(&mut rng, w.nodes()) {
                apply(&mut w, e);
            }
        }
        assert!(converged(&w), "{}", w.describe());
        w.kv.mut_lock
            .insert(Which::X, (Session(0, 0), Holder::Transfer));
        assert!(settled(&w) && !converged(&w), "{}", w.describe());
        assert_eq!(locks_left(&w), vec!["X's mutation lock (Transfer, s0.0)"]);

        let r = check_parallel(
            &Config {
                schedules: 300,
                seed: 2,
                mutant: Some(Mutant::KeepsTransferLock),
                stop_at_first: false,
                ..Config::default()
            },
            2,
        );
        let kinds: Vec<&str> = r.counterexamples.iter().map(|c| kind_of(&c.what)).collect();
        assert!(kinds.contains(&"lock leak"), "{kinds:?}: {}", r.summary());
    }

    /// Runs `rounds` fair rounds (faults not stopped), calling `after` after each event.
    fn run_rounds(w: &mut World, rounds: usize, mut after: impl FnMut(&mut World)) {
        let mut rng = StdRng::seed_from_u64(11);
        for _ in 0..rounds {
            for e in round(&mut rng, w.nodes()) {
                apply(w, e);
                after(w);
            }
        }
    }

    /// Which farm holds `rc`'s lock.
    fn owner(w: &World, rc: Which) -> usize {
        (0..FARMS)
            .find(|f| w.kv.own_lock.get(&rc) == Some(&w.farms[*f].session))
            .unwrap_or_else(|| panic!("{rc:?} unowned:\n  {}", w.describe()))
    }

    /// Each promise the checker keeps is shown broken by the mutant that breaks the rule it
    /// rests on (with the rule kept, the same schedule breaks nothing): an RC's count (a write
    /// not guarded by the RC's version), a roll's minimum (the planner shown none), no roll
    /// failed with its new pods up (a deadline that counts while the roll is paused), no revert
    /// of a revert. (Fencing and the deadlock: `the_checker_finds_the_old_bugs`; the budget:
    /// `the_cluster_window_refuses_a_second_spend_of_the_same_room`; a lock leak:
    /// `a_lock_left_held_is_a_lock_leak`.)
    #[test]
    fn each_promise_is_shown_broken() {
        let kinds =
            |w: &World| -> Vec<&'static str> { w.broken.iter().map(|b| kind_of(&b.0)).collect() };
        for mutant in [None, Some(Mutant::UnguardedRcWrites)] {
            // X (one pod) scaled to 2 and, while its task's write is in flight, back to 1.
            let mut w = World::new(Setup::plain(1, false, false, true), mutant);
            run_rounds(&mut w, 3, |_| {});
            let fx = owner(&w, Which::X);
            apply(&mut w, Event::EditX(2));
            assert!(apply(&mut w, Event::RcPass(fx, Which::X)).is_some());
            apply(&mut w, Event::EditX(1));
            let did = apply(&mut w, Event::Commit(fx)).unwrap_or_default();
            match mutant {
                None => assert!(did.starts_with("refused (stale)"), "{did}"),
                Some(_) => assert_eq!(kinds(&w), ["too many"], "{did}"),
            }
        }

        for mutant in [None, Some(Mutant::IgnoresMinimum)] {
            let mut w = World::new(Setup::plain(0, false, false, false), mutant);
            run_rounds(&mut w, 30, |_| {});
            match mutant {
                None => assert!(w.broken.is_empty() && w.kv.roll.is_none(), "{:?}", w.broken),
                Some(_) => assert!(kinds(&w).contains(&"minimum"), "{:?}", w.broken),
            }
        }

        for mutant in [None, Some(Mutant::DeadlineAlwaysCounts)] {
            // An operator pauses the roll once its new pods are all up.
            let mut w = World::new(Setup::plain(0, false, false, false), mutant);
            let new_up = |w: &World| {
                let n = w.kv.pods_of(Which::N);
                !n.is_empty() && n.iter().all(|i| w.kv.up(*i))
            };
            run_rounds(&mut w, 30, |w| {
                if w.kv.roll.as_ref().is_some_and(|r| r.started && !r.paused) && new_up(w) {
                    apply(w, Event::Pause);
                }
            });
            let paused = w.kv.roll.as_ref().is_some_and(|r| r.paused);
            match mutant {
                None => assert!(w.broken.is_empty() && paused, "{:?}", w.broken),
                Some(_) => assert!(kinds(&w).contains(&"failed while up"), "{:?}", w.broken),
            }
        }

        for mutant in [None, Some(Mutant::RevertsARevert)] {
            // A bad deploy reverts itself; then every node falls sick, and the revert fails.
            let mut w = World::new(Setup::plain(0, true, true, false), mutant);
            run_rounds(&mut w, 60, |w| {
                if w.kv.roll.as_ref().is_some_and(|r| r.revert_of)
                    && !w.kv.nodes.iter().all(|n| n.sick)
                {
                    for n in 0..w.nodes() {
                        apply(w, Event::Sick(n));
                    }
                }
            });
            match mutant {
                None => assert!(
                    w.broken.is_empty() && w.kv.roll.as_ref().is_some_and(|r| r.failed),
                    "{:?}\n  {}",
                    w.broken,
                    w.describe()
                ),
                Some(_) => assert!(
                    kinds(&w).contains(&"revert of a revert"),
                    "{:?}\n  {}",
                    w.broken,
                    w.describe()
                ),
            }
        }
    }

    #[test]
    fn a_world_left_alone_converges() {
        let mut stats = Report::default();
        let mut rng = StdRng::seed_from_u64(1);
        for x in 0..=2 {
            let setup = Setup::plain(x, false, false, false);
            let (_, r) = run_schedule(
                setup,
                None,
                Some(&[]),
                &mut rng,
                &Config::default(),
                &mut stats,
            );
            assert!(r.is_ok(), "{:?}", r.err().map(|e| (e.0, e.2.describe())));
        }
        assert_eq!(stats.rolls_completed, 3, "{stats:?}");
    }

    /// Two RCs scaled to nothing at once, each task planning its removals from the same room:
    /// the cluster's window lets the first commit and refuses the second whole (uncharged),
    /// a restart gives nothing back, and the checker's own count of the commits catches the
    /// second when its charge is written blindly (`Mutant::BlindCharge`). The random schedules
    /// seldom reach this: in this world only X's scale-downs and a roll's retirement remove
    /// counted pods.
    #[test]
    fn the_cluster_window_refuses_a_second_spend_of_the_same_room() {
        for mutant in [
            None,
            Some(Mutant::BlindCharge),
            Some(Mutant::UnchargedScaleDown),
        ] {
            let setup = Setup::plain(2, false, false, true);
            let mut w = World::new(setup, mutant);
            for _ in 0..4 {
                apply(&mut w, Event::Farm(0));
                apply(&mut w, Event::Farm(1));
                apply(&mut w, Event::Tick);
            }
            let (fo, fx) = (owner(&w, Which::O), owner(&w, Which::X));
            // An operator scales O and X to nothing.
            apply(&mut w, Event::EditX(0));
            w.kv.index += 1;
            let v = w.kv.index;
            if let Some(r) = w.kv.rcs.get_mut(&Which::O) {
                r.desired = 0;
                r.version = v;
            }
            assert!(apply(&mut w, Event::RcPass(fo, Which::O)).is_some());
            assert!(apply(&mut w, Event::RcPass(fx, Which::X)).is_some());
            let charges: Vec<u64> = w.pending.iter().map(|p| p.charge).collect();
            if mutant == Some(Mutant::UnchargedScaleDown) {
                // Charged nothing, so neither is refused: the checker counts the pods that
                // left the KV, not the charges.
                assert_eq!(charges, [0, 0]);
                w.commit(0);
                w.commit(0);
                let what = w.broken.first().map(|b| b.0.clone()).unwrap_or_default();
                assert_eq!(kind_of(&what), "budget", "{what:?}");
                continue;
            }
            assert_eq!(charges, [2, 2], "both planned from the same room of 2");
            let first = w.commit(0);
            let second = w.commit(0);
            assert!(first.starts_with("committed"), "{first}");
            match mutant {
                None => {
                    assert!(second.starts_with("refused (uncharged"), "{second}");
                    assert!(w.broken.is_empty(), "{:?}", w.broken);
                    assert_eq!(w.removed.iter().map(|r| r.3).sum::<u64>(), 2);
                    // A restart resets nothing: the room is the cluster's.
                    let spender = w.removed[0].1;
                    apply(&mut w, Event::Crash(spender));
                    assert_eq!(w.kv.room(w.now), 0);
                    // Room comes back once the window has passed (a bucket is one tick).
                    for _ in 0..world::BUDGET_WINDOW + 1 {
                        apply(&mut w, Event::Tick);
                    }
                    assert_eq!(w.kv.room(w.now), world::BUDGET_LIMIT);
                }
                Some(_) => {
                    assert!(second.starts_with("committed"), "{second}");
                    let what = w.broken.first().map(|b| b.0.clone()).unwrap_or_default();
                    assert_eq!(kind_of(&what), "budget", "{what:?}");
                }
            }
        }
    }
}

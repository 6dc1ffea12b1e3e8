//! Every interleaving of the smallest world, up to a depth: a breadth-first search over the
//! model's events with state hashing (two states that differ only in how far the KV's index
//! or the clock have run are one state), checking each commit's promises on the way and, from
//! every state reached, that the world converges once the faults stop.
//!
//! Our own search rather than `stateright`: the world is the random schedules' world, whose
//! events already carry the checks, and what makes the search small is the canonical form of
//! a state ([`fingerprint`]), which a generic checker would take as the state's `Hash` all the
//! same.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::hash::{Hash, Hasher};
use std::time::Instant as StdInstant;

use super::world::{
    BUDGET_WINDOW, CLAIM_GRACE, FARMS, Guard, ROLL_DEADLINE, RollRec, TRANSFER_TIMEOUT, Which,
    Write, at,
};
use super::{Config, Event, Mutant, Report, Setup, World, apply, converge_remembering, waits};

/// What to explore.
#[derive(Debug, Clone)]
pub struct Explore {
    pub setup: Setup,
    pub mutant: Option<Mutant>,
    pub nodes: usize,
    /// Events from the start, at most.
    pub depth: usize,
    /// Stop (and say so) past this many states.
    pub max_states: usize,
    /// The events a step may take.
    pub alphabet: Vec<Event>,
    /// From every state reached, this many fair schedules (each shuffled by its own seed) after
    /// the faults stop must converge with no lock left held (0: no liveness check).
    pub fair_schedules: u64,
    /// Rounds of fair running each is allowed.
    pub calm_rounds: usize,
}

impl Explore {
    /// The smallest world: two farms, the roll's two RCs and X with one pod, three nodes; the
    /// farms', the nodes' and time's events, and the faults that start transfers, handovers
    /// and reverts (a session lost, a handover of each kind, a node sick and healed, X scaled
    /// to nothing, P2's roller taking the RCs' mutation locks one at a time and letting go, an
    /// operator's pause and resume, and an operator disabling or enabling O or N by hand).
    pub fn smallest(setup: Setup, depth: usize) -> Explore {
        let nodes = 3;
        let mut alphabet = vec![Event::Tick];
        for f in 0..FARMS {
            alphabet.extend([Event::Farm(f), Event::RollPass(f), Event::Commit(f)]);
            alphabet.extend(Which::ALL.map(|w| Event::RcPass(f, w)));
        }
        for n in 0..nodes {
            alphabet.extend([Event::NodeActs(n), Event::NodePasses(n)]);
        }
        alphabet.extend([
            Event::LoseSession(0),
            Event::HandOverRc(0, Which::O),
            Event::HandOverRoll(0),
            Event::Sick(2),
            Event::Heal(2),
            Event::EditX(0),
            Event::P2Takes(Which::O),
            Event::P2Takes(Which::N),
            Event::P2Releases,
            Event::Pause,
            Event::Resume,
            Event::Flip(Which::O),
            Event::Flip(Which::N),
        ]);
        if setup.roll_later {
            alphabet.push(Event::StartRoll);
        }
        Explore {
            setup,
            mutant: None,
            nodes,
            depth,
            max_states: 2_000_000,
            alphabet,
            fair_schedules: 1,
            calm_rounds: Config::default().calm_rounds,
        }
    }
}

/// What an exploration found.
#[derive(Debug, Clone, Default)]
pub struct Explored {
    /// Distinct states reached (the start included).
    pub states: usize,
    /// Events applied (each from a state, to a state new or seen).
    pub transitions: u64,
    /// The deepest level fully explored.
    pub depth: usize,
    /// States from which the fair schedules were run after the faults stopped.
    pub liveness_checked: usize,
    /// Stopped at `max_states` before the depth.
    pub cut: bool,
    /// The first broken promise or non-converging state: what, and the events from the start.
    pub counterexample: Option<(String, Vec<Event>, String)>,
    pub seconds: f64,
}

impl Explored {
    pub fn summary(&self) -> String {
        format!(
            "{} distinct states to depth {}{} ({} transitions), liveness from {} of them; {}; {:.1} s",
            self.states,
            self.depth,
            if self.cut {
                " (cut at the state limit)"
            } else {
                ""
            },
            self.transitions,
            self.liveness_checked,
            match &self.counterexample {
                None => "no counterexample".to_string(),
                Some((what, path, _)) =>
                    format!("counterexample after {} events: {what}", path.len()),
            },
            self.seconds
        )
    }
}

/// Explores every interleaving of `cfg.alphabet` from the start, breadth first, to
/// `cfg.depth`. Stops at the first counterexample.
pub fn explore(cfg: &Explore) -> Explored {
    let started = StdInstant::now();
    let mut out = Explored::default();
    let start = World::with_nodes(cfg.setup, cfg.mutant, cfg.nodes);
    // Each state's parent and the event that reached it, to rebuild a counterexample's path.
    let mut parents: Vec<(usize, Event)> = vec![(usize::MAX, Event::Tick)];
    let mut seen: HashSet<u128> = HashSet::from([fingerprint(&start)]);
    let path_to = |parents: &[(usize, Event)], mut i: usize| {
        let mut path = Vec::new();
        while i != 0 {
            let (p, e) = parents[i];
            path.push(e);
            i = p;
        }
        path.reverse();
        path
    };
    // The calm states (faults stopped) from which each seed's fair schedule converged.
    let mut known: Vec<HashSet<u128>> = vec![HashSet::new(); cfg.fair_schedules as usize];
    // `true` when every seed's fair schedule converges from `w` (none: nothing checked).
    let mut check_live = |w: &World, i: usize, parents: &[(usize, Event)], out: &mut Explored| {
        if known.is_empty() {
            return true;
        }
        out.liveness_checked += 1;
        for (seed, known) in known.iter_mut().enumerate() {
            let mut w = w.clone();
            let mut stats = Report::default();
            let r = converge_remembering(
                &mut w,
                seed as u64,
                cfg.calm_rounds,
                &mut stats,
                Some(known),
            );
            if let Err(what) = r {
                out.counterexample = Some((what, path_to(parents, i), state_of(&w)));
                return false;
            }
        }
        true
    };
    let live_at_start = check_live(&start, 0, &parents, &mut out);
    let mut frontier: Vec<(usize, World)> = if live_at_start {
        vec![(0, start)]
    } else {
        Vec::new()
    };
    'levels: for depth in 1..=cfg.depth {
        if frontier.is_empty() {
            break;
        }
        let mut next = Vec::new();
        for (i, w) in &frontier {
            for e in &cfg.alphabet {
                let mut w2 = w.clone();
                apply(&mut w2, *e);
                out.transitions += 1;
                if !seen.insert(fingerprint(&w2)) {
                    continue;
                }
                let j = parents.len();
                parents.push((*i, *e));
                if let Some(b) = w2.broken.first() {
                    out.counterexample = Some((b.0.clone(), path_to(&parents, j), state_of(&w2)));
                    break 'levels;
                }
                if !check_live(&w2, j, &parents, &mut out) {
                    break 'levels;
                }
                if seen.len() >= cfg.max_states {
                    out.cut = true;
                    break 'levels;
                }
                next.push((j, w2));
            }
        }
        out.depth = depth;
        frontier = next;
    }
    out.states = seen.len();
    out.seconds = started.elapsed().as_secs_f64();
    out
}

fn state_of(w: &World) -> String {
    let mut s = w.describe();
    for line in waits(w) {
        s.push_str("\n  ");
        s.push_str(&line);
    }
    s
}

/// The state's canonical form, hashed (128 bits). The KV's versions are replaced by their
/// ranks among the versions the state holds (guards of pending writes included): only their
/// order and equality decide anything, so two states whose versions differ by how far the
/// index ran are the same state. Times become ages at `now`, capped where no rule tells them
/// apart any more (the transfer timeout, the roll deadline, the claim grace, the removal
/// window). What only names things (transfer ids, a process's incarnation, traces) is left
/// out.
pub fn fingerprint(w: &World) -> u128 {
    let now = w.now;
    let mut versions = BTreeSet::new();
    for r in w.kv.rcs.values() {
        versions.insert(r.version);
    }
    for n in &w.kv.nodes {
        versions.extend(n.pod.map(|p| p.version));
        versions.extend(n.reality.map(|r| r.1));
        versions.extend(n.health.map(|h| h.1));
    }
    if let Some(r) = &w.kv.roll {
        versions.extend([r.version, r.control_version]);
    }
    versions.insert(w.kv.window_version);
    for p in &w.pending {
        for g in &p.guards {
            match g {
                Guard::RcVersion(_, v) | Guard::RollVersion(v) | Guard::ControlVersion(v) => {
                    versions.insert(*v);
                }
                Guard::Label(_, v) => versions.extend(*v),
                Guard::MutLockHeld(..) | Guard::StatusAbsent(_) => {}
            }
        }
    }
    let rank: BTreeMap<u64, usize> = versions.iter().enumerate().map(|(i, v)| (*v, i)).collect();
    let v = |x: u64| rank.get(&x).copied().unwrap_or(usize::MAX);
    let age = |t: u64, cap: u64| now.saturating_sub(t).min(cap);
    let instant_age = |t: tokio::time::Instant, cap: u64| {
        // The model's instants are whole ticks after `at(0)`.
        let tick = t.saturating_duration_since(at(0)).as_secs();
        age(tick, cap)
    };

    let mut h = Fingerprint::default();
    for (w_, r) in &w.kv.rcs {
        (w_, r.desired, r.disabled, r.retire, v(r.version)).hash(&mut h);
    }
    h.sep();
    w.kv.own_lock.hash(&mut h);
    for (rc, (s, holder)) in &w.kv.mut_lock {
        (rc, s, holder).hash(&mut h);
    }
    w.kv.nt_lock.hash(&mut h);
    for (rc, t) in &w.kv.transfer {
        (rc, t.old, t.new, age(t.started, TRANSFER_TIMEOUT + 1)).hash(&mut h);
    }
    h.sep();
    for n in &w.kv.nodes {
        (
            n.eligible,
            n.sick,
            n.pod.map(|p| (p.owner, p.intent, v(p.version))),
            n.reality.map(|(m, rv)| (m, v(rv))),
            n.health.map(|(ok, hv)| (ok, v(hv))),
        )
            .hash(&mut h);
    }
    h.sep();
    if let Some(r) = &w.kv.roll {
        (roll_shape(r), v(r.version), v(r.control_version)).hash(&mut h);
    }
    w.kv.roll_lock.hash(&mut h);
    // The window: what each bucket still counted holds, by age.
    for (start, n) in &w.kv.window.buckets {
        let a = now as i64 - start;
        if a < BUDGET_WINDOW as i64 {
            (a, n).hash(&mut h);
        }
    }
    v(w.kv.window_version).hash(&mut h);
    h.sep();
    for f in &w.farms {
        f.session.hash(&mut h);
        for (rc, t) in &f.tasks {
            (
                rc,
                t.transfer_loaded,
                t.transfer_started.map(|s| age(s, TRANSFER_TIMEOUT + 1)),
            )
                .hash(&mut h);
        }
        h.sep();
        if let Some(t) = &f.roll_task {
            (
                t.ready_since.map(|s| age(s, ROLL_DEADLINE + 1)),
                t.deadline_spent.min(ROLL_DEADLINE),
                t.counting_since.map(|s| age(s, ROLL_DEADLINE + 1)),
                t.best_new_up,
            )
                .hash(&mut h);
        }
        h.sep();
        for unheld in [&f.unheld_since, &f.roll_unheld_since] {
            let mut ages: Vec<_> = unheld
                .iter()
                .map(|(id, t)| (*id, instant_age(*t, CLAIM_GRACE + 1)))
                .collect();
            ages.sort();
            ages.hash(&mut h);
        }
    }
    h.sep();
    for p in &w.pending {
        (
            p.farm,
            p.session,
            p.fence,
            p.charge,
            p.writer,
            p.release_transfer_lock,
            &p.up_at_plan,
        )
            .hash(&mut h);
        for g in &p.guards {
            match g {
                Guard::RcVersion(rc, x) => (0u8, rc, v(*x)).hash(&mut h),
                Guard::Label(n, x) => (1u8, n, x.map(v)).hash(&mut h),
                Guard::MutLockHeld(rc, s) => (2u8, rc, s).hash(&mut h),
                Guard::StatusAbsent(rc) => (3u8, rc).hash(&mut h),
                Guard::RollVersion(x) => (4u8, v(*x)).hash(&mut h),
                Guard::ControlVersion(x) => (5u8, v(*x)).hash(&mut h),
            }
        }
        for wr in &p.writes {
            match wr {
                Write::SetPod { node, owner } => (0u8, node, owner).hash(&mut h),
                Write::DeletePod { node } => (1u8, node).hash(&mut h),
                Write::SetTransfer(rc, t) => {
                    (2u8, rc, t.old, t.new, age(t.started, TRANSFER_TIMEOUT + 1)).hash(&mut h)
                }
                Write::DeleteTransfer(rc) => (3u8, rc).hash(&mut h),
                Write::SetRc(rc, r) => (4u8, rc, r.desired, r.disabled, r.retire).hash(&mut h),
                Write::DeleteRc(rc) => (5u8, rc).hash(&mut h),
                Write::SetRoll(r) => (6u8, r.as_ref().map(roll_shape)).hash(&mut h),
                Write::DeleteMutLock(rc) => (7u8, rc).hash(&mut h),
                Write::DeleteRollLock => 8u8.hash(&mut h),
            }
        }
        h.sep();
    }
    h.sep();
    // The removals the budget property still counts, by age.
    for (t, _, _, n) in &w.removed {
        if now - t < BUDGET_WINDOW {
            (now - t, n).hash(&mut h);
        }
    }
    w.rolled.hash(&mut h);
    w.flipped.hash(&mut h);
    h.finish128()
}

/// A roll record but for its versions.
fn roll_shape(r: &RollRec) -> impl Hash + use<> {
    (
        (r.old, r.new, r.target, r.minimum, r.canary),
        (r.started, r.paused, r.failed, r.auto_revert, r.revert_of),
    )
}

/// Two independently keyed SipHash streams: 128 bits, so that two of a few million states
/// sharing a fingerprint (and one being skipped) is out of the question.
struct Fingerprint(std::hash::DefaultHasher, std::hash::DefaultHasher);

impl Default for Fingerprint {
    fn default() -> Self {
        let mut b = std::hash::DefaultHasher::new();
        0x5eed_u64.hash(&mut b);
        Fingerprint(std::hash::DefaultHasher::new(), b)
    }
}

impl Fingerprint {
    /// Marks the end of a variable-length part.
    fn sep(&mut self) {
        0xffu8.hash(self);
    }

    fn finish128(&self) -> u128 {
        (u128::from(self.0.finish()) << 64) | u128::from(self.1.finish())
    }
}

impl Hasher for Fingerprint {
    fn finish(&self) -> u64 {
        self.0.finish()
    }

    fn write(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
        self.1.write(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// X with one pod.
    fn setup(roll_later: bool, bad_deploy: bool, auto_revert: bool) -> Setup {
        Setup::plain(1, bad_deploy, auto_revert, roll_later)
    }

    /// Two states that differ only in how far the index and the clock ran are one state; a
    /// pod more, a lock held, a guard on another version are not.
    #[test]
    fn a_states_fingerprint_is_its_canonical_form() {
        let w = World::with_nodes(setup(false, false, false), None, 3);
        let mut later = w.clone();
        later.kv.index += 100;
        for r in later.kv.rcs.values_mut() {
            r.version += 100;
        }
        for n in &mut later.kv.nodes {
            n.pod.iter_mut().for_each(|p| p.version += 100);
            n.reality.iter_mut().for_each(|r| r.1 += 100);
            n.health.iter_mut().for_each(|h| h.1 += 100);
        }
        if let Some(r) = later.kv.roll.as_mut() {
            r.version += 100;
            r.control_version += 100;
        }
        later.kv.window_version += 100;
        later.now += 50;
        assert_eq!(fingerprint(&w), fingerprint(&later));

        let mut locked = w.clone();
        locked
            .kv
            .own_lock
            .insert(Which::X, super::super::world::Session(0, 0));
        assert_ne!(fingerprint(&w), fingerprint(&locked));
        let mut older_health = w.clone();
        // n0's health now older than its reality: not up any more.
        if let Some(h) = older_health.kv.nodes[0].health.as_mut() {
            h.1 = 0;
        }
        assert_ne!(fingerprint(&w), fingerprint(&older_health));
    }

    /// Every interleaving of the smallest world's events to a depth keeps every promise, and
    /// from every state reached the world converges once the faults stop, with no lock left.
    /// (The longer exploration: `rcfarm-tools model-check --explore DEPTH`.)
    #[test]
    fn every_interleaving_of_the_smallest_world_keeps_the_promises() {
        let depth = std::env::var("RCFARM_MODEL_DEPTH")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(5);
        for s in [setup(false, false, true), setup(true, true, true)] {
            let r = explore(&Explore::smallest(s, depth));
            eprintln!("{s:?}: {}", r.summary());
            assert!(
                r.counterexample.is_none(),
                "{}\n{:?}",
                r.summary(),
                r.counterexample
            );
            assert_eq!(r.depth, depth, "{}", r.summary());
            assert!(r.states > 100, "{}", r.summary());
        }
    }

    /// The exploration has teeth: a roll planner shown no minimum is caught taking a roll's
    /// pods below it, at the shortest interleaving that does.
    #[test]
    fn the_exploration_finds_a_broken_minimum() {
        let mut cfg = Explore::smallest(setup(false, false, false), 3);
        cfg.mutant = Some(Mutant::IgnoresMinimum);
        let r = explore(&cfg);
        let (what, _, _) = r.counterexample.clone().unwrap_or_default();
        assert_eq!(super::super::kind_of(&what), "minimum", "{}", r.summary());
    }
}

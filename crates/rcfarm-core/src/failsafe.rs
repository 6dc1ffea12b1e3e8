//! Failsafes (P2 refused to act on an empty RC tree or on all-zero replicas; rcfarm keeps that
//! guard without P2's panic, and adds a blast-radius limit):
//!
//! - a **removal budget** per farm: at most `--max-removals` pods removed (unscheduled or
//!   replaced) per `--max-removals-window`, across RC tasks, roll steps and node transfers.
//!   Each asks for `n` removals and is granted `m ≤ n`; it removes only what it was granted and
//!   otherwise reports `RemovalsHeld`. Adding pods never counts.
//! - a **tripwire** on the RC tree: when the listing goes from non-empty to empty, or every RC
//!   to 0 replicas, no removal is granted until that state has held for `--failsafe-confirm`.
//! - an operator's **release** (`rcctl farm release-removals`), a key under
//!   `rcfarm/failsafe/release/<farm-id>` the farm watches: a new one empties the window and ends
//!   a pending confirmation, once.
//!
//! Below the RC and roll tasks (which ask), above nothing but the RC model: the budget and the
//! tripwire are pure (time is an input) and unit-tested; [`Failsafe`] shares them in a farm.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::clock::Clock;
use crate::rc::RcId;
use crate::util::format_go_duration;

/// Where operators' releases live (P2 never reads it).
pub const FAILSAFE_PREFIX: &str = "rcfarm/failsafe/";

/// How a hold by the tripwire begins (a hold by the window does not).
pub const TRIPPED: &str = "failsafe tripped";

/// A percentage limit never goes below this many removals per window (a small farm must still
/// be able to scale down).
pub const MIN_REMOVALS: u64 = 5;

/// `rcfarm/failsafe/release/<farm-id>`: the last release of one farm's removals.
/// Why removals wait while the tripwire's first look at a share waits for its pods.
pub const FIRST_LOOK: &str = "removals held: this farm took up RCs that are all at 0 replicas; they wait for a read of those RCs' pods, whose result decides whether the failsafe trips (a bulk edit)";

pub fn release_key(farm_id: &str) -> String {
    format!("{FAILSAFE_PREFIX}release/{farm_id}")
}

/// What `rcctl farm release-removals` writes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Release {
    /// Who released (`rcctl:<user>@<host>`).
    pub by: String,
    pub at: DateTime<Utc>,
}

impl Release {
    pub fn parse(bytes: &[u8]) -> Result<Release, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("not a release record: {e}"))
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        // A struct of plain fields always serializes.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// `--max-removals`: a count, a percentage of the pods the farm serves, or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaxRemovals {
    Off,
    Pods(u64),
    /// Percent of the pods the farm serves, at least [`MIN_REMOVALS`].
    Percent(u64),
}

impl Default for MaxRemovals {
    fn default() -> Self {
        MaxRemovals::Percent(20)
    }
}

impl MaxRemovals {
    /// The most removals per window for a farm serving `served` pods (`None`: no limit).
    pub fn limit(self, served: u64) -> Option<u64> {
        match self {
            MaxRemovals::Off => None,
            MaxRemovals::Pods(n) => Some(n),
            MaxRemovals::Percent(p) => Some((served.saturating_mul(p) / 100).max(MIN_REMOVALS)),
        }
    }
}

impl FromStr for MaxRemovals {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let bad = || {
            format!(
                "{s:?}: give a number of pods (20), a percentage of the pods the farm serves (20%), or off"
            )
        };
        if s.eq_ignore_ascii_case("off") {
            return Ok(MaxRemovals::Off);
        }
        let zero = || {
            format!(
                "{s:?}: a farm allowed no removal could never scale down or roll; give at least 1 (or 1%), or off"
            )
        };
        if let Some(p) = s.strip_suffix('%') {
            let p: u64 = p.trim().parse().map_err(|_| bad())?;
            if p == 0 {
                return Err(zero());
            }
            if p > 100 {
                return Err(format!("{s:?}: a percentage is at most 100%"));
            }
            return Ok(MaxRemovals::Percent(p));
        }
        match s.parse::<u64>().map_err(|_| bad())? {
            0 => Err(zero()),
            n => Ok(MaxRemovals::Pods(n)),
        }
    }
}

impl fmt::Display for MaxRemovals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MaxRemovals::Off => write!(f, "off"),
            MaxRemovals::Pods(n) => write!(f, "{n}"),
            MaxRemovals::Percent(p) => write!(f, "{p}%"),
        }
    }
}

/// A farm's failsafe settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailsafeConfig {
    pub max_removals: MaxRemovals,
    /// The sliding window the limit counts over (`--max-removals-window`).
    pub window: Duration,
    /// How long an empty or all-zero RC tree must be seen before the farm acts on it
    /// (`--failsafe-confirm`; zero: no tripwire).
    pub confirm: Duration,
}

impl Default for FailsafeConfig {
    fn default() -> Self {
        FailsafeConfig {
            max_removals: MaxRemovals::default(),
            window: Duration::from_secs(300),
            confirm: Duration::from_secs(120),
        }
    }
}

/// The removals granted over a sliding window. Pure: the time is an argument.
#[derive(Debug, Default, Clone, PartialEq, Eq, Hash)]
pub struct Budget {
    /// (when, how many, the grant's id), oldest first.
    grants: VecDeque<(Instant, u64, u64)>,
    next_id: u64,
}

impl Budget {
    fn prune(&mut self, now: Instant, window: Duration) {
        while let Some((t, _, _)) = self.grants.front() {
            if now.saturating_duration_since(*t) >= window {
                self.grants.pop_front();
            } else {
                break;
            }
        }
    }

    /// Removals granted within the window before `now`.
    pub fn used(&mut self, now: Instant, window: Duration) -> u64 {
        self.prune(now, window);
        self.grants.iter().map(|(_, n, _)| n).sum()
    }

    /// How many more may be granted now (`limit` `None`: any number).
    pub fn room(&mut self, now: Instant, window: Duration, limit: Option<u64>) -> u64 {
        match limit {
            None => u64::MAX,
            Some(l) => l.saturating_sub(self.used(now, window)),
        }
    }

    /// Grants up to `want` removals: what the window has room for, and the grant's id (for
    /// [`Budget::refund`]).
    pub fn take(
        &mut self,
        now: Instant,
        window: Duration,
        limit: Option<u64>,
        want: u64,
    ) -> (u64, u64) {
        let granted = want.min(self.room(now, window, limit));
        let id = self.next_id;
        self.next_id += 1;
        if granted > 0 {
            self.grants.push_back((now, granted, id));
        }
        (granted, id)
    }

    /// Gives back `n` removals of grant `id` that were not made. The grant keeps its time: what
    /// it did remove still counts from when it was granted. A grant that left the window has
    /// nothing left to give back.
    pub fn refund(&mut self, id: u64, n: u64) {
        if let Some(i) = self.grants.iter().position(|(_, _, g)| *g == id) {
            let entry = &mut self.grants[i].1;
            *entry = entry.saturating_sub(n);
            if *entry == 0 {
                self.grants.remove(i);
            }
        }
    }

    /// Forgets every grant: an operator's release.
    pub fn clear(&mut self) {
        self.grants.clear();
    }

    /// When the oldest grant in the window leaves it (room comes back then).
    pub fn next_room_at(&mut self, now: Instant, window: Duration) -> Option<Instant> {
        self.prune(now, window);
        self.grants.front().map(|(t, _, _)| *t + window)
    }
}

/// What the RC tree looks like, for the tripwire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TreeShape {
    /// No RC key at all.
    Empty,
    /// RCs, every one at 0 replicas.
    AllZero,
    /// At least one RC wants pods (or cannot be read, which is never read as 0).
    Serving,
}

/// What the tripwire counts: the RC tree's keys, and the RCs this farm serves (issue 38: a
/// farm reads the records of its own RCs only, so a bulk edit to 0 trips every farm, each on
/// its own share).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tree {
    /// Keys in the RC tree, valid or not, whoever serves them.
    pub keys: usize,
    /// RCs this farm serves, valid or not.
    pub rcs: usize,
    /// Of those, the RCs that want pods, or cannot be read (never read as 0).
    pub serving: usize,
}

impl Tree {
    /// A farm's share: `replicas` the counts of its valid RCs, `invalid` how many of its
    /// records could not be read; the tree's keys are taken to be these (see [`Tree::keys`]).
    pub fn of(replicas: impl IntoIterator<Item = u64>, invalid: usize) -> Tree {
        let mut t = Tree {
            keys: invalid,
            rcs: invalid,
            serving: invalid,
        };
        for r in replicas {
            t.rcs += 1;
            t.serving += usize::from(r > 0);
        }
        t.keys = t.rcs;
        t
    }

    /// The same share in a tree of `keys` keys.
    pub fn keys(self, keys: usize) -> Tree {
        Tree { keys, ..self }
    }

    pub fn shape(self) -> TreeShape {
        if self.keys == 0 {
            TreeShape::Empty
        } else if self.rcs > 0 && self.serving == 0 {
            TreeShape::AllZero
        } else {
            TreeShape::Serving
        }
    }
}

/// A tripped failsafe: what was seen, since when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trip {
    pub shape: TreeShape,
    pub since: Instant,
    pub since_utc: DateTime<Utc>,
    pub why: String,
}

/// What the tripwire decided on one look.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TripEvent {
    /// Tripped now: no removal until confirmed.
    Tripped(String),
    /// The state held for the confirmation window: the farm acts on it.
    Confirmed,
    /// The tree changed back before the window ran out.
    Cleared(String),
}

/// Watches the RC tree's shape for the two states P2 refused to act on. Pure.
#[derive(Debug, Default, Clone)]
pub struct Tripwire {
    last: Option<Tree>,
    /// When each RC of the tree last wanted pods: a bulk edit zeroes two or more within the
    /// confirmation window (at once, or one by one).
    /// (when it last wanted pods, whether it did at the last look).
    serving_at: HashMap<RcId, (Instant, bool)>,
    trip: Option<Trip>,
}

impl Tripwire {
    pub fn trip(&self) -> Option<&Trip> {
        self.trip.as_ref()
    }

    /// Whether the next look is the first at a share (see [`Tripwire::observe`]).
    pub fn at_first_look(&self) -> bool {
        self.last.is_none_or(|l| l.rcs == 0)
    }

    /// Looks at the tree now (each valid RC's replica count, and how many keys could not be
    /// read); `removable`: whether pods of its RCs exist (looked at on the first look only). It
    /// trips on bulk changes only: the tree went empty from two RCs or more at once, or every
    /// RC went to 0 with two or more of them having wanted pods within the window. One RC
    /// scaled to 0 or deleted is an operator's act, even the last one (or the last after a
    /// roll deleted its old RC). The first look after a start has nothing to compare with: an
    /// empty tree then removes nothing anyway (deleting an RC key leaves its pods), but an
    /// all-zero tree of two RCs or more with pods is held as a change would be (a farm
    /// restarted into a bulk edit).
    #[allow(clippy::too_many_arguments)]
    pub fn observe(
        &mut self,
        now: Instant,
        wall: DateTime<Utc>,
        keys: usize,
        rcs: impl IntoIterator<Item = (RcId, u64)>,
        invalid: usize,
        removable: bool,
        confirm: Duration,
    ) -> Option<TripEvent> {
        let rcs: Vec<(RcId, u64)> = rcs.into_iter().collect();
        let tree = Tree::of(rcs.iter().map(|(_, r)| *r), invalid).keys(keys);
        let shape = tree.shape();
        let last = self.last.replace(tree);
        // What served at the last look served until now.
        for (t, serving) in self.serving_at.values_mut() {
            if *serving {
                *t = now;
            }
        }
        for (id, r) in &rcs {
            if *r > 0 {
                self.serving_at.insert(*id, (now, true));
            } else if let Some(e) = self.serving_at.get_mut(id) {
                e.1 = false;
            }
        }
        let present: HashSet<RcId> = rcs.iter().map(|(id, _)| *id).collect();
        self.serving_at.retain(|id, _| present.contains(id));
        let zeroed_recently = rcs
            .iter()
            .filter(|(id, r)| {
                *r == 0
                    && self
                        .serving_at
                        .get(id)
                        .is_some_and(|(t, _)| now.saturating_duration_since(*t) <= confirm)
            })
            .count();
        if confirm.is_zero() {
            return self
                .trip
                .take()
                .map(|_| TripEvent::Cleared("the tripwire is off".into()));
        }
        if let Some((tripped, since)) = self.trip.as_ref().map(|t| (t.shape, t.since)) {
            if tripped != shape {
                self.trip = None;
                return Some(TripEvent::Cleared(format!(
                    "the RC tree changed before {} passed: it is no longer {}",
                    format_go_duration(confirm),
                    describe(tripped)
                )));
            }
            if now.saturating_duration_since(since) >= confirm {
                self.trip = None;
                return Some(TripEvent::Confirmed);
            }
            return None;
        }
        let trips = match shape {
            TreeShape::Empty => last.is_some_and(|l| l.keys >= 2),
            // A bulk change trips whatever this farm's view of the pods shows: a farm reads
            // only the pods of the RCs it serves, and one that has just been handed RCs over
            // has not read theirs yet (on real Consul, three farms: 9 pods of 24 removed
            // within 15 s by the farms whose view looked empty). Tripping with nothing to
            // remove holds nothing. Only the first look relies on the view, which then holds
            // every pod (no RC is another farm's yet).
            // The first look at a share (a farm's first claims, after a start or when it
            // served nothing) has nothing to compare with either.
            TreeShape::AllZero => {
                last.is_none_or(|l| l.shape() != TreeShape::AllZero)
                    && (zeroed_recently >= 2
                        || last.is_none_or(|l| l.rcs == 0) && tree.rcs >= 2 && removable)
            }
            TreeShape::Serving => false,
        };
        if !trips {
            return None;
        }
        let why = match (shape, last) {
            (TreeShape::Empty, _) => "the RC tree went from non-empty to empty".to_string(),
            (_, l) if l.is_none_or(|l| l.rcs == 0) => {
                "every RC this farm takes up is at 0 replicas while their pods still run"
                    .to_string()
            }
            _ => "every RC this farm serves went to 0 replicas".to_string(),
        };
        let why = format!(
            "{why} (a wiped or bulk-edited Consul?): no pod is removed until this has held for {}",
            format_go_duration(confirm)
        );
        self.trip = Some(Trip {
            shape,
            since: now,
            since_utc: wall,
            why: why.clone(),
        });
        Some(TripEvent::Tripped(why))
    }

    /// An operator's release ends a pending confirmation. `true`: one was pending.
    pub fn release(&mut self) -> bool {
        self.trip.take().is_some()
    }
}

fn describe(shape: TreeShape) -> &'static str {
    match shape {
        TreeShape::Empty => "empty",
        TreeShape::AllZero => "all at 0 replicas",
        TreeShape::Serving => "serving",
    }
}

/// What a task asked for and got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub granted: u64,
    /// Why fewer than asked were granted.
    pub held: Option<String>,
    /// The grant's id in the budget: what it does not remove is refunded against it.
    pub id: u64,
}

/// Removals granted to one action and not yet made: what the action commits is spent, chunk by
/// chunk; what is left when it is dropped (the action stopped early, or a write was refused)
/// goes back to the budget, against the grant it came from. Exact both ways: a write that
/// wrote nothing costs nothing, and a write that committed some chunks costs exactly those.
#[derive(Debug)]
pub struct Reservation {
    failsafe: std::sync::Arc<Failsafe>,
    id: u64,
    left: u64,
}

impl Reservation {
    /// Removals still reserved.
    pub fn left(&self) -> u64 {
        self.left
    }

    /// `n` removals were made (committed, or written with the outcome unknown: counted, as
    /// they may have been made).
    pub fn spend(&mut self, n: u64) {
        self.left = self.left.saturating_sub(n);
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.left > 0 {
            self.failsafe.refund(self.id, self.left);
        }
    }
}

/// The failsafe as a farm reports it (`/v1/farms`, the status page).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct FailsafeStatus {
    /// `--max-removals` as given (`20%`, `50`, `off`).
    pub max_removals: String,
    /// What it comes to now (`None`: no limit).
    pub removal_limit: Option<u64>,
    /// Pods the farm serves (the base of a percentage).
    pub served_pods: u64,
    /// Removals granted within the window.
    pub removals_in_window: u64,
    pub window: String,
    pub confirm: String,
    /// Why the tripwire holds every removal, while it does (`FailsafeTripped`).
    pub tripped: Option<String>,
    pub tripped_since: Option<DateTime<Utc>>,
    /// RCs and rolls whose removals are held now.
    pub held: usize,
}

#[derive(Debug, Default)]
struct State {
    budget: Budget,
    /// The most pods served within the window, and when it was seen.
    served: u64,
    served_at: Option<Instant>,
    tripwire: Tripwire,
    /// RCs and rolls held now (`rc:<id>`, `roll:<id>`).
    held: BTreeSet<String>,
    /// Set while the tripwire's first look at a share just taken up waits for a read of its
    /// pods (the ticket of that read): every removal waits with it.
    first_look: Option<u64>,
}

/// A farm's failsafe, shared by its RC tasks, roll tasks and the farm loop.
#[derive(Debug)]
pub struct Failsafe {
    farm_id: String,
    config: FailsafeConfig,
    state: Mutex<State>,
    clock: Clock,
}

impl Failsafe {
    pub fn new(farm_id: impl Into<String>, config: FailsafeConfig) -> Failsafe {
        Failsafe {
            farm_id: farm_id.into(),
            config,
            state: Mutex::default(),
            clock: Clock::system(),
        }
    }

    pub fn with_clock(mut self, clock: Clock) -> Failsafe {
        self.clock = clock;
        self
    }

    pub fn config(&self) -> FailsafeConfig {
        self.config
    }

    /// The pods the farm serves now. A percentage limit counts the most it served within
    /// the window: a farm scaling down must not see its own limit shrink with every pod it
    /// removes.
    pub fn set_served(&self, pods: u64) {
        let now = self.clock.now();
        let mut s = self.state.lock();
        let expired = s
            .served_at
            .is_none_or(|t| now.saturating_duration_since(t) >= self.config.window);
        if pods >= s.served || expired {
            s.served = pods;
            s.served_at = Some(now);
        }
    }

    fn held_reason(&self, s: &mut State, now: Instant) -> String {
        if let Some(t) = s.tripwire.trip() {
            return format!("{TRIPPED}: {}", t.why);
        }
        if s.first_look.is_some() {
            return FIRST_LOOK.to_string();
        }
        let limit = self.config.max_removals.limit(s.served);
        let used = s.budget.used(now, self.config.window);
        let when = s
            .budget
            .next_room_at(now, self.config.window)
            .map(|t| {
                let wait = t.saturating_duration_since(now);
                format!(
                    "room again in {}",
                    format_go_duration(Duration::from_secs(wait.as_secs() + 1))
                )
            })
            .unwrap_or_default();
        format!(
            "removals held: farm {} removed {used} pods in the last {} (--max-removals {}: {} now); {when}, or run `rcctl farm release-removals {}`",
            self.farm_id,
            format_go_duration(self.config.window),
            self.config.max_removals,
            limit.map_or("no limit".to_string(), |l| l.to_string()),
            self.farm_id,
        )
    }

    /// How many removals could be granted now, and why not more if none (a planner's cap).
    pub fn room(&self) -> (u64, Option<String>) {
        let now = self.clock.now();
        let mut s = self.state.lock();
        if s.tripwire.trip().is_some() || s.first_look.is_some() {
            let why = self.held_reason(&mut s, now);
            return (0, Some(why));
        }
        let limit = self.config.max_removals.limit(s.served);
        let room = s.budget.room(now, self.config.window, limit);
        let why = (room == 0).then(|| self.held_reason(&mut s, now));
        (room, why)
    }

    /// Asks for `want` removals.
    pub fn take(&self, want: u64) -> Grant {
        if want == 0 {
            return Grant {
                granted: 0,
                held: None,
                id: u64::MAX,
            };
        }
        let now = self.clock.now();
        let mut s = self.state.lock();
        let (granted, id) = if s.tripwire.trip().is_some() || s.first_look.is_some() {
            (0, u64::MAX)
        } else {
            let limit = self.config.max_removals.limit(s.served);
            s.budget.take(now, self.config.window, limit, want)
        };
        let held = (granted < want).then(|| self.held_reason(&mut s, now));
        if granted > 0 {
            metrics::counter!("rcfarm_removals_granted_total").increment(granted);
        }
        Grant { granted, held, id }
    }

    /// Asks for `want` removals, as a [`Reservation`] of what was granted (and why no more).
    pub fn reserve(self: &std::sync::Arc<Self>, want: u64) -> (Reservation, Option<String>) {
        let g = self.take(want);
        (
            Reservation {
                failsafe: self.clone(),
                id: g.id,
                left: g.granted,
            },
            g.held,
        )
    }

    /// Gives back removals of grant `id` not made.
    pub fn refund(&self, id: u64, n: u64) {
        if n > 0 {
            self.state.lock().budget.refund(id, n);
            metrics::counter!("rcfarm_removals_refunded_total").increment(n);
        }
    }

    /// Why every removal is held now, if the tripwire holds them: replacements that lose no
    /// capacity (a roll's steps, a node transfer's end) are not counted by the budget, but wait
    /// for a tripped failsafe like every removal.
    pub fn tripped(&self) -> Option<String> {
        let now = self.clock.now();
        let mut s = self.state.lock();
        if s.tripwire.trip().is_none() && s.first_look.is_none() {
            return None;
        }
        Some(self.held_reason(&mut s, now))
    }

    /// Whether the tripwire has not looked at a share yet (it started, or served nothing at
    /// its last look): its next look trips on two RCs or more at 0 whose pods run.
    pub fn at_first_look(&self) -> bool {
        self.state.lock().tripwire.at_first_look()
    }

    /// Holds every removal until [`Failsafe::first_look_done`]: the farm takes up RCs all at 0
    /// replicas whose pods it has not read yet (they are read with `ticket`), so whether they
    /// would remove anything, and the tripwire trip, is not known yet.
    pub fn await_first_look(&self, ticket: u64) {
        self.state.lock().first_look = Some(ticket);
    }

    /// The ticket of the read the tripwire's first look waits for, if it waits.
    pub fn first_look_pending(&self) -> Option<u64> {
        self.state.lock().first_look
    }

    pub fn first_look_done(&self) {
        self.state.lock().first_look = None;
    }

    /// Marks `who` (`rc:<id>`, `roll:<id>`) held or not. `true`: that changed (held: a new
    /// episode, to audit once).
    pub fn set_held(&self, who: &str, held: bool) -> bool {
        let mut s = self.state.lock();
        let changed = if held {
            s.held.insert(who.to_string())
        } else {
            s.held.remove(who)
        };
        metrics::gauge!("rcfarm_removals_held").set(s.held.len() as f64);
        if changed && held {
            metrics::counter!("rcfarm_removals_held_total").increment(1);
        }
        changed
    }

    /// Forgets every hold (the session was lost: tasks start again).
    pub fn clear_held(&self) {
        let mut s = self.state.lock();
        s.held.clear();
        metrics::gauge!("rcfarm_removals_held").set(0.0);
    }

    /// The tripwire's look at the RC tree (see [`Tripwire::observe`]).
    pub fn observe_tree(
        &self,
        keys: usize,
        rcs: impl IntoIterator<Item = (RcId, u64)>,
        invalid: usize,
        removable: bool,
    ) -> Option<TripEvent> {
        let mut s = self.state.lock();
        let ev = s.tripwire.observe(
            self.clock.now(),
            self.clock.wall(),
            keys,
            rcs,
            invalid,
            removable,
            self.config.confirm,
        );
        metrics::gauge!("rcfarm_failsafe_tripped").set(if s.tripwire.trip().is_some() {
            1.0
        } else {
            0.0
        });
        ev
    }

    /// An operator's release: the window starts empty, a pending confirmation ends. `true`:
    /// a confirmation was pending.
    pub fn release(&self) -> bool {
        let mut s = self.state.lock();
        s.budget.clear();
        let ended = s.tripwire.release();
        metrics::gauge!("rcfarm_failsafe_tripped").set(0.0);
        ended
    }

    pub fn status(&self) -> FailsafeStatus {
        let now = self.clock.now();
        let mut s = self.state.lock();
        let trip = s.tripwire.trip().cloned();
        FailsafeStatus {
            max_removals: self.config.max_removals.to_string(),
            removal_limit: self.config.max_removals.limit(s.served),
            served_pods: s.served,
            removals_in_window: s.budget.used(now, self.config.window),
            window: format_go_duration(self.config.window),
            confirm: format_go_duration(self.config.confirm),
            tripped: trip.as_ref().map(|t| t.why.clone()),
            tripped_since: trip.map(|t| t.since_utc),
            held: s.held.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Duration = Duration::from_secs(300);

    #[test]
    fn max_removals_parses_counts_percentages_and_off() {
        assert_eq!("20%".parse(), Ok(MaxRemovals::Percent(20)));
        assert_eq!(" 7 ".parse(), Ok(MaxRemovals::Pods(7)));
        assert_eq!("OFF".parse(), Ok(MaxRemovals::Off));
        for bad in ["0", "0%", "150%", "-1", "x", "5 pods", ""] {
            assert!(bad.parse::<MaxRemovals>().is_err(), "{bad}");
        }
        assert_eq!(MaxRemovals::Percent(20).to_string(), "20%");
        // 20 % of what the farm serves, at least 5; a count is taken as given.
        assert_eq!(MaxRemovals::Percent(20).limit(200), Some(40));
        assert_eq!(MaxRemovals::Percent(20).limit(10), Some(5));
        assert_eq!(MaxRemovals::Percent(20).limit(0), Some(5));
        assert_eq!(MaxRemovals::Pods(2).limit(1000), Some(2));
        assert_eq!(MaxRemovals::Off.limit(1000), None);
    }

    #[test]
    fn the_budget_grants_what_the_window_has_room_for() {
        let t0 = Instant::now();
        let mut b = Budget::default();
        let take = |b: &mut Budget, t, limit, want| b.take(t, W, limit, want).0;
        assert_eq!(take(&mut b, t0, Some(5), 3), 3);
        assert_eq!(take(&mut b, t0 + Duration::from_secs(60), Some(5), 4), 2);
        assert_eq!(take(&mut b, t0 + Duration::from_secs(61), Some(5), 1), 0);
        assert_eq!(b.used(t0 + Duration::from_secs(61), W), 5);
        assert_eq!(
            b.next_room_at(t0 + Duration::from_secs(61), W),
            Some(t0 + W)
        );
        // The first grant leaves the window: its 3 come back, the later 2 still count.
        assert_eq!(take(&mut b, t0 + W, Some(5), 10), 3);
        assert_eq!(b.used(t0 + W, W), 5);
        // The limit can change under it (a percentage of a farm that grew).
        assert_eq!(take(&mut b, t0 + W, Some(8), 10), 3);
        // No limit: anything, still counted.
        assert_eq!(take(&mut b, t0 + W, None, 100), 100);
        assert_eq!(b.used(t0 + W, W), 108);
    }

    #[test]
    fn refunds_go_back_to_their_own_grant_and_releases_empty_the_window() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(200);
        let mut b = Budget::default();
        let (two, early) = b.take(t0, W, Some(5), 2);
        let (three, _) = b.take(t1, W, Some(5), 3);
        assert_eq!((two, three), (2, 3));
        // The early grant made one removal of two: one comes back, from that grant. The later
        // grant keeps its three, which count until t1 + W, not t0 + W.
        b.refund(early, 1);
        assert_eq!(b.used(t1, W), 4);
        assert_eq!(b.used(t0 + W, W), 3, "the early grant's one left with it");
        assert_eq!(b.used(t1 + W, W), 0);
        // A refund of more than is left, or of a grant gone from the window, gives back what
        // there is and no more.
        let mut b = Budget::default();
        let (_, g) = b.take(t0, W, Some(5), 2);
        b.refund(g, 10);
        assert_eq!(b.used(t0, W), 0);
        b.refund(g, 1);
        assert_eq!(b.room(t0, W, Some(5)), 5);
        assert_eq!(b.take(t0, W, Some(5), 5).0, 5);
        b.clear();
        assert_eq!(b.room(t0, W, Some(5)), 5);
    }

    #[test]
    fn a_reservation_returns_what_its_action_did_not_remove() {
        let f = std::sync::Arc::new(Failsafe::new(
            "farm-a",
            FailsafeConfig {
                max_removals: MaxRemovals::Pods(5),
                ..FailsafeConfig::default()
            },
        ));
        // Granted 4; the first chunk of 2 commits, then the action stops: 2 spent, 2 back.
        let (mut r, held) = f.reserve(4);
        assert_eq!((r.left(), held), (4, None));
        r.spend(2);
        drop(r);
        assert_eq!(f.status().removals_in_window, 2);
        // Nothing written: everything back.
        let (r, _) = f.reserve(3);
        assert_eq!(r.left(), 3);
        assert_eq!(f.status().removals_in_window, 5);
        drop(r);
        assert_eq!(f.status().removals_in_window, 2);
        // Asked for more than there is room for: what there is, and why no more.
        let (r, held) = f.reserve(9);
        assert_eq!(r.left(), 3);
        assert!(held.is_some_and(|h| h.contains("--max-removals 5")));
    }

    /// A 200-pod deploy under 20 % per 5 minutes: 40 replacements per window, so 200 take five
    /// windows (about 25 minutes), never blocked for good.
    #[test]
    fn a_big_deploy_proceeds_window_by_window() {
        let t0 = Instant::now();
        let mut b = Budget::default();
        let limit = MaxRemovals::Percent(20).limit(200);
        let (mut left, mut now, mut windows) = (200u64, t0, 0);
        while left > 0 {
            let (got, _) = b.take(now, W, limit, left);
            assert!(got <= 40);
            left -= got;
            if left > 0 {
                now = b.next_room_at(now, W).unwrap();
                windows += 1;
            }
        }
        assert_eq!(
            windows, 4,
            "five windows of 40: done at the start of the fifth"
        );
        assert_eq!(now - t0, W * 4);
    }

    const C: Duration = Duration::from_secs(120);

    /// The tripwire's look at RCs `ids[..replicas.len()]` with these counts.
    fn look(
        w: &mut Tripwire,
        ids: &[RcId],
        t: Instant,
        replicas: &[u64],
        removable: bool,
        confirm: Duration,
    ) -> Option<TripEvent> {
        w.observe(
            t,
            Utc::now(),
            replicas.len(),
            ids.iter().copied().zip(replicas.iter().copied()),
            0,
            removable,
            confirm,
        )
    }

    fn ids() -> Vec<RcId> {
        (0..3).map(|_| RcId::new()).collect()
    }

    #[test]
    fn an_emptied_tree_trips_until_confirmed() {
        let ids = ids();
        let t0 = Instant::now();
        let mut w = Tripwire::default();
        // A farm that starts on an empty tree has nothing to remove: no trip.
        assert_eq!(look(&mut w, &ids, t0, &[], false, C), None);
        assert_eq!(look(&mut w, &ids, t0, &[1, 1, 0], true, C), None);
        assert!(matches!(
            look(&mut w, &ids, t0, &[], false, C),
            Some(TripEvent::Tripped(why)) if why.contains("non-empty to empty")
        ));
        assert!(w.trip().is_some());
        assert_eq!(
            look(&mut w, &ids, t0 + C - Duration::from_secs(1), &[], false, C),
            None
        );
        assert_eq!(
            look(&mut w, &ids, t0 + C, &[], false, C),
            Some(TripEvent::Confirmed)
        );
        // Acted on: the same state does not trip again.
        assert_eq!(look(&mut w, &ids, t0 + C * 2, &[], false, C), None);
        assert!(w.trip().is_none());
        // The last RC deleted is an operator's act.
        let mut one = Tripwire::default();
        look(&mut one, &ids, t0, &[1], true, C);
        assert_eq!(look(&mut one, &ids, t0, &[], false, C), None);
    }

    #[test]
    fn all_zero_trips_and_clears_when_the_tree_changes_back() {
        let ids = ids();
        let t0 = Instant::now();
        let mut w = Tripwire::default();
        assert_eq!(look(&mut w, &ids, t0, &[1, 1, 0], true, C), None);
        assert!(matches!(
            look(&mut w, &ids, t0, &[0, 0, 0], true, C),
            Some(TripEvent::Tripped(_))
        ));
        assert!(matches!(
            look(&mut w, &ids, t0, &[1, 0, 0], true, C),
            Some(TripEvent::Cleared(_))
        ));
        // Zeroed again: a bulk change, even where this farm sees no pod of these RCs (another
        // farm may run them, or this one has not read them yet).
        assert!(matches!(
            look(&mut w, &ids, t0, &[0, 0, 0], false, C),
            Some(TripEvent::Tripped(_))
        ));
        // Off: never trips.
        let mut off = Tripwire::default();
        look(&mut off, &ids, t0, &[1, 1, 0], true, Duration::ZERO);
        assert_eq!(
            look(&mut off, &ids, t0, &[0, 0, 0], true, Duration::ZERO),
            None
        );
    }

    #[test]
    fn only_bulk_changes_trip() {
        let ids = ids();
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        // A script zeroing RCs one by one, within the window: a bulk edit.
        let mut w = Tripwire::default();
        look(&mut w, &ids, t0, &[1, 1, 1], true, C);
        look(&mut w, &ids, t0 + s, &[1, 1, 0], true, C);
        look(&mut w, &ids, t0 + s * 2, &[1, 0, 0], true, C);
        assert!(matches!(
            look(&mut w, &ids, t0 + s * 3, &[0, 0, 0], true, C),
            Some(TripEvent::Tripped(_))
        ));
        // The same, days apart: each an operator's act.
        let mut w = Tripwire::default();
        look(&mut w, &ids, t0, &[1, 1, 0], true, C);
        look(&mut w, &ids, t0 + C * 10, &[1, 0, 0], true, C);
        assert_eq!(look(&mut w, &ids, t0 + C * 20, &[0, 0, 0], true, C), None);
        // A tree that served for days, zeroed at once.
        let mut w = Tripwire::default();
        look(&mut w, &ids, t0, &[1, 1, 1], true, C);
        assert!(matches!(
            look(&mut w, &ids, t0 + C * 30, &[0, 0, 0], true, C),
            Some(TripEvent::Tripped(_))
        ));
        // One RC, scaled to 0.
        let mut w = Tripwire::default();
        look(&mut w, &ids, t0, &[1], true, C);
        assert_eq!(look(&mut w, &ids, t0, &[0], true, C), None);
    }

    #[test]
    fn a_farm_started_on_an_all_zero_tree_with_pods_waits() {
        let ids = ids();
        let t0 = Instant::now();
        let mut w = Tripwire::default();
        assert!(matches!(
            look(&mut w, &ids, t0, &[0, 0], true, C),
            Some(TripEvent::Tripped(why)) if why.contains("takes up")
        ));
        assert!(w.release());
        assert!(!w.release());
        assert_eq!(look(&mut w, &ids, t0, &[0, 0], true, C), None);
        // Started on an all-zero tree with no pod, or of one RC: nothing to hold.
        let mut quiet = Tripwire::default();
        assert_eq!(look(&mut quiet, &ids, t0, &[0, 0], false, C), None);
        let mut one = Tripwire::default();
        assert_eq!(look(&mut one, &ids, t0, &[0], true, C), None);
    }

    /// Issue 38: the all-to-zero check looks at the farm's own share of a bigger tree. A farm
    /// that serves nothing yet is at its first look when it takes RCs up (a farm starts
    /// before it claims); a share that goes to 0 trips whatever the rest of the tree does.
    #[test]
    fn the_all_to_zero_check_looks_at_the_farms_share() {
        let ids = ids();
        let t0 = Instant::now();
        let share = |w: &mut Tripwire, keys: usize, replicas: &[u64]| {
            w.observe(
                t0,
                Utc::now(),
                keys,
                ids.iter().copied().zip(replicas.iter().copied()),
                0,
                true,
                C,
            )
        };
        // Started, serving nothing of a tree of 10 keys: no shape to trip on.
        let mut w = Tripwire::default();
        assert_eq!(share(&mut w, 10, &[]), None);
        // Then takes up two RCs at 0 whose pods run: held as a start into a bulk edit.
        assert!(matches!(
            share(&mut w, 10, &[0, 0]),
            Some(TripEvent::Tripped(why)) if why.contains("takes up")
        ));
        // A share that served, set to 0 in a tree of 10 keys.
        let mut w = Tripwire::default();
        assert_eq!(share(&mut w, 10, &[2, 3, 1]), None);
        assert!(matches!(
            share(&mut w, 10, &[0, 0, 0]),
            Some(TripEvent::Tripped(why)) if why.contains("every RC this farm serves")
        ));
        // The tree emptied while this farm served none of it: tripped on the keys.
        let mut w = Tripwire::default();
        assert_eq!(share(&mut w, 10, &[]), None);
        assert!(matches!(
            share(&mut w, 0, &[]),
            Some(TripEvent::Tripped(why)) if why.contains("non-empty to empty")
        ));
    }

    #[test]
    fn tree_shapes() {
        assert_eq!(Tree::of([], 0).shape(), TreeShape::Empty);
        assert_eq!(Tree::of([0, 0], 0).shape(), TreeShape::AllZero);
        assert_eq!(
            Tree::of([0, 3], 0),
            Tree {
                keys: 2,
                rcs: 2,
                serving: 1
            }
        );
        // A farm that serves none of a tree's RCs has no share to go to 0.
        assert_eq!(Tree::of([], 0).keys(5).shape(), TreeShape::Serving);
        assert_eq!(Tree::of([0], 0).keys(5).shape(), TreeShape::AllZero);
        // An unreadable record is never taken for 0.
        assert_eq!(Tree::of([0], 1).shape(), TreeShape::Serving);
        assert_eq!(Tree::of([], 1).shape(), TreeShape::Serving);
    }

    /// The farm's failsafe on a paused clock: its window and confirmation are timers, driven
    /// here by `tokio::time::advance` instead of waited for.
    #[tokio::test(start_paused = true)]
    async fn on_a_paused_clock_the_window_slides_and_a_trip_is_confirmed() {
        let start: DateTime<Utc> = "2026-01-01T00:00:00Z".parse().unwrap();
        let f = Failsafe::new(
            "farm-a",
            FailsafeConfig {
                max_removals: MaxRemovals::Pods(2),
                window: Duration::from_secs(300),
                confirm: Duration::from_secs(120),
            },
        )
        .with_clock(crate::clock::Clock::paused_at(start));
        assert_eq!(f.take(3).granted, 2);
        tokio::time::advance(Duration::from_secs(299)).await;
        assert_eq!(f.take(1).granted, 0, "still within the window");
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(
            f.take(3).granted,
            2,
            "the window slid past the first grants"
        );

        let ids = ids();
        assert!(
            f.observe_tree(ids.len(), ids.iter().map(|id| (*id, 3)), 0, true)
                .is_none()
        );
        assert!(f.observe_tree(0, [], 0, true).is_some(), "emptied: tripped");
        let tripped = f.status();
        assert_eq!(
            tripped.tripped_since,
            Some(start + chrono::Duration::seconds(301)),
            "stamped from the clock"
        );
        tokio::time::advance(Duration::from_secs(119)).await;
        f.observe_tree(0, [], 0, true);
        assert!(f.status().tripped.is_some(), "not confirmed before 120 s");
        tokio::time::advance(Duration::from_secs(1)).await;
        f.observe_tree(0, [], 0, true);
        assert!(f.status().tripped.is_none(), "confirmed after 120 s");
    }

    #[test]
    fn a_percentage_counts_the_most_pods_served_within_the_window() {
        let f = Failsafe::new("farm-a", FailsafeConfig::default());
        f.set_served(200);
        assert_eq!(f.status().removal_limit, Some(40));
        // Scaling down must not shrink its own limit as it goes.
        f.set_served(120);
        assert_eq!(f.status().removal_limit, Some(40));
        assert_eq!(f.take(50).granted, 40);
        f.set_served(300);
        assert_eq!(f.status().removal_limit, Some(60));
        assert_eq!(f.take(50).granted, 20);
        let s = f.status();
        assert_eq!((s.removals_in_window, s.window.as_str()), (60, "5m0s"));
    }

    #[test]
    fn the_shared_failsafe_holds_while_tripped_and_reports() {
        let f = Failsafe::new(
            "farm-a",
            FailsafeConfig {
                max_removals: MaxRemovals::Pods(2),
                ..FailsafeConfig::default()
            },
        );
        let g = f.take(3);
        assert_eq!(g.granted, 2);
        assert!(
            g.held
                .as_deref()
                .is_some_and(|h| h.contains("rcctl farm release-removals farm-a")),
            "{g:?}"
        );
        assert_eq!(f.room().0, 0);
        assert!(!f.release());
        assert_eq!(f.room().0, 2);
        let (a, b) = (RcId::new(), RcId::new());
        f.observe_tree(2, [(a, 1), (b, 1)], 0, true);
        assert!(matches!(
            f.observe_tree(2, [(a, 0), (b, 0)], 0, true),
            Some(TripEvent::Tripped(_))
        ));
        let g = f.take(1);
        assert_eq!(g.granted, 0);
        assert!(g.held.unwrap().starts_with(TRIPPED));
        assert!(f.status().tripped.is_some());
        assert!(f.set_held("rc:x", true));
        assert!(!f.set_held("rc:x", true));
        assert_eq!(f.status().held, 1);
        assert!(f.release());
        assert_eq!(f.take(1).granted, 1);
    }
}

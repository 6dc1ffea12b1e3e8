//! Failsafes (P2 refused to act on an empty RC tree or on all-zero replicas; rcfarm keeps that
//! guard without P2's panic, and adds a blast-radius limit):
//!
//! - a **removal budget** for the whole cluster: at most `--max-removals` pods removed
//!   (unscheduled or replaced) per `--max-removals-window` by all the farms together, across RC
//!   tasks, roll steps and node transfers. It is one Consul key ([`crate::budget`]) that each
//!   removal charges in its own transaction ([`Failsafe::commit_charged`]); a planner caps an
//!   action to the room it last read ([`Failsafe::room`]) and otherwise reports
//!   `RemovalsHeld`. Adding pods never counts.
//! - a **tripwire** on the RC tree: when the listing goes from non-empty to empty, or every RC
//!   to 0 replicas, no removal is granted until that state has held for `--failsafe-confirm`.
//! - an operator's **release** (`rcctl farm release-removals`), a key under
//!   `rcfarm/failsafe/release/<farm-id>` the farm watches: a new one empties the window and ends
//!   a pending confirmation, once.
//!
//! Below the RC and roll tasks (which charge), above the RC model and the Consul client: the
//! window and the tripwire are pure (time is an input) and unit-tested; [`Failsafe`] shares
//! them in a farm.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::budget::{BUDGET_KEY, Count, Settings, Window};
pub use crate::budget::{MIN_REMOVALS, MaxRemovals};
use crate::clock::Clock;
use crate::consul::{
    Consul, ConsulError, Fence, FenceError, FencedTxn, KvPair, QueryOptions, TxnOp,
};
use crate::rc::RcId;
use crate::util::format_go_duration;

/// Where operators' releases live (P2 never reads it).
pub const FAILSAFE_PREFIX: &str = "rcfarm/failsafe/";

/// How a hold by the tripwire begins (a hold by the window does not).
pub const TRIPPED: &str = "failsafe tripped";

/// `rcfarm/failsafe/release/<farm-id>`: the last release of one farm's removals.
/// Why removals wait while the tripwire's first look at a share waits for its pods.
pub const FIRST_LOOK: &str = "removals held: this farm took up RCs that are all at 0 replicas; they wait for a read of those RCs' pods, whose result decides whether the failsafe trips (a bulk edit)";

pub fn release_key(farm_id: &str) -> String {
    format!("{FAILSAFE_PREFIX}release/{farm_id}")
}

/// The op that empties the cluster's removal window (an operator's release: `rcctl farm
/// release-removals`), a `cas` on the version read now, and how many removals the window held.
/// A record that cannot be read is released all the same: the release writes it anew (what a
/// farm's error says to do). The caller commits it, with what else it writes, and reads again
/// if the `cas` loses to a farm's charge.
pub async fn release_window_op(consul: &Consul, by: &str) -> Result<(TxnOp, u64), ConsulError> {
    let opts = QueryOptions {
        consistent: true,
        ..QueryOptions::default()
    };
    let (kv, _) = consul.kv_get(BUDGET_KEY, &opts).await?;
    let (window, index) = match kv {
        Some(kv) => (
            Window::parse(kv.value_bytes()).unwrap_or_default(),
            kv.modify_index,
        ),
        None => (Window::default(), 0),
    };
    let now = Utc::now().timestamp();
    let held = window.held(now);
    let released = window.release(by, now);
    Ok((TxnOp::cas(BUDGET_KEY, released.to_bytes(), index), held))
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

/// The failsafe as a farm reports it (`/v1/farms`, the status page). The removal figures are
/// the cluster's window ([`crate::budget`]), the same for every farm that has read the key.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct FailsafeStatus {
    /// `--max-removals` as given (`20%`, `50`, `off`): the whole cluster's limit.
    pub max_removals: String,
    /// What it comes to now (`None`: no limit).
    pub removal_limit: Option<u64>,
    /// Pods this farm serves (its share of the base of a percentage).
    pub served_pods: u64,
    /// The base of a percentage: the most pods the farms served within the window, by their
    /// own counts in the window key.
    pub cluster_pods: u64,
    /// Removals charged to the cluster's window within it, by every farm.
    pub removals_in_window: u64,
    /// When room comes back (the oldest removal still counted leaves the window).
    pub room_at: Option<DateTime<Utc>>,
    /// The window key's index this was read from (0: not read yet).
    pub window_index: u64,
    /// Why the window key cannot be used, if it cannot (removals wait until it can).
    pub window_problem: Option<String>,
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
    /// The pods this farm serves now (what it reports into the window key).
    served: u64,
    /// The farms the registry holds, as this farm last saw it: farm id → the session its
    /// registration holds (`None`: not seen yet). A farm's count of the pods it serves is kept
    /// in the window key only while it is live under the session it wrote it with.
    live: Option<BTreeMap<String, String>>,
    /// The registry's index `live` was read at: an older read never replaces it.
    live_index: u64,
    /// The session this farm serves under now: written with its count.
    session: Option<String>,
    tripwire: Tripwire,
    /// RCs and rolls held now (`rc:<id>`, `roll:<id>`).
    held: BTreeSet<String>,
    /// Set while the tripwire's first look at a share just taken up waits for a read of its
    /// pods (the ticket of that read): every removal waits with it.
    first_look: Option<u64>,
}

/// The cluster's window key as this farm last read or wrote it.
#[derive(Debug, Clone, Default)]
enum Cached {
    /// Not read yet: planning takes it as empty, a charge reads it first.
    #[default]
    Unread,
    /// Its value (or why it cannot be read) at its `ModifyIndex` (0: the key does not exist).
    At(Result<Window, String>, u64),
}

impl Cached {
    fn index(&self) -> Option<u64> {
        match self {
            Cached::Unread => None,
            Cached::At(_, i) => Some(*i),
        }
    }
}

/// Why a charged commit did not commit.
#[derive(Debug, thiserror::Error)]
pub enum ChargeError {
    /// The cluster's window has no room for the charge now (or the tripwire holds removals):
    /// nothing was written; plan again.
    #[error("{0}")]
    Held(String),
    /// The transaction's own failure (its charge included nothing: nothing was applied), or
    /// a lost answer (it may have been applied, and charged with it).
    #[error(transparent)]
    Fence(#[from] FenceError),
    /// The window key could not be read after another farm charged it first.
    #[error("cannot read the removal window: {0}")]
    Read(#[from] ConsulError),
}

/// What became of a farm's count in a report ([`Failsafe::report_before_release`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reported {
    /// Written into the window key.
    Written,
    /// Nothing to write: the key already holds no more than this count, the limit is not a
    /// percentage, or the key cannot be read (it is written anew, without counts, before
    /// removals go on).
    Unneeded,
    /// Not written now: a charge in flight kept the farm's turn, or other farms wrote first at
    /// every try.
    Later,
}

/// How often a charge that loses its `cas` to another farm reads the key and tries again
/// before its caller plans again.
const CHARGE_TRIES: usize = 5;

/// A farm's failsafe, shared by its RC tasks, roll tasks and the farm loop.
#[derive(Debug)]
pub struct Failsafe {
    farm_id: String,
    config: FailsafeConfig,
    state: Mutex<State>,
    clock: Clock,
    cluster: Mutex<Cached>,
    /// The window's time: Consul's clock (the `Date` of the last read of the key, else this
    /// farm's wall clock at its start) carried forward by this farm's monotonic clock. Every
    /// farm's buckets are then stamped alike, and a farm whose wall clock is stepped (an hour
    /// forward or back) neither sees the window emptied nor stamps charges that leave it
    /// early: (unix seconds, the monotonic instant they were read at).
    anchor: Mutex<(i64, Instant)>,
    /// This farm's charges go one at a time: each builds its `cas` on the result of the one
    /// before, so the farm's own tasks never make each other's charge fail.
    turn: tokio::sync::Mutex<()>,
}

impl Failsafe {
    pub fn new(farm_id: impl Into<String>, config: FailsafeConfig) -> Failsafe {
        Failsafe {
            farm_id: farm_id.into(),
            config,
            state: Mutex::default(),
            clock: Clock::system(),
            cluster: Mutex::default(),
            anchor: Mutex::new((Utc::now().timestamp(), Instant::now())),
            turn: tokio::sync::Mutex::new(()),
        }
    }

    pub fn with_clock(mut self, clock: Clock) -> Failsafe {
        self.anchor = Mutex::new((clock.wall().timestamp(), clock.now()));
        self.clock = clock;
        self
    }

    pub fn config(&self) -> FailsafeConfig {
        self.config
    }

    fn settings(&self) -> Settings {
        Settings {
            max_removals: self.config.max_removals,
            window: self.config.window,
        }
    }

    /// The window's time in unix seconds (see `anchor`).
    fn now_s(&self) -> i64 {
        let (at, then) = *self.anchor.lock();
        at + self.clock.now().saturating_duration_since(then).as_secs() as i64
    }

    /// The pods the farm serves now: its share of the base of a percentage limit, written
    /// into the window key with its next charge or report ([`Failsafe::report_served`]).
    pub fn set_served(&self, pods: u64) {
        self.state.lock().served = pods;
    }

    /// The farms the registry holds now: farm id → the session its registration holds. Every
    /// write of the window key drops the counts of the others, and those written under a
    /// session that ended ([`Window::without_stale`]): a farm whose session ended serves
    /// nothing, and the farms that take its RCs over count them once they hold their locks,
    /// which is after its session ended. Kept, its count would add those pods twice to the
    /// base of a percentage, and the peak would keep them for the whole window.
    ///
    /// `index` is the registry's index as read (`rcfarm/farms/`): a read older than the one
    /// kept changes nothing, so the farm loop's watch cannot take back what a fresh read before
    /// a growing count ([`Failsafe::served`]) taught.
    pub fn set_live_farms(&self, live: BTreeMap<String, String>, index: u64) {
        let mut s = self.state.lock();
        // `live_index` starts at 0, so the first read is always taken.
        if index >= s.live_index {
            s.live = Some(live);
            s.live_index = index;
        }
    }

    /// Whether the pods a farm serves are the base of its limit (a percentage
    /// `--max-removals`): otherwise the count written into the window key is for operators
    /// only.
    pub fn counts_served(&self) -> bool {
        matches!(self.config.max_removals, MaxRemovals::Percent(_))
    }

    /// Whether a count grown to `pods` is due to be written into the window key
    /// ([`Window::report_due`], against the key as last read). One that is not stays out of
    /// [`Failsafe::served`] until it is: the count in the key is then low by at most what a
    /// report lets it lag anyway, and the farm reads the registry for its growth a few times
    /// as it converges, not on every turn of its loop.
    pub fn growth_due(&self, pods: u64) -> bool {
        // Only this farm's own count is looked at, which pruning never drops.
        self.window()
            .is_ok_and(|w| w.report_due(self.settings(), self.now_s(), &self.farm_id, pods))
    }

    /// The pods this farm serves, as it last set them: what its next write of the window key
    /// reports. The farm raises it only after a read of the registry sent once the claims
    /// that grew it had committed: the farms whose sessions ended before those claims (so
    /// that they could be made) are then known gone, and their counts are dropped by the
    /// write that adds the same pods to this farm's.
    pub fn served(&self) -> u64 {
        self.state.lock().served
    }

    /// The session this farm serves under from now on (written with its count).
    pub fn set_session(&self, session: &str) {
        self.state.lock().session = Some(session.to_string());
    }

    /// `w` as this farm writes it: without the counts of farms it does not see live under the
    /// session they wrote them with.
    fn pruned(&self, w: Window, s: &State) -> Window {
        match &s.live {
            Some(live) => w.without_stale(&self.farm_id, live),
            None => w,
        }
    }

    /// This farm's count as it writes it now.
    fn count<'a>(&'a self, s: &'a State) -> Count<'a> {
        Count {
            farm: &self.farm_id,
            session: s.session.as_deref(),
            pods: s.served,
        }
    }

    /// A read of the window key (a watch's answer, or a read after a lost `cas`): kept unless
    /// this farm knows a newer version (its own charge committed after the read began).
    pub fn observe_window(&self, kv: Option<&KvPair>) {
        let (value, index) = match kv {
            Some(kv) => (Window::parse(kv.value_bytes()), kv.modify_index),
            None => (Ok(Window::default()), 0),
        };
        let mut c = self.cluster.lock();
        // The farm loop passes the watch's last answer on each look: a version already known
        // changes nothing (and is not logged again).
        if c.index() == Some(index) {
            return;
        }
        // A key deleted (index 0) after a version we know is news too: the operator wiped it.
        if c.index().is_none_or(|i| index > i || index == 0) {
            if let Err(e) = &value {
                tracing::error!(key = BUDGET_KEY, error = %e, "the cluster's removal window cannot be read: removals wait until `rcctl farm release-removals` writes it anew");
            }
            *c = Cached::At(value, index);
        }
        drop(c);
        self.publish_metrics();
    }

    /// The window as cached: its value (empty if unread) or why it cannot be used.
    fn window(&self) -> Result<Window, String> {
        match &*self.cluster.lock() {
            Cached::Unread => Ok(Window::default()),
            Cached::At(w, _) => w.clone(),
        }
    }

    fn held_reason(&self, s: &State) -> String {
        if let Some(t) = s.tripwire.trip() {
            return format!("{TRIPPED}: {}", t.why);
        }
        if s.first_look.is_some() {
            return FIRST_LOOK.to_string();
        }
        let w = match self.window() {
            Ok(w) => w,
            Err(e) => {
                return format!(
                    "removals held: the cluster's removal window ({BUDGET_KEY}) cannot be read ({e}); run `rcctl farm release-removals` to write it anew"
                );
            }
        };
        let (st, now) = (self.settings(), self.now_s());
        let when = w
            .room_at(st, now)
            .map(|t| {
                format!(
                    "room again in {}",
                    format_go_duration(Duration::from_secs((t - now).max(1) as u64))
                )
            })
            .unwrap_or_default();
        format!(
            "removals held: the farms removed {} pods in the last {} (--max-removals {} for the whole cluster: {} now); {when}, or run `rcctl farm release-removals`",
            w.spent(st, now),
            format_go_duration(self.config.window),
            self.config.max_removals,
            w.limit(st, now)
                .map_or("no limit".to_string(), |l| l.to_string()),
        )
    }

    /// How many removals the cluster's window has room for now, as this farm last read it,
    /// and why not more if none (a planner's cap; the charge decides).
    pub fn room(&self) -> (u64, Option<String>) {
        let s = self.state.lock();
        if s.tripwire.trip().is_some() || s.first_look.is_some() {
            return (0, Some(self.held_reason(&s)));
        }
        let room = match self.window() {
            Ok(w) => w.room(self.settings(), self.now_s()),
            Err(_) => 0,
        };
        let why = (room == 0).then(|| self.held_reason(&s));
        (room, why)
    }

    /// Commits `txn` charged `n` removals in the cluster's window, in the same transaction:
    /// it commits if and only if the charge does. `send` commits a transaction and returns
    /// what it returns with the commit index. Nothing is charged ahead, so nothing is given
    /// back: a transaction refused, cancelled before it was sent, or sent with its answer lost
    /// charged exactly what it applied. A charge that loses its `cas` to another farm reads
    /// the key and tries again while there is room; without room: [`ChargeError::Held`].
    pub async fn commit_charged<T, F, Fut>(
        &self,
        consul: &Consul,
        n: u64,
        txn: FencedTxn,
        send: F,
    ) -> Result<T, ChargeError>
    where
        F: Fn(FencedTxn) -> Fut,
        Fut: Future<Output = Result<(T, u64), FenceError>>,
    {
        if n == 0 || self.config.max_removals == MaxRemovals::Off {
            return Ok(send(txn).await?.0);
        }
        let _turn = self.turn.lock().await;
        for _ in 0..CHARGE_TRIES {
            if matches!(*self.cluster.lock(), Cached::Unread) {
                self.read_window(consul).await?;
            }
            let (next, index) = {
                let s = self.state.lock();
                if s.tripwire.trip().is_some() || s.first_look.is_some() {
                    return Err(ChargeError::Held(self.held_reason(&s)));
                }
                let c = self.cluster.lock().clone();
                let Cached::At(Ok(w), index) = c else {
                    return Err(ChargeError::Held(self.held_reason(&s)));
                };
                let farm = Some(self.count(&s));
                let w = self.pruned(w, &s);
                match w.charge(self.settings(), self.now_s(), n, farm) {
                    Ok(next) => (next, index),
                    Err(_) => return Err(ChargeError::Held(self.held_reason(&s))),
                }
            };
            let charged = txn
                .clone()
                .charge(TxnOp::cas(BUDGET_KEY, next.to_bytes(), index));
            match send(charged).await {
                Ok((out, at)) => {
                    metrics::counter!("rcfarm_removals_charged_total").increment(n);
                    self.wrote(next, at);
                    return Ok(out);
                }
                Err(FenceError::Uncharged { .. }) => {
                    metrics::counter!("rcfarm_removal_charge_conflicts_total").increment(1);
                    self.read_window(consul).await?;
                }
                Err(e) => {
                    if matches!(e, FenceError::Consul(_)) {
                        // Applied or not (an answer lost or unreadable): read what is there.
                        // Correctness does not rest on this read: a charge built on a version
                        // the lost commit moved fails its `cas` and reads then.
                        self.read_window(consul).await.ok();
                    }
                    return Err(e.into());
                }
            }
        }
        Err(ChargeError::Held(format!(
            "removals held: the cluster's removal window ({BUDGET_KEY}) kept changing under {CHARGE_TRIES} charges in a row; planning again"
        )))
    }

    /// Writes this farm's count of the pods it serves into the window key when it is due
    /// (see [`Window::report_due`]), fenced by `fence` (the farm's registration): the base of
    /// a percentage is what the farms report. `Ok(false)`: nothing was written.
    pub async fn report_served(&self, consul: &Consul, fence: Fence) -> Result<bool, ChargeError> {
        if !matches!(self.config.max_removals, MaxRemovals::Percent(_)) {
            return Ok(false);
        }
        // The farm loop calls this: it never waits for a charge in flight (which reports the
        // farm's count with it).
        let Ok(_turn) = self.turn.try_lock() else {
            return Ok(false);
        };
        // One try: when another farm wrote first, the next look reports on the newer version.
        let r = self
            .write_report(consul, &fence, 1, |w, st, now, me, pods| {
                w.report_due(st, now, me, pods)
            })
            .await?;
        Ok(r == Reported::Written)
    }

    /// Before the farm gives RCs back (handed over, or at shutdown): writes its count without
    /// them (`pods`) into the window key, whatever its size. The farm that takes them over
    /// counts them once it holds their locks, which is after this write; written after the
    /// release, or only when due, the key could hold both counts at once, and the peak would
    /// keep that sum (a higher limit) for the whole window.
    ///
    /// Invariant for the caller: RCs are released only after an answer other than
    /// [`Reported::Later`] (or an error the caller chooses to ride over at shutdown). `Later`
    /// means the count could not be written now (a charge in flight kept the farm's turn for
    /// `wait`, or other farms wrote first at every try): keep the RCs and try again.
    pub async fn report_before_release(
        &self,
        consul: &Consul,
        fence: Fence,
        pods: u64,
        wait: Duration,
    ) -> Result<Reported, ChargeError> {
        self.set_served(pods);
        if !matches!(self.config.max_removals, MaxRemovals::Percent(_)) {
            return Ok(Reported::Unneeded);
        }
        let Ok(_turn) = tokio::time::timeout(wait, self.turn.lock()).await else {
            return Ok(Reported::Later);
        };
        self.write_report(consul, &fence, CHARGE_TRIES, |w, _, _, me, pods| {
            w.farms.get(me).is_some_and(|f| f.pods > pods)
        })
        .await
    }

    /// Writes this farm's count into the window key if `due` says so, with a `cas`, trying
    /// `tries` times when another farm wrote first. The caller holds `turn`.
    async fn write_report(
        &self,
        consul: &Consul,
        fence: &Fence,
        tries: usize,
        due: impl Fn(&Window, Settings, i64, &str, u64) -> bool,
    ) -> Result<Reported, ChargeError> {
        for _ in 0..tries {
            if matches!(*self.cluster.lock(), Cached::Unread) {
                self.read_window(consul).await?;
            }
            let st = self.settings();
            let now = self.now_s();
            let (next, index) = {
                let s = self.state.lock();
                // A key that cannot be read holds every removal until an operator writes it
                // anew (`rcctl farm release-removals`), with no farm's count in it.
                let Cached::At(Ok(w), index) = self.cluster.lock().clone() else {
                    return Ok(Reported::Unneeded);
                };
                let w = self.pruned(w, &s);
                if !due(&w, st, now, &self.farm_id, s.served) {
                    return Ok(Reported::Unneeded);
                }
                (w.report(st, now, self.count(&s)), index)
            };
            let txn = FencedTxn::fenced(fence.clone()).charge(TxnOp::cas(
                BUDGET_KEY,
                next.to_bytes(),
                index,
            ));
            match txn.commit(consul).await {
                Ok(at) => {
                    self.wrote(next, at);
                    return Ok(Reported::Written);
                }
                Err(FenceError::Uncharged { .. }) => self.read_window(consul).await?,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(Reported::Later)
    }

    /// Our own write of the window committed at `index`.
    fn wrote(&self, w: Window, index: u64) {
        let mut c = self.cluster.lock();
        if c.index().is_none_or(|i| index > i) {
            *c = Cached::At(Ok(w), index);
        }
        drop(c);
        self.publish_metrics();
    }

    /// Reads the window key from the leader (a `cas` lost means our version is behind).
    async fn read_window(&self, consul: &Consul) -> Result<(), ConsulError> {
        let opts = QueryOptions {
            consistent: true,
            ..QueryOptions::default()
        };
        let (kv, meta) = consul.kv_get(BUDGET_KEY, &opts).await?;
        if let Some(date) = meta.date {
            *self.anchor.lock() = (date, self.clock.now());
        }
        self.observe_window(kv.as_ref());
        Ok(())
    }

    fn publish_metrics(&self) {
        let (st, now) = (self.settings(), self.now_s());
        if let Ok(w) = self.window() {
            metrics::gauge!("rcfarm_cluster_removals_in_window").set(w.spent(st, now) as f64);
            metrics::gauge!("rcfarm_cluster_removal_limit")
                .set(w.limit(st, now).map_or(-1.0, |l| l as f64));
            metrics::gauge!("rcfarm_cluster_removals_room_seconds")
                .set(w.room_at(st, now).map_or(0, |t| (t - now).max(0)) as f64);
        }
    }

    /// Why every removal is held now, if the tripwire holds them: replacements that lose no
    /// capacity (a roll's steps, a node transfer's end) are not counted by the budget, but wait
    /// for a tripped failsafe like every removal.
    pub fn tripped(&self) -> Option<String> {
        let s = self.state.lock();
        if s.tripwire.trip().is_none() && s.first_look.is_none() {
            return None;
        }
        Some(self.held_reason(&s))
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

    /// An operator's release of this farm (its release key): a pending confirmation ends.
    /// The cluster's window is released in its own key (`rcctl farm release-removals` empties
    /// it there). `true`: a confirmation was pending.
    pub fn release(&self) -> bool {
        let mut s = self.state.lock();
        let ended = s.tripwire.release();
        metrics::gauge!("rcfarm_failsafe_tripped").set(0.0);
        ended
    }

    pub fn status(&self) -> FailsafeStatus {
        let (st, now) = (self.settings(), self.now_s());
        let s = self.state.lock();
        let trip = s.tripwire.trip().cloned();
        let cached = self.cluster.lock().clone();
        let (w, problem) = match &cached {
            Cached::At(Err(e), _) => (Window::default(), Some(e.clone())),
            Cached::At(Ok(w), _) => (w.clone(), None),
            Cached::Unread => (Window::default(), None),
        };
        FailsafeStatus {
            max_removals: self.config.max_removals.to_string(),
            removal_limit: w.limit(st, now),
            served_pods: s.served,
            cluster_pods: w.base(st, now),
            removals_in_window: w.spent(st, now),
            room_at: w
                .room_at(st, now)
                .and_then(|t| DateTime::<Utc>::from_timestamp(t, 0)),
            window_index: cached.index().unwrap_or(0),
            window_problem: problem,
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

    fn farm_a(pods: u64) -> Count<'static> {
        Count {
            farm: "farm-a",
            session: None,
            pods,
        }
    }

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
    fn a_big_scale_down_proceeds_window_by_window() {
        let st = Settings {
            max_removals: MaxRemovals::Percent(20),
            window: W,
        };
        let t0 = 1_000_000;
        // The farms serve 1,000 pods: 200 per window.
        let mut w = Window::default().report(st, t0, farm_a(1000));
        let (mut left, mut now, mut windows) = (500u64, t0, 0);
        while left > 0 {
            // The farm writes its count again at least every half window.
            w = w.report(st, now, farm_a(1000));
            let got = w.room(st, now).min(left);
            assert!(got <= 200, "{got}");
            w = w.charge(st, now, got, Some(farm_a(1000))).unwrap();
            left -= got;
            if left > 0 {
                now = w.room_at(st, now).unwrap();
                windows += 1;
            }
        }
        assert_eq!(windows, 2, "200, 200, then 100");
        // Each window is 300 s and at most one bucket (10 s) more.
        assert!(now - t0 >= 600 && now - t0 <= 620, "{}", now - t0);
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

    /// The farm's failsafe on a paused clock: its confirmation is a timer, driven here by
    /// `tokio::time::advance` instead of waited for.
    #[tokio::test(start_paused = true)]
    async fn on_a_paused_clock_a_trip_is_confirmed() {
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
        tokio::time::advance(Duration::from_secs(301)).await;
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

    type Sent = std::pin::Pin<Box<dyn Future<Output = Result<((), u64), FenceError>> + Send>>;

    /// Sends a transaction as the farm's writes do (alone, not coalesced).
    fn sender(consul: &Consul) -> impl Fn(FencedTxn) -> Sent {
        let consul = consul.clone();
        move |t: FencedTxn| {
            let consul = consul.clone();
            Box::pin(async move { t.commit(&consul).await.map(|i| ((), i)) })
        }
    }

    #[tokio::test]
    async fn removals_charge_the_clusters_window_in_their_own_transaction() {
        let (server, consul, ours, _theirs) = crate::testing::two_sessions().await;
        consul
            .txn(&[TxnOp::lock("t/lock", b"o".to_vec(), ours.id())])
            .await
            .unwrap();
        let cfg = FailsafeConfig {
            max_removals: MaxRemovals::Pods(3),
            ..FailsafeConfig::default()
        };
        // Two farms: each its own failsafe, one key.
        let (a, b) = (Failsafe::new("farm-a", cfg), Failsafe::new("farm-b", cfg));
        let send = sender(&consul);
        let txn = |k: &str| {
            FencedTxn::fenced(Fence::new("t/lock", ours.id())).op(TxnOp::set(k, b"x".to_vec()))
        };
        a.commit_charged(&consul, 2, txn("t/a"), &send)
            .await
            .unwrap();
        // b has not read the key: it reads it before it charges, and finds 1 left.
        let held = b.commit_charged(&consul, 2, txn("t/b"), &send).await;
        assert!(
            matches!(held, Err(ChargeError::Held(ref w)) if w.contains("removed 2 pods")),
            "{held:?}"
        );
        assert!(
            consul
                .kv_get("t/b", &QueryOptions::default())
                .await
                .unwrap()
                .0
                .is_none(),
            "held: nothing written"
        );
        b.commit_charged(&consul, 1, txn("t/b"), &send)
            .await
            .unwrap();
        // a's copy is behind now: its cas loses, it reads the key again, and is held.
        assert_eq!(a.room().0, 1, "a's last read");
        let held = a.commit_charged(&consul, 1, txn("t/c"), &send).await;
        assert!(matches!(held, Err(ChargeError::Held(_))), "{held:?}");
        assert_eq!(a.room().0, 0);
        // A refused transaction charges nothing: its charge was in it.
        let fenced = FencedTxn::fenced(Fence::new("t/lock", _theirs.id()))
            .op(TxnOp::set("t/d", b"x".to_vec()));
        let c = Failsafe::new(
            "farm-c",
            FailsafeConfig {
                max_removals: MaxRemovals::Pods(10),
                ..cfg
            },
        );
        let r = c.commit_charged(&consul, 2, fenced, &send).await;
        assert!(
            matches!(r, Err(ChargeError::Fence(FenceError::Fenced { .. }))),
            "{r:?}"
        );
        let (kv, _) = consul
            .kv_get(BUDGET_KEY, &QueryOptions::default())
            .await
            .unwrap();
        let w = Window::parse(kv.unwrap().value_bytes()).unwrap();
        assert_eq!(
            w.spent(c.settings(), c.now_s()),
            3,
            "exactly what committed"
        );
        assert_eq!(
            w.limit,
            Some(3),
            "the limit each charge was made under is in the key"
        );
        server.shutdown().await;
    }

    /// The leaks of the per-farm budget (issue 45), each now impossible by construction: the
    /// window key is charged in the very transaction that removes, so it counts exactly what
    /// committed, whatever becomes of the farm's side of the call.
    mod leaks {
        use super::*;

        fn cfg(limit: u64) -> FailsafeConfig {
            FailsafeConfig {
                max_removals: MaxRemovals::Pods(limit),
                ..FailsafeConfig::default()
            }
        }

        /// A server, a client, and a session holding `t/lock`.
        async fn locked() -> (
            crate::server::EmbeddedServer,
            Consul,
            crate::consul::Session,
        ) {
            let (server, consul, ours, _) = crate::testing::two_sessions().await;
            consul
                .txn(&[TxnOp::lock("t/lock", b"o".to_vec(), ours.id())])
                .await
                .unwrap();
            (server, consul, ours)
        }

        async fn spent(consul: &Consul, f: &Failsafe) -> u64 {
            let (kv, _) = consul
                .kv_get(BUDGET_KEY, &QueryOptions::default())
                .await
                .unwrap();
            Window::parse(kv.unwrap().value_bytes())
                .unwrap()
                .spent(f.settings(), f.now_s())
        }

        /// A write that committed and whose answer was then lost or unreadable (the old
        /// budget refunded a 200 it could not decode, and a retirement whose view wait timed
        /// out): it stays charged, and the next charge does not spend it again.
        #[tokio::test]
        async fn a_commit_whose_answer_is_lost_stays_charged() {
            let (server, consul, ours) = locked().await;
            let f = Failsafe::new("farm-a", cfg(3));
            let txn = |k: &str| {
                FencedTxn::fenced(Fence::new("t/lock", ours.id())).op(TxnOp::set(k, b"x".to_vec()))
            };
            let lost = |t: FencedTxn| {
                let consul = consul.clone();
                async move {
                    t.commit(&consul).await?;
                    Err::<((), u64), _>(FenceError::Consul(ConsulError::BadResponse(
                        "a 200 whose body did not decode".into(),
                    )))
                }
            };
            let r = f.commit_charged(&consul, 2, txn("t/a"), lost).await;
            assert!(r.is_err());
            assert_eq!(spent(&consul, &f).await, 2, "charged: it committed");
            let send = sender(&consul);
            let r = f.commit_charged(&consul, 2, txn("t/b"), &send).await;
            assert!(matches!(r, Err(ChargeError::Held(_))), "only 1 left: {r:?}");
            f.commit_charged(&consul, 1, txn("t/b"), &send)
                .await
                .unwrap();
            assert_eq!(spent(&consul, &f).await, 3);
            server.shutdown().await;
        }

        /// A task cancelled (handed over) while its write was in flight: the old budget gave
        /// back a chunk that was sent and committed. The charge went with it.
        #[tokio::test]
        async fn a_write_cancelled_in_flight_is_charged_if_it_committed() {
            let (server, consul, ours) = locked().await;
            let f = Failsafe::new("farm-a", cfg(3));
            let txn = FencedTxn::fenced(Fence::new("t/lock", ours.id()))
                .op(TxnOp::set("t/a", b"x".to_vec()));
            let (sent_tx, sent_rx) = tokio::sync::oneshot::channel::<()>();
            let sent_tx = std::sync::Mutex::new(Some(sent_tx));
            let slow = |t: FencedTxn| {
                let consul = consul.clone();
                let tell = sent_tx.lock().unwrap().take();
                async move {
                    let i = t.commit(&consul).await?;
                    if let Some(tell) = tell {
                        let _ = tell.send(());
                    }
                    // The answer never reaches the task: it is cancelled first.
                    std::future::pending::<()>().await;
                    Ok(((), i))
                }
            };
            tokio::select! {
                _ = f.commit_charged(&consul, 2, txn, slow) => unreachable!("cancelled first"),
                _ = sent_rx => {}
            }
            assert_eq!(spent(&consul, &f).await, 2);
            // The farm's copy is behind; its next charge loses its cas, reads, and finds 1.
            let send = sender(&consul);
            let two = FencedTxn::fenced(Fence::new("t/lock", ours.id()))
                .op(TxnOp::set("t/b", b"x".to_vec()));
            assert!(matches!(
                f.commit_charged(&consul, 2, two, &send).await,
                Err(ChargeError::Held(_))
            ));
            server.shutdown().await;
        }

        /// A farm whose wall clock is an hour off (stepped, or started so) stamps its charges
        /// in Consul's time, as every other farm does: it neither sees the others' removals as
        /// long gone nor stamps its own to leave the window early.
        #[tokio::test]
        async fn a_farm_with_its_clock_off_charges_in_consuls_time() {
            let (server, consul, _, _) = crate::testing::two_sessions().await;
            let off = Utc::now() - chrono::Duration::hours(1);
            let f = Failsafe::new("farm-a", cfg(3)).with_clock(crate::clock::Clock::paused_at(off));
            let txn = FencedTxn::unfenced().op(TxnOp::set("t/a", b"x".to_vec()));
            f.commit_charged(&consul, 1, txn, &sender(&consul))
                .await
                .unwrap();
            let (kv, _) = consul
                .kv_get(BUDGET_KEY, &QueryOptions::default())
                .await
                .unwrap();
            let w = Window::parse(kv.unwrap().value_bytes()).unwrap();
            let stamped = w.buckets[0].0;
            assert!(
                (stamped - Utc::now().timestamp()).abs() < 60,
                "stamped {stamped}, an hour from the farm's clock"
            );
            server.shutdown().await;
        }

        /// A write paced for minutes by the audit outbox: the old budget charged it when it
        /// was granted, before the wait, so it left the window minutes early (two windows'
        /// worth could land together). The charge is made when the write is sent.
        #[tokio::test(start_paused = true)]
        async fn a_paced_write_is_charged_when_it_is_sent() {
            let (server, consul, _, _) = crate::testing::two_sessions().await;
            let start: DateTime<Utc> = "2026-01-01T00:00:00Z".parse().unwrap();
            let f =
                Failsafe::new("farm-a", cfg(3)).with_clock(crate::clock::Clock::paused_at(start));
            // Unfenced: the paused clock outlives every session's TTL.
            let txn = FencedTxn::unfenced().op(TxnOp::set("t/a", b"x".to_vec()));
            // Planned with room at t0, held by the pacer for four minutes, then sent.
            assert_eq!(f.room().0, 3);
            tokio::time::advance(Duration::from_secs(240)).await;
            let send = sender(&consul);
            f.commit_charged(&consul, 3, txn, &send).await.unwrap();
            // Six minutes after the plan, two after the write: it still counts.
            tokio::time::advance(Duration::from_secs(120)).await;
            assert_eq!(spent(&consul, &f).await, 3);
            assert_eq!(f.room().0, 0);
            server.shutdown().await;
        }
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
        assert_eq!(f.room().0, 2, "an unread window is planned as empty");
        let (a, b) = (RcId::new(), RcId::new());
        f.observe_tree(2, [(a, 1), (b, 1)], 0, true);
        assert!(matches!(
            f.observe_tree(2, [(a, 0), (b, 0)], 0, true),
            Some(TripEvent::Tripped(_))
        ));
        let (room, why) = f.room();
        assert_eq!(room, 0);
        assert!(why.unwrap().starts_with(TRIPPED));
        assert!(f.status().tripped.is_some());
        assert!(f.set_held("rc:x", true));
        assert!(!f.set_held("rc:x", true));
        assert_eq!(f.status().held, 1);
        assert!(f.release());
        assert_eq!(f.room().0, 2);
        // A window key that cannot be read holds every removal, and says how to mend it.
        f.observe_window(Some(&KvPair {
            key: BUDGET_KEY.into(),
            modify_index: 7,
            value: Some(b"garbage".to_vec()),
            ..KvPair::default()
        }));
        let (room, why) = f.room();
        assert_eq!(room, 0);
        assert!(why.unwrap().contains("rcctl farm release-removals"));
    }

    /// The base of a percentage counts each pod once across a handover and a farm's end: the
    /// farm giving RCs back writes its smaller count first, however small the change (a report
    /// only when due would leave it), and a farm no longer in the registry drops out of the
    /// key at the next write.
    #[tokio::test]
    async fn the_base_counts_pods_once_across_handovers_and_farms_gone() {
        let (server, consul, ours, _theirs) = crate::testing::two_sessions().await;
        consul
            .txn(&[TxnOp::lock("t/lock", b"o".to_vec(), ours.id())])
            .await
            .unwrap();
        let fence = || Fence::new("t/lock", ours.id());
        let cfg = FailsafeConfig::default();
        assert_eq!(cfg.max_removals, MaxRemovals::Percent(20), "the default");
        let read = || async {
            let (kv, _) = consul
                .kv_get(BUDGET_KEY, &QueryOptions::default())
                .await
                .unwrap();
            Window::parse(kv.unwrap().value_bytes()).unwrap()
        };
        let (a, b, gone) = (
            Failsafe::new("farm-a", cfg),
            Failsafe::new("farm-b", cfg),
            Failsafe::new("farm-gone", cfg),
        );
        a.set_session("s-a1");
        b.set_session("s-b");
        let live = |a_session: &str| {
            [("farm-a", a_session), ("farm-b", "s-b")]
                .map(|(f, s)| (f.to_string(), s.to_string()))
                .into()
        };
        for (f, pods) in [(&a, 20), (&b, 20), (&gone, 60)] {
            f.set_served(pods);
            assert!(f.report_served(&consul, fence()).await.unwrap());
        }
        // a hands one RC of 2 pods over to b: not due as a report (a tenth of 20 is 2), written
        // before the release all the same.
        a.set_served(18);
        assert!(!a.report_served(&consul, fence()).await.unwrap(), "not due");
        let wait = Duration::from_secs(2);
        assert_eq!(
            a.report_before_release(&consul, fence(), 18, wait)
                .await
                .unwrap(),
            Reported::Written,
            "written before the release"
        );
        assert_eq!(read().await.farms["farm-a"].pods, 18);
        // Nothing smaller to write: nothing written.
        assert_eq!(
            a.report_before_release(&consul, fence(), 18, wait)
                .await
                .unwrap(),
            Reported::Unneeded
        );
        // A charge in flight holds the farm's turn: the smaller count waits, and says so.
        let turn = a.turn.lock().await;
        assert_eq!(
            a.report_before_release(&consul, fence(), 16, Duration::from_millis(50))
                .await
                .unwrap(),
            Reported::Later
        );
        drop(turn);
        assert_eq!(read().await.farms["farm-a"].pods, 18, "not written");
        // b takes the RC over and counts it; the sum never held those 2 pods twice.
        b.set_live_farms(live("s-a1"), 1);
        b.set_served(22);
        b.report_before_release(&consul, fence(), 22, wait)
            .await
            .unwrap();
        let send = sender(&consul);
        let txn = FencedTxn::fenced(fence()).op(TxnOp::set("t/x", b"x".to_vec()));
        b.commit_charged(&consul, 1, txn, &send).await.unwrap();
        let w = read().await;
        assert!(
            !w.farms.contains_key("farm-gone"),
            "a farm not in the registry drops out: {w:?}"
        );
        assert_eq!(w.served(b.settings(), b.now_s()), 18 + 22, "{w:?}");
        // a's session ends (its locks with it: b takes its RCs over, 18 pods) and a registers
        // again under a new session before it has written anything: b's next write drops the
        // count a wrote under the session that ended, or those 18 pods would count twice.
        b.set_live_farms(live("s-a2"), 3);
        b.set_served(40);
        let txn = FencedTxn::fenced(fence()).op(TxnOp::set("t/y", b"y".to_vec()));
        b.commit_charged(&consul, 1, txn, &send).await.unwrap();
        // A watch's answer older than that read changes nothing.
        b.set_live_farms(live("s-a1"), 2);
        let w = read().await;
        assert!(!w.farms.contains_key("farm-a"), "{w:?}");
        assert_eq!(w.farms["farm-b"].session.as_deref(), Some("s-b"));
        assert_eq!(w.served(b.settings(), b.now_s()), 40, "{w:?}");
        server.shutdown().await;
    }
}

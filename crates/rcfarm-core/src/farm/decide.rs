//! The ownership decisions, as pure functions of what the farm sees: which tasks to stop, what
//! to claim, what to hand over. [`super::ownership::Owned::reconcile`] gathers the situation,
//! asks these, and carries the answers out (the writes, the tasks, the logs); the tests below
//! read as the rules, one row per case.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::claims::Assignment;
use crate::rc::RcId;

/// What the farm sees of one kind of claimed object at a reconcile.
pub struct Situation<'a> {
    pub farm_id: &'a str,
    /// This farm's session.
    pub session: &'a str,
    /// Every object that exists.
    pub all: &'a BTreeSet<RcId>,
    /// The objects this farm may serve.
    pub matching: &'a BTreeSet<RcId>,
    pub assignment: &'a Assignment,
    /// The session holding each object's lock, as last read.
    pub holders: &'a BTreeMap<RcId, Arc<str>>,
    /// Of `matching`, what no session holds per the view, and what this farm's session
    /// holds: kept with the view ([`HeldIndex`]), so a reconcile walks what it may claim or
    /// start, not every object (20,000 RCs several times a second, in every farm).
    pub held: &'a HeldIndex,
    /// When the lock tree was last known current.
    pub locks_read_at: Instant,
    /// Claimed by this farm since the lock tree was read (ours, whatever it shows).
    pub claimed: &'a dyn Fn(&RcId) -> bool,
    /// Given back by this farm since the lock tree was read (not ours, whatever it shows).
    pub released: &'a dyn Fn(&RcId) -> bool,
    /// Refused to this farm since the lock tree was read (held, whatever it shows).
    pub refused: &'a dyn Fn(&RcId) -> bool,
    /// Finished by their task (a completed roll) and not yet gone from the view.
    pub finished: &'a dyn Fn(&RcId) -> bool,
}

/// Where a farm's session stands in a lock view, computed once per view.
#[derive(Debug, Default)]
pub struct HeldIndex {
    /// Objects the farm may serve that no session holds.
    pub unheld: BTreeSet<RcId>,
    /// Objects the session holds.
    pub ours: BTreeSet<RcId>,
}

impl HeldIndex {
    pub fn new(
        matching: &BTreeSet<RcId>,
        holders: &BTreeMap<RcId, Arc<str>>,
        session: &str,
    ) -> HeldIndex {
        HeldIndex {
            unheld: matching
                .iter()
                .filter(|id| !holders.contains_key(*id))
                .copied()
                .collect(),
            ours: holders
                .iter()
                .filter(|(_, s)| &***s == session)
                .map(|(id, _)| *id)
                .collect(),
        }
    }
}

impl Situation<'_> {
    /// Held by this farm's session.
    pub fn held_by_us(&self, id: &RcId) -> bool {
        self.holders.get(id).is_some_and(|s| **s == *self.session) && !(self.released)(id)
    }

    /// Held by some session, as far as this farm knows.
    pub fn held_by_anyone(&self, id: &RcId) -> bool {
        self.holders.contains_key(id) || (self.refused)(id)
    }

    /// This farm's fair share.
    pub fn cap(&self) -> usize {
        self.assignment.cap.get(self.farm_id).copied().unwrap_or(0)
    }

    /// Assigned to this farm.
    fn mine(&self, id: &RcId) -> bool {
        self.assignment
            .owner
            .get(id)
            .is_some_and(|f| **f == *self.farm_id)
    }
}

/// Why a task is stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// It ended on its own.
    Ended,
    /// Its object is gone; `release`: its lock is ours, to give back.
    Deleted { release: bool },
    /// Another session holds its object's lock.
    HeldElsewhere(String),
    /// Nobody holds its object's lock (a roll deletes its lock as it completes, or a hand did).
    LockGone,
}

/// The tasks to stop (`ended` tells a task that ended on its own), in id order.
pub fn stops<T>(
    s: &Situation<'_>,
    tasks: &BTreeMap<RcId, T>,
    ended: impl Fn(&T) -> bool,
) -> Vec<(RcId, Stop)> {
    tasks
        .iter()
        .filter_map(|(id, t)| {
            let why = if !s.all.contains(id) {
                Stop::Deleted {
                    release: s.held_by_us(id),
                }
            } else if ended(t) {
                Stop::Ended
            } else if !s.held_by_us(id) && !(s.claimed)(id) {
                match s.holders.get(id) {
                    Some(other) if **other != *s.session => Stop::HeldElsewhere(other.to_string()),
                    _ => Stop::LockGone,
                }
            } else {
                return None;
            };
            Some((*id, why))
        })
        .collect()
}

/// The rules for taking objects assigned elsewhere.
#[derive(Debug, Clone, Copy)]
pub struct Rules {
    /// How long an unheld object waits for its assigned farm before a farm with room takes it.
    pub grace: Duration,
    /// How far over its fair share a farm may go for objects nobody else takes (past two
    /// graces; past one, only within the share).
    pub slack: usize,
}

/// What to claim.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Claims {
    pub claim: Vec<RcId>,
    /// Of those, how many are assigned to another farm (taken past the grace).
    pub unassigned: usize,
    /// An object's grace is over unless the lock tree changed since it was read, or objects
    /// have waited for farms that do not take them: read it.
    pub read_locks: bool,
    /// When to look again: objects wait for the farms they are assigned to, and the lock tree
    /// is to be read once they have settled (see [`SETTLE_OF_GRACE`]).
    pub recheck_at: Option<Instant>,
}

/// While unheld objects assigned elsewhere wait, the lock tree is read again whenever none of
/// them is new and the last read is older than a settling time: the grace / [`SETTLE_OF_GRACE`]
/// (100 ms at the default 3 s, growing with the farms as the grace does) per [`SETTLE_PER`]
/// objects in the cluster, at least one.
///
/// Farms whose lock views differ compute different assignments (each holder keeps what it
/// holds up to its share, so how full another farm looks depends on when its claims were read),
/// and an object can sit between two farms, each leaving it to the other, until one reads the
/// lock tree again: seen as a 1-s tail on one RC of 200 at a cold start of three farms, and a
/// 1.5-s one at 2,000 (issue 38). One read is not always enough: the other farm may still be
/// claiming when it answers. How many objects wait says nothing (a stale view shows every
/// object claimed since as waiting); what a read costs grows with the tree, so the settling
/// time does: at 20,000 RCs it is the lock tree's idle read (2 s × farms/3) and adds nothing.
pub const SETTLE_OF_GRACE: u32 = 30;

/// See [`SETTLE_OF_GRACE`].
pub const SETTLE_PER: usize = 1000;

/// What to claim, given the tasks running (after [`stops`]): what is assigned to us and free,
/// and, past the grace, what nobody takes. `unheld_since` is when each unheld object was first
/// seen unheld; it is kept up to date here.
pub fn claims<T>(
    s: &Situation<'_>,
    tasks: &BTreeMap<RcId, T>,
    unheld_since: &mut HashMap<RcId, Instant>,
    now: Instant,
    rules: Rules,
) -> Claims {
    let cap = s.cap();
    unheld_since.retain(|id, _| s.all.contains(id) && !s.held_by_anyone(id));
    let mut out = Claims::default();
    // Of the objects unheld, assigned elsewhere and left to their farm, the newest first seen.
    let mut newest = None::<Instant>;
    // What the view shows held is never claimed: only the rest of `matching` is looked at.
    for id in &s.held.unheld {
        if s.held_by_anyone(id) || tasks.contains_key(id) || (s.finished)(id) {
            continue;
        }
        let since = *unheld_since.entry(*id).or_insert(now);
        // Unheld for as long as the view shows: an object first seen a while after the lock
        // tree was read may have been claimed since by the farm it is assigned to.
        let waited = s.locks_read_at.min(now).saturating_duration_since(since);
        if waited < rules.grace && now.duration_since(since) >= rules.grace {
            out.read_locks = true;
        }
        let holding = tasks.len() + out.claim.len();
        // Past one grace, only within our share: taken over it, an RC is handed back as soon
        // as the lock tree shows it ours, and its next owner then reads the whole pod label
        // tree to learn what we wrote (25 MiB at 100,000 pods; 1-3 RCs in 2 of 5 runs of six
        // farms converging 20,000 RCs). The slack over the share waits a second grace, and
        // past a third, shares no longer matter.
        let past = |n: u32| waited >= rules.grace * n;
        let may_take =
            (past(1) && holding < cap) || (past(2) && holding < cap + rules.slack) || past(3);
        // What is assigned to us is taken whatever we hold: under rule 1 it is within our share
        // (that assignment counts what each farm holds); under rule 2 it does not count what we
        // hold that is assigned elsewhere, so taking it may put us over our share, and
        // `handovers` then gives back only what is assigned elsewhere, each RC to the farm it
        // is assigned to, so every hand-over leaves one fewer RC away from its farm.
        if s.mine(id) {
            out.claim.push(*id);
        } else if may_take {
            out.claim.push(*id);
            out.unassigned += 1;
        } else {
            newest = newest.max(Some(since));
        }
    }
    if let Some(newest) = newest {
        let settle = (rules.grace / SETTLE_OF_GRACE)
            .mul_f64((s.all.len() as f64 / SETTLE_PER as f64).max(1.0))
            .min(rules.grace);
        let due = newest.max(s.locks_read_at) + settle;
        if now >= due {
            out.read_locks = true;
        } else {
            out.recheck_at = Some(due);
        }
    }
    out
}

/// What to start a task for (after claims): every existing object we hold or just claimed
/// (`claimed`: those the view may not show yet), that has no task yet and is not finished (a
/// completed roll whose record the view still shows).
pub fn starts<'a, T>(
    s: &Situation<'_>,
    tasks: &BTreeMap<RcId, T>,
    claimed: impl IntoIterator<Item = &'a RcId>,
) -> Vec<RcId> {
    let mut candidates: BTreeSet<RcId> = claimed.into_iter().copied().collect();
    candidates.extend(s.held.ours.iter().copied());
    candidates
        .into_iter()
        .filter(|id| s.all.contains(id))
        .filter(|id| s.held_by_us(id) || (s.claimed)(id))
        .filter(|id| !(s.finished)(id))
        .filter(|id| !tasks.contains_key(id))
        .collect()
}

/// What [`handovers`] decided: what to hand over now, and how many more go once their tasks'
/// first passes are done.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Handovers {
    pub now: Vec<RcId>,
    pub after_first_pass: usize,
}

/// What to hand over, given the tasks running (after claims): what we may not serve, and as
/// many objects assigned to other farms as we hold over our share. Only objects held per the
/// view (never one just claimed), so no farm claims something only to hand it back. Of those,
/// one whose task is on its first pass (`first_pass`) goes after it, not now: farms started
/// together each claim what they see free before they see each other, and a task stopped in
/// its first pass leaves its writes to a farm that has yet to claim, read and write the same
/// (`TaskHandle::on_first_pass`, within `FIRST_PASS_GRACE`). What is handed over is the same
/// either way; only when changes.
pub fn handovers<T>(
    s: &Situation<'_>,
    tasks: &BTreeMap<RcId, T>,
    first_pass: impl Fn(&T) -> bool,
) -> Handovers {
    let handable = |id: &&RcId| !s.mine(id) && s.held_by_us(id) && !(s.claimed)(id);
    let mut out: Vec<RcId> = tasks
        .keys()
        .filter(handable)
        .filter(|id| !s.matching.contains(id))
        .copied()
        .collect();
    let over = tasks
        .len()
        .saturating_sub(out.len())
        .saturating_sub(s.cap());
    if over > 0 {
        out.extend(
            tasks
                .keys()
                .filter(handable)
                .filter(|id| s.matching.contains(id))
                .filter(|id| {
                    s.assignment
                        .owner
                        .get(id)
                        .is_some_and(|f| **f != *s.farm_id)
                })
                .take(over)
                .copied(),
        );
    }
    let (later, now): (Vec<RcId>, Vec<RcId>) = out
        .into_iter()
        .partition(|id| tasks.get(id).is_some_and(&first_pass));
    Handovers {
        now,
        after_first_pass: later.len(),
    }
}

#[cfg(test)]
mod tests {
    //! The rules, one row each. Farm `f` with session `S`; another farm `g` with session `G`.
    //! Objects are named by a small number.

    use std::collections::HashSet;

    use super::*;

    fn rc(n: u8) -> RcId {
        RcId::parse(&format!("00000000-0000-4000-8000-0000000000{n:02}")).unwrap()
    }

    /// One situation, written as a table row would say it.
    #[derive(Default, Clone)]
    struct Row {
        /// Objects that exist (all matching `f`'s selector unless in `foreign`).
        exist: Vec<u8>,
        /// Objects `f` may not serve.
        foreign: Vec<u8>,
        /// Object → farm it is assigned to.
        assigned: Vec<(u8, &'static str)>,
        cap_f: usize,
        /// Object → session holding its lock per the view.
        held: Vec<(u8, &'static str)>,
        claimed: Vec<u8>,
        released: Vec<u8>,
        refused: Vec<u8>,
        finished: Vec<u8>,
        /// Objects `f` runs a task for, and whether it ended.
        tasks: Vec<(u8, bool)>,
        /// How long each unheld object has been seen unheld (and the view as old as now).
        unheld_for: Vec<(u8, u64)>,
    }

    struct Built {
        all: BTreeSet<RcId>,
        matching: BTreeSet<RcId>,
        assignment: Assignment,
        holders: BTreeMap<RcId, Arc<str>>,
        claimed: HashSet<RcId>,
        released: HashSet<RcId>,
        refused: HashSet<RcId>,
        finished: HashSet<RcId>,
        tasks: BTreeMap<RcId, bool>,
    }

    fn set(v: &[u8]) -> HashSet<RcId> {
        v.iter().map(|n| rc(*n)).collect()
    }

    impl Row {
        fn build(&self) -> Built {
            let all: BTreeSet<RcId> = self.exist.iter().map(|n| rc(*n)).collect();
            let foreign = set(&self.foreign);
            Built {
                matching: all
                    .iter()
                    .filter(|id| !foreign.contains(id))
                    .copied()
                    .collect(),
                all,
                assignment: Assignment {
                    owner: self
                        .assigned
                        .iter()
                        .map(|(n, f)| (rc(*n), Arc::from(*f)))
                        .collect(),
                    cap: [("f".to_string(), self.cap_f), ("g".to_string(), 100)].into(),
                },
                holders: self
                    .held
                    .iter()
                    .map(|(n, s)| (rc(*n), Arc::from(*s)))
                    .collect(),
                claimed: set(&self.claimed),
                released: set(&self.released),
                refused: set(&self.refused),
                finished: set(&self.finished),
                tasks: self.tasks.iter().map(|(n, e)| (rc(*n), *e)).collect(),
            }
        }
    }

    const GRACE: Duration = Duration::from_secs(10);

    /// Object → why its task stops.
    type Stops = Vec<(u8, Stop)>;

    fn with<R>(b: &Built, now: Instant, f: impl FnOnce(&Situation<'_>) -> R) -> R {
        let held = HeldIndex::new(&b.matching, &b.holders, "S");
        let s = Situation {
            held: &held,
            farm_id: "f",
            session: "S",
            all: &b.all,
            matching: &b.matching,
            assignment: &b.assignment,
            holders: &b.holders,
            locks_read_at: now,
            claimed: &|id| b.claimed.contains(id),
            released: &|id| b.released.contains(id),
            refused: &|id| b.refused.contains(id),
            finished: &|id| b.finished.contains(id),
        };
        f(&s)
    }

    fn names(ids: &[RcId]) -> Vec<u8> {
        ids.iter()
            .map(|id| (id.as_u128() & 0xff) as u8)
            .map(|x| x / 16 * 10 + x % 16)
            .collect()
    }

    #[test]
    fn what_is_claimed() {
        let base = Row {
            exist: vec![1],
            cap_f: 1,
            ..Row::default()
        };
        #[rustfmt::skip]
        let rows: Vec<(&str, Row, Vec<u8>)> = vec![
            ("assigned to us and free: claimed",
             Row { assigned: vec![(1, "f")], ..base.clone() }, vec![1]),
            ("assigned to us and free, our share served by one assigned elsewhere (rule 2 does not count it): claimed",
             Row { exist: vec![1, 2], assigned: vec![(1, "f"), (2, "g")], held: vec![(2, "S")], tasks: vec![(2, false)], ..base.clone() }, vec![1]),
            ("assigned to us, another session holds it: not claimed",
             Row { assigned: vec![(1, "f")], held: vec![(1, "G")], ..base.clone() }, vec![]),
            ("assigned to us, a claim was refused and the tree not read since: not claimed",
             Row { assigned: vec![(1, "f")], refused: vec![1], ..base.clone() }, vec![]),
            ("assigned to us, its task finished it and the view still shows it: not claimed",
             Row { assigned: vec![(1, "f")], finished: vec![1], ..base.clone() }, vec![]),
            ("assigned to us, we gave it back and the view still shows our lock: not claimed again",
             Row { assigned: vec![(1, "f")], held: vec![(1, "S")], released: vec![1], ..base.clone() }, vec![]),
            ("assigned to us, a task runs for it: nothing to claim",
             Row { assigned: vec![(1, "f")], tasks: vec![(1, false)], ..base.clone() }, vec![]),
            ("not ours to serve (selector): never claimed, even past the grace",
             Row { foreign: vec![1], unheld_for: vec![(1, 100)], ..base.clone() }, vec![]),
            ("assigned elsewhere, unheld within the grace: left to its farm",
             Row { assigned: vec![(1, "g")], unheld_for: vec![(1, 5)], ..base.clone() }, vec![]),
            ("assigned elsewhere, unheld past the grace, we have room: claimed",
             Row { assigned: vec![(1, "g")], unheld_for: vec![(1, 11)], ..base.clone() }, vec![1]),
            ("assigned elsewhere, unheld past the grace, we are full: left",
             Row { exist: vec![1, 2], assigned: vec![(1, "g")], tasks: vec![(2, false)], unheld_for: vec![(1, 11)], ..base.clone() }, vec![]),
            ("assigned elsewhere, unheld past three graces: claimed even when full",
             Row { exist: vec![1, 2], assigned: vec![(1, "g")], tasks: vec![(2, false)], unheld_for: vec![(1, 31)], ..base.clone() }, vec![1]),
            ("assigned to nobody (no farm may serve it but us, past the grace): claimed",
             Row { unheld_for: vec![(1, 11)], ..base.clone() }, vec![1]),
        ];
        let rules = Rules {
            grace: GRACE,
            slack: 0,
        };
        for (rule, row, want) in rows {
            assert_eq!(claimed_in(&row, rules), want, "{rule}");
        }
    }

    /// What `claims` takes in `row`, each object unheld for as long as the row says.
    fn claimed_in(row: &Row, rules: Rules) -> Vec<u8> {
        let b = row.build();
        let now = Instant::now() + Duration::from_secs(1000);
        let mut since: HashMap<RcId, Instant> = row
            .unheld_for
            .iter()
            .map(|(n, secs)| (rc(*n), now - Duration::from_secs(*secs)))
            .collect();
        let got = with(&b, now, |s| claims(s, &b.tasks, &mut since, now, rules));
        names(&got.claim)
    }

    /// The slack over a farm's share is for what nobody takes: an RC assigned elsewhere is
    /// taken over the share only past a second grace (taken at once, it was handed back as
    /// soon as the view showed it, and its next owner read every pod's labels).
    #[test]
    fn the_slack_over_the_share_waits_a_second_grace() {
        let rules = Rules {
            grace: GRACE,
            slack: 1,
        };
        #[rustfmt::skip]
        let rows: Vec<(&str, Row, Vec<u8>)> = vec![
            ("full, past one grace: left to its farm",
             Row { exist: vec![1, 2], cap_f: 1, assigned: vec![(1, "g")], tasks: vec![(2, false)], unheld_for: vec![(1, 11)], ..Row::default() }, vec![]),
            ("full, past two graces: taken within the slack",
             Row { exist: vec![1, 2], cap_f: 1, assigned: vec![(1, "g")], tasks: vec![(2, false)], unheld_for: vec![(1, 21)], ..Row::default() }, vec![1]),
            ("full and the slack used, past two graces: left",
             Row { exist: vec![1, 2, 3], cap_f: 1, assigned: vec![(1, "g")], tasks: vec![(2, false), (3, false)], unheld_for: vec![(1, 21)], ..Row::default() }, vec![]),
            ("room under the share, past one grace: taken",
             Row { exist: vec![1, 2], cap_f: 2, assigned: vec![(1, "g")], tasks: vec![(2, false)], unheld_for: vec![(1, 11)], ..Row::default() }, vec![1]),
        ];
        for (rule, row, want) in rows {
            assert_eq!(claimed_in(&row, rules), want, "{rule}");
        }
    }

    /// A grace period runs out on a view read before it ran out: the tree is read first, and
    /// nothing assigned elsewhere is taken on the old view.
    #[test]
    fn a_grace_over_on_an_old_view_asks_for_a_read_first() {
        let row = Row {
            exist: vec![1],
            cap_f: 1,
            assigned: vec![(1, "g")],
            ..Row::default()
        };
        let b = row.build();
        let now = Instant::now() + Duration::from_secs(1000);
        let mut since: HashMap<RcId, Instant> = [(rc(1), now - Duration::from_secs(11))].into();
        let rules = Rules {
            grace: GRACE,
            slack: 0,
        };
        // The view was read 5 s after the object was first seen unheld.
        let got = with(&b, now - Duration::from_secs(6), |s| {
            claims(s, &b.tasks, &mut since, now, rules)
        });
        assert_eq!(
            got,
            Claims {
                claim: vec![],
                unassigned: 0,
                read_locks: true,
                recheck_at: None,
            }
        );
    }

    /// Objects assigned elsewhere that their farms do not take (two farms' views of the lock
    /// tree differ, each leaves the object to the other): once none is new and the last read is
    /// older than the settling time (grace / 30 per 1,000 objects in the cluster), the tree is
    /// read again.
    #[test]
    fn objects_left_between_farms_ask_for_a_read_once_settled() {
        let rules = Rules {
            grace: GRACE,
            slack: 0,
        };
        let settle = GRACE / SETTLE_OF_GRACE;
        let now = Instant::now() + Duration::from_secs(1000);
        // `waiting` objects assigned elsewhere among `exist`.
        let decide = |exist: u16, waiting: u16, unheld_for: Duration, read_ago: Duration| {
            let id = |i: u16| RcId::parse(&format!("00000000-0000-4000-8000-{i:012}")).unwrap();
            let all: BTreeSet<RcId> = (1..=exist).map(id).collect();
            let matching: BTreeSet<RcId> = (1..=waiting).map(id).collect();
            let assignment = Assignment {
                owner: matching.iter().map(|r| (*r, "g".into())).collect(),
                cap: [("f".to_string(), 1), ("g".to_string(), 100)].into(),
            };
            let holders = BTreeMap::new();
            let held = HeldIndex::new(&matching, &holders, "S");
            let no = |_: &RcId| false;
            let s = Situation {
                farm_id: "f",
                session: "S",
                all: &all,
                matching: &matching,
                assignment: &assignment,
                holders: &holders,
                held: &held,
                locks_read_at: now - read_ago,
                claimed: &no,
                released: &no,
                refused: &no,
                finished: &no,
            };
            let mut since: HashMap<RcId, Instant> =
                matching.iter().map(|r| (*r, now - unheld_for)).collect();
            let tasks = BTreeMap::<RcId, ()>::new();
            let got = claims(&s, &tasks, &mut since, now, rules);
            (got.claim.len(), got.read_locks, got.recheck_at)
        };
        // Settled, the tree last read a settling time ago: read it (nothing claimed).
        assert_eq!(decide(10, 1, settle * 2, settle * 3 / 2), (0, true, None));
        // Not settled yet: look again when they will have.
        assert_eq!(
            decide(10, 1, settle / 2, settle * 2),
            (0, false, Some(now - settle / 2 + settle))
        );
        // Read a moment ago: again a settling time after that read (the other farm may have
        // been claiming still), until the grace takes it from there.
        assert_eq!(
            decide(10, 1, settle * 5, settle / 4),
            (0, false, Some(now - settle / 4 + settle))
        );
        // A bigger cluster settles longer (a read costs more), however many wait.
        let longer = settle * 3;
        assert_eq!(
            decide(3000, 1, settle * 2, settle * 5),
            (0, false, Some(now - settle * 2 + longer))
        );
        assert_eq!(decide(3000, 40, settle * 4, settle * 4), (0, true, None));
    }

    #[test]
    fn which_tasks_stop() {
        #[rustfmt::skip]
        let rows: Vec<(&str, Row, Stops)> = vec![
            ("held by us: runs on",
             Row { exist: vec![1], held: vec![(1, "S")], tasks: vec![(1, false)], ..Row::default() }, vec![]),
            ("claimed since the view was read (the view lags): runs on",
             Row { exist: vec![1], claimed: vec![1], tasks: vec![(1, false)], ..Row::default() }, vec![]),
            ("ended on its own: stopped",
             Row { exist: vec![1], held: vec![(1, "S")], tasks: vec![(1, true)], ..Row::default() }, vec![(1, Stop::Ended)]),
            ("its object was deleted while we hold it: stopped, the lock given back",
             Row { held: vec![(1, "S")], tasks: vec![(1, false)], ..Row::default() }, vec![(1, Stop::Deleted { release: true })]),
            ("its object was deleted and the lock is gone too: stopped, nothing to give back",
             Row { tasks: vec![(1, false)], ..Row::default() }, vec![(1, Stop::Deleted { release: false })]),
            ("another session holds its lock: stopped",
             Row { exist: vec![1], held: vec![(1, "G")], tasks: vec![(1, false)], ..Row::default() }, vec![(1, Stop::HeldElsewhere("G".into()))]),
            ("nobody holds its lock (a roll completed, or a hand deleted it): stopped",
             Row { exist: vec![1], tasks: vec![(1, false)], ..Row::default() }, vec![(1, Stop::LockGone)]),
        ];
        for (rule, row, want) in rows {
            let b = row.build();
            let got = with(&b, Instant::now(), |s| stops(s, &b.tasks, |e| *e));
            let got: Vec<(u8, Stop)> = got
                .into_iter()
                .map(|(id, why)| (names(&[id])[0], why))
                .collect();
            assert_eq!(got, want, "{rule}");
        }
    }

    #[test]
    fn what_gets_a_task() {
        #[rustfmt::skip]
        let rows: Vec<(&str, Row, Vec<u8>)> = vec![
            ("held by us, no task: started",
             Row { exist: vec![1], assigned: vec![(1, "f")], held: vec![(1, "S")], ..Row::default() }, vec![1]),
            ("just claimed, the view not showing it yet: started",
             Row { exist: vec![1], assigned: vec![(1, "f")], claimed: vec![1], ..Row::default() }, vec![1]),
            ("held by us with a task already: not again",
             Row { exist: vec![1], assigned: vec![(1, "f")], held: vec![(1, "S")], tasks: vec![(1, false)], ..Row::default() }, vec![]),
            ("held by another session: not ours to serve",
             Row { exist: vec![1], assigned: vec![(1, "f")], held: vec![(1, "T")], ..Row::default() }, vec![]),
            ("given back (the view still shows our lock): not started again",
             Row { exist: vec![1], assigned: vec![(1, "g")], held: vec![(1, "S")], released: vec![1], ..Row::default() }, vec![]),
            ("finished (a completed roll the listing still shows): not started again",
             Row { exist: vec![1], assigned: vec![(1, "f")], held: vec![(1, "S")], finished: vec![1], ..Row::default() }, vec![]),
            ("unheld and unclaimed: claims decide, not this",
             Row { exist: vec![1], assigned: vec![(1, "f")], ..Row::default() }, vec![]),
        ];
        for (rule, row, want) in rows {
            let b = row.build();
            let got = with(&b, Instant::now(), |s| starts(s, &b.tasks, &b.claimed));
            assert_eq!(names(&got), want, "{rule}");
        }
    }

    #[test]
    fn what_is_handed_over() {
        #[rustfmt::skip]
        let rows: Vec<(&str, Row, Vec<u8>)> = vec![
            ("within our share: nothing",
             Row { exist: vec![1, 2], cap_f: 2, assigned: vec![(1, "f"), (2, "f")], held: vec![(1, "S"), (2, "S")], tasks: vec![(1, false), (2, false)], ..Row::default() }, vec![]),
            ("over our share: as many as we are over, of those assigned elsewhere",
             Row { exist: vec![1, 2, 3], cap_f: 1, assigned: vec![(1, "f"), (2, "g"), (3, "g")], held: vec![(1, "S"), (2, "S"), (3, "S")], tasks: vec![(1, false), (2, false), (3, false)], ..Row::default() }, vec![2, 3]),
            ("over our share by one: one goes",
             Row { exist: vec![1, 2, 3], cap_f: 2, assigned: vec![(1, "f"), (2, "g"), (3, "g")], held: vec![(1, "S"), (2, "S"), (3, "S")], tasks: vec![(1, false), (2, false), (3, false)], ..Row::default() }, vec![2]),
            ("our selector no longer admits it: handed over whatever our share",
             Row { exist: vec![1], foreign: vec![1], cap_f: 5, assigned: vec![(1, "g")], held: vec![(1, "S")], tasks: vec![(1, false)], ..Row::default() }, vec![1]),
            ("just claimed (the view does not show it yet): kept",
             Row { exist: vec![1], foreign: vec![1], assigned: vec![(1, "g")], claimed: vec![1], tasks: vec![(1, false)], ..Row::default() }, vec![]),
            ("already given back (the view still shows our lock): not again",
             Row { exist: vec![1], foreign: vec![1], assigned: vec![(1, "g")], held: vec![(1, "S")], released: vec![1], tasks: vec![(1, false)], ..Row::default() }, vec![]),
        ];
        for (rule, row, want) in rows {
            let b = row.build();
            let got = with(&b, Instant::now(), |s| handovers(s, &b.tasks, |_| false));
            assert_eq!(names(&got.now), want, "{rule}");
            assert_eq!(got.after_first_pass, 0, "{rule}");
        }
    }

    /// A task on its first pass is handed over after it, not in it; the others go as ever.
    /// (In these rows a task's flag stands for "on its first pass".)
    #[test]
    fn a_task_on_its_first_pass_is_handed_over_after_it() {
        let held = vec![(1, "S"), (2, "S"), (3, "S")];
        let over = Row {
            exist: vec![1, 2, 3],
            cap_f: 1,
            assigned: vec![(1, "f"), (2, "g"), (3, "g")],
            held: held.clone(),
            tasks: vec![(1, false), (2, true), (3, false)],
            ..Row::default()
        }
        .build();
        let got = with(&over, Instant::now(), |s| handovers(s, &over.tasks, |p| *p));
        assert_eq!(
            names(&got.now),
            vec![3],
            "over our share: 2 waits for its pass"
        );
        assert_eq!(got.after_first_pass, 1);
        let got = with(&over, Instant::now(), |s| {
            handovers(s, &over.tasks, |_| false)
        });
        assert_eq!(names(&got.now), vec![2, 3], "its pass done: 2 goes too");
        let foreign = Row {
            exist: vec![1],
            foreign: vec![1],
            cap_f: 5,
            assigned: vec![(1, "g")],
            held: vec![(1, "S")],
            tasks: vec![(1, true)],
            ..Row::default()
        }
        .build();
        let got = with(&foreign, Instant::now(), |s| {
            handovers(s, &foreign.tasks, |p| *p)
        });
        assert!(
            got.now.is_empty(),
            "not ours to serve, on its first pass: after it"
        );
        assert_eq!(got.after_first_pass, 1);
        // One not ours to serve on its first pass still counts as leaving: the share is
        // counted as if it had gone, so no extra object is handed over in its place.
        let both = Row {
            exist: vec![1, 2, 3, 4],
            foreign: vec![1],
            cap_f: 2,
            assigned: vec![(1, "g"), (2, "g"), (3, "g"), (4, "f")],
            held: vec![(1, "S"), (2, "S"), (3, "S"), (4, "S")],
            tasks: vec![(1, true), (2, false), (3, false), (4, false)],
            ..Row::default()
        }
        .build();
        let got = with(&both, Instant::now(), |s| handovers(s, &both.tasks, |p| *p));
        assert_eq!(
            names(&got.now),
            vec![2],
            "1 after its pass; 2 for the share; 3 kept"
        );
        assert_eq!(got.after_first_pass, 1);
    }
}

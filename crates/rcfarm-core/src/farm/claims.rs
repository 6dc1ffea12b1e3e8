//! Which farm should serve which RC: rendezvous hashing.
//!
//! Every farm computes the same assignment from the same view (the RCs, and the live farms with
//! their RC selectors). Scores are `hash(farm id, RC id)`, so an RC's preferred farm does not
//! depend on which other farms exist. Two rules exist ([`Rule`]); the live farms use the oldest
//! of their newest rules (`registry::agreed_rule`), so farms of two releases never compute
//! different assignments from the same view:
//! - [`Rule::HoldersFirst`] (the default, and every release before rule 2): RCs are taken in id
//!   order; each farm first keeps what it holds up to its cap, the fair share `ceil(RCs it may
//!   serve / farms sharing its selector)`, and each other RC goes to the highest-scoring farm
//!   that may serve it and is still under its cap. Holdings end exactly balanced, but the
//!   assignment depends on every RC's holder: each farm reads the whole lock tree for it, and
//!   farms whose lock views are of different ages (farms claiming at once: each claim changes
//!   the others' inputs) compute different assignments.
//! - [`Rule::Score`] (`--assignment-rule 2` on every farm): each RC goes to its highest-scoring
//!   farm, whoever holds what. A function of the RCs and the live farms alone, which claims do
//!   not change, so farms with lock views of any age agree, and an RC's farm does not depend on
//!   the other RCs. Loads are balanced by the hash only (a farm keeps what it holds beyond its
//!   assignment only within its fair share, `decide::handovers`).
//!
//! A third candidate, the caps of rule 1 without its holders, was measured and dropped: its
//! assignment of an RC shifts whenever RCs are created before it in id order, and at 20,000
//! RCs written while six farms claimed that made 734 hand-overs (BENCHMARKS.md, "the assignment
//! by score alone").
//!
//! Views differ for a moment when farms come and go; the farm loop tolerates that with a grace
//! rule (an RC nobody holds for a while is claimed by whoever sees it and is under its cap, a
//! while longer by a farm within a small slack over the cap, and past a longer wait by anyone
//! at all), so no RC waits because every farm thinks it is full.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use crate::labels::{LabelSet, Selector};
use crate::rc::RcId;

/// A live farm as the others see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FarmView {
    pub farm_id: String,
    pub rc_selector: Selector,
}

/// The score of `rc` for `farm`: a stable 64-bit hash (FNV-1a, then a SplitMix64 finaliser for
/// avalanche). Stable across versions and platforms, unlike `std`'s hasher.
pub fn score(farm_id: &str, rc: &RcId) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut buf = [0u8; 36];
    for b in farm_id
        .bytes()
        .chain([0u8])
        .chain(rc.encode(&mut buf).bytes())
    {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// How farms assign RCs. The number is what a farm publishes in its registration
/// (`FarmInfo::assignment_rule`, its newest); the order is the order of releases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Rule {
    /// Holders keep what they hold up to their fair share; the rest by score under the caps.
    HoldersFirst = 1,
    /// By score alone.
    Score = 2,
}

impl Rule {
    /// The newest rule this release computes.
    pub const NEWEST: Rule = Rule::Score;

    /// The rule a farm offers unless told otherwise (`--assignment-rule`).
    pub const DEFAULT: Rule = Rule::HoldersFirst;

    /// The rule a farm's published number names: a farm that publishes none (an older release)
    /// or an unknown older number computes [`Rule::HoldersFirst`]; a number above ours is a newer
    /// release, which also computes ours.
    pub fn from_published(n: u32) -> Rule {
        match n {
            0 | 1 => Rule::HoldersFirst,
            _ => Rule::Score,
        }
    }

    pub fn number(self) -> u32 {
        self as u32
    }
}

/// The assignment: RC → farm id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Assignment {
    /// Each RC's farm id, one `Arc` per farm shared by all the RCs assigned to it (not a copy
    /// per RC: every farm computes this over every RC of the cluster at each change).
    pub owner: BTreeMap<RcId, Arc<str>>,
    /// Each farm's cap (its fair share).
    pub cap: BTreeMap<String, usize>,
}

impl Assignment {
    /// The RCs assigned to `farm_id`.
    pub fn of(&self, farm_id: &str) -> BTreeSet<RcId> {
        self.owner
            .iter()
            .filter(|(_, f)| &***f == farm_id)
            .map(|(rc, _)| *rc)
            .collect()
    }

    /// Whether this gives `farm_id` an RC that another farm holds while holding more than its
    /// cap (`holder`: the id of the farm holding an RC, if a live one does): that farm hands
    /// its excess over as soon as it computes the same assignment. A farm within its cap
    /// keeps what it holds.
    pub fn handover_due_to<'a>(
        &self,
        farm_id: &str,
        holder: impl Fn(&RcId) -> Option<&'a str>,
    ) -> bool {
        let mut held: HashMap<&str, usize> = HashMap::new();
        for rc in self.owner.keys() {
            if let Some(f) = holder(rc) {
                *held.entry(f).or_default() += 1;
            }
        }
        let over =
            |f: &str| held.get(f).copied().unwrap_or(0) > self.cap.get(f).copied().unwrap_or(0);
        self.owner
            .iter()
            .any(|(rc, f)| &**f == farm_id && holder(rc).is_some_and(|h| h != farm_id && over(h)))
    }
}

/// Computes the assignment of `rcs` (each with its own labels, for the farms' RC selectors),
/// nothing held.
pub fn assign(rcs: &BTreeMap<RcId, LabelSet>, farms: &[FarmView], rule: Rule) -> Assignment {
    assign_held(rcs, farms, &BTreeMap::<RcId, String>::new(), rule)
}

/// Like [`assign`], with `held` (RC → id of the live farm holding it), which only
/// [`Rule::HoldersFirst`] reads: a farm keeps what it holds, up to its cap, and only the rest is
/// placed by score. Without that, under caps, the assignment of an RC shifts whenever RCs are
/// created before it in id order or farms come and go, and each shift is a claim, a handover and
/// a claim again; with it, growth moves nothing and a new or departed farm moves only the RCs
/// over a cap or left unheld. [`Rule::Score`] reads neither holders nor caps: an RC's farm
/// depends on the live farms alone.
pub fn assign_held<L: Borrow<LabelSet>, H: Borrow<str>>(
    rcs: &BTreeMap<RcId, L>,
    farms: &[FarmView],
    held: &BTreeMap<RcId, H>,
    rule: Rule,
) -> Assignment {
    assign_by(rcs, farms, held, rule, |selector, labels| {
        selector.matches(labels.borrow())
    })
}

/// Computes the assignment of any claimed objects (named by an RC id: rolls are named by
/// their new RC), `may_serve` telling whether a farm's RC selector admits an object, `held`
/// who holds what (see [`assign_held`]).
pub fn assign_by<L, H: Borrow<str>>(
    items: &BTreeMap<RcId, L>,
    farms: &[FarmView],
    held: &BTreeMap<RcId, H>,
    rule: Rule,
    may_serve: impl Fn(&Selector, &L) -> bool,
) -> Assignment {
    let mut farms: Vec<&FarmView> = farms.iter().collect();
    farms.sort_by(|a, b| a.farm_id.cmp(&b.farm_id));
    farms.dedup_by(|a, b| a.farm_id == b.farm_id);
    if farms.is_empty() {
        return Assignment::default();
    }
    // Farms by position, not by id: this runs over every RC in every farm at each change of
    // the listing or lock tree, and looking farms up by name was much of it.
    let position: HashMap<&str, usize> = farms
        .iter()
        .enumerate()
        .map(|(i, f)| (f.farm_id.as_str(), i))
        .collect();
    // Fair share per farm: the objects it may serve, divided among the farms with the same
    // selector.
    let caps: Vec<usize> = farms
        .iter()
        .map(|f| {
            let servable = items
                .values()
                .filter(|l| may_serve(&f.rc_selector, l))
                .count();
            let peers = farms
                .iter()
                .filter(|g| g.rc_selector == f.rc_selector)
                .count()
                .max(1);
            servable.div_ceil(peers)
        })
        .collect();
    let mut load = vec![0usize; farms.len()];
    // Each item's farm, by the item's position in `items` (both passes walk it in id order).
    let mut chosen: Vec<Option<usize>> = vec![None; items.len()];
    // Holders first (rule 1 only), in id order, each up to its cap.
    if rule == Rule::HoldersFirst {
        for ((rc, labels), slot) in items.iter().zip(chosen.iter_mut()) {
            let Some(&i) = held.get(rc).and_then(|h| position.get(h.borrow())) else {
                continue;
            };
            if load[i] < caps[i] && may_serve(&farms[i].rc_selector, labels) {
                load[i] += 1;
                *slot = Some(i);
            }
        }
    }
    // One list for every RC's candidates, not one allocated per RC.
    let mut candidates: Vec<(usize, u64)> = Vec::with_capacity(farms.len());
    for ((rc, labels), slot) in items.iter().zip(chosen.iter_mut()) {
        if slot.is_some() {
            continue;
        }
        candidates.clear();
        candidates.extend(
            farms
                .iter()
                .enumerate()
                .filter(|(_, f)| may_serve(&f.rc_selector, labels))
                .map(|(i, f)| (i, score(&f.farm_id, rc))),
        );
        // Farms are sorted by id, so the position breaks ties as the id would.
        candidates.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        let pick = match rule {
            Rule::HoldersFirst => candidates
                .iter()
                .find(|(i, _)| load[*i] < caps[*i])
                // Overlapping selectors can leave everyone at cap: then the least loaded.
                .or_else(|| candidates.iter().min_by_key(|(i, _)| load[*i])),
            Rule::Score => candidates.first(),
        };
        if let Some(&(i, _)) = pick {
            load[i] += 1;
            *slot = Some(i);
        }
    }
    let ids: Vec<Arc<str>> = farms
        .iter()
        .map(|f| Arc::from(f.farm_id.as_str()))
        .collect();
    let owner = items
        .keys()
        .zip(chosen)
        .filter_map(|(rc, i)| Some((*rc, ids[i?].clone())))
        .collect();
    let cap = farms
        .iter()
        .zip(caps)
        .map(|(f, c)| (f.farm_id.clone(), c))
        .collect();
    Assignment { owner, cap }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rule of every release before rule 2 (what most rows here pin).
    const B: Rule = Rule::HoldersFirst;
    const R: Rule = Rule::Score;

    fn farms(ids: &[&str]) -> Vec<FarmView> {
        ids.iter()
            .map(|id| FarmView {
                farm_id: id.to_string(),
                rc_selector: Selector::everything(),
            })
            .collect()
    }

    fn rcs(n: usize) -> BTreeMap<RcId, LabelSet> {
        (0..n).map(|_| (RcId::new(), LabelSet::new())).collect()
    }

    /// A farm waits for a handover only from a farm over its share.
    #[test]
    fn a_handover_is_due_only_from_a_farm_over_its_share() {
        let fs = farms(&["a", "b", "c"]);
        let all = rcs(9);
        let a = assign(&all, &fs, B);
        let of_b: Vec<RcId> = a.of("b").into_iter().collect();
        // Farm a holds every RC (it started first): b waits for its share.
        assert!(a.handover_due_to("b", |_| Some("a")));
        // Nobody holds anything: nothing to wait for (b claims).
        assert!(!a.handover_due_to("b", |_| None));
        // b already holds its share; a holds the rest: only c waits.
        let holder = |rc: &RcId| Some(if of_b.contains(rc) { "b" } else { "a" });
        assert!(!a.handover_due_to("b", holder));
        assert!(a.handover_due_to("c", holder));
        // a holds one of b's RCs and one fewer of its own: within its cap, it keeps it, and
        // b does not wait for it.
        let mut held_by_a = a.of("a");
        let first = *held_by_a.iter().next().expect("a has a share");
        held_by_a.remove(&first);
        held_by_a.insert(of_b[0]);
        let holder = |rc: &RcId| held_by_a.contains(rc).then_some("a");
        assert!(!a.handover_due_to("b", holder));
    }

    #[test]
    fn balanced_within_one() {
        let rcs = rcs(50);
        let a = assign(&rcs, &farms(&["a", "b", "c"]), B);
        let counts: Vec<usize> = ["a", "b", "c"].iter().map(|f| a.of(f).len()).collect();
        assert_eq!(counts.iter().sum::<usize>(), 50);
        assert!(
            counts.iter().max().unwrap() - counts.iter().min().unwrap() <= 1,
            "{counts:?}"
        );
    }

    #[test]
    fn every_farm_computes_the_same_assignment() {
        let rcs = rcs(100);
        let mut f1 = farms(&["a", "b", "c"]);
        let a1 = assign(&rcs, &f1, B);
        f1.reverse();
        assert_eq!(
            assign(&rcs, &f1, B),
            a1,
            "order of the view does not matter"
        );
    }

    #[test]
    fn a_joining_farm_moves_few_rcs() {
        let rcs = rcs(300);
        let before = assign(&rcs, &farms(&["a", "b", "c"]), B);
        let after = assign(&rcs, &farms(&["a", "b", "c", "d"]), B);
        let moved = rcs
            .keys()
            .filter(|rc| before.owner[rc] != after.owner[rc])
            .count();
        // The new farm takes its quarter; a few more move because of the caps.
        assert!(after.of("d").len() == 75, "{}", after.of("d").len());
        assert!(moved < 150, "moved {moved} of 300");
        let left = assign(&rcs, &farms(&["a", "c"]), B);
        let moved_away = rcs
            .keys()
            .filter(|rc| before.owner[rc] != left.owner[rc])
            .count();
        assert!(moved_away < 170, "moved {moved_away} of 300 when b left");
    }

    /// Holders keep what they hold up to their cap: a new farm takes only what is over the
    /// caps, growth moves nothing held, and a departed farm's RCs go to those with room.
    #[test]
    fn holders_keep_what_they_hold_up_to_their_cap() {
        let all = rcs(300);
        let three = farms(&["a", "b", "c"]);
        let before = assign(&all, &three, B);
        let held: BTreeMap<RcId, Arc<str>> = before.owner.clone();
        assert_eq!(assign_held(&all, &three, &held, B), before);
        let four = farms(&["a", "b", "c", "d"]);
        let after = assign_held(&all, &four, &held, B);
        let moved = all
            .keys()
            .filter(|rc| before.owner[rc] != after.owner[rc])
            .count();
        assert_eq!(after.of("d").len(), 75);
        assert_eq!(moved, 75, "only what d takes moves");
        // 100 more RCs: nothing held moves; each farm gets new ones up to its cap.
        let mut more = all.clone();
        more.extend(rcs(100));
        let grown = assign_held(&more, &three, &held, B);
        assert!(held.iter().all(|(rc, f)| grown.owner[rc] == *f));
        for f in ["a", "b", "c"] {
            assert!(grown.of(f).len() <= grown.cap[f], "{f}");
        }
        assert_eq!(grown.owner.len(), 400);
        // b leaves: only b's RCs move, and they are spread over a and c.
        let two = farms(&["a", "c"]);
        let left = assign_held(&all, &two, &held, B);
        let moved: Vec<&RcId> = all
            .keys()
            .filter(|rc| before.owner[rc] != left.owner[rc])
            .collect();
        assert!(moved.iter().all(|rc| &*before.owner[*rc] == "b"));
        assert_eq!(left.of("a").len(), 150);
        assert_eq!(left.of("c").len(), 150);
    }

    #[test]
    fn rc_selectors_partition_the_work() {
        let mut rcs = BTreeMap::new();
        for i in 0..20 {
            let team = if i % 2 == 0 { "red" } else { "blue" };
            rcs.insert(RcId::new(), [("team".to_string(), team.to_string())].into());
        }
        let views = vec![
            FarmView {
                farm_id: "r1".into(),
                rc_selector: Selector::parse("team=red").unwrap(),
            },
            FarmView {
                farm_id: "r2".into(),
                rc_selector: Selector::parse("team=red").unwrap(),
            },
            FarmView {
                farm_id: "b1".into(),
                rc_selector: Selector::parse("team=blue").unwrap(),
            },
        ];
        let a = assign(&rcs, &views, B);
        assert_eq!(a.of("b1").len(), 10);
        assert_eq!(a.of("r1").len() + a.of("r2").len(), 10);
        assert!(a.of("r1").len() == 5 && a.of("r2").len() == 5);
        for (rc, farm) in &a.owner {
            let team = &rcs[rc]["team"];
            assert_eq!(farm.starts_with('r'), team == "red");
        }
    }

    #[test]
    fn rcs_no_farm_may_serve_are_unassigned() {
        let mut rcs = rcs(3);
        rcs.insert(RcId::new(), [("x".to_string(), "y".to_string())].into());
        let views = vec![FarmView {
            farm_id: "a".into(),
            rc_selector: Selector::parse("!x").unwrap(),
        }];
        assert_eq!(assign(&rcs, &views, B).owner.len(), 3);
        assert!(assign(&rcs, &[], B).owner.is_empty());
    }

    #[test]
    fn scores_are_stable() {
        let rc = RcId::parse("6ba7b810-9dad-11d1-80b4-00c04fd430c8").unwrap();
        assert_eq!(score("farm-a", &rc), score("farm-a", &rc));
        assert_ne!(score("farm-a", &rc), score("farm-b", &rc));
        // Pinned: farms of different builds must agree.
        assert_eq!(score("farm-a", &rc), 4_932_952_535_229_323_081);
    }

    /// Rule 2 gives each RC to its best-scoring farm, whoever holds what: a joining farm takes
    /// exactly the RCs it scores best on, a departed farm's RCs go to their next best, growth
    /// moves nothing, and farms with lock views of different ages agree on it.
    #[test]
    fn score_gives_each_rc_to_its_best_farm_whoever_holds_it() {
        let all = rcs(3000);
        let three = farms(&["a", "b", "c"]);
        let a = assign(&all, &three, R);
        for (rc, f) in &a.owner {
            let best = ["a", "b", "c"]
                .into_iter()
                .max_by_key(|g| score(g, rc))
                .unwrap();
            assert_eq!(&**f, best);
        }
        let skewed: BTreeMap<RcId, String> = all.keys().map(|rc| (*rc, "a".to_string())).collect();
        assert_eq!(assign_held(&all, &three, &skewed, R), a);
        // Rule 1 keeps them with a, up to its cap (the first 1,000 in id order).
        let kept = assign_held(&all, &three, &skewed, B);
        assert_eq!(kept.of("a"), all.keys().take(1000).copied().collect());
        for f in ["a", "b", "c"] {
            let n = a.of(f).len();
            assert!((900..=1100).contains(&n), "balanced by the hash: {f} {n}");
            assert_eq!(
                a.cap[f], 1000,
                "the fair share is the same under both rules"
            );
        }
        let four = assign(&all, &farms(&["a", "b", "c", "d"]), R);
        for rc in all.keys() {
            if &*four.owner[rc] != "d" {
                assert_eq!(four.owner[rc], a.owner[rc], "only what d wins moves");
            }
        }
        let two = assign(&all, &farms(&["a", "c"]), R);
        for rc in all.keys() {
            if &*a.owner[rc] != "b" {
                assert_eq!(two.owner[rc], a.owner[rc], "only b's RCs move");
            }
        }
        let mut more = all.clone();
        more.extend(rcs(500));
        let grown = assign(&more, &three, R);
        assert!(a.owner.iter().all(|(rc, f)| grown.owner[rc] == *f));
    }

    /// What a farm publishes names the rule it computes: nothing (an older release) is rule 1,
    /// and a newer release's number is a rule this one need not know (it computes ours too).
    #[test]
    fn published_numbers_name_rules() {
        assert_eq!(Rule::from_published(0), B);
        assert_eq!(Rule::from_published(1), B);
        assert_eq!(Rule::from_published(2), R);
        assert_eq!(Rule::from_published(7), R);
        assert_eq!(Rule::NEWEST.number(), 2);
        assert!(B < R);
    }
}

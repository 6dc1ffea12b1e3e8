//! Which farm serves which RC, and the rule the live farms agree on: the oldest any of them
//! offers (`--assignment-rule`; a farm of a release before rule 2 offers none, which is 1).
//! The rules differ where RCs are held: rule 1 keeps each with its holder up to its share and
//! places new RCs around them, rule 2 places every RC by score alone, whoever holds what (what
//! is held stays put all the same, up to the share). So RCs written once
//! others are held, chosen so that the two rules place them differently, end up exactly where
//! the rule every farm computed puts them, and nowhere else if any farm computed the other.

use std::collections::BTreeMap;
use std::time::Duration;

use rcfarm::consul::TxnOp;
use rcfarm::farm::claims::{FarmView, Rule, assign_held};
use rcfarm::labels::{LabelSet, Selector};
use rcfarm::rc::RcId;

use crate::harness::{Backend, Cluster, signal};
use crate::on_both_backends;

/// RCs written in one transaction, so every farm's first view of them holds them all.
const RCS: usize = 48;

fn views(farms: &[&str]) -> Vec<FarmView> {
    farms
        .iter()
        .map(|f| FarmView {
            farm_id: f.to_string(),
            rc_selector: Selector::everything(),
        })
        .collect()
}

fn labelled<'a>(ids: impl IntoIterator<Item = &'a RcId>) -> BTreeMap<RcId, LabelSet> {
    ids.into_iter().map(|id| (*id, LabelSet::new())).collect()
}

/// Writes `ids` as RCs of no replicas in one transaction.
async fn put_rcs_at_once(c: &Cluster, ids: &[RcId]) {
    let ops: Vec<TxnOp> = ids
        .iter()
        .map(|id| {
            let record = serde_json::json!({
                "id": id.to_string(),
                "manifest": format!("id: app-{id}\nlaunchables:\n  app:\n    launchable_type: hoist\n"),
                "node_selector": "",
                "pod_labels": {},
                "replicas_desired": 0,
                "disabled": false,
            });
            TxnOp::set(id.key(), record.to_string().into_bytes())
        })
        .collect();
    c.consul.txn(&ops).await.unwrap();
}

/// RC → id of the farm whose session holds its ownership lock.
async fn placement(c: &Cluster) -> BTreeMap<RcId, String> {
    let farm_of = c.farm_sessions().await;
    c.owners()
        .await
        .into_iter()
        .filter_map(|(id, s)| Some((id, farm_of.get(&s)?.clone())))
        .collect()
}

/// Waits until every farm in `farms` sees all of them live, and `on_rule` (this release's) say
/// they compute `rule`. Every farm's view must show the others before RCs come: a farm that saw
/// fewer would claim more than its share, and what it kept of that within its share would
/// stand under rule 1.
async fn all_on_rule(c: &Cluster, farms: &[&str], on_rule: &[&str], rule: Rule) {
    let live = format!("rcfarm_live_farms {}", farms.len());
    let rule_line = format!("rcfarm_assignment_rule {}", rule.number());
    let (live, rule_line) = (&live, &rule_line);
    c.wait_for(
        Duration::from_secs(30),
        &format!(
            "farms {farms:?} live, {on_rule:?} on assignment rule {}",
            rule.number()
        ),
        move || async move {
            // Registered (with their HTTP address, which the registration carries).
            let registered = c.farm_sessions().await;
            if !farms.iter().all(|f| registered.values().any(|l| l == f)) {
                return false;
            }
            for f in farms {
                let m = c.metrics(f).await;
                let has = |want: &str| m.lines().any(|l| l.trim() == want);
                if !has(live) || (on_rule.contains(f) && !has(rule_line)) {
                    return false;
                }
            }
            true
        },
    )
    .await;
}

/// `rcctl farms` tells the operator the rule, and which farm holds the others to an older one.
async fn farms_say(c: &Cluster, line: &str) {
    let (code, out, err) = c.rcctl(&["farms"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.lines().any(|l| l.starts_with(line)), "{out}");
}

/// Waits until the RCs in `expected` are held exactly as it says (or fails with those held
/// otherwise).
async fn placed(c: &Cluster, expected: &BTreeMap<RcId, String>, what: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(45);
    loop {
        let now = placement(c).await;
        let wrong: Vec<(&RcId, &String, Option<&String>)> = expected
            .iter()
            .filter(|(id, f)| now.get(*id) != Some(*f))
            .map(|(id, f)| (id, f, now.get(id)))
            .collect();
        if wrong.is_empty() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: after 45 s, {} of {} RCs are not where the rule places them (RC, its farm by the rule, its holder): {wrong:?}",
            wrong.len(),
            expected.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every RC written so far (`all`), and what the farms serving them are.
struct Written {
    all: Vec<RcId>,
}

impl Written {
    /// Waits until every farm of `farms` sees every RC held, then writes `RCS` new RCs at once,
    /// chosen so that `expected` and `other` place at least 3 of them differently given what is
    /// held now (any, with nothing held: the rules then agree), and waits until they are held
    /// exactly as `expected` places them. New RCs are never handed over under either rule
    /// (what is assigned to its holder stays), so where they end is where the rule put them.
    async fn batch(
        &mut self,
        c: &Cluster,
        farms: &[&str],
        expected: Rule,
        other: Rule,
        what: &str,
    ) {
        let settled = [
            format!("rcfarm_rcs {}", self.all.len()),
            "rcfarm_rcs_unowned 0".to_string(),
        ];
        let settled = &settled;
        c.wait_for(
            Duration::from_secs(30),
            "every RC held, in every farm's view",
            move || async move {
                for f in farms {
                    let m = c.metrics(f).await;
                    if !settled.iter().all(|w| m.lines().any(|l| l.trim() == w)) {
                        return false;
                    }
                }
                true
            },
        )
        .await;
        let held = placement(c).await;
        assert_eq!(held.len(), self.all.len(), "every RC held: {held:?}");
        let views = views(farms);
        let mut tries = 0;
        let (ids, by_rule) = loop {
            tries += 1;
            assert!(tries < 1000, "no {RCS} RCs the rules place apart: {held:?}");
            let ids: Vec<RcId> = (0..RCS).map(|_| RcId::new()).collect();
            let items = labelled(self.all.iter().chain(&ids));
            let exp = assign_held(&items, &views, &held, expected).owner;
            let oth = assign_held(&items, &views, &held, other).owner;
            let apart = ids.iter().filter(|id| exp[id] != oth[id]).count();
            if held.is_empty() || apart >= 3 {
                let by_rule: BTreeMap<RcId, String> =
                    ids.iter().map(|id| (*id, exp[id].to_string())).collect();
                break (ids, by_rule);
            }
        };
        put_rcs_at_once(c, &ids).await;
        self.all.extend(&ids);
        placed(c, &by_rule, what).await;
    }
}

/// Farms `a` (offering only rule 1, from `a_bin` with `a_args`), `b` and `c` (this release,
/// started with `--assignment-rule 2`):
/// all three compute rule 1, and RCs written once others are held are placed exactly as rule
/// 1 places them. With `a` stopped, `b` and `c` move to rule 2 together: what `a` held is taken,
/// and RCs written then are placed exactly as rule 2 places them.
pub(crate) async fn the_oldest_rule_offered_is_every_farms(
    backend: Backend,
    a_bin: &str,
    a_args: &[&str],
) {
    let (one, two) = (Rule::HoldersFirst, Rule::Score);
    let mut c = Cluster::start_on(&backend).await;
    let url = c.server.url();
    let a = c.spawn_farm_from(a_bin, "a", &url, a_args, &[]).await;
    c.spawn_farm("b", &["--assignment-rule", "2"]).await;
    c.spawn_farm("c", &["--assignment-rule", "2"]).await;
    let three = ["a", "b", "c"];
    all_on_rule(&c, &three, &["b", "c"], one).await;
    farms_say(&c, "assignment rule: 1 (holders first; offered by a:").await;

    let mut w = Written { all: Vec::new() };
    w.batch(&c, &three, one, one, "the first RCs placed").await;
    w.batch(
        &c,
        &three,
        one,
        two,
        "RCs written beside held ones placed by rule 1 (every farm computes the oldest offered)",
    )
    .await;

    signal(c.farms[a].pid, "TERM");
    let _ = tokio::time::timeout(Duration::from_secs(20), c.farms[a].child.wait()).await;
    let rest = ["b", "c"];
    all_on_rule(&c, &rest, &rest, two).await;
    farms_say(&c, "assignment rule: 2 (by score alone").await;
    w.batch(
        &c,
        &rest,
        two,
        one,
        "RCs written beside held ones placed by rule 2, once the farm offering rule 1 is gone",
    )
    .await;
    c.check_invariants(|_| false);
}

on_both_backends!(a_farm_offering_rule_1_holds_every_farm_to_it);
/// One farm of this release started with `--assignment-rule 1` (what a farm of a release
/// before rule 2 offers, see `mixed::…` for that release itself).
async fn a_farm_offering_rule_1_holds_every_farm_to_it(backend: Backend) {
    the_oldest_rule_offered_is_every_farms(
        backend,
        crate::harness::BIN,
        &["--assignment-rule", "1"],
    )
    .await;
}

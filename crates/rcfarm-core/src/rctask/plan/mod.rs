//! What an RC should do next, decided from what is observed. Pure: no I/O, no clock of its own
//! (the time is an input), so every decision is unit-tested.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::health::HealthStatus;
use crate::rc::{AllocationStrategy, Rc, RcId};
use crate::scheduler::{NodeName, NodeSet};

/// A node transfer in flight, as kept in P2's status key
/// (`status/replication_controllers/<id>/replication_controller`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transfer {
    pub old_node: NodeName,
    pub new_node: NodeName,
    pub id: String,
    /// rcfarm's addition, for the timeout. P2 writes none: see [`Transfer::resumed`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<DateTime<Utc>>,
}

impl Transfer {
    /// The transfer read from Consul, with a start time for the timeout: its own, else the one
    /// this task gave the same transfer when it first read it, else `now`. Without the second,
    /// a P2-written transfer (no start time) got a new one at every re-read, and its timeout
    /// could be put off for ever.
    pub fn resumed(
        stored: Option<Transfer>,
        known: Option<&Transfer>,
        now: DateTime<Utc>,
    ) -> Option<Transfer> {
        let mut t = stored?;
        if t.started_at.is_none() {
            t.started_at = Some(
                known
                    .filter(|k| k.id == t.id)
                    .and_then(|k| k.started_at)
                    .unwrap_or(now),
            );
        }
        Some(t)
    }
}

/// Everything the planner looks at.
#[derive(Debug, Clone)]
pub struct Observed<'a> {
    pub rc: &'a Rc,
    /// Nodes with a pod of this RC, and the pod id each carries (an older manifest may have
    /// had another id).
    pub current: BTreeMap<NodeName, String>,
    pub eligible: NodeSet,
    /// This pod id's health by node.
    pub health: BTreeMap<NodeName, HealthStatus>,
    /// Whether anything reports health for this pod id at all; if not, health cannot gate.
    pub health_in_use: bool,
    /// Current nodes whose intent is missing or differs from the manifest.
    pub bad_intents: BTreeSet<NodeName>,
    pub transfer: Option<Transfer>,
    /// Nodes to take first when growing: pods of this pod id that another, disabled RC has
    /// given up (it runs more than it wants: a rolling update moved its replicas), unhealthy
    /// ones first, so each new pod replaces an old one in place, as the roll's arithmetic
    /// assumes.
    pub takeover: Vec<NodeName>,
    /// Nodes where another RC runs a pod of this pod id. Never scheduled on (the two RCs
    /// would overwrite each other's intent), except by takeover.
    pub occupied: BTreeSet<NodeName>,
    /// The labels of the pods the writes may touch, by pod label id (`<node>/<pod-id>`), with
    /// their `ModifyIndex`, as seen when this was observed: the RC's own pods and other RCs'
    /// pods of its pod id. The writes planned from this view are guarded by these (a label
    /// that changed since fails the write; a node without one is written create-only), so a
    /// plan never acts on what it did not see. Not read by the planner.
    pub labels_seen: BTreeMap<String, (crate::labels::LabelSet, u64)>,
    /// The scheduler was already asked for nodes in this pass and gave what it could.
    pub allocation_exhausted: bool,
    /// Another session holds the mutation lock (a rolling update, say): no transfer now.
    pub mutation_locked_elsewhere: bool,
    /// Whether a static-strategy RC moves pods off ineligible nodes (`--transfer-static`);
    /// P2 moves only dynamic RCs' pods.
    pub transfer_static: bool,
    /// Who holds P2's node-transfer lock, if anyone: no transfer starts, and one in flight is
    /// neither completed nor rolled back, while it is held.
    pub transfer_frozen: Option<String>,
    /// How long the transfer in flight has run, on the monotonic clock (from its start as
    /// recorded, when another farm started it: see `rctask::transfer`).
    pub transfer_age: Duration,
    pub transfer_timeout: Duration,
    /// Current nodes whose intent runs another manifest than the RC's: rewriting one replaces
    /// a running pod (a removal), where rewriting a missing intent removes nothing.
    pub runs_other: BTreeSet<NodeName>,
    /// The RC's record is as its rolling update left it when it retired it ([`Rc::retired_by`]):
    /// the roll charged the failsafe for the capacity its removals take away.
    pub retiring: bool,
    /// A rolling update names this RC (as its old or new RC): no node transfer starts, even
    /// while the roll's farm has not taken the mutation lock yet (a handover between two
    /// farms carrying the roll leaves it free for a moment).
    pub in_roll: Option<String>,
}

/// What an action takes away, as the farm's failsafe counts it: the rule is that a removal
/// counts when a pod goes and nothing already up takes its place.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Removals {
    /// Pods that go without a replacement that is up (a scale-down, a pod of an older pod id
    /// or manifest rewritten in place): charged to the removal budget, in the plan's order.
    pub counted: Vec<NodeName>,
    /// Pods that go with a replacement already up (a node transfer's end) or whose lost
    /// capacity their rolling update charged (a retired old RC's leftovers): not charged, but
    /// held like every removal while the tripwire is tripped.
    pub uncounted: usize,
    /// Nodes the action writes without removing anything (a missing intent rewritten).
    pub harmless: Vec<NodeName>,
}

impl Removals {
    /// Whether the action removes any pod at all.
    pub fn any(&self) -> bool {
        !self.counted.is_empty() || self.uncounted > 0
    }
}

/// Where other RCs run an RC's pod id: the nodes it takes over first when growing, the nodes
/// it keeps off, and the givers it should ask about.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Neighbours {
    pub takeover: Vec<NodeName>,
    pub occupied: BTreeSet<NodeName>,
    /// Disabled RCs with pods of this pod id they no longer want, not known to roll onto this
    /// RC: asked about (a fresh read of the mutation locks) before their pods are taken for
    /// occupied.
    pub unconfirmed: Vec<RcId>,
}

/// Decides [`Neighbours`] from other RCs' pods of an RC's pod id (owner's id as its label
/// says → each pod's (healthy, node)), what each owner is (`rc_of`: id, disabled, replicas
/// desired; `None` for no valid RC), and whether a rolling update moves an owner's replicas
/// onto this RC (`rolled_onto`). Only that RC takes a disabled RC's surplus over, in place,
/// unhealthy pods first: a pod any other RC runs is left alone, given up or not (an unrelated
/// RC that took a roll's given-up pod would overwrite what the roll's new RC just wrote).
pub fn neighbours(
    others: BTreeMap<String, Vec<(bool, NodeName)>>,
    rc_of: impl Fn(&str) -> Option<(RcId, bool, u64)>,
    rolled_onto: impl Fn(RcId) -> bool,
) -> Neighbours {
    let mut out = Neighbours::default();
    let mut takeover: Vec<(bool, NodeName)> = Vec::new();
    for (owner, mut pods) in others {
        let giver = rc_of(&owner);
        let surplus = giver
            .filter(|(_, disabled, _)| *disabled)
            .map_or(0, |(_, _, desired)| {
                pods.len().saturating_sub(desired as usize)
            });
        let ours = giver.is_some_and(|(g, _, _)| rolled_onto(g));
        if surplus > 0
            && !ours
            && let Some((g, _, _)) = giver
        {
            out.unconfirmed.push(g);
        }
        let given_up = if ours { surplus } else { 0 };
        // Unhealthy first (false sorts before true), then by name.
        pods.sort();
        for (i, p) in pods.into_iter().enumerate() {
            if i < given_up {
                takeover.push(p);
            } else {
                out.occupied.insert(p.1);
            }
        }
    }
    takeover.sort();
    out.takeover = takeover.into_iter().map(|(_, n)| n).collect();
    out
}

/// What of `action` may be done with `granted` of its counted removals (`cost` from
/// [`removals`]): the plan orders its victims (ineligible, unhealthy, then by name), so the
/// first `granted` are kept, with every node it touches without removing anything; `None`
/// when nothing of it may be done.
pub fn within_grant(action: Action, cost: &Removals, granted: usize) -> Option<Action> {
    if granted >= cost.counted.len() {
        return Some(action);
    }
    if granted == 0 && cost.harmless.is_empty() {
        return None;
    }
    let keep: BTreeSet<&NodeName> = cost.counted.iter().take(granted).collect();
    let kept = |t: Vec<NodeName>| -> Vec<NodeName> {
        t.into_iter()
            .filter(|n| keep.contains(n) || cost.harmless.contains(n))
            .collect()
    };
    Some(match action {
        Action::Unschedule(t) => Action::Unschedule(kept(t)),
        Action::Replace(t) => Action::Replace(kept(t)),
        Action::Repair(t) => Action::Repair(kept(t)),
        other => other,
    })
}

/// Whether applying `action` needs the RC's mutation lock. Only a node transfer's start does:
/// a lock is waited for only before something starts, and what is in flight ends without one
/// (docs/architecture.md, "Locks").
pub fn needs_mutation_lock(action: &Action) -> bool {
    matches!(action, Action::StartTransfer { .. })
}

/// What `action`, planned from `o`, takes away.
pub fn removals(action: &Action, o: &Observed<'_>) -> Removals {
    let mut r = Removals::default();
    match action {
        Action::Unschedule(t) if o.retiring => r.uncounted = t.len(),
        Action::Unschedule(t) | Action::Replace(t) => r.counted = t.clone(),
        Action::Repair(t) => {
            (r.counted, r.harmless) = t.iter().cloned().partition(|n| o.runs_other.contains(n))
        }
        // The old pod goes once the new one passed its health check, or the new one goes and
        // the old stays: the RC keeps its count either way.
        Action::CompleteTransfer | Action::RollbackTransfer(_) => {
            r.uncounted = usize::from(o.transfer.is_some())
        }
        Action::Schedule(_) | Action::Allocate(_) | Action::StartTransfer { .. } => {}
    }
    r
}

/// One step. The executor performs them in order, each as fenced transactions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Write intent and pod labels on these nodes.
    Schedule(Vec<NodeName>),
    /// Remove intent and pod labels from these nodes.
    Unschedule(Vec<NodeName>),
    /// Rewrite intent and labels where they are missing or differ (the node set is unchanged).
    Repair(Vec<NodeName>),
    /// Replace pods carrying an older pod id with the current one, in place.
    Replace(Vec<NodeName>),
    /// Ask the scheduler for this many more nodes, then plan again.
    Allocate(usize),
    /// Move the pod on `old` to `new` (or to a node to allocate when `None`).
    StartTransfer {
        old: NodeName,
        new: Option<NodeName>,
    },
    CompleteTransfer,
    RollbackTransfer(String),
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub actions: Vec<Action>,
    /// Why the desires cannot be met, if they cannot.
    pub unmet: Option<String>,
    /// What the RC is waiting for, if anything (shown in its status).
    pub waiting: Option<String>,
}

impl Plan {
    pub fn is_idle(&self) -> bool {
        self.actions.is_empty()
    }
}

/// Decides the next steps.
pub fn plan(o: &Observed<'_>) -> Plan {
    let mut p = Plan::default();
    let rc = o.rc;
    if rc.disabled {
        p.waiting = Some("disabled: no scheduling changes".into());
        return p;
    }
    let desired = rc.replicas_desired as usize;
    let current: BTreeSet<&NodeName> = o.current.keys().collect();
    let n = current.len();

    if let Some(t) = &o.transfer {
        if let Some(holder) = &o.transfer_frozen {
            p.waiting = Some(format!(
                "transferring {} → {}: frozen while {holder} holds the node-transfer lock (neither completed nor rolled back until it is released)",
                t.old_node, t.new_node
            ));
            push_repairs(o, &mut p, &BTreeSet::new());
            return p;
        }
        match transfer::in_flight(o, t) {
            transfer::InFlight::Complete => p.actions.push(Action::CompleteTransfer),
            transfer::InFlight::RollBack(reason) => {
                p.actions.push(Action::RollbackTransfer(reason))
            }
            transfer::InFlight::Wait(why) => p.waiting = Some(why),
        }
        push_repairs(o, &mut p, &BTreeSet::new());
        return p;
    }

    let ineligible: Vec<&NodeName> = current
        .iter()
        .filter(|n| !o.eligible.contains(n))
        .copied()
        .collect();
    let mut removed: BTreeSet<NodeName> = BTreeSet::new();

    if n > desired {
        let unhealthy = |node: &&NodeName| o.health.get(*node).is_some_and(|h| !h.is_passing());
        let mut order: Vec<&NodeName> = ineligible.clone();
        let mut rest: Vec<&NodeName> = current
            .iter()
            .filter(|n| o.eligible.contains(n))
            .copied()
            .collect();
        // Unhealthy next, then the highest names (scale-up takes the lowest first).
        rest.sort_by(|a, b| unhealthy(b).cmp(&unhealthy(a)).then_with(|| b.cmp(a)));
        order.extend(rest);
        let victims: Vec<NodeName> = order.into_iter().take(n - desired).cloned().collect();
        removed.extend(victims.iter().cloned());
        p.actions.push(Action::Unschedule(victims));
    } else if n < desired {
        let need = desired - n;
        let mut candidates: Vec<NodeName> = o
            .takeover
            .iter()
            .filter(|t| !o.current.contains_key(*t) && o.eligible.contains(t))
            .take(need)
            .cloned()
            .collect();
        let taken: BTreeSet<NodeName> = candidates.iter().cloned().collect();
        candidates.extend(
            o.eligible
                .iter()
                .filter(|e| {
                    !o.current.contains_key(*e) && !o.occupied.contains(*e) && !taken.contains(*e)
                })
                .take(need - candidates.len())
                .cloned(),
        );
        if candidates.len() >= need {
            p.actions
                .push(Action::Schedule(candidates[..need].to_vec()));
        } else {
            if !candidates.is_empty() {
                p.actions.push(Action::Schedule(candidates.clone()));
            }
            let short = need - candidates.len();
            if rc.strategy == AllocationStrategy::Dynamic && !o.allocation_exhausted {
                p.actions.push(Action::Allocate(short));
            } else {
                p.unmet = Some(format!(
                    "not enough nodes: {desired} replicas desired, {n} current, {} eligible for selector \"{}\"{}",
                    o.eligible.len(),
                    rc.node_selector,
                    if rc.strategy == AllocationStrategy::Dynamic {
                        "; the scheduler could not allocate more"
                    } else {
                        ""
                    }
                ));
            }
        }
    } else if let Some(old) = ineligible.first() {
        match transfer::start(o, old, &current) {
            Ok(action) => p.actions.push(action),
            Err(why) => p.waiting = Some(why),
        }
    }

    let stale: Vec<NodeName> = o
        .current
        .iter()
        .filter(|(node, pod)| pod.as_str() != rc.pod_id() && !removed.contains(*node))
        .map(|(node, _)| node.clone())
        .collect();
    if !stale.is_empty() {
        removed.extend(stale.iter().cloned());
        p.actions.push(Action::Replace(stale));
    }
    push_repairs(o, &mut p, &removed);
    p
}

fn push_repairs(o: &Observed<'_>, p: &mut Plan, skip: &BTreeSet<NodeName>) {
    let repairs: Vec<NodeName> = o
        .bad_intents
        .iter()
        .filter(|n| o.current.contains_key(*n) && o.eligible.contains(n) && !skip.contains(*n))
        .cloned()
        .collect();
    if !repairs.is_empty() {
        p.actions.push(Action::Repair(repairs));
    }
}

mod transfer;

#[cfg(test)]
mod rules;

#[cfg(test)]
mod tests {
    use super::rules::{observed, t0};
    use super::*;
    use crate::rc::{Rc, RcId};

    fn rc(replicas: u64, strategy: &str, disabled: bool) -> Rc {
        let id = RcId::new();
        let json = format!(
            r#"{{"id":"{id}","manifest":"id: web\n","node_selector":"env=prod","pod_labels":{{}},"replicas_desired":{replicas},"disabled":{disabled},"allocation_strategy":"{strategy}"}}"#
        );
        Rc::from_kv(&id.key(), json.as_bytes(), 1).unwrap()
    }

    fn nodes(ns: &[&str]) -> BTreeSet<NodeName> {
        ns.iter().map(|s| NodeName::from(*s)).collect()
    }

    fn s(v: &[&str]) -> Vec<NodeName> {
        v.iter().map(|x| NodeName::from(*x)).collect()
    }

    /// What the farm's failsafe counts of each action: a pod that goes with nothing up in its
    /// place counts; a replacement already up, or capacity its roll paid for, does not.
    #[test]
    fn what_counts_as_a_removal() {
        let r = rc(2, "dynamic_strategy", false);
        let mut o = observed(&r, &["a", "b", "x"], &["a", "b"]);
        o.runs_other = nodes(&["b"]);
        let t = Transfer {
            old_node: "x".into(),
            new_node: "b".into(),
            id: "t".into(),
            started_at: None,
        };
        let counted = |a: &Action, o: &Observed<'_>| {
            let r = removals(a, o);
            (r.counted.len(), r.uncounted, r.harmless.len())
        };
        /// (rule, action, retiring, transfer in flight, (counted, uncounted, harmless)).
        type Row = (
            &'static str,
            Action,
            bool,
            Option<Transfer>,
            (usize, usize, usize),
        );
        let rows: Vec<Row> = vec![
            (
                "a scale-down: each pod counts",
                Action::Unschedule(s(&["x", "b"])),
                false,
                None,
                (2, 0, 0),
            ),
            (
                "a retired old RC's leftovers: its roll paid",
                Action::Unschedule(s(&["x", "b"])),
                true,
                None,
                (0, 2, 0),
            ),
            (
                "a pod of an older pod id rewritten in place",
                Action::Replace(s(&["a"])),
                false,
                None,
                (1, 0, 0),
            ),
            (
                "a repair: a running pod of another manifest counts, a missing intent does not",
                Action::Repair(s(&["a", "b"])),
                false,
                None,
                (1, 0, 1),
            ),
            (
                "a transfer's end: the new pod is up, or the old one stays",
                Action::CompleteTransfer,
                false,
                Some(t.clone()),
                (0, 1, 0),
            ),
            (
                "a transfer rolled back",
                Action::RollbackTransfer("x".into()),
                false,
                Some(t),
                (0, 1, 0),
            ),
            (
                "a transfer's start adds a pod",
                Action::StartTransfer {
                    old: "x".into(),
                    new: None,
                },
                false,
                None,
                (0, 0, 0),
            ),
            (
                "scheduling adds pods",
                Action::Schedule(s(&["a"])),
                false,
                None,
                (0, 0, 0),
            ),
        ];
        for (rule, action, retiring, transfer, want) in rows {
            o.retiring = retiring;
            o.transfer = transfer;
            assert_eq!(counted(&action, &o), want, "{rule}");
        }
    }

    #[test]
    fn node_sets_sort_dedup_and_search() {
        let set: NodeSet = s(&["c", "a", "b", "a"]).into_iter().collect();
        assert_eq!(
            set.iter().map(|n| &**n).collect::<Vec<_>>(),
            ["a", "b", "c"]
        );
        assert!(set.contains("b") && !set.contains("d") && !set.contains(""));
        assert_eq!(set.len(), 3);
        assert!(NodeSet::default().is_empty());
    }

    #[test]
    fn scales_up_onto_eligible_nodes_by_name() {
        let r = rc(3, "static_strategy", false);
        let p = plan(&observed(&r, &["b"], &["d", "c", "b", "a"]));
        assert_eq!(p.actions, [Action::Schedule(s(&["a", "c"]))]);
        assert_eq!(p.unmet, None);
    }

    #[test]
    fn static_rc_short_of_nodes_is_unmet_after_scheduling_what_it_can() {
        let r = rc(5, "static_strategy", false);
        let p = plan(&observed(&r, &["a"], &["a", "b"]));
        assert_eq!(p.actions, [Action::Schedule(s(&["b"]))]);
        let unmet = p.unmet.unwrap();
        assert!(
            unmet.contains("5 replicas desired, 1 current, 2 eligible"),
            "{unmet}"
        );
    }

    #[test]
    fn dynamic_rc_asks_to_allocate_then_reports_unmet_when_exhausted() {
        let r = rc(4, "dynamic_strategy", false);
        let mut o = observed(&r, &["a"], &["a", "b"]);
        assert_eq!(
            plan(&o).actions,
            [Action::Schedule(s(&["b"])), Action::Allocate(2)]
        );
        o.allocation_exhausted = true;
        let p = plan(&o);
        assert_eq!(p.actions, [Action::Schedule(s(&["b"]))]);
        assert!(p.unmet.is_some());
    }

    #[test]
    fn scales_down_ineligible_then_unhealthy_then_highest_names() {
        let r = rc(2, "static_strategy", false);
        let mut o = observed(
            &r,
            &["a", "b", "c", "d", "e", "x"],
            &["a", "b", "c", "d", "e"],
        );
        o.health = [
            (NodeName::from("b"), HealthStatus::Critical),
            (NodeName::from("c"), HealthStatus::Passing),
        ]
        .into();
        o.health_in_use = true;
        let p = plan(&o);
        assert_eq!(p.actions, [Action::Unschedule(s(&["x", "b", "e", "d"]))]);
    }

    #[test]
    fn zero_replicas_unschedules_everything_and_disabled_does_nothing() {
        let r = rc(0, "static_strategy", false);
        assert_eq!(
            plan(&observed(&r, &["a", "b"], &["a"])).actions,
            [Action::Unschedule(s(&["b", "a"]))]
        );
        let d = rc(0, "static_strategy", true);
        let p = plan(&observed(&d, &["a", "b"], &["a"]));
        assert!(p.is_idle());
        let d5 = rc(5, "static_strategy", true);
        assert!(plan(&observed(&d5, &[], &["a", "b"])).is_idle());
    }

    #[test]
    fn repairs_bad_intents_on_eligible_current_nodes_only() {
        let r = rc(2, "static_strategy", false);
        let mut o = observed(&r, &["a", "b"], &["a", "b"]);
        o.bad_intents = nodes(&["b", "zzz"]);
        assert_eq!(plan(&o).actions, [Action::Repair(s(&["b"]))]);
    }

    #[test]
    fn pods_of_an_older_pod_id_are_replaced_in_place() {
        let r = rc(2, "static_strategy", false);
        let mut o = observed(&r, &["a", "b"], &["a", "b"]);
        o.current.insert("b".into(), "old-web".into());
        assert_eq!(plan(&o).actions, [Action::Replace(s(&["b"]))]);
    }

    #[test]
    fn a_pod_on_an_ineligible_node_is_transferred_one_at_a_time() {
        let r = rc(3, "static_strategy", false);
        let mut o = observed(&r, &["a", "x", "y"], &["a", "b", "c"]);
        o.transfer_static = true;
        let p = plan(&o);
        assert_eq!(
            p.actions,
            [Action::StartTransfer {
                old: "x".into(),
                new: Some("b".into())
            }]
        );
        // Dynamic with no eligible spare: the transfer will allocate.
        let d = rc(1, "dynamic_strategy", false);
        assert_eq!(
            plan(&observed(&d, &["x"], &[])).actions,
            [Action::StartTransfer {
                old: "x".into(),
                new: None
            }]
        );
        // Static with no spare: nothing to move to.
        let st = rc(1, "static_strategy", false);
        let mut o = observed(&st, &["x"], &[]);
        o.transfer_static = true;
        let p = plan(&o);
        assert!(p.is_idle() && p.waiting.unwrap().contains("no eligible node"));
    }

    #[test]
    fn a_static_rcs_pod_on_an_ineligible_node_stays_as_p2_leaves_it() {
        // Whatever the strategy is spelled (P2 reads anything but dynamic_strategy as static).
        for strategy in ["static_strategy", "static", ""] {
            let r = rc(2, strategy, false);
            let mut o = observed(&r, &["a", "x"], &["a", "b"]);
            let p = plan(&o);
            assert!(p.is_idle(), "{strategy:?}: {:?}", p.actions);
            assert!(p.waiting.unwrap().contains("--transfer-static"));
            o.transfer_static = true;
            assert_eq!(
                plan(&o).actions,
                [Action::StartTransfer {
                    old: "x".into(),
                    new: Some("b".into())
                }]
            );
        }
        // Repairs and scale-down (ineligible first) still happen, as in P2.
        let r = rc(1, "static_strategy", false);
        let mut o = observed(&r, &["a", "x"], &["a", "b"]);
        o.bad_intents = nodes(&["a"]);
        assert_eq!(
            plan(&o).actions,
            [Action::Unschedule(s(&["x"])), Action::Repair(s(&["a"]))]
        );
    }

    #[test]
    fn a_held_node_transfer_lock_freezes_starts_and_transfers_in_flight() {
        let r = rc(2, "dynamic_strategy", false);
        let mut o = observed(&r, &["a", "x"], &["a", "b"]);
        o.transfer_frozen = Some("session s1".into());
        let p = plan(&o);
        assert!(p.is_idle() && p.waiting.unwrap().contains("frozen"));
        // In flight: neither completed (healthy) nor rolled back (timed out, or the old node
        // eligible again) while frozen.
        let mut o = observed(&r, &["a", "x", "b"], &["a", "b"]);
        o.transfer = Some(Transfer {
            old_node: "x".into(),
            new_node: "b".into(),
            id: "t1".into(),
            started_at: Some(t0()),
        });
        o.transfer_age = Duration::from_secs(3600);
        o.transfer_frozen = Some("session s1".into());
        let p = plan(&o);
        assert!(p.is_idle(), "{:?}", p.actions);
        assert!(
            p.waiting
                .unwrap()
                .contains("neither completed nor rolled back")
        );
        o.transfer_frozen = None;
        assert_eq!(plan(&o).actions, [Action::CompleteTransfer]);
    }

    #[test]
    fn transfer_waits_for_the_other_pods_to_be_healthy() {
        let r = rc(2, "static_strategy", false);
        let mut o = observed(&r, &["a", "x"], &["a", "b"]);
        o.transfer_static = true;
        o.health_in_use = true;
        o.health = [
            (NodeName::from("a"), HealthStatus::Warning),
            (NodeName::from("x"), HealthStatus::Passing),
        ]
        .into();
        assert!(plan(&o).is_idle());
        o.health.insert("a".into(), HealthStatus::Passing);
        assert_eq!(
            plan(&o).actions,
            [Action::StartTransfer {
                old: "x".into(),
                new: Some("b".into())
            }]
        );
        // An unhealthy pod on the ineligible node may move regardless.
        o.health = [
            (NodeName::from("a"), HealthStatus::Critical),
            (NodeName::from("x"), HealthStatus::Critical),
        ]
        .into();
        assert!(!plan(&o).is_idle());
        o.mutation_locked_elsewhere = true;
        assert!(plan(&o).is_idle());
    }

    #[test]
    fn transfer_in_flight_completes_when_healthy_and_rolls_back_on_timeout_or_change() {
        let r = rc(2, "dynamic_strategy", false);
        let mut o = observed(&r, &["a", "x", "n"], &["a", "n"]);
        o.health_in_use = true;
        o.transfer = Some(Transfer {
            old_node: "x".into(),
            new_node: "n".into(),
            id: "t1".into(),
            started_at: Some(t0()),
        });
        let p = plan(&o);
        assert!(p.is_idle() && p.waiting.is_some(), "waits for health");
        o.health.insert("n".into(), HealthStatus::Passing);
        assert_eq!(plan(&o).actions, [Action::CompleteTransfer]);
        o.health.clear();
        o.transfer_age = Duration::from_secs(301);
        assert!(
            matches!(&plan(&o).actions[..], [Action::RollbackTransfer(r)] if r.contains("not healthy"))
        );
        o.transfer_age = Duration::ZERO;
        o.eligible = nodes(&["a", "n", "x"]).into_iter().collect();
        assert!(
            matches!(&plan(&o).actions[..], [Action::RollbackTransfer(r)] if r.contains("eligible again"))
        );
        let r3 = rc(3, "dynamic_strategy", false);
        o.rc = &r3;
        o.eligible = nodes(&["a", "n"]).into_iter().collect();
        assert!(
            matches!(&plan(&o).actions[..], [Action::RollbackTransfer(r)] if r.contains("replicas changed"))
        );
        // Without health reports at all, the new pod counts as healthy at once.
        o.rc = &r;
        o.health_in_use = false;
        assert_eq!(plan(&o).actions, [Action::CompleteTransfer]);
    }

    #[test]
    fn growing_takes_over_the_rolled_rcs_nodes_first_and_never_another_rcs_pod() {
        let r = rc(2, "static_strategy", false);
        let mut o = observed(&r, &[], &["a", "b", "c", "d"]);
        // The old RC of a roll runs on c and d; another RC with this pod id on a.
        o.takeover = vec!["d".into(), "c".into()];
        o.occupied = nodes(&["a", "c", "d"]);
        assert_eq!(
            plan(&o).actions,
            vec![Action::Schedule(vec!["d".into(), "c".into()])],
            "takeover nodes in the order given (unhealthy first)"
        );
        let r3 = rc(3, "static_strategy", false);
        let mut o = observed(&r3, &[], &["a", "b", "c", "d"]);
        o.takeover = vec!["c".into()];
        o.occupied = nodes(&["a", "c"]);
        assert_eq!(
            plan(&o).actions,
            vec![Action::Schedule(vec!["c".into(), "b".into(), "d".into()])],
            "then eligible nodes no other RC's pod of this id is on"
        );
        // A takeover node that is not eligible for this RC is not taken.
        let mut o = observed(&r, &[], &["a", "b"]);
        o.takeover = vec!["z".into()];
        assert_eq!(
            plan(&o).actions,
            vec![Action::Schedule(vec!["a".into(), "b".into()])]
        );
    }

    #[test]
    fn a_transfer_without_a_start_keeps_the_first_one_it_was_given() {
        let t = |id: &str, at: Option<DateTime<Utc>>| Transfer {
            old_node: "a".into(),
            new_node: "b".into(),
            id: id.into(),
            started_at: at,
        };
        let (t1, t2) = (t0(), t0() + chrono::Duration::seconds(600));
        // Rows: what Consul holds, what the task knew, when it reads → the start it uses.
        let cases = [
            (
                t("x", None),
                None,
                t1,
                t1,
                "first read of a P2 transfer: from now",
            ),
            (
                t("x", None),
                Some(t("x", Some(t1))),
                t2,
                t1,
                "re-read: the start already given",
            ),
            (
                t("y", None),
                Some(t("x", Some(t1))),
                t2,
                t2,
                "another transfer: from now",
            ),
            (t("x", Some(t1)), None, t2, t1, "its own start wins"),
            (
                t("x", Some(t1)),
                Some(t("x", Some(t2))),
                t2,
                t1,
                "its own start wins over ours",
            ),
        ];
        for (stored, known, now, want, why) in cases {
            let got = Transfer::resumed(Some(stored), known.as_ref(), now).unwrap();
            assert_eq!(got.started_at, Some(want), "{why}");
        }
        assert_eq!(Transfer::resumed(None, Some(&t("x", Some(t1))), t2), None);
        // A P2 transfer's JSON has no start; written back, ours has one.
        let p2: Transfer =
            serde_json::from_str(r#"{"old_node":"a","new_node":"b","id":"x"}"#).unwrap();
        assert_eq!(p2.started_at, None);
    }
}

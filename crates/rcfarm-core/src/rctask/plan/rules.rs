//! The RC planner's rules, one row each: the situation (an RC, where its pods are, which nodes
//! are eligible, and what else is observed) → the actions, and whether the RC is unmet or
//! waiting and why. Read top to bottom, this is what an RC task does; P2's
//! `replication_controller.go` behaves the same wherever it has the case.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::{Action, Observed, Plan, Transfer, plan};
use crate::health::HealthStatus;
use crate::rc::{Rc, RcId};
use crate::scheduler::NodeName;

pub(super) fn t0() -> DateTime<Utc> {
    DateTime::parse_from_rfc3339("2026-01-01T00:00:00Z")
        .unwrap()
        .with_timezone(&Utc)
}

fn names(v: &[&str]) -> Vec<NodeName> {
    v.iter().map(|x| NodeName::from(*x)).collect()
}

fn set(v: &[&str]) -> BTreeSet<NodeName> {
    names(v).into_iter().collect()
}

/// A transfer from `old` to `new`, started `ago` seconds before the row's now, and its age.
fn transfer(old: &str, new: &str, ago: i64) -> (Option<Transfer>, Duration) {
    (
        Some(Transfer {
            old_node: old.into(),
            new_node: new.into(),
            id: "t1".into(),
            started_at: Some(t0() - chrono::Duration::seconds(ago)),
        }),
        Duration::from_secs(ago as u64),
    )
}

fn health(v: &[(&str, HealthStatus)]) -> BTreeMap<NodeName, HealthStatus> {
    v.iter().map(|(n, h)| (NodeName::from(*n), *h)).collect()
}

use HealthStatus::{Critical, Passing, Warning};

/// What a row expects besides the actions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Then {
    /// Neither unmet nor waiting.
    Fine,
    /// Unmet, the reason containing this.
    Unmet(&'static str),
    /// Waiting, the reason containing this.
    Waiting(&'static str),
}

struct Row {
    rule: &'static str,
    /// Replicas desired, `dynamic_strategy` or not, disabled.
    rc: (u64, bool, bool),
    current: &'static [&'static str],
    eligible: &'static [&'static str],
    /// The rest of the situation.
    and: fn(&mut Observed<'_>),
    want: Vec<Action>,
    then: Then,
}

fn nothing(_: &mut Observed<'_>) {}

fn schedule(v: &[&str]) -> Action {
    Action::Schedule(names(v))
}
fn unschedule(v: &[&str]) -> Action {
    Action::Unschedule(names(v))
}
fn start(old: &str, new: Option<&str>) -> Action {
    Action::StartTransfer {
        old: old.into(),
        new: new.map(NodeName::from),
    }
}
fn rollback(why: &str) -> Action {
    Action::RollbackTransfer(why.into())
}

fn rc(replicas: u64, dynamic: bool, disabled: bool) -> Rc {
    let id = RcId::new();
    let strategy = if dynamic {
        "dynamic_strategy"
    } else {
        "static_strategy"
    };
    let json = format!(
        r#"{{"id":"{id}","manifest":"id: web\n","node_selector":"env=prod","pod_labels":{{}},"replicas_desired":{replicas},"disabled":{disabled},"allocation_strategy":"{strategy}"}}"#
    );
    Rc::from_kv(&id.key(), json.as_bytes(), 1).unwrap()
}

#[rustfmt::skip]
fn rows() -> Vec<Row> {
    const STATIC: bool = false;
    const DYNAMIC: bool = true;
    vec![
        // Scaling.
        Row { rule: "a disabled RC changes nothing, whatever it lacks",
              rc: (3, STATIC, true), current: &[], eligible: &["a", "b", "c"], and: nothing,
              want: vec![], then: Then::Waiting("disabled") },
        Row { rule: "as many pods as desired on eligible nodes: nothing to do",
              rc: (2, STATIC, false), current: &["a", "b"], eligible: &["a", "b", "c"], and: nothing,
              want: vec![], then: Then::Fine },
        Row { rule: "short: schedule on the free eligible nodes, lowest names first",
              rc: (3, STATIC, false), current: &["b"], eligible: &["d", "c", "b", "a"], and: nothing,
              want: vec![schedule(&["a", "c"])], then: Then::Fine },
        Row { rule: "short: never a node where another RC runs this pod id",
              rc: (2, STATIC, false), current: &[], eligible: &["a", "b", "c"], and: |o| o.occupied = set(&["a"]),
              want: vec![schedule(&["b", "c"])], then: Then::Fine },
        Row { rule: "short: a rolled RC's given-up pods first, in place",
              rc: (2, STATIC, false), current: &[], eligible: &["a", "b", "c"], and: |o| { o.takeover = names(&["c"]); o.occupied = set(&["c"]) },
              want: vec![schedule(&["c", "a"])], then: Then::Fine },
        Row { rule: "static and short of eligible nodes: schedule what it can, and it is unmet",
              rc: (5, STATIC, false), current: &["a"], eligible: &["a", "b"], and: nothing,
              want: vec![schedule(&["b"])], then: Then::Unmet("5 replicas desired, 1 current, 2 eligible") },
        Row { rule: "dynamic and short: schedule what it can and ask the scheduler for the rest",
              rc: (4, DYNAMIC, false), current: &["a"], eligible: &["a", "b"], and: nothing,
              want: vec![schedule(&["b"]), Action::Allocate(2)], then: Then::Fine },
        Row { rule: "dynamic and short after the scheduler gave what it could: unmet",
              rc: (4, DYNAMIC, false), current: &["a"], eligible: &["a", "b"], and: |o| o.allocation_exhausted = true,
              want: vec![schedule(&["b"])], then: Then::Unmet("the scheduler could not allocate more") },
        Row { rule: "too many: remove pods on ineligible nodes first, then unhealthy, then the highest names",
              rc: (2, STATIC, false), current: &["a", "b", "c", "d", "e", "x"], eligible: &["a", "b", "c", "d", "e"],
              and: |o| { o.health_in_use = true; o.health = health(&[("b", Critical), ("c", Passing)]) },
              want: vec![unschedule(&["x", "b", "e", "d"])], then: Then::Fine },
        Row { rule: "zero replicas: every pod goes",
              rc: (0, STATIC, false), current: &["a", "b"], eligible: &["a"], and: nothing,
              want: vec![unschedule(&["b", "a"])], then: Then::Fine },

        // Pods that are not as they should be.
        Row { rule: "an intent missing or unlike the manifest on an eligible node: rewritten",
              rc: (2, STATIC, false), current: &["a", "b"], eligible: &["a", "b"], and: |o| o.bad_intents = set(&["b", "gone"]),
              want: vec![Action::Repair(names(&["b"]))], then: Then::Fine },
        Row { rule: "a pod of an older pod id: replaced in place",
              rc: (2, STATIC, false), current: &["a", "b"], eligible: &["a", "b"], and: |o| { o.current.insert("b".into(), "old-web".into()); },
              want: vec![Action::Replace(names(&["b"]))], then: Then::Fine },
        Row { rule: "a pod being removed is not repaired too",
              rc: (1, STATIC, false), current: &["a", "b"], eligible: &["a", "b"], and: |o| o.bad_intents = set(&["a", "b"]),
              want: vec![unschedule(&["b"]), Action::Repair(names(&["a"]))], then: Then::Fine },

        // Moving a pod off a node that is no longer eligible (one at a time).
        Row { rule: "dynamic, a pod on an ineligible node: moved to the lowest free eligible node",
              rc: (2, DYNAMIC, false), current: &["a", "x"], eligible: &["a", "b", "c"], and: nothing,
              want: vec![start("x", Some("b"))], then: Then::Fine },
        Row { rule: "dynamic with no free eligible node: moved to a node the scheduler will allocate",
              rc: (1, DYNAMIC, false), current: &["x"], eligible: &[], and: nothing,
              want: vec![start("x", None)], then: Then::Fine },
        Row { rule: "static: the pod stays where it is, as P2 leaves it",
              rc: (2, STATIC, false), current: &["a", "x"], eligible: &["a", "b"], and: nothing,
              want: vec![], then: Then::Waiting("--transfer-static") },
        Row { rule: "static with --transfer-static: moved like a dynamic RC's",
              rc: (2, STATIC, false), current: &["a", "x"], eligible: &["a", "b"], and: |o| o.transfer_static = true,
              want: vec![start("x", Some("b"))], then: Then::Fine },
        Row { rule: "static with --transfer-static and no free eligible node: nowhere to go",
              rc: (1, STATIC, false), current: &["x"], eligible: &[], and: |o| o.transfer_static = true,
              want: vec![], then: Then::Waiting("no eligible node") },
        Row { rule: "a transfer never moves onto a pod another RC gave up (taking those over is its roll's new RC's)",
              rc: (2, DYNAMIC, false), current: &["a", "x"], eligible: &["a", "b", "c"], and: |o| o.takeover = names(&["b"]),
              want: vec![start("x", Some("c"))], then: Then::Fine },
        Row { rule: "someone holds P2's node-transfer lock: no transfer starts",
              rc: (2, DYNAMIC, false), current: &["a", "x"], eligible: &["a", "b"], and: |o| o.transfer_frozen = Some("session s1".into()),
              want: vec![], then: Then::Waiting("frozen") },
        Row { rule: "another session holds the mutation lock (a rolling update): no transfer starts",
              rc: (2, DYNAMIC, false), current: &["a", "x"], eligible: &["a", "b"], and: |o| o.mutation_locked_elsewhere = true,
              want: vec![], then: Then::Waiting("mutation lock") },
        Row { rule: "a rolling update names the RC: no transfer starts, even with the mutation lock free (between two farms carrying the roll)",
              rc: (2, DYNAMIC, false), current: &["a", "x"], eligible: &["a", "b"], and: |o| o.in_roll = Some("rolling update r1".into()),
              want: vec![], then: Then::Waiting("no node transfer starts until it ends") },
        Row { rule: "a healthy pod waits to move until the RC's other pods are healthy",
              rc: (2, DYNAMIC, false), current: &["a", "x"], eligible: &["a", "b"],
              and: |o| { o.health_in_use = true; o.health = health(&[("a", Warning), ("x", Passing)]) },
              want: vec![], then: Then::Waiting("other pods to be healthy") },
        Row { rule: "an unhealthy pod moves whatever the others' health",
              rc: (2, DYNAMIC, false), current: &["a", "x"], eligible: &["a", "b"],
              and: |o| { o.health_in_use = true; o.health = health(&[("a", Critical), ("x", Critical)]) },
              want: vec![start("x", Some("b"))], then: Then::Fine },

        // A transfer in flight (old pod kept until the new one is healthy).
        Row { rule: "in flight, the new pod healthy: completed (the old pod goes)",
              rc: (2, DYNAMIC, false), current: &["a", "x", "b"], eligible: &["a", "b"],
              and: |o| { (o.transfer, o.transfer_age) = transfer("x", "b", 10); o.health_in_use = true; o.health = health(&[("b", Passing)]) },
              want: vec![Action::CompleteTransfer], then: Then::Fine },
        Row { rule: "in flight, nothing reports health: completed at once",
              rc: (2, DYNAMIC, false), current: &["a", "x", "b"], eligible: &["a", "b"], and: |o| (o.transfer, o.transfer_age) = transfer("x", "b", 0),
              want: vec![Action::CompleteTransfer], then: Then::Fine },
        Row { rule: "in flight, the new pod not healthy yet: wait",
              rc: (2, DYNAMIC, false), current: &["a", "x", "b"], eligible: &["a", "b"],
              and: |o| { (o.transfer, o.transfer_age) = transfer("x", "b", 10); o.health_in_use = true; o.health = health(&[("b", Warning)]) },
              want: vec![], then: Then::Waiting("waiting for the new pod to pass its health check") },
        Row { rule: "in flight, not healthy within the timeout: rolled back",
              rc: (2, DYNAMIC, false), current: &["a", "x", "b"], eligible: &["a", "b"],
              and: |o| { (o.transfer, o.transfer_age) = transfer("x", "b", 301); o.health_in_use = true; o.health = health(&[("b", Warning)]) },
              want: vec![rollback("the new pod on b was not healthy within 300s")], then: Then::Fine },
        Row { rule: "in flight, the new pod gone: rolled back",
              rc: (2, DYNAMIC, false), current: &["a", "x"], eligible: &["a", "b"], and: |o| (o.transfer, o.transfer_age) = transfer("x", "b", 10),
              want: vec![rollback("the new pod on b is gone")], then: Then::Fine },
        Row { rule: "in flight, the old pod already gone: as good as completed",
              rc: (2, DYNAMIC, false), current: &["a", "b"], eligible: &["a", "b"], and: |o| (o.transfer, o.transfer_age) = transfer("x", "b", 10),
              want: vec![Action::CompleteTransfer], then: Then::Fine },
        Row { rule: "in flight, the replica count changed: rolled back",
              rc: (3, DYNAMIC, false), current: &["a", "x", "b"], eligible: &["a", "b", "c"], and: |o| (o.transfer, o.transfer_age) = transfer("x", "b", 10),
              want: vec![rollback("replicas changed to 3 during the transfer")], then: Then::Fine },
        Row { rule: "in flight, the old node eligible again: rolled back",
              rc: (2, DYNAMIC, false), current: &["a", "x", "b"], eligible: &["a", "b", "x"], and: |o| (o.transfer, o.transfer_age) = transfer("x", "b", 10),
              want: vec![rollback("x is eligible again")], then: Then::Fine },
        Row { rule: "in flight, the new node no longer eligible: rolled back",
              rc: (2, DYNAMIC, false), current: &["a", "x", "b"], eligible: &["a"], and: |o| (o.transfer, o.transfer_age) = transfer("x", "b", 10),
              want: vec![rollback("b is no longer eligible")], then: Then::Fine },
        Row { rule: "in flight, the mutation lock held elsewhere (a roll took it after a handover): it ends all the same, needing no lock",
              rc: (2, DYNAMIC, false), current: &["a", "x", "b"], eligible: &["a", "b"],
              and: |o| { (o.transfer, o.transfer_age) = transfer("x", "b", 10); o.mutation_locked_elsewhere = true; o.health_in_use = true; o.health = health(&[("b", Passing)]) },
              want: vec![Action::CompleteTransfer], then: Then::Fine },
        Row { rule: "in flight, the replicas changed by a roll holding the mutation lock: rolled back, needing no lock",
              rc: (0, DYNAMIC, false), current: &["a", "x", "b"], eligible: &["a", "b"],
              and: |o| { (o.transfer, o.transfer_age) = transfer("x", "b", 10); o.mutation_locked_elsewhere = true },
              want: vec![rollback("replicas changed to 0 during the transfer")], then: Then::Fine },
        Row { rule: "in flight while the node-transfer lock is held: neither completed nor rolled back",
              rc: (2, DYNAMIC, false), current: &["a", "x", "b"], eligible: &["a", "b"],
              and: |o| { (o.transfer, o.transfer_age) = transfer("x", "b", 3600); o.transfer_frozen = Some("session s1".into()) },
              want: vec![], then: Then::Waiting("neither completed nor rolled back") },
    ]
}

/// The situation of `rc` with pods (of its pod id) on `current`, `eligible` nodes, and
/// nothing else of note.
pub(super) fn observed<'a>(rc: &'a Rc, current: &[&str], eligible: &[&str]) -> Observed<'a> {
    Observed {
        rc,
        current: current
            .iter()
            .map(|n| (NodeName::from(*n), "web".to_string()))
            .collect(),
        eligible: names(eligible).into_iter().collect(),
        health: BTreeMap::new(),
        health_in_use: false,
        bad_intents: BTreeSet::new(),
        transfer: None,
        takeover: Vec::new(),
        occupied: BTreeSet::new(),
        labels_seen: BTreeMap::new(),
        allocation_exhausted: false,
        mutation_locked_elsewhere: false,
        transfer_static: false,
        transfer_frozen: None,
        transfer_age: Duration::ZERO,
        transfer_timeout: Duration::from_secs(300),
        runs_other: BTreeSet::new(),
        retiring: false,
        in_roll: None,
    }
}

fn then_of(p: &Plan) -> (Option<&str>, Option<&str>) {
    (p.unmet.as_deref(), p.waiting.as_deref())
}

#[test]
fn the_rules() {
    for row in rows() {
        let (replicas, dynamic, disabled) = row.rc;
        let rc = rc(replicas, dynamic, disabled);
        let mut o = observed(&rc, row.current, row.eligible);
        (row.and)(&mut o);
        let p = plan(&o);
        assert_eq!(p.actions, row.want, "{}", row.rule);
        let (unmet, waiting) = then_of(&p);
        match row.then {
            Then::Fine => assert!(unmet.is_none() && waiting.is_none(), "{}: {p:?}", row.rule),
            Then::Unmet(why) => {
                assert!(
                    unmet.is_some_and(|u| u.contains(why)),
                    "{}: {p:?}",
                    row.rule
                )
            }
            Then::Waiting(why) => {
                assert!(unmet.is_none(), "{}: {p:?}", row.rule);
                assert!(
                    waiting.is_some_and(|w| w.contains(why)),
                    "{}: {p:?}",
                    row.rule
                )
            }
        }
    }
}

//! The roll planner's rules, one row each: the situation (the roll's target and minimum, the
//! old and new RCs' pods, locks, and what operators did) → the next step, or why the roll
//! waits. Read top to bottom, this is what a rolling update does; the replica arithmetic is
//! P2's `rollAlgorithm` (its own cases are in the unit tests beside this file).

use std::time::Duration;

use super::{LockState, RcCounts, RollAction, RollObserved, WaitKind, plan};
use crate::rc::RcId;
use crate::roll::Update;

/// An RC of the roll: `desired`, `current` pods of which `healthy` run its manifest and pass.
pub(super) fn rc(desired: u64, current: u64, healthy: u64, disabled: bool) -> RcCounts {
    RcCounts {
        desired,
        disabled,
        current,
        real: healthy,
        healthy,
        unknown: desired.saturating_sub(current),
        failing: 0,
    }
}

/// An RC of the roll whose `current` pods all run its manifest and fail their health check.
fn all_failing(desired: u64, current: u64, disabled: bool) -> RcCounts {
    RcCounts {
        real: current,
        failing: current,
        ..rc(desired, current, 0, disabled)
    }
}

/// The roll `u` with these RCs, both mutation locks ours, started if its old RC is disabled,
/// and nothing else of note.
pub(super) fn observe(u: &Update, old: RcCounts, new: RcCounts) -> RollObserved<'_> {
    RollObserved {
        update: u,
        old: Ok(old),
        new: Ok(new),
        old_lock: LockState::Ours,
        new_lock: LockState::Ours,
        conflict: None,
        transfer: None,
        ready_for: Duration::ZERO,
        started: old.disabled,
        old_missing: false,
        paused: None,
        max_parallel: None,
        failed: None,
        canary: None,
        removal_room: None,
        tripped: None,
        old_served_by: None,
    }
}

#[derive(Debug)]
enum Want {
    Act(RollAction),
    Wait(WaitKind, &'static str),
}

struct Row {
    rule: &'static str,
    /// The roll's target replicas, minimum healthy, and whether it leaves the old RC.
    roll: (u64, u64, bool),
    /// Old and new RC.
    old: RcCounts,
    new: RcCounts,
    /// The rest of the situation (the roll as `update`, started, both locks ours).
    and: fn(&mut RollObserved<'_>),
    want: Want,
}

fn nothing(_: &mut RollObserved<'_>) {}

fn step(add: u64, remove: u64, old_to: u64) -> Want {
    Want::Act(RollAction::Step {
        add,
        remove,
        old_to,
    })
}

const ON: bool = false;
const OFF: bool = true;

#[rustfmt::skip]
fn rows() -> Vec<Row> {
    use WaitKind::*;
    vec![
        // Before anything: what stops a roll.
        Row { rule: "its old RC is gone and its new RC exists: the roll is deleted (P2), paused or not",
              roll: (4, 3, false), old: rc(4, 4, 4, OFF), new: rc(0, 0, 0, ON),
              and: |o| { o.old_missing = true; o.paused = Some("paused".into()) },
              want: Want::Act(RollAction::DeleteOrphan) },
        Row { rule: "failed: no step until an operator resumes or aborts it",
              roll: (4, 3, false), old: rc(4, 4, 4, OFF), new: rc(0, 0, 0, ON), and: |o| o.failed = Some("deadline".into()),
              want: Want::Wait(Failed, "deadline") },
        Row { rule: "paused: no step, not even a lock",
              roll: (4, 3, false), old: rc(4, 4, 4, OFF), new: rc(0, 0, 0, ON),
              and: |o| { o.paused = Some("paused by alice".into()); o.old_lock = LockState::Free },
              want: Want::Wait(Paused, "alice") },
        Row { rule: "another roll shares an RC and goes first: blocked",
              roll: (4, 3, false), old: rc(4, 4, 4, OFF), new: rc(0, 0, 0, ON), and: |o| o.conflict = Some("roll X goes first".into()),
              want: Want::Wait(Blocked, "roll X goes first") },
        Row { rule: "its old RC cannot be read: blocked",
              roll: (4, 3, false), old: rc(4, 4, 4, OFF), new: rc(0, 0, 0, ON), and: |o| o.old = Err("invalid JSON".into()),
              want: Want::Wait(Blocked, "invalid JSON") },
        Row { rule: "its new RC is missing: blocked (P2 leaves such a roll alone)",
              roll: (4, 3, false), old: rc(4, 4, 4, OFF), new: rc(0, 0, 0, ON), and: |o| o.new = Err("missing".into()),
              want: Want::Wait(Blocked, "new RC") },
        Row { rule: "another session holds an RC's mutation lock: wait",
              roll: (4, 3, false), old: rc(4, 4, 4, OFF), new: rc(0, 0, 0, ON), and: |o| o.new_lock = LockState::Elsewhere("s2".into()),
              want: Want::Wait(Lock, "held by s2") },
        Row { rule: "a node transfer is in flight on one of its RCs: no lock taken until it ends (it needs none to end)",
              roll: (4, 3, false), old: rc(4, 4, 4, OFF), new: rc(0, 0, 0, ON),
              and: |o| { o.old_lock = LockState::Free; o.transfer = Some("a node transfer is in flight on the old RC".into()) },
              want: Want::Wait(Transfer, "in flight on the old RC") },
        Row { rule: "a transfer in flight does not stop a roll that holds its locks",
              roll: (4, 3, false), old: rc(4, 4, 4, OFF), new: rc(0, 0, 0, ON), and: |o| o.transfer = Some("in flight".into()),
              want: step(1, 1, 3) },
        Row { rule: "the mutation locks are free: take them first",
              roll: (4, 3, false), old: rc(4, 4, 4, OFF), new: rc(0, 0, 0, ON), and: |o| o.old_lock = LockState::Free,
              want: Want::Act(RollAction::Lock) },

        // Starting.
        Row { rule: "not started: disable the old RC and enable the new one",
              roll: (4, 3, false), old: rc(4, 4, 4, ON), new: rc(0, 0, 0, OFF), and: |o| o.started = false,
              want: Want::Act(RollAction::Start { disable_old: true, enable_new: true, adopt: 0 }) },
        Row { rule: "not started, the new RC disabled with more pods than it wants (a revert's, which a failed roll placed elsewhere): it takes them back as it starts, removing none",
              roll: (4, 3, false), old: rc(3, 3, 3, ON), new: rc(1, 2, 2, OFF), and: |o| o.started = false,
              want: Want::Act(RollAction::Start { disable_old: true, enable_new: true, adopt: 1 }) },
        Row { rule: "not started, the new RC disabled with more pods than the roll's target: it takes back up to the target",
              roll: (2, 1, false), old: rc(1, 1, 1, ON), new: rc(1, 3, 3, OFF), and: |o| o.started = false,
              want: Want::Act(RollAction::Start { disable_old: true, enable_new: true, adopt: 1 }) },
        Row { rule: "not started, the new RC disabled with fewer pods than it wants: enabled (it adds them; nothing goes)",
              roll: (4, 3, false), old: rc(3, 3, 3, ON), new: rc(1, 0, 0, OFF), and: |o| o.started = false,
              want: Want::Act(RollAction::Start { disable_old: true, enable_new: true, adopt: 0 }) },
        Row { rule: "started, and someone enabled the old RC again: the roll does not fight them",
              roll: (4, 3, false), old: rc(4, 4, 4, ON), new: rc(0, 0, 0, ON), and: nothing,
              want: Want::Wait(Blocked, "the old RC was enabled again") },
        Row { rule: "started, and someone disabled the new RC: the roll does not fight them",
              roll: (4, 3, false), old: rc(4, 4, 4, OFF), new: rc(0, 0, 0, OFF), and: nothing,
              want: Want::Wait(Blocked, "the new RC was disabled") },

        // Steps.
        Row { rule: "a step moves as many replicas as the healthy pods above the minimum allow",
              roll: (4, 3, false), old: rc(4, 4, 4, OFF), new: rc(0, 0, 0, ON), and: nothing,
              want: step(1, 1, 3) },
        Row { rule: "no minimum: everything at once",
              roll: (4, 0, false), old: rc(4, 4, 4, OFF), new: rc(0, 0, 0, ON), and: nothing,
              want: step(4, 4, 0) },
        Row { rule: "max parallel caps a step below what the minimum allows",
              roll: (4, 0, false), old: rc(4, 4, 4, OFF), new: rc(0, 0, 0, ON), and: |o| o.max_parallel = Some(2),
              want: step(2, 2, 2) },
        Row { rule: "a disabled old RC counts the pods it has, not those it wants: the missing one is added, nothing taken down",
              roll: (4, 3, false), old: rc(4, 3, 3, OFF), new: rc(0, 0, 0, ON), and: nothing,
              want: step(1, 0, 3) },
        Row { rule: "old pods failing their health check hold up nothing: a revert from a failed deploy onto an RC below the minimum replaces them (P2 would wait for ever)",
              roll: (3, 2, false), old: all_failing(3, 3, OFF), new: rc(0, 0, 0, ON), and: nothing,
              want: step(1, 1, 2) },
        Row { rule: "failing old pods are headroom beside the healthy ones",
              roll: (3, 2, false), old: all_failing(2, 2, OFF), new: rc(1, 1, 1, ON), and: nothing,
              want: step(1, 1, 1) },
        Row { rule: "the minimum cannot be kept with the pods as they are, all settled: say so",
              roll: (4, 5, false), old: rc(4, 4, 4, OFF), new: rc(0, 0, 0, ON), and: nothing,
              want: Want::Wait(MinimumUnreachable, "lower the roll's minimum or add capacity") },
        Row { rule: "the last step's new pods are not healthy yet: wait for health",
              roll: (4, 3, false), old: rc(3, 3, 3, OFF), new: rc(1, 1, 0, ON), and: nothing,
              want: Want::Wait(Health, "waiting for health") },
        Row { rule: "the roll delay counts from when a step became safe",
              roll: (4, 3, false), old: rc(3, 3, 3, OFF), new: rc(1, 1, 1, ON),
              and: |o| { o.ready_for = Duration::from_secs(5) },
              want: Want::Wait(Delay, "roll delay") },
        Row { rule: "the roll delay over: the step",
              roll: (4, 3, false), old: rc(3, 3, 3, OFF), new: rc(1, 1, 1, ON),
              and: |o| { o.ready_for = Duration::from_secs(60) },
              want: step(1, 1, 2) },

        // Canaries and the farm's removal budget.
        Row { rule: "a canary of 2: no more new pods than the canary, whatever the minimum allows",
              roll: (4, 0, false), old: rc(4, 4, 4, OFF), new: rc(0, 0, 0, ON), and: |o| o.canary = Some(2),
              want: step(2, 2, 2) },
        Row { rule: "the canary's pods scheduled, not all up: wait for them",
              roll: (4, 0, false), old: rc(2, 2, 2, OFF), new: rc(2, 2, 1, ON), and: |o| o.canary = Some(2),
              want: Want::Wait(Health, "canary: 1 of 2") },
        Row { rule: "the canary's pods all up: pause until an operator promotes the roll",
              roll: (4, 0, false), old: rc(2, 2, 2, OFF), new: rc(2, 2, 2, ON), and: |o| o.canary = Some(2),
              want: Want::Act(RollAction::CanaryPause { up: 2 }) },
        Row { rule: "a canary as big as the roll is no canary",
              roll: (4, 0, false), old: rc(4, 4, 4, OFF), new: rc(0, 0, 0, ON), and: |o| o.canary = Some(4),
              want: step(4, 4, 0) },
        Row { rule: "a step replaces pods under the minimum: the removal budget does not hold it",
              roll: (4, 0, false), old: rc(4, 4, 4, OFF), new: rc(0, 0, 0, ON), and: |o| o.removal_room = Some((0, "budget spent".into())),
              want: step(4, 4, 0) },
        Row { rule: "the tripwire holds a step that takes pods down",
              roll: (4, 0, false), old: rc(4, 4, 4, OFF), new: rc(0, 0, 0, ON), and: |o| o.tripped = Some("failsafe tripped: every RC went to 0".into()),
              want: Want::Wait(RemovalsHeld, "failsafe tripped") },
        Row { rule: "the tripwire lets a growing step add what replaces nothing",
              roll: (4, 0, false), old: rc(2, 2, 2, OFF), new: rc(0, 0, 0, ON), and: |o| o.tripped = Some("failsafe tripped".into()),
              want: step(2, 0, 2) },

        // The end.
        Row { rule: "the new RC has its target, not all healthy: wait for them",
              roll: (4, 3, false), old: rc(0, 0, 0, OFF), new: rc(4, 4, 3, ON), and: nothing,
              want: Want::Wait(Health, "3 of 4 new pods healthy") },
        Row { rule: "the new RC has its target, all healthy, the old RC has no pods: complete",
              roll: (4, 3, false), old: rc(0, 0, 0, OFF), new: rc(4, 4, 4, ON), and: nothing,
              want: Want::Act(RollAction::Complete) },
        Row { rule: "the new RC done, the old kept pods the new ones replaced elsewhere: retire it, nothing charged",
              roll: (4, 3, false), old: rc(0, 2, 2, OFF), new: rc(4, 4, 4, ON), and: nothing,
              want: Want::Act(RollAction::RetireOld { old_to: 0, charge: 0 }) },
        Row { rule: "a roll onto fewer replicas: the old pods beyond the new count are lost capacity, charged as the old RC is retired",
              roll: (3, 2, false), old: rc(2, 2, 2, OFF), new: rc(3, 3, 3, ON), and: nothing,
              want: Want::Act(RollAction::RetireOld { old_to: 0, charge: 2 }) },
        Row { rule: "room for one of two: the old RC is retired down to the one held back",
              roll: (3, 2, false), old: rc(2, 2, 2, OFF), new: rc(3, 3, 3, ON), and: |o| o.removal_room = Some((1, "budget".into())),
              want: Want::Act(RollAction::RetireOld { old_to: 1, charge: 1 }) },
        Row { rule: "no room for the lost capacity: wait (RemovalsHeld), not a stall",
              roll: (3, 2, false), old: rc(2, 2, 2, OFF), new: rc(3, 3, 3, ON), and: |o| o.removal_room = Some((0, "budget spent".into())),
              want: Want::Wait(RemovalsHeld, "budget spent") },
        Row { rule: "the tripwire holds the retirement",
              roll: (4, 3, false), old: rc(0, 2, 2, OFF), new: rc(4, 4, 4, ON), and: |o| o.tripped = Some("failsafe tripped".into()),
              want: Want::Wait(RemovalsHeld, "failsafe tripped") },
        Row { rule: "the new RC done, the old retired and removing its pods: wait for it",
              roll: (4, 3, false), old: rc(0, 1, 1, ON), new: rc(4, 4, 4, ON),
              and: |o| o.old_served_by = Some("farm f2".into()),
              want: Want::Wait(Pods, "remove its 1 remaining pods (served by farm f2)") },
        Row { rule: "leave_old: complete with the old RC's pods left where they are",
              roll: (4, 3, true), old: rc(1, 1, 1, OFF), new: rc(4, 4, 4, ON), and: nothing,
              want: Want::Act(RollAction::Complete) },
        Row { rule: "resumed at its end with the new RC never enabled: enable it, and only it",
              roll: (4, 3, false), old: rc(0, 0, 0, ON), new: rc(4, 4, 4, OFF), and: |o| o.started = false,
              want: Want::Act(RollAction::Start { disable_old: false, enable_new: true, adopt: 0 }) },
    ]
}

#[test]
fn the_rules() {
    for row in rows() {
        let (desired, minimum, leave_old) = row.roll;
        let update = Update {
            old_rc: RcId::new(),
            new_rc: RcId::new(),
            desired_replicas: desired,
            minimum_replicas: minimum,
            leave_old,
            roll_delay: Duration::from_secs(30),
        };
        let mut o = observe(&update, row.old, row.new);
        // Ready long enough for the roll delay unless a row says otherwise.
        o.ready_for = Duration::from_secs(3600);
        o.started = true;
        (row.and)(&mut o);
        let p = plan(&o);
        match &row.want {
            Want::Act(a) => {
                assert_eq!(p.action.as_ref(), Some(a), "{}: {p:?}", row.rule);
                assert_eq!(p.waiting, None, "{}", row.rule);
            }
            Want::Wait(kind, why) => {
                assert_eq!(p.action, None, "{}: {p:?}", row.rule);
                let (k, w) = p
                    .waiting
                    .clone()
                    .unwrap_or((WaitKind::Blocked, String::new()));
                assert_eq!(k, *kind, "{}: {w}", row.rule);
                assert!(w.contains(why), "{}: {w:?} lacks {why:?}", row.rule);
            }
        }
    }
}

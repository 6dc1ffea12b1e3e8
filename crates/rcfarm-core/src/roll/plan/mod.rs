//! What a rolling update should do next, decided from what is observed. Pure: no I/O, the
//! clock is an input, so every decision is unit-tested (the RC task's `plan` is the model).
//!
//! The algorithm is P2's (`pkg/roll/run_update.go`): the old RC is disabled and the new one
//! enabled, then replicas move from the old RC to the new in steps. The new RC's pods replace
//! the old ones in place (same node, same pod id), so a step assumes each pod it adds takes an
//! old one down: it never moves more than the healthy pods above the minimum allow. Only pods
//! that run the RC's own manifest (per `reality/`) and pass their health check count.

use std::time::Duration;

use serde::Serialize;

use super::record::Update;
use crate::health::HealthStatus;

/// One RC of the roll as the planner counts it (P2's `rcNodeCounts`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RcCounts {
    pub desired: u64,
    pub disabled: bool,
    /// Pods labelled with the RC.
    pub current: u64,
    /// Current pods whose node runs this RC's manifest (per `reality/`).
    pub real: u64,
    /// Real pods that pass their health check.
    pub healthy: u64,
    /// Real pods without a health result, plus desired pods not yet scheduled.
    pub unknown: u64,
    /// Real pods whose health check says they fail (critical or warning): what taking them
    /// down loses no healthy capacity.
    pub failing: u64,
}

impl RcCounts {
    /// Counts an RC's pods as P2 does: a pod is real when its node runs the RC's manifest
    /// (`runs`: the digest `reality/` shows), and only real pods' health counts.
    pub fn count(
        desired: u64,
        disabled: bool,
        manifest_digest: &str,
        pods: impl IntoIterator<Item = (Option<String>, Option<HealthStatus>)>,
    ) -> RcCounts {
        let mut c = RcCounts {
            desired,
            disabled,
            ..Default::default()
        };
        for (runs, health) in pods {
            c.current += 1;
            if runs.as_deref() != Some(manifest_digest) {
                continue;
            }
            c.real += 1;
            match health {
                Some(h) if h.is_passing() => c.healthy += 1,
                None | Some(HealthStatus::Unknown) => c.unknown += 1,
                Some(_) => c.failing += 1,
            }
        }
        c.unknown += c.desired.saturating_sub(c.current);
        c
    }
}

/// Who holds one RC's mutation lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockState {
    /// This roll (this farm's session, with the roll's holder value).
    Ours,
    Free,
    /// Another session, or this farm's session for something else (a node transfer).
    Elsewhere(String),
}

/// Everything the planner looks at.
#[derive(Debug, Clone)]
pub struct RollObserved<'a> {
    pub update: &'a Update,
    /// `Err` says why the RC cannot be used (missing, invalid).
    pub old: Result<RcCounts, String>,
    pub new: Result<RcCounts, String>,
    pub old_lock: LockState,
    pub new_lock: LockState,
    /// Another roll that shares an RC with this one and goes first.
    pub conflict: Option<String>,
    /// A node transfer in flight on one of the roll's RCs, in words (which, where, and when it
    /// ends): the roll takes no mutation lock until it ends, which it does without one.
    pub transfer: Option<String>,
    /// How long a step has been possible without interruption, on the monotonic clock (kept
    /// by the worker; the roll delay counts from there, as P2 sleeps `RollDelay` once a step
    /// is safe).
    pub ready_for: Duration,
    /// Whether the roll has started (disabled its old RC and enabled its new one), per its
    /// labels: a roll starts once; an RC flipped back afterwards was someone's decision.
    pub started: bool,
    /// The old RC's key is absent (confirmed by a read of its own, not only the farm's view).
    pub old_missing: bool,
    /// An operator paused the roll (`rcctl roll pause`): who and when, in words. `Err`: its
    /// control record cannot be read, which pauses it too (never a step nobody can stop).
    pub paused: Option<String>,
    /// At most this many pods replaced (added and removed) per step (`--max-parallel`).
    pub max_parallel: Option<u64>,
    /// The roll failed (its progress deadline passed): why. Terminal until an operator acts.
    pub failed: Option<String>,
    /// A canary not yet promoted: replace this many pods, wait until they are up, then pause.
    pub canary: Option<u64>,
    /// How much lost capacity the farm's removal budget lets the roll's end take away now,
    /// and why no more (`--max-removals`); `None`: no limit. A step replaces pods under the
    /// roll's minimum and never counts; the old RC's pods the roll did not replace (a roll
    /// onto fewer replicas) do, when it retires the old RC.
    pub removal_room: Option<(u64, String)>,
    /// Why the farm's tripwire holds every removal now, if it does: no step, no retirement.
    pub tripped: Option<String>,
    /// Who serves the old RC (its ownership lock's holder), for what the roll waits on.
    pub old_served_by: Option<String>,
}

/// One step, applied as one fenced transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RollAction {
    /// Take both RCs' mutation locks (no node transfers, no other roll, during the roll).
    Lock,
    /// Disable the old RC (the new one replaces its pods in place) and enable the new one,
    /// moving `adopt` replicas from the old RC to the new one first: pods the new RC runs
    /// beyond what it wants, taken back rather than removed.
    Start {
        disable_old: bool,
        enable_new: bool,
        adopt: u64,
    },
    /// Move replicas: the new RC's count rises by `add`; the old one's becomes `old_to` (its
    /// count less `remove`, counted from the pods it has when it has fewer than it wants: a
    /// disabled RC never makes up the difference).
    Step { add: u64, remove: u64, old_to: u64 },
    /// The new RC is complete but the old one still has pods it did not hand over: enable it
    /// at `old_to` (0 unless the removal budget holds some of its lost capacity back) so it
    /// removes them, charging the budget `charge` pods of lost capacity: the old RC's pods that
    /// no new pod replaced (a roll onto fewer replicas). Its other leftovers were replaced by
    /// the roll's new pods (up, as the roll is done) and cost nothing.
    RetireOld { old_to: u64, charge: u64 },
    /// Delete the roll (and the old RC, unless `LeaveOld`).
    Complete,
    /// Delete the roll, whose old RC does not exist, and leave the new RC as it is: what P2's
    /// roll farm does with such a roll (most likely one whose completion deleted the old RC
    /// but not the roll). Nothing is scheduled or unscheduled by it.
    DeleteOrphan,
    /// The canary's pods are all up: pause the roll until an operator promotes it.
    CanaryPause { up: u64 },
}

/// Why a roll waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WaitKind {
    /// An RC of the roll is missing or invalid, or another roll goes first.
    Blocked,
    /// Another session holds a mutation lock (named, with what lets it go).
    Lock,
    /// A node transfer is in flight on one of the roll's RCs: it ends by itself (its new pod
    /// passes, or its timeout rolls it back), needing no lock.
    Transfer,
    /// Pods must pass their health checks (or reach reality) before the next step.
    Health,
    /// Healthy pods can never exceed the minimum as things are: no step is possible until
    /// the minimum is lowered or capacity added.
    MinimumUnreachable,
    /// The roll delay runs.
    Delay,
    /// Pods must come or go (a disabled new RC settling, the old RC removing leftovers).
    Pods,
    /// An operator paused the roll; it takes no step until resumed.
    Paused,
    /// The roll failed; it takes no step until an operator resumes or aborts it.
    Failed,
    /// The farm's removal budget is spent (or its failsafe tripped): the next step waits for
    /// the window to allow it, or an operator's `rcctl farm release-removals`. Not a stall,
    /// and not counted toward the progress deadline.
    RemovalsHeld,
}

impl WaitKind {
    /// Waits that cannot end by themselves: alerted at once, not after the stall timeout.
    pub fn is_stuck(self) -> bool {
        matches!(self, WaitKind::Blocked | WaitKind::MinimumUnreachable)
    }
}

/// What the roll does next, or why it waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RollPlan {
    pub action: Option<RollAction>,
    pub waiting: Option<(WaitKind, String)>,
    /// A replica step is safe now (the roll delay may still hold it back).
    pub step_ready: bool,
}

impl RollPlan {
    fn act(a: RollAction) -> RollPlan {
        RollPlan {
            action: Some(a),
            waiting: None,
            step_ready: false,
        }
    }

    fn wait(kind: WaitKind, why: impl Into<String>) -> RollPlan {
        RollPlan {
            action: None,
            waiting: Some((kind, why.into())),
            step_ready: false,
        }
    }
}

/// Decides the next step.
pub fn plan(o: &RollObserved<'_>) -> RollPlan {
    let u = o.update;
    // P2's order: a roll whose new RC is missing is left alone (below: blocked); one whose
    // new RC exists and old RC does not is deleted, whatever else holds.
    if o.old_missing && o.new.is_ok() {
        return RollPlan::act(RollAction::DeleteOrphan);
    }
    // Before anything that writes, locks included: a paused roll holds what it holds and
    // takes nothing more. (A roll whose old RC is gone is deleted all the same, as P2 does.)
    if let Some(f) = &o.failed {
        return RollPlan::wait(WaitKind::Failed, f.clone());
    }
    if let Some(p) = &o.paused {
        return RollPlan::wait(WaitKind::Paused, p.clone());
    }
    if let Some(c) = &o.conflict {
        return RollPlan::wait(WaitKind::Blocked, c.clone());
    }
    let old = match &o.old {
        Ok(c) => *c,
        Err(why) => {
            return RollPlan::wait(WaitKind::Blocked, format!("old RC {}: {why}", u.old_rc));
        }
    };
    let new = match &o.new {
        Ok(c) => *c,
        Err(why) => {
            return RollPlan::wait(WaitKind::Blocked, format!("new RC {}: {why}", u.new_rc));
        }
    };
    for (which, id, lock) in [
        ("old", u.old_rc, &o.old_lock),
        ("new", u.new_rc, &o.new_lock),
    ] {
        if let LockState::Elsewhere(holder) = lock {
            return RollPlan::wait(
                WaitKind::Lock,
                format!("the mutation lock of the {which} RC {id} is held by {holder}"),
            );
        }
    }
    if o.old_lock != LockState::Ours || o.new_lock != LockState::Ours {
        // A transfer in flight ends without the mutation lock; a roll that took it would
        // step an RC whose pod count the transfer still changes.
        if let Some(t) = &o.transfer {
            return RollPlan::wait(WaitKind::Transfer, t.clone());
        }
        return RollPlan::act(RollAction::Lock);
    }

    // Done? (Checked before starting: a roll resumed at its end must not disable an old RC
    // that is removing its last pods.)
    let target = u.desired_replicas;
    if new.desired >= target {
        if new.disabled {
            if o.started {
                return intervened("the new RC was disabled");
            }
            return RollPlan::act(RollAction::Start {
                disable_old: false,
                enable_new: true,
                adopt: 0,
            });
        }
        if new.healthy < target {
            return RollPlan::wait(
                WaitKind::Health,
                format!(
                    "{} of {target} new pods healthy; waiting for the rest to pass their health checks",
                    new.healthy
                ),
            );
        }
        if u.leave_old || old.current == 0 {
            return RollPlan::act(RollAction::Complete);
        }
        if old.desired > 0 || old.disabled {
            if let Some(why) = &o.tripped {
                return RollPlan::wait(WaitKind::RemovalsHeld, why.clone());
            }
            // The old RC's pods no new pod replaced: what it still wants, of what it has.
            let lost = old.desired.min(old.current);
            let charge = match &o.removal_room {
                Some((room, why)) if *room < lost => {
                    if *room == 0 {
                        return RollPlan::wait(WaitKind::RemovalsHeld, why.clone());
                    }
                    *room
                }
                _ => lost,
            };
            return RollPlan::act(RollAction::RetireOld {
                old_to: lost - charge,
                charge,
            });
        }
        return RollPlan::wait(
            WaitKind::Pods,
            format!(
                "waiting for the old RC {} to remove its {} remaining pods{}",
                u.old_rc,
                old.current,
                o.old_served_by
                    .as_ref()
                    .map(|f| format!(" (served by {f})"))
                    .unwrap_or_default()
            ),
        );
    }

    if o.started && new.disabled {
        return intervened("the new RC was disabled");
    }
    if o.started && !old.disabled {
        return intervened("the old RC was enabled again");
    }
    if !old.disabled || new.disabled {
        // Enabling a disabled new RC that has more pods than it wants would make it remove
        // them at once (P2 waits for them to match, for ever: a disabled RC changes nothing).
        // Those pods are the ones it gave up to the roll a revert undoes, that the failed new
        // RC placed elsewhere rather than in place: the start takes them back, as replicas
        // moved from the old RC, in the same transaction that disables the old RC (which so
        // removes nothing), up to the roll's target.
        let adopt = if new.disabled && new.current > new.desired {
            new.current.min(target).saturating_sub(new.desired)
        } else {
            0
        };
        return RollPlan::act(RollAction::Start {
            disable_old: !old.disabled,
            enable_new: new.disabled,
            adopt,
        });
    }

    // The old RC is disabled: it will never schedule the pods it wants but lacks, so it counts
    // as what it has. And it may not have removed a pod it no longer wants yet: count no more
    // healthy old pods than it desires, or the minimum could be broken.
    let old_desired = old.desired.min(old.current);
    let old_healthy = old.healthy.min(old_desired);
    // Old pods that fail their health check hold up nothing: replacing them takes no healthy
    // pod down (the new RC takes over not-passing pods first). Without this, a revert from a
    // failed deploy whose pods all fail, onto an RC left with fewer healthy pods than the
    // minimum, could never take a step (P2's arithmetic counts only healthy pods): chaos on
    // real Consul saw one wait 95 s, until the run ended.
    let old_failing = old.failing.min(old_desired.saturating_sub(old_healthy));
    // (P2's arithmetic counts old pods only as headroom above the minimum: a failing one is
    // headroom.)
    let (remove, add) = roll_algorithm(
        old_healthy + old_failing,
        new.healthy,
        old_desired,
        new.desired,
        target,
        u.minimum_replicas,
    );
    // Fewer than the minimum allows is always safe: fewer pods down, fewer new pods to wait for.
    let (remove, add) = match o.max_parallel {
        Some(n) => (remove.min(n), add.min(n)),
        None => (remove, add),
    };
    // A canary larger than the roll is no canary (rcctl refuses one; a hand-written control
    // record is read as P2 would: an ordinary roll).
    let canary = o.canary.filter(|k| *k > 0 && *k < target);
    let (remove, add) = match canary {
        Some(k) if new.desired >= k => {
            if new.healthy >= k {
                return RollPlan::act(RollAction::CanaryPause { up: new.healthy });
            }
            return RollPlan::wait(
                WaitKind::Health,
                format!(
                    "canary: {} of {k} canary pods up; waiting for the rest to run the new manifest and pass their health checks",
                    new.healthy
                ),
            );
        }
        // Never more new pods than the canary, whatever the minimum and pace allow.
        Some(k) => (remove.min(k - new.desired), add.min(k - new.desired)),
        None => (remove, add),
    };
    // A step replaces pods under the roll's minimum: no lost capacity, nothing charged to the
    // farm's budget. A tripped failsafe holds it like every removal (growing still goes).
    let (remove, add) = match &o.tripped {
        Some(why) if remove > 0 => {
            let add = add.saturating_sub(remove);
            if add == 0 {
                return RollPlan::wait(WaitKind::RemovalsHeld, why.clone());
            }
            (0, add)
        }
        _ => (remove, add),
    };
    if add == 0 && remove == 0 {
        let min = u.minimum_replicas;
        let healthy = old_healthy + new.healthy;
        let settled = old.unknown == 0
            && new.unknown == 0
            && old.healthy == old.current
            && new.healthy == new.current
            && new.current >= new.desired;
        return if settled {
            RollPlan::wait(
                WaitKind::MinimumUnreachable,
                format!(
                    "cannot take a pod down: the minimum is {min} and only {healthy} pods are healthy \
                     ({old_healthy} old + {} new), all of them settled; lower the roll's minimum or add capacity",
                    new.healthy
                ),
            )
        } else {
            RollPlan::wait(
                WaitKind::Health,
                format!(
                    "waiting for health: {old_healthy} old + {} new pods healthy, the minimum is {min} \
                     ({} old and {} new pods not healthy or not yet running their manifest)",
                    new.healthy,
                    old.current.saturating_sub(old.healthy),
                    new.current.saturating_sub(new.healthy)
                        + new.desired.saturating_sub(new.current)
                ),
            )
        };
    }
    if new.desired > 0 && !u.roll_delay.is_zero() {
        let ready_for = o.ready_for;
        if ready_for < u.roll_delay {
            return RollPlan {
                action: None,
                waiting: Some((
                    WaitKind::Delay,
                    format!(
                        "roll delay: next step (+{add} new, -{remove} old) in {:.1}s",
                        (u.roll_delay - ready_for).as_secs_f64()
                    ),
                )),
                step_ready: true,
            };
        }
    }
    RollPlan {
        action: Some(RollAction::Step {
            add,
            remove,
            old_to: old_desired.saturating_sub(remove),
        }),
        waiting: None,
        step_ready: true,
    }
}

/// What a look at a roll does to its progress deadline's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadlineClock {
    /// It starts again: the roll moved, an operator paused it, or a step is ready (the roll
    /// delay runs).
    Restart,
    /// It stops, keeping what it counted: the roll waits on something else than its new pods
    /// (a lock, a transfer, held removals, the old RC, an operator), or does not wait.
    Pause,
    /// It runs: the roll waits on new pods it scheduled that are not up.
    Count,
}

/// The progress deadline counts only time in which the roll waited on its own new pods: a roll
/// whose scheduled new pods are all up is never failed (nor reverted) by it, whatever it waits
/// for.
pub fn deadline_clock(waiting: Option<WaitKind>, new: Option<RcCounts>) -> DeadlineClock {
    match waiting {
        Some(WaitKind::Paused | WaitKind::Delay | WaitKind::Failed) => DeadlineClock::Restart,
        Some(WaitKind::Health) if new.is_some_and(|c| c.healthy < c.desired) => {
            DeadlineClock::Count
        }
        _ => DeadlineClock::Pause,
    }
}

/// Someone changed an RC of a started roll: the roll does not fight them.
fn intervened(what: &str) -> RollPlan {
    RollPlan::wait(
        WaitKind::Blocked,
        format!(
            "{what} after the roll started; the roll waits rather than undo it: undo the change, or abort the roll (rcctl roll abort)"
        ),
    )
}

/// P2's `rollAlgorithm`: how many replicas to remove from the old RC and add to the new one,
/// given the healthy pods of each, their desired counts, the roll's target and its minimum.
/// Both zero when the roll is done, or when taking a pod down could break the minimum.
pub fn roll_algorithm(
    old_healthy: u64,
    new_healthy: u64,
    old_desired: u64,
    new_desired: u64,
    target: u64,
    min_healthy: u64,
) -> (u64, u64) {
    let (old, new) = (old_healthy as i64, new_healthy as i64);
    let (old_desired, new_desired) = (old_desired as i64, new_desired as i64);
    let (target, min) = (target as i64, min_healthy as i64);
    // Healthy pods above the minimum: how many may go down at once.
    let mut headroom = old + new - min;
    // Growing capacity schedules pods that replace nothing: they add headroom.
    let mut increase = target - (old_desired + new_desired);
    if increase > 0 {
        headroom += increase;
    } else {
        increase = 0;
    }
    let remaining = target - new_desired;
    if remaining <= 0 {
        return (0, 0);
    }
    if new >= min {
        // The new pods alone satisfy the minimum.
        return ((remaining - increase).max(0) as u64, remaining as u64);
    }
    if headroom <= 0 {
        return (0, 0);
    }
    let add = remaining.min(headroom);
    ((add - increase).max(0) as u64, add as u64)
}

#[cfg(test)]
mod rules;

#[cfg(test)]
mod tests {
    use super::rules::{observe, rc as counts};
    use super::*;
    use crate::rc::RcId;

    /// P2's `uniformRollAlgorithm`: old + new desired equal the target (P2 lets the old
    /// count go negative when new exceeds the target; counts here floor at 0).
    fn uniform(old: u64, new: u64, want: u64, need: u64) -> u64 {
        let (remove, add) = roll_algorithm(old, new, want.saturating_sub(new), new, want, need);
        assert_eq!(remove, add);
        add
    }

    #[test]
    fn p2s_roll_algorithm_cases() {
        // Cases of P2's update_test.go, as data.
        assert_eq!(uniform(1, 1, 3, 4), 0, "below minimum");
        assert_eq!(uniform(1, 1, 2, 4), 0, "at minimum");
        assert_eq!(uniform(1, 4, 3, 4), 0, "done");
        assert_eq!(
            uniform(2, 2, 6, 3),
            1,
            "schedule the difference above the minimum"
        );
        assert_eq!(
            uniform(1, 3, 6, 3),
            3,
            "minimum satisfied by new: all the rest"
        );
        assert_eq!(uniform(3, 0, 6, 0), 6, "no minimum");
        assert_eq!(
            roll_algorithm(1, 1, 1, 2, 3, 1),
            (1, 1),
            "does not exceed the target"
        );
        let same = |o, n, f, need| roll_algorithm(o, n, o, n, f, need);
        assert_eq!(same(0, 0, 3, 2), (0, 1), "capacity from zero");
        assert_eq!(same(0, 1, 3, 2), (0, 1));
        assert_eq!(same(0, 2, 3, 2), (0, 1));
        assert_eq!(same(0, 0, 3, 0), (0, 3));
        assert_eq!(same(3, 0, 4, 2), (1, 2), "growing with existing nodes");
        assert_eq!(same(3, 0, 4, 3), (0, 1), "growing with no headroom");
    }

    fn update(desired: u64, minimum: u64) -> Update {
        Update {
            old_rc: RcId::new(),
            new_rc: RcId::new(),
            desired_replicas: desired,
            minimum_replicas: minimum,
            leave_old: false,
            roll_delay: Duration::ZERO,
        }
    }

    #[test]
    fn a_canary_replaces_k_pods_under_the_minimum_then_pauses_until_promoted() {
        let step = |o: &RollObserved<'_>| match plan(o).action {
            Some(RollAction::Step { add, remove, .. }) => (add, remove),
            other => panic!("expected a step, got {other:?} ({:?})", plan(o).waiting),
        };
        // 4 pods, at least 3 healthy: one at a time, the canary of 2 included.
        let u = update(4, 3);
        let mut o = observe(&u, counts(4, 4, 4, true), counts(0, 0, 0, false));
        o.canary = Some(2);
        assert_eq!(step(&o), (1, 1), "the minimum still holds for the canary");
        o.old = Ok(counts(3, 3, 3, true));
        o.new = Ok(counts(1, 1, 1, false));
        assert_eq!(step(&o), (1, 1));
        // Both canary pods scheduled, one up: no third pod, wait for it.
        o.old = Ok(counts(2, 2, 2, true));
        o.new = Ok(counts(2, 2, 1, false));
        let p = plan(&o);
        assert_eq!(p.action, None);
        let (kind, why) = p.waiting.unwrap();
        assert_eq!(kind, WaitKind::Health);
        assert!(why.starts_with("canary: 1 of 2 canary pods up"), "{why}");
        // Both up: pause.
        o.new = Ok(counts(2, 2, 2, false));
        assert_eq!(plan(&o).action, Some(RollAction::CanaryPause { up: 2 }));
        // Promoted: the rest of the roll.
        o.canary = None;
        assert_eq!(step(&o), (1, 1));

        // A minimum of 0 would move all 4 at once; the canary moves 2.
        let u = update(4, 0);
        let mut o = observe(&u, counts(4, 4, 4, true), counts(0, 0, 0, false));
        o.canary = Some(2);
        assert_eq!(step(&o), (2, 2));
        o.max_parallel = Some(1);
        assert_eq!(step(&o), (1, 1), "the pace applies to the canary too");
        // A canary as large as the roll is no canary.
        o.max_parallel = None;
        o.canary = Some(4);
        assert_eq!(step(&o), (4, 4));
    }

    #[test]
    fn a_paused_roll_takes_no_step_and_resumes_from_the_counts() {
        let u = update(4, 3);
        // Mid-roll: one pod moved, the next step possible.
        let old = counts(3, 3, 3, true);
        let new = counts(1, 1, 1, false);
        let mut o = observe(&u, old, new);
        let step = plan(&o).action;
        assert!(matches!(step, Some(RollAction::Step { .. })), "{step:?}");
        o.paused = Some("paused by rcctl:ops@host".into());
        let p = plan(&o);
        assert_eq!(p.action, None);
        assert_eq!(
            p.waiting,
            Some((WaitKind::Paused, "paused by rcctl:ops@host".into()))
        );
        assert!(!p.step_ready, "the roll delay starts again after a resume");
        // Nor a lock it lacks, nor the start.
        o.old_lock = LockState::Free;
        assert_eq!(plan(&o).action, None);
        let mut o = observe(&u, counts(4, 4, 4, false), counts(0, 0, 0, false));
        o.paused = Some("paused".into());
        assert_eq!(plan(&o).action, None);
        // Resumed: the same step as before the pause, from the RCs' counts.
        o = observe(&u, old, new);
        assert_eq!(plan(&o).action, step);
        // A failed roll takes no step either, paused or not.
        let mut f = observe(&u, old, new);
        f.failed = Some("no new pod became up for 10m".into());
        assert_eq!(plan(&f).action, None);
        assert_eq!(plan(&f).waiting.unwrap().0, WaitKind::Failed);
        // A roll whose old RC is gone is deleted even while paused, as P2 would.
        let mut o = observe(&u, old, new);
        o.paused = Some("paused".into());
        o.old_missing = true;
        assert_eq!(plan(&o).action, Some(RollAction::DeleteOrphan));
    }

    fn step(add: u64, remove: u64, old_to: u64) -> Option<RollAction> {
        Some(RollAction::Step {
            add,
            remove,
            old_to,
        })
    }

    /// The progress deadline counts only waits on the roll's own new pods.
    #[test]
    fn the_deadline_counts_only_waits_on_new_pods() {
        use DeadlineClock::*;
        let some_down = Some(counts(2, 2, 1, false));
        let all_up = Some(counts(2, 2, 2, false));
        let rows = [
            (
                "new pods not up: counts",
                Some(WaitKind::Health),
                some_down,
                Count,
            ),
            (
                "health of the old pods with every new pod up: no failure of the deploy",
                Some(WaitKind::Health),
                all_up,
                Pause,
            ),
            (
                "a lock held elsewhere",
                Some(WaitKind::Lock),
                some_down,
                Pause,
            ),
            (
                "a node transfer in flight",
                Some(WaitKind::Transfer),
                some_down,
                Pause,
            ),
            (
                "removals held by the budget or the tripwire",
                Some(WaitKind::RemovalsHeld),
                some_down,
                Pause,
            ),
            (
                "blocked by an RC or another roll",
                Some(WaitKind::Blocked),
                some_down,
                Pause,
            ),
            (
                "the old RC removing its leftovers",
                Some(WaitKind::Pods),
                all_up,
                Pause,
            ),
            (
                "the minimum out of reach",
                Some(WaitKind::MinimumUnreachable),
                all_up,
                Pause,
            ),
            ("a step taken or ready", None, some_down, Pause),
            (
                "paused: starts again on resume",
                Some(WaitKind::Paused),
                some_down,
                Restart,
            ),
            (
                "the roll delay: a step is ready",
                Some(WaitKind::Delay),
                some_down,
                Restart,
            ),
            (
                "failed: another deadline on resume",
                Some(WaitKind::Failed),
                some_down,
                Restart,
            ),
        ];
        for (rule, waiting, new, want) in rows {
            assert_eq!(deadline_clock(waiting, new), want, "{rule}");
        }
    }

    #[test]
    fn max_parallel_caps_each_step_below_what_the_minimum_allows() {
        // A minimum of 0 would replace all four pods at once.
        let u = update(4, 0);
        let mut o = observe(&u, counts(4, 4, 4, true), counts(0, 0, 0, false));
        assert_eq!(plan(&o).action, step(4, 4, 0));
        o.max_parallel = Some(1);
        assert_eq!(plan(&o).action, step(1, 1, 3));
        // Where the minimum allows fewer, the minimum decides.
        let u = update(4, 3);
        let mut o = observe(&u, counts(4, 4, 4, true), counts(0, 0, 0, false));
        o.max_parallel = Some(2);
        assert_eq!(plan(&o).action, step(1, 1, 3));
    }

    #[test]
    fn steps_are_not_charged_and_only_the_tripwire_holds_them() {
        let u = update(4, 0);
        let mut o = observe(&u, counts(4, 4, 4, true), counts(0, 0, 0, false));
        o.removal_room = Some((0, "removals held: farm a removed 5".into()));
        assert_eq!(
            plan(&o).action,
            step(4, 4, 0),
            "a spent budget holds no step"
        );
        o.tripped = Some("failsafe tripped: every RC went to 0".into());
        let p = plan(&o);
        assert_eq!(p.action, None);
        assert_eq!(p.waiting.unwrap().0, WaitKind::RemovalsHeld);
        // Growing capacity removes nothing: a tripped failsafe still lets those pods be added.
        let mut o = observe(&u, counts(2, 2, 2, true), counts(0, 0, 0, false));
        assert_eq!(plan(&o).action, step(4, 2, 0));
        o.tripped = Some("held".into());
        assert_eq!(plan(&o).action, step(2, 0, 2));
    }

    #[test]
    fn locks_then_starts_then_steps() {
        let u = update(3, 2);
        let old = counts(3, 3, 3, false);
        let new = counts(0, 0, 0, false);
        let mut o = observe(&u, old, new);
        o.old_lock = LockState::Free;
        assert_eq!(plan(&o).action, Some(RollAction::Lock));
        o.new_lock = LockState::Elsewhere("session s (p2-rctl)".into());
        let p = plan(&o);
        assert_eq!(p.action, None);
        assert_eq!(p.waiting.unwrap().0, WaitKind::Lock);
        let o = observe(&u, old, new);
        assert_eq!(
            plan(&o).action,
            Some(RollAction::Start {
                disable_old: true,
                enable_new: false,
                adopt: 0
            })
        );
        let o = observe(&u, counts(3, 3, 3, true), new);
        assert_eq!(
            plan(&o).action,
            Some(RollAction::Step {
                add: 1,
                remove: 1,
                old_to: 2
            })
        );
    }

    #[test]
    fn waits_for_health_and_alerts_when_the_minimum_is_unreachable() {
        let u = update(3, 2);
        // One step made, the new pod not healthy yet: 2 old healthy = minimum.
        let o = observe(&u, counts(2, 2, 2, true), counts(1, 1, 0, false));
        let p = plan(&o);
        assert_eq!(p.action, None);
        assert_eq!(p.waiting.as_ref().unwrap().0, WaitKind::Health);
        // Minimum 3 of 3: nothing can ever go down.
        let u = update(3, 3);
        let o = observe(&u, counts(3, 3, 3, true), counts(0, 0, 0, false));
        let p = plan(&o);
        assert_eq!(p.waiting.as_ref().unwrap().0, WaitKind::MinimumUnreachable);
        assert!(p.waiting.unwrap().0.is_stuck());
    }

    #[test]
    fn completes_only_when_the_new_rc_is_healthy_and_retires_leftovers() {
        let u = update(3, 2);
        let o = observe(&u, counts(0, 0, 0, true), counts(3, 3, 2, false));
        assert_eq!(plan(&o).waiting.unwrap().0, WaitKind::Health);
        let o = observe(&u, counts(0, 0, 0, true), counts(3, 3, 3, false));
        assert_eq!(plan(&o).action, Some(RollAction::Complete));
        // The new RC placed a pod elsewhere: the old one kept a pod; it must go first.
        let o = observe(&u, counts(0, 1, 1, true), counts(3, 3, 3, false));
        assert_eq!(
            plan(&o).action,
            Some(RollAction::RetireOld {
                old_to: 0,
                charge: 0
            })
        );
        let o = observe(&u, counts(0, 1, 1, false), counts(3, 3, 3, false));
        assert_eq!(plan(&o).waiting.unwrap().0, WaitKind::Pods);
        let leave = Update {
            leave_old: true,
            ..u
        };
        let o = observe(&leave, counts(0, 1, 1, true), counts(3, 3, 3, false));
        assert_eq!(plan(&o).action, Some(RollAction::Complete));
    }

    #[test]
    fn a_resumed_roll_at_its_end_does_not_disable_the_retiring_old_rc() {
        let u = update(2, 1);
        let o = observe(&u, counts(0, 1, 1, false), counts(2, 2, 2, false));
        assert_ne!(
            plan(&o).action,
            Some(RollAction::Start {
                disable_old: true,
                enable_new: false,
                adopt: 0
            })
        );
    }

    #[test]
    fn a_disabled_new_rc_takes_its_extra_pods_back_as_it_is_enabled() {
        let u = update(3, 1);
        let mut o = observe(&u, counts(3, 3, 3, true), counts(1, 2, 2, true));
        o.started = false;
        assert_eq!(
            plan(&o).action,
            Some(RollAction::Start {
                disable_old: false,
                enable_new: true,
                adopt: 1
            })
        );
        let mut o = observe(&u, counts(3, 3, 3, true), counts(1, 1, 1, true));
        o.started = false;
        assert_eq!(
            plan(&o).action,
            Some(RollAction::Start {
                disable_old: false,
                enable_new: true,
                adopt: 0
            })
        );
    }

    #[test]
    fn roll_delay_holds_a_ready_step_back() {
        let u = Update {
            roll_delay: Duration::from_secs(10),
            ..update(3, 1)
        };
        let mut o = observe(&u, counts(2, 2, 2, true), counts(1, 1, 1, false));
        let p = plan(&o);
        assert!(p.step_ready);
        assert_eq!(p.waiting.unwrap().0, WaitKind::Delay);
        o.ready_for = Duration::from_secs(11);
        assert!(matches!(plan(&o).action, Some(RollAction::Step { .. })));
        // No delay before the first step (nothing new to prove yet), as in P2.
        let o = observe(&u, counts(3, 3, 3, true), counts(0, 0, 0, false));
        assert!(matches!(plan(&o).action, Some(RollAction::Step { .. })));
    }

    #[test]
    fn old_pods_above_the_old_desire_are_not_counted() {
        // The old RC wants 1 but still shows 3 healthy: count 1, or two could go at once.
        let u = update(3, 2);
        let o = observe(&u, counts(1, 3, 3, true), counts(2, 2, 1, false));
        // 1 old + 1 new healthy = 2 = minimum: wait.
        assert_eq!(plan(&o).action, None);
    }

    #[test]
    fn a_started_roll_does_not_fight_an_operator() {
        let u = update(3, 2);
        let mut o = observe(&u, counts(2, 2, 2, false), counts(1, 1, 1, false));
        o.started = true;
        let p = plan(&o);
        assert_eq!(p.action, None);
        let (kind, why) = p.waiting.unwrap();
        assert_eq!(kind, WaitKind::Blocked);
        assert!(why.contains("old RC was enabled again"), "{why}");
        let mut o = observe(&u, counts(2, 2, 2, true), counts(1, 1, 1, true));
        o.started = true;
        assert!(plan(&o).waiting.unwrap().1.contains("new RC was disabled"));
        // Before it started, the same states are what it sets right.
        let mut o = observe(&u, counts(3, 3, 3, false), counts(0, 0, 0, true));
        o.started = false;
        assert_eq!(
            plan(&o).action,
            Some(RollAction::Start {
                disable_old: true,
                enable_new: true,
                adopt: 0
            })
        );
    }

    #[test]
    fn missing_rcs_and_conflicts_block() {
        let u = update(3, 2);
        let mut o = observe(&u, counts(3, 3, 3, false), counts(0, 0, 0, false));
        o.old = Err("does not exist".into());
        let p = plan(&o);
        assert_eq!(p.waiting.as_ref().unwrap().0, WaitKind::Blocked);
        assert!(p.waiting.unwrap().1.contains("does not exist"));
        let mut o = observe(&u, counts(3, 3, 3, false), counts(0, 0, 0, false));
        o.conflict = Some("shares RC x with roll y".into());
        assert_eq!(plan(&o).waiting.unwrap().0, WaitKind::Blocked);
    }

    #[test]
    fn a_roll_whose_old_rc_is_gone_is_deleted_and_one_whose_new_rc_is_gone_waits() {
        let u = update(3, 2);
        let mut o = observe(&u, counts(3, 3, 3, false), counts(1, 1, 1, false));
        o.old = Err("does not exist".into());
        o.old_missing = true;
        // Whatever else holds: another roll first, locks elsewhere (P2 checks nothing else).
        o.conflict = Some("shares RC x with roll y".into());
        o.new_lock = LockState::Elsewhere("session s".into());
        assert_eq!(plan(&o).action, Some(RollAction::DeleteOrphan));
        // Both gone: P2 leaves the roll alone (it never claims it).
        o.new = Err("does not exist".into());
        let p = plan(&o);
        assert_eq!(p.action, None);
        assert_eq!(p.waiting.unwrap().0, WaitKind::Blocked);
    }

    /// A model of a roll's world: nodes whose pods belong to the old or the new RC, start
    /// (taking some ticks) and pass or fail. The new RC takes the old one's nodes over first,
    /// as the RC task does; the old RC (disabled) does nothing until retired.
    mod model {
        use super::*;
        use proptest::prelude::*;

        #[derive(Clone, Copy, PartialEq, Debug)]
        enum Owner {
            Old,
            New,
        }

        #[derive(Clone, Copy, PartialEq, Debug)]
        enum State {
            Up,
            Starting(u8),
            Failed,
        }

        struct World {
            pods: Vec<Option<(Owner, State)>>,
            old: (u64, bool),
            new: (u64, bool),
            rng: u64,
            fail_rate: u8,
        }

        impl World {
            fn next(&mut self) -> u64 {
                self.rng ^= self.rng << 13;
                self.rng ^= self.rng >> 7;
                self.rng ^= self.rng << 17;
                self.rng
            }

            fn counts(&self, who: Owner) -> RcCounts {
                let (desired, disabled) = if who == Owner::Old {
                    self.old
                } else {
                    self.new
                };
                let states = self
                    .pods
                    .iter()
                    .flatten()
                    .filter(|(o, _)| *o == who)
                    .map(|(_, s)| match s {
                        State::Up => (Some("d".to_string()), Some(HealthStatus::Passing)),
                        State::Starting(_) => (None, None),
                        State::Failed => (Some("d".to_string()), Some(HealthStatus::Critical)),
                    });
                RcCounts::count(desired, disabled, "d", states)
            }

            fn up(&self) -> usize {
                self.pods
                    .iter()
                    .flatten()
                    .filter(|(_, s)| *s == State::Up)
                    .count()
            }

            /// The RC tasks converge: the new RC takes over as many old nodes as the old RC
            /// gave up (failed ones first), then free ones; an enabled old RC removes pods it
            /// does not want.
            fn converge(&mut self) {
                let new_current = self
                    .pods
                    .iter()
                    .flatten()
                    .filter(|(o, _)| *o == Owner::New)
                    .count() as u64;
                for _ in new_current..self.new.0 {
                    let old_current = self
                        .pods
                        .iter()
                        .flatten()
                        .filter(|(o, _)| *o == Owner::Old)
                        .count() as u64;
                    let may_take_over = old_current > self.old.0;
                    let pick = (0..self.pods.len())
                        .filter(|i| {
                            may_take_over
                                && matches!(self.pods[*i], Some((Owner::Old, State::Failed)))
                        })
                        .chain((0..self.pods.len()).filter(|i| {
                            may_take_over && matches!(self.pods[*i], Some((Owner::Old, _)))
                        }))
                        .chain((0..self.pods.len()).filter(|i| self.pods[*i].is_none()))
                        .next();
                    let Some(i) = pick else { break };
                    let ticks = 1 + (self.next() % 3) as u8;
                    self.pods[i] = Some((Owner::New, State::Starting(ticks)));
                }
                if !self.old.1 {
                    let mut old_current = self
                        .pods
                        .iter()
                        .flatten()
                        .filter(|(o, _)| *o == Owner::Old)
                        .count() as u64;
                    for p in self.pods.iter_mut() {
                        if old_current > self.old.0 && matches!(p, Some((Owner::Old, _))) {
                            *p = None;
                            old_current -= 1;
                        }
                    }
                }
            }

            fn tick_health(&mut self) {
                for i in 0..self.pods.len() {
                    if let Some((o, State::Starting(t))) = self.pods[i] {
                        let fails = (self.next() % 100) < u64::from(self.fail_rate);
                        self.pods[i] = Some((
                            o,
                            match t {
                                0 | 1 if fails => State::Failed,
                                0 | 1 => State::Up,
                                t => State::Starting(t - 1),
                            },
                        ));
                    }
                }
            }
        }

        proptest! {
            #[test]
            fn never_below_the_minimum_and_completes_when_pods_pass(
                old_n in 1u64..8,
                target in 1u64..8,
                min_gap in 1u64..4,
                spare in 0usize..3,
                missing in prop_oneof![Just(0u64), 0u64..3],
                seed in 1u64..u64::MAX,
                fail_rate in prop_oneof![Just(0u8), 0u8..30],
                max_parallel in prop_oneof![Just(None), (1u64..4).prop_map(Some)],
                canary in prop_oneof![Just(None), (1u64..4).prop_map(Some)],
                // Each pass is paused with this chance (percent).
                pause_rate in prop_oneof![Just(0u64), 0u64..40],
            ) {
                let minimum = target.saturating_sub(min_gap).min(old_n.saturating_sub(1));
                let nodes = (old_n as usize).max(target as usize) + spare;
                // The old RC may run fewer pods than it wants (too few eligible nodes when the
                // roll started).
                let running = old_n.saturating_sub(missing).max(1) as usize;
                let mut w = World {
                    pods: (0..nodes).map(|i| (i < running).then_some((Owner::Old, State::Up))).collect(),
                    old: (old_n, false),
                    new: (0, false),
                    rng: seed,
                    fail_rate,
                };
                let u = Update {
                    old_rc: RcId::new(),
                    new_rc: RcId::new(),
                    desired_replicas: target,
                    minimum_replicas: minimum,
                    leave_old: false,
                    roll_delay: Duration::ZERO,
                };
                let mut started = false;
                let mut done = false;
                let mut promoted = false;
                let mut canary_paused = false;
                for _ in 0..400 {
                    let paused = (w.next() % 100) < pause_rate;
                    // The operator promotes a paused canary a little later.
                    if canary_paused && w.next().is_multiple_of(3) {
                        promoted = true;
                        canary_paused = false;
                    }
                    let o = RollObserved {
                        update: &u,
                        old: Ok(w.counts(Owner::Old)),
                        new: Ok(w.counts(Owner::New)),
                        old_lock: LockState::Ours,
                        new_lock: LockState::Ours,
                        conflict: None,
                        transfer: None,
                        ready_for: Duration::ZERO,
                        started,
                        old_missing: false,
                        paused: (paused || canary_paused).then(|| "paused".to_string()),
                        max_parallel,
                        failed: None,
                        canary: canary.filter(|_| !promoted),
                        removal_room: None,
                        tripped: None,
                        old_served_by: None,
                    };
                    let up_before = w.up();
                    let new_before = w.new.0;
                    let planned = plan(&o);
                    if o.paused.is_some() {
                        prop_assert_eq!(planned.action.clone(), None, "a paused roll takes no step");
                    }
                    match planned.action {
                        Some(RollAction::Start { disable_old, enable_new, adopt }) => {
                            if disable_old { w.old.1 = true; }
                            if enable_new { w.new.1 = false; }
                            w.new.0 += adopt;
                            w.old.0 = w.old.0.saturating_sub(adopt);
                            started = true;
                        }
                        Some(RollAction::Step { add, remove, old_to }) => {
                            let old_current = w.pods.iter().flatten().filter(|(o, _)| *o == Owner::Old).count() as u64;
                            prop_assert_eq!(old_to, w.old.0.min(old_current).saturating_sub(remove));
                            if let Some(n) = max_parallel {
                                prop_assert!(add <= n && remove <= n, "+{} -{} in one step, max-parallel {}", add, remove, n);
                            }
                            if let Some(k) = canary.filter(|k| *k < target && !promoted) {
                                prop_assert!(new_before + add <= k, "{} new pods before promotion, canary {}", new_before + add, k);
                            }
                            w.new.0 += add;
                            w.old.0 = old_to;
                        }
                        Some(RollAction::CanaryPause { up }) => {
                            let k = canary.unwrap_or_default();
                            prop_assert!(!promoted && up >= k && k < target);
                            canary_paused = true;
                        }
                        Some(RollAction::RetireOld { old_to, .. }) => w.old = (old_to, false),
                        Some(RollAction::Complete) => { done = true; break; }
                        Some(RollAction::Lock) => unreachable!("locks are ours"),
                        Some(RollAction::DeleteOrphan) => unreachable!("both RCs exist"),
                        None => {}
                    }
                    w.converge();
                    let up = w.up();
                    prop_assert!(
                        up >= up_before || up as u64 >= minimum,
                        "pods up fell from {} to {} below the minimum {}", up_before, up, minimum
                    );
                    w.tick_health();
                }
                if fail_rate == 0 {
                    prop_assert!(done, "a roll whose pods all pass completes");
                    let new_up = w.pods.iter().flatten().filter(|p| **p == (Owner::New, State::Up)).count();
                    prop_assert_eq!(new_up as u64, target);
                    prop_assert!(w.pods.iter().flatten().all(|(o, _)| *o == Owner::New), "no old pod left");
                }
            }
        }
    }
}

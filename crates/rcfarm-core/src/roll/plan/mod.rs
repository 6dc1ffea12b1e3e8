//! What a rolling update should do next, decided from what is observed. Pure: no I/O, the
//! clock is an input, so every decision is unit-tested (the RC task's `plan` is the model).
//!
//! The algorithm is P2's (`pkg/roll/run_update.go`): the old RC is disabled and the new one
//! enabled, then replicas move from the old RC to the new in steps. The new RC's pods replace
//! the old ones in place (same node, same pod id), so a step assumes each pod it adds takes an
//! old one down: it never moves more than the healthy pods above the minimum allow. Only pods
//! that run the RC's own manifest (per `reality/`) and pass their health check count.

use std::time::Duration;

use chrono::{DateTime, Utc};
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
                Some(_) => {}
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
    pub now: DateTime<Utc>,
    /// Since when a step has been possible without interruption (kept by the worker; the roll
    /// delay counts from there, as P2 sleeps `RollDelay` once a step is safe).
    pub ready_since: Option<DateTime<Utc>>,
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
    /// How many pods the farm's removal budget lets a step take down now, and why no more
    /// (`--max-removals`, the failsafe); `None`: no limit.
    pub removal_room: Option<(u64, String)>,
}

/// One step, applied as one fenced transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RollAction {
    /// Take both RCs' mutation locks (no node transfers, no other roll, during the roll).
    Lock,
    /// Disable the old RC (the new one replaces its pods in place) and enable the new one.
    Start { disable_old: bool, enable_new: bool },
    /// Move replicas: the new RC's count rises by `add`; the old one's becomes `old_to` (its
    /// count less `remove`, counted from the pods it has when it has fewer than it wants: a
    /// disabled RC never makes up the difference).
    Step { add: u64, remove: u64, old_to: u64 },
    /// The new RC is complete but the old one still has pods it did not hand over: scale it
    /// to 0 and enable it so it removes them.
    RetireOld,
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
    /// Another session holds a mutation lock.
    Lock,
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
            return RollPlan::act(RollAction::RetireOld);
        }
        return RollPlan::wait(
            WaitKind::Pods,
            format!(
                "waiting for the old RC to remove its {} remaining pods",
                old.current
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
        // P2's guard: enabling a disabled RC that has more pods than it wants would make it
        // remove one at once.
        if new.disabled && new.current != new.desired {
            return RollPlan::wait(
                WaitKind::Pods,
                format!(
                    "the new RC is disabled with {} pods but wants {}; waiting for them to match before enabling it",
                    new.current, new.desired
                ),
            );
        }
        return RollPlan::act(RollAction::Start {
            disable_old: !old.disabled,
            enable_new: new.disabled,
        });
    }

    // The old RC is disabled: it will never schedule the pods it wants but lacks, so it counts
    // as what it has. And it may not have removed a pod it no longer wants yet: count no more
    // healthy old pods than it desires, or the minimum could be broken.
    let old_desired = old.desired.min(old.current);
    let old_healthy = old.healthy.min(old_desired);
    let (remove, add) = roll_algorithm(
        old_healthy,
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
    // Each pod added beyond those removed replaces nothing (growing capacity): only removals
    // spend the farm's budget.
    let (remove, add) = match &o.removal_room {
        Some((room, why)) if remove > *room => {
            let free = add.saturating_sub(remove);
            let (remove, add) = (*room, add.min(*room + free));
            if add == 0 && remove == 0 {
                return RollPlan::wait(WaitKind::RemovalsHeld, why.clone());
            }
            (remove, add)
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
        let ready_for = o
            .ready_since
            .map(|t| (o.now - t).to_std().unwrap_or(Duration::ZERO))
            .unwrap_or(Duration::ZERO);
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
    fn the_removal_budget_caps_steps_and_holds_them_when_spent() {
        let u = update(4, 0);
        let mut o = observe(&u, counts(4, 4, 4, true), counts(0, 0, 0, false));
        o.removal_room = Some((3, String::new()));
        assert_eq!(plan(&o).action, step(3, 3, 1));
        o.removal_room = Some((0, "removals held: farm a removed 5".into()));
        let p = plan(&o);
        assert_eq!(p.action, None);
        assert_eq!(
            p.waiting,
            Some((
                WaitKind::RemovalsHeld,
                "removals held: farm a removed 5".into()
            ))
        );
        // Room enough: as without a budget.
        o.removal_room = Some((10, String::new()));
        assert_eq!(plan(&o).action, step(4, 4, 0));
        // Growing capacity removes nothing: a spent budget still lets those pods be added.
        let u = update(4, 0);
        let mut o = observe(&u, counts(2, 2, 2, true), counts(0, 0, 0, false));
        assert_eq!(plan(&o).action, step(4, 2, 0));
        o.removal_room = Some((0, "held".into()));
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
                enable_new: false
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
        assert_eq!(plan(&o).action, Some(RollAction::RetireOld));
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
                enable_new: false
            })
        );
    }

    #[test]
    fn a_disabled_new_rc_is_enabled_only_when_settled() {
        let u = update(3, 1);
        let mut o = observe(&u, counts(3, 3, 3, true), counts(1, 2, 2, true));
        o.started = false;
        assert_eq!(plan(&o).waiting.unwrap().0, WaitKind::Pods);
        let mut o = observe(&u, counts(3, 3, 3, true), counts(1, 1, 1, true));
        o.started = false;
        assert_eq!(
            plan(&o).action,
            Some(RollAction::Start {
                disable_old: false,
                enable_new: true
            })
        );
    }

    #[test]
    fn roll_delay_holds_a_ready_step_back() {
        let u = Update {
            roll_delay: Duration::from_secs(10),
            ..update(3, 1)
        };
        let now = Utc::now();
        let mut o = observe(&u, counts(2, 2, 2, true), counts(1, 1, 1, false));
        o.now = now;
        let p = plan(&o);
        assert!(p.step_ready);
        assert_eq!(p.waiting.unwrap().0, WaitKind::Delay);
        o.ready_since = Some(now - chrono::Duration::seconds(11));
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
                enable_new: true
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
                        now: Utc::now(),
                        ready_since: None,
                        started,
                        old_missing: false,
                        paused: (paused || canary_paused).then(|| "paused".to_string()),
                        max_parallel,
                        failed: None,
                        canary: canary.filter(|_| !promoted),
                        removal_room: None,
                    };
                    let up_before = w.up();
                    let new_before = w.new.0;
                    let planned = plan(&o);
                    if o.paused.is_some() {
                        prop_assert_eq!(planned.action.clone(), None, "a paused roll takes no step");
                    }
                    match planned.action {
                        Some(RollAction::Start { disable_old, enable_new }) => {
                            if disable_old { w.old.1 = true; }
                            if enable_new { w.new.1 = false; }
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
                        Some(RollAction::RetireOld) => w.old = (0, false),
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

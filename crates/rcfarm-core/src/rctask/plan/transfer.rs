//! The node-transfer decisions, pure: whether to start moving a pod off a node that is no
//! longer eligible (one at a time, as P2's `replication_controller.go` does for dynamic RCs),
//! and what becomes of a transfer in flight (its new pod is started first; the old one goes
//! when the new one is healthy). The planner calls these; their rules are rows in
//! `rules.rs`.

use std::collections::BTreeSet;

use super::{Action, Observed, Transfer};
use crate::rc::AllocationStrategy;
use crate::scheduler::NodeName;

/// What becomes of a transfer in flight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum InFlight {
    /// The new pod is up (or the old one already gone): remove the old pod.
    Complete,
    /// Undo it: remove the new pod, keep the old (why).
    RollBack(String),
    /// Not yet (why).
    Wait(String),
}

/// What becomes of `t`, when P2's node-transfer lock is not held (while it is, nothing).
pub(super) fn in_flight(o: &Observed<'_>, t: &Transfer) -> InFlight {
    let desired = o.rc.replicas_desired as usize;
    if !o.current.contains_key(&t.new_node) {
        InFlight::RollBack(format!("the new pod on {} is gone", t.new_node))
    } else if !o.current.contains_key(&t.old_node) {
        // Someone removed the old pod already: the transfer is as good as done.
        InFlight::Complete
    } else if o.current.len() != desired + 1 {
        InFlight::RollBack(format!("replicas changed to {desired} during the transfer"))
    } else if !o.eligible.contains(&t.new_node) {
        InFlight::RollBack(format!("{} is no longer eligible", t.new_node))
    } else if o.eligible.contains(&t.old_node) {
        InFlight::RollBack(format!("{} is eligible again", t.old_node))
    } else if !o.health_in_use || o.health.get(&t.new_node).is_some_and(|h| h.is_passing()) {
        InFlight::Complete
    } else if o.transfer_age >= o.transfer_timeout {
        InFlight::RollBack(format!(
            "the new pod on {} was not healthy within {}s",
            t.new_node,
            o.transfer_timeout.as_secs()
        ))
    } else {
        InFlight::Wait(format!(
            "transferring {} → {}: waiting for the new pod to pass its health check",
            t.old_node, t.new_node
        ))
    }
}

/// For an RC with all its replicas, one of them (`old`) on a node that is not eligible: the
/// transfer to start, or why none starts now. `current`: the nodes with a pod of the RC.
pub(super) fn start(
    o: &Observed<'_>,
    old: &NodeName,
    current: &BTreeSet<&NodeName>,
) -> Result<Action, String> {
    let rc = o.rc;
    // Move it when the rest of the RC is healthy (or when it is not healthy itself).
    let old_ok = o.health.get(old).is_none_or(|h| !h.is_passing());
    let others_healthy = !o.health_in_use
        || current
            .iter()
            .filter(|n| **n != old)
            .all(|n| o.health.get(*n).is_some_and(|h| h.is_passing()));
    // Never onto another RC's pod, given up or not: a transfer is no takeover.
    let target = o
        .eligible
        .iter()
        .find(|e| {
            !o.current.contains_key(*e) && !o.occupied.contains(*e) && !o.takeover.contains(e)
        })
        .cloned();
    if rc.strategy != AllocationStrategy::Dynamic && !o.transfer_static {
        // P2 moves only dynamic RCs' pods: a static RC's stays, and nothing is written.
        Err(format!(
            "{old} is not eligible; a static RC leaves its pod there, as P2 does (a farm with --transfer-static moves it)"
        ))
    } else if let Some(holder) = &o.transfer_frozen {
        Err(format!(
            "{old} is not eligible, but node transfers are frozen while {holder} holds the node-transfer lock"
        ))
    } else if let Some(roll) = &o.in_roll {
        Err(format!(
            "{old} is not eligible, but {roll} moves this RC's replicas: no node transfer starts until it ends"
        ))
    } else if o.mutation_locked_elsewhere {
        Err(format!(
            "{old} is not eligible, but another session holds the mutation lock"
        ))
    } else if !(old_ok || others_healthy) {
        Err(format!(
            "{old} is not eligible; waiting for the other pods to be healthy before moving it"
        ))
    } else if target.is_none()
        && (rc.strategy != AllocationStrategy::Dynamic || o.allocation_exhausted)
    {
        Err(format!(
            "{old} is not eligible and there is no eligible node to move its pod to"
        ))
    } else {
        Ok(Action::StartTransfer {
            old: old.clone(),
            new: target,
        })
    }
}

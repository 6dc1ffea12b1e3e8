//! What the chaos checks from outside, after the faults: RCs converged, rolls done, and why
//! the audit outbox did not drain if it did not.

use std::collections::{BTreeMap, BTreeSet};

use super::DRAIN_LIMIT;
use crate::consul::{Consul, QueryOptions};
use crate::labels::{LabelStore, LabelType, parse_labels, split_pod_label_id};
use crate::rc::{Mutation, RC_ID_LABEL, RcId, RcStore, parse_locks};
use crate::roll::{ControlChange, RollControl, RollStore, control_key};

/// Does what an operator does with the rolls left braked when the faults stop: resumes paused
/// ones, promotes canaries, aborts failed ones (their manifest never becomes healthy). How many
/// it released, and the failed rolls whose manifest is a good one (a roll that failed although
/// its pods could pass: a broken promise), with why they failed.
pub(super) async fn release_rolls(consul: &Consul) -> (u64, Vec<String>) {
    let store = RollStore::new(consul.clone());
    let Ok(rolls) = store.list().await else {
        return (0, Vec::new());
    };
    let keys: Vec<String> = rolls.rolls.keys().map(|id| control_key(*id)).collect();
    let Ok(controls) = consul.read_keys(&keys).await else {
        return (0, Vec::new());
    };
    let listing = RcStore::new(consul.clone()).list().await.ok();
    let mut good_failed = Vec::new();
    // RCs in a roll are the roll's; an aborted roll's are not any more.
    let mut in_rolls: BTreeSet<RcId> = BTreeSet::new();
    let mut released = 0;
    for (id, roll) in &rolls.rolls {
        let control = controls
            .get(&control_key(*id))
            .and_then(|kv| RollControl::parse(kv.value_bytes()).ok())
            .unwrap_or_default();
        if let Some(failure) = &control.failed
            && let Some(new) = listing
                .as_ref()
                .and_then(|l| l.rcs.get(&roll.update.new_rc))
            && !new.manifest.raw().contains(super::mutate::FAILING_BUILD)
        {
            good_failed.push(format!("{id}: {failure:?}"));
        }
        let aborted = control.failed.is_some() && store.abort(*id, "chaos", false).await.is_ok();
        if !aborted {
            in_rolls.extend([roll.update.old_rc, roll.update.new_rc]);
        }
        let done = if control.failed.is_some() {
            aborted
        } else {
            let mut any = false;
            if control.canary_pending().is_some() {
                any |= store
                    .change_control(*id, ControlChange::Promote, "chaos", false)
                    .await
                    .is_ok();
            }
            if control.paused && !control.canary_paused() {
                any |= store
                    .change_control(*id, ControlChange::Resume, "chaos", false)
                    .await
                    .is_ok();
            }
            any
        };
        released += u64::from(done);
    }
    // A bad deploy's RC left by an abort (its pods never pass) is scaled to 0 and deleted, as
    // an operator cleans up after a bad deploy; its pods could otherwise never be transferred
    // or rolled from.
    let rcs = RcStore::new(consul.clone());
    if let Ok(listing) = rcs.list().await {
        for rc in listing.rcs.values() {
            if in_rolls.contains(&rc.id)
                || !rc.manifest.raw().contains(super::mutate::FAILING_BUILD)
            {
                continue;
            }
            if rcs
                .mutate(rc.id, &Mutation::SetReplicas(0), "chaos", false)
                .await
                .is_ok()
                && rcs.delete(rc.id, false, "chaos", false).await.is_ok()
            {
                released += 1;
            }
        }
    }
    (released, good_failed)
}

/// Who holds the shipper lock, and whether that session is still alive: what to look at when
/// the outbox does not drain.
pub(super) async fn shipper_diagnosis(consul: &Consul, left: usize) -> String {
    let q = QueryOptions::default();
    let holder = match consul.kv_get(crate::audit::SHIPPER_LOCK, &q).await {
        Ok((Some(e), _)) => match &e.session {
            Some(sid) => {
                let alive = matches!(consul.session_info(sid, &q).await, Ok((Some(_), _)));
                format!(
                    "held by session {sid} of {:?} (session {})",
                    e.value_str().unwrap_or("?"),
                    if alive { "alive" } else { "gone" }
                )
            }
            None => "present but held by no session".into(),
        },
        Ok((None, _)) => "free".into(),
        Err(e) => format!("unreadable: {e}"),
    };
    format!(
        "{left} records still in Consul after {} s; shipper lock {holder}",
        DRAIN_LIMIT.as_secs()
    )
}

/// The RCs that are not as desired yet, with why: not owned by one of the `running` farm
/// processes, a transfer in flight, or pods not matching the desired count and selector.
pub async fn not_converged(consul: &Consul, running: &BTreeSet<u32>) -> Vec<String> {
    let q = QueryOptions::default();
    let store = RcStore::new(consul.clone());
    let Ok(listing) = store.list().await else {
        return vec!["cannot list RCs".into()];
    };
    let Ok((nodes, _)) = LabelStore::new(consul.clone()).list(LabelType::Node).await else {
        return vec!["cannot list nodes".into()];
    };
    let Ok((pods, _)) = consul.kv_list(&LabelType::Pod.prefix(), &q).await else {
        return vec!["cannot list pods".into()];
    };
    let Ok((intents, _)) = consul.kv_keys("intent/", None, &q).await else {
        return vec!["cannot list intents".into()];
    };
    let Ok((locks, _)) = consul.kv_list(crate::rc::RC_LOCK_PREFIX, &q).await else {
        return vec!["cannot list locks".into()];
    };
    let Ok((farms, _)) = consul
        .kv_list(crate::farm::registry::FARMS_PREFIX, &q)
        .await
    else {
        return vec!["cannot list farms".into()];
    };
    let Ok((transfers, _)) = consul
        .kv_keys("status/replication_controllers/", None, &q)
        .await
    else {
        return vec!["cannot list transfers".into()];
    };
    // Owned by a farm process that is running (a killed farm's session outlives it by up to 2×TTL).
    let live: BTreeSet<String> = crate::farm::registry::live_farms(&farms)
        .into_iter()
        .filter(|f| running.contains(&f.pid))
        .map(|f| f.session.into())
        .collect();
    let holders = parse_locks(&locks).0;
    let intents: BTreeSet<String> = intents.into_iter().collect();
    let mut pods_of: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    // Pod id → RC → nodes: an RC never schedules where another RC runs its pod id (an
    // aborted roll leaves two RCs with one pod id), so those nodes are not open to it.
    let mut by_pod_id: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for e in &pods {
        let Some(id) = e.key.strip_prefix(&LabelType::Pod.prefix()) else {
            continue;
        };
        let Some((node, pod)) = split_pod_label_id(id) else {
            continue;
        };
        if !intents.contains(&format!("intent/{node}/{pod}")) {
            continue;
        }
        if let Some(rc) = parse_labels(e.value_bytes())
            .ok()
            .and_then(|l| l.get(RC_ID_LABEL).cloned())
        {
            pods_of
                .entry(rc.clone())
                .or_default()
                .insert(node.to_string());
            by_pod_id
                .entry(pod.to_string())
                .or_default()
                .entry(rc)
                .or_default()
                .insert(node.to_string());
        }
    }
    let mut out = Vec::new();
    for (id, rc) in &listing.rcs {
        let owner = holders
            .get(id)
            .and_then(|h| h.ownership.as_ref())
            .map(|(s, _)| s.to_string());
        if !owner.as_ref().is_some_and(|s| live.contains(s)) {
            out.push(format!("{id}: not owned by a running farm"));
            continue;
        }
        if rc.disabled {
            continue;
        }
        // P2's status key says a transfer is in flight; rcfarm's own key beside it only
        // records starts (a previous release's farm leaves it behind when it ends one).
        if transfers.contains(&crate::rctask::status_key(*id)) {
            out.push(format!("{id}: a transfer is in flight"));
            continue;
        }
        let others: BTreeSet<&String> = by_pod_id
            .get(rc.pod_id())
            .into_iter()
            .flatten()
            .filter(|(other, _)| **other != id.to_string())
            .flat_map(|(_, nodes)| nodes)
            .collect();
        let eligible: BTreeSet<String> = nodes
            .iter()
            .filter(|n| rc.node_selector.matches(&n.labels) && !others.contains(&n.id))
            .map(|n| n.id.clone())
            .collect();
        let current = pods_of.get(&id.to_string()).cloned().unwrap_or_default();
        let desired = rc.replicas_desired as usize;
        let expected = desired.min(eligible.len());
        let on_eligible = current.iter().filter(|n| eligible.contains(*n)).count();
        // A pod on a node that left the selector stays while no eligible node is free to move
        // it to (removing it would run fewer copies than desired); never more than desired.
        let stranded = current.iter().any(|n| !eligible.contains(n))
            && eligible.difference(&current).next().is_some();
        if current.len() > desired || on_eligible != expected || stranded {
            out.push(format!(
                "{id}: {} pods ({on_eligible} on eligible nodes), {expected} expected on eligible nodes, {desired} desired ({} eligible, selector {})",
                current.len(),
                eligible.len(),
                rc.node_selector
            ));
        }
    }
    out
}

/// Rolls not done yet that could be (their new RC has enough nodes for the target: eligible,
/// and not running the pod id for another RC, such as what an aborted roll left behind), with
/// why; and how many are left that cannot complete as things are.
pub async fn rolls_not_done(consul: &Consul) -> (Vec<String>, usize) {
    let q = QueryOptions::default();
    let Ok(rolls) = RollStore::new(consul.clone()).list().await else {
        return (vec!["cannot list rolls".into()], 0);
    };
    let Ok(listing) = RcStore::new(consul.clone()).list().await else {
        return (vec!["cannot list RCs".into()], 0);
    };
    let Ok((nodes, _)) = LabelStore::new(consul.clone()).list(LabelType::Node).await else {
        return (vec!["cannot list nodes".into()], 0);
    };
    let Ok((pods, _)) = consul.kv_list(&LabelType::Pod.prefix(), &q).await else {
        return (vec!["cannot list pods".into()], 0);
    };
    let Ok((locks, _)) = consul.kv_list(crate::roll::ROLL_LOCK_PREFIX, &q).await else {
        return (vec!["cannot list roll locks".into()], 0);
    };
    // (node, pod id) → RC running it.
    let mut runs: BTreeMap<(String, String), String> = BTreeMap::new();
    for e in &pods {
        if let Some((node, pod)) = e
            .key
            .strip_prefix(&LabelType::Pod.prefix())
            .and_then(split_pod_label_id)
            && let Some(rc) = parse_labels(e.value_bytes())
                .ok()
                .and_then(|l| l.get(RC_ID_LABEL).cloned())
        {
            runs.insert((node.to_string(), pod.to_string()), rc);
        }
    }
    let mut out = Vec::new();
    let mut impossible = 0;
    for r in rolls.rolls.values() {
        let Some(new) = listing.rcs.get(&r.update.new_rc) else {
            out.push(format!("{}: its new RC is gone", r.id()));
            continue;
        };
        let ours = [r.update.old_rc.to_string(), r.update.new_rc.to_string()];
        let open = nodes
            .iter()
            .filter(|n| new.node_selector.matches(&n.labels))
            .filter(|n| {
                runs.get(&(n.id.clone(), new.pod_id().to_string()))
                    .is_none_or(|rc| ours.contains(rc))
            })
            .count() as u64;
        if open < r.update.desired_replicas {
            impossible += 1;
        } else {
            let holder = locks
                .iter()
                .find(|e| e.key.ends_with(&r.id().to_string()))
                .and_then(|e| e.session.clone());
            out.push(format!(
                "{}: not done ({} of {} replicas moved, {open} nodes open to it, lock held by {holder:?})",
                r.id(),
                new.replicas_desired,
                r.update.desired_replicas
            ));
        }
    }
    (out, impossible)
}

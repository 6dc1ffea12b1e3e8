//! What the chaos does to RCs, rolls and nodes while farms are faulted: random, seeded.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio_util::sync::CancellationToken;

use super::ChaosReport;
use crate::consul::Consul;
use crate::labels::{LabelSet, LabelStore, LabelType};
use crate::rc::{AllocationStrategy, Mutation, NewRc, RcId, RcStore};
use crate::roll::{ControlChange, RollControl, RollStore, RollStoreError, StartRoll};

/// What the manifests of the chaos's bad deploys carry: the node simulator never makes their
/// pods healthy.
pub(super) const FAILING_BUILD: &str = "chaos-never-healthy";

/// Node labels the chaos moves nodes between.
pub(super) fn node_labels(rng: &mut StdRng) -> LabelSet {
    let mut l = LabelSet::new();
    if rng.random_range(0..10) > 0 {
        l.insert("env".into(), "prod".into());
    }
    l.insert("zone".into(), format!("z{}", rng.random_range(0..3)));
    l
}

const SELECTORS: [&str; 5] = [
    "env=prod",
    "zone=z0",
    "zone=z1",
    "zone in (z1,z2)",
    "env=prod,zone!=z2",
];

pub(super) fn new_rc(rng: &mut StdRng, i: usize) -> NewRc {
    NewRc {
        manifest: format!(
            "id: chaos-{i}-{}\nlaunchables: {{}}\n",
            rng.random_range(0..1_000_000)
        ),
        node_selector: SELECTORS[rng.random_range(0..SELECTORS.len())].to_string(),
        pod_labels: LabelSet::new(),
        replicas_desired: rng.random_range(0..4),
        strategy: AllocationStrategy::Static,
        rc_labels: LabelSet::new(),
        disabled: false,
    }
}

/// Random RC and node label changes until `stop`.
pub(super) async fn mutate(
    consul: Consul,
    seed: u64,
    rcs: usize,
    nodes: usize,
    report: Arc<Mutex<ChaosReport>>,
    stop: CancellationToken,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let store = RcStore::new(consul.clone());
    let rolls = RollStore::new(consul.clone());
    let labels = LabelStore::new(consul.clone());
    let mut created = rcs;
    let mut rolled = 0u64;
    while !stop.is_cancelled() {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(rng.random_range(100..500))) => {}
        }
        let Ok(listing) = store.list().await else {
            continue;
        };
        let Ok(roll_listing) = rolls.list().await else {
            continue;
        };
        // RCs in a roll are left to it (an operator who changes them mid-roll stalls it).
        let rolling: BTreeSet<RcId> = roll_listing
            .rolls
            .values()
            .flat_map(|r| [r.update.old_rc, r.update.new_rc])
            .collect();
        let ids: Vec<RcId> = listing
            .rcs
            .keys()
            .copied()
            .filter(|id| !rolling.contains(id))
            .collect();
        let pick = |rng: &mut StdRng| ids.get(rng.random_range(0..ids.len().max(1))).copied();
        let kind = match rng.random_range(0..100) {
            0..30 => "scale",
            30..38 => "selector",
            38..45 => "disable",
            45..52 => "enable",
            52..58 => "create",
            58..63 => "delete",
            63..70 => "roll-start",
            70..72 => "roll-abort",
            72..74 => "roll-pause",
            74..77 => "roll-resume",
            77..80 => "roll-promote",
            80..82 => "restart",
            82..84 => "roll-undo",
            _ => "node-labels",
        };
        let result: Result<(), String> = match kind {
            "scale" => match pick(&mut rng) {
                Some(id) => store
                    .mutate(
                        id,
                        &Mutation::SetReplicas(rng.random_range(0..5)),
                        "chaos",
                        false,
                    )
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
                None => Ok(()),
            },
            "selector" => match pick(&mut rng) {
                Some(id) => {
                    let sel = SELECTORS[rng.random_range(0..SELECTORS.len())].to_string();
                    store
                        .mutate(id, &Mutation::SetNodeSelector(sel), "chaos", false)
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                }
                None => Ok(()),
            },
            "disable" | "enable" => match pick(&mut rng) {
                Some(id) => {
                    let m = if kind == "disable" {
                        Mutation::Disable
                    } else {
                        Mutation::Enable
                    };
                    store
                        .mutate(id, &m, "chaos", false)
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                }
                None => Ok(()),
            },
            "create" if ids.len() < rcs * 3 / 2 => {
                created += 1;
                store
                    .create(new_rc(&mut rng, created), "chaos", false)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }
            "delete" if ids.len() > rcs / 2 => match pick(&mut rng) {
                // Sometimes forced (pods left unmanaged), usually after scaling to 0.
                Some(id) if rng.random_range(0..4) == 0 => store
                    .delete(id, true, "chaos", false)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
                // As an operator does: scale to 0 first, delete once its pods are gone (a
                // delete with pods left is refused; this RC is picked again later).
                Some(id)
                    if listing
                        .rcs
                        .get(&id)
                        .is_some_and(|rc| rc.replicas_desired > 0) =>
                {
                    store
                        .mutate(id, &Mutation::SetReplicas(0), "chaos", false)
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                }
                Some(id) => store
                    .delete(id, false, "chaos", false)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
                None => Ok(()),
            },
            "roll-start" | "restart" => {
                let candidates: Vec<&Arc<crate::rc::Rc>> = ids
                    .iter()
                    .filter_map(|id| listing.rcs.get(id))
                    .filter(|rc| rc.replicas_desired >= 1 && !rc.disabled)
                    // A bad deploy's RC (left by an abort) never has a healthy pod to roll from.
                    .filter(|rc| !rc.manifest.raw().contains(FAILING_BUILD))
                    .collect();
                match candidates.get(rng.random_range(0..candidates.len().max(1))) {
                    Some(rc) => {
                        rolled += 1;
                        let desired = rc.replicas_desired;
                        // A deploy of a manifest the nodes never make healthy, now and then:
                        // it fails at its (short) deadline and stays failed until the end.
                        let bad = kind == "roll-start" && rng.random_range(0..3) == 0;
                        let manifest = if kind == "restart" {
                            rc.manifest
                                .restarted(&format!("chaos-{rolled}"))
                                .unwrap_or_else(|_| rc.manifest.raw().to_string())
                        } else {
                            format!(
                                "id: {}\nlaunchables: {{}}\nconfig:\n  rollout: {rolled}{}\n",
                                rc.pod_id(),
                                if bad {
                                    format!("\n  build: {FAILING_BUILD}")
                                } else {
                                    String::new()
                                }
                            )
                        };
                        let control = RollControl {
                            // Half the bad deploys revert themselves (a revert is never
                            // reverted: the observer checks).
                            auto_revert: bad.then(|| rng.random_bool(0.5)),
                            canary: (desired >= 2 && rng.random_range(0..3) == 0)
                                .then(|| rng.random_range(1..desired)),
                            max_parallel: (rng.random_range(0..3) == 0)
                                .then(|| rng.random_range(1..3)),
                            progress_deadline: Some(if bad { "3s" } else { "2m" }.into()),
                            ..Default::default()
                        };
                        let r = rolls
                            .clone()
                            .with_control(control)
                            .start(
                                StartRoll {
                                    old_rc: rc.id,
                                    manifest,
                                    desired: None,
                                    minimum: Some(rng.random_range(0..desired)),
                                    leave_old: false,
                                    roll_delay: Duration::from_millis(
                                        [0, 500, 1000, 2000][rng.random_range(0..4)],
                                    ),
                                },
                                "chaos",
                                false,
                            )
                            .await
                            .map(|_| ())
                            .map_err(|e| e.to_string());
                        if r.is_ok() && bad {
                            report.lock().rolls_bad += 1;
                        }
                        r
                    }
                    None => Ok(()),
                }
            }
            "roll-undo" => {
                // An RC with a revision, back to its latest one, as `rcctl roll undo` does.
                let mut with_history = Vec::new();
                for id in &ids {
                    if let Ok(Some(h)) = rolls.history(*id).await
                        && let (Some(rev), Some(rc)) = (h.latest(), listing.rcs.get(id))
                        && rc.replicas_desired >= 1
                        // Not back onto a bad deploy (a reverted one is a revision too).
                        && !rev.manifest.contains(FAILING_BUILD)
                    {
                        with_history.push((rc.clone(), rev.clone()));
                    }
                }
                match with_history.get(rng.random_range(0..with_history.len().max(1))) {
                    Some((rc, rev)) => {
                        let desired = rc.replicas_desired;
                        rolls
                            .clone()
                            .with_control(RollControl {
                                max_parallel: rev.max_parallel,
                                progress_deadline: Some("2m".into()),
                                ..Default::default()
                            })
                            .start_shaped(
                                StartRoll {
                                    old_rc: rc.id,
                                    manifest: rev.manifest.clone(),
                                    desired: Some(desired),
                                    minimum: Some(rng.random_range(0..desired)),
                                    leave_old: false,
                                    roll_delay: Duration::ZERO,
                                },
                                Some((rev.node_selector.clone(), rev.pod_labels.clone())),
                                "chaos",
                                false,
                            )
                            .await
                            .map(|_| ())
                            .map_err(|e| e.to_string())
                    }
                    None => Ok(()),
                }
            }
            "roll-pause" | "roll-resume" | "roll-promote" => {
                let ids: Vec<RcId> = roll_listing.rolls.keys().copied().collect();
                match ids.get(rng.random_range(0..ids.len().max(1))) {
                    Some(id) => {
                        let change = match kind {
                            "roll-pause" => ControlChange::Pause,
                            "roll-resume" => ControlChange::Resume,
                            _ => ControlChange::Promote,
                        };
                        match rolls.change_control(*id, change, "chaos", false).await {
                            // Refusals (promoting a roll with no canary, resuming one that
                            // waits for its promotion) are answers, not errors.
                            Ok(_) | Err(RollStoreError::Refused(_)) => Ok(()),
                            Err(e) => Err(e.to_string()),
                        }
                    }
                    None => Ok(()),
                }
            }
            "roll-abort" => {
                let ids: Vec<RcId> = roll_listing.rolls.keys().copied().collect();
                match ids.get(rng.random_range(0..ids.len().max(1))) {
                    Some(id) => {
                        let r = rolls.abort(*id, "chaos", false).await;
                        if r.is_ok() {
                            report.lock().rolls_aborted += 1;
                        }
                        r.map(|_| ()).map_err(|e| e.to_string())
                    }
                    None => Ok(()),
                }
            }
            "node-labels" => {
                let node = format!("node-{:02}", rng.random_range(0..nodes));
                labels
                    .set(LabelType::Node, &node, &node_labels(&mut rng))
                    .await
                    .map_err(|e| e.to_string())
            }
            _ => continue,
        };
        let mut r = report.lock();
        *r.mutations.entry(kind).or_default() += 1;
        if result.is_err() {
            r.mutation_errors += 1;
        }
    }
}

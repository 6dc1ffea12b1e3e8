//! A read-only overview of the whole installation, from Consul: every RC with its owner, pods
//! and conditions, and every live farm with its share. Used by `rcctl` and the HTTP API; costs a
//! handful of reads whatever the size.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::consul::{Consul, ConsulError, QueryOptions};
use crate::farm::claims::assign;
use crate::farm::registry::{self, FARMS_PREFIX, FarmInfo};
use crate::health::{HEALTH_PREFIX, parse_health};
use crate::labels::{LabelSet, LabelStore, LabelType, Selector, parse_labels, split_pod_label_id};
use crate::rc::{RC_ID_LABEL, RC_LOCK_PREFIX, RcId, RcStore, parse_locks};
use crate::rctask::{STATUS_PREFIX, Transfer, parse_transfers};
use crate::roll::{
    ROLL_LOCK_PREFIX, ROLL_PREFIX, RcCounts, RollControl, RollStatus, RollStore, RollStoreError,
    control_key, reality_key, runs,
};

/// One RC.
#[derive(Debug, Clone, Serialize)]
pub struct RcOverview {
    pub id: String,
    pub pod_id: Option<String>,
    pub desired: Option<u64>,
    pub current: usize,
    /// Current pods passing their health check; `None` when nothing reports this pod id's
    /// health (no node agent, or P2's preparer without health checks).
    pub healthy: Option<usize>,
    pub nodes: Vec<String>,
    pub owner_farm: Option<String>,
    pub owner_session: Option<String>,
    pub disabled: bool,
    pub node_selector: String,
    pub strategy: String,
    pub rc_labels: LabelSet,
    pub pod_labels: LabelSet,
    pub conditions: Vec<String>,
    pub transfer: Option<Transfer>,
    /// Why the record is invalid, if it is.
    pub problem: Option<String>,
    pub modify_index: u64,
}

/// One live farm.
#[derive(Debug, Clone, Serialize)]
pub struct FarmOverview {
    pub farm_id: String,
    pub hostname: String,
    pub session: String,
    pub rc_selector: String,
    pub http: Option<String>,
    pub started_at: chrono::DateTime<chrono::Utc>,
    pub version: String,
    pub owned: usize,
    pub fair_share: usize,
    pub rcs: Vec<String>,
    /// `false`: the farm leaves audit records in Consul (`--audit-shipping off`).
    pub audit_shipping: bool,
    /// The newest assignment rule the farm offers (`--assignment-rule`; 1 for older releases).
    pub assignment_rule: u32,
}

/// A pod whose label names an RC that no longer exists: nothing manages it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OrphanPod {
    pub node: String,
    pub pod_id: String,
    /// The RC its label names.
    pub rc_id: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Overview {
    pub rcs: Vec<RcOverview>,
    pub farms: Vec<FarmOverview>,
    /// Pods whose RC is gone, by node.
    pub orphans: Vec<OrphanPod>,
    /// The Consul index of the RC tree when read.
    pub index: u64,
    /// The assignment rule the live farms agree on (`registry::agreed_rule`).
    pub assignment_rule: u32,
}

impl Overview {
    /// Reads everything.
    pub async fn load(consul: &Consul) -> Result<Overview, ConsulError> {
        let q = QueryOptions::default();
        let store = RcStore::new(consul.clone());
        let listing = store.list().await.map_err(|e| match e {
            crate::rc::RcStoreError::Consul(c) => c,
            other => ConsulError::BadResponse(other.to_string()),
        })?;
        let (locks, _) = consul.kv_list(RC_LOCK_PREFIX, &q).await?;
        let (holders, _) = parse_locks(&locks);
        let (farm_entries, _) = consul.kv_list(FARMS_PREFIX, &q).await?;
        let farms: Vec<FarmInfo> = registry::live_farms(&farm_entries);
        let farm_of: BTreeMap<&str, &str> = farms
            .iter()
            .map(|f| (f.session.as_str(), f.farm_id.as_str()))
            .collect();
        let (pods, _) = consul.kv_list(&LabelType::Pod.prefix(), &q).await?;
        let mut pods_of: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut orphans = Vec::new();
        for e in &pods {
            let Some(id) = e.key.strip_prefix(&LabelType::Pod.prefix()) else {
                continue;
            };
            let Some((node, pod)) = split_pod_label_id(id) else {
                continue;
            };
            if let Some(rc) = parse_labels(e.value_bytes())
                .ok()
                .and_then(|l| l.get(RC_ID_LABEL).cloned())
            {
                let gone = RcId::parse(&rc).is_ok_and(|id| {
                    !listing.rcs.contains_key(&id) && !listing.invalid.contains_key(&id.key())
                });
                if gone {
                    orphans.push(OrphanPod {
                        node: node.to_string(),
                        pod_id: pod.to_string(),
                        rc_id: rc.clone(),
                    });
                }
                pods_of.entry(rc).or_default().insert(node.to_string());
            }
        }
        let (health_entries, _) = consul.kv_list(HEALTH_PREFIX, &q).await?;
        // pod id → node → passing.
        let mut health: BTreeMap<&str, BTreeMap<&str, bool>> = BTreeMap::new();
        for e in &health_entries {
            if let Some((pod, node)) = e
                .key
                .strip_prefix(HEALTH_PREFIX)
                .and_then(|k| k.split_once('/'))
            {
                let passing = parse_health(e.value_bytes()).is_ok_and(|h| h.is_passing());
                health.entry(pod).or_default().insert(node, passing);
            }
        }
        let healthy = |pod: &str, nodes: &[String]| {
            health.get(pod).map(|by_node| {
                nodes
                    .iter()
                    .filter(|n| by_node.get(n.as_str()) == Some(&true))
                    .count()
            })
        };
        let (rc_label_entries, _) = consul
            .kv_list(&LabelType::ReplicationController.prefix(), &q)
            .await?;
        let rc_labels: BTreeMap<String, LabelSet> =
            crate::labels::store::parse_tree(LabelType::ReplicationController, &rc_label_entries)
                .0
                .into_iter()
                .map(|l| (l.id, l.labels))
                .collect();
        let (status, _) = consul.kv_list(STATUS_PREFIX, &q).await?;
        let transfers = parse_transfers(&status);

        let mut rcs = Vec::new();
        let owner = |id: &RcId| {
            holders
                .get(id)
                .and_then(|h| h.ownership.as_ref())
                .map(|(s, _)| s.to_string())
        };
        for (id, rc) in &listing.rcs {
            let idt = id.to_string();
            let nodes: Vec<String> = pods_of
                .get(&idt)
                .map(|s| s.iter().cloned().collect())
                .unwrap_or_default();
            let session = owner(id);
            let owner_farm = session
                .as_deref()
                .and_then(|s| farm_of.get(s))
                .map(|f| f.to_string());
            let transfer = transfers.get(id).cloned();
            let mut conditions = Vec::new();
            if rc.disabled {
                conditions.push("Disabled".to_string());
            }
            if let Some(t) = &transfer {
                conditions.push(format!("Transferring {}→{}", t.old_node, t.new_node));
            }
            if let Some((s, _)) = holders.get(id).and_then(|h| h.node_transfer.as_ref()) {
                conditions.push(format!(
                    "TransferFrozen: session {s} holds {}: no node transfer starts, completes or rolls back",
                    id.node_transfer_lock_key()
                ));
            }
            if session.is_none() {
                conditions.push("Unowned".to_string());
            }
            if nodes.len() as u64 != rc.replicas_desired && !rc.disabled && transfer.is_none() {
                conditions.push("Converging".to_string());
            }
            rcs.push(RcOverview {
                id: idt.clone(),
                pod_id: Some(rc.pod_id().to_string()),
                desired: Some(rc.replicas_desired),
                current: nodes.len(),
                healthy: healthy(rc.pod_id(), &nodes),
                nodes,
                owner_farm,
                owner_session: session,
                disabled: rc.disabled,
                node_selector: rc.node_selector.to_string(),
                strategy: rc.strategy.as_str().to_string(),
                rc_labels: rc_labels.get(&idt).cloned().unwrap_or_default(),
                pod_labels: rc.pod_labels.clone(),
                conditions,
                transfer,
                problem: None,
                modify_index: rc.modify_index,
            });
        }
        for (key, inv) in &listing.invalid {
            let id = key.trim_start_matches(crate::rc::RC_PREFIX).to_string();
            let session = RcId::parse(&id).ok().and_then(|i| owner(&i));
            let owner_farm = session
                .as_deref()
                .and_then(|s| farm_of.get(s))
                .map(|f| f.to_string());
            rcs.push(RcOverview {
                current: pods_of.get(&id).map_or(0, |s| s.len()),
                healthy: None,
                nodes: pods_of
                    .get(&id)
                    .map(|s| s.iter().cloned().collect())
                    .unwrap_or_default(),
                rc_labels: rc_labels.get(&id).cloned().unwrap_or_default(),
                id,
                pod_id: None,
                desired: None,
                owner_farm,
                owner_session: session,
                disabled: false,
                node_selector: String::new(),
                strategy: String::new(),
                pod_labels: LabelSet::new(),
                conditions: vec![format!("Invalid: {}", inv.problem)],
                transfer: None,
                problem: Some(inv.problem.to_string()),
                modify_index: inv.modify_index,
            });
        }
        rcs.sort_by(|a, b| a.id.cmp(&b.id));

        // Each farm's share, as the farms compute it.
        let all: BTreeMap<RcId, LabelSet> = rcs
            .iter()
            .filter_map(|r| RcId::parse(&r.id).ok().map(|id| (id, r.rc_labels.clone())))
            .collect();
        let rule = registry::agreed_rule(&farms);
        let assignment = assign(&all, &registry::views(&farms), rule);
        let farms = farms
            .iter()
            .map(|f| {
                let owned: Vec<String> = rcs
                    .iter()
                    .filter(|r| r.owner_session.as_deref() == Some(f.session.as_str()))
                    .map(|r| r.id.clone())
                    .collect();
                FarmOverview {
                    farm_id: f.farm_id.clone(),
                    hostname: f.hostname.clone(),
                    session: f.session.to_string(),
                    rc_selector: f.rc_selector.clone(),
                    http: f.http.clone(),
                    started_at: f.started_at,
                    version: f.version.clone(),
                    owned: owned.len(),
                    fair_share: assignment.cap.get(&f.farm_id).copied().unwrap_or(0),
                    rcs: owned,
                    audit_shipping: f.audit_shipping,
                    assignment_rule: f.assignment_rule,
                }
            })
            .collect();
        Ok(Overview {
            rcs,
            farms,
            orphans,
            index: listing.index,
            assignment_rule: rule.number(),
        })
    }

    pub fn rc(&self, id: &str) -> Option<&RcOverview> {
        self.rcs.iter().find(|r| r.id == id)
    }

    /// RCs whose own labels match `selector`.
    pub fn select(&self, selector: &Selector) -> Vec<&RcOverview> {
        self.rcs
            .iter()
            .filter(|r| selector.matches(&r.rc_labels))
            .collect()
    }
}

/// Node names with their labels, filtered by a selector.
pub async fn nodes(
    consul: &Consul,
    selector: &Selector,
) -> Result<Vec<(String, LabelSet)>, ConsulError> {
    let store = LabelStore::new(consul.clone());
    let (nodes, _) = store.list(LabelType::Node).await.map_err(|e| match e {
        crate::labels::LabelsError::Consul(c) => c,
        other => ConsulError::BadResponse(other.to_string()),
    })?;
    Ok(nodes
        .into_iter()
        .filter(|n| selector.matches(&n.labels))
        .map(|n| (n.id, n.labels))
        .collect())
}

/// The condition of a roll paused for its canary (the farm's status says `Paused`, with why).
pub const CANARY_CONDITION: &str = "Paused (canary)";

/// One rolling update, as Consul shows it.
#[derive(Debug, Clone, Serialize)]
pub struct RollOverview {
    pub id: String,
    pub old_rc: Option<String>,
    pub new_rc: Option<String>,
    pub pod_id: Option<String>,
    pub desired_replicas: u64,
    pub minimum_replicas: u64,
    pub leave_old: bool,
    pub roll_delay: String,
    pub owner_farm: Option<String>,
    pub owner_session: Option<String>,
    /// Desired, current, real (running the RC's manifest) and healthy pods of each RC.
    pub old: Option<RcCounts>,
    pub new: Option<RcCounts>,
    /// What the roll waits for, per the farm carrying it out (when that farm answers).
    pub waiting: Option<String>,
    /// Replica steps the owning farm took.
    pub steps: Option<u64>,
    pub conditions: Vec<String>,
    /// Why the record is invalid, if it is.
    pub problem: Option<String>,
    /// Healthy new pods over the desired count, 0 to 1.
    pub progress: f64,
    pub modify_index: u64,
}

impl RollOverview {
    /// Folds in what the farm carrying the roll out says about it.
    pub fn merge(&mut self, local: &RollStatus) {
        self.waiting = local.waiting.as_ref().map(|(_, why)| why.clone());
        self.steps = Some(local.steps);
        for c in &local.conditions {
            if !self.conditions.iter().any(|x| x.starts_with(&c.kind)) {
                self.conditions.push(format!("{}: {}", c.kind, c.message));
            }
        }
        if let Some(e) = &local.last_error {
            self.conditions.push(format!("Error: {e}"));
        }
    }
}

/// Every rolling update, with both RCs' pods counted as the roll farm counts them (their
/// health, and whether their nodes run the RC's manifest per `reality/`). A handful of reads
/// plus one batched read of the rolls' pods.
pub async fn load_rolls(consul: &Consul) -> Result<Vec<RollOverview>, ConsulError> {
    let q = QueryOptions::default();
    let store_err = |e: RollStoreError| match e {
        RollStoreError::Consul(c) => c,
        other => ConsulError::BadResponse(other.to_string()),
    };
    let rolls = RollStore::new(consul.clone())
        .list()
        .await
        .map_err(store_err)?;
    if rolls.rolls.is_empty() && rolls.invalid.is_empty() {
        return Ok(Vec::new());
    }
    let listing = RcStore::new(consul.clone())
        .list()
        .await
        .map_err(|e| match e {
            crate::rc::RcStoreError::Consul(c) => c,
            other => ConsulError::BadResponse(other.to_string()),
        })?;
    let (locks, _) = consul.kv_list(ROLL_LOCK_PREFIX, &q).await?;
    let holder: BTreeMap<String, String> = locks
        .iter()
        .filter_map(|e| {
            Some((
                e.key.strip_prefix(ROLL_LOCK_PREFIX)?.to_string(),
                e.session.clone()?,
            ))
        })
        .collect();
    let (farm_entries, _) = consul.kv_list(FARMS_PREFIX, &q).await?;
    let farms = registry::live_farms(&farm_entries);
    // The pods of the rolls' RCs, and what their nodes run and report.
    let rc_ids: BTreeSet<RcId> = rolls
        .rolls
        .values()
        .flat_map(|r| [r.update.old_rc, r.update.new_rc])
        .collect();
    let (pods, _) = consul.kv_list(&LabelType::Pod.prefix(), &q).await?;
    let mut pods_of: BTreeMap<RcId, Vec<(String, String)>> = BTreeMap::new();
    for e in &pods {
        let Some((node, pod)) = e
            .key
            .strip_prefix(&LabelType::Pod.prefix())
            .and_then(split_pod_label_id)
        else {
            continue;
        };
        if let Some(rc) = parse_labels(e.value_bytes())
            .ok()
            .and_then(|l| l.get(RC_ID_LABEL).and_then(|v| RcId::parse(v).ok()))
            .filter(|rc| rc_ids.contains(rc))
        {
            pods_of
                .entry(rc)
                .or_default()
                .push((node.to_string(), pod.to_string()));
        }
    }
    let keys: Vec<String> = pods_of
        .values()
        .flatten()
        .flat_map(|(n, p)| [reality_key(n, p), format!("{HEALTH_PREFIX}{p}/{n}")])
        .chain(rolls.rolls.keys().map(|id| control_key(*id)))
        .collect();
    let found = consul.read_keys(&keys).await?;
    let counts = |id: RcId| -> Option<RcCounts> {
        let rc = listing.rcs.get(&id)?;
        let pods = pods_of.get(&id).map(Vec::as_slice).unwrap_or_default();
        Some(RcCounts::count(
            rc.replicas_desired,
            rc.disabled,
            rc.manifest.digest(),
            pods.iter().map(|(n, p)| {
                let real = found.get(&reality_key(n, p));
                // As the roll counts it: a result older than what the node runs says nothing.
                let health = found
                    .get(&format!("{HEALTH_PREFIX}{p}/{n}"))
                    .filter(|kv| {
                        crate::health::speaks_of_reality(
                            kv.modify_index,
                            real.map(|r| r.modify_index),
                            rc.manifest.health_checked(),
                        )
                    })
                    .and_then(|kv| parse_health(kv.value_bytes()).ok());
                (runs(real), health)
            }),
        ))
    };
    let owner = |id: &str| {
        let session = holder.get(id).cloned();
        let farm = session.as_ref().and_then(|s| {
            farms
                .iter()
                .find(|f| &f.session == s)
                .map(|f| f.farm_id.clone())
        });
        (session, farm)
    };
    let mut out = Vec::new();
    for r in rolls.rolls.values() {
        let u = &r.update;
        let id = r.id().to_string();
        let (owner_session, owner_farm) = owner(&id);
        let (old, new) = (counts(u.old_rc), counts(u.new_rc));
        let mut conditions = Vec::new();
        for (which, rc, c) in [("old", u.old_rc, &old), ("new", u.new_rc, &new)] {
            if c.is_none() {
                let why = if listing.invalid.contains_key(&rc.key()) {
                    "is invalid"
                } else {
                    "does not exist"
                };
                conditions.push(format!("Blocked: the {which} RC {rc} {why}"));
            }
        }
        if let Some(c) = rolls.conflict(r) {
            conditions.push(format!("Blocked: {c}"));
        }
        if let Some(kv) = found.get(&control_key(r.id())) {
            match RollControl::parse(kv.value_bytes()) {
                Ok(c) => {
                    if let Some(f) = &c.failed {
                        conditions.push(format!("Failed: {}", f.reason));
                    }
                    if c.canary_paused() {
                        conditions.push(format!(
                            "{CANARY_CONDITION}: its {} canary pods are up; `rcctl roll promote {}` goes on to the end",
                            c.canary.unwrap_or_default(),
                            r.id()
                        ));
                    } else if c.paused {
                        conditions.push(format!("Paused: {}", c.describe()));
                    }
                    if let Some(failed) = c.revert_of {
                        conditions.push(format!(
                            "Reverting: rolls back the failed rolling update {failed}"
                        ));
                    }
                }
                Err(e) => {
                    conditions.push(format!("Paused: its control record is unreadable ({e})"))
                }
            }
        }
        if owner_session.is_none() {
            conditions.push("Unowned".into());
        }
        let progress = new.map_or(0.0, |n| {
            (n.healthy.min(u.desired_replicas) as f64 / u.desired_replicas.max(1) as f64)
                .clamp(0.0, 1.0)
        });
        out.push(RollOverview {
            id,
            old_rc: Some(u.old_rc.to_string()),
            new_rc: Some(u.new_rc.to_string()),
            pod_id: listing.rcs.get(&u.new_rc).map(|rc| rc.pod_id().to_string()),
            desired_replicas: u.desired_replicas,
            minimum_replicas: u.minimum_replicas,
            leave_old: u.leave_old,
            roll_delay: crate::util::format_go_duration(u.roll_delay),
            owner_farm,
            owner_session,
            old,
            new,
            waiting: None,
            steps: None,
            conditions,
            problem: None,
            progress,
            modify_index: r.modify_index,
        });
    }
    for (key, inv) in &rolls.invalid {
        let id = key.trim_start_matches(ROLL_PREFIX).to_string();
        let (owner_session, owner_farm) = owner(&id);
        out.push(RollOverview {
            id,
            old_rc: None,
            new_rc: None,
            pod_id: None,
            desired_replicas: 0,
            minimum_replicas: 0,
            leave_old: false,
            roll_delay: "0s".into(),
            owner_farm,
            owner_session,
            old: None,
            new: None,
            waiting: None,
            steps: None,
            conditions: vec![format!("Invalid: {}", inv.problem)],
            problem: Some(inv.problem.to_string()),
            progress: 0.0,
            modify_index: inv.modify_index,
        });
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

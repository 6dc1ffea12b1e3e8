//! What RC tasks and the farm report about themselves, readable in-process (HTTP API, status
//! page, tests).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use parking_lot::RwLock;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::plan::Transfer;
use crate::rc::RcId;
use crate::scheduler::NodeName;

/// A condition an RC is in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Condition {
    /// `Unmet`, `Invalid`, `Transferring`, `Disabled`, `Waiting`, `Error`.
    pub kind: String,
    pub message: String,
    pub since: DateTime<Utc>,
}

/// Sets (or with `None` clears) the condition `kind`, keeping its `since` while it stays.
pub fn set_condition(conditions: &mut Vec<Condition>, kind: &str, message: Option<String>) {
    match message {
        None => conditions.retain(|c| c.kind != kind),
        Some(message) => match conditions.iter_mut().find(|c| c.kind == kind) {
            Some(c) => c.message = message,
            None => conditions.push(Condition {
                kind: kind.to_string(),
                message,
                since: Utc::now(),
            }),
        },
    }
}

/// One RC as its owning farm sees it.
#[derive(Debug, Clone, Serialize)]
pub struct RcStatus {
    pub id: RcId,
    pub pod_id: Option<String>,
    /// The RC's node selector: alerts carry it, as P2's pages did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    pub owner_farm: String,
    pub desired: Option<u64>,
    pub current: usize,
    pub healthy: usize,
    pub nodes: Vec<NodeName>,
    pub disabled: bool,
    pub conditions: Vec<Condition>,
    pub transfer: Option<Transfer>,
    pub last_error: Option<String>,
    pub last_pass: Option<DateTime<Utc>>,
    pub passes: u64,
}

impl RcStatus {
    pub fn new(id: RcId, owner_farm: &str) -> Self {
        RcStatus {
            id,
            pod_id: None,
            selector: None,
            owner_farm: owner_farm.to_string(),
            desired: None,
            current: 0,
            healthy: 0,
            nodes: Vec::new(),
            disabled: false,
            conditions: Vec::new(),
            transfer: None,
            last_error: None,
            last_pass: None,
            passes: 0,
        }
    }

    /// Sets (or with `None` clears) a condition, keeping its `since` while it stays.
    pub fn set_condition(&mut self, kind: &str, message: Option<String>) {
        set_condition(&mut self.conditions, kind, message);
    }

    pub fn has_condition(&self, kind: &str) -> bool {
        self.conditions.iter().any(|c| c.kind == kind)
    }
}

/// [`StatusRegistry::scrape`]: sums over every RC the farm serves, and the statuses that have
/// series of their own.
#[derive(Debug, Default)]
pub struct RcScrape {
    pub desired: u64,
    pub current: u64,
    pub healthy: u64,
    /// RCs in the `Unmet` condition.
    pub unmet: usize,
    /// The RCs with a condition or a transfer in flight, in id order.
    pub noted: Vec<RcStatus>,
}

/// The farm as it sees itself.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FarmStatus {
    pub farm_id: String,
    pub session: Option<String>,
    pub session_name: String,
    pub owned: usize,
    pub fair_share: usize,
    pub live_farms: Vec<String>,
    /// The assignment rule the live farms agree on (`--assignment-rule`).
    pub assignment_rule: u32,
    pub matching_rcs: usize,
    pub invalid_rcs: usize,
    pub owned_rolls: usize,
    pub invalid_rolls: usize,
    pub synced: bool,
    pub session_losses: u64,
    /// No renewal has succeeded for a TTL; the farm holds on and takes nothing new.
    pub session_in_doubt: bool,
    /// Whether this farm ships the audit outbox to SQL (`--audit-shipping`, `--audit-db`).
    pub audit_shipping: bool,
    /// Where this farm's audit records go, for operators.
    pub audit_destination: String,
    /// Farm-wide conditions (`FailsafeTripped`).
    pub conditions: Vec<Condition>,
    /// The removal budget and tripwire (`--max-removals`, `--failsafe-confirm`).
    pub failsafe: Option<crate::failsafe::FailsafeStatus>,
}

/// Shared status of a farm and its RCs.
#[derive(Debug, Default)]
pub struct StatusRegistry {
    rcs: RwLock<RcStatuses>,
    farm: RwLock<FarmStatus>,
}

/// The RCs' statuses, and the sum of their `current` kept beside them: the farm reads it at
/// every turn of its loop, and a sum over every RC there cost a walk of the whole map.
#[derive(Debug, Default)]
struct RcStatuses {
    by_id: BTreeMap<RcId, RcStatus>,
    current: usize,
}

impl StatusRegistry {
    /// Updates the status of `id` on behalf of its task, unless the task was stopped
    /// (`stopped` cancelled). Checked under the registry's lock: the farm cancels a task before
    /// it forgets its status (`remove_rc`, `clear_rcs`), so a task stopped without being awaited
    /// (a session lost, a write fenced) cannot bring its RC back afterwards. Such a status would
    /// keep the RC's pods in this farm's count of the pods it serves (the base of the cluster's
    /// removal limit) while the farm that took the RC over counts them too.
    pub fn update_rc(
        &self,
        id: RcId,
        owner: &str,
        stopped: &CancellationToken,
        f: impl FnOnce(&mut RcStatus),
    ) {
        let mut rcs = self.rcs.write();
        if stopped.is_cancelled() {
            return;
        }
        let RcStatuses { by_id, current } = &mut *rcs;
        let status = by_id.entry(id).or_insert_with(|| RcStatus::new(id, owner));
        let before = status.current;
        f(status);
        *current = *current - before + status.current;
    }

    pub fn remove_rc(&self, id: RcId) {
        let mut rcs = self.rcs.write();
        if let Some(s) = rcs.by_id.remove(&id) {
            rcs.current -= s.current;
        }
    }

    pub fn clear_rcs(&self) {
        *self.rcs.write() = RcStatuses::default();
    }

    pub fn rc(&self, id: RcId) -> Option<RcStatus> {
        self.rcs.read().by_id.get(&id).cloned()
    }

    /// Pods the farm's RCs run now (the base of a percentage `--max-removals`).
    pub fn pods_current(&self) -> usize {
        self.rcs.read().current
    }

    /// [`StatusRegistry::pods_current`] without the pods of `ids`, read at one instant.
    pub fn pods_current_without(&self, ids: &[RcId]) -> usize {
        let rcs = self.rcs.read();
        let leaving: usize = ids
            .iter()
            .filter_map(|id| rcs.by_id.get(id))
            .map(|s| s.current)
            .sum();
        rcs.current.saturating_sub(leaving)
    }

    /// What a scrape of `/metrics` needs of the RCs, read at one instant: sums over every RC,
    /// and copies of only the statuses that have series of their own (a condition or a
    /// transfer). A copy of every status per scrape took 44-51 ms at 50,000 RCs, each copy
    /// with its nodes and strings (BENCHMARKS.md, "The SIGTERM handover at a million pods").
    pub fn scrape(&self) -> RcScrape {
        let rcs = self.rcs.read();
        let mut out = RcScrape {
            current: rcs.current as u64,
            ..RcScrape::default()
        };
        for s in rcs.by_id.values() {
            out.desired += s.desired.unwrap_or(0);
            out.healthy += s.healthy as u64;
            out.unmet += usize::from(s.has_condition("Unmet"));
            if !s.conditions.is_empty() || s.transfer.is_some() {
                out.noted.push(s.clone());
            }
        }
        out
    }

    pub fn farm(&self) -> FarmStatus {
        self.farm.read().clone()
    }

    pub fn update_farm(&self, f: impl FnOnce(&mut FarmStatus)) {
        f(&mut self.farm.write());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stopped_task_cannot_bring_its_rc_back_into_the_count() {
        let reg = StatusRegistry::default();
        let (a, b) = (RcId::new(), RcId::new());
        let (live_a, live_b) = (CancellationToken::new(), CancellationToken::new());
        reg.update_rc(a, "f", &live_a, |s| s.current = 3);
        reg.update_rc(b, "f", &live_b, |s| s.current = 2);
        assert_eq!(reg.pods_current(), 5);
        assert_eq!(reg.pods_current_without(&[a]), 2);
        // The session is lost: every task is cancelled (not awaited), then the statuses go.
        live_a.cancel();
        live_b.cancel();
        reg.clear_rcs();
        // A task still finishing its pass reports after that: nothing comes back.
        reg.update_rc(a, "f", &live_a, |s| s.current = 3);
        assert_eq!(reg.pods_current(), 0);
        assert!(reg.rc(a).is_none());
        // A task handed over (cancelled, then forgotten) likewise.
        let live_c = CancellationToken::new();
        reg.update_rc(b, "f", &live_c, |s| s.current = 2);
        live_c.cancel();
        reg.remove_rc(b);
        reg.update_rc(b, "f", &live_c, |s| s.current = 4);
        assert_eq!(reg.pods_current(), 0);
    }

    /// A scrape sums every RC's figures, and copies only the statuses that have series of
    /// their own.
    #[test]
    fn a_scrape_sums_every_rc_and_copies_only_those_with_conditions() {
        let reg = StatusRegistry::default();
        let live = CancellationToken::new();
        let ids: Vec<RcId> = (0..5).map(|_| RcId::new()).collect();
        for (n, id) in ids.iter().enumerate() {
            reg.update_rc(*id, "f", &live, |s| {
                s.desired = Some(n as u64 + 1);
                s.current = n;
                s.healthy = n / 2;
                s.nodes = vec![format!("node-{n}").as_str().into()];
                if n == 1 {
                    s.set_condition("Unmet", Some("1 of 2".into()));
                }
                if n == 3 {
                    s.set_condition("Disabled", Some("disabled".into()));
                }
            });
        }
        let got = reg.scrape();
        // 1 + … + 5, 0 + … + 4, and 0 + 0 + 1 + 1 + 2.
        assert_eq!(got.desired, 15);
        assert_eq!(got.current, 10);
        assert_eq!(got.healthy, 4);
        assert_eq!(got.unmet, 1);
        let noted: Vec<RcId> = got.noted.iter().map(|r| r.id).collect();
        let mut want = vec![ids[1], ids[3]];
        want.sort();
        assert_eq!(noted, want, "only the RCs with a condition are copied");
    }
}

//! What roll tasks report about themselves, readable in-process (HTTP API, status page, tests).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use parking_lot::RwLock;
use serde::Serialize;

use super::plan::{RcCounts, WaitKind};
use super::record::RollId;
use crate::rc::RcId;
use crate::rctask::{Condition, set_condition};

/// One roll as its owning farm sees it.
#[derive(Debug, Clone, Serialize)]
pub struct RollStatus {
    pub id: RollId,
    pub owner_farm: String,
    pub old_rc: Option<RcId>,
    pub new_rc: Option<RcId>,
    pub desired_replicas: u64,
    pub minimum_replicas: u64,
    pub leave_old: bool,
    pub roll_delay: String,
    pub old: Option<RcCounts>,
    pub new: Option<RcCounts>,
    /// What the roll waits for, if it waits.
    pub waiting: Option<(WaitKind, String)>,
    /// `Stalled`, `Invalid`, `Blocked`.
    pub conditions: Vec<Condition>,
    /// Replica steps taken by this farm.
    pub steps: u64,
    pub last_step: Option<DateTime<Utc>>,
    /// The fewest healthy pods (old + new) this farm saw while it carried the roll out.
    pub lowest_healthy: Option<u64>,
    pub last_error: Option<String>,
    /// Passes this farm has made over the roll: each a look at it (a planned step, or a
    /// reason to wait), on every change and at least every `--roll-resync`.
    pub passes: u64,
}

impl RollStatus {
    pub fn new(id: RollId, owner_farm: &str) -> Self {
        RollStatus {
            id,
            owner_farm: owner_farm.to_string(),
            old_rc: None,
            new_rc: None,
            desired_replicas: 0,
            minimum_replicas: 0,
            leave_old: false,
            roll_delay: "0s".into(),
            old: None,
            new: None,
            waiting: None,
            conditions: Vec::new(),
            steps: 0,
            last_step: None,
            lowest_healthy: None,
            last_error: None,
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

/// Shared status of a farm's rolls.
#[derive(Debug, Default)]
pub struct RollStatusRegistry {
    rolls: RwLock<BTreeMap<RollId, RollStatus>>,
}

impl RollStatusRegistry {
    pub fn update(&self, id: RollId, owner: &str, f: impl FnOnce(&mut RollStatus)) {
        let mut rolls = self.rolls.write();
        f(rolls
            .entry(id)
            .or_insert_with(|| RollStatus::new(id, owner)));
    }

    pub fn remove(&self, id: RollId) {
        self.rolls.write().remove(&id);
    }

    /// Counts a pass over a roll this farm still reports (a completed or reverted roll's
    /// status is gone, and stays gone).
    pub fn count_pass(&self, id: RollId) {
        if let Some(s) = self.rolls.write().get_mut(&id) {
            s.passes += 1;
        }
    }

    pub fn clear(&self) {
        self.rolls.write().clear();
    }

    pub fn get(&self, id: RollId) -> Option<RollStatus> {
        self.rolls.read().get(&id).cloned()
    }

    pub fn all(&self) -> Vec<RollStatus> {
        self.rolls.read().values().cloned().collect()
    }
}

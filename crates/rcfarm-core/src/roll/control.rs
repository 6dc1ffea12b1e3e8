//! What operators say about a roll beyond P2's record (paused or not, its pace, its progress
//! deadline) and whether its farm failed it. Kept at
//! `rcfarm/rolls/<id>` (P2's tools never read it) so that P2's `rolls/<id>` stays byte for byte
//! P2's. Every write a roll task makes is guarded by this key's version (or, while it does not
//! exist, creates it), so a pause written while a step is planned makes that step's transaction
//! fail: a paused roll takes no step, not even one already planned. It also says who created
//! the roll (for the revision history) and whether a failure is reverted by the farm.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::record::RollId;
use crate::consul::TxnOp;

/// Where the controls of rolls live.
pub const CONTROL_PREFIX: &str = "rcfarm/rolls/";

/// `rcfarm/rolls/<id>`.
pub fn control_key(id: RollId) -> String {
    format!("{CONTROL_PREFIX}{id}")
}

/// An operator's say over one roll.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RollControl {
    #[serde(default)]
    pub paused: bool,
    /// Who paused it (`rcctl:<user>@<host>`), and when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_by: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_at: Option<DateTime<Utc>>,
    /// At most this many pods replaced per step, even where the minimum would allow more
    /// (`--max-parallel`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_parallel: Option<u64>,
    /// No new pod becoming up for this long fails the roll (Go duration, `--progress-deadline`);
    /// the farm's `--roll-progress-deadline` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_deadline: Option<String>,
    /// Set by the farm when the roll failed: a terminal state, kept until an operator acts
    /// (`rcctl roll resume` gives it another deadline, `rcctl roll abort` ends it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<RollFailure>,
    /// The roll's last progress (written with each step): a farm that takes the roll over
    /// counts its progress deadline from here, so a handover does not postpone a failure.
    /// Cleared by a resume or a promotion (another deadline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    /// Replace this many pods first, then pause until promoted (`--canary K`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<u64>,
    /// Who promoted the canary (`rcctl roll promote`), and when: the roll goes on to the end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promoted_by: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promoted_at: Option<DateTime<Utc>>,
    /// Who created the roll (`rcctl:<user>@<host>`, or the farm for an auto-revert): the
    /// `by` of the revision the replaced RC leaves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_by: Option<String>,
    /// When the roll fails, the farm rolls back to the old RC itself (`--auto-revert`); the
    /// farm's `--roll-auto-revert` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_revert: Option<bool>,
    /// Set on a roll the farm started to revert a failed one (that roll's id). Such a roll is
    /// never reverted itself: a revert that fails stays Failed (no revert loop).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revert_of: Option<RollId>,
}

/// A roll's last progress as its owner recorded it with a step: when, and how many new pods
/// were up then.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    pub at: DateTime<Utc>,
    pub new_up: u64,
}

/// Why and when a roll failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RollFailure {
    pub reason: String,
    pub at: DateTime<Utc>,
}

/// Who a pause is by when the farm paused the roll for its canary.
pub const CANARY_PAUSER: &str = "canary";

impl RollControl {
    /// The progress deadline this roll runs under: its own (`--progress-deadline`) when it
    /// names a positive one, else the farm's (`--roll-progress-deadline`).
    pub fn progress_deadline_or(&self, farm_default: std::time::Duration) -> std::time::Duration {
        self.progress_deadline
            .as_deref()
            .and_then(|d| crate::util::parse_go_duration(d).ok())
            .filter(|d| !d.negative && d.nanos > 0)
            .map_or(farm_default, |d| std::time::Duration::from_nanos(d.nanos))
    }

    /// The canary still to prove itself: its size, until promoted.
    pub fn canary_pending(&self) -> Option<u64> {
        self.canary.filter(|_| self.promoted_by.is_none())
    }

    /// Paused by the farm because its canary is up: only a promotion goes on.
    pub fn canary_paused(&self) -> bool {
        self.paused && self.paused_by.as_deref() == Some(CANARY_PAUSER)
    }

    pub fn parse(bytes: &[u8]) -> Result<RollControl, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("not a roll control record: {e}"))
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        // A struct of plain fields always serializes.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// "paused by X at T", for conditions and messages.
    pub fn describe(&self) -> String {
        if self.canary_paused() {
            let mut s = format!(
                "paused (canary): its {} canary pods are up; promote it to go on (rcctl roll promote)",
                self.canary.unwrap_or_default()
            );
            if let Some(at) = &self.paused_at {
                s.push_str(&format!(", since {}", at.format("%Y-%m-%dT%H:%M:%SZ")));
            }
            return s;
        }
        let mut s = "paused".to_string();
        if let Some(by) = &self.paused_by {
            s.push_str(&format!(" by {by}"));
        }
        if let Some(at) = &self.paused_at {
            s.push_str(&format!(" at {}", at.format("%Y-%m-%dT%H:%M:%SZ")));
        }
        s
    }

    /// Whether the farm reverts this roll when it fails: never a revert itself, else as the
    /// roll says, else the farm's default.
    pub fn reverts(&self, farm_default: bool) -> bool {
        self.revert_of.is_none() && self.auto_revert.unwrap_or(farm_default)
    }
}

/// A roll's control as last read: its record and the key's version (0: no key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlSeen {
    pub control: Result<RollControl, String>,
    pub index: u64,
}

impl ControlSeen {
    pub fn absent() -> ControlSeen {
        ControlSeen {
            control: Ok(RollControl::default()),
            index: 0,
        }
    }

    pub fn from_entry(value: &[u8], index: u64) -> ControlSeen {
        ControlSeen {
            control: RollControl::parse(value),
            index,
        }
    }

    /// The guard a roll task's write carries: the key unchanged since read, or still absent
    /// (then created, unpaused, by the same transaction).
    pub fn guard(&self, id: RollId) -> TxnOp {
        if self.index > 0 {
            TxnOp::check_index(control_key(id), self.index)
        } else {
            TxnOp::cas(control_key(id), RollControl::default().to_bytes(), 0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rc::RcId;

    #[test]
    fn a_control_round_trips_and_guards_by_version() {
        let c = RollControl {
            paused: true,
            paused_by: Some("rcctl:ops@host".into()),
            paused_at: None,
            max_parallel: Some(2),
            progress_deadline: Some("10m".into()),
            canary: Some(1),
            ..Default::default()
        };
        assert_eq!(RollControl::parse(&c.to_bytes()).unwrap(), c);
        assert_eq!(c.describe(), "paused by rcctl:ops@host");
        assert!(!RollControl::parse(b"{}").unwrap().paused);
        assert_eq!(c.canary_pending(), Some(1));
        assert!(!c.canary_paused());
        let canary = RollControl {
            paused: true,
            paused_by: Some(CANARY_PAUSER.into()),
            ..c.clone()
        };
        assert!(canary.canary_paused());
        assert!(
            canary
                .describe()
                .starts_with("paused (canary): its 1 canary pods are up")
        );
        let promoted = RollControl {
            promoted_by: Some("rcctl:ops@host".into()),
            ..c.clone()
        };
        assert_eq!(promoted.canary_pending(), None);
        assert!(RollControl::parse(b"nope").is_err());
        // A revert is never reverted, whatever it or the farm says.
        assert!(c.reverts(true) && !c.reverts(false));
        let revert = RollControl {
            auto_revert: Some(true),
            revert_of: Some(RcId::new()),
            ..Default::default()
        };
        assert!(!revert.reverts(true));
        assert!(
            !RollControl {
                auto_revert: Some(false),
                ..Default::default()
            }
            .reverts(true)
        );
        let id = RcId::new();
        let seen = ControlSeen::from_entry(&c.to_bytes(), 42);
        assert_eq!(seen.guard(id), TxnOp::check_index(control_key(id), 42));
        assert_eq!(
            ControlSeen::absent().guard(id),
            TxnOp::cas(control_key(id), RollControl::default().to_bytes(), 0)
        );
    }
}

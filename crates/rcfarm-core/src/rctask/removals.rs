//! The RC task's side of the farm's failsafe ([`crate::failsafe`]): an action that takes
//! capacity away (a scale-down, a replacement of an older pod id, a repair that rewrites an
//! intent running another manifest) is capped to the room the cluster's removal window had at
//! its last read, and each of its writes charges the window in its own transaction; one whose pods go with a
//! replacement already up (a node transfer's end), or whose lost capacity its rolling update
//! charged (a retired old RC), is not charged, but waits like every removal while the
//! tripwire is tripped. What counts is [`crate::rctask::plan::removals`]. An RC held reports
//! `RemovalsHeld` (condition, metric, one audit record per episode). Taking over pods a
//! rolling update gave up removes nothing of this RC's.

use serde_json::json;

use super::outcome::{Gated, GrantedRemovals, TaskError};
use super::plan::{Action, Observed, removals, within_grant};
use super::worker::Worker;
use crate::audit::{AuditRecord, events};
use crate::rc::Rc;
use crate::scheduler::NodeName;

impl Worker {
    /// Asks the farm's failsafe for what `action` removes.
    pub(super) fn gate_removals(&self, o: &Observed<'_>, action: Action) -> Gated {
        let cost = removals(&action, o);
        if !cost.any() {
            return Gated::Go {
                action,
                removals: GrantedRemovals::default(),
            };
        }
        if let Some(why) = self.ctx.failsafe.tripped() {
            // Only what removes nothing goes ahead (a missing intent rewritten).
            if cost.harmless.is_empty() {
                return Gated::Held(why);
            }
            return Gated::Go {
                action: Action::Repair(cost.harmless),
                removals: GrantedRemovals::default(),
            };
        }
        if cost.counted.is_empty() {
            return Gated::Go {
                action,
                removals: GrantedRemovals::default(),
            };
        }
        // The room as last read: each write charges what it removes in its own transaction,
        // and one that finds the room gone since is held then (`TaskError::Held`).
        let (room, held) = self.ctx.failsafe.room();
        let granted = (cost.counted.len() as u64).min(room) as usize;
        let Some(action) = within_grant(action, &cost, granted) else {
            return Gated::Held(held.unwrap_or_default());
        };
        let keep: Vec<NodeName> = cost.counted.into_iter().take(granted).collect();
        Gated::Go {
            action,
            removals: GrantedRemovals::new(keep),
        }
    }

    /// Reports the RC held (condition always, audit record once per episode) or not held.
    pub(super) async fn settle_held(
        &mut self,
        rc: &Rc,
        o: &Observed<'_>,
        held: Option<String>,
    ) -> Result<(), TaskError> {
        let who = format!("rc:{}", self.id);
        match &held {
            Some(why) => {
                // The tripwire says it once for the whole farm: no record per RC for it.
                if !self.held.1 && !why.starts_with(crate::failsafe::TRIPPED) {
                    let audit = AuditRecord::new(
                        events::REMOVALS_HELD,
                        json!({
                            "replication_controller_id": self.id,
                            "pod_id": rc.pod_id(),
                            "farm_id": self.ctx.farm_id,
                            "desired": rc.replicas_desired,
                            "current": o.current.len(),
                            "reason": why,
                        }),
                    );
                    // On failure: reported on the next pass.
                    self.commit(vec![], vec![audit]).await?;
                    self.held.1 = true;
                }
                if !self.held.0 {
                    tracing::warn!(reason = %why, "removals held");
                    self.ctx.failsafe.set_held(&who, true);
                    self.held.0 = true;
                }
            }
            None => {
                if std::mem::take(&mut self.held) != (false, false) {
                    tracing::info!("removals no longer held");
                    self.ctx.failsafe.set_held(&who, false);
                }
            }
        }
        self.set_status(|s| s.set_condition("RemovalsHeld", held));
        Ok(())
    }
}

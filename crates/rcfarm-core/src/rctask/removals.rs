//! The RC task's side of the farm's failsafe ([`crate::failsafe`]): every action that removes
//! pods (a scale-down, a replacement of an older pod id, a repair that rewrites an intent
//! running another manifest, the start of a node transfer) asks the farm's removal budget
//! first and does only what it was granted; an RC held reports `RemovalsHeld` (condition,
//! metric, one audit record per episode). Taking over pods a rolling update gave up is not
//! counted here: the roll's step was (each removal is counted once, where it is decided).

use serde_json::json;

use super::outcome::{Gated, TaskError};
use super::plan::{Action, Observed};
use super::worker::Worker;
use crate::audit::{AuditRecord, events};
use crate::rc::Rc;
use crate::scheduler::NodeName;

impl Worker {
    /// How many pods `action` would remove, and which nodes it may touch for free.
    fn removals_of(&self, rc: &Rc, action: &Action) -> (Vec<NodeName>, Vec<NodeName>) {
        match action {
            Action::Unschedule(t) | Action::Replace(t) => (t.clone(), Vec::new()),
            // Rewriting a missing intent removes nothing; rewriting one that runs another
            // manifest replaces the pod.
            Action::Repair(t) => t.iter().cloned().partition(|n| {
                self.ctx
                    .intents
                    .runs_other(n, rc.pod_id(), rc.manifest.digest())
            }),
            Action::StartTransfer { old, .. } => (vec![old.clone()], Vec::new()),
            _ => (Vec::new(), Vec::new()),
        }
    }

    /// Asks the farm's removal budget for what `action` removes.
    pub(super) fn gate_removals(&self, rc: &Rc, action: Action) -> Gated {
        let (costly, free) = self.removals_of(rc, &action);
        if costly.is_empty() {
            return Gated::Go { action, granted: 0 };
        }
        let grant = self.ctx.failsafe.take(costly.len() as u64);
        let granted = grant.granted as usize;
        if granted == 0 && free.is_empty() {
            return Gated::Held(grant.held.unwrap_or_default());
        }
        if granted == costly.len() {
            return Gated::Go {
                action,
                granted: grant.granted,
            };
        }
        // The plan orders its victims (ineligible, unhealthy, then by name): keep its first.
        let keep: Vec<NodeName> = costly.into_iter().take(granted).chain(free).collect();
        let action = match action {
            Action::Unschedule(_) => Action::Unschedule(keep),
            Action::Replace(_) => Action::Replace(keep),
            Action::Repair(t) => {
                Action::Repair(t.into_iter().filter(|n| keep.contains(n)).collect())
            }
            other => other,
        };
        Gated::Go {
            action,
            granted: grant.granted,
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
        self.ctx.status.update_rc(self.id, &self.ctx.farm_id, |s| {
            s.set_condition("RemovalsHeld", held)
        });
        Ok(())
    }
}

//! The farm's side of its failsafe ([`crate::failsafe`]): the tripwire's look at the RC tree,
//! operators' releases (`rcfarm/failsafe/release/<farm-id>`), the base of a percentage limit,
//! and what the farm reports about it (log, status, metric, audit).

use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde_json::json;

use super::rcs::OwnedRcs;
use super::rolls::OwnedRolls;
use super::{Farm, Serving, Views};
use crate::audit::{AuditRecord, events};
use crate::failsafe::{Release, Tree, TreeShape, TripEvent};
use crate::labels::Selector;
use crate::rc::{RC_ID_LABEL, RcId, RcListing};
use crate::rctask::TaskHandle;

/// What the farm last acted on.
#[derive(Debug)]
pub(super) struct FailsafeSeen {
    /// The RC listing's index last looked at.
    listing: u64,
    /// The release key's index last acted on (or set aside as older than this farm).
    release: u64,
    started: DateTime<Utc>,
    /// `FAILSAFE_TRIPPED`/`…_CLEARED` records not yet committed: retried until they are, like
    /// every audit record (each named after its trip, so a retry after a lost answer writes it
    /// once).
    unrecorded: Vec<AuditRecord>,
}

impl Default for FailsafeSeen {
    fn default() -> Self {
        FailsafeSeen {
            listing: 0,
            release: 0,
            started: Utc::now(),
            unrecorded: Vec::new(),
        }
    }
}

/// Whether pods of the listing's RCs exist (something would be removed).
fn removable(views: &Views, listing: &RcListing) -> bool {
    let Ok(sel) = Selector::parse(RC_ID_LABEL) else {
        return true;
    };
    views.pods.matches(&sel).iter().any(|id| {
        views
            .pods
            .get(id)
            .and_then(|l| l.get(RC_ID_LABEL).and_then(|v| RcId::parse(v).ok()))
            .is_some_and(|rc| listing.rcs.contains_key(&rc))
    })
}

impl Farm {
    /// Looks at the RC tree and the release key; reports and wakes tasks when the failsafe
    /// lets go.
    pub(super) async fn watch_failsafe(
        &self,
        views: &Views,
        sv: &Serving<'_>,
        owned: &OwnedRcs,
        rolls: &OwnedRolls,
    ) {
        let fs = &self.failsafe;
        fs.set_served(self.status.pods_current() as u64);
        self.record_trips(sv).await;
        let mut wake = false;
        if let Some(snap) = views.release.latest() {
            let (index, release) = match &snap.value {
                Some(kv) => (kv.modify_index, Release::parse(kv.value_bytes()).ok()),
                None => (0, None),
            };
            let mut seen = self.failsafe_seen.lock();
            // A release older than this farm's start is not for it (its window started empty).
            let fresh = index != seen.release
                && release
                    .as_ref()
                    .is_some_and(|r| seen.release != 0 || r.at >= seen.started);
            seen.release = index;
            drop(seen);
            if fresh && let Some(r) = release {
                let ended_trip = fs.release();
                tracing::warn!(by = %r.by, at = %r.at, ended_trip, "removals released by an operator: the removal window starts empty");
                wake = true;
            }
        }
        // `--failsafe-confirm 0s`: no tripwire, nothing to look at.
        let tripwire = !fs.config().confirm.is_zero();
        if tripwire && let Some(listing) = views.rcs.latest() {
            let pending = fs.status().tripped.is_some();
            let changed = {
                let mut seen = self.failsafe_seen.lock();
                std::mem::replace(&mut seen.listing, listing.index) != listing.index
            };
            if changed || pending {
                let replicas = listing.rcs.iter().map(|(id, r)| (*id, r.replicas_desired));
                let shape =
                    Tree::of(replicas.clone().map(|(_, r)| r), listing.invalid.len()).shape();
                let can_remove = shape == TreeShape::AllZero && removable(views, &listing);
                let trip_before = fs.status().tripped_since;
                if let Some(ev) = fs.observe_tree(replicas, listing.invalid.len(), can_remove) {
                    let since = match ev {
                        TripEvent::Tripped(_) => fs.status().tripped_since,
                        _ => trip_before,
                    };
                    wake |= !matches!(ev, TripEvent::Tripped(_));
                    self.report_trip(sv, &listing, ev, since).await;
                }
            }
        }
        let status = fs.status();
        self.status.update_farm(|f| {
            crate::rctask::set_condition(
                &mut f.conditions,
                "FailsafeTripped",
                status.tripped.clone(),
            );
            f.failsafe = Some(status);
        });
        if wake {
            owned.tasks.values().for_each(TaskHandle::wake);
            rolls.tasks.values().for_each(|t| t.wake());
        }
    }

    /// Log, metric and audit record of what the tripwire decided (the trip it concerns began
    /// at `since`).
    async fn report_trip(
        &self,
        sv: &Serving<'_>,
        listing: &Arc<RcListing>,
        ev: TripEvent,
        since: Option<DateTime<Utc>>,
    ) {
        let confirm = crate::util::format_go_duration(self.failsafe.config().confirm);
        let (event, details) = match &ev {
            TripEvent::Tripped(why) => {
                tracing::error!(reason = %why, rcs = listing.rcs.len(), "FAILSAFE TRIPPED: this farm removes no pod until the state is confirmed or an operator runs `rcctl farm release-removals`");
                metrics::counter!("rcfarm_failsafe_trips_total").increment(1);
                (
                    events::FAILSAFE_TRIPPED,
                    json!({"reason": why, "rcs": listing.rcs.len(), "confirm": confirm}),
                )
            }
            TripEvent::Confirmed => {
                tracing::warn!(%confirm, "failsafe: the RC tree stayed so for the confirmation window; acting on it");
                (
                    events::FAILSAFE_CLEARED,
                    json!({"reason": format!("confirmed: the state held for {confirm}"), "rcs": listing.rcs.len()}),
                )
            }
            TripEvent::Cleared(why) => {
                tracing::warn!(reason = %why, "failsafe cleared");
                (
                    events::FAILSAFE_CLEARED,
                    json!({"reason": why, "rcs": listing.rcs.len()}),
                )
            }
        };
        let mut details = details;
        details["farm_id"] = json!(self.config.farm_id);
        // One record per trip and event: a retry writes the same one.
        let identity = format!(
            "failsafe:{}:{event}:{}",
            self.config.farm_id,
            since.map(|t| t.to_rfc3339()).unwrap_or_default()
        );
        let audit =
            AuditRecord::deterministic(&identity, event, details).at(self.config.clock.wall());
        self.failsafe_seen.lock().unrecorded.push(audit);
        self.record_trips(sv).await;
    }

    /// Commits the failsafe's records not yet committed, fenced by the farm's registration
    /// (a farm without its session says nothing until it has a new one); what fails stays for
    /// the next look.
    async fn record_trips(&self, sv: &Serving<'_>) {
        let pending = std::mem::take(&mut self.failsafe_seen.lock().unrecorded);
        let mut left = Vec::new();
        for audit in pending {
            let txn = crate::consul::FencedTxn::fenced(crate::consul::Fence::new(
                sv.info.key(),
                sv.session.id(),
            ))
            .records([audit.txn_op()]);
            match txn.commit(&self.consul).await {
                Ok(_) | Err(crate::consul::FenceError::AlreadyRecorded) => {}
                Err(e) => {
                    tracing::warn!(error = %e, event = %audit.event_type, "cannot record the failsafe's audit event yet; retrying");
                    left.push(audit);
                }
            }
        }
        if !left.is_empty() {
            let mut seen = self.failsafe_seen.lock();
            left.append(&mut seen.unrecorded);
            seen.unrecorded = left;
        }
    }
}

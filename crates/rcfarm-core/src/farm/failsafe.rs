//! The farm's side of its failsafe ([`crate::failsafe`]): the tripwire's look at the RC tree,
//! operators' releases (`rcfarm/failsafe/release/<farm-id>`), the base of a percentage limit,
//! and what the farm reports about it (log, status, metric, audit).

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use serde_json::json;

use super::rcs::OwnedRcs;
use super::rolls::OwnedRolls;
use super::{Farm, Serving, Views, registry};
use crate::audit::{AuditRecord, events};
use crate::consul::QueryOptions;
use crate::failsafe::{Release, Tree, TreeShape, TripEvent};
use crate::labels::Selector;
use crate::rc::{RC_ID_LABEL, RcId};
use crate::rctask::TaskHandle;

/// What the farm last acted on.
#[derive(Debug)]
pub(super) struct FailsafeSeen {
    /// What the tripwire last looked at: the keys' index, the records' index, and the RCs
    /// served (their number and ids folded).
    look: (u64, u64, (u64, u128)),
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
            look: (0, 0, (0, 0)),
            release: 0,
            started: Utc::now(),
            unrecorded: Vec::new(),
        }
    }
}

/// Whether pods of `rcs` exist (something would be removed).
fn removable(views: &Views, rcs: &HashSet<RcId>) -> bool {
    let Ok(sel) = Selector::parse(RC_ID_LABEL) else {
        return true;
    };
    views.pods.matches(&sel).iter().any(|id| {
        views
            .pods
            .get(id)
            .and_then(|l| l.get(RC_ID_LABEL).and_then(|v| RcId::parse(v).ok()))
            .is_some_and(|rc| rcs.contains(&rc))
    })
}

impl Farm {
    /// Sets the pods this farm serves (the base of a percentage limit) into its failsafe: at
    /// once when fewer; when more, only after a read of the registry sent now. The pods it
    /// gained came with RCs it claimed, and an RC can be claimed only once its lock is free:
    /// when the farm that held it lost its session, Consul released that farm's registration
    /// in the same commit, so a read sent after the claims shows it gone, and the write that
    /// adds those pods to this farm's count drops that farm's count of them
    /// ([`crate::budget::Window::without_stale`]). The registry view the loop watches may be
    /// older than the lock tree the claims were made from: taken as it is, the key held both
    /// counts, and the peak kept the sum for the window. The read is a few keys, made only when
    /// the grown count is due to be written ([`crate::failsafe::Failsafe::growth_due`]); until
    /// then the count stays where it was (low by what a report may lag, never high).
    async fn count_served(&self) {
        let fs = &self.failsafe;
        let pods = self.status.pods_current() as u64;
        if pods <= fs.served() || !fs.counts_served() {
            fs.set_served(pods);
            return;
        }
        if !fs.growth_due(pods) {
            return;
        }
        let opts = QueryOptions {
            consistent: true,
            ..QueryOptions::default()
        };
        match self.consul.kv_list(registry::FARMS_PREFIX, &opts).await {
            Ok((entries, meta)) => {
                let farms = registry::live_farms(&entries);
                fs.set_live_farms(registry::sessions_by_farm(&farms), meta.index);
                fs.set_served(pods);
            }
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the registry before this farm's count of its pods grows; it grows at a later look")
            }
        }
    }

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
        self.count_served().await;
        self.record_trips(sv).await;
        let mut wake = false;
        // The cluster's window: room that came back (the window slid, another farm's charge
        // was refused, an operator released it) wakes the tasks that wait for it.
        if let Some(snap) = views.window.latest() {
            let before = fs.room().0;
            fs.observe_window(snap.value.as_ref());
            wake |= before == 0 && fs.room().0 > 0;
        }
        let fence = super::registry::registration_fence(sv.session);
        if let Err(e) = fs.report_served(&self.consul, fence).await {
            tracing::debug!(error = %e, "cannot report the pods this farm serves into the removal window yet");
        }
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
        match fs.first_look_pending() {
            // The first look at a share taken up all at 0, once its pods are read.
            Some(ticket) if views.pods.demand().is_none_or(|d| d.is_fresh(ticket)) => {
                self.failsafe_seen.lock().look = (0, 0, (0, 0));
                self.look_at_share(views, owned.tasks.keys().copied());
                fs.first_look_done();
                wake = true;
            }
            Some(_) => {}
            None if tripwire => {
                wake |= self.look_at_share(views, owned.tasks.keys().copied());
            }
            None => {}
        }
        self.record_trips(sv).await;
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

    /// The tripwire's look at the tree's keys (the emptied-tree check) and at the RCs of
    /// `share`, the RCs this farm serves (the all-to-zero check: it reads no other record,
    /// issue 38). Called before tasks are started for new RCs too, so that a share that is all
    /// at 0 trips before any of them plans. What it decided is logged and its audit record
    /// queued (committed by `watch_failsafe`). Returns whether the failsafe let go.
    pub(super) fn look_at_share(&self, views: &Views, share: impl Iterator<Item = RcId>) -> bool {
        let fs = &self.failsafe;
        if fs.config().confirm.is_zero() {
            return false;
        }
        let (Some(keys), Some(listing)) = (views.rc_keys.latest(), views.records.latest()) else {
            return false;
        };
        let share: Vec<RcId> = share.collect();
        let pending = fs.status().tripped.is_some();
        let look = (keys.index, listing.index, RcId::digest(&share));
        let changed = std::mem::replace(&mut self.failsafe_seen.lock().look, look) != look;
        if !changed && !pending {
            return false;
        }
        let replicas: Vec<(RcId, u64)> = share
            .iter()
            .filter_map(|id| Some((*id, listing.rcs.get(id)?.replicas_desired)))
            .collect();
        let invalid = share
            .iter()
            .filter(|id| listing.invalid.contains_key(&keys.key_of(id)))
            .count();
        let shape = Tree::of(replicas.iter().map(|(_, r)| *r), invalid)
            .keys(keys.len())
            .shape();
        let can_remove = shape == TreeShape::AllZero
            && removable(views, &replicas.iter().map(|(id, _)| *id).collect());
        let trip_before = fs.status().tripped_since;
        let served = replicas.len() + invalid;
        let Some(ev) = fs.observe_tree(keys.len(), replicas, invalid, can_remove) else {
            return false;
        };
        let since = match ev {
            TripEvent::Tripped(_) => fs.status().tripped_since,
            _ => trip_before,
        };
        let let_go = !matches!(ev, TripEvent::Tripped(_));
        self.report_trip(served, ev, since);
        let_go
    }

    /// Log, metric and audit record of what the tripwire decided (the trip it concerns began
    /// at `since`).
    fn report_trip(&self, served: usize, ev: TripEvent, since: Option<DateTime<Utc>>) {
        let confirm = crate::util::format_go_duration(self.failsafe.config().confirm);
        let (event, details) = match &ev {
            TripEvent::Tripped(why) => {
                tracing::error!(reason = %why, rcs = served, "FAILSAFE TRIPPED: this farm removes no pod until the state is confirmed or an operator runs `rcctl farm release-removals`");
                metrics::counter!("rcfarm_failsafe_trips_total").increment(1);
                (
                    events::FAILSAFE_TRIPPED,
                    json!({"reason": why, "rcs": served, "confirm": confirm}),
                )
            }
            TripEvent::Confirmed => {
                tracing::warn!(%confirm, "failsafe: the RC tree stayed so for the confirmation window; acting on it");
                (
                    events::FAILSAFE_CLEARED,
                    json!({"reason": format!("confirmed: the state held for {confirm}"), "rcs": served}),
                )
            }
            TripEvent::Cleared(why) => {
                tracing::warn!(reason = %why, "failsafe cleared");
                (
                    events::FAILSAFE_CLEARED,
                    json!({"reason": why, "rcs": served}),
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

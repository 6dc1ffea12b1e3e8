//! Rolling updates as claimed work, beside RCs: the same fair share, claims, handover and
//! fencing (through [`super::ownership`]), with `lock/rolls/<id>` as each roll's lock. A farm
//! serves a roll when its RC selector admits both of the roll's RCs (as P2's roll farm does).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use tokio::sync::{broadcast, mpsc};

use super::claims::assign_by;
use super::ownership::{ClaimView, Kind, Owned, ownership_record};
use super::registry::{self, FarmInfo};
use super::unclaimable::Unclaimable;
use super::{Farm, Views};
use crate::audit::{AuditRecord, events};
use crate::consul::{KvPair, Session, TxnOp};
use crate::labels::{LabelChanges, LabelSet};
use crate::rc::{LockView, RC_ID_LABEL, RcId, RcListing, RcStore};
use crate::roll::{
    ROLL_LOCK_PREFIX, ROLL_PREFIX, RollContext, RollEvent, RollId, RollListing, RollState,
    RollStatusRegistry, roll_holder, roll_lock_key,
};

/// Rolling updates, for the claim machinery.
pub(crate) struct RollKind {
    pub farm_id: String,
    pub status: Arc<RollStatusRegistry>,
}

impl Kind for RollKind {
    type State = RollState;
    const NOUN: &'static str = "rolling update";
    const PLURAL: &'static str = "rolling updates";

    fn lock_key(id: RcId) -> String {
        roll_lock_key(id)
    }

    fn claimed_record(&self, id: RcId, session: &Session) -> AuditRecord {
        ownership_record(
            events::ROLL_CLAIMED,
            "rolling_update_id",
            id,
            &self.farm_id,
            session,
            None,
        )
    }

    fn released_record(&self, id: RcId, session: &Session, reason: &str) -> AuditRecord {
        ownership_record(
            events::ROLL_RELEASED,
            "rolling_update_id",
            id,
            &self.farm_id,
            session,
            Some(reason),
        )
    }

    fn deleted() -> RollState {
        RollState::Deleted
    }

    fn forget(&self, id: RcId) {
        self.status.remove(id);
    }
}

pub(crate) type OwnedRolls = Owned<RollKind>;

/// What the farm remembers between reconciles to wake roll tasks only for what concerns them.
#[derive(Default)]
pub(crate) struct RollDispatch {
    /// Versions of each owned roll's RCs last seen.
    rc_versions: HashMap<RollId, (u64, u64)>,
}

type Changes = Result<Arc<LabelChanges>, broadcast::error::RecvError>;

/// Holders of roll locks from the `lock/rolls/` tree; keys that are no roll lock are set aside.
fn parse_roll_locks(entries: &[KvPair]) -> (BTreeMap<RollId, Arc<str>>, Vec<String>) {
    let mut holders = BTreeMap::new();
    let mut garbage = Vec::new();
    for e in entries {
        match e.key.strip_prefix(ROLL_LOCK_PREFIX).map(RcId::parse) {
            Some(Ok(id)) => {
                if let Some(s) = &e.session {
                    holders.insert(id, Arc::from(s.as_str()));
                }
            }
            _ => garbage.push(e.key.clone()),
        }
    }
    (holders, garbage)
}

fn roll_state(rolls: &RollListing, id: RollId) -> RollState {
    if let Some(r) = rolls.rolls.get(&id) {
        RollState::Valid {
            roll: r.clone(),
            conflict: rolls.conflict(r),
        }
    } else if let Some(inv) = rolls.invalid.get(&crate::roll::roll_key(id)) {
        RollState::Invalid(Arc::new(inv.clone()))
    } else {
        RollState::Deleted
    }
}

/// The version a roll task was last handed: the record's, and whether it must wait for
/// another roll.
fn roll_version(rolls: &RollListing, id: RollId) -> Option<u64> {
    if let Some(r) = rolls.rolls.get(&id) {
        Some(r.modify_index * 2 + u64::from(rolls.conflict(r).is_some()))
    } else {
        rolls
            .invalid
            .get(&crate::roll::roll_key(id))
            .map(|i| i.modify_index * 2)
    }
}

impl Farm {
    /// Claims, starts and hands over roll tasks; publishes the rolls in progress to the RC
    /// tasks. Returns whether it claimed something.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn reconcile_rolls(
        &self,
        views: &Views,
        session: &Session,
        info: &FarmInfo,
        ctx: &Arc<RollContext>,
        owned: &mut OwnedRolls,
        ev_tx: &mpsc::UnboundedSender<RollEvent>,
    ) -> bool {
        let (Some(rolls), Some(lock_snap), Some(farm_snap)) = (
            views.rolls.latest(),
            views.roll_locks.latest(),
            views.farms.latest(),
        ) else {
            return false;
        };
        let sid = session.id();
        // The records of these rolls' RCs, before any roll task looks for them (the roll
        // listing may be newer than the last read of the records).
        let roll_rcs: BTreeSet<RcId> = rolls
            .rolls
            .values()
            .flat_map(|r| [r.update.old_rc, r.update.new_rc])
            .collect();
        self.add_records(views, &roll_rcs).await;

        let (holders, garbage) = parse_roll_locks(&lock_snap.value);
        {
            let mut seen = self.garbage_locks_reported.lock();
            seen.rolls.retain(|k| garbage.contains(k));
            for key in garbage {
                if seen.rolls.insert(key.clone()) {
                    tracing::warn!(%key, "a key under lock/rolls/ is not a roll lock; ignoring it");
                }
            }
        }
        self.report_unclaimable(
            ROLL_PREFIX,
            "rolling update",
            events::ROLL_INVALID,
            "rcfarm_roll_invalid_total",
            rolls
                .invalid
                .iter()
                .filter(|(k, _)| !matches!(crate::roll::record::roll_id_from_key(k), Some(Ok(_))))
                .map(|(k, inv)| Unclaimable {
                    key: k.clone(),
                    modify_index: inv.modify_index,
                    problem: inv.problem.to_string(),
                    kind: inv.problem.kind(),
                })
                .collect(),
        )
        .await;

        // Every roll key that names a roll, valid or not, with the labels of its two RCs.
        let rc_labels = |id: RcId| -> LabelSet {
            views
                .rc_labels
                .get(&id.to_string())
                .map(|l| (*l).clone())
                .unwrap_or_default()
        };
        let mut items: BTreeMap<RollId, (LabelSet, LabelSet)> = BTreeMap::new();
        for r in rolls.rolls.values() {
            items.insert(
                r.id(),
                (rc_labels(r.update.old_rc), rc_labels(r.update.new_rc)),
            );
        }
        for key in rolls.invalid.keys() {
            if let Some(Ok(id)) = crate::roll::record::roll_id_from_key(key) {
                items.insert(id, (rc_labels(id), rc_labels(id)));
            }
        }
        let all: BTreeSet<RollId> = items.keys().copied().collect();
        let farms = registry::live_farms_with(&farm_snap.value, info);
        let may_serve = |sel: &crate::labels::Selector, (old, new): &(LabelSet, LabelSet)| {
            sel.matches(old) && sel.matches(new)
        };
        let assignment = assign_by(
            &items,
            &registry::views(&farms),
            &BTreeMap::<RcId, String>::new(),
            registry::agreed_rule(&farms),
            may_serve,
        );
        let matching: BTreeSet<RollId> = items
            .iter()
            .filter(|(_, l)| may_serve(&self.config.rc_selector, l))
            .map(|(id, _)| *id)
            .collect();
        let view = ClaimView {
            all: &all,
            matching: &matching,
            assignment: &assignment,
            holders: &holders,
            held: None,
            lock_index: lock_snap.index,
            locks_read_at: tokio::time::Instant::now(),
            lock_reads: None,
            listing_index: rolls.index,
            guard: &|id| {
                let index = rolls.rolls.get(&id).map(|r| r.modify_index).or_else(|| {
                    rolls
                        .invalid
                        .get(&crate::roll::roll_key(id))
                        .map(|i| i.modify_index)
                })?;
                Some(TxnOp::check_index(crate::roll::roll_key(id), index))
            },
        };
        let claimed = owned
            .reconcile(
                &self.claim_farm(session),
                &view,
                |id| {
                    crate::roll::spawn(
                        ctx.clone(),
                        sid.clone(),
                        session.lost(),
                        id,
                        roll_state(&rolls, id),
                        ev_tx.clone(),
                    )
                },
                |id| Some((roll_state(&rolls, id), roll_version(&rolls, id)?)),
            )
            .await;

        // Mutation locks our session holds for a roll it no longer carries out (handed over,
        // deleted, a release lost): the next owner takes them again, as P2's roll does.
        let locks = ctx.locks.borrow().clone();
        let stray: Vec<(RcId, String)> = locks
            .holders
            .iter()
            .filter_map(|(rc, h)| {
                let (s, v) = h.mutation.as_ref()?;
                let roll = v
                    .strip_prefix("rcfarm-roll:")
                    .and_then(|r| RcId::parse(r).ok())?;
                (**s == **sid && !owned.tasks.contains_key(&roll)).then(|| (*rc, roll_holder(roll)))
            })
            .collect();
        self.release_stray_mutation_locks(sid, stray).await;

        metrics::gauge!("rcfarm_owned_rolls").set(owned.tasks.len() as f64);
        metrics::gauge!("rcfarm_rolls").set(rolls.rolls.len() as f64);
        self.status.update_farm(|f| {
            f.owned_rolls = owned.tasks.len();
            f.invalid_rolls = rolls.invalid.len();
        });
        !claimed.is_empty()
    }

    /// Wakes the roll tasks whose RCs' records changed.
    pub(super) fn dispatch_rcs_to_rolls(
        &self,
        owned: &OwnedRolls,
        rolls: Option<&RollListing>,
        rcs: &RcListing,
        seen: &mut RollDispatch,
    ) {
        let Some(rolls) = rolls else { return };
        let version = |id: RcId| {
            rcs.rcs
                .get(&id)
                .map(|r| r.modify_index)
                .or_else(|| rcs.invalid.get(&id.key()).map(|i| i.modify_index))
                .unwrap_or(0)
        };
        seen.rc_versions
            .retain(|id, _| owned.tasks.contains_key(id));
        for (id, t) in &owned.tasks {
            let Some(r) = rolls.rolls.get(id) else {
                continue;
            };
            let now = (version(r.update.old_rc), version(r.update.new_rc));
            if seen.rc_versions.insert(*id, now) != Some(now) {
                t.wake();
            }
        }
    }

    /// Wakes the roll tasks whose RCs' pods changed.
    pub(super) fn dispatch_pods_to_rolls(
        &self,
        owned: &OwnedRolls,
        rolls: Option<&RollListing>,
        c: &Changes,
    ) {
        let Some(rolls) = rolls else { return };
        match c {
            Ok(ch) => {
                let touched: BTreeSet<&str> = ch
                    .changes
                    .iter()
                    .flat_map(|change| [&change.old, &change.new].into_iter().flatten())
                    .filter_map(|l| l.get(RC_ID_LABEL).map(String::as_str))
                    .collect();
                for (id, t) in &owned.tasks {
                    if let Some(r) = rolls.rolls.get(id)
                        && (touched.contains(r.update.old_rc.to_string().as_str())
                            || touched.contains(r.update.new_rc.to_string().as_str()))
                    {
                        t.wake();
                    }
                }
            }
            Err(_) => owned.tasks.values().for_each(|t| t.wake()),
        }
    }

    /// Wakes the roll tasks whose RCs' pods' health changed (`None`: changes were missed).
    pub(super) fn dispatch_health_to_rolls(
        &self,
        owned: &OwnedRolls,
        views: &Views,
        changed: Option<&BTreeSet<String>>,
    ) {
        let (Some(rolls), Some(rcs), Some(changed)) =
            (views.rolls.latest(), views.records.latest(), changed)
        else {
            owned.tasks.values().for_each(|t| t.wake());
            return;
        };
        for (id, t) in &owned.tasks {
            let Some(r) = rolls.rolls.get(id) else {
                continue;
            };
            let concerns = [r.update.old_rc, r.update.new_rc]
                .iter()
                .filter_map(|rc| rcs.rcs.get(rc))
                .any(|rc| changed.contains(rc.pod_id()));
            if concerns {
                t.wake();
            }
        }
    }

    /// Wakes the roll tasks whose RCs' mutation locks changed.
    pub(super) fn dispatch_locks_to_rolls(
        &self,
        owned: &OwnedRolls,
        rolls: Option<&RollListing>,
        old: &LockView,
        new: &LockView,
    ) {
        let Some(rolls) = rolls else { return };
        for (id, t) in &owned.tasks {
            if let Some(r) = rolls.rolls.get(id)
                && [r.update.old_rc, r.update.new_rc]
                    .iter()
                    .any(|rc| old.mutation(*rc) != new.mutation(*rc))
            {
                t.wake();
            }
        }
    }

    /// Graceful shutdown of the roll half: stop roll tasks, give their locks and the RCs'
    /// mutation locks back (whoever takes a roll next takes them again).
    pub(super) async fn hand_over_rolls(
        &self,
        session: &Session,
        owned: &mut OwnedRolls,
        rolls: Option<&RollListing>,
        locks: &LockView,
    ) {
        let farm = self.claim_farm(session);
        let ids = owned.hand_over(&farm).await;
        let store = RcStore::new(self.consul.clone());
        for id in &ids {
            let holder = roll_holder(*id);
            // The roll's RCs, and whatever else the lock view says the roll holds.
            let mut rcs: BTreeSet<RcId> = rolls
                .and_then(|l| l.rolls.get(id))
                .map(|r| [r.update.old_rc, r.update.new_rc].into_iter().collect())
                .unwrap_or_default();
            rcs.extend(locks.holders.iter().filter_map(|(rc, h)| {
                h.mutation
                    .as_ref()
                    .is_some_and(|(s, v)| **s == **session.id() && **v == *holder)
                    .then_some(*rc)
            }));
            for rc in rcs {
                let _ = store.release_mutation(rc, session.id(), &holder).await;
            }
        }
        if !ids.is_empty() {
            tracing::info!(released = ids.len(), "handed every rolling update over");
        }
    }
}

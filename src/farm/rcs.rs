//! RCs as claimed work: the farm's reconcile of its RCs (claims through [`super::ownership`]),
//! the dispatch of pod, node and health changes to the RC tasks they concern, the consistency
//! sweep, and the reports of what no task can report.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use tokio::sync::{broadcast, mpsc, watch};

use super::claims::assign;
use super::ownership::{ClaimView, Kind, Owned, ownership_record};
use super::registry::{self, FarmInfo};
use super::unclaimable::Unclaimable;
use super::{Farm, Views, sweep};
use crate::audit::{AuditRecord, events};
use crate::consul::Session;
use crate::labels::{LabelChanges, LabelSet, Selector};
use crate::rc::{LockView, RC_ID_LABEL, RcId, RcListing, RcStore};
use crate::rctask::{RcState, StatusRegistry, TaskContext, TaskEvent, TaskHandle};

/// RCs, for the claim machinery.
pub(crate) struct RcKind {
    pub farm_id: String,
    pub status: Arc<StatusRegistry>,
}

impl Kind for RcKind {
    type State = RcState;
    const NOUN: &'static str = "replication controller";
    const PLURAL: &'static str = "RCs";

    fn lock_key(id: RcId) -> String {
        id.ownership_lock_key()
    }

    fn claimed_record(&self, id: RcId, session: &Session) -> AuditRecord {
        ownership_record(
            events::RC_CLAIMED,
            "replication_controller_id",
            id,
            &self.farm_id,
            session,
            None,
        )
    }

    fn released_record(&self, id: RcId, session: &Session, reason: &str) -> AuditRecord {
        ownership_record(
            events::RC_RELEASED,
            "replication_controller_id",
            id,
            &self.farm_id,
            session,
            Some(reason),
        )
    }

    fn deleted() -> RcState {
        RcState::Deleted
    }

    fn forget(&self, id: RcId) {
        self.status.remove_rc(id);
    }
}

pub(crate) type OwnedRcs = Owned<RcKind>;

/// Where the farm publishes the RC lock tree to its tasks.
pub(crate) type LocksTx = watch::Sender<Arc<LockView>>;

type Changes = Result<Arc<LabelChanges>, broadcast::error::RecvError>;

impl Farm {
    pub(super) fn dispatch_pod_changes(&self, owned: &OwnedRcs, c: Changes) {
        match c {
            Ok(ch) => {
                let mut woken = BTreeSet::new();
                for change in &ch.changes {
                    for labels in [&change.old, &change.new].into_iter().flatten() {
                        if let Some(Ok(id)) = labels.get(RC_ID_LABEL).map(|v| RcId::parse(v))
                            && woken.insert(id)
                            && let Some(t) = owned.tasks.get(&id)
                        {
                            t.wake();
                        }
                    }
                }
            }
            // Missed some: wake everyone.
            Err(_) => owned.tasks.values().for_each(TaskHandle::wake),
        }
    }

    pub(super) fn dispatch_node_changes(&self, owned: &OwnedRcs, views: &Views, c: Changes) {
        let Some(listing) = views.rcs.latest() else {
            return;
        };
        match c {
            Ok(ch) => {
                for t in owned.tasks.values() {
                    let Some(rc) = listing.rcs.get(&t.id) else {
                        continue;
                    };
                    let affected = ch.changes.iter().any(|change| {
                        [&change.old, &change.new]
                            .into_iter()
                            .flatten()
                            .any(|l| rc.node_selector.matches(&**l))
                    });
                    // Pool membership also moves eligibility of dynamic RCs.
                    if affected || rc.strategy == crate::rc::AllocationStrategy::Dynamic {
                        t.wake();
                    }
                }
            }
            Err(_) => owned.tasks.values().for_each(TaskHandle::wake),
        }
    }

    /// Wakes the tasks of RCs whose pods' health changed (`None`: changes were missed, wake
    /// every task).
    pub(super) fn dispatch_health_changes(
        &self,
        owned: &OwnedRcs,
        views: &Views,
        pods: Option<&BTreeSet<String>>,
    ) {
        let Some(pods) = pods else {
            owned.tasks.values().for_each(TaskHandle::wake);
            return;
        };
        if let Some(listing) = views.rcs.latest() {
            for t in owned.tasks.values() {
                if listing
                    .rcs
                    .get(&t.id)
                    .is_some_and(|rc| pods.contains(rc.pod_id()))
                {
                    t.wake();
                }
            }
        }
    }

    /// Decides what to claim and release, starts and stops tasks, and hands RCs their updates.
    /// Returns whether it claimed something.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn reconcile_rcs(
        &self,
        views: &Views,
        session: &Session,
        info: &FarmInfo,
        ctx: &Arc<TaskContext>,
        owned: &mut OwnedRcs,
        ev_tx: &mpsc::UnboundedSender<TaskEvent>,
        locks_tx: &LocksTx,
    ) -> bool {
        let Some(listing) = views.rcs.latest() else {
            return false;
        };
        let Some(locks) = views.locks.latest() else {
            return false;
        };
        let Some(farm_snap) = views.farms.latest() else {
            return false;
        };
        let sid = session.id();
        {
            let mut seen = self.garbage_locks_reported.lock();
            seen.retain(|k| locks.garbage.contains(k));
            for key in &locks.garbage {
                if seen.insert(key.clone()) {
                    tracing::warn!(%key, "a key under the lock prefix is not an RC lock; ignoring it");
                }
            }
        }
        if locks_tx.borrow().index != locks.index {
            let old = locks_tx.send_replace(locks.clone());
            for (id, t) in &owned.tasks {
                if old.mutation(*id) != locks.mutation(*id)
                    || old.node_transfer(*id) != locks.node_transfer(*id)
                {
                    t.wake();
                }
            }
        }
        let holders = &locks.holders;

        self.report_unclaimable(
            crate::rc::RC_PREFIX,
            "RC",
            events::RC_INVALID,
            "rcfarm_rc_invalid_total",
            listing
                .invalid
                .iter()
                .filter(|(k, _)| !matches!(RcId::from_key(k), Some(Ok(_))))
                .map(|(k, inv)| Unclaimable {
                    key: k.clone(),
                    modify_index: inv.modify_index,
                    problem: inv.problem.to_string(),
                    kind: inv.problem.kind(),
                })
                .collect(),
        )
        .await;

        // Every RC key that names an RC, valid or not (an invalid one is still claimed, so that
        // exactly one farm reports it).
        let all_ids: BTreeSet<RcId> = listing
            .rcs
            .keys()
            .copied()
            .chain(
                listing
                    .invalid
                    .keys()
                    .filter_map(|k| RcId::from_key(k).and_then(Result::ok)),
            )
            .collect();
        let rc_labels: BTreeMap<RcId, LabelSet> = all_ids
            .iter()
            .map(|id| {
                (
                    *id,
                    views
                        .rc_labels
                        .get(&id.to_string())
                        .map(Arc::unwrap_or_clone)
                        .unwrap_or_default(),
                )
            })
            .collect();
        let farms = registry::live_farms_with(&farm_snap.value, info);
        let assignment = assign(&rc_labels, &registry::views(&farms));
        let cap = assignment
            .cap
            .get(&self.config.farm_id)
            .copied()
            .unwrap_or(0);
        let matching: BTreeSet<RcId> = rc_labels
            .iter()
            .filter(|(_, l)| self.config.rc_selector.matches(*l))
            .map(|(id, _)| *id)
            .collect();
        let owners: BTreeMap<RcId, String> = holders
            .iter()
            .filter_map(|(id, h)| h.ownership.as_ref().map(|(s, _)| (*id, s.clone())))
            .collect();
        let view = ClaimView {
            all: &all_ids,
            matching: &matching,
            assignment: &assignment,
            holders: &owners,
            lock_index: locks.index,
            listing_index: listing.index,
            // A claim of an RC deleted meanwhile is harmless: its task is told, and gives the
            // lock back.
            guard: &|_| None,
        };
        let claimed = owned
            .reconcile(
                &self.claim_farm(session),
                &view,
                |id| {
                    crate::rctask::spawn(
                        ctx.clone(),
                        sid.to_string(),
                        session.lost(),
                        id,
                        rc_state(&listing, id),
                        ev_tx.clone(),
                    )
                },
                |id| Some((rc_state(&listing, id), rc_version(&listing, id)?)),
            )
            .await;

        // A mutation lock our session holds on an RC we do not serve would stop its owner from
        // ever moving a pod (it waits for "another session"). It happens when a task is stopped
        // mid-transfer (handover, fencing, deletion), when the release request is lost, or when
        // an acquire sent by a task just stopped lands late; the lock tree's change brings us
        // back here. The transfer itself, if one is in flight, is resumed by the owner.
        let stray: Vec<(RcId, String)> = holders
            .iter()
            .filter_map(|(id, h)| {
                let (s, v) = h.mutation.as_ref()?;
                if s != sid {
                    return None;
                }
                let ours_for_transfer = *v == id.node_transfer_holder();
                // A rolling update's lock is the roll farm's business; any other value under
                // our session (a late request of a stopped task, an older version) is stray.
                let stray = if ours_for_transfer {
                    !owned.tasks.contains_key(id)
                } else {
                    !v.starts_with(crate::roll::ROLL_HOLDER_PREFIX)
                };
                stray.then(|| (*id, v.clone()))
            })
            .collect();
        self.release_stray_mutation_locks(sid, stray).await;

        let owned_n = owned.tasks.len();
        metrics::gauge!("rcfarm_owned_rcs").set(owned_n as f64);
        metrics::gauge!("rcfarm_fair_share").set(cap as f64);
        metrics::gauge!("rcfarm_live_farms").set(farms.len() as f64);
        self.status.update_farm(|f| {
            f.owned = owned_n;
            f.fair_share = cap;
            f.live_farms = farms.iter().map(|f| f.farm_id.clone()).collect();
            f.matching_rcs = matching.len();
            f.invalid_rcs = listing.invalid.len();
        });
        !claimed.is_empty()
    }

    /// Reads the intents of every owned pod and wakes the tasks that have something to repair.
    pub(super) async fn sweep(&self, views: &Views, ctx: &Arc<TaskContext>, owned: &OwnedRcs) {
        let mut pods = BTreeSet::new();
        for id in owned.tasks.keys() {
            let sel = Selector::from_equalities([(RC_ID_LABEL, id.to_string().as_str())]);
            for pid in views.pods.matches(&sel) {
                if let Some((n, p)) = crate::labels::split_pod_label_id(&pid) {
                    pods.insert((n.to_string(), p.to_string()));
                }
            }
        }
        match sweep::sweep(&self.consul, &ctx.intents, &pods).await {
            Ok(n) => {
                tracing::debug!(intents = n, "consistency sweep done");
                if let Some(listing) = views.rcs.latest() {
                    // Grouped once: looking each owned RC's pods up in the whole list made a
                    // sweep quadratic (10,000 RCs × 50,000 pods blocked a farm's claims for 12 s
                    // while it took over a dead farm's RCs).
                    let mut nodes_of: HashMap<&str, Vec<&str>> = HashMap::new();
                    for (n, p) in &pods {
                        nodes_of.entry(p.as_str()).or_default().push(n.as_str());
                    }
                    for t in owned.tasks.values() {
                        if let Some(rc) = listing.rcs.get(&t.id) {
                            let nodes = nodes_of
                                .get(rc.pod_id())
                                .into_iter()
                                .flatten()
                                .map(|n| crate::scheduler::NodeName::from(*n));
                            if !ctx
                                .intents
                                .bad(rc.pod_id(), rc.manifest.digest(), nodes)
                                .is_empty()
                            {
                                t.wake();
                            }
                        }
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "consistency sweep failed"),
        }
    }
}

impl Farm {
    /// Releases mutation locks this farm's session holds for something it no longer does (a
    /// node transfer or a roll it stopped serving), each as `(RC, value it holds)`: left held,
    /// they would keep the RC's next owner from ever moving a pod.
    pub(super) async fn release_stray_mutation_locks(&self, sid: &str, stray: Vec<(RcId, String)>) {
        let store = RcStore::new(self.consul.clone());
        for (id, holder) in stray {
            match store.release_mutation(id, sid, &holder).await {
                Ok(false) => {}
                Ok(true) => {
                    tracing::info!(rc_id = %id, %holder, "released the mutation lock of an RC this farm no longer serves")
                }
                Err(e) => {
                    tracing::warn!(rc_id = %id, error = %e, "cannot release a stray mutation lock; will retry")
                }
            }
        }
    }
}

fn rc_state(listing: &RcListing, id: RcId) -> RcState {
    if let Some(rc) = listing.rcs.get(&id) {
        RcState::Valid(rc.clone())
    } else if let Some(inv) = listing.invalid.get(&id.key()) {
        RcState::Invalid(Arc::new(inv.clone()))
    } else {
        RcState::Deleted
    }
}

fn rc_version(listing: &RcListing, id: RcId) -> Option<u64> {
    listing
        .rcs
        .get(&id)
        .map(|r| r.modify_index)
        .or_else(|| listing.invalid.get(&id.key()).map(|i| i.modify_index))
}

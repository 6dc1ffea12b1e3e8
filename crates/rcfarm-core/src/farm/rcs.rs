//! RCs as claimed work: the farm's reconcile of its RCs (claims through [`super::ownership`]),
//! the dispatch of pod, node and health changes to the RC tasks they concern, the consistency
//! sweep, and the reports of what no task can report.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::{broadcast, mpsc, watch};

use super::claims::assign_held;
use super::decide::HeldIndex;
use super::ownership::{ClaimFarm, ClaimView, Kind, Owned, ownership_record};
use super::registry::{self, FarmInfo};
use super::unclaimable::Unclaimable;
use super::{Farm, Views, sweep};
use crate::audit::{AuditRecord, events};
use crate::consul::{Demand, KvPair, Session};
use crate::failsafe::Reported;
use crate::labels::{LabelChanges, LabelLookup, LabelSet, Selector};
use crate::rc::{ListedRc, LockView, RC_ID_LABEL, RcId, RcKeys, RcListing, RcStore};
use crate::rctask::{RcState, StatusRegistry, TaskContext, TaskEvent, TaskHandle};

/// Which claimed RCs must wait for a read of the pod label tree before their first plan.
/// The farm reads that tree on demand and applies its own writes as it commits them, so its
/// view lacks only what other sessions wrote since the last read: the pods of an RC it takes
/// from another farm (seen holding it), and after a farm came or left (its last writes, an
/// RC held briefly in a handover, or this farm's own under a session it lost) those of any
/// RC it claims.
#[derive(Debug, Default)]
pub(crate) struct PodFreshness {
    /// RCs seen held by another session, until this farm claims them.
    foreign: HashSet<RcId>,
    /// The live farms' sessions last seen.
    sessions: BTreeSet<String>,
    /// A read every claim waits for until it is done.
    pending: Option<u64>,
    /// The lock view whose holders `foreign` has taken in.
    foreign_at: Option<u64>,
}

impl PodFreshness {
    /// For a new session: after a lost one, claims wait for a read sent from now on.
    pub fn new(demand: Option<&Arc<Demand>>, after_loss: bool) -> Self {
        PodFreshness {
            pending: demand.filter(|_| after_loss).map(|d| d.next_ticket()),
            ..Default::default()
        }
    }

    /// The live farms' sessions are `now`: if a farm came or went, RCs change hands, some
    /// after being held too briefly for this farm's view of the lock tree to show it; claims
    /// wait for a read sent from now on.
    pub fn farms_seen(
        &mut self,
        now: BTreeSet<String>,
        demand: Option<&Arc<Demand>>,
    ) -> FarmsChange {
        if let Some(d) = demand
            && !self.sessions.is_empty()
            && self.sessions != now
        {
            self.pending = Some(d.next_ticket());
        }
        let change = FarmsChange {
            changed: self.sessions != now,
            left: self.sessions.iter().any(|s| !now.contains(s)),
        };
        self.sessions = now;
        change
    }
}

/// What changed in the live farms since the farm last looked.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FarmsChange {
    /// A farm came or left, or this is the first look.
    pub changed: bool,
    /// A farm left.
    pub left: bool,
}

/// Handovers this farm waits for: the shared assignment gives it RCs held by a farm over its
/// share, and that farm, reading the same farms, hands them over within moments. Until they
/// come, every change of the lock tree is read, not one every `LOCK_TREE_IDLE`; only within
/// `limit` of a change of the live farms (which is what puts a farm over its share), so that
/// farms whose views differ for a while never read every change for long. Without it a farm
/// started beside others waited a whole idle read (2 s) for RCs handed to it 0.3 s after its
/// start (issue 46: the restart path's slow mode, 4 of 5 runs of 3 farms at 200 RCs).
pub(crate) struct AwaitedHandovers {
    limit: std::time::Duration,
    /// Until when handovers may be awaited: `limit` after the live farms last changed.
    open_until: Option<tokio::time::Instant>,
    fast: Option<crate::consul::FastGuard>,
    /// The claim inputs last looked at (a new `Arc` is a new look).
    seen: Option<Arc<ClaimInputs>>,
}

impl AwaitedHandovers {
    pub fn new(limit: std::time::Duration) -> Self {
        AwaitedHandovers {
            limit,
            open_until: None,
            fast: None,
            seen: None,
        }
    }

    /// The live farms changed (or were seen for the first time) at `now`.
    pub fn farms_changed(&mut self, now: tokio::time::Instant) {
        self.open_until = Some(now + self.limit);
        self.seen = None;
    }

    /// Looks at the claim inputs of the last reconcile.
    pub fn update(
        &mut self,
        inputs: Option<Arc<ClaimInputs>>,
        farm_id: &str,
        session: &str,
        locks: &Arc<Demand>,
        now: tokio::time::Instant,
    ) {
        if self.open_until.is_none_or(|until| now >= until) {
            self.open_until = None;
            self.fast = None;
            return;
        }
        if let Some(inputs) = inputs
            && !self.seen.as_ref().is_some_and(|s| Arc::ptr_eq(s, &inputs))
        {
            let awaited = inputs.handovers_awaited(farm_id, session);
            self.seen = Some(inputs);
            if !awaited {
                self.fast = None;
            } else if self.fast.is_none() {
                self.fast = Some(locks.fast());
            }
        }
    }
}

/// Which pods a farm keeps in its pod label cache: not those of RCs another session holds
/// (they are that farm's business, and at 100,000 pods they were most of a farm's memory),
/// unless they share a pod id with an RC this farm serves (a rolling update's old RC, which
/// the new one takes pods over from), or a rolling update is in flight, or the pool scheduler
/// counts every pod on a node.
#[derive(Debug, Default)]
pub(crate) struct PodInterest {
    pub everything: bool,
    /// RCs held by another session, less those about to be claimed.
    foreign: HashSet<RcId>,
    /// Pod ids of the RCs this farm serves or is about to claim.
    pod_ids: HashSet<String>,
}

impl PodInterest {
    pub fn keep(&self, labels: &dyn LabelLookup) -> bool {
        self.everything
            // A label that names no RC is no other farm's.
            || labels
                .label(RC_ID_LABEL)
                .and_then(|rc| RcId::parse(rc).ok())
                .is_none_or(|rc| !self.foreign.contains(&rc))
            || labels
                .label(crate::rc::POD_ID_LABEL)
                .is_some_and(|p| self.pod_ids.contains(p))
    }
}

/// RCs, for the claim machinery.
pub(crate) struct RcKind {
    pub farm_id: String,
    pub status: Arc<StatusRegistry>,
    pub failsafe: Arc<crate::failsafe::Failsafe>,
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

    /// The pods of RCs handed over leave this farm's count in the removal window before
    /// their locks do (`Failsafe::report_before_release`): the farm that takes them over
    /// counts them as soon as it holds them.
    async fn before_release(&self, farm: &ClaimFarm<'_>, ids: &[RcId], last: bool) -> bool {
        let fence = registry::registration_fence(farm.session);
        // RCs already forgotten (at shutdown) are out of the count already.
        let pods = self.status.pods_current_without(ids) as u64;
        // At shutdown the tasks have stopped: only a roll's charge can hold the turn.
        let wait = if last {
            Duration::from_secs(10)
        } else {
            Duration::from_secs(1)
        };
        match self
            .failsafe
            .report_before_release(farm.consul, fence, pods, wait)
            .await
        {
            Ok(Reported::Written | Reported::Unneeded) => true,
            Ok(Reported::Later) => false,
            Err(e) => {
                tracing::info!(error = %e, "cannot write this farm's smaller count into the removal window before a release");
                false
            }
        }
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
        let Some(listing) = views.records.latest() else {
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
        if let Some(listing) = views.records.latest() {
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
    /// Returns the RCs it took over that another session may have written pods for.
    ///
    /// Gather (the views, the claim inputs), decide (which claims must wait for a read of the
    /// pod labels: `crate::freshness`'s `SinceTakeover`), apply (claims, releases, tasks),
    /// then report. Each step is a function of its own below.
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
    ) -> Vec<RcId> {
        // Gather.
        let Some(g) = Gathered::from(views) else {
            return Vec::new();
        };
        self.report_garbage_locks(&g.locks);
        publish_locks(locks_tx, &g.locks, owned);
        self.report_invalid_rcs(&g.listing).await;
        let (inputs, inputs_changed) = self.claim_inputs_for(&g, views, session, info, owned);
        // Decide which claims wait for the pod labels.
        let pod_demand = views.pods.demand().cloned();
        if let Some(d) = &pod_demand {
            self.after_store_regression(views, ctx, owned, d);
        }
        let owed = match &pod_demand {
            Some(d) => self.pods_owed(&g, &inputs, ctx, owned, d),
            None => BTreeSet::new(),
        };
        // Apply.
        let claimed = self
            .apply_claims(&g, &inputs, views, session, ctx, owned, ev_tx)
            .await;
        let listing = views.records.latest().unwrap_or_else(|| g.listing.clone());
        if inputs_changed || !claimed.is_empty() {
            self.keep_pods_of(&listing, &inputs, owned);
        }
        if let Some(d) = &pod_demand {
            self.settle_pods_owed(&owed, &claimed, ctx, owned, d);
        }
        // A ticket is for a task's next pass: one of an RC this farm no longer serves (deleted,
        // handed over, fenced before its pass) would be kept for ever.
        ctx.pod_tickets
            .lock()
            .retain(|id, _| owned.tasks.contains_key(id) || claimed.contains(id));
        self.release_stray_mutation_locks(session.id(), stray_mutation_locks(&inputs, owned))
            .await;
        // Report.
        self.publish_ownership(&inputs, &listing, owned);
        claimed
            .iter()
            .filter(|id| pod_demand.is_none() || owed.contains(*id))
            .copied()
            .collect()
    }

    /// Logs each key under the lock prefix that is not an RC lock, once while it is there.
    fn report_garbage_locks(&self, locks: &LockView) {
        let mut seen = self.garbage_locks_reported.lock();
        // Only what is still there stays reported (a key removed and written again is
        // reported again).
        seen.rcs.retain(|k| locks.garbage.contains(k));
        let seen = &mut seen.rcs;
        for key in &locks.garbage {
            if seen.insert(key.clone()) {
                tracing::warn!(%key, "a key under the lock prefix is not an RC lock; ignoring it");
            }
        }
    }

    /// Reports the RC keys that name no RC (each once, audited).
    async fn report_invalid_rcs(&self, listing: &RcListing) {
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
    }

    /// The claim inputs for what `g` shows, and whether they were computed anew: ticks and
    /// events that changed none of their inputs do not compute the assignment of 20,000 RCs
    /// again (it was most of an idle farm's CPU).
    fn claim_inputs_for(
        &self,
        g: &Gathered,
        views: &Views,
        session: &Session,
        info: &FarmInfo,
        owned: &OwnedRcs,
    ) -> (Arc<ClaimInputs>, bool) {
        // What this farm holds beyond what the lock tree showed (claims since its last read).
        let key = (
            g.keys.index,
            views.rc_labels.index(),
            g.farms.index,
            g.locks.index,
            session.id().to_string(),
            RcId::digest(owned.tasks.keys()),
        );
        if let Some(c) = self.claim_inputs.lock().clone()
            && c.key == key
        {
            return (c, false);
        }
        let c = Arc::new(claim_inputs(
            key,
            &g.keys,
            &g.listing,
            views,
            &g.locks,
            &g.farms.value,
            info,
            &self.config.rc_selector,
            owned.tasks.keys(),
        ));
        *self.claim_inputs.lock() = Some(c.clone());
        (c, true)
    }

    /// A watch was answered with an older state than it had seen: Consul restored from a
    /// backup or emptied (or a new leader replaying its log, which costs one read). The
    /// watches of the RC tree and of the pod label tree each take in a store gone back on
    /// their own, seconds apart (each holds an older answer back for its grace, or until the
    /// restored store's index passes the one it held), so a task handed the restored RC record
    /// could plan it against the pods as they were before, and its writes pass every check the
    /// restored store makes: the record's index is the restored one, a pod on a node the old
    /// view shows empty is created. (The restore chaos: an RC scaled down after the backup got
    /// its 3 replicas and 3 pods back, and its farm, still seeing none, wrote 3 more.) So
    /// before the tasks are handed what the RC watch now says, every task's next plan and
    /// every claim's first waits for a read of the pod labels sent from now on, and that read
    /// is believed over our own earlier writes.
    fn after_store_regression(
        &self,
        views: &Views,
        ctx: &TaskContext,
        owned: &OwnedRcs,
        demand: &Demand,
    ) {
        let regressions = self.store_regressions.count();
        if self.regressions_acted.swap(regressions, Ordering::SeqCst) == regressions {
            return;
        }
        views.pods.forget_all_own();
        let ticket = demand.urge();
        self.pod_freshness.lock().pending = Some(ticket);
        let mut tickets = ctx.pod_tickets.lock();
        for id in owned.tasks.keys() {
            tickets.insert(*id, ticket);
        }
        tracing::warn!(
            "Consul answered with an older state than seen (restored, emptied, or a new leader replaying its log): every RC's next plan waits for a fresh read of the pod labels"
        );
    }

    /// The RCs that would need a read of the pod label tree if claimed now (another session
    /// may have written their pods), each given a ticket for that read, their pods kept by the
    /// cache from now on.
    fn pods_owed(
        &self,
        g: &Gathered,
        inputs: &ClaimInputs,
        ctx: &TaskContext,
        owned: &OwnedRcs,
        demand: &Demand,
    ) -> BTreeSet<RcId> {
        let mut f = self.pod_freshness.lock();
        // Holders change only with the lock view (not with each claim or listing).
        if f.foreign_at != Some(g.locks.index) {
            f.foreign.extend(inputs.theirs.iter().copied());
            f.foreign_at = Some(g.locks.index);
        }
        f.foreign.extend(owned.refused().copied());
        f.pending = f.pending.filter(|t| !demand.is_fresh(*t));
        // Free locks, and ours without a task: a lock our session holds that this farm serves
        // no task for is taken up as if claimed (a store restored from a backup hands back
        // locks we gave up since, of RCs whose pods the cache stopped keeping when another
        // farm took them: planned from that view, the RC's pods were not there, and one was
        // scheduled twice).
        let owed: BTreeSet<RcId> = inputs
            .held
            .unheld
            .iter()
            .chain(&inputs.held.ours)
            .filter(|id| !owned.tasks.contains_key(*id))
            .filter(|id| {
                f.pending.is_some()
                    || f.foreign.contains(*id)
                    // Another RC of its pod id is held elsewhere (a rolling update's old RC):
                    // the pods it may take over are not in the cache.
                    || g
                        .listing
                        .rcs
                        .get(id)
                        .is_some_and(|rc| inputs.foreign_pod_ids.contains(rc.pod_id()))
            })
            .copied()
            .collect();
        drop(f);
        if !owed.is_empty() {
            // Their pods are kept from now on, before the ticket is taken: the read their
            // tasks wait for must be folded with them wanted. A read already in flight (a
            // pending ticket's, or one started by the last claims) may be folded before this
            // reconcile updates the interest, leaving them out; their tasks then planned
            // without their pods and every write was refused (1,800-2,000 passes per farm
            // when a SIGTERMed farm handed 6,666 RCs over).
            let mut interest = self.pod_interest.write();
            for id in &owed {
                interest.foreign.remove(id);
                if let Some(rc) = g.listing.rcs.get(id) {
                    interest.pod_ids.insert(rc.pod_id().to_string());
                }
            }
        }
        // Not an earlier pending ticket: its read may have been sent already. A later one
        // also follows whatever made it pending.
        let ticket = demand.next_ticket();
        let mut tickets = ctx.pod_tickets.lock();
        for id in &owed {
            tickets.insert(*id, ticket);
        }
        owed
    }

    /// Claims what is assigned and free, starts a task per RC held, hands over what is over
    /// the farm's share (`ownership::Owned`). Returns what it claimed.
    #[allow(clippy::too_many_arguments)]
    async fn apply_claims(
        &self,
        g: &Gathered,
        inputs: &ClaimInputs,
        views: &Views,
        session: &Session,
        ctx: &Arc<TaskContext>,
        owned: &mut OwnedRcs,
        ev_tx: &mpsc::UnboundedSender<TaskEvent>,
    ) -> BTreeSet<RcId> {
        let view = ClaimView {
            all: &inputs.all,
            matching: &inputs.matching,
            assignment: &inputs.assignment,
            holders: &inputs.owners,
            held: Some(&inputs.held),
            lock_index: g.locks.index,
            // Not the view's own time: an answer equal to the last one leaves the view as it
            // was, yet says it is still current (a refused claim, or a grace period, waits for
            // such an answer).
            locks_read_at: self
                .lock_demand
                .answered_at()
                .unwrap_or_else(tokio::time::Instant::now),
            lock_reads: Some(&self.lock_demand),
            // The records' own index: a read that failed leaves it behind the keys', so the
            // tasks are handed their records once a read succeeds.
            listing_index: g.listing.index,
            // A claim of an RC deleted meanwhile is harmless: its task is told, and gives the
            // lock back.
            guard: &|_| None,
        };
        let records = &views.records;
        let keys = &g.keys;
        let sid = session.id();
        let serving: BTreeSet<RcId> = owned.tasks.keys().copied().collect();
        owned
            .reconcile_with(
                &self.claim_farm(session),
                &view,
                |id| {
                    // `prepare` started only RCs whose state is known.
                    let listing = records.latest().unwrap_or_default();
                    crate::rctask::spawn(
                        ctx.clone(),
                        sid.clone(),
                        session.lost(),
                        id,
                        rc_state(keys, &listing, id).unwrap_or(RcState::Deleted),
                        ev_tx.clone(),
                    )
                },
                |id| {
                    let listing = records.latest()?;
                    Some((
                        rc_state(keys, &listing, id)?,
                        listing.record(&id)?.modify_index(),
                    ))
                },
                |ids| async move {
                    self.add_records(views, &ids.into_iter().collect()).await;
                },
                |ids| self.prepare_records(views, keys, serving, ids),
            )
            .await
            .into_iter()
            .collect()
    }

    /// The pods the cache keeps: those of the pod ids this farm serves, not those of RCs
    /// another session holds. Updated before any read the claims ask for.
    fn keep_pods_of(&self, listing: &RcListing, inputs: &ClaimInputs, owned: &OwnedRcs) {
        let pod_ids: HashSet<String> = owned
            .tasks
            .keys()
            .filter_map(|id| listing.rcs.get(id))
            .map(|rc| rc.pod_id().to_string())
            .collect();
        let mut interest = self.pod_interest.write();
        interest.pod_ids = pod_ids;
        interest.foreign = inputs.theirs.clone();
    }

    /// After the claims: asks for the read the owed RCs now served wait for, and forgets the
    /// tickets of those not claimed. RCs taken over from another session have their intents
    /// swept soon too; new RCs have none to sweep (a sweep lists every intent: 100,000 of them
    /// were most of what a farm read while claiming, and its peak memory).
    fn settle_pods_owed(
        &self,
        owed: &BTreeSet<RcId>,
        claimed: &BTreeSet<RcId>,
        ctx: &TaskContext,
        owned: &OwnedRcs,
        demand: &Demand,
    ) {
        if owed.is_empty() {
            return;
        }
        // Claimed, or a lock of ours taken up: its task waits for the read.
        let started: Vec<RcId> = owed
            .iter()
            .filter(|id| owned.tasks.contains_key(*id))
            .copied()
            .collect();
        if !started.is_empty() {
            demand.urge();
        }
        let mut f = self.pod_freshness.lock();
        for id in claimed.iter().chain(&started) {
            f.foreign.remove(id);
        }
        let mut tickets = ctx.pod_tickets.lock();
        for id in owed.iter().filter(|id| !owned.tasks.contains_key(*id)) {
            tickets.remove(id);
        }
    }

    /// The farm's ownership in its metrics and status.
    fn publish_ownership(&self, inputs: &ClaimInputs, listing: &RcListing, owned: &OwnedRcs) {
        let cap = inputs
            .assignment
            .cap
            .get(&self.config.farm_id)
            .copied()
            .unwrap_or(0);
        let owned_n = owned.tasks.len();
        metrics::gauge!("rcfarm_owned_rcs").set(owned_n as f64);
        metrics::gauge!("rcfarm_fair_share").set(cap as f64);
        metrics::gauge!("rcfarm_live_farms").set(inputs.farms.len() as f64);
        let rule = inputs.rule.number();
        metrics::gauge!("rcfarm_assignment_rule").set(rule as f64);
        let was = self.rule_in_use.swap(rule, Ordering::Relaxed);
        if was != rule {
            let offered: Vec<String> = inputs
                .farms
                .iter()
                .map(|f| format!("{}={}", f.farm_id, f.assignment_rule))
                .collect();
            tracing::info!(
                rule,
                was,
                offered = %offered.join(","),
                "assignment rule: the oldest rule the live farms offer"
            );
        }
        // As this farm sees them: an RC no session holds a lock on (none of the farms'
        // selectors matches it, or its farm died and nobody has taken it yet).
        metrics::gauge!("rcfarm_rcs").set(inputs.all.len() as f64);
        let unowned = inputs
            .all_unheld
            .iter()
            .filter(|id| !owned.tasks.contains_key(*id))
            .count();
        metrics::gauge!("rcfarm_rcs_unowned").set(unowned as f64);
        self.status.update_farm(|f| {
            f.owned = owned_n;
            f.fair_share = cap;
            f.live_farms = inputs.farms.iter().map(|f| f.farm_id.clone()).collect();
            f.assignment_rule = rule;
            f.matching_rcs = inputs.matching.len();
            f.invalid_rcs = listing.invalid.len();
        });
    }

    /// Reads the intents of every owned pod and wakes the tasks that have something to repair.
    /// Reads the intents of every owned pod (`only`: of those RCs, just taken over) and wakes
    /// the tasks that have something to repair.
    pub(super) async fn sweep(
        &self,
        views: &Views,
        ctx: &Arc<TaskContext>,
        owned: &OwnedRcs,
        only: Option<&BTreeSet<RcId>>,
    ) {
        let mut pods = BTreeSet::new();
        for id in owned
            .tasks
            .keys()
            .filter(|id| only.is_none_or(|o| o.contains(*id)))
        {
            let sel = Selector::from_equalities([(RC_ID_LABEL, id.to_string().as_str())]);
            for pid in views.pods.matches(&sel) {
                if let Some((n, p)) = crate::labels::split_pod_label_id(&pid) {
                    pods.insert((n.to_string(), p.to_string()));
                }
            }
        }
        match sweep::sweep(&self.consul, &ctx.intents, &pods, only.is_none()).await {
            Ok(n) => {
                tracing::debug!(intents = n, "consistency sweep done");
                if let Some(listing) = views.records.latest() {
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
    /// The RCs whose records this farm reads besides `serving`: those of every rolling update
    /// (a roll task here may run one whose RCs other farms own, and a new RC's task takes pods
    /// over from its old RC), and those under a held mutation lock (a roller that writes no
    /// roll record moves replicas between RCs it holds the locks of).
    pub(super) fn record_interest(
        &self,
        views: &Views,
        serving: impl IntoIterator<Item = RcId>,
    ) -> BTreeSet<RcId> {
        let mut ids: BTreeSet<RcId> = serving.into_iter().collect();
        if let Some(rolls) = views.rolls.latest() {
            for r in rolls.rolls.values() {
                ids.insert(r.update.old_rc);
                ids.insert(r.update.new_rc);
            }
        }
        if let Some(locks) = views.locks.latest() {
            ids.extend(
                locks
                    .holders
                    .iter()
                    .filter(|(_, h)| h.mutation.is_some())
                    .map(|(id, _)| *id),
            );
        }
        ids
    }

    /// Brings the records of `interest` to the latest keys. A failed read is logged; the
    /// listing stays as it was and the next pass reads again. Returns whether it changed.
    pub(super) async fn sync_records(&self, views: &Views, interest: &BTreeSet<RcId>) -> bool {
        let Some(keys) = views.rc_keys.latest() else {
            return false;
        };
        match views.records.sync(&keys, interest).await {
            Ok(changed) => changed,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the records of this farm's RCs; reading them again at the next pass");
                false
            }
        }
    }

    /// Reads the records of `ids` this farm does not hold yet, keeping the others (and the
    /// listing's index: the tripwire looks at every change of what the farm serves first).
    pub(super) async fn add_records(&self, views: &Views, ids: &BTreeSet<RcId>) {
        let Some(keys) = views.rc_keys.latest() else {
            return;
        };
        if let Err(e) = views.records.add(&keys, ids).await {
            tracing::warn!(error = %e, count = ids.len(), "cannot read the records of RCs to start tasks for; they start at a later pass");
        }
    }

    /// Reads the records of the RCs about to get a task (`starts`): returns those whose state
    /// is now known (read, or deleted).
    /// The tripwire then looks at `serving` with them, before any of them plans.
    async fn prepare_records(
        &self,
        views: &Views,
        keys: &RcKeys,
        serving: BTreeSet<RcId>,
        starts: Vec<RcId>,
    ) -> Vec<RcId> {
        self.add_records(views, &starts.iter().copied().collect())
            .await;
        let listing = views.records.latest().unwrap_or_default();
        let known: Vec<RcId> = starts
            .into_iter()
            .filter(|id| rc_state(keys, &listing, *id).is_some())
            .collect();
        let share: BTreeSet<RcId> = serving.into_iter().chain(known.iter().copied()).collect();
        let fs = &self.failsafe;
        // A first look trips on two RCs or more at 0 only if their pods run, and the pods
        // of RCs just taken from another farm are not read yet: the look, and every removal,
        // wait for that read (the tasks wait for it anyway).
        let all_zero = share.len() >= 2
            && share.iter().all(|id| {
                listing
                    .rcs
                    .get(id)
                    .is_some_and(|rc| rc.replicas_desired == 0)
            });
        match views.pods.demand() {
            Some(d)
                if !known.is_empty()
                    && all_zero
                    && !fs.config().confirm.is_zero()
                    && fs.at_first_look() =>
            {
                fs.await_first_look(d.urge());
            }
            _ => {
                self.look_at_share(views, share.into_iter());
            }
        }
        known
    }

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

/// An RC's state as the farm knows it: `None` when its key exists but its record was not read
/// (never taken for a deletion).
/// The views a reconcile of the RCs decides from, each as last read.
struct Gathered {
    keys: Arc<RcKeys>,
    listing: Arc<RcListing>,
    locks: Arc<LockView>,
    farms: Arc<crate::consul::Snapshot<Vec<KvPair>>>,
}

impl Gathered {
    /// `None` until every one of them was read once.
    fn from(views: &Views) -> Option<Gathered> {
        Some(Gathered {
            keys: views.rc_keys.latest()?,
            listing: views.records.latest()?,
            locks: views.locks.latest()?,
            farms: views.farms.latest()?,
        })
    }
}

/// Tells the RC tasks what the lock tree now says, waking those whose mutation or
/// node-transfer lock changed.
fn publish_locks(locks_tx: &LocksTx, locks: &Arc<LockView>, owned: &OwnedRcs) {
    if locks_tx.borrow().index == locks.index {
        return;
    }
    let old = locks_tx.send_replace(locks.clone());
    for (id, t) in &owned.tasks {
        if old.mutation(*id) != locks.mutation(*id)
            || old.node_transfer(*id) != locks.node_transfer(*id)
        {
            t.wake();
        }
    }
}

/// A mutation lock our session holds on an RC we do not serve would stop its owner from ever
/// moving a pod (it waits for "another session"). It happens when a task is stopped
/// mid-transfer (handover, fencing, deletion), when the release request is lost, or when an
/// acquire sent by a task just stopped lands late; the lock tree's change brings us back here.
/// The transfer itself, if one is in flight, is resumed by the owner.
fn stray_mutation_locks(inputs: &ClaimInputs, owned: &OwnedRcs) -> Vec<(RcId, String)> {
    inputs
        .our_mutations
        .iter()
        .filter_map(|(id, v)| {
            let ours_for_transfer = **v == *id.node_transfer_holder();
            // A rolling update's lock is the roll farm's business; any other value under our
            // session (a late request of a stopped task, an older version) is stray.
            let stray = if ours_for_transfer {
                !owned.tasks.contains_key(id)
            } else {
                !v.starts_with(crate::roll::ROLL_HOLDER_PREFIX)
            };
            stray.then(|| (*id, v.to_string()))
        })
        .collect()
}

fn rc_state(keys: &RcKeys, listing: &RcListing, id: RcId) -> Option<RcState> {
    match listing.record(&id) {
        Some(ListedRc::Valid(rc)) => Some(RcState::Valid(rc.clone())),
        Some(ListedRc::Invalid(inv)) => Some(RcState::Invalid(Arc::new(inv.clone()))),
        None if !keys.ids.contains(&id) => Some(RcState::Deleted),
        None => None,
    }
}

/// What a reconcile of the RCs decides from: derived from the RC listing, the RC labels, the
/// farm registry and the lock tree, and kept until one of them changes.
pub(crate) struct ClaimInputs {
    key: ClaimKey,
    /// Every RC key that names an RC, valid or not (an invalid one is still claimed, so that
    /// exactly one farm reports it).
    all: BTreeSet<RcId>,
    matching: BTreeSet<RcId>,
    assignment: super::claims::Assignment,
    /// The rule the assignment was computed by (`registry::agreed_rule`).
    rule: super::claims::Rule,
    /// RC → the session holding its ownership lock.
    owners: BTreeMap<RcId, Arc<str>>,
    /// Pod ids of RCs another session holds.
    foreign_pod_ids: HashSet<String>,
    /// The RCs another session holds.
    theirs: HashSet<RcId>,
    /// Of `matching`, what no session holds, and what this farm's session holds.
    held: HeldIndex,
    /// Of `all`, what no session holds (for the gauge of RCs nobody serves).
    all_unheld: Vec<RcId>,
    /// The mutation locks this farm's session holds, as (RC, value held).
    our_mutations: Vec<(RcId, Arc<str>)>,
    farms: Vec<FarmInfo>,
}

impl ClaimInputs {
    /// Whether the assignment gives `farm_id` an RC held by a farm over its share (see
    /// [`super::claims::Assignment::handover_due_to`]). Not any RC held elsewhere: RCs claimed
    /// in a rush change hands that way all the time, and reading every change of the lock tree
    /// over them read up to 1.7x the bytes at 20,000 RCs (one run; the spread is wide).
    fn handovers_awaited(&self, farm_id: &str, session: &str) -> bool {
        let farm_of: HashMap<&str, &str> = self
            .farms
            .iter()
            .map(|f| (f.session.as_str(), f.farm_id.as_str()))
            .collect();
        self.assignment.handover_due_to(farm_id, |rc| {
            let s = self.owners.get(rc)?;
            if &**s == session {
                return Some(farm_id);
            }
            farm_of.get(&**s).copied()
        })
    }
}

/// The indexes of the listing, RC labels, registry and lock tree, the session, and what the
/// farm's tasks hold (their number and ids folded).
type ClaimKey = (u64, u64, u64, u64, String, (u64, u128));

#[allow(clippy::too_many_arguments)]
fn claim_inputs<'a>(
    key: ClaimKey,
    keys: &RcKeys,
    listing: &RcListing,
    views: &Views,
    locks: &LockView,
    registry_entries: &[KvPair],
    info: &FarmInfo,
    selector: &Selector,
    tasks: impl Iterator<Item = &'a RcId>,
) -> ClaimInputs {
    // From the keys alone: claims read no record (issue 38).
    let all: BTreeSet<RcId> = keys.ids.clone();
    // Most RCs carry no labels: they share one empty set. The labelled ones are taken from the
    // cache in one pass, not looked up (and their ids written out) one RC at a time.
    let none = LabelSet::new();
    let labelled: HashMap<RcId, Arc<LabelSet>> = views
        .rc_labels
        .all()
        .into_iter()
        .filter_map(|(id, l)| Some((RcId::parse(&id).ok()?, l)))
        .collect();
    let rc_labels: BTreeMap<RcId, &LabelSet> = all
        .iter()
        .map(|id| (*id, labelled.get(id).map_or(&none, |l| &**l)))
        .collect();
    let farms = registry::live_farms_with(registry_entries, info);
    let farm_of: HashMap<&str, &str> = farms
        .iter()
        .map(|f| (f.session.as_str(), f.farm_id.as_str()))
        .collect();
    let owners: BTreeMap<RcId, Arc<str>> = locks
        .holders
        .iter()
        .filter_map(|(id, h)| h.ownership.as_ref().map(|(s, _)| (*id, s.clone())))
        .collect();
    let mut farm_holding: BTreeMap<RcId, &str> = owners
        .iter()
        .filter_map(|(id, s)| Some((*id, *farm_of.get(&**s)?)))
        .collect();
    // Claims the lock tree does not show yet are ours too: counted as free, they were given to
    // this farm again on top of its share, and it then had that many to hand back.
    farm_holding.extend(tasks.map(|id| (*id, info.farm_id.as_str())));
    let rule = registry::agreed_rule(&farms);
    let assignment = assign_held(&rc_labels, &registry::views(&farms), &farm_holding, rule);
    let matching: BTreeSet<RcId> = rc_labels
        .iter()
        .filter(|(_, l)| selector.matches(**l))
        .map(|(id, _)| *id)
        .collect();
    let held = HeldIndex::new(&matching, &owners, &key.4);
    let theirs: HashSet<RcId> = owners
        .iter()
        .filter(|(_, s)| ***s != *key.4)
        .map(|(id, _)| *id)
        .collect();
    // Only a pod id more than one RC carries can be another farm's and a candidate's both (and
    // with no RC held elsewhere, none is: a lone farm skips the walk over every pod id). Of the
    // records this farm reads: those of rolling updates' RCs and of RCs under a held mutation
    // lock are among them, which is how one pod id comes to be two RCs'.
    let foreign_pod_ids = if theirs.is_empty() {
        HashSet::new()
    } else {
        listing
            .shared_pod_ids()
            .into_iter()
            .filter(|(_, ids)| ids.iter().any(|id| theirs.contains(id)))
            .map(|(pod_id, _)| pod_id.to_string())
            .collect()
    };
    let all_unheld = all
        .iter()
        .filter(|id| !owners.contains_key(*id))
        .copied()
        .collect();
    let our_mutations = locks
        .holders
        .iter()
        .filter_map(|(id, h)| {
            let (s, v) = h.mutation.as_ref()?;
            (**s == *key.4).then(|| (*id, v.clone()))
        })
        .collect();
    ClaimInputs {
        held,
        all_unheld,
        our_mutations,
        foreign_pod_ids,
        theirs,
        key,
        all,
        matching,
        assignment,
        rule,
        owners,
        farms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pod is left out only when its RC label names an RC another session holds and its pod
    /// id is none of ours; a label that names no RC is nobody's, so the pod is kept.
    #[test]
    fn pods_of_rcs_held_elsewhere_are_left_out() {
        let (theirs, ours) = (RcId::new(), RcId::new());
        let interest = PodInterest {
            everything: false,
            foreign: [theirs].into(),
            pod_ids: ["shared".to_string()].into(),
        };
        let pod = |rc: &str, pod_id: &str| -> LabelSet {
            [
                (RC_ID_LABEL.to_string(), rc.to_string()),
                (crate::rc::POD_ID_LABEL.to_string(), pod_id.to_string()),
            ]
            .into()
        };
        assert!(!interest.keep(&pod(&theirs.to_string(), "web")));
        assert!(interest.keep(&pod(&theirs.to_string(), "shared")));
        assert!(interest.keep(&pod(&ours.to_string(), "web")));
        assert!(interest.keep(&pod("not-an-rc", "web")));
        assert!(interest.keep(&pod(&theirs.to_string().to_uppercase(), "web")));
        assert!(interest.keep(&LabelSet::new()));
        let everything = PodInterest {
            everything: true,
            ..interest
        };
        assert!(everything.keep(&pod(&theirs.to_string(), "web")));
    }
}

//! Claimed work, whatever is claimed: the farm claims RCs and rolling updates the same way.
//! Each kind has a lock per object (`lock/replication_controllers/<id>`, `lock/rolls/<id>`);
//! a farm claims its fair share of the objects it may serve, starts a task per object it
//! holds, hands objects over when they are assigned elsewhere, and gives everything back on
//! shutdown. This module is that machinery; the kinds differ only in their [`Kind`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::claims::Assignment;
pub(crate) use super::decide::Rules;
use super::decide::{self, HeldIndex, Situation, Stop};
use crate::audit::AuditRecord;
use crate::clock::Clock;
use crate::consul::{
    BatchError, Consul, Demand, Fence, FenceError, FencedBatch, FencedTxn, MAX_TXN_OPS, Session,
    TxnFailure, TxnOp,
};
use crate::freshness::Learnt;
use crate::rc::RcId;
use crate::task::TaskHandle;

/// Release transactions sent at once when handing objects over.
const RELEASES_IN_FLIGHT: usize = 4;
/// How soon a farm looks again at handovers it deferred for tasks' first passes.
const FIRST_PASS_RECHECK: Duration = Duration::from_millis(20);
/// How soon a handover that had to wait (see [`Kind::before_release`]) is tried again.
const RELEASE_RECHECK: Duration = Duration::from_millis(250);
/// Claim transactions in flight at once.
const CLAIMS_IN_FLIGHT: usize = 4;

/// What distinguishes one kind of claimed work.
pub(crate) trait Kind {
    /// What the kind's task is handed: the object as the farm last saw it.
    type State: Send + Sync + 'static;
    /// For logs and audit records: "replication controller", "rolling update".
    const NOUN: &'static str;
    /// For logs: "RCs", "rolling updates".
    const PLURAL: &'static str;

    fn lock_key(id: RcId) -> String;
    /// The audit record written with a claim.
    fn claimed_record(&self, id: RcId, session: &Session) -> AuditRecord;
    /// The audit record written with a release.
    fn released_record(&self, id: RcId, session: &Session, reason: &str) -> AuditRecord;
    /// The state that tells a task its object was deleted.
    fn deleted() -> Self::State;
    /// Forgets what the farm reports about an object it stopped serving.
    fn forget(&self, id: RcId);
    /// What must be written while `ids` are still this farm's, before their locks are given
    /// back. A handover calls it while their tasks still run and goes on only on `true`
    /// (`false`: not now; they stay this farm's and a later reconcile tries again); a shutdown
    /// (`last`) calls it after their tasks stopped and releases whatever it answers.
    fn before_release(
        &self,
        _farm: &ClaimFarm<'_>,
        _ids: &[RcId],
        _last: bool,
    ) -> impl Future<Output = bool> + Send {
        async { true }
    }
}

/// What the farm sees of one kind at a reconcile.
pub(crate) struct ClaimView<'a> {
    /// Every object that exists (a valid or an invalid record: an invalid one is claimed too,
    /// so that exactly one farm reports it).
    pub all: &'a BTreeSet<RcId>,
    /// The objects this farm may serve.
    pub matching: &'a BTreeSet<RcId>,
    pub assignment: &'a Assignment,
    /// The session holding each object's lock.
    pub holders: &'a BTreeMap<RcId, Arc<str>>,
    /// Of `matching` and `holders`, what is unheld and what is this farm's, if the caller
    /// keeps it with its view (`None`: computed at each reconcile; fine for a few objects).
    pub held: Option<&'a HeldIndex>,
    /// The lock tree's index, to tell a lagging view from a lost lock.
    pub lock_index: u64,
    /// When the lock tree was read: an object is known unheld only up to then.
    pub locks_read_at: Instant,
    /// The on-demand read of the lock tree behind `holders`, if it is one (`None`: a watch
    /// that answers every change).
    pub lock_reads: Option<&'a Demand>,
    /// The objects' tree's index, to tell a lagging view from an object that ended.
    pub listing_index: u64,
    /// An op a claim must carry to be sure the object is still as seen (a roll that has just
    /// completed may still show in a lagging view after its lock went), if the kind wants one.
    pub guard: &'a dyn Fn(RcId) -> Option<TxnOp>,
}

/// A claim or release record: the object (under `id_field`), the farm, its session, and for
/// a release why.
pub(crate) fn ownership_record(
    event: &str,
    id_field: &str,
    id: RcId,
    farm_id: &str,
    session: &Session,
    reason: Option<&str>,
) -> AuditRecord {
    let mut details = serde_json::json!({
        id_field: id,
        "farm_id": farm_id,
        "session": session.id(),
        "session_name": session.name(),
    });
    if let Some(r) = reason {
        details["reason"] = r.into();
    }
    AuditRecord::new(event, details)
}

/// What a farm owns of one kind under its current session.
pub(crate) struct Owned<K: Kind> {
    pub kind: K,
    pub tasks: BTreeMap<RcId, TaskHandle<K::State>>,
    /// Each object claimed, at the claim's commit: until the lock tree shows that index, a
    /// missing lock in the view is the watch lagging, not a loss.
    claimed_at: HashMap<RcId, Learnt>,
    /// When each unheld object was first seen unheld (for the grace rule).
    unheld_since: HashMap<RcId, Instant>,
    /// The versions handed to tasks.
    sent: HashMap<RcId, u64>,
    /// The listing index at which every task was last handed its version: versions come from
    /// the listing, so until it changes there is nothing new to hand (a task started since
    /// was spawned with its version).
    sent_at: Option<u64>,
    /// Objects whose task finished them (a completed roll) at a commit index: not claimed
    /// or started again until the view of the objects has caught up with that index.
    finished_at: HashMap<RcId, Learnt>,
    /// Objects a claim found held by another session: held, as far as this farm knows, until
    /// a lock tree read after the refusal shows otherwise.
    refused_at: HashMap<RcId, Learnt>,
    /// Objects this farm gave back: not ours, though the view may show them so until a lock
    /// tree read after the release (without this, each tick started their tasks from the
    /// stale view and handed them over again).
    released_at: HashMap<RcId, Learnt>,
    /// When the last reconcile asked to be run again (see [`decide::Claims::recheck_at`]).
    recheck_at: Option<Instant>,
}

/// What a write taught the farm about the lock tree (a claim refused, a lock given back),
/// learnt now: shown by a read asked for now, or by a change of a watch's view.
fn learnt_now(view: &ClaimView<'_>) -> Learnt {
    Learnt::after(view.lock_index, view.lock_reads.map(Demand::urge))
}

impl ClaimView<'_> {
    /// Whether the lock tree shows what `l` stands for.
    fn locks_show(&self, l: &Learnt) -> bool {
        l.shown(self.lock_index, |t| {
            self.lock_reads.is_some_and(|d| d.is_fresh(t))
        })
    }
}

impl<K: Kind> Owned<K> {
    pub fn new(kind: K) -> Self {
        Owned {
            kind,
            tasks: BTreeMap::new(),
            claimed_at: HashMap::new(),
            unheld_since: HashMap::new(),
            sent: HashMap::new(),
            sent_at: None,
            finished_at: HashMap::new(),
            refused_at: HashMap::new(),
            released_at: HashMap::new(),
            recheck_at: None,
        }
    }

    /// When to reconcile again though nothing changed, if the last reconcile asked.
    pub fn recheck_at(&self) -> Option<Instant> {
        self.recheck_at
    }

    /// The recheck is due: forgotten, so that a loop that cannot reconcile now (not ready, the
    /// session in doubt) does not wake for it again and again; the next reconcile asks anew.
    pub fn recheck_due(&mut self) {
        self.recheck_at = None;
    }

    /// Objects a claim found held by another session that the lock tree has not shown since.
    pub fn refused(&self) -> impl Iterator<Item = &RcId> {
        self.refused_at.keys()
    }

    /// A task finished its object (deleted it) at commit `index`.
    pub fn finished(&mut self, id: RcId, index: u64) {
        // A task started again from a lagging view before this news arrived: it cannot write
        // (its object's lock is gone), but it must not even try.
        if let Some(t) = self.tasks.remove(&id) {
            t.cancel();
        }
        self.finished_at.insert(id, Learnt::written_at(index));
        self.claimed_at.remove(&id);
        self.sent.remove(&id);
    }

    /// A task stopped on its own because a write was fenced: forget it (it is claimed again
    /// if the object is still ours to serve).
    pub fn fenced(&mut self, id: RcId) {
        if let Some(t) = self.tasks.remove(&id) {
            t.cancel();
        }
        self.claimed_at.remove(&id);
        self.sent.remove(&id);
        self.kind.forget(id);
    }

    /// Cancels every task at once (the session is lost: they must not even try to write).
    pub fn cancel_all(&mut self) {
        for (_, t) in std::mem::take(&mut self.tasks) {
            t.cancel();
        }
        self.claimed_at.clear();
        self.sent.clear();
    }

    /// Claims, starts, stops and hands over tasks so that the farm serves what the view says
    /// it should. `spawn` starts a task; `state` gives an object's state and version. Returns
    /// what was claimed.
    pub async fn reconcile(
        &mut self,
        farm: &ClaimFarm<'_>,
        view: &ClaimView<'_>,
        spawn: impl FnMut(RcId) -> TaskHandle<K::State>,
        state: impl Fn(RcId) -> Option<(K::State, u64)>,
    ) -> Vec<RcId> {
        self.reconcile_with(farm, view, spawn, state, |_| async {}, std::future::ready)
            .await
    }

    /// [`Owned::reconcile`], with `prepare` called on the objects about to get a task (just
    /// claimed, or held without one) before any is spawned: it returns those that may start
    /// now (their record read); the others start at a later reconcile, their locks kept.
    /// `prefetch` runs beside the claims, on the objects being claimed: what `prepare` will
    /// read is read meanwhile, so a claimed object's task starts one round trip sooner.
    pub async fn reconcile_with<F, FFut, P, Fut>(
        &mut self,
        farm: &ClaimFarm<'_>,
        view: &ClaimView<'_>,
        mut spawn: impl FnMut(RcId) -> TaskHandle<K::State>,
        state: impl Fn(RcId) -> Option<(K::State, u64)>,
        prefetch: F,
        prepare: P,
    ) -> Vec<RcId>
    where
        F: FnOnce(Vec<RcId>) -> FFut,
        FFut: std::future::Future<Output = ()>,
        P: FnOnce(Vec<RcId>) -> Fut,
        Fut: std::future::Future<Output = Vec<RcId>>,
    {
        // What this farm's writes taught it is laid over the views until they show it
        // (`freshness::Need::OwnWrites`).
        for learnt in [
            &mut self.refused_at,
            &mut self.released_at,
            &mut self.claimed_at,
        ] {
            learnt.retain(|_, l| !view.locks_show(l));
        }
        self.finished_at
            .retain(|_, l| !l.shown(view.listing_index, |_| false));
        let computed;
        let held = match view.held {
            Some(h) => h,
            None => {
                computed = HeldIndex::new(view.matching, view.holders, farm.session.id());
                &computed
            }
        };
        let (claimed_at, released_at, refused_at, finished_at) = (
            &self.claimed_at,
            &self.released_at,
            &self.refused_at,
            &self.finished_at,
        );
        let situation = Situation {
            farm_id: farm.farm_id,
            session: farm.session.id(),
            all: view.all,
            matching: view.matching,
            assignment: view.assignment,
            holders: view.holders,
            held,
            locks_read_at: view.locks_read_at,
            claimed: &|id| claimed_at.contains_key(id),
            released: &|id| released_at.contains_key(id),
            refused: &|id| refused_at.contains_key(id),
            finished: &|id| finished_at.contains_key(id),
        };
        let s = &situation;

        let mut deleted = Vec::new();
        for (id, why) in decide::stops(s, &self.tasks, |t| t.is_finished()) {
            let Some(t) = self.tasks.remove(&id) else {
                continue;
            };
            match why {
                Stop::Deleted { release } => {
                    t.update(K::deleted());
                    if release {
                        deleted.push(id);
                    }
                }
                Stop::Ended => {}
                Stop::HeldElsewhere(other) => {
                    tracing::warn!(id = %id, holder = %other, "another session holds the lock of one of our {}; stopping its task", K::PLURAL)
                }
                // A rolling update deletes its lock with its record when it completes, and the
                // lock tree may show that before the task has ended and the roll tree shows
                // the record gone. Not news.
                Stop::LockGone => {
                    tracing::info!(id = %id, "the lock of one of our {} is gone (completed, or deleted by hand); stopping its task", K::PLURAL)
                }
            }
            t.stop().await;
            self.kind.forget(id);
            self.sent.remove(&id);
        }
        // A deleted object's lock is given back.
        if !deleted.is_empty() {
            farm.release(&self.kind, &deleted, &format!("{} deleted", K::NOUN))
                .await;
        }

        let plan = decide::claims(
            s,
            &self.tasks,
            &mut self.unheld_since,
            farm.clock.now(),
            farm.rules,
        );
        if plan.read_locks
            && let Some(d) = view.lock_reads
        {
            d.urge();
        }
        self.recheck_at = plan.recheck_at;
        if plan.unassigned > 0 {
            tracing::info!(
                count = plan.unassigned,
                "claiming {} assigned elsewhere that nobody took within the grace",
                K::PLURAL
            );
        }
        let (claimed, refused) = if plan.claim.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            let ((claimed, refused), ()) = tokio::join!(
                farm.claim(&self.kind, &plan.claim, view.guard),
                prefetch(plan.claim.clone())
            );
            (claimed, refused)
        };
        for id in refused.iter().chain(claimed.iter().map(|(id, _)| id)) {
            self.unheld_since.remove(id);
        }

        // The situation again, with what was just claimed.
        let just_claimed: HashMap<RcId, Learnt> = claimed
            .iter()
            .map(|(id, index)| (*id, Learnt::written_at(*index)))
            .collect();
        let claimed_now = |id: &RcId| claimed_at.contains_key(id) || just_claimed.contains_key(id);
        let situation = Situation {
            claimed: &claimed_now,
            ..situation
        };
        let s = &situation;

        // Start tasks for what we hold and have no task for (claimed now, or held after a
        // restart of the loop).
        let starts = decide::starts(s, &self.tasks, claimed_at.keys().chain(just_claimed.keys()));
        let starts = if starts.is_empty() {
            starts
        } else {
            prepare(starts).await
        };
        for id in starts {
            self.tasks.insert(id, spawn(id));
            // The task starts from the version it was spawned with.
            if let Some((_, version)) = state(id) {
                self.sent.insert(id, version);
            }
        }

        let handovers = decide::handovers(s, &self.tasks, |t| t.on_first_pass());
        let mut excess = handovers.now;
        // Those kept for their first pass are looked at again soon (the pass is a few round
        // trips), not at the next change of a view.
        if handovers.after_first_pass > 0 {
            let soon = Instant::now() + FIRST_PASS_RECHECK;
            self.recheck_at = Some(self.recheck_at.map_or(soon, |r| r.min(soon)));
        }
        if !excess.is_empty() && !self.kind.before_release(farm, &excess, false).await {
            tracing::info!(
                count = excess.len(),
                "handing {} over waits: what must be written before their release could not be written now",
                K::PLURAL
            );
            let soon = Instant::now() + RELEASE_RECHECK;
            self.recheck_at = Some(self.recheck_at.map_or(soon, |r| r.min(soon)));
            excess.clear();
        }
        if !excess.is_empty() {
            tracing::info!(
                count = excess.len(),
                "handing {} over to the farms they are assigned to",
                K::PLURAL
            );
            for id in &excess {
                if let Some(t) = self.tasks.remove(id) {
                    t.stop().await;
                }
                self.sent.remove(id);
                self.kind.forget(*id);
            }
            farm.release(&self.kind, &excess, "handed over for fair share")
                .await;
        }
        self.claimed_at.extend(just_claimed);
        if !refused.is_empty() {
            let l = learnt_now(view);
            self.refused_at
                .extend(refused.into_iter().map(|id| (id, l)));
        }
        if !deleted.is_empty() || !excess.is_empty() {
            let l = learnt_now(view);
            self.released_at
                .extend(deleted.iter().chain(&excess).map(|id| (*id, l)));
        }

        // Hand tasks the versions they have not seen.
        if self.sent_at != Some(view.listing_index) {
            for (id, t) in &self.tasks {
                if let Some((s, version)) = state(*id)
                    && self.sent.get(id) != Some(&version)
                {
                    t.update(s);
                    self.sent.insert(*id, version);
                }
            }
            self.sent_at = Some(view.listing_index);
        }
        claimed.into_iter().map(|(id, _)| id).collect()
    }

    /// Graceful shutdown: stops every task and gives every lock back. Returns what was held.
    pub async fn hand_over(&mut self, farm: &ClaimFarm<'_>) -> Vec<RcId> {
        let ids: Vec<RcId> = self.tasks.keys().copied().collect();
        let tasks = std::mem::take(&mut self.tasks);
        for t in tasks.values() {
            t.cancel();
        }
        for (_, t) in tasks {
            let _ = tokio::time::timeout(Duration::from_secs(10), t.stop()).await;
        }
        for id in &ids {
            self.kind.forget(*id);
        }
        self.kind.before_release(farm, &ids, true).await;
        farm.release(&self.kind, &ids, "farm shutting down").await;
        ids
    }
}

/// The farm as the claim machinery needs it.
pub(crate) struct ClaimFarm<'a> {
    pub consul: &'a Consul,
    pub session: &'a Session,
    pub farm_id: &'a str,
    pub clock: Clock,
    pub rules: Rules,
}

impl ClaimFarm<'_> {
    /// Takes locks in batched transactions (a lock and its audit record per object); ops that
    /// fail (someone else was faster) are dropped and the rest retried once. Returns each
    /// object claimed with the commit index, and the objects whose lock another session held.
    ///
    /// A few batches are in flight at once: each object's claim is its own unit, so their
    /// order does not matter, and farms started together claim in the time of a few round
    /// trips instead of one per batch (the restart path: BENCHMARKS.md).
    async fn claim<K: Kind>(
        &self,
        kind: &K,
        ids: &[RcId],
        guard: &dyn Fn(RcId) -> Option<TxnOp>,
    ) -> (Vec<(RcId, u64)>, Vec<RcId>) {
        use futures::StreamExt;
        // Each object's own op count: a guard adds one, and not every object has one.
        let ops_of = |id: RcId| 2 + usize::from(guard(id).is_some());
        let results: Vec<_> = futures::stream::iter(chunks_by_ops(ids, ops_of, MAX_TXN_OPS))
            .map(|chunk| self.claim_batch(kind, chunk, guard))
            .buffer_unordered(CLAIMS_IN_FLIGHT)
            .collect()
            .await;
        let mut refused = Vec::new();
        let mut got = Vec::new();
        for (g, r) in results {
            got.extend(g);
            refused.extend(r);
        }
        (got, refused)
    }

    /// One batch of [`ClaimFarm::claim`].
    async fn claim_batch<K: Kind>(
        &self,
        kind: &K,
        chunk: Vec<RcId>,
        guard: &dyn Fn(RcId) -> Option<TxnOp>,
    ) -> (Vec<(RcId, u64)>, Vec<RcId>) {
        let mut refused = Vec::new();
        let mut got = Vec::new();
        let mut batch: Vec<RcId> = chunk;
        for _ in 0..2 {
            if batch.is_empty() {
                break;
            }
            // One unit per object: its guard, its lock, its record.
            let batch_txn = FencedBatch::new(
                batch
                    .iter()
                    .map(|id| {
                        FencedTxn::unfenced()
                            .guards(guard(*id))
                            .op(TxnOp::lock(
                                K::lock_key(*id),
                                self.session.name().as_bytes().to_vec(),
                                self.session.id(),
                            ))
                            .records([kind
                                .claimed_record(*id, self.session)
                                .at(self.clock.wall())
                                .txn_op()])
                    })
                    .collect(),
            );
            match batch_txn.commit(self.consul).await {
                Ok(index) => {
                    tracing::info!(count = batch.len(), "claimed {}", K::PLURAL);
                    metrics::counter!("rcfarm_claims_total", "kind" => K::PLURAL)
                        .increment(batch.len() as u64);
                    got.extend(batch.iter().map(|id| (*id, index)));
                    break;
                }
                Err(BatchError::Units(units)) => {
                    metrics::counter!("rcfarm_claim_conflicts_total").increment(1);
                    let failed: BTreeSet<RcId> = units
                        .iter()
                        .filter_map(|(u, _)| batch.get(*u).copied())
                        .collect();
                    refused.extend(units.iter().filter_map(|(u, e)| {
                        let held = matches!(e, FenceError::Conflict { ops, .. }
                            if ops.iter().any(|(_, f)| *f == TxnFailure::LockHeld));
                        held.then(|| batch.get(*u).copied()).flatten()
                    }));
                    batch.retain(|id| !failed.contains(id));
                }
                Err(BatchError::Consul(e)) => {
                    tracing::warn!(error = %e, "claiming {} failed", K::PLURAL);
                    break;
                }
            }
        }
        (got, refused)
    }

    /// One object's release: its lock deleted if still ours, and its audit record.
    fn release_txn<K: Kind>(&self, kind: &K, id: RcId, reason: &str) -> FencedTxn {
        let key = K::lock_key(id);
        FencedTxn::fenced(Fence::new(key.clone(), self.session.id()))
            .op(TxnOp::delete(key))
            .records([kind
                .released_record(id, self.session, reason)
                .at(self.clock.wall())
                .txn_op()])
    }

    /// Gives locks up (deleted if still ours, so no lock-delay applies), with an audit record
    /// each.
    pub async fn release<K: Kind>(&self, kind: &K, ids: &[RcId], reason: &str) {
        metrics::counter!("rcfarm_rcs_released_total", "kind" => K::PLURAL)
            .increment(ids.len() as u64);
        // A few transactions in flight at once: a farm shutting down hands thousands of RCs
        // over, and the others wait for each lock (one at a time took ~5 s for 6,700 RCs).
        use futures::StreamExt;
        futures::stream::iter(ids.chunks(MAX_TXN_OPS / 3))
            .for_each_concurrent(RELEASES_IN_FLIGHT, |chunk| async move {
                let batch = FencedBatch::new(
                    chunk
                        .iter()
                        .map(|id| self.release_txn(kind, *id, reason))
                        .collect(),
                );
                let retry: Vec<RcId> = match batch.commit(self.consul).await {
                    Ok(_) => return,
                    // A lock not ours any more (another farm took it, or it is gone) has
                    // nothing to give back; the others go one by one, each with its record,
                    // as the batch would have.
                    Err(BatchError::Units(units)) => {
                        let gone: BTreeSet<usize> = units
                            .iter()
                            .filter(|(_, e)| matches!(e, FenceError::Fenced { .. }))
                            .map(|(u, _)| *u)
                            .collect();
                        chunk
                            .iter()
                            .enumerate()
                            .filter(|(u, _)| !gone.contains(u))
                            .map(|(_, id)| *id)
                            .collect()
                    }
                    Err(BatchError::Consul(e)) => {
                        tracing::debug!(error = %e, "batched release failed; releasing one by one");
                        chunk.to_vec()
                    }
                };
                for id in retry {
                    match self.release_txn(kind, id, reason).commit(self.consul).await {
                        Ok(_) | Err(FenceError::Fenced { .. }) => {}
                        Err(e) => tracing::warn!(
                            error = %e,
                            id = %id,
                            "could not give a {} back; its lock goes when the session does",
                            K::NOUN
                        ),
                    }
                }
            })
            .await;
    }
}

/// Splits `ids` into runs whose ops (`ops_of` each) fit one transaction of `max` ops, in order.
fn chunks_by_ops(ids: &[RcId], ops_of: impl Fn(RcId) -> usize, max: usize) -> Vec<Vec<RcId>> {
    let mut out: Vec<Vec<RcId>> = Vec::new();
    let mut used = 0;
    for id in ids {
        let n = ops_of(*id);
        if out.is_empty() || used + n > max {
            out.push(Vec::new());
            used = 0;
        }
        used += n;
        if let Some(last) = out.last_mut() {
            last.push(*id);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_chunks_count_each_objects_own_ops() {
        let ids: Vec<RcId> = (0..100).map(|_| RcId::new()).collect();
        let guarded: BTreeSet<RcId> = ids.iter().skip(1).step_by(2).copied().collect();
        let ops_of = |id: RcId| 2 + usize::from(guarded.contains(&id));
        // Rows: which objects have a guard → every chunk within 64 ops, all kept in order.
        // (The first object unguarded, the rest mixed: sized by the first, a chunk of 32
        // objects held 80 ops.)
        for (name, ops) in [
            ("mixed, first unguarded", &ops_of as &dyn Fn(RcId) -> usize),
            ("none guarded", &|_| 2),
            ("all guarded", &|_| 3),
        ] {
            let chunks = chunks_by_ops(&ids, ops, MAX_TXN_OPS);
            for c in &chunks {
                let n: usize = c.iter().map(|id| ops(*id)).sum();
                assert!(n <= MAX_TXN_OPS, "{name}: a chunk of {n} ops");
                assert!(!c.is_empty(), "{name}");
            }
            let flat: Vec<RcId> = chunks.concat();
            assert_eq!(flat, ids, "{name}: every object once, in order");
        }
        assert_eq!(
            chunks_by_ops(&ids, |_| 2, MAX_TXN_OPS).len(),
            4,
            "32 per chunk"
        );
        assert!(chunks_by_ops(&[], |_| 2, MAX_TXN_OPS).is_empty());
    }

    struct TestKind;

    impl Kind for TestKind {
        type State = ();
        const NOUN: &'static str = "test object";
        const PLURAL: &'static str = "test objects";
        fn lock_key(id: RcId) -> String {
            format!("lock/test/{id}")
        }
        fn claimed_record(&self, id: RcId, _: &Session) -> AuditRecord {
            AuditRecord::new("TEST_CLAIMED", serde_json::json!({"id": id}))
        }
        fn released_record(&self, id: RcId, _: &Session, _: &str) -> AuditRecord {
            AuditRecord::new("TEST_RELEASED", serde_json::json!({"id": id}))
        }
        fn deleted() {}
        fn forget(&self, _: RcId) {}
    }

    use crate::testing::two_sessions;

    /// Farm `f`, claiming without a grace period.
    fn test_farm<'a>(consul: &'a Consul, session: &'a Session) -> ClaimFarm<'a> {
        ClaimFarm {
            consul,
            session,
            farm_id: "f",
            clock: Clock::system(),
            rules: Rules {
                grace: Duration::ZERO,
                slack: 0,
            },
        }
    }

    /// Takes `id`'s lock for `session`; returns the lock's key.
    async fn hold(consul: &Consul, session: &Session, id: RcId) -> String {
        let key = TestKind::lock_key(id);
        let got = consul.kv_acquire(&key, b"x", session.id(), None).await;
        assert!(got.unwrap(), "{key} taken");
        key
    }

    /// A claim refused because another session held the lock stands until a read of the lock
    /// tree sent after the refusal, and that read is asked for: when the holder lets go and
    /// nothing else changes, the object is claimed (a regression: the refusal waited for a
    /// read answered after it, and an on-demand tree that did not change was never read, so a
    /// SIGTERM handover stalled).
    #[tokio::test]
    async fn a_refused_claim_asks_for_a_read_and_claims_once_the_holder_lets_go() {
        use crate::consul::WatchConfig;
        let (_server, consul, ours, theirs) = two_sessions().await;
        let id = RcId::new();
        let key = hold(&consul, &theirs, id).await;
        // Read only when asked (the idle read is far away).
        let demand = Demand::new(Duration::from_secs(3600));
        let watch = consul.watch_prefix(
            "lock/test/",
            WatchConfig::default().on_demand(demand.clone()),
        );
        let mut rx = watch.subscribe();
        while rx.borrow_and_update().is_none() {
            rx.changed().await.unwrap();
        }
        let farm = test_farm(&consul, &ours);
        let all: BTreeSet<RcId> = [id].into();
        let assignment = Assignment {
            owner: [(id, "f".into())].into(),
            cap: [("f".to_string(), 1)].into(),
        };
        let cancel = tokio_util::sync::CancellationToken::new();
        let mut owned = Owned::new(TestKind);
        let reconcile = async |owned: &mut Owned<TestKind>| {
            // As the farm builds it: the holders from an older read (the other session's
            // claim not in it yet), read "now" as far as the last answer goes.
            let view = ClaimView {
                all: &all,
                matching: &all,
                assignment: &assignment,
                holders: &BTreeMap::new(),
                held: None,
                lock_index: 1,
                locks_read_at: demand.answered_at().unwrap(),
                lock_reads: Some(&demand),
                listing_index: 1,
                guard: &|_| None,
            };
            owned
                .reconcile(
                    &farm,
                    &view,
                    |id| crate::task::spawn(id, (), &cancel, |_| async {}),
                    |_| None,
                )
                .await
        };
        assert!(reconcile(&mut owned).await.is_empty(), "refused");
        assert_eq!(owned.refused().count(), 1);
        // Still held: the read the refusal asked for shows it, and the claim is not retried
        // before then.
        assert!(reconcile(&mut owned).await.is_empty());
        assert!(consul.release_lock(&key, theirs.id()).await.unwrap());
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if reconcile(&mut owned).await == vec![id] {
                break;
            }
            assert!(Instant::now() < deadline, "never claimed once free");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// One object held by our session and assigned to another farm, `g`, seen through a view
    /// (never read again) that shows our lock.
    struct AssignedAway {
        id: RcId,
        all: BTreeSet<RcId>,
        assignment: Assignment,
        holders: BTreeMap<RcId, Arc<str>>,
    }

    impl AssignedAway {
        /// A server, a client, our session, the object's lock key (held by our session).
        async fn start() -> (
            crate::server::EmbeddedServer,
            Consul,
            Session,
            String,
            AssignedAway,
        ) {
            let (server, consul, ours, _) = two_sessions().await;
            let id = RcId::new();
            let key = hold(&consul, &ours, id).await;
            let away = AssignedAway::new(id, &ours);
            (server, consul, ours, key, away)
        }

        fn new(id: RcId, ours: &Session) -> Self {
            AssignedAway {
                id,
                all: [id].into(),
                assignment: Assignment {
                    owner: [(id, "g".into())].into(),
                    cap: [("f".to_string(), 0), ("g".to_string(), 1)].into(),
                },
                holders: [(id, Arc::from(ours.id().as_str()))].into(),
            }
        }

        fn view(&self) -> ClaimView<'_> {
            ClaimView {
                all: &self.all,
                matching: &self.all,
                assignment: &self.assignment,
                holders: &self.holders,
                held: None,
                lock_index: 5,
                locks_read_at: Instant::now(),
                lock_reads: None,
                listing_index: 1,
                guard: &|_| None,
            }
        }
    }

    /// What a farm handed over is not its own again because its view, read before the
    /// release, still shows its lock (a regression: every tick started the object's task from
    /// the stale view and handed it over again, for as long as the tree was not read).
    #[tokio::test]
    async fn a_handed_over_object_is_not_restarted_from_a_view_read_before_the_release() {
        use crate::consul::QueryOptions;
        let (_server, consul, ours, key, away) = AssignedAway::start().await;
        let farm = test_farm(&consul, &ours);
        let cancel = tokio_util::sync::CancellationToken::new();
        let spawned = std::cell::Cell::new(0);
        let mut owned = Owned::new(TestKind);
        for _ in 0..3 {
            let view = away.view();
            owned
                .reconcile(
                    &farm,
                    &view,
                    |id| {
                        spawned.set(spawned.get() + 1);
                        // A task whose first pass is done at once (one on its first pass is
                        // handed over after it).
                        crate::task::spawn(id, (), &cancel, |inbox| async move {
                            inbox
                                .passed
                                .store(true, std::sync::atomic::Ordering::Release);
                            inbox.cancel.cancelled().await
                        })
                    },
                    |_| None,
                )
                .await;
            tokio::task::yield_now().await;
        }
        assert_eq!(
            spawned.get(),
            1,
            "started once (held after a restart), then handed over"
        );
        assert!(owned.tasks.is_empty());
        let (e, _) = consul.kv_get(&key, &QueryOptions::default()).await.unwrap();
        assert!(e.is_none(), "given back");
    }

    /// A kind whose pre-release write succeeds only once `ready`: it counts its calls and
    /// whether the objects' tasks were still running at each.
    #[derive(Default)]
    struct Gated {
        ready: std::sync::atomic::AtomicBool,
        calls: std::sync::atomic::AtomicUsize,
        running: std::sync::Arc<std::sync::atomic::AtomicBool>,
        running_at_calls: std::sync::atomic::AtomicBool,
    }

    impl Kind for Gated {
        type State = ();
        const NOUN: &'static str = "test object";
        const PLURAL: &'static str = "test objects";
        fn lock_key(id: RcId) -> String {
            TestKind::lock_key(id)
        }
        fn claimed_record(&self, id: RcId, s: &Session) -> AuditRecord {
            TestKind.claimed_record(id, s)
        }
        fn released_record(&self, id: RcId, s: &Session, r: &str) -> AuditRecord {
            TestKind.released_record(id, s, r)
        }
        fn deleted() {}
        fn forget(&self, _: RcId) {}
        fn before_release(
            &self,
            _: &ClaimFarm<'_>,
            _: &[RcId],
            _: bool,
        ) -> impl Future<Output = bool> + Send {
            use std::sync::atomic::Ordering::SeqCst;
            self.calls.fetch_add(1, SeqCst);
            self.running_at_calls
                .fetch_or(self.running.load(SeqCst), SeqCst);
            let ready = self.ready.load(SeqCst);
            async move { ready }
        }
    }

    /// A handover whose pre-release write cannot be made now (the removal window's smaller
    /// count: `Failsafe::report_before_release` answering `Later`) keeps the object, its task
    /// and its lock, and asks to be looked at again soon; once the write goes through, the
    /// object is handed over. The write is made while the task still runs (a regression: the
    /// tasks were stopped first and the release went on without the write, so the taker's
    /// count and ours were both in the window key).
    #[tokio::test]
    async fn a_handover_waits_for_the_write_before_its_release() {
        use crate::consul::QueryOptions;
        use std::sync::atomic::Ordering::SeqCst;
        let (_server, consul, ours, key, away) = AssignedAway::start().await;
        let id = away.id;
        let farm = test_farm(&consul, &ours);
        let cancel = tokio_util::sync::CancellationToken::new();
        let mut owned = Owned::new(Gated::default());
        let running = owned.kind.running.clone();
        let holder = async || {
            let (e, _) = consul.kv_get(&key, &QueryOptions::default()).await.unwrap();
            e.and_then(|e| e.session)
        };
        for round in 0..6 {
            if round == 3 {
                assert!(owned.kind.calls.load(SeqCst) > 0, "a handover was tried");
                assert!(owned.tasks.contains_key(&id), "the task still runs");
                assert!(running.load(SeqCst));
                assert!(owned.recheck_at().is_some(), "looked at again soon");
                assert_eq!(holder().await.as_deref(), Some(ours.id().as_str()));
                owned.kind.ready.store(true, SeqCst);
            }
            let view = away.view();
            let (running, cancel) = (running.clone(), &cancel);
            owned
                .reconcile(
                    &farm,
                    &view,
                    move |id| {
                        let running = running.clone();
                        crate::task::spawn(id, (), cancel, |inbox| async move {
                            running.store(true, SeqCst);
                            inbox.passed.store(true, SeqCst);
                            inbox.cancel.cancelled().await;
                            running.store(false, SeqCst);
                        })
                    },
                    |_| None,
                )
                .await;
            tokio::task::yield_now().await;
        }
        assert!(owned.tasks.is_empty(), "handed over once the write went");
        assert!(!running.load(SeqCst), "its task stopped");
        assert!(
            owned.kind.running_at_calls.load(SeqCst),
            "the write is made while the task runs"
        );
        assert_eq!(holder().await, None, "given back");
    }

    /// A batched release refused because one lock was taken meanwhile gives the others back
    /// one by one, each with its record (a regression: the one-by-one fallback wrote none).
    #[tokio::test]
    async fn a_failed_batched_release_gives_the_rest_back_with_their_records() {
        use crate::consul::QueryOptions;
        let (_server, consul, ours, theirs) = two_sessions().await;
        let ids: Vec<RcId> = (0..3).map(|_| RcId::new()).collect();
        for id in &ids {
            let key = TestKind::lock_key(*id);
            assert!(
                consul
                    .kv_acquire(&key, b"x", ours.id(), None)
                    .await
                    .unwrap()
            );
        }
        // Another session has the second one now (ours was lost and taken over).
        let stolen = TestKind::lock_key(ids[1]);
        assert!(consul.release_lock(&stolen, ours.id()).await.unwrap());
        assert!(
            consul
                .kv_acquire(&stolen, b"y", theirs.id(), None)
                .await
                .unwrap()
        );

        let farm = test_farm(&consul, &ours);
        farm.release(&TestKind, &ids, "test").await;

        let holder = |key: String| {
            let consul = consul.clone();
            async move {
                let (e, _) = consul.kv_get(&key, &QueryOptions::default()).await.unwrap();
                e.and_then(|e| e.session)
            }
        };
        assert_eq!(holder(TestKind::lock_key(ids[0])).await, None);
        assert_eq!(holder(TestKind::lock_key(ids[2])).await, None);
        assert_eq!(holder(stolen).await.as_deref(), Some(theirs.id().as_str()));
        let (records, _) = consul
            .kv_list(crate::audit::AUDIT_PREFIX, &QueryOptions::default())
            .await
            .unwrap();
        let released: BTreeSet<String> = records
            .iter()
            .filter_map(|r| {
                let v: serde_json::Value = serde_json::from_slice(r.value_bytes()).ok()?;
                (v["event_type"] == "TEST_RELEASED")
                    .then(|| v["event_details"]["id"].as_str().map(str::to_string))?
            })
            .collect();
        assert_eq!(
            released,
            [ids[0].to_string(), ids[2].to_string()].into(),
            "{records:?}"
        );
    }
}

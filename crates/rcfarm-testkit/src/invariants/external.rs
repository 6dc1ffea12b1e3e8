//! An observer that works from outside, for a Consul without a commit log (a real agent or
//! cluster): one blocking query on the whole KV store keeps a history of every RC's record,
//! lock holder, pods and intents, and checks, at every snapshot, what can be checked from
//! there: never more pods than desired (+1 while a transfer is in flight). It also collects the
//! id of every audit record it saw in the outbox (for "every audit record in SQL, once") and
//! counts how often RCs changed hands.
//!
//! A blocking query returns the store as it is when it answers: changes in between are
//! coalesced, so a transient excess lasting less than one round trip can be missed. The
//! commit-log [`super::Observer`] of the embedded server sees every commit.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde_json::Value;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::Violation;
use crate::audit::{AUDIT_PREFIX, AuditRecord, events};
use crate::consul::{Consul, KvPair, QueryOptions};
use crate::labels::parse_labels;
use crate::rc::{RC_ID_LABEL, RC_LOCK_PREFIX, RC_PREFIX};

/// What the observer found.
#[derive(Debug, Clone, Default)]
pub struct ExternalReport {
    pub snapshots: u64,
    pub violations: Vec<Violation>,
    /// Ids of every audit record seen in `audit_logs/`.
    pub audit_ids: BTreeSet<String>,
    /// Audit records last seen before the store was restored from a backup that did not hold
    /// them: unless they were shipped before, the restore took them (SQL keeps what happened,
    /// Consul what is now), and a record not in SQL among these is lost to the restore, not
    /// by a farm.
    pub audit_restored_away: BTreeSet<String>,
    /// Restores of the store from a backup, as told by the run.
    pub restores: u64,
    /// Ids of the `RC_RETARGET` records among them.
    pub retarget_ids: BTreeSet<String>,
    /// Times an RC's ownership lock went from one session to another (through a gap or not).
    pub handovers: u64,
    /// Read errors (Consul unreachable, an election): the history has gaps there.
    pub errors: u64,
    /// The last read error, to say why a history is empty.
    pub last_error: Option<String>,
    /// Rolling update → the fewest pods of its two RCs seen up at once after it started.
    pub roll_lowest_up: BTreeMap<String, usize>,
    /// Answers older than one already observed (a server that had not caught up, or a leader
    /// not yet deposed, answering), held back rather than compared with what came before.
    pub stale_snapshots: u64,
    /// Pod writes (intent and label, one commit) found made while their RC's lock was held by
    /// a session the store had at that commit.
    pub pod_writes_under_lock: u64,
    /// Pod writes whose commit fell in a stretch where the snapshots do not say what their
    /// RC's lock was (it changed between two of them).
    pub pod_writes_unplaced: u64,
    /// Removals charged to the cluster's removal window (`rcfarm/removals/window`), summed
    /// over the snapshots' increases of its buckets.
    pub window_charged: u64,
    /// The most the key held within its window at any snapshot, and the limit it said then.
    pub window_most: u64,
    pub window_limit: Option<u64>,
}

#[derive(Default)]
struct State {
    report: ExternalReport,
    /// RC → pods last seen.
    pods: BTreeMap<String, usize>,
    /// RC → replicas desired last seen.
    desired: BTreeMap<String, i64>,
    /// RC → last session seen holding its ownership lock.
    owner: BTreeMap<String, String>,
    /// RC → what its ownership lock was over stretches of the store's history, oldest first.
    locks: BTreeMap<String, Vec<LockSpan>>,
    /// Pod label → the ModifyIndex at which its write was last checked against its RC's lock.
    pod_writes_checked: BTreeMap<String, u64>,
    /// The window key as last seen.
    window: Option<crate::budget::Window>,
    /// The store went back in time: the next snapshot is a new baseline, not compared with
    /// the last one from before (a restored store may hold more pods than the store had just
    /// before the restore, as the backup held them: removals held by the failsafe, say).
    baseline_next: bool,
}

/// Over `from..=to` (Consul indexes), an RC's ownership lock was held by `holder` (`None`:
/// free). Known from a snapshot at index `to` whose lock key, last modified at `from`, said
/// so: nothing changed the key in between. Consul releases a session's locks in the same
/// commit that invalidates it, so a lock a snapshot shows held is held by a live session.
#[derive(Debug, Clone, PartialEq)]
struct LockSpan {
    from: u64,
    to: u64,
    holder: Option<String>,
}

impl State {
    /// The store went back in time (a restore): indexes are reused, histories start over.
    fn store_went_back(&mut self) {
        self.locks.clear();
        self.pod_writes_checked.clear();
        self.baseline_next = true;
    }

    /// Records what each RC's lock was up to `index`.
    fn note_locks(&mut self, index: u64, locks: &BTreeMap<&str, (Option<String>, u64)>) {
        for (rc, (holder, from)) in locks {
            let spans = self.locks.entry(rc.to_string()).or_default();
            match spans.last_mut() {
                Some(last) if last.from == *from && last.holder == *holder => {
                    last.to = last.to.max(index);
                }
                _ => spans.push(LockSpan {
                    from: *from,
                    to: index,
                    holder: holder.clone(),
                }),
            }
        }
    }

    /// Checks a pod write (its label, written in one commit with its intent, names its RC)
    /// against what its RC's lock was at that commit: held by a live session (checked), free
    /// (a broken promise: a write from a session the store no longer had), or not known (the
    /// commit fell between two snapshots that saw the lock change).
    fn check_pod_write(&mut self, index: u64, label: &str, rc: &str, written_at: u64) {
        if self.pod_writes_checked.get(label) == Some(&written_at) {
            return;
        }
        self.pod_writes_checked
            .insert(label.to_string(), written_at);
        let span = self.locks.get(rc).and_then(|spans| {
            spans
                .iter()
                .rev()
                .find(|s| (s.from..=s.to).contains(&written_at))
        });
        match span {
            Some(LockSpan {
                holder: Some(_), ..
            }) => self.report.pod_writes_under_lock += 1,
            Some(LockSpan { from, to, .. }) => self.report.violations.push(Violation {
                index,
                what: format!(
                    "pod {label} of {rc} written at index {written_at}, while its RC's lock was free (indexes {from} to {to}): written from a session the store no longer had"
                ),
            }),
            None => self.report.pod_writes_unplaced += 1,
        }
    }
}

/// How long answers older than one observed are held back before the observer takes the
/// store as gone back in time.
const STALE_GRACE: Duration = Duration::from_secs(5);

/// A running observer; [`ExternalObserver::finish`] stops it and reports.
pub struct ExternalObserver {
    state: Arc<Mutex<State>>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl ExternalObserver {
    pub fn spawn(consul: Consul) -> ExternalObserver {
        let state = Arc::new(Mutex::new(State::default()));
        let stop = CancellationToken::new();
        let (st, token) = (state.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let mut index = 0;
            // The highest index observed, and since when answers have been older than it.
            let mut observed = 0;
            let mut regressed_since: Option<tokio::time::Instant> = None;
            loop {
                // Consistent: the leader checks it still leads before answering, so a leader
                // cut off from the others (a partition) cannot answer with the past. A snapshot
                // from the past, compared with the present, reads as pods that came and went.
                let q = QueryOptions {
                    consistent: true,
                    ..QueryOptions::blocking(index, Duration::from_secs(5))
                };
                let restores = st.lock().report.restores;
                let read = tokio::select! {
                    _ = token.cancelled() => return,
                    r = consul.kv_list("", &q) => r,
                };
                if st.lock().report.restores != restores {
                    // The store was restored while this read was out: its answer may be from
                    // before, and what comes next starts from the backup's (lower) index.
                    index = 0;
                    observed = 0;
                    regressed_since = None;
                    continue;
                }
                match read {
                    Ok((entries, meta)) => {
                        if meta.index < observed {
                            // Older than what was seen: held back for a while; past that, the
                            // store really went back (restored or emptied) and starts over.
                            let since =
                                *regressed_since.get_or_insert_with(tokio::time::Instant::now);
                            if since.elapsed() < STALE_GRACE {
                                st.lock().report.stale_snapshots += 1;
                                index = 0;
                                tokio::select! {
                                    _ = token.cancelled() => return,
                                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                                }
                                continue;
                            }
                        }
                        if meta.index < observed {
                            st.lock().store_went_back();
                        }
                        regressed_since = None;
                        observed = meta.index;
                        index = meta.index;
                        st.lock().observe(meta.index, &entries);
                    }
                    Err(e) => {
                        {
                            let mut st = st.lock();
                            st.report.errors += 1;
                            st.report.last_error = Some(e.to_string());
                        }
                        index = 0;
                        tokio::select! {
                            _ = token.cancelled() => return,
                            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                        }
                    }
                }
            }
        });
        ExternalObserver { state, stop, task }
    }

    /// The run restored the store from a backup (called while every server is down, so no
    /// answer after it is from before the restore).
    pub fn store_restored(&self) {
        let mut st = self.state.lock();
        let seen = st.report.audit_ids.clone();
        st.report.audit_restored_away.extend(seen);
        st.report.restores += 1;
        st.store_went_back();
    }

    /// What it found so far.
    pub fn report(&self) -> ExternalReport {
        self.state.lock().report.clone()
    }

    /// Stops watching; what it found.
    pub async fn finish(self) -> ExternalReport {
        self.stop.cancel();
        let _ = self.task.await;
        self.state.lock().report.clone()
    }
}

impl State {
    /// The cluster's removal window in a snapshot: what it was charged since the last one,
    /// and whether it ever holds more within its window than the limit its charges were made
    /// under (the farms' `cas` makes that impossible; a farm of another release that does not
    /// charge it is not seen here).
    fn observe_window(&mut self, index: u64, value: &[u8]) {
        let Ok(w) = crate::budget::Window::parse(value) else {
            self.report.violations.push(Violation {
                index,
                what: "the removal window key is unreadable".into(),
            });
            return;
        };
        let last = self.window.take().unwrap_or_default();
        // After a release, everything the key holds was charged since it.
        let since = if w.released == last.released {
            last
        } else {
            crate::budget::Window::default()
        };
        self.report.window_charged += w.charged_since(&since);
        if let Some(st) = w.recorded_settings() {
            // Judged at the newest charge's bucket: the key as its last writer saw it.
            let at = w.buckets.last().map_or(0, |b| b.0);
            let spent = w.spent(st, at);
            self.report.window_most = self.report.window_most.max(spent);
            self.report.window_limit = self.report.window_limit.max(w.limit);
            if let Some(limit) = w.limit
                && spent > limit
            {
                self.report.violations.push(Violation {
                    index,
                    what: format!(
                        "the removal window key holds {spent} removals within its window, above the limit of {limit} its charges were made under"
                    ),
                });
            }
        }
        self.window = Some(w);
    }

    fn observe(&mut self, index: u64, entries: &[KvPair]) {
        self.report.snapshots += 1;
        let mut desired: BTreeMap<&str, i64> = BTreeMap::new();
        // Each RC record's ModifyIndex, and each intent's.
        let mut rc_index: BTreeMap<&str, u64> = BTreeMap::new();
        let mut intents: BTreeMap<&str, u64> = BTreeMap::new();
        let mut transfers: BTreeSet<&str> = BTreeSet::new();
        let mut owners: BTreeMap<String, String> = BTreeMap::new();
        let mut locks: BTreeMap<&str, (Option<String>, u64)> = BTreeMap::new();
        let mut labels: Vec<(&str, &KvPair)> = Vec::new();
        for e in entries {
            let k = e.key.as_str();
            if let Some(id) = k.strip_prefix(RC_PREFIX) {
                let n = serde_json::from_slice::<Value>(e.value_bytes())
                    .ok()
                    .and_then(|v| v["replicas_desired"].as_i64())
                    .unwrap_or(0);
                desired.insert(id, n);
                rc_index.insert(id, e.modify_index);
            } else if let Some(rest) = k.strip_prefix("intent/") {
                intents.insert(rest, e.modify_index);
            } else if let Some(rest) = k.strip_prefix("labels/pod/") {
                labels.push((rest, e));
            } else if let Some(rest) = k.strip_prefix("status/replication_controllers/") {
                // A transfer is in flight while P2's status key says so; rcfarm's own key
                // beside it only records starts (a previous release leaves it behind).
                if let Some(id) = rest.strip_suffix("/replication_controller") {
                    transfers.insert(id);
                }
            } else if let Some(id) = k.strip_prefix(RC_LOCK_PREFIX) {
                if !id.contains('/') {
                    if let Some(s) = &e.session {
                        owners.insert(id.to_string(), s.clone());
                    }
                    locks.insert(id, (e.session.clone(), e.modify_index));
                }
            } else if k == crate::budget::BUDGET_KEY {
                self.observe_window(index, e.value_bytes());
            } else if let Some(id) = k.strip_prefix(AUDIT_PREFIX) {
                if !self.report.audit_restored_away.is_empty() {
                    self.report.audit_restored_away.remove(id);
                }
                if self.report.audit_ids.insert(id.to_string())
                    && AuditRecord::from_kv(k, e.value_bytes())
                        .is_ok_and(|r| r.event_type == events::RC_RETARGET)
                {
                    self.report.retarget_ids.insert(id.to_string());
                }
            }
        }
        let mut pods: BTreeMap<String, usize> = BTreeMap::new();
        // Per RC, the latest write to any of its pods (intent or label).
        let mut newest_pod_write: BTreeMap<String, u64> = BTreeMap::new();
        self.note_locks(index, &locks);
        for (node_pod, e) in labels {
            let Some(intent_index) = intents.get(node_pod) else {
                continue;
            };
            if let Some(rc) = parse_labels(e.value_bytes())
                .ok()
                .and_then(|l| l.get(RC_ID_LABEL).cloned())
            {
                self.check_pod_write(index, node_pod, &rc, e.modify_index);
                let w = newest_pod_write.entry(rc.clone()).or_default();
                *w = (*w).max(*intent_index).max(e.modify_index);
                *pods.entry(rc).or_default() += 1;
            }
        }
        for (rc, n) in &pods {
            // Between two snapshots a farm may add a pod under the replica count it read (its
            // write checks the RC's index) and an operator may then lower that count: judge
            // the rise by the higher of the two counts seen. (Seen with partitions: a
            // transfer's start at 2 replicas, then a scale to 0, in one gap: "rose to 3 pods".)
            let wanted = desired
                .get(rc.as_str())
                .copied()
                .unwrap_or(0)
                .max(self.desired.get(rc.as_str()).copied().unwrap_or(0));
            let limit = wanted.max(0) as usize + usize::from(transfers.contains(rc.as_str()));
            let before = self.pods.get(rc).copied().unwrap_or(0);
            // Farms write pods under a check of the RC record's index: a pod written before the
            // record's current version was planned under an earlier count (which a gap between
            // snapshots can hide: 0, then 1 and a pod, then 0 again), and is the farm's to
            // remove, not a broken promise. One written since is judged by the current count.
            let written_under_this_version = newest_pod_write
                .get(rc.as_str())
                .zip(rc_index.get(rc.as_str()))
                .is_some_and(|(pod, record)| pod > record);
            if *n > limit
                && !self.baseline_next
                && *n > before
                && desired.contains_key(rc.as_str())
                && written_under_this_version
            {
                self.report.violations.push(Violation {
                    index,
                    what: format!("{rc} rose to {n} pods, desired {}", limit),
                });
            }
        }
        // The rolls, judged by the commit-log observer's own rules on this snapshot.
        let mut replica = super::Observer::default();
        for e in entries {
            replica.set(&e.key, Some((e.value_bytes(), e.session.as_ref())));
        }
        for (id, roll) in replica.started_rolls() {
            let up = replica.up(&roll);
            let lowest = self.report.roll_lowest_up.entry(id).or_insert(up);
            *lowest = (*lowest).min(up);
        }
        for (rc, s) in &owners {
            if self.owner.get(rc).is_some_and(|old| old != s) {
                self.report.handovers += 1;
            }
            self.owner.insert(rc.clone(), s.clone());
        }
        self.baseline_next = false;
        self.pods = pods;
        self.desired = desired
            .into_iter()
            .map(|(id, n)| (id.to_string(), n))
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(key: &str, value: &str, modify_index: u64) -> KvPair {
        KvPair {
            key: key.to_string(),
            value: Some(value.as_bytes().to_vec()),
            modify_index,
            ..Default::default()
        }
    }

    fn rc(desired: i64, index: u64) -> KvPair {
        kv(
            "replication_controllers/r",
            &format!(r#"{{"replicas_desired": {desired}}}"#),
            index,
        )
    }

    fn pod(node: &str, index: u64) -> [KvPair; 2] {
        [
            kv(&format!("intent/{node}/web"), "id: web", index),
            kv(
                &format!("labels/pod/{node}/web"),
                r#"{"replication_controller_id": "r"}"#,
                index,
            ),
        ]
    }

    fn lock(session: Option<&str>, index: u64) -> KvPair {
        KvPair {
            key: format!("{RC_LOCK_PREFIX}r"),
            session: session.map(str::to_string),
            modify_index: index,
            ..Default::default()
        }
    }

    /// A pod written while its RC's lock was held is checked; one written while the lock was
    /// free is a broken promise; one whose commit fell where the snapshots do not tell is
    /// only counted.
    #[test]
    fn pod_writes_are_judged_by_what_the_lock_was_at_their_commit() {
        let mut st = State::default();
        // Held by S from 5; a pod written at 8 (seen at 10).
        let mut snap = vec![rc(2, 3), lock(Some("S"), 5)];
        snap.extend(pod("n1", 8));
        st.observe(10, &snap);
        assert_eq!(st.report.pod_writes_under_lock, 1);
        // Free from 12 (S gone); seen at 20, with a pod written at 15: under no lock.
        let mut snap = vec![rc(2, 3), lock(None, 12)];
        snap.extend(pod("n1", 8));
        snap.extend(pod("n2", 15));
        st.observe(20, &snap);
        assert_eq!(st.report.violations.len(), 1, "{:?}", st.report.violations);
        assert!(st.report.violations[0].what.contains("lock was free"));
        // Held by T from 30; a pod written at 25, between the snapshots at 20 and 31: not
        // known, counted.
        let mut snap = vec![rc(2, 3), lock(Some("T"), 30)];
        snap.extend(pod("n3", 25));
        st.observe(31, &snap);
        assert_eq!(st.report.pod_writes_unplaced, 1);
        assert_eq!(st.report.violations.len(), 1);
        // Each write is checked once.
        st.observe(32, &snap);
        assert_eq!(st.report.pod_writes_under_lock, 1);
        assert_eq!(st.report.pod_writes_unplaced, 1);
    }

    /// Across a restore the counts start over: the restored store's pods are what the backup
    /// held, not a rise since the last snapshot; a rise after it is judged again.
    #[test]
    fn a_restored_store_is_a_new_baseline() {
        let mut st = State::default();
        let mut snap = vec![rc(2, 10)];
        snap.extend(pod("n1", 11));
        snap.extend(pod("n2", 12));
        st.observe(20, &snap);
        st.store_went_back();
        // The backup: 4 pods under a count of 2 (removals held), one rewritten since the
        // record (a repair).
        let mut restored = vec![rc(2, 5)];
        for (i, n) in ["n1", "n2", "n3", "n4"].iter().enumerate() {
            restored.extend(pod(n, 6 + i as u64));
        }
        st.observe(9, &restored);
        assert!(
            st.report.violations.is_empty(),
            "{:?}",
            st.report.violations
        );
        restored.extend(pod("n5", 12));
        st.observe(12, &restored);
        assert_eq!(st.report.violations.len(), 1, "{:?}", st.report.violations);
    }

    /// A pod above the count is a broken promise only when it was written under the RC
    /// record's current version: one written under an earlier count that a gap between two
    /// snapshots hid (0, then 1 and a pod, then 0 again) is the farm's to remove.
    #[test]
    fn a_rise_is_judged_by_the_count_the_pod_was_written_under() {
        let mut st = State::default();
        st.observe(10, &[rc(0, 10)]);
        let mut snap = vec![rc(0, 20)];
        snap.extend(pod("n1", 15));
        st.observe(20, &snap);
        assert!(
            st.report.violations.is_empty(),
            "{:?}",
            st.report.violations
        );
        snap.extend(pod("n2", 25));
        st.observe(25, &snap);
        assert_eq!(st.report.violations.len(), 1, "{:?}", st.report.violations);
        assert!(st.report.violations[0].what.contains("rose to 2 pods"));
    }
}

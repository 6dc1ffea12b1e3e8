//! The shipper: moves audit records from the Consul outbox (`audit_logs/`) into SQL.
//!
//! One farm at a time ships: it holds `rcfarm/audit-shipper` under its session, and another
//! takes over when that session dies. For each batch: read the records, insert them into SQL
//! (a record already there, by uuid, is skipped), then delete them from Consul with
//! `delete-cas` in transactions fenced by the shipper lock. A crash between the two steps
//! re-ships the batch, and the insert stores nothing twice; nothing is deleted before it is
//! stored. Records that do not parse go to a dead-letter table, verbatim.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio_util::sync::CancellationToken;

use super::pace::{AuditPace, BACKLOG_KEY, Backlog, worth_publishing};
use super::record::{AUDIT_PREFIX, AuditRecord};
use super::store::AuditStore;
use crate::clock::Clock;
use crate::consul::{
    Consul, ConsulError, Fence, FenceError, FencedTxn, KvPair, MAX_TXN_OPS, QueryOptions,
    SessionId, TxnOp,
};
use crate::util::Backoff;

pub const SHIPPER_LOCK: &str = "rcfarm/audit-shipper";

/// Set to make the process abort right after a batch is stored in SQL and before it is deleted
/// from Consul (crash tests).
pub const FAILPOINT_ENV: &str = "RCFARM_FAILPOINT_AFTER_AUDIT_INSERT";

#[derive(Debug, Clone)]
pub struct ShipperConfig {
    /// Records per SQL transaction. Large, because the log's indexes by id, RC, pod and node
    /// are random inserts: a batch writes about one page per record per index until it is big
    /// enough to touch the same pages twice (SQLite, 300,000 records over 200,000 RCs: 10,000
    /// a batch stored 1.7x as many a second as 2,000).
    pub batch: usize,
    /// Records shipped between two listings of a long outbox, at least (see [`pass_size`]).
    pub pass: usize,
    /// Listed records a prefix read covers, at most (see [`Group`]).
    pub group: usize,
    /// The `wait` of the blocking query on the outbox.
    pub wait: Duration,
}

/// A record stored in SQL, to delete from the outbox at the index it was read at (its value
/// is not kept: three batches are in the pipeline at once).
struct Stored {
    key: String,
    modify_index: u64,
}

/// Records how long one stage of shipping took: `list` (the outbox's keys, when listed without
/// blocking), `read`, `store` and `delete` (one batch each). The sums tell an operator, and
/// `bench farm`, which stage a slow outbox waits on.
fn stage_took(stage: &'static str, started: std::time::Instant, records: usize) {
    let took = started.elapsed();
    metrics::histogram!("rcfarm_audit_ship_stage_seconds", "stage" => stage)
        .record(took.as_secs_f64());
    tracing::debug!(
        stage,
        records,
        took_ms = took.as_millis() as u64,
        "audit shipping stage"
    );
}

/// Consul requests a shipper stage sends at once (the prefix reads of one batch, the delete
/// transactions of another).
const REQUESTS_IN_FLIGHT: usize = 4;

/// Runs `jobs` at most `n` at a time and collects their outputs (in the order they finish);
/// the first error stops the rest.
async fn in_flight<F, T, E>(jobs: impl Iterator<Item = F>, n: usize) -> Result<Vec<T>, E>
where
    F: std::future::Future<Output = Result<T, E>>,
{
    let mut pending = FuturesUnordered::new();
    let mut out = Vec::new();
    for job in jobs {
        if pending.len() >= n
            && let Some(done) = pending.next().await
        {
            out.push(done?);
        }
        pending.push(job);
    }
    while let Some(done) = pending.next().await {
        out.push(done?);
    }
    Ok(out)
}

/// Keys of the outbox that share a prefix, read with one `GET ?recurse` of that prefix.
///
/// Why not a transaction of gets per key: a transaction holds at most 64 operations, so a
/// batch of 10,000 records took 157 of them, each parsed, dispatched and answered op by op; at
/// a million pods reading was the shipper's slowest stage (133 s of a run's 305 s of stages).
/// A prefix read is one range of the store per group. The prefixes come from the listing, not
/// from the keys' format, so keys of any shape (P2's, dead letters) are read too.
#[derive(Debug, PartialEq, Eq)]
struct Group {
    prefix: String,
    /// Keys of the listing under `prefix` (a read may find more: records written since).
    listed: usize,
    /// Read the key `prefix` alone, not the tree under it: a listed key that other listed keys
    /// extend (`audit_logs/x` beside `audit_logs/xa`, or `audit_logs/` itself), whose tree
    /// would be more than a group.
    exact: bool,
}

/// Splits `keys` (sorted, distinct, each starting with their shared first `depth` bytes) into
/// groups whose prefixes cover at most `max` of them each, a prefix one character longer at a
/// time.
fn prefix_groups(keys: &[String], depth: usize, max: usize, out: &mut Vec<Group>) {
    let mut i = 0;
    while i < keys.len() {
        let first = &keys[i];
        let cut = (depth + 1..=first.len())
            .find(|&b| first.is_char_boundary(b))
            .unwrap_or(first.len());
        let prefix = &first[..cut];
        // Sorted: the keys under `prefix` are the run that starts at `i`.
        let run = keys[i..].partition_point(|k| k.starts_with(prefix));
        let group = &keys[i..i + run];
        if group.len() <= max {
            out.push(Group {
                prefix: prefix.to_string(),
                listed: group.len(),
                exact: false,
            });
        } else if cut < first.len() {
            prefix_groups(group, cut, max, out);
        } else {
            // `first` is the prefix itself (the shortest key of the run, and the only one that
            // can be): read it alone, and split the keys that extend it.
            out.push(Group {
                prefix: first.clone(),
                listed: 1,
                exact: true,
            });
            prefix_groups(&group[1..], cut, max, out);
        }
        i += run;
    }
}

/// How many of `groups`, from the first, hold `records` listed keys: whole groups, the last
/// one reaching the number (all of them if they hold fewer).
fn groups_for(groups: &[Group], records: usize) -> usize {
    let mut listed = 0;
    groups
        .iter()
        .position(|g| {
            listed += g.listed;
            listed >= records
        })
        .map_or(groups.len(), |i| i + 1)
}

/// The most records shipped between two listings of the outbox: at least `pass` (a few
/// seconds of shipping), and a quarter of a longer outbox, so that draining a big one lists it
/// a handful of times, not once per part.
fn pass_size(listed: usize, pass: usize) -> usize {
    (listed / 4).max(pass).max(1)
}

impl Default for ShipperConfig {
    fn default() -> Self {
        Self {
            batch: 10_000,
            pass: 50_000,
            // About half a mebibyte of records a read.
            group: 1_000,
            wait: Duration::from_secs(60),
        }
    }
}

/// What the shipper has done (for metrics and status).
#[derive(Debug, Default)]
pub struct ShipperStats {
    pub shipped: AtomicU64,
    pub dead_letters: AtomicU64,
    pub backlog: AtomicU64,
    /// Age in seconds of the oldest record waiting (0 when none).
    pub oldest_age_secs: AtomicU64,
    pub is_shipper: AtomicU64,
}

enum Acquire {
    Acquired,
    HeldElsewhere,
    /// Nobody holds it, but Consul refused (a lock-delay after its holder's session died).
    Refused,
}

#[derive(Debug, thiserror::Error)]
enum ShipError {
    #[error("lost the shipper lock")]
    Fenced,
    #[error(transparent)]
    Consul(#[from] ConsulError),
    #[error(transparent)]
    Store(#[from] super::store::AuditError),
    #[error("{0}")]
    Other(String),
}

pub struct Shipper {
    pub consul: Consul,
    pub store: Arc<AuditStore>,
    pub session: SessionId,
    pub farm_id: String,
    pub config: ShipperConfig,
    pub stats: Arc<ShipperStats>,
    pub clock: Clock,
    /// The farm's pace, told each count; the count is published for the other farms.
    pub pace: Arc<AuditPace>,
}

impl Shipper {
    /// A transaction fenced by the shipper lock: only its holder deletes from the outbox.
    fn fenced(&self) -> FencedTxn {
        FencedTxn::fenced(Fence::new(SHIPPER_LOCK, &self.session))
    }

    /// Runs until `cancel` (the farm stops or loses its session).
    pub async fn run(self, cancel: CancellationToken) {
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
        let mut lock_index = 0u64;
        loop {
            if cancel.is_cancelled() {
                break;
            }
            // Become the shipper, or wait for the lock to be free.
            let attempt = tokio::select! {
                _ = cancel.cancelled() => break,
                r = self.acquire(&mut lock_index) => r,
            };
            match attempt {
                Ok(Acquire::Acquired) => {}
                Ok(Acquire::HeldElsewhere) => continue,
                Ok(Acquire::Refused) => {
                    // Free but refused: the lock-delay after its holder died. Try again soon
                    // rather than block on a key that will not change.
                    lock_index = 0;
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        _ = tokio::time::sleep(crate::util::jitter_half(Duration::from_secs(1))) => continue,
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "audit shipper: cannot take the shipper lock");
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        _ = tokio::time::sleep(backoff.next_delay()) => continue,
                    }
                }
            }
            tracing::info!("this farm now ships the audit log to {}", self.store.url());
            self.stats.is_shipper.store(1, Ordering::Relaxed);
            metrics::gauge!("rcfarm_audit_shipper").set(1.0);
            let outcome = tokio::select! {
                _ = cancel.cancelled() => None,
                r = self.ship_forever(&mut backoff) => Some(r),
            };
            self.stats.is_shipper.store(0, Ordering::Relaxed);
            metrics::gauge!("rcfarm_audit_shipper").set(0.0);
            match outcome {
                None => break,
                Some(e) => tracing::warn!(error = %e, "audit shipper stopped; will try again"),
            }
        }
        // Give the lock back so another farm takes over at once.
        let _ = self
            .fenced()
            .op(TxnOp::delete(SHIPPER_LOCK))
            .op(TxnOp::delete(BACKLOG_KEY))
            .commit(&self.consul)
            .await;
    }

    /// Takes the shipper lock if it is free; while another session holds it, blocks until the
    /// lock key changes.
    async fn acquire(&self, index: &mut u64) -> Result<Acquire, ConsulError> {
        let (entry, meta) = self
            .consul
            .kv_get(
                SHIPPER_LOCK,
                &QueryOptions::blocking(*index, self.config.wait),
            )
            .await?;
        tracing::debug!(
            asked = *index,
            index = meta.index,
            holder = entry.as_ref().and_then(|e| e.session.as_deref()),
            exists = entry.is_some(),
            "shipper lock read"
        );
        *index = meta.index;
        match entry.and_then(|e| e.session) {
            Some(s) if s == self.session => Ok(Acquire::Acquired),
            Some(_) => Ok(Acquire::HeldElsewhere),
            None => Ok(
                if self
                    .consul
                    .kv_acquire(SHIPPER_LOCK, self.farm_id.as_bytes(), &self.session, None)
                    .await?
                {
                    Acquire::Acquired
                } else {
                    Acquire::Refused
                },
            ),
        }
    }

    /// Ships whatever appears in the outbox until an error or the loss of the lock.
    async fn ship_forever(&self, backoff: &mut Backoff) -> ShipError {
        let mut index = 0u64;
        let mut published = None;
        let mut shipping = true;
        // The count at the listing before, to tell whether the outbox drains.
        let mut before: Option<u64> = None;
        loop {
            // A listing at index 0 answers at once: its time is the listing's own.
            let listed_at = (index == 0).then(std::time::Instant::now);
            let keys = self
                .consul
                .kv_keys(
                    AUDIT_PREFIX,
                    None,
                    &QueryOptions::blocking(index, self.config.wait),
                )
                .await;
            let (mut keys, meta) = match keys {
                Ok(k) => k,
                Err(e) => return e.into(),
            };
            if let Some(t) = listed_at {
                stage_took("list", t, keys.len());
            }
            if meta.index < index {
                index = 0;
            } else {
                index = meta.index;
            }
            let count = keys.len() as u64;
            let draining = shipping && before.is_some_and(|b| count < b);
            before = Some(count);
            self.stats.backlog.store(count, Ordering::Relaxed);
            metrics::gauge!("rcfarm_audit_backlog").set(count as f64);
            self.pace.set_backlog(count, draining);
            let now = (count, draining);
            if worth_publishing(published, now, self.pace.config().slow_at) {
                match self.publish(count, shipping, draining).await {
                    Ok(()) => published = Some(now),
                    Err(ShipError::Fenced) => return ShipError::Fenced,
                    Err(e) => tracing::debug!(error = %e, "cannot publish the outbox's size"),
                }
            }
            // A long listing is shipped a part at a time, listing again between parts, so that
            // the count the farms pace by stays a few seconds old at most.
            let part = pass_size(keys.len(), self.config.pass);
            keys.sort_unstable();
            let mut groups = Vec::new();
            prefix_groups(
                &keys,
                AUDIT_PREFIX.len(),
                self.config.group.max(1),
                &mut groups,
            );
            let whole = groups_for(&groups, part);
            let more = whole < groups.len();
            groups.truncate(whole);
            drop(keys);
            let failed = self.ship_pass(groups).await.err();
            shipping = failed.is_none();
            match failed {
                Some(ShipError::Fenced) => return ShipError::Fenced,
                Some(e) => {
                    let wait = backoff.next_delay();
                    tracing::warn!(error = %e, retry_in = ?wait, "audit shipping failed; records stay in Consul");
                    tokio::time::sleep(wait).await;
                    // Look again at once rather than block on the same index.
                    index = 0;
                }
                None => {
                    backoff.reset();
                    if more {
                        // Records are still there: list again at once.
                        index = 0;
                    } else {
                        self.stats.oldest_age_secs.store(0, Ordering::Relaxed);
                        metrics::gauge!("rcfarm_audit_backlog_oldest_seconds").set(0.0);
                    }
                }
            }
        }
    }

    /// Tells every farm how many records wait ([`BACKLOG_KEY`]), as the shipper.
    async fn publish(&self, records: u64, shipping: bool, draining: bool) -> Result<(), ShipError> {
        let backlog = Backlog {
            records,
            farm_id: self.farm_id.clone(),
            shipping,
            at: self.clock.wall(),
            draining,
        };
        let value = serde_json::to_vec(&backlog).map_err(|e| ShipError::Other(e.to_string()))?;
        match self
            .fenced()
            // Held by the shipper's session: a count dies with its counter, and never stays
            // behind, too high, for farms to pace by after another farm (of a release that
            // does not publish) drained the outbox.
            .op(TxnOp::lock(BACKLOG_KEY, value, &self.session))
            .commit(&self.consul)
            .await
        {
            Ok(_) => Ok(()),
            Err(FenceError::Fenced { .. }) => Err(ShipError::Fenced),
            Err(e) => Err(ShipError::Other(e.to_string())),
        }
    }

    /// Ships `keys` in batches, three stages at once: reading a batch from Consul, storing the
    /// one before in SQL, deleting the one before that from Consul. Each stage sends up to
    /// [`REQUESTS_IN_FLIGHT`] requests at once. A batch is deleted only after its SQL commit;
    /// the first error stops every stage, and what was not deleted stays for the next pass.
    async fn ship_pass(&self, groups: Vec<Group>) -> Result<(), ShipError> {
        let batch = self.config.batch.max(1);
        let (to_store, mut stored_rx) = tokio::sync::mpsc::channel::<Vec<KvPair>>(1);
        let (to_delete, mut delete_rx) = tokio::sync::mpsc::channel::<Vec<Stored>>(1);
        let read = async move {
            // Whole groups, about `batch` listed records a batch.
            let mut rest = &groups[..];
            while !rest.is_empty() {
                let (chunk, after) = rest.split_at(groups_for(rest, batch));
                rest = after;
                let t = std::time::Instant::now();
                let entries = self.read_batch(chunk).await?;
                stage_took("read", t, entries.len());
                if to_store.send(entries).await.is_err() {
                    break;
                }
            }
            Ok::<(), ShipError>(())
        };
        let store = async move {
            while let Some(entries) = stored_rx.recv().await {
                let t = std::time::Instant::now();
                let entries = self.store_batch(entries).await?;
                stage_took("store", t, entries.len());
                if to_delete.send(entries).await.is_err() {
                    break;
                }
            }
            Ok::<(), ShipError>(())
        };
        let delete = async move {
            while let Some(entries) = delete_rx.recv().await {
                let t = std::time::Instant::now();
                self.delete_batch(&entries).await?;
                stage_took("delete", t, entries.len());
            }
            Ok::<(), ShipError>(())
        };
        tokio::try_join!(read, store, delete).map(|_| ())
    }

    /// The records under `groups`' prefixes, [`REQUESTS_IN_FLIGHT`] reads at once. A default
    /// (not `consistent`) read is enough: records are written once and never change, a record
    /// too new to be seen is read at the next pass, and one already deleted is stored by its
    /// uuid no more than once and deleted again as absent.
    async fn read_batch(&self, groups: &[Group]) -> Result<Vec<KvPair>, ShipError> {
        let reads = groups.iter().map(|g| async move {
            let opts = QueryOptions::default();
            if g.exact {
                let (entry, _) = self.consul.kv_get(&g.prefix, &opts).await?;
                Ok::<_, ConsulError>(entry.into_iter().collect())
            } else {
                let (entries, _) = self.consul.kv_list(&g.prefix, &opts).await?;
                Ok(entries)
            }
        });
        let parts = in_flight(reads, REQUESTS_IN_FLIGHT).await?;
        Ok(parts.into_iter().flatten().collect())
    }

    /// Stores one batch in SQL (records that do not parse as dead letters); returns what
    /// to delete.
    async fn store_batch(&self, entries: Vec<KvPair>) -> Result<Vec<Stored>, ShipError> {
        let mut records = Vec::new();
        let mut dead = Vec::new();
        for e in &entries {
            match AuditRecord::from_kv(&e.key, e.value_bytes()) {
                Ok(r) => records.push(r),
                Err(reason) => dead.push((e.key.clone(), e.value_bytes().to_vec(), reason)),
            }
        }
        if let Some(oldest) = records.iter().map(|r| r.timestamp).min() {
            let age = self.clock.wall_since(oldest).as_secs();
            self.stats.oldest_age_secs.store(age, Ordering::Relaxed);
            metrics::gauge!("rcfarm_audit_backlog_oldest_seconds").set(age as f64);
        }
        let stored = self.store.insert(&records, &self.farm_id).await?;
        if !dead.is_empty() {
            tracing::warn!(
                count = dead.len(),
                "audit records that do not parse kept as dead letters"
            );
            self.store.insert_dead_letters(&dead).await?;
        }
        if std::env::var_os(FAILPOINT_ENV).is_some() {
            tracing::error!(
                "{FAILPOINT_ENV} is set: aborting between the SQL insert and the Consul delete"
            );
            std::process::abort();
        }
        self.stats
            .shipped
            .fetch_add(records.len() as u64, Ordering::Relaxed);
        self.stats
            .dead_letters
            .fetch_add(dead.len() as u64, Ordering::Relaxed);
        metrics::counter!("rcfarm_audit_shipped_total").increment(records.len() as u64);
        if !entries.is_empty() {
            tracing::debug!(
                read = entries.len(),
                new = stored,
                dead = dead.len(),
                "shipped audit records"
            );
        }
        Ok(entries
            .into_iter()
            .map(|e| Stored {
                key: e.key,
                modify_index: e.modify_index,
            })
            .collect())
    }

    /// Deletes stored records from the outbox, [`REQUESTS_IN_FLIGHT`] transactions at once.
    async fn delete_batch(&self, entries: &[Stored]) -> Result<(), ShipError> {
        let deletes = entries
            .chunks(MAX_TXN_OPS - 1)
            .map(|chunk| self.delete_txn(chunk));
        in_flight(deletes, REQUESTS_IN_FLIGHT).await.map(|_| ())
    }

    /// One transaction of `delete-cas` at the index read (a record rewritten since is not
    /// lost), fenced by the shipper lock.
    async fn delete_txn(&self, entries: &[Stored]) -> Result<(), ShipError> {
        let txn = self.fenced().ops(
            entries
                .iter()
                .map(|e| TxnOp::delete_cas(e.key.clone(), e.modify_index)),
        );
        match txn.commit(&self.consul).await {
            Ok(_) => Ok(()),
            Err(FenceError::Fenced { .. }) => Err(ShipError::Fenced),
            Err(FenceError::Conflict { source, .. } | FenceError::Consul(source)) => {
                Err(source.into())
            }
            Err(e) => Err(ShipError::Other(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (prefix, listed keys under it), an exact key's prefix ending in `=`.
    fn groups(keys: &[&str], max: usize) -> Vec<(String, usize)> {
        let mut keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        keys.sort_unstable();
        let mut out = Vec::new();
        prefix_groups(&keys, AUDIT_PREFIX.len(), max, &mut out);
        out.into_iter()
            .map(|g| {
                let p = if g.exact {
                    format!("{}=", g.prefix)
                } else {
                    g.prefix
                };
                (p, g.listed)
            })
            .collect()
    }

    /// Every listed key is under exactly one group's prefix, each group within the bound.
    #[test]
    fn groups_cover_every_key_once_within_the_bound() {
        let keys: Vec<String> = (0..5_000)
            .map(|_| format!("{AUDIT_PREFIX}{}", uuid::Uuid::new_v4()))
            .collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let gs = groups(&refs, 100);
        assert!(gs.iter().all(|(_, n)| *n <= 100), "{gs:?}");
        assert_eq!(gs.iter().map(|(_, n)| n).sum::<usize>(), keys.len());
        for k in &keys {
            let under = gs.iter().filter(|(p, _)| k.starts_with(p.as_str())).count();
            assert_eq!(under, 1, "{k} is under {under} prefixes");
        }
        // Prefixes as short as the bound allows: 5,000 random uuids in groups of 100 need
        // two hex digits (about 20 a prefix), not three.
        assert!(gs.iter().all(|(p, _)| p.len() <= AUDIT_PREFIX.len() + 2));
    }

    #[test]
    fn a_small_listing_is_one_group_per_first_character() {
        let gs = groups(
            &[
                "audit_logs/a1",
                "audit_logs/a2",
                "audit_logs/b1",
                "audit_logs/c",
            ],
            10,
        );
        assert_eq!(
            gs,
            [
                ("audit_logs/a".to_string(), 2),
                ("audit_logs/b".to_string(), 1),
                ("audit_logs/c".to_string(), 1)
            ]
        );
    }

    /// A pass or a batch takes whole groups up to the one that reaches its size.
    #[test]
    fn whole_groups_are_taken_up_to_the_size() {
        let gs: Vec<Group> = [3, 4, 5]
            .iter()
            .map(|&listed| Group {
                prefix: String::new(),
                listed,
                exact: false,
            })
            .collect();
        assert_eq!(groups_for(&gs, 1), 1);
        assert_eq!(groups_for(&gs, 3), 1);
        assert_eq!(groups_for(&gs, 4), 2);
        assert_eq!(groups_for(&gs, 12), 3);
        assert_eq!(groups_for(&gs, 100), 3);
        assert_eq!(groups_for(&[], 5), 0);
    }

    /// A key that other keys extend is read alone, and the keys that extend it split as any
    /// others: no group's tree is larger than the bound, not even under a key `audit_logs/`.
    /// Odd keys (not uuids, not ASCII) are grouped like any other.
    #[test]
    fn a_key_that_others_extend_is_read_alone() {
        let gs = groups(
            &[
                "audit_logs/x",
                "audit_logs/xa",
                "audit_logs/xb",
                "audit_logs/é1",
                "audit_logs/é2",
            ],
            1,
        );
        let want = [
            ("audit_logs/x=", 1),
            ("audit_logs/xa", 1),
            ("audit_logs/xb", 1),
            ("audit_logs/é1", 1),
            ("audit_logs/é2", 1),
        ];
        assert_eq!(gs, want.map(|(p, n)| (p.to_string(), n)));
        let gs = groups(&["audit_logs/", "audit_logs/a", "audit_logs/b"], 2);
        let want = [
            ("audit_logs/=", 1),
            ("audit_logs/a", 1),
            ("audit_logs/b", 1),
        ];
        assert_eq!(gs, want.map(|(p, n)| (p.to_string(), n)));
        // Within the bound, the key and those extending it are one tree read.
        assert_eq!(
            groups(&["audit_logs/x", "audit_logs/xa"], 2),
            [("audit_logs/x".to_string(), 2)]
        );
    }
}

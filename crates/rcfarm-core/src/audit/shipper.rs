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
    /// Records per SQL transaction.
    pub batch: usize,
    /// The `wait` of the blocking query on the outbox.
    pub wait: Duration,
}

impl Default for ShipperConfig {
    fn default() -> Self {
        Self {
            batch: 500,
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
        loop {
            let keys = self
                .consul
                .kv_keys(
                    AUDIT_PREFIX,
                    None,
                    &QueryOptions::blocking(index, self.config.wait),
                )
                .await;
            let (keys, meta) = match keys {
                Ok(k) => k,
                Err(e) => return e.into(),
            };
            if meta.index < index {
                index = 0;
            } else {
                index = meta.index;
            }
            let count = keys.len() as u64;
            self.stats.backlog.store(count, Ordering::Relaxed);
            metrics::gauge!("rcfarm_audit_backlog").set(count as f64);
            self.pace.set_backlog(count);
            if worth_publishing(published, count, self.pace.config().slow_at) {
                match self.publish(count, shipping).await {
                    Ok(()) => published = Some(count),
                    Err(ShipError::Fenced) => return ShipError::Fenced,
                    Err(e) => tracing::debug!(error = %e, "cannot publish the outbox's size"),
                }
            }
            let mut failed = None;
            for chunk in keys.chunks(self.config.batch.max(1)) {
                if let Err(e) = self.ship_batch(chunk).await {
                    failed = Some(e);
                    break;
                }
            }
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
                    self.stats.oldest_age_secs.store(0, Ordering::Relaxed);
                    metrics::gauge!("rcfarm_audit_backlog_oldest_seconds").set(0.0);
                }
            }
        }
    }

    /// Tells every farm how many records wait ([`BACKLOG_KEY`]), as the shipper.
    async fn publish(&self, records: u64, shipping: bool) -> Result<(), ShipError> {
        let backlog = Backlog {
            records,
            farm_id: self.farm_id.clone(),
            shipping,
            at: self.clock.wall(),
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

    /// Reads, stores and deletes one batch of outbox keys.
    async fn ship_batch(&self, keys: &[String]) -> Result<(), ShipError> {
        let mut entries: Vec<KvPair> = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(MAX_TXN_OPS) {
            // `get-tree` on the exact key never fails for a key deleted meanwhile.
            let ops: Vec<TxnOp> = chunk.iter().map(|k| TxnOp::get_tree(k.clone())).collect();
            let resp = self.consul.txn(&ops).await?;
            entries.extend(resp.results.into_iter().filter(|e| chunk.contains(&e.key)));
        }
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
        // Only what is stored is deleted, and only by the holder of the shipper lock.
        for chunk in entries.chunks(MAX_TXN_OPS - 1) {
            let txn = self.fenced().ops(
                chunk
                    .iter()
                    .map(|e| TxnOp::delete_cas(e.key.clone(), e.modify_index)),
            );
            match txn.commit(&self.consul).await {
                Ok(_) => {}
                Err(FenceError::Fenced { .. }) => return Err(ShipError::Fenced),
                Err(FenceError::Conflict { source, .. } | FenceError::Consul(source)) => {
                    return Err(source.into());
                }
                Err(e) => return Err(ShipError::Other(e.to_string())),
            }
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
        Ok(())
    }
}

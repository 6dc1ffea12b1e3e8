//! Keeping the outbox from endangering Consul while SQL is away.
//!
//! Every record is written in the same transaction as the change it describes, so the outbox
//! can only be kept small by writing fewer changes: dropping records would leave changes no one
//! can audit, and refusing changes would stop the farms keeping pods running (their job) for as
//! long as the database is out. rcfarm slows instead: past `slow_at` records waiting
//! (`--audit-outbox-slow`, 50,000 by default), each farm commits at most `per_second`
//! record-carrying writes of its RC and roll tasks (`--audit-outbox-pace`, 5 by default). The
//! outbox then grows by at most farms × pace records a second, which gives operators hours
//! (`RcfarmAuditOutboxGrowing` fires long before, `RcfarmAuditPaced` pages when pacing starts)
//! instead of a store that grows with every pod change. Claims and operators' own writes (rcctl, the API) are never slowed: a handover
//! must not wait on an audit outage, and an operator must be able to scale down.
//!
//! An outbox past the mark that the shipper is draining (it reached SQL, and counted fewer
//! records than at its listing before) is not paced: SQL keeps up, and pacing would only slow
//! the farms to 5 writes a second while the outbox empties anyway. When the farms fill it faster
//! than SQL takes it, the count grows, the pace starts, the count falls, the pace lifts: the
//! farms' write rate follows what the shipper drains. A write waiting for its slot stops
//! waiting the moment the pace lifts (slots are not honoured after it).
//!
//! Who knows the backlog: the farm that holds the shipper lock lists the outbox on every pass
//! (it goes on listing while SQL refuses), and publishes the count in
//! [`BACKLOG_KEY`] (fenced by that lock, and held by its session, so that the count goes with
//! the farm that made it) when it crosses the mark or moves by a tenth; every farm reads that key
//! every few seconds. Farms of a release before this one neither publish nor pace. While no
//! farm ships (none reaches SQL since it started), nothing publishes and nothing is slowed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// Where the shipper publishes the outbox's size. Under the shipper lock's name, so the farm
/// policy's `rcfarm/audit-shipper` prefix rule covers it.
pub const BACKLOG_KEY: &str = "rcfarm/audit-shipper-backlog";

/// How often a farm reads [`BACKLOG_KEY`].
pub const BACKLOG_READ_EVERY: Duration = Duration::from_secs(3);

/// What the shipper publishes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Backlog {
    /// Records in `audit_logs/` at the shipper's last listing.
    pub records: u64,
    /// The farm that counted them (the shipper).
    pub farm_id: String,
    /// Whether its last batch reached SQL.
    pub shipping: bool,
    pub at: DateTime<Utc>,
    /// Whether the shipper is shipping and counted fewer records than at its listing before.
    /// Absent from counts published by a release before this one: read as `false`, so those
    /// pace as they always did.
    #[serde(default)]
    pub draining: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PaceConfig {
    /// Records waiting past which writes are paced; 0: never.
    pub slow_at: u64,
    /// Record-carrying writes per second per farm while paced.
    pub per_second: f64,
}

impl Default for PaceConfig {
    fn default() -> Self {
        PaceConfig {
            slow_at: 50_000,
            per_second: 5.0,
        }
    }
}

/// One farm's pace: the backlog it last heard of and the next free slot.
#[derive(Debug)]
pub struct AuditPace {
    config: PaceConfig,
    backlog: AtomicU64,
    /// Whether writes are paced now; waiting writes watch it to stop waiting when it lifts.
    slowed: tokio::sync::watch::Sender<bool>,
    next_slot: parking_lot::Mutex<Option<Instant>>,
    paced: AtomicU64,
}

impl AuditPace {
    pub fn new(config: PaceConfig) -> AuditPace {
        AuditPace {
            config,
            backlog: AtomicU64::new(0),
            slowed: tokio::sync::watch::Sender::new(false),
            next_slot: parking_lot::Mutex::new(None),
            paced: AtomicU64::new(0),
        }
    }

    pub fn config(&self) -> PaceConfig {
        self.config
    }

    /// What the shipper last counted, and whether it is draining the outbox.
    pub fn set_backlog(&self, records: u64, draining: bool) {
        self.backlog.store(records, Ordering::Relaxed);
        let now = self.config.slow_at > 0 && records >= self.config.slow_at && !draining;
        let before = self.slowed.send_replace(now);
        if before != now {
            if now {
                tracing::warn!(
                    records,
                    slow_at = self.config.slow_at,
                    per_second = self.config.per_second,
                    "the audit outbox in Consul is past --audit-outbox-slow and not draining (SQL \
                     is away or slower than the farms): this farm paces its RC and roll writes"
                );
            } else if records >= self.config.slow_at {
                tracing::info!(
                    records,
                    "the audit outbox is past --audit-outbox-slow but draining: writes no longer paced"
                );
            } else {
                tracing::info!(
                    records,
                    "the audit outbox is below --audit-outbox-slow again: writes no longer paced"
                );
            }
        }
        metrics::gauge!("rcfarm_audit_outbox_records").set(records as f64);
        metrics::gauge!("rcfarm_audit_paced").set(if now { 1.0 } else { 0.0 });
    }

    pub fn backlog(&self) -> u64 {
        self.backlog.load(Ordering::Relaxed)
    }

    /// Whether writes are paced now.
    pub fn slowed(&self) -> bool {
        *self.slowed.borrow()
    }

    /// Writes that waited for a slot.
    pub fn paced_writes(&self) -> u64 {
        self.paced.load(Ordering::Relaxed)
    }

    /// Waits for this write's slot while paced; at once otherwise. Slots are handed out in
    /// order, `1 / per_second` apart, so the farm's rate holds whatever number of tasks wait.
    /// The wait ends early when the pace lifts: a slot handed out while paced is not honoured
    /// after (thousands of tasks queued behind a pace of 5 a second would otherwise wait for
    /// minutes after the outbox drained).
    pub async fn admit(&self) {
        let mut lifted = self.slowed.subscribe();
        let Some(wait) = self.reserve(Instant::now()) else {
            return;
        };
        self.paced.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("rcfarm_audit_paced_writes_total").increment(1);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            // The sender lives as long as `self`: an error cannot happen while we borrow it.
            _ = lifted.wait_for(|slowed| !slowed) => {}
        }
    }

    /// The wait for the next slot from `now`, taking it; `None` when not paced.
    fn reserve(&self, now: Instant) -> Option<Duration> {
        if !self.slowed() {
            *self.next_slot.lock() = None;
            return None;
        }
        let gap = Duration::from_secs_f64(1.0 / self.config.per_second.max(0.001));
        let mut next = self.next_slot.lock();
        let slot = next.map_or(now, |n| n.max(now));
        *next = Some(slot + gap);
        Some(slot - now)
    }
}

impl Default for AuditPace {
    fn default() -> Self {
        AuditPace::new(PaceConfig::default())
    }
}

/// When the shipper publishes a new count: the first time, on crossing the mark either way,
/// when the outbox empties, when it starts or stops draining past the mark, or when it moved by
/// a tenth (and at least 100) since the last one. `last` and `now` are (records, draining).
pub fn worth_publishing(last: Option<(u64, bool)>, now: (u64, bool), slow_at: u64) -> bool {
    let Some((last, was_draining)) = last else {
        return true;
    };
    let (now, draining) = now;
    let past = slow_at > 0 && now >= slow_at;
    if past && draining != was_draining {
        return true;
    }
    if last == now {
        return false;
    }
    let crossed = slow_at > 0 && ((last >= slow_at) != past);
    crossed || now == 0 || last.abs_diff(now) >= (last / 10).max(100)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn below_the_mark_nothing_waits_and_past_it_slots_are_a_pace_apart() {
        let pace = AuditPace::new(PaceConfig {
            slow_at: 100,
            per_second: 4.0,
        });
        pace.set_backlog(99, false);
        let t0 = Instant::now();
        assert_eq!(pace.reserve(t0), None);
        pace.set_backlog(100, false);
        let waits: Vec<Duration> = (0..4).map(|_| pace.reserve(t0).unwrap()).collect();
        assert_eq!(
            waits,
            [0, 250, 500, 750].map(Duration::from_millis).to_vec(),
            "four writes at once get slots 1/4 s apart"
        );
        // Later than every slot handed out: no wait, and the next is a gap after it.
        let later = t0 + Duration::from_secs(5);
        assert_eq!(pace.reserve(later), Some(Duration::ZERO));
        assert_eq!(pace.reserve(later), Some(Duration::from_millis(250)));
        pace.set_backlog(10, false);
        assert_eq!(pace.reserve(later), None);
        // Off with slow_at 0, whatever the backlog.
        let off = AuditPace::new(PaceConfig {
            slow_at: 0,
            per_second: 1.0,
        });
        off.set_backlog(1_000_000, false);
        assert!(!off.slowed());
    }

    #[tokio::test(start_paused = true)]
    async fn admit_holds_a_farm_to_its_pace() {
        let pace = std::sync::Arc::new(AuditPace::new(PaceConfig {
            slow_at: 1,
            per_second: 10.0,
        }));
        pace.set_backlog(5, false);
        let t0 = Instant::now();
        let tasks: Vec<_> = (0..20)
            .map(|_| {
                let p = pace.clone();
                tokio::spawn(async move { p.admit().await })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        // 20 writes at 10 a second: the last waits 1.9 s.
        assert_eq!(t0.elapsed(), Duration::from_millis(1900));
        assert_eq!(pace.paced_writes(), 20);
    }

    #[tokio::test(start_paused = true)]
    async fn a_draining_outbox_is_not_paced_and_a_lifted_pace_frees_every_waiting_write() {
        let pace = std::sync::Arc::new(AuditPace::new(PaceConfig {
            slow_at: 100,
            per_second: 5.0,
        }));
        // Past the mark but draining: SQL keeps up, nothing waits.
        pace.set_backlog(5_000, true);
        assert!(!pace.slowed());
        assert_eq!(pace.reserve(Instant::now()), None);
        // Growing: paced. 1,000 writes queue, the last one's slot 200 s away.
        pace.set_backlog(6_000, false);
        assert!(pace.slowed());
        let t0 = Instant::now();
        let tasks: Vec<_> = (0..1_000)
            .map(|_| {
                let p = pace.clone();
                tokio::spawn(async move { p.admit().await })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(2)).await;
        // The shipper drains it again: every queued write goes now, not at its slot.
        pace.set_backlog(5_500, true);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(t0.elapsed(), Duration::from_secs(2));
        assert_eq!(pace.paced_writes(), 1_000);
    }

    #[test]
    fn the_shipper_publishes_on_crossings_and_tenths() {
        let w = |last: Option<(u64, bool)>, now: (u64, bool)| worth_publishing(last, now, 50_000);
        assert!(w(None, (0, false)));
        assert!(!w(Some((10, false)), (10, false)));
        assert!(!w(Some((1_000, false)), (1_050, false)));
        assert!(w(Some((1_000, false)), (1_100, false)));
        assert!(w(Some((49_990, false)), (50_000, false)));
        assert!(w(Some((50_000, false)), (49_999, false)));
        assert!(!w(Some((60_000, false)), (63_000, false)));
        assert!(w(Some((60_000, false)), (66_000, false)));
        assert!(w(Some((5, false)), (0, false)));
        // Draining starts or stops past the mark: the pace depends on it.
        assert!(w(Some((60_000, false)), (59_000, true)));
        assert!(w(Some((59_000, true)), (60_000, false)));
        // Below the mark it changes nothing.
        assert!(!w(Some((1_000, false)), (1_010, true)));
    }
}

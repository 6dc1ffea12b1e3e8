//! The store's indexes, what blocking queries compare against: the last committed (Raft)
//! index, the KV and session tables' indexes, and the tombstones that keep a prefix's index
//! from going back after deletes, with Consul's rules for what index each read reports. Waking
//! the blocked queries is `waiters.rs`'s job and the wait loop is `http::blocking`'s; this is
//! only the numbers they go by.

use std::time::Duration;

use tokio::time::Instant;

use super::Store;

/// Consul reaps tombstones after about 15 minutes.
pub const TOMBSTONE_TTL: Duration = Duration::from_secs(15 * 60);

/// A deleted key (or deleted prefix) and the index that deleted it, kept so a prefix query's
/// index does not go back when its newest entry goes away (Consul's tombstones).
#[derive(Debug, Clone, Copy)]
pub(super) struct Tombstone {
    pub(super) index: u64,
    pub(super) at: Instant,
}

impl Store {
    pub fn index(&self) -> u64 {
        self.index
    }

    /// The index a read of KV reports when it finds nothing of its own: the KV table's
    /// (never 0: Consul reports at least 1).
    pub fn kv_index(&self) -> u64 {
        self.kv_table_index.max(1)
    }

    /// The index of a prefix query: the highest `ModifyIndex` or tombstone under the prefix, or
    /// the KV table's if both are 0.
    pub(super) fn prefix_index(&self, prefix: &str, max_entry: u64) -> u64 {
        let max_tomb = self
            .tombstones
            .range::<str, _>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Unbounded,
            ))
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(_, t)| t.index)
            .max()
            .unwrap_or(0);
        let idx = max_entry.max(max_tomb);
        if idx == 0 { self.kv_index() } else { idx }
    }

    pub fn sessions_index(&self) -> u64 {
        self.sessions_index.max(1)
    }

    /// The index the next write commits at.
    pub(super) fn next_index(&self) -> u64 {
        self.index + 1
    }

    /// Makes a committed write's index the current one, and the session table's if it changed
    /// sessions (blocking session queries compare against that).
    pub(super) fn advance(&mut self, idx: u64, sessions_changed: bool) {
        self.index = idx;
        if sessions_changed {
            self.sessions_index = idx;
        }
    }
}

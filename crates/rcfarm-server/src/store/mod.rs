//! The embedded server's state machine: KV entries, tombstones, sessions, lock-delays and
//! indexes, with Consul's semantics (`agent/consul/state/{kvs,txn,session}.go`).
//!
//! Every write runs as a transaction with an undo log: ops apply one after another, see earlier
//! ops' writes, and either all stay or all are undone. A committed write yields a [`Record`] (for
//! the durable log) and the keys it changed (to wake blocking queries). This file holds the
//! [`Store`] and its API; the records and tables are in `data`, the op-by-op transaction logic
//! in `txn`, and the indexes and tombstones blocking queries go by in `indexes`.

mod data;
mod indexes;
mod txn;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::consul::{KvPair, SessionEntry};
pub use data::{Behavior, Entry, KvOp, Listed, SessionRecord};
use indexes::{TOMBSTONE_TTL, Tombstone};
use txn::{OpResult, op_key};

/// A state change, as written to the durable log and replayed from it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Change {
    Put(String, Entry),
    Delete(String),
    DeleteTree(String),
    SessionCreate(SessionRecord),
    SessionDestroy(String),
}

/// All changes of one committed write, at one index.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    pub index: u64,
    pub changes: Vec<Change>,
}

/// The failed ops of a rolled-back transaction: `(op index, Consul's text)`.
pub type TxnErrors = Vec<(usize, String)>;

/// What a single KV write answered (the KV endpoint's `true`/`false`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvWriteOutcome {
    Applied,
    NotApplied,
}

/// Why a KV write request failed outright (Consul answers 500 with this text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvWriteError(pub String);

/// What a committed write produced.
#[derive(Debug, Default)]
pub struct Commit {
    pub record: Option<Record>,
    pub changed_keys: Vec<String>,
    pub sessions_changed: bool,
    /// The `check-session` ops of the transaction: `(key, session)`.
    pub checks: Vec<(String, String)>,
}

/// The whole state.
#[derive(Debug)]
pub struct Store {
    /// The last index handed out (Consul's Raft index).
    index: u64,
    /// Keys shared (`Arc<str>`): a listing clones each key it answers with, and at a million
    /// pod labels a copied key was an allocation per entry per answer.
    kv: BTreeMap<Arc<str>, Entry>,
    /// The highest index of any change to the KV or tombstone tables.
    kv_table_index: u64,
    tombstones: BTreeMap<String, Tombstone>,
    sessions: BTreeMap<String, SessionRecord>,
    /// When each TTL session expires (2×TTL after its last renewal).
    session_expiry: HashMap<String, Instant>,
    sessions_index: u64,
    /// Keys held by each session.
    held: HashMap<String, BTreeSet<String>>,
    lock_delays: HashMap<String, Instant>,
    /// Consul 0.7 moves an entry's `ModifyIndex` on a write that changes nothing; 1.x keeps
    /// the entry as it was (and wakes nobody). Set by `--compat`; not part of the state.
    identical_rewrites_bump: bool,
}

impl Default for Store {
    fn default() -> Self {
        Self::new()
    }
}

impl Store {
    /// Consul 0.7's rule for a write that changes nothing (see the field).
    pub fn set_identical_rewrites_bump(&mut self, bump: bool) {
        self.identical_rewrites_bump = bump;
    }

    pub fn new() -> Self {
        Store {
            // As Raft's first entry is Consul's own configuration, the first write here gets
            // index 2. An empty table reports index 1 (Consul never reports 0), and a blocking
            // query on 1 must be woken by the first write: when that write got index 1 too,
            // a farm that listed an empty prefix slept through it for a whole wait.
            index: 1,
            kv: BTreeMap::new(),
            kv_table_index: 0,
            tombstones: BTreeMap::new(),
            sessions: BTreeMap::new(),
            session_expiry: HashMap::new(),
            sessions_index: 0,
            held: HashMap::new(),
            lock_delays: HashMap::new(),
            identical_rewrites_bump: false,
        }
    }

    // ---- reads ------------------------------------------------------------------------------

    pub fn get(&self, key: &str) -> Option<&Entry> {
        self.kv.get(key)
    }

    /// A single-key read: the entry and the query's index (its `ModifyIndex`, or the KV table
    /// index if it does not exist).
    pub fn read_key(&self, key: &str) -> (Option<KvPair>, u64) {
        let e = self.kv.get(key);
        (e.map(|e| e.to_pair(key, true)), self.read_index_of(e))
    }

    /// The index a single-key read reports, without copying the entry (what a blocking query
    /// compares before it waits).
    pub fn key_read_index(&self, key: &str) -> u64 {
        self.read_index_of(self.kv.get(key))
    }

    /// A single-key read's index: the entry's `ModifyIndex`, or the KV table's if it is absent.
    fn read_index_of(&self, e: Option<&Entry>) -> u64 {
        e.map_or_else(|| self.kv_index(), |e| e.modify_index.max(1))
    }

    /// A recursive read's entries as copied `KvPair`s (for in-process readers; the HTTP API
    /// answers [`Store::list_prefix`]). Its index is [`Store::prefix_read_index`].
    pub fn read_prefix(&self, prefix: &str) -> Vec<KvPair> {
        self.prefix_range(prefix)
            .map(|(k, e)| e.to_pair(k, true))
            .collect()
    }

    /// The index a recursive or `?keys` read of `prefix` reports, without building its answer
    /// (what a blocking query compares before it waits).
    pub fn prefix_read_index(&self, prefix: &str) -> u64 {
        let max = self
            .prefix_range(prefix)
            .map(|(_, e)| e.modify_index)
            .max()
            .unwrap_or(0);
        self.prefix_index(prefix, max)
    }

    /// A recursive read as the HTTP API answers it: each entry's value shared with the store
    /// (`Bytes`), not copied, until it is encoded. Its index is [`Store::prefix_read_index`].
    pub fn list_prefix(&self, prefix: &str) -> Vec<Listed> {
        self.prefix_range(prefix)
            .map(|(k, e)| Listed {
                key: k.clone(),
                entry: e.clone(),
            })
            .collect()
    }

    /// How many keys start with `prefix`.
    pub fn count_prefix(&self, prefix: &str) -> usize {
        self.prefix_range(prefix).count()
    }

    /// A `?keys` read, cut after `separator` and deduplicated. Its index is
    /// [`Store::prefix_read_index`].
    pub fn read_keys(&self, prefix: &str, separator: &str) -> Vec<Arc<str>> {
        let mut keys: Vec<Arc<str>> = Vec::new();
        for (k, _) in self.prefix_range(prefix) {
            let after = &k[prefix.len()..];
            let key = match (!separator.is_empty())
                .then(|| after.find(separator))
                .flatten()
            {
                Some(pos) => &k[..prefix.len() + pos + separator.len()],
                None => &**k,
            };
            if keys.last().map(|k| &**k) != Some(key) {
                // A whole key is the map's own, shared; a cut one is new.
                keys.push(if key.len() == k.len() {
                    k.clone()
                } else {
                    Arc::from(key)
                });
            }
        }
        keys
    }

    pub fn session(&self, id: &str) -> Option<&SessionRecord> {
        self.sessions.get(id)
    }

    /// Sessions in creation order, as Consul lists them.
    pub fn list_sessions(&self, node: Option<&str>) -> Vec<SessionEntry> {
        let mut v: Vec<&SessionRecord> = self
            .sessions
            .values()
            .filter(|s| node.is_none_or(|n| s.node == n))
            .collect();
        v.sort_by_key(|s| s.create_index);
        v.into_iter().map(SessionRecord::to_entry).collect()
    }

    /// True while `key` refuses locks because its last holder was invalidated.
    pub fn in_lock_delay(&self, key: &str, now: Instant) -> bool {
        self.lock_delays.get(key).is_some_and(|until| now < *until)
    }

    // ---- writes -----------------------------------------------------------------------------

    /// Runs a transaction. On failure nothing is applied and every failed op is reported as
    /// `(op index, Consul's text)`.
    pub fn txn(&mut self, ops: &[KvOp], now: Instant) -> Result<(Vec<KvPair>, Commit), TxnErrors> {
        let mut tx = self.begin(now);
        let mut results = Vec::new();
        let mut errors = Vec::new();
        // Consul's pre-checks run before anything applies: every op needs a key (but
        // delete-tree, whose empty prefix means everything), and locks respect lock-delays.
        for (i, op) in ops.iter().enumerate() {
            if op_key(op).is_some_and(str::is_empty) {
                errors.push((i, "Must provide key".to_string()));
            } else if let KvOp::Lock { key, .. } = op
                && tx.store.in_lock_delay(key, now)
            {
                errors.push((i, format!("failed to lock key {key:?} due to lock delay")));
            }
        }
        if errors.is_empty() {
            for (i, op) in ops.iter().enumerate() {
                match tx.apply_txn_op(op) {
                    Ok(OpResult::Entry(e)) => results.push(e),
                    Ok(OpResult::Entries(es)) => results.extend(es),
                    Ok(OpResult::None) => {}
                    Err(what) => errors.push((i, what)),
                }
            }
        }
        if !errors.is_empty() {
            tx.abort();
            return Err(errors);
        }
        let mut commit = tx.commit();
        commit.checks = ops
            .iter()
            .filter_map(|op| match op {
                KvOp::CheckSession { key, session } => Some((key.clone(), session.clone())),
                _ => None,
            })
            .collect();
        Ok((results, commit))
    }

    /// A KV endpoint write (`PUT`/`DELETE` on `/v1/kv/…`): `true`/`false`, or an error Consul
    /// answers with 500.
    pub fn kv_write(
        &mut self,
        op: &KvOp,
        now: Instant,
    ) -> Result<(KvWriteOutcome, Commit), KvWriteError> {
        if let KvOp::Lock { key, .. } = op
            && self.in_lock_delay(key, now)
        {
            return Ok((KvWriteOutcome::NotApplied, Commit::default()));
        }
        let mut tx = self.begin(now);
        match tx.apply_kv_op(op) {
            Ok(true) => Ok((KvWriteOutcome::Applied, tx.commit())),
            Ok(false) => {
                tx.abort();
                Ok((KvWriteOutcome::NotApplied, Commit::default()))
            }
            Err(e) => {
                tx.abort();
                Err(KvWriteError(e))
            }
        }
    }

    /// Creates a session (already validated).
    pub fn create_session(&mut self, rec: SessionRecord, now: Instant) -> Commit {
        let mut tx = self.begin(now);
        tx.create_session(rec);
        tx.commit()
    }

    /// Resets a session's TTL timer; `false` if the session does not exist.
    pub fn renew_session(&mut self, id: &str, now: Instant) -> Option<SessionEntry> {
        let rec = self.sessions.get(id)?;
        if let Some(ttl) = rec.ttl {
            self.session_expiry.insert(id.to_string(), now + ttl * 2);
        }
        Some(rec.to_entry())
    }

    /// Invalidates a session: its keys are released or deleted, with lock-delay. Destroying an
    /// unknown session changes nothing.
    pub fn destroy_session(&mut self, id: &str, now: Instant) -> Commit {
        if !self.sessions.contains_key(id) {
            return Commit::default();
        }
        let mut tx = self.begin(now);
        tx.invalidate_session(id);
        tx.commit()
    }

    /// Invalidates every session whose TTL timer ran out (2×TTL without a renewal).
    pub fn expire_sessions(&mut self, now: Instant) -> Vec<(String, Commit)> {
        let expired: Vec<String> = self
            .session_expiry
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(id, _)| id.clone())
            .collect();
        expired
            .into_iter()
            .map(|id| {
                let commit = self.destroy_session(&id, now);
                (id, commit)
            })
            .collect()
    }

    /// Gives every session a fresh TTL timer (after a restart, as a new Consul leader does).
    pub fn reset_session_timers(&mut self, now: Instant) {
        self.session_expiry.clear();
        for rec in self.sessions.values() {
            if let Some(ttl) = rec.ttl {
                self.session_expiry.insert(rec.id.clone(), now + ttl * 2);
            }
        }
    }

    /// The next time a session may expire, for the reaper's sleep.
    pub fn next_session_expiry(&self) -> Option<Instant> {
        self.session_expiry.values().min().copied()
    }

    /// Drops tombstones older than `TOMBSTONE_TTL` and lock-delays that have run out.
    pub fn reap(&mut self, now: Instant) -> usize {
        let before = self.tombstones.len();
        self.tombstones
            .retain(|_, t| now.duration_since(t.at) < TOMBSTONE_TTL);
        self.lock_delays.retain(|_, until| now < *until);
        before - self.tombstones.len()
    }

    // ---- durable log support ----------------------------------------------------------------

    /// Re-applies a logged record (after a restart).
    pub fn replay(&mut self, rec: &Record, now: Instant) {
        if rec.index <= self.index {
            return;
        }
        let idx = rec.index;
        for change in &rec.changes {
            match change {
                Change::Put(key, entry) => {
                    self.set_raw(key, Some(entry.clone()));
                    self.kv_table_index = self.kv_table_index.max(idx);
                }
                Change::Delete(key) => {
                    self.set_raw(key, None);
                    self.tombstones.insert(
                        key.clone(),
                        Tombstone {
                            index: idx,
                            at: now,
                        },
                    );
                    self.kv_table_index = self.kv_table_index.max(idx);
                }
                Change::DeleteTree(prefix) => {
                    let keys: Vec<Arc<str>> =
                        self.prefix_range(prefix).map(|(k, _)| k.clone()).collect();
                    for k in keys {
                        self.set_raw(&k, None);
                    }
                    self.tombstones.insert(
                        prefix.clone(),
                        Tombstone {
                            index: idx,
                            at: now,
                        },
                    );
                    self.kv_table_index = self.kv_table_index.max(idx);
                }
                Change::SessionCreate(s) => {
                    self.insert_session(s.clone(), now);
                    self.sessions_index = self.sessions_index.max(idx);
                }
                Change::SessionDestroy(id) => {
                    self.sessions.remove(id);
                    self.session_expiry.remove(id);
                    self.sessions_index = self.sessions_index.max(idx);
                }
            }
        }
        self.index = idx;
    }

    /// The whole state, for a snapshot.
    pub fn snapshot(&self) -> SnapshotData {
        SnapshotData {
            index: self.index,
            kv_table_index: self.kv_table_index,
            sessions_index: self.sessions_index,
            entries: self
                .kv
                .iter()
                .map(|(k, e)| (k.to_string(), e.clone()))
                .collect(),
            tombstones: self
                .tombstones
                .iter()
                .map(|(k, t)| (k.clone(), t.index))
                .collect(),
            sessions: self.sessions.values().cloned().collect(),
        }
    }

    /// Rebuilds the state from a snapshot; sessions get fresh TTL timers.
    pub fn restore(data: SnapshotData, now: Instant) -> Store {
        let mut s = Store::new();
        s.index = data.index;
        s.kv_table_index = data.kv_table_index;
        s.sessions_index = data.sessions_index;
        for (k, e) in data.entries {
            s.set_raw(&k, Some(e));
        }
        for (k, index) in data.tombstones {
            s.tombstones.insert(k, Tombstone { index, at: now });
        }
        for rec in data.sessions {
            s.insert_session(rec, now);
        }
        s
    }

    pub fn len(&self) -> usize {
        self.kv.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kv.is_empty()
    }

    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }
}

/// The serialized form of a whole store.
#[derive(Debug, Serialize, Deserialize)]
pub struct SnapshotData {
    pub index: u64,
    pub kv_table_index: u64,
    pub sessions_index: u64,
    pub entries: Vec<(String, Entry)>,
    pub tombstones: Vec<(String, u64)>,
    pub sessions: Vec<SessionRecord>,
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;

    use super::*;

    fn set(key: &str, value: &str) -> KvOp {
        KvOp::Set {
            key: key.into(),
            value: Bytes::from(value.to_string()),
            flags: 0,
        }
    }

    fn lock(key: &str, session: &str) -> KvOp {
        KvOp::Lock {
            key: key.into(),
            value: Bytes::from_static(b"held"),
            flags: 0,
            session: session.into(),
        }
    }

    fn unlock(key: &str, session: &str) -> KvOp {
        KvOp::Unlock {
            key: key.into(),
            value: Bytes::from_static(b"held"),
            flags: 0,
            session: session.into(),
        }
    }

    fn check_index(key: &str, index: u64) -> KvOp {
        KvOp::CheckIndex {
            key: key.into(),
            index,
        }
    }

    fn check_session(key: &str, session: &str) -> KvOp {
        KvOp::CheckSession {
            key: key.into(),
            session: session.into(),
        }
    }

    /// A committed write's index (panics if it failed or changed nothing).
    fn write(s: &mut Store, ops: &[KvOp]) -> u64 {
        let (_, commit) = s.txn(ops, Instant::now()).expect("txn applies");
        commit.record.expect("txn changes something").index
    }

    fn new_session(s: &mut Store, id: &str, lock_delay: Duration) {
        let rec = SessionRecord {
            id: id.into(),
            name: String::new(),
            node: "n".into(),
            lock_delay,
            behavior: Behavior::Release,
            ttl_text: String::new(),
            ttl: None,
            node_checks: vec!["serfHealth".into()],
            service_checks: None,
            create_index: 0,
            modify_index: 0,
        };
        s.create_session(rec, Instant::now());
    }

    fn value(s: &Store, key: &str) -> Option<Vec<u8>> {
        s.get(key).map(|e| e.value.to_vec())
    }

    /// A write that changes nothing: Consul 1.x keeps the entry and its index, and answers
    /// with that index; 0.7 (`--compat 0.7`) commits it at a new index, as the real 0.7.0
    /// does (a `set` of the same value twice moves `ModifyIndex`).
    #[test]
    fn an_identical_rewrite_keeps_its_index_on_1x_and_moves_it_on_0_7() {
        for bump in [false, true] {
            let mut s = Store::new();
            s.set_identical_rewrites_bump(bump);
            let first = write(&mut s, &[set("k", "v")]);
            let (results, commit) = s
                .txn(&[set("k", "v"), set("j", "v")], Instant::now())
                .unwrap();
            let at = commit.record.unwrap().index;
            let k = s.get("k").unwrap().modify_index;
            assert_eq!(
                results[0].modify_index, k,
                "the answer names the key's index"
            );
            assert_eq!(results[1].modify_index, at);
            assert_eq!(k, if bump { at } else { first }, "bump: {bump}");
        }
    }

    /// The HTTP API's listing (values shared, index computed apart) answers what the copied
    /// `KvPair`s did, byte for byte: locked and unlocked entries, empty values, flags, a
    /// prefix whose newest entry was deleted (its tombstone sets the index), and no entry.
    #[test]
    fn a_listing_encodes_as_the_copied_pairs_and_reports_their_index() {
        let mut s = Store::new();
        new_session(&mut s, "s1", Duration::ZERO);
        let first = write(
            &mut s,
            &[
                set("a/1", "one"),
                set("a/2", ""),
                KvOp::Set {
                    key: "a/3".into(),
                    value: Bytes::from_static(b"\x00\xff binary"),
                    flags: 42,
                },
                set("b/1", "other"),
            ],
        );
        let locked = write(&mut s, &[lock("a/4", "s1")]);
        write(&mut s, &[set("a/9", "gone")]);
        let deleted = write(&mut s, &[KvOp::Delete { key: "a/9".into() }]);
        for (prefix, index) in [
            ("", deleted),
            ("a/", deleted),
            ("a/4", locked),
            ("b/", first),
            ("nothing/", s.kv_index()),
        ] {
            assert_eq!(
                serde_json::to_string(&s.list_prefix(prefix)).unwrap(),
                serde_json::to_string(&s.read_prefix(prefix)).unwrap(),
                "{prefix:?}"
            );
            assert_eq!(s.prefix_read_index(prefix), index, "{prefix:?}");
        }
        assert!(
            serde_json::to_string(&s.list_prefix("a/4"))
                .unwrap()
                .contains(r#""Session":"s1""#)
        );
    }

    #[test]
    fn a_failed_check_applies_nothing_and_names_every_failed_op() {
        let mut s = Store::new();
        let a_index = write(&mut s, &[set("a", "1"), set("c", "1")]);
        let (index, kv_index) = (s.index(), s.kv_index());
        let prefix_index = s.prefix_read_index("");

        let errs = s
            .txn(
                &[
                    set("b", "new"),
                    KvOp::Delete { key: "a".into() },
                    check_index("c", a_index + 100),
                    set("c", "2"),
                    KvOp::Get { key: "nope".into() },
                ],
                Instant::now(),
            )
            .unwrap_err();
        let failed: Vec<usize> = errs.iter().map(|(i, _)| *i).collect();
        assert_eq!(failed, [2, 4]);
        assert_eq!(
            errs[0].1,
            format!(
                "failed index check for key \"c\", current modify index {a_index} != {}",
                a_index + 100
            )
        );
        assert_eq!(errs[1].1, "key \"nope\" doesn't exist");

        // Nothing stayed: not the writes before the failure, not the delete's tombstone, not
        // the writes after it, and no index was used up.
        assert_eq!(value(&s, "a").as_deref(), Some(&b"1"[..]));
        assert_eq!(value(&s, "b"), None);
        assert_eq!(value(&s, "c").as_deref(), Some(&b"1"[..]));
        assert_eq!(s.get("a").unwrap().modify_index, a_index);
        assert_eq!((s.index(), s.kv_index()), (index, kv_index));
        assert_eq!(s.prefix_read_index(""), prefix_index);
        assert_eq!(write(&mut s, &[set("b", "x")]), index + 1);
    }

    #[test]
    fn pre_checks_refuse_a_missing_key_before_anything_applies() {
        let mut s = Store::new();
        let errs = s
            .txn(&[set("a", "1"), set("", "x")], Instant::now())
            .unwrap_err();
        assert_eq!(errs, [(1, "Must provide key".to_string())]);
        assert_eq!(value(&s, "a"), None);
        // delete-tree's empty prefix is everything, not a missing key.
        write(&mut s, &[set("a", "1")]);
        write(&mut s, &[KvOp::DeleteTree { prefix: "".into() }]);
        assert!(s.is_empty());
    }

    #[test]
    fn a_lock_held_by_one_session_refuses_another() {
        let mut s = Store::new();
        new_session(&mut s, "s1", Duration::ZERO);
        new_session(&mut s, "s2", Duration::ZERO);

        let (results, _) = s.txn(&[lock("k", "s1")], Instant::now()).unwrap();
        assert_eq!(results[0].session.as_deref(), Some("s1"));
        assert_eq!(results[0].lock_index, 1);
        // A transaction's write answers carry no value.
        assert_eq!(results[0].value, None);
        let held = s.get("k").unwrap().clone();

        let errs = s.txn(&[lock("k", "s2")], Instant::now()).unwrap_err();
        assert_eq!(
            errs,
            [(
                0,
                "failed to lock key \"k\", lock is already held".to_string()
            )]
        );
        let errs = s.txn(&[unlock("k", "s2")], Instant::now()).unwrap_err();
        assert_eq!(errs[0].0, 0);
        assert_eq!(s.get("k"), Some(&held));
        // The KV endpoint's acquire answers `false` instead.
        let (outcome, commit) = s.kv_write(&lock("k", "s2"), Instant::now()).unwrap();
        assert_eq!(outcome, KvWriteOutcome::NotApplied);
        assert!(commit.record.is_none());

        // The holder may acquire again (same lock index); once released, the other session
        // gets it with the next lock index.
        let (results, _) = s.txn(&[lock("k", "s1")], Instant::now()).unwrap();
        assert_eq!(results[0].lock_index, 1);
        write(&mut s, &[unlock("k", "s1")]);
        assert_eq!(s.get("k").unwrap().session, None);
        let (results, _) = s.txn(&[lock("k", "s2")], Instant::now()).unwrap();
        assert_eq!(results[0].lock_index, 2);
        assert_eq!(results[0].session.as_deref(), Some("s2"));

        let errs = s.txn(&[lock("j", "ghost")], Instant::now()).unwrap_err();
        assert_eq!(errs, [(0, "invalid session \"ghost\"".to_string())]);
    }

    #[test]
    fn an_invalidated_holder_leaves_a_lock_delay() {
        let mut s = Store::new();
        new_session(&mut s, "s1", Duration::from_secs(15));
        new_session(&mut s, "s2", Duration::ZERO);
        write(&mut s, &[lock("k", "s1")]);
        let now = Instant::now();
        s.destroy_session("s1", now);
        assert_eq!(s.get("k").unwrap().session, None);
        let errs = s.txn(&[lock("k", "s2")], now).unwrap_err();
        assert_eq!(
            errs,
            [(0, "failed to lock key \"k\" due to lock delay".to_string())]
        );
        assert!(
            s.txn(&[lock("k", "s2")], now + Duration::from_secs(16))
                .is_ok()
        );
    }

    #[test]
    fn check_session_and_check_index() {
        let mut s = Store::new();
        new_session(&mut s, "s1", Duration::ZERO);
        new_session(&mut s, "s2", Duration::ZERO);
        let locked = write(&mut s, &[lock("held", "s1")]);
        let plain = write(&mut s, &[set("plain", "v")]);
        let index = s.index();

        // Checks alone: they pass, change nothing and use no index, and a transaction reports
        // its check-session ops.
        let (results, commit) = s
            .txn(
                &[
                    check_session("held", "s1"),
                    check_session("plain", ""),
                    check_index("held", locked),
                    check_index("plain", plain),
                ],
                Instant::now(),
            )
            .unwrap();
        assert_eq!(results.len(), 4);
        assert_eq!(results[0].key, "held");
        assert_eq!(results[0].value, None);
        assert_eq!(results[3].modify_index, plain);
        assert!(commit.record.is_none());
        assert_eq!(s.index(), index);
        assert_eq!(
            commit.checks,
            [
                ("held".to_string(), "s1".to_string()),
                ("plain".to_string(), String::new())
            ]
        );

        let fails = |s: &mut Store, op: KvOp| -> String {
            let mut errs = s.txn(&[op], Instant::now()).unwrap_err();
            assert_eq!(errs.len(), 1);
            assert_eq!(errs[0].0, 0);
            errs.remove(0).1
        };
        assert_eq!(
            fails(&mut s, check_session("held", "s2")),
            "failed session check for key \"held\", current session \"s1\" != \"s2\""
        );
        assert_eq!(
            fails(&mut s, check_session("plain", "s1")),
            "failed session check for key \"plain\", current session \"\" != \"s1\""
        );
        assert_eq!(
            fails(&mut s, check_session("nope", "s1")),
            "failed to check session, key \"nope\" doesn't exist"
        );
        assert_eq!(
            fails(&mut s, check_index("plain", locked)),
            format!(
                "failed index check for key \"plain\", current modify index {plain} != {locked}"
            )
        );
        assert_eq!(
            fails(&mut s, check_index("nope", 1)),
            "failed to check index, key \"nope\" doesn't exist"
        );

        // A check guards the writes of its transaction.
        let (_, commit) = s
            .txn(
                &[check_session("held", "s1"), set("guarded", "1")],
                Instant::now(),
            )
            .unwrap();
        assert_eq!(commit.checks, [("held".to_string(), "s1".to_string())]);
        assert!(value(&s, "guarded").is_some());
    }

    #[test]
    fn delete_tree_removes_the_prefix_only_and_leaves_its_index() {
        let mut s = Store::new();
        write(
            &mut s,
            &[
                set("a/1", "x"),
                set("a/2", "x"),
                set("ab", "x"),
                set("b", "x"),
            ],
        );
        new_session(&mut s, "s1", Duration::ZERO);
        write(&mut s, &[lock("a/3", "s1")]);

        let (_, commit) = s
            .txn(
                &[KvOp::DeleteTree {
                    prefix: "a/".into(),
                }],
                Instant::now(),
            )
            .unwrap();
        let rec = commit.record.unwrap();
        assert!(matches!(&rec.changes[..], [Change::DeleteTree(p)] if p == "a/"));
        assert_eq!(commit.changed_keys, ["a/1", "a/2", "a/3"]);
        assert_eq!(s.count_prefix("a/"), 0);
        assert_eq!(value(&s, "ab").as_deref(), Some(&b"x"[..]));
        assert_eq!(value(&s, "b").as_deref(), Some(&b"x"[..]));
        // The emptied prefix reports the delete's index (its tombstone), not an older one.
        assert_eq!(s.read_prefix("a/"), Vec::new());
        assert_eq!(s.prefix_read_index("a/"), rec.index);
        assert_eq!(s.prefix_read_index("a"), rec.index);
        // Invalidating the session that held a deleted key touches nothing more under it.
        let commit = s.destroy_session("s1", Instant::now());
        assert!(commit.changed_keys.is_empty());
        assert_eq!(s.count_prefix("a/"), 0);

        // Nothing under the prefix: nothing changes and no index is used.
        let index = s.index();
        let (_, commit) = s
            .txn(
                &[KvOp::DeleteTree {
                    prefix: "zz/".into(),
                }],
                Instant::now(),
            )
            .unwrap();
        assert!(commit.record.is_none());
        assert_eq!(s.index(), index);
    }

    #[test]
    fn commit_indexes_increase_and_are_the_written_keys_modify_index() {
        let mut s = Store::new();
        // An empty store reports 1 and the first write gets 2, so a query blocked on 1 wakes.
        assert_eq!((s.index(), s.kv_index(), s.sessions_index()), (1, 1, 1));
        let mut last = s.index();
        let mut created = None;
        for round in 0..5 {
            let v = round.to_string();
            let idx = write(&mut s, &[set("k", &v), set(&format!("other/{round}"), &v)]);
            assert!(idx > last, "{idx} after {last}");
            assert_eq!(idx, s.index());
            assert_eq!(s.kv_index(), idx);
            let e = s.get("k").unwrap();
            assert_eq!(e.modify_index, idx);
            assert_eq!(s.get(&format!("other/{round}")).unwrap().modify_index, idx);
            // CreateIndex is the first write's.
            assert_eq!(e.create_index, *created.get_or_insert(idx));
            assert_eq!(s.read_key("k").1, idx);
            last = idx;
        }
        assert_eq!(last, 6);

        // A write that changes nothing is skipped: no commit, no new index.
        let (results, commit) = s.txn(&[set("k", "4")], Instant::now()).unwrap();
        assert!(commit.record.is_none());
        assert_eq!(results[0].modify_index, last);
        assert_eq!(s.index(), last);

        // A delete's index is the prefix's until a later write, and sessions count too.
        let del = write(&mut s, &[KvOp::Delete { key: "k".into() }]);
        assert_eq!(del, last + 1);
        assert_eq!(s.prefix_read_index("k"), del);
        assert_eq!(s.read_key("k"), (None, del));
        new_session(&mut s, "s1", Duration::ZERO);
        assert_eq!(s.index(), del + 1);
        assert_eq!(s.sessions_index(), del + 1);
        assert_eq!(s.kv_index(), del);
        let cas = write(
            &mut s,
            &[KvOp::Cas {
                key: "k".into(),
                value: Bytes::from_static(b"back"),
                flags: 0,
                index: 0,
            }],
        );
        assert_eq!(cas, del + 2);
        assert_eq!(s.get("k").unwrap().create_index, cas);
        assert_eq!(s.get("k").unwrap().modify_index, cas);
    }
}

//! The embedded server's state machine: KV entries, tombstones, sessions, lock-delays and
//! indexes, with Consul's semantics (`agent/consul/state/{kvs,txn,session}.go`).
//!
//! Every write runs as a transaction with an undo log: ops apply one after another, see earlier
//! ops' writes, and either all stay or all are undone. A committed write yields a [`Record`] (for
//! the durable log) and the keys it changed (to wake blocking queries).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::consul::{KvPair, ServiceCheck, SessionEntry};

/// Consul caps the lock-delay applied at invalidation at 60 s.
pub const MAX_LOCK_DELAY: Duration = Duration::from_secs(60);
/// Consul reaps tombstones after about 15 minutes.
pub const TOMBSTONE_TTL: Duration = Duration::from_secs(15 * 60);

/// One KV entry (the key is the map key).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub value: Bytes,
    pub flags: u64,
    pub session: Option<String>,
    pub lock_index: u64,
    pub create_index: u64,
    pub modify_index: u64,
}

impl Entry {
    pub fn to_pair(&self, key: &str, with_value: bool) -> KvPair {
        KvPair {
            lock_index: self.lock_index,
            key: key.to_string(),
            flags: self.flags,
            value: (with_value && !self.value.is_empty()).then(|| self.value.to_vec()),
            session: self.session.clone(),
            create_index: self.create_index,
            modify_index: self.modify_index,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Behavior {
    Release,
    Delete,
}

impl Behavior {
    pub fn as_str(self) -> &'static str {
        match self {
            Behavior::Release => "release",
            Behavior::Delete => "delete",
        }
    }
}

/// A session as the store keeps it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SessionRecord {
    pub id: String,
    pub name: String,
    pub node: String,
    pub lock_delay: Duration,
    pub behavior: Behavior,
    /// Exactly as the creator sent it; empty without a TTL.
    pub ttl_text: String,
    pub ttl: Option<Duration>,
    pub node_checks: Vec<String>,
    pub service_checks: Option<Vec<(String, String)>>,
    pub create_index: u64,
    pub modify_index: u64,
}

impl SessionRecord {
    pub fn to_entry(&self) -> SessionEntry {
        SessionEntry {
            id: self.id.clone(),
            name: self.name.clone(),
            node: self.node.clone(),
            lock_delay: self.lock_delay.as_nanos() as u64,
            behavior: self.behavior.as_str().to_string(),
            ttl: self.ttl_text.clone(),
            node_checks: Some(self.node_checks.clone()),
            service_checks: self.service_checks.as_ref().map(|v| {
                v.iter()
                    .map(|(id, ns)| ServiceCheck {
                        id: id.clone(),
                        namespace: ns.clone(),
                    })
                    .collect()
            }),
            checks: None,
            create_index: self.create_index,
            modify_index: self.modify_index,
        }
    }
}

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

/// A KV operation, from a KV request or a transaction.
#[derive(Debug, Clone)]
pub enum KvOp {
    Set {
        key: String,
        value: Bytes,
        flags: u64,
    },
    Cas {
        key: String,
        value: Bytes,
        flags: u64,
        index: u64,
    },
    Lock {
        key: String,
        value: Bytes,
        flags: u64,
        session: String,
    },
    Unlock {
        key: String,
        value: Bytes,
        flags: u64,
        session: String,
    },
    Get {
        key: String,
    },
    GetOrEmpty {
        key: String,
    },
    GetTree {
        prefix: String,
    },
    CheckIndex {
        key: String,
        index: u64,
    },
    CheckSession {
        key: String,
        session: String,
    },
    CheckNotExists {
        key: String,
    },
    Delete {
        key: String,
    },
    DeleteTree {
        prefix: String,
    },
    DeleteCas {
        key: String,
        index: u64,
    },
    Unknown {
        verb: String,
    },
}

impl KvOp {
    pub fn is_write(&self) -> bool {
        matches!(
            self,
            KvOp::Set { .. }
                | KvOp::Cas { .. }
                | KvOp::Lock { .. }
                | KvOp::Unlock { .. }
                | KvOp::Delete { .. }
                | KvOp::DeleteTree { .. }
                | KvOp::DeleteCas { .. }
        )
    }
}

/// The key an op names, except for delete-tree (and unknown verbs), which may be empty.
fn op_key(op: &KvOp) -> Option<&str> {
    match op {
        KvOp::Set { key, .. }
        | KvOp::Cas { key, .. }
        | KvOp::Lock { key, .. }
        | KvOp::Unlock { key, .. }
        | KvOp::Get { key }
        | KvOp::GetOrEmpty { key }
        | KvOp::CheckIndex { key, .. }
        | KvOp::CheckSession { key, .. }
        | KvOp::CheckNotExists { key }
        | KvOp::Delete { key }
        | KvOp::DeleteCas { key, .. } => Some(key),
        KvOp::GetTree { prefix } => Some(prefix),
        KvOp::DeleteTree { .. } | KvOp::Unknown { .. } => None,
    }
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

#[derive(Debug, Clone, Copy)]
struct Tombstone {
    index: u64,
    at: Instant,
}

/// The whole state.
#[derive(Debug)]
pub struct Store {
    /// The last index handed out (Consul's Raft index).
    index: u64,
    kv: BTreeMap<String, Entry>,
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
}

enum Undo {
    Entry(String, Option<Entry>),
    Tombstone(String, Option<Tombstone>),
}

/// A write in progress.
struct Tx<'a> {
    store: &'a mut Store,
    idx: u64,
    now: Instant,
    undo: Vec<Undo>,
    changes: Vec<Change>,
    changed_keys: Vec<String>,
    kv_table_index_before: u64,
    sessions_changed: bool,
}

/// The answer of one op inside a transaction.
pub enum OpResult {
    /// An entry to report (with its value only for the get verbs).
    Entry(KvPair),
    Entries(Vec<KvPair>),
    None,
}

impl Default for Store {
    fn default() -> Self {
        Self::new()
    }
}

impl Store {
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
        }
    }

    pub fn index(&self) -> u64 {
        self.index
    }

    // ---- reads ------------------------------------------------------------------------------

    /// The index a read of KV reports when it finds nothing of its own: the KV table's
    /// (never 0: Consul reports at least 1).
    pub fn kv_index(&self) -> u64 {
        self.kv_table_index.max(1)
    }

    pub fn get(&self, key: &str) -> Option<&Entry> {
        self.kv.get(key)
    }

    /// A single-key read: the entry and the query's index (its `ModifyIndex`, or the KV table
    /// index if it does not exist).
    pub fn read_key(&self, key: &str) -> (Option<KvPair>, u64) {
        match self.kv.get(key) {
            Some(e) => (Some(e.to_pair(key, true)), e.modify_index.max(1)),
            None => (None, self.kv_index()),
        }
    }

    fn prefix_range<'a>(
        &'a self,
        prefix: &'a str,
    ) -> impl Iterator<Item = (&'a String, &'a Entry)> + 'a {
        self.kv
            .range::<str, _>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Unbounded,
            ))
            .take_while(move |(k, _)| k.starts_with(prefix))
    }

    /// The index of a prefix query: the highest `ModifyIndex` or tombstone under the prefix, or
    /// the KV table's if both are 0.
    fn prefix_index(&self, prefix: &str, max_entry: u64) -> u64 {
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

    /// A recursive read.
    pub fn read_prefix(&self, prefix: &str) -> (Vec<KvPair>, u64) {
        let mut max = 0;
        let entries: Vec<KvPair> = self
            .prefix_range(prefix)
            .map(|(k, e)| {
                max = max.max(e.modify_index);
                e.to_pair(k, true)
            })
            .collect();
        (entries, self.prefix_index(prefix, max))
    }

    /// How many keys start with `prefix`.
    pub fn count_prefix(&self, prefix: &str) -> usize {
        self.prefix_range(prefix).count()
    }

    /// A `?keys` read, cut after `separator` and deduplicated.
    pub fn read_keys(&self, prefix: &str, separator: &str) -> (Vec<String>, u64) {
        let mut max = 0;
        let mut keys: Vec<String> = Vec::new();
        for (k, e) in self.prefix_range(prefix) {
            max = max.max(e.modify_index);
            let after = &k[prefix.len()..];
            let key = match (!separator.is_empty())
                .then(|| after.find(separator))
                .flatten()
            {
                Some(pos) => &k[..prefix.len() + pos + separator.len()],
                None => k.as_str(),
            };
            if keys.last().map(String::as_str) != Some(key) {
                keys.push(key.to_string());
            }
        }
        (keys, self.prefix_index(prefix, max))
    }

    pub fn sessions_index(&self) -> u64 {
        self.sessions_index.max(1)
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

    fn begin(&mut self, now: Instant) -> Tx<'_> {
        let idx = self.index + 1;
        let kv_table_index_before = self.kv_table_index;
        Tx {
            store: self,
            idx,
            now,
            undo: Vec::new(),
            changes: Vec::new(),
            changed_keys: Vec::new(),
            kv_table_index_before,
            sessions_changed: false,
        }
    }

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
    pub fn create_session(&mut self, mut rec: SessionRecord, now: Instant) -> Commit {
        let mut tx = self.begin(now);
        rec.create_index = tx.idx;
        rec.modify_index = tx.idx;
        tx.store.insert_session(rec.clone(), now);
        tx.sessions_changed = true;
        tx.changes.push(Change::SessionCreate(rec));
        tx.commit()
    }

    fn insert_session(&mut self, rec: SessionRecord, now: Instant) {
        if let Some(ttl) = rec.ttl {
            self.session_expiry.insert(rec.id.clone(), now + ttl * 2);
        }
        self.sessions.insert(rec.id.clone(), rec);
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
                    let keys: Vec<String> =
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
                .map(|(k, e)| (k.clone(), e.clone()))
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

    /// Sets or removes an entry, keeping the per-session sets of held keys right.
    fn set_raw(&mut self, key: &str, entry: Option<Entry>) -> Option<Entry> {
        let old = match entry {
            Some(e) => {
                if let Some(s) = &e.session {
                    self.held
                        .entry(s.clone())
                        .or_default()
                        .insert(key.to_string());
                }
                self.kv.insert(key.to_string(), e)
            }
            None => self.kv.remove(key),
        };
        if let Some(old_session) = old.as_ref().and_then(|o| o.session.as_ref()) {
            let still_held = self.kv.get(key).and_then(|e| e.session.as_ref()) == Some(old_session);
            if !still_held && let Some(set) = self.held.get_mut(old_session) {
                set.remove(key);
                if set.is_empty() {
                    self.held.remove(old_session);
                }
            }
        }
        old
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

impl Tx<'_> {
    fn entry(&self, key: &str) -> Option<&Entry> {
        self.store.kv.get(key)
    }

    fn put(&mut self, key: &str, entry: Entry) {
        let old = self.store.set_raw(key, Some(entry.clone()));
        self.undo.push(Undo::Entry(key.to_string(), old));
        self.store.kv_table_index = self.idx;
        self.changes.push(Change::Put(key.to_string(), entry));
        self.changed_keys.push(key.to_string());
    }

    fn tombstone(&mut self, key: &str) {
        let old = self.store.tombstones.insert(
            key.to_string(),
            Tombstone {
                index: self.idx,
                at: self.now,
            },
        );
        self.undo.push(Undo::Tombstone(key.to_string(), old));
    }

    fn delete(&mut self, key: &str) {
        if let Some(old) = self.store.set_raw(key, None) {
            self.undo.push(Undo::Entry(key.to_string(), Some(old)));
            self.tombstone(key);
            self.store.kv_table_index = self.idx;
            self.changes.push(Change::Delete(key.to_string()));
            self.changed_keys.push(key.to_string());
        }
    }

    fn delete_tree(&mut self, prefix: &str) {
        let keys: Vec<String> = self
            .store
            .prefix_range(prefix)
            .map(|(k, _)| k.clone())
            .collect();
        if keys.is_empty() {
            return;
        }
        for k in &keys {
            let old = self.store.set_raw(k, None);
            self.undo.push(Undo::Entry(k.clone(), old));
        }
        self.tombstone(prefix);
        self.store.kv_table_index = self.idx;
        self.changes.push(Change::DeleteTree(prefix.to_string()));
        self.changed_keys.extend(keys);
    }

    /// Consul's `kvsSetTxn`: keeps `CreateIndex`, keeps the session unless the op manages it,
    /// and skips the write entirely if nothing would change.
    fn set(
        &mut self,
        key: &str,
        value: &Bytes,
        flags: u64,
        session: Option<String>,
        lock_index: u64,
        update_session: bool,
    ) -> Entry {
        let existing = self.entry(key).cloned();
        let session = if update_session {
            session
        } else {
            existing.as_ref().and_then(|e| e.session.clone())
        };
        let mut entry = Entry {
            value: value.clone(),
            flags,
            session,
            lock_index,
            create_index: existing.as_ref().map_or(self.idx, |e| e.create_index),
            modify_index: self.idx,
        };
        if let Some(ex) = &existing
            && ex.value == entry.value
            && ex.flags == entry.flags
            && ex.session == entry.session
            && ex.lock_index == entry.lock_index
        {
            entry.modify_index = ex.modify_index;
            return entry;
        }
        self.put(key, entry.clone());
        entry
    }

    /// `Ok(true)` applied, `Ok(false)` refused (the KV endpoint's `false`), `Err` for a request
    /// Consul rejects outright.
    fn apply_kv_op(&mut self, op: &KvOp) -> Result<bool, String> {
        match op {
            KvOp::Set { key, value, flags } => {
                self.set(key, value, *flags, None, 0, false);
                Ok(true)
            }
            KvOp::Cas {
                key,
                value,
                flags,
                index,
            } => {
                let ok = match (self.entry(key), *index) {
                    (Some(_), 0) => false,
                    (None, 0) => true,
                    (None, _) => false,
                    (Some(e), i) => e.modify_index == i,
                };
                if ok {
                    self.set(key, value, *flags, None, 0, false);
                }
                Ok(ok)
            }
            KvOp::Lock {
                key,
                value,
                flags,
                session,
            } => self.lock(key, value, *flags, session).map(|e| e.is_some()),
            KvOp::Unlock {
                key,
                value,
                flags,
                session,
            } => Ok(self.unlock(key, value, *flags, session).is_some()),
            KvOp::Delete { key } => {
                self.delete(key);
                Ok(true)
            }
            KvOp::DeleteTree { prefix } => {
                self.delete_tree(prefix);
                Ok(true)
            }
            KvOp::DeleteCas { key, index } => {
                let ok = match self.entry(key) {
                    None => true,
                    Some(e) if e.modify_index == *index => {
                        self.delete(key);
                        true
                    }
                    Some(_) => false,
                };
                Ok(ok)
            }
            _ => Err("not a KV write".to_string()),
        }
    }

    /// Consul's `kvsLockTxn`; `Ok(None)` if another session holds the key.
    fn lock(
        &mut self,
        key: &str,
        value: &Bytes,
        flags: u64,
        session: &str,
    ) -> Result<Option<Entry>, String> {
        if session.is_empty() {
            return Err("missing session".to_string());
        }
        if !self.store.sessions.contains_key(session) {
            return Err(format!("invalid session {session:?}"));
        }
        let lock_index = match self.entry(key) {
            Some(e) if e.session.as_deref() == Some(session) => e.lock_index,
            Some(e) if e.session.is_some() => return Ok(None),
            Some(e) => e.lock_index + 1,
            None => 1,
        };
        Ok(Some(self.set(
            key,
            value,
            flags,
            Some(session.to_string()),
            lock_index,
            true,
        )))
    }

    /// Consul's `kvsUnlockTxn`; `None` unless `session` holds the key.
    fn unlock(&mut self, key: &str, value: &Bytes, flags: u64, session: &str) -> Option<Entry> {
        let e = self.entry(key)?;
        if e.session.as_deref() != Some(session) {
            return None;
        }
        let lock_index = e.lock_index;
        Some(self.set(key, value, flags, None, lock_index, true))
    }

    fn apply_txn_op(&mut self, op: &KvOp) -> Result<OpResult, String> {
        let no_value = |key: &str, e: &Entry| OpResult::Entry(e.to_pair(key, false));
        match op {
            KvOp::Set { key, value, flags } => {
                let e = self.set(key, value, *flags, None, 0, false);
                Ok(no_value(key, &e))
            }
            KvOp::Cas {
                key,
                value,
                flags,
                index,
            } => {
                if !self.apply_kv_op(op)? {
                    return Err(format!("failed to set key {key:?}, index is stale"));
                }
                let _ = (value, flags, index);
                let e = self
                    .entry(key)
                    .cloned()
                    .ok_or_else(|| format!("key {key:?} doesn't exist"))?;
                Ok(no_value(key, &e))
            }
            KvOp::Lock {
                key,
                value,
                flags,
                session,
            } => match self.lock(key, value, *flags, session)? {
                Some(e) => Ok(no_value(key, &e)),
                None => Err(format!("failed to lock key {key:?}, lock is already held")),
            },
            KvOp::Unlock {
                key,
                value,
                flags,
                session,
            } => match self.unlock(key, value, *flags, session) {
                Some(e) => Ok(no_value(key, &e)),
                None => Err(format!(
                    "failed to unlock key {key:?}, lock isn't held, or is held by another session"
                )),
            },
            KvOp::Get { key } => match self.entry(key) {
                Some(e) => Ok(OpResult::Entry(e.to_pair(key, true))),
                None => Err(format!("key {key:?} doesn't exist")),
            },
            KvOp::GetOrEmpty { key } => Ok(OpResult::Entry(match self.entry(key) {
                Some(e) => e.to_pair(key, true),
                None => KvPair {
                    key: key.clone(),
                    ..Default::default()
                },
            })),
            KvOp::GetTree { prefix } => Ok(OpResult::Entries(
                self.store
                    .prefix_range(prefix)
                    .map(|(k, e)| e.to_pair(k, true))
                    .collect(),
            )),
            KvOp::CheckIndex { key, index } => match self.entry(key) {
                None => Err(format!("failed to check index, key {key:?} doesn't exist")),
                Some(e) if e.modify_index != *index => Err(format!(
                    "failed index check for key {key:?}, current modify index {} != {}",
                    e.modify_index, index
                )),
                Some(e) => Ok(no_value(key, e)),
            },
            KvOp::CheckSession { key, session } => match self.entry(key) {
                None => Err(format!(
                    "failed to check session, key {key:?} doesn't exist"
                )),
                Some(e) if e.session.as_deref().unwrap_or("") != session => Err(format!(
                    "failed session check for key {key:?}, current session {:?} != {:?}",
                    e.session.as_deref().unwrap_or(""),
                    session
                )),
                Some(e) => Ok(no_value(key, e)),
            },
            KvOp::CheckNotExists { key } => match self.entry(key) {
                Some(_) => Err(format!("key {key:?} exists")),
                None => Ok(OpResult::None),
            },
            KvOp::Delete { .. } | KvOp::DeleteTree { .. } => {
                self.apply_kv_op(op)?;
                Ok(OpResult::None)
            }
            KvOp::DeleteCas { key, .. } => {
                if !self.apply_kv_op(op)? {
                    return Err(format!("failed to delete key {key:?}, index is stale"));
                }
                Ok(OpResult::None)
            }
            KvOp::Unknown { verb } => Err(format!("unknown KV verb {verb:?}")),
        }
    }

    /// Consul's `deleteSessionTxn`: release or delete every held key, set lock-delays.
    fn invalidate_session(&mut self, id: &str) {
        let Some(rec) = self.store.sessions.remove(id) else {
            return;
        };
        self.store.session_expiry.remove(id);
        let delay = rec.lock_delay.min(MAX_LOCK_DELAY);
        let keys: Vec<String> = self
            .store
            .held
            .get(id)
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default();
        for key in keys {
            match rec.behavior {
                Behavior::Release => {
                    if let Some(e) = self.entry(&key).cloned() {
                        let value = e.value.clone();
                        self.set(&key, &value, e.flags, None, e.lock_index, true);
                    }
                }
                Behavior::Delete => self.delete(&key),
            }
            if !delay.is_zero() {
                self.store.lock_delays.insert(key, self.now + delay);
            }
        }
        self.sessions_changed = true;
        self.changes.push(Change::SessionDestroy(id.to_string()));
    }

    fn abort(mut self) {
        while let Some(u) = self.undo.pop() {
            match u {
                Undo::Entry(k, old) => {
                    self.store.set_raw(&k, old);
                }
                Undo::Tombstone(k, old) => match old {
                    Some(t) => {
                        self.store.tombstones.insert(k, t);
                    }
                    None => {
                        self.store.tombstones.remove(&k);
                    }
                },
            }
        }
        self.store.kv_table_index = self.kv_table_index_before;
    }

    fn commit(self) -> Commit {
        if self.changes.is_empty() {
            return Commit::default();
        }
        self.store.index = self.idx;
        if self.sessions_changed {
            self.store.sessions_index = self.idx;
        }
        Commit {
            record: Some(Record {
                index: self.idx,
                changes: self.changes,
            }),
            changed_keys: self.changed_keys,
            sessions_changed: self.sessions_changed,
            checks: Vec::new(),
        }
    }
}

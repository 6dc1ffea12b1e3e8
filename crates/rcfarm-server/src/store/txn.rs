//! A write in progress: Consul's `kvs*Txn` and `deleteSessionTxn` semantics, op by op, with an
//! undo log. Ops see earlier ops' writes and either all stay ([`Tx::commit`]) or all are undone
//! ([`Tx::abort`]); this is pure state manipulation (no I/O, no clock but the `now` it is
//! given), so every write path, the KV endpoint's, `/v1/txn`'s and session invalidation's,
//! shares one implementation.

use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::indexes::Tombstone;
use super::{Behavior, Change, Commit, Entry, KvOp, Record, SessionRecord, Store};
use crate::consul::KvPair;

/// Consul caps the lock-delay applied at invalidation at 60 s.
pub const MAX_LOCK_DELAY: Duration = Duration::from_secs(60);

/// The key an op names, except for delete-tree (and unknown verbs), which may be empty.
pub(super) fn op_key(op: &KvOp) -> Option<&str> {
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

enum Undo {
    Entry(String, Option<Entry>),
    Tombstone(String, Option<Tombstone>),
}

/// A write in progress.
pub(super) struct Tx<'a> {
    /// Readable during a write (the pre-checks read lock-delays); written only through `Tx`.
    pub(super) store: &'a mut Store,
    idx: u64,
    now: Instant,
    undo: Vec<Undo>,
    changes: Vec<Change>,
    changed_keys: Vec<String>,
    kv_table_index_before: u64,
    sessions_changed: bool,
}

/// The answer of one op inside a transaction.
pub(super) enum OpResult {
    /// An entry to report (with its value only for the get verbs).
    Entry(KvPair),
    Entries(Vec<KvPair>),
    None,
}

impl Store {
    pub(super) fn begin(&mut self, now: Instant) -> Tx<'_> {
        let idx = self.next_index();
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
        let keys: Vec<std::sync::Arc<str>> = self
            .store
            .prefix_range(prefix)
            .map(|(k, _)| k.clone())
            .collect();
        if keys.is_empty() {
            return;
        }
        for k in &keys {
            let old = self.store.set_raw(k, None);
            self.undo.push(Undo::Entry(k.to_string(), old));
        }
        self.tombstone(prefix);
        self.store.kv_table_index = self.idx;
        self.changes.push(Change::DeleteTree(prefix.to_string()));
        self.changed_keys.extend(keys.iter().map(|k| k.to_string()));
    }

    /// Consul's `kvsSetTxn`: keeps `CreateIndex`, keeps the session unless the op manages it,
    /// and (1.x; not 0.7) skips the write entirely if nothing would change.
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
            && !self.store.identical_rewrites_bump
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
    pub(super) fn apply_kv_op(&mut self, op: &KvOp) -> Result<bool, String> {
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

    pub(super) fn apply_txn_op(&mut self, op: &KvOp) -> Result<OpResult, String> {
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

    /// Adds a session (already validated) at this write's index.
    pub(super) fn create_session(&mut self, mut rec: SessionRecord) {
        rec.create_index = self.idx;
        rec.modify_index = self.idx;
        self.store.insert_session(rec.clone(), self.now);
        self.sessions_changed = true;
        self.changes.push(Change::SessionCreate(rec));
    }

    /// Consul's `deleteSessionTxn`: release or delete every held key, set lock-delays.
    pub(super) fn invalidate_session(&mut self, id: &str) {
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

    pub(super) fn abort(mut self) {
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

    pub(super) fn commit(self) -> Commit {
        if self.changes.is_empty() {
            return Commit::default();
        }
        self.store.advance(self.idx, self.sessions_changed);
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

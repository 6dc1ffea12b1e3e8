//! The store's records and tables: KV entries, sessions and the ops that name them, and the
//! table primitives (prefix scans, setting an entry while keeping each session's held keys
//! right) that transactions, reads and log replay all build on. Nothing here knows about
//! indexes beyond the ones an entry or session carries.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::Store;
use crate::consul::{KvPair, ServiceCheck, SessionEntry};

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

/// One entry of a recursive read (`Store::list_prefix`), encoded as Consul's `api.KVPair`
/// exactly as [`KvPair`] is (a test holds the two to the same bytes). The value is the store's
/// own `Bytes`: a listing of a million pod labels copies no value.
#[derive(Debug, Clone)]
pub struct Listed {
    pub key: Arc<str>,
    pub entry: Entry,
}

impl Serialize for Listed {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use base64::Engine as _;
        use serde::ser::SerializeStruct as _;
        let e = &self.entry;
        let mut st = s.serialize_struct("KVPair", 6 + usize::from(e.session.is_some()))?;
        st.serialize_field("LockIndex", &e.lock_index)?;
        st.serialize_field("Key", &*self.key)?;
        st.serialize_field("Flags", &e.flags)?;
        // Consul's null for an empty value, as `KvPair` (`b64_opt`).
        let value = (!e.value.is_empty())
            .then(|| base64::engine::general_purpose::STANDARD.encode(&e.value));
        st.serialize_field("Value", &value)?;
        if let Some(session) = &e.session {
            st.serialize_field("Session", session)?;
        }
        st.serialize_field("CreateIndex", &e.create_index)?;
        st.serialize_field("ModifyIndex", &e.modify_index)?;
        st.end()
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

impl Store {
    pub(super) fn prefix_range<'a>(
        &'a self,
        prefix: &'a str,
    ) -> impl Iterator<Item = (&'a Arc<str>, &'a Entry)> + 'a {
        self.kv
            .range::<str, _>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Unbounded,
            ))
            .take_while(move |(k, _)| k.starts_with(prefix))
    }

    pub(super) fn insert_session(&mut self, rec: SessionRecord, now: Instant) {
        if let Some(ttl) = rec.ttl {
            self.session_expiry.insert(rec.id.clone(), now + ttl * 2);
        }
        self.sessions.insert(rec.id.clone(), rec);
    }

    /// Sets or removes an entry, keeping the per-session sets of held keys right.
    pub(super) fn set_raw(&mut self, key: &str, entry: Option<Entry>) -> Option<Entry> {
        let old = match entry {
            Some(e) => {
                if let Some(s) = &e.session {
                    self.held
                        .entry(s.clone())
                        .or_default()
                        .insert(key.to_string());
                }
                // An update keeps the key the map holds (no new allocation for it).
                match self.kv.get_mut(key) {
                    Some(slot) => Some(std::mem::replace(slot, e)),
                    None => self.kv.insert(Arc::from(key), e),
                }
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
}

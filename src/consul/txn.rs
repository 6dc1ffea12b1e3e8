//! `/v1/txn`: the KV operations of a transaction, its results, and its rollback errors.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use serde::{Deserialize, Serialize, Serializer};

use super::types::KvPair;

/// Consul refuses more operations than this before 1.14 (128 after); splitting at the lower limit
/// works with every version.
pub const MAX_TXN_OPS: usize = 64;

/// Refuses, before anything is sent, a transaction Consul would refuse for its size.
pub(super) fn check_op_count(count: usize) -> super::Result<()> {
    if count > MAX_TXN_OPS {
        return Err(super::ConsulError::TooManyOps {
            count,
            limit: MAX_TXN_OPS,
        });
    }
    Ok(())
}

/// A KV verb of `/v1/txn`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvVerb {
    Set,
    Cas,
    Lock,
    Unlock,
    Get,
    GetOrEmpty,
    GetTree,
    CheckIndex,
    CheckSession,
    CheckNotExists,
    Delete,
    DeleteTree,
    DeleteCas,
}

impl KvVerb {
    pub const ALL: [KvVerb; 13] = [
        KvVerb::Set,
        KvVerb::Cas,
        KvVerb::Lock,
        KvVerb::Unlock,
        KvVerb::Get,
        KvVerb::GetOrEmpty,
        KvVerb::GetTree,
        KvVerb::CheckIndex,
        KvVerb::CheckSession,
        KvVerb::CheckNotExists,
        KvVerb::Delete,
        KvVerb::DeleteTree,
        KvVerb::DeleteCas,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            KvVerb::Set => "set",
            KvVerb::Cas => "cas",
            KvVerb::Lock => "lock",
            KvVerb::Unlock => "unlock",
            KvVerb::Get => "get",
            KvVerb::GetOrEmpty => "get-or-empty",
            KvVerb::GetTree => "get-tree",
            KvVerb::CheckIndex => "check-index",
            KvVerb::CheckSession => "check-session",
            KvVerb::CheckNotExists => "check-not-exists",
            KvVerb::Delete => "delete",
            KvVerb::DeleteTree => "delete-tree",
            KvVerb::DeleteCas => "delete-cas",
        }
    }

    pub fn parse(s: &str) -> Option<KvVerb> {
        KvVerb::ALL.into_iter().find(|v| v.as_str() == s)
    }

    /// Whether Consul answers the op with a result (deletes and checks yield none).
    pub fn yields_result(self) -> bool {
        !matches!(
            self,
            KvVerb::Delete
                | KvVerb::DeleteTree
                | KvVerb::DeleteCas
                | KvVerb::CheckIndex
                | KvVerb::CheckSession
                | KvVerb::CheckNotExists
        )
    }

    /// Whether the verb only reads (a transaction of such verbs changes nothing).
    pub fn is_read(self) -> bool {
        matches!(
            self,
            KvVerb::Get
                | KvVerb::GetOrEmpty
                | KvVerb::GetTree
                | KvVerb::CheckIndex
                | KvVerb::CheckSession
                | KvVerb::CheckNotExists
        )
    }
}

/// One KV operation of a transaction. Build it with the constructors; they fill exactly the fields
/// the verb uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnOp {
    pub verb: KvVerb,
    pub key: String,
    pub value: Option<Vec<u8>>,
    pub flags: u64,
    pub index: u64,
    pub session: Option<String>,
}

impl TxnOp {
    fn new(verb: KvVerb, key: impl Into<String>) -> Self {
        Self {
            verb,
            key: key.into(),
            value: None,
            flags: 0,
            index: 0,
            session: None,
        }
    }

    pub fn set(key: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        Self {
            value: Some(value.into()),
            ..Self::new(KvVerb::Set, key)
        }
    }
    /// Write only if the key's `ModifyIndex` is `index` (0: only if the key does not exist).
    pub fn cas(key: impl Into<String>, value: impl Into<Vec<u8>>, index: u64) -> Self {
        Self {
            value: Some(value.into()),
            index,
            ..Self::new(KvVerb::Cas, key)
        }
    }
    pub fn lock(key: impl Into<String>, value: impl Into<Vec<u8>>, session: &str) -> Self {
        Self {
            value: Some(value.into()),
            session: Some(session.to_string()),
            ..Self::new(KvVerb::Lock, key)
        }
    }
    pub fn unlock(key: impl Into<String>, value: impl Into<Vec<u8>>, session: &str) -> Self {
        Self {
            value: Some(value.into()),
            session: Some(session.to_string()),
            ..Self::new(KvVerb::Unlock, key)
        }
    }
    pub fn get(key: impl Into<String>) -> Self {
        Self::new(KvVerb::Get, key)
    }
    pub fn get_or_empty(key: impl Into<String>) -> Self {
        Self::new(KvVerb::GetOrEmpty, key)
    }
    pub fn get_tree(prefix: impl Into<String>) -> Self {
        Self::new(KvVerb::GetTree, prefix)
    }
    pub fn check_index(key: impl Into<String>, index: u64) -> Self {
        Self {
            index,
            ..Self::new(KvVerb::CheckIndex, key)
        }
    }
    /// Fails the transaction unless `session` holds the key's lock: the fencing check.
    pub fn check_session(key: impl Into<String>, session: &str) -> Self {
        Self {
            session: Some(session.to_string()),
            ..Self::new(KvVerb::CheckSession, key)
        }
    }
    pub fn check_not_exists(key: impl Into<String>) -> Self {
        Self::new(KvVerb::CheckNotExists, key)
    }
    pub fn delete(key: impl Into<String>) -> Self {
        Self::new(KvVerb::Delete, key)
    }
    pub fn delete_tree(prefix: impl Into<String>) -> Self {
        Self::new(KvVerb::DeleteTree, prefix)
    }
    pub fn delete_cas(key: impl Into<String>, index: u64) -> Self {
        Self {
            index,
            ..Self::new(KvVerb::DeleteCas, key)
        }
    }

    pub fn with_flags(mut self, flags: u64) -> Self {
        self.flags = flags;
        self
    }
}

impl Serialize for TxnOp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        #[serde(rename_all = "PascalCase")]
        struct Kv<'a> {
            verb: &'a str,
            key: &'a str,
            #[serde(skip_serializing_if = "Option::is_none")]
            value: Option<String>,
            #[serde(skip_serializing_if = "is_zero")]
            flags: u64,
            #[serde(skip_serializing_if = "is_zero")]
            index: u64,
            #[serde(skip_serializing_if = "Option::is_none")]
            session: Option<&'a str>,
        }
        #[derive(Serialize)]
        struct Op<'a> {
            #[serde(rename = "KV")]
            kv: Kv<'a>,
        }
        Op {
            kv: Kv {
                verb: self.verb.as_str(),
                key: &self.key,
                value: self.value.as_ref().map(|v| B64.encode(v)),
                flags: self.flags,
                index: self.index,
                session: self.session.as_deref(),
            },
        }
        .serialize(s)
    }
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// The answer to a committed transaction: one entry per op that yields one (deletes yield none).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TxnResponse {
    pub results: Vec<KvPair>,
    /// `X-Consul-Index` if the server sent one.
    pub index: Option<u64>,
}

impl TxnResponse {
    /// The index the transaction committed at, as its results show it (0 when it wrote
    /// nothing that yields a result).
    pub fn commit_index(&self) -> u64 {
        self.results
            .iter()
            .map(|r| r.modify_index)
            .max()
            .unwrap_or(0)
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub(crate) struct WireTxnResponse {
    #[serde(default)]
    pub results: Option<Vec<WireTxnResult>>,
    #[serde(default)]
    pub errors: Option<Vec<TxnOpError>>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct WireTxnResult {
    #[serde(rename = "KV", default)]
    pub kv: Option<KvPair>,
}

/// One failed operation of a rolled-back transaction, as Consul reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct TxnOpError {
    pub op_index: usize,
    pub what: String,
}

/// Why an operation failed, read from Consul's message so callers can react without string
/// matching of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxnFailure {
    /// A `cas`, `delete-cas` or `check-index` saw another index.
    IndexStale,
    /// A `lock` found the key held by another session.
    LockHeld,
    /// A `lock` hit the key's lock-delay.
    LockDelay,
    /// A `check-session` found another (or no) session: the caller lost the lock.
    SessionMismatch,
    /// An `unlock` of a key the session does not hold.
    NotLockHolder,
    /// A `check-not-exists` found the key.
    KeyExists,
    /// A `get`, `check-index` or `check-session` found no key.
    KeyMissing,
    /// A `lock` with a session Consul does not know.
    InvalidSession,
    /// The server does not know the verb (Consul 0.7 lacks `get-or-empty`, `check-not-exists`).
    UnknownVerb,
    Other,
}

impl TxnOpError {
    pub fn failure(&self) -> TxnFailure {
        let w = self.what.as_str();
        // Consul ≥ 1.19.1 says "unknown KV operation: x", older ones `unknown KV verb "x"`.
        if w.starts_with("unknown KV verb") || w.starts_with("unknown KV operation") {
            TxnFailure::UnknownVerb
        } else if w.starts_with("invalid session") {
            TxnFailure::InvalidSession
        } else if w.contains("due to lock delay") {
            TxnFailure::LockDelay
        } else if w.contains("lock is already held") {
            TxnFailure::LockHeld
        } else if w.contains("lock isn't held") {
            TxnFailure::NotLockHolder
        } else if w.starts_with("failed session check") {
            TxnFailure::SessionMismatch
        } else if w.contains("index is stale") || w.starts_with("failed index check") {
            TxnFailure::IndexStale
        } else if w.contains("doesn't exist") {
            TxnFailure::KeyMissing
        } else if w.ends_with("exists") {
            TxnFailure::KeyExists
        } else {
            TxnFailure::Other
        }
    }
}

impl std::fmt::Display for TxnOpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "op {}: {}", self.op_index, self.what)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_serialize_as_consul_expects() {
        let v = serde_json::to_value(TxnOp::cas("a", b"x".to_vec(), 9).with_flags(3)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"KV": {"Verb": "cas", "Key": "a", "Value": "eA==", "Flags": 3, "Index": 9}})
        );
        let v = serde_json::to_value(TxnOp::check_session("lock/x", "s")).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"KV": {"Verb": "check-session", "Key": "lock/x", "Session": "s"}})
        );
        for verb in KvVerb::ALL {
            assert_eq!(KvVerb::parse(verb.as_str()), Some(verb));
        }
    }

    #[test]
    fn failures_are_classified() {
        let cases = [
            (
                r#"failed to set key "k", index is stale"#,
                TxnFailure::IndexStale,
            ),
            (
                r#"failed to lock key "k", lock is already held"#,
                TxnFailure::LockHeld,
            ),
            (
                r#"failed to lock key "k" due to lock delay"#,
                TxnFailure::LockDelay,
            ),
            (
                r#"failed session check for key "k", current session "a" != "b""#,
                TxnFailure::SessionMismatch,
            ),
            (r#"key "k" exists"#, TxnFailure::KeyExists),
            (r#"key "k" doesn't exist"#, TxnFailure::KeyMissing),
            (
                r#"failed to check session, key "k" doesn't exist"#,
                TxnFailure::KeyMissing,
            ),
            (
                r#"failed index check for key "k", current modify index 3 != 4"#,
                TxnFailure::IndexStale,
            ),
            (
                r#"failed to unlock key "k", lock isn't held, or is held by another session"#,
                TxnFailure::NotLockHolder,
            ),
            (r#"invalid session "x""#, TxnFailure::InvalidSession),
            (r#"unknown KV verb "x""#, TxnFailure::UnknownVerb),
            ("unknown KV operation: x", TxnFailure::UnknownVerb),
        ];
        for (what, want) in cases {
            let e = TxnOpError {
                op_index: 0,
                what: what.into(),
            };
            assert_eq!(e.failure(), want, "{what}");
        }
    }
}

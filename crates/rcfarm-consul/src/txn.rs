//! `/v1/txn`: the KV operations of a transaction, its results, and its rollback errors.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use serde::{Deserialize, Serialize, Serializer};

use super::types::KvPair;

/// Consul refuses more operations than this before 1.14 (128 after); splitting at the lower limit
/// works with every version.
pub const MAX_TXN_OPS: usize = 64;

/// The largest transaction body to send: Consul 1.x refuses a body over `txn_max_req_len`
/// (512 KiB by default; `kv_max_value_size` if larger), Consul 0.7 a transaction whose values
/// add up to more than 512 KiB (and a body is larger than its decoded values).
pub const MAX_TXN_BYTES: usize = 512 * 1024;

/// What one transaction may carry when ops are split over several.
#[derive(Debug, Clone, Copy)]
pub struct TxnBudget {
    /// Most groups (of ops that must go together) per transaction.
    pub groups: usize,
    pub ops: usize,
    /// Most body bytes ([`TxnOp::encoded_len`] of the ops, with the array's commas).
    pub bytes: usize,
}

/// The bytes `ops` add to a transaction body: each op's JSON and a comma.
pub fn encoded_len(ops: &[TxnOp]) -> usize {
    ops.iter().map(|op| op.encoded_len() + 1).sum()
}

/// Splits `groups` (each a set of ops that must be in one transaction) into runs of
/// consecutive groups that each fit `budget`, in order. A group that does not fit alone gets a
/// run of its own: Consul's 413 then names what was too big.
pub fn split_to_fit(groups: &[Vec<TxnOp>], budget: TxnBudget) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let (mut start, mut ops, mut bytes) = (0, 0, 0);
    for (i, g) in groups.iter().enumerate() {
        let (n, b) = (g.len(), encoded_len(g));
        let fits = i - start < budget.groups && ops + n <= budget.ops && bytes + b <= budget.bytes;
        if i > start && !fits {
            runs.push(start..i);
            (start, ops, bytes) = (i, 0, 0);
        }
        ops += n;
        bytes += b;
    }
    if start < groups.len() {
        runs.push(start..groups.len());
    }
    runs
}

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

    /// The length of this op's JSON in a transaction body, as [`Serialize`] writes it, without
    /// writing it: batches are cut by it.
    pub fn encoded_len(&self) -> usize {
        fn digits(mut n: u64) -> usize {
            let mut d = 1;
            while n >= 10 {
                n /= 10;
                d += 1;
            }
            d
        }
        // `{"KV":{"Verb":"…","Key":"…"` and `}}`.
        let mut len = 7 + 8 + self.verb.as_str().len() + 1 + 8 + json_str_len(&self.key) + 1 + 2;
        if let Some(v) = &self.value {
            len += 10 + v.len().div_ceil(3) * 4 + 1;
        }
        if self.flags != 0 {
            len += 9 + digits(self.flags);
        }
        if self.index != 0 {
            len += 9 + digits(self.index);
        }
        if let Some(s) = &self.session {
            len += 12 + json_str_len(s) + 1;
        }
        len
    }
}

/// The length of `s` inside a JSON string, as serde_json escapes it.
fn json_str_len(s: &str) -> usize {
    s.len()
        + s.bytes()
            .map(|b| match b {
                b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 1,
                0..=0x1f => 5,
                _ => 0,
            })
            .sum::<usize>()
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
    /// The answer's size in bytes, as sent.
    pub body_len: usize,
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

/// What a committed transaction tells the caller whose ops it carried (alone or batched with
/// others': [`crate::Consul::txn_coalesced`]): the index it committed at (0 when none of the
/// caller's ops yields a result), and the `ModifyIndex` Consul gave each key the caller set.
/// That is not always the commit index: Consul 1.x leaves an entry a write did not change
/// (same value, flags and session) as it was, `ModifyIndex` included, and answers with it;
/// Consul 0.7 moves it to the commit index. A cache of what was written must take the key's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Committed {
    pub index: u64,
    written: Vec<(String, u64)>,
}

impl Committed {
    /// From the answer to a transaction that carried `ops` (and maybe other callers' ops:
    /// only results for keys `ops` set are kept), committed at `index` for this caller.
    pub fn of(index: u64, ops: &[TxnOp], results: &[KvPair]) -> Self {
        let keys: std::collections::HashSet<&str> = ops
            .iter()
            .filter(|op| {
                matches!(
                    op.verb,
                    KvVerb::Set | KvVerb::Cas | KvVerb::Lock | KvVerb::Unlock
                )
            })
            .map(|op| op.key.as_str())
            .collect();
        let written = results
            .iter()
            .filter(|r| keys.contains(r.key.as_str()))
            .map(|r| (r.key.clone(), r.modify_index))
            .collect();
        Committed { index, written }
    }

    /// The `ModifyIndex` of `key` after the commit, if the caller set it. A check on the same
    /// key earlier in the transaction answers too, with the index before the write: the
    /// write's result comes after it, so the last one counts.
    pub fn modify_index(&self, key: &str) -> Option<u64> {
        self.written
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, i)| *i)
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
    fn encoded_len_is_the_serialized_length() {
        let ops = [
            TxnOp::set("a", b"x".to_vec()),
            TxnOp::set("intent/node-1/web", vec![7u8; 200 * 1024 + 1]),
            TxnOp::set("e", Vec::new()),
            TxnOp::cas("k\"q\\\n\u{1}\u{7f}é", b"yz".to_vec(), 0),
            TxnOp::cas("k", b"abc".to_vec(), 1234567890).with_flags(u64::MAX),
            TxnOp::check_session("lock/replication_controllers/x", "3f2a-…"),
            TxnOp::check_index("r", 9),
            TxnOp::delete_tree("p/"),
            TxnOp::lock("l", b"me".to_vec(), "s\t"),
        ];
        for op in &ops {
            assert_eq!(
                op.encoded_len(),
                serde_json::to_vec(op).unwrap().len(),
                "{op:?}"
            );
        }
        // A body: the ops, the commas between them and the brackets.
        let body = serde_json::to_vec(&ops).unwrap().len();
        assert_eq!(encoded_len(&ops) + 1, body);
    }

    #[test]
    fn splits_keep_every_run_under_the_budget_and_groups_whole() {
        let manifest = vec![b'm'; 200 * 1024];
        let node = |i: usize| {
            vec![
                TxnOp::set(format!("intent/node-{i}/web"), manifest.clone()),
                TxnOp::set(format!("labels/pod/node-{i}/web"), b"{}".to_vec()),
            ]
        };
        let groups: Vec<Vec<TxnOp>> = (0..7).map(node).collect();
        let budget = TxnBudget {
            groups: 15,
            ops: 60,
            bytes: MAX_TXN_BYTES - 4096,
        };
        let runs = split_to_fit(&groups, budget);
        // 200 KiB is ~273 KiB in base64: one node per transaction.
        assert_eq!(runs, (0..7).map(|i| i..i + 1).collect::<Vec<_>>());
        let small: Vec<Vec<TxnOp>> = (0..40)
            .map(|i| vec![TxnOp::set(format!("intent/n{i}/web"), b"id: web".to_vec()); 2])
            .collect();
        // Small manifests: cut by the group cap only, as before.
        assert_eq!(split_to_fit(&small, budget), vec![0..15, 15..30, 30..40]);
        assert_eq!(
            split_to_fit(&small, TxnBudget { ops: 7, ..budget }),
            (0..14)
                .map(|i| i * 3..(i * 3 + 3).min(40))
                .collect::<Vec<_>>()
        );
        // Mixed sizes: every run fits, nothing is lost or reordered, and an oversized group
        // goes alone.
        let mut mixed = groups.clone();
        mixed.insert(3, vec![TxnOp::set("huge", vec![0u8; 600 * 1024])]);
        mixed.extend(small.iter().take(5).cloned());
        let runs = split_to_fit(&mixed, budget);
        let mut next = 0;
        for r in &runs {
            assert_eq!(r.start, next);
            next = r.end;
            let bytes = encoded_len(&mixed[r.clone()].concat());
            assert!(bytes <= budget.bytes || r.len() == 1, "{r:?}: {bytes}");
        }
        assert_eq!(next, mixed.len());
        assert!(runs.contains(&(3..4)));
        assert!(split_to_fit(&[], budget).is_empty());
    }

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

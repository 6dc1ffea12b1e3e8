//! Consul's JSON shapes, shared by the client and the embedded server so both speak the same wire
//! format. Field order follows Consul's own structs; clients must not depend on it.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// One KV entry as Consul returns it (`api.KVPair`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "PascalCase")]
pub struct KvPair {
    #[serde(default)]
    pub lock_index: u64,
    pub key: String,
    #[serde(default)]
    pub flags: u64,
    /// `None` is Consul's `null` (no value, or an empty one).
    #[serde(default, with = "b64_opt")]
    pub value: Option<Vec<u8>>,
    /// The session holding the key's lock; Consul omits the field when unlocked.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "empty_string_as_none"
    )]
    pub session: Option<String>,
    #[serde(default)]
    pub create_index: u64,
    #[serde(default)]
    pub modify_index: u64,
}

impl KvPair {
    /// The value's bytes; an absent value reads as empty.
    pub fn value_bytes(&self) -> &[u8] {
        self.value.as_deref().unwrap_or(&[])
    }

    /// The value as UTF-8 text, if it is.
    pub fn value_str(&self) -> Option<&str> {
        std::str::from_utf8(self.value_bytes()).ok()
    }
}

/// A session as `/v1/session/info` and `/v1/session/list` return it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "PascalCase")]
pub struct SessionEntry {
    #[serde(rename = "ID")]
    pub id: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub node: String,
    /// Nanoseconds, as Go's `time.Duration` marshals.
    #[serde(default)]
    pub lock_delay: u64,
    #[serde(default)]
    pub behavior: String,
    /// Kept exactly as the creator sent it (`"15s"`); empty when the session has no TTL.
    #[serde(rename = "TTL", default)]
    pub ttl: String,
    #[serde(default)]
    pub node_checks: Option<Vec<String>>,
    #[serde(default)]
    pub service_checks: Option<Vec<ServiceCheck>>,
    /// Consul 0.7 reports checks here instead of `NodeChecks`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checks: Option<Vec<String>>,
    #[serde(default)]
    pub create_index: u64,
    #[serde(default)]
    pub modify_index: u64,
}

impl SessionEntry {
    /// The TTL as a duration, if the session has one and it parses.
    pub fn ttl_duration(&self) -> Option<Duration> {
        if self.ttl.is_empty() {
            return None;
        }
        crate::util::parse_go_duration(&self.ttl)
            .ok()
            .and_then(|d| d.positive())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "PascalCase")]
pub struct ServiceCheck {
    #[serde(rename = "ID")]
    pub id: String,
    #[serde(default)]
    pub namespace: String,
}

/// What happens to a session's locks when it is invalidated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SessionBehavior {
    #[default]
    Release,
    Delete,
}

impl SessionBehavior {
    pub fn as_str(self) -> &'static str {
        match self {
            SessionBehavior::Release => "release",
            SessionBehavior::Delete => "delete",
        }
    }
}

/// The body of `PUT /v1/session/create`.
#[derive(Debug, Clone, Default)]
pub struct SessionRequest {
    pub name: Option<String>,
    pub node: Option<String>,
    pub lock_delay: Option<Duration>,
    pub behavior: Option<SessionBehavior>,
    pub ttl: Option<Duration>,
    pub node_checks: Option<Vec<String>>,
}

impl Serialize for SessionRequest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(None)?;
        if let Some(n) = &self.name {
            m.serialize_entry("Name", n)?;
        }
        if let Some(n) = &self.node {
            m.serialize_entry("Node", n)?;
        }
        if let Some(d) = self.lock_delay {
            m.serialize_entry("LockDelay", &crate::util::format_go_duration(d))?;
        }
        if let Some(b) = self.behavior {
            m.serialize_entry("Behavior", b.as_str())?;
        }
        if let Some(t) = self.ttl {
            m.serialize_entry("TTL", &crate::util::format_go_duration(t))?;
        }
        if let Some(c) = &self.node_checks {
            m.serialize_entry("NodeChecks", c)?;
        }
        m.end()
    }
}

/// Options of a read: consistency and, for a blocking query, the index to wait past.
#[derive(Debug, Clone, Default)]
pub struct QueryOptions {
    /// Block until the result's index exceeds this one (0: do not block).
    pub index: u64,
    /// How long the server may hold a blocking query (Consul's default is 5 min).
    pub wait: Option<Duration>,
    pub consistent: bool,
    pub stale: bool,
    /// How many bytes the answer is expected to be (a watch's last answer, say), so that its
    /// body is read into one buffer of about that size; 0: no idea.
    pub size_hint: usize,
}

impl QueryOptions {
    pub fn blocking(index: u64, wait: Duration) -> Self {
        Self {
            index,
            wait: Some(wait),
            ..Default::default()
        }
    }
}

/// What the `X-Consul-*` headers of a read said, and how big the answer was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QueryMeta {
    pub index: u64,
    pub known_leader: bool,
    pub last_contact: Duration,
    /// Bytes in the response body: what it cost to send and decode.
    pub body_len: usize,
    /// The server's wall clock when it answered (its `Date` header, unix seconds), if sent:
    /// a time every farm reads alike, whatever its own host's clock says.
    pub date: Option<i64>,
}

pub(crate) mod b64_opt {
    use super::*;

    pub fn serialize<S: Serializer>(v: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(b) if !b.is_empty() => s.serialize_str(&B64.encode(b)),
            _ => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        let s: Option<String> = Option::deserialize(d)?;
        match s {
            None => Ok(None),
            Some(s) => B64
                .decode(s.as_bytes())
                .map(Some)
                .map_err(serde::de::Error::custom),
        }
    }
}

fn empty_string_as_none<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let s: Option<String> = Option::deserialize(d)?;
    Ok(s.filter(|s| !s.is_empty()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_pair_round_trips_consul_json() {
        let json = r#"{"LockIndex":1,"Key":"a/b","Flags":42,"Value":"aGVsbG8=","Session":"s1","CreateIndex":5,"ModifyIndex":7}"#;
        let kv: KvPair = serde_json::from_str(json).unwrap();
        assert_eq!(kv.value_bytes(), b"hello");
        assert_eq!(kv.session.as_deref(), Some("s1"));
        assert_eq!(serde_json::to_string(&kv).unwrap(), json);

        let unlocked: KvPair =
            serde_json::from_str(r#"{"Key":"k","Value":null,"Session":"","ModifyIndex":3}"#)
                .unwrap();
        assert_eq!(unlocked.session, None);
        assert_eq!(unlocked.value, None);
        let out = serde_json::to_string(&unlocked).unwrap();
        assert!(!out.contains("Session"), "{out}");
        assert!(out.contains(r#""Value":null"#));
    }

    #[test]
    fn session_request_uses_go_durations() {
        let req = SessionRequest {
            name: Some("farm".into()),
            ttl: Some(Duration::from_secs(15)),
            lock_delay: Some(Duration::from_millis(500)),
            behavior: Some(SessionBehavior::Delete),
            ..Default::default()
        };
        let v: serde_json::Value = serde_json::to_value(&req).unwrap();
        assert_eq!(v["TTL"], "15s");
        assert_eq!(v["LockDelay"], "500ms");
        assert_eq!(v["Behavior"], "delete");
        assert!(v.get("Node").is_none());
    }
}

/// A Consul session's id, as `/v1/session/create` returns it: what a lock is held by and what
/// every fenced write checks. A type of its own so a session id is never mistaken for a farm
/// id, a key or a lock's value.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SessionId(String);

impl SessionId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<String> for SessionId {
    fn from(s: String) -> SessionId {
        SessionId(s)
    }
}

impl From<&str> for SessionId {
    fn from(s: &str) -> SessionId {
        SessionId(s.to_string())
    }
}

impl From<SessionId> for String {
    fn from(s: SessionId) -> String {
        s.0
    }
}

impl std::ops::Deref for SessionId {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for SessionId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl std::borrow::Borrow<str> for SessionId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl PartialEq<str> for SessionId {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<String> for SessionId {
    fn eq(&self, other: &String) -> bool {
        &self.0 == other
    }
}

impl PartialEq<SessionId> for String {
    fn eq(&self, other: &SessionId) -> bool {
        *self == other.0
    }
}

impl PartialEq<SessionId> for str {
    fn eq(&self, other: &SessionId) -> bool {
        *self == other.0
    }
}

//! The replication controller record, exactly as P2 stores it in `replication_controllers/<uuid>`,
//! and its validation.

use std::fmt;
use std::sync::Arc;

use serde::Serialize;
use serde_json::{Map, Value};
use uuid::Uuid;

use super::manifest::{Manifest, ManifestError};
use crate::labels::{LabelSet, Selector, SelectorError};
use crate::util::describe_json as found;

pub const RC_PREFIX: &str = "replication_controllers/";
pub const RC_LOCK_PREFIX: &str = "lock/replication_controllers/";
/// The label naming the RC that owns a pod.
pub const RC_ID_LABEL: &str = "replication_controller_id";
/// The label naming a pod's (or an RC's) pod id.
pub const POD_ID_LABEL: &str = "pod_id";
/// The field rcfarm's own writers stamp on an RC record with the id of the change's audit
/// record, so the owning farm can tell those changes (audited already) from direct KV writes.
pub const CHANGE_MARKER: &str = "rcfarm_change_id";
/// The field a rolling update stamps on its old RC when it retires it (the new RC complete, the
/// old one enabled at a count to remove its leftover pods): `{"roll": <id>, "replicas": N}`.
/// The roll charged the farm's removal budget for the capacity that goes (see
/// `crate::failsafe`), so the old RC's task does not charge it again while its record is as
/// the roll wrote it. Any other change of the record drops it.
pub const RETIRE_MARKER: &str = "rcfarm_retired_by";

/// An RC's id: a UUID, written in its canonical lowercase form.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RcId(Uuid);

impl RcId {
    /// The id as a number (for digests of id sets).
    pub fn as_u128(&self) -> u128 {
        self.0.as_u128()
    }

    /// A digest of a set of ids: how many, and their numbers xor-ed. Equal sets give equal
    /// digests; the farm's loop compares digests to tell "the same RCs as last time" without
    /// keeping a copy of a set of thousands (ids are random, so unequal sets collide only by
    /// design, never by accident).
    pub fn digest<'a>(ids: impl IntoIterator<Item = &'a RcId>) -> (u64, u128) {
        ids.into_iter()
            .fold((0, 0), |(n, x), id| (n + 1, x ^ id.as_u128()))
    }

    pub fn new() -> RcId {
        RcId(Uuid::new_v4())
    }

    /// The id as it is displayed, written into `buf` instead of a new string (the claim
    /// assignment hashes every RC's id once per farm at every change).
    pub fn encode<'b>(&self, buf: &'b mut [u8; 36]) -> &'b str {
        self.0.hyphenated().encode_lower(buf)
    }

    /// Parses an id as it appears in keys: only the canonical lowercase hyphenated form, since
    /// any other spelling names a different Consul key.
    pub fn parse(s: &str) -> Result<RcId, String> {
        let u = Uuid::parse_str(s).map_err(|e| format!("{s:?} is not a UUID ({e})"))?;
        // Compared in a stack buffer: every farm parses every RC and lock key of each answer.
        if RcId(u).encode(&mut [0u8; 36]) != s {
            return Err(format!(
                "{s:?} is not a canonical lowercase UUID (write it as {})",
                u.hyphenated()
            ));
        }
        Ok(RcId(u))
    }

    /// `replication_controllers/<id>`.
    pub fn key(&self) -> String {
        format!("{RC_PREFIX}{self}")
    }

    /// The ownership lock, held by the farm serving the RC.
    pub fn ownership_lock_key(&self) -> String {
        format!("{RC_LOCK_PREFIX}{self}")
    }

    /// The mutation lock (node transfers, rolling updates). The name `update` is P2's.
    pub fn mutation_lock_key(&self) -> String {
        format!("{RC_LOCK_PREFIX}{self}/update")
    }

    /// P2's node-transfer lock: held by anyone, it freezes the RC's node transfers.
    pub fn node_transfer_lock_key(&self) -> String {
        format!("{RC_LOCK_PREFIX}{self}/node_transfer")
    }

    /// P2's status keys of the RC (its node transfer in flight, and rcfarm's record of when it
    /// started, beside it): `status/replication_controllers/<id>/`.
    pub fn status_prefix(&self) -> String {
        format!("status/replication_controllers/{self}/")
    }

    /// The value a node transfer writes into the mutation lock it holds.
    pub fn node_transfer_holder(&self) -> String {
        format!("rc-node-transfer-{self}")
    }

    /// The id from an RC key, if the key is one.
    pub fn from_key(key: &str) -> Option<Result<RcId, String>> {
        key.strip_prefix(RC_PREFIX).map(RcId::parse)
    }
}

impl Default for RcId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for RcId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.hyphenated())
    }
}

impl fmt::Debug for RcId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RcId({self})")
    }
}

impl std::str::FromStr for RcId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RcId::parse(s)
    }
}

impl Serialize for RcId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for RcId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        RcId::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// Where the RC may place pods beyond the nodes its selector already matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AllocationStrategy {
    /// May ask the scheduler for more nodes and move pods off ineligible nodes.
    Dynamic,
    /// Only the nodes the selector matches. (An empty strategy, found in old P2 records, means
    /// this too.)
    Static,
}

impl AllocationStrategy {
    /// Reads a stored strategy as P2 does: `dynamic_strategy` is dynamic, anything else is
    /// static (`p2-rctl create --allocation-strategy` writes whatever it is given, `static`
    /// say, and P2 serves such RCs as static ones).
    pub fn from_p2(s: &str) -> AllocationStrategy {
        match s {
            "dynamic_strategy" => AllocationStrategy::Dynamic,
            _ => AllocationStrategy::Static,
        }
    }

    /// Why a stored strategy deserves a warning (P2 reads it as static; so do we), if it does.
    pub fn unusual(s: &str) -> Option<String> {
        match s {
            "dynamic_strategy" | "static_strategy" | "" => None,
            other => Some(format!(
                "allocation_strategy {other:?} is neither \"static_strategy\" nor \"dynamic_strategy\"; \
                 served as static_strategy, as P2 does"
            )),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            AllocationStrategy::Dynamic => "dynamic_strategy",
            AllocationStrategy::Static => "static_strategy",
        }
    }
}

/// The record as stored (P2's `RawRC`): every field P2 writes, in P2's order, plus any fields
/// someone else added, kept so a rewrite loses nothing.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RawRc {
    pub id: String,
    pub manifest: Arc<str>,
    pub node_selector: String,
    pub pod_labels: Option<LabelSet>,
    pub replicas_desired: Option<i64>,
    pub disabled: bool,
    pub allocation_strategy: String,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// What is wrong with a stored RC.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RcProblem {
    #[error("not JSON: {0}")]
    BadJson(String),
    #[error("the record must be a JSON object, found {0}")]
    NotAnObject(&'static str),
    #[error("field `{field}` must be {expected}, found {found}")]
    WrongType {
        field: &'static str,
        expected: &'static str,
        found: String,
    },
    #[error(
        "field `replicas_desired` is missing; a record without it is rejected rather than read as 0 replicas"
    )]
    MissingReplicas,
    #[error("the key is not a valid RC key: {0}")]
    BadKey(String),
    #[error("field `id` is {id:?} but the key says {key_id}")]
    IdMismatch { id: String, key_id: String },
    #[error("field `replicas_desired` is {0}; it must be 0 or more")]
    NegativeReplicas(i64),
    #[error("field `node_selector`: {0}")]
    BadSelector(SelectorError),
    #[error("field `manifest`: {0}")]
    BadManifest(ManifestError),
    #[error("field `pod_labels`: {0}")]
    BadPodLabel(String),
}

impl RcProblem {
    /// A short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            RcProblem::BadJson(_) | RcProblem::NotAnObject(_) | RcProblem::WrongType { .. } => {
                "malformed"
            }
            RcProblem::MissingReplicas => "missing_replicas",
            RcProblem::BadKey(_) | RcProblem::IdMismatch { .. } => "bad_id",
            RcProblem::NegativeReplicas(_) => "negative_replicas",
            RcProblem::BadSelector(_) => "bad_selector",
            RcProblem::BadManifest(_) => "bad_manifest",
            RcProblem::BadPodLabel(_) => "bad_pod_label",
        }
    }
}

/// A stored RC that cannot be acted on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{key}: {problem}")]
pub struct InvalidRc {
    pub key: String,
    pub modify_index: u64,
    pub problem: RcProblem,
}

impl RawRc {
    /// Decodes a stored record, naming the field that is wrong.
    pub fn from_json(bytes: &[u8]) -> Result<RawRc, RcProblem> {
        let v: Value =
            serde_json::from_slice(bytes).map_err(|e| RcProblem::BadJson(e.to_string()))?;
        let Value::Object(mut m) = v else {
            return Err(RcProblem::NotAnObject(crate::util::json_kind(&v)));
        };
        let mut string = |field: &'static str| -> Result<String, RcProblem> {
            match m.remove(field) {
                None | Some(Value::Null) => Ok(String::new()),
                Some(Value::String(s)) => Ok(s),
                Some(other) => Err(RcProblem::WrongType {
                    field,
                    expected: "a string",
                    found: found(&other),
                }),
            }
        };
        let id = string("id")?;
        let manifest = string("manifest")?;
        let node_selector = string("node_selector")?;
        let allocation_strategy = string("allocation_strategy")?;
        let pod_labels = match m.remove("pod_labels") {
            None | Some(Value::Null) => None,
            Some(Value::Object(o)) => Some(
                o.into_iter()
                    .map(|(k, v)| match v {
                        Value::String(s) => Ok((k, s)),
                        other => Err(RcProblem::WrongType {
                            field: "pod_labels",
                            expected: "an object of string values",
                            found: format!("{k:?}: {}", found(&other)),
                        }),
                    })
                    .collect::<Result<LabelSet, _>>()?,
            ),
            Some(other) => {
                return Err(RcProblem::WrongType {
                    field: "pod_labels",
                    expected: "an object",
                    found: found(&other),
                });
            }
        };
        let replicas_desired = match m.remove("replicas_desired") {
            None | Some(Value::Null) => None,
            Some(Value::Number(n)) if n.as_i64().is_some() => n.as_i64(),
            Some(other) => {
                return Err(RcProblem::WrongType {
                    field: "replicas_desired",
                    expected: "an integer",
                    found: found(&other),
                });
            }
        };
        let disabled = match m.remove("disabled") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => b,
            Some(other) => {
                return Err(RcProblem::WrongType {
                    field: "disabled",
                    expected: "true or false",
                    found: found(&other),
                });
            }
        };
        Ok(RawRc {
            id,
            manifest: manifest.into(),
            node_selector,
            pod_labels,
            replicas_desired,
            disabled,
            allocation_strategy,
            // The parsed object keeps room for every field taken out of it: ~650 bytes per RC
            // for nothing, in every farm's listing of every RC. Unknown fields are rare.
            extra: if m.is_empty() {
                Map::new()
            } else {
                m.into_iter().collect()
            },
        })
    }

    pub fn to_json(&self) -> Vec<u8> {
        // Strings, maps of strings, numbers and JSON values always serialize.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// A valid RC: everything parsed and checked.
#[derive(Debug, Clone)]
pub struct Rc {
    pub id: RcId,
    pub manifest: Manifest,
    /// Shared: a listing holds equal selectors once.
    pub node_selector: Arc<Selector>,
    pub pod_labels: LabelSet,
    pub replicas_desired: u64,
    pub disabled: bool,
    pub strategy: AllocationStrategy,
    /// The key's `ModifyIndex` when read (0 for one not stored yet).
    pub modify_index: u64,
    /// The record as stored, to rewrite it without losing fields.
    pub raw: RawRc,
}

impl Rc {
    /// Parses and validates the value of `replication_controllers/<id>`.
    pub fn from_kv(key: &str, value: &[u8], modify_index: u64) -> Result<Rc, InvalidRc> {
        let invalid = |problem| InvalidRc {
            key: key.to_string(),
            modify_index,
            problem,
        };
        let key_id = match RcId::from_key(key) {
            Some(Ok(id)) => id,
            Some(Err(e)) => return Err(invalid(RcProblem::BadKey(e))),
            None => return Err(invalid(RcProblem::BadKey(format!("not under {RC_PREFIX}")))),
        };
        let raw = RawRc::from_json(value).map_err(invalid)?;
        Rc::from_raw(key_id, raw, modify_index).map_err(invalid)
    }

    /// Validates a decoded record for the RC `key_id`.
    pub fn from_raw(key_id: RcId, raw: RawRc, modify_index: u64) -> Result<Rc, RcProblem> {
        let replicas = raw.replicas_desired.ok_or(RcProblem::MissingReplicas)?;
        if raw.id != key_id.to_string() {
            return Err(RcProblem::IdMismatch {
                id: raw.id.clone(),
                key_id: key_id.to_string(),
            });
        }
        if replicas < 0 {
            return Err(RcProblem::NegativeReplicas(replicas));
        }
        let node_selector =
            Arc::new(Selector::parse(&raw.node_selector).map_err(RcProblem::BadSelector)?);
        let manifest =
            Manifest::parse_shared(raw.manifest.clone()).map_err(RcProblem::BadManifest)?;
        let strategy = AllocationStrategy::from_p2(&raw.allocation_strategy);
        let pod_labels = raw.pod_labels.clone().unwrap_or_default();
        for k in pod_labels.keys() {
            if k.is_empty() {
                return Err(RcProblem::BadPodLabel("a label key is empty".into()));
            }
        }
        Ok(Rc {
            id: key_id,
            manifest,
            node_selector,
            pod_labels,
            replicas_desired: replicas as u64,
            disabled: raw.disabled,
            strategy,
            modify_index,
            raw,
        })
    }

    pub fn pod_id(&self) -> &str {
        self.manifest.pod_id()
    }

    /// The roll that retired this RC and the replica count it left it at, if the record is
    /// as that roll wrote it ([`RETIRE_MARKER`], and the count unchanged since).
    pub fn retired_by(&self) -> Option<RcId> {
        let m = self.raw.extra.get(RETIRE_MARKER)?;
        let roll = RcId::parse(m.get("roll")?.as_str()?).ok()?;
        let replicas = m.get("replicas")?.as_u64()?;
        (replicas == self.replicas_desired && !self.disabled).then_some(roll)
    }

    /// The labels the RC puts on each of its pods: its `pod_labels` plus `pod_id` and
    /// `replication_controller_id` (which win over user labels of the same name).
    pub fn labels_for_pods(&self) -> LabelSet {
        let mut l = self.pod_labels.clone();
        l.insert(POD_ID_LABEL.to_string(), self.pod_id().to_string());
        l.insert(RC_ID_LABEL.to_string(), self.id.to_string());
        l
    }

    /// The desired state as a comparable value: what an operator can change.
    pub fn desired(&self) -> DesiredState {
        DesiredState {
            manifest_digest: self.manifest.digest().to_string(),
            pod_id: self.pod_id().to_string(),
            node_selector: self.node_selector.to_string(),
            pod_labels: self.pod_labels.clone(),
            replicas_desired: self.replicas_desired,
            disabled: self.disabled,
            strategy: self.strategy,
        }
    }
}

/// The operator-controlled part of an RC, for noticing and describing changes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DesiredState {
    pub manifest_digest: String,
    pub pod_id: String,
    pub node_selector: String,
    pub pod_labels: LabelSet,
    pub replicas_desired: u64,
    pub disabled: bool,
    pub strategy: AllocationStrategy,
}

impl DesiredState {
    /// `{field: {"old": …, "new": …}}` for every field that differs.
    pub fn diff(&self, new: &DesiredState) -> Map<String, Value> {
        let old = serde_json::to_value(self).unwrap_or(Value::Null);
        let new = serde_json::to_value(new).unwrap_or(Value::Null);
        let mut out = Map::new();
        if let (Value::Object(o), Value::Object(n)) = (old, new) {
            for (k, nv) in n {
                let ov = o.get(&k).cloned().unwrap_or(Value::Null);
                if ov != nv {
                    out.insert(k, serde_json::json!({"old": ov, "new": nv}));
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "6ba7b810-9dad-11d1-80b4-00c04fd430c8";

    fn key() -> String {
        format!("{RC_PREFIX}{ID}")
    }

    fn p2_record() -> String {
        format!(
            r#"{{"id":"{ID}","manifest":"id: web\nlaunchables: {{}}\n","node_selector":"env=prod","pod_labels":{{"team":"a"}},"replicas_desired":3,"disabled":false,"allocation_strategy":"dynamic_strategy"}}"#
        )
    }

    #[test]
    fn parses_a_p2_record_and_writes_it_back_identically() {
        let rc = Rc::from_kv(&key(), p2_record().as_bytes(), 9).unwrap();
        assert_eq!(rc.pod_id(), "web");
        assert_eq!(rc.replicas_desired, 3);
        assert_eq!(rc.strategy, AllocationStrategy::Dynamic);
        assert_eq!(rc.node_selector.to_string(), "env=prod");
        assert_eq!(String::from_utf8(rc.raw.to_json()).unwrap(), p2_record());
        let l = rc.labels_for_pods();
        assert_eq!(l[RC_ID_LABEL], ID);
        assert_eq!(l[POD_ID_LABEL], "web");
        assert_eq!(l["team"], "a");
    }

    #[test]
    fn unknown_fields_survive_a_rewrite() {
        let with_extra = p2_record().replace(
            r#""disabled":false"#,
            r#""disabled":false,"owner":{"team":"x"}"#,
        );
        let rc = Rc::from_kv(&key(), with_extra.as_bytes(), 1).unwrap();
        let v: Value = serde_json::from_slice(&rc.raw.to_json()).unwrap();
        assert_eq!(v["owner"]["team"], "x");
    }

    #[test]
    fn every_problem_names_itself() {
        let bad = |json: &str| Rc::from_kv(&key(), json.as_bytes(), 1).unwrap_err().problem;
        let rec = p2_record();
        assert!(matches!(bad("{"), RcProblem::BadJson(_)));
        assert!(matches!(bad("[]"), RcProblem::NotAnObject("an array")));
        let missing = rec.replace(r#""replicas_desired":3,"#, "");
        let p = bad(&missing);
        assert_eq!(p, RcProblem::MissingReplicas);
        assert!(p.to_string().contains("replicas_desired"));
        assert_eq!(
            bad(&rec.replace(r#""replicas_desired":3"#, r#""replicas_desired":null"#)),
            RcProblem::MissingReplicas
        );
        assert!(matches!(
            bad(&rec.replace(r#""replicas_desired":3"#, r#""replicas_desired":"3""#)),
            RcProblem::WrongType {
                field: "replicas_desired",
                ..
            }
        ));
        assert_eq!(
            bad(&rec.replace(r#""replicas_desired":3"#, r#""replicas_desired":-2"#)),
            RcProblem::NegativeReplicas(-2)
        );
        assert!(matches!(
            bad(&rec.replace("env=prod", "env in prod")),
            RcProblem::BadSelector(_)
        ));
        assert!(matches!(
            bad(&rec.replace(r#"id: web\nlaunchables: {}\n"#, "")),
            RcProblem::BadManifest(ManifestError::Empty)
        ));
        assert!(matches!(
            bad(&rec.replace(r#"id: web\n"#, "")),
            RcProblem::BadManifest(ManifestError::MissingId)
        ));
        assert!(matches!(
            bad(&rec.replace(ID, "6ba7b810-9dad-11d1-80b4-00c04fd430c9")),
            RcProblem::IdMismatch { .. }
        ));
        assert!(matches!(
            bad(&rec.replace(r#""team":"a""#, r#""team":1"#)),
            RcProblem::WrongType {
                field: "pod_labels",
                ..
            }
        ));
        assert!(matches!(
            Rc::from_kv("replication_controllers/nope", rec.as_bytes(), 1)
                .unwrap_err()
                .problem,
            RcProblem::BadKey(_)
        ));
        let upper = format!("{RC_PREFIX}{}", ID.to_uppercase());
        assert!(matches!(
            Rc::from_kv(&upper, rec.as_bytes(), 1).unwrap_err().problem,
            RcProblem::BadKey(_)
        ));
    }

    #[test]
    fn any_strategy_but_dynamic_is_static_as_in_p2() {
        // `p2-rctl create --allocation-strategy static` writes "static" verbatim.
        for s in ["static", "fancy", "STATIC_STRATEGY"] {
            let rc = Rc::from_kv(
                &key(),
                p2_record().replace("dynamic_strategy", s).as_bytes(),
                1,
            )
            .unwrap();
            assert_eq!(rc.strategy, AllocationStrategy::Static, "{s}");
            assert!(AllocationStrategy::unusual(s).is_some());
            assert!(
                String::from_utf8(rc.raw.to_json())
                    .unwrap()
                    .contains(&format!("\"{s}\"")),
                "kept as written"
            );
        }
        assert!(AllocationStrategy::unusual("static_strategy").is_none());
    }

    #[test]
    fn empty_strategy_is_static_and_is_kept() {
        let rec = p2_record().replace("dynamic_strategy", "");
        let rc = Rc::from_kv(&key(), rec.as_bytes(), 1).unwrap();
        assert_eq!(rc.strategy, AllocationStrategy::Static);
        assert_eq!(String::from_utf8(rc.raw.to_json()).unwrap(), rec);
    }

    #[test]
    fn desired_state_diffs() {
        let a = Rc::from_kv(&key(), p2_record().as_bytes(), 1)
            .unwrap()
            .desired();
        let mut b = a.clone();
        b.replicas_desired = 5;
        b.disabled = true;
        let d = a.diff(&b);
        assert_eq!(d.len(), 2);
        assert_eq!(
            d["replicas_desired"],
            serde_json::json!({"old": 3, "new": 5})
        );
    }
}

//! The rolling-update record, exactly as P2 stores it at `rolls/<new-rc-id>`: P2's
//! `roll/fields.Update` marshalled by Go's `encoding/json`. The struct has no JSON tags, so the
//! keys are the Go field names, in declaration order; `RollDelay` is a `time.Duration`, written
//! as a number of nanoseconds.
//!
//! Reading follows Go's decoder where P2 relies on it (keys match case-insensitively, `null`
//! leaves a field at its zero value), except that the four fields that define the roll must be
//! present: a record without `DesiredReplicas` is rejected, never read as 0 (P2's decoder would
//! read it as a roll to no replicas and delete the old RC).

use std::fmt;
use std::time::Duration;

use serde_json::{Map, Value};

use crate::rc::RcId;
use crate::util::describe_json as found;

pub const ROLL_PREFIX: &str = "rolls/";
pub const ROLL_LOCK_PREFIX: &str = "lock/rolls/";

/// A roll is named by its new RC's id (P2: `Update.ID()`).
pub type RollId = RcId;

/// `rolls/<id>`.
pub fn roll_key(id: RollId) -> String {
    format!("{ROLL_PREFIX}{id}")
}

/// `lock/rolls/<id>`: held by the farm carrying the roll out.
pub fn roll_lock_key(id: RollId) -> String {
    format!("{ROLL_LOCK_PREFIX}{id}")
}

/// The roll id of a key under `rolls/`, if the key is one.
pub fn roll_id_from_key(key: &str) -> Option<Result<RollId, String>> {
    key.strip_prefix(ROLL_PREFIX).map(RcId::parse)
}

/// P2's `roll/fields.Update`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    /// The RC giving its replicas up; deleted at the end unless `leave_old`.
    pub old_rc: RcId,
    /// The RC taking them; the roll's id.
    pub new_rc: RcId,
    /// The roll is done when the new RC has this many healthy replicas.
    pub desired_replicas: u64,
    /// Healthy replicas, old and new together, never to go below during the roll.
    pub minimum_replicas: u64,
    pub leave_old: bool,
    /// Pause before each step once it is safe, so new pods prove themselves.
    pub roll_delay: Duration,
}

impl Update {
    pub fn id(&self) -> RollId {
        self.new_rc
    }

    /// The bytes Go's `json.Marshal` writes for P2's struct.
    pub fn to_json(&self) -> Vec<u8> {
        format!(
            r#"{{"OldRC":"{}","NewRC":"{}","DesiredReplicas":{},"MinimumReplicas":{},"LeaveOld":{},"RollDelay":{}}}"#,
            self.old_rc,
            self.new_rc,
            self.desired_replicas,
            self.minimum_replicas,
            self.leave_old,
            self.roll_delay.as_nanos()
        )
        .into_bytes()
    }

    /// What a creator must not ask for (records found in Consul are held to less: see
    /// [`Roll::from_kv`]).
    pub fn check_new(&self) -> Result<(), String> {
        if self.old_rc == self.new_rc {
            return Err("the old and the new RC are the same RC".into());
        }
        if self.desired_replicas == 0 {
            return Err(
                "--desired must be at least 1: a rolling update to no replicas is a scale to 0 (rcctl rc scale)"
                    .into(),
            );
        }
        if self.minimum_replicas >= self.desired_replicas {
            return Err(format!(
                "--minimum ({}) must be below --desired ({}): the roll replaces pods in place, so \
                 it must be able to take at least one down",
                self.minimum_replicas, self.desired_replicas
            ));
        }
        Ok(())
    }
}

/// What is wrong with a stored roll.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RollProblem {
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
    #[error("field `{0}` is missing; a roll is not guessed from defaults")]
    Missing(&'static str),
    #[error("field `{field}`: {problem}")]
    BadRcId {
        field: &'static str,
        problem: String,
    },
    #[error("the key is not a valid roll key: {0}")]
    BadKey(String),
    #[error("field `NewRC` is {new_rc} but the key says {key_id}: a roll lives at rolls/<NewRC>")]
    IdMismatch { new_rc: String, key_id: String },
    #[error("`OldRC` and `NewRC` are the same RC")]
    SameRc,
    #[error("field `{field}` is {value}; it must be 0 or more")]
    Negative { field: &'static str, value: i64 },
    #[error("field `DesiredReplicas` is 0: a roll to no replicas would only delete the old RC")]
    NoReplicas,
}

impl RollProblem {
    /// A short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            RollProblem::BadJson(_)
            | RollProblem::NotAnObject(_)
            | RollProblem::WrongType { .. } => "malformed",
            RollProblem::Missing(_) => "missing_field",
            RollProblem::BadRcId { .. }
            | RollProblem::BadKey(_)
            | RollProblem::IdMismatch { .. } => "bad_id",
            RollProblem::SameRc => "same_rc",
            RollProblem::Negative { .. } | RollProblem::NoReplicas => "bad_count",
        }
    }
}

/// A stored roll that cannot be acted on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {problem}")]
pub struct InvalidRoll {
    pub key: String,
    pub modify_index: u64,
    pub problem: RollProblem,
}

/// A valid stored roll.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roll {
    pub update: Update,
    pub modify_index: u64,
    /// Orders conflicting rolls: the older one goes first.
    pub create_index: u64,
}

impl Roll {
    pub fn id(&self) -> RollId {
        self.update.new_rc
    }

    /// Parses and validates the value of `rolls/<id>`.
    pub fn from_kv(
        key: &str,
        value: &[u8],
        modify_index: u64,
        create_index: u64,
    ) -> Result<Roll, InvalidRoll> {
        let invalid = |problem| InvalidRoll {
            key: key.to_string(),
            modify_index,
            problem,
        };
        let key_id = match roll_id_from_key(key) {
            Some(Ok(id)) => id,
            Some(Err(e)) => return Err(invalid(RollProblem::BadKey(e))),
            None => {
                return Err(invalid(RollProblem::BadKey(format!(
                    "not under {ROLL_PREFIX}"
                ))));
            }
        };
        let update = decode(value).map_err(invalid)?;
        if update.new_rc != key_id {
            return Err(invalid(RollProblem::IdMismatch {
                new_rc: update.new_rc.to_string(),
                key_id: key_id.to_string(),
            }));
        }
        Ok(Roll {
            update,
            modify_index,
            create_index,
        })
    }
}

impl fmt::Display for Roll {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} → {}", self.update.old_rc, self.update.new_rc)
    }
}

/// Go's decoder matches a key to a field case-insensitively, preferring an exact match.
fn take(m: &mut Map<String, Value>, field: &'static str) -> Option<Value> {
    if let Some(v) = m.remove(field) {
        return Some(v);
    }
    let key = m.keys().find(|k| k.eq_ignore_ascii_case(field))?.clone();
    m.remove(&key)
}

/// Decodes P2's record, naming the field that is wrong.
pub fn decode(bytes: &[u8]) -> Result<Update, RollProblem> {
    let v: Value =
        serde_json::from_slice(bytes).map_err(|e| RollProblem::BadJson(e.to_string()))?;
    let Value::Object(mut m) = v else {
        return Err(RollProblem::NotAnObject(crate::util::json_kind(&v)));
    };
    let mut rc = |field: &'static str| -> Result<RcId, RollProblem> {
        match take(&mut m, field) {
            None | Some(Value::Null) => Err(RollProblem::Missing(field)),
            Some(Value::String(s)) => {
                RcId::parse(&s).map_err(|problem| RollProblem::BadRcId { field, problem })
            }
            Some(other) => Err(RollProblem::WrongType {
                field,
                expected: "a string (an RC id)",
                found: found(&other),
            }),
        }
    };
    let old_rc = rc("OldRC")?;
    let new_rc = rc("NewRC")?;
    // Go's `int` fields: an integral JSON number (no fraction, no exponent beyond it).
    let mut int = |field: &'static str, required: bool| -> Result<i64, RollProblem> {
        match take(&mut m, field) {
            None | Some(Value::Null) if required => Err(RollProblem::Missing(field)),
            None | Some(Value::Null) => Ok(0),
            Some(Value::Number(n)) if n.as_i64().is_some() => Ok(n.as_i64().unwrap_or_default()),
            Some(other) => Err(RollProblem::WrongType {
                field,
                expected: "an integer",
                found: found(&other),
            }),
        }
    };
    let desired = int("DesiredReplicas", true)?;
    let minimum = int("MinimumReplicas", true)?;
    let delay = int("RollDelay", false)?;
    for (field, value) in [
        ("DesiredReplicas", desired),
        ("MinimumReplicas", minimum),
        ("RollDelay", delay),
    ] {
        if value < 0 {
            return Err(RollProblem::Negative { field, value });
        }
    }
    let leave_old = match take(&mut m, "LeaveOld") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => b,
        Some(other) => {
            return Err(RollProblem::WrongType {
                field: "LeaveOld",
                expected: "true or false",
                found: found(&other),
            });
        }
    };
    if old_rc == new_rc {
        return Err(RollProblem::SameRc);
    }
    if desired == 0 {
        return Err(RollProblem::NoReplicas);
    }
    Ok(Update {
        old_rc,
        new_rc,
        desired_replicas: desired as u64,
        minimum_replicas: minimum as u64,
        leave_old,
        roll_delay: Duration::from_nanos(delay as u64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const OLD: &str = "ada5cdcc-1dc7-4229-87ef-854060b66b79";
    const NEW: &str = "e1c8399f-68df-4e7b-a024-e6d4fa60e8c7";

    /// Written by `p2-rctl schedule-update --old OLD --new NEW --desired 3 --minimum 2`
    /// (P2 commit 8223eb18), read back from Consul.
    fn p2_written() -> String {
        format!(
            r#"{{"OldRC":"{OLD}","NewRC":"{NEW}","DesiredReplicas":3,"MinimumReplicas":2,"LeaveOld":false,"RollDelay":0}}"#
        )
    }

    fn key() -> String {
        format!("{ROLL_PREFIX}{NEW}")
    }

    #[test]
    fn reads_p2s_record_and_writes_the_same_bytes() {
        let r = Roll::from_kv(&key(), p2_written().as_bytes(), 7, 7).unwrap();
        assert_eq!(r.update.old_rc.to_string(), OLD);
        assert_eq!(r.id().to_string(), NEW);
        assert_eq!(r.update.desired_replicas, 3);
        assert_eq!(r.update.minimum_replicas, 2);
        assert_eq!(String::from_utf8(r.update.to_json()).unwrap(), p2_written());
        let with_delay = Update {
            roll_delay: Duration::from_millis(1500),
            leave_old: true,
            ..r.update
        };
        let text = String::from_utf8(with_delay.to_json()).unwrap();
        assert!(
            text.ends_with(r#""LeaveOld":true,"RollDelay":1500000000}"#),
            "{text}"
        );
        assert_eq!(decode(text.as_bytes()).unwrap(), with_delay);
    }

    #[test]
    fn keys_match_case_insensitively_and_optional_fields_default() {
        let lower = format!(
            r#"{{"oldrc":"{OLD}","newrc":"{NEW}","desiredreplicas":2,"minimumreplicas":1}}"#
        );
        let u = decode(lower.as_bytes()).unwrap();
        assert_eq!(u.desired_replicas, 2);
        assert!(!u.leave_old);
        assert_eq!(u.roll_delay, Duration::ZERO);
    }

    #[test]
    fn every_problem_names_itself() {
        let rec = p2_written();
        let bad = |json: &str| {
            Roll::from_kv(&key(), json.as_bytes(), 1, 1)
                .unwrap_err()
                .problem
        };
        assert!(matches!(bad("{"), RollProblem::BadJson(_)));
        assert_eq!(bad("[]"), RollProblem::NotAnObject("an array"));
        assert_eq!(
            bad(&rec.replace(r#""DesiredReplicas":3,"#, "")),
            RollProblem::Missing("DesiredReplicas")
        );
        assert_eq!(
            bad(&rec.replace(r#""MinimumReplicas":2"#, r#""MinimumReplicas":null"#)),
            RollProblem::Missing("MinimumReplicas")
        );
        assert!(matches!(
            bad(&rec.replace(r#""DesiredReplicas":3"#, r#""DesiredReplicas":"3""#)),
            RollProblem::WrongType {
                field: "DesiredReplicas",
                ..
            }
        ));
        assert!(matches!(
            bad(&rec.replace(r#""DesiredReplicas":3"#, r#""DesiredReplicas":2.5"#)),
            RollProblem::WrongType { .. }
        ));
        assert_eq!(
            bad(&rec.replace(r#""MinimumReplicas":2"#, r#""MinimumReplicas":-1"#)),
            RollProblem::Negative {
                field: "MinimumReplicas",
                value: -1
            }
        );
        assert_eq!(
            bad(&rec.replace(r#""RollDelay":0"#, r#""RollDelay":-5"#)),
            RollProblem::Negative {
                field: "RollDelay",
                value: -5
            }
        );
        assert_eq!(
            bad(&rec.replace(r#""DesiredReplicas":3"#, r#""DesiredReplicas":0"#)),
            RollProblem::NoReplicas
        );
        assert!(matches!(
            bad(&rec.replace(OLD, "not-a-uuid")),
            RollProblem::BadRcId { field: "OldRC", .. }
        ));
        assert!(matches!(bad(&rec.replace(OLD, NEW)), RollProblem::SameRc));
        assert!(matches!(
            bad(&rec.replace(r#""LeaveOld":false"#, r#""LeaveOld":"no""#)),
            RollProblem::WrongType {
                field: "LeaveOld",
                ..
            }
        ));
        let elsewhere = format!("{ROLL_PREFIX}{OLD}");
        assert!(matches!(
            Roll::from_kv(&elsewhere, rec.as_bytes(), 1, 1)
                .unwrap_err()
                .problem,
            RollProblem::IdMismatch { .. }
        ));
        assert!(matches!(
            Roll::from_kv("rolls/x", rec.as_bytes(), 1, 1)
                .unwrap_err()
                .problem,
            RollProblem::BadKey(_)
        ));
    }

    #[test]
    fn creation_refuses_nonsense() {
        let u = decode(p2_written().as_bytes()).unwrap();
        assert!(u.check_new().is_ok());
        assert!(
            Update {
                minimum_replicas: 3,
                ..u.clone()
            }
            .check_new()
            .is_err()
        );
        assert!(
            Update {
                desired_replicas: 0,
                minimum_replicas: 0,
                ..u.clone()
            }
            .check_new()
            .is_err()
        );
        assert!(
            Update {
                old_rc: u.new_rc,
                ..u
            }
            .check_new()
            .is_err()
        );
    }
}

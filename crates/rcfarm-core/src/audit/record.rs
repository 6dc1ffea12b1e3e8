//! The audit record: P2's `AuditLog` JSON, written to `audit_logs/<uuid>` in the same Consul
//! transaction as the change it describes (a transactional outbox).

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use crate::consul::TxnOp;

/// The audit outbox tree.
pub const AUDIT_PREFIX: &str = "audit_logs/";
/// P2's `CurrentSchemaVersion`.
pub const SCHEMA_VERSION: i64 = 1;

/// Event types. P2's own: the first four and `ROLLING_UPDATE_CREATION|COMPLETION`; the rest are rcfarm's.
pub mod events {
    /// The full node set of an RC after a scheduling change (P2).
    pub const RC_RETARGET: &str = "REPLICATION_CONTROLLER_RETARGET";
    pub const NODE_TRANSFER_START: &str = "NODE_TRANSFER_START";
    pub const NODE_TRANSFER_COMPLETION: &str = "NODE_TRANSFER_COMPLETION";
    pub const NODE_TRANSFER_ROLLBACK: &str = "NODE_TRANSFER_ROLLBACK";
    /// Someone holds P2's node-transfer lock of an RC: its transfers are frozen (once per
    /// hold), and the hold ended.
    pub const NODE_TRANSFER_FROZEN: &str = "NODE_TRANSFER_FROZEN";
    pub const NODE_TRANSFER_UNFROZEN: &str = "NODE_TRANSFER_UNFROZEN";
    pub const RC_CREATED: &str = "REPLICATION_CONTROLLER_CREATED";
    /// Desired state changed through rcfarm (rcctl or the API).
    pub const RC_MODIFIED: &str = "REPLICATION_CONTROLLER_MODIFIED";
    /// Desired state changed by someone writing the KV record directly, noticed by the owner.
    pub const RC_OBSERVED_CHANGE: &str = "REPLICATION_CONTROLLER_OBSERVED_CHANGE";
    pub const RC_DELETED: &str = "REPLICATION_CONTROLLER_DELETED";
    pub const RC_INVALID: &str = "REPLICATION_CONTROLLER_INVALID";
    pub const RC_CLAIMED: &str = "REPLICATION_CONTROLLER_CLAIMED";
    pub const RC_RELEASED: &str = "REPLICATION_CONTROLLER_RELEASED";
    pub const RC_DESIRES_UNMET: &str = "REPLICATION_CONTROLLER_DESIRES_UNMET";
    pub const RC_DESIRES_MET: &str = "REPLICATION_CONTROLLER_DESIRES_MET";
    /// Intents (and labels) rewritten because they were missing or differed from the manifest.
    pub const RC_REPAIRED: &str = "REPLICATION_CONTROLLER_REPAIRED";
    /// A node's labels changed through rcctl.
    pub const NODE_LABELS_CHANGED: &str = "NODE_LABELS_CHANGED";
    /// A rolling update was created (P2's record, plus the roll's parameters).
    pub const ROLL_CREATION: &str = "ROLLING_UPDATE_CREATION";
    /// A rolling update ended: completed, aborted or canceled (P2's record, plus the reason).
    pub const ROLL_COMPLETION: &str = "ROLLING_UPDATE_COMPLETION";
    /// A farm took a roll's RCs: their mutation locks, the old RC disabled, the new enabled.
    pub const ROLL_STARTED: &str = "ROLLING_UPDATE_STARTED";
    /// Replicas moved from the old RC to the new one (or the old RC was told to remove its
    /// leftovers), in the same transaction as the RC records.
    pub const ROLL_STEP: &str = "ROLLING_UPDATE_STEP";
    /// A roll stopped progressing (once when it starts, with why) and progresses again.
    pub const ROLL_STALLED: &str = "ROLLING_UPDATE_STALLED";
    pub const ROLL_PROGRESSING: &str = "ROLLING_UPDATE_PROGRESSING";
    /// A roll record that cannot be acted on, once per version.
    pub const ROLL_INVALID: &str = "ROLLING_UPDATE_INVALID";
    pub const ROLL_CLAIMED: &str = "ROLLING_UPDATE_CLAIMED";
    pub const ROLL_RELEASED: &str = "ROLLING_UPDATE_RELEASED";
    /// An operator paused a roll (`rcctl roll pause`) or resumed it, with the actor.
    pub const ROLL_PAUSED: &str = "ROLLING_UPDATE_PAUSED";
    pub const ROLL_RESUMED: &str = "ROLLING_UPDATE_RESUMED";
    /// A roll failed: no new pod became up for its progress deadline (with why, and each new
    /// pod's state). Terminal until an operator resumes or aborts it.
    pub const ROLL_FAILED: &str = "ROLLING_UPDATE_FAILED";
    /// An operator promoted a roll's canary (`rcctl roll promote`): it goes on to the end.
    pub const ROLL_PROMOTED: &str = "ROLLING_UPDATE_PROMOTED";
    /// A roll was reverted: replaced by a roll back to its old RC, under its minimum and pace
    /// (`auto`: by the farm, on failure, with `--auto-revert`), naming both rolls.
    pub const ROLL_REVERTED: &str = "ROLLING_UPDATE_REVERTED";

    /// The farm's removal budget (`--max-removals`) held an RC's or a roll's removals: once
    /// per episode, with why and until when.
    pub const REMOVALS_HELD: &str = "REMOVALS_HELD";
    /// An operator released a farm's removals (`rcctl farm release-removals`), with the actor.
    pub const REMOVALS_RELEASED: &str = "REMOVALS_RELEASED";
    /// The RC tree went empty, or every RC to 0 replicas: the farm removes nothing until
    /// that has held for `--failsafe-confirm`.
    pub const FAILSAFE_TRIPPED: &str = "FAILSAFE_TRIPPED";
    /// The tripwire let go: confirmed (the state held), the tree changed back, or released.
    pub const FAILSAFE_CLEARED: &str = "FAILSAFE_CLEARED";

    pub const ALL: [&str; 35] = [
        RC_RETARGET,
        NODE_TRANSFER_START,
        NODE_TRANSFER_COMPLETION,
        NODE_TRANSFER_ROLLBACK,
        NODE_TRANSFER_FROZEN,
        NODE_TRANSFER_UNFROZEN,
        RC_CREATED,
        RC_MODIFIED,
        RC_OBSERVED_CHANGE,
        RC_DELETED,
        RC_INVALID,
        RC_CLAIMED,
        RC_RELEASED,
        RC_DESIRES_UNMET,
        RC_DESIRES_MET,
        RC_REPAIRED,
        NODE_LABELS_CHANGED,
        ROLL_CREATION,
        ROLL_COMPLETION,
        ROLL_STARTED,
        ROLL_STEP,
        ROLL_STALLED,
        ROLL_PROGRESSING,
        ROLL_INVALID,
        ROLL_CLAIMED,
        ROLL_RELEASED,
        ROLL_PAUSED,
        ROLL_RESUMED,
        ROLL_FAILED,
        ROLL_PROMOTED,
        ROLL_REVERTED,
        REMOVALS_HELD,
        REMOVALS_RELEASED,
        FAILSAFE_TRIPPED,
        FAILSAFE_CLEARED,
    ];
}

/// One audit record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditRecord {
    /// The uuid of its `audit_logs/<uuid>` key (not part of P2's JSON).
    #[serde(skip)]
    pub id: Uuid,
    pub event_type: String,
    pub event_details: Value,
    #[serde(with = "rfc3339_nanos")]
    pub timestamp: DateTime<Utc>,
    pub schema_version: i64,
}

impl AuditRecord {
    /// A new record stamped now.
    pub fn new(event_type: &str, event_details: Value) -> Self {
        AuditRecord {
            id: Uuid::new_v4(),
            event_type: event_type.to_string(),
            event_details,
            timestamp: Utc::now(),
            schema_version: SCHEMA_VERSION,
        }
    }

    /// A record whose id is derived from `identity`: farms that report the same thing
    /// independently write the same key (create-only), so it is recorded once.
    pub fn deterministic(identity: &str, event_type: &str, event_details: Value) -> Self {
        AuditRecord {
            id: Uuid::new_v5(
                &Uuid::NAMESPACE_URL,
                format!("rcfarm:{identity}").as_bytes(),
            ),
            ..AuditRecord::new(event_type, event_details)
        }
    }

    /// The record stamped at `t`: writers stamp each record from their clock when they commit
    /// it, so the log says when it was written.
    pub fn at(mut self, t: DateTime<Utc>) -> Self {
        self.timestamp = t;
        self
    }

    /// `audit_logs/<uuid>`.
    pub fn key(&self) -> String {
        format!("{AUDIT_PREFIX}{}", self.id)
    }

    /// The transaction op that writes this record: a create-only `cas`, so the same record can
    /// never be written twice.
    pub fn txn_op(&self) -> TxnOp {
        // Serializing a struct of strings, a JSON value and a timestamp cannot fail.
        let body = serde_json::to_vec(self).unwrap_or_default();
        TxnOp::cas(self.key(), body, 0)
    }

    /// Parses a record read back from `audit_logs/<uuid>`.
    pub fn from_kv(key: &str, value: &[u8]) -> Result<AuditRecord, String> {
        let id_text = key
            .strip_prefix(AUDIT_PREFIX)
            .ok_or_else(|| format!("{key} is not under {AUDIT_PREFIX}"))?;
        let id =
            Uuid::parse_str(id_text).map_err(|e| format!("{key}: the id is not a UUID ({e})"))?;
        let mut rec: AuditRecord = serde_json::from_slice(value)
            .map_err(|e| format!("{key}: not an audit record ({e})"))?;
        if rec.event_type.is_empty() {
            return Err(format!("{key}: empty event_type"));
        }
        rec.id = id;
        Ok(rec)
    }
}

mod rfc3339_nanos {
    use super::*;
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&t.to_rfc3339_opts(SecondsFormat::Nanos, true))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DateTime<Utc>, D::Error> {
        let s = String::deserialize(d)?;
        DateTime::parse_from_rfc3339(&s)
            .map(|t| t.with_timezone(&Utc))
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_use_p2_json() {
        let r = AuditRecord::new(
            events::RC_RETARGET,
            serde_json::json!({"pod_id": "web", "nodes": ["a"]}),
        );
        let v: Value = serde_json::to_value(&r).unwrap();
        assert_eq!(v["event_type"], "REPLICATION_CONTROLLER_RETARGET");
        assert_eq!(v["event_details"]["pod_id"], "web");
        assert_eq!(v["schema_version"], 1);
        assert!(v["timestamp"].as_str().unwrap().ends_with('Z'));
        assert!(v.get("id").is_none());
        let back = AuditRecord::from_kv(&r.key(), &serde_json::to_vec(&r).unwrap()).unwrap();
        assert_eq!(back, r);
        // P2 wrote local offsets; they read back as UTC.
        let p2 = br#"{"event_type":"X","event_details":{},"timestamp":"2019-05-01T10:00:00.5-07:00","schema_version":1}"#;
        let rec =
            AuditRecord::from_kv("audit_logs/6ba7b810-9dad-11d1-80b4-00c04fd430c8", p2).unwrap();
        assert_eq!(rec.timestamp.to_rfc3339(), "2019-05-01T17:00:00.500+00:00");
        assert!(AuditRecord::from_kv("audit_logs/nope", p2).is_err());
        assert!(
            AuditRecord::from_kv("audit_logs/6ba7b810-9dad-11d1-80b4-00c04fd430c8", b"{}").is_err()
        );
    }
}

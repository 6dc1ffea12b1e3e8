//! The farm's first step: making sure Consul lets its ACL token (or the anonymous one) do what the
//! farm does, before it creates a session or claims anything. A farm that could read RCs but not
//! write pods, or hold a session but not register, would half-work: it stops at start instead.
//!
//! One transaction asks for everything at once and can never commit: Consul checks every op's
//! ACL before applying any, and answers 409 with "Permission denied" for each one the token may
//! not do (403 "ACL not found" for a token it does not know); otherwise the ops run, and the
//! `check-index` probes of keys that do not exist roll the whole transaction back.

use crate::consul::{Consul, ConsulError, TxnOp};

/// Where the farm reads (Consul's key rules match by prefix).
const READS: &[&str] = &[
    "replication_controllers/",
    "lock/",
    "rolls/",
    "rcfarm/",
    "labels/",
    "intent/",
    "reality/",
    "health/",
    "status/replication_controllers/",
    "audit_logs/",
];

/// Where the farm writes.
const WRITES: &[&str] = &[
    "replication_controllers/",
    "lock/replication_controllers/",
    "lock/rolls/",
    "rolls/",
    "rcfarm/farms/",
    "labels/pod/",
    "labels/replication_controller/",
    "labels/rolls/",
    "intent/",
    "status/replication_controllers/",
    "audit_logs/",
];

/// Only with `--scheduler pool`.
const POOL: &str = "scheduler/pool/reservations/";

/// Appended to each prefix to make the probed key (never written: see the module doc).
const PROBE: &str = ".rcfarm-acl-check";

/// An index no key has, so that a `check-index` probe fails even on a key that exists.
const NO_INDEX: u64 = i64::MAX as u64;

/// What the farm needs, for an error message.
pub(super) fn needs(pool: bool, ships_audit: bool) -> String {
    let (reads, writes) = probes(pool, ships_audit);
    format!(
        "read on the KV prefixes {}; write on {}; and session creation (Consul ≥ 0.8: \
         session:write on the agent's node)",
        reads.join(", "),
        writes.join(", ")
    )
}

fn probes(pool: bool, ships_audit: bool) -> (Vec<&'static str>, Vec<&'static str>) {
    let mut reads = READS.to_vec();
    let mut writes = WRITES.to_vec();
    if pool {
        reads.push(POOL);
        writes.push(POOL);
    }
    if ships_audit {
        writes.push(crate::audit::SHIPPER_LOCK);
    }
    (reads, writes)
}

/// Checks that the token may read and write where the farm does, writing nothing. Denials come
/// back as [`ConsulError::PermissionDenied`] naming each refused access; unavailability as it is.
pub(super) async fn check(
    consul: &Consul,
    pool: bool,
    ships_audit: bool,
) -> Result<(), ConsulError> {
    let (reads, writes) = probes(pool, ships_audit);
    let mut ops: Vec<TxnOp> = reads
        .iter()
        .map(|p| TxnOp::check_index(format!("{p}{PROBE}"), NO_INDEX))
        .collect();
    ops.extend(writes.iter().map(|p| TxnOp::delete(format!("{p}{PROBE}"))));
    let errs = match consul.txn(&ops).await {
        // Only if someone wrote a probe key at an index that cannot be: nothing was refused.
        Ok(_) => return Ok(()),
        Err(ConsulError::Conflict(errs)) => errs,
        Err(e) => return Err(e),
    };
    let refused: Vec<String> = errs
        .iter()
        .filter(|e| is_denial(&e.what))
        .map(|e| match e.op_index.checked_sub(reads.len()) {
            None => format!("read on {}", reads.get(e.op_index).unwrap_or(&"?")),
            Some(i) => format!("write on {}", writes.get(i).unwrap_or(&"?")),
        })
        .collect();
    if refused.is_empty() {
        return Ok(());
    }
    let reason = errs
        .iter()
        .find(|e| is_denial(&e.what))
        .map(|e| e.what.clone())
        .unwrap_or_default();
    let what = if refused.len() == reads.len() + writes.len() {
        "on every prefix the farm uses".to_string()
    } else {
        format!("for {}", refused.join(", "))
    };
    Err(ConsulError::PermissionDenied(format!("{reason} {what}")))
}

/// Consul's words for an op the token may not do ("Permission denied", or "Permission denied:
/// token with AccessorID … lacks permission …" in 1.x), or for a token it does not know.
fn is_denial(what: &str) -> bool {
    what.contains("Permission denied") || what.contains("ACL not found")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::labels::LabelType;

    #[test]
    fn the_probed_prefixes_are_the_ones_the_farm_uses() {
        let (reads, writes) = probes(true, true);
        for p in [
            crate::rc::RC_PREFIX,
            crate::rc::RC_LOCK_PREFIX,
            crate::roll::ROLL_PREFIX,
            crate::roll::ROLL_LOCK_PREFIX,
            super::super::registry::FARMS_PREFIX,
            crate::audit::AUDIT_PREFIX,
            crate::scheduler::RESERVATIONS_PREFIX,
            &LabelType::Pod.prefix(),
            &LabelType::ReplicationController.prefix(),
            &LabelType::Rolls.prefix(),
        ] {
            assert!(writes.contains(&p), "{p} is written");
            assert!(reads.iter().any(|r| p.starts_with(r)), "{p} is read");
        }
        assert!(reads.contains(&crate::health::HEALTH_PREFIX));
        assert!(writes.contains(&crate::audit::SHIPPER_LOCK));
        assert!(needs(false, false).contains("write on replication_controllers/"));
        assert!(!needs(false, false).contains("scheduler/"));
    }

    #[test]
    fn denials_are_recognised_in_every_wording() {
        assert!(is_denial("Permission denied"));
        assert!(is_denial(
            "Permission denied: token with AccessorID 'x' lacks permission 'key:write' on \"a\""
        ));
        assert!(is_denial("ACL not found"));
        assert!(!is_denial("failed to check index, key \"a\" doesn't exist"));
    }
}

//! The farm's first step: making sure Consul lets its ACL token (or the anonymous one) do what the
//! farm does, before it creates a session or claims anything. A farm that could read RCs but not
//! write pods, or hold a session but not register, would half-work: it stops at start instead.
//!
//! One transaction asks for everything at once and can never commit: Consul checks every op's
//! ACL before applying any, and answers 409 with "Permission denied" for each one the token may
//! not do (403 "ACL not found" for a token it does not know); otherwise the ops run, and the
//! `check-index` probes of keys that do not exist roll the whole transaction back.

use crate::consul::{Consul, ConsulError, TxnOp};

/// What a right allows on a prefix (Consul's `write` includes `read`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
}

impl Access {
    pub fn as_str(self) -> &'static str {
        match self {
            Access::Read => "read",
            Access::Write => "write",
        }
    }
}

/// Every key right a farm needs, and no other: the least-privilege policy files in
/// `deploy/consul/` list exactly these (a test checks it). Consul's key rules match by prefix.
const RIGHTS: &[(&str, Access)] = &[
    ("replication_controllers/", Access::Write),
    ("lock/replication_controllers/", Access::Write),
    ("lock/rolls/", Access::Write),
    ("rolls/", Access::Write),
    ("rcfarm/farms/", Access::Write),
    ("rcfarm/rolls/", Access::Write),
    ("rcfarm/history/", Access::Write),
    (crate::failsafe::FAILSAFE_PREFIX, Access::Read),
    (crate::budget::BUDGET_PREFIX, Access::Write),
    ("labels/node/", Access::Read),
    ("labels/pod/", Access::Write),
    ("labels/replication_controller/", Access::Write),
    ("labels/rolls/", Access::Write),
    ("intent/", Access::Write),
    ("reality/", Access::Read),
    ("health/", Access::Read),
    ("status/replication_controllers/", Access::Write),
    ("audit_logs/", Access::Write),
];

/// Only with `--scheduler pool`.
const POOL: &str = "scheduler/pool/reservations/";

/// Appended to each prefix to make the probed key (never written: see the module doc).
const PROBE: &str = ".rcfarm-acl-check";

/// An index no key has, so that a `check-index` probe fails even on a key that exists.
const NO_INDEX: u64 = i64::MAX as u64;

/// What the farm needs, for an error message.
pub(super) fn needs(pool: bool, ships_audit: bool) -> String {
    let rights = rights(pool, ships_audit);
    let list = |a: Access| {
        rights
            .iter()
            .filter(|r| r.1 == a)
            .map(|r| r.0)
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "write on the KV prefixes {}; read on {}; and sessions (Consul ≥ 0.8: session write on \
         the agent's node). Policy files with exactly these rights: deploy/consul/rcfarm-farm.*.hcl",
        list(Access::Write),
        list(Access::Read),
    )
}

/// The key rights of a farm with these options.
pub fn rights(pool: bool, ships_audit: bool) -> Vec<(&'static str, Access)> {
    let mut rights = RIGHTS.to_vec();
    if ships_audit {
        rights.push((crate::audit::SHIPPER_LOCK, Access::Write));
    }
    if pool {
        rights.push((POOL, Access::Write));
    }
    rights
}

/// Checks that the token may read and write where the farm does, writing nothing. Denials come
/// back as [`ConsulError::PermissionDenied`] naming each refused access; unavailability as it is.
pub(super) async fn check(
    consul: &Consul,
    pool: bool,
    ships_audit: bool,
) -> Result<(), ConsulError> {
    let rights = rights(pool, ships_audit);
    let ops: Vec<TxnOp> = rights
        .iter()
        .map(|(p, a)| match a {
            Access::Read => TxnOp::check_index(format!("{p}{PROBE}"), NO_INDEX),
            Access::Write => TxnOp::delete(format!("{p}{PROBE}")),
        })
        .collect();
    let errs = match consul.txn(&ops).await {
        // Only if someone wrote a probe key at an index that cannot be: nothing was refused.
        Ok(_) => return Ok(()),
        Err(ConsulError::Conflict(errs)) => errs,
        Err(e) => return Err(e),
    };
    let refused: Vec<String> = errs
        .iter()
        .filter(|e| is_denial(&e.what))
        .map(|e| match rights.get(e.op_index) {
            Some((p, a)) => format!("{} on {p}", a.as_str()),
            None => format!("op {}", e.op_index),
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
    let what = if refused.len() == rights.len() {
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
        let rights = rights(true, true);
        let has = |p: &str, a: Access| rights.iter().any(|r| r.0 == p && r.1 == a);
        for p in [
            crate::rc::RC_PREFIX,
            crate::rc::RC_LOCK_PREFIX,
            crate::roll::ROLL_PREFIX,
            crate::roll::ROLL_LOCK_PREFIX,
            super::super::registry::FARMS_PREFIX,
            crate::audit::AUDIT_PREFIX,
            crate::audit::SHIPPER_LOCK,
            crate::scheduler::RESERVATIONS_PREFIX,
            crate::rctask::STATUS_PREFIX,
            crate::rctask::INTENT_PREFIX,
            &LabelType::Pod.prefix(),
            &LabelType::ReplicationController.prefix(),
            &LabelType::Rolls.prefix(),
        ] {
            assert!(has(p, Access::Write), "{p} is written");
        }
        for p in [
            crate::health::HEALTH_PREFIX,
            &LabelType::Node.prefix(),
            "reality/",
        ] {
            assert!(has(p, Access::Read), "{p} is read");
        }
        assert!(needs(false, false).contains("write on the KV prefixes replication_controllers/"));
        assert!(!needs(false, false).contains("scheduler/"));
        assert!(!needs(false, false).contains("audit-shipper"));
    }

    /// The rights a policy file grants: its uncommented key rules.
    fn policy_rights(file: &str, rule: &str) -> Vec<(String, Access)> {
        let path = format!("{}/../../deploy/consul/{file}", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).unwrap();
        text.lines()
            .map(str::trim)
            .filter(|l| l.starts_with(&format!("{rule} \"")))
            .map(|l| {
                let prefix = l.split('"').nth(1).unwrap().to_string();
                let access = if l.contains("policy = \"write\"") {
                    Access::Write
                } else {
                    assert!(l.contains("policy = \"read\""), "{path}: {l}");
                    Access::Read
                };
                (prefix, access)
            })
            .collect()
    }

    #[test]
    fn the_policy_files_grant_exactly_the_rights_the_farm_checks() {
        let want: Vec<(String, Access)> = rights(false, true)
            .into_iter()
            .map(|(p, a)| (p.to_string(), a))
            .collect();
        for (file, rule) in [
            ("rcfarm-farm.legacy.hcl", "key"),
            ("rcfarm-farm.policy.hcl", "key_prefix"),
        ] {
            let mut got = policy_rights(file, rule);
            let mut want = want.clone();
            got.sort_by(|a, b| a.0.cmp(&b.0));
            want.sort_by(|a, b| a.0.cmp(&b.0));
            assert_eq!(got, want, "{file}");
        }
        // rcctl's read-only rules grant no write.
        for (file, rule) in [
            ("rcctl-readonly.legacy.hcl", "key"),
            ("rcctl-readonly.policy.hcl", "key_prefix"),
        ] {
            let got = policy_rights(file, rule);
            assert!(
                !got.is_empty() && got.iter().all(|r| r.1 == Access::Read),
                "{file}"
            );
        }
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

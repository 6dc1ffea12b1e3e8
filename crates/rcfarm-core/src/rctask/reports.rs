//! What an RC task reports once per occurrence: invalid records, writes Consul refuses,
//! changes made outside rcfarm, and desires that cannot be met.

use serde_json::{Value, json};

use super::outcome::TaskError;
use super::worker::Worker;
use crate::audit::{AuditRecord, events};
use crate::rc::{CHANGE_MARKER, InvalidRc, Rc};

impl Worker {
    /// Warns once per version about what P2 serves but nobody should write: a strategy P2
    /// reads as static. The RC is served all the same.
    pub(super) fn warn_unusual(&mut self, rc: &Rc) {
        if self.warned == Some(rc.modify_index) {
            return;
        }
        self.warned = Some(rc.modify_index);
        if let Some(why) = crate::rc::AllocationStrategy::unusual(&rc.raw.allocation_strategy) {
            tracing::warn!(%why, "RC record has an unusual field; serving it as P2 would");
            metrics::counter!("rcfarm_rc_warnings_total", "kind" => "allocation_strategy")
                .increment(1);
        }
    }

    /// Reports an invalid record once per version: log, metric, status, audit event.
    pub(super) async fn report_invalid(&mut self, inv: &InvalidRc) -> Result<(), TaskError> {
        self.set_status(|s| {
            s.set_condition("Invalid", Some(inv.problem.to_string()));
        });
        if self.invalid_reported == Some(inv.modify_index) {
            return Ok(());
        }
        tracing::warn!(problem = %inv.problem, "RC record is invalid; not acting on it until it is fixed");
        metrics::counter!("rcfarm_rc_invalid_total", "kind" => inv.problem.kind()).increment(1);
        let audit = AuditRecord::deterministic(
            &format!("invalid:{}@{}", inv.key, inv.modify_index),
            events::RC_INVALID,
            json!({
                "replication_controller_id": self.id,
                "key": inv.key,
                "modify_index": inv.modify_index,
                "problem": inv.problem.to_string(),
                "farm_id": self.ctx.farm_id,
            }),
        );
        self.commit_report(audit).await?;
        self.invalid_reported = Some(inv.modify_index);
        Ok(())
    }

    /// Reports, once per RC version, that Consul refused the farm's writes for it (HTTP 413 or
    /// 400: a manifest too large for a transaction, say): log, metric, status, audit event.
    pub(super) async fn report_rejected(
        &mut self,
        version: Option<u64>,
        status: u16,
        body: &str,
    ) -> Result<(), TaskError> {
        let problem = format!(
            "Consul refused the farm's write for this RC (HTTP {status}: {}); a manifest too large \
             for a Consul transaction is the usual cause: shrink it, or raise Consul's \
             txn_max_req_len and kv_max_value_size",
            body.trim()
        );
        self.set_status(|s| {
            s.set_condition("Invalid", Some(problem.clone()));
            s.last_error = Some(problem.clone());
        });
        if version.is_none() || self.rejected_reported == version {
            return Ok(());
        }
        tracing::warn!(%problem, "RC cannot be served as it is");
        metrics::counter!("rcfarm_rc_invalid_total", "kind" => "rejected_by_consul").increment(1);
        let audit = AuditRecord::deterministic(
            &format!("rejected:{}@{}", self.id.key(), version.unwrap_or_default()),
            events::RC_INVALID,
            json!({
                "replication_controller_id": self.id,
                "key": self.id.key(),
                "modify_index": version,
                "problem": problem,
                "farm_id": self.ctx.farm_id,
            }),
        );
        self.commit_report(audit).await?;
        self.rejected_reported = version;
        Ok(())
    }

    /// Records a change of desired state made without rcfarm (a direct KV write).
    pub(super) async fn notice_changes(&mut self, rc: &Rc) -> Result<(), TaskError> {
        let marker = rc
            .raw
            .extra
            .get(CHANGE_MARKER)
            .and_then(Value::as_str)
            .map(str::to_string);
        let desired = rc.desired();
        let seen = (rc.modify_index, desired.clone(), marker.clone());
        let Some((idx, old, old_marker)) = &self.last_seen else {
            self.last_seen = Some(seen);
            return Ok(());
        };
        if *idx >= rc.modify_index {
            return Ok(());
        }
        let changes = old.diff(&desired);
        if !changes.is_empty() && (marker.is_none() || marker == *old_marker) {
            tracing::info!(
                ?changes,
                "desired state changed outside rcfarm; recording it"
            );
            // Named after the versions it spans and written create-only: a retry after a lost
            // answer, or a failed pass, records the change once. The previous version is kept
            // until it is recorded, so a failure never loses it.
            let audit = AuditRecord::deterministic(
                &format!(
                    "{}@{idx}->{}:observed-change",
                    self.id.key(),
                    rc.modify_index
                ),
                events::RC_OBSERVED_CHANGE,
                json!({
                    "replication_controller_id": self.id,
                    "pod_id": rc.pod_id(),
                    "farm_id": self.ctx.farm_id,
                    "modify_index": rc.modify_index,
                    "changes": changes,
                }),
            );
            self.commit_report(audit).await?;
        }
        self.last_seen = Some(seen);
        Ok(())
    }

    /// Reports unmet desires when they start and when they clear, once each.
    pub(super) async fn settle_unmet(
        &mut self,
        rc: &Rc,
        now: Option<String>,
    ) -> Result<(), TaskError> {
        match (&self.unmet, &now) {
            (None, Some(reason)) => {
                tracing::warn!(%reason, "desires cannot be met");
                let audit = AuditRecord::new(
                    events::RC_DESIRES_UNMET,
                    json!({"replication_controller_id": self.id, "pod_id": rc.pod_id(), "farm_id": self.ctx.farm_id, "reason": reason}),
                );
                self.commit(vec![], vec![audit]).await?;
                metrics::counter!("rcfarm_desires_unmet_total").increment(1);
            }
            (Some(_), None) => {
                tracing::info!("desires are met again");
                let audit = AuditRecord::new(
                    events::RC_DESIRES_MET,
                    json!({"replication_controller_id": self.id, "pod_id": rc.pod_id(), "farm_id": self.ctx.farm_id}),
                );
                self.commit(vec![], vec![audit]).await?;
            }
            _ => {}
        }
        self.unmet = now.clone();
        self.set_status(|s| s.set_condition("Unmet", now));
        Ok(())
    }
}

//! Records under a claimed prefix whose key names no object (`replication_controllers/x`,
//! `rolls/x`): no lock can be taken on them, so no task reports them and every farm sees them.
//! Each farm logs each version once; the audit record's id is derived from key and version and
//! written create-only, so there is one record per version however many farms notice.

use serde_json::json;

use super::Farm;
use crate::audit::AuditRecord;
use crate::consul::{FenceError, FencedTxn};

/// One such record.
pub(crate) struct Unclaimable {
    pub key: String,
    pub modify_index: u64,
    pub problem: String,
    /// For the metric's `kind` label.
    pub kind: &'static str,
}

impl Farm {
    /// Reports the unclaimable records found under `prefix` (all of them: those no longer
    /// there are forgotten).
    pub(super) async fn report_unclaimable(
        &self,
        prefix: &str,
        what: &str,
        event: &str,
        metric: &'static str,
        found: Vec<Unclaimable>,
    ) {
        let due: Vec<&Unclaimable> = {
            let mut reported = self.unclaimable_reported.lock();
            reported.retain(|k, _| !k.starts_with(prefix) || found.iter().any(|u| &u.key == k));
            found
                .iter()
                .filter(|u| reported.get(&u.key) != Some(&u.modify_index))
                .collect()
        };
        for u in due {
            tracing::warn!(key = %u.key, problem = %u.problem, "a record under {prefix} names no {what}; no farm will serve it");
            metrics::counter!(metric, "kind" => u.kind).increment(1);
            let audit = AuditRecord::deterministic(
                &format!("{}@{}", u.key, u.modify_index),
                event,
                json!({
                    "key": u.key,
                    "modify_index": u.modify_index,
                    "problem": u.problem,
                    "farm_id": self.config.farm_id,
                }),
            );
            match FencedTxn::unfenced()
                .records([audit.txn_op()])
                .commit(&self.consul)
                .await
            {
                // Or another farm recorded it first.
                Ok(_) | Err(FenceError::AlreadyRecorded) => {}
                Err(e) => {
                    tracing::warn!(key = %u.key, error = %e, "cannot record the invalid key; will retry");
                    continue;
                }
            }
            self.unclaimable_reported
                .lock()
                .insert(u.key.clone(), u.modify_index);
        }
    }
}

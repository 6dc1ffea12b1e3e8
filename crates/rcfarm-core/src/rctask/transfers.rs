//! The node transfers in flight, read for many RC tasks with one request.
//!
//! A task must know its RC's transfer (P2's status key) before it acts, and it must read it
//! after its farm's claim of the RC committed, so that a transfer the previous owner wrote is
//! seen. Tasks are started in bursts (a farm claims thousands of RCs at start), and one GET per
//! RC was a third of the requests of converging. Instead, every task that needs its transfer
//! waits for a listing of the whole (small: only RCs with a transfer) status tree that was
//! *sent* after it asked; concurrent askers share one listing.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::Value;
use tokio::time::Instant;

use super::plan::Transfer;
use crate::consul::{Consul, ConsulError, KvPair, QueryOptions};
use crate::rc::RcId;

/// P2's tree of RC status keys.
pub const STATUS_PREFIX: &str = "status/replication_controllers/";

/// P2's status key of an RC, where its node transfer in flight is kept.
pub fn status_key(id: RcId) -> String {
    format!("{}replication_controller", id.status_prefix())
}

/// rcfarm's own status key of an RC, beside P2's (another namespace of P2's status store,
/// which P2's tools leave alone): `{"node_transfer": {"id", "started_at"}}`, when the transfer
/// in flight started, so that whichever farm serves the RC next times it out from there,
/// including a transfer P2 started (P2 records no start).
pub fn rcfarm_status_key(id: RcId) -> String {
    format!("{}rcfarm", id.status_prefix())
}

/// The value of [`rcfarm_status_key`] for `t`.
pub fn rcfarm_status(t: &Transfer) -> Vec<u8> {
    serde_json::json!({"node_transfer": {"id": t.id, "started_at": t.started_at}})
        .to_string()
        .into_bytes()
}

/// The node transfers in a listing of [`STATUS_PREFIX`], by RC. Keys other than an RC's status
/// keys, and values without a readable `node_transfer`, are left out. A transfer's start is
/// its own (farms before rcfarm's own key wrote it into P2's), else the one rcfarm's key
/// records for the same transfer id.
pub fn parse_transfers(entries: &[KvPair]) -> BTreeMap<RcId, Transfer> {
    let mut transfers = BTreeMap::new();
    let mut starts: BTreeMap<RcId, (String, chrono::DateTime<chrono::Utc>)> = BTreeMap::new();
    for e in entries {
        let Some(rest) = e.key.strip_prefix(STATUS_PREFIX) else {
            continue;
        };
        let Some((id, namespace)) = rest.split_once('/') else {
            continue;
        };
        let Ok(id) = id.parse::<RcId>() else {
            continue;
        };
        let Ok(v) = serde_json::from_slice::<Value>(e.value_bytes()) else {
            continue;
        };
        let Some(t) = v.get("node_transfer") else {
            continue;
        };
        match namespace {
            "replication_controller" => {
                if let Ok(t) = serde_json::from_value::<Transfer>(t.clone()) {
                    transfers.insert(id, t);
                }
            }
            "rcfarm" => {
                let tid = t.get("id").and_then(Value::as_str);
                let at = t
                    .get("started_at")
                    .and_then(|a| serde_json::from_value(a.clone()).ok());
                if let (Some(tid), Some(at)) = (tid, at) {
                    starts.insert(id, (tid.to_string(), at));
                }
            }
            _ => {}
        }
    }
    for (id, t) in transfers.iter_mut() {
        if t.started_at.is_none()
            && let Some((tid, at)) = starts.get(id)
            && *tid == t.id
        {
            t.started_at = Some(*at);
        }
    }
    transfers
}

/// rcfarm's start keys in a listing of [`STATUS_PREFIX`] that record no transfer in flight
/// (P2's key is gone, or names another transfer), with their `ModifyIndex`: a farm of the
/// previous release ends a transfer by deleting P2's key only. The RC's next owner deletes
/// such a key.
pub fn stale_starts(entries: &[KvPair]) -> BTreeMap<RcId, u64> {
    let transfers = parse_transfers(entries);
    entries
        .iter()
        .filter_map(|e| {
            let id: RcId = e
                .key
                .strip_prefix(STATUS_PREFIX)?
                .strip_suffix("/rcfarm")?
                .parse()
                .ok()?;
            let recorded = serde_json::from_slice::<Value>(e.value_bytes())
                .ok()
                .and_then(|v| {
                    v.get("node_transfer")?
                        .get("id")?
                        .as_str()
                        .map(str::to_string)
                });
            let live = transfers
                .get(&id)
                .is_some_and(|t| recorded.as_deref() == Some(t.id.as_str()));
            (!live).then_some((id, e.modify_index))
        })
        .collect()
}

struct Listing {
    sent_at: Instant,
    transfers: Arc<BTreeMap<RcId, Transfer>>,
    stale: Arc<BTreeMap<RcId, u64>>,
}

/// Shared by a farm's RC tasks.
pub struct TransferReader {
    consul: Consul,
    /// Held while a listing is fetched: askers queue behind it and then find it fresh enough.
    last: tokio::sync::Mutex<Option<Listing>>,
}

impl TransferReader {
    pub fn new(consul: Consul) -> Self {
        Self {
            consul,
            last: tokio::sync::Mutex::new(None),
        }
    }

    /// The transfer of `id` in Consul as of a read sent no earlier than `since`, and the
    /// `ModifyIndex` of a stale start key of it ([`stale_starts`]), if any.
    pub(super) async fn transfer(
        &self,
        id: RcId,
        since: Instant,
    ) -> Result<(Option<Transfer>, Option<u64>), ConsulError> {
        let mut last = self.last.lock().await;
        if let Some(l) = last.as_ref()
            && l.sent_at >= since
        {
            return Ok((l.transfers.get(&id).cloned(), l.stale.get(&id).copied()));
        }
        let sent_at = Instant::now();
        let (entries, _) = self
            .consul
            .kv_list(STATUS_PREFIX, &QueryOptions::default())
            .await?;
        let transfers = parse_transfers(&entries);
        let stale = stale_starts(&entries);
        let found = (transfers.get(&id).cloned(), stale.get(&id).copied());
        *last = Some(Listing {
            sent_at,
            transfers: Arc::new(transfers),
            stale: Arc::new(stale),
        });
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(key: String, value: &str, modify_index: u64) -> KvPair {
        KvPair {
            key,
            value: Some(value.as_bytes().to_vec()),
            modify_index,
            ..Default::default()
        }
    }

    /// rcfarm's start key is kept with the transfer it names, and stale without it: a farm of
    /// the previous release ended the transfer (P2's key deleted) or another one runs now.
    #[test]
    fn a_start_key_without_its_transfer_is_stale() {
        let (a, b, c) = (RcId::new(), RcId::new(), RcId::new());
        let p2 = |id: RcId, t: &str| {
            kv(
                status_key(id),
                &format!(r#"{{"node_transfer":{{"old_node":"n1","new_node":"n2","id":"{t}"}}}}"#),
                5,
            )
        };
        let ours = |id: RcId, t: &str, i| {
            kv(
                rcfarm_status_key(id),
                &format!(
                    r#"{{"node_transfer":{{"id":"{t}","started_at":"2026-11-26T20:00:00Z"}}}}"#
                ),
                i,
            )
        };
        let entries = vec![
            p2(a, "t1"),
            ours(a, "t1", 6),
            ours(b, "t2", 7),
            p2(c, "t4"),
            ours(c, "t3", 8),
        ];
        let transfers = parse_transfers(&entries);
        assert!(
            transfers[&a].started_at.is_some(),
            "its start, from our key"
        );
        assert!(transfers[&c].started_at.is_none(), "not another transfer's");
        assert_eq!(stale_starts(&entries), BTreeMap::from([(b, 7), (c, 8)]));
    }
}

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
    format!("{STATUS_PREFIX}{id}/replication_controller")
}

/// The node transfers in a listing of [`STATUS_PREFIX`], by RC. Keys other than an RC's status
/// key, and values without a readable `node_transfer`, are left out.
pub fn parse_transfers(entries: &[KvPair]) -> BTreeMap<RcId, Transfer> {
    entries
        .iter()
        .filter_map(|e| {
            let id = e
                .key
                .strip_prefix(STATUS_PREFIX)?
                .strip_suffix("/replication_controller")?
                .parse()
                .ok()?;
            let v: Value = serde_json::from_slice(e.value_bytes()).ok()?;
            let t = serde_json::from_value(v.get("node_transfer")?.clone()).ok()?;
            Some((id, t))
        })
        .collect()
}

struct Listing {
    sent_at: Instant,
    transfers: Arc<BTreeMap<RcId, Transfer>>,
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

    /// The transfer of `id` in Consul as of a read sent no earlier than `since`.
    pub(super) async fn transfer(
        &self,
        id: RcId,
        since: Instant,
    ) -> Result<Option<Transfer>, ConsulError> {
        let mut last = self.last.lock().await;
        if let Some(l) = last.as_ref()
            && l.sent_at >= since
        {
            return Ok(l.transfers.get(&id).cloned());
        }
        let sent_at = Instant::now();
        let (entries, _) = self
            .consul
            .kv_list(STATUS_PREFIX, &QueryOptions::default())
            .await?;
        let transfers = parse_transfers(&entries);
        let found = transfers.get(&id).cloned();
        *last = Some(Listing {
            sent_at,
            transfers: Arc::new(transfers),
        });
        Ok(found)
    }
}

//! The consistency sweep: reads the intents of the farm's pods in batched read-only
//! transactions and records what it found in the [`IntentView`], for tasks to repair.

use std::collections::BTreeSet;

use crate::consul::{Consul, ConsulError, MAX_TXN_OPS, TxnOp};
use crate::rctask::{IntentState, IntentView, intent_key};

/// Reads the intents of `pods` (`(node, pod id)`) and records them. `get-tree` on the exact key
/// never fails for a missing key and exists in every Consul version (unlike `get-or-empty`).
pub async fn sweep(
    consul: &Consul,
    view: &IntentView,
    pods: &BTreeSet<(String, String)>,
) -> Result<usize, ConsulError> {
    let pods: Vec<&(String, String)> = pods.iter().collect();
    let mut read = 0;
    for chunk in pods.chunks(MAX_TXN_OPS) {
        let ops: Vec<TxnOp> = chunk
            .iter()
            .map(|(n, p)| TxnOp::get_tree(intent_key(n, p)))
            .collect();
        let resp = consul.txn(&ops).await?;
        for (node, pod) in chunk {
            let key = intent_key(node, pod);
            let value = resp
                .results
                .iter()
                .find(|r| r.key == key)
                .map(|r| r.value_bytes());
            view.set(node, pod, IntentState::from_value(value));
            read += 1;
        }
    }
    view.retain(&pods.into_iter().cloned().collect());
    Ok(read)
}

//! The consistency sweep: reads the intents of the farm's pods in batched read-only
//! transactions and records what it found in the [`IntentView`], for tasks to repair.

use std::collections::BTreeSet;

use crate::consul::{Consul, ConsulError};
use crate::rctask::{IntentState, IntentView, intent_key};

/// Reads the intents of `pods` (`(node, pod id)`) and records them.
pub async fn sweep(
    consul: &Consul,
    view: &IntentView,
    pods: &BTreeSet<(String, String)>,
) -> Result<usize, ConsulError> {
    let keys: Vec<String> = pods.iter().map(|(n, p)| intent_key(n, p)).collect();
    let found = consul.read_keys(&keys).await?;
    for ((node, pod), key) in pods.iter().zip(&keys) {
        view.set(
            node,
            pod,
            IntentState::from_value(found.get(key).map(|kv| kv.value_bytes())),
        );
    }
    view.retain(pods);
    Ok(keys.len())
}

//! The consistency sweep: reads the intents of the farm's pods in batched read-only
//! transactions and records what it found in the [`IntentView`], for tasks to repair.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap, HashSet};

use crate::consul::{Consul, ConsulError, KvList, KvPair, KvRef, MAX_TXN_OPS, QueryOptions};
use crate::rctask::{INTENT_PREFIX, IntentState, IntentView, intent_key};

/// Batches of reads beyond which the sweep lists the whole intent tree instead.
const LIST_AFTER_BATCHES: usize = 4;

/// Reads the intents of `pods` (`(node, pod id)`) and records them; `all`: they are every
/// pod the farm serves (the view forgets the others).
pub async fn sweep(
    consul: &Consul,
    view: &IntentView,
    pods: &BTreeSet<(String, String)>,
    all: bool,
) -> Result<usize, ConsulError> {
    let keys: Vec<String> = pods.iter().map(|(n, p)| intent_key(n, p)).collect();
    // Taken before the read: a task's write that commits while it is in flight is kept.
    let ticket = view.read_ticket();
    // Batched reads cost a request per 64 pods: 500 a minute for a farm with 33,000 pods, most
    // of a farm's idle load. Past a few batches, one listing of the whole intent tree is
    // cheaper in requests (Consul sends more bytes, once).
    let mut read: HashMap<String, KvPair> = HashMap::new();
    let mut listed = KvList::default();
    if keys.len() > LIST_AFTER_BATCHES * MAX_TXN_OPS {
        // Kept as sent: the tree holds every farm's intents (a million at a million pods),
        // and only this farm's are decoded. Decoded whole into `KvPair`s and then copied into
        // a map, it was the biggest thing a farm held at its peak (BENCHMARKS.md, "A million
        // pods on one machine").
        listed = consul
            .kv_listing(INTENT_PREFIX, &QueryOptions::default())
            .await?
            .0;
    } else {
        read = consul.read_keys(&keys).await?;
    }
    let wanted: HashSet<&str> = keys.iter().map(String::as_str).collect();
    let in_list: HashMap<&str, KvRef<'_>> = listed
        .iter()
        .filter(|e| wanted.contains(e.key()))
        .map(|e| (e.key(), e))
        .collect();
    for ((node, pod), key) in pods.iter().zip(&keys) {
        // A key listed with no value reads as an empty value, as a batched read's does.
        let value: Option<Cow<'_, [u8]>> = match read.get(key) {
            Some(kv) => Some(Cow::Borrowed(kv.value_bytes())),
            None => in_list
                .get(key.as_str())
                .map(|e| Cow::Owned(e.value().unwrap_or_default())),
        };
        view.set_read(node, pod, IntentState::from_value(value.as_deref()), ticket);
    }
    if all {
        let keep: HashSet<(&str, &str)> =
            pods.iter().map(|(n, p)| (n.as_str(), p.as_str())).collect();
        view.retain(|node, pod| keep.contains(&(node, pod)));
    }
    Ok(keys.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consul::{ConsulConfig, TxnOp};
    use crate::scheduler::NodeName;
    use crate::server::{EmbeddedServer, ServerConfig};

    /// Both ways of reading (batched gets for a few pods, one listing for many) find the same
    /// missing and unparseable intents, and ignore other farms' intents.
    #[tokio::test]
    async fn finds_missing_and_broken_intents_batched_and_listed() {
        let server = EmbeddedServer::start(ServerConfig::ephemeral())
            .await
            .unwrap();
        let consul = Consul::new(ConsulConfig::new(server.url())).unwrap();
        let manifest = "id: app\nlaunchables: {}\n";
        for n in [10usize, 600] {
            let pods: BTreeSet<(String, String)> = (0..n)
                .map(|i| (format!("n{n}-{i:04}"), "app".to_string()))
                .collect();
            let mut ops: Vec<TxnOp> = pods
                .iter()
                .skip(2)
                .map(|(node, pod)| TxnOp::set(intent_key(node, pod), manifest.as_bytes().to_vec()))
                .collect();
            // Pod 1's intent is garbage; pod 0's is missing; someone else's pod is beside them.
            let (n1, p1) = pods.iter().nth(1).unwrap();
            ops.push(TxnOp::set(intent_key(n1, p1), b"{not yaml".to_vec()));
            ops.push(TxnOp::set(
                intent_key("n-other", "other"),
                manifest.as_bytes().to_vec(),
            ));
            for chunk in ops.chunks(64) {
                consul.txn(chunk).await.unwrap();
            }
            let view = IntentView::default();
            let before = consul.stats();
            assert_eq!(sweep(&consul, &view, &pods, true).await.unwrap(), n);
            let after = consul.stats();
            // 10 pods: one batched read; 600: one listing instead of ten batches.
            assert_eq!(after.requests - before.requests, 1, "{n} pods");
            assert_eq!(after.txns - before.txns, u64::from(n == 10), "{n} pods");
            let digest = crate::rc::Manifest::parse(manifest)
                .unwrap()
                .digest()
                .to_string();
            let nodes: Vec<NodeName> = pods
                .iter()
                .map(|(node, _)| NodeName::from(node.as_str()))
                .collect();
            let bad = view.bad("app", &digest, nodes);
            let want: BTreeSet<NodeName> = pods
                .iter()
                .take(2)
                .map(|(node, _)| NodeName::from(node.as_str()))
                .collect();
            assert_eq!(bad, want, "{n} pods");
            assert_eq!(view.len(), n);
        }
        server.shutdown().await;
    }
}

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::Mutex;

use super::{NodeName, NodeSet, Scheduler, SchedulerError};
use crate::labels::{LabelCache, Selector};
use crate::rc::Manifest;

/// Matching nodes per selector, valid at one node-cache index.
pub(super) type SelectorMemo = Mutex<(u64, HashMap<String, Arc<[NodeName]>>)>;

/// Eligible nodes are the nodes whose labels match; nothing to allocate.
pub struct LabelScheduler {
    nodes: Arc<LabelCache>,
    /// Answers per selector at one cache index: RCs often share selectors, and a farm
    /// re-plans every RC when nodes change.
    memo: SelectorMemo,
}

impl LabelScheduler {
    /// Answers from a watched cache of `labels/node/`.
    pub fn new(nodes: Arc<LabelCache>) -> Self {
        Self {
            nodes,
            memo: Mutex::new((0, HashMap::new())),
        }
    }
}

impl LabelScheduler {
    /// The memoized answer, once the node cache has synced (before, "no nodes" would be a lie).
    fn synced_matching(&self, selector: &Selector) -> Result<Arc<[NodeName]>, SchedulerError> {
        if !self.nodes.is_synced() {
            return Err(SchedulerError::NotReady);
        }
        Ok(matching(&self.nodes, &self.memo, selector))
    }
}

/// The nodes matching `selector`, computed once per cache index.
pub(super) fn matching(
    nodes: &LabelCache,
    memo: &SelectorMemo,
    selector: &Selector,
) -> Arc<[NodeName]> {
    let index = nodes.index();
    let key = selector.to_string();
    {
        let m = memo.lock();
        if m.0 == index
            && let Some(v) = m.1.get(&key)
        {
            return v.clone();
        }
    }
    let computed: Arc<[NodeName]> = nodes
        .matches(selector)
        .into_iter()
        .map(NodeName::from)
        .collect();
    let mut m = memo.lock();
    if m.0 != index {
        *m = (index, HashMap::new());
    }
    m.1.insert(key, computed.clone());
    computed
}

#[async_trait]
impl Scheduler for LabelScheduler {
    async fn eligible_nodes(
        &self,
        _manifest: &Manifest,
        selector: &Selector,
    ) -> Result<Vec<NodeName>, SchedulerError> {
        Ok(self.synced_matching(selector)?.to_vec())
    }

    async fn eligible_set(
        &self,
        _manifest: &Manifest,
        selector: &Selector,
    ) -> Result<NodeSet, SchedulerError> {
        Ok(NodeSet::from_sorted_unique(self.synced_matching(selector)?))
    }

    async fn allocate_nodes(
        &self,
        _manifest: &Manifest,
        selector: &Selector,
        count: usize,
        _force: bool,
    ) -> Result<Vec<NodeName>, SchedulerError> {
        Err(SchedulerError::AllocationUnsupported(format!(
            "the label scheduler cannot allocate nodes ({count} more wanted for selector \"{selector}\"): label more nodes to match the selector, or run the farm with --scheduler pool"
        )))
    }

    async fn deallocate_nodes(
        &self,
        _selector: &Selector,
        _nodes: &[NodeName],
    ) -> Result<(), SchedulerError> {
        // Nothing was allocated, so nothing to free.
        Ok(())
    }

    fn name(&self) -> &'static str {
        "label"
    }
}

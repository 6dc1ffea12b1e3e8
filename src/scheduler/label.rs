use std::sync::Arc;

use async_trait::async_trait;

use super::{NodeName, Scheduler, SchedulerError};
use crate::labels::{LabelCache, Selector};
use crate::rc::Manifest;

/// Eligible nodes are the nodes whose labels match; nothing to allocate.
pub struct LabelScheduler {
    nodes: Arc<LabelCache>,
}

impl LabelScheduler {
    /// Answers from a watched cache of `labels/node/`.
    pub fn new(nodes: Arc<LabelCache>) -> Self {
        Self { nodes }
    }
}

#[async_trait]
impl Scheduler for LabelScheduler {
    async fn eligible_nodes(
        &self,
        _manifest: &Manifest,
        selector: &Selector,
    ) -> Result<Vec<NodeName>, SchedulerError> {
        if !self.nodes.is_synced() {
            return Err(SchedulerError::NotReady);
        }
        Ok(self.nodes.matches(selector))
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

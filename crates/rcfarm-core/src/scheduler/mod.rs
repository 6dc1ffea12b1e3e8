//! Schedulers decide which nodes an RC may use (P2's `Scheduler` seam).
//!
//! - [`LabelScheduler`]: eligible nodes are those whose labels match the RC's node selector;
//!   it cannot allocate (like P2's `ApplicatorScheduler`, but with a clear error).
//! - [`PoolScheduler`]: the same, plus a pool of spare nodes it really allocates from, with
//!   reservations kept in Consul under CAS so several farms never hand out the same slot.

mod label;
mod pool;

use std::sync::Arc;

use async_trait::async_trait;

pub use label::LabelScheduler;
pub use pool::{NodeReservations, PoolConfig, PoolScheduler, RESERVATIONS_PREFIX, Slot};

use crate::labels::Selector;
use crate::rc::Manifest;

/// A node's name (its `labels/node/<name>` id).
pub type NodeName = std::sync::Arc<str>;

/// A sorted set of node names, shared and searched rather than rebuilt: a farm plans thousands
/// of RCs against the same few thousand eligible nodes, and copying them into a tree per RC and
/// observation (4 million string-keyed inserts in the 10× benchmark) took a quarter of its
/// convergence time (BENCHMARKS.md, `rcfarm-tools bench farm`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeSet(Arc<[NodeName]>);

impl NodeSet {
    /// Wraps names known to be sorted and unique (the label cache answers so), without a copy.
    pub(crate) fn from_sorted_unique(nodes: Arc<[NodeName]>) -> Self {
        debug_assert!(nodes.windows(2).all(|w| w[0] < w[1]));
        NodeSet(nodes)
    }

    pub fn contains(&self, node: &str) -> bool {
        self.0.binary_search_by(|n| (**n).cmp(node)).is_ok()
    }

    /// In name order.
    pub fn iter(&self) -> std::slice::Iter<'_, NodeName> {
        self.0.iter()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<Vec<NodeName>> for NodeSet {
    fn from(mut nodes: Vec<NodeName>) -> Self {
        // Schedulers answering from the label cache give sorted names already.
        if !nodes.is_sorted() {
            nodes.sort_unstable();
        }
        nodes.dedup();
        NodeSet(nodes.into())
    }
}

impl FromIterator<NodeName> for NodeSet {
    fn from_iter<I: IntoIterator<Item = NodeName>>(iter: I) -> Self {
        iter.into_iter().collect::<Vec<_>>().into()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SchedulerError {
    #[error("{0}")]
    AllocationUnsupported(String),
    #[error(transparent)]
    Consul(#[from] crate::consul::ConsulError),
    #[error("scheduler data is not ready yet (the node label cache has not synced)")]
    NotReady,
    #[error("{0}")]
    Other(String),
}

#[async_trait]
pub trait Scheduler: Send + Sync {
    /// The nodes the manifest may run on under this selector, sorted by name.
    async fn eligible_nodes(
        &self,
        manifest: &Manifest,
        selector: &Selector,
    ) -> Result<Vec<NodeName>, SchedulerError>;

    /// [`Scheduler::eligible_nodes`] as a [`NodeSet`]. Schedulers that keep their answers
    /// sorted and shared override it to skip the copy (the RC task asks on every pass).
    async fn eligible_set(
        &self,
        manifest: &Manifest,
        selector: &Selector,
    ) -> Result<NodeSet, SchedulerError> {
        Ok(self.eligible_nodes(manifest, selector).await?.into())
    }

    /// Asks for up to `count` more nodes; they appear in later `eligible_nodes` answers. May
    /// return fewer. `force` lets the scheduler relax its preferences to find nodes at all.
    async fn allocate_nodes(
        &self,
        manifest: &Manifest,
        selector: &Selector,
        count: usize,
        force: bool,
    ) -> Result<Vec<NodeName>, SchedulerError>;

    /// Tells the scheduler the RC no longer uses these nodes.
    async fn deallocate_nodes(
        &self,
        selector: &Selector,
        nodes: &[NodeName],
    ) -> Result<(), SchedulerError>;

    /// A short name for logs and status.
    fn name(&self) -> &'static str;
}

//! Schedulers decide which nodes an RC may use (P2's `Scheduler` seam).
//!
//! - [`LabelScheduler`]: eligible nodes are those whose labels match the RC's node selector;
//!   it cannot allocate (like P2's `ApplicatorScheduler`, but with a clear error).
//! - [`PoolScheduler`]: the same, plus a pool of spare nodes it really allocates from, with
//!   reservations kept in Consul under CAS so several farms never hand out the same slot.

mod label;
mod pool;

use async_trait::async_trait;

pub use label::LabelScheduler;
pub use pool::{NodeReservations, PoolConfig, PoolScheduler, RESERVATIONS_PREFIX, Slot};

use crate::labels::Selector;
use crate::rc::Manifest;

/// A node's name (its `labels/node/<name>` id).
pub type NodeName = std::sync::Arc<str>;

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

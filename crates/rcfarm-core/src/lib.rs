//! rcfarm's domain and farm: label selectors and the labels store, the RC model and store, the
//! audit log (records, outbox, SQL, shipper), pod health, the schedulers, the failsafes, the RC
//! task, rolling updates, and the farm that claims and serves them.
//!
//! Depends on the Consul client crate (`rcfarm-consul`) only; its unit tests start the embedded
//! server (`rcfarm-server`, a dev-dependency). Layers inside, lowest first: `labels`, `audit`,
//! `rc`, `health`, `scheduler`, `failsafe`, `task`, `freshness` (pure) (and `clock`, time as an input, used by all); then `rctask`, `roll`, `farm`.

// The client crate under the names the modules have always used.
use rcfarm_consul as consul;
use rcfarm_consul::util;
#[cfg(test)]
use rcfarm_server as server;

pub mod audit;
pub mod budget;
pub mod clock;
pub mod failsafe;
pub mod farm;
pub mod freshness;
pub mod health;
pub mod labels;
pub mod rc;
pub mod rctask;
pub mod roll;
pub mod scheduler;
pub mod task;
#[cfg(test)]
mod testing;

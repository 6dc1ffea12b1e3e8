//! rcfarm's test kit: fault injection ([`chaos`]), the invariant checker ([`invariants`]), the
//! model check ([`model`]) and the node simulator ([`simulator`]). Used by the tests and by
//! `rcfarm-tools`; nothing in the product depends on it.

use rcfarm_consul as consul;
use rcfarm_consul::util;
use rcfarm_core::{audit, budget, failsafe, farm, health, labels, rc, rctask, roll, scheduler};
use rcfarm_server as server;

pub mod chaos;
pub mod fullfs;
pub mod invariants;
pub mod model;
pub mod postgres;
pub mod simulator;

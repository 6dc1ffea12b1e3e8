//! rcfarm's operator surface: the farm's HTTP API, `/metrics` and status page ([`api`]), the
//! cluster overview ([`overview`]), and the `rcfarm` and `rcctl` commands ([`cli`]).
//!
//! The top of the product: it uses the Consul client, the embedded server and the core, never
//! the test kit (the test equipment's commands are `rcfarm-tools`, crate `rcfarm-tools`).

use rcfarm_consul as consul;
use rcfarm_consul::util;
use rcfarm_core::{audit, budget, failsafe, farm, health, labels, rc, rctask, roll, scheduler};
use rcfarm_server as server;

pub mod api;
pub mod cli;
pub mod overview;

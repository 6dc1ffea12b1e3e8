//! rcfarm's operator surface: the farm's HTTP API, `/metrics` and status page ([`api`]), the
//! cluster overview ([`overview`]), and the `rcfarm` and `rcctl` commands ([`cli`]).
//!
//! The top of the workspace: it uses every other crate (the test kit only for `rcfarm
//! chaos|bench|simulate-nodes`).

use rcfarm_consul as consul;
use rcfarm_consul::util;
use rcfarm_core::{audit, budget, failsafe, farm, health, labels, rc, rctask, roll, scheduler};
use rcfarm_server as server;
use rcfarm_testkit::{chaos, invariants, model, simulator};

pub mod api;
pub mod cli;
pub mod overview;

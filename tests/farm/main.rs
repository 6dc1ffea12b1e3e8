//! Farms as real `rcfarm serve` processes against one embedded Consul server: convergence,
//! every kind of change, failover, fencing, fair share, node transfer.

#[path = "../common/mod.rs"]
mod common;

mod assignment;
mod audit;
mod bad_input;
mod behind_the_back;
mod brakes;
mod chaos;
mod clocks;
mod compat;
mod converge;
mod failover;
mod failsafe;
mod fence;
mod freshness;
mod harness;
mod history;
mod mixed;
mod p2_behaviour;
mod p2_nodes;
mod p2_side_by_side;
mod partitions;
mod restore;
mod rolls;
mod security;
mod sick_audit;
mod trouble;

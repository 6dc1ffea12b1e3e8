//! The domain layer over real HTTP against the embedded server: label store and cache, RC store
//! and locks, schedulers, health; conflicts and malformed data.

#[path = "../common/mod.rs"]
mod common;

mod labels;
mod p2;
mod rcs;
mod rolls;
mod schedulers;

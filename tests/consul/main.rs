//! The Consul client against the embedded server, over real HTTP, for every endpoint, verb and
//! error case of shared/CONSUL_API.md; and the server's own process-level promises.

#[path = "../common/mod.rs"]
mod common;

mod blocking;
mod client_behaviour;
mod compat;
mod kv;
mod process;
mod py_consul;
mod sessions;
mod txn;
mod wire;

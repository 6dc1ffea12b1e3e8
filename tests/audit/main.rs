//! The audit log: the SQL store on SQLite (always) and PostgreSQL (when
//! `RCFARM_TEST_POSTGRES_URL` is set), and the shipper moving records out of Consul.

#[path = "../common/mod.rs"]
mod common;

mod db;
mod shipping;
mod store;

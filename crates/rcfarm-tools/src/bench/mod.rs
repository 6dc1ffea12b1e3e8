//! `rcfarm-tools bench`: measurements that print figures (not tests). BENCHMARKS.md has each
//! figure with the command that produced it.

pub mod audit;
pub mod consul;
pub mod farm;
pub mod outbox;
pub mod rolls;
pub mod selectors;

use clap::Subcommand;

use crate::CliError;

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// KV and transaction throughput, blocking-query wake-up latency of the embedded server.
    Consul(consul::BenchConsulArgs),
    /// Label selector queries over a watched cache of many nodes.
    Selectors(selectors::BenchSelectorsArgs),
    /// Audit log query latency over many records (SQLite or PostgreSQL).
    Audit(audit::BenchAuditArgs),
    /// Farms converging many RCs: throughput, latency, failover, idle cost, memory.
    Farm(farm::BenchFarmArgs),
    /// One farm's audit shipper emptying a full outbox into SQL, with nothing else running.
    Outbox(outbox::BenchOutboxArgs),
    /// Farms carrying out many concurrent rolling updates, with simulated nodes.
    Rolls(rolls::BenchRollsArgs),
}

pub async fn run(command: BenchCommand) -> Result<(), CliError> {
    match command {
        BenchCommand::Consul(args) => consul::run(args).await,
        BenchCommand::Selectors(args) => selectors::run(args).await,
        BenchCommand::Audit(args) => audit::run(args).await,
        BenchCommand::Farm(args) => {
            println!("{}", farm::header());
            farm::run(args).await
        }
        BenchCommand::Outbox(args) => outbox::run(args).await,
        BenchCommand::Rolls(args) => {
            println!("{}", rolls::header());
            rolls::run(args).await
        }
    }
}

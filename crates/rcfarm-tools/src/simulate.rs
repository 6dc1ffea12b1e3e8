//! `rcfarm-tools simulate-nodes`: plays P2's preparer for a set of nodes (see
//! [`crate::simulator`]) against a Consul: beside `rcfarm dev` (its default address), the
//! walkthrough's nodes.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::consul::Consul;
use crate::simulator::{NodeSimulator, SimConfig};
use crate::{CliError, parse_duration_flag, parse_pairs, shutdown_signal};

/// How simulated nodes behave.
#[derive(Debug, Clone, clap::Args)]
pub struct SimBehaviour {
    /// Simulated nodes are named <prefix>1 … <prefix>N.
    #[arg(long, default_value = "node-")]
    pub node_prefix: String,
    /// Labels set on every simulated node (repeat, or comma-separate: env=dev,zone=a).
    #[arg(long = "labels", value_name = "K=V")]
    pub labels: Vec<String>,
    /// From an intent to the pod passing its health check.
    #[arg(long, default_value = "1s", value_parser = parse_duration_flag)]
    pub startup: Duration,
    /// The fraction of pods that never pass their health check (0 to 1).
    #[arg(long, default_value_t = 0.0)]
    pub unhealthy_rate: f64,
    /// Which pods fail is decided from this seed (the same seed fails the same pods).
    #[arg(long, default_value_t = 0)]
    pub sim_seed: u64,
    /// Pods whose manifest contains this text never pass their health check (a bad deploy,
    /// to try a roll's progress deadline).
    #[arg(long, value_name = "PATTERN")]
    pub fail_manifests: Option<String>,
}

impl SimBehaviour {
    pub fn to_config(&self, nodes: usize) -> Result<SimConfig, CliError> {
        if nodes == 0 {
            return Err(CliError::Usage(
                "--nodes: simulate at least one node".into(),
            ));
        }
        if !(0.0..=1.0).contains(&self.unhealthy_rate) {
            return Err(CliError::Usage(format!(
                "--unhealthy-rate {}: give a fraction between 0 and 1 (0.1 fails one pod in ten)",
                self.unhealthy_rate
            )));
        }
        let labels: Vec<String> = self
            .labels
            .iter()
            .flat_map(|l| l.split(',').filter(|s| !s.is_empty()).map(str::to_string))
            .collect();
        Ok(SimConfig {
            nodes: SimConfig::named(&self.node_prefix, nodes),
            labels: parse_pairs(&labels, "--labels")?,
            startup: self.startup,
            unhealthy_rate: self.unhealthy_rate,
            fail_manifests: self.fail_manifests.clone().filter(|p| !p.is_empty()),
            seed: self.sim_seed,
            ..SimConfig::default()
        })
    }
}

#[derive(Debug, clap::Args)]
pub struct SimulateArgs {
    #[command(flatten)]
    pub connection: rcfarm_ops::cli::ConsulArgs,
    /// How many nodes to play.
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    #[command(flatten)]
    pub behaviour: SimBehaviour,
}

pub async fn run(args: SimulateArgs) -> Result<(), CliError> {
    let config = args.behaviour.to_config(args.nodes)?;
    let consul =
        Consul::new(args.connection.to_config()?).map_err(|e| CliError::Usage(e.to_string()))?;
    let sim = NodeSimulator::new(consul, config).map_err(|e| CliError::Usage(e.to_string()))?;
    let stop = CancellationToken::new();
    let s = stop.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        s.cancel();
    });
    sim.run(stop)
        .await
        .map_err(|e| CliError::Failed(e.to_string()))
}

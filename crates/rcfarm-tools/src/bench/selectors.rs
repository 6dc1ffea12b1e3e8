//! `rcfarm-tools bench selectors`: selector queries answered from the watched label cache, over a
//! tree of N nodes served by an in-process embedded server.

use std::time::{Duration, Instant};

use crate::CliError;
use crate::consul::{Consul, ConsulConfig, WatchConfig};
use crate::labels::{LabelCache, LabelSet, LabelStore, LabelType, Selector};
use crate::server::{EmbeddedServer, ServerConfig};

#[derive(Debug, clap::Args)]
pub struct BenchSelectorsArgs {
    /// Nodes in the tree.
    #[arg(long, default_value_t = 10_000)]
    pub nodes: usize,
    /// Queries per selector.
    #[arg(long, default_value_t = 2_000)]
    pub iterations: usize,
}

fn failed(e: impl std::fmt::Display) -> CliError {
    CliError::Failed(e.to_string())
}

pub async fn run(args: BenchSelectorsArgs) -> Result<(), CliError> {
    let server = EmbeddedServer::start(ServerConfig::ephemeral())
        .await
        .map_err(failed)?;
    let consul = Consul::new(ConsulConfig::new(server.url())).map_err(failed)?;
    let ops: Vec<_> = (0..args.nodes)
        .map(|i| {
            let labels: LabelSet = [
                ("rack".to_string(), format!("r{}", i % 100)),
                ("zone".to_string(), format!("z{}", i % 3)),
                (
                    "pool".to_string(),
                    if i % 10 == 0 { "spare" } else { "main" }.to_string(),
                ),
                ("cpu".to_string(), format!("{}", 4 << (i % 4))),
            ]
            .into();
            LabelStore::set_op(LabelType::Node, &format!("node-{i:05}"), &labels)
        })
        .collect();
    for chunk in ops.chunks(64) {
        consul.txn(chunk).await.map_err(failed)?;
    }
    let started = Instant::now();
    let cache = LabelCache::spawn(&consul, LabelType::Node, WatchConfig::default());
    while cache.len() < args.nodes {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let load = started.elapsed();
    println!(
        "rcfarm-tools bench selectors: {} nodes, cache loaded from Consul in {:.1} ms, {} queries per selector",
        args.nodes,
        load.as_secs_f64() * 1e3,
        args.iterations
    );
    println!();
    println!("| selector | matches | mean µs | p50 µs | p99 µs |");
    println!("|---|---|---|---|---|");
    for s in [
        "rack=r7,zone=z1",
        "rack in (r1,r2,r3)",
        "zone=z2,pool=spare",
        "pool!=spare,zone notin (z0,z2)",
        "cpu>16",
        "rack",
        "",
    ] {
        let sel = Selector::parse(s).map_err(failed)?;
        let mut samples = Vec::with_capacity(args.iterations);
        let mut n = 0;
        for _ in 0..args.iterations {
            let t = Instant::now();
            n = std::hint::black_box(cache.matches(&sel)).len();
            samples.push(t.elapsed());
        }
        samples.sort();
        let mean = samples.iter().sum::<Duration>() / samples.len().max(1) as u32;
        let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        let shown = if s.is_empty() { "(everything)" } else { s };
        println!(
            "| `{shown}` | {n} | {:.1} | {:.1} | {:.1} |",
            us(mean),
            us(at(0.5)),
            us(at(0.99))
        );
    }
    let requests = consul.stats().requests;
    println!();
    println!(
        "Consul requests made while querying: 0 (client counter: {requests} in total, all for loading)"
    );
    server.shutdown().await;
    Ok(())
}

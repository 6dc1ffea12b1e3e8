//! A short chaos run (the long one is `rcfarm chaos --duration 10m`): three farms killed,
//! stopped past their TTL, terminated and restarted, one behind a faulty proxy, while RCs and
//! node labels change; every promise is checked.

use std::time::Duration;

use rcfarm::chaos::{ChaosConfig, ChaosConsul, ChaosReport, proxy::ProxyFaults, run};

use crate::harness::{BIN, Backend, TTL};
use crate::on_both_backends;

on_both_backends!(thirty_seconds_of_chaos_break_no_promise);
async fn thirty_seconds_of_chaos_break_no_promise(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let consul = match backend {
        // The chaos run starts its own server, as Consul 1.x (`on_both_backends!` asks no other).
        Backend::Embedded(_) => ChaosConsul::Embedded,
        Backend::Real(bin) => ChaosConsul::Agent(bin),
    };
    let report = run(ChaosConfig {
        farms: 3,
        seed: 7,
        proxy: Some(ProxyFaults {
            max_delay: Duration::from_millis(200),
            drop_per_mille: 10,
        }),
        ..thirty_seconds(consul, dir.path())
    })
    .await
    .unwrap();
    let summary = report.summary();
    println!("{summary}");
    let faults: u64 = report.faults.values().sum();
    let mutations: u64 = report.mutations.values().sum();
    assert!(faults >= 5, "faults were injected: {summary}");
    assert!(mutations >= 30, "RCs and nodes changed: {summary}");
    assert!(
        report.fenced_writes > 0 || report.external_snapshots.is_some_and(|(s, _)| s > 0),
        "the farms scheduled: {summary}"
    );
    assert!(report.audit_written > 0, "{summary}");
    // Where the commit log is replayed, the blast-radius check ran on real removals.
    if let Some((seen, _)) = report.removals {
        assert!(seen > 0, "the farms removed pods: {summary}");
    }
    let braking = ["roll-pause", "roll-resume", "roll-promote", "restart"];
    assert!(
        braking.iter().any(|m| report.mutations.contains_key(m)),
        "the rolls were braked: {summary}"
    );
    explain_failure(&report, dir.path());
}

/// On a real 3-server cluster with a client agent per farm: farms and Consul servers (the
/// leader included) faulted while RCs change, every promise checked from outside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_seconds_of_chaos_on_a_consul_cluster_break_no_promise() {
    let Some(Backend::Real(bin)) = Backend::real() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let report = run(ChaosConfig {
        farms: 2,
        seed: 12,
        ..thirty_seconds(
            ChaosConsul::Cluster {
                bin,
                servers: 3,
                partitions: false,
            },
            dir.path(),
        )
    })
    .await
    .unwrap();
    let summary = report.summary();
    println!("{summary}");
    let server_faults: u64 = report
        .faults
        .iter()
        .filter(|(k, _)| k.starts_with("consul-"))
        .map(|(_, n)| n)
        .sum();
    assert!(server_faults >= 2, "Consul servers were faulted: {summary}");
    assert!(report.elections.is_some_and(|e| e >= 1), "{summary}");
    explain_failure(&report, dir.path());
}

/// On a real 3-server cluster whose agents each have an address of their own: the network
/// between them cut (the leader, one server, a farm's agent, one-way links, bridges,
/// flapping) among the farm and server faults, while RCs and rolls change; every promise
/// checked from outside. Needs root and nftables (`rcfarm::chaos::partition`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_minute_of_partitions_on_a_consul_cluster_breaks_no_promise() {
    let Some(Backend::Real(bin)) = Backend::real() else {
        return;
    };
    if let Err(why) = rcfarm::chaos::partition::available() {
        eprintln!("SKIPPED: no partitions on this machine: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let report = run(ChaosConfig {
        farms: 2,
        seed: 37,
        duration: Duration::from_secs(60),
        partition_faults: true,
        ..thirty_seconds(
            ChaosConsul::Cluster {
                bin,
                servers: 3,
                partitions: true,
            },
            dir.path(),
        )
    })
    .await
    .unwrap();
    let summary = report.summary();
    println!("{summary}");
    let partitions: u64 = report
        .faults
        .iter()
        .filter(|(k, _)| k.starts_with("partition-"))
        .map(|(_, n)| n)
        .sum();
    assert!(partitions >= 2, "the network was cut: {summary}");
    explain_failure(&report, dir.path());
}

/// 30 s of every fault and mutation on 10 nodes and 12 RCs.
fn thirty_seconds(consul: ChaosConsul, dir: &std::path::Path) -> ChaosConfig {
    ChaosConfig {
        farm_binary: BIN.into(),
        duration: Duration::from_secs(30),
        farms: 3,
        nodes: 10,
        rcs: 12,
        session_ttl: TTL,
        seed: 0,
        // Node transfers go one at a time, each waiting for its new pod to be healthy: an RC
        // whose selector changed late, with its farm killed at the end, needs a failover and
        // two or three transfers. 10 s was too little for that on a loaded 2-core CI machine.
        settle_margin: Duration::from_secs(30),
        proxy: None,
        log_dir: dir.to_path_buf(),
        consul,
        farm_faults: true,
        consul_faults: true,
        partition_faults: false,
        mutations: true,
    }
}

fn explain_failure(report: &ChaosReport, dir: &std::path::Path) {
    let summary = report.summary();
    if !report.ok() {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            if e.path().extension().is_some_and(|x| x == "log") {
                let log = std::fs::read_to_string(e.path()).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                // Shipping and sessions over the whole run: an outbox that did not drain is
                // explained there, not in the last lines.
                eprintln!("--- {}: shipper and session lines ---", e.path().display());
                for l in log.lines().filter(|l| {
                    l.contains("ship") || l.contains("session") || l.contains("panicked")
                }) {
                    eprintln!("{l}");
                }
                eprintln!("--- {}: last lines ---", e.path().display());
                for l in tail.into_iter().rev() {
                    eprintln!("{l}");
                }
            }
        }
        panic!("{summary}");
    }
}

//! A short chaos run (the long one is `rcfarm-tools chaos --duration 10m`): three farms killed,
//! stopped past their TTL, terminated and restarted, one behind a faulty proxy, while RCs and
//! node labels change; every promise is checked.

use std::time::Duration;

use rcfarm_testkit::chaos::{ChaosConfig, ChaosConsul, ChaosReport, proxy::ProxyFaults, run};

use crate::harness::{BIN, Backend, TTL};
use crate::on_both_backends;

on_both_backends!(thirty_seconds_of_chaos_break_no_promise);
async fn thirty_seconds_of_chaos_break_no_promise(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let consul = chaos_consul(backend);
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
        ..thirty_seconds(three_servers(bin, false), dir.path())
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
/// checked from outside. Needs root and nftables (`rcfarm_testkit::chaos::partition`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_minute_of_partitions_on_a_consul_cluster_breaks_no_promise() {
    let Some(Backend::Real(bin)) = Backend::real() else {
        return;
    };
    if let Err(why) = rcfarm_testkit::chaos::partition::available() {
        eprintln!("SKIPPED: no partitions on this machine: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let report = run(ChaosConfig {
        farms: 2,
        seed: 37,
        duration: Duration::from_secs(60),
        partition_faults: true,
        // As a new user runs them: deploys and brakes under partitions on the defaults.
        default_failsafe: true,
        ..thirty_seconds(three_servers(bin, true), dir.path())
    })
    .await
    .unwrap();
    assert_faulted(&report, &["partition-"], 2, dir.path());
}

/// Every server of a real 3-server cluster stopped and copied (a cold backup, as Consul 0.7 is
/// backed up), and later every server put back to that copy while the farms work: the store
/// goes back in time (claims, rolls, pods and audit records written since vanish, locks taken
/// since are free again, locks given up since are held again). Every promise holds, every
/// RC converges on what the restored store desires, every audit record seen reaches SQL
/// unless the restore took it before it was shipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consul_cluster_restored_from_a_backup_under_chaos_breaks_no_promise() {
    let Some(Backend::Real(bin)) = Backend::real() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let report = run(ChaosConfig {
        farms: 2,
        seed: 3709,
        duration: Duration::from_secs(45),
        consul_faults: false,
        restore_faults: true,
        default_failsafe: true,
        ..thirty_seconds(three_servers(bin, false), dir.path())
    })
    .await
    .unwrap();
    assert_faulted(&report, &["consul-restore"], 1, dir.path());
}

on_both_backends!(thirty_seconds_of_clock_and_audit_database_faults_break_no_promise);
/// Farms whose wall clocks step an hour forward or back, or run 10 % fast (libfaketime), and
/// their audit database (a PostgreSQL of the run's own) stopped or slowed, while RCs change
/// and rolls run, on the farms' default failsafe: every promise holds, every audit record
/// reaches SQL once.
async fn thirty_seconds_of_clock_and_audit_database_faults_break_no_promise(backend: Backend) {
    if rcfarm_testkit::chaos::clock::libfaketime().is_none() {
        eprintln!(
            "SKIPPED: libfaketime not found (Debian's faketime package; .ci/run installs it)"
        );
        return;
    }
    if let Err(e) = rcfarm_testkit::postgres::PrivatePostgres::start() {
        eprintln!("SKIPPED: no PostgreSQL of the run's own to stop and start: {e}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let consul = chaos_consul(backend);
    let report = run(ChaosConfig {
        farms: 3,
        seed: 3707,
        // Only these two kinds (farm faults have runs of their own), so that 30 s hold a few.
        farm_faults: false,
        clock_faults: true,
        audit_db_faults: true,
        restore_faults: false,
        // The observer checks the default blast radius (20 % of what a farm serves, at
        // least 5, per 5 minutes), with the tripwire on.
        default_failsafe: true,
        ..thirty_seconds(consul, dir.path())
    })
    .await
    .unwrap();
    // Which of the two a seed draws, and how many fit in 30 s, varies with the machine's
    // pace (a clock fault holds 3–20 s): at least two of them, of either kind.
    assert_faulted(&report, &["clock-", "audit-db-"], 2, dir.path());
}

/// 30 s of every fault and mutation on 10 nodes and 12 RCs, on the run's quick failsafe.
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
        clock_faults: false,
        audit_db_faults: false,
        restore_faults: false,
        default_failsafe: false,
        mutations: true,
    }
}

/// A real cluster of 3 servers and a client agent per farm; `partitions`: each agent on an
/// address of its own, so that the network between them can be cut.
fn three_servers(bin: std::path::PathBuf, partitions: bool) -> ChaosConsul {
    ChaosConsul::Cluster {
        bin,
        servers: 3,
        partitions,
    }
}

/// The Consul a chaos run starts for `backend`: its own embedded server (as Consul 1.x:
/// `on_both_backends!` asks no other), or a real agent.
fn chaos_consul(backend: Backend) -> ChaosConsul {
    match backend {
        Backend::Embedded(_) => ChaosConsul::Embedded,
        Backend::Real(bin) => ChaosConsul::Agent(bin),
    }
}

/// At least `least` faults of the kinds named `prefix…` were injected, and every promise held.
fn assert_faulted(report: &ChaosReport, prefixes: &[&str], least: u64, dir: &std::path::Path) {
    let summary = report.summary();
    println!("{summary}");
    let n: u64 = report
        .faults
        .iter()
        .filter(|(k, _)| prefixes.iter().any(|p| k.starts_with(p)))
        .map(|(_, n)| n)
        .sum();
    assert!(
        n >= least,
        "{least} {prefixes:?}… faults injected: {summary}"
    );
    explain_failure(report, dir);
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

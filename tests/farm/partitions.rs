//! Network partitions between real Consul agents on one machine (issue 37): each agent binds
//! its own 127.0.0.x and runs as its own user, and `nftables` rules drop what one sends
//! another (`rcfarm_testkit::chaos::partition`). These check the tool against Consul 0.7 itself
//! before farms are put under it: a partition must do to the cluster what it would do on a
//! network. They need root, `nft` and the Consul binary, and say SKIPPED without them.

use std::time::{Duration, Instant};

use rcfarm::consul::{Consul, ConsulConfig, QueryOptions};
use rcfarm_testkit::chaos::agent::{ConsulAgent, ConsulCluster};
use rcfarm_testkit::chaos::partition::{self, Partitions};

use crate::harness::Backend;

/// A 3-server cluster with `clients` client agents, partitionable; `None` (said loudly) where
/// this machine cannot partition.
async fn cluster(clients: usize) -> Option<(ConsulCluster, Partitions)> {
    let Some(Backend::Real(bin)) = Backend::real() else {
        return None;
    };
    if let Err(why) = partition::available() {
        eprintln!("SKIPPED: no partitions on this machine: {why}");
        return None;
    }
    Some(
        ConsulCluster::start_partitionable(&bin, 3, clients)
            .await
            .unwrap(),
    )
}

/// A client of one agent that gives up fast (a partitioned agent may hang a request).
fn quick(agent: &ConsulAgent) -> Consul {
    Consul::new(ConsulConfig {
        attempts: 1,
        timeout: Duration::from_secs(3),
        ..ConsulConfig::new(agent.http_url())
    })
    .unwrap()
}

/// The leader `agent` names, as an index into `cc.servers` (`None`: none, or no answer).
async fn leader_seen_by(cc: &ConsulCluster, agent: &ConsulAgent) -> Option<usize> {
    let l = quick(agent).leader().await.ok()?;
    cc.servers.iter().position(|s| s.raft_addr() == l)
}

/// The value of `key` as `agent` reads it (default consistency: through its leader).
async fn read(agent: &ConsulAgent, key: &str) -> Result<Option<String>, String> {
    quick(agent)
        .kv_get(key, &QueryOptions::default())
        .await
        .map(|(e, _)| e.map(|e| String::from_utf8_lossy(e.value_bytes()).to_string()))
        .map_err(|e| e.to_string())
}

async fn until<F, Fut>(what: &str, timeout: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < timeout, "not within {timeout:?}: {what}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The leader cut from the other two servers (a minority of one): the majority elects another
/// and takes writes; the old leader stops answering consistent reads rather than serve its
/// stale state; healed, it follows the new leader and reads what was written while it was
/// away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_from_the_other_servers_is_replaced_and_catches_up() {
    let Some((cc, mut parts)) = cluster(1).await else {
        return;
    };
    let cr = &cc;
    until("a leader", Duration::from_secs(30), || async move {
        cr.leader().await.is_some()
    })
    .await;
    let old = cc.leader().await.expect("a leader");
    let others: Vec<usize> = (0..3).filter(|i| *i != old).collect();
    parts.isolate(old, &others).unwrap();
    let (a, b) = (&cc.servers[others[0]], &cc.servers[others[1]]);
    until(
        "the majority names a new leader",
        Duration::from_secs(30),
        || async {
            let (la, lb) = (leader_seen_by(&cc, a).await, leader_seen_by(&cc, b).await);
            la.is_some() && la == lb && la != Some(old)
        },
    )
    .await;
    until(
        "a write through the majority",
        Duration::from_secs(30),
        || async {
            quick(a)
                .kv_put("partition/written", b"while away", None)
                .await
                .unwrap_or(false)
        },
    )
    .await;
    let cut = &cc.servers[old];
    until(
        "the old leader answers no consistent read",
        Duration::from_secs(30),
        || async { read(cut, "partition/written").await.is_err() },
    )
    .await;
    assert_eq!(
        read(cut, "partition/written").await.ok().flatten(),
        None,
        "the cut leader never serves what it cannot have"
    );
    parts.heal().unwrap();
    until(
        "healed: the old leader reads what was written while it was away",
        Duration::from_secs(60),
        || async { read(cut, "partition/written").await == Ok(Some("while away".into())) },
    )
    .await;
    until(
        "one leader for all three",
        Duration::from_secs(30),
        || async {
            let mut seen = Vec::new();
            for s in &cc.servers {
                seen.push(leader_seen_by(&cc, s).await);
            }
            seen[0].is_some() && seen.iter().all(|l| *l == seen[0])
        },
    )
    .await;
}

/// A client agent (a farm's own, in production) cut from every server: what it is asked fails
/// instead of answering from nothing, and healed, it answers again; the servers keep serving
/// the other client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_agent_cut_from_every_server_fails_requests_then_recovers() {
    let Some((cc, mut parts)) = cluster(2).await else {
        return;
    };
    let (cut, other) = (&cc.clients[0], &cc.clients[1]);
    until("the client answers", Duration::from_secs(30), || async {
        quick(cut)
            .kv_put("partition/k", b"1", None)
            .await
            .unwrap_or(false)
    })
    .await;
    // Servers are endpoints 0..3, clients after them.
    parts.split(&[3], &[0, 1, 2]).unwrap();
    assert_eq!(parts.blocked().len(), 6);
    until(
        "the cut client's reads fail",
        Duration::from_secs(30),
        || async { read(cut, "partition/k").await.is_err() },
    )
    .await;
    assert!(
        quick(other)
            .kv_put("partition/k", b"2", None)
            .await
            .unwrap(),
        "the other client writes on"
    );
    parts.heal().unwrap();
    until(
        "healed: the client reads the other's write",
        Duration::from_secs(60),
        || async { read(cut, "partition/k").await == Ok(Some("2".into())) },
    )
    .await;
}

//! The Consul a chaos run works against: the embedded server (every commit recorded and
//! replayed), one real agent, or a real cluster of servers with a client agent per farm (its
//! servers faulted too). Real Consul keeps no commit log, so an [`ExternalObserver`] watches it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rand::Rng;
use rand::rngs::StdRng;
use tokio_util::sync::CancellationToken;

use super::agent::{AgentConfig, ConsulAgent, ConsulCluster};
use super::partition::Partitions;
use crate::consul::{Consul, ConsulConfig, QueryOptions};
use crate::invariants::external::ExternalObserver;
use crate::server::{EmbeddedServer, ServerConfig};

/// Which Consul the chaos runs against.
#[derive(Debug, Clone)]
pub enum ChaosConsul {
    /// The embedded server in this process, recording every commit.
    Embedded,
    /// A real Consul dev agent from this binary.
    Agent(PathBuf),
    /// Real Consul: `servers` servers and a client agent per farm (plus one for the checks);
    /// servers are SIGKILLed, SIGSTOPped and restarted, the leader included. `partitions`:
    /// every agent on an address and a user of its own, so that the network between them can
    /// be cut ([`super::partition`]; needs root and nftables).
    Cluster {
        bin: PathBuf,
        servers: usize,
        partitions: bool,
    },
}

pub(super) enum Backend {
    Embedded(EmbeddedServer),
    Real {
        cluster: ConsulCluster,
        observer: ExternalObserver,
        /// Raft term increases seen (elections), counted by a poller.
        elections: Arc<AtomicU64>,
        /// The network between the agents, when it can be cut.
        partitions: Option<Partitions>,
        stop_poller: CancellationToken,
    },
}

impl Backend {
    pub(super) async fn start(choice: &ChaosConsul, farms: usize) -> Result<Backend, String> {
        let cluster = match choice {
            ChaosConsul::Embedded => {
                let server = EmbeddedServer::start(ServerConfig {
                    session_ttl_min: Duration::from_secs(1),
                    record_commits: true,
                    ..ServerConfig::ephemeral()
                })
                .await
                .map_err(|e| e.to_string())?;
                return Ok(Backend::Embedded(server));
            }
            ChaosConsul::Agent(bin) => (
                ConsulCluster {
                    servers: vec![ConsulAgent::start(AgentConfig::dev(bin, "chaos")).await?],
                    clients: Vec::new(),
                },
                None,
            ),
            ChaosConsul::Cluster {
                bin,
                servers,
                partitions: false,
            } => (ConsulCluster::start(bin, *servers, farms + 1).await?, None),
            ChaosConsul::Cluster {
                bin,
                servers,
                partitions: true,
            } => {
                let (c, p) = ConsulCluster::start_partitionable(bin, *servers, farms + 1).await?;
                (c, Some(p))
            }
        };
        let (cluster, partitions) = cluster;
        let consul = client(&harness_url(&cluster))?;
        let observer = ExternalObserver::spawn(consul);
        let elections = Arc::new(AtomicU64::new(0));
        let stop_poller = CancellationToken::new();
        let urls: Vec<String> = cluster.servers.iter().map(|s| s.http_url()).collect();
        tokio::spawn(count_elections(
            urls,
            elections.clone(),
            stop_poller.clone(),
        ));
        Ok(Backend::Real {
            cluster,
            observer,
            elections,
            partitions,
            stop_poller,
        })
    }

    /// The Consul farm `i` talks to: its own client agent in a cluster, else the server.
    pub(super) fn farm_addr(&self, i: usize) -> SocketAddr {
        match self {
            Backend::Embedded(s) => s.addr(),
            Backend::Real { cluster, .. } => match cluster.clients.len() {
                0 => cluster.servers[0].http_addr(),
                n => cluster.clients[i % (n - 1).max(1)].http_addr(),
            },
        }
    }

    /// The Consul the run's own reads and writes (mutations, checks) go to.
    pub(super) fn url(&self) -> String {
        match self {
            Backend::Embedded(s) => s.url(),
            Backend::Real { cluster, .. } => harness_url(cluster),
        }
    }

    /// Whether Consul servers can be faulted (a cluster that keeps a quorum without one).
    pub(super) fn faults_servers(&self) -> bool {
        matches!(self, Backend::Real { cluster, .. } if cluster.servers.len() >= 3)
    }

    /// Keys under `prefix` now.
    pub(super) async fn count_prefix(&self, consul: &Consul, prefix: &str) -> Option<usize> {
        match self {
            Backend::Embedded(s) => Some(s.count_prefix(prefix)),
            Backend::Real { .. } => consul
                .kv_keys(prefix, None, &QueryOptions::default())
                .await
                .ok()
                .map(|(k, _)| k.len()),
        }
    }

    /// One fault on a Consul server: the leader (or another server) SIGKILLed and restarted,
    /// SIGSTOPped past an election and continued, or stopped and restarted. Returns its kind.
    /// Waits until a leader is back before it returns, so faults never stack up to a lost
    /// quorum.
    pub(super) async fn server_fault(&mut self, rng: &mut StdRng) -> Option<&'static str> {
        let Backend::Real { cluster, .. } = self else {
            return None;
        };
        let leader = cluster.leader().await;
        let (target, on_leader) = match leader {
            Some(l) if rng.random_bool(0.6) => (l, true),
            _ => (rng.random_range(0..cluster.servers.len()), false),
        };
        let kind = match (rng.random_range(0..3), on_leader) {
            (0, true) => "consul-sigkill-leader",
            (0, false) => "consul-sigkill-server",
            (1, true) => "consul-sigstop-leader",
            (1, false) => "consul-sigstop-server",
            (_, true) => "consul-restart-leader",
            (_, false) => "consul-restart-server",
        };
        let s = &mut cluster.servers[target];
        match kind {
            "consul-sigkill-leader" | "consul-sigkill-server" => {
                s.kill().await;
                tokio::time::sleep(Duration::from_millis(rng.random_range(500..3000))).await;
                if let Err(e) = s.restart().await {
                    tracing::warn!(error = %e, "Consul server did not come back");
                }
            }
            "consul-sigstop-leader" | "consul-sigstop-server" => {
                s.signal("STOP");
                tokio::time::sleep(Duration::from_millis(rng.random_range(2000..5000))).await;
                s.signal("CONT");
            }
            _ => {
                s.stop().await;
                tokio::time::sleep(Duration::from_millis(rng.random_range(0..2000))).await;
                if let Err(e) = s.restart().await {
                    tracing::warn!(error = %e, "Consul server did not come back");
                }
            }
        }
        // The next fault only once the cluster has a leader again.
        wait_for_leader(cluster, Duration::from_secs(20)).await;
        Some(kind)
    }

    /// Whether the network between the agents can be cut.
    pub(super) fn partitions(&self) -> bool {
        matches!(
            self,
            Backend::Real {
                partitions: Some(_),
                ..
            }
        )
    }

    /// One network partition, held for a few seconds and healed (see [`Topology`]). Returns
    /// its kind. Like [`Backend::server_fault`], waits for a leader after healing. The run's
    /// own client agent (the last) is never cut: the checks read through it.
    pub(super) async fn partition_fault(&mut self, rng: &mut StdRng) -> Option<&'static str> {
        let Backend::Real {
            cluster,
            partitions: Some(parts),
            ..
        } = self
        else {
            return None;
        };
        let servers = cluster.servers.len();
        // Farms' own client agents (the last client is the run's).
        let farm_agents: Vec<usize> =
            (servers..servers + cluster.clients.len().saturating_sub(1)).collect();
        let leader = cluster.leader().await;
        let topology = Topology::pick(rng, servers, &farm_agents, leader);
        let hold = Duration::from_millis(rng.random_range(3000..10_000));
        let kind = topology.kind();
        tracing::info!(kind, ?topology, ?hold, "partition");
        match &topology {
            Topology::Flapping(rounds) => {
                for t in rounds {
                    if let Err(e) = t.apply(parts, servers) {
                        tracing::warn!(error = %e, "partition not applied");
                    }
                    tokio::time::sleep(Duration::from_millis(rng.random_range(500..2000))).await;
                    let _ = parts.heal();
                    tokio::time::sleep(Duration::from_millis(rng.random_range(500..2000))).await;
                }
            }
            t => {
                if let Err(e) = t.apply(parts, servers) {
                    tracing::warn!(error = %e, "partition not applied");
                }
                tokio::time::sleep(hold).await;
            }
        }
        if let Err(e) = parts.heal() {
            tracing::warn!(error = %e, "partition not healed");
        }
        wait_for_leader(cluster, Duration::from_secs(30)).await;
        Some(kind)
    }

    /// Whether the whole store can be backed up and restored: a cluster whose servers keep
    /// their data on disk.
    pub(super) fn restores(&self) -> bool {
        matches!(self, Backend::Real { cluster, .. } if cluster.servers.len() >= 3)
    }

    /// A cold backup of every server into `dir` (see [`ConsulCluster::backup_servers`]), or,
    /// with `restore`, every server put back to the backup in `dir`. The outside observer is
    /// told when the store goes back (what it saw in the outbox and does not see again was
    /// lost with the store). Waits for a leader.
    pub(super) async fn backup_or_restore(
        &mut self,
        dir: &std::path::Path,
        restore: bool,
    ) -> Result<&'static str, String> {
        let Backend::Real {
            cluster, observer, ..
        } = self
        else {
            return Err("a backup needs a Consul cluster".into());
        };
        let kind = if restore {
            cluster
                .restore_servers(dir, || observer.store_restored())
                .await?;
            "consul-restore"
        } else {
            cluster.backup_servers(dir).await?;
            "consul-backup"
        };
        wait_for_leader(cluster, Duration::from_secs(30)).await;
        Ok(kind)
    }

    /// Elections seen so far (raft term increases), on real Consul.
    pub(super) fn elections(&self) -> Option<u64> {
        match self {
            Backend::Embedded(_) => None,
            Backend::Real { elections, .. } => Some(elections.load(Ordering::Relaxed)),
        }
    }

    pub(super) fn observer(&self) -> Option<&ExternalObserver> {
        match self {
            Backend::Embedded(_) => None,
            Backend::Real { observer, .. } => Some(observer),
        }
    }

    pub(super) fn embedded(&self) -> Option<&EmbeddedServer> {
        match self {
            Backend::Embedded(s) => Some(s),
            Backend::Real { .. } => None,
        }
    }

    pub(super) async fn shutdown(self) {
        match self {
            Backend::Embedded(s) => s.shutdown().await,
            Backend::Real {
                mut cluster,
                observer,
                stop_poller,
                ..
            } => {
                stop_poller.cancel();
                let _ = observer.finish().await;
                for a in cluster.clients.iter_mut().chain(cluster.servers.iter_mut()) {
                    a.kill().await;
                }
            }
        }
    }
}

/// Waits (up to `limit`) until the cluster names a leader.
async fn wait_for_leader(cluster: &ConsulCluster, limit: Duration) {
    let start = tokio::time::Instant::now();
    while cluster.leader().await.is_none() && start.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The harness's own agent: the last client of a cluster (so that it survives server faults),
/// else the server.
fn harness_url(cluster: &ConsulCluster) -> String {
    match cluster.clients.last() {
        Some(c) => c.http_url(),
        None => cluster.servers[0].http_url(),
    }
}

fn client(url: &str) -> Result<Consul, String> {
    Consul::new(ConsulConfig::new(url.to_string())).map_err(|e| e.to_string())
}

/// Counts raft term increases across the servers: each is an election (one that a candidate
/// won or not; a term is only ever raised by a candidate).
async fn count_elections(urls: Vec<String>, elections: Arc<AtomicU64>, stop: CancellationToken) {
    crate::consul::init_tls();
    let Ok(http) = reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
    else {
        return;
    };
    let mut highest: Option<u64> = None;
    loop {
        for u in &urls {
            let Ok(r) = http.get(format!("{u}/v1/agent/self")).send().await else {
                continue;
            };
            let Ok(v) = r.json::<serde_json::Value>().await else {
                continue;
            };
            let Some(term) = v["Stats"]["raft"]["term"]
                .as_str()
                .and_then(|t| t.parse::<u64>().ok())
            else {
                continue;
            };
            match highest {
                None => highest = Some(term),
                Some(h) if term > h => {
                    elections.fetch_add(term - h, Ordering::Relaxed);
                    highest = Some(term);
                }
                _ => {}
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    }
}

/// What a partition cuts. Indices are endpoints: servers first, then client agents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Topology {
    /// The leader cut from the other servers, both ways: a minority leader, until it notices.
    MinorityLeader(usize),
    /// One server (not the leader) cut from the other servers.
    OneServer(usize),
    /// A farm's own client agent cut from every server: the farm keeps its agent, the agent
    /// loses the cluster.
    FarmAgent(usize),
    /// What `.0` sends `.1` is dropped, not the other way (two servers).
    OneWay(usize, usize),
    /// Two servers that cannot see each other, both seeing the third.
    Bridge(usize, usize),
    /// Partitions that form and heal every second or two.
    Flapping(Vec<Topology>),
}

impl Topology {
    pub(super) fn pick(
        rng: &mut StdRng,
        servers: usize,
        farm_agents: &[usize],
        leader: Option<usize>,
    ) -> Topology {
        let other_than = |rng: &mut StdRng, x: usize| loop {
            let s = rng.random_range(0..servers);
            if s != x {
                return s;
            }
        };
        let simple = |rng: &mut StdRng| -> Topology {
            match rng.random_range(0..5) {
                0 => Topology::MinorityLeader(leader.unwrap_or(0)),
                1 => Topology::OneServer(other_than(rng, leader.unwrap_or(usize::MAX))),
                2 if !farm_agents.is_empty() => {
                    Topology::FarmAgent(farm_agents[rng.random_range(0..farm_agents.len())])
                }
                3 => {
                    let a = rng.random_range(0..servers);
                    Topology::OneWay(a, other_than(rng, a))
                }
                _ => {
                    let a = rng.random_range(0..servers);
                    Topology::Bridge(a, other_than(rng, a))
                }
            }
        };
        if rng.random_range(0..6) == 0 {
            let rounds = rng.random_range(3..7);
            Topology::Flapping((0..rounds).map(|_| simple(rng)).collect())
        } else {
            simple(rng)
        }
    }

    pub(super) fn kind(&self) -> &'static str {
        match self {
            Topology::MinorityLeader(_) => "partition-minority-leader",
            Topology::OneServer(_) => "partition-one-server",
            Topology::FarmAgent(_) => "partition-farm-agent",
            Topology::OneWay(..) => "partition-one-way",
            Topology::Bridge(..) => "partition-bridge",
            Topology::Flapping(_) => "partition-flapping",
        }
    }

    fn apply(&self, parts: &mut Partitions, servers: usize) -> Result<(), String> {
        let others = |x: usize| (0..servers).filter(|s| *s != x).collect::<Vec<_>>();
        parts.heal()?;
        match self {
            Topology::MinorityLeader(s) | Topology::OneServer(s) => parts.isolate(*s, &others(*s)),
            Topology::FarmAgent(a) => parts.isolate(*a, &(0..servers).collect::<Vec<_>>()),
            Topology::OneWay(a, b) => parts.block(*a, *b),
            Topology::Bridge(a, b) => parts.split(&[*a], &[*b]),
            Topology::Flapping(_) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn partitions_never_cut_the_runs_own_agent_and_pick_every_kind() {
        let mut rng = StdRng::seed_from_u64(37);
        let mut kinds = std::collections::BTreeSet::new();
        for _ in 0..500 {
            let t = Topology::pick(&mut rng, 3, &[3, 4], Some(1));
            kinds.insert(t.kind());
            let mut all = vec![t.clone()];
            if let Topology::Flapping(r) = &t {
                all.extend(r.iter().cloned());
            }
            for t in all {
                match t {
                    Topology::MinorityLeader(s) => assert_eq!(s, 1),
                    Topology::OneServer(s) => assert!(s < 3 && s != 1),
                    Topology::FarmAgent(a) => assert!(a == 3 || a == 4, "never 5, the run's"),
                    Topology::OneWay(a, b) | Topology::Bridge(a, b) => {
                        assert!(a < 3 && b < 3 && a != b)
                    }
                    Topology::Flapping(_) => {}
                }
            }
        }
        assert_eq!(kinds.len(), 6, "{kinds:?}");
    }
}

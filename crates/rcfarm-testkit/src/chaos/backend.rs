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
    /// servers are SIGKILLed, SIGSTOPped and restarted, the leader included.
    Cluster { bin: PathBuf, servers: usize },
}

pub(super) enum Backend {
    Embedded(EmbeddedServer),
    Real {
        cluster: ConsulCluster,
        observer: ExternalObserver,
        /// Raft term increases seen (elections), counted by a poller.
        elections: Arc<AtomicU64>,
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
            ChaosConsul::Agent(bin) => ConsulCluster {
                servers: vec![ConsulAgent::start(AgentConfig::dev(bin, "chaos")).await?],
                clients: Vec::new(),
            },
            ChaosConsul::Cluster { bin, servers } => {
                ConsulCluster::start(bin, *servers, farms + 1).await?
            }
        };
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
        for _ in 0..200 {
            if cluster.leader().await.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Some(kind)
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

//! Real Consul agents on loopback, for tests and the chaos runs: a dev agent, or the servers
//! and client agents of a cluster, each with its own ports and data directory. The binary is
//! whatever `RCFARM_TEST_CONSUL_BIN` names (CI points it at HashiCorp Consul 0.7.0 in
//! `../shared/consul/`); nothing here works without one.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::process::{Child, Command};

/// The environment variable naming the Consul binary tests and chaos runs use.
pub const CONSUL_BIN_ENV: &str = "RCFARM_TEST_CONSUL_BIN";

/// The Consul binary from [`CONSUL_BIN_ENV`], if it names an existing file.
pub fn consul_bin() -> Option<PathBuf> {
    let p = PathBuf::from(std::env::var_os(CONSUL_BIN_ENV)?);
    p.is_file().then_some(p)
}

/// TLS for an agent's HTTPS listener.
#[derive(Debug, Clone)]
pub struct AgentTls {
    pub ca_file: PathBuf,
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// Consul's `verify_incoming`: HTTPS clients must present a certificate signed by the CA.
    pub verify_incoming: bool,
    /// No plain HTTP listener: the API is served over HTTPS only.
    pub https_only: bool,
}

impl AgentTls {
    /// A client configuration that reaches an agent with this TLS: its CA trusted, and its own
    /// certificate (made for client authentication too) presented.
    pub fn client_config(&self, url: &str) -> crate::consul::ConsulConfig {
        crate::consul::ConsulConfig {
            tls: crate::consul::TlsConfig {
                ca_file: Some(self.ca_file.clone()),
                client_cert: Some(self.cert_file.clone()),
                client_key: Some(self.key_file.clone()),
                ..Default::default()
            },
            ..crate::consul::ConsulConfig::new(url)
        }
    }
}

/// How to run one agent.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub bin: PathBuf,
    pub node_name: String,
    /// `-dev`: a single in-memory server that elects itself.
    pub dev: bool,
    pub server: bool,
    pub bootstrap_expect: Option<usize>,
    /// Serf LAN addresses of agents to join (`retry_join`).
    pub join: Vec<SocketAddr>,
    /// Keep state here (for a restart "with its data"); a fresh temporary one when `None`.
    pub data_dir: Option<PathBuf>,
    /// ACLs on, with this master token and default policy deny.
    pub acl_master_token: Option<String>,
    /// An HTTPS listener beside the HTTP one.
    pub tls: Option<AgentTls>,
    /// Lowest session TTL the agent accepts (tests run farms with TTLs below Consul's 10 s).
    pub session_ttl_min: Duration,
    /// The address it binds (its API, Serf and server ports): 127.0.0.1, or one of its own
    /// for partitions ([`super::partition`]).
    pub ip: Ipv4Addr,
    /// Runs under this user id (and group id) instead of the caller's: what a partition's
    /// rules recognise its packets by. Needs root.
    pub uid: Option<u32>,
}

impl AgentConfig {
    pub fn dev(bin: &Path, node_name: &str) -> Self {
        AgentConfig {
            bin: bin.to_path_buf(),
            node_name: node_name.to_string(),
            dev: true,
            server: true,
            bootstrap_expect: None,
            join: Vec::new(),
            data_dir: None,
            acl_master_token: None,
            tls: None,
            session_ttl_min: Duration::from_secs(1),
            ip: Ipv4Addr::LOCALHOST,
            uid: None,
        }
    }
}

/// The first port the kernel hands out for a port-0 listener or an outgoing connection
/// (`net.ipv4.ip_local_port_range`; Linux's default when it cannot be read).
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
}

/// `n` ports free on `ip`, all bound at once until the last is picked (a port given back can be
/// handed out again at once: two listeners on one port, and Consul refuses to start), for a
/// server that keeps its ports across a restart. They come from below the ephemeral range, at
/// random: while the server is stopped, a port of the ephemeral range can be taken by any
/// outgoing connection or port-0 listener on the machine (seen with eight tests at a time: a
/// restarted agent's server port held by another, "bind: address already in use"). Port-0
/// picks where that range leaves too little room below it.
///
/// A port is handed out once per process: the agents of one cluster are given their ports one
/// agent at a time before any starts, and a port one agent was given is free again until that
/// agent binds it (seen in CI: one server's Serf LAN port was another's Serf WAN port, so the
/// cluster joined itself twice and never bootstrapped, "Found duplicate ID in configuration").
pub fn ports_below_ephemeral(ip: Ipv4Addr, n: usize) -> Result<Vec<u16>, String> {
    use rand::Rng;
    static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    const LOWEST: u16 = 10_000;
    let high = ephemeral_low();
    let mut handed = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    let mut held: Vec<TcpListener> = Vec::with_capacity(n);
    let mut take = |l: TcpListener, held: &mut Vec<TcpListener>| -> Result<(), String> {
        let port = l.local_addr().map_err(|e| e.to_string())?.port();
        if handed.insert(port) {
            held.push(l);
        }
        Ok(())
    };
    if high > LOWEST + 2_000 {
        let mut rng = rand::rng();
        for _ in 0..2_000 {
            if held.len() == n {
                break;
            }
            if let Ok(l) = TcpListener::bind((ip, rng.random_range(LOWEST..high))) {
                take(l, &mut held)?;
            }
        }
    }
    for _ in 0..10_000 {
        if held.len() == n {
            break;
        }
        take(
            TcpListener::bind((ip, 0)).map_err(|e| e.to_string())?,
            &mut held,
        )?;
    }
    if held.len() < n {
        return Err(format!("no {n} free ports on {ip} not handed out before"));
    }
    held.iter()
        .map(|l| l.local_addr().map(|a| a.port()).map_err(|e| e.to_string()))
        .collect()
}

/// The ports an agent listens on.
#[derive(Debug, Clone, Copy)]
pub struct AgentPorts {
    pub http: u16,
    pub https: Option<u16>,
    pub rpc: u16,
    pub serf_lan: u16,
    pub serf_wan: u16,
    pub server: u16,
}

/// A running (or stopped) agent. Dropping it kills the process.
pub struct ConsulAgent {
    pub config: AgentConfig,
    pub ports: AgentPorts,
    dir: PathBuf,
    data_dir: PathBuf,
    child: Option<Child>,
    _tmp: Option<tempfile::TempDir>,
}

impl ConsulAgent {
    /// Starts an agent and waits until its HTTP API answers (and, for a dev agent, until it
    /// has elected itself).
    pub async fn start(config: AgentConfig) -> Result<ConsulAgent, String> {
        let mut agent = ConsulAgent::prepare(config)?;
        agent.spawn()?;
        let wait_leader = agent.config.dev;
        agent
            .wait_ready(wait_leader, Duration::from_secs(60))
            .await?;
        Ok(agent)
    }

    /// Picks the ports and the directories; starts nothing.
    fn prepare(config: AgentConfig) -> Result<ConsulAgent, String> {
        let tmp = tempfile::Builder::new()
            .prefix(&format!("rcfarm-consul-{}-", config.node_name))
            .tempdir()
            .map_err(|e| e.to_string())?;
        let dir = tmp.path().to_path_buf();
        let data_dir = config.data_dir.clone().unwrap_or_else(|| dir.join("data"));
        let p = ports_below_ephemeral(config.ip, 6)?;
        let ports = AgentPorts {
            http: p[0],
            https: config.tls.as_ref().map(|_| p[1]),
            rpc: p[2],
            serf_lan: p[3],
            serf_wan: p[4],
            server: p[5],
        };
        Ok(ConsulAgent {
            config,
            ports,
            dir,
            data_dir,
            child: None,
            _tmp: Some(tmp),
        })
    }

    fn config_json(&self) -> serde_json::Value {
        let c = &self.config;
        let mut v = json!({
            "node_name": c.node_name,
            "bind_addr": c.ip.to_string(),
            "client_addr": c.ip.to_string(),
            "disable_update_check": true,
            "session_ttl_min": crate::util::format_go_duration(c.session_ttl_min),
            "performance": {"raft_multiplier": 1},
            "ports": {
                "dns": -1,
                "http": if self.https_only() { -1 } else { i64::from(self.ports.http) },
                "https": self.ports.https.map_or(-1, i64::from),
                "rpc": self.ports.rpc,
                "serf_lan": self.ports.serf_lan,
                "serf_wan": self.ports.serf_wan,
                "server": self.ports.server,
            },
        });
        if !c.dev {
            v["data_dir"] = json!(self.data_dir);
            v["server"] = json!(c.server);
            if let Some(n) = c.bootstrap_expect {
                v["bootstrap_expect"] = json!(n);
            }
            if !c.join.is_empty() {
                v["retry_join"] = json!(c.join.iter().map(|a| a.to_string()).collect::<Vec<_>>());
                v["retry_interval"] = json!("1s");
            }
        }
        if let Some(t) = &c.acl_master_token {
            v["acl_datacenter"] = json!("dc1");
            v["acl_master_token"] = json!(t);
            v["acl_default_policy"] = json!("deny");
            v["acl_down_policy"] = json!("deny");
        }
        if let Some(t) = &c.tls {
            v["ca_file"] = json!(t.ca_file);
            v["cert_file"] = json!(t.cert_file);
            v["key_file"] = json!(t.key_file);
            v["verify_incoming"] = json!(t.verify_incoming);
        }
        v
    }

    fn spawn(&mut self) -> Result<(), String> {
        let cfg_path = self.dir.join("agent.json");
        if let Some(uid) = self.config.uid {
            // Its files (config, log, data) become its own: it runs as another user.
            std::fs::create_dir_all(&self.data_dir).map_err(|e| e.to_string())?;
            chown_tree(&self.dir, uid)?;
            chown_tree(&self.data_dir, uid)?;
        }
        std::fs::write(&cfg_path, self.config_json().to_string()).map_err(|e| e.to_string())?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .map_err(|e| e.to_string())?;
        let mut cmd = Command::new(&self.config.bin);
        cmd.arg("agent");
        if self.config.dev {
            cmd.arg("-dev");
        }
        cmd.arg("-config-file")
            .arg(&cfg_path)
            .stdout(Stdio::from(log.try_clone().map_err(|e| e.to_string())?))
            .stderr(Stdio::from(log))
            .kill_on_drop(true);
        if let Some(uid) = self.config.uid {
            cmd.uid(uid).gid(uid);
        }
        let child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.config.bin.display()))?;
        self.child = Some(child);
        Ok(())
    }

    /// Where the agent's output goes.
    pub fn log_path(&self) -> PathBuf {
        self.dir.join("agent.log")
    }

    /// The last lines of the agent's log, for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(lines).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    fn https_only(&self) -> bool {
        self.config.tls.as_ref().is_some_and(|t| t.https_only)
    }

    /// The API's address: the HTTPS listener when the agent has no plain one.
    pub fn url(&self) -> String {
        match (self.https_only(), self.https_url()) {
            (true, Some(u)) => u,
            _ => self.http_url(),
        }
    }

    /// A client configuration that reaches this agent's API (over HTTPS with the agent's CA and
    /// certificate when it has no plain listener).
    pub fn client_config(&self) -> crate::consul::ConsulConfig {
        match (&self.config.tls, self.https_only()) {
            (Some(t), true) => t.client_config(&self.url()),
            _ => crate::consul::ConsulConfig::new(self.http_url()),
        }
    }

    /// Waits until the HTTP API answers, and with `leader` until it names a leader.
    pub async fn wait_ready(&self, leader: bool, timeout: Duration) -> Result<(), String> {
        let client = crate::consul::Consul::new(crate::consul::ConsulConfig {
            attempts: 1,
            timeout: Duration::from_secs(2),
            ..self.client_config()
        })
        .map_err(|e| e.to_string())?;
        let started = Instant::now();
        loop {
            if let Ok(l) = client.leader().await
                && (!leader || !l.is_empty())
            {
                return Ok(());
            }
            if started.elapsed() > timeout {
                return Err(format!(
                    "Consul agent {} not ready after {timeout:?}:\n{}",
                    self.config.node_name,
                    self.log_tail(30)
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn http_url(&self) -> String {
        format!("http://{}:{}", self.config.ip, self.ports.http)
    }

    pub fn https_url(&self) -> Option<String> {
        self.ports
            .https
            .map(|p| format!("https://{}:{p}", self.config.ip))
    }

    pub fn http_addr(&self) -> SocketAddr {
        SocketAddr::from((self.config.ip, self.ports.http))
    }

    /// The Serf LAN address others join.
    pub fn serf_lan(&self) -> SocketAddr {
        SocketAddr::from((self.config.ip, self.ports.serf_lan))
    }

    /// The raft address `/v1/status/leader` names when this agent leads.
    pub fn raft_addr(&self) -> String {
        format!("{}:{}", self.config.ip, self.ports.server)
    }

    /// This agent as a partition's rules see it (`None`: it has no address and user of its
    /// own).
    pub fn endpoint(&self) -> Option<super::partition::Endpoint> {
        Some(super::partition::Endpoint {
            name: self.config.node_name.clone(),
            ip: self.config.ip,
            uid: self.config.uid?,
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Sends a signal (`STOP`, `CONT`, …) to the agent.
    pub fn signal(&self, sig: &str) {
        if let Some(pid) = self.pid() {
            let _ = std::process::Command::new("kill")
                .arg(format!("-{sig}"))
                .arg(pid.to_string())
                .stderr(Stdio::null())
                .status();
        }
    }

    /// Where the agent keeps its raft log and snapshots (nothing in it for a dev agent).
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// SIGKILL, and reaps it.
    pub async fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.start_kill();
            let _ = c.wait().await;
        }
    }

    /// SIGTERM (a graceful leave), waiting up to 15 s before killing it.
    pub async fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            if let Some(pid) = c.id() {
                let _ = std::process::Command::new("kill")
                    .arg("-TERM")
                    .arg(pid.to_string())
                    .status();
            }
            if tokio::time::timeout(Duration::from_secs(15), c.wait())
                .await
                .is_err()
            {
                let _ = c.start_kill();
                let _ = c.wait().await;
            }
        }
    }

    /// Starts a stopped agent again with the same ports and data (a dev agent comes back
    /// empty: it keeps nothing).
    pub async fn restart(&mut self) -> Result<(), String> {
        if self.child.is_some() {
            self.stop().await;
        }
        self.spawn()?;
        self.wait_ready(self.config.dev, Duration::from_secs(60))
            .await
    }
}

/// A cluster on loopback: `servers` servers that elect a leader among themselves, and client
/// agents joined to them (one per farm, as production runs them).
pub struct ConsulCluster {
    pub servers: Vec<ConsulAgent>,
    pub clients: Vec<ConsulAgent>,
}

impl ConsulCluster {
    pub async fn start(
        bin: &Path,
        servers: usize,
        clients: usize,
    ) -> Result<ConsulCluster, String> {
        Self::start_with(bin, servers, clients, false).await
    }

    /// A cluster whose agents can be partitioned from each other: each binds an address of its
    /// own and runs under a user id of its own ([`super::partition`]; needs root), and the
    /// partitions between them (none yet), servers first, then clients.
    pub async fn start_partitionable(
        bin: &Path,
        servers: usize,
        clients: usize,
    ) -> Result<(ConsulCluster, super::partition::Partitions), String> {
        super::partition::available()?;
        let cluster = Self::start_with(bin, servers, clients, true).await?;
        let endpoints = cluster
            .servers
            .iter()
            .chain(&cluster.clients)
            .filter_map(ConsulAgent::endpoint)
            .collect();
        let partitions = super::partition::Partitions::new(endpoints)?;
        Ok((cluster, partitions))
    }

    async fn start_with(
        bin: &Path,
        servers: usize,
        clients: usize,
        own_identities: bool,
    ) -> Result<ConsulCluster, String> {
        let own = |c: &mut AgentConfig| {
            if own_identities {
                let (ip, uid) = super::partition::identity();
                c.ip = ip;
                c.uid = Some(uid);
            }
        };
        // Ports first, so every server can name the others to join.
        let mut agents = Vec::new();
        for i in 0..servers {
            let mut c = AgentConfig::dev(bin, &format!("s{}", i + 1));
            c.dev = false;
            c.bootstrap_expect = Some(servers);
            own(&mut c);
            agents.push(c);
        }
        let mut started: Vec<ConsulAgent> = agents
            .into_iter()
            .map(ConsulAgent::prepare)
            .collect::<Result<_, _>>()?;
        let join: Vec<SocketAddr> = started.iter().map(ConsulAgent::serf_lan).collect();
        for a in &mut started {
            a.config.join = join.clone();
            a.spawn()?;
        }
        for a in &started {
            a.wait_ready(true, Duration::from_secs(60)).await?;
        }
        let mut cluster = ConsulCluster {
            servers: started,
            clients: Vec::new(),
        };
        for i in 0..clients {
            let mut c = AgentConfig::dev(bin, &format!("c{}", i + 1));
            c.dev = false;
            c.server = false;
            c.join = join.clone();
            own(&mut c);
            let mut a = ConsulAgent::prepare(c)?;
            a.spawn()?;
            a.wait_ready(true, Duration::from_secs(60)).await?;
            cluster.clients.push(a);
        }
        Ok(cluster)
    }

    /// A cold backup of every server: all stopped (SIGTERM, which a server does not take as
    /// leaving), their data directories copied under `to` (one directory per server), and all
    /// started again. Consul 0.7 has no snapshot API (it came in 0.7.1); the copy of stopped
    /// servers is the backup an operator of 0.7 takes.
    pub async fn backup_servers(&mut self, to: &Path) -> Result<(), String> {
        self.stop_servers().await;
        let _ = std::fs::remove_dir_all(to);
        for (i, s) in self.servers.iter().enumerate() {
            copy_tree(&s.data_dir, &to.join(format!("s{}", i + 1)))?;
        }
        self.start_servers().await
    }

    /// Every server stopped, its data directory replaced by the copy under `from` that
    /// [`ConsulCluster::backup_servers`] took, and started: the whole store goes back to the
    /// backup's moment (client agents keep running and find the servers again).
    /// `while_down` runs once every server has stopped.
    pub async fn restore_servers(
        &mut self,
        from: &Path,
        while_down: impl FnOnce(),
    ) -> Result<(), String> {
        self.stop_servers().await;
        while_down();
        for (i, s) in self.servers.iter().enumerate() {
            let copy = from.join(format!("s{}", i + 1));
            if !copy.is_dir() {
                return Err(format!(
                    "no backup of server {} in {}",
                    i + 1,
                    from.display()
                ));
            }
            std::fs::remove_dir_all(&s.data_dir)
                .map_err(|e| format!("{}: {e}", s.data_dir.display()))?;
            // Its own again when it starts (an agent with a uid of its own is given its data
            // directory at every start).
            copy_tree(&copy, &s.data_dir)?;
        }
        self.start_servers().await
    }

    async fn stop_servers(&mut self) {
        for s in &mut self.servers {
            s.stop().await;
        }
    }

    /// Starts every stopped server at once (one alone cannot elect a leader) and waits for a
    /// leader.
    async fn start_servers(&mut self) -> Result<(), String> {
        for s in self.servers.iter_mut().filter(|s| !s.is_running()) {
            s.spawn()?;
        }
        for s in &self.servers {
            s.wait_ready(true, Duration::from_secs(60)).await?;
        }
        Ok(())
    }

    /// The server that leads now, per the first server that answers.
    pub async fn leader(&self) -> Option<usize> {
        crate::consul::init_tls();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .ok()?;
        for s in self.servers.iter().filter(|s| s.is_running()) {
            let Ok(r) = http
                .get(format!("{}/v1/status/leader", s.http_url()))
                .send()
                .await
            else {
                continue;
            };
            let Ok(body) = r.text().await else { continue };
            let addr = body.trim().trim_matches('"');
            if let Some(i) = self.servers.iter().position(|x| x.raft_addr() == addr) {
                return Some(i);
            }
        }
        None
    }
}

/// Copies a directory tree (files, directories; an agent's data directory has nothing else).
pub fn copy_tree(from: &Path, to: &Path) -> Result<(), String> {
    std::fs::create_dir_all(to).map_err(|e| format!("{}: {e}", to.display()))?;
    for entry in std::fs::read_dir(from).map_err(|e| format!("{}: {e}", from.display()))? {
        let entry = entry.map_err(|e| e.to_string())?;
        let kind = entry.file_type().map_err(|e| e.to_string())?;
        let target = to.join(entry.file_name());
        if kind.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else if kind.is_file() {
            std::fs::copy(entry.path(), &target)
                .map_err(|e| format!("{}: {e}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// Gives `path` and everything under it to user and group `uid`.
fn chown_tree(path: &Path, uid: u32) -> Result<(), String> {
    std::os::unix::fs::chown(path, Some(uid), Some(uid))
        .map_err(|e| format!("cannot give {} to user {uid}: {e}", path.display()))?;
    if path.is_dir() {
        for entry in std::fs::read_dir(path).map_err(|e| e.to_string())? {
            let entry = entry.map_err(|e| e.to_string())?;
            if !entry.file_type().map_err(|e| e.to_string())?.is_symlink() {
                chown_tree(&entry.path(), uid)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_port_is_handed_out_twice_in_one_process() {
        let ip = Ipv4Addr::LOCALHOST;
        let mut seen = std::collections::BTreeSet::new();
        // Each pick gives its listeners back before the next, as a cluster's agents get theirs.
        for _ in 0..50 {
            for p in ports_below_ephemeral(ip, 6).unwrap() {
                assert!(seen.insert(p), "port {p} handed out twice");
            }
        }
    }
}

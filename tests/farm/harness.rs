//! A cluster for farm tests: a Consul — the embedded server in this process (recording every
//! commit), or a real Consul agent (`RCFARM_TEST_CONSUL_BIN`, watched from outside) — real
//! `rcfarm serve` processes around it, and helpers to set up nodes and RCs and to check what
//! the farms did. [`on_both_backends!`] runs a test against each.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rcfarm::consul::{Consul, QueryOptions};
use rcfarm::labels::{LabelSet, LabelStore, LabelType, parse_labels, split_pod_label_id};
use rcfarm::rc::{RcId, RcStore};
use rcfarm::server::{Compat, EmbeddedServer, LoggedCommit, ServerConfig};
use rcfarm_testkit::chaos::agent::{AgentConfig, ConsulAgent};
use rcfarm_testkit::invariants::Observer;
use rcfarm_testkit::invariants::external::ExternalObserver;
use rcfarm_testkit::simulator::{NodeSimulator, SimConfig};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::common::{client, client_for, init_tracing};

pub const BIN: &str = env!("CARGO_BIN_EXE_rcfarm");
/// Session TTL the test farms use (the server accepts down to 1 s).
pub const TTL: Duration = Duration::from_secs(2);

pub struct FarmProc {
    pub id: String,
    pub child: Child,
    pub pid: u32,
    pub log: Arc<Mutex<String>>,
}

/// With `RCFARM_TEST_FARM_LOGS=DIR`, every test farm's log is written to
/// `DIR/<farm-id>-<pid>.log` when the test drops it (to read after a failure).
impl Drop for FarmProc {
    fn drop(&mut self) {
        if let Ok(dir) = std::env::var("RCFARM_TEST_FARM_LOGS") {
            let _ = std::fs::create_dir_all(&dir);
            let text = self.log.lock().clone();
            let _ = std::fs::write(format!("{dir}/{}-{}.log", self.id, self.pid), text);
        }
    }
}

/// Which Consul a test runs against.
#[derive(Debug, Clone)]
pub enum Backend {
    /// The embedded server, answering as this Consul version where versions differ.
    Embedded(Compat),
    /// A real Consul agent from this binary.
    Real(std::path::PathBuf),
}

impl Backend {
    /// The real Consul of `RCFARM_TEST_CONSUL_BIN`, or `None` after saying loudly that the
    /// test is skipped.
    pub fn real() -> Option<Backend> {
        crate::common::real_consul_bin().map(Backend::Real)
    }
}

/// Runs an `async fn(Backend)` test against the embedded server and against real Consul.
#[macro_export]
macro_rules! on_both_backends {
    ($name:ident) => {
        $crate::on_both_backends!(@with $name {});
    };
    (@with $name:ident { $($extra:item)* }) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn embedded() {
                super::$name($crate::harness::Backend::Embedded(
                    rcfarm::server::Compat::V1,
                ))
                .await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn real_consul() {
                if let Some(b) = $crate::harness::Backend::real() {
                    super::$name(b).await
                }
            }
            $($extra)*
        }
    };
}

/// Like [`on_both_backends!`], plus `…::embedded_consul_0_7`: the embedded server answering as
/// Consul 0.7 (`consul-dev --compat 0.7`), so that the farm runs on both emulations in CI
/// whether or not a real Consul is at hand.
#[macro_export]
macro_rules! on_every_backend {
    ($name:ident) => {
        $crate::on_both_backends!(@with $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn embedded_consul_0_7() {
                super::$name($crate::harness::Backend::Embedded(
                    rcfarm::server::Compat::V0_7,
                ))
                .await
            }
        });
    };
}

/// The Consul of a cluster.
pub enum Server {
    Embedded(EmbeddedServer),
    Real(Box<ConsulAgent>),
}

impl Server {
    pub fn url(&self) -> String {
        match self {
            Server::Embedded(s) => s.url(),
            Server::Real(a) => a.url(),
        }
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        match self {
            Server::Embedded(s) => s.addr(),
            Server::Real(a) => a.http_addr(),
        }
    }

    /// The embedded server (a test of what only it offers: its commit log, its counters).
    pub fn embedded(&self) -> &EmbeddedServer {
        match self {
            Server::Embedded(s) => s,
            Server::Real(_) => panic!("this check needs the embedded server's commit log"),
        }
    }

    pub fn commit_log(&self) -> Vec<LoggedCommit> {
        self.embedded().commit_log()
    }
}

pub struct Cluster {
    pub server: Server,
    pub consul: Consul,
    pub farms: Vec<FarmProc>,
    /// The SQLite audit database every farm of the cluster ships to.
    pub audit_db: String,
    /// On real Consul, the observer that watches from outside.
    external: Option<ExternalObserver>,
    _dir: tempfile::TempDir,
}

/// Collects a child's stderr, line by line, into the returned buffer.
pub fn capture_stderr(child: &mut Child) -> Arc<Mutex<String>> {
    let log = Arc::new(Mutex::new(String::new()));
    let sink = log.clone();
    let mut lines = BufReader::new(child.stderr.take().expect("stderr piped")).lines();
    tokio::spawn(async move {
        while let Ok(Some(l)) = lines.next_line().await {
            let mut s = sink.lock();
            s.push_str(&l);
            s.push('\n');
        }
    });
    log
}

pub fn signal(pid: u32, sig: &str) {
    let st = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .expect("kill runs");
    assert!(st.success(), "kill -{sig} {pid}");
}

impl Cluster {
    pub async fn start() -> Cluster {
        Cluster::start_with(Cluster::server_config()).await
    }

    /// What the cluster's server runs with: 1 s TTLs allowed, every commit recorded.
    pub fn server_config() -> ServerConfig {
        ServerConfig {
            session_ttl_min: Duration::from_secs(1),
            record_commits: true,
            ..ServerConfig::ephemeral()
        }
    }

    /// A cluster around the embedded server run with `config` (the test's own client uses its
    /// ACL token, if it has one). Started by `common::server_with`, on a port a restart
    /// (`restart_server`) can listen on again.
    pub async fn start_with(config: ServerConfig) -> Cluster {
        let token = config.acl_token.clone();
        let server = crate::common::server_with(config).await;
        let consul = match token {
            Some(t) => {
                Consul::new(rcfarm::consul::ConsulConfig::new(server.url()).with_token(Some(t)))
                    .unwrap()
            }
            None => client(&server),
        };
        Cluster::around(Server::Embedded(server), consul)
    }

    /// A cluster on `backend`: the embedded server as [`Cluster::start`] makes it, or a real
    /// Consul dev agent (sessions down to 1 s allowed).
    pub async fn start_on(backend: &Backend) -> Cluster {
        match backend {
            Backend::Embedded(compat) => {
                Cluster::start_with(ServerConfig {
                    compat: *compat,
                    ..Cluster::server_config()
                })
                .await
            }
            Backend::Real(bin) => Cluster::start_real(AgentConfig::dev(bin, "rcfarm-test")).await,
        }
    }

    /// A cluster around a real Consul agent run with `config` (the test's own client uses the
    /// agent's HTTP listener, with the ACL master token when ACLs are on).
    /// A server that keeps its data on disk, in `data_dir` (the embedded one; a real one is a
    /// one-server cluster that keeps its raft log and snapshots in a directory of its own).
    /// Returns the config to restart the embedded server with.
    pub async fn start_persistent(
        backend: &Backend,
        data_dir: &std::path::Path,
    ) -> (Cluster, ServerConfig) {
        let config = ServerConfig {
            data_dir: Some(data_dir.to_path_buf()),
            ..Cluster::server_config()
        };
        let c = match backend {
            Backend::Embedded(compat) => {
                Cluster::start_with(ServerConfig {
                    compat: *compat,
                    ..config.clone()
                })
                .await
            }
            Backend::Real(bin) => {
                Cluster::start_real(AgentConfig {
                    dev: false,
                    bootstrap_expect: Some(1),
                    ..AgentConfig::dev(bin, "rcfarm-data")
                })
                .await
            }
        };
        (c, config)
    }

    pub async fn start_real(config: AgentConfig) -> Cluster {
        init_tracing();
        let agent = ConsulAgent::start(config).await.unwrap();
        Cluster::around_agent(agent)
    }

    /// A cluster around an agent already running (a client agent of a real Consul cluster).
    pub fn around_agent(agent: ConsulAgent) -> Cluster {
        init_tracing();
        let consul = match (&agent.config.acl_master_token, &agent.config.tls) {
            (Some(token), _) => Consul::new(
                rcfarm::consul::ConsulConfig::new(agent.http_url()).with_token(Some(token.clone())),
            )
            .unwrap(),
            (None, Some(t)) if t.https_only => Consul::new(agent.client_config()).unwrap(),
            (None, _) => client_for(&agent.http_url()),
        };
        let mut c = Cluster::around(Server::Real(Box::new(agent)), consul.clone());
        c.external = Some(ExternalObserver::spawn(consul));
        c
    }

    fn around(server: Server, consul: Consul) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let audit_db = format!("sqlite://{}", dir.path().join("audit.db").display());
        Cluster {
            server,
            consul,
            farms: Vec::new(),
            audit_db,
            external: None,
            _dir: dir,
        }
    }

    pub fn is_real(&self) -> bool {
        matches!(self.server, Server::Real(_))
    }

    /// Keys under a prefix, however many.
    pub async fn count_prefix(&self, prefix: &str) -> usize {
        match &self.server {
            Server::Embedded(s) => s.count_prefix(prefix),
            Server::Real(_) => self
                .consul
                .kv_keys(prefix, None, &QueryOptions::default())
                .await
                .map(|(k, _)| k.len())
                .unwrap_or(0),
        }
    }

    /// Starts `rcfarm serve --farm-id <id>` with short timers, plus `extra` flags.
    pub async fn spawn_farm(&mut self, id: &str, extra: &[&str]) -> usize {
        let url = self.server.url();
        self.spawn_farm_via(id, &url, extra).await
    }

    /// Like [`Cluster::spawn_farm`], talking to Consul at `consul` (a proxy, say).
    pub async fn spawn_farm_via(&mut self, id: &str, consul: &str, extra: &[&str]) -> usize {
        self.spawn_farm_with(id, consul, extra, &[]).await
    }

    /// Like [`Cluster::spawn_farm_via`], with more environment variables for the process (a
    /// preloaded library faking its clock, say).
    pub async fn spawn_farm_with(
        &mut self,
        id: &str,
        consul: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> usize {
        self.spawn_farm_from(BIN, id, consul, extra, env).await
    }

    /// Like [`Cluster::spawn_farm_with`], running the farm from `bin` (another release's).
    pub async fn spawn_farm_from(
        &mut self,
        bin: &str,
        id: &str,
        consul: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> usize {
        let mut cmd = Command::new(bin);
        cmd.envs(env.iter().copied());
        cmd.args(["serve", "--consul", consul, "--farm-id", id])
            .args([
                "--session-ttl",
                "2s",
                "--lock-delay",
                "500ms",
                "--resync-interval",
                "1s",
            ])
            .args([
                "--consistency-interval",
                "1s",
                "--claim-grace",
                "1s",
                "--watch-wait",
                "30s",
            ])
            .args(["--audit-db", &self.audit_db])
            .args(["--http", "127.0.0.1:0"])
            // Failsafes are tested on their own (tests/farm/failsafe.rs, with their flags
            // last): elsewhere the budget counts, far from its limit, and the tripwire is off.
            .args(["--max-removals", "100000", "--failsafe-confirm", "0s"])
            .args(extra)
            .env("RUST_LOG", "info,rcfarm=debug")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().expect("rcfarm serve starts");
        let pid = child.id().unwrap();
        let log = capture_stderr(&mut child);
        self.farms.push(FarmProc {
            id: id.to_string(),
            child,
            pid,
            log,
        });
        self.farms.len() - 1
    }

    /// The HTTP address a live farm registered (`rcfarm/farms/<id>`), waiting (up to 60 s) for
    /// the registration, which `spawn_farm` does not wait for: on a loaded machine a farm that
    /// serves no RC had not written it 1.9 s in, when the other farm had placed every pod.
    pub async fn farm_http(&self, farm_id: &str) -> String {
        crate::common::eventually(
            Duration::from_secs(60),
            &format!("farm {farm_id} live with an HTTP address"),
            || async {
                let (entries, _) = self
                    .consul
                    .kv_list("rcfarm/farms/", &rcfarm::consul::QueryOptions::default())
                    .await
                    .unwrap();
                rcfarm::farm::registry::live_farms(&entries)
                    .into_iter()
                    .find(|f| f.farm_id == farm_id)
                    .and_then(|f| f.http)
            },
        )
        .await
    }

    /// The farm's `/metrics` page.
    pub async fn metrics(&self, farm_id: &str) -> String {
        rcfarm::consul::init_tls();
        let base = self.farm_http(farm_id).await;
        reqwest::get(format!("{base}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    pub fn farm_log(&self, i: usize) -> String {
        self.farms[i].log.lock().clone()
    }

    pub async fn label_node(&self, node: &str, labels: &[(&str, &str)]) {
        let l: LabelSet = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LabelStore::new(self.consul.clone())
            .set(LabelType::Node, node, &l)
            .await
            .unwrap();
    }

    /// Whether a node transfer of `id` is in flight (its P2 status key exists).
    pub async fn transfer_in_flight(&self, id: RcId) -> bool {
        self.consul
            .kv_get(&rcfarm::rctask::status_key(id), &QueryOptions::default())
            .await
            .unwrap()
            .0
            .is_some()
    }

    /// Writes an RC the way a P2 tool (or `curl -X PUT`) would: the raw JSON record.
    pub async fn put_rc(
        &self,
        id: RcId,
        pod_id: &str,
        selector: &str,
        replicas: i64,
        strategy: &str,
    ) {
        let record = serde_json::json!({
            "id": id.to_string(),
            "manifest": format!("id: {pod_id}\nlaunchables:\n  app:\n    launchable_type: hoist\n"),
            "node_selector": selector,
            "pod_labels": {"availability_zone": "az1", "cluster_name": "test"},
            "replicas_desired": replicas,
            "disabled": false,
            "allocation_strategy": strategy,
        });
        self.consul
            .kv_put(&id.key(), record.to_string().as_bytes(), None)
            .await
            .unwrap();
    }

    /// Starts a roll of `old` onto version 2 of its pod's manifest, as `rcctl roll start` does;
    /// the new RC's id (the roll's).
    pub async fn start_roll(&self, old: RcId, minimum: u64, delay: Duration) -> RcId {
        self.start_roll_to(old, 2, None, minimum, delay).await
    }

    /// Starts a roll of `old` onto `version` of its pod's manifest with `desired` replicas
    /// (the old RC's count when `None`); the new RC's id.
    pub async fn start_roll_to(
        &self,
        old: RcId,
        version: u32,
        desired: Option<u64>,
        minimum: u64,
        delay: Duration,
    ) -> RcId {
        let pod = rcfarm::rc::RcStore::new(self.consul.clone())
            .get(old)
            .await
            .unwrap()
            .unwrap()
            .pod_id()
            .to_string();
        rcfarm::roll::RollStore::new(self.consul.clone())
            .start(
                rcfarm::roll::StartRoll {
                    old_rc: old,
                    manifest: Cluster::manifest(&pod, version),
                    desired,
                    minimum: Some(minimum),
                    leave_old: false,
                    roll_delay: delay,
                },
                "test",
                false,
            )
            .await
            .unwrap()
            .update
            .new_rc
    }

    /// Runs `rcctl` against this cluster's Consul and audit database: exit code, stdout, stderr.
    pub async fn rcctl(&self, args: &[&str]) -> (i32, String, String) {
        let out = Command::new(env!("CARGO_BIN_EXE_rcctl"))
            .args(["--consul", &self.server.url()])
            .args(args)
            .env("RCFARM_AUDIT_DB", &self.audit_db)
            .env_remove("CONSUL_HTTP_TOKEN")
            .env_remove("CONSUL_HTTP_TOKEN_FILE")
            .output()
            .await
            .unwrap();
        crate::common::outcome(out)
    }

    /// A stored RC record with one field rewritten (not written back).
    pub async fn patched_rc(&self, id: RcId, field: &str, value: Value) -> Vec<u8> {
        let (e, _) = self
            .consul
            .kv_get(&id.key(), &QueryOptions::default())
            .await
            .unwrap();
        let mut v: Value = serde_json::from_slice(e.unwrap().value_bytes()).unwrap();
        v[field] = value;
        v.to_string().into_bytes()
    }

    /// Rewrites one field of a stored RC record directly in KV.
    pub async fn patch_rc(&self, id: RcId, field: &str, value: Value) {
        let body = self.patched_rc(id, field, value).await;
        self.consul.kv_put(&id.key(), &body, None).await.unwrap();
    }

    /// Audit records of one type, wherever they are now: shipped to SQL or still in the Consul
    /// outbox (by id, so a record in both counts once). Details only.
    pub async fn audit_events(&self, event_type: &str) -> Vec<Value> {
        let mut by_id: BTreeMap<String, Value> = BTreeMap::new();
        // The outbox first, then SQL: a record leaves the outbox only once it is in SQL, and
        // SQL never forgets one, so whatever was written before this read is in one of the two.
        // (SQL first could miss a record shipped between the two reads: seen once in CI.)
        let (entries, _) = self
            .consul
            .kv_list("audit_logs/", &QueryOptions::default())
            .await
            .unwrap();
        for e in entries {
            if let Ok(r) = rcfarm::audit::AuditRecord::from_kv(&e.key, e.value_bytes())
                && r.event_type == event_type
            {
                by_id.insert(r.id.to_string(), r.event_details);
            }
        }
        if let Ok(store) = rcfarm::audit::AuditStore::connect(&self.audit_db).await {
            let q = rcfarm::audit::AuditQuery {
                event_type: Some(event_type.to_string()),
                limit: Some(1000),
                ..Default::default()
            };
            for r in store.query(&q).await.unwrap().records {
                by_id.entry(r.id.clone()).or_insert(r.details);
            }
            store.close().await;
        }
        by_id.into_values().collect()
    }

    /// RC → session holding its ownership lock.
    pub async fn owners(&self) -> BTreeMap<RcId, String> {
        let (holders, _) = RcStore::new(self.consul.clone())
            .lock_holders()
            .await
            .unwrap();
        holders
            .into_iter()
            .filter_map(|(id, h)| h.ownership.map(|(s, _)| (id, s.to_string())))
            .collect()
    }

    /// Session → farm id, from the farm registry.
    pub async fn farm_sessions(&self) -> BTreeMap<String, String> {
        let (entries, _) = self
            .consul
            .kv_list("rcfarm/farms/", &QueryOptions::default())
            .await
            .unwrap();
        entries
            .iter()
            .filter(|e| e.session.is_some())
            .filter_map(|e| {
                let v: Value = serde_json::from_slice(e.value_bytes()).ok()?;
                Some((
                    v["session"].as_str()?.to_string(),
                    v["farm_id"].as_str()?.to_string(),
                ))
            })
            .collect()
    }

    /// RC → farm id owning it.
    /// The cluster's removal window as its key holds it (`None` until a farm wrote it).
    pub async fn removal_window(&self) -> Option<rcfarm::budget::Window> {
        let (kv, _) = self
            .consul
            .kv_get(rcfarm::budget::BUDGET_KEY, &QueryOptions::default())
            .await
            .unwrap();
        Some(rcfarm::budget::Window::parse(kv?.value_bytes()).unwrap())
    }

    pub async fn owner_farms(&self) -> BTreeMap<RcId, String> {
        let sessions = self.farm_sessions().await;
        self.owners()
            .await
            .into_iter()
            .filter_map(|(rc, s)| sessions.get(&s).map(|f| (rc, f.clone())))
            .collect()
    }

    /// How many passes the farm serving each of `rcs` has made over it (its `/v1/rcs/<id>`).
    pub async fn pass_counts(&self, rcs: &[RcId]) -> BTreeMap<RcId, u64> {
        rcfarm::consul::init_tls();
        let owners = self.owner_farms().await;
        let mut out = BTreeMap::new();
        for id in rcs {
            let Some(farm) = owners.get(id) else { continue };
            let base = self.farm_http(farm).await;
            let Ok(resp) = reqwest::get(format!("{base}/v1/rcs/{id}")).await else {
                continue;
            };
            let v: Value = resp.json().await.unwrap_or_default();
            if let Some(n) = v["local_status"]["passes"].as_u64() {
                out.insert(*id, n);
            }
        }
        out
    }

    /// Waits until the farm serving each of `rcs` has made `n` more passes over it than when
    /// called. A test that asserts nothing happened after a change waits for this: the farm
    /// has looked again (on the change, and at least every resync interval: 1 s here), rather
    /// than for a fixed time. Three passes leave one that began after the change was seen.
    pub async fn passes(&self, rcs: &[RcId], n: u64) {
        let start = self.pass_counts(rcs).await;
        let start = &start;
        self.wait_for(
            Duration::from_secs(30),
            &format!("{n} more passes over {rcs:?}"),
            move || async move {
                let now = self.pass_counts(rcs).await;
                rcs.iter().all(|id| {
                    now.get(id).copied().unwrap_or(0) >= start.get(id).copied().unwrap_or(0) + n
                })
            },
        )
        .await;
    }

    /// How many passes the farm holding `roll` has made over it (its `/v1/rolls/<id>`).
    pub async fn roll_pass_count(&self, roll: RcId) -> Option<u64> {
        rcfarm::consul::init_tls();
        let (lock, _) = self
            .consul
            .kv_get(&rcfarm::roll::roll_lock_key(roll), &QueryOptions::default())
            .await
            .ok()?;
        let farm = self.farm_sessions().await.get(&lock?.session?)?.clone();
        let base = self.farm_http(&farm).await;
        let v: Value = reqwest::get(format!("{base}/v1/rolls/{roll}"))
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        v["local_status"]["passes"].as_u64()
    }

    /// Waits until the farm holding `roll` has made `n` more passes over it: as
    /// [`Cluster::passes`], for a rolling update (a pass at least every `--roll-resync`).
    pub async fn roll_passes(&self, roll: RcId, n: u64) {
        let start = self.roll_pass_count(roll).await.unwrap_or(0);
        self.wait_for(
            Duration::from_secs(30),
            &format!("{n} more passes over the roll {roll}"),
            move || async move { self.roll_pass_count(roll).await.unwrap_or(0) >= start + n },
        )
        .await;
    }

    /// Every RC of `ids` owned and placed on `replicas` nodes, and owned by exactly `farms`
    /// distinct farms: farms that start together hand RCs over until each has its share, so a
    /// test that picks a farm's RCs waits for this first.
    pub async fn placed_and_shared(&self, ids: &[RcId], farms: usize, replicas: usize) -> bool {
        let owners = self.owner_farms().await;
        let placed = self.placements().await;
        let owning: BTreeSet<&String> = ids.iter().filter_map(|id| owners.get(id)).collect();
        owning.len() == farms
            && ids.iter().all(|id| {
                owners.contains_key(id) && placed.get(id).is_some_and(|p| p.len() == replicas)
            })
    }

    /// Farms `f1`…`f<farms>` (no extra flags) serving `n` new RCs of `replicas` (see [`rcs`]);
    /// returns once every RC is placed and every farm owns some, so that a test can pick a
    /// farm's RCs, or take Consul away, knowing each farm is serving.
    pub async fn farms_sharing(&mut self, farms: usize, n: usize, replicas: usize) -> Vec<RcId> {
        self.farms_sharing_with(farms, n, replicas, &[]).await
    }

    /// [`Cluster::farms_sharing`], the farms run with `extra` flags.
    pub async fn farms_sharing_with(
        &mut self,
        farms: usize,
        n: usize,
        replicas: usize,
        extra: &[&str],
    ) -> Vec<RcId> {
        for i in 1..=farms {
            self.spawn_farm(&format!("f{i}"), extra).await;
        }
        let ids = rcs(self, n, replicas as i64).await;
        let (this, idr) = (&*self, &ids);
        this.wait_for(
            Duration::from_secs(30),
            &format!("all placed, shared by {farms} farms"),
            move || async move { this.placed_and_shared(idr, farms, replicas).await },
        )
        .await;
        ids
    }

    /// RC → the nodes its pods are on (pods with an intent and labels).
    pub async fn placements(&self) -> BTreeMap<RcId, BTreeSet<String>> {
        let (labels, _) = self
            .consul
            .kv_list("labels/pod/", &QueryOptions::default())
            .await
            .unwrap();
        let (intents, _) = self
            .consul
            .kv_keys("intent/", None, &QueryOptions::default())
            .await
            .unwrap();
        let intents: BTreeSet<String> = intents.into_iter().collect();
        let mut out: BTreeMap<RcId, BTreeSet<String>> = BTreeMap::new();
        for e in labels {
            let id = e.key.trim_start_matches("labels/pod/");
            let Some((node, pod)) = split_pod_label_id(id) else {
                continue;
            };
            let Ok(l) = parse_labels(e.value_bytes()) else {
                continue;
            };
            let Some(Ok(rc)) = l.get("replication_controller_id").map(|v| RcId::parse(v)) else {
                continue;
            };
            if intents.contains(&format!("intent/{node}/{pod}")) {
                out.entry(rc).or_default().insert(node.to_string());
            }
        }
        out
    }

    /// Waits until `check` holds, or fails the test with `what` and the farms' logs' tails.
    pub async fn wait_for<F, Fut>(&self, timeout: Duration, what: &str, mut check: F) -> Duration
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let started = Instant::now();
        loop {
            if check().await {
                return started.elapsed();
            }
            if started.elapsed() > timeout {
                let logs: Vec<String> = (0..self.farms.len())
                    .map(|i| {
                        let l = self.farm_log(i);
                        let tail: Vec<&str> = l.lines().rev().take(30).collect();
                        format!(
                            "--- farm {} ---\n{}",
                            self.farms[i].id,
                            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                        )
                    })
                    .collect();
                panic!(
                    "timed out after {timeout:?} waiting for {what}\n{}",
                    logs.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops the server, keeps it down for `down`, and starts it again on the same address
    /// (the embedded one with `config`; a real agent as it was: with its data unless it is a
    /// dev agent). Returns the commits the stopped embedded server recorded.
    pub async fn restart_server(
        &mut self,
        down: Duration,
        config: ServerConfig,
    ) -> Vec<LoggedCommit> {
        self.restart_server_doing(down, config, |_| {}).await
    }

    /// [`Cluster::restart_server`], running `while_down` with the server's data directory (a
    /// real agent's; the embedded server's is `config.data_dir`) while it is stopped: a backup
    /// copied, or one restored.
    pub async fn restart_server_doing(
        &mut self,
        down: Duration,
        mut config: ServerConfig,
        while_down: impl FnOnce(&std::path::Path),
    ) -> Vec<LoggedCommit> {
        let addr = self.server.addr();
        match &mut self.server {
            Server::Real(agent) => {
                let seen = self.external.as_ref().map_or(0, |e| e.report().snapshots);
                agent.stop().await;
                while_down(agent.data_dir());
                tokio::time::sleep(down).await;
                agent.restart().await.unwrap();
                // The outside observer's history must reach past the restart: a test that
                // ends soon after it would otherwise check nothing (its first read can take
                // until the restart, when the agent starts without a leader).
                if let Some(ext) = &self.external {
                    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
                    while ext.report().snapshots <= seen && tokio::time::Instant::now() < deadline {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
                Vec::new()
            }
            Server::Embedded(_) => {
                // A stand-in so that `self.server` stays a value while the real one is down.
                let stand_in = EmbeddedServer::start(Cluster::server_config())
                    .await
                    .unwrap();
                let Server::Embedded(old) =
                    std::mem::replace(&mut self.server, Server::Embedded(stand_in))
                else {
                    unreachable!("matched above")
                };
                let log = old.commit_log();
                old.shutdown().await;
                if let Some(d) = &config.data_dir {
                    while_down(d);
                }
                tokio::time::sleep(down).await;
                config.listen = addr;
                let new = EmbeddedServer::start(config).await.unwrap();
                if let Server::Embedded(s) =
                    std::mem::replace(&mut self.server, Server::Embedded(new))
                {
                    s.shutdown().await;
                }
                log
            }
        }
    }

    /// Replays every committed write through [`Observer`] and fails the test on a broken
    /// promise (a pod write not fenced by its RC's lock held by the writer, or an RC raised
    /// above its desired count +1 during a transfer). `unfenced_ok` exempts the test's own
    /// direct writes. Returns the number of fenced scheduling commits checked.
    pub fn check_invariants(&self, unfenced_ok: impl Fn(&LoggedCommit) -> bool) -> Option<usize> {
        if let Some(ext) = &self.external {
            // Real Consul keeps no commit log: what the outside observer could check.
            let r = ext.report();
            assert_kept(&r.violations, "seen from outside");
            assert!(
                r.snapshots > 0,
                "the outside observer saw nothing ({} reads failed, the last with {:?})",
                r.errors,
                r.last_error
            );
            return None;
        }
        Some(self.observe(unfenced_ok).fenced_writes as usize)
    }

    /// Every promise checked (see [`Cluster::check_invariants`]); rolling update → the fewest
    /// pods of its two RCs up at once after a farm's write (embedded) or in any snapshot (real).
    pub fn roll_lowest_up(&self) -> BTreeMap<String, usize> {
        match &self.external {
            Some(ext) => {
                self.check_invariants(|_| false);
                ext.report().roll_lowest_up
            }
            None => self.observe(|_| false).roll_lowest_up,
        }
    }

    /// Commits that carried a roll's start, step or completion (embedded only: real Consul
    /// shows no commits).
    pub fn roll_steps(&self) -> Option<u64> {
        (!self.is_real()).then(|| self.observe(|_| false).roll_steps)
    }

    /// Like [`Cluster::check_invariants`], returning the observer (its roll figures).
    pub fn observe(&self, unfenced_ok: impl Fn(&LoggedCommit) -> bool) -> Observer {
        let mut o = Observer::default();
        for c in self.server.commit_log() {
            let before = o.violations.len();
            o.observe(&c);
            // An unfenced commit yields exactly one violation and nothing else.
            if c.checks.is_empty() && o.violations.len() > before && unfenced_ok(&c) {
                o.violations.truncate(before);
            }
        }
        assert_kept(&o.violations, "in the commit log");
        o
    }

    /// Plays P2's preparer for `node-00` … `node-<n-1>` (the nodes [`nodes`] labels) in this
    /// process, until the returned token is cancelled.
    pub fn simulate(&self, n: usize, unhealthy_rate: f64) -> tokio_util::sync::CancellationToken {
        self.simulate_with(
            n,
            SimConfig {
                unhealthy_rate,
                ..SimConfig::default()
            },
        )
    }

    /// Simulated nodes that never make a pod whose manifest contains `pattern` healthy.
    pub fn simulate_failing(&self, n: usize, pattern: &str) -> tokio_util::sync::CancellationToken {
        self.simulate_with(
            n,
            SimConfig {
                fail_manifests: Some(pattern.to_string()),
                ..SimConfig::default()
            },
        )
    }

    fn simulate_with(&self, n: usize, config: SimConfig) -> tokio_util::sync::CancellationToken {
        let config = SimConfig {
            nodes: (0..n).map(|i| format!("node-{i:02}")).collect(),
            startup: Duration::from_millis(300),
            ..config
        };
        let sim = NodeSimulator::new(self.consul.clone(), config).unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        tokio::spawn(sim.run(stop.clone()));
        stop
    }

    /// A P2 manifest for `pod_id`, version `v` (the same pod id, another artifact).
    pub fn manifest(pod_id: &str, v: u32) -> String {
        format!(
            "id: {pod_id}\nlaunchables:\n  app:\n    launchable_type: hoist\n    location: https://example.com/{pod_id}-{v}.tar.gz\n"
        )
    }

    /// Whether every pod of `rc` runs its manifest and passes its health check.
    pub async fn all_up(&self, rc: RcId, replicas: usize) -> bool {
        let Some(r) = RcStore::new(self.consul.clone())
            .get(rc)
            .await
            .ok()
            .flatten()
        else {
            return false;
        };
        let Some(nodes) = self.placements().await.get(&rc).cloned() else {
            return replicas == 0;
        };
        if nodes.len() != replicas {
            return false;
        }
        let mut keys = Vec::new();
        for n in &nodes {
            keys.push(format!("reality/{n}/{}", r.pod_id()));
            keys.push(format!("health/{}/{n}", r.pod_id()));
        }
        let found = self.consul.read_keys(&keys).await.unwrap();
        nodes.iter().all(|n| {
            rcfarm::roll::runs(found.get(&format!("reality/{n}/{}", r.pod_id()))).as_deref()
                == Some(r.manifest.digest())
                && found
                    .get(&format!("health/{}/{n}", r.pod_id()))
                    .and_then(|kv| rcfarm::health::parse_health(kv.value_bytes()).ok())
                    .is_some_and(|h| h.is_passing())
        })
    }
}

/// Fails the test on any broken promise, showing the first ten.
fn assert_kept(violations: &[rcfarm_testkit::invariants::Violation], how: &str) {
    let shown: Vec<String> = violations.iter().take(10).map(|v| v.to_string()).collect();
    assert!(
        violations.is_empty(),
        "{} broken promises {how}, first: {shown:#?}",
        violations.len()
    );
}

/// Sets up `n` nodes `node-00…` with `zone=z<i%zones>` and `env=prod`.
/// `n` static RCs named `svc-<i>`, `replicas` each on `env=prod` nodes, written as P2 tools do.
pub async fn rcs(c: &Cluster, n: usize, replicas: i64) -> Vec<RcId> {
    let mut ids = Vec::new();
    for i in 0..n {
        let id = RcId::new();
        c.put_rc(
            id,
            &format!("svc-{i}"),
            "env=prod",
            replicas,
            "static_strategy",
        )
        .await;
        ids.push(id);
    }
    ids
}

pub async fn nodes(c: &Cluster, n: usize, zones: usize) {
    for i in 0..n {
        let zone = format!("z{}", i % zones);
        c.label_node(&format!("node-{i:02}"), &[("env", "prod"), ("zone", &zone)])
            .await;
    }
}

//! The embedded Consul-compatible development server (`rcfarm consul-dev`).
//!
//! A single-node Consul for the endpoints rcfarm uses (KV, blocking queries, sessions, `/v1/txn`,
//! status), with Consul's exact semantics, so rcfarm runs and is tested without a Consul binary.
//! Memory-only by default, like `consul agent -dev`; with a data directory every acknowledged
//! write survives `kill -9`.
//!
//! Depends on the Consul client crate's wire types only (`KvPair`, `SessionEntry`,
//! `ServiceCheck`) and its `util`; never on the farm.

use rcfarm_consul as consul;
use rcfarm_consul::util;

mod compat;
mod connlimit;
mod http;
mod store;
mod waiters;
mod wal;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use compat::{Compat, StaleCheckpoint, UnknownCompat};
pub use store::{Change, Commit, Entry, KvOp, Record, Store};

/// A committed write, as kept by [`ServerConfig::record_commits`].
#[derive(Debug, Clone)]
pub struct LoggedCommit {
    pub index: u64,
    pub changes: Vec<Change>,
    /// The transaction's `check-session` ops: `(key, session)`.
    pub checks: Vec<(String, String)>,
    /// When it was committed.
    pub at: std::time::Instant,
}
use waiters::Waiters;
pub use wal::{Recovery, WalError};

/// Default of [`ServerConfig::http_max_conns_per_client`] (Consul 1.7.1 and later).
pub const DEFAULT_HTTP_MAX_CONNS_PER_CLIENT: usize = 200;

/// How to run the server. Its `Debug` never shows the ACL token.
#[derive(Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// Keep state here (log + snapshot); `None` keeps it in memory only.
    pub data_dir: Option<PathBuf>,
    /// The shortest session TTL accepted (Consul's `session_ttl_min`, default 10 s).
    pub session_ttl_min: Duration,
    /// When set, every request but `/v1/status/*` must carry this token.
    pub acl_token: Option<String>,
    pub node_name: String,
    /// Transactions with more operations are refused with 413. Consul before 1.14 allowed 64,
    /// later ones 128; the lower limit here means code that works against this server works
    /// against every Consul.
    pub max_txn_ops: usize,
    pub kv_max_value_size: usize,
    pub txn_max_req_len: usize,
    /// Keep every committed write in memory (for tests that replay them to check invariants).
    pub record_commits: bool,
    /// Most concurrent TCP connections from one client IP (Consul 1.x's
    /// `limits.http_max_conns_per_client`, default 200; loopback is not exempt); 0 = no limit.
    /// The one beyond it is answered `429 Too Many Requests` and closed, as Consul does.
    pub http_max_conns_per_client: usize,
    /// Which Consul to answer as where versions differ (`consul-dev --compat`). Under 0.7
    /// `http_max_conns_per_client`, `txn_max_req_len` and `kv_max_value_size` do not apply
    /// (0.7 has fixed 512 KiB value limits and no connection limit).
    pub compat: Compat,
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("listen", &self.listen)
            .field("data_dir", &self.data_dir)
            .field("session_ttl_min", &self.session_ttl_min)
            .field("acl_token", &self.acl_token.as_ref().map(|_| "***"))
            .field("node_name", &self.node_name)
            .field("max_txn_ops", &self.max_txn_ops)
            .field("kv_max_value_size", &self.kv_max_value_size)
            .field("txn_max_req_len", &self.txn_max_req_len)
            .field("record_commits", &self.record_commits)
            .field("http_max_conns_per_client", &self.http_max_conns_per_client)
            .field("compat", &self.compat)
            .finish()
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8500)),
            data_dir: None,
            session_ttl_min: Duration::from_secs(10),
            acl_token: None,
            node_name: "rcfarm-dev".to_string(),
            max_txn_ops: 64,
            kv_max_value_size: 512 * 1024,
            txn_max_req_len: 512 * 1024,
            record_commits: false,
            http_max_conns_per_client: DEFAULT_HTTP_MAX_CONNS_PER_CLIENT,
            compat: Compat::V1,
        }
    }
}

impl ServerConfig {
    /// A server on an ephemeral loopback port, for tests.
    pub fn ephemeral() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            ..Default::default()
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Wal(#[from] WalError),
    #[error("stale post-election answers are Consul 0.7's; this server runs as Consul {0}")]
    NotUnderCompat(Compat),
}

pub(crate) struct State {
    pub store: Store,
    pub waiters: Waiters,
}

pub(crate) struct Shared {
    pub state: Mutex<State>,
    pub wal: Option<wal::Wal>,
    pub config: ServerConfig,
    pub leader: String,
    pub shutdown: CancellationToken,
    pub commit_log: Option<Mutex<Vec<LoggedCommit>>>,
    pub requests: std::sync::atomic::AtomicU64,
    pub txns: std::sync::atomic::AtomicU64,
    pub conns: Arc<connlimit::ConnLimiter>,
    pub stale: compat::StaleReads,
}

impl Shared {
    /// After a commit, under the state lock: log it and wake the queries it concerns.
    pub fn publish(&self, st: &mut State, commit: &Commit) {
        if let (Some(rec), Some(wal)) = (&commit.record, &self.wal) {
            wal.append(rec);
            if wal.take_snapshot_due() {
                wal.snapshot(&st.store.snapshot());
            }
        }
        if let (Some(rec), Some(log)) = (&commit.record, &self.commit_log) {
            log.lock().push(LoggedCommit {
                index: rec.index,
                changes: rec.changes.clone(),
                checks: commit.checks.clone(),
                at: std::time::Instant::now(),
            });
        }
        for key in &commit.changed_keys {
            st.waiters.key_changed(key);
        }
        if commit.sessions_changed {
            st.waiters.sessions_changed();
        }
    }

    /// Waits until `index` is durable (immediately without a data directory).
    pub async fn wait_durable(&self, index: u64) -> Result<(), http::ApiError> {
        match &self.wal {
            None => Ok(()),
            Some(wal) => wal.wait_durable(index).await.map_err(|e| {
                http::ApiError::new(
                    axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                    format!("raft apply failed: {e}"),
                )
            }),
        }
    }

    /// Every committed write so far, if the server records them.
    fn commit_log(&self) -> Vec<LoggedCommit> {
        self.commit_log
            .as_ref()
            .map(|l| l.lock().clone())
            .unwrap_or_default()
    }

    /// Refuses writes once the log has failed: an acknowledged write must be durable.
    pub fn check_writable(&self) -> Result<(), http::ApiError> {
        match &self.wal {
            Some(wal) if wal.is_failed() => Err(http::ApiError::new(
                axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                "raft apply failed: the write-ahead log failed; restart the server",
            )),
            _ => Ok(()),
        }
    }
}

/// Figures about a running server.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct ServerStats {
    pub index: u64,
    pub keys: usize,
    pub sessions: usize,
    pub blocked_queries: usize,
    /// Bytes written to the log since start (0 without a data directory).
    pub wal_bytes: u64,
    /// HTTP requests served since start.
    pub requests: u64,
    /// `/v1/txn` requests served since start.
    pub txns: u64,
    /// HTTP connections open now.
    pub open_conns: usize,
    /// Connections refused (429) for `http_max_conns_per_client` since start.
    pub conns_refused: u64,
}

impl Shared {
    fn new(
        config: ServerConfig,
        mut store: Store,
        wal: Option<wal::Wal>,
        addr: SocketAddr,
    ) -> Arc<Shared> {
        store.set_identical_rewrites_bump(config.compat == Compat::V0_7);
        Arc::new(Shared {
            state: Mutex::new(State {
                store,
                waiters: Waiters::default(),
            }),
            wal,
            shutdown: CancellationToken::new(),
            commit_log: config.record_commits.then(Mutex::default),
            requests: Default::default(),
            txns: Default::default(),
            // Consul 0.7 limits no client's connections.
            conns: connlimit::ConnLimiter::new(match config.compat {
                Compat::V0_7 => 0,
                Compat::V1 => config.http_max_conns_per_client,
            }),
            stale: Default::default(),
            leader: format!("{}:8300", addr.ip()),
            config,
        })
    }
}

/// The server's request handling without a socket, in memory: for fuzzing the HTTP surface,
/// and as the in-memory Consul a client reaches through its [`consul::Port`]
/// ([`consul::Consul::over`]). Sessions expire only once [`InProcess::spawn_reaper`] runs.
#[derive(Clone)]
pub struct InProcess {
    shared: Arc<Shared>,
}

impl InProcess {
    /// A memory-only server (`data_dir` is ignored).
    pub fn new(config: ServerConfig) -> InProcess {
        let addr = config.listen;
        InProcess {
            shared: Shared::new(config, Store::new(), None, addr),
        }
    }

    /// Handles one request the way the listening server does.
    pub async fn call(
        &self,
        req: axum::http::Request<axum::body::Body>,
    ) -> axum::response::Response {
        http::handle(self.shared.clone(), req).await
    }

    /// Expires sessions and reaps tombstones and lock-delays as the listening server does,
    /// until [`InProcess::shutdown`].
    pub fn spawn_reaper(&self) -> JoinHandle<()> {
        tokio::spawn(reap_loop(self.shared.clone()))
    }

    /// Ends blocking queries and the reaper.
    pub fn shutdown(&self) {
        self.shared.shutdown.cancel();
    }

    /// Every committed write so far, if the server records them.
    pub fn commit_log(&self) -> Vec<LoggedCommit> {
        self.shared.commit_log()
    }

    /// The state as it is now, to be answered from later by [`InProcess::serve_stale`].
    pub fn checkpoint(&self) -> StaleCheckpoint {
        StaleCheckpoint(self.shared.state.lock().store.snapshot())
    }

    /// Test control, Consul 0.7 only: the next `answers` reads (KV and session queries, blocking
    /// or not, including those blocked now; not transactions) are answered at once from
    /// `checkpoint`'s state and index, as a Consul < 0.8.5 leader still replaying its log after
    /// an election answers them (hashicorp/consul#2644). Writes still apply to the real state.
    pub fn serve_stale(
        &self,
        checkpoint: StaleCheckpoint,
        answers: usize,
    ) -> Result<(), ServerError> {
        let shared = &self.shared;
        if !shared.config.compat.is_0_7() {
            return Err(ServerError::NotUnderCompat(shared.config.compat));
        }
        shared
            .stale
            .start(Store::restore(checkpoint.0, Instant::now()), answers);
        // Queries blocked now ask again (as clients whose old leader went away do).
        shared.state.lock().waiters.wake_all();
        Ok(())
    }

    /// How many answers [`InProcess::serve_stale`] still has to give.
    pub fn stale_answers_left(&self) -> usize {
        self.shared.stale.left()
    }

    /// `key` now, read without a request.
    pub fn get(&self, key: &str) -> Option<consul::KvPair> {
        self.shared.state.lock().store.read_key(key).0
    }

    /// Every entry under `prefix` now, read without a request.
    pub fn list(&self, prefix: &str) -> Vec<consul::KvPair> {
        self.shared.state.lock().store.read_prefix(prefix)
    }
}

impl consul::Port for InProcess {
    fn call(&self, request: consul::Exchange) -> consul::PortFuture {
        let shared = self.shared.clone();
        Box::pin(async move {
            let mut req = axum::http::Request::new(axum::body::Body::from(request.body));
            *req.method_mut() = request.method;
            *req.uri_mut() = request
                .path_and_query
                .parse()
                .map_err(|e| consul::PortFailure::NotSent(format!("bad request path: {e}")))?;
            *req.headers_mut() = request.headers;
            let resp = http::handle(shared, req).await;
            let (parts, body) = resp.into_parts();
            let body = axum::body::to_bytes(body, usize::MAX)
                .await
                .map_err(|e| consul::PortFailure::Lost(e.to_string()))?;
            Ok(consul::Answer {
                status: parts.status,
                headers: parts.headers,
                body,
            })
        })
    }
}

/// A running embedded server.
pub struct EmbeddedServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
    recovery: Option<Recovery>,
}

impl EmbeddedServer {
    /// Binds, recovers the data directory if any, and starts serving.
    pub async fn start(config: ServerConfig) -> Result<EmbeddedServer, ServerError> {
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| ServerError::Bind {
                    addr: config.listen,
                    source,
                })?;
        let addr = listener.local_addr().map_err(|source| ServerError::Bind {
            addr: config.listen,
            source,
        })?;
        let (store, wal, recovery) = match &config.data_dir {
            Some(dir) => {
                let dir = dir.clone();
                let (wal, store, rec) = tokio::task::spawn_blocking(move || wal::Wal::open(&dir))
                    .await
                    .map_err(|e| WalError::Io {
                        path: PathBuf::new(),
                        source: std::io::Error::other(e.to_string()),
                    })??;
                (store, Some(wal), Some(rec))
            }
            None => (Store::new(), None, None),
        };
        let shared = Shared::new(config, store, wal, addr);

        let app = axum::Router::new().fallback({
            let shared = shared.clone();
            move |req: axum::http::Request<axum::body::Body>| http::handle(shared.clone(), req)
        });
        let serve_shutdown = shared.shutdown.clone();
        let listener = connlimit::LimitedListener::new(listener, shared.conns.clone());
        let server = tokio::spawn(async move {
            let r = axum::serve(listener, app)
                .with_graceful_shutdown(async move { serve_shutdown.cancelled().await })
                .await;
            if let Err(e) = r {
                tracing::error!(error = %e, "embedded Consul server stopped with an error");
            }
        });
        let reaper = tokio::spawn(reap_loop(shared.clone()));
        Ok(EmbeddedServer {
            addr,
            shared,
            tasks: vec![server, reaper],
            recovery,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// What recovery of the data directory found, if there is one.
    pub fn recovery(&self) -> Option<Recovery> {
        self.recovery
    }

    /// Every committed write so far, if the server records them.
    pub fn commit_log(&self) -> Vec<LoggedCommit> {
        self.shared.commit_log()
    }

    pub fn stats(&self) -> ServerStats {
        let st = self.shared.state.lock();
        ServerStats {
            index: st.store.index(),
            keys: st.store.len(),
            sessions: st.store.session_count(),
            blocked_queries: st.waiters.count(),
            wal_bytes: self.shared.wal.as_ref().map_or(0, |w| w.bytes_logged()),
            requests: self
                .shared
                .requests
                .load(std::sync::atomic::Ordering::Relaxed),
            txns: self.shared.txns.load(std::sync::atomic::Ordering::Relaxed),
            open_conns: self.shared.conns.open(),
            conns_refused: self.shared.conns.refused(),
        }
    }

    /// How many keys start with `prefix`.
    pub fn count_prefix(&self, prefix: &str) -> usize {
        self.shared.state.lock().store.count_prefix(prefix)
    }

    /// A handle on this server's state without its socket: the same store, sessions and
    /// waiters ([`InProcess::checkpoint`], [`InProcess::serve_stale`]).
    pub fn in_process(&self) -> InProcess {
        InProcess {
            shared: self.shared.clone(),
        }
    }

    /// Ends blocking queries, stops serving and flushes the log.
    pub async fn shutdown(self) {
        self.shared.shutdown.cancel();
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
        }
        if let Some(wal) = &self.shared.wal {
            wal.close();
        }
    }
}

/// Expires sessions (2×TTL without renewal) and reaps old tombstones and lock-delays.
async fn reap_loop(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_reap = Instant::now();
    loop {
        tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = Instant::now();
        let mut st = shared.state.lock();
        if st.store.next_session_expiry().is_some_and(|at| at <= now) {
            for (id, commit) in st.store.expire_sessions(now) {
                tracing::info!(session = %id, "session expired (no renewal for 2×TTL)");
                shared.publish(&mut st, &commit);
            }
        }
        if now.duration_since(last_reap) >= Duration::from_secs(30) {
            st.store.reap(now);
            last_reap = now;
        }
    }
}

#[cfg(test)]
mod port_tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::{InProcess, ServerConfig};
    use crate::consul::{Consul, ConsulConfig, QueryOptions, Session, SessionConfig};

    /// The client over the in-process port speaks Consul as over HTTP: a session's body (name,
    /// TTL, lock-delay) arrives, a lock is exclusive and its lock-delay holds after the
    /// session ends, and a blocking read answers when its key changes.
    #[tokio::test]
    async fn a_client_over_the_in_process_port_speaks_consul() {
        let server = InProcess::new(ServerConfig::ephemeral());
        let c = Consul::over(
            ConsulConfig::new("http://in-memory:8500"),
            Arc::new(server.clone()),
        )
        .unwrap();
        let config = |name: &str| SessionConfig {
            name: name.into(),
            ttl: Duration::from_secs(10),
            lock_delay: Duration::from_secs(30),
            behavior: Default::default(),
        };
        let a = Session::create(&c, &config("a")).await.unwrap();
        let b = Session::create(&c, &config("b")).await.unwrap();
        let (listed, _) = c.session_list(&QueryOptions::default()).await.unwrap();
        let entry = listed.iter().find(|s| s.name == "a").unwrap();
        assert_eq!(entry.ttl, "10s");
        assert_eq!(entry.lock_delay, 30_000_000_000);

        let (a_id, b_id) = (a.id().to_string(), b.id().to_string());
        assert!(c.kv_acquire("lock/x", b"a", &a_id, None).await.unwrap());
        assert!(!c.kv_acquire("lock/x", b"b", &b_id, None).await.unwrap());
        let (_, index) = c.kv_get("k", &QueryOptions::default()).await.unwrap();
        let blocked = {
            let c = c.clone();
            tokio::spawn(async move {
                c.kv_get(
                    "k",
                    &QueryOptions::blocking(index.index, Duration::from_secs(60)),
                )
                .await
            })
        };
        tokio::task::yield_now().await;
        assert!(c.kv_put("k", b"v", None).await.unwrap());
        let (kv, _) = blocked.await.unwrap().unwrap();
        assert_eq!(kv.unwrap().value_bytes(), b"v");

        // The holder ends: the lock is free, but not for the other session within lock-delay.
        a.destroy().await.unwrap();
        assert!(!c.kv_acquire("lock/x", b"b", &b_id, None).await.unwrap());
        b.destroy().await.unwrap();
    }
}

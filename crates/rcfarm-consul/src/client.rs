//! The HTTP client: one method per Consul call rcfarm makes, typed answers, typed errors, and
//! retries only where repeating a call cannot change its meaning.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};
use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;

use super::error::{ConsulError, Result};
use super::tls::{HandshakeSeen, TlsConfig};
use super::token::TokenSource;
use super::txn::{MAX_TXN_OPS, TxnOp, TxnResponse, WireTxnResponse};
use super::types::{KvPair, QueryMeta, QueryOptions, SessionEntry, SessionRequest};
use crate::util::Backoff;

/// Characters escaped in a key's URL path: everything but unreserved characters and `/`, so
/// Consul's path decoding gives back the exact key.
const KEY_ESCAPE: &AsciiSet = &CONTROLS
    .add(b' ')
    .add(b'"')
    .add(b'#')
    .add(b'%')
    .add(b'<')
    .add(b'>')
    .add(b'?')
    .add(b'`')
    .add(b'{')
    .add(b'}')
    .add(b'+')
    .add(b'&')
    .add(b'=')
    .add(b';')
    .add(b'\\')
    .add(b'^')
    .add(b'|')
    .add(b'[')
    .add(b']');

/// Where Consul is and how to talk to it.
#[derive(Debug, Clone)]
pub struct ConsulConfig {
    /// `http://host:port` or `https://…`; a bare `host:port` means `http://`.
    pub address: String,
    /// ACL token, sent as `X-Consul-Token`.
    pub token: Option<String>,
    /// A file holding the ACL token (`CONSUL_HTTP_TOKEN_FILE`); wins over `token`, as in
    /// Consul's client, and is re-read when it changes.
    pub token_file: Option<std::path::PathBuf>,
    /// Headers sent on every request (P2's `--header K=V`).
    pub headers: Vec<(String, String)>,
    /// Timeout of a non-blocking request. Blocking queries get `wait + wait/16 + margin`.
    pub timeout: Duration,
    /// Attempts for reads and idempotent writes (1 = no retry).
    pub attempts: u32,
    pub retry_base: Duration,
    pub retry_cap: Duration,
    /// Most TCP connections to Consul at once: one is kept for session calls, the rest are
    /// shared by every other request (blocking queries included), which wait their turn rather
    /// than open another connection. Consul 1.x refuses a client's 201st connection.
    pub max_conns: usize,
    /// CAs, client certificate, server name and verification for `https://` addresses.
    pub tls: TlsConfig,
}

/// Default of [`ConsulConfig::max_conns`].
pub const DEFAULT_MAX_CONNS: usize = 32;

/// The smallest [`ConsulConfig::max_conns`] that leaves room for a farm's blocking queries
/// (about a dozen, each holding a connection for minutes) beside its bulk work.
pub const MIN_MAX_CONNS: usize = 16;

impl Default for ConsulConfig {
    fn default() -> Self {
        Self {
            address: "http://127.0.0.1:8500".into(),
            token: None,
            timeout: Duration::from_secs(10),
            attempts: 4,
            retry_base: Duration::from_millis(50),
            retry_cap: Duration::from_secs(2),
            max_conns: DEFAULT_MAX_CONNS,
            token_file: None,
            headers: Vec::new(),
            tls: TlsConfig::default(),
        }
    }
}

impl ConsulConfig {
    pub fn new(address: impl Into<String>) -> Self {
        Self {
            address: address.into(),
            ..Default::default()
        }
    }

    /// Reads Consul's CLI variables as the Consul CLI does: `CONSUL_HTTP_ADDR`,
    /// `CONSUL_HTTP_SSL`, `CONSUL_HTTP_TOKEN`, `CONSUL_HTTP_TOKEN_FILE`, `CONSUL_CACERT`,
    /// `CONSUL_CAPATH`, `CONSUL_CLIENT_CERT`, `CONSUL_CLIENT_KEY`, `CONSUL_TLS_SERVER_NAME` and
    /// `CONSUL_HTTP_SSL_VERIFY`. A boolean that does not parse is an error naming it.
    pub fn from_env() -> Result<Self> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let path = |name: &str| var(name).map(std::path::PathBuf::from);
        let mut c = Self::default();
        if let Some(a) = var("CONSUL_HTTP_ADDR") {
            c.address = a;
        }
        if let Some(ssl) = var("CONSUL_HTTP_SSL")
            && parse_go_bool(&ssl)
                .map_err(|e| ConsulError::Config(format!("CONSUL_HTTP_SSL: {e}")))?
        {
            c.address = with_https(&c.address);
        }
        c.token = var("CONSUL_HTTP_TOKEN");
        c.token_file = path("CONSUL_HTTP_TOKEN_FILE");
        c.tls = TlsConfig {
            ca_file: path("CONSUL_CACERT"),
            ca_path: path("CONSUL_CAPATH"),
            client_cert: path("CONSUL_CLIENT_CERT"),
            client_key: path("CONSUL_CLIENT_KEY"),
            server_name: var("CONSUL_TLS_SERVER_NAME"),
            skip_verify: match var("CONSUL_HTTP_SSL_VERIFY") {
                None => false,
                Some(v) => !parse_go_bool(&v)
                    .map_err(|e| ConsulError::Config(format!("CONSUL_HTTP_SSL_VERIFY: {e}")))?,
            },
        };
        Ok(c)
    }

    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token;
        self
    }

    pub fn with_ca_file(mut self, ca_file: Option<std::path::PathBuf>) -> Self {
        self.tls.ca_file = ca_file;
        self
    }

    /// Which ACL token requests carry, in words for an error (never the token itself); `None`
    /// without one.
    pub fn token_origin(&self) -> Option<String> {
        match (&self.token_file, &self.token) {
            (Some(f), _) => Some(format!(
                "the ACL token in {} (--consul-token-file / CONSUL_HTTP_TOKEN_FILE)",
                f.display()
            )),
            (None, Some(_)) => {
                Some("the ACL token given by --consul-token / CONSUL_HTTP_TOKEN".into())
            }
            (None, None) => None,
        }
    }
}

/// Go's `strconv.ParseBool`, which Consul's CLI uses for its boolean variables.
pub fn parse_go_bool(s: &str) -> std::result::Result<bool, String> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(format!("{s:?} is not a boolean (use true or false)")),
    }
}

/// `CONSUL_HTTP_SSL=true`: an address without a scheme means `https://`.
pub fn with_https(address: &str) -> String {
    if address.contains("://") {
        address.to_string()
    } else {
        format!("https://{address}")
    }
}

/// Requests in flight at once on the shared connections. The pool returns a connection a
/// moment after its answer was read, and a request that starts in that moment opens another;
/// the headroom keeps those extra connections within `max_conns`. A quarter: with an eighth
/// (4 of 32) a farm under full CPU was seen at 34. Fewer permits also cost nothing in speed:
/// transactions queue deeper and go out in bigger batches (`txn_coalesced`; 20,000 RCs on
/// Consul 0.7 converged in 22.5-22.8 s against 25.0-28.5 s with an eighth).
fn shared_permits(max_conns: usize) -> usize {
    // Capped: the race costs a few connections at a time, not a share of a big bound.
    let headroom = (max_conns / 4).clamp(1, 8);
    max_conns.saturating_sub(1 + headroom).max(1)
}

/// Installs rustls' crypto provider for every HTTPS client of the process (reqwest is built
/// without a default one). Idempotent.
pub fn init_tls() {
    // Another caller may have installed one already; any installed provider will do.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Counters a benchmark or the status page can read without a metrics registry.
#[derive(Debug, Default)]
pub struct ClientStats {
    pub requests: AtomicU64,
    /// Requests that found every connection busy and waited for one.
    pub waited: AtomicU64,
    pub txns: AtomicU64,
    pub errors: AtomicU64,
    pub blocking_open: AtomicI64,
}

/// A snapshot of [`ClientStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ClientStatsSnapshot {
    pub requests: u64,
    pub waited: u64,
    pub txns: u64,
    pub errors: u64,
    pub blocking_open: i64,
}

/// A Consul HTTP client. Cheap to clone; clones share the connection pool and counters.
#[derive(Clone)]
pub struct Consul {
    pub(super) inner: Arc<Inner>,
}

/// A permit for one request on the shared connections.
/// Owned, so that a batch of transactions can be sent from a task of its own
/// ([`Consul::txn_coalesced`]).
pub(super) type Permit = tokio::sync::OwnedSemaphorePermit;

pub(super) struct Inner {
    /// Every request but session calls; at most `permits` of them in flight.
    http: reqwest::Client,
    permits: Arc<tokio::sync::Semaphore>,
    /// Transactions waiting to be sent together ([`Consul::txn_coalesced`]).
    pub(super) txn_queue: super::coalesce::TxnQueue,
    /// Session create/renew/destroy, on a connection of their own so that renewals never queue
    /// behind bulk work (a starved renewal loses every lock the farm holds).
    session_http: reqwest::Client,
    base: String,
    cfg: ConsulConfig,
    token: TokenSource,
    /// What Consul asked for in TLS handshakes, to explain a refused one.
    tls_seen: Arc<HandshakeSeen>,
    stats: ClientStats,
}

impl std::fmt::Debug for Consul {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consul")
            .field("address", &self.inner.base)
            .finish()
    }
}

/// How a call may be repeated after a failure.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Retry {
    /// Reads and idempotent writes: retry on any unavailability.
    Idempotent,
    /// Writes whose repetition could change the answer: retry only if the request never left
    /// (connection refused), so it cannot have been applied.
    ConnectOnly,
}

struct Raw {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    body: Bytes,
}

impl Raw {
    fn meta(&self) -> QueryMeta {
        let h = |name: &str| self.headers.get(name).and_then(|v| v.to_str().ok());
        QueryMeta {
            index: h("x-consul-index")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            known_leader: h("x-consul-knownleader") == Some("true"),
            last_contact: Duration::from_millis(
                h("x-consul-lastcontact")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0),
            ),
            body_len: self.body.len(),
        }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).trim().to_string()
    }

    fn json<T: DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_slice(&self.body).map_err(|e| {
            ConsulError::BadResponse(format!(
                "cannot decode JSON ({e}): {}",
                truncate(&String::from_utf8_lossy(&self.body), 200)
            ))
        })
    }
}

fn truncate(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

impl Consul {
    pub fn new(cfg: ConsulConfig) -> Result<Self> {
        init_tls();
        let base = normalize_address(&cfg.address)?;
        let max_conns = cfg.max_conns.max(2);
        let token = TokenSource::new(cfg.token.as_deref(), cfg.token_file.as_deref())?;
        let mut headers = reqwest::header::HeaderMap::new();
        for (name, value) in &cfg.headers {
            let bad = |what: &str| {
                ConsulError::Config(format!(
                    "--header {name}=…: {what} (give NAME=VALUE, e.g. --header X-Request-Source=rcfarm)"
                ))
            };
            let n = reqwest::header::HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| bad("not a valid HTTP header name"))?;
            let v = reqwest::header::HeaderValue::from_str(value)
                .map_err(|_| bad("the value has characters not allowed in an HTTP header"))?;
            headers.append(n, v);
        }
        // Built even for http:// addresses: a bad certificate file is a mistake either way,
        // better found at start than when someone switches the address to https://.
        let tls = cfg.tls.build()?;
        let build = |idle: usize| {
            reqwest::Client::builder()
                // Idle connections are kept (up to the bound) for reuse instead of being
                // closed and reopened: churn leaves thousands of sockets in TIME-WAIT.
                .pool_max_idle_per_host(idle)
                .pool_idle_timeout(Duration::from_secs(90))
                .connect_timeout(Duration::from_secs(5))
                .tcp_nodelay(true)
                .default_headers(headers.clone())
                .tls_backend_preconfigured(tls.config.clone())
                .build()
                .map_err(|e| ConsulError::Config(format!("cannot build the HTTP client: {e}")))
        };
        let http = build(max_conns - 1)?;
        let session_http = build(1)?;
        Ok(Self {
            inner: Arc::new(Inner {
                http,
                permits: Arc::new(tokio::sync::Semaphore::new(shared_permits(max_conns))),
                txn_queue: Default::default(),
                session_http,
                base,
                cfg,
                token,
                tls_seen: tls.seen,
                stats: ClientStats::default(),
            }),
        })
    }

    /// Whether requests carry an ACL token (given, or read from a file).
    pub fn has_token(&self) -> bool {
        self.inner.token.is_set()
    }

    /// The base URL requests go to.
    pub fn address(&self) -> &str {
        &self.inner.base
    }

    pub fn stats(&self) -> ClientStatsSnapshot {
        let s = &self.inner.stats;
        ClientStatsSnapshot {
            requests: s.requests.load(Ordering::Relaxed),
            waited: s.waited.load(Ordering::Relaxed),
            txns: s.txns.load(Ordering::Relaxed),
            errors: s.errors.load(Ordering::Relaxed),
            blocking_open: s.blocking_open.load(Ordering::Relaxed),
        }
    }

    fn kv_url(&self, key: &str) -> String {
        format!(
            "{}/v1/kv/{}",
            self.inner.base,
            utf8_percent_encode(key, KEY_ESCAPE)
        )
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}", self.inner.base, path)
    }

    /// Sends a request built by `build` (called again for each attempt) and returns the raw
    /// answer; statuses every endpoint treats alike (403, unavailability) become errors here.
    async fn execute(
        &self,
        endpoint: &'static str,
        retry: Retry,
        timeout: Duration,
        via: Via,
        blocking: bool,
        build: impl Fn() -> Result<reqwest::RequestBuilder>,
    ) -> Result<Raw> {
        // A blocking read is not retried here: its watch loop decides how to recover.
        let attempts = if blocking { 1 } else { self.inner.cfg.attempts };
        let (lane, mut held) = match via {
            Via::Lane(lane) => (lane, None),
            Via::Held(p) => (Lane::Shared, Some(p)),
        };
        let cfg = &self.inner.cfg;
        let mut backoff = Backoff::new(cfg.retry_base, cfg.retry_cap);
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            self.inner.stats.requests.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("rcfarm_consul_requests_total", "endpoint" => endpoint).increment(1);
            // Held until the answer's body is read, so that the connection is back in the pool
            // before another request may start.
            let _permit = match (held.take(), lane) {
                (Some(p), _) => Some(p),
                (None, Lane::Session) => None,
                (None, Lane::Shared) => Some(self.permit().await?),
            };
            let mut request = build()?.timeout(timeout);
            if let Some(token) = self.inner.token.current() {
                request = request.header("X-Consul-Token", token);
            }
            // A blocking query's time is how long nothing changed, not latency: not timed.
            let started = (!blocking).then(std::time::Instant::now);
            let mut http_status = None;
            let (err, may_retry) = match request.send().await {
                Ok(resp) => {
                    let status = resp.status();
                    http_status = Some(status.as_u16());
                    let headers = resp.headers().clone();
                    match resp.bytes().await {
                        Ok(body) => {
                            // hyper puts the connection back in the pool from a task of its
                            // own once the body is done; let it run before the permit goes,
                            // or the next request finds no idle connection and opens one more.
                            tokio::task::yield_now().await;
                            if let Some(t) = started {
                                metrics::histogram!("rcfarm_consul_request_duration_seconds", "endpoint" => endpoint)
                                    .record(t.elapsed().as_secs_f64());
                            }
                            let raw = Raw {
                                status,
                                headers,
                                body,
                            };
                            match self.generic_error(&raw) {
                                None => return Ok(raw),
                                Some(e) => {
                                    let retry_ok = e.is_retryable() && retry == Retry::Idempotent;
                                    (e, retry_ok)
                                }
                            }
                        }
                        Err(e) => (self.unavailable(e.to_string()), retry == Retry::Idempotent),
                    }
                }
                Err(e) => {
                    let never_sent = e.is_connect();
                    (
                        self.unavailable(self.describe_transport(&e)),
                        retry == Retry::Idempotent || never_sent,
                    )
                }
            };
            self.inner.stats.errors.fetch_add(1, Ordering::Relaxed);
            // Consul's rate limiter answers 429: told apart from other unavailability, since
            // the cure (fewer farms' requests, a higher limit) differs.
            let reason = if http_status == Some(429) {
                "rate_limited"
            } else {
                err.reason_label()
            };
            metrics::counter!("rcfarm_consul_request_errors_total", "endpoint" => endpoint, "reason" => reason)
                .increment(1);
            if !may_retry || attempt >= attempts.max(1) {
                return Err(err);
            }
            tracing::debug!(endpoint, attempt, error = %err, "retrying Consul request");
            tokio::time::sleep(backoff.next_delay()).await;
        }
    }

    /// A permit for one request on the shared connections.
    pub(super) async fn permit(&self) -> Result<Permit> {
        let permits = &self.inner.permits;
        if let Ok(p) = permits.clone().try_acquire_owned() {
            return Ok(p);
        }
        self.inner.stats.waited.fetch_add(1, Ordering::Relaxed);
        permits
            .clone()
            .acquire_owned()
            .await
            // The semaphore is never closed while the client exists.
            .map_err(|_| self.unavailable("the client is shutting down".into()))
    }

    /// A transport error in words, with why Consul refused a TLS handshake when it said so
    /// with an alert after asking for a client certificate.
    fn describe_transport(&self, e: &reqwest::Error) -> String {
        let mut reason = describe_reqwest(e);
        if super::tls::is_peer_alert(&reason)
            && let Some(why) = self.inner.tls_seen.explain()
        {
            reason.push_str(": ");
            reason.push_str(&why);
        }
        reason
    }

    fn unavailable(&self, reason: String) -> ConsulError {
        ConsulError::Unavailable {
            addr: self.inner.base.clone(),
            reason,
        }
    }

    /// Errors shared by every endpoint. Endpoint-specific statuses (404, 409, 400, 413) are left
    /// to the caller.
    fn generic_error(&self, raw: &Raw) -> Option<ConsulError> {
        match raw.status.as_u16() {
            403 => {
                // A token file may have been rotated a moment ago: look again before the retry
                // or the next call.
                self.inner.token.recheck_soon();
                Some(ConsulError::PermissionDenied(raw.text()))
            }
            429 | 502 | 503 | 504 => {
                Some(self.unavailable(format!("HTTP {}: {}", raw.status.as_u16(), raw.text())))
            }
            500 => {
                let text = raw.text();
                let lower = text.to_ascii_lowercase();
                // A lock with an unknown session: `raft apply failed: invalid session "<id>"`.
                // (Not to be confused with "Invalid Session TTL", a rejected create.)
                if let Some(pos) = text.find("invalid session \"") {
                    let id = text[pos..].split('"').nth(1).unwrap_or("").to_string();
                    Some(ConsulError::InvalidSession(id))
                } else if is_availability_error(&lower) {
                    Some(self.unavailable(format!("HTTP 500: {text}")))
                } else {
                    Some(ConsulError::Rejected {
                        status: 500,
                        body: text,
                    })
                }
            }
            _ => None,
        }
    }

    fn blocking_timeout(&self, opts: &QueryOptions) -> Duration {
        if opts.index == 0 {
            return self.inner.cfg.timeout;
        }
        // Consul clamps wait to 10 min and adds up to wait/16 of jitter.
        let wait = opts
            .wait
            .filter(|w| !w.is_zero())
            .unwrap_or(Duration::from_secs(300))
            .min(Duration::from_secs(600));
        wait + wait / 16 + self.inner.cfg.timeout.max(Duration::from_secs(5))
    }

    /// A read, with blocking-query parameters. Blocking reads are not retried here: the caller's
    /// watch loop decides how to recover.
    async fn read(
        &self,
        endpoint: &'static str,
        url: String,
        extra: &[(&str, &str)],
        opts: &QueryOptions,
    ) -> Result<Raw> {
        let mut query: Vec<(String, String)> = extra
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        if opts.index > 0 {
            query.push(("index".into(), opts.index.to_string()));
            if let Some(w) = opts.wait {
                query.push(("wait".into(), format!("{}ms", w.as_millis().max(1))));
            }
        }
        if opts.consistent {
            query.push(("consistent".into(), String::new()));
        } else if opts.stale {
            query.push(("stale".into(), String::new()));
        }
        let timeout = self.blocking_timeout(opts);
        let blocking = opts.index > 0;
        let _open = blocking.then(|| BlockingGuard::new(&self.inner.stats));
        self.execute(
            endpoint,
            Retry::Idempotent,
            timeout,
            Via::Lane(Lane::Shared),
            blocking,
            || Ok(self.inner.http.get(&url).query(&query)),
        )
        .await
    }
}

struct BlockingGuard<'a>(&'a ClientStats);

impl<'a> BlockingGuard<'a> {
    fn new(stats: &'a ClientStats) -> Self {
        stats.blocking_open.fetch_add(1, Ordering::Relaxed);
        metrics::gauge!("rcfarm_consul_blocking_queries_open").increment(1.0);
        Self(stats)
    }
}

impl Drop for BlockingGuard<'_> {
    fn drop(&mut self) {
        self.0.blocking_open.fetch_sub(1, Ordering::Relaxed);
        metrics::gauge!("rcfarm_consul_blocking_queries_open").decrement(1.0);
    }
}

fn is_availability_error(lower: &str) -> bool {
    [
        "no cluster leader",
        "no path to datacenter",
        "rpc error",
        "i/o timeout",
        "connection refused",
        "eof",
        "raft",
        "leadership lost",
        "rate limit",
    ]
    .iter()
    .any(|s| lower.contains(s))
}

fn describe_reqwest(e: &reqwest::Error) -> String {
    // reqwest's Display hides the cause ("error sending request"); the chain says why.
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(cause) = src {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        src = cause.source();
    }
    s
}

fn normalize_address(addr: &str) -> Result<String> {
    let addr = addr.trim().trim_end_matches('/');
    if addr.is_empty() {
        return Err(ConsulError::Config(
            "empty Consul address; give one like http://127.0.0.1:8500".into(),
        ));
    }
    let with_scheme = if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    let url = reqwest::Url::parse(&with_scheme).map_err(|e| {
        ConsulError::Config(format!(
            "invalid Consul address {addr:?} ({e}); give one like http://127.0.0.1:8500"
        ))
    })?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(ConsulError::Config(format!(
            "invalid Consul address {addr:?}: the scheme must be http or https"
        )));
    }
    Ok(with_scheme)
}

/// A write's HTTP method, body and retry class.
struct Write<'a> {
    endpoint: &'static str,
    method: Method,
    url: String,
    query: Vec<(&'a str, String)>,
    body: Option<Body<'a>>,
    retry: Retry,
    lane: Lane,
}

/// A write's body.
enum Body<'a> {
    Bytes(Vec<u8>),
    /// A transaction's ops, serialized only once a connection permit is held: at 20,000 RCs
    /// thousands of tasks wait for a permit at once, and their serialized bodies (base64 values
    /// in JSON) were ~14 MB of a farm's peak heap beside the ops they were made from.
    Txn(&'a [TxnOp]),
}

impl Body<'_> {
    fn to_vec(&self) -> Result<Vec<u8>> {
        match self {
            Body::Bytes(b) => Ok(b.clone()),
            Body::Txn(ops) => {
                serde_json::to_vec(ops).map_err(|e| ConsulError::BadResponse(e.to_string()))
            }
        }
    }
}

/// How a request gets its connection: from its lane, or with a permit its caller holds
/// already (on the shared lane).
enum Via {
    Lane(Lane),
    Held(Permit),
}

/// Which connections a request uses.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Lane {
    /// The bounded pool shared by every request but session calls.
    Shared,
    /// The session's own connection.
    Session,
}

impl Consul {
    async fn write(&self, w: Write<'_>) -> Result<Raw> {
        self.write_held(w, None).await
    }

    /// A write sent with a permit the caller already holds (then on the shared lane).
    async fn write_held(&self, w: Write<'_>, held: Option<Permit>) -> Result<Raw> {
        let timeout = self.inner.cfg.timeout;
        self.execute(
            w.endpoint,
            w.retry,
            timeout,
            match held {
                Some(p) => Via::Held(p),
                None => Via::Lane(w.lane),
            },
            false,
            || {
                let http = match w.lane {
                    Lane::Shared => &self.inner.http,
                    Lane::Session => &self.inner.session_http,
                };
                let mut rb = http.request(w.method.clone(), &w.url).query(&w.query);
                if let Some(b) = &w.body {
                    rb = rb.body(b.to_vec()?);
                }
                Ok(rb)
            },
        )
        .await
    }

    /// Reads a `true`/`false` answer (KV PUT and DELETE).
    fn bool_answer(&self, raw: &Raw) -> Result<bool> {
        match raw.status.as_u16() {
            200 => {
                let text = raw.text();
                match text.as_str() {
                    "true" => Ok(true),
                    "false" => Ok(false),
                    _ => Err(ConsulError::BadResponse(format!(
                        "expected true or false, got {:?}",
                        truncate(&text, 100)
                    ))),
                }
            }
            status => Err(ConsulError::Rejected {
                status,
                body: raw.text(),
            }),
        }
    }

    fn kv_write(
        &self,
        key: &str,
        method: Method,
        query: Vec<(&'static str, String)>,
    ) -> Write<'static> {
        Write {
            endpoint: "kv",
            method,
            url: self.kv_url(key),
            query,
            body: None,
            retry: Retry::Idempotent,
            lane: Lane::Shared,
        }
    }

    // ---- KV ---------------------------------------------------------------------------------

    /// `GET /v1/kv/<key>`: the entry, or `None` if the key does not exist.
    pub async fn kv_get(
        &self,
        key: &str,
        opts: &QueryOptions,
    ) -> Result<(Option<KvPair>, QueryMeta)> {
        let raw = self.read("kv", self.kv_url(key), &[], opts).await?;
        let meta = raw.meta();
        match raw.status.as_u16() {
            200 => {
                let mut entries: Vec<KvPair> = raw.json()?;
                Ok((entries.pop(), meta))
            }
            404 => Ok((None, meta)),
            status => Err(ConsulError::Rejected {
                status,
                body: raw.text(),
            }),
        }
    }

    /// `GET /v1/kv/<prefix>?recurse`: every entry whose key starts with `prefix` (sorted by key).
    /// An empty tree is an empty list.
    pub async fn kv_list(
        &self,
        prefix: &str,
        opts: &QueryOptions,
    ) -> Result<(Vec<KvPair>, QueryMeta)> {
        let raw = self
            .read("kv", self.kv_url(prefix), &[("recurse", "")], opts)
            .await?;
        let meta = raw.meta();
        match raw.status.as_u16() {
            200 => Ok((raw.json()?, meta)),
            404 => Ok((Vec::new(), meta)),
            status => Err(ConsulError::Rejected {
                status,
                body: raw.text(),
            }),
        }
    }

    /// `GET /v1/kv/<prefix>?keys[&separator=…]`: the keys under `prefix`, cut after the separator.
    pub async fn kv_keys(
        &self,
        prefix: &str,
        separator: Option<&str>,
        opts: &QueryOptions,
    ) -> Result<(Vec<String>, QueryMeta)> {
        let mut extra = vec![("keys", "")];
        if let Some(sep) = separator {
            extra.push(("separator", sep));
        }
        let raw = self.read("kv", self.kv_url(prefix), &extra, opts).await?;
        let meta = raw.meta();
        match raw.status.as_u16() {
            200 => Ok((raw.json()?, meta)),
            404 => Ok((Vec::new(), meta)),
            status => Err(ConsulError::Rejected {
                status,
                body: raw.text(),
            }),
        }
    }

    /// `PUT /v1/kv/<key>`: an unconditional write (idempotent, so retried).
    pub async fn kv_put(&self, key: &str, value: &[u8], flags: Option<u64>) -> Result<bool> {
        let mut w = self.kv_write(key, Method::PUT, flags_query(flags));
        w.body = Some(Body::Bytes(value.to_vec()));
        let raw = self.write(w).await?;
        self.bool_answer(&raw)
    }

    /// `PUT /v1/kv/<key>?cas=N`: write only if `ModifyIndex == N` (0: only if absent).
    pub async fn kv_cas(
        &self,
        key: &str,
        value: &[u8],
        index: u64,
        flags: Option<u64>,
    ) -> Result<bool> {
        let mut query = flags_query(flags);
        query.push(("cas", index.to_string()));
        let mut w = self.kv_write(key, Method::PUT, query);
        w.body = Some(Body::Bytes(value.to_vec()));
        w.retry = Retry::ConnectOnly;
        let raw = self.write(w).await?;
        self.bool_answer(&raw)
    }

    /// `PUT /v1/kv/<key>?acquire=<session>`: take the key's lock. Repeating it with the same
    /// session is harmless, so it is retried.
    pub async fn kv_acquire(
        &self,
        key: &str,
        value: &[u8],
        session: &str,
        flags: Option<u64>,
    ) -> Result<bool> {
        let mut query = flags_query(flags);
        query.push(("acquire", session.to_string()));
        let mut w = self.kv_write(key, Method::PUT, query);
        w.body = Some(Body::Bytes(value.to_vec()));
        let raw = self.write(w).await?;
        self.bool_answer(&raw)
    }

    /// `PUT /v1/kv/<key>?release=<session>`: give the lock up (no lock-delay applies).
    pub async fn kv_release(
        &self,
        key: &str,
        value: &[u8],
        session: &str,
        flags: Option<u64>,
    ) -> Result<bool> {
        let mut query = flags_query(flags);
        query.push(("release", session.to_string()));
        let mut w = self.kv_write(key, Method::PUT, query);
        w.body = Some(Body::Bytes(value.to_vec()));
        w.retry = Retry::ConnectOnly;
        let raw = self.write(w).await?;
        self.bool_answer(&raw)
    }

    /// Reads many keys, some perhaps missing, in batched read-only transactions: `get-tree` on
    /// each exact key never fails for a missing one and exists in every Consul version (unlike
    /// `get-or-empty`). The entries found, by key.
    pub async fn read_keys(
        &self,
        keys: &[String],
    ) -> Result<std::collections::HashMap<String, KvPair>> {
        let mut found = std::collections::HashMap::with_capacity(keys.len());
        for chunk in keys.chunks(MAX_TXN_OPS) {
            let ops: Vec<TxnOp> = chunk.iter().map(|k| TxnOp::get_tree(k.clone())).collect();
            let resp = self.txn(&ops).await?;
            for kv in resp.results {
                // A prefix read also returns longer keys (`a/web` finds `a/web2`).
                if chunk.contains(&kv.key) {
                    found.insert(kv.key.clone(), kv);
                }
            }
        }
        Ok(found)
    }

    /// Gives a lock up by deleting its key, only if `session` holds it (as P2's unlock does):
    /// no lock-delay applies, so another session can take it at once. `Ok(false)` if the
    /// session did not hold it.
    pub async fn release_lock(&self, key: &str, session: &str) -> Result<bool> {
        match self
            .txn(&[TxnOp::check_session(key, session), TxnOp::delete(key)])
            .await
        {
            Ok(_) => Ok(true),
            Err(e)
                if e.txn_failures().any(|(_, f)| {
                    matches!(
                        f,
                        super::txn::TxnFailure::SessionMismatch
                            | super::txn::TxnFailure::KeyMissing
                    )
                }) =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// `DELETE /v1/kv/<key>`.
    pub async fn kv_delete(&self, key: &str) -> Result<()> {
        let raw = self
            .write(self.kv_write(key, Method::DELETE, vec![]))
            .await?;
        self.bool_answer(&raw).map(|_| ())
    }

    /// `DELETE /v1/kv/<prefix>?recurse`.
    pub async fn kv_delete_tree(&self, prefix: &str) -> Result<()> {
        let w = self.kv_write(prefix, Method::DELETE, vec![("recurse", String::new())]);
        let raw = self.write(w).await?;
        self.bool_answer(&raw).map(|_| ())
    }

    /// `DELETE /v1/kv/<key>?cas=N`: true if deleted at that index, or already absent.
    pub async fn kv_delete_cas(&self, key: &str, index: u64) -> Result<bool> {
        let mut w = self.kv_write(key, Method::DELETE, vec![("cas", index.to_string())]);
        w.retry = Retry::ConnectOnly;
        let raw = self.write(w).await?;
        self.bool_answer(&raw)
    }

    // ---- Sessions ---------------------------------------------------------------------------

    /// `PUT /v1/session/create`: the new session's id.
    pub async fn session_create(&self, req: &SessionRequest) -> Result<String> {
        let body = serde_json::to_vec(req).map_err(|e| ConsulError::BadResponse(e.to_string()))?;
        let raw = self
            .write(Write {
                endpoint: "session",
                method: Method::PUT,
                url: self.url("/v1/session/create"),
                query: vec![],
                body: Some(Body::Bytes(body)),
                retry: Retry::ConnectOnly,
                lane: Lane::Session,
            })
            .await?;
        match raw.status.as_u16() {
            200 => {
                #[derive(serde::Deserialize)]
                struct Created {
                    #[serde(rename = "ID")]
                    id: String,
                }
                Ok(raw.json::<Created>()?.id)
            }
            status => Err(ConsulError::Rejected {
                status,
                body: raw.text(),
            }),
        }
    }

    /// `PUT /v1/session/renew/<id>`. A session Consul no longer has is `NotFound`.
    pub async fn session_renew(&self, id: &str) -> Result<SessionEntry> {
        let raw = self
            .write(Write {
                endpoint: "session",
                method: Method::PUT,
                url: self.url(&format!("/v1/session/renew/{id}")),
                query: vec![],
                body: None,
                retry: Retry::Idempotent,
                lane: Lane::Session,
            })
            .await?;
        match raw.status.as_u16() {
            200 => raw
                .json::<Vec<SessionEntry>>()?
                .pop()
                .ok_or_else(|| ConsulError::NotFound(format!("session {id}"))),
            404 => Err(ConsulError::NotFound(format!("session {id}"))),
            status => Err(ConsulError::Rejected {
                status,
                body: raw.text(),
            }),
        }
    }

    /// `PUT /v1/session/destroy/<id>`: releases or deletes every key the session holds.
    pub async fn session_destroy(&self, id: &str) -> Result<()> {
        let raw = self
            .write(Write {
                endpoint: "session",
                method: Method::PUT,
                url: self.url(&format!("/v1/session/destroy/{id}")),
                query: vec![],
                body: None,
                retry: Retry::Idempotent,
                lane: Lane::Session,
            })
            .await?;
        self.bool_answer(&raw).map(|_| ())
    }

    /// `GET /v1/session/info/<id>`: the session, or `None` if it does not exist.
    pub async fn session_info(
        &self,
        id: &str,
        opts: &QueryOptions,
    ) -> Result<(Option<SessionEntry>, QueryMeta)> {
        let raw = self
            .read(
                "session",
                self.url(&format!("/v1/session/info/{id}")),
                &[],
                opts,
            )
            .await?;
        let meta = raw.meta();
        match raw.status.as_u16() {
            // Consul answers `null` for an unknown session in some versions, `[]` in others.
            200 => Ok((
                raw.json::<Option<Vec<SessionEntry>>>()?
                    .and_then(|mut v| v.pop()),
                meta,
            )),
            404 => Ok((None, meta)),
            status => Err(ConsulError::Rejected {
                status,
                body: raw.text(),
            }),
        }
    }

    /// `GET /v1/session/list`.
    pub async fn session_list(
        &self,
        opts: &QueryOptions,
    ) -> Result<(Vec<SessionEntry>, QueryMeta)> {
        let raw = self
            .read("session", self.url("/v1/session/list"), &[], opts)
            .await?;
        let meta = raw.meta();
        match raw.status.as_u16() {
            200 => Ok((
                raw.json::<Option<Vec<SessionEntry>>>()?.unwrap_or_default(),
                meta,
            )),
            status => Err(ConsulError::Rejected {
                status,
                body: raw.text(),
            }),
        }
    }

    // ---- Transactions -----------------------------------------------------------------------

    /// Commits `ops` all or nothing, as [`Consul::txn`] does, possibly in one transaction with
    /// other callers' ops (see [`super::coalesce`]). Returns the index it committed at (0 if
    /// nothing in it yields a result, as for `txn`).
    ///
    /// A caller dropped before its ops were sent never sends them; once sent, they may apply
    /// whatever becomes of the caller, like any request in flight.
    pub async fn txn_coalesced(&self, ops: Vec<TxnOp>) -> Result<u64> {
        super::coalesce::txn(self, ops).await
    }

    /// `PUT /v1/txn`: all ops or none. A rollback is [`ConsulError::Conflict`] naming each
    /// failed op. More than [`MAX_TXN_OPS`] ops is refused before anything is sent.
    pub async fn txn(&self, ops: &[TxnOp]) -> Result<TxnResponse> {
        self.txn_held(ops, None).await
    }

    /// [`Consul::txn`] with a permit the caller already holds.
    pub(super) async fn txn_held(
        &self,
        ops: &[TxnOp],
        held: Option<Permit>,
    ) -> Result<TxnResponse> {
        super::txn::check_op_count(ops.len())?;
        let read_only = ops.iter().all(|op| op.verb.is_read());
        self.inner.stats.txns.fetch_add(1, Ordering::Relaxed);
        let raw = self
            .write_held(
                Write {
                    endpoint: "txn",
                    // PUT, never POST: Consul 0.7 answers POST with 405.
                    method: Method::PUT,
                    url: self.url("/v1/txn"),
                    query: vec![],
                    body: Some(Body::Txn(ops)),
                    retry: if read_only {
                        Retry::Idempotent
                    } else {
                        Retry::ConnectOnly
                    },
                    lane: Lane::Shared,
                },
                held,
            )
            .await;
        let raw = match raw {
            Ok(r) => r,
            Err(e) => {
                metrics::counter!("rcfarm_consul_txn_total", "outcome" => e.reason_label())
                    .increment(1);
                return Err(e);
            }
        };
        let index = raw
            .headers
            .get("x-consul-index")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let result = match raw.status.as_u16() {
            200 => {
                let wire: WireTxnResponse = raw.json()?;
                let results = wire
                    .results
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|r| r.kv)
                    .collect();
                Ok(TxnResponse { results, index })
            }
            409 => {
                let wire: WireTxnResponse = raw.json()?;
                match wire.errors {
                    Some(errs) if !errs.is_empty() => Err(ConsulError::Conflict(errs)),
                    _ => Err(ConsulError::BadResponse(format!(
                        "409 without Errors: {}",
                        truncate(&raw.text(), 200)
                    ))),
                }
            }
            status => Err(ConsulError::Rejected {
                status,
                body: raw.text(),
            }),
        };
        let outcome = match &result {
            Ok(_) => "committed",
            Err(e) => e.reason_label(),
        };
        metrics::counter!("rcfarm_consul_txn_total", "outcome" => outcome).increment(1);
        result
    }

    // ---- Status -----------------------------------------------------------------------------

    /// `GET /v1/status/leader`: the leader's address, empty if the cluster has none.
    pub async fn leader(&self) -> Result<String> {
        let raw = self
            .read(
                "status",
                self.url("/v1/status/leader"),
                &[],
                &QueryOptions::default(),
            )
            .await?;
        match raw.status.as_u16() {
            200 => raw.json(),
            status => Err(ConsulError::Rejected {
                status,
                body: raw.text(),
            }),
        }
    }

    /// `GET /v1/status/peers`.
    pub async fn peers(&self) -> Result<Vec<String>> {
        let raw = self
            .read(
                "status",
                self.url("/v1/status/peers"),
                &[],
                &QueryOptions::default(),
            )
            .await?;
        match raw.status.as_u16() {
            200 => raw.json(),
            status => Err(ConsulError::Rejected {
                status,
                body: raw.text(),
            }),
        }
    }
}

fn flags_query(flags: Option<u64>) -> Vec<(&'static str, String)> {
    flags
        .map(|f| vec![("flags", f.to_string())])
        .unwrap_or_default()
}

impl super::coalesce::Sender for Consul {
    type Permit = Permit;

    fn queue(&self) -> &super::coalesce::TxnQueue {
        &self.inner.txn_queue
    }

    fn address(&self) -> &str {
        Consul::address(self)
    }

    async fn permit(&self) -> Result<Permit> {
        Consul::permit(self).await
    }

    async fn send(&self, ops: &[TxnOp], held: Option<Permit>) -> Result<u64> {
        Ok(self.txn_held(ops, held).await?.commit_index())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_normalized() {
        assert_eq!(
            normalize_address("127.0.0.1:8500").unwrap(),
            "http://127.0.0.1:8500"
        );
        assert_eq!(
            normalize_address("https://c:8501/").unwrap(),
            "https://c:8501"
        );
        assert!(normalize_address("").is_err());
        assert!(normalize_address("ftp://x").is_err());
    }

    #[test]
    fn keys_are_escaped_so_consul_decodes_them_back() {
        let c = Consul::new(ConsulConfig::new("http://h:1")).unwrap();
        assert_eq!(
            c.kv_url("a/b c+d?e%f"),
            "http://h:1/v1/kv/a/b%20c%2Bd%3Fe%25f"
        );
    }
}

//! The client and its configuration: where Consul is, which token and TLS settings to use, and
//! the connections every call shares (a bounded pool, and one kept for sessions). The calls are
//! in `verbs`, how they go over HTTP in `transport`.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use super::error::{ConsulError, Result};
use super::tls::{HandshakeSeen, TlsConfig};
use super::token::TokenSource;

/// Where Consul is and how to talk to it. Its `Debug` never shows the token or a header's
/// value (a header may carry credentials).
#[derive(Clone)]
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

impl std::fmt::Debug for ConsulConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsulConfig")
            .field("address", &self.address)
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("token_file", &self.token_file)
            .field(
                "headers",
                &self
                    .headers
                    .iter()
                    .map(|(k, _)| format!("{k}: ***"))
                    .collect::<Vec<_>>(),
            )
            .field("timeout", &self.timeout)
            .field("attempts", &self.attempts)
            .field("retry_base", &self.retry_base)
            .field("retry_cap", &self.retry_cap)
            .field("max_conns", &self.max_conns)
            .field("tls", &self.tls)
            .finish()
    }
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
    pub(crate) inner: Arc<Inner>,
}

/// A permit for one request on the shared connections.
/// Owned, so that a batch of transactions can be sent from a task of its own
/// ([`Consul::txn_coalesced`]).
pub(crate) type Permit = tokio::sync::OwnedSemaphorePermit;

pub(crate) struct Inner {
    /// Every request but session calls; at most `permits` of them in flight.
    pub(crate) http: reqwest::Client,
    pub(crate) permits: Arc<tokio::sync::Semaphore>,
    /// Transactions waiting to be sent together ([`Consul::txn_coalesced`]).
    pub(crate) txn_queue: super::coalesce::TxnQueue,
    /// Session create/renew/destroy, on a connection of their own so that renewals never queue
    /// behind bulk work (a starved renewal loses every lock the farm holds).
    pub(crate) session_http: reqwest::Client,
    pub(crate) base: String,
    pub(crate) cfg: ConsulConfig,
    pub(crate) token: TokenSource,
    /// What Consul asked for in TLS handshakes, to explain a refused one.
    pub(crate) tls_seen: Arc<HandshakeSeen>,
    pub(crate) stats: ClientStats,
    /// `cfg.headers` as parsed: `reqwest` sends them as its clients' default headers; a
    /// request to [`Inner::port`] carries them itself.
    pub(crate) headers: reqwest::header::HeaderMap,
    /// Where requests go instead of the network ([`Consul::over`]).
    pub(crate) port: Option<Arc<dyn super::port::Port>>,
}

impl std::fmt::Debug for Consul {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consul")
            .field("address", &self.inner.base)
            .finish()
    }
}

impl Consul {
    pub fn new(cfg: ConsulConfig) -> Result<Self> {
        Self::build(cfg, None)
    }

    /// A client whose every request goes to `port` rather than to `cfg.address` (the address
    /// still names Consul in errors and logs). The timeouts, retries and connection bounds of
    /// `cfg` apply as over the network.
    pub fn over(cfg: ConsulConfig, port: Arc<dyn super::port::Port>) -> Result<Self> {
        Self::build(cfg, Some(port))
    }

    pub(crate) fn build(
        cfg: ConsulConfig,
        port: Option<Arc<dyn super::port::Port>>,
    ) -> Result<Self> {
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
                headers,
                port,
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
}

//! How a request goes over HTTP: its URL, a connection (a permit on the shared pool, or the
//! session's own), retries only where repeating a call cannot change its meaning, and the
//! errors every endpoint answers alike.

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};
use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;

use super::client::{ClientStats, Consul, Permit};
use super::error::{ConsulError, Result};
use super::kvlist::KvList;
use super::txn::TxnOp;
use super::types::{QueryMeta, QueryOptions};
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

/// How a call may be repeated after a failure.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retry {
    /// Reads and idempotent writes: retry on any unavailability.
    Idempotent,
    /// Writes whose repetition could change the answer: retry only if the request never left
    /// (connection refused), so it cannot have been applied.
    ConnectOnly,
}

pub(crate) struct Raw {
    pub(crate) status: StatusCode,
    pub(crate) headers: reqwest::header::HeaderMap,
    body: Bytes,
}

impl Raw {
    pub(crate) fn meta(&self) -> QueryMeta {
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
            date: h("date")
                .and_then(|d| chrono::DateTime::parse_from_rfc2822(d).ok())
                .map(|d| d.timestamp()),
        }
    }

    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).trim().to_string()
    }

    /// The listing as sent (see [`KvList`]); the body is shared, not copied.
    pub(crate) fn kv_list(&self) -> Result<KvList> {
        let heavy = self.body.len() >= crate::util::CPU_HEAVY_BYTES;
        crate::util::cpu_heavy(heavy, || KvList::decode(self.body.clone()))
            .map_err(|e| self.undecodable("a KV listing", e))
    }

    pub(crate) fn json<T: DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_slice(&self.body).map_err(|e| self.undecodable("JSON", e))
    }

    /// The body's first 200 characters go in the error; only then is the body read as text.
    fn undecodable(&self, what: &str, e: impl std::fmt::Display) -> ConsulError {
        ConsulError::BadResponse(format!(
            "cannot decode {what} ({e}): {}",
            truncate(&String::from_utf8_lossy(&self.body), 200)
        ))
    }
}

pub(crate) fn truncate(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

impl Consul {
    pub(crate) fn kv_url(&self, key: &str) -> String {
        format!(
            "{}/v1/kv/{}",
            self.inner.base,
            utf8_percent_encode(key, KEY_ESCAPE)
        )
    }

    pub(crate) fn url(&self, path: &str) -> String {
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
        reading: Reading,
        build: impl Fn() -> Result<reqwest::RequestBuilder>,
    ) -> Result<Raw> {
        let blocking = reading.blocking;
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
            let (err, may_retry) = match self.send(request, reading.size_hint).await {
                Ok((status, headers, body)) => {
                    http_status = Some(status.as_u16());
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
                Err(Unsent { reason, never_sent }) => (
                    self.unavailable(reason),
                    retry == Retry::Idempotent || never_sent,
                ),
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

    /// Sends one request: over the network, or to the client's [`super::port::Port`].
    async fn send(
        &self,
        request: reqwest::RequestBuilder,
        size_hint: usize,
    ) -> std::result::Result<(StatusCode, reqwest::header::HeaderMap, Bytes), Unsent> {
        let Some(port) = &self.inner.port else {
            return match request.send().await {
                Ok(resp) => {
                    let status = resp.status();
                    let headers = resp.headers().clone();
                    match read_body(resp, size_hint).await {
                        Ok(body) => {
                            // hyper puts the connection back in the pool from a task of its
                            // own once the body is done; let it run before the permit goes,
                            // or the next request finds no idle connection and opens one more.
                            tokio::task::yield_now().await;
                            Ok((status, headers, body))
                        }
                        // The request went: a write's outcome is unknown.
                        Err(e) => Err(Unsent {
                            reason: e.to_string(),
                            never_sent: false,
                        }),
                    }
                }
                Err(e) => Err(Unsent {
                    never_sent: e.is_connect(),
                    reason: self.describe_transport(&e),
                }),
            };
        };
        let request = request.build().map_err(|e| Unsent {
            reason: format!("cannot build the request: {e}"),
            never_sent: true,
        })?;
        let url = request.url();
        let path_and_query = match url.query() {
            Some(q) => format!("{}?{q}", url.path()),
            None => url.path().to_string(),
        };
        // The client's default headers, as reqwest adds them over the network.
        let mut headers = self.inner.headers.clone();
        headers.extend(request.headers().clone());
        let body = request
            .body()
            .and_then(|b| b.as_bytes())
            .map(Bytes::copy_from_slice)
            .unwrap_or_default();
        // As hyper sends it: Consul decodes a body only when it has a length.
        if !body.is_empty() {
            headers.insert(reqwest::header::CONTENT_LENGTH, body.len().into());
        }
        let exchange = super::port::Exchange {
            method: request.method().clone(),
            path_and_query,
            headers,
            body,
        };
        // The request's timeout, as reqwest applies it over the network.
        let timeout = request.timeout().copied();
        let answer = match timeout {
            Some(t) => match tokio::time::timeout(t, port.call(exchange)).await {
                Ok(a) => a,
                Err(_) => Err(super::port::PortFailure::Lost(format!(
                    "operation timed out after {t:?}"
                ))),
            },
            None => port.call(exchange).await,
        };
        match answer {
            Ok(a) => Ok((a.status, a.headers, a.body)),
            Err(f) => Err(Unsent {
                never_sent: matches!(f, super::port::PortFailure::NotSent(_)),
                reason: f.to_string(),
            }),
        }
    }

    /// A permit for one request on the shared connections.
    pub(crate) async fn permit(&self) -> Result<Permit> {
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
    pub(crate) async fn read(
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
        let reading = Reading {
            blocking,
            size_hint: opts.size_hint,
        };
        self.execute(
            endpoint,
            Retry::Idempotent,
            timeout,
            Via::Lane(Lane::Shared),
            reading,
            || Ok(self.inner.http.get(&url).query(&query)),
        )
        .await
    }
}

/// Why a request got no answer.
struct Unsent {
    reason: String,
    /// It never left, so it cannot have been applied.
    never_sent: bool,
}

/// What kind of answer a request expects.
#[derive(Default, Clone, Copy)]
struct Reading {
    /// A blocking query: not retried, not timed.
    blocking: bool,
    /// See [`QueryOptions::size_hint`].
    size_hint: usize,
}

/// Reads a body into one buffer sized up front: from its `Content-Length`, or else (Consul
/// sends big answers chunked) from the caller's hint. Collected chunk by chunk and then copied
/// into one buffer, a 10-MiB watch answer was held twice for a moment; grown by doubling, up
/// to 1.5 times over.
///
/// Past the hint (a tree that grew by more than the watch's margin, or a first answer, whose
/// hint is 0) the buffer grows by a quarter at a time, not by doubling, and is cut to the body
/// at the end: the body lives on while it is decoded and folded, seconds for a big tree, and a
/// doubled buffer held up to twice a 125-MiB pod-label answer for that long.
async fn read_body(mut resp: reqwest::Response, hint: usize) -> reqwest::Result<Bytes> {
    let expected = resp
        .content_length()
        .and_then(|n| usize::try_from(n).ok())
        .unwrap_or(hint);
    // A hint is a guess: never reserve past 1 GiB on one.
    let mut buf = Vec::with_capacity(expected.min(1 << 30));
    while let Some(chunk) = resp.chunk().await? {
        push_chunk(&mut buf, &chunk);
    }
    shrink_body(&mut buf);
    Ok(Bytes::from(buf))
}

/// Appends a chunk, growing the buffer by a quarter (or the chunk) when it is full.
fn push_chunk(buf: &mut Vec<u8>, chunk: &[u8]) {
    if buf.capacity() - buf.len() < chunk.len() {
        buf.reserve_exact(chunk.len().max(buf.capacity() / 4));
    }
    buf.extend_from_slice(chunk);
}

/// Gives back what a body's buffer holds past the body when that is worth a call: 64 KiB or
/// more (jemalloc cuts a large block in place, without a copy).
fn shrink_body(buf: &mut Vec<u8>) {
    if buf.capacity() - buf.len() >= 64 << 10 {
        buf.shrink_to_fit();
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

/// A write's HTTP method, body and retry class.
pub(crate) struct Write<'a> {
    pub(crate) endpoint: &'static str,
    pub(crate) method: Method,
    pub(crate) url: String,
    pub(crate) query: Vec<(&'a str, String)>,
    pub(crate) body: Option<Body<'a>>,
    pub(crate) retry: Retry,
    pub(crate) lane: Lane,
}

/// A write's body.
pub(crate) enum Body<'a> {
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
pub(crate) enum Lane {
    /// The bounded pool shared by every request but session calls.
    Shared,
    /// The session's own connection.
    Session,
}

impl Consul {
    pub(crate) async fn write(&self, w: Write<'_>) -> Result<Raw> {
        self.write_held(w, None).await
    }

    /// A write sent with a permit the caller already holds (then on the shared lane).
    pub(crate) async fn write_held(&self, w: Write<'_>, held: Option<Permit>) -> Result<Raw> {
        let timeout = self.inner.cfg.timeout;
        self.execute(
            w.endpoint,
            w.retry,
            timeout,
            match held {
                Some(p) => Via::Held(p),
                None => Via::Lane(w.lane),
            },
            Reading::default(),
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
    pub(crate) fn bool_answer(&self, raw: &Raw) -> Result<bool> {
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

    pub(crate) fn kv_write(
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::ConsulConfig;

    #[test]
    fn keys_are_escaped_so_consul_decodes_them_back() {
        let c = Consul::new(ConsulConfig::new("http://h:1")).unwrap();
        assert_eq!(
            c.kv_url("a/b c+d?e%f"),
            "http://h:1/v1/kv/a/b%20c%2Bd%3Fe%25f"
        );
    }

    /// A chunked body past its hint is held at most a quarter over while it arrives, and at
    /// its size once read (a few KiB over are not worth a call).
    #[test]
    fn a_body_past_its_hint_is_not_held_twice_over() {
        let chunk = vec![7u8; 16 << 10];
        for hint in [0, 1 << 20] {
            let mut buf = Vec::with_capacity(hint);
            for _ in 0..1024 {
                push_chunk(&mut buf, &chunk);
                assert!(
                    buf.capacity() <= hint.max(buf.len() + (buf.len() / 4).max(chunk.len())),
                    "{} held for {} (hint {hint})",
                    buf.capacity(),
                    buf.len()
                );
            }
            shrink_body(&mut buf);
            assert_eq!(buf.len(), 16 << 20);
            assert_eq!(buf.capacity(), buf.len(), "hint {hint}");
            assert!(buf.iter().all(|b| *b == 7));
        }
        let mut small = Vec::with_capacity(100 << 10);
        small.extend_from_slice(&[1u8; 60 << 10]);
        shrink_body(&mut small);
        assert_eq!(small.capacity(), 100 << 10);
    }
}

//! HTTP handlers of the embedded server, answering as Consul's `agent/*_endpoint.go` do: the same
//! statuses, plain-text error bodies, `X-Consul-*` headers and JSON shapes.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, Method, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use futures::StreamExt as _;
use percent_encoding::percent_decode_str;
use serde::Serialize;
use serde_json::{Map, Value, json};
use tokio::time::Instant;

use super::Shared;
use super::compat::Compat;
use super::store::{Behavior, KvOp, KvWriteOutcome, SessionRecord};
use super::waiters::WatchTarget;
use crate::consul::{KvPair, SessionEntry};
use crate::util::parse_go_duration;

const KV_SIZE_DOC: &str = "https://www.consul.io/docs/agent/config/config-files#kv_max_value_size";
const TXN_SIZE_DOC: &str = "https://www.consul.io/docs/agent/config/config-files#txn_max_req_len";
const DEFAULT_WAIT: Duration = Duration::from_secs(300);
const MAX_WAIT: Duration = Duration::from_secs(600);
const SESSION_TTL_MAX: Duration = Duration::from_secs(24 * 3600);
/// Consul 0.7's fixed limit on a KV value, and on the sum of a transaction's values.
const MAX_KV_SIZE_0_7: usize = 512 * 1024;
/// Consul 0.7 reads a transaction's body whatever its size; this server stops somewhere.
const MAX_TXN_BODY_0_7: usize = 64 << 20;

/// An error answer: Consul's errors are a status and a plain-text body.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    body: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, body: impl Into<String>) -> Self {
        Self {
            status,
            body: body.into(),
        }
    }

    #[cfg(test)]
    fn status(&self) -> StatusCode {
        self.status
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        text(self.status, self.body)
    }
}

type Answer = ApiError;

fn text(status: StatusCode, body: impl Into<String>) -> Response {
    let mut r = (status, body.into()).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

fn err(status: StatusCode, body: impl Into<String>) -> ApiError {
    ApiError::new(status, body)
}

fn bad_request(body: impl Into<String>) -> ApiError {
    err(StatusCode::BAD_REQUEST, body)
}

fn too_large(body: impl Into<String>) -> ApiError {
    err(StatusCode::PAYLOAD_TOO_LARGE, body)
}

fn internal(body: impl Into<String>) -> ApiError {
    err(StatusCode::INTERNAL_SERVER_ERROR, body)
}

/// Query parameters; flags count by presence, values by their first occurrence (Go's `Get`).
struct Params {
    pairs: Vec<(String, String)>,
}

impl Params {
    fn parse(raw: Option<&str>) -> Params {
        let pairs = form_urlencoded::parse(raw.unwrap_or("").as_bytes())
            .into_owned()
            .collect();
        Params { pairs }
    }

    fn has(&self, name: &str) -> bool {
        self.pairs.iter().any(|(k, _)| k == name)
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Go's `url.Values.Encode`: every parameter, sorted by key.
    fn encode_sorted(&self) -> String {
        let mut pairs = self.pairs.clone();
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        form_urlencoded::Serializer::new(String::new())
            .extend_pairs(pairs)
            .finish()
    }
}

/// The blocking and consistency options every read parses first (Consul's `s.parse`).
struct ReadOpts {
    index: u64,
    wait: Duration,
    pretty: bool,
}

fn parse_read_opts(p: &Params) -> Result<ReadOpts, Answer> {
    if p.has("stale") && p.has("consistent") {
        return Err(bad_request(
            "Cannot specify ?stale with ?consistent, conflicting semantics.",
        ));
    }
    let mut wait = DEFAULT_WAIT;
    if let Some(w) = p.get("wait").filter(|w| !w.is_empty()) {
        let d = parse_go_duration(w).map_err(|_| bad_request("Invalid wait time"))?;
        if let Some(d) = d.positive() {
            wait = d.min(MAX_WAIT);
        }
    }
    let mut index = 0;
    if let Some(i) = p.get("index").filter(|i| !i.is_empty()) {
        index = i.parse::<u64>().map_err(|_| bad_request("Invalid index"))?;
    }
    Ok(ReadOpts {
        index,
        wait,
        pretty: p.has("pretty"),
    })
}

fn json_body<T: Serialize + ?Sized>(status: StatusCode, value: &T, pretty: bool) -> Response {
    let body = if pretty {
        serde_json::to_vec_pretty(value)
    } else {
        serde_json::to_vec(value)
    };
    match body {
        Ok(mut b) => {
            if pretty {
                b.push(b'\n');
            }
            let mut r = (status, b).into_response();
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            r
        }
        Err(e) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("failed to encode response: {e}"),
        ),
    }
}

fn set_meta(headers: &mut HeaderMap, index: u64) {
    headers.insert("X-Consul-Index", HeaderValue::from(index.max(1)));
    headers.insert("X-Consul-KnownLeader", HeaderValue::from_static("true"));
    headers.insert("X-Consul-LastContact", HeaderValue::from_static("0"));
    headers.insert(
        "X-Consul-Query-Backend",
        HeaderValue::from_static("blocking-query"),
    );
}

fn with_meta(mut r: Response, index: u64) -> Response {
    set_meta(r.headers_mut(), index);
    r
}

fn not_found_with_meta(index: u64) -> Response {
    with_meta(StatusCode::NOT_FOUND.into_response(), index)
}

fn request_token(req: &Request<Body>, p: &Params) -> Option<String> {
    if let Some(t) = p.get("token").filter(|t| !t.is_empty()) {
        return Some(t.to_string());
    }
    let h = req.headers();
    if let Some(t) = h
        .get("X-Consul-Token")
        .and_then(|v| v.to_str().ok())
        .filter(|t| !t.is_empty())
    {
        return Some(t.to_string());
    }
    let auth = h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok())?;
    let mut parts = auth.splitn(2, ' ');
    let scheme = parts.next()?;
    let rest = parts.next()?.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !rest.is_empty())
        .then(|| rest.split(' ').next().unwrap_or("").to_string())
}

/// Go's `path.Clean` as its `ServeMux` applies it: one slash for many, no `.` elements, `..`
/// removing the element before it, and a trailing slash kept. (HTTP clients usually resolve
/// `.` and `..` themselves; `//` reaches the server.)
pub(super) fn clean_path(p: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for seg in p.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            s => parts.push(s),
        }
    }
    let mut out = format!("/{}", parts.join("/"));
    if p.ends_with('/') && out != "/" {
        out.push('/');
    }
    out
}

/// Characters Go escapes in a URL path.
const GO_PATH: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS
    .add(b' ')
    .add(b'"')
    .add(b'#')
    .add(b'%')
    .add(b'<')
    .add(b'>')
    .add(b'?')
    .add(b'[')
    .add(b'\\')
    .add(b']')
    .add(b'^')
    .add(b'`')
    .add(b'{')
    .add(b'|')
    .add(b'}');

/// Go's `http.Redirect` with 301: an HTML body for GET and HEAD only.
fn moved_permanently(path: &str, query: Option<&str>, method: &Method) -> Response {
    let mut location = percent_encoding::utf8_percent_encode(path, GO_PATH).to_string();
    if let Some(q) = query {
        location.push('?');
        location.push_str(q);
    }
    let mut r = if method == Method::GET || method == Method::HEAD {
        let mut r = format!("<a href=\"{location}\">Moved Permanently</a>.\n\n").into_response();
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/html; charset=utf-8"),
        );
        r
    } else {
        ().into_response()
    };
    *r.status_mut() = StatusCode::MOVED_PERMANENTLY;
    if let Ok(v) = HeaderValue::from_str(&location) {
        r.headers_mut().insert(header::LOCATION, v);
    }
    r
}

/// Entry point: routes by path and method like Consul's HTTP mux.
pub(super) async fn handle(shared: Arc<Shared>, req: Request<Body>) -> Response {
    shared
        .requests
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if req.uri().path() == "/v1/txn" {
        shared
            .txns
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    let mut resp = route(shared.clone(), req).await;
    let too_large = resp.status() == StatusCode::PAYLOAD_TOO_LARGE;
    let h = resp.headers_mut();
    if too_large {
        // The rest of the body may be unread (past what `read_body` discards), so the connection
        // cannot carry another request; say so, or a client may reuse it and see its next
        // request fail (as Go's server does).
        h.insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    if shared.config.compat == Compat::V0_7 {
        h.remove("X-Consul-Query-Backend");
    } else {
        // Consul 0.7 neither compresses (no `Vary`) nor says its ACL policy.
        h.insert(header::VARY, HeaderValue::from_static("Accept-Encoding"));
        let policy = if shared.config.acl_token.is_some() {
            "deny"
        } else {
            "allow"
        };
        h.insert(
            "X-Consul-Default-Acl-Policy",
            HeaderValue::from_static(policy),
        );
    }
    resp
}

async fn route(shared: Arc<Shared>, req: Request<Body>) -> Response {
    let raw_path = req.uri().path().to_string();
    let path = match percent_decode_str(&raw_path).decode_utf8() {
        Ok(p) if !p.chars().any(|c| c.is_control()) => p.into_owned(),
        // Go's http server refuses unprintable paths with an empty 400.
        _ => return StatusCode::BAD_REQUEST.into_response(),
    };
    // Go's ServeMux answers a path that is not clean (`a//b`, `a/./b`, `a/../b`) with a 301 to
    // the cleaned one, which clients follow: `health/web//` lists `health/web/`.
    let clean = clean_path(&path);
    if clean != path {
        return moved_permanently(&clean, req.uri().query(), req.method());
    }
    let params = Params::parse(req.uri().query());

    let (allowed, endpoint): (&[&str], Endpoint) = if let Some(key) = path.strip_prefix("/v1/kv/") {
        (&["GET", "PUT", "DELETE"], Endpoint::Kv(key.to_string()))
    } else if path == "/v1/kv" {
        let mut r = StatusCode::MOVED_PERMANENTLY.into_response();
        r.headers_mut()
            .insert(header::LOCATION, HeaderValue::from_static("/v1/kv/"));
        return r;
    } else if path == "/v1/txn" {
        (&["PUT"], Endpoint::Txn)
    } else if path == "/v1/session/create" {
        (&["PUT"], Endpoint::SessionCreate)
    } else if let Some(id) = path.strip_prefix("/v1/session/destroy/") {
        (&["PUT"], Endpoint::SessionDestroy(id.to_string()))
    } else if let Some(id) = path.strip_prefix("/v1/session/renew/") {
        (&["PUT"], Endpoint::SessionRenew(id.to_string()))
    } else if let Some(id) = path.strip_prefix("/v1/session/info/") {
        (&["GET"], Endpoint::SessionInfo(id.to_string()))
    } else if let Some(node) = path.strip_prefix("/v1/session/node/") {
        (&["GET"], Endpoint::SessionNode(node.to_string()))
    } else if path == "/v1/session/list" {
        (&["GET"], Endpoint::SessionList)
    } else if path == "/v1/status/leader" {
        (&["GET"], Endpoint::StatusLeader)
    } else if path == "/v1/status/peers" {
        (&["GET"], Endpoint::StatusPeers)
    } else if path == "/" {
        return text(
            StatusCode::OK,
            "rcfarm consul-dev: a Consul-compatible development server (KV, sessions, txn, status)",
        );
    } else if path.contains("/v1/") {
        return text(
            StatusCode::NOT_FOUND,
            "Invalid URL path: not a recognized HTTP API endpoint\n",
        );
    } else {
        return text(
            StatusCode::NOT_FOUND,
            "Invalid URL path: if attempting to use the HTTP API, ensure the path starts with '/v1/'\n",
        );
    };

    let method = req.method().clone();
    let compat = shared.config.compat;
    if compat == Compat::V0_7 && !allowed.contains(&method.as_str()) {
        // Consul 0.7: an empty 405 without `Allow`, for OPTIONS too.
        return StatusCode::METHOD_NOT_ALLOWED.into_response();
    }
    let allow = std::iter::once("OPTIONS")
        .chain(allowed.iter().copied())
        .collect::<Vec<_>>()
        .join(",");
    if method == Method::OPTIONS {
        let mut r = StatusCode::OK.into_response();
        if let Ok(v) = HeaderValue::from_str(&allow) {
            r.headers_mut().insert(header::ALLOW, v);
        }
        return r;
    }
    if !allowed.contains(&method.as_str()) {
        let mut r = text(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("method {method} not allowed"),
        );
        if let Ok(v) = HeaderValue::from_str(&allow) {
            r.headers_mut().insert(header::ALLOW, v);
        }
        return r;
    }

    let mut anonymous = false;
    if let Some(required) = &shared.config.acl_token
        && !matches!(endpoint, Endpoint::StatusLeader | Endpoint::StatusPeers)
        && !(compat == Compat::V0_7 && endpoint.is_session())
    {
        match request_token(&req, &params) {
            Some(t) if &t == required => {}
            Some(_) => return text(StatusCode::FORBIDDEN, "ACL not found"),
            // Consul 0.7's anonymous token under a deny policy: reads are filtered (the
            // endpoints below answer as if nothing matched), writes refused.
            None if compat == Compat::V0_7 => anonymous = true,
            None => {
                return text(
                    StatusCode::FORBIDDEN,
                    "Permission denied: anonymous token lacks permission",
                );
            }
        }
    }
    if anonymous && let Endpoint::Kv(_) = endpoint {
        if method == Method::GET {
            let index = shared.state.lock().store.index();
            return not_found_with_meta(index);
        }
        return text(StatusCode::FORBIDDEN, "Permission denied");
    }

    let result = match endpoint {
        Endpoint::Txn if anonymous => txn_anonymous_0_7(&shared, &params, req).await,
        Endpoint::Kv(key) => match method {
            Method::GET => kv_get(&shared, &key, &params).await,
            Method::PUT => kv_put(&shared, &key, &params, req).await,
            _ => kv_delete(&shared, &key, &params).await,
        },
        Endpoint::Txn => txn(&shared, &params, req).await,
        Endpoint::SessionCreate => session_create(&shared, req).await,
        Endpoint::SessionDestroy(id) => session_destroy(&shared, &id).await,
        Endpoint::SessionRenew(id) => session_renew(&shared, &id, &params),
        Endpoint::SessionInfo(id) => session_read(&shared, &params, SessionQuery::Info(id)).await,
        Endpoint::SessionNode(node) => {
            session_read(&shared, &params, SessionQuery::Node(node)).await
        }
        Endpoint::SessionList => session_read(&shared, &params, SessionQuery::List).await,
        Endpoint::StatusLeader => status(&shared, &params, true),
        Endpoint::StatusPeers => status(&shared, &params, false),
    };
    result.unwrap_or_else(IntoResponse::into_response)
}

impl Endpoint {
    /// Consul 0.7 has no ACLs on sessions.
    fn is_session(&self) -> bool {
        matches!(
            self,
            Endpoint::SessionCreate
                | Endpoint::SessionDestroy(_)
                | Endpoint::SessionRenew(_)
                | Endpoint::SessionInfo(_)
                | Endpoint::SessionNode(_)
                | Endpoint::SessionList
        )
    }
}

enum Endpoint {
    Kv(String),
    Txn,
    SessionCreate,
    SessionDestroy(String),
    SessionRenew(String),
    SessionInfo(String),
    SessionNode(String),
    SessionList,
    StatusLeader,
    StatusPeers,
}

/// Runs `eval` until its index passes the requested one, the wait runs out, or the server
/// stops; then waits until what it read is durable.
async fn blocking<T>(
    shared: &Shared,
    opts: &ReadOpts,
    target: WatchTarget,
    eval: impl Fn(&super::store::Store) -> (T, u64),
) -> Result<(T, u64), Answer> {
    let deadline = (opts.index > 0).then(|| {
        let jitter = crate::util::jitter_up_to(opts.wait / 16);
        Instant::now() + opts.wait + jitter
    });
    loop {
        if let Some(stale) = shared.stale.answer(&eval) {
            // A Consul 0.7 leader replaying its log answers at once from what it has replayed.
            return Ok(stale);
        }
        let timed_out = deadline.is_some_and(|d| Instant::now() >= d);
        let (value, index, applied, waiter) = {
            let mut st = shared.state.lock();
            let (value, index) = eval(&st.store);
            let applied = st.store.index();
            let waiter = if deadline.is_some()
                && index <= opts.index
                && !timed_out
                && !shared.shutdown.is_cancelled()
            {
                Some(st.waiters.register(&target))
            } else {
                None
            };
            (value, index, applied, waiter)
        };
        let Some((id, rx)) = waiter else {
            shared.wait_durable(applied).await?;
            return Ok((value, index));
        };
        drop(value);
        // Deregisters the waiter if this request ends (timeout, shutdown, or the client hanging
        // up) before a change fires it, so abandoned queries leave nothing behind.
        let mut guard = WaiterGuard {
            shared,
            target: &target,
            id,
            fired: false,
        };
        let deadline = deadline.unwrap_or_else(Instant::now);
        guard.fired = tokio::select! {
            r = rx => r.is_ok(),
            _ = tokio::time::sleep_until(deadline) => false,
            _ = shared.shutdown.cancelled() => false,
        };
    }
}

struct WaiterGuard<'a> {
    shared: &'a Shared,
    target: &'a WatchTarget,
    id: u64,
    fired: bool,
}

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        if !self.fired {
            self.shared
                .state
                .lock()
                .waiters
                .deregister(self.target, self.id);
        }
    }
}

// ---- KV ---------------------------------------------------------------------------------------

async fn kv_get(shared: &Shared, key: &str, p: &Params) -> Result<Response, Answer> {
    let opts = parse_read_opts(p)?;
    if p.has("keys") {
        let sep = p
            .get("separator")
            .or_else(|| p.get("seperator"))
            .unwrap_or("")
            .to_string();
        let prefix = key.to_string();
        let (keys, index) = blocking(shared, &opts, WatchTarget::Prefix(prefix.clone()), |s| {
            s.read_keys(&prefix, &sep)
        })
        .await?;
        if keys.is_empty() && !prefix.is_empty() {
            return Ok(not_found_with_meta(index));
        }
        return Ok(with_meta(
            json_body(StatusCode::OK, &keys, opts.pretty),
            index,
        ));
    }
    if p.has("recurse") {
        let prefix = key.to_string();
        let (entries, index) = blocking(shared, &opts, WatchTarget::Prefix(prefix.clone()), |s| {
            s.read_prefix(&prefix)
        })
        .await?;
        if entries.is_empty() {
            return Ok(not_found_with_meta(index));
        }
        return Ok(with_meta(
            json_body(StatusCode::OK, &entries, opts.pretty),
            index,
        ));
    }
    if key.is_empty() {
        return Err(bad_request("Missing key name"));
    }
    let k = key.to_string();
    let (entry, index) = blocking(shared, &opts, WatchTarget::Key(k.clone()), |s| {
        s.read_key(&k)
    })
    .await?;
    let Some(entry) = entry else {
        return Ok(not_found_with_meta(index));
    };
    if p.has("raw") {
        let mut r = (StatusCode::OK, entry.value.unwrap_or_default()).into_response();
        let h = r.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        h.insert(
            "X-Content-Type-Options",
            HeaderValue::from_static("nosniff"),
        );
        h.insert(
            "Content-Security-Policy",
            HeaderValue::from_static("sandbox"),
        );
        return Ok(with_meta(r, index));
    }
    Ok(with_meta(
        json_body(StatusCode::OK, &[entry], opts.pretty),
        index,
    ))
}

/// Consul's `conflictingFlags`.
fn conflicting(p: &Params, flags: &[&str]) -> Result<(), Answer> {
    if flags.iter().filter(|f| p.has(f)).count() > 1 {
        return Err(bad_request(format!(
            "Conflicting flags: {}",
            p.encode_sorted()
        )));
    }
    Ok(())
}

/// Go's `strconv.ParseUint(v, 10, 64)` and its error text.
fn parse_uint(v: &str) -> Result<u64, Answer> {
    v.parse::<u64>().map_err(|e| {
        let why = if matches!(e.kind(), std::num::IntErrorKind::PosOverflow) {
            "value out of range"
        } else {
            "invalid syntax"
        };
        internal(format!("strconv.ParseUint: parsing {v:?}: {why}"))
    })
}

async fn read_body(
    req: Request<Body>,
    limit: usize,
    too_large: impl Fn(Option<u64>) -> String,
) -> Result<Bytes, Answer> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let mut body = req.into_body().into_data_stream();
    if let Some(len) = declared
        && len > limit as u64
    {
        if len <= DISCARD_MAX as u64 {
            discard(&mut body, 0).await;
        }
        return Err(err(StatusCode::PAYLOAD_TOO_LARGE, too_large(Some(len))));
    }
    let mut buf = bytes::BytesMut::new();
    while let Some(chunk) = body.next().await {
        // A body that breaks off: the client is gone, and the answer only has to be an error.
        let chunk = chunk.map_err(|_| err(StatusCode::PAYLOAD_TOO_LARGE, too_large(None)))?;
        if buf.len() + chunk.len() > limit {
            discard(&mut body, buf.len() + chunk.len()).await;
            return Err(err(StatusCode::PAYLOAD_TOO_LARGE, too_large(None)));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

/// How much of a refused body the server reads before answering.
const DISCARD_MAX: usize = 8 << 20;

/// Reads and drops the rest of a refused body, up to [`DISCARD_MAX`] in all, before the 413 is
/// sent: a client still writing a large body would otherwise see a broken pipe instead of the
/// answer (Go's server, in front of real Consul, likewise reads some of an unread body).
async fn discard(body: &mut axum::body::BodyDataStream, mut read: usize) {
    while read <= DISCARD_MAX {
        match body.next().await {
            Some(Ok(chunk)) => read += chunk.len(),
            _ => return,
        }
    }
}

async fn kv_put(
    shared: &Shared,
    key: &str,
    p: &Params,
    req: Request<Body>,
) -> Result<Response, Answer> {
    parse_read_opts(p)?;
    if key.is_empty() {
        return Err(bad_request("Missing key name"));
    }
    conflicting(p, &["cas", "acquire", "release"])?;
    let flags = match p.get("flags") {
        Some(v) if p.has("flags") => parse_uint(v)?,
        _ => 0,
    };
    let cas = match p.get("cas") {
        Some(v) => Some(parse_uint(v)?),
        None => None,
    };
    let value = match shared.config.compat {
        Compat::V0_7 => {
            read_body(req, MAX_KV_SIZE_0_7, |_| {
                format!("Value exceeds {MAX_KV_SIZE_0_7} byte limit")
            })
            .await?
        }
        Compat::V1 => {
            let max = shared.config.kv_max_value_size;
            read_body(req, max, |len| match len {
                Some(len) => format!(
                    "Request body({len} bytes) too large, max size: {max} bytes. See {KV_SIZE_DOC}."
                ),
                None => format!("Request body too large. Max allowed is {max} bytes."),
            })
            .await?
        }
    };
    let key = key.to_string();
    let op = if let Some(index) = cas {
        KvOp::Cas {
            key,
            value,
            flags,
            index,
        }
    } else if let Some(session) = p.get("acquire") {
        KvOp::Lock {
            key,
            value,
            flags,
            session: session.to_string(),
        }
    } else if let Some(session) = p.get("release") {
        KvOp::Unlock {
            key,
            value,
            flags,
            session: session.to_string(),
        }
    } else {
        KvOp::Set { key, value, flags }
    };
    kv_apply(shared, &op).await
}

async fn kv_delete(shared: &Shared, key: &str, p: &Params) -> Result<Response, Answer> {
    parse_read_opts(p)?;
    conflicting(p, &["recurse", "cas"])?;
    let op = if p.has("recurse") {
        KvOp::DeleteTree {
            prefix: key.to_string(),
        }
    } else {
        if key.is_empty() {
            return Err(bad_request("Missing key name"));
        }
        match p.get("cas") {
            Some(v) => KvOp::DeleteCas {
                key: key.to_string(),
                index: parse_uint(v)?,
            },
            None => KvOp::Delete {
                key: key.to_string(),
            },
        }
    };
    kv_apply(shared, &op).await
}

async fn kv_apply(shared: &Shared, op: &KvOp) -> Result<Response, Answer> {
    shared.check_writable()?;
    let (outcome, index) = {
        let mut st = shared.state.lock();
        let now = Instant::now();
        match st.store.kv_write(op, now) {
            Ok((outcome, commit)) => {
                let index = st.store.index();
                shared.publish(&mut st, &commit);
                (outcome, index)
            }
            Err(e) => return Err(internal(format!("raft apply failed: {}", e.0))),
        }
    };
    shared.wait_durable(index).await?;
    Ok(json_body(
        StatusCode::OK,
        &(outcome == KvWriteOutcome::Applied),
        false,
    ))
}

// ---- Transactions -----------------------------------------------------------------------------

/// What a transaction may hold.
struct TxnRules {
    compat: Compat,
    max_ops: usize,
    /// Largest decoded value of one op.
    max_value: usize,
    /// Largest sum of the decoded values (Consul 0.7 only; 1.x limits the body instead).
    max_total: Option<usize>,
}

impl TxnRules {
    fn of(shared: &Shared) -> TxnRules {
        let c = &shared.config;
        match c.compat {
            Compat::V0_7 => TxnRules {
                compat: c.compat,
                max_ops: c.max_txn_ops,
                max_value: MAX_KV_SIZE_0_7,
                max_total: Some(MAX_KV_SIZE_0_7),
            },
            Compat::V1 => TxnRules {
                compat: c.compat,
                max_ops: c.max_txn_ops,
                max_value: c.kv_max_value_size,
                max_total: None,
            },
        }
    }
}

async fn read_txn_body(shared: &Shared, req: Request<Body>) -> Result<Bytes, Answer> {
    match shared.config.compat {
        Compat::V0_7 => {
            read_body(req, MAX_TXN_BODY_0_7, |_| {
                format!("Request body too large, max size: {MAX_TXN_BODY_0_7} bytes")
            })
            .await
        }
        // Consul 1.x: `txn_max_req_len`, or `kv_max_value_size` if that is larger.
        Compat::V1 => {
            let max = shared
                .config
                .kv_max_value_size
                .max(shared.config.txn_max_req_len);
            read_body(req, max, |len| match len {
                Some(len) => format!(
                    "Request body({len} bytes) too large, max size: {max} bytes. See {TXN_SIZE_DOC}."
                ),
                None => {
                    format!("Request body too large, max size: {max} bytes. See {TXN_SIZE_DOC}.")
                }
            })
            .await
        }
    }
}

/// A transaction from Consul 0.7's anonymous token under a deny policy: every op but `get` and
/// `get-tree` is refused (409, `Permission denied` at its index); the reads' results are
/// filtered out.
async fn txn_anonymous_0_7(
    shared: &Shared,
    p: &Params,
    req: Request<Body>,
) -> Result<Response, Answer> {
    let body = read_txn_body(shared, req).await?;
    let ops = decode_txn(&body, &TxnRules::of(shared))?;
    let denied: Vec<(usize, String)> = ops
        .iter()
        .enumerate()
        .filter(|(_, op)| !matches!(op, KvOp::Get { .. } | KvOp::GetTree { .. }))
        .map(|(i, _)| (i, "Permission denied".to_string()))
        .collect();
    let result = if denied.is_empty() {
        Ok(Vec::new())
    } else {
        Err(denied)
    };
    if ops.iter().any(KvOp::is_write) {
        let (status, body) = txn_body(result);
        Ok(json_body(status, &body, p.has("pretty")))
    } else {
        read_txn_answer(shared, p, result)
    }
}

/// A read-only transaction's answer: Consul's TxnReadResponse, which embeds its QueryMeta in
/// the body, and no index header.
fn read_txn_answer(
    shared: &Shared,
    p: &Params,
    result: Result<Vec<KvPair>, super::store::TxnErrors>,
) -> Result<Response, Answer> {
    let opts = parse_read_opts(p)?;
    let (status, mut body) = txn_body(result);
    if let Value::Object(m) = &mut body {
        let v0_7 = shared.config.compat == Compat::V0_7;
        m.insert("Index".into(), json!(if v0_7 { 0 } else { 1 }));
        m.insert("LastContact".into(), json!(0));
        m.insert("KnownLeader".into(), json!(true));
        if !v0_7 {
            m.insert("ConsistencyLevel".into(), json!(""));
            m.insert("NotModified".into(), json!(false));
            m.insert("Backend".into(), json!(0));
            m.insert("ResultsFilteredByACLs".into(), json!(false));
        }
    }
    let mut r = json_body(status, &body, opts.pretty);
    r.headers_mut()
        .insert("X-Consul-KnownLeader", HeaderValue::from_static("true"));
    r.headers_mut()
        .insert("X-Consul-LastContact", HeaderValue::from_static("0"));
    Ok(r)
}

async fn txn(shared: &Shared, p: &Params, req: Request<Body>) -> Result<Response, Answer> {
    let body = read_txn_body(shared, req).await?;
    let ops = decode_txn(&body, &TxnRules::of(shared))?;
    let writes = ops.iter().any(KvOp::is_write);
    let pretty = p.has("pretty");
    if !writes {
        // Read-only: not blocking, parsed like a read.
        parse_read_opts(p)?;
        let (result, applied) = {
            let mut st = shared.state.lock();
            let r = st.store.txn(&ops, Instant::now());
            (r, st.store.index())
        };
        shared.wait_durable(applied).await?;
        return read_txn_answer(shared, p, result.map(|(res, _)| res));
    }
    shared.check_writable()?;
    let (result, index) = {
        let mut st = shared.state.lock();
        match st.store.txn(&ops, Instant::now()) {
            Ok((results, commit)) => {
                let index = st.store.index();
                shared.publish(&mut st, &commit);
                (Ok(results), index)
            }
            Err(errs) => (Err(errs), 0),
        }
    };
    if result.is_ok() {
        shared.wait_durable(index).await?;
    }
    let (status, body) = txn_body(result);
    Ok(json_body(status, &body, pretty))
}

fn txn_body(result: Result<Vec<KvPair>, super::store::TxnErrors>) -> (StatusCode, Value) {
    match result {
        Ok(results) => {
            let results: Vec<Value> = results.into_iter().map(|kv| json!({ "KV": kv })).collect();
            (
                StatusCode::OK,
                json!({ "Results": results, "Errors": null }),
            )
        }
        Err(errs) => {
            let errors: Vec<Value> = errs
                .into_iter()
                .map(|(i, w)| json!({ "OpIndex": i, "What": w }))
                .collect();
            (
                StatusCode::CONFLICT,
                json!({ "Results": null, "Errors": errors }),
            )
        }
    }
}

fn parse_err(msg: impl std::fmt::Display) -> Answer {
    bad_request(format!("Failed to parse body: {msg}"))
}

/// Finds a field by case-insensitive name, as Go's encoding/json matches them.
fn field<'a>(m: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    m.iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v)
}

fn type_err(got: &Value, field: &str, want: &str) -> Answer {
    let kind = match got {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    };
    parse_err(format!(
        "json: cannot unmarshal {kind} into Go struct field KVTxnOp.KV.{field} of type {want}"
    ))
}

/// Decodes a `/v1/txn` body like Consul's `lib.DecodeJSON` into `api.TxnOps`: field names match
/// case-insensitively, unknown fields are refused (ignored by 0.7), `Value` is standard base64.
/// Then Consul's checks, in its order: the number of ops, each value's size, and under 0.7 the
/// sum of the values.
fn decode_txn(body: &[u8], rules: &TxnRules) -> Result<Vec<KvOp>, Answer> {
    let lax = rules.compat == Compat::V0_7;
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(parse_err("EOF"));
    }
    let v: Value = serde_json::from_slice(body).map_err(parse_err)?;
    let items = match v {
        Value::Null => return Ok(Vec::new()),
        Value::Array(a) => a,
        other => {
            let kind = if other.is_object() { "object" } else { "value" };
            return Err(parse_err(format!(
                "json: cannot unmarshal {kind} into Go value of type api.TxnOps"
            )));
        }
    };
    if items.len() > rules.max_ops {
        return Err(too_large(format!(
            "Transaction contains too many operations ({} > {})",
            items.len(),
            rules.max_ops
        )));
    }
    let mut ops = Vec::with_capacity(items.len());
    let mut total = 0usize;
    for item in items {
        let obj = match item {
            Value::Object(o) => o,
            Value::Null => return Err(bad_request("Failed to parse body: unknown operation type")),
            _ => {
                return Err(parse_err(
                    "json: cannot unmarshal value into Go value of type api.TxnOp",
                ));
            }
        };
        let mut kv = None;
        for (k, val) in &obj {
            match k.to_ascii_lowercase().as_str() {
                "kv" => kv = Some(val),
                // Consul 0.7 knows only KV ops and ignores other fields.
                _ if lax => {}
                "node" | "service" | "check" => {
                    return Err(parse_err(format!(
                        "json: unknown field {k:?} (this development server implements KV operations only)"
                    )));
                }
                _ => return Err(parse_err(format!("json: unknown field {k:?}"))),
            }
        }
        let Some(Value::Object(kv)) = kv else {
            if lax {
                // Consul 0.7 skips an op without a KV part.
                continue;
            }
            return Err(bad_request("Failed to parse body: unknown operation type"));
        };
        for k in kv.keys() {
            let known = [
                "verb",
                "key",
                "value",
                "flags",
                "index",
                "session",
                "namespace",
                "partition",
            ];
            if !lax && !known.contains(&k.to_ascii_lowercase().as_str()) {
                return Err(parse_err(format!("json: unknown field {k:?}")));
            }
        }
        let string = |name: &str| -> Result<String, Answer> {
            match field(kv, name) {
                None | Some(Value::Null) => Ok(String::new()),
                Some(Value::String(s)) => Ok(s.clone()),
                Some(other) => Err(type_err(other, name, "string")),
            }
        };
        let uint = |name: &str| -> Result<u64, Answer> {
            match field(kv, name) {
                None | Some(Value::Null) => Ok(0),
                Some(Value::Number(n)) => n
                    .as_u64()
                    .ok_or_else(|| type_err(&Value::Number(n.clone()), name, "uint64")),
                Some(other) => Err(type_err(other, name, "uint64")),
            }
        };
        let verb = string("Verb")?;
        let key = string("Key")?;
        let flags = uint("Flags")?;
        let index = uint("Index")?;
        let session = string("Session")?;
        let value: Bytes = match field(kv, "Value") {
            None | Some(Value::Null) => Bytes::new(),
            Some(Value::String(s)) => B64.decode(s.as_bytes()).map(Bytes::from).map_err(|e| {
                let at = match e {
                    base64::DecodeError::InvalidByte(i, _)
                    | base64::DecodeError::InvalidLastSymbol(i, _) => i,
                    _ => s.len().saturating_sub(1),
                };
                parse_err(format!("illegal base64 data at input byte {at}"))
            })?,
            Some(other) => return Err(type_err(other, "Value", "[]uint8")),
        };
        if value.len() > rules.max_value {
            return Err(too_large(format!(
                "Value for key {key:?} is too large ({} > {} bytes)",
                value.len(),
                rules.max_value
            )));
        }
        total += value.len();
        if !rules.compat.knows_verb(&verb) {
            ops.push(KvOp::Unknown { verb });
            continue;
        }
        ops.push(match verb.as_str() {
            "set" => KvOp::Set { key, value, flags },
            "cas" => KvOp::Cas {
                key,
                value,
                flags,
                index,
            },
            "lock" => KvOp::Lock {
                key,
                value,
                flags,
                session,
            },
            "unlock" => KvOp::Unlock {
                key,
                value,
                flags,
                session,
            },
            "get" => KvOp::Get { key },
            "get-or-empty" => KvOp::GetOrEmpty { key },
            "get-tree" => KvOp::GetTree { prefix: key },
            "check-index" => KvOp::CheckIndex { key, index },
            "check-session" => KvOp::CheckSession { key, session },
            "check-not-exists" => KvOp::CheckNotExists { key },
            "delete" => KvOp::Delete { key },
            "delete-tree" => KvOp::DeleteTree { prefix: key },
            "delete-cas" => KvOp::DeleteCas { key, index },
            _ => KvOp::Unknown { verb },
        });
    }
    if let Some(max) = rules.max_total
        && total > max
    {
        return Err(too_large(format!(
            "Cumulative size of key data is too large ({total} > {max} bytes)"
        )));
    }
    Ok(ops)
}

// ---- Sessions ---------------------------------------------------------------------------------

async fn session_create(shared: &Shared, req: Request<Body>) -> Result<Response, Answer> {
    let has_length = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|l| l > 0);
    // Consul decodes the body only when it has a Content-Length.
    let body = read_body(req, 1 << 20, |_| "Request body too large".to_string()).await?;
    let mut name = String::new();
    let mut node = shared.config.node_name.clone();
    let mut lock_delay = Duration::from_secs(15);
    let mut behavior = String::new();
    let mut ttl_text = String::new();
    let mut node_checks: Option<Vec<String>> = None;
    let mut legacy_checks: Option<Vec<String>> = None;
    let mut service_checks: Option<Vec<(String, String)>> = None;
    let decode_err = |m: String| bad_request(format!("Request decode failed: {m}"));
    let lax = shared.config.compat == Compat::V0_7;
    // Consul 1.x prefixes the state store's refusals; 0.7 does not.
    let apply_failed = if lax { "" } else { "apply failed: " };
    if has_length && !body.iter().all(u8::is_ascii_whitespace) {
        let v: Value = serde_json::from_slice(&body).map_err(|e| decode_err(e.to_string()))?;
        let obj = match v {
            Value::Object(o) => o,
            Value::Null => Map::new(),
            _ => {
                return Err(decode_err(
                    "json: cannot unmarshal value into Go value of type structs.Session".into(),
                ));
            }
        };
        let str_field = |k: &str| -> Result<Option<String>, Answer> {
            match field(&obj, k) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(decode_err(format!(
                    "json: cannot unmarshal value into Go struct field Session.{k} of type string"
                ))),
            }
        };
        let list_field = |k: &str| -> Result<Option<Vec<String>>, Answer> {
            match field(&obj, k) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|x| x.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
                    .map(Some)
                    .ok_or_else(|| decode_err(format!("json: cannot unmarshal value into Go struct field Session.{k} of type string"))),
                Some(_) => Err(decode_err(format!("json: cannot unmarshal value into Go struct field Session.{k} of type []string"))),
            }
        };
        if let Some(n) = str_field("Name")? {
            name = n;
        }
        if let Some(n) = str_field("Node")?
            && !n.is_empty()
        {
            node = n;
        }
        if let Some(b) = str_field("Behavior")? {
            behavior = b;
        }
        if let Some(t) = str_field("TTL")? {
            ttl_text = t;
        }
        // Consul 0.7 knows only `Checks` (and ignores fields it does not know).
        if !lax {
            node_checks = list_field("NodeChecks")?;
        }
        legacy_checks = list_field("Checks")?;
        if let Some(Value::Array(a)) = field(&obj, "ServiceChecks").filter(|_| !lax) {
            let mut v = Vec::new();
            for sc in a {
                let id = sc
                    .as_object()
                    .and_then(|o| field(o, "ID"))
                    .and_then(Value::as_str)
                    .unwrap_or("");
                let ns = sc
                    .as_object()
                    .and_then(|o| field(o, "Namespace"))
                    .and_then(Value::as_str)
                    .unwrap_or("");
                v.push((id.to_string(), ns.to_string()));
            }
            service_checks = Some(v);
        }
        match field(&obj, "LockDelay") {
            Some(Value::String(s)) => {
                let d = parse_go_duration(s).map_err(decode_err)?;
                lock_delay = fix_lock_delay(if d.negative { 0 } else { d.nanos });
            }
            Some(Value::Number(n)) => {
                let ns = n.as_f64().unwrap_or(0.0);
                lock_delay = fix_lock_delay(if ns <= 0.0 { 0 } else { ns as u64 });
            }
            Some(Value::Null) | None => {}
            Some(_) => lock_delay = Duration::ZERO,
        }
    }
    let behavior = match behavior.as_str() {
        "" | "release" => Behavior::Release,
        "delete" => Behavior::Delete,
        other => return Err(internal(format!("Invalid Behavior setting '{other}'"))),
    };
    let mut ttl = None;
    if !ttl_text.is_empty() {
        let d = parse_go_duration(&ttl_text)
            .map_err(|e| internal(format!("Session TTL '{ttl_text}' invalid: {e}")))?;
        let nanos = if d.negative {
            -(d.nanos as i128)
        } else {
            d.nanos as i128
        };
        if nanos != 0 {
            let min = shared.config.session_ttl_min;
            if nanos < min.as_nanos() as i128 || nanos > SESSION_TTL_MAX.as_nanos() as i128 {
                return Err(internal(format!(
                    "Invalid Session TTL '{nanos}', must be between [{}={}]",
                    crate::util::format_go_duration(min),
                    crate::util::format_go_duration(SESSION_TTL_MAX)
                )));
            }
            ttl = Some(Duration::from_nanos(d.nanos));
        }
    }
    if node != shared.config.node_name {
        return Err(internal(format!("{apply_failed}Missing node registration")));
    }
    let checks = node_checks
        .or(legacy_checks)
        .unwrap_or_else(|| vec!["serfHealth".to_string()]);
    for c in &checks {
        if c != "serfHealth" {
            return Err(internal(format!(
                "{apply_failed}Missing check '{c}' registration"
            )));
        }
    }
    if let Some((id, _)) = service_checks.as_ref().and_then(|v| v.first()) {
        return Err(internal(format!(
            "{apply_failed}Missing check '{id}' registration"
        )));
    }
    shared.check_writable()?;
    let id = uuid::Uuid::new_v4().to_string();
    let rec = SessionRecord {
        id: id.clone(),
        name,
        node,
        lock_delay,
        behavior,
        ttl_text,
        ttl,
        node_checks: checks,
        service_checks,
        create_index: 0,
        modify_index: 0,
    };
    let index = {
        let mut st = shared.state.lock();
        let commit = st.store.create_session(rec, Instant::now());
        let index = st.store.index();
        shared.publish(&mut st, &commit);
        index
    };
    shared.wait_durable(index).await?;
    Ok(json_body(StatusCode::OK, &json!({ "ID": id }), false))
}

/// Consul's `LockDelay` fix-up: values under 1000 are seconds, larger ones nanoseconds.
fn fix_lock_delay(nanos: u64) -> Duration {
    if nanos < 1000 {
        Duration::from_secs(nanos)
    } else {
        Duration::from_nanos(nanos)
    }
}

async fn session_destroy(shared: &Shared, id: &str) -> Result<Response, Answer> {
    if id.is_empty() {
        return Err(bad_request("Missing session"));
    }
    shared.check_writable()?;
    let index = {
        let mut st = shared.state.lock();
        let commit = st.store.destroy_session(id, Instant::now());
        let index = st.store.index();
        shared.publish(&mut st, &commit);
        index
    };
    shared.wait_durable(index).await?;
    Ok(json_body(StatusCode::OK, &true, false))
}

fn session_renew(shared: &Shared, id: &str, p: &Params) -> Result<Response, Answer> {
    let opts = parse_read_opts(p)?;
    if id.is_empty() {
        return Err(bad_request("Missing session"));
    }
    let renewed = shared.state.lock().store.renew_session(id, Instant::now());
    match renewed {
        Some(s) => Ok(sessions_body(&[s], shared.config.compat, opts.pretty)),
        None => Err(err(
            StatusCode::NOT_FOUND,
            format!("Session id '{id}' not found"),
        )),
    }
}

enum SessionQuery {
    Info(String),
    Node(String),
    List,
}

async fn session_read(shared: &Shared, p: &Params, q: SessionQuery) -> Result<Response, Answer> {
    let opts = parse_read_opts(p)?;
    match &q {
        SessionQuery::Info(id) if id.is_empty() => return Err(bad_request("Missing session")),
        SessionQuery::Node(n) if n.is_empty() => return Err(bad_request("Missing node name")),
        _ => {}
    }
    let (list, index) = blocking(shared, &opts, WatchTarget::Sessions, |s| {
        let list = match &q {
            SessionQuery::Info(id) => s
                .session(id)
                .map(|r| vec![r.to_entry()])
                .unwrap_or_default(),
            SessionQuery::Node(n) => s.list_sessions(Some(n)),
            SessionQuery::List => s.list_sessions(None),
        };
        (list, s.sessions_index())
    })
    .await?;
    Ok(with_meta(
        sessions_body(&list, shared.config.compat, opts.pretty),
        index,
    ))
}

/// Consul 0.7's session JSON: `Checks` where 1.x has `NodeChecks` and `ServiceChecks`.
#[derive(Serialize)]
#[serde(rename_all = "PascalCase")]
struct Session07<'a> {
    #[serde(rename = "ID")]
    id: &'a str,
    name: &'a str,
    node: &'a str,
    checks: &'a [String],
    lock_delay: u64,
    behavior: &'a str,
    #[serde(rename = "TTL")]
    ttl: &'a str,
    create_index: u64,
    modify_index: u64,
}

fn sessions_body(list: &[SessionEntry], compat: Compat, pretty: bool) -> Response {
    match compat {
        Compat::V1 => json_body(StatusCode::OK, list, pretty),
        Compat::V0_7 => {
            let list: Vec<Session07> = list
                .iter()
                .map(|s| Session07 {
                    id: &s.id,
                    name: &s.name,
                    node: &s.node,
                    checks: s.node_checks.as_deref().unwrap_or_default(),
                    lock_delay: s.lock_delay,
                    behavior: &s.behavior,
                    ttl: &s.ttl,
                    create_index: s.create_index,
                    modify_index: s.modify_index,
                })
                .collect();
            json_body(StatusCode::OK, &list, pretty)
        }
    }
}

// ---- Status -----------------------------------------------------------------------------------

fn status(shared: &Shared, p: &Params, leader: bool) -> Result<Response, Answer> {
    let opts = parse_read_opts(p)?;
    if leader {
        Ok(json_body(StatusCode::OK, &shared.leader, opts.pretty))
    } else {
        Ok(json_body(StatusCode::OK, &[&shared.leader], opts.pretty))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(max_value: usize) -> TxnRules {
        TxnRules {
            compat: Compat::V1,
            max_ops: 64,
            max_value,
            max_total: None,
        }
    }

    #[test]
    fn txn_bodies_decode_case_insensitively_and_strictly() {
        let ops = decode_txn(
            br#"[{"kv":{"verb":"set","key":"a","value":"eA=="}}]"#,
            &rules(100),
        )
        .unwrap();
        assert!(
            matches!(&ops[0], KvOp::Set { key, value, .. } if key == "a" && &value[..] == b"x")
        );
        let bad = |b: &[u8]| {
            let r = decode_txn(b, &rules(100)).unwrap_err();
            assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        };
        bad(b"");
        bad(b"{");
        bad(br#"{"KV":{}}"#);
        bad(br#"[{"KV":{"Verb":"set","Key":"a","Value":"!!"}}]"#);
        bad(br#"[{"KV":{"Verb":"set","Key":"a","Bogus":1}}]"#);
        bad(br#"[{"KV":{"Verb":"set","Key":"a","Flags":"x"}}]"#);
        bad(br#"[{"KV":{"Verb":"set","Key":"a","Flags":-1}}]"#);
        assert!(decode_txn(b"null", &rules(100)).unwrap().is_empty());
        let big = format!(
            r#"[{{"KV":{{"Verb":"set","Key":"a","Value":"{}"}}}}]"#,
            B64.encode([0u8; 200])
        );
        assert_eq!(
            decode_txn(big.as_bytes(), &rules(100))
                .unwrap_err()
                .status(),
            StatusCode::PAYLOAD_TOO_LARGE
        );
        assert!(matches!(
            &decode_txn(br#"[{"KV":{"Verb":"zap","Key":"a"}}]"#, &rules(10)).unwrap()[0],
            KvOp::Unknown { .. }
        ));
    }

    #[test]
    fn lock_delay_numbers_follow_consul() {
        assert_eq!(fix_lock_delay(10), Duration::from_secs(10));
        assert_eq!(fix_lock_delay(1000), Duration::from_nanos(1000));
        assert_eq!(fix_lock_delay(0), Duration::ZERO);
    }
}

#[cfg(test)]
mod path_tests {
    use super::clean_path;

    #[test]
    fn cleans_as_go_does() {
        for (p, want) in [
            ("/v1/kv/a", "/v1/kv/a"),
            ("/v1/kv/a/", "/v1/kv/a/"),
            ("/v1/kv/a//b", "/v1/kv/a/b"),
            ("/v1/kv/health/web//", "/v1/kv/health/web/"),
            ("/v1/kv/a/./b", "/v1/kv/a/b"),
            ("/v1/kv/a/../b", "/v1/kv/b"),
            ("/../x", "/x"),
            ("/", "/"),
            ("//", "/"),
        ] {
            assert_eq!(clean_path(p), want, "{p}");
        }
    }
}

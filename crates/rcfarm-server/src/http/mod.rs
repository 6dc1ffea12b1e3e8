//! HTTP layer of the embedded server, answering as Consul's `agent/*_endpoint.go` do: the same
//! statuses, plain-text error bodies, `X-Consul-*` headers and JSON shapes.
//!
//! This module holds what every endpoint family shares: the router (path, method and ACL checks
//! in Consul's order), error and JSON answers, query parameters, request bodies and the blocking
//! query loop. Each family's handlers live in their own file, so one family's Consul quirks can
//! be read and changed without the others'.

mod kv;
mod session;
mod status;
mod txn;

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, Method, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt as _;
use percent_encoding::percent_decode_str;
use serde::Serialize;
use serde_json::{Map, Value};
use tokio::time::Instant;

use super::Shared;
use super::compat::Compat;
use super::waiters::WatchTarget;
use crate::util::{cpu_heavy, parse_go_duration};
use kv::{kv_delete, kv_get, kv_put};
use session::{SessionQuery, session_create, session_destroy, session_read, session_renew};
use status::status;
use txn::{txn, txn_anonymous_0_7};

const DEFAULT_WAIT: Duration = Duration::from_secs(300);
const MAX_WAIT: Duration = Duration::from_secs(600);
/// Consul 0.7's fixed limit on a KV value, and on the sum of a transaction's values.
const MAX_KV_SIZE_0_7: usize = 512 * 1024;

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
    json_body_sized(status, value, pretty, 0)
}

/// [`json_body`] into a buffer of `size_hint` bytes to start with: a body grown by doubling
/// holds up to twice its size while it is written, and the old buffer beside the new one at
/// each step (at a million pod labels, 125 MiB an answer).
fn json_body_sized<T: Serialize + ?Sized>(
    status: StatusCode,
    value: &T,
    pretty: bool,
    size_hint: usize,
) -> Response {
    let mut buf = Vec::with_capacity(size_hint);
    let written = if pretty {
        serde_json::to_writer_pretty(&mut buf, value)
    } else {
        serde_json::to_writer(&mut buf, value)
    };
    match written.map(|()| buf) {
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

/// A listing's answer (`?recurse`, `?keys`). A short one (or `?pretty`) is one body, encoded
/// off this worker's queue when it is long ([`cpu_heavy`]: a million pod labels took a worker
/// for a second and more, and the session renewals queued behind it waited that long).
///
/// A long one is streamed ([`streamed_listing`]): encoded a piece at a time as the connection
/// takes it, its exact `Content-Length` sent first (the client sizes its buffer once). Whole,
/// a million pod labels were a 125-MiB body held until the last byte was sent, and at a
/// million pods the bodies of the farms' answers in flight were the server's peak (790 of
/// 2,062 MB live in a heap profile).
fn json_listing<T: Serialize + Encoded + Send + 'static>(
    entries: Vec<T>,
    pretty: bool,
) -> Response {
    /// About a mebibyte of KV pairs and more.
    const HEAVY_ENTRIES: usize = 4_096;
    if entries.len() >= HEAVY_ENTRIES && !pretty {
        return streamed_listing(entries);
    }
    cpu_heavy(entries.len() >= HEAVY_ENTRIES, || {
        // The compact encoding's size (pretty output grows the buffer as it must).
        json_body_sized(StatusCode::OK, &entries, pretty, listing_len(&entries))
    })
}

/// A listing's compact JSON length: `[` `]`, its items, and a comma between each two.
fn listing_len<T: Encoded>(entries: &[T]) -> usize {
    2 + entries.len().saturating_sub(1) + entries.iter().map(Encoded::encoded_len).sum::<usize>()
}

/// A listing's compact JSON array in pieces of `PER_PIECE` entries (about 100–300 KiB each,
/// a millisecond or less of encoding: short enough for a worker). Each entry is dropped once
/// encoded; the values it shares with the store stay the store's.
fn streamed_listing<T: Serialize + Encoded + Send + 'static>(entries: Vec<T>) -> Response {
    const PER_PIECE: usize = 1_024;
    let length = listing_len(&entries);
    // A piece's buffer at the listing's mean size per entry: each entry's length is computed
    // once (for `length`), not again per piece; a piece of longer entries grows its buffer.
    let per_piece = (length / entries.len().max(1) + 1) * PER_PIECE + 2;
    let mut rest = entries.into_iter();
    let (mut first, mut done) = (true, false);
    let pieces = std::iter::from_fn(move || {
        if done {
            return None;
        }
        let mut buf = Vec::with_capacity(per_piece);
        if first {
            buf.push(b'[');
        }
        for e in rest.by_ref().take(PER_PIECE) {
            if !first {
                buf.push(b',');
            }
            first = false;
            if let Err(err) = serde_json::to_writer(&mut buf, &e) {
                // Cut short: the client sees a broken body, never a wrong one.
                done = true;
                return Some(Err(err));
            }
        }
        if rest.len() == 0 {
            buf.push(b']');
            done = true;
        }
        Some(Ok(Bytes::from(buf)))
    });
    let mut r = Response::new(Body::from_stream(futures::stream::iter(pieces)));
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
    r
}

/// How many bytes an item of a listing takes in compact JSON, exactly (serde_json's output; a
/// test holds them equal): a streamed listing sends it as its `Content-Length`, so that a
/// client sizes its buffer once, as for a whole body.
trait Encoded {
    fn encoded_len(&self) -> usize;
}

/// A string's length in JSON as serde_json writes it: quoted, `"` `\\` and the control
/// characters escaped (two bytes for the five with a short form, six for the others), every
/// other character as its UTF-8.
fn json_str_len(s: &str) -> usize {
    2 + s
        .bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\x08' | b'\x0c' | b'\n' | b'\r' | b'\t' => 2,
            0x00..=0x1f => 6,
            _ => 1,
        })
        .sum::<usize>()
}

/// A number's length in decimal.
fn digits(n: u64) -> usize {
    n.checked_ilog10().map_or(1, |d| d as usize + 1)
}

impl Encoded for std::sync::Arc<str> {
    fn encoded_len(&self) -> usize {
        json_str_len(self)
    }
}

impl Encoded for super::store::Listed {
    fn encoded_len(&self) -> usize {
        // {"LockIndex":N,"Key":S,"Flags":N,"Value":null|S[,"Session":S],"CreateIndex":N,"ModifyIndex":N}
        let e = &self.entry;
        let value = if e.value.is_empty() {
            4
        } else {
            2 + e.value.len().div_ceil(3) * 4
        };
        1 + 12
            + digits(e.lock_index)
            + 7
            + json_str_len(&self.key)
            + 9
            + digits(e.flags)
            + 9
            + value
            + e.session.as_deref().map_or(0, |s| 11 + json_str_len(s))
            + 15
            + digits(e.create_index)
            + 15
            + digits(e.modify_index)
            + 1
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
    index_of: impl Fn(&super::store::Store) -> u64,
    build: impl Fn(&super::store::Store) -> T,
) -> Result<(T, u64), Answer> {
    let eval = |s: &super::store::Store| (build(s), index_of(s));
    let deadline = (opts.index > 0).then(|| {
        let jitter = crate::util::jitter_up_to(opts.wait / 16);
        Instant::now() + opts.wait + jitter
    });
    loop {
        if let Some(stale) = shared.stale.answer(eval) {
            // A Consul 0.7 leader replaying its log answers at once from what it has replayed.
            return Ok(stale);
        }
        let timed_out = deadline.is_some_and(|d| Instant::now() >= d);
        // The answer is built only when it is sent: a query that waits compares the index
        // alone. Most blocking queries arrive at the index they were last answered at and
        // wait, and a listing's answer (a million pod labels) is the costly part.
        let (answer, applied, waiter) = {
            let mut st = shared.state.lock();
            let index = index_of(&st.store);
            let applied = st.store.index();
            if deadline.is_some()
                && index <= opts.index
                && !timed_out
                && !shared.shutdown.is_cancelled()
            {
                (None, applied, Some(st.waiters.register(&target)))
            } else {
                (Some((build(&st.store), index)), applied, None)
            }
        };
        let Some((id, rx)) = waiter else {
            shared.wait_durable(applied).await?;
            // Invariant: no waiter means the answer was built above.
            return answer
                .ok_or_else(|| internal("a blocking read with neither answer nor waiter"));
        };
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

/// Finds a field by case-insensitive name, as Go's encoding/json matches them.
fn field<'a>(m: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    m.iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Entry, Listed};

    /// A streamed listing is the same JSON as the whole body, across piece boundaries and for
    /// an empty one.
    #[tokio::test]
    async fn a_streamed_listing_is_the_whole_listings_json() {
        for n in [0usize, 1, 1_023, 1_024, 1_025, 5_000] {
            let keys: Vec<std::sync::Arc<str>> =
                (0..n).map(|i| format!("k/\"{i}\"\n").into()).collect();
            let whole = serde_json::to_vec(&keys).unwrap();
            let body = body_of(streamed_listing(keys)).await;
            assert_eq!(body.as_ref(), whole.as_slice(), "{n} keys");
            let listing: Vec<Listed> = (0..n as u64)
                .map(|i| Listed {
                    key: format!("labels/pod/n{i}").into(),
                    entry: Entry {
                        value: if i % 2 == 0 {
                            format!("v{i}").into()
                        } else {
                            Default::default()
                        },
                        flags: i,
                        session: (i % 3 == 0).then(|| "s".to_string()),
                        lock_index: 0,
                        create_index: i,
                        modify_index: i,
                    },
                })
                .collect();
            let whole = serde_json::to_vec(&listing).unwrap();
            let body = body_of(streamed_listing(listing)).await;
            assert_eq!(body.as_ref(), whole.as_slice(), "{n} entries");
        }
    }

    /// The body, after checking that its `Content-Length` is its length.
    async fn body_of(r: Response) -> Bytes {
        let length: usize = r.headers()[header::CONTENT_LENGTH]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        let body = axum::body::to_bytes(r.into_body(), usize::MAX)
            .await
            .unwrap();
        assert_eq!(body.len(), length);
        body
    }

    /// Each item's length is exactly its compact JSON's: keys with every ASCII character (the
    /// escaped ones included) and others, values of every length mod 3 and empty, sessions or
    /// none, indexes from 0 to `u64::MAX`.
    #[test]
    fn a_listings_lengths_are_its_jsons_exactly() {
        let ascii: String = (0u8..0x80).map(char::from).collect();
        let keys = [
            "labels/pod/node-00001/bench-1".to_string(),
            ascii,
            "ünïcødé/键/🙂".to_string(),
            String::new(),
        ];
        let mut listing = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            for (n, index) in [0u64, 9, 10, 99_999_999, u64::MAX].into_iter().enumerate() {
                listing.push(Listed {
                    key: key.as_str().into(),
                    entry: Entry {
                        value: vec![b'x'; (i + n) % 5].into(),
                        flags: index,
                        session: (n % 2 == 0).then(|| format!("{key}-{n}")),
                        lock_index: index,
                        create_index: index / 3,
                        modify_index: index,
                    },
                });
            }
        }
        for e in &listing {
            assert_eq!(
                e.encoded_len(),
                serde_json::to_vec(e).unwrap().len(),
                "{:?}",
                e.key
            );
            let k = e.key.clone();
            assert_eq!(
                k.encoded_len(),
                serde_json::to_vec(&k).unwrap().len(),
                "{k:?}"
            );
        }
    }
}

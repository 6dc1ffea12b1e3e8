//! `/v1/kv/…`: single-key and prefix reads (blocking, `?keys`, `?recurse`, `?raw`) and the
//! KV endpoint's writes (`?cas`, `?acquire`, `?release`, `DELETE ?recurse`), each answered
//! `true`/`false` as Consul's `kvs_endpoint.go` does.

use axum::body::Body;
use axum::http::{HeaderValue, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use tokio::time::Instant;

use super::{
    Answer, MAX_KV_SIZE_0_7, Params, bad_request, blocking, internal, json_body, json_listing,
    not_found_with_meta, parse_read_opts, read_body, with_meta,
};
use crate::Shared;
use crate::compat::Compat;
use crate::store::{KvOp, KvWriteOutcome};
use crate::waiters::WatchTarget;

const KV_SIZE_DOC: &str = "https://www.consul.io/docs/agent/config/config-files#kv_max_value_size";

pub(super) async fn kv_get(shared: &Shared, key: &str, p: &Params) -> Result<Response, Answer> {
    let opts = parse_read_opts(p)?;
    if p.has("keys") {
        let sep = p
            .get("separator")
            .or_else(|| p.get("seperator"))
            .unwrap_or("")
            .to_string();
        let prefix = key.to_string();
        let (keys, index) = blocking(
            shared,
            &opts,
            WatchTarget::Prefix(prefix.clone()),
            |s| s.prefix_read_index(&prefix),
            |s| s.read_keys(&prefix, &sep),
        )
        .await?;
        if keys.is_empty() && !prefix.is_empty() {
            return Ok(not_found_with_meta(index));
        }
        return Ok(with_meta(json_listing(keys, opts.pretty), index));
    }
    if p.has("recurse") {
        let prefix = key.to_string();
        let (entries, index) = blocking(
            shared,
            &opts,
            WatchTarget::Prefix(prefix.clone()),
            |s| s.prefix_read_index(&prefix),
            |s| s.list_prefix(&prefix),
        )
        .await?;
        if entries.is_empty() {
            return Ok(not_found_with_meta(index));
        }
        return Ok(with_meta(json_listing(entries, opts.pretty), index));
    }
    if key.is_empty() {
        return Err(bad_request("Missing key name"));
    }
    let k = key.to_string();
    let (entry, index) = blocking(
        shared,
        &opts,
        WatchTarget::Key(k.clone()),
        |s| s.key_read_index(&k),
        |s| s.read_key(&k).0,
    )
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

pub(super) async fn kv_put(
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

pub(super) async fn kv_delete(shared: &Shared, key: &str, p: &Params) -> Result<Response, Answer> {
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

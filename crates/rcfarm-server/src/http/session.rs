//! `/v1/session/*`: creating sessions (validated as Consul does: TTL bounds, behavior, node and
//! check registrations, lock-delay units), destroying and renewing them, and the blocking
//! session reads, in Consul 1.x's JSON or 0.7's.

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use axum::response::Response;
use serde::Serialize;
use serde_json::{Map, Value, json};
use tokio::time::Instant;

use super::{
    Answer, Params, bad_request, blocking, err, field, internal, json_body, parse_read_opts,
    read_body, with_meta,
};
use crate::Shared;
use crate::compat::Compat;
use crate::consul::SessionEntry;
use crate::store::{Behavior, SessionRecord};
use crate::util::parse_go_duration;
use crate::waiters::WatchTarget;

const SESSION_TTL_MAX: Duration = Duration::from_secs(24 * 3600);

pub(super) async fn session_create(
    shared: &Shared,
    req: Request<Body>,
) -> Result<Response, Answer> {
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

pub(super) async fn session_destroy(shared: &Shared, id: &str) -> Result<Response, Answer> {
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

pub(super) fn session_renew(shared: &Shared, id: &str, p: &Params) -> Result<Response, Answer> {
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

pub(super) enum SessionQuery {
    Info(String),
    Node(String),
    List,
}

pub(super) async fn session_read(
    shared: &Shared,
    p: &Params,
    q: SessionQuery,
) -> Result<Response, Answer> {
    let opts = parse_read_opts(p)?;
    match &q {
        SessionQuery::Info(id) if id.is_empty() => return Err(bad_request("Missing session")),
        SessionQuery::Node(n) if n.is_empty() => return Err(bad_request("Missing node name")),
        _ => {}
    }
    let (list, index) = blocking(
        shared,
        &opts,
        WatchTarget::Sessions,
        |s| s.sessions_index(),
        |s| match &q {
            SessionQuery::Info(id) => s
                .session(id)
                .map(|r| vec![r.to_entry()])
                .unwrap_or_default(),
            SessionQuery::Node(n) => s.list_sessions(Some(n)),
            SessionQuery::List => s.list_sessions(None),
        },
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_delay_numbers_follow_consul() {
        assert_eq!(fix_lock_delay(10), Duration::from_secs(10));
        assert_eq!(fix_lock_delay(1000), Duration::from_nanos(1000));
        assert_eq!(fix_lock_delay(0), Duration::ZERO);
    }
}

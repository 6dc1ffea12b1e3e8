//! `/v1/txn`: decoding a transaction body as Consul's `lib.DecodeJSON` does (with its size and
//! op-count limits, per compat version), running it on the store and answering with
//! `Results`/`Errors`, or a read-only transaction's `TxnReadResponse`.

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, Request, StatusCode};
use axum::response::Response;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::{
    Answer, MAX_KV_SIZE_0_7, Params, bad_request, field, json_body, parse_read_opts, read_body,
    too_large,
};
use crate::Shared;
use crate::compat::Compat;
use crate::consul::KvPair;
use crate::store::{KvOp, TxnErrors};

const TXN_SIZE_DOC: &str = "https://www.consul.io/docs/agent/config/config-files#txn_max_req_len";
/// Consul 0.7 reads a transaction's body whatever its size; this server stops somewhere.
const MAX_TXN_BODY_0_7: usize = 64 << 20;

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
pub(super) async fn txn_anonymous_0_7(
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
    result: Result<Vec<KvPair>, TxnErrors>,
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

pub(super) async fn txn(
    shared: &Shared,
    p: &Params,
    req: Request<Body>,
) -> Result<Response, Answer> {
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

fn txn_body(result: Result<Vec<KvPair>, TxnErrors>) -> (StatusCode, Value) {
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
}

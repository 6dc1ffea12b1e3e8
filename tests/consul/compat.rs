//! Where Consul 0.7 and 1.x answer differently, the embedded server answers as the one it runs
//! as (`ServerConfig::compat`, `consul-dev --compat 0.7|1.x`): each difference of
//! docs/consul-backends.md, checked under both modes with a raw HTTP client, and the rcfarm
//! client working under both. The 0.7 answers were read off the real Consul 0.7.0 binary.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::common::{client, http, server_with};
use rcfarm::consul::{QueryOptions, TxnOp};
use rcfarm::server::{Compat, EmbeddedServer, ServerConfig, ServerError};

const BOTH: [Compat; 2] = [Compat::V0_7, Compat::V1];

async fn server_as(compat: Compat) -> EmbeddedServer {
    server_with(ServerConfig {
        compat,
        session_ttl_min: Duration::from_secs(1),
        ..ServerConfig::ephemeral()
    })
    .await
}

async fn send(req: reqwest::RequestBuilder) -> (StatusCode, reqwest::header::HeaderMap, String) {
    let r = req.send().await.expect("request completes");
    let status = r.status();
    let headers = r.headers().clone();
    (status, headers, r.text().await.unwrap())
}

fn txn_op(verb: &str, key: &str, value: Option<&[u8]>) -> Value {
    let mut kv = json!({"Verb": verb, "Key": key});
    if let Some(v) = value {
        kv["Value"] = json!(B64.encode(v));
    }
    json!({ "KV": kv })
}

#[tokio::test]
async fn get_or_empty_and_check_not_exists_are_unknown_verbs_under_0_7() {
    for compat in BOTH {
        let s = server_as(compat).await;
        let body = json!([
            txn_op("set", "a", Some(b"x")),
            txn_op("get-or-empty", "b", None),
            txn_op("check-not-exists", "c", None),
        ]);
        let (st, _, b) = send(http().put(format!("{}/v1/txn", s.url())).json(&body)).await;
        match compat {
            // Byte for byte what Consul 0.7.0 answers.
            Compat::V0_7 => {
                assert_eq!(st, StatusCode::CONFLICT);
                assert_eq!(
                    b,
                    r#"{"Results":null,"Errors":[{"OpIndex":1,"What":"unknown KV verb \"get-or-empty\""},{"OpIndex":2,"What":"unknown KV verb \"check-not-exists\""}]}"#
                );
                assert_eq!(s.count_prefix("a"), 0, "rolled back");
            }
            Compat::V1 => {
                assert_eq!(st, StatusCode::OK, "{b}");
                assert_eq!(s.count_prefix("a"), 1);
            }
        }
        s.shutdown().await;
    }
}

#[tokio::test]
async fn session_json_has_0_7s_checks_or_1x_node_and_service_checks() {
    for compat in BOTH {
        let s = server_as(compat).await;
        let u = s.url();
        let (_, _, b) = send(
            http()
                .put(format!("{u}/v1/session/create"))
                .body(r#"{"Name":"n","TTL":"10s","Behavior":"delete"}"#),
        )
        .await;
        let id = serde_json::from_str::<Value>(&b).unwrap()["ID"]
            .as_str()
            .unwrap()
            .to_string();
        for path in [
            format!("/v1/session/info/{id}"),
            "/v1/session/list".into(),
            "/v1/session/node/rcfarm-dev".into(),
        ] {
            let (st, _, b) = send(http().get(format!("{u}{path}"))).await;
            assert_eq!(st, StatusCode::OK);
            let v: Value = serde_json::from_str(&b).unwrap();
            let keys: Vec<&str> = v[0]
                .as_object()
                .unwrap()
                .keys()
                .map(String::as_str)
                .collect();
            let want = match compat {
                Compat::V0_7 => vec![
                    "ID",
                    "Name",
                    "Node",
                    "Checks",
                    "LockDelay",
                    "Behavior",
                    "TTL",
                    "CreateIndex",
                    "ModifyIndex",
                ],
                Compat::V1 => vec![
                    "ID",
                    "Name",
                    "Node",
                    "LockDelay",
                    "Behavior",
                    "TTL",
                    "NodeChecks",
                    "ServiceChecks",
                    "CreateIndex",
                    "ModifyIndex",
                ],
            };
            assert_eq!(keys, want, "{compat} {path}");
            let checks = if compat == Compat::V0_7 {
                "Checks"
            } else {
                "NodeChecks"
            };
            assert_eq!(v[0][checks], json!(["serfHealth"]));
        }
        let (_, _, b) = send(http().put(format!("{u}/v1/session/renew/{id}"))).await;
        let v: Value = serde_json::from_str(&b).unwrap();
        assert_eq!(v[0].get("Checks").is_some(), compat == Compat::V0_7, "{b}");

        // 0.7 does not know NodeChecks and ignores it; 1.x checks the checks exist.
        let (st, _, b) = send(
            http()
                .put(format!("{u}/v1/session/create"))
                .body(r#"{"NodeChecks":["nope"]}"#),
        )
        .await;
        match compat {
            Compat::V0_7 => assert_eq!(st, StatusCode::OK, "{b}"),
            Compat::V1 => assert_eq!(
                (st, b.as_str()),
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "apply failed: Missing check 'nope' registration"
                )
            ),
        }
        let (st, _, b) = send(
            http()
                .put(format!("{u}/v1/session/create"))
                .body(r#"{"Checks":["nope"]}"#),
        )
        .await;
        assert_eq!(st, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            b.strip_prefix("apply failed: ").is_some(),
            compat == Compat::V1,
            "{b}"
        );

        // rcfarm's client reads both shapes.
        let c = client(&s);
        let (info, _) = c.session_info(&id, &QueryOptions::default()).await.unwrap();
        let info = info.expect("the session exists");
        let checks = info.node_checks.or(info.checks).unwrap();
        assert_eq!(checks, vec!["serfHealth".to_string()]);
        s.shutdown().await;
    }
}

#[tokio::test]
async fn txn_size_limits_are_0_7s_cumulative_values_or_1xs_body_length() {
    let values_over_512k = json!([
        txn_op("set", "b1", Some(&[b'a'; 300_000])),
        txn_op("set", "b2", Some(&[b'a'; 300_000])),
    ]);
    // A body over 512 KiB whose values are small: long keys.
    let long_keys: Vec<Value> = (0..60)
        .map(|i| txn_op("set", &format!("k{i}/{}", "x".repeat(10_000)), Some(b"v")))
        .collect();
    let one_too_big = json!([txn_op("set", "b1", Some(&[b'a'; 600_000]))]);
    for compat in BOTH {
        let s = server_as(compat).await;
        let u = format!("{}/v1/txn", s.url());
        let (st, _, b) = send(http().put(&u).json(&values_over_512k)).await;
        assert_eq!(st, StatusCode::PAYLOAD_TOO_LARGE, "{compat}");
        match compat {
            Compat::V0_7 => assert_eq!(
                b,
                "Cumulative size of key data is too large (600000 > 524288 bytes)"
            ),
            Compat::V1 => assert!(
                b.starts_with("Request body(") && b.contains("too large, max size: 524288 bytes"),
                "{b}"
            ),
        }
        let (st, _, b) = send(http().put(&u).json(&long_keys)).await;
        match compat {
            Compat::V0_7 => assert_eq!(st, StatusCode::OK, "0.7 has no body limit: {b}"),
            Compat::V1 => assert_eq!(st, StatusCode::PAYLOAD_TOO_LARGE, "{b}"),
        }
        let (st, _, b) = send(http().put(&u).json(&one_too_big)).await;
        if compat == Compat::V0_7 {
            assert_eq!(
                (st, b.as_str()),
                (
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "Value for key \"b1\" is too large (600000 > 524288 bytes)"
                )
            );
        } else {
            assert_eq!(st, StatusCode::PAYLOAD_TOO_LARGE);
        }
        // KV PUT: 0.7's own wording.
        let (st, _, b) = send(
            http()
                .put(format!("{}/v1/kv/big", s.url()))
                .body(vec![b'a'; 600_000]),
        )
        .await;
        assert_eq!(st, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(
            b == "Value exceeds 524288 byte limit",
            compat == Compat::V0_7,
            "{b}"
        );
        s.shutdown().await;
    }
}

#[tokio::test]
async fn kv_writes_carry_no_index_header_under_either() {
    for compat in BOTH {
        let s = server_as(compat).await;
        let (st, h, b) = send(http().put(format!("{}/v1/kv/k", s.url())).body("v")).await;
        assert_eq!((st, b.as_str()), (StatusCode::OK, "true"));
        assert!(h.get("x-consul-index").is_none(), "{compat}: {h:?}");
        // Reads do, under both.
        let (_, h, _) = send(http().get(format!("{}/v1/kv/k", s.url()))).await;
        assert!(h.get("x-consul-index").is_some());
        // rcfarm's client writes without it.
        assert!(client(&s).kv_put("k2", b"v", None).await.unwrap());
        s.shutdown().await;
    }
}

#[tokio::test]
async fn wrong_methods_and_1x_only_headers() {
    for compat in BOTH {
        let s = server_as(compat).await;
        let u = s.url();
        let (st, h, b) = send(http().post(format!("{u}/v1/txn")).body("[]")).await;
        assert_eq!(st, StatusCode::METHOD_NOT_ALLOWED);
        let (st_opt, h_opt, _) =
            send(http().request(reqwest::Method::OPTIONS, format!("{u}/v1/kv/x"))).await;
        let (_, h_get, _) = send(http().get(format!("{u}/v1/kv/x"))).await;
        let (_, _, ro) = send(
            http()
                .put(format!("{u}/v1/txn"))
                .json(&json!([txn_op("get-tree", "x", None)])),
        )
        .await;
        let ro: Value = serde_json::from_str(&ro).unwrap();
        match compat {
            Compat::V0_7 => {
                assert_eq!(b, "");
                assert!(h.get("allow").is_none());
                assert_eq!(st_opt, StatusCode::METHOD_NOT_ALLOWED);
                for name in [
                    "vary",
                    "x-consul-default-acl-policy",
                    "x-consul-query-backend",
                ] {
                    assert!(h_get.get(name).is_none(), "{name}");
                }
                assert_eq!(
                    ro,
                    json!({"Results": [], "Errors": null, "Index": 0, "LastContact": 0, "KnownLeader": true})
                );
            }
            Compat::V1 => {
                assert_eq!(b, "method POST not allowed");
                assert_eq!(h["allow"], "OPTIONS,PUT");
                assert_eq!(st_opt, StatusCode::OK);
                assert_eq!(h_opt["allow"], "OPTIONS,GET,PUT,DELETE");
                assert_eq!(h_get["x-consul-default-acl-policy"], "allow");
                assert_eq!(ro["ResultsFilteredByACLs"], json!(false));
            }
        }
        s.shutdown().await;
    }
}

#[tokio::test]
async fn acl_answers_are_0_7s_legacy_ones_or_1xs() {
    for compat in BOTH {
        let s = server_with(ServerConfig {
            compat,
            acl_token: Some("master".into()),
            ..ServerConfig::ephemeral()
        })
        .await;
        let u = s.url();
        let h = http();
        // A token the server does not know: the same under both.
        let (st, _, b) = send(h.put(format!("{u}/v1/kv/k?token=bogus")).body("v")).await;
        assert_eq!((st, b.as_str()), (StatusCode::FORBIDDEN, "ACL not found"));
        let (st, _, _) = send(h.put(format!("{u}/v1/kv/k?token=master")).body("v")).await;
        assert_eq!(st, StatusCode::OK);

        // No token under a deny policy.
        let (put, _, put_body) = send(h.put(format!("{u}/v1/kv/k")).body("v")).await;
        let (get, get_h, _) = send(h.get(format!("{u}/v1/kv/k"))).await;
        let (txn, _, txn_body) = send(h.put(format!("{u}/v1/txn")).json(&json!([
            txn_op("set", "a", Some(b"x")),
            txn_op("get", "k", None),
            {"KV": {"Verb": "check-index", "Key": "k", "Index": 1}},
        ])))
        .await;
        let (session, _, _) = send(h.put(format!("{u}/v1/session/create"))).await;
        match compat {
            Compat::V0_7 => {
                assert_eq!(
                    (put, put_body.as_str()),
                    (StatusCode::FORBIDDEN, "Permission denied")
                );
                assert_eq!(get, StatusCode::NOT_FOUND, "reads are filtered");
                assert!(get_h.get("x-consul-index").is_some());
                assert_eq!(txn, StatusCode::CONFLICT);
                assert_eq!(
                    serde_json::from_str::<Value>(&txn_body).unwrap(),
                    json!({"Results": null, "Errors": [
                        {"OpIndex": 0, "What": "Permission denied"},
                        {"OpIndex": 2, "What": "Permission denied"},
                    ]})
                );
                assert_eq!(session, StatusCode::OK, "0.7 has no session ACLs");
            }
            Compat::V1 => {
                for (st, b) in [(put, &put_body), (txn, &txn_body)] {
                    assert_eq!(
                        (st, b.as_str()),
                        (
                            StatusCode::FORBIDDEN,
                            "Permission denied: anonymous token lacks permission"
                        )
                    );
                }
                assert_eq!(get, StatusCode::FORBIDDEN);
                assert_eq!(session, StatusCode::FORBIDDEN);
            }
        }
        s.shutdown().await;
    }
}

#[tokio::test]
async fn only_0_7_limits_no_clients_connections() {
    for compat in BOTH {
        let s = server_with(ServerConfig {
            compat,
            http_max_conns_per_client: 2,
            ..ServerConfig::ephemeral()
        })
        .await;
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(tokio::net::TcpStream::connect(s.addr()).await.unwrap());
        }
        let mut served = 0;
        for c in &mut held {
            if answered(c).await {
                served += 1;
            }
        }
        match compat {
            Compat::V0_7 => assert_eq!((served, s.stats().conns_refused), (3, 0)),
            Compat::V1 => assert_eq!((served, s.stats().conns_refused), (2, 1)),
        }
        drop(held);
        s.shutdown().await;
    }
}

/// Whether a raw connection gets `/v1/status/leader` answered (a refused one gets the 429).
async fn answered(conn: &mut tokio::net::TcpStream) -> bool {
    crate::wire::leader_over(conn).await.0 == "HTTP/1.1 200 OK"
}

/// hashicorp/consul#2644: a Consul < 0.8.5 leader replaying its log after an election answers
/// reads from an older state, with a lower index, at once (even a blocking query).
#[tokio::test]
async fn stale_post_election_answers_are_0_7s_only() {
    for compat in BOTH {
        let s = server_as(compat).await;
        let c = client(&s);
        c.kv_put("rc/a", b"old", None).await.unwrap();
        let checkpoint = s.in_process().checkpoint();
        c.txn(&[
            TxnOp::set("rc/a", b"new".to_vec()),
            TxnOp::set("rc/b", b"x".to_vec()),
        ])
        .await
        .unwrap();
        let (now, meta) = c.kv_list("rc/", &QueryOptions::default()).await.unwrap();
        let index = meta.index;
        assert_eq!(now.len(), 2);
        match s.in_process().serve_stale(checkpoint, 2) {
            Err(ServerError::NotUnderCompat(Compat::V1)) => {
                assert_eq!(compat, Compat::V1);
                s.shutdown().await;
                continue;
            }
            other => {
                assert_eq!(compat, Compat::V0_7);
                other.unwrap();
            }
        }
        // A blocking query on the current index answers at once, from the old state.
        let blocking = QueryOptions::blocking(index, Duration::from_secs(30));
        let started = std::time::Instant::now();
        let (stale, stale_meta) = c.kv_list("rc/", &blocking).await.unwrap();
        let stale_index = stale_meta.index;
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(stale_index < index, "{stale_index} < {index}");
        assert_eq!(stale.len(), 1);
        assert_eq!(stale[0].value_bytes(), b"old");
        let (e, _) = c.kv_get("rc/a", &QueryOptions::default()).await.unwrap();
        assert_eq!(e.unwrap().value_bytes(), b"old");
        // Then the real state again.
        let (e, meta) = c.kv_get("rc/a", &QueryOptions::default()).await.unwrap();
        assert_eq!(e.unwrap().value_bytes(), b"new");
        assert!(meta.index >= index);
        s.shutdown().await;
    }
}

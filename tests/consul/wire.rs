//! Exact statuses, headers and bodies of the embedded server, checked with a raw HTTP client:
//! bad requests get Consul's answers, never a crash or a hang.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::common::{http, server, server_with};
use rcfarm::server::ServerConfig;

async fn send(req: reqwest::RequestBuilder) -> (StatusCode, reqwest::header::HeaderMap, String) {
    let r = req.send().await.expect("request completes");
    let status = r.status();
    let headers = r.headers().clone();
    (status, headers, r.text().await.unwrap())
}

#[tokio::test]
async fn bad_index_and_wait_are_400s() {
    let s = server().await;
    let u = s.url();
    let h = http();
    for (q, body) in [
        ("index=abc", "Invalid index"),
        ("index=-1", "Invalid index"),
        ("index=5&wait=10", "Invalid wait time"),
        ("wait=soon", "Invalid wait time"),
        (
            "stale&consistent",
            "Cannot specify ?stale with ?consistent, conflicting semantics.",
        ),
    ] {
        let (st, _, b) = send(h.get(format!("{u}/v1/kv/x?{q}"))).await;
        assert_eq!((st, b.as_str()), (StatusCode::BAD_REQUEST, body), "{q}");
    }
    // `wait` alone does not block.
    let started = std::time::Instant::now();
    let (st, _, _) = send(h.get(format!("{u}/v1/kv/x?wait=5s"))).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn reads_carry_consul_headers_even_on_404() {
    let s = server().await;
    let u = s.url();
    let (st, h, body) = send(http().get(format!("{u}/v1/kv/missing"))).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    assert!(body.is_empty());
    assert_eq!(h["x-consul-index"], "1", "never 0");
    assert_eq!(h["x-consul-knownleader"], "true");
    assert_eq!(h["x-consul-lastcontact"], "0");
    let (st, h, _) = send(http().get(format!("{u}/v1/session/list"))).await;
    assert_eq!(st, StatusCode::OK);
    assert!(h.contains_key("x-consul-index"));
    // Writes carry no index.
    let (_, h, body) = send(http().put(format!("{u}/v1/kv/k")).body("v")).await;
    assert_eq!(body, "true");
    assert!(!h.contains_key("x-consul-index"));
}

#[tokio::test]
async fn kv_request_errors_match_consul() {
    let s = server().await;
    let u = s.url();
    let h = http();
    let cases = [
        (
            h.get(format!("{u}/v1/kv/")),
            StatusCode::BAD_REQUEST,
            "Missing key name",
        ),
        (
            h.put(format!("{u}/v1/kv/")).body("x"),
            StatusCode::BAD_REQUEST,
            "Missing key name",
        ),
        (
            h.delete(format!("{u}/v1/kv/")),
            StatusCode::BAD_REQUEST,
            "Missing key name",
        ),
        (
            h.put(format!("{u}/v1/kv/k?cas=1&acquire=s")),
            StatusCode::BAD_REQUEST,
            "Conflicting flags: acquire=s&cas=1",
        ),
        (
            h.put(format!("{u}/v1/kv/k?release=s&acquire=s")),
            StatusCode::BAD_REQUEST,
            "Conflicting flags: acquire=s&release=s",
        ),
        (
            h.delete(format!("{u}/v1/kv/k?recurse&cas=3")),
            StatusCode::BAD_REQUEST,
            "Conflicting flags: cas=3&recurse=",
        ),
        (
            h.put(format!("{u}/v1/kv/k?flags=abc")),
            StatusCode::INTERNAL_SERVER_ERROR,
            r#"strconv.ParseUint: parsing "abc": invalid syntax"#,
        ),
        (
            h.put(format!("{u}/v1/kv/k?cas=-1")),
            StatusCode::INTERNAL_SERVER_ERROR,
            r#"strconv.ParseUint: parsing "-1": invalid syntax"#,
        ),
        (
            h.put(format!("{u}/v1/kv/k?acquire=nope")),
            StatusCode::INTERNAL_SERVER_ERROR,
            r#"raft apply failed: invalid session "nope""#,
        ),
    ];
    for (req, status, body) in cases {
        let (st, _, b) = send(req).await;
        assert_eq!((st, b.as_str()), (status, body));
    }
    let huge = vec![b'x'; 512 * 1024 + 1];
    let (st, _, b) = send(h.put(format!("{u}/v1/kv/big")).body(huge)).await;
    assert_eq!(st, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(
        b.starts_with("Request body(524289 bytes) too large, max size: 524288 bytes."),
        "{b}"
    );
    let ok = vec![b'x'; 512 * 1024];
    let (st, _, _) = send(h.put(format!("{u}/v1/kv/big")).body(ok)).await;
    assert_eq!(st, StatusCode::OK, "exactly the limit is fine");
}

#[tokio::test]
async fn flags_count_by_presence_and_keys_wins() {
    let s = server().await;
    let u = s.url();
    let h = http();
    send(h.put(format!("{u}/v1/kv/p/a")).body("1")).await;
    send(h.put(format!("{u}/v1/kv/p/b")).body("2")).await;
    let (_, _, b) = send(h.get(format!("{u}/v1/kv/p/?recurse=false"))).await;
    assert_eq!(
        serde_json::from_str::<Vec<Value>>(&b).unwrap().len(),
        2,
        "?recurse=false still recurses"
    );
    let (_, _, b) = send(h.get(format!("{u}/v1/kv/p/?recurse&keys"))).await;
    assert_eq!(
        serde_json::from_str::<Value>(&b).unwrap(),
        json!(["p/a", "p/b"])
    );
    let (_, hd, b) = send(h.get(format!("{u}/v1/kv/p/a?raw"))).await;
    assert_eq!(b, "1");
    assert!(
        hd["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    // `?keys` on an empty root is an empty list; on an empty prefix, a 404.
    let (st, _, _) = send(h.get(format!("{u}/v1/kv/none/?keys"))).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn key_paths_are_url_decoded_but_plus_stays() {
    let s = server().await;
    let u = s.url();
    let h = http();
    send(h.put(format!("{u}/v1/kv/a%2Fb")).body("slash")).await;
    send(h.put(format!("{u}/v1/kv/c+d")).body("plus")).await;
    let (_, _, b) = send(h.get(format!("{u}/v1/kv/?keys"))).await;
    assert_eq!(
        serde_json::from_str::<Value>(&b).unwrap(),
        json!(["a/b", "c+d"])
    );
}

#[tokio::test]
async fn methods_paths_and_options() {
    let s = server().await;
    let u = s.url();
    let h = http();
    let (st, hd, b) = send(h.post(format!("{u}/v1/txn")).body("[]")).await;
    assert_eq!(
        (st, b.as_str()),
        (StatusCode::METHOD_NOT_ALLOWED, "method POST not allowed")
    );
    assert_eq!(hd["allow"], "OPTIONS,PUT");
    let (st, hd, _) = send(h.request(reqwest::Method::OPTIONS, format!("{u}/v1/kv/x"))).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(hd["allow"], "OPTIONS,GET,PUT,DELETE");
    let (st, _, b) = send(h.get(format!("{u}/v1/nothing"))).await;
    assert_eq!(
        (st, b.as_str()),
        (
            StatusCode::NOT_FOUND,
            "Invalid URL path: not a recognized HTTP API endpoint\n"
        )
    );
    let (st, _, _) = send(h.get(format!("{u}/v1/session/create"))).await;
    assert_eq!(st, StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn txn_request_errors_match_consul() {
    let s = server().await;
    let u = s.url();
    let h = http();
    let txn = |body: String| h.put(format!("{u}/v1/txn")).body(body);
    let (st, _, b) = send(txn(String::new())).await;
    assert_eq!(
        (st, b.as_str()),
        (StatusCode::BAD_REQUEST, "Failed to parse body: EOF")
    );
    let (st, _, b) = send(txn(
        r#"[{"KV":{"Verb":"set","Key":"k","Value":"%%%"}}]"#.into()
    ))
    .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert!(
        b.starts_with("Failed to parse body: illegal base64 data at input byte"),
        "{b}"
    );
    let (st, _, b) = send(txn(r#"[{"KV":{"Verb":"set","Key":"k","Extra":1}}]"#.into())).await;
    assert_eq!(
        (st, b.as_str()),
        (
            StatusCode::BAD_REQUEST,
            r#"Failed to parse body: json: unknown field "Extra""#
        )
    );
    let (st, _, b) = send(txn(r#"{"KV":{}}"#.into())).await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{b}");

    let (st, _, b) = send(txn(r#"[{"KV":{"Verb":"frobnicate","Key":"k"}}]"#.into())).await;
    assert_eq!(st, StatusCode::CONFLICT);
    let v: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["Errors"][0]["What"], r#"unknown KV verb "frobnicate""#);
    assert_eq!(v["Results"], Value::Null);

    let ops: Vec<Value> = (0..65)
        .map(|i| json!({"KV": {"Verb": "set", "Key": format!("k{i}")}}))
        .collect();
    let (st, _, b) = send(txn(serde_json::to_string(&ops).unwrap())).await;
    assert_eq!(
        (st, b.as_str()),
        (
            StatusCode::PAYLOAD_TOO_LARGE,
            "Transaction contains too many operations (65 > 64)"
        )
    );

    let big = "A".repeat(600 * 1024);
    let (st, _, b) = send(txn(format!(
        r#"[{{"KV":{{"Verb":"set","Key":"k","Value":"{big}"}}}}]"#
    )))
    .await;
    assert_eq!(st, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(b.starts_with("Request body("), "{b}");

    let (st, _, b) = send(txn(r#"[{"KV":{"Verb":"get-tree","Key":""}}]"#.into())).await;
    assert_eq!(st, StatusCode::CONFLICT);
    assert!(b.contains("Must provide key"), "{b}");
}

#[tokio::test]
async fn txn_shapes_match_consul() {
    let s = server().await;
    let u = s.url();
    let h = http();
    // Only deletes: an empty result list, not null; `Value: ""` stores null.
    let (st, hd, b) = send(
        h.put(format!("{u}/v1/txn"))
            .body(r#"[{"KV":{"Verb":"delete","Key":"x"}}]"#),
    )
    .await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(
        serde_json::from_str::<Value>(&b).unwrap(),
        json!({"Results": [], "Errors": null})
    );
    assert!(!hd.contains_key("x-consul-index"));
    let (_, _, b) = send(
        h.put(format!("{u}/v1/txn"))
            .body(r#"[{"kv":{"verb":"set","key":"e","value":""}}]"#),
    )
    .await;
    let v: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(
        v["Results"][0]["KV"]["Key"], "e",
        "lower-case field names are accepted"
    );
    let (_, _, b) = send(h.get(format!("{u}/v1/kv/e"))).await;
    assert_eq!(
        serde_json::from_str::<Value>(&b).unwrap()[0]["Value"],
        Value::Null
    );
    // Read-only: Consul's TxnReadResponse embeds its query meta; no index header.
    let (st, hd, b) = send(
        h.put(format!("{u}/v1/txn"))
            .body(r#"[{"KV":{"Verb":"get","Key":"e"}}]"#),
    )
    .await;
    assert_eq!(st, StatusCode::OK);
    assert!(!hd.contains_key("x-consul-index"));
    assert_eq!(hd["x-consul-knownleader"], "true");
    let v: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["KnownLeader"], true);
    assert_eq!(v["Results"][0]["KV"]["Key"], "e");
}

#[tokio::test]
async fn session_create_accepts_consul_encodings_and_rejects_bad_ones() {
    // Consul's default session_ttl_min of 10 s.
    let s = server_with(ServerConfig::ephemeral()).await;
    let u = s.url();
    let h = http();
    let create = |body: &str| {
        h.put(format!("{u}/v1/session/create"))
            .body(body.to_string())
    };
    let (st, _, b) = send(create(
        r#"{"name":"py","ttl":"15s","lockdelay":"5s","behavior":"delete"}"#,
    ))
    .await;
    assert_eq!(st, StatusCode::OK, "{b}");
    let id = serde_json::from_str::<Value>(&b).unwrap()["ID"]
        .as_str()
        .unwrap()
        .to_string();
    let (_, _, b) = send(h.get(format!("{u}/v1/session/info/{id}"))).await;
    let info: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(info[0]["Name"], "py");
    assert_eq!(info[0]["LockDelay"], 5_000_000_000u64);
    assert_eq!(info[0]["Behavior"], "delete");

    // Numbers under 1000 are seconds, larger ones nanoseconds.
    let (_, _, b) = send(create(r#"{"LockDelay": 10}"#)).await;
    let id = serde_json::from_str::<Value>(&b).unwrap()["ID"]
        .as_str()
        .unwrap()
        .to_string();
    let (_, _, b) = send(h.get(format!("{u}/v1/session/info/{id}"))).await;
    assert_eq!(
        serde_json::from_str::<Value>(&b).unwrap()[0]["LockDelay"],
        10_000_000_000u64
    );

    for (body, status, text) in [
        (
            r#"{"Behavior":"explode"}"#,
            500,
            "Invalid Behavior setting 'explode'",
        ),
        (
            r#"{"TTL":"5s"}"#,
            500,
            "Invalid Session TTL '5000000000', must be between [10s=24h0m0s]",
        ),
        (
            r#"{"TTL":"soon"}"#,
            500,
            r#"Session TTL 'soon' invalid: time: invalid duration "soon""#,
        ),
        (
            r#"{"Node":"elsewhere"}"#,
            500,
            "apply failed: Missing node registration",
        ),
        (
            r#"{"NodeChecks":["web"]}"#,
            500,
            "apply failed: Missing check 'web' registration",
        ),
        (
            r#"{"LockDelay":"later"}"#,
            400,
            r#"Request decode failed: time: invalid duration "later""#,
        ),
        ("{not json", 400, ""),
    ] {
        let (st, _, b) = send(create(body)).await;
        assert_eq!(st.as_u16(), status, "{body}: {b}");
        if !text.is_empty() {
            assert_eq!(b, text, "{body}");
        } else {
            assert!(b.starts_with("Request decode failed: "), "{b}");
        }
    }
    let (st, _, b) = send(h.put(format!("{u}/v1/session/renew/unknown"))).await;
    assert_eq!(
        (st, b.as_str()),
        (StatusCode::NOT_FOUND, "Session id 'unknown' not found")
    );
    let (st, _, b) = send(h.get(format!("{u}/v1/session/info/unknown"))).await;
    assert_eq!((st, b.as_str()), (StatusCode::OK, "[]"));
    let (st, _, b) = send(h.put(format!("{u}/v1/session/destroy/unknown"))).await;
    assert_eq!((st, b.as_str()), (StatusCode::OK, "true"));
}

#[tokio::test]
async fn status_endpoints() {
    let s = server().await;
    let u = s.url();
    let (_, _, leader) = send(http().get(format!("{u}/v1/status/leader"))).await;
    assert_eq!(
        serde_json::from_str::<String>(&leader).unwrap(),
        "127.0.0.1:8300"
    );
    let (_, _, peers) = send(http().get(format!("{u}/v1/status/peers"))).await;
    assert_eq!(
        serde_json::from_str::<Vec<String>>(&peers).unwrap(),
        ["127.0.0.1:8300"]
    );
}

#[tokio::test]
async fn acl_token_is_required_when_configured() {
    let s = server_with(ServerConfig {
        acl_token: Some("s3cret".into()),
        ..ServerConfig::ephemeral()
    })
    .await;
    let u = s.url();
    let h = http();
    let (st, _, _) = send(h.get(format!("{u}/v1/kv/x"))).await;
    assert_eq!(st, StatusCode::FORBIDDEN);
    let (st, _, b) = send(
        h.get(format!("{u}/v1/kv/x"))
            .header("X-Consul-Token", "wrong"),
    )
    .await;
    assert_eq!((st, b.as_str()), (StatusCode::FORBIDDEN, "ACL not found"));
    for req in [
        h.get(format!("{u}/v1/kv/x"))
            .header("X-Consul-Token", "s3cret"),
        h.get(format!("{u}/v1/kv/x?token=s3cret")),
        h.get(format!("{u}/v1/kv/x"))
            .header("Authorization", "Bearer s3cret"),
    ] {
        let (st, _, _) = send(req).await;
        assert_eq!(st, StatusCode::NOT_FOUND, "authorized, key missing");
    }
    let (st, _, _) = send(h.get(format!("{u}/v1/status/leader"))).await;
    assert_eq!(st, StatusCode::OK, "status needs no token");
}

#[tokio::test]
async fn malformed_inputs_never_crash_or_hang_the_server() {
    let s = server().await;
    let u = s.url();
    let h = http();
    let junk_bodies = [
        "[",
        "[1]",
        "[null]",
        r#"[{"KV":null}]"#,
        r#"[{"KV":{"Verb":5}}]"#,
        r#"[{"KV":{"Index":1.5}}]"#,
        "\u{0}\u{1}",
    ];
    for body in junk_bodies {
        let (st, _, _) = send(h.put(format!("{u}/v1/txn")).body(body)).await;
        assert!(st.is_client_error(), "{body:?} -> {st}");
    }
    for path in [
        "/v1/kv/%ff%fe",
        "/v1/kv/%00",
        "/v1/session/info/",
        "/v1/session/node/",
        "/v1/session/renew/",
    ] {
        let (st, _, _) = send(h.get(format!("{u}{path}"))).await;
        assert!(
            st.is_client_error() || st == StatusCode::METHOD_NOT_ALLOWED,
            "{path} -> {st}"
        );
    }
    // Still serving.
    let (st, _, _) = send(h.put(format!("{u}/v1/kv/alive")).body("yes")).await;
    assert_eq!(st, StatusCode::OK);
}

/// Read off a real Consul 0.7.0 agent: Go's ServeMux answers a path that is not clean with a
/// 301 to the cleaned path, query kept, so `GET /v1/kv/health/web//?recurse` (P2's health
/// checker asks exactly that) lists `health/web/`.
#[tokio::test]
async fn unclean_paths_are_redirected_to_the_clean_one_as_go_does() {
    let s = server().await;
    let u = s.url();
    rcfarm::consul::init_tls();
    let raw = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    for (path, method, location) in [
        ("/v1/kv/a/b//?recurse", "GET", "/v1/kv/a/b/?recurse"),
        ("/v1/kv/a//d", "PUT", "/v1/kv/a/d"),
        ("/v1/kv//x", "DELETE", "/v1/kv/x"),
    ] {
        let m = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let (st, h, body) = send(raw.request(m, format!("{u}{path}"))).await;
        assert_eq!(st, StatusCode::MOVED_PERMANENTLY, "{method} {path}");
        assert_eq!(h["location"], location, "{method} {path}");
        assert_eq!(
            body.is_empty(),
            method != "GET",
            "{method} {path}: {body:?}"
        );
    }
    // Followed, as Go's client (P2's tools) follows it.
    let h = http();
    send(h.put(format!("{u}/v1/kv/health/web/n1")).body("{}")).await;
    let (st, _, body) = send(h.get(format!("{u}/v1/kv/health/web//?recurse"))).await;
    assert_eq!(st, StatusCode::OK);
    assert!(body.contains("health/web/n1"), "{body}");
}

/// go-connlimit's refusal, as Consul 1.x writes it on a connection over the per-client limit.
const TOO_MANY_CONNS: &str = "HTTP/1.1 429 Too Many Requests\r\n\
Content-Type: text/plain\r\n\
Content-Length: 81\r\n\
Connection: close\r\n\
\r\n\
Your IP is issuing too many concurrent connections, please rate limit your calls\n";

/// `GET /v1/status/leader` on a kept-alive raw connection: the status line and the body.
pub(crate) async fn leader_over(conn: &mut tokio::net::TcpStream) -> (String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    conn.write_all(b"GET /v1/status/leader HTTP/1.1\r\nHost: consul\r\n\r\n")
        .await
        .expect("request written");
    let mut buf = Vec::new();
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let mut chunk = [0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut chunk))
            .await
            .expect("answered in time")
            .expect("read");
        assert!(
            n > 0,
            "closed before the answer: {:?}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8(buf[..head_end].to_vec()).unwrap();
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().unwrap())
        })
        .expect("content-length");
    let mut body = buf[head_end..].to_vec();
    while body.len() < len {
        let mut chunk = [0u8; 1024];
        let n = conn.read(&mut chunk).await.expect("read");
        assert!(n > 0, "closed mid-body");
        body.extend_from_slice(&chunk[..n]);
    }
    (
        head.lines().next().unwrap().to_string(),
        String::from_utf8(body).unwrap(),
    )
}

/// Everything a connection receives until the server closes it.
async fn read_until_closed(conn: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut got))
        .await
        .expect("the server closes the connection")
        .expect("read");
    String::from_utf8(got).unwrap()
}

/// Polls the server's gauge of open connections until it reads `n`.
async fn until_open_conns(s: &rcfarm::server::EmbeddedServer, n: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while s.stats().open_conns != n {
        assert!(
            std::time::Instant::now() < deadline,
            "open connections stay at {}, not {n}",
            s.stats().open_conns
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Consul 1.x's `limits.http_max_conns_per_client`: connections are counted per client IP
/// (loopback included) from accept to close; the one beyond the limit gets go-connlimit's 429
/// before any request is read and is closed; a closed connection frees its slot.
#[tokio::test]
async fn connections_beyond_the_per_client_limit_get_consuls_429_and_are_closed() {
    let s = server_with(ServerConfig {
        http_max_conns_per_client: 3,
        ..ServerConfig::ephemeral()
    })
    .await;
    let leader = (
        "HTTP/1.1 200 OK".to_string(),
        "\"127.0.0.1:8300\"".to_string(),
    );
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut c = tokio::net::TcpStream::connect(s.addr()).await.unwrap();
        assert_eq!(leader_over(&mut c).await, leader);
        held.push(c);
    }
    assert_eq!(s.stats().open_conns, 3);

    let mut fourth = tokio::net::TcpStream::connect(s.addr()).await.unwrap();
    assert_eq!(read_until_closed(&mut fourth).await, TOO_MANY_CONNS);
    assert_eq!(s.stats().conns_refused, 1);
    assert_eq!(
        s.stats().open_conns,
        3,
        "a refused connection is never counted"
    );

    // The held ones are still served, on the same connections.
    for c in &mut held {
        assert_eq!(leader_over(c).await, leader);
    }

    // Closing one frees its slot.
    drop(held.pop());
    until_open_conns(&s, 2).await;
    let mut fifth = tokio::net::TcpStream::connect(s.addr()).await.unwrap();
    assert_eq!(leader_over(&mut fifth).await, leader);
    assert_eq!(s.stats().open_conns, 3);

    // Full again: refused again.
    let mut sixth = tokio::net::TcpStream::connect(s.addr()).await.unwrap();
    assert_eq!(read_until_closed(&mut sixth).await, TOO_MANY_CONNS);
    assert_eq!(s.stats().conns_refused, 2);

    drop(held);
    drop(fifth);
    until_open_conns(&s, 0).await;
}

/// The default is Consul 1.x's 200: the 201st concurrent connection from one IP is refused.
/// 0 means no limit.
#[tokio::test]
async fn the_per_client_connection_limit_defaults_to_200_and_0_lifts_it() {
    assert_eq!(rcfarm::server::DEFAULT_HTTP_MAX_CONNS_PER_CLIENT, 200);
    assert_eq!(ServerConfig::default().http_max_conns_per_client, 200);
    assert_eq!(ServerConfig::ephemeral().http_max_conns_per_client, 200);

    for (limit, refused) in [(None, true), (Some(0), false)] {
        let mut config = ServerConfig::ephemeral();
        if let Some(l) = limit {
            config.http_max_conns_per_client = l;
        }
        let s = server_with(config).await;
        let mut held = Vec::new();
        for _ in 0..200 {
            let mut c = tokio::net::TcpStream::connect(s.addr()).await.unwrap();
            assert_eq!(leader_over(&mut c).await.0, "HTTP/1.1 200 OK");
            held.push(c);
        }
        assert_eq!(s.stats().open_conns, 200);
        let mut c = tokio::net::TcpStream::connect(s.addr()).await.unwrap();
        if refused {
            assert_eq!(read_until_closed(&mut c).await, TOO_MANY_CONNS);
            assert_eq!(s.stats().conns_refused, 1);
        } else {
            assert_eq!(
                leader_over(&mut c).await.0,
                "HTTP/1.1 200 OK",
                "limit {limit:?}"
            );
            assert_eq!(s.stats().conns_refused, 0);
        }
    }
}

//! The embedded server's HTTP surface (KV paths, query strings, transaction bodies, sessions)
//! must answer every request, never panic, never hang and never return a 5xx other than the
//! ones Consul itself returns. Input: one method byte, then `path?query`, a newline, the body.
#![no_main]

use std::sync::OnceLock;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request};
use libfuzzer_sys::fuzz_target;
use rcfarm::server::{InProcess, ServerConfig};

struct Harness {
    rt: tokio::runtime::Runtime,
    server: InProcess,
}

fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| {
        // Paused time: a blocking query with `?index=…&wait=10m` resolves at once instead of
        // stalling the fuzzer, while still going through its waiting path.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        let server = rt.block_on(async {
            InProcess::new(ServerConfig {
                session_ttl_min: Duration::from_secs(1),
                ..ServerConfig::ephemeral()
            })
        });
        Harness { rt, server }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&m, rest)) = data.split_first() else { return };
    let method = match m % 6 {
        0 => Method::GET,
        1 => Method::PUT,
        2 => Method::DELETE,
        3 => Method::POST,
        4 => Method::OPTIONS,
        _ => Method::HEAD,
    };
    let (line, body) = match rest.iter().position(|b| *b == b'\n') {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, &[][..]),
    };
    let Ok(line) = std::str::from_utf8(line) else { return };
    let uri = if line.starts_with('/') { line.to_string() } else { format!("/v1/{line}") };
    let Ok(req) = Request::builder().method(method).uri(uri.as_str()).body(Body::from(body.to_vec())) else {
        return;
    };
    let h = harness();
    let resp = h.rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(3600), async {
            let resp = h.server.call(req).await;
            let status = resp.status();
            let bytes = axum::body::to_bytes(resp.into_body(), 64 << 20).await;
            (status, bytes)
        })
        .await
    });
    let (status, body) = resp.expect("every request is answered (time is paused, so this is an hour)");
    let body = body.expect("the body can be read");
    // Consul answers 500 only for a few storage-level failures, always with a message.
    if status.is_server_error() {
        assert!(!body.is_empty(), "{status} with an empty body for {uri}");
    }
});

//! The client's own behaviour: which calls it retries, ACL tokens, unavailability.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use rcfarm::consul::{Consul, ConsulConfig, ConsulError, QueryOptions};
use rcfarm::server::ServerConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::common::server_with;

/// A server that answers every request with 503 and counts requests by method.
async fn flaky_server() -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let count = Arc::new(AtomicUsize::new(0));
    let c = count.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let c = c.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let mut got = Vec::new();
                // Read until the end of headers plus any declared body.
                loop {
                    let n = match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    got.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&got);
                    if let Some(end) = text.find("\r\n\r\n") {
                        let len = text
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length: ")
                                    .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                            })
                            .unwrap_or(0);
                        if got.len() >= end + 4 + len {
                            c.fetch_add(1, Ordering::SeqCst);
                            let body = "No cluster leader";
                            let resp = format!(
                                "HTTP/1.1 503 Service Unavailable\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                                body.len()
                            );
                            let _ = sock.write_all(resp.as_bytes()).await;
                            return;
                        }
                    }
                }
            });
        }
    });
    (format!("http://{addr}"), count)
}

fn fast_retry(url: &str) -> Consul {
    Consul::new(ConsulConfig {
        attempts: 4,
        retry_base: Duration::from_millis(5),
        retry_cap: Duration::from_millis(20),
        ..ConsulConfig::new(url)
    })
    .unwrap()
}

#[tokio::test]
async fn reads_and_idempotent_writes_are_retried_others_are_not() {
    let (url, count) = flaky_server().await;
    let c = fast_retry(&url);

    let err = c.kv_get("k", &QueryOptions::default()).await.unwrap_err();
    assert!(matches!(err, ConsulError::Unavailable { .. }), "{err:?}");
    assert_eq!(count.swap(0, Ordering::SeqCst), 4, "a read is retried");

    c.kv_put("k", b"v", None).await.unwrap_err();
    assert_eq!(
        count.swap(0, Ordering::SeqCst),
        4,
        "a plain PUT is idempotent"
    );

    c.kv_cas("k", b"v", 3, None).await.unwrap_err();
    assert_eq!(
        count.swap(0, Ordering::SeqCst),
        1,
        "a CAS is not retried once it may have been applied"
    );

    c.txn(&[rcfarm::consul::TxnOp::set("k", b"v".to_vec())])
        .await
        .unwrap_err();
    assert_eq!(
        count.swap(0, Ordering::SeqCst),
        1,
        "a write transaction is not retried"
    );

    c.txn(&[rcfarm::consul::TxnOp::get("k")]).await.unwrap_err();
    assert_eq!(
        count.swap(0, Ordering::SeqCst),
        4,
        "a read-only transaction is"
    );

    c.session_create(&Default::default()).await.unwrap_err();
    assert_eq!(
        count.swap(0, Ordering::SeqCst),
        1,
        "creating a session twice would leak one"
    );

    c.session_renew("s").await.unwrap_err();
    assert_eq!(count.swap(0, Ordering::SeqCst), 4);

    // A blocking query is left to its watch loop: one attempt.
    c.kv_get("k", &QueryOptions::blocking(5, Duration::from_secs(1)))
        .await
        .unwrap_err();
    assert_eq!(count.swap(0, Ordering::SeqCst), 1);
}

#[tokio::test]
async fn connection_refused_is_unavailable_and_retried_even_for_writes() {
    // Bind then drop to find a port nobody listens on.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let c = fast_retry(&format!("127.0.0.1:{port}"));
    let started = std::time::Instant::now();
    let err = c.kv_cas("k", b"v", 0, None).await.unwrap_err();
    assert!(
        matches!(&err, ConsulError::Unavailable { reason, .. } if !reason.is_empty()),
        "{err:?}"
    );
    assert!(
        err.to_string().contains(&port.to_string()),
        "the error names the address: {err}"
    );
    assert_eq!(
        c.stats().requests,
        4,
        "a request that never left is safe to retry"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn the_acl_token_is_sent_and_denials_are_typed() {
    let s = server_with(ServerConfig {
        acl_token: Some("tok".into()),
        ..ServerConfig::ephemeral()
    })
    .await;
    let without = Consul::new(ConsulConfig::new(s.url())).unwrap();
    let err = without.kv_put("k", b"v", None).await.unwrap_err();
    assert!(matches!(err, ConsulError::PermissionDenied(_)), "{err:?}");
    assert!(
        err.to_string().contains("CONSUL_HTTP_TOKEN"),
        "says how to fix it: {err}"
    );
    let with = Consul::new(ConsulConfig::new(s.url()).with_token(Some("tok".into()))).unwrap();
    assert!(with.kv_put("k", b"v", None).await.unwrap());
    assert_eq!(with.leader().await.unwrap(), "127.0.0.1:8300");
    assert_eq!(with.peers().await.unwrap(), ["127.0.0.1:8300"]);
}

#[tokio::test]
async fn config_reads_consul_environment_variables() {
    let vars = [
        ("CONSUL_HTTP_ADDR", "10.1.2.3:8500"),
        ("CONSUL_HTTP_SSL", "true"),
        ("CONSUL_HTTP_TOKEN", "abc"),
        ("CONSUL_HTTP_TOKEN_FILE", "/etc/consul/token"),
        ("CONSUL_CACERT", "/etc/consul/ca.pem"),
        ("CONSUL_CAPATH", "/etc/consul/cas"),
        ("CONSUL_CLIENT_CERT", "/etc/consul/client.pem"),
        ("CONSUL_CLIENT_KEY", "/etc/consul/client-key.pem"),
        ("CONSUL_TLS_SERVER_NAME", "server.dc1.consul"),
        ("CONSUL_HTTP_SSL_VERIFY", "0"),
    ];
    // SAFETY of the test: nextest runs each test in a process of its own.
    unsafe {
        for (k, v) in vars {
            std::env::set_var(k, v);
        }
    }
    let cfg = ConsulConfig::from_env().unwrap();
    assert_eq!(cfg.address, "https://10.1.2.3:8500");
    assert_eq!(cfg.token.as_deref(), Some("abc"));
    let path = |p: &str| Some(std::path::PathBuf::from(p));
    assert_eq!(cfg.token_file, path("/etc/consul/token"));
    assert_eq!(cfg.tls.ca_file, path("/etc/consul/ca.pem"));
    assert_eq!(cfg.tls.ca_path, path("/etc/consul/cas"));
    assert_eq!(cfg.tls.client_cert, path("/etc/consul/client.pem"));
    assert_eq!(cfg.tls.client_key, path("/etc/consul/client-key.pem"));
    assert_eq!(cfg.tls.server_name.as_deref(), Some("server.dc1.consul"));
    assert!(cfg.tls.skip_verify);

    unsafe {
        std::env::set_var("CONSUL_HTTP_SSL_VERIFY", "maybe");
    }
    let Err(ConsulError::Config(msg)) = ConsulConfig::from_env() else {
        panic!("a boolean that does not parse is refused");
    };
    assert!(
        msg.contains("CONSUL_HTTP_SSL_VERIFY") && msg.contains("\"maybe\""),
        "{msg}"
    );

    unsafe {
        for (k, _) in vars {
            std::env::remove_var(k);
        }
        std::env::set_var("CONSUL_HTTP_ADDR", "10.1.2.3:8500");
        std::env::set_var("CONSUL_HTTP_TOKEN", "abc");
    }
    let cfg = ConsulConfig::from_env().unwrap();
    assert_eq!(cfg.token.as_deref(), Some("abc"));
    let c = Consul::new(cfg).unwrap();
    assert_eq!(c.address(), "http://10.1.2.3:8500");
}

//! `rcfarm consul-dev` as a process: durability across `kill -9`, startup messages, CLI errors.

use std::collections::HashMap;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rcfarm::consul::{Consul, ConsulConfig, QueryOptions, SessionBehavior, SessionRequest, TxnOp};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const BIN: &str = env!("CARGO_BIN_EXE_rcfarm");

/// Starts `rcfarm consul-dev` on an ephemeral port and returns it with its URL.
async fn spawn_server(
    data_dir: Option<&Path>,
    extra: &[&str],
) -> (Child, String, Arc<Mutex<String>>) {
    let mut cmd = Command::new(BIN);
    cmd.args(["consul-dev", "--listen", "127.0.0.1:0"])
        .args(extra);
    if let Some(d) = data_dir {
        cmd.arg("--data-dir").arg(d);
    }
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn().expect("rcfarm starts");
    let stderr = Arc::new(Mutex::new(String::new()));
    let mut err_lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let sink = stderr.clone();
    tokio::spawn(async move {
        while let Ok(Some(l)) = err_lines.next_line().await {
            let mut s = sink.lock();
            s.push_str(&l);
            s.push('\n');
        }
    });
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("server announces itself")
        .unwrap()
        .unwrap_or_else(|| panic!("server exited early: {}", stderr.lock()));
    let url = line
        .strip_prefix("consul-dev listening on ")
        .expect("announce line")
        .to_string();
    (child, url, stderr)
}

fn client(url: &str) -> Consul {
    Consul::new(ConsulConfig {
        attempts: 1,
        ..ConsulConfig::new(url)
    })
    .unwrap()
}

#[tokio::test]
async fn every_acknowledged_write_survives_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, url, _) = spawn_server(Some(dir.path()), &["--session-ttl-min", "1s"]).await;
    let c = client(&url);

    // A session holding a lock, to check sessions come back with their keys.
    let sess = c
        .session_create(&SessionRequest {
            name: Some("survivor".into()),
            ttl: Some(Duration::from_secs(3)),
            behavior: Some(SessionBehavior::Release),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(c.kv_acquire("locks/a", b"held", &sess, None).await.unwrap());
    c.kv_put("doomed", b"x", None).await.unwrap();
    c.kv_delete("doomed").await.unwrap();

    let acked: Arc<Mutex<HashMap<String, String>>> = Arc::default();
    let attempted_txns: Arc<Mutex<Vec<u32>>> = Arc::default();
    let stop = tokio_util::sync::CancellationToken::new();
    let mut writers = Vec::new();
    for w in 0..8u32 {
        let c = c.clone();
        let acked = acked.clone();
        let txns = attempted_txns.clone();
        let stop = stop.clone();
        writers.push(tokio::spawn(async move {
            let mut i = 0u32;
            while !stop.is_cancelled() {
                i += 1;
                if w == 0 {
                    // Transactions: all three keys or none, whatever the crash timing.
                    let n = i;
                    txns.lock().push(n);
                    let ops: Vec<TxnOp> = (0..3)
                        .map(|k| TxnOp::set(format!("txn/{n}/{k}"), format!("{n}").into_bytes()))
                        .collect();
                    if c.txn(&ops).await.is_ok() {
                        let mut a = acked.lock();
                        for k in 0..3 {
                            a.insert(format!("txn/{n}/{k}"), format!("{n}"));
                        }
                    }
                } else {
                    let key = format!("w/{w}/{i}");
                    let val = format!("value-{w}-{i}");
                    if let Ok(true) = c.kv_put(&key, val.as_bytes(), None).await {
                        acked.lock().insert(key, val);
                    }
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    child.start_kill().unwrap(); // SIGKILL
    child.wait().await.unwrap();
    stop.cancel();
    for w in writers {
        w.await.unwrap();
    }
    let acked = acked.lock().clone();
    assert!(
        acked.len() > 100,
        "the writers made progress before the kill: {}",
        acked.len()
    );

    let (_child2, url2, stderr2) =
        spawn_server(Some(dir.path()), &["--session-ttl-min", "1s"]).await;
    let c2 = client(&url2);
    let (all, _) = c2.kv_list("", &QueryOptions::default()).await.unwrap();
    let stored: HashMap<String, String> = all
        .iter()
        .map(|e| {
            (
                e.key.clone(),
                String::from_utf8_lossy(e.value_bytes()).into_owned(),
            )
        })
        .collect();
    let lost: Vec<&String> = acked
        .keys()
        .filter(|k| stored.get(*k) != acked.get(*k))
        .collect();
    assert!(
        lost.is_empty(),
        "{} acknowledged writes lost, e.g. {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
    for n in attempted_txns.lock().iter() {
        let present = (0..3)
            .filter(|k| stored.contains_key(&format!("txn/{n}/{k}")))
            .count();
        assert!(
            present == 0 || present == 3,
            "transaction {n} half applied ({present}/3)"
        );
    }
    assert!(!stored.contains_key("doomed"));

    // The session is back with a fresh TTL timer and still holds its lock...
    let (info, _) = c2
        .session_info(&sess, &QueryOptions::default())
        .await
        .unwrap();
    assert_eq!(info.expect("session restored").name, "survivor");
    assert_eq!(stored.get("locks/a").map(String::as_str), Some("held"));
    let lock = c2
        .kv_get("locks/a", &QueryOptions::default())
        .await
        .unwrap()
        .0
        .unwrap();
    assert_eq!(lock.session.as_deref(), Some(sess.as_str()));
    // ...and expires 2×TTL later, releasing it, since nobody renews it any more.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let e = c2
            .kv_get("locks/a", &QueryOptions::default())
            .await
            .unwrap()
            .0
            .unwrap();
        if e.session.is_none() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "restored session never expired"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        stderr2.lock().contains("recovered index"),
        "{}",
        stderr2.lock()
    );
}

#[tokio::test]
async fn indexes_continue_after_a_restart_with_data_dir() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, url, _) = spawn_server(Some(dir.path()), &[]).await;
    let c = client(&url);
    for i in 0..20 {
        c.kv_put(&format!("i/{i}"), b"x", None).await.unwrap();
    }
    let (_, before) = c.kv_list("i/", &QueryOptions::default()).await.unwrap();
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    let (_c2, url2, _) = spawn_server(Some(dir.path()), &[]).await;
    let c2 = client(&url2);
    let (_, same) = c2.kv_list("i/", &QueryOptions::default()).await.unwrap();
    assert_eq!(same.index, before.index, "indexes are durable too");
    c2.kv_put("i/new", b"x", None).await.unwrap();
    let (_, after) = c2.kv_list("i/", &QueryOptions::default()).await.unwrap();
    assert!(
        after.index > before.index,
        "indexes never go backwards across restarts"
    );
}

#[tokio::test]
async fn a_data_dir_serves_one_server_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let (_first, _, _) = spawn_server(Some(dir.path()), &[]).await;
    let out = Command::new(BIN)
        .args(["consul-dev", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path())
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("in use by another server"), "{err}");
}

#[tokio::test]
async fn startup_says_where_and_how_durable() {
    let (_child, url, stderr) = spawn_server(None, &[]).await;
    assert!(url.starts_with("http://127.0.0.1:"));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let s = stderr.lock().clone();
        if s.contains("loopback only") && s.contains("memory only") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "startup messages missing: {s}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn cli_mistakes_exit_2_and_say_what_to_do() {
    for (args, needle) in [
        (
            vec!["consul-dev", "--listen", "not-an-address"],
            "invalid socket address",
        ),
        (vec!["consul-dev", "--session-ttl-min", "10"], "use a unit"),
        (vec!["consul-dev", "--bogus"], "--bogus"),
    ] {
        let out = Command::new(BIN).args(&args).output().await.unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// `--http-max-conns-per-client` reaches the server (`rcfarm consul-dev`, and `rcfarm dev`,
/// which takes the same server flags).
#[tokio::test]
async fn http_max_conns_per_client_flag_limits_connections_per_ip() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_child, url, _) = spawn_server(None, &["--http-max-conns-per-client", "1"]).await;
    let addr = url.strip_prefix("http://").unwrap();
    let mut first = tokio::net::TcpStream::connect(addr).await.unwrap();
    first
        .write_all(b"GET /v1/status/leader HTTP/1.1\r\nHost: consul\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 12];
    first.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"HTTP/1.1 200", "the first connection is served");
    let mut second = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), second.read_to_end(&mut got))
        .await
        .expect("the server closes the second connection")
        .unwrap();
    let got = String::from_utf8(got).unwrap();
    assert!(
        got.starts_with("HTTP/1.1 429 Too Many Requests\r\n")
            && got.ends_with(
                "\r\n\r\nYour IP is issuing too many concurrent connections, please rate limit your calls\n"
            ),
        "{got:?}"
    );

    for sub in ["consul-dev", "dev"] {
        let out = Command::new(BIN)
            .args([sub, "--help"])
            .output()
            .await
            .unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(
            help.contains("--http-max-conns-per-client <HTTP_MAX_CONNS_PER_CLIENT>")
                && help.contains("[default: 200]"),
            "{sub} --help: {help}"
        );
    }
}

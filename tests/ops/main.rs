//! The operator surface: the farm's HTTP API and status page (in headless Chromium), rcctl,
//! configuration, the compose file, and the README walkthrough.

#[path = "../common/mod.rs"]
mod common;

mod alerting;
mod browser;
mod cli;
mod files;
mod http;
mod secrets;

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rcfarm::server::{EmbeddedServer, ServerConfig};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

pub const RCFARM: &str = env!("CARGO_BIN_EXE_rcfarm");
pub const RCCTL: &str = env!("CARGO_BIN_EXE_rcctl");

/// The test tools' binary (`rcfarm-tools`, package `rcfarm-tools`): cargo puts it beside
/// `rcfarm` when it builds the workspace (`scripts/test` does), but a package's tests cannot name
/// another package's binary, so it is found there.
pub fn rcfarm_tools() -> std::path::PathBuf {
    let tools = std::path::Path::new(RCFARM).with_file_name("rcfarm-tools");
    assert!(
        tools.is_file(),
        "{} not built: build the workspace's binaries (cargo build --workspace --bins), or run \
         the tests with scripts/test",
        tools.display()
    );
    tools
}

/// An embedded server in this process and one `rcfarm serve` process with its HTTP API on an
/// ephemeral port.
pub struct Setup {
    pub server: EmbeddedServer,
    pub farm: Child,
    pub http: String,
    pub audit_db: String,
    pub log: Arc<Mutex<String>>,
    pub dir: tempfile::TempDir,
}

pub async fn setup(extra: &[&str]) -> Setup {
    common::init_tracing();
    let server = EmbeddedServer::start(ServerConfig {
        session_ttl_min: Duration::from_secs(1),
        ..ServerConfig::ephemeral()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let audit_db = format!("sqlite://{}", dir.path().join("audit.db").display());
    let (farm, http, log) = spawn_farm(&server.url(), "ops", &audit_db, extra).await;
    Setup {
        server,
        farm,
        http,
        audit_db,
        log,
        dir,
    }
}

/// Starts `rcfarm serve` against `consul` with its HTTP API on an ephemeral port; returns the
/// process, the API's URL and its log as it grows.
pub async fn spawn_farm(
    consul: &str,
    farm_id: &str,
    audit_db: &str,
    extra: &[&str],
) -> (Child, String, Arc<Mutex<String>>) {
    let mut farm = Command::new(RCFARM)
        .args([
            "serve",
            "--consul",
            consul,
            "--farm-id",
            farm_id,
            "--http",
            "127.0.0.1:0",
        ])
        .args([
            "--session-ttl",
            "2s",
            "--resync-interval",
            "1s",
            "--audit-db",
            audit_db,
        ])
        .args(["--max-removals", "100000", "--failsafe-confirm", "0s"])
        .args(extra)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let log = Arc::new(Mutex::new(String::new()));
    let sink = log.clone();
    let mut lines = BufReader::new(farm.stderr.take().unwrap()).lines();
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let mut tx = Some(tx);
        while let Ok(Some(l)) = lines.next_line().await {
            if let Some(pos) = l.find("status page on ")
                && let Some(tx) = tx.take()
            {
                let url = l[pos + "status page on ".len()..]
                    .trim()
                    .trim_end_matches('/')
                    .to_string();
                let _ = tx.send(url);
            }
            let mut s = sink.lock();
            s.push_str(&l);
            s.push('\n');
        }
    });
    let http = tokio::time::timeout(Duration::from_secs(30), rx)
        .await
        .unwrap_or_else(|_| panic!("farm did not announce its HTTP address: {}", log.lock()))
        .unwrap();
    (farm, http, log)
}

/// Runs rcctl against the setup's server; returns (exit code, stdout, stderr).
pub async fn rcctl(s: &Setup, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(RCCTL)
        .args(args)
        .env("CONSUL_HTTP_ADDR", s.server.url())
        .env("RCFARM_AUDIT_DB", &s.audit_db)
        .env_remove("CONSUL_HTTP_TOKEN")
        .output()
        .await
        .unwrap();
    common::outcome(out)
}

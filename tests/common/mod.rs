//! Helpers shared by the integration test binaries.
#![allow(dead_code)]

use std::time::Duration;

use rcfarm::consul::{Consul, ConsulConfig};
use rcfarm::server::{EmbeddedServer, ServerConfig};

/// An embedded server on an ephemeral loopback port, accepting TTLs down to 1 s.
pub async fn server() -> EmbeddedServer {
    server_with(ServerConfig {
        session_ttl_min: Duration::from_secs(1),
        ..ServerConfig::ephemeral()
    })
    .await
}

/// A server on `config.listen`; where that names port 0, on a free port from below the
/// ephemeral range instead, so that a test restarting it on its port (the same `listen`) never
/// finds the port taken by a connection made while it was down.
pub async fn server_with(mut config: ServerConfig) -> EmbeddedServer {
    init_tracing();
    if config.listen.port() == 0
        && let std::net::IpAddr::V4(ip) = config.listen.ip()
    {
        let port =
            rcfarm_testkit::chaos::agent::ports_below_ephemeral(ip, 1).expect("a free port")[0];
        config.listen.set_port(port);
    }
    EmbeddedServer::start(config)
        .await
        .expect("embedded server starts")
}

pub fn client(server: &EmbeddedServer) -> Consul {
    client_for(&server.url())
}

pub fn client_for(url: &str) -> Consul {
    Consul::new(ConsulConfig::new(url)).expect("client builds")
}

/// The real Consul of `RCFARM_TEST_CONSUL_BIN`, or `None` after saying loudly that the test
/// is skipped on it.
pub fn real_consul_bin() -> Option<std::path::PathBuf> {
    let bin = rcfarm_testkit::chaos::agent::consul_bin();
    if bin.is_none() {
        eprintln!(
            "SKIPPED on real Consul: set {} to a Consul binary (.ci/run sets it to ../shared/consul/consul)",
            rcfarm_testkit::chaos::agent::CONSUL_BIN_ENV
        );
    }
    bin
}

/// The keys of the audit database's dead letters, in key order, each as often as stored.
pub async fn dead_letter_keys(store: &rcfarm::audit::AuditStore) -> Vec<String> {
    store
        .dead_letters()
        .await
        .expect("dead letters read")
        .into_iter()
        .map(|(k, _)| k)
        .collect()
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// Polls `f` until it returns `Some`, or panics with `what` after `timeout`.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until at least `n` blocking queries are parked on `s`. A test of what wakes a
/// query (or what does not) acts once its query waits on the server, not after a fixed sleep.
pub async fn parked(s: &EmbeddedServer, n: usize) {
    eventually(
        Duration::from_secs(10),
        &format!("{n} blocking queries parked on the server"),
        || async { (s.stats().blocked_queries >= n).then_some(()) },
    )
    .await
}

/// A raw HTTP client, for checking exact statuses, headers and bodies.
pub fn http() -> reqwest::Client {
    rcfarm::consul::init_tls();
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("reqwest client")
}

/// The Python virtualenv with the pinned third-party clients of `tests/interop/requirements.txt`,
/// created on first use (under a file lock: test processes run in parallel). Set
/// `RCFARM_PY_VENV` to use another one.
pub fn py_venv() -> std::path::PathBuf {
    use std::path::PathBuf;
    use std::process::Command;
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let venv = std::env::var_os("RCFARM_PY_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target").join("py-venv"));
    let reqs = root.join("tests").join("interop").join("requirements.txt");
    let wanted = std::fs::read_to_string(&reqs).expect("requirements.txt");
    let marker = venv.join(".rcfarm-installed");
    std::fs::create_dir_all(venv.parent().unwrap()).unwrap();
    let lock = std::fs::File::create(venv.with_extension("lock")).unwrap();
    lock.lock().unwrap();
    if std::fs::read_to_string(&marker).ok().as_deref() == Some(wanted.as_str()) {
        return venv;
    }
    eprintln!(
        "creating the Python venv {} for interop tests (pip install -r {})",
        venv.display(),
        reqs.display()
    );
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let st = Command::new(&python)
        .args(["-m", "venv", "--clear"])
        .arg(&venv)
        .status()
        .expect("python3 runs");
    assert!(st.success(), "python3 -m venv failed: install python3-venv");
    let st = Command::new(venv.join("bin").join("pip"))
        .args(["install", "--quiet", "--disable-pip-version-check", "-r"])
        .arg(&reqs)
        .status()
        .expect("pip runs");
    assert!(
        st.success(),
        "pip install -r {} failed (is PyPI reachable?)",
        reqs.display()
    );
    std::fs::write(&marker, wanted).unwrap();
    venv
}

/// A finished process as tests read it: exit code (-1 when killed by a signal), stdout, stderr.
pub fn outcome(out: std::process::Output) -> (i32, String, String) {
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

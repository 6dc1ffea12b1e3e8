//! A real third-party client, Python's `py-consul` (pinned), against the embedded server.

use std::time::Duration;

use crate::common::{py_venv, server};

#[tokio::test]
async fn py_consul_drives_kv_sessions_blocking_and_txn() {
    let s = server().await;
    let venv = tokio::task::spawn_blocking(py_venv).await.unwrap();
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/interop/py_consul_check.py");
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(venv.join("bin").join("python"))
            .arg(&script)
            .arg(s.addr().ip().to_string())
            .arg(s.addr().port().to_string())
            .output(),
    )
    .await
    .expect("the interop script finishes")
    .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "py-consul interop failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("all checks passed"), "{stdout}");
}

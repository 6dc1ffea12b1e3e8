//! Files operators use as they are: the README walkthrough (run verbatim), the compose file.

use std::process::Stdio;
use std::time::Duration;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Every command of the README walkthrough, pasted into bash as written, works.
#[tokio::test]
async fn the_readme_walkthrough_runs_as_written() {
    let readme = std::fs::read_to_string(format!("{ROOT}/README.md")).unwrap();
    let block = readme
        .split("<!-- walkthrough:start -->")
        .nth(1)
        .and_then(|s| s.split("<!-- walkthrough:end -->").next())
        .expect("the README has a walkthrough block");
    let script = block
        .trim()
        .trim_start_matches("```sh")
        .trim_end_matches("```");
    let dir = tempfile::tempdir().unwrap();
    let bin_dir = std::path::Path::new(crate::RCFARM)
        .parent()
        .unwrap()
        .to_path_buf();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // The walkthrough uses the default addresses; the test moves them to free ports through
    // the environment variables every option has.
    let (consul_port, http_port) = (free_port(), free_port());
    let wrapped = format!(
        "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n{script}\necho WALKTHROUGH-DONE\n"
    );
    let out = tokio::time::timeout(
        Duration::from_secs(240),
        tokio::process::Command::new("bash")
            .arg("-c")
            .arg(&wrapped)
            .current_dir(dir.path())
            .env("PATH", path)
            .env(
                "RCFARM_CONSUL_DEV_LISTEN",
                format!("127.0.0.1:{consul_port}"),
            )
            .env(
                "CONSUL_HTTP_ADDR",
                format!("http://127.0.0.1:{consul_port}"),
            )
            .env("RCFARM_HTTP", format!("127.0.0.1:{http_port}"))
            .env_remove("RCFARM_AUDIT_DB")
            .env_remove("CONSUL_HTTP_TOKEN")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the walkthrough finishes within 4 minutes")
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let dev_log = std::fs::read_to_string(dir.path().join("dev.log")).unwrap_or_default();
    assert!(
        out.status.success() && stdout.contains("WALKTHROUGH-DONE"),
        "walkthrough failed ({:?})\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}\n--- dev.log (tail) ---\n{}",
        out.status,
        dev_log
            .lines()
            .rev()
            .take(40)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n")
    );
    // What it showed is what an operator expects to see.
    assert!(
        stdout.contains("node-1") && stdout.contains("env=prod"),
        "{stdout}"
    );
    assert!(
        stdout.contains("Current:        3 on node-1, node-2, node-3"),
        "{stdout}"
    );
    assert!(
        stdout.contains("REPLICATION_CONTROLLER_RETARGET"),
        "the audit log shows the retargets:\n{stdout}"
    );
    assert!(
        stdout.contains("second") || stdout.contains("dev"),
        "rcctl farms listed the farms:\n{stdout}"
    );
    assert!(stdout.contains("deleted"), "{stdout}");
}

#[test]
fn the_compose_file_is_valid_and_complete() {
    let text = std::fs::read_to_string(format!("{ROOT}/docker-compose.yml")).unwrap();
    let mut doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).expect("valid YAML");
    doc.apply_merge().expect("merge keys resolve");
    let services = doc["services"].as_mapping().expect("services");
    let consul = &doc["services"]["consul"];
    assert!(
        consul["image"]
            .as_str()
            .unwrap()
            .starts_with("hashicorp/consul:"),
        "a real Consul server"
    );
    assert!(
        consul["command"]
            .as_sequence()
            .unwrap()
            .iter()
            .any(|a| a.as_str() == Some("-server"))
    );
    assert!(
        doc["services"]["postgres"]["image"]
            .as_str()
            .unwrap()
            .starts_with("postgres:")
    );
    let farms: Vec<&str> = services
        .keys()
        .filter_map(|k| k.as_str())
        .filter(|k| k.starts_with("farm"))
        .collect();
    assert_eq!(farms.len(), 3, "three farms: {farms:?}");
    for name in ["consul", "postgres"].iter().chain(farms.iter()) {
        let s = &doc["services"][*name];
        assert!(
            s["healthcheck"]["test"]
                .as_sequence()
                .is_some_and(|t| !t.is_empty()),
            "{name} has a health check"
        );
    }
    let mut ids = std::collections::BTreeSet::new();
    for f in &farms {
        let s = &doc["services"][*f];
        assert_eq!(
            s["build"].as_str(),
            Some("."),
            "{f} is built from the repo's Dockerfile"
        );
        assert_eq!(
            s["depends_on"]["consul"]["condition"].as_str(),
            Some("service_healthy")
        );
        assert_eq!(
            s["depends_on"]["postgres"]["condition"].as_str(),
            Some("service_healthy")
        );
        let env = &s["environment"];
        assert_eq!(env["CONSUL_HTTP_ADDR"].as_str(), Some("http://consul:8500"));
        assert!(
            env["RCFARM_AUDIT_DB"]
                .as_str()
                .unwrap()
                .starts_with("postgres://")
        );
        assert!(env["RCFARM_HTTP"].as_str().unwrap().starts_with("0.0.0.0:"));
        ids.insert(env["RCFARM_FARM_ID"].as_str().unwrap().to_string());
    }
    assert_eq!(ids.len(), 3, "distinct farm ids");
    let dockerfile = std::fs::read_to_string(format!("{ROOT}/Dockerfile")).unwrap();
    assert!(dockerfile.contains("cargo build --release --locked --bin rcfarm --bin rcctl"));
    assert!(
        dockerfile.contains("COPY migrations migrations"),
        "migrations are embedded at build time"
    );
    assert!(
        dockerfile.contains("curl"),
        "the health check's curl is installed"
    );
}

#[test]
fn every_audit_event_type_is_in_the_catalog() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/audit-events.md"))
        .unwrap();
    for t in rcfarm::audit::events::ALL {
        assert!(
            doc.contains(&format!("`{t}`")),
            "docs/audit-events.md lacks {t}"
        );
    }
}

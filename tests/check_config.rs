//! `rcfarm check-config FILE`, run as the real binary: what the service's ExecStartPre runs.

use std::process::{Command, Output};

const RCFARM: &str = env!("CARGO_BIN_EXE_rcfarm");
const DEPLOYED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/rcfarm.toml");

fn check_config(file: &str) -> Output {
    Command::new(RCFARM)
        .args(["check-config", file])
        .env_remove("RCFARM_CONFIG")
        .output()
        .expect("rcfarm runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn a_bad_file_gets_every_mistake_with_its_line_and_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "farm-id = \"farm-a\"\n\
         sesion-ttl = \"20s\"\n\
         lock-delay = \"soon\"\n\
         http = \"nowhere\"\n\
         transfer-static = \"yes\"\n\
         scheduler = \"magic\"\n",
    )
    .unwrap();
    let file = bad.to_str().unwrap();
    let out = check_config(file);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    for line in [
        format!("{file}:2: key `sesion-ttl`: unknown key; did you mean `session-ttl`?"),
        format!("{file}:3: key `lock-delay`: invalid value \"soon\""),
        format!(
            "{file}:4: key `http`: --http \"nowhere\": give an address like 127.0.0.1:8791, or off"
        ),
        format!("{file}:5: key `transfer-static`: a switch takes true or false (unquoted)"),
        format!("{file}:6: key `scheduler`: invalid value \"magic\"; possible values: label, pool"),
        format!("{file}: 5 problems"),
    ] {
        assert!(err.contains(&line), "{line:?} in:\n{err}");
    }
    // In the order of the file, one line each, then the summary.
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 6, "{err}");
    assert!(
        lines[0].contains(":2:") && lines[4].contains(":6:"),
        "{err}"
    );
    assert!(text(&out.stdout).is_empty());
}

#[test]
fn a_syntax_error_is_reported_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("syntax.toml");
    std::fs::write(&bad, "farm-id = \"a\"\nsession-ttl = 15s\n").unwrap();
    let file = bad.to_str().unwrap();
    let out = check_config(file);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!("{file}:2: TOML syntax error")),
        "{err}"
    );
}

#[test]
fn the_deployed_config_is_ok_whatever_the_environment_says() {
    // The file is checked on its own: a bad RCFARM_* variable is no mistake of the file's.
    let out = Command::new(RCFARM)
        .args(["check-config", DEPLOYED])
        .env("RCFARM_SESSION_TTL", "bogus")
        .env_remove("RCFARM_CONFIG")
        .output()
        .unwrap();
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout.starts_with(&format!("{DEPLOYED}: ok (")) && stdout.contains(" settings)"),
        "{stdout}"
    );
}

#[test]
fn an_unreadable_file_is_exit_2() {
    let out = check_config("/nonexistent/rcfarm.toml");
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("/nonexistent/rcfarm.toml: cannot read it"),
        "{err}"
    );
}

#[test]
fn version() {
    let out = Command::new(RCFARM).arg("--version").output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        text(&out.stdout).trim(),
        format!("rcfarm {}", env!("CARGO_PKG_VERSION"))
    );
}

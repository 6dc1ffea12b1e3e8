//! Never print a password or a token (issue 36, item 8): a password planted in `--audit-db`
//! (in the URL's user info and as `?password=`) and a token planted as the Consul ACL token
//! never appear in what `rcfarm` or `rcctl` write to stderr or stdout, on bad input and on
//! good, with debug logging on.

use std::process::Stdio;
use std::time::Duration;

use rcfarm::server::{EmbeddedServer, ServerConfig};
use tokio::process::Command;

use crate::{RCCTL, RCFARM};

const PASSWORD: &str = "PlantedPassw0rd";
const TOKEN: &str = "planted-consul-t0ken";

/// Fails if `text` shows a planted secret.
fn clean(what: &str, text: &str) {
    assert!(
        !text.contains(PASSWORD) && !text.contains(TOKEN),
        "{what} printed a secret:\n{text}"
    );
}

/// Runs a command to its end (at most 20 s): exit code and everything it printed.
async fn run(bin: &str, args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let out = tokio::time::timeout(
        Duration::from_secs(20),
        Command::new(bin)
            .args(args)
            .env_remove("CONSUL_HTTP_TOKEN")
            .env_remove("RCFARM_AUDIT_DB")
            .envs(env.iter().copied())
            .env("RUST_LOG", "debug")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the command ends")
    .unwrap();
    (out.status.code(), printed(&out))
}

/// Everything a process printed, stdout then stderr.
fn printed(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs `rcfarm serve` for `secs` seconds, then stops it: everything it printed.
async fn serve_for(args: &[&str], env: &[(&str, &str)], secs: u64) -> String {
    let mut child = Command::new(RCFARM)
        .arg("serve")
        .args(args)
        .env_remove("CONSUL_HTTP_TOKEN")
        .env_remove("RCFARM_AUDIT_DB")
        .envs(env.iter().copied())
        .env("RUST_LOG", "debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &child.id().unwrap().to_string()])
        .status();
    let _ = tokio::time::timeout(Duration::from_secs(15), child.wait()).await;
    let _ = child.start_kill();
    printed(&child.wait_with_output().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_password_or_token_is_ever_printed() {
    crate::common::init_tracing();
    let server = EmbeddedServer::start(ServerConfig {
        session_ttl_min: Duration::from_secs(1),
        acl_token: Some(TOKEN.into()),
        ..ServerConfig::ephemeral()
    })
    .await
    .unwrap();
    let consul = server.url();
    let dir = tempfile::tempdir().unwrap();
    let sqlite = format!("sqlite://{}", dir.path().join("audit.db").display());
    let pw_url = |scheme: &str, port: u16| {
        format!(
            "{scheme}://rcfarm:{PASSWORD}@127.0.0.1:{port}/rcfarm?sslmode=disable&password={PASSWORD}"
        )
    };

    // Bad input: a mistyped scheme, at start (exit 2).
    let (code, out) = run(
        RCFARM,
        &[
            "serve",
            "--consul",
            &consul,
            "--audit-db",
            &pw_url("postgress", 5432),
        ],
        &[("CONSUL_HTTP_TOKEN", TOKEN)],
    )
    .await;
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("--audit-db") && out.contains("***"), "{out}");
    clean("rcfarm serve with a mistyped --audit-db scheme", &out);

    // Bad input: a database that cannot be reached, tried again and again while the farm
    // serves (with the token on the command line, which draws a warning).
    let out = serve_for(
        &[
            "--consul",
            &consul,
            "--consul-token",
            TOKEN,
            "--http",
            "off",
            "--session-ttl",
            "2s",
            "--audit-db",
            &pw_url("postgres", 1),
        ],
        &[],
        // The first connection attempt gives up after the pool's 10 s.
        13,
    )
    .await;
    assert!(out.contains("audit database unavailable"), "{out}");
    clean("rcfarm serve with an unreachable --audit-db", &out);

    // Bad input: a wrong token.
    let out = serve_for(
        &["--consul", &consul, "--http", "off", "--audit-db", &sqlite],
        &[("CONSUL_HTTP_TOKEN", "not-the-token-planted-consul-t0ken-x")],
        2,
    )
    .await;
    clean(
        "rcfarm serve with a wrong token",
        &out.replace("not-the-token-planted-consul-t0ken-x", "<wrong>"),
    );

    // Bad input: check-config of a file with both secrets and a mistake.
    let toml = dir.path().join("farm.toml");
    std::fs::write(
        &toml,
        format!(
            "consul-token = \"{TOKEN}\"\naudit-db = \"{}\"\nsesion-ttl = \"15s\"\n",
            pw_url("mysql", 3306)
        ),
    )
    .unwrap();
    let (code, out) = run(RCFARM, &["check-config", toml.to_str().unwrap()], &[]).await;
    assert_eq!(code, Some(2), "{out}");
    clean("rcfarm check-config", &out);

    // Bad input for rcctl: a mistyped scheme, an unreachable database, a wrong token.
    for (what, db) in [
        ("a mistyped scheme", pw_url("postgress", 5432)),
        ("an unreachable database", pw_url("postgres", 1)),
    ] {
        let (code, out) = run(
            RCCTL,
            &["--consul", &consul, "audit", "--audit-db", &db],
            &[("CONSUL_HTTP_TOKEN", TOKEN)],
        )
        .await;
        assert_ne!(code, Some(0), "{what}: {out}");
        clean(&format!("rcctl audit with {what}"), &out);
    }
    let (code, out) = run(
        RCCTL,
        &["--consul", &consul, "--consul-token", "x", "rc", "list"],
        &[],
    )
    .await;
    assert_ne!(code, Some(0), "{out}");
    clean("rcctl with a wrong token", &out);

    // Good input: the farm with the token and a database URL carrying a password (PostgreSQL
    // with trust authentication ignores it), serving for a while with debug logs.
    let db = match std::env::var("RCFARM_TEST_POSTGRES_URL") {
        Ok(u) => {
            // postgres://user@host:port/db → with a password in both places.
            let (scheme, rest) = u.split_once("://").unwrap();
            let (user, host) = rest.split_once('@').unwrap_or(("postgres", rest));
            format!("{scheme}://{user}:{PASSWORD}@{host}?password={PASSWORD}")
        }
        Err(_) => {
            eprintln!(
                "note: RCFARM_TEST_POSTGRES_URL is not set; the good-input farm uses SQLite (no password in its URL)"
            );
            sqlite.clone()
        }
    };
    let out = serve_for(
        &[
            "--consul",
            &consul,
            "--http",
            "127.0.0.1:0",
            "--session-ttl",
            "2s",
            "--audit-db",
            &db,
        ],
        &[("CONSUL_HTTP_TOKEN", TOKEN)],
        5,
    )
    .await;
    assert!(out.contains("serving"), "{out}");
    clean("rcfarm serve on good input", &out);
    let (code, out) = run(
        RCCTL,
        &["--consul", &consul, "farms"],
        &[("CONSUL_HTTP_TOKEN", TOKEN)],
    )
    .await;
    assert_eq!(code, Some(0), "{out}");
    clean("rcctl farms", &out);
    let (code, out) = run(
        RCCTL,
        &[
            "--consul",
            &consul,
            "audit",
            "--audit-db",
            &db,
            "--limit",
            "3",
        ],
        &[("CONSUL_HTTP_TOKEN", TOKEN)],
    )
    .await;
    assert_eq!(code, Some(0), "{out}");
    clean("rcctl audit", &out);
}

#[test]
fn configs_holding_secrets_print_them_hidden() {
    let consul =
        rcfarm::consul::ConsulConfig::new("http://127.0.0.1:8500").with_token(Some(TOKEN.into()));
    let shown = format!("{consul:?}");
    assert!(shown.contains("***") && !shown.contains(TOKEN), "{shown}");
    let server = ServerConfig {
        acl_token: Some(TOKEN.into()),
        ..ServerConfig::ephemeral()
    };
    let shown = format!("{server:?}");
    assert!(shown.contains("***") && !shown.contains(TOKEN), "{shown}");
    let url = rcfarm::audit::store::DbUrl::new(format!(
        "postgres://u:{PASSWORD}@h/db?password={PASSWORD}"
    ));
    for shown in [format!("{url:?}"), url.to_string()] {
        assert!(
            shown.contains("***") && !shown.contains(PASSWORD),
            "{shown}"
        );
    }
    assert!(url.expose().contains(PASSWORD));
}

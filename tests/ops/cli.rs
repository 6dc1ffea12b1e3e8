//! rcctl and rcfarm as an operator uses them: exit codes, JSON, dry runs, errors that say what
//! to do, configuration.

use std::time::Duration;

use rcfarm::labels::{LabelSet, LabelStore, LabelType};
use serde_json::Value;

use crate::common::{client, eventually};
use crate::{RCFARM, rcctl, setup};

async fn label(s: &crate::Setup, nodes: &[&str]) {
    for n in nodes {
        let l: LabelSet = [("env".to_string(), "prod".to_string())].into();
        LabelStore::new(client(&s.server))
            .set(LabelType::Node, n, &l)
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn rcctl_commands_exit_codes_json_and_dry_runs() {
    let s = setup(&[]).await;
    label(&s, &["n1", "n2"]).await;
    let m = s.dir.path().join("web.yaml");
    std::fs::write(&m, "id: web\nlaunchables: {}\n").unwrap();
    let mpath = m.to_str().unwrap();

    // Usage mistakes: exit 2, and the message says what to do.
    for (args, needle) in [
        (
            vec!["rc", "create", "-f", "/nonexistent.yaml"],
            "cannot read the manifest",
        ),
        (
            vec!["rc", "create", "-f", mpath, "--node-selector", "env in"],
            "--node-selector",
        ),
        (
            vec!["rc", "create", "-f", mpath, "--pod-label", "oops"],
            "expected KEY=VALUE",
        ),
        (vec!["rc", "scale", "not-an-id", "3"], "rcctl rc list"),
        (vec!["rc", "list", "-l", "a in ("], "-l"),
        (vec!["rc", "frobnicate"], "unrecognized subcommand"),
        (vec!["node", "label", "n1", "bad key=x"], "label"),
        (vec!["audit", "--since", "last tuesday"], "give an age"),
    ] {
        let (code, _, err) = rcctl(&s, &args).await;
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }

    // A dry run prints the transaction and writes nothing.
    let (code, out, err) = rcctl(
        &s,
        &[
            "rc",
            "create",
            "-f",
            mpath,
            "--node-selector",
            "env=prod",
            "--replicas",
            "1",
            "--dry-run",
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let body = out
        .lines()
        .skip_while(|l| l.starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    let ops: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(ops[0]["KV"]["Verb"], "cas");
    let (_, out, _) = rcctl(&s, &["rc", "list", "--json"]).await;
    assert_eq!(
        serde_json::from_str::<Value>(&out)
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        0,
        "nothing created"
    );

    let (code, id, err) = rcctl(
        &s,
        &[
            "rc",
            "create",
            "-f",
            mpath,
            "--node-selector",
            "env=prod",
            "--replicas",
            "1",
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let id = id.trim().to_string();
    let (code, _, err) = rcctl(&s, &["rc", "scale", &id, "2", "--wait", "--timeout", "30s"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("converged"), "progress is shown: {err}");
    let (_, out, _) = rcctl(&s, &["rc", "list", "--json"]).await;
    let list: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (list[0]["current"].as_u64(), list[0]["owner_farm"].as_str()),
        (Some(2), Some("ops"))
    );

    // Every read command speaks JSON.
    for args in [
        vec!["rc", "show", &id],
        vec!["node", "list"],
        vec!["farms"],
        vec!["audit", "--limit", "5"],
        vec!["ping"],
    ] {
        let mut a = args.clone();
        a.push("--json");
        let (code, out, err) = rcctl(&s, &a).await;
        assert_eq!(code, 0, "{a:?}: {err}");
        serde_json::from_str::<Value>(&out)
            .unwrap_or_else(|e| panic!("{a:?} is not JSON ({e}): {out}"));
    }

    // Dry runs of every write leave the state alone.
    for args in [
        vec!["rc", "scale", &id, "0", "--dry-run"],
        vec!["rc", "disable", &id, "--dry-run"],
        vec!["rc", "set-selector", &id, "env=dev", "--dry-run"],
        vec!["rc", "delete", &id, "--force", "--dry-run"],
        vec!["node", "label", "n1", "env-", "--dry-run"],
    ] {
        let (code, out, err) = rcctl(&s, &args).await;
        assert_eq!(code, 0, "{args:?}: {err}");
        assert!(out.contains("\"Verb\""), "{args:?}: {out}");
    }
    let (_, out, _) = rcctl(&s, &["rc", "show", &id, "--json"]).await;
    let show: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(show["rc"]["desired"], 2);
    assert_eq!(show["rc"]["disabled"], false);
    let (_, out, _) = rcctl(&s, &["node", "list", "-l", "env=prod"]).await;
    assert!(out.contains("n1"));

    // An operation that fails: exit 1 with the way out.
    let (code, _, err) = rcctl(&s, &["rc", "delete", &id]).await;
    assert_eq!(code, 1);
    assert!(
        err.contains("rc scale") && err.contains("0 --wait") && err.contains("--force"),
        "{err}"
    );
    let (code, _, err) = rcctl(&s, &["rc", "scale", &id, "9", "--wait", "--timeout", "2s"]).await;
    assert_eq!(code, 1, "not enough nodes: the wait times out");
    assert!(err.contains("not converged"), "{err}");
    let (code, _, err) = rcctl(&s, &["rc", "show", "6ba7b810-9dad-11d1-80b4-00c04fd430c8"]).await;
    assert_eq!(code, 1);
    assert!(err.contains("does not exist"), "{err}");

    // Scale to 0 and delete; prune the audit log.
    let (code, _, err) = rcctl(&s, &["rc", "scale", &id, "0", "--wait", "--timeout", "30s"]).await;
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = rcctl(&s, &["rc", "delete", &id]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("deleted"));
    // Shipped to SQL (what `rcctl audit` reads) by the farm's shipper, within its interval.
    let sr = &s;
    let idr = &id;
    eventually(
        Duration::from_secs(30),
        "the RC's records in the audit log",
        || async move {
            let (code, out, err) = rcctl(sr, &["audit", "--rc", idr, "--json"]).await;
            assert_eq!(code, 0, "{err}");
            let page: Value = serde_json::from_str(&out).unwrap();
            let types: Vec<String> = page["records"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|r| r["event_type"].as_str().map(str::to_string))
                .collect();
            [
                "REPLICATION_CONTROLLER_CREATED",
                "REPLICATION_CONTROLLER_MODIFIED",
                "REPLICATION_CONTROLLER_RETARGET",
            ]
            .iter()
            .all(|want| types.iter().any(|t| t == want))
            .then_some(())
        },
    )
    .await;
    let (code, out, err) = rcctl(&s, &["audit", "prune", "--older-than", "0d"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("pruned"), "{out}");
}

#[tokio::test]
async fn rcctl_without_consul_says_where_it_looked() {
    let out = tokio::process::Command::new(crate::RCCTL)
        .args(["rc", "list"])
        .env("CONSUL_HTTP_ADDR", "http://127.0.0.1:1")
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("127.0.0.1:1") && err.contains("CONSUL_HTTP_ADDR"),
        "{err}"
    );
}

#[tokio::test]
async fn farm_configuration_flags_env_and_file() {
    // --help documents every option with its default.
    let out = tokio::process::Command::new(RCFARM)
        .args(["serve", "--help"])
        .output()
        .await
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for opt in [
        "--consul",
        "--farm-id",
        "--rc-selector",
        "--scheduler",
        "--session-ttl",
        "--lock-delay",
        "--audit-db",
        "--http",
        "--config",
        "--resync-interval",
        "--transfer-timeout",
    ] {
        assert!(help.contains(opt), "{opt} documented:\n{help}");
    }
    for default in [
        "[default: 15s]",
        "[default: 127.0.0.1:8791]",
        "[default: label]",
        "[env: RCFARM_SESSION_TTL=",
        "[env: RCFARM_MAX_REMOVALS=",
        "[default: 20%]",
    ] {
        assert!(help.contains(default), "{default} shown:\n{help}");
    }
    // Invalid configuration fails at startup, naming the option.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "session-ttl = \"soon\"\n").unwrap();
    for (args, env, needle) in [
        (vec!["serve", "--session-ttl", "10"], None, "--session-ttl"),
        (
            vec!["serve", "--rc-selector", "a in"],
            None,
            "--rc-selector",
        ),
        (vec!["serve", "--http", "nowhere"], None, "--http"),
        (vec!["serve", "--audit-db", "mysql://x"], None, "--audit-db"),
        (
            vec!["serve", "--consul-max-conns", "4"],
            None,
            "--consul-max-conns 4: a farm needs at least 16",
        ),
        (
            vec!["serve", "--config", bad.to_str().unwrap()],
            None,
            "--session-ttl",
        ),
        (
            vec!["serve"],
            Some(("RCFARM_SCHEDULER", "magic")),
            "--scheduler",
        ),
        (
            vec!["serve", "--max-removals", "150%"],
            None,
            "a percentage is at most 100%",
        ),
        (
            vec!["serve"],
            Some(("RCFARM_MAX_REMOVALS", "0")),
            "--max-removals",
        ),
        (
            vec!["serve", "--max-removals-window", "0s"],
            None,
            "--max-removals-window must be longer than 0s",
        ),
    ] {
        let mut cmd = tokio::process::Command::new(RCFARM);
        cmd.args(&args).env_remove("RCFARM_CONFIG");
        if let Some((k, v)) = env {
            cmd.env(k, v);
        }
        let out = cmd.output().await.unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    // A config file works, and flags override it.
    let s = setup(&[]).await;
    let good = dir.path().join("farm.toml");
    std::fs::write(&good, format!("consul = \"{}\"\nfarm-id = \"from-file\"\nhttp = \"off\"\nsession-ttl = \"2s\"\naudit-db = \"{}\"\n", s.server.url(), s.audit_db)).unwrap();
    let mut child = tokio::process::Command::new(RCFARM)
        .args([
            "serve",
            "--config",
            good.to_str().unwrap(),
            "--farm-id",
            "from-flag",
        ])
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let c = client(&s.server);
    let cr = &c;
    crate::common::eventually(
        Duration::from_secs(20),
        "the configured farm registered",
        || async move {
            let (entries, _) = cr
                .kv_list("rcfarm/farms/", &Default::default())
                .await
                .unwrap();
            entries
                .iter()
                .any(|e| {
                    e.value_str()
                        .unwrap_or("")
                        .contains("\"farm_id\":\"from-flag\"")
                })
                .then_some(())
        },
    )
    .await;
    let _ = child.start_kill();
}

#[tokio::test]
async fn json_logs_carry_the_farm_and_rc_ids() {
    let s = setup(&["--log-format", "json"]).await;
    label(&s, &["n1"]).await;
    let m = s.dir.path().join("j.yaml");
    std::fs::write(&m, "id: jsonlog\n").unwrap();
    let (code, _, err) = rcctl(
        &s,
        &[
            "rc",
            "create",
            "-f",
            m.to_str().unwrap(),
            "--node-selector",
            "env=prod",
            "--replicas",
            "1",
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let found = s
            .log
            .lock()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| v["message"] == "scheduled" || v["fields"]["message"] == "scheduled")
            .filter(|v| {
                v.to_string().contains("\"rc_id\"") && v.to_string().contains("\"farm_id\":\"ops\"")
            })
            .is_some();
        if found {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no JSON \"scheduled\" line carrying rc_id and farm_id=ops; the farm logged:\n{}",
            s.log.lock()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn rcctl_refuses_a_manifest_consul_cannot_store_and_says_which_limit() {
    let s = setup(&[]).await;
    let m = s.dir.path().join("huge.yaml");
    let huge = format!(
        "id: huge\nlaunchables: {{}}\nconfig:\n  blob: \"{}\"\n",
        "x".repeat(1 << 20)
    );
    std::fs::write(&m, huge).unwrap();
    let (code, _, err) = rcctl(
        &s,
        &["rc", "create", "-f", m.to_str().unwrap(), "--replicas", "1"],
    )
    .await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("413") && err.contains("too large") && err.contains("txn_max_req_len"),
        "{err}"
    );
    let (_, out, _) = rcctl(&s, &["rc", "list", "--json"]).await;
    let listed: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        listed.as_array().map(Vec::len),
        Some(0),
        "nothing stored: {out}"
    );
}

#[tokio::test]
async fn rcctl_roll_commands_refuse_mistakes_and_drive_a_roll_to_completion() {
    let s = setup(&["--roll-resync", "300ms"]).await;
    let nodes = ["n1", "n2", "n3"];
    label(&s, &nodes).await;
    let sim = rcfarm_testkit::simulator::NodeSimulator::new(
        client(&s.server),
        rcfarm_testkit::simulator::SimConfig {
            nodes: nodes.iter().map(|n| n.to_string()).collect(),
            startup: Duration::from_millis(200),
            ..Default::default()
        },
    )
    .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(sim.run(stop.clone()));
    let v1 = s.dir.path().join("v1.yaml");
    let v2 = s.dir.path().join("v2.yaml");
    std::fs::write(
        &v1,
        "id: app\nlaunchables:\n  a:\n    location: https://example.com/1.tgz\n",
    )
    .unwrap();
    std::fs::write(
        &v2,
        "id: app\nlaunchables:\n  a:\n    location: https://example.com/2.tgz\n",
    )
    .unwrap();
    let (v1, v2) = (v1.to_str().unwrap(), v2.to_str().unwrap());
    let (code, out, err) = rcctl(
        &s,
        &[
            "rc",
            "create",
            "-f",
            v1,
            "--node-selector",
            "env=prod",
            "--replicas",
            "3",
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let old = out.trim().to_string();
    let (code, _, err) = rcctl(
        &s,
        &["rc", "scale", &old, "3", "--wait", "--timeout", "30s"],
    )
    .await;
    assert_eq!(code, 0, "{err}");

    // Mistakes: usage (exit 2) or a refused operation (exit 1), each saying what to do.
    for (args, want, needle) in [
        (
            vec!["roll", "start", "not-an-id", "-f", v2],
            2,
            "rcctl rc list",
        ),
        (
            vec!["roll", "start", &old, "-f", "/nonexistent.yaml"],
            2,
            "cannot read the manifest",
        ),
        (
            vec!["roll", "start", &old, "-f", v2, "--minimum", "3"],
            2,
            "must be below --desired",
        ),
        (
            vec!["roll", "start", &old, "-f", v2, "--roll-delay", "soon"],
            2,
            "unit",
        ),
        (
            vec!["roll", "create", "--old", &old, "--new", &old],
            2,
            "--desired",
        ),
        (
            vec![
                "roll",
                "create",
                "--old",
                &old,
                "--new",
                "6ba7b810-9dad-11d1-80b4-00c04fd430c8",
                "--desired",
                "3",
                "--minimum",
                "2",
            ],
            1,
            "does not exist",
        ),
        (
            vec!["roll", "show", "6ba7b810-9dad-11d1-80b4-00c04fd430c8"],
            1,
            "rcctl roll list",
        ),
        (
            vec!["roll", "abort", "6ba7b810-9dad-11d1-80b4-00c04fd430c8"],
            1,
            "does not exist",
        ),
        (
            vec![
                "roll",
                "create",
                "--old",
                &old,
                "--new",
                &old,
                "--desired",
                "-1",
                "--minimum",
                "0",
            ],
            2,
            "-1",
        ),
    ] {
        let (code, _, err) = rcctl(&s, &args).await;
        assert_eq!(code, want, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    // A dry run prints the one transaction (under the update_creation lock) and writes nothing.
    let (code, out, err) = rcctl(&s, &["roll", "start", &old, "-f", v2, "--dry-run"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("update_creation") && out.contains("rolls/"),
        "{out}"
    );
    let (_, out, _) = rcctl(&s, &["roll", "list", "--json"]).await;
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["rolls"],
        serde_json::json!([])
    );

    // The roll, followed to the end with a progress display.
    let (code, out, err) = rcctl(
        &s,
        &[
            "roll",
            "start",
            &old,
            "-f",
            v2,
            "--roll-delay",
            "500ms",
            "--wait",
            "--timeout",
            "60s",
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let new = out.trim().to_string();
    assert!(
        err.contains("%]") || err.contains("%"),
        "progress shown: {err}"
    );
    assert!(err.contains("rolling update complete"), "{err}");
    let (_, out, _) = rcctl(&s, &["rc", "list", "--json"]).await;
    let rcs: Value = serde_json::from_str(&out).unwrap();
    let ids: Vec<&str> = rcs
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec![new.as_str()], "the old RC is deleted");

    // A second roll, stopped half-way with abort: both RCs stay, the old one disabled.
    let v3 = s.dir.path().join("v3.yaml");
    std::fs::write(
        &v3,
        "id: app\nlaunchables:\n  a:\n    location: https://example.com/3.tgz\n",
    )
    .unwrap();
    let (code, out, err) = rcctl(
        &s,
        &[
            "roll",
            "start",
            &new,
            "-f",
            v3.to_str().unwrap(),
            "--roll-delay",
            "30s",
            "--json",
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let started: Value = serde_json::from_str(&out).unwrap();
    let third = started["id"].as_str().unwrap().to_string();
    // It shows, with both RCs' counts, and says what it waits for.
    let mut shown = Value::Null;
    for _ in 0..100 {
        let (_, out, _) = rcctl(&s, &["roll", "show", &third, "--json"]).await;
        shown = serde_json::from_str(&out).unwrap();
        if shown["waiting"]
            .as_str()
            .is_some_and(|w| w.contains("roll delay"))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        shown["waiting"]
            .as_str()
            .unwrap_or("")
            .contains("roll delay"),
        "{shown:#}"
    );
    assert_eq!(shown["owner_farm"], "ops");
    assert_eq!(shown["old"]["desired"], 2, "{shown:#}");
    let (code, out, _) = rcctl(&s, &["roll", "list"]).await;
    assert_eq!(code, 0);
    assert!(out.contains(&third) && out.contains('%'), "{out}");
    let (code, out, err) = rcctl(&s, &["roll", "abort", &third]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("rcctl rc enable"), "{out}");
    let (_, out, _) = rcctl(&s, &["rc", "show", &new, "--json"]).await;
    let old_rc: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(old_rc["record"]["disabled"], true, "{old_rc:#}");
    stop.cancel();
}

/// Connection mistakes (P2's flag spellings included) are named at start, exit 2, for rcctl and
/// for a farm, before anything is sent to Consul.
#[tokio::test]
async fn connection_mistakes_are_named_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    std::fs::write(p("empty-token"), "  \n").unwrap();
    std::fs::write(p("garbage.pem"), "not a certificate\n").unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    std::fs::write(p("client.pem"), cert.pem()).unwrap();
    std::fs::write(p("client-key.pem"), key.serialize_pem()).unwrap();
    std::fs::write(
        p("alias.toml"),
        format!(
            "tls-cert-file = \"{}\"\ntls-key-file = \"{}\"\n",
            p("garbage.pem"),
            p("client-key.pem")
        ),
    )
    .unwrap();
    let (garbage, client, client_key, empty, alias_toml) = (
        p("garbage.pem"),
        p("client.pem"),
        p("client-key.pem"),
        p("empty-token"),
        p("alias.toml"),
    );
    // (arguments, an environment variable, what the error must say)
    type Case<'a> = (Vec<&'a str>, Option<(&'a str, &'a str)>, String);
    let cases: Vec<Case> = vec![
        (
            vec!["--header", "X-Team"],
            None,
            "--header \"X-Team\": expected NAME=VALUE".into(),
        ),
        (
            vec!["--header", "=v"],
            None,
            "the header name is empty".into(),
        ),
        (
            vec!["--header", "Bad Name=v"],
            None,
            "not a valid HTTP header name".into(),
        ),
        (
            vec!["--token-file", "/nonexistent/rcfarm-token"],
            None,
            "the ACL token file /nonexistent/rcfarm-token (--consul-token-file / CONSUL_HTTP_TOKEN_FILE): cannot read it".into(),
        ),
        (
            vec![],
            Some(("CONSUL_HTTP_TOKEN_FILE", empty.as_str())),
            format!("the ACL token file {empty} (--consul-token-file / CONSUL_HTTP_TOKEN_FILE): it is empty"),
        ),
        (
            vec!["--tls-cert-file", &garbage, "--tls-key-file", &client_key],
            None,
            format!("the client certificate {garbage} (--consul-client-cert / CONSUL_CLIENT_CERT): no PEM certificate"),
        ),
        (
            vec!["--consul-client-cert", &client, "--consul-client-key", &garbage],
            None,
            format!("the client key {garbage} (--consul-client-key / CONSUL_CLIENT_KEY): no PEM private key"),
        ),
        (
            vec!["--consul-client-cert", &client],
            None,
            "is given without its key: give the key with --consul-client-key / CONSUL_CLIENT_KEY".into(),
        ),
        (
            vec!["--consul-ssl-verify", "maybe"],
            None,
            "--consul-ssl-verify / CONSUL_HTTP_SSL_VERIFY: \"maybe\" is not a boolean".into(),
        ),
        (
            vec![],
            Some(("CONSUL_HTTP_SSL_VERIFY", "nope")),
            "\"nope\" is not a boolean".into(),
        ),
        (
            vec!["--consul-ca-path", "/nonexistent/cas"],
            None,
            "the Consul CA directory /nonexistent/cas (--consul-ca-path / CONSUL_CAPATH): cannot read it".into(),
        ),
    ];
    for (args, env, needle) in &cases {
        // rcctl, and a farm.
        for (bin, cmd) in [
            (crate::RCCTL, vec!["ping"]),
            (RCFARM, vec!["serve", "--http", "off"]),
        ] {
            let mut c = tokio::process::Command::new(bin);
            if bin == RCFARM {
                c.args(&cmd).args(args);
            } else {
                c.args(args).args(&cmd);
            }
            c.env("CONSUL_HTTP_ADDR", "http://127.0.0.1:1")
                .env_remove("RCFARM_CONFIG")
                .env_remove("CONSUL_HTTP_TOKEN");
            if let Some((k, v)) = env {
                c.env(k, v);
            }
            let out = tokio::time::timeout(Duration::from_secs(20), c.output())
                .await
                .expect("exits at once")
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{bin} {args:?} {env:?}: {err}");
            assert!(
                err.contains(needle.as_str()),
                "{bin} {args:?} {env:?}: {err}"
            );
            assert!(!err.contains("panicked"), "{err}");
        }
    }
    // P2's spellings are keys of the farm's TOML file too.
    let out = tokio::process::Command::new(RCFARM)
        .args(["serve", "--http", "off", "--config", &alias_toml])
        .env("CONSUL_HTTP_ADDR", "http://127.0.0.1:1")
        .env_remove("RCFARM_CONFIG")
        .output()
        .await
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!("the client certificate {garbage}")),
        "{err}"
    );
}

/// The allocator settings `bin/rcfarm.rs` builds in are the ones the farm runs with: jemalloc
/// ignores a misspelt option with only a line on stderr, and the farm's peak memory depends on
/// them (big transients handed back at once, the rest after a second). `stats_print` makes
/// jemalloc print the options it took when the process exits.
#[test]
fn the_farm_runs_with_its_built_in_allocator_settings() {
    let out = std::process::Command::new(RCFARM)
        .arg("--version")
        .env("_RJEM_MALLOC_CONF", "stats_print:true")
        .output()
        .expect("rcfarm runs");
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("<jemalloc>"), "jemalloc complained:\n{err}");
    for opt in [
        "opt.background_thread: true",
        "opt.dirty_decay_ms: 1000",
        "opt.muzzy_decay_ms: 0",
        "opt.oversize_threshold: 65536",
    ] {
        assert!(
            err.contains(opt),
            "{opt:?} not in jemalloc's statistics:\n{err}"
        );
    }
}

/// `rcfarm-tools chaos --faults` names what is wrong and how to fix it: an unknown kind, and a
/// restore (which puts every server of a cluster back to a backup) without a cluster.
#[tokio::test]
async fn chaos_fault_kinds_are_checked_before_anything_starts() {
    for (args, needle) in [
        (
            vec!["chaos", "--faults", "restore"],
            "add --consul-bin PATH --consul-servers 3",
        ),
        (
            vec!["chaos", "--faults", "farms,bogus"],
            "--faults bogus: no such fault kind",
        ),
    ] {
        usage_error(&crate::rcfarm_tools(), &args, needle).await;
    }
}

/// `program args` exits 2 (a usage mistake) saying `needle`, without a panic.
async fn usage_error(program: &std::path::Path, args: &[&str], needle: &str) {
    let out = tokio::process::Command::new(program)
        .args(args)
        .output()
        .await
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(err.contains(needle), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// The test equipment's commands left `rcfarm` for `rcfarm-tools`: an operator's old command
/// line says where each went (exit 2), and `rcfarm-tools` has them.
#[tokio::test]
async fn the_test_equipments_commands_say_where_they_went() {
    for (args, needle) in [
        (vec!["chaos", "--duration", "1s"], "rcfarm-tools chaos"),
        (
            vec!["--log-format", "json", "bench", "farm"],
            "rcfarm-tools bench",
        ),
        (vec!["model-check"], "rcfarm-tools model-check"),
        (
            vec!["simulate-nodes", "--nodes", "3"],
            "rcfarm-tools simulate-nodes",
        ),
        (
            vec!["dev", "--simulate-nodes", "3"],
            "rcfarm-tools simulate-nodes --nodes N",
        ),
    ] {
        usage_error(std::path::Path::new(RCFARM), &args, needle).await;
    }
    let out = tokio::process::Command::new(crate::rcfarm_tools())
        .arg("--help")
        .output()
        .await
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{help}");
    for command in ["bench", "chaos", "model-check", "simulate-nodes"] {
        assert!(
            help.contains(command),
            "rcfarm-tools --help lacks {command}: {help}"
        );
    }
}

/// Runs `rcfarm-tools bench ARGS --farm-bin RCFARM`, which must succeed: its stdout, its stderr
/// and the figures it printed (`figures: {JSON}`).
async fn bench(args: &[&str]) -> (String, String, serde_json::Value) {
    let out = tokio::process::Command::new(crate::rcfarm_tools())
        .arg("bench")
        .args(args)
        .args(["--farm-bin", RCFARM])
        .output()
        .await
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "{args:?}: {stdout}\n{stderr}");
    let figures = stdout
        .lines()
        .find_map(|l| l.strip_prefix("figures: "))
        .map(|j| serde_json::from_str(j).unwrap())
        .unwrap_or_else(|| panic!("no figures line: {stdout}"));
    (stdout, stderr, figures)
}

/// `rcfarm-tools bench farm --server-process` runs the embedded server as `rcfarm consul-dev`
/// of its own and reports that process's memory (issue 46: "the server ≤ 1.5 GiB" is read off
/// it); it cannot be asked together with a real agent.
#[tokio::test]
async fn bench_farm_measures_a_server_in_its_own_process() {
    let (stdout, stderr, figures) = bench(&[
        "farm",
        "--farms",
        "2",
        "--rcs",
        "20",
        "--nodes",
        "20",
        "--changes",
        "0",
        "--idle",
        "1s",
        "--server-process",
        "--json",
    ])
    .await;
    assert!(
        stderr.contains("the server's RSS now / at its peak (its own process)"),
        "{stderr}"
    );
    assert!(
        stdout.contains("| embedded (own process) | 2 | 20×5 |"),
        "{stdout}"
    );
    let (now, peak) = (
        figures["server_rss"].as_f64().unwrap_or(0.0),
        figures["server_peak_rss"].as_f64().unwrap_or(0.0),
    );
    // A process that served 100 pods to two farms holds some MiB; this one's own, not this
    // test's or the harness's (which would be the case in-process).
    assert!(now > 1.0 && peak >= now, "{figures}");
    assert!(figures["consul_cpu"].as_f64().is_some(), "{figures}");
    assert!(figures["change_p99_ms"].is_null(), "{figures}");

    usage_error(
        &crate::rcfarm_tools(),
        &[
            "bench",
            "farm",
            "--server-process",
            "--consul-bin",
            "/bin/true",
        ],
        "--consul-bin",
    )
    .await;
}

/// `rcfarm-tools bench outbox` fills the outbox, starts one farm and times its shipper
/// emptying it (issue 46's "the audit outbox shipped as fast as it fills"); the figures it
/// prints are checked against SQL's count and Consul's, and `--db` ships to the database given.
#[tokio::test]
async fn bench_outbox_ships_a_full_outbox_and_says_how_fast() {
    // The server in its own process, so that its CPU is reported apart from the harness's.
    let (stdout, _, figures) = bench(&["outbox", "--records", "3000", "--server-process"]).await;
    // Every record shipped once, stored once, and gone from the outbox: counted by the farm,
    // by SQL and by Consul, each on its own.
    assert_eq!(figures["shipped"], 3000, "{figures}");
    assert_eq!(figures["stored"], 3000, "{figures}");
    assert_eq!(figures["left"], 0, "{figures}");
    assert!(figures["server_cpu_s"].as_f64().is_some(), "{figures}");
    assert!(
        stdout.contains("stages (seconds in all, times): list "),
        "{stdout}"
    );

    // `--db`: a database that already holds records (the run before's) gains this run's only.
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("given.db").display());
    for _ in 0..2 {
        let (_, _, figures) = bench(&["outbox", "--records", "500", "--db", &db]).await;
        assert_eq!(figures["stored"], 500, "{figures}");
        assert_eq!(figures["left"], 0, "{figures}");
    }
    let store = rcfarm::audit::AuditStore::connect(&db).await.unwrap();
    let all = store.count(&Default::default()).await.unwrap();
    assert_eq!(all, 1000);

    usage_error(
        &crate::rcfarm_tools(),
        &["bench", "outbox", "--records", "0"],
        "--records",
    )
    .await;
}

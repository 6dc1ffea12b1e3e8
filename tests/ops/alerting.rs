//! Alerts for real: the rule files under Debian's `promtool`, then Prometheus and Alertmanager
//! scraping two real farms and paging a webhook this test runs.
//!
//! The binaries come from Debian's `prometheus` and `prometheus-alertmanager` packages
//! (`.ci/run` installs them), or from `RCFARM_TEST_PROMETHEUS_BIN`, `RCFARM_TEST_PROMTOOL_BIN`
//! and `RCFARM_TEST_ALERTMANAGER_BIN`. Where they are absent the tests say SKIPPED and pass.

use std::net::TcpListener as StdListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::{Json, Router};
use parking_lot::Mutex;
use rcfarm::labels::{LabelSet, LabelStore, LabelType};
use serde_json::Value;
use tokio::process::{Child, Command};

use crate::common::{self, client, eventually};
use crate::{RCCTL, spawn_farm};

const RULES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/prometheus/rcfarm.rules.yml"
);
const RULE_TESTS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/prometheus/rcfarm.rules.test.yml"
);
const ALERTMANAGER_EXAMPLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/alertmanager/alertmanager.yml"
);
pub const DASHBOARD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/grafana/rcfarm.json");
const DOCS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/alerts.md");

/// A binary from the environment variable `env`, else the first of `names` found on PATH.
pub fn tool(env: &str, names: &[&str]) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(env).filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    names.iter().find_map(|n| {
        std::env::split_paths(&path)
            .chain([PathBuf::from("/usr/bin")])
            .map(|d| d.join(n))
            .find(|p| p.is_file())
    })
}

fn skipped(what: &str, missing: &str) {
    eprintln!(
        "SKIPPED {what}: {missing} not found (apt-get install prometheus prometheus-alertmanager, or set RCFARM_TEST_*_BIN)"
    );
}

fn promtool() -> Option<PathBuf> {
    tool("RCFARM_TEST_PROMTOOL_BIN", &["promtool"])
}

#[test]
fn rules_pass_promtool_check_and_their_unit_tests() {
    let Some(promtool) = promtool() else {
        return skipped("promtool rule tests", "promtool");
    };
    for args in [
        vec!["check", "rules", RULES],
        vec!["test", "rules", RULE_TESTS],
    ] {
        let out = std::process::Command::new(&promtool)
            .args(&args)
            .output()
            .unwrap();
        let (code, stdout, stderr) = common::outcome(out);
        assert_eq!(code, 0, "promtool {args:?}:\n{stdout}\n{stderr}");
    }
    if let Some(amtool) = tool("RCFARM_TEST_AMTOOL_BIN", &["amtool"]) {
        let out = std::process::Command::new(amtool)
            .args(["check-config", ALERTMANAGER_EXAMPLE])
            .output()
            .unwrap();
        let (code, stdout, stderr) = common::outcome(out);
        assert_eq!(code, 0, "amtool check-config:\n{stdout}\n{stderr}");
    }
}

/// Alert names in the rules file.
fn alert_names(rules: &str) -> Vec<String> {
    rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .map(|s| s.trim().to_string())
        .collect()
}

#[test]
fn every_alert_has_a_firing_test_a_quiet_test_and_a_runbook() {
    let rules = std::fs::read_to_string(RULES).unwrap();
    let tests = std::fs::read_to_string(RULE_TESTS).unwrap();
    let docs = std::fs::read_to_string(DOCS).unwrap();
    let names = alert_names(&rules);
    assert!(names.len() >= 10, "{names:?}");
    for name in &names {
        // Each alert is evaluated in a case expecting it (exp_alerts) and in one expecting
        // nothing: an `alertname:` line followed directly by another case or test.
        let lines: Vec<&str> = tests.lines().collect();
        let mut fires = false;
        let mut quiet = false;
        for (i, l) in lines.iter().enumerate() {
            if l.trim() != format!("alertname: {name}") {
                continue;
            }
            match lines.get(i + 1).map(|n| n.trim()) {
                Some("exp_alerts:") => fires = true,
                _ => quiet = true,
            }
        }
        assert!(fires, "{name}: no promtool case where it fires");
        assert!(quiet, "{name}: no promtool case where it stays quiet");
        assert!(
            docs.contains(&format!("## {name}")),
            "{name}: no runbook section in docs/alerts.md"
        );
        let anchor = format!("docs/alerts.md#{}", name.to_lowercase());
        assert!(rules.contains(&anchor), "{name}: no runbook_url {anchor}");
    }
    // Every description names the rcctl command (or the metric) to look closer with.
    for block in rules.split("- alert: ").skip(1) {
        assert!(block.contains("summary:"), "{block}");
        assert!(block.contains("Look closer:"), "{block}");
    }
}

/// A free TCP port on 127.0.0.1 (free when asked; the tools bind it a moment later).
fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A child process whose output is kept for the assertion messages.
pub struct Tool {
    /// Killed when the tool is dropped.
    _process: Child,
    pub log: Arc<Mutex<String>>,
}

pub async fn start_tool(bin: &Path, args: &[String]) -> Tool {
    let mut child = Command::new(bin)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    let log = Arc::new(Mutex::new(String::new()));
    for r in [
        Box::new(child.stdout.take().unwrap()) as Box<dyn tokio::io::AsyncRead + Unpin + Send>,
        Box::new(child.stderr.take().unwrap()),
    ] {
        let sink = log.clone();
        tokio::spawn(async move {
            use tokio::io::AsyncBufReadExt;
            let mut lines = tokio::io::BufReader::new(r).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                let mut s = sink.lock();
                s.push_str(&l);
                s.push('\n');
            }
        });
    }
    Tool {
        _process: child,
        log,
    }
}

/// Prometheus scraping `targets` every second with the rules loaded (their `for:` shortened to
/// 3 s: the real durations are what the promtool tests check), sending to `alertmanager`.
pub async fn start_prometheus(
    bin: &Path,
    dir: &Path,
    targets: &[String],
    alertmanager: Option<u16>,
) -> (Tool, String) {
    let rules = std::fs::read_to_string(RULES).unwrap();
    let short: String = rules
        .lines()
        .map(|l| match l.trim_start().strip_prefix("for: ") {
            Some(_) => format!("{}for: 3s", &l[..l.len() - l.trim_start().len()]),
            None => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(dir.join("rules.yml"), short).unwrap();
    let targets: Vec<String> = targets
        .iter()
        .map(|t| {
            format!(
                "'{}'",
                t.trim_start_matches("http://").trim_end_matches('/')
            )
        })
        .collect();
    let alerting = match alertmanager {
        Some(port) => format!(
            "alerting:\n  alertmanagers:\n    - static_configs:\n        - targets: ['127.0.0.1:{port}']\n"
        ),
        None => String::new(),
    };
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files: [rules.yml]\n{alerting}scrape_configs:\n  - job_name: rcfarm\n    static_configs:\n      - targets: [{}]\n",
        targets.join(", ")
    );
    std::fs::write(dir.join("prometheus.yml"), config).unwrap();
    let port = free_port();
    let tool = start_tool(
        bin,
        &[
            format!("--config.file={}", dir.join("prometheus.yml").display()),
            format!("--storage.tsdb.path={}", dir.join("tsdb").display()),
            format!("--web.listen-address=127.0.0.1:{port}"),
            "--rules.alert.resend-delay=1s".into(),
            "--log.level=warn".into(),
        ],
    )
    .await;
    let url = format!("http://127.0.0.1:{port}");
    let http = common::http();
    let ready = format!("{url}/-/ready");
    eventually(Duration::from_secs(60), "Prometheus ready", || {
        let (http, ready) = (http.clone(), ready.clone());
        async move {
            let r = http.get(&ready).send().await.ok()?;
            r.status().is_success().then_some(())
        }
    })
    .await;
    (tool, url)
}

/// An instant query's result vector.
pub async fn query(prom: &str, q: &str) -> Option<Vec<Value>> {
    let v: Value = common::http()
        .get(format!("{prom}/api/v1/query"))
        .query(&[("query", q)])
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    if v["status"] != "success" {
        panic!("query {q} refused: {v}");
    }
    v["data"]["result"].as_array().cloned()
}

/// Names and labels of the alerts Prometheus has firing now.
async fn firing(prom: &str) -> Option<Vec<Value>> {
    let v: Value = common::http()
        .get(format!("{prom}/api/v1/alerts"))
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    Some(
        v["data"]["alerts"]
            .as_array()?
            .iter()
            .filter(|a| a["state"] == "firing")
            .map(|a| a["labels"].clone())
            .collect(),
    )
}

async fn rcctl(consul: &str, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(RCCTL)
        .args(args)
        .env("CONSUL_HTTP_ADDR", consul)
        .env_remove("CONSUL_HTTP_TOKEN")
        .output()
        .await
        .unwrap();
    common::outcome(out)
}

/// Every webhook notification Alertmanager sent, as it sent them.
type Received = Arc<Mutex<Vec<Value>>>;

async fn webhook() -> (u16, Received) {
    let got: Received = Arc::default();
    let sink = got.clone();
    let app = Router::new().route(
        "/hook",
        post(move |Json(v): Json<Value>| {
            let sink = sink.clone();
            async move {
                sink.lock().push(v);
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (port, got)
}

/// The first alert notified with this status and these labels.
fn notified(got: &Received, status: &str, labels: &[(&str, &str)]) -> Option<Value> {
    got.lock().iter().find_map(|n| {
        n["alerts"].as_array()?.iter().find_map(|a| {
            (a["status"] == status && labels.iter().all(|(k, v)| a["labels"][*k] == *v))
                .then(|| a.clone())
        })
    })
}

/// Waits (up to 90 s) for Alertmanager to notify an alert with this status and these labels.
async fn await_notified(got: &Received, status: &str, labels: &[(&str, &str)]) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        if let Some(a) = notified(got, status, labels) {
            return a;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no {status} notification with {labels:?} in 90 s; got: {:#?}",
            got.lock()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The embedded server, farms with these ids (HTTP API on ephemeral ports), and an RC of one
/// replica whose node selector is `selector`, which no node matches yet; returns the RC's id.
async fn farms_and_an_rc(
    ids: &[&str],
    selector: &str,
) -> (
    rcfarm::server::EmbeddedServer,
    tempfile::TempDir,
    Vec<(Child, String, Arc<Mutex<String>>)>,
    String,
) {
    common::init_tracing();
    let server = common::server_with(rcfarm::server::ServerConfig {
        session_ttl_min: Duration::from_secs(1),
        ..rcfarm::server::ServerConfig::ephemeral()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let audit_db = format!("sqlite://{}", dir.path().join("audit.db").display());
    let mut farms = Vec::new();
    for id in ids {
        farms.push(spawn_farm(&server.url(), id, &audit_db, &[]).await);
    }
    let m = dir.path().join("web.yaml");
    std::fs::write(&m, "id: web\nlaunchables: {}\n").unwrap();
    let (code, id, err) = rcctl(
        &server.url(),
        &[
            "rc",
            "create",
            "-f",
            m.to_str().unwrap(),
            "--node-selector",
            selector,
            "--replicas",
            "1",
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    (server, dir, farms, id.trim().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmeetable_rc_pages_through_alertmanager_and_resolves() {
    let (Some(prometheus), Some(alertmanager)) = (
        tool("RCFARM_TEST_PROMETHEUS_BIN", &["prometheus"]),
        tool(
            "RCFARM_TEST_ALERTMANAGER_BIN",
            &["prometheus-alertmanager", "alertmanager"],
        ),
    ) else {
        return skipped("the end-to-end alert test", "prometheus or alertmanager");
    };
    // An RC whose selector no node matches: its desires cannot be met.
    let (server, dir, mut farms, id) = farms_and_an_rc(&["alerts-a", "alerts-b"], "role=web").await;
    let consul = server.url();

    let (hook_port, got) = webhook().await;
    let am_port = free_port();
    std::fs::write(
        dir.path().join("alertmanager.yml"),
        format!(
            "route:\n  receiver: hook\n  group_by: [alertname, rc_id]\n  group_wait: 1s\n  group_interval: 1s\n  repeat_interval: 1h\nreceivers:\n  - name: hook\n    webhook_configs:\n      - url: http://127.0.0.1:{hook_port}/hook\n        send_resolved: true\n"
        ),
    )
    .unwrap();
    let am = start_tool(
        &alertmanager,
        &[
            format!(
                "--config.file={}",
                dir.path().join("alertmanager.yml").display()
            ),
            format!("--storage.path={}", dir.path().join("am").display()),
            format!("--web.listen-address=127.0.0.1:{am_port}"),
            "--cluster.listen-address=".into(),
            "--log.level=warn".into(),
        ],
    )
    .await;
    let targets: Vec<String> = farms.iter().map(|f| f.1.clone()).collect();
    let (prom, prom_url) = start_prometheus(&prometheus, dir.path(), &targets, Some(am_port)).await;
    let logs = || {
        format!(
            "prometheus:\n{}\nalertmanager:\n{}\nnotifications: {:#?}",
            prom.log.lock(),
            am.log.lock(),
            got.lock()
        )
    };
    eventually(
        Duration::from_secs(60),
        "both farms scraped and ready",
        || {
            let p = prom_url.clone();
            async move { (query(&p, "rcfarm_ready == 1").await?.len() == 2).then_some(()) }
        },
    )
    .await;

    let page = await_notified(
        &got,
        "firing",
        &[("alertname", "RcfarmRcUnmet"), ("rc_id", &id)],
    )
    .await;
    eprintln!("paged: {page}");
    assert_eq!(page["labels"]["pod_id"], "web", "{page:#}");
    assert_eq!(page["labels"]["selector"], "role=web", "{page:#}");
    assert_eq!(page["labels"]["severity"], "page", "{page:#}");
    let desc = page["annotations"]["description"].as_str().unwrap_or("");
    assert!(desc.contains(&format!("rcctl rc show {id}")), "{desc}");

    // A node labelled to match: the RC gets its pod, and the page resolves.
    let l: LabelSet = [("role".to_string(), "web".to_string())].into();
    LabelStore::new(client(&server))
        .set(LabelType::Node, "n1", &l)
        .await
        .unwrap();
    let resolved = await_notified(
        &got,
        "resolved",
        &[("alertname", "RcfarmRcUnmet"), ("rc_id", &id)],
    )
    .await;
    eprintln!("resolved: {resolved}");

    // The RC's farm is killed: the other takes the RC over, and what is left firing is the
    // dead farm's own alert, nothing about RCs.
    let owner = eventually(Duration::from_secs(30), "the RC's owner", || {
        let consul = consul.clone();
        async move {
            let (_, out, _) = rcctl(&consul, &["rc", "list", "--json"]).await;
            let v: Value = serde_json::from_str(&out).ok()?;
            v[0]["owner_farm"].as_str().map(str::to_string)
        }
    })
    .await;
    let (dead, alive) = if owner == "alerts-a" {
        (0, "alerts-b")
    } else {
        (1, "alerts-a")
    };
    let dead_instance = farms[dead]
        .1
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    farms[dead].0.start_kill().unwrap();
    eventually(Duration::from_secs(60), "the RC re-owned", || {
        let consul = consul.clone();
        async move {
            let (_, out, _) = rcctl(&consul, &["rc", "list", "--json"]).await;
            let v: Value = serde_json::from_str(&out).ok()?;
            (v[0]["owner_farm"] == alive && v[0]["current"] == 1).then_some(())
        }
    })
    .await;
    await_notified(
        &got,
        "firing",
        &[
            ("alertname", "RcfarmFarmNotReady"),
            ("instance", &dead_instance),
        ],
    )
    .await;
    // Several evaluations in a row with nothing else firing.
    let mut quiet = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut last = Vec::new();
    while quiet < 5 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "alerts left firing: {last:#?}\n{}",
            logs()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        last = firing(&prom_url)
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|a| !(a["alertname"] == "RcfarmFarmNotReady" && a["instance"] == dead_instance))
            .collect();
        quiet = if last.is_empty() { quiet + 1 } else { 0 };
    }
}

/// Metric names (`rcfarm_…`, `process_…`) an expression or file mentions.
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut out = std::collections::BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if !text.is_char_boundary(i) {
            i += 1;
            continue;
        }
        let rest = &text[i..];
        let boundary = i == 0
            || !(bytes[i - 1].is_ascii_alphanumeric()
                || bytes[i - 1] == b'_'
                || bytes[i - 1] == b':');
        if boundary && (rest.starts_with("rcfarm_") || rest.starts_with("process_")) {
            let end = rest
                .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
                .unwrap_or(rest.len());
            // A recorded series (`rcfarm:…`) or a word in prose that ends in `_` is not one.
            if !rest[end..].starts_with(':') && !rest[..end].ends_with('_') {
                out.insert(rest[..end].to_string());
            }
            i += end;
        } else {
            i += 1;
        }
    }
    out
}

/// The metric names a farm's `/metrics` declares now (`None` if it did not answer).
async fn declared_metrics(http: &str) -> Option<std::collections::BTreeSet<String>> {
    let text = common::http()
        .get(format!("{http}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    Some(exported(&text))
}

/// What a farm's `/metrics` declares (`# TYPE` lines), with a histogram's series names.
fn exported(exposition: &str) -> std::collections::BTreeSet<String> {
    let mut out = std::collections::BTreeSet::new();
    for l in exposition.lines() {
        if let Some(rest) = l.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            let (Some(name), Some(kind)) = (it.next(), it.next()) else {
                continue;
            };
            out.insert(name.to_string());
            if kind == "histogram" {
                for s in ["_bucket", "_sum", "_count"] {
                    out.insert(format!("{name}{s}"));
                }
            }
        }
    }
    out
}

/// The dashboard's PromQL, with Grafana's variables given the values a user's "All" gives.
fn dashboard_queries() -> Vec<(String, String)> {
    let d: Value = serde_json::from_str(&std::fs::read_to_string(DASHBOARD).unwrap()).unwrap();
    let mut out = Vec::new();
    for p in d["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            let expr = t["expr"]
                .as_str()
                .unwrap()
                .replace("$job", ".*")
                .replace("$__rate_interval", "15s");
            out.push((p["title"].as_str().unwrap().to_string(), expr));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_and_the_rules_name_only_what_a_farm_exports_and_prometheus_answers() {
    // An RC in a condition (Unmet), so the per-RC series have a sample.
    let (_server, dir, farms, _) = farms_and_an_rc(&["dash"], "role=none").await;
    let http = farms[0].1.clone();

    // Without Prometheus: every metric the rules and the dashboard name is one the farm
    // declares on /metrics.
    let mut declared = eventually(Duration::from_secs(30), "the farm's metrics", || {
        let http = http.clone();
        async move {
            let names = declared_metrics(&http).await?;
            names.contains("rcfarm_rc_condition").then_some(names)
        }
    })
    .await;
    let rules = std::fs::read_to_string(RULES).unwrap();
    let dashboard = std::fs::read_to_string(DASHBOARD).unwrap();
    // A metric is declared once its code path first runs (a watch's first reconnect counter,
    // the first timed request): give the farm a while to declare every named one before
    // saying which are missing.
    let wanted: std::collections::BTreeSet<String> = metric_names(&rules)
        .into_iter()
        .chain(metric_names(&dashboard))
        .collect();
    let until = tokio::time::Instant::now() + Duration::from_secs(20);
    while !wanted.is_subset(&declared) && tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if let Some(names) = declared_metrics(&http).await {
            declared = names;
        }
    }
    for (file, text) in [("rules", &rules), ("dashboard", &dashboard)] {
        let named = metric_names(text);
        assert!(named.len() >= 10, "{file}: {named:?}");
        let missing: Vec<&String> = named.difference(&declared).collect();
        assert!(
            missing.is_empty(),
            "the {file} name metrics the farm does not export: {missing:?}"
        );
    }

    let Some(prometheus) = tool("RCFARM_TEST_PROMETHEUS_BIN", &["prometheus"]) else {
        return skipped("the dashboard's queries against Prometheus", "prometheus");
    };
    let (prom, prom_url) = start_prometheus(&prometheus, dir.path(), &[http], None).await;
    let queries = dashboard_queries();
    assert!(queries.len() >= 18, "{queries:?}");
    // Each panel's query is accepted and answers with series, and each metric it names has
    // series in Prometheus (not hidden by an `or vector(0)`).
    let mut pending: Vec<(String, String)> = queries.clone();
    for (_, expr) in &queries {
        for name in metric_names(expr) {
            pending.push(("metric".into(), format!("{{__name__=\"{name}\"}}")));
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !pending.is_empty() {
        let mut left = Vec::new();
        for (title, q) in pending {
            match query(&prom_url, &q).await {
                Some(r) if !r.is_empty() => {}
                _ => left.push((title, q)),
            }
        }
        pending = left;
        if !pending.is_empty() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "queries without series after 60 s: {pending:#?}\nprometheus:\n{}\nfarm:\n{}",
                prom.log.lock(),
                farms[0].2.lock()
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

#[test]
fn metric_names_are_found_in_promql_and_prose() {
    let n = metric_names(
        "sum(rate(rcfarm_claims_total{job=~\"a\"}[5m])) / rcfarm:consul_requests:rate5m + process_cpu_seconds_total; see rcfarm_ in prose",
    );
    assert_eq!(
        n.into_iter().collect::<Vec<_>>(),
        ["process_cpu_seconds_total", "rcfarm_claims_total"]
    );
}

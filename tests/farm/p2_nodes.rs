//! Real P2 nodes: P2's own node agent (`p2-preparer`, the bundle in `shared/p2/preparer`) runs
//! the pods that real farms schedule, on real Consul. Each node is a preparer in its own mount
//! namespace with its own runsvdir and loopback address; its pods are real processes (a Python
//! HTTP server from `make-artifact.sh`) whose status port P2's own health checker probes.
//!
//! Needs root, runit, ruby, the bundle and a Consul binary; without any of them every test here
//! prints `SKIPPED: … because …` and passes.

use std::collections::{BTreeMap, BTreeSet};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rcfarm::audit::events;
use rcfarm::consul::{Consul, QueryOptions};
use rcfarm::rc::{RcId, RcStore};
use rcfarm::roll::roll_key;
use rcfarm_testkit::chaos::agent::{AgentConfig, consul_bin};

use crate::harness::Cluster;

/// Where the bundle is unless `RCFARM_TEST_P2_PREPARER` says otherwise: beside the repository,
/// as CI lays out `shared/`.
const BUNDLE_ENV: &str = "RCFARM_TEST_P2_PREPARER";

/// Farm flags: rolls look again often (P2's preparer writes `reality/`, which is not watched).
/// The farm's own defaults (the harness turns the budget and tripwire off elsewhere): the flow
/// on real P2 nodes is an operator's, with no `release-removals`.
const FARM_FLAGS: [&str; 6] = [
    "--roll-resync",
    "300ms",
    "--max-removals",
    "20%",
    "--failsafe-confirm",
    "2m",
];

/// Where every test's node work dirs live, so that a test killed before its guard ran has its
/// nodes stopped by the next one.
const WORK_ROOT: &str = "rcfarm-p2-nodes";

/// The bundle and the Consul binary, or why the test cannot run.
fn prerequisites(test: &str) -> Option<(PathBuf, PathBuf)> {
    let skip = |why: String| {
        eprintln!("SKIPPED: {test} (real P2 nodes) because {why}");
        None
    };
    let bundle = std::env::var_os(BUNDLE_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/p2/preparer"));
    if !effective_uid_is_root() {
        return skip(
            "it is not running as root (P2's preparer needs mount namespaces, setuid and cgroups)"
                .into(),
        );
    }
    for f in [
        "bin/p2-preparer",
        "bin/p2-exec",
        "run-preparer.sh",
        "stop-preparer.sh",
        "make-artifact.sh",
    ] {
        if !bundle.join(f).is_file() {
            return skip(format!(
                "the P2 preparer bundle is missing ({} not found; set {BUNDLE_ENV})",
                bundle.join(f).display()
            ));
        }
    }
    for tool in [
        "runsvdir", "runsv", "sv", "svlogd", "unshare", "nsenter", "curl", "pgrep",
    ] {
        if !on_path(tool) {
            return skip(format!(
                "{tool} is not installed (Debian: apt-get install -y runit ruby libsqlite3-0 python3 curl util-linux procps)"
            ));
        }
    }
    // P2 writes every runit script as `#!/usr/bin/ruby`; the test launchable runs python3.
    for path in ["/usr/bin/ruby", "/usr/bin/python3"] {
        if !Path::new(path).is_file() {
            return skip(format!(
                "{path} is missing (Debian: apt-get install -y runit ruby python3)"
            ));
        }
    }
    // bin/p2-preparer is built with cgo against the system's SQLite.
    let sqlite = [
        "/usr/lib/x86_64-linux-gnu",
        "/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
    ]
    .iter()
    .any(|d| Path::new(d).join("libsqlite3.so.0").exists());
    if !sqlite {
        return skip("libsqlite3.so.0 is missing (Debian: apt-get install -y libsqlite3-0)".into());
    }
    let Some(consul) = consul_bin() else {
        return skip(format!(
            "{} does not name a Consul binary (.ci/run sets it to ../shared/consul/consul)",
            rcfarm_testkit::chaos::agent::CONSUL_BIN_ENV
        ));
    };
    Some((bundle, consul))
}

fn effective_uid_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Runs a bundle script synchronously; its output goes into the test's output.
fn run_script(
    bundle: &Path,
    work: &Path,
    script: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> String {
    let out = std::process::Command::new(bundle.join(script))
        .args(args)
        .env("P2PREP_WORK", work)
        .envs(env.iter().copied())
        .output()
        .unwrap_or_else(|e| panic!("{script} runs: {e}"));
    succeeded(&format!("{script} {args:?}"), out)
}

/// A command's standard output, or the test fails showing both outputs.
fn succeeded(what: &str, out: std::process::Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}): {stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Stops every node of a work dir (each `stop-preparer.sh` at once: each waits for its pods)
/// and removes the dir.
fn stop_and_remove(bundle: &Path, work: &Path) {
    let nodes: Vec<String> = std::fs::read_dir(work.join("nodes"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    let stops: Vec<_> = nodes
        .iter()
        .filter_map(|n| {
            std::process::Command::new(bundle.join("stop-preparer.sh"))
                .arg(n)
                .env("P2PREP_WORK", work)
                .stdout(std::process::Stdio::null())
                .spawn()
                .map_err(|e| eprintln!("stop-preparer.sh {n}: {e}"))
                .ok()
        })
        .collect();
    for mut s in stops {
        let _ = s.wait();
    }
    let _ = std::fs::remove_dir_all(work);
}

/// One node: a `p2-preparer` run by `run-preparer.sh`.
#[derive(Debug, Clone)]
struct Node {
    name: String,
    ip: String,
}

/// The nodes of one test, stopped (pods, runsvdir, namespace, cgroups) and their work dir
/// removed when dropped, panic or not.
struct P2Nodes {
    bundle: PathBuf,
    work: PathBuf,
    nodes: Vec<Node>,
    /// The port every pod's status server listens on, on its own node's address.
    port: u16,
}

impl Drop for P2Nodes {
    fn drop(&mut self) {
        stop_and_remove(&self.bundle, &self.work);
    }
}

impl P2Nodes {
    /// Starts one node per address in `ips`, named `<tag>-<pid>-<i>`, against the Consul at
    /// `consul` (`host:port`).
    fn start(bundle: &Path, tag: &str, consul: &str, ips: &[&str]) -> P2Nodes {
        let root = std::env::temp_dir().join(WORK_ROOT);
        sweep(bundle, &root);
        let pid = std::process::id();
        let work = root.join(format!("{tag}-{pid}"));
        for d in [&root, &work] {
            std::fs::create_dir_all(d).unwrap();
            // Pods run as `nobody` and must reach their pod root below.
            set_mode(d, 0o755);
        }
        let mut nodes = P2Nodes {
            bundle: bundle.to_path_buf(),
            work,
            nodes: Vec::new(),
            port: free_port(ips),
        };
        let started = Instant::now();
        let names: Vec<String> = (1..=ips.len())
            .map(|i| format!("{tag}-{pid}-{i}"))
            .collect();
        // Started together (each waits for Consul's leader and its own namespace); the guard
        // knows the work dir already, so a failed start still stops those that did start.
        let runs: Vec<_> = names
            .iter()
            .zip(ips)
            .map(|(name, ip)| {
                let (b, w, n, ip, c) = (
                    bundle.to_path_buf(),
                    nodes.work.clone(),
                    name.clone(),
                    ip.to_string(),
                    consul.to_string(),
                );
                std::thread::spawn(move || {
                    run_script(&b, &w, "run-preparer.sh", &[&n, &c], &[("NODE_IP", &ip)])
                })
            })
            .collect();
        for ((run, name), ip) in runs.into_iter().zip(names).zip(ips) {
            let out = run.join().expect("run-preparer.sh thread");
            eprintln!("{}", out.trim());
            nodes.nodes.push(Node {
                name,
                ip: ip.to_string(),
            });
        }
        eprintln!(
            "{} P2 nodes up in {:.1?}",
            nodes.nodes.len(),
            started.elapsed()
        );
        nodes
    }

    fn names(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.name.clone()).collect()
    }

    fn node(&self, name: &str) -> &Node {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node {name}"))
    }

    /// Builds the test launchable for `version`; returns its `file://` location.
    fn artifact(&self, version: &str) -> String {
        let dir = self.work.join("artifacts");
        let name = run_script(
            &self.bundle,
            &self.work,
            "make-artifact.sh",
            &[version, dir.to_str().unwrap()],
            &[("NAME", "web")],
        );
        format!("file://{}", dir.join(name.trim()).display())
    }

    /// A manifest as P2's preparer needs it (README of the bundle): `run_as`, a hoist
    /// launchable whose status server listens on `port` on its node's own address, and P2's
    /// HTTP health check of that port.
    fn manifest(&self, pod: &str, location: &str) -> String {
        let port = self.port;
        format!(
            "id: {pod}\nrun_as: nobody\nlaunchables:\n  web:\n    launchable_type: hoist\n    location: {location}\n    env:\n      HELLO_PORT: \"{port}\"\nconfig: {{}}\nstatus_port: {port}\nstatus_http: true\n"
        )
    }

    fn write_manifest(&self, name: &str, text: &str) -> PathBuf {
        let p = self.work.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    /// Pids of the pod's status server running inside `node`'s mount namespace.
    async fn pod_pids(&self, node: &str) -> Vec<u32> {
        let ns = self.work.join("nodes").join(node).join("runsvdir.pid");
        let Ok(ns_pid) = std::fs::read_to_string(&ns) else {
            return Vec::new();
        };
        let out = tokio::process::Command::new("pgrep")
            .args(["--ns", ns_pid.trim(), "--nslist", "mnt", "-f"])
            .arg(format!("http.server {} ", self.port))
            .output()
            .await
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// What the pod's status server on `node` says its version is.
    async fn version(&self, node: &str) -> Option<String> {
        let url = format!("http://{}:{}/version", self.node(node).ip, self.port);
        let r = crate::common::http()
            .get(url)
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .ok()?;
        if !r.status().is_success() {
            return None;
        }
        Some(r.text().await.ok()?.trim().to_string())
    }

    /// Whether on every one of `nodes` the pod's process runs in the node's namespace and
    /// serves `version`.
    async fn serve(&self, nodes: &BTreeSet<String>, version: &str) -> bool {
        for n in nodes {
            if self.pod_pids(n).await.is_empty()
                || self.version(n).await.as_deref() != Some(version)
            {
                return false;
            }
        }
        true
    }

    /// What is left of the pod on `node`: its process, its intent, its `reality/` and
    /// `health/` keys (nothing once the node has stopped it).
    async fn leftovers(&self, consul: &Consul, node: &str, pod: &str) -> Vec<String> {
        let keys = [
            format!("intent/{node}/{pod}"),
            format!("reality/{node}/{pod}"),
            format!("health/{pod}/{node}"),
        ];
        let mut left: Vec<String> = match consul.read_keys(&keys).await {
            Ok(found) => keys.into_iter().filter(|k| found.contains_key(k)).collect(),
            Err(e) => vec![format!("(Consul unreadable: {e})")],
        };
        let pids = self.pod_pids(node).await;
        if !pids.is_empty() {
            left.push(format!("processes {pids:?} in {node}'s namespace"));
        }
        left
    }

    /// The last lines of a node's preparer log, for a failure message.
    fn log_tail(&self, node: &str) -> String {
        let log = std::fs::read_to_string(self.work.join("nodes").join(node).join("preparer.log"))
            .unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(15).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }
}

fn set_mode(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// A port free on every one of `ips` (each pod binds its own node's address).
fn free_port(ips: &[&str]) -> u16 {
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if ips.iter().all(|ip| TcpListener::bind((*ip, port)).is_ok()) {
            return port;
        }
    }
}

/// Stops the nodes of tests that died without their guard (killed by a timeout, say): their
/// preparers, runsvdirs and pods would otherwise live on.
fn sweep(bundle: &Path, root: &Path) {
    let Ok(dirs) = std::fs::read_dir(root) else {
        return;
    };
    for d in dirs.filter_map(|e| e.ok()) {
        let name = d.file_name().to_string_lossy().into_owned();
        let owner = name.rsplit('-').next().and_then(|p| p.parse::<u32>().ok());
        if owner.is_some_and(|p| !pid_alive(p)) {
            eprintln!(
                "stopping the P2 nodes a dead test left in {}",
                d.path().display()
            );
            stop_and_remove(bundle, &d.path());
        }
    }
}

/// Samples, from outside, every 100 ms until dropped, how many of a pod's nodes pass P2's
/// health check (a passing `health/<pod>/<node>` while `reality/<node>/<pod>` exists); keeps
/// the fewest seen and a timeline of every change (health, the artifact `reality/` names, and
/// whether the process itself answers `/_status`), for the failure message.
struct HealthWatch {
    seen: Arc<Mutex<Seen>>,
    stop: tokio_util::sync::CancellationToken,
}

#[derive(Default)]
struct Seen {
    samples: usize,
    lowest: Option<(usize, String)>,
    timeline: Vec<String>,
}

impl HealthWatch {
    fn spawn(consul: Consul, nodes: &P2Nodes, pod: &str) -> HealthWatch {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let stop = tokio_util::sync::CancellationToken::new();
        let (seen2, stop2, pod) = (seen.clone(), stop.clone(), pod.to_string());
        let targets: Vec<(String, String)> = nodes
            .nodes
            .iter()
            .map(|n| {
                let status = format!("http://{}:{}/_status", n.ip, nodes.port);
                (n.name.clone(), status)
            })
            .collect();
        tokio::spawn(async move {
            let started = Instant::now();
            let http = crate::common::http();
            let keys: Vec<String> = targets
                .iter()
                .flat_map(|(n, _)| [format!("health/{pod}/{n}"), format!("reality/{n}/{pod}")])
                .collect();
            let mut last = String::new();
            while !stop2.is_cancelled() {
                let Ok(found) = consul.read_keys(&keys).await else {
                    continue;
                };
                let mut healthy = 0;
                let mut states = Vec::new();
                for (n, status) in &targets {
                    let health = found
                        .get(&format!("health/{pod}/{n}"))
                        .and_then(|kv| rcfarm::health::parse_health(kv.value_bytes()).ok());
                    let runs = found
                        .get(&format!("reality/{n}/{pod}"))
                        .map(|kv| artifact_of(kv.value_bytes()));
                    if runs.is_some() && health.is_some_and(|h| h.is_passing()) {
                        healthy += 1;
                    }
                    let answers = http
                        .head(status)
                        .timeout(Duration::from_millis(500))
                        .send()
                        .await
                        .is_ok_and(|r| r.status().is_success());
                    states.push(format!(
                        "{n}: health {} reality {} process {}",
                        health.map_or("none".into(), |h| format!("{h:?}")),
                        runs.as_deref().unwrap_or("none"),
                        if answers { "up" } else { "down" }
                    ));
                }
                let now = states.join("; ");
                {
                    let mut s = seen2.lock();
                    s.samples += 1;
                    if now != last {
                        let at = started.elapsed();
                        s.timeline
                            .push(format!("+{at:.1?} healthy {healthy}: {now}"));
                        last = now;
                    }
                    if s.lowest.as_ref().is_none_or(|(h, _)| healthy < *h) {
                        s.lowest = Some((healthy, format!("at +{:.1?}", started.elapsed())));
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        HealthWatch { seen, stop }
    }

    /// Stops watching; fails the test if fewer than `minimum` pods were healthy at any time
    /// (`during`: what the pods went through), showing when and the timeline.
    fn assert_never_below(self, minimum: usize, during: &str) {
        self.stop.cancel();
        let s = self.seen.lock();
        assert!(
            s.samples > 10,
            "the health watch took only {} samples",
            s.samples
        );
        let (lowest, when) = s.lowest.clone().expect("samples were taken");
        let timeline = s.timeline.join("\n");
        eprintln!("fewest healthy pods during {during}: {lowest} ({when}); timeline:\n{timeline}");
        assert!(
            lowest >= minimum,
            "{during} took P2's healthy pods below {minimum}: {lowest} {when}; timeline:\n{timeline}"
        );
    }
}

impl Drop for HealthWatch {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The artifact a manifest's launchable location names (`web_<sha1>.tar.gz`), shortened.
fn artifact_of(manifest: &[u8]) -> String {
    let text = String::from_utf8_lossy(manifest);
    text.split("web_")
        .nth(1)
        .map(|rest| format!("web_{}", &rest[..rest.len().min(7)]))
        .unwrap_or_else(|| "?".into())
}

/// Runs rcctl against the cluster's Consul and audit database; stdout, or the test fails.
async fn rcctl(c: &Cluster, args: &[&str]) -> String {
    let (code, out, err) = c.rcctl(args).await;
    assert_eq!(code, 0, "rcctl {args:?} failed: {out}{err}");
    out
}

/// `rcctl rc create` of `replicas` pods of `manifest` on the nodes labelled `p2=<tag>`.
async fn create_rc(c: &Cluster, manifest: &Path, tag: &str, replicas: u32, strategy: &str) -> RcId {
    let (f, selector, n) = (
        manifest.to_str().unwrap(),
        format!("p2={tag}"),
        replicas.to_string(),
    );
    let out = rcctl(
        c,
        &[
            "rc",
            "create",
            "-f",
            f,
            "--node-selector",
            &selector,
            "--replicas",
            &n,
            "--strategy",
            strategy,
        ],
    )
    .await;
    RcId::parse(out.trim()).unwrap()
}

/// `rcctl rc scale <rc> 0`, then waits until every node has stopped the pod.
async fn scale_to_zero(c: &Cluster, nodes: &P2Nodes, pod: &str, rc: RcId) {
    let id = rc.to_string();
    rcctl(c, &["rc", "scale", &id, "0", "--wait", "--timeout", "60s"]).await;
    all_gone(c, nodes, pod, &nodes.names()).await;
}

/// The nodes an RC's pods are on.
async fn placed(c: &Cluster, rc: RcId) -> BTreeSet<String> {
    c.placements().await.get(&rc).cloned().unwrap_or_default()
}

/// Waits until the RC has `n` pods (on exactly the nodes `on`, if given) that P2 runs
/// (`reality/` holds the RC's manifest and `health/` passes, per [`Cluster::all_up`]) and whose
/// processes serve `version`.
async fn running(
    c: &Cluster,
    nodes: &P2Nodes,
    rc: RcId,
    n: usize,
    on: Option<&BTreeSet<String>>,
    version: &str,
    timeout: Duration,
) -> BTreeSet<String> {
    let what = format!("{n} pods of {rc} running {version} on real P2 nodes {on:?}");
    let took = c
        .wait_for(timeout, &what, || async move {
            let at = placed(c, rc).await;
            on.is_none_or(|o| *o == at) && c.all_up(rc, n).await && nodes.serve(&at, version).await
        })
        .await;
    eprintln!("{what}: {took:.1?}");
    placed(c, rc).await
}

/// Waits until nothing of the pod is left on any of `on` (see [`P2Nodes::leftovers`]), or
/// fails the test saying what is left. The intents and processes must go within 30 s; the
/// preparer's keys may take longer: now and then (once in ~50 deletions here) P2's uninstall
/// races runit — it deletes the service dir while `runsv` still writes into it ("Uninstall
/// failed … supervise: directory not empty") — and its retry first waits out two 30-s stop
/// timeouts of a service whose `runsv` is gone, so about a minute instead of 1.5 s.
async fn all_gone(c: &Cluster, nodes: &P2Nodes, pod: &str, on: &[String]) {
    let started = Instant::now();
    let mut stopped = None;
    loop {
        let mut left = BTreeMap::new();
        for n in on {
            let l = nodes.leftovers(&c.consul, n, pod).await;
            if !l.is_empty() {
                left.insert(n.clone(), l);
            }
        }
        let running = left
            .values()
            .flatten()
            .any(|l| l.starts_with("intent/") || l.starts_with("processes"));
        if !running && stopped.is_none() {
            stopped = Some(started.elapsed());
        }
        if left.is_empty() {
            eprintln!(
                "pod {pod} stopped on {on:?} in {:.1?}, its keys removed in {:.1?}",
                stopped.unwrap_or_default(),
                started.elapsed()
            );
            return;
        }
        let limit = if running { 30 } else { 150 };
        if started.elapsed() > Duration::from_secs(limit) {
            let logs: Vec<String> = left
                .keys()
                .map(|n| format!("--- {n} preparer.log ---\n{}", nodes.log_tail(n)))
                .collect();
            panic!(
                "pod {pod} not stopped after {limit} s, left: {left:#?}\n{}",
                logs.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A real Consul agent, nodes `<tag>-<pid>-<i>` on `ips` labelled `p2=<tag>`, one farm, and
/// the pod id the test uses (unique: P2 names cgroups after it, at the root of the hierarchy
/// that every test shares). `None` once the test said why it is skipped.
async fn setup(test: &str, tag: &str, ips: &[&str]) -> Option<(Cluster, P2Nodes, String)> {
    let (bundle, consul) = prerequisites(test)?;
    let mut c = Cluster::start_real(AgentConfig::dev(&consul, &format!("rcfarm-{tag}"))).await;
    let nodes = P2Nodes::start(&bundle, tag, &c.server.addr().to_string(), ips);
    for n in nodes.names() {
        c.label_node(&n, &[("p2", tag)]).await;
    }
    c.spawn_farm("f1", &FARM_FLAGS).await;
    Some((c, nodes, format!("{tag}-{}", std::process::id())))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rc_on_real_p2_nodes_runs_rolls_under_p2_health_and_stops() {
    let test = "an_rc_on_real_p2_nodes_runs_rolls_under_p2_health_and_stops";
    let ips = ["127.0.0.11", "127.0.0.12", "127.0.0.13"];
    let Some((c, nodes, pod)) = setup(test, "p2roll", &ips).await else {
        return;
    };
    let (v1, v2) = (nodes.artifact("v1"), nodes.artifact("v2"));
    let m1 = nodes.write_manifest("v1.yaml", &nodes.manifest(&pod, &v1));
    let m2 = nodes.write_manifest("v2.yaml", &nodes.manifest(&pod, &v2));

    // An RC converges to pods that P2 really runs and finds healthy.
    let old = create_rc(&c, &m1, "p2roll", 3, "static").await;
    let on = running(&c, &nodes, old, 3, None, "v1", Duration::from_secs(90)).await;
    assert_eq!(on, nodes.names().into_iter().collect());
    let before: BTreeMap<String, Vec<u32>> = {
        let mut m = BTreeMap::new();
        for n in &on {
            m.insert(n.clone(), nodes.pod_pids(n).await);
        }
        m
    };

    // A roll to v2 replaces them in place, gated by P2's health: never fewer than the minimum
    // healthy, as seen from outside.
    let watch = HealthWatch::spawn(c.consul.clone(), &nodes, &pod);
    let started = Instant::now();
    let out = rcctl(
        &c,
        &[
            "roll",
            "start",
            &old.to_string(),
            "-f",
            m2.to_str().unwrap(),
            "--minimum",
            "2",
        ],
    )
    .await;
    let new = RcId::parse(out.trim()).unwrap();
    let cr = &c;
    c.wait_for(
        Duration::from_secs(180),
        "the roll to v2 completes",
        || async move {
            cr.consul
                .kv_get(&roll_key(new), &QueryOptions::default())
                .await
                .is_ok_and(|(e, _)| e.is_none())
                && RcStore::new(cr.consul.clone())
                    .get(old)
                    .await
                    .is_ok_and(|r| r.is_none())
        },
    )
    .await;
    let after = running(&c, &nodes, new, 3, Some(&on), "v2", Duration::from_secs(60)).await;
    eprintln!("roll of 3 real pods: {:.1?}", started.elapsed());
    for n in &after {
        let pids = nodes.pod_pids(n).await;
        assert!(
            pids.iter().all(|p| !before[n].contains(p)),
            "{n} runs new processes: {pids:?} (before {:?})",
            before[n]
        );
    }
    watch.assert_never_below(2, "the roll (minimum 2)");
    let completion = c.audit_events("ROLLING_UPDATE_COMPLETION").await;
    assert!(
        completion.iter().any(|d| d["succeeded"] == true),
        "{completion:#?}"
    );

    // A rolling restart: the same artifact, a manifest whose only change is
    // `config.rcfarm_restarted_at`. P2's preparer sees a new SHA and relaunches every pod
    // (new processes), under the same minimum.
    let watch = HealthWatch::spawn(c.consul.clone(), &nodes, &pod);
    let mut before = BTreeMap::new();
    for n in &after {
        before.insert(n.clone(), nodes.pod_pids(n).await);
    }
    let started = Instant::now();
    let out = rcctl(
        &c,
        &[
            "rc",
            "restart",
            &new.to_string(),
            "--minimum",
            "2",
            "--wait",
            "--timeout",
            "180s",
        ],
    )
    .await;
    let restarted = RcId::parse(out.lines().next().unwrap().trim()).unwrap();
    let after = running(
        &c,
        &nodes,
        restarted,
        3,
        Some(&on),
        "v2",
        Duration::from_secs(60),
    )
    .await;
    eprintln!("rolling restart of 3 real pods: {:.1?}", started.elapsed());
    for n in &after {
        let pids = nodes.pod_pids(n).await;
        assert!(
            !pids.is_empty() && pids.iter().all(|p| !before[n].contains(p)),
            "{n} relaunched the pod: {pids:?} (before {:?})",
            before[n]
        );
    }
    watch.assert_never_below(2, "the rolling restart (minimum 2)");
    let new = restarted;

    // Scale to 0, then delete: the processes stop and the preparers remove their keys.
    scale_to_zero(&c, &nodes, &pod, new).await;
    rcctl(&c, &["rc", "delete", &new.to_string()]).await;
    assert!(
        RcStore::new(c.consul.clone())
            .get(new)
            .await
            .unwrap()
            .is_none()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    for n in nodes.names() {
        let left = nodes.leftovers(&c.consul, &n, &pod).await;
        assert!(left.is_empty(), "after the RC's deletion {n} has {left:?}");
    }
    c.check_invariants(|_| false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_transfer_moves_a_pod_to_a_real_p2_node_that_runs_it() {
    let test = "a_node_transfer_moves_a_pod_to_a_real_p2_node_that_runs_it";
    let ips = ["127.0.0.21", "127.0.0.22", "127.0.0.23"];
    let Some((c, nodes, pod)) = setup(test, "p2move", &ips).await else {
        return;
    };
    let v1 = nodes.artifact("v1");
    let m = nodes.write_manifest("v1.yaml", &nodes.manifest(&pod, &v1));
    // Dynamic: a pod on a node that stops matching moves (static RCs may not, by default).
    let rc = create_rc(&c, &m, "p2move", 2, "dynamic").await;
    let on = running(&c, &nodes, rc, 2, None, "v1", Duration::from_secs(90)).await;
    let spare: String = nodes
        .names()
        .into_iter()
        .find(|n| !on.contains(n))
        .expect("a third node");
    let drained = on.iter().next().unwrap().clone();
    let stays = on.iter().nth(1).unwrap().clone();
    assert!(nodes.pod_pids(&spare).await.is_empty());

    // The node stops matching: its pod moves to the spare node, which really runs it, and
    // the old one stops only once the new one passes P2's health check.
    let watch = HealthWatch::spawn(c.consul.clone(), &nodes, &pod);
    let started = Instant::now();
    c.label_node(&drained, &[("p2", "drained")]).await;
    let moved = BTreeSet::from([stays.clone(), spare.clone()]);
    running(
        &c,
        &nodes,
        rc,
        2,
        Some(&moved),
        "v1",
        Duration::from_secs(90),
    )
    .await;
    all_gone(&c, &nodes, &pod, std::slice::from_ref(&drained)).await;
    eprintln!(
        "node transfer between real P2 nodes: {:.1?}",
        started.elapsed()
    );
    watch.assert_never_below(2, "the transfer");
    let (cr, spare_ref) = (&c, &spare);
    c.wait_for(
        Duration::from_secs(10),
        "the transfer's audit record",
        || async move {
            cr.audit_events(events::NODE_TRANSFER_COMPLETION)
                .await
                .iter()
                .any(|d| d.to_string().contains(spare_ref.as_str()))
        },
    )
    .await;

    // Scale to 0: every process stops.
    scale_to_zero(&c, &nodes, &pod, rc).await;
    c.check_invariants(|_| false);
}

//! The status page, end to end in headless Chromium driven over WebDriver (chromedriver).

use std::process::Stdio;
use std::time::Duration;

use rcfarm::labels::{LabelSet, LabelStore, LabelType};
use rcfarm::rc::{Mutation, RcId, RcStore};
use serde_json::{Value, json};

use crate::common::{client, eventually, http};
use crate::setup;

fn find(name: &str) -> Option<String> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| format!("{d}/{name}"))
        .find(|p| std::path::Path::new(p).exists())
}

struct Driver {
    base: String,
    session: String,
    child: tokio::process::Child,
}

impl Driver {
    async fn start() -> Driver {
        let chromium = find("chromium").or_else(|| find("chromium-browser")).expect(
            "Chromium is needed for the status page test: install Debian's chromium and chromium-driver (.ci/run does)",
        );
        let chromedriver = find("chromedriver")
            .expect("chromedriver is needed: install Debian's chromium-driver (.ci/run does)");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        // Its own process group, which the Chromium it starts joins: killing chromedriver
        // alone left every browser it had started running, reparented to init (24 processes
        // per suite run, found still running after it).
        let child = tokio::process::Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let base = format!("http://127.0.0.1:{port}");
        let b = base.clone();
        eventually(Duration::from_secs(20), "chromedriver up", || {
            let b = b.clone();
            async move {
                http()
                    .get(format!("{b}/status"))
                    .send()
                    .await
                    .ok()
                    .filter(|r| r.status().is_success())
                    .map(|_| ())
            }
        })
        .await;
        let profile = tempfile::tempdir().unwrap().keep();
        let caps = json!({"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
            "binary": chromium,
            "args": ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     "--disable-dev-shm-usage", format!("--user-data-dir={}", profile.display())]
        }}}});
        let r: Value = http()
            .post(format!("{base}/session"))
            .json(&caps)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let session = r["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no WebDriver session: {r}"))
            .to_string();
        Driver {
            base,
            session,
            child,
        }
    }

    /// Chromium is chromedriver's child: only its process group reaches it once the
    /// driver is gone (also when a test panics).
    fn kill_group(&self) {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", "--", &format!("-{pid}")])
                .stderr(Stdio::null())
                .status();
        }
    }

    async fn cmd(&self, path: &str, body: Value) -> Value {
        let r: Value = http()
            .post(format!("{}/session/{}/{path}", self.base, self.session))
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        r["value"].clone()
    }

    async fn goto(&self, url: &str) {
        self.cmd("url", json!({"url": url})).await;
    }

    /// Runs JavaScript in the page and returns its result.
    async fn eval(&self, script: &str) -> Value {
        self.cmd("execute/sync", json!({"script": script, "args": []}))
            .await
    }

    async fn screenshot(&self, path: &std::path::Path) {
        let r: Value = http()
            .get(format!("{}/session/{}/screenshot", self.base, self.session))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if let Some(b64) = r["value"].as_str() {
            use base64::Engine as _;
            if let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(b64) {
                let _ = std::fs::write(path, bytes);
            }
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        self.kill_group();
    }
}

/// The cell text of an RC's row: (current, desired), or `None` while it is not shown.
async fn shown(d: &Driver, id: &str) -> Option<(String, String)> {
    let v = d
        .eval(&format!(
            "const r = document.querySelector('tr[data-rc-id=\"{id}\"]'); return r ? [r.querySelector('.current').textContent, r.querySelector('.desired').textContent] : null;"
        ))
        .await;
    Some((
        v.get(0)?.as_str()?.to_string(),
        v.get(1)?.as_str()?.to_string(),
    ))
}

#[tokio::test]
async fn the_status_page_shows_a_new_rc_and_follows_a_scale_change() {
    let s = setup(&[]).await;
    let consul = client(&s.server);
    for n in ["n1", "n2", "n3"] {
        let l: LabelSet = [("env".to_string(), "prod".to_string())].into();
        LabelStore::new(consul.clone())
            .set(LabelType::Node, n, &l)
            .await
            .unwrap();
    }
    let d = Driver::start().await;
    d.goto(&format!("{}/", s.http)).await;
    let title = d.eval("return document.title").await;
    assert_eq!(title, "rcfarm");

    // Created after the page loaded: the page shows it by refreshing itself.
    let store = RcStore::new(consul.clone());
    let new = rcfarm::rc::NewRc {
        manifest: "id: page-test\n".into(),
        node_selector: "env=prod".into(),
        pod_labels: Default::default(),
        replicas_desired: 1,
        strategy: rcfarm::rc::AllocationStrategy::Static,
        rc_labels: Default::default(),
        disabled: false,
    };
    let id: RcId = store
        .create(new, "test", false)
        .await
        .unwrap()
        .rc
        .unwrap()
        .id;
    let idt = id.to_string();
    let dr = &d;
    let ir = &idt;
    eventually(
        Duration::from_secs(30),
        "the RC on the page at 1/1",
        || async move { (shown(dr, ir).await == Some(("1".into(), "1".into()))).then_some(()) },
    )
    .await;
    let farms = d
        .eval("return document.getElementById('farms').textContent")
        .await;
    assert!(farms.as_str().unwrap().contains("ops"), "{farms}");

    store
        .mutate(id, &Mutation::SetReplicas(3), "test", false)
        .await
        .unwrap();
    eventually(
        Duration::from_secs(30),
        "the page follows the scale change to 3/3",
        || async move { (shown(dr, ir).await == Some(("3".into(), "3".into()))).then_some(()) },
    )
    .await;
    let audit = d
        .eval("return document.getElementById('audit').textContent")
        .await;
    assert!(
        audit
            .as_str()
            .unwrap_or("")
            .contains("REPLICATION_CONTROLLER"),
        "latest audit events shown: {audit}"
    );
    // For a person to look at (not committed).
    d.screenshot(&std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("status-page.png"))
        .await;
}

/// A roll's row on the page: (healthy new pods, target, width of the bar), or `None`.
async fn roll_shown(d: &Driver, id: &str) -> Option<(u64, u64, String)> {
    let v = d
        .eval(&format!(
            "const r = document.querySelector('tr[data-roll-id=\"{id}\"]'); return r ? [r.querySelector('.new-healthy').textContent, r.querySelector('.target').textContent, r.querySelector('.bar .fill').style.width] : null;"
        ))
        .await;
    Some((
        v.get(0)?.as_str()?.parse().ok()?,
        v.get(1)?.as_str()?.parse().ok()?,
        v.get(2)?.as_str()?.to_string(),
    ))
}

#[tokio::test]
async fn the_status_page_follows_a_rolling_update_with_a_progress_bar() {
    let s = setup(&["--roll-resync", "300ms"]).await;
    let consul = client(&s.server);
    let nodes = ["n1", "n2", "n3"];
    for n in nodes {
        let l: LabelSet = [("env".to_string(), "prod".to_string())].into();
        LabelStore::new(consul.clone())
            .set(LabelType::Node, n, &l)
            .await
            .unwrap();
    }
    let sim = rcfarm_testkit::simulator::NodeSimulator::new(
        consul.clone(),
        rcfarm_testkit::simulator::SimConfig {
            nodes: nodes.iter().map(|n| n.to_string()).collect(),
            startup: Duration::from_millis(500),
            ..Default::default()
        },
    )
    .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(sim.run(stop.clone()));
    let manifest = |v: u32| {
        format!(
            "id: roll-page\nlaunchables:\n  app:\n    launchable_type: hoist\n    location: https://example.com/app-{v}.tar.gz\n"
        )
    };
    let old = RcStore::new(consul.clone())
        .create(
            rcfarm::rc::NewRc {
                manifest: manifest(1),
                node_selector: "env=prod".into(),
                pod_labels: Default::default(),
                replicas_desired: 3,
                strategy: rcfarm::rc::AllocationStrategy::Static,
                rc_labels: Default::default(),
                disabled: false,
            },
            "test",
            false,
        )
        .await
        .unwrap()
        .rc
        .unwrap()
        .id;
    let d = Driver::start().await;
    d.goto(&format!("{}/", s.http)).await;
    let dr = &d;
    let old_id = old.to_string();
    let oi = &old_id;
    eventually(
        Duration::from_secs(30),
        "the old RC at 3/3",
        || async move { (shown(dr, oi).await == Some(("3".into(), "3".into()))).then_some(()) },
    )
    .await;
    let roll = rcfarm::roll::RollStore::new(consul.clone())
        .start(
            rcfarm::roll::StartRoll {
                old_rc: old,
                manifest: manifest(2),
                desired: None,
                minimum: Some(2),
                leave_old: false,
                roll_delay: Duration::from_secs(1),
            },
            "test",
            false,
        )
        .await
        .unwrap()
        .update
        .new_rc
        .to_string();
    let ri = &roll;
    // The row appears, its bar part-filled at some point, then full; then the roll is gone.
    let partial = eventually(
        Duration::from_secs(30),
        "a part-filled bar",
        || async move {
            roll_shown(dr, ri)
                .await
                .filter(|(h, t, _)| *t == 3 && *h >= 1 && *h < 3)
        },
    )
    .await;
    assert_ne!(partial.2, "0%", "{partial:?}");
    assert_ne!(partial.2, "100%", "{partial:?}");
    eventually(
        Duration::from_secs(30),
        "the roll done and gone",
        || async move {
            (roll_shown(dr, ri).await.is_none()
                && shown(dr, ri).await == Some(("3".into(), "3".into())))
            .then_some(())
        },
    )
    .await;
    let rolls = d
        .eval("return document.getElementById('rolls').textContent")
        .await;
    assert!(
        rolls.as_str().unwrap().contains("no rolling updates"),
        "{rolls}"
    );
    let audit = d
        .eval("return document.getElementById('audit').textContent")
        .await;
    assert!(
        audit.as_str().unwrap_or("").contains("ROLLING_UPDATE"),
        "{audit}"
    );
    stop.cancel();
}

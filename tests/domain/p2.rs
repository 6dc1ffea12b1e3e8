//! Records as P2's own `p2-rctl` writes and reads them (`../shared/p2/`; skipped, loudly,
//! where the binary is absent): everything P2 writes, rcfarm reads; what rcfarm writes, P2
//! reads; and the two agree on which RC is in a roll.

use std::path::PathBuf;
use std::time::Duration;

use rcfarm::consul::Consul;
use rcfarm::labels::{LabelSet, LabelStore, LabelType};
use rcfarm::rc::{AllocationStrategy, NewRc, RcId, RcStore};
use rcfarm::roll::{NewRoll, RollStore, RollStoreError, Update};

use crate::common::{client, server};

fn p2_rctl() -> Option<PathBuf> {
    let p = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/p2/p2-rctl"));
    if p.exists() {
        Some(p)
    } else {
        eprintln!(
            "SKIPPED: P2's p2-rctl is not at {} (CI has it); these tests check P2's records",
            p.display()
        );
        None
    }
}

async fn p2(consul: &str, args: &[&str]) -> (bool, String) {
    let out = tokio::process::Command::new(p2_rctl().unwrap())
        .arg("--consul")
        .arg(consul)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

const MANIFEST: &str = "id: web\nlaunchables:\n  app:\n    launchable_type: hoist\n    location: https://example.com/web.tar.gz\n    cgroup:\n      cpus: 2\n      memory: 1G\nconfig:\n  a: b\nstatus_port: 8080\n";

async fn p2_create(
    consul: &str,
    manifest: &std::path::Path,
    selector: &str,
    strategy: &str,
) -> RcId {
    let (ok, out) = p2(
        consul,
        &[
            "create",
            "--manifest",
            manifest.to_str().unwrap(),
            "--node-selector",
            selector,
            "--availability-zone",
            "az1",
            "--cluster-name",
            "c1",
            "--allocation-strategy",
            strategy,
            "--pod-label",
            "team=x",
            "--rc-label",
            "owner=y",
        ],
    )
    .await;
    assert!(ok, "p2-rctl create {selector:?}: {out}");
    let id = out
        .split("id=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap();
    RcId::parse(id).unwrap()
}

#[tokio::test]
async fn every_rc_p2_creates_is_served_as_p2_serves_it() {
    if p2_rctl().is_none() {
        return;
    }
    let s = server().await;
    let c = client(&s);
    let addr = s.addr().to_string();
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("m.yaml");
    std::fs::write(&m, MANIFEST).unwrap();
    // As P2 accepts them, and the same selector as rcfarm spells it.
    let selectors = [
        ("env=prod", "env=prod"),
        ("env==prod", "env=prod"),
        ("env!=prod", "env!=prod"),
        ("env in (a,b)", "env in (a,b)"),
        ("env in ( a , b )", "env in (a,b)"),
        ("env notin (a)", "env notin (a)"),
        ("env", "env"),
        ("!env", "!env"),
        ("a.b/c=d", "a.b/c=d"),
        ("env=prod,zone in (z1)", "env=prod,zone in (z1)"),
        ("", ""),
        ("env=", "env="),
        ("x=a_b-c.d", "x=a_b-c.d"),
        ("role=web , tier!=db", "role=web,tier!=db"),
    ];
    let mut ids = Vec::new();
    for (i, (sel, canonical)) in selectors.iter().enumerate() {
        // `--allocation-strategy` is written verbatim: P2 serves anything but
        // `dynamic_strategy` as static.
        let strategy = ["static_strategy", "static", "dynamic_strategy", "anything"][i % 4];
        ids.push((
            p2_create(&addr, &m, sel, strategy).await,
            *sel,
            *canonical,
            strategy,
        ));
    }
    let listing = RcStore::new(c.clone()).list().await.unwrap();
    assert!(listing.invalid.is_empty(), "{:#?}", listing.invalid);
    let labels: LabelSet = [
        ("env".to_string(), "prod".to_string()),
        ("zone".to_string(), "z1".to_string()),
    ]
    .into();
    for (id, sel, canonical, strategy) in &ids {
        let rc = &listing.rcs[id];
        let want = if *strategy == "dynamic_strategy" {
            AllocationStrategy::Dynamic
        } else {
            AllocationStrategy::Static
        };
        assert_eq!(rc.strategy, want, "{sel:?} {strategy}");
        assert_eq!(rc.pod_id(), "web");
        assert_eq!(rc.pod_labels["availability_zone"], "az1");
        assert_eq!(rc.pod_labels["team"], "x");
        // Spelling aside, the same selector means the same thing.
        let same = rcfarm::labels::Selector::parse(canonical).unwrap();
        assert_eq!(
            rc.node_selector.matches(&labels),
            same.matches(&labels),
            "{sel:?}"
        );
        assert_eq!(*rc.node_selector, same, "{sel:?}");
    }
    let (rc_labels, _) = LabelStore::new(c.clone())
        .get(LabelType::ReplicationController, &ids[0].0.to_string())
        .await
        .unwrap();
    assert_eq!(rc_labels["owner"], "y");
    assert_eq!(rc_labels["pod_id"], "web");
}

#[tokio::test]
async fn p2_reads_what_rcfarm_writes_and_both_agree_on_rolls() {
    if p2_rctl().is_none() {
        return;
    }
    let s = server().await;
    let c: Consul = client(&s);
    let addr = s.addr().to_string();
    let store = RcStore::new(c.clone());
    let mk = |replicas: u64| NewRc {
        manifest: MANIFEST.into(),
        node_selector: "env=prod".into(),
        pod_labels: LabelSet::new(),
        replicas_desired: replicas,
        strategy: AllocationStrategy::Static,
        rc_labels: LabelSet::new(),
        disabled: false,
    };
    let a = store
        .create(mk(3), "t", false)
        .await
        .unwrap()
        .rc
        .unwrap()
        .id;
    let b = store
        .create(mk(0), "t", false)
        .await
        .unwrap()
        .rc
        .unwrap()
        .id;
    let d = store
        .create(mk(0), "t", false)
        .await
        .unwrap()
        .rc
        .unwrap()
        .id;
    // P2 reads rcfarm's records (with rcfarm's extra field), and changes them.
    let (ok, out) = p2(&addr, &["get", &a.to_string()]).await;
    assert!(ok && out.contains(&a.to_string()), "{out}");
    let (ok, out) = p2(&addr, &["set-replicas", "--yes", &a.to_string(), "4"]).await;
    assert!(ok, "{out}");
    assert_eq!(store.get(a).await.unwrap().unwrap().replicas_desired, 4);

    // A roll rcfarm created blocks P2's schedule-update on the same RC, and the reverse.
    RollStore::new(c.clone())
        .create(
            NewRoll {
                update: Update {
                    old_rc: a,
                    new_rc: b,
                    desired_replicas: 4,
                    minimum_replicas: 3,
                    leave_old: false,
                    roll_delay: Duration::ZERO,
                },
                labels: LabelSet::new(),
            },
            "t",
            false,
        )
        .await
        .unwrap();
    let (ok, out) = p2(
        &addr,
        &[
            "schedule-update",
            "--old",
            &a.to_string(),
            "--new",
            &d.to_string(),
            "--desired",
            "4",
            "--minimum",
            "3",
        ],
    )
    .await;
    assert!(!ok, "P2 sees rcfarm's roll: {out}");
    assert!(
        out.contains("already in progress") || out.contains("conflicts"),
        "{out}"
    );
    // P2 deletes rcfarm's roll.
    let (ok, out) = p2(&addr, &["delete-rolling-update", "--id", &b.to_string()]).await;
    assert!(ok, "{out}");
    assert!(
        RollStore::new(c.clone())
            .list()
            .await
            .unwrap()
            .rolls
            .is_empty()
    );
    // P2's refused attempt left its update_creation locks on a and d (its CLI exits without
    // destroying its session; they go with it after 2×TTL): a roll of two other RCs, by P2.
    let e = store
        .create(mk(3), "t", false)
        .await
        .unwrap()
        .rc
        .unwrap()
        .id;
    let f = store
        .create(mk(0), "t", false)
        .await
        .unwrap()
        .rc
        .unwrap()
        .id;
    let (ok, out) = p2(
        &addr,
        &[
            "schedule-update",
            "--old",
            &e.to_string(),
            "--new",
            &f.to_string(),
            "--desired",
            "3",
            "--minimum",
            "2",
        ],
    )
    .await;
    assert!(ok, "{out}");
    let err = RollStore::new(c.clone())
        .create(
            NewRoll {
                update: Update {
                    old_rc: b,
                    new_rc: f,
                    desired_replicas: 4,
                    minimum_replicas: 3,
                    leave_old: false,
                    roll_delay: Duration::ZERO,
                },
                labels: LabelSet::new(),
            },
            "t",
            false,
        )
        .await
        .unwrap_err();
    match err {
        RollStoreError::CreationLocked { name, .. } => {
            assert!(name.contains("RU create lock"), "{name}")
        }
        RollStoreError::Conflict { rc, .. } => assert_eq!(rc, f),
        other => panic!("expected P2's roll or its lock to stop it: {other:?}"),
    }
    let rolls = RollStore::new(c.clone()).list().await.unwrap();
    assert_eq!(rolls.rolls[&f].update.old_rc, e, "rcfarm reads P2's roll");
    assert_eq!(rolls.rolls[&f].update.desired_replicas, 3);
}

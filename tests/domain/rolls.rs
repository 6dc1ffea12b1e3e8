//! The roll store against the embedded server: creation as P2 does it (update_creation locks,
//! conflicts, refusals), the record's bytes, starting from an RC, aborting.

use std::time::Duration;

use rcfarm::audit::{AuditRecord, events};
use rcfarm::consul::{Consul, QueryOptions, SessionRequest};
use rcfarm::labels::{LabelSet, LabelStore, LabelType};
use rcfarm::rc::{AllocationStrategy, NewRc, RcId, RcStore};
use rcfarm::roll::{
    NewRoll, RollStore, RollStoreError, StartRoll, Update, roll_key, update_creation_key,
};

use crate::common::{client, server};

const V1: &str = "id: web\nlaunchables:\n  app:\n    launchable_type: hoist\n    location: https://example.com/web-1.tar.gz\n";
const V2: &str = "id: web\nlaunchables:\n  app:\n    launchable_type: hoist\n    location: https://example.com/web-2.tar.gz\n";

async fn rc(c: &Consul, manifest: &str, replicas: u64) -> RcId {
    RcStore::new(c.clone())
        .create(
            NewRc {
                manifest: manifest.into(),
                node_selector: "env=prod".into(),
                pod_labels: [("availability_zone".to_string(), "az1".to_string())].into(),
                replicas_desired: replicas,
                strategy: AllocationStrategy::Dynamic,
                rc_labels: [("team".to_string(), "payments".to_string())].into(),
                disabled: false,
            },
            "test",
            false,
        )
        .await
        .unwrap()
        .rc
        .unwrap()
        .id
}

fn update(old: RcId, new: RcId, desired: u64, minimum: u64) -> Update {
    Update {
        old_rc: old,
        new_rc: new,
        desired_replicas: desired,
        minimum_replicas: minimum,
        leave_old: false,
        roll_delay: Duration::from_millis(1500),
    }
}

fn new_roll(u: Update) -> NewRoll {
    NewRoll {
        update: u,
        labels: LabelSet::new(),
    }
}

async fn raw(c: &Consul, key: &str) -> Option<Vec<u8>> {
    c.kv_get(key, &QueryOptions::default())
        .await
        .unwrap()
        .0
        .map(|e| e.value_bytes().to_vec())
}

#[tokio::test]
async fn a_roll_is_written_byte_for_byte_as_p2_writes_it_with_its_labels_and_audit_record() {
    let s = server().await;
    let c = client(&s);
    let (old, new) = (rc(&c, V1, 3).await, rc(&c, V2, 0).await);
    let store = RollStore::new(c.clone());
    let w = store
        .create(new_roll(update(old, new, 3, 2)), "alice", false)
        .await
        .unwrap();
    assert!(w.committed);
    let bytes = raw(&c, &roll_key(new)).await.unwrap();
    assert_eq!(
        String::from_utf8(bytes).unwrap(),
        format!(
            r#"{{"OldRC":"{old}","NewRC":"{new}","DesiredReplicas":3,"MinimumReplicas":2,"LeaveOld":false,"RollDelay":1500000000}}"#
        )
    );
    let (labels, _) = LabelStore::new(c.clone())
        .get(LabelType::Rolls, &new.to_string())
        .await
        .unwrap();
    assert_eq!(labels["pod_id"], "web");
    assert_eq!(labels["availability_zone"], "az1");
    // The update_creation locks are given back (deleted) at once.
    for id in [old, new] {
        assert!(raw(&c, &update_creation_key(id)).await.is_none());
    }
    let (entries, _) = c
        .kv_list("audit_logs/", &QueryOptions::default())
        .await
        .unwrap();
    let creation: Vec<AuditRecord> = entries
        .iter()
        .filter_map(|e| AuditRecord::from_kv(&e.key, e.value_bytes()).ok())
        .filter(|r| r.event_type == events::ROLL_CREATION)
        .collect();
    assert_eq!(creation.len(), 1);
    let d = &creation[0].event_details;
    assert_eq!(d["rolling_update_id"], new.to_string());
    assert_eq!(d["deployer"], "alice");
    assert_eq!(d["manifest"], V2);
    assert_eq!(d["availability_zone"], "az1");
    let listed = store.list().await.unwrap();
    assert_eq!(listed.rolls[&new].update, w.update);
}

#[tokio::test]
async fn creation_refuses_conflicts_missing_rcs_nonsense_and_a_held_creation_lock() {
    let s = server().await;
    let c = client(&s);
    let store = RollStore::new(c.clone());
    let (a, b, d) = (
        rc(&c, V1, 3).await,
        rc(&c, V2, 0).await,
        rc(&c, V2, 0).await,
    );
    let refused = |r: Result<_, RollStoreError>| match r {
        Err(RollStoreError::Refused(why)) => why,
        other => panic!("expected a refusal, got {other:?}"),
    };
    let why = refused(store.create(new_roll(update(a, b, 3, 3)), "t", false).await);
    assert!(
        why.contains("--minimum (3) must be below --desired (3)"),
        "{why}"
    );
    let why = refused(store.create(new_roll(update(a, b, 0, 0)), "t", false).await);
    assert!(why.contains("--desired must be at least 1"), "{why}");
    let why = refused(store.create(new_roll(update(a, a, 3, 1)), "t", false).await);
    assert!(why.contains("same RC"), "{why}");
    let missing = RcId::new();
    assert!(matches!(
        store.create(new_roll(update(a, missing, 3, 1)), "t", false).await,
        Err(RollStoreError::RcNotFound(id)) if id == missing
    ));

    store
        .create(new_roll(update(a, b, 3, 1)), "t", false)
        .await
        .unwrap();
    // Either RC of a roll is taken: as old or as new.
    for u in [update(a, d, 3, 1), update(d, b, 3, 1)] {
        match store.create(new_roll(u), "t", false).await {
            Err(e @ RollStoreError::Conflict { .. }) => {
                assert!(e.to_string().contains("rcctl roll abort"), "{e}")
            }
            other => panic!("expected a conflict, got {other:?}"),
        }
    }
    // Another creator holds d's update_creation lock (a p2-rctl running, or one that died).
    let other = c
        .session_create(&SessionRequest {
            name: Some("RU create lock for elsewhere".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(
        c.kv_acquire(
            &update_creation_key(d),
            b"RU create lock for elsewhere",
            &other,
            None
        )
        .await
        .unwrap()
    );
    let e2 = rc(&c, V2, 0).await;
    match store
        .create(new_roll(update(d, e2, 3, 1)), "t", false)
        .await
    {
        Err(err @ RollStoreError::CreationLocked { .. }) => {
            let msg = err.to_string();
            assert!(msg.contains("RU create lock for elsewhere"), "{msg}");
            assert!(msg.contains("try again"), "{msg}");
        }
        other => panic!("expected the creation lock to stop it, got {other:?}"),
    }
    // The refused creation left no lock of its own behind.
    assert!(raw(&c, &update_creation_key(e2)).await.is_none());
}

#[tokio::test]
async fn start_makes_the_new_rc_from_the_old_and_a_dry_run_writes_nothing() {
    let s = server().await;
    let c = client(&s);
    let old = rc(&c, V1, 4).await;
    let store = RollStore::new(c.clone());
    let req = StartRoll {
        old_rc: old,
        manifest: V2.into(),
        desired: None,
        minimum: None,
        leave_old: false,
        roll_delay: Duration::ZERO,
    };
    let dry = store.start(req.clone(), "t", true).await.unwrap();
    assert!(!dry.committed);
    assert!(raw(&c, &roll_key(dry.update.new_rc)).await.is_none());
    assert!(raw(&c, &dry.update.new_rc.key()).await.is_none());
    assert_eq!(store.list().await.unwrap().rolls.len(), 0);

    let w = store.start(req, "t", false).await.unwrap();
    let u = w.update;
    assert_eq!((u.desired_replicas, u.minimum_replicas), (4, 3), "defaults");
    let new = RcStore::new(c.clone())
        .get(u.new_rc)
        .await
        .unwrap()
        .unwrap();
    let old_rc = RcStore::new(c.clone()).get(old).await.unwrap().unwrap();
    assert_eq!(new.replicas_desired, 0);
    assert_eq!(
        new.node_selector.to_string(),
        old_rc.node_selector.to_string()
    );
    assert_eq!(new.pod_labels, old_rc.pod_labels);
    assert_eq!(new.strategy, AllocationStrategy::Dynamic);
    assert_eq!(new.manifest.raw(), V2);
    let (labels, _) = LabelStore::new(c.clone())
        .get(LabelType::ReplicationController, &u.new_rc.to_string())
        .await
        .unwrap();
    assert_eq!(
        labels["team"], "payments",
        "the old RC's labels, for RC selectors"
    );

    // Abort: the record and its labels go, with P2's completion record (canceled).
    let a = store.abort(u.new_rc, "t", false).await.unwrap();
    assert!(a.committed);
    assert!(raw(&c, &roll_key(u.new_rc)).await.is_none());
    assert!(matches!(
        store.abort(u.new_rc, "t", false).await,
        Err(RollStoreError::NotFound(_))
    ));
}

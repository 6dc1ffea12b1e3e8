use std::time::Duration;

use rcfarm::audit::{AuditRecord, events};
use rcfarm::consul::{Consul, QueryOptions, SessionRequest, TxnFailure, TxnOp, WatchConfig};
use rcfarm::labels::{LabelSet, LabelStore, LabelType};
use rcfarm::rc::{
    AllocationStrategy, Mutation, NewRc, RcId, RcKeysWatch, RcProblem, RcRecords, RcStore,
    RcStoreError,
};

use crate::common::{client, eventually, http, server};

const MANIFEST: &str = "id: web\nlaunchables:\n  app:\n    launchable_type: hoist\n    location: https://example.com/web.tar.gz\n";

fn new_rc(replicas: u64) -> NewRc {
    NewRc {
        manifest: MANIFEST.into(),
        node_selector: "env=prod".into(),
        pod_labels: [("team".to_string(), "payments".to_string())].into(),
        replicas_desired: replicas,
        strategy: AllocationStrategy::Static,
        rc_labels: [("tier".to_string(), "web".to_string())].into(),
        disabled: false,
    }
}

async fn audit_records(c: &Consul) -> Vec<AuditRecord> {
    let (entries, _) = c
        .kv_list("audit_logs/", &QueryOptions::default())
        .await
        .unwrap();
    entries
        .iter()
        .map(|e| AuditRecord::from_kv(&e.key, e.value_bytes()).unwrap())
        .collect()
}

#[tokio::test]
async fn a_p2_record_put_with_plain_http_parses() {
    let s = server().await;
    let id = "0b5e8e2e-6b0f-4f3e-9d0a-2f7c1d5e9a11";
    let body = format!(
        r#"{{"id":"{id}","manifest":"id: legacy\nlaunchables: {{}}\n","node_selector":"az=west,tier in (web)","pod_labels":{{"cluster_name":"c1","availability_zone":"west"}},"replicas_desired":2,"disabled":false,"allocation_strategy":""}}"#
    );
    // What `curl -X PUT --data-binary @rc.json` sends.
    let r = http()
        .put(format!("{}/v1/kv/replication_controllers/{id}", s.url()))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.text().await.unwrap(), "true");
    let store = RcStore::new(client(&s));
    let rc = store.get(RcId::parse(id).unwrap()).await.unwrap().unwrap();
    assert_eq!(rc.pod_id(), "legacy");
    assert_eq!(rc.replicas_desired, 2);
    assert_eq!(rc.strategy, AllocationStrategy::Static);
    assert_eq!(rc.node_selector.to_string(), "az=west,tier in (web)");

    let missing = format!(
        r#"{{"id":"{id}","manifest":"id: legacy\n","node_selector":"","pod_labels":null,"disabled":false}}"#
    );
    http()
        .put(format!("{}/v1/kv/replication_controllers/{id}", s.url()))
        .body(missing)
        .send()
        .await
        .unwrap();
    let err = store.get(RcId::parse(id).unwrap()).await.unwrap_err();
    let RcStoreError::Invalid(inv) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(inv.problem, RcProblem::MissingReplicas);
    assert!(
        err.to_string().contains("replicas_desired"),
        "the message names the field: {err}"
    );
}

#[tokio::test]
async fn create_writes_rc_labels_and_audit_record_in_one_transaction() {
    let s = server().await;
    let c = client(&s);
    let store = RcStore::new(c.clone());
    let w = store.create(new_rc(3), "tester", false).await.unwrap();
    assert!(w.committed);
    let rc = w.rc.unwrap();
    let (entry, _) = c
        .kv_get(&rc.id.key(), &QueryOptions::default())
        .await
        .unwrap();
    let entry = entry.unwrap();
    let (labels, label_index) = LabelStore::new(c.clone())
        .get(LabelType::ReplicationController, &rc.id.to_string())
        .await
        .unwrap();
    assert_eq!(labels["pod_id"], "web");
    assert_eq!(labels["tier"], "web");
    let records = audit_records(&c).await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].event_type, events::RC_CREATED);
    assert_eq!(records[0].event_details["actor"], "tester");
    assert_eq!(
        records[0].event_details["replication_controller_id"],
        rc.id.to_string()
    );
    let (audit_entry, _) = c
        .kv_get(&records[0].key(), &QueryOptions::default())
        .await
        .unwrap();
    assert_eq!(
        entry.modify_index, label_index,
        "one transaction, one index"
    );
    assert_eq!(entry.modify_index, audit_entry.unwrap().modify_index);

    // A dry run builds the same kind of transaction and sends nothing.
    let before = c.stats().txns;
    let dry = store.create(new_rc(1), "tester", true).await.unwrap();
    assert!(!dry.committed);
    assert_eq!(dry.ops.len(), 3);
    assert_eq!(c.stats().txns, before);
    assert_eq!(store.list().await.unwrap().rcs.len(), 1);

    let bad = NewRc {
        node_selector: "env in prod".into(),
        ..new_rc(1)
    };
    assert!(matches!(
        store.create(bad, "t", false).await,
        Err(RcStoreError::BadChange(RcProblem::BadSelector(_)))
    ));
}

#[tokio::test]
async fn every_mutation_writes_its_audit_record() {
    let s = server().await;
    let c = client(&s);
    let store = RcStore::new(c.clone());
    let id = store
        .create(new_rc(2), "t", false)
        .await
        .unwrap()
        .rc
        .unwrap()
        .id;
    let muts = [
        Mutation::SetReplicas(5),
        Mutation::AddReplicas(-2),
        Mutation::AddReplicas(-10),
        Mutation::Disable,
        Mutation::Enable,
        Mutation::SetNodeSelector("env=prod,tier!=db".into()),
        Mutation::SetPodLabels([("team".to_string(), "risk".to_string())].into()),
        Mutation::SetStrategy(AllocationStrategy::Dynamic),
        Mutation::SetManifest(MANIFEST.replace("id: web", "id: web2")),
    ];
    for m in &muts {
        let w = store.mutate(id, m, "op", false).await.unwrap();
        assert!(w.committed, "{m:?}");
    }
    let rc = store.get(id).await.unwrap().unwrap();
    assert_eq!(rc.replicas_desired, 0, "floor at 0");
    assert!(!rc.disabled);
    assert_eq!(rc.node_selector.to_string(), "env=prod,tier!=db");
    assert_eq!(rc.pod_labels["team"], "risk");
    assert_eq!(rc.strategy, AllocationStrategy::Dynamic);
    assert_eq!(rc.pod_id(), "web2");
    let (labels, _) = LabelStore::new(c.clone())
        .get(LabelType::ReplicationController, &id.to_string())
        .await
        .unwrap();
    assert_eq!(
        labels["pod_id"], "web2",
        "the RC's pod_id label follows its manifest"
    );
    let modified: Vec<_> = audit_records(&c)
        .await
        .into_iter()
        .filter(|r| r.event_type == events::RC_MODIFIED)
        .collect();
    assert_eq!(modified.len(), muts.len());
    assert!(
        modified
            .iter()
            .any(|r| r.event_details["changes"]["replicas_desired"]
                == serde_json::json!({"old": 2, "new": 5}))
    );

    // A no-op change writes nothing; an invalid one is refused and writes nothing.
    let before = audit_records(&c).await.len();
    assert!(
        !store
            .mutate(id, &Mutation::Enable, "op", false)
            .await
            .unwrap()
            .committed
    );
    let err = store
        .mutate(id, &Mutation::SetNodeSelector("a in".into()), "op", false)
        .await
        .unwrap_err();
    assert!(
        matches!(err, RcStoreError::BadChange(RcProblem::BadSelector(_))),
        "{err}"
    );
    assert_eq!(audit_records(&c).await.len(), before);
    assert!(matches!(
        store
            .mutate(RcId::new(), &Mutation::Enable, "op", false)
            .await,
        Err(RcStoreError::NotFound(_))
    ));
}

#[tokio::test]
async fn racing_writers_on_one_rc_all_land_through_cas() {
    let s = server().await;
    let c = client(&s);
    let store = RcStore::new(c.clone());
    let id = store
        .create(new_rc(0), "t", false)
        .await
        .unwrap()
        .rc
        .unwrap()
        .id;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            store
                .mutate(id, &Mutation::AddReplicas(1), "racer", false)
                .await
        }));
    }
    let mut ok = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(w) => {
                assert!(w.committed);
                ok += 1;
            }
            // Bounded retries may give up under heavy contention; that must be reported.
            Err(RcStoreError::Contended { .. }) => {}
            Err(e) => panic!("{e}"),
        }
    }
    let rc = store.get(id).await.unwrap().unwrap();
    assert_eq!(
        rc.replicas_desired, ok,
        "every reported success is counted exactly once"
    );
    assert!(ok >= 1);
    let modified = audit_records(&c)
        .await
        .into_iter()
        .filter(|r| r.event_type == events::RC_MODIFIED)
        .count();
    assert_eq!(modified as u64, ok, "one audit record per committed change");
}

#[tokio::test]
async fn delete_is_refused_with_replicas_unless_forced_and_removes_labels() {
    let s = server().await;
    let c = client(&s);
    let store = RcStore::new(c.clone());
    let id = store
        .create(new_rc(3), "t", false)
        .await
        .unwrap()
        .rc
        .unwrap()
        .id;
    let err = store.delete(id, false, "op", false).await.unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("3 desired replicas") && msg.contains("--force") && msg.contains("rc scale"),
        "{msg}"
    );
    store
        .mutate(id, &Mutation::SetReplicas(0), "op", false)
        .await
        .unwrap();
    // At 0 replicas with a pod still there (its farm has not removed it yet, or its removal
    // is held): refused, naming the pod; the pod of another RC with the same pod id does not
    // count.
    let label = |rc: RcId| {
        serde_json::json!({"pod_id": "web", "replication_controller_id": rc.to_string()})
            .to_string()
            .into_bytes()
    };
    c.kv_put("labels/pod/node-7/web", &label(id), None)
        .await
        .unwrap();
    c.kv_put("labels/pod/node-8/web", &label(RcId::new()), None)
        .await
        .unwrap();
    let err = store.delete(id, false, "op", false).await.unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("it still has 1 pod (on node-7)")
            && msg.contains("rc scale")
            && msg.contains("--wait")
            && msg.contains("--force"),
        "{msg}"
    );
    c.kv_delete("labels/pod/node-7/web").await.unwrap();
    let (dry, left) = store.delete(id, false, "op", true).await.unwrap();
    assert!(!dry.committed && left.is_empty());
    assert!(store.get(id).await.unwrap().is_some());
    store.delete(id, false, "op", false).await.unwrap();
    assert!(store.get(id).await.unwrap().is_none());
    assert!(
        c.kv_get(
            &format!("labels/replication_controller/{id}"),
            &QueryOptions::default()
        )
        .await
        .unwrap()
        .0
        .is_none()
    );
    let deleted = audit_records(&c)
        .await
        .into_iter()
        .find(|r| r.event_type == events::RC_DELETED)
        .unwrap();
    assert_eq!(deleted.event_details["forced"], false);

    let id2 = store
        .create(new_rc(2), "t", false)
        .await
        .unwrap()
        .rc
        .unwrap()
        .id;
    c.kv_put("labels/pod/node-9/web", &label(id2), None)
        .await
        .unwrap();
    let (_, left) = store.delete(id2, true, "op", false).await.unwrap();
    assert!(store.get(id2).await.unwrap().is_none());
    assert_eq!(left, ["node-9"], "forced: the pods left running, named");
    let deleted = audit_records(&c)
        .await
        .into_iter()
        .filter(|r| r.event_type == events::RC_DELETED)
        .find(|r| r.event_details["replication_controller_id"] == id2.to_string())
        .unwrap();
    assert_eq!(deleted.event_details["forced"], true);
    assert_eq!(
        deleted.event_details["pods_left"],
        serde_json::json!(["node-9"])
    );
}

#[tokio::test]
async fn list_and_watch_report_bad_records_and_keep_the_good_ones() {
    let s = server().await;
    let c = client(&s);
    let store = RcStore::new(c.clone());
    let good = store
        .create(new_rc(1), "t", false)
        .await
        .unwrap()
        .rc
        .unwrap()
        .id;
    let bad_id = RcId::new();
    c.kv_put(&bad_id.key(), b"{\"id\": truncated", None)
        .await
        .unwrap();
    c.kv_put("replication_controllers/not-a-uuid", b"{}", None)
        .await
        .unwrap();
    let mismatched = RcId::new();
    c.kv_put(
        &mismatched.key(),
        format!(r#"{{"id":"{good}","manifest":"id: x","replicas_desired":1}}"#).as_bytes(),
        None,
    )
    .await
    .unwrap();

    let listing = store.list().await.unwrap();
    assert_eq!(listing.rcs.keys().copied().collect::<Vec<_>>(), [good]);
    assert_eq!(listing.invalid.len(), 3);
    assert!(matches!(
        listing.invalid[&bad_id.key()].problem,
        RcProblem::BadJson(_)
    ));
    assert!(matches!(
        listing.invalid[&mismatched.key()].problem,
        RcProblem::IdMismatch { .. }
    ));

    // A farm's view of the tree: its keys watched, the records it has a use for read (here
    // every RC's).
    let keys_watch = RcKeysWatch::spawn(&c, WatchConfig::default());
    let records = RcRecords::new(c.clone());
    let mut rx = keys_watch.subscribe();
    let keys = eventually(Duration::from_secs(5), "the tree's keys", || {
        let v = rx.borrow_and_update().clone();
        async move { v }
    })
    .await;
    assert_eq!((keys.ids.len(), keys.other.len()), (3, 1));
    let every = keys.ids.clone();
    assert!(records.sync(&keys, &every).await.unwrap());
    let first = records.latest().unwrap();
    assert_eq!((first.rcs.len(), first.invalid.len()), (1, 3));
    assert!(
        !records.sync(&keys, &every).await.unwrap(),
        "nothing moved: nothing read or dropped"
    );

    // Fixing the bad record makes it valid; the good one is untouched (same parse reused).
    let fixed = format!(
        r#"{{"id":"{bad_id}","manifest":"id: fixed\n","node_selector":"","pod_labels":null,"replicas_desired":0,"disabled":false,"allocation_strategy":"static_strategy"}}"#
    );
    c.kv_put(&bad_id.key(), fixed.as_bytes(), None)
        .await
        .unwrap();
    let keys = eventually(Duration::from_secs(5), "the keys after the fix", || {
        let v = rx
            .borrow_and_update()
            .clone()
            .filter(|k| k.index > keys.index);
        async move { v }
    })
    .await;
    assert!(records.sync(&keys, &every).await.unwrap());
    let next = records.latest().unwrap();
    assert_eq!((next.rcs.len(), next.invalid.len()), (2, 2));
    assert!(
        std::sync::Arc::ptr_eq(&first.rcs[&good], &next.rcs[&good]),
        "unchanged RCs are not re-parsed"
    );

    // The interest narrowed to the good RC: the others' records are dropped, the key that names
    // no RC is still reported.
    assert!(records.sync(&keys, &[good].into()).await.unwrap());
    let narrowed = records.latest().unwrap();
    assert_eq!(narrowed.rcs.keys().copied().collect::<Vec<_>>(), [good]);
    assert_eq!(
        narrowed.invalid.keys().collect::<Vec<_>>(),
        ["replication_controllers/not-a-uuid"]
    );
    assert!(narrowed.record(&bad_id).is_none() && narrowed.record(&good).is_some());
}

#[tokio::test]
async fn ownership_and_mutation_locks() {
    let s = server().await;
    let c = client(&s);
    let store = RcStore::new(c.clone());
    let id = store
        .create(new_rc(1), "t", false)
        .await
        .unwrap()
        .rc
        .unwrap()
        .id;
    let no_delay = SessionRequest {
        lock_delay: Some(Duration::ZERO),
        ..Default::default()
    };
    let a = c.session_create(&no_delay).await.unwrap();
    let b = c.session_create(&no_delay).await.unwrap();

    assert!(store.acquire_ownership(id, &a, "farm-a").await.unwrap());
    assert!(!store.acquire_ownership(id, &b, "farm-b").await.unwrap());
    assert!(store.acquire_mutation(id, &b, "transfer").await.unwrap());
    let (holders, garbage) = store.lock_holders().await.unwrap();
    assert!(garbage.is_empty());
    assert_eq!(
        holders[&id].ownership,
        Some((a.as_str().into(), "farm-a".into()))
    );
    assert_eq!(
        holders[&id].mutation,
        Some((b.as_str().into(), "transfer".into()))
    );

    // Fencing: a write checked against the ownership lock lands only for the holder.
    let write = |session: &str| {
        vec![
            TxnOp::check_session(id.ownership_lock_key(), session),
            TxnOp::set("intent/n1/web", MANIFEST.as_bytes().to_vec()),
        ]
    };
    c.txn(&write(&a)).await.unwrap();
    let err = c.txn(&write(&b)).await.unwrap_err();
    assert!(err.failed_at(0, TxnFailure::SessionMismatch));

    assert!(
        !store.release_ownership(id, &b).await.unwrap(),
        "only the holder releases"
    );
    assert!(store.release_ownership(id, &a).await.unwrap());
    assert!(
        c.kv_get(&id.ownership_lock_key(), &QueryOptions::default())
            .await
            .unwrap()
            .0
            .is_none(),
        "released by deleting the key"
    );
    assert!(
        store.acquire_ownership(id, &b, "farm-b").await.unwrap(),
        "no lock-delay after an explicit release"
    );
    // One session, two users of the mutation lock (a node transfer, a rolling update): neither
    // takes it from the other, nor releases it for the other.
    assert!(
        store.acquire_mutation(id, &b, "transfer").await.unwrap(),
        "held already"
    );
    assert!(!store.acquire_mutation(id, &b, "roll").await.unwrap());
    assert!(!store.release_mutation(id, &b, "roll").await.unwrap());
    assert!(
        !store.acquire_mutation(id, &a, "transfer").await.unwrap(),
        "another session"
    );
    assert!(store.release_mutation(id, &b, "transfer").await.unwrap());
    assert!(store.acquire_mutation(id, &b, "roll").await.unwrap());
    assert!(store.release_mutation(id, &b, "roll").await.unwrap());
    // A free key left behind (a lock released without deleting it) is taken too.
    c.kv_put(&id.mutation_lock_key(), b"", None).await.unwrap();
    assert!(store.acquire_mutation(id, &a, "roll").await.unwrap());
    let (holders, _) = store.lock_holders().await.unwrap();
    assert_eq!(
        holders[&id].mutation,
        Some((a.as_str().into(), "roll".into()))
    );
    assert!(holders[&id].mutation_index.is_some());
    let _unused: LabelSet = LabelSet::new();
}

#[tokio::test]
async fn a_handover_releases_only_its_own_transfer_locks_in_one_listing() {
    let s = server().await;
    let c = client(&s);
    let store = RcStore::new(c.clone());
    let mut ids = Vec::new();
    for i in 0..4 {
        ids.push(
            store
                .create(new_rc(i + 1), "t", false)
                .await
                .unwrap()
                .rc
                .unwrap()
                .id,
        );
    }
    let no_delay = SessionRequest {
        lock_delay: Some(Duration::ZERO),
        ..Default::default()
    };
    let a = c.session_create(&no_delay).await.unwrap();
    let b = c.session_create(&no_delay).await.unwrap();
    // ids[0], ids[1]: transfers of session a; ids[2]: a's rolling update; ids[3]: b's transfer.
    for id in &ids[..2] {
        assert!(
            store
                .acquire_mutation(*id, &a, &id.node_transfer_holder())
                .await
                .unwrap()
        );
    }
    assert!(store.acquire_mutation(ids[2], &a, "roll").await.unwrap());
    assert!(
        store
            .acquire_mutation(ids[3], &b, &ids[3].node_transfer_holder())
            .await
            .unwrap()
    );
    let before = c.stats().requests;
    // a hands over ids[1..]: only ids[1]'s transfer lock is a's to release here.
    assert_eq!(
        store
            .release_transfer_mutations(&ids[1..], &a)
            .await
            .unwrap(),
        1
    );
    assert_eq!(c.stats().requests - before, 2, "one listing, one release");
    let (holders, _) = store.lock_holders().await.unwrap();
    let mutation = |i: usize| holders.get(&ids[i]).and_then(|h| h.mutation.clone());
    assert_eq!(
        mutation(0),
        Some((a.as_str().into(), ids[0].node_transfer_holder().into()))
    );
    assert_eq!(mutation(1), None);
    assert_eq!(mutation(2), Some((a.as_str().into(), "roll".into())));
    assert_eq!(
        mutation(3),
        Some((b.as_str().into(), ids[3].node_transfer_holder().into()))
    );
}

//! The fenced transaction against each backend: what every farm write relies on, that a
//! failure is named by the part that failed, read from the op indexes the server reports.

use rcfarm::consul::{
    BatchError, Fence, FenceError, FencedBatch, FencedTxn, QueryOptions, SessionId, SessionRequest,
    TxnFailure, TxnOp,
};

use crate::harness::{Backend, Cluster};
use crate::on_every_backend;

async fn session(c: &Cluster) -> SessionId {
    c.consul
        .session_create(&SessionRequest::default())
        .await
        .unwrap()
        .into()
}

fn record(key: &str) -> TxnOp {
    TxnOp::cas(format!("audit_logs/{key}"), b"{}".to_vec(), 0)
}

on_every_backend!(each_failure_is_named_by_the_part_that_failed);
async fn each_failure_is_named_by_the_part_that_failed(b: Backend) {
    let c = Cluster::start_on(&b).await;
    let (ours, theirs) = (session(&c).await, session(&c).await);
    c.consul
        .txn(&[TxnOp::lock("fence/lock", b"f1".to_vec(), &ours)])
        .await
        .unwrap();
    c.consul.kv_put("fence/rc", b"v1", None).await.unwrap();
    let (rc, _) = c
        .consul
        .kv_get("fence/rc", &QueryOptions::default())
        .await
        .unwrap();
    let rc_index = rc.unwrap().modify_index;
    let fenced = |s: &SessionId| FencedTxn::fenced(Fence::new("fence/lock", s));

    // Everything as planned: committed, with its record.
    let index = fenced(&ours)
        .guard(TxnOp::check_index("fence/rc", rc_index))
        .op(TxnOp::set("fence/intent", b"x".to_vec()))
        .records([record("r1")])
        .commit(&c.consul)
        .await
        .unwrap();
    assert!(index > rc_index);

    // Another session's write under our lock: fenced, whatever else is wrong with it.
    let e = fenced(&theirs)
        .guard(TxnOp::check_index("fence/rc", rc_index + 1000))
        .op(TxnOp::set("fence/intent", b"y".to_vec()))
        .commit(&c.consul)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, FenceError::Fenced { key } if key == "fence/lock"),
        "{e:?}"
    );

    // The RC moved since the plan: stale, naming the guard.
    let e = fenced(&ours)
        .guard(TxnOp::check_session("fence/lock", &ours))
        .guard(TxnOp::check_index("fence/rc", rc_index + 1000))
        .op(TxnOp::set("fence/intent", b"z".to_vec()))
        .commit(&c.consul)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, FenceError::Stale { guards, .. } if guards.as_slice() == [(1, TxnFailure::IndexStale)]),
        "{e:?}"
    );

    // A write of ours that someone else's write beat: a conflict, naming the op.
    let e = fenced(&ours)
        .op(TxnOp::set("fence/other", b"1".to_vec()))
        .op(TxnOp::cas("fence/rc", b"v2".to_vec(), rc_index + 1000))
        .commit(&c.consul)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, FenceError::Conflict { ops, .. } if ops.as_slice() == [(1, TxnFailure::IndexStale)]),
        "{e:?}"
    );

    // A deterministic report another farm made already: only the record failed.
    let e = fenced(&ours)
        .records([record("r1")])
        .commit(&c.consul)
        .await
        .unwrap_err();
    assert!(matches!(e, FenceError::AlreadyRecorded), "{e:?}");
    let e = FencedTxn::unfenced()
        .records([record("r1")])
        .commit(&c.consul)
        .await
        .unwrap_err();
    assert!(matches!(e, FenceError::AlreadyRecorded), "{e:?}");

    // Nothing of the refused transactions was applied.
    let (intent, _) = c
        .consul
        .kv_get("fence/intent", &QueryOptions::default())
        .await
        .unwrap();
    assert_eq!(intent.unwrap().value_bytes(), b"x");
    let (other, _) = c
        .consul
        .kv_get("fence/other", &QueryOptions::default())
        .await
        .unwrap();
    assert!(other.is_none());

    // The lock gone (deleted by hand): fenced too.
    c.consul.kv_delete("fence/lock").await.unwrap();
    let e = fenced(&ours)
        .op(TxnOp::set("fence/intent", b"w".to_vec()))
        .commit(&c.consul)
        .await
        .unwrap_err();
    assert!(matches!(e, FenceError::Fenced { .. }), "{e:?}");
}

on_every_backend!(a_batch_of_claims_names_the_units_refused);
async fn a_batch_of_claims_names_the_units_refused(b: Backend) {
    let c = Cluster::start_on(&b).await;
    let (ours, theirs) = (session(&c).await, session(&c).await);
    c.consul
        .txn(&[TxnOp::lock("claims/b", b"other".to_vec(), &theirs)])
        .await
        .unwrap();
    let claim = |k: &str| {
        FencedTxn::unfenced()
            .op(TxnOp::lock(format!("claims/{k}"), b"f1".to_vec(), &ours))
            .records([record(&format!("claimed-{k}"))])
    };
    let batch = FencedBatch::new(vec![claim("a"), claim("b"), claim("c")]);
    let Err(BatchError::Units(units)) = batch.commit(&c.consul).await else {
        panic!("the batch is refused unit by unit")
    };
    assert_eq!(units.len(), 1, "{units:?}");
    assert_eq!(units[0].0, 1);
    assert!(
        matches!(&units[0].1, FenceError::Conflict { ops, .. } if ops.as_slice() == [(0, TxnFailure::LockHeld)]),
        "{units:?}"
    );
    // The others go again without it.
    FencedBatch::new(vec![claim("a"), claim("c")])
        .commit(&c.consul)
        .await
        .unwrap();
    // Released one by one: the lock not ours is fenced, ours is deleted.
    for (k, ok) in [("a", true), ("b", false)] {
        let r = FencedTxn::fenced(Fence::new(format!("claims/{k}"), &ours))
            .op(TxnOp::delete(format!("claims/{k}")))
            .commit(&c.consul)
            .await;
        assert_eq!(r.is_ok(), ok, "{k}: {r:?}");
        if !ok {
            assert!(matches!(r, Err(FenceError::Fenced { .. })), "{r:?}");
        }
    }
}

on_every_backend!(a_pod_write_is_guarded_by_the_label_its_plan_saw);
/// The race behind chaos seed 5550123: an RC plans to write a pod on a node from what the
/// node's pod label said then; another RC writes that pod first. The planned write must fail
/// whole (intent included), not overwrite the other RC's pod with a label version read when it
/// is sent.
async fn a_pod_write_is_guarded_by_the_label_its_plan_saw(b: Backend) {
    use rcfarm::labels::{LabelStore, LabelType};
    use rcfarm::rc::{Rc, RcId};
    use std::collections::BTreeMap;

    let c = Cluster::start_on(&b).await;
    let rc = |id: RcId, version: u32| {
        let json = serde_json::json!({
            "id": id.to_string(),
            "manifest": format!("id: web\nversion: {version}\n"),
            "node_selector": "", "pod_labels": {}, "replicas_desired": 1,
            "disabled": false, "allocation_strategy": "dynamic_strategy",
        });
        Rc::from_kv(&id.key(), json.to_string().as_bytes(), 1).unwrap()
    };
    let (old, new, other) = (rc(RcId::new(), 1), rc(RcId::new(), 2), rc(RcId::new(), 3));
    let ours = session(&c).await;
    for r in [&old, &new, &other] {
        c.consul
            .txn(&[TxnOp::lock(r.id.ownership_lock_key(), b"f".to_vec(), &ours)])
            .await
            .unwrap();
    }
    let write = |r: &Rc, seen: &BTreeMap<String, (rcfarm::labels::LabelSet, u64)>| {
        FencedTxn::fenced(Fence::new(r.id.ownership_lock_key(), &ours))
            .ops(rcfarm::rctask::pod_write_ops(r, "node-00", seen))
    };
    // The old RC's pod on node-00.
    write(&old, &BTreeMap::new())
        .commit(&c.consul)
        .await
        .unwrap();
    let store = LabelStore::new(c.consul.clone());
    let (labels, index) = store.get(LabelType::Pod, "node-00/web").await.unwrap();
    let seen: BTreeMap<_, _> = [("node-00/web".to_string(), (labels, index))].into();
    // Planned from that view by the unrelated RC; meanwhile the roll's new RC takes the pod.
    write(&new, &seen).commit(&c.consul).await.unwrap();
    let e = write(&other, &seen).commit(&c.consul).await.unwrap_err();
    assert!(
        matches!(&e, FenceError::Conflict { ops, .. } if ops.iter().any(|(_, f)| *f == TxnFailure::IndexStale)),
        "{e:?}"
    );
    // Nothing of it landed: the pod is the new RC's, label and intent.
    let (labels, _) = store.get(LabelType::Pod, "node-00/web").await.unwrap();
    assert_eq!(labels["replication_controller_id"], new.id.to_string());
    let (intent, _) = c
        .consul
        .kv_get("intent/node-00/web", &QueryOptions::default())
        .await
        .unwrap();
    assert!(
        String::from_utf8_lossy(intent.unwrap().value_bytes()).contains("version: 2"),
        "the intent is the new RC's"
    );
    // A node the plan saw free is written create-only: taken meanwhile, the write fails too.
    let e = write(&other, &BTreeMap::new())
        .commit(&c.consul)
        .await
        .unwrap_err();
    assert!(matches!(&e, FenceError::Conflict { .. }), "{e:?}");
}

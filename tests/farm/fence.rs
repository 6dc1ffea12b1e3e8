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

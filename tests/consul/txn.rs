//! `/v1/txn`: every KV verb, typed results, rollback leaving nothing applied, typed errors.

use rcfarm::consul::{ConsulError, QueryOptions, SessionRequest, TxnFailure, TxnOp};

use crate::common::{client, server};

fn q() -> QueryOptions {
    QueryOptions::default()
}

#[tokio::test]
async fn every_verb_commits_with_results() {
    let s = server().await;
    let c = client(&s);
    let sess = c.session_create(&SessionRequest::default()).await.unwrap();
    c.kv_put("t/old", b"old", None).await.unwrap();
    c.kv_put("t/tree/a", b"a", None).await.unwrap();
    c.kv_put("t/tree/b", b"b", None).await.unwrap();
    c.kv_put("t/delcas", b"x", None).await.unwrap();
    let delcas = c
        .kv_get("t/delcas", &q())
        .await
        .unwrap()
        .0
        .unwrap()
        .modify_index;
    let old = c
        .kv_get("t/old", &q())
        .await
        .unwrap()
        .0
        .unwrap()
        .modify_index;

    let ops = vec![
        TxnOp::set("t/set", b"s".to_vec()).with_flags(7),
        TxnOp::cas("t/new", b"n".to_vec(), 0),
        TxnOp::cas("t/old", b"o2".to_vec(), old),
        TxnOp::lock("t/lock", b"l".to_vec(), &sess),
        TxnOp::check_session("t/lock", &sess),
        TxnOp::get("t/set"),
        TxnOp::get_or_empty("t/absent"),
        TxnOp::get_tree("t/tree/"),
        TxnOp::check_not_exists("t/absent"),
        TxnOp::delete("t/tree/a"),
        TxnOp::delete_cas("t/delcas", delcas),
        TxnOp::unlock("t/lock", b"done".to_vec(), &sess),
    ];
    let resp = c.txn(&ops).await.unwrap();
    let keys: Vec<&str> = resp.results.iter().map(|r| r.key.as_str()).collect();
    // get-tree runs before the delete, so it sees both entries; deletes and check-not-exists
    // yield no result.
    assert_eq!(
        keys,
        [
            "t/set", "t/new", "t/old", "t/lock", "t/lock", "t/set", "t/absent", "t/tree/a",
            "t/tree/b", "t/lock"
        ]
    );
    // Writes and checks report no value; the get verbs do; all ops share one index.
    assert_eq!(resp.results[0].value, None);
    assert_eq!(resp.results[0].flags, 7);
    assert_eq!(
        resp.results[5].value_bytes(),
        b"s",
        "ops see earlier ops' writes"
    );
    assert_eq!(resp.results[6].value, None);
    assert_eq!(resp.results[7].value_bytes(), b"a");
    let idx = resp.results[0].modify_index;
    assert!(
        resp.results
            .iter()
            .filter(|r| r.key != "t/tree/a" && r.key != "t/tree/b" && r.key != "t/absent")
            .all(|r| r.modify_index == idx)
    );
    assert_eq!(resp.results[3].session.as_deref(), Some(sess.as_str()));
    assert_eq!(resp.results[9].session, None, "unlocked");

    assert!(c.kv_get("t/tree/a", &q()).await.unwrap().0.is_none());
    assert!(c.kv_get("t/delcas", &q()).await.unwrap().0.is_none());
    let l = c.kv_get("t/lock", &q()).await.unwrap().0.unwrap();
    assert_eq!(
        (l.value_bytes(), l.lock_index, l.session.as_deref()),
        (&b"done"[..], 1, None)
    );

    let resp = c
        .txn(&[TxnOp::delete_tree("t/tree/"), TxnOp::delete("t/never")])
        .await
        .unwrap();
    assert!(resp.results.is_empty());
    assert!(c.kv_list("t/tree/", &q()).await.unwrap().0.is_empty());
}

#[tokio::test]
async fn a_failed_op_rolls_everything_back_and_names_every_failure() {
    let s = server().await;
    let c = client(&s);
    c.kv_put("r/exists", b"x", None).await.unwrap();
    let before = c.kv_list("", &q()).await.unwrap().0;
    let ops = vec![
        TxnOp::set("r/new", b"should not stay".to_vec()),
        TxnOp::delete("r/exists"),
        TxnOp::check_index("r/missing", 5),
        TxnOp::set("r/new2", b"nor this".to_vec()),
        TxnOp::check_not_exists("r/new"),
        TxnOp::check_session("r/new2", "no-such-session"),
    ];
    let err = c.txn(&ops).await.unwrap_err();
    let ConsulError::Conflict(errs) = &err else {
        panic!("{err:?}")
    };
    let failed: Vec<(usize, TxnFailure)> = errs.iter().map(|e| (e.op_index, e.failure())).collect();
    assert_eq!(
        failed,
        [
            (2, TxnFailure::KeyMissing),
            (4, TxnFailure::KeyExists),
            (5, TxnFailure::SessionMismatch)
        ]
    );
    assert_eq!(
        errs[2].what,
        r#"failed session check for key "r/new2", current session "" != "no-such-session""#
    );
    assert_eq!(
        c.kv_list("", &q()).await.unwrap().0,
        before,
        "nothing applied"
    );
}

#[tokio::test]
async fn fencing_check_session_fails_once_the_lock_moves() {
    let s = server().await;
    let c = client(&s);
    let a = c
        .session_create(&SessionRequest {
            lock_delay: Some(std::time::Duration::ZERO),
            ..Default::default()
        })
        .await
        .unwrap();
    let b = c.session_create(&SessionRequest::default()).await.unwrap();
    c.kv_acquire("own", b"", &a, None).await.unwrap();
    c.txn(&[
        TxnOp::check_session("own", &a),
        TxnOp::set("data", b"a1".to_vec()),
    ])
    .await
    .unwrap();
    c.session_destroy(&a).await.unwrap();
    c.kv_acquire("own", b"", &b, None).await.unwrap();
    let err = c
        .txn(&[
            TxnOp::check_session("own", &a),
            TxnOp::set("data", b"a2".to_vec()),
        ])
        .await
        .unwrap_err();
    assert!(err.failed_at(0, TxnFailure::SessionMismatch));
    assert_eq!(err.reason_label(), "fenced");
    assert_eq!(
        c.kv_get("data", &q())
            .await
            .unwrap()
            .0
            .unwrap()
            .value_bytes(),
        b"a1"
    );
}

#[tokio::test]
async fn cas_lock_and_unlock_failures_are_typed() {
    let s = server().await;
    let c = client(&s);
    let a = c.session_create(&SessionRequest::default()).await.unwrap();
    let b = c.session_create(&SessionRequest::default()).await.unwrap();
    c.kv_put("k", b"x", None).await.unwrap();
    c.kv_acquire("l", b"", &a, None).await.unwrap();
    let cases: Vec<(TxnOp, TxnFailure)> = vec![
        (TxnOp::cas("k", b"y".to_vec(), 0), TxnFailure::IndexStale),
        (TxnOp::cas("k", b"y".to_vec(), 9999), TxnFailure::IndexStale),
        (TxnOp::delete_cas("k", 9999), TxnFailure::IndexStale),
        (TxnOp::check_index("k", 9999), TxnFailure::IndexStale),
        (TxnOp::lock("l", b"".to_vec(), &b), TxnFailure::LockHeld),
        (
            TxnOp::unlock("l", b"".to_vec(), &b),
            TxnFailure::NotLockHolder,
        ),
        (
            TxnOp::lock("l2", b"".to_vec(), "00000000-0000-0000-0000-000000000000"),
            TxnFailure::InvalidSession,
        ),
        (TxnOp::get("absent"), TxnFailure::KeyMissing),
        (TxnOp::check_session("absent", &a), TxnFailure::KeyMissing),
    ];
    for (op, want) in cases {
        let err = c.txn(std::slice::from_ref(&op)).await.unwrap_err();
        assert!(err.failed_at(0, want), "{op:?}: {err}");
    }
}

#[tokio::test]
async fn more_than_64_ops_are_refused_before_sending() {
    let s = server().await;
    let c = client(&s);
    let ops: Vec<TxnOp> = (0..65)
        .map(|i| TxnOp::set(format!("many/{i}"), b"x".to_vec()))
        .collect();
    let before = c.stats().requests;
    let err = c.txn(&ops).await.unwrap_err();
    assert!(
        matches!(
            err,
            ConsulError::TooManyOps {
                count: 65,
                limit: 64
            }
        ),
        "{err:?}"
    );
    assert_eq!(c.stats().requests, before, "nothing was sent");
    c.txn(&ops[..64]).await.unwrap();
    assert_eq!(c.kv_keys("many/", None, &q()).await.unwrap().0.len(), 64);
}

#[tokio::test]
async fn read_only_transactions_read_a_consistent_view() {
    let s = server().await;
    let c = client(&s);
    c.kv_put("ro/a", b"1", None).await.unwrap();
    let resp = c
        .txn(&[
            TxnOp::get("ro/a"),
            TxnOp::get_tree("ro/"),
            TxnOp::check_not_exists("ro/b"),
        ])
        .await
        .unwrap();
    assert_eq!(resp.results.len(), 2);
    assert_eq!(resp.index, None, "a read-only transaction carries no index");
    let err = c.txn(&[TxnOp::get("ro/missing")]).await.unwrap_err();
    assert!(err.failed_at(0, TxnFailure::KeyMissing));
}

/// Callers queued for a connection share one transaction, yet each keeps its own outcome: the
/// one whose check fails gets its failure (at its own op index) and nothing of it applies,
/// while the others commit.
#[tokio::test]
async fn coalesced_transactions_share_requests_and_keep_their_own_outcomes() {
    let s = server().await;
    // Two connections: one for sessions, one shared; every caller but one queues.
    let c = rcfarm::consul::Consul::new(rcfarm::consul::ConsulConfig {
        max_conns: 2,
        ..rcfarm::consul::ConsulConfig::new(s.url())
    })
    .unwrap();
    let before = c.stats().txns;
    let calls: Vec<_> = (0..40)
        .map(|i| {
            let c = c.clone();
            tokio::spawn(async move {
                let mut ops = vec![
                    TxnOp::set(format!("co/{i}/a"), b"a".to_vec()),
                    TxnOp::set(format!("co/{i}/b"), b"b".to_vec()),
                ];
                if i == 7 {
                    ops.push(TxnOp::check_index("co/missing", 3));
                }
                if i == 9 {
                    // Only a delete: no result, so no index, as alone.
                    ops = vec![TxnOp::delete("co/none")];
                }
                (i, c.txn_coalesced(ops).await)
            })
        })
        .collect();
    let mut committed = 0;
    for call in calls {
        let (i, r) = call.await.unwrap();
        match i {
            7 => {
                let Err(ConsulError::Conflict(errs)) = &r else {
                    panic!("{r:?}")
                };
                assert_eq!(errs.len(), 1, "{errs:?}");
                assert_eq!(errs[0].op_index, 2, "its own op index");
                assert_eq!(errs[0].failure(), TxnFailure::KeyMissing);
            }
            9 => assert_eq!(r.unwrap().index, 0),
            _ => {
                let r = r.unwrap();
                assert!(r.index > 0);
                // Each caller learns its own keys' indexes, and none of another's.
                for k in ["a", "b"] {
                    assert_eq!(r.modify_index(&format!("co/{i}/{k}")), Some(r.index));
                }
                assert_eq!(r.modify_index(&format!("co/{}/a", (i + 1) % 40)), None);
                committed += 1;
            }
        }
    }
    assert_eq!(committed, 38);
    let keys = c.kv_keys("co/", None, &q()).await.unwrap().0;
    assert_eq!(keys.len(), 76, "38 callers × 2 keys: {keys:?}");
    assert!(!keys.iter().any(|k| k.starts_with("co/7/")), "{keys:?}");
    let sent = c.stats().txns - before;
    assert!(
        sent < 40,
        "40 callers queued behind one connection were sent in {sent} transactions"
    );
    eprintln!("FIGURE 40 queued transactions sent in {sent} requests");
}

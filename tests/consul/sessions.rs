//! Sessions: create/info/list/renew/destroy, TTL expiry releasing or deleting keys, lock-delay,
//! and the background renewer's loss signal.

use std::time::{Duration, Instant};

use rcfarm::consul::{
    ConsulError, QueryOptions, Session, SessionBehavior, SessionConfig, SessionRequest, TxnFailure,
    TxnOp,
};
use rcfarm::server::{EmbeddedServer, ServerConfig};

use crate::common::{client, eventually, server};

fn q() -> QueryOptions {
    QueryOptions::default()
}

#[tokio::test]
async fn create_info_list_renew_destroy() {
    let s = server().await;
    let c = client(&s);
    let id = c
        .session_create(&SessionRequest {
            name: Some("farm-a".into()),
            ttl: Some(Duration::from_secs(15)),
            lock_delay: Some(Duration::from_millis(250)),
            behavior: Some(SessionBehavior::Delete),
            ..Default::default()
        })
        .await
        .unwrap();
    let (info, meta) = c.session_info(&id, &q()).await.unwrap();
    let info = info.unwrap();
    assert_eq!(info.name, "farm-a");
    assert_eq!(info.ttl, "15s");
    assert_eq!(info.behavior, "delete");
    assert_eq!(
        info.lock_delay, 250_000_000,
        "LockDelay is reported in nanoseconds"
    );
    assert_eq!(
        info.node_checks.as_deref(),
        Some(&["serfHealth".to_string()][..])
    );
    assert!(meta.index >= info.create_index);

    let renewed = c.session_renew(&id).await.unwrap();
    assert_eq!(renewed.id, id);
    let (list, _) = c.session_list(&q()).await.unwrap();
    assert_eq!(
        list.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
        [id.as_str()]
    );

    c.session_destroy(&id).await.unwrap();
    assert!(c.session_info(&id, &q()).await.unwrap().0.is_none());
    assert!(matches!(
        c.session_renew(&id).await,
        Err(ConsulError::NotFound(_))
    ));
    // Destroying an unknown session is fine.
    c.session_destroy(&id).await.unwrap();
}

#[tokio::test]
async fn ttl_outside_the_allowed_range_is_refused() {
    let s = server().await; // session_ttl_min = 1s
    let c = client(&s);
    for ttl in [Duration::from_millis(500), Duration::from_secs(25 * 3600)] {
        let err = c
            .session_create(&SessionRequest {
                ttl: Some(ttl),
                ..Default::default()
            })
            .await
            .unwrap_err();
        match err {
            ConsulError::Rejected { status: 500, body } => {
                assert!(body.starts_with("Invalid Session TTL"), "{body}")
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[tokio::test]
async fn expiry_releases_keys_after_two_ttls() {
    let s = server().await;
    let c = client(&s);
    let id = c
        .session_create(&SessionRequest {
            ttl: Some(Duration::from_secs(1)),
            lock_delay: Some(Duration::ZERO),
            ..Default::default()
        })
        .await
        .unwrap();
    let created = Instant::now();
    assert!(c.kv_acquire("rel/lock", b"v", &id, None).await.unwrap());
    let held = c.kv_get("rel/lock", &q()).await.unwrap().0.unwrap();

    let released = eventually(Duration::from_secs(6), "session expiry", || {
        let c = c.clone();
        async move {
            c.kv_get("rel/lock", &q())
                .await
                .unwrap()
                .0
                .filter(|e| e.session.is_none())
        }
    })
    .await;
    let took = created.elapsed();
    assert!(
        took >= Duration::from_millis(1900),
        "TTL is a lower bound: invalidated after 2×TTL, took {took:?}"
    );
    assert_eq!(released.value_bytes(), b"v", "release keeps the value");
    assert_eq!(released.lock_index, held.lock_index, "and LockIndex");
    assert!(
        released.modify_index > held.modify_index,
        "ModifyIndex is bumped"
    );
    assert!(c.session_info(&id, &q()).await.unwrap().0.is_none());
}

#[tokio::test]
async fn renewal_keeps_a_session_alive() {
    let s = server().await;
    let c = client(&s);
    let id = c
        .session_create(&SessionRequest {
            ttl: Some(Duration::from_secs(1)),
            ..Default::default()
        })
        .await
        .unwrap();
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        c.session_renew(&id).await.unwrap();
    }
    assert!(
        c.session_info(&id, &q()).await.unwrap().0.is_some(),
        "alive after 4 s of 1 s TTL"
    );
}

#[tokio::test]
async fn expiry_with_delete_behavior_deletes_keys() {
    let s = server().await;
    let c = client(&s);
    let id = c
        .session_create(&SessionRequest {
            ttl: Some(Duration::from_secs(1)),
            behavior: Some(SessionBehavior::Delete),
            ..Default::default()
        })
        .await
        .unwrap();
    c.kv_acquire("del/lock", b"v", &id, None).await.unwrap();
    eventually(Duration::from_secs(6), "key deleted by expiry", || {
        let c = c.clone();
        async move {
            c.kv_get("del/lock", &q())
                .await
                .unwrap()
                .0
                .is_none()
                .then_some(())
        }
    })
    .await;
}

#[tokio::test]
async fn lock_delay_blocks_acquire_after_invalidation_but_not_plain_writes() {
    let s = server().await;
    let c = client(&s);
    let a = c
        .session_create(&SessionRequest {
            lock_delay: Some(Duration::from_millis(1500)),
            ..Default::default()
        })
        .await
        .unwrap();
    let b = c.session_create(&SessionRequest::default()).await.unwrap();
    assert!(c.kv_acquire("ld", b"a", &a, None).await.unwrap());
    c.session_destroy(&a).await.unwrap();
    let invalidated = Instant::now();

    assert!(
        !c.kv_acquire("ld", b"b", &b, None).await.unwrap(),
        "acquire refused during lock-delay"
    );
    let err = c
        .txn(&[TxnOp::lock("ld", b"b".to_vec(), &b)])
        .await
        .unwrap_err();
    assert!(err.failed_at(0, TxnFailure::LockDelay), "{err}");
    assert!(
        c.kv_put("ld", b"plain", None).await.unwrap(),
        "plain PUT is not blocked"
    );
    let e = c.kv_get("ld", &q()).await.unwrap().0.unwrap();
    assert!(
        c.kv_cas("ld", b"cas", e.modify_index, None).await.unwrap(),
        "CAS is not blocked"
    );

    eventually(Duration::from_secs(5), "lock-delay to pass", || {
        let c = c.clone();
        let b = b.clone();
        async move {
            c.kv_acquire("ld", b"b", &b, None)
                .await
                .unwrap()
                .then_some(())
        }
    })
    .await;
    assert!(invalidated.elapsed() >= Duration::from_millis(1400));
}

#[tokio::test]
async fn renewer_keeps_the_session_and_signals_loss_promptly() {
    let s = server().await;
    let c = client(&s);
    let cfg = SessionConfig {
        name: "renewer".into(),
        ttl: Duration::from_secs(1),
        lock_delay: Duration::ZERO,
        behavior: SessionBehavior::Delete,
    };
    let session = Session::create(&c, &cfg).await.unwrap();
    // Six renewals: three TTLs, each of which would have expired it unrenewed.
    eventually(Duration::from_secs(10), "six renewals", || async {
        (session.renewals() >= 6 || session.is_lost()).then_some(())
    })
    .await;
    assert!(
        !session.is_lost(),
        "renewed every TTL/2: {:?}",
        session.loss_reason()
    );
    assert!(session.renewals() >= 4, "renewals: {}", session.renewals());
    assert!(
        c.session_info(session.id(), &q())
            .await
            .unwrap()
            .0
            .is_some()
    );

    // Someone destroys it behind our back: the next renewal gets a 404.
    c.session_destroy(session.id()).await.unwrap();
    let destroyed = Instant::now();
    tokio::time::timeout(Duration::from_secs(3), session.lost().cancelled())
        .await
        .expect("loss signalled");
    assert!(
        destroyed.elapsed() <= Duration::from_millis(1100),
        "within about TTL/2"
    );
    assert!(session.loss_reason().unwrap().contains("404"));
}

/// Renewals that fail do not mean the session is gone (an election restarts every session's
/// timer): after one TTL the session is in doubt, renewing goes on, and it is lost only when
/// Consul answers that it no longer knows it.
#[tokio::test]
async fn renewer_is_in_doubt_after_a_ttl_without_consul_and_lost_only_on_404() {
    let s = server().await;
    let addr = s.addr();
    let c = client(&s);
    let cfg = SessionConfig {
        name: "renewer".into(),
        ttl: Duration::from_secs(2),
        lock_delay: Duration::ZERO,
        behavior: SessionBehavior::Release,
    };
    let session = Session::create(&c, &cfg).await.unwrap();
    let mut doubt = session.doubt();
    assert!(!*doubt.borrow());
    s.shutdown().await;
    let stopped = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), doubt.wait_for(|d| *d))
        .await
        .expect("doubt signalled")
        .unwrap();
    assert!(
        stopped.elapsed() <= Duration::from_millis(2300),
        "in doubt no later than one TTL: {:?}",
        stopped.elapsed()
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !session.is_lost(),
        "lost without Consul saying so: {:?}",
        session.loss_reason()
    );

    // Consul is back, without the session (a memory-only server): the next renewal hears 404.
    let back = EmbeddedServer::start(ServerConfig {
        listen: addr,
        session_ttl_min: Duration::from_secs(1),
        ..ServerConfig::ephemeral()
    })
    .await
    .unwrap();
    tokio::time::timeout(Duration::from_secs(5), session.lost().cancelled())
        .await
        .expect("loss signalled once Consul answers");
    assert!(session.loss_reason().unwrap().contains("404"));
    back.shutdown().await;
}

#[tokio::test]
async fn destroy_releases_the_locks_it_holds() {
    let s = server().await;
    let c = client(&s);
    let cfg = SessionConfig {
        name: "d".into(),
        ttl: Duration::from_secs(10),
        lock_delay: Duration::ZERO,
        behavior: SessionBehavior::Release,
    };
    let session = Session::create(&c, &cfg).await.unwrap();
    c.kv_acquire("dl", b"x", session.id(), None).await.unwrap();
    session.destroy().await.unwrap();
    let e = c.kv_get("dl", &q()).await.unwrap().0.unwrap();
    assert!(e.session.is_none());
}

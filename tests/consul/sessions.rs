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
    // Its state is behind the session's creation, as a restarted server's is until it has
    // applied its log, so the loss is declared once that lasted a TTL (see the next test).
    let back = EmbeddedServer::start(ServerConfig {
        listen: addr,
        session_ttl_min: Duration::from_secs(1),
        ..ServerConfig::ephemeral()
    })
    .await
    .unwrap();
    tokio::time::timeout(Duration::from_secs(10), session.lost().cancelled())
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

/// What the scripted Consul below answers about the one session it knows.
#[derive(Clone, Copy, PartialEq)]
enum Replay {
    /// Renewals succeed.
    Serving,
    /// A restarted server that answers as leader before it has applied its log again: 404 on
    /// renew, and the session absent from a state (index 3) before its creation (index 7).
    Behind,
    /// The session was destroyed: 404 on renew, absent at index 12.
    Gone,
}

/// A Consul that knows one session, `s1`, created at index 7, answering as `mode` says.
async fn scripted_consul(
    mode: std::sync::Arc<parking_lot::Mutex<Replay>>,
) -> (String, tokio_util::sync::CancellationToken) {
    use axum::http::{StatusCode, Uri};
    let entry = r#"[{"ID":"s1","Name":"renewer","Node":"n","LockDelay":0,"Behavior":"release","TTL":"2s","CreateIndex":7,"ModifyIndex":7}]"#;
    let app = axum::Router::new().fallback(move |uri: Uri| {
        let mode = *mode.lock();
        async move {
            let path = uri.path();
            let (status, index, body) = if path == "/v1/session/create" {
                (StatusCode::OK, 7, r#"{"ID":"s1"}"#)
            } else if path.starts_with("/v1/session/renew/") {
                match mode {
                    Replay::Serving => (StatusCode::OK, 8, entry),
                    _ => (StatusCode::NOT_FOUND, 0, "Session id 's1' not found"),
                }
            } else if path.starts_with("/v1/session/info/") {
                match mode {
                    Replay::Serving => (StatusCode::OK, 8, entry),
                    Replay::Behind => (StatusCode::OK, 3, "null"),
                    Replay::Gone => (StatusCode::OK, 12, "null"),
                }
            } else {
                (StatusCode::NOT_FOUND, 0, "not scripted")
            };
            (status, [("X-Consul-Index", index.to_string())], body)
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    let s = stop.clone();
    tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(s.cancelled_owned())
            .await
    });
    (url, stop)
}

/// A restarted Consul 0.7 server answers as leader before it has applied its log again, and
/// for that moment knows none of the sessions created since its last snapshot (seen on the
/// 0.7.0 binary: a farm gave its session up, which the server then kept). A 404 from a state
/// before the session's creation puts the session in doubt, not lost; once Consul has caught
/// up, renewals go on with the same session. A 404 from a state past its creation is a loss,
/// at once; one from a state that never catches up (a Consul back empty) is, after a TTL.
#[tokio::test]
async fn a_404_from_a_consul_still_applying_its_log_is_doubt_not_loss() {
    crate::common::init_tracing();
    let mode = std::sync::Arc::new(parking_lot::Mutex::new(Replay::Serving));
    let (url, stop) = scripted_consul(mode.clone()).await;
    let c = crate::common::client_for(&url);
    let cfg = SessionConfig {
        name: "renewer".into(),
        ttl: Duration::from_secs(2),
        lock_delay: Duration::ZERO,
        behavior: SessionBehavior::Release,
    };

    // A session renewed once, while Consul serves.
    let (m, cr, cfgr) = (&mode, &c, &cfg);
    let renewed_once = move || async move {
        *m.lock() = Replay::Serving;
        let session = Session::create(cr, cfgr).await.unwrap();
        eventually(Duration::from_secs(5), "a renewal", || async {
            (session.renewals() >= 1).then_some(())
        })
        .await;
        session
    };

    // Catching up: in doubt while Consul is behind, the same session once it has caught up.
    let session = renewed_once().await;
    *mode.lock() = Replay::Behind;
    let mut doubt = session.doubt();
    tokio::time::timeout(Duration::from_secs(5), doubt.wait_for(|d| *d))
        .await
        .expect("in doubt after a 404 from a state before the session's creation")
        .unwrap();
    assert!(!session.is_lost(), "{:?}", session.loss_reason());
    let renewed = session.renewals();
    *mode.lock() = Replay::Serving;
    tokio::time::timeout(Duration::from_secs(5), doubt.wait_for(|d| !*d))
        .await
        .expect("out of doubt once Consul has caught up")
        .unwrap();
    assert!(session.renewals() > renewed);
    assert!(!session.is_lost(), "{:?}", session.loss_reason());
    drop(session);

    // A Consul that never catches up: lost after about a TTL of 404s, not before.
    let session = renewed_once().await;
    *mode.lock() = Replay::Behind;
    let behind = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), session.lost().cancelled())
        .await
        .expect("lost once a TTL has passed without Consul catching up");
    assert!(
        behind.elapsed() >= Duration::from_secs(2),
        "lost before a TTL of 404s: {:?}",
        behind.elapsed()
    );
    let reason = session.loss_reason().unwrap();
    assert!(
        reason.contains("404") && reason.contains("index 3"),
        "{reason}"
    );
    drop(session);

    // Gone: a 404 from a state past the session's creation is believed at once.
    let session = renewed_once().await;
    *mode.lock() = Replay::Gone;
    let gone = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), session.lost().cancelled())
        .await
        .expect("lost");
    assert!(
        gone.elapsed() < Duration::from_secs(2),
        "believed at once: {:?}",
        gone.elapsed()
    );
    assert!(session.loss_reason().unwrap().contains("404"));
    stop.cancel();
}

/// A farm's runtime can be busy for seconds at a time (decoding and indexing a watch answer of a
/// million pod labels); its session must not be lost for that. The renewer runs on a thread of
/// its own: with every worker of the caller's runtime blocked for twice the TTL and more (long
/// enough for Consul to expire a session renewed from those workers), renewals go on and the
/// session holds. The server runs on a runtime of its own, as Consul would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_outlives_a_runtime_whose_workers_are_all_busy() {
    crate::common::init_tracing();
    let (url_tx, url_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server_thread = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let s = server().await;
            url_tx.send(s.url()).unwrap();
            let _ = stop_rx.await;
            s.shutdown().await;
        });
    });
    let url = url_rx.recv().unwrap();
    let c = crate::common::client_for(&url);
    let ttl = Duration::from_secs(1);
    let session = Session::create(
        &c,
        &SessionConfig {
            name: "busy".into(),
            ttl,
            lock_delay: Duration::ZERO,
            behavior: SessionBehavior::Release,
        },
    )
    .await
    .unwrap();
    eventually(Duration::from_secs(5), "a renewal", || async {
        (session.renewals() >= 1).then_some(())
    })
    .await;

    // Both workers blocked (not awaiting: busy) for 4 TTLs; this future waits on neither.
    let before = session.renewals();
    let busy: Vec<_> = (0..2)
        .map(|_| tokio::spawn(async move { std::thread::sleep(4 * ttl) }))
        .collect();
    for b in busy {
        b.await.unwrap();
    }
    let during = session.renewals() - before;
    assert!(
        during >= 3,
        "renewed {during} times while the runtime's workers were busy for {:?}",
        4 * ttl
    );
    assert!(!session.is_lost(), "{:?}", session.loss_reason());
    let (info, _) = c.session_info(session.id(), &q()).await.unwrap();
    assert!(info.is_some(), "Consul still has the session");
    session.destroy().await.unwrap();
    let _ = stop_tx.send(());
    server_thread.join().unwrap();
}

//! Blocking queries: wake-up on change, timeout with the same index, no wake for other prefixes,
//! tombstones keeping prefix indexes monotonic, and the watch primitive's index rules.

use std::time::{Duration, Instant};

use rcfarm::consul::{QueryOptions, WatchConfig};
use rcfarm::server::{EmbeddedServer, ServerConfig};

use crate::common::{client, client_for, eventually, parked, server, server_with};

/// A memory-only server stopped and started again on its port: it comes back empty, with low
/// indexes.
async fn restarted_empty(s: EmbeddedServer) -> EmbeddedServer {
    let addr = s.addr();
    s.shutdown().await;
    server_with(ServerConfig {
        listen: addr,
        ..ServerConfig::ephemeral()
    })
    .await
}

fn wait(index: u64, ms: u64) -> QueryOptions {
    QueryOptions::blocking(index, Duration::from_millis(ms))
}

#[tokio::test]
async fn a_change_under_the_prefix_wakes_the_query() {
    let s = server().await;
    let c = client(&s);
    c.kv_put("w/a", b"1", None).await.unwrap();
    let (_, meta) = c.kv_list("w/", &QueryOptions::default()).await.unwrap();

    let c2 = c.clone();
    let started = Instant::now();
    let blocked = tokio::spawn(async move { c2.kv_list("w/", &wait(meta.index, 20_000)).await });
    parked(&s, 1).await;
    assert!(
        !blocked.is_finished(),
        "the query blocks while nothing changes"
    );
    c.kv_put("w/b", b"2", None).await.unwrap();
    let (entries, meta2) = blocked.await.unwrap().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "woke on the change, not the timeout"
    );
    assert!(meta2.index > meta.index);
    assert_eq!(entries.len(), 2);
}

/// A regression: on a fresh server an empty prefix reports index 1 (Consul never reports 0)
/// and the first write got index 1 too, so a watch blocked on 1 slept through it for a whole
/// wait (a farm started on a new server missed the first RC created for 5 minutes).
#[tokio::test]
async fn the_first_write_to_a_fresh_server_wakes_a_query_on_an_empty_prefix() {
    let s = server().await;
    let c = client(&s);
    let (entries, meta) = c.kv_list("first/", &QueryOptions::default()).await.unwrap();
    assert!(entries.is_empty());
    assert_eq!(meta.index, 1, "an empty table reports 1, as Consul does");
    let c2 = c.clone();
    let started = Instant::now();
    let blocked =
        tokio::spawn(async move { c2.kv_list("first/", &wait(meta.index, 20_000)).await });
    parked(&s, 1).await;
    c.kv_put("first/a", b"1", None).await.unwrap();
    let (entries, meta2) = blocked.await.unwrap().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "woke on the first write, not the timeout"
    );
    assert!(meta2.index > meta.index, "{meta2:?}");
    assert_eq!(entries.len(), 1);
}

#[tokio::test]
async fn timeout_returns_the_same_index() {
    let s = server().await;
    let c = client(&s);
    c.kv_put("t/a", b"1", None).await.unwrap();
    let (_, meta) = c.kv_get("t/a", &QueryOptions::default()).await.unwrap();
    let started = Instant::now();
    let (e, meta2) = c.kv_get("t/a", &wait(meta.index, 300)).await.unwrap();
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(300),
        "waited the full wait: {took:?}"
    );
    assert!(
        took < Duration::from_secs(3),
        "jitter is at most wait/16: {took:?}"
    );
    assert_eq!(meta2.index, meta.index);
    assert!(e.is_some());
}

#[tokio::test]
async fn changes_elsewhere_do_not_wake_the_query() {
    let s = server().await;
    let c = client(&s);
    c.kv_put("mine/a", b"1", None).await.unwrap();
    let (_, meta) = c.kv_list("mine/", &QueryOptions::default()).await.unwrap();
    let c2 = c.clone();
    let started = Instant::now();
    let blocked = tokio::spawn(async move { c2.kv_list("mine/", &wait(meta.index, 700)).await });
    for i in 0..20 {
        c.kv_put(&format!("other/{i}"), b"x", None).await.unwrap();
        // A key sharing a string prefix but outside "mine/".
        c.kv_put(&format!("mine-not/{i}"), b"x", None)
            .await
            .unwrap();
    }
    let (_, meta2) = blocked.await.unwrap().unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(700),
        "not woken by other prefixes"
    );
    assert_eq!(meta2.index, meta.index);
}

#[tokio::test]
async fn an_identical_write_wakes_nobody() {
    let s = server().await;
    let c = client(&s);
    c.kv_put("same/k", b"v", None).await.unwrap();
    let (_, meta) = c.kv_get("same/k", &QueryOptions::default()).await.unwrap();
    let c2 = c.clone();
    let started = Instant::now();
    let blocked = tokio::spawn(async move { c2.kv_get("same/k", &wait(meta.index, 600)).await });
    parked(&s, 1).await;
    c.kv_put("same/k", b"v", None).await.unwrap();
    let (_, meta2) = blocked.await.unwrap().unwrap();
    assert!(started.elapsed() >= Duration::from_millis(600));
    assert_eq!(meta2.index, meta.index);
}

#[tokio::test]
async fn deletes_leave_tombstones_so_prefix_indexes_never_go_back() {
    let s = server().await;
    let c = client(&s);
    c.kv_put("tomb/a", b"1", None).await.unwrap();
    c.kv_put("tomb/b", b"2", None).await.unwrap();
    c.kv_put("unrelated", b"3", None).await.unwrap();
    let (_, before) = c.kv_list("tomb/", &QueryOptions::default()).await.unwrap();

    let c2 = c.clone();
    let blocked =
        tokio::spawn(async move { c2.kv_list("tomb/", &wait(before.index, 20_000)).await });
    parked(&s, 1).await;
    c.kv_delete("tomb/b").await.unwrap();
    let (entries, after) = blocked.await.unwrap().unwrap();
    assert_eq!(entries.len(), 1, "woken by the delete");
    assert!(
        after.index > before.index,
        "the tombstone's index counts: {} -> {}",
        before.index,
        after.index
    );

    // A tree delete leaves one tombstone at the prefix: the index still moves forward.
    c.kv_delete_tree("tomb/").await.unwrap();
    let (empty, gone) = c.kv_list("tomb/", &QueryOptions::default()).await.unwrap();
    assert!(empty.is_empty());
    assert!(gone.index > after.index);
}

#[tokio::test]
async fn a_missing_key_keeps_blocking_until_it_appears() {
    let s = server().await;
    let c = client(&s);
    let (_, meta) = c.kv_get("later", &QueryOptions::default()).await.unwrap();
    let c2 = c.clone();
    let started = Instant::now();
    let blocked = tokio::spawn(async move { c2.kv_get("later", &wait(meta.index, 20_000)).await });
    parked(&s, 1).await;
    for i in 0..5 {
        c.kv_put(&format!("noise/{i}"), b"x", None).await.unwrap();
    }
    // A write wakes its waiters as it commits: one still parked was not woken.
    assert_eq!(s.stats().blocked_queries, 1, "still parked");
    assert!(
        !blocked.is_finished(),
        "other keys do not wake a missing key's query"
    );
    c.kv_put("later", b"here", None).await.unwrap();
    let (e, meta2) = blocked.await.unwrap().unwrap();
    assert_eq!(e.unwrap().value_bytes(), b"here");
    assert!(meta2.index > meta.index);
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn an_index_above_the_current_one_waits_the_full_wait() {
    let s = server().await;
    let c = client(&s);
    c.kv_put("hi", b"1", None).await.unwrap();
    let started = Instant::now();
    let (_, meta) = c.kv_get("hi", &wait(1_000_000, 400)).await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(400));
    assert!(meta.index < 1_000_000, "returns the current index");
}

#[tokio::test]
async fn session_list_blocks_until_a_session_changes() {
    let s = server().await;
    let c = client(&s);
    let (_, meta) = c.session_list(&QueryOptions::default()).await.unwrap();
    let c2 = c.clone();
    let blocked = tokio::spawn(async move { c2.session_list(&wait(meta.index, 20_000)).await });
    parked(&s, 1).await;
    c.kv_put("kv-does-not-wake-sessions", b"x", None)
        .await
        .unwrap();
    assert_eq!(s.stats().blocked_queries, 1, "still parked");
    assert!(!blocked.is_finished());
    c.session_create(&Default::default()).await.unwrap();
    let (list, meta2) = blocked.await.unwrap().unwrap();
    assert_eq!(list.len(), 1);
    assert!(meta2.index > meta.index);
}

/// The watch's first snapshot, marked seen.
async fn first_snapshot<T: Send + Sync>(
    rx: &mut rcfarm::consul::SnapshotRx<T>,
) -> std::sync::Arc<rcfarm::consul::Snapshot<T>> {
    let first = eventually(Duration::from_secs(5), "first snapshot", || {
        let v = rx.borrow().clone();
        async move { v }
    })
    .await;
    rx.mark_unchanged();
    first
}

#[tokio::test]
async fn watch_publishes_changes_and_skips_identical_results() {
    let s = server().await;
    let c = client(&s);
    c.kv_put("wp/a", b"1", None).await.unwrap();
    let watch = c.watch_prefix("wp/", WatchConfig::default());
    let mut rx = watch.subscribe();
    let first = first_snapshot(&mut rx).await;
    assert_eq!(first.value.len(), 1);

    c.kv_put("wp/b", b"2", None).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), rx.changed())
        .await
        .unwrap()
        .unwrap();
    let second = rx.borrow_and_update().clone().unwrap();
    assert_eq!(second.value.len(), 2);
    assert!(second.index > first.index);

    // Writes elsewhere and identical rewrites publish nothing.
    c.kv_put("elsewhere", b"x", None).await.unwrap();
    c.kv_put("wp/b", b"2", None).await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(400), rx.changed())
            .await
            .is_err()
    );
    watch.stop().await;
}

#[tokio::test]
async fn watch_holds_an_older_state_back_then_resets_when_the_index_stays_lower() {
    // A memory-only server restarted on the same port comes back with low indexes.
    let s = server().await;
    let c = client(&s);
    for i in 0..50 {
        c.kv_put(&format!("r/{i}"), b"x", None).await.unwrap();
    }
    let watch = c.watch_prefix(
        "r/",
        WatchConfig {
            wait: Duration::from_secs(2),
            error_backoff_base: Duration::from_millis(20),
            ..Default::default()
        },
    );
    let mut rx = watch.subscribe();
    let before = eventually(Duration::from_secs(5), "snapshot of 50", || {
        let v = rx.borrow().clone().filter(|s| s.value.len() == 50);
        async move { v }
    })
    .await;
    let s2 = restarted_empty(s).await;
    let c2 = client_for(&s2.url());
    c2.kv_put("r/new", b"fresh", None).await.unwrap();
    // An older state is not believed at once (it is what a Consul leader replaying its log
    // serves for a moment): the last view is held while the watch asks again.
    let held = &watch.stats().regressions_held;
    eventually(Duration::from_secs(10), "an older answer held back", || {
        let n = held.load(std::sync::atomic::Ordering::Relaxed);
        async move { (n >= 1).then_some(()) }
    })
    .await;
    assert_eq!(
        rx.borrow().as_ref().map(|s| s.value.len()),
        Some(50),
        "the older state was believed at once"
    );
    let after = eventually(
        Duration::from_secs(10),
        "snapshot from the new server",
        || {
            let v = rx
                .borrow_and_update()
                .clone()
                .filter(|s| s.value.len() == 1);
            async move { v }
        },
    )
    .await;
    assert!(
        after.index < before.index,
        "the new server's index is lower"
    );
    assert!(
        watch
            .stats()
            .resets
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    );
    // And it keeps following the new server from its own index.
    c2.kv_put("r/newer", b"x", None).await.unwrap();
    eventually(Duration::from_secs(5), "follows the new server", || {
        let v = rx.borrow().clone().filter(|s| s.value.len() == 2);
        async move { v }
    })
    .await;
    watch.stop().await;
}

#[tokio::test]
async fn a_thousand_blocked_queries_wake_on_one_write() {
    // A thousand connections from one IP: lift Consul 1.x's per-client limit (200 by default),
    // as one would on a real agent.
    let s = server_with(ServerConfig {
        session_ttl_min: Duration::from_secs(1),
        http_max_conns_per_client: 0,
        ..ServerConfig::ephemeral()
    })
    .await;
    // And the client's own bound (32 connections by default), which would queue them.
    let c = rcfarm::consul::Consul::new(rcfarm::consul::ConsulConfig {
        max_conns: 1200,
        ..rcfarm::consul::ConsulConfig::new(s.url())
    })
    .unwrap();
    c.kv_put("many/k", b"0", None).await.unwrap();
    let (_, meta) = c.kv_get("many/k", &QueryOptions::default()).await.unwrap();
    let mut handles = Vec::new();
    for _ in 0..1000 {
        let c = c.clone();
        handles.push(tokio::spawn(async move {
            c.kv_list("many/", &wait(meta.index, 30_000)).await
        }));
    }
    eventually(Duration::from_secs(20), "1000 blocked queries", || {
        let n = s.stats().blocked_queries;
        async move { (n >= 1000).then_some(()) }
    })
    .await;
    c.kv_put("many/k", b"1", None).await.unwrap();
    for h in handles {
        let (_, m) = tokio::time::timeout(Duration::from_secs(20), h)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(m.index > meta.index);
    }
    assert_eq!(s.stats().blocked_queries, 0);
}

#[tokio::test]
async fn abandoned_blocking_queries_leave_no_waiters_behind() {
    let s = server().await;
    let c = client(&s);
    c.kv_put("quiet/k", b"0", None).await.unwrap();
    let (_, meta) = c.kv_get("quiet/k", &QueryOptions::default()).await.unwrap();
    let mut handles = Vec::new();
    for _ in 0..20 {
        // Each on its own connection, so aborting it closes the socket.
        let c = client(&s);
        handles.push(tokio::spawn(async move {
            c.kv_list("quiet/", &wait(meta.index, 60_000)).await
        }));
    }
    eventually(Duration::from_secs(10), "20 blocked queries", || {
        let n = s.stats().blocked_queries;
        async move { (n >= 20).then_some(()) }
    })
    .await;
    for h in handles {
        h.abort();
    }
    eventually(
        Duration::from_secs(10),
        "waiters of hung-up clients removed",
        || {
            let n = s.stats().blocked_queries;
            async move { (n == 0).then_some(()) }
        },
    )
    .await;
}

/// A watch read on demand does not read after a change until asked (or until its idle wait is
/// over); asked, it reads at once even with nothing changed, and an open blocking query is
/// dropped for a read that answers at once.
#[tokio::test]
async fn a_watch_read_on_demand_reads_when_asked() {
    let s = server().await;
    let c = client(&s);
    c.kv_put("wd/a", b"1", None).await.unwrap();
    let demand = rcfarm::consul::Demand::new(Duration::from_secs(3600));
    let watch = c.watch_prefix("wd/", WatchConfig::default().on_demand(demand.clone()));
    let mut rx = watch.subscribe();
    let first = first_snapshot(&mut rx).await;
    assert_eq!(first.value.len(), 1);

    // Nobody asks: a change is not read.
    c.kv_put("wd/b", b"2", None).await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(500), rx.changed())
            .await
            .is_err(),
        "read without being asked"
    );
    // Asked: read at once.
    let ticket = demand.urge();
    tokio::time::timeout(Duration::from_secs(5), demand.fresh(ticket))
        .await
        .expect("the urged read");
    assert_eq!(rx.borrow_and_update().clone().unwrap().value.len(), 2);

    // Asked again with nothing changed: answered at once all the same, and the time of that
    // answer is known (the view is current up to it, though nothing in it changed).
    let before = demand.answered_at().expect("answered before");
    let ticket = demand.urge();
    tokio::time::timeout(Duration::from_secs(5), demand.fresh(ticket))
        .await
        .expect("an urged read answers even when nothing changed");
    assert!(demand.answered_at().expect("answered") > before);

    // While someone needs every change, changes are read as they come.
    let fast = demand.fast();
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.kv_put("wd/c", b"3", None).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), rx.changed())
        .await
        .expect("read in fast mode")
        .unwrap();
    assert_eq!(rx.borrow_and_update().clone().unwrap().value.len(), 3);
    drop(fast);
    watch.stop().await;
}

/// A watch whose query reached the server after it came back empty blocks on an index the new
/// store has not reached, until `wait` runs out (the farm of
/// `trouble::consul_down_past_the_ttl_and_back_empty` that claimed nothing for 30 s: the
/// server's shutdown ends blocking queries with an answer, and the next one goes to the new
/// server). Another watch of the same process that sees the store go back (here: its shorter
/// wait ends first) makes it ask again at once.
#[tokio::test]
async fn a_watch_that_sees_the_store_go_back_wakes_the_others() {
    let s = server().await;
    let c = client(&s);
    for i in 0..50 {
        c.kv_put(&format!("quiet/{i}"), b"x", None).await.unwrap();
    }
    c.kv_put("busy/a", b"x", None).await.unwrap();
    let regressions = std::sync::Arc::new(rcfarm::consul::Regressions::default());
    let config = |wait: Duration| WatchConfig {
        wait,
        regression_grace: Duration::ZERO,
        error_backoff_base: Duration::from_millis(20),
        regressions: Some(regressions.clone()),
        ..Default::default()
    };
    let quiet = c.watch_prefix("quiet/", config(Duration::from_secs(60)));
    let busy = c.watch_prefix("busy/", config(Duration::from_secs(2)));
    let rx = quiet.subscribe();
    eventually(
        Duration::from_secs(5),
        "the quiet watch's first answer",
        || {
            let v = rx.borrow().clone().filter(|s| s.value.len() == 50);
            async move { v }
        },
    )
    .await;
    let s2 = restarted_empty(s).await;
    let c2 = client_for(&s2.url());
    c2.kv_put("quiet/new", b"fresh", None).await.unwrap();
    let started = Instant::now();
    eventually(
        Duration::from_secs(20),
        "the quiet watch on the new server's store",
        || {
            let v = rx.borrow().clone().filter(|s| s.value.len() == 1);
            async move { v }
        },
    )
    .await;
    assert!(regressions.count() >= 1);
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "not at the end of the 60 s wait"
    );
    quiet.stop().await;
    busy.stop().await;
}

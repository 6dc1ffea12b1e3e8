//! Timers on monotonic time (issues 36 and 37): a farm whose wall clock jumps or runs fast
//! (libfaketime, Debian's `faketime` package, preloaded into the farm process with its monotonic
//! clock left alone) keeps every timer, one test per kind: session renewal (jumps both ways and
//! a wall clock ten times fast cost no session), node transfer timeouts (a jump forward does not
//! time a transfer out), roll delays (a jump back does not stretch one), roll progress deadlines
//! (a jump forward does not fail a roll early), the consistency interval (a jump back does not
//! put a pass off) and the removal budget's window (a jump forward does not refill it). Each
//! fails when libfaketime fakes the monotonic clock too. Skipped, saying so, where libfaketime is
//! not installed.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::harness::{Backend, Cluster, nodes};
use crate::on_every_backend;
use crate::rolls::{ROLL_FLAGS, completed};

/// libfaketime's preload library, or `None` after saying loudly that the test is skipped.
fn libfaketime() -> Option<PathBuf> {
    let found = rcfarm_testkit::chaos::clock::libfaketime();
    if found.is_none() {
        eprintln!(
            "SKIPPED: libfaketime not found (Debian's faketime package; .ci/run installs it)"
        );
    }
    found
}

/// A farm whose wall clock follows the offset written in `offset` (`+0`, `+1h`, `-1h`…), its
/// monotonic clock untouched.
struct FakeClock {
    _dir: tempfile::TempDir,
    file: PathBuf,
    lib: PathBuf,
}

impl FakeClock {
    fn new() -> Option<FakeClock> {
        let lib = libfaketime()?;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("offset");
        std::fs::write(&file, "+0\n").unwrap();
        Some(FakeClock {
            _dir: dir,
            file,
            lib,
        })
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("LD_PRELOAD", self.lib.display().to_string()),
            ("FAKETIME_TIMESTAMP_FILE", self.file.display().to_string()),
            ("FAKETIME_NO_CACHE", "1".into()),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1".into()),
        ]
    }

    /// Steps the wall clock of the farms under it to `offset` from the real time.
    fn jump(&self, offset: &str) {
        std::fs::write(&self.file, format!("{offset}\n")).unwrap();
    }
}

async fn spawn_faked(c: &mut Cluster, clock: &FakeClock, id: &str, flags: &[&str]) {
    let url = c.server.url();
    let env = clock.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    c.spawn_farm_with(id, &url, flags, &env).await;
}

/// Three nodes played by the simulator (never passing manifests matching `failing`), a faked
/// farm with the roll flags, and an RC of 3 pods up, to roll.
async fn faked_rolling_cluster(
    backend: &Backend,
    clock: &FakeClock,
    failing: Option<&str>,
) -> (
    Cluster,
    tokio_util::sync::CancellationToken,
    rcfarm::rc::RcId,
) {
    let mut c = Cluster::start_on(backend).await;
    nodes(&c, 3, 1).await;
    let sim = match failing {
        Some(pattern) => c.simulate_failing(3, pattern),
        None => c.simulate(3, 0.0),
    };
    spawn_faked(&mut c, clock, "f1", &ROLL_FLAGS).await;
    let old = crate::harness::rcs(&c, 1, 3).await[0];
    let cr = &c;
    c.wait_for(
        Duration::from_secs(30),
        "the old RC up",
        move || async move { cr.all_up(old, 3).await },
    )
    .await;
    (c, sim, old)
}

on_every_backend!(a_wall_clock_jump_forward_does_not_time_a_transfer_out);
async fn a_wall_clock_jump_forward_does_not_time_a_transfer_out(backend: Backend) {
    let Some(clock) = FakeClock::new() else {
        return;
    };
    let env = clock.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (c, o) = crate::brakes::a_transfer_in_flight_with(
        &backend,
        "f1",
        &["--transfer-timeout", "20s"],
        &env,
    )
    .await;
    let cr = &c;
    let started = Instant::now();
    // An hour forward: a timeout measured on the wall clock would fire at once.
    clock.jump("+1h");
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(
        c.transfer_in_flight(o).await,
        "the transfer timed out {:?} after it started, its timeout being 20 s",
        started.elapsed()
    );
    assert!(c.audit_events("NODE_TRANSFER_ROLLBACK").await.is_empty());
    // And it does time out, on the farm's monotonic clock (then starts again: the pod still
    // has to move).
    c.wait_for(
        Duration::from_secs(40),
        "the transfer rolled back after its timeout",
        move || async move { !cr.audit_events("NODE_TRANSFER_ROLLBACK").await.is_empty() },
    )
    .await;
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_secs(12),
        "rolled back {elapsed:?} after it started"
    );
    let rollbacks = c.audit_events("NODE_TRANSFER_ROLLBACK").await;
    assert!(
        rollbacks.iter().any(|r| r["rollback_reason"]
            .as_str()
            .is_some_and(|w| w.contains("not healthy within 20s"))),
        "{rollbacks:#?}"
    );
}

on_every_backend!(a_wall_clock_jump_back_does_not_stretch_a_roll_delay);
async fn a_wall_clock_jump_back_does_not_stretch_a_roll_delay(backend: Backend) {
    let Some(clock) = FakeClock::new() else {
        return;
    };
    let (c, _sim, old) = faked_rolling_cluster(&backend, &clock, None).await;
    let cr = &c;
    // One pod at a time, 4 s apart once each step is safe.
    let new = c.start_roll(old, 2, Duration::from_secs(4)).await;
    c.wait_for(
        Duration::from_secs(30),
        "the first step",
        move || async move { !cr.audit_events("ROLLING_UPDATE_STEP").await.is_empty() },
    )
    .await;
    // An hour back: a delay measured on the wall clock would wait an hour more.
    clock.jump("-1h");
    let started = Instant::now();
    completed(&c, new, old, 3, Duration::from_secs(60)).await;
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "the roll's last steps took {:?}",
        started.elapsed()
    );
}

/// The RC ids' pod counts, as the store says now.
async fn pod_counts(c: &Cluster) -> std::collections::BTreeMap<rcfarm::rc::RcId, usize> {
    c.placements()
        .await
        .into_iter()
        .map(|(id, n)| (id, n.len()))
        .collect()
}

on_every_backend!(wall_clock_jumps_and_a_fast_wall_clock_cost_a_farm_no_session);
/// Session renewal runs on monotonic time: a farm whose wall clock jumps an hour forward, an
/// hour back, a day back, and runs ten times fast, for seven TTLs in all, renews its session
/// throughout and keeps every RC.
async fn wall_clock_jumps_and_a_fast_wall_clock_cost_a_farm_no_session(backend: Backend) {
    let Some(clock) = FakeClock::new() else {
        return;
    };
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 3, 1).await;
    spawn_faked(&mut c, &clock, "f1", &[]).await;
    let ids = crate::harness::rcs(&c, 3, 1).await;
    let (cr, idr) = (&c, &ids);
    c.wait_for(
        Duration::from_secs(30),
        "every RC placed",
        move || async move { cr.placed_and_shared(idr, 1, 1).await },
    )
    .await;
    let owners = c.owners().await;
    for offset in ["+1h", "-1h", "-1d", "+0 x10", "+0"] {
        clock.jump(offset);
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    let log = c.farm_log(0);
    assert!(!log.contains("session lost"), "{log}");
    assert_eq!(
        c.owners().await,
        owners,
        "the RCs kept their owner and session"
    );
}

on_every_backend!(a_wall_clock_jump_forward_does_not_fail_a_roll_before_its_deadline);
/// A roll's progress deadline runs on monotonic time: a bad deploy with a 20 s deadline, on a
/// farm whose wall clock jumps an hour forward just after it starts, fails at its deadline and
/// not at the jump.
async fn a_wall_clock_jump_forward_does_not_fail_a_roll_before_its_deadline(backend: Backend) {
    let Some(clock) = FakeClock::new() else {
        return;
    };
    let (c, _sim, old) = faked_rolling_cluster(&backend, &clock, Some("-9.tar.gz")).await;
    let cr = &c;
    crate::rolls::start_bad_roll(&c, old, "20s").await;
    // Its first step: from here the roll waits on a new pod, against its deadline.
    c.wait_for(
        Duration::from_secs(30),
        "the roll's first step",
        move || async move { !cr.audit_events("ROLLING_UPDATE_STEP").await.is_empty() },
    )
    .await;
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    // An hour forward: a deadline measured on the wall clock would pass at once.
    clock.jump("+1h");
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(
        c.audit_events("ROLLING_UPDATE_FAILED").await.is_empty(),
        "the roll failed {:?} after it started, its deadline being 20 s",
        started.elapsed()
    );
    c.wait_for(
        Duration::from_secs(60),
        "the roll failed at its deadline",
        move || async move { !cr.audit_events("ROLLING_UPDATE_FAILED").await.is_empty() },
    )
    .await;
    assert!(
        started.elapsed() >= Duration::from_secs(12),
        "failed {:?} after it started",
        started.elapsed()
    );
}

on_every_backend!(a_wall_clock_jump_back_does_not_put_off_a_consistency_pass);
/// The consistency interval runs on monotonic time: on a farm whose wall clock jumped an hour
/// back, an intent deleted behind its back is still rewritten within a few intervals.
async fn a_wall_clock_jump_back_does_not_put_off_a_consistency_pass(backend: Backend) {
    let Some(clock) = FakeClock::new() else {
        return;
    };
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 3, 1).await;
    spawn_faked(&mut c, &clock, "f1", &["--consistency-interval", "3s"]).await;
    let ids = crate::harness::rcs(&c, 1, 2).await;
    let (cr, idr) = (&c, &ids);
    c.wait_for(
        Duration::from_secs(30),
        "the RC placed",
        move || async move { cr.placed_and_shared(idr, 1, 2).await },
    )
    .await;
    clock.jump("-1h");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let node = c.placements().await[&ids[0]].iter().next().unwrap().clone();
    let intent = format!("intent/{node}/svc-0");
    c.consul.kv_delete(&intent).await.unwrap();
    let intent = intent.as_str();
    let took = c
        .wait_for(
            Duration::from_secs(30),
            "the deleted intent rewritten",
            move || async move {
                cr.consul
                    .kv_get(intent, &rcfarm::consul::QueryOptions::default())
                    .await
                    .unwrap()
                    .0
                    .is_some()
            },
        )
        .await;
    println!("rewritten {took:?} after it was deleted, the farm's wall clock an hour back");
}

on_every_backend!(a_wall_clock_jump_forward_does_not_refill_the_removal_budget);
/// The removal budget's window runs on monotonic time: with 2 removals per 30 s, a farm whose
/// wall clock jumps an hour forward after spending its budget removes nothing more until the
/// window has passed.
async fn a_wall_clock_jump_forward_does_not_refill_the_removal_budget(backend: Backend) {
    let Some(clock) = FakeClock::new() else {
        return;
    };
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 6, 1).await;
    spawn_faked(
        &mut c,
        &clock,
        "f1",
        &["--max-removals", "2", "--max-removals-window", "30s"],
    )
    .await;
    let rc = crate::harness::rcs(&c, 1, 6).await[0];
    let cr = &c;
    c.wait_for(
        Duration::from_secs(30),
        "6 pods placed",
        move || async move { pod_counts(cr).await.get(&rc) == Some(&6) },
    )
    .await;
    c.patch_rc(rc, "replicas_desired", serde_json::json!(0))
        .await;
    c.wait_for(
        Duration::from_secs(30),
        "the budget's 2 removals",
        move || async move { pod_counts(cr).await.get(&rc) == Some(&4) },
    )
    .await;
    let spent = Instant::now();
    clock.jump("+1h");
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(
        pod_counts(&c).await.get(&rc),
        Some(&4),
        "removed more {:?} after the budget was spent, its window being 30 s",
        spent.elapsed()
    );
    c.wait_for(
        Duration::from_secs(60),
        "more removals once the window passed",
        move || async move { pod_counts(cr).await.get(&rc).copied().unwrap_or(0) <= 2 },
    )
    .await;
    assert!(
        spent.elapsed() >= Duration::from_secs(15),
        "the next removals came {:?} after the budget was spent",
        spent.elapsed()
    );
}

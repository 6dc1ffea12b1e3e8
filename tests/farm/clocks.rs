//! Timers on monotonic time (issue 36, item 7): a farm whose wall clock jumps (libfaketime,
//! Debian's `faketime` package, preloaded into the farm process with its monotonic clock left
//! alone) keeps its node transfer timeouts and roll delays: a jump forward does not time a
//! transfer out, a jump back does not stretch a roll's delay. Skipped, saying so, where
//! libfaketime is not installed.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::harness::{Backend, Cluster, nodes};
use crate::on_every_backend;
use crate::rolls::{ROLL_FLAGS, completed};

/// libfaketime's preload library (the thread-safe build where there is one).
fn libfaketime() -> Option<PathBuf> {
    let dirs = [
        "/usr/lib/x86_64-linux-gnu/faketime",
        "/usr/lib/aarch64-linux-gnu/faketime",
        "/usr/lib/faketime",
    ];
    let found = dirs.iter().find_map(|d| {
        ["libfaketimeMT.so.1", "libfaketime.so.1"]
            .iter()
            .map(|f| Path::new(d).join(f))
            .find(|p| p.exists())
    });
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
    let mut c = Cluster::start_on(&backend).await;
    nodes(&c, 3, 1).await;
    let _sim = c.simulate(3, 0.0);
    spawn_faked(&mut c, &clock, "f1", &ROLL_FLAGS).await;
    let old = crate::harness::rcs(&c, 1, 3).await[0];
    let cr = &c;
    c.wait_for(
        Duration::from_secs(30),
        "the old RC up",
        move || async move { cr.all_up(old, 3).await },
    )
    .await;
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

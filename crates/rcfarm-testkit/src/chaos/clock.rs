//! Clock faults: each farm of the run starts with libfaketime (Debian's `faketime`) preloaded,
//! its wall clock following a file of its own and its monotonic clock left alone, as a machine
//! whose clock NTP steps or that drifts: the chaos writes `+1h`, `-1h` or a wall clock 10 %
//! fast into one farm's file, holds it a while, and sets it back.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rand::Rng;
use rand::rngs::StdRng;

/// libfaketime's preload library (the thread-safe build where there is one).
pub fn libfaketime() -> Option<PathBuf> {
    let dirs = [
        "/usr/lib/x86_64-linux-gnu/faketime",
        "/usr/lib/aarch64-linux-gnu/faketime",
        "/usr/lib/faketime",
    ];
    dirs.iter().find_map(|d| {
        ["libfaketimeMT.so.1", "libfaketime.so.1"]
            .iter()
            .map(|f| Path::new(d).join(f))
            .find(|p| p.exists())
    })
}

/// The farms' fake wall clocks: one offset file each, in the run's directory.
#[derive(Debug, Clone)]
pub struct FarmClocks {
    dir: PathBuf,
    lib: PathBuf,
}

impl FarmClocks {
    pub fn new(dir: &Path) -> Result<FarmClocks, String> {
        let lib = libfaketime().ok_or(
            "clock faults need libfaketime (Debian's faketime package: apt-get install faketime)",
        )?;
        Ok(FarmClocks {
            dir: dir.to_path_buf(),
            lib,
        })
    }

    fn file(&self, farm: &str) -> PathBuf {
        self.dir.join(format!("{farm}.faketime"))
    }

    /// The environment a farm starts with (its clock as it was, or true).
    pub fn env(&self, farm: &str) -> Vec<(&'static str, String)> {
        let file = self.file(farm);
        if !file.exists() {
            let _ = std::fs::write(&file, "+0\n");
        }
        vec![
            ("LD_PRELOAD", self.lib.display().to_string()),
            ("FAKETIME_TIMESTAMP_FILE", file.display().to_string()),
            ("FAKETIME_NO_CACHE", "1".into()),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1".into()),
        ]
    }

    /// Sets `farm`'s wall clock: `+1h`, `-1h`, `+0 x1.1` (10 % fast), `+0` (true).
    pub fn set(&self, farm: &str, spec: &str) {
        let _ = std::fs::write(self.file(farm), format!("{spec}\n"));
    }

    /// One fault: a farm's wall clock an hour forward, an hour back, or 10 % fast, for 3–10 s
    /// (the fast one 10–20 s), then true again (itself a step).
    pub async fn fault(&self, farms: &[String], rng: &mut StdRng) -> &'static str {
        let farm = &farms[rng.random_range(0..farms.len())];
        let (kind, spec, hold) = match rng.random_range(0..3) {
            0 => ("clock-forward", "+1h", rng.random_range(3000..10000)),
            1 => ("clock-back", "-1h", rng.random_range(3000..10000)),
            _ => ("clock-fast", "+0 x1.1", rng.random_range(10000..20000)),
        };
        tracing::info!(farm, spec, hold_ms = hold, "clock fault");
        self.set(farm, spec);
        tokio::time::sleep(Duration::from_millis(hold)).await;
        self.set(farm, "+0");
        kind
    }
}

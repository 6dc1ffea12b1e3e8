//! What decoding one watch answer costs in memory and time: a listing of N entries with values
//! of V bytes (a 20,000-RC listing: `20000 320`; 100,000 pods' labels: `100000 90`), decoded
//! as `Vec<KvPair>` (what watches held before) and as a [`KvList`]. Memory is counted by a
//! counting allocator: held beside the body once decoded, and the peak while decoding.
//!
//! `cargo run --release -p rcfarm-consul --example decode_peak -- 20000 320`

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::Instant;

use rcfarm_consul::{KvList, KvPair};

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let n = LIVE.fetch_add(l.size(), Relaxed) + l.size();
        PEAK.fetch_max(n, Relaxed);
        // SAFETY: the caller's layout, as GlobalAlloc requires.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Relaxed);
        // SAFETY: `p` came from `alloc` above with this layout.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static A: Counting = Counting;

fn mib(b: usize) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// Runs `f`, printing what it left allocated and its peak above what was allocated before.
fn measure<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let base = LIVE.load(Relaxed);
    PEAK.store(base, Relaxed);
    let t = Instant::now();
    let out = f();
    let took = t.elapsed();
    println!(
        "{what}: held {:.1} MiB beside the body, peak {:.1} MiB, {:.1} ms",
        mib(LIVE.load(Relaxed) - base),
        mib(PEAK.load(Relaxed) - base),
        took.as_secs_f64() * 1000.0
    );
    out
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>());
    let n = args.next().transpose()?.unwrap_or(20_000);
    let vlen = args.next().transpose()?.unwrap_or(320);
    let pairs: Vec<KvPair> = (0..n)
        .map(|i| KvPair {
            key: format!("replication_controllers/{i:08x}-0000-4000-8000-{i:012x}"),
            value: Some(vec![b'x'; vlen]),
            modify_index: i as u64 + 10,
            create_index: i as u64 + 10,
            ..Default::default()
        })
        .collect();
    let body = bytes::Bytes::from(serde_json::to_vec(&pairs)?);
    drop(pairs);
    println!("{n} entries, body {:.1} MiB", mib(body.len()));
    for _ in 0..2 {
        let v = measure("Vec<KvPair>", || {
            serde_json::from_slice::<Vec<KvPair>>(&body)
        })?;
        drop(v);
        let l = measure("KvList", || KvList::decode(body.clone()))?;
        drop(l);
    }
    Ok(())
}

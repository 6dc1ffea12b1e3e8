/// jemalloc, not glibc's malloc. A farm's biggest allocations are transient (a blocking query on a
/// big tree answers with the whole tree: 25 MiB of JSON at 100,000 pods, parsed into a cache and
/// dropped), made from whichever runtime thread runs the watch. glibc kept what they freed in
/// its arenas, so RSS stayed near its peak unless trimmed, and two arenas (to bound that) are
/// two locks for every runtime thread to share. With jemalloc a converged farm at 20,000 RCs × 5
/// uses 3 % of a core instead of 9–12 %, and ~145 instead of 174–198 MiB before any other saving
/// (BENCHMARKS.md, "Peak memory and jemalloc's settings").
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's settings, read at its first allocation (`_RJEM_MALLOC_CONF` in the environment
/// overrides them). A background thread hands pages freed for a second back to the kernel
/// (`dirty_decay_ms`), at once (`muzzy_decay_ms:0`: `MADV_FREE`d pages still count in RSS
/// until the kernel wants them, and RSS is what an operator sizes a container by).
///
/// Allocations of 64 KiB and more come from jemalloc's arena for big allocations, which hands
/// pages back as soon as they are freed (`oversize_threshold`; its default is 8 MiB). Those are
/// a farm's transients: a watch answer's body, the maps rebuilt over every RC when the listing
/// or the lock tree changes. Kept for a second, they were most of the gap between a farm's peak
/// and its steady RSS (six farms at 20,000 RCs: peaks 1.26-1.64x steady, 1.17-1.33x with this),
/// with no farm CPU the benchmark could tell apart (BENCHMARKS.md, "Peak memory and jemalloc's
/// settings").
#[unsafe(export_name = "_rjem_malloc_conf")]
pub static MALLOC_CONF: &[u8] =
    b"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0,oversize_threshold:65536\0";

fn main() -> std::process::ExitCode {
    rcfarm::cli::rcfarm_main()
}

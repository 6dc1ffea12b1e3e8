/// jemalloc, not glibc's malloc. A farm's biggest allocations are transient (a blocking query on a
/// big tree answers with the whole tree: 25 MiB of JSON at 100,000 pods, parsed into a cache and
/// dropped), made from whichever runtime thread runs the watch. glibc kept what they freed in
/// its arenas, so RSS stayed near its peak unless trimmed, and two arenas (to bound that) are
/// two locks for every runtime thread to share. With jemalloc a converged farm at 20,000 RCs × 5
/// uses 3 % of a core instead of 9–12 %, and ~145 instead of 174–198 MiB before any other saving
/// (BENCHMARKS.md, fourth session).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's settings, read at its first allocation (`_RJEM_MALLOC_CONF` in the environment
/// overrides them). A background thread hands pages freed for a second back to the kernel
/// (`dirty_decay_ms`), at once (`muzzy_decay_ms:0`: `MADV_FREE`d pages still count in RSS
/// until the kernel wants them, and RSS is what an operator sizes a container by).
#[unsafe(export_name = "_rjem_malloc_conf")]
pub static MALLOC_CONF: &[u8] = b"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0\0";

fn main() -> std::process::ExitCode {
    rcfarm::cli::rcfarm_main()
}

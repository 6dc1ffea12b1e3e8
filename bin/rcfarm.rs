/// jemalloc, not glibc's malloc. A farm's biggest allocations are transient (a blocking query on a
/// big tree answers with the whole tree: 25 MiB of JSON at 100,000 pods, parsed into a cache and
/// dropped), made from whichever runtime thread runs the watch. glibc kept what they freed in
/// its arenas (RSS stayed at its peak) and, limited to two arenas to bound that, made the
/// runtime's threads queue for its locks: at 20,000 RCs × 5 jemalloc converged in 2.9–3.5 s
/// against 8.3–9.0 s, at 141–146 against 190 MiB per farm (BENCHMARKS.md, fourth session).
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

/// glibc's allocator kept a farm's freed memory in per-thread arenas: the farm re-reads big
/// label trees (25 MiB of JSON at 100,000 pods) and its RSS grew by a third from fragmentation
/// alone (BENCHMARKS.md). mimalloc returns it.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    rcfarm::cli::rcfarm_main()
}

fn main() -> std::process::ExitCode {
    limit_malloc_arenas();
    rcfarm::cli::rcfarm_main()
}

/// glibc gives each thread that contends for the allocator an arena of its own (up to 8 per
/// core) and keeps freed memory in them. A farm re-reads big label trees (25 MiB of JSON at
/// 100,000 pods) from whichever runtime thread runs the watch, and at that size a third of its
/// RSS was memory held in arenas (BENCHMARKS.md: 440 → 342 MiB with two). mimalloc saved as
/// much at that size but doubled a small farm's RSS and slowed its start.
fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator parameter; called before any thread exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

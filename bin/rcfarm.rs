fn main() -> std::process::ExitCode {
    rcfarm::cli::rcfarm_main()
}

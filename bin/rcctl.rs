fn main() -> std::process::ExitCode {
    rcfarm::cli::rcctl_main()
}

fn main() -> std::process::ExitCode {
    rcfarm_tools::main()
}

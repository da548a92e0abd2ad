fn main() -> std::process::ExitCode {
    fugu::cli::main()
}

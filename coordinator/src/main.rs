//! The `ternfleet` binary: parses arguments and hands them to the library.
use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = ternfleet_coordinator::cli::Cli::parse();
    match ternfleet_coordinator::cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

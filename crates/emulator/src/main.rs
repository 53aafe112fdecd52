//! The `tidegate-emulator` binary: parses options and runs the emulator.

use std::process::ExitCode;

use clap::Parser;
use tidegate_emulator::{run, Args};

fn main() -> ExitCode {
    let args = Args::parse();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if args.threads > 0 {
        builder.worker_threads(args.threads);
    }
    let result = builder.enable_all().build().and_then(|rt| rt.block_on(run(args)));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("tidegate-emulator: {err}");
            ExitCode::FAILURE
        }
    }
}

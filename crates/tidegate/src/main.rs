//! The `tidegate` binary: `tidegate serve` runs the proxy, `tidegate ctl`
//! talks to a running one through its admin API.

mod cli;
mod config_file;
mod ctl;
mod serve;

use clap::Parser;

/// mimalloc: measurably fewer cycles per proxied request than glibc's
/// allocator (see docs/benchmarks.md). Built with lazy arena commit
/// (`.cargo/config.toml`), which keeps resident memory close to what is in
/// use.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    let args = cli::Cli::parse();
    let result = match args.command {
        cli::Command::Serve(opts) => serve::run(opts),
        cli::Command::Ctl(opts) => ctl::run(opts),
        cli::Command::Validate { file } => validate(&file),
        cli::Command::Distributor(opts) => distributor(opts),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tidegate: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// `tidegate validate FILE`: reads and checks a configuration file.
fn validate(file: &std::path::Path) -> anyhow::Result<std::process::ExitCode> {
    match config_file::read(file) {
        Ok(content) => {
            println!("{}: valid: {}", file.display(), content.summary());
            Ok(std::process::ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("{e}");
            Ok(std::process::ExitCode::FAILURE)
        }
    }
}

/// `tidegate distributor`: the reference external distributor.
fn distributor(opts: tidegate_distributor::ServeOptions) -> anyhow::Result<std::process::ExitCode> {
    serve::init_logs();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(tidegate_distributor::serve(opts))?;
    Ok(std::process::ExitCode::SUCCESS)
}

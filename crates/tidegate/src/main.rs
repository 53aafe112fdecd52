//! The `tidegate` binary: `tidegate serve` runs the proxy, `tidegate ctl`
//! talks to a running one through its admin API.

mod cli;
mod config_file;
mod ctl;
#[cfg(feature = "demo")]
mod demo;
#[cfg(test)]
mod layers;
mod man;
mod output;
mod serve;
mod systemd;
mod takeover;
mod upgrade;

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
        cli::Command::Serve(opts) => serve::run(*opts),
        cli::Command::Upgrade(opts) => upgrade::run(opts),
        cli::Command::Ctl(opts) => ctl::run(opts),
        cli::Command::Validate { file } => validate(&file),
        cli::Command::Completions { shell } => {
            let mut cmd = <cli::Cli as clap::CommandFactory>::command();
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut cmd, "tidegate", &mut script);
            write_stdout(&script)
        }
        cli::Command::Man(opts) => man::run(&opts),
        #[cfg(feature = "demo")]
        cli::Command::Demo(opts) => demo::run(opts),
        #[cfg(feature = "demo")]
        cli::Command::Emulate(opts) => emulate(opts),
        cli::Command::Schema => {
            let schema = tidegate_model::config_file_schema();
            let mut text = serde_json::to_vec_pretty(&schema).unwrap_or_default();
            text.push(b'\n');
            write_stdout(&text)
        }
        cli::Command::Store(cli::StoreCommand::Copy { from, to, etcd }) => serve::copy_store(&from, to, &etcd),
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

/// Writes to standard output; a reader that went away (`| head`) ends the
/// output quietly.
pub(crate) fn write_stdout(bytes: &[u8]) -> anyhow::Result<std::process::ExitCode> {
    match std::io::Write::write_all(&mut std::io::stdout().lock(), bytes) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(std::process::ExitCode::SUCCESS),
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

/// `tidegate emulate`: the backend emulator (the demo's instances).
#[cfg(feature = "demo")]
fn emulate(args: tidegate_emulator::Args) -> anyhow::Result<std::process::ExitCode> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if args.threads > 0 {
        builder.worker_threads(args.threads);
    }
    builder.enable_all().build()?.block_on(tidegate_emulator::run(args))?;
    Ok(std::process::ExitCode::SUCCESS)
}

/// `tidegate distributor`: the reference external distributor.
fn distributor(opts: tidegate_distributor::ServeOptions) -> anyhow::Result<std::process::ExitCode> {
    serve::init_logs(std::env::var("TIDEGATE_LOG_FORMAT").is_ok_and(|f| f == "json"));
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(tidegate_distributor::serve(opts))?;
    Ok(std::process::ExitCode::SUCCESS)
}

//! `tidegate-bench`: a dev-only benchmark driver for an already running
//! Tidegate on loopback.
//!
//! Subcommands (each prints one JSON object on stdout; latencies are in
//! microseconds):
//! - `setup`: create the service under test, its catch-all route, and an
//!   optional preload of many services and routes (`POST /v1/changes`);
//! - `churn`: open-loop route creation at a fixed rate; time from each
//!   change's scheduled send until the proxy serves the new route;
//! - `saturate`: closed-loop admin writes from concurrent keep-alive clients;
//! - `traffic`: open-loop GETs against the proxy, to run next to the others;
//! - `users`: a closed loop of concurrent users against any proxy;
//! - `ramp`: open-loop GETs whose rate follows a timetable of steps, with a
//!   per-step and per-second report (and an optional per-request CSV);
//! - `sequential`: one GET at a time against any target, exact mean,
//!   deviation and percentiles;
//! - `disk-floor`: no Tidegate, the disk's floor for a durable change
//!   (4 KiB writes and `fdatasync`s driven like `churn`'s changes).
//!
//! Open-loop latencies are measured from the scheduled send time, so a slow
//! answer cannot hide the requests it would otherwise have delayed. Server
//! errors are counted, never fatal; only an unusable setup (no token, a
//! missing service, a non-loopback address) ends a run early, with
//! `{"error": ...}` on stdout and exit status 1.

mod churn;
mod cli;
mod client;
mod disk_floor;
mod h3load;
mod minimal;
mod minimal_raw;
mod open_loop;
mod ramp;
mod raw;
mod report;
mod saturate;
mod schedule;
mod sequential;
mod setup;
mod traffic;
mod users;

use std::process::ExitCode;

use clap::Parser;
use serde::Serialize;

use crate::cli::{Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::MinimalProxy(args) = &cli.command {
        let served = match args.engine {
            cli::MinimalEngine::Hyper => minimal::run(args),
            cli::MinimalEngine::Epoll => minimal_raw::run_epoll(args),
            cli::MinimalEngine::Uring => minimal_raw::run_uring(args),
        };
        return match served {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("tidegate-bench: {err:#}");
                ExitCode::FAILURE
            }
        };
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if cli.target.threads > 0 {
        builder.worker_threads(cli.target.threads);
    }
    let result = builder.enable_all().build().map_err(anyhow::Error::from).and_then(|rt| rt.block_on(run(&cli)));
    match result {
        Ok(json) => report(&json, ExitCode::SUCCESS),
        Err(err) => {
            eprintln!("tidegate-bench: {err:#}");
            report(&serde_json::json!({ "error": format!("{err:#}") }).to_string(), ExitCode::FAILURE)
        }
    }
}

/// Prints the report on stdout. A reader that went away (a closed pipe)
/// is an error to say, not a panic.
fn report(json: &str, code: ExitCode) -> ExitCode {
    use std::io::Write;
    match writeln!(std::io::stdout().lock(), "{json}") {
        Ok(()) => code,
        Err(e) => {
            eprintln!("tidegate-bench: cannot write the report: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the chosen scenario and renders its report.
async fn run(cli: &Cli) -> anyhow::Result<String> {
    client::require_loopback("--admin", cli.target.admin)?;
    client::require_loopback("--proxy", cli.target.proxy)?;
    match &cli.command {
        Command::Setup(args) => render(&setup::run(&cli.target, args).await?),
        Command::Churn(args) => render(&churn::run(&cli.target, args).await?),
        Command::Saturate(args) => render(&saturate::run(&cli.target, args).await?),
        Command::Traffic(args) => render(&traffic::run(&cli.target, args).await?),
        Command::Users(args) => render(&users::run(&cli.target, args).await?),
        Command::Ramp(args) => render(&ramp::run(&cli.target, args).await?),
        Command::Sequential(args) => render(&sequential::run(&cli.target, args).await?),
        Command::DiskFloor(args) => render(&disk_floor::run(args).await?),
        Command::H3(args) => render(&h3load::run(&cli.target, args).await?),
        Command::MinimalProxy(_) => anyhow::bail!("minimal-proxy runs on its own runtimes"),
    }
}

fn render<T: Serialize>(report: &T) -> anyhow::Result<String> {
    Ok(serde_json::to_string(report)?)
}

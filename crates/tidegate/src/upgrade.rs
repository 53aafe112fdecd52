//! `tidegate upgrade`: replaces the instance serving a data directory with
//! a new binary, through `serve --takeover`.
//!
//! It asks the running instance how it was started (on the hand-over's
//! socket, `DATA_DIR/takeover.sock`: its arguments, working directory and
//! `TIDEGATE_*`/`NOTIFY_SOCKET` environment), starts `BINARY serve <those
//! arguments> --takeover` in a process group of its own (so that a
//! terminal's Ctrl-C to this command does not reach it), and returns once
//! the new process answers on the socket: it serves then, and the old one
//! drains and exits by itself. A new process that exits first, or does
//! not serve in time (it is stopped), leaves the old one serving; the
//! command then fails with the reason. `SIGUSR2` to a running `tidegate
//! serve` does the same from inside, with the executable it was started
//! from (nginx's binary upgrade signal).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tidegate_takeover::{Description, Timeouts};

use crate::cli::UpgradeArgs;

/// How often the new process is looked at while it starts.
const POLL: Duration = Duration::from_millis(20);

/// A finished upgrade.
#[derive(Debug)]
pub struct Upgraded {
    /// The process taken over.
    pub old_pid: u32,
    /// The process serving now.
    pub new_pid: u32,
    /// The binary it runs.
    pub binary: PathBuf,
    /// From the question to the new process serving.
    pub took: Duration,
}

pub fn run(args: UpgradeArgs) -> anyhow::Result<ExitCode> {
    let u = upgrade(&args.data_dir, args.binary, Duration::from_secs(args.timeout_s))?;
    println!(
        "upgraded: pid {} -> {} ({}) in {} ms; pid {} drains and exits",
        u.old_pid,
        u.new_pid,
        u.binary.display(),
        u.took.as_millis(),
        u.old_pid
    );
    Ok(ExitCode::SUCCESS)
}

/// Replaces the instance serving `data_dir` with `binary` (default: this
/// process's executable); returns once the new process serves, or fails
/// leaving the old one serving.
pub fn upgrade(data_dir: &Path, binary: Option<PathBuf>, timeout: Duration) -> anyhow::Result<Upgraded> {
    let started = Instant::now();
    let socket = tidegate_takeover::socket_path(data_dir);
    let running = tidegate_takeover::describe(&socket, Timeouts::default())
        .with_context(|| format!("asking the instance serving {} how it was started", data_dir.display()))?;
    let serve_args = successor_args(&running.args)?;
    let binary = match binary {
        Some(b) => b,
        None => std::env::current_exe().context("finding this binary (give --binary)")?,
    };
    let mut command = Command::new(&binary);
    command.args(&serve_args).envs(running.env.iter().map(|(k, v)| (k, v))).stdin(Stdio::null());
    if let Some(cwd) = &running.cwd {
        command.current_dir(cwd);
    }
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    let mut child = command.spawn().with_context(|| format!("starting {}", binary.display()))?;
    let deadline = started + timeout;
    loop {
        if let Some(status) = child.try_wait().context("waiting for the new process")? {
            bail!(
                "the new process ({}) exited with {status} before serving; the running instance (pid {}) keeps serving",
                binary.display(),
                running.pid
            );
        }
        if serves(&socket, child.id()) {
            break;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "the new process did not serve within {} s and was stopped; the running instance (pid {}) keeps serving",
                timeout.as_secs(),
                running.pid
            );
        }
        std::thread::sleep(POLL);
    }
    Ok(Upgraded { old_pid: running.pid, new_pid: child.id(), binary, took: started.elapsed() })
}

/// Whether the process `pid` answers on the hand-over's socket: it listens
/// there just before it tells its predecessor that it serves.
fn serves(socket: &Path, pid: u32) -> bool {
    let quick = Timeouts { step: Duration::from_secs(2), ..Timeouts::default() };
    matches!(tidegate_takeover::describe(socket, quick), Ok(Description { pid: p, .. }) if p == pid)
}

/// The new process's arguments: the running instance's, with
/// `--takeover` once.
fn successor_args(running: &[String]) -> anyhow::Result<Vec<String>> {
    if running.first().map(String::as_str) != Some("serve") {
        bail!(
            "the running instance was not started as `tidegate serve ...` (its arguments: {running:?}, empty when not \
             UTF-8): start `tidegate serve <its flags> --takeover` yourself"
        );
    }
    let mut args: Vec<String> = running.iter().filter(|a| *a != "--takeover").cloned().collect();
    args.push("--takeover".into());
    Ok(args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_successor_runs_serve_with_the_same_flags_and_takeover_once() {
        let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            successor_args(&args(&["serve", "--data-dir", "d", "--takeover", "--listen", ":80"])).expect("serve"),
            args(&["serve", "--data-dir", "d", "--listen", ":80", "--takeover"])
        );
        let e = successor_args(&args(&["demo"])).expect_err("not serve");
        assert!(e.to_string().contains("not started as `tidegate serve"), "{e}");
        assert!(successor_args(&[]).is_err());
    }
}

//! Processes and process groups, through `nix` (the workspace forbids
//! `unsafe`), careful about the two ways a pid lies:
//!
//! - a zombie (exited, not yet reaped) still answers `kill(pid, 0)`, so
//!   liveness also reads `/proc/PID/stat` and counts zombies as gone;
//! - a pid is reused once its process is reaped, so an instance is
//!   recognised by its pid, its process group (instances lead their own)
//!   and, where `/proc` has it, its start time.
//!
//! A process group id stays allocated while any member lives, so signalling
//! a group that still has members never reaches a stranger.

use std::path::Path;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::{getpgid, getpgrp, getpid, Pid};
use tokio::time::Instant;

/// How often waits re-check a process.
const POLL: Duration = Duration::from_millis(50);

/// How long to wait for a group to vanish after SIGKILL.
pub(crate) const KILL_WAIT: Duration = Duration::from_secs(5);

/// What `/proc/PID/stat` says about a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcInfo {
    /// One-letter state (`R`, `S`, `Z`...).
    pub state: char,
    /// Its process group.
    pub pgrp: i32,
    /// When it started, in clock ticks since boot.
    pub start: u64,
}

/// Reads `/proc/PID/stat`; `None` when it cannot (no such process, or no
/// procfs).
pub(crate) fn proc_info(pid: i32) -> Option<ProcInfo> {
    if pid <= 0 {
        return None;
    }
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Parses one `/proc/PID/stat` line. The command name (field 2) may hold
/// spaces and parentheses, so fields are counted from its last `)`.
fn parse_stat(text: &str) -> Option<ProcInfo> {
    let (_, rest) = text.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let _ppid = fields.next()?;
    let pgrp = fields.next()?.parse().ok()?;
    // Fields 6 to 21 come between the process group (5) and the start time (22).
    let start = fields.nth(16)?.parse().ok()?;
    Some(ProcInfo { state, pgrp, start })
}

fn have_procfs() -> bool {
    Path::new("/proc/self/stat").exists()
}

/// Whether `pid` runs, is not a zombie, leads its own process group and,
/// when `start` is known, started then.
pub(crate) fn leader_alive(pid: i32, start: Option<u64>) -> bool {
    if pid <= 1 {
        return false;
    }
    match kill(Pid::from_raw(pid), None) {
        Ok(()) | Err(Errno::EPERM) => {}
        Err(_) => return false,
    }
    match proc_info(pid) {
        Some(info) => info.state != 'Z' && info.pgrp == pid && start.is_none_or(|s| s == info.start),
        // Either it just exited, or there is no procfs to tell more.
        None => !have_procfs() && getpgid(Some(Pid::from_raw(pid))) == Ok(Pid::from_raw(pid)),
    }
}

/// Whether process group `pgid` has a member that is not a zombie.
pub(crate) fn group_alive(pgid: i32) -> bool {
    if pgid <= 1 {
        return false;
    }
    if killpg(Pid::from_raw(pgid), None) == Err(Errno::ESRCH) {
        return false;
    }
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return true;
    };
    entries.flatten().any(|entry| {
        let pid = entry.file_name().to_str().and_then(|name| name.parse::<i32>().ok());
        pid.and_then(proc_info).is_some_and(|info| info.pgrp == pgid && info.state != 'Z')
    })
}

/// Why an instance's process group could not be signalled or stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignalError {
    /// Our own group, init's, or not a group id: never signalled.
    #[error("refusing to signal process group {0}")]
    Refused(i32),
    /// The system refused the signal.
    #[error("sending {signal} to process group {pgid}: {errno}")]
    Send {
        /// The group.
        pgid: i32,
        /// The signal.
        signal: Signal,
        /// What the system said.
        errno: Errno,
    },
    /// The group's leader still runs after SIGKILL and the wait after it.
    #[error("process group {pgid} still runs {} s after SIGKILL", .waited.as_secs())]
    StillRuns {
        /// The group.
        pgid: i32,
        /// How long it was waited for after SIGKILL.
        waited: Duration,
    },
}

/// Sends `signal` to process group `pgid`. A group that is already gone is
/// fine; our own group, init's and nonsense ids are refused.
pub(crate) fn signal_group(pgid: i32, signal: Signal) -> Result<(), SignalError> {
    if pgid <= 1 || pgid == getpgrp().as_raw() || pgid == getpid().as_raw() {
        return Err(SignalError::Refused(pgid));
    }
    match killpg(Pid::from_raw(pgid), signal) {
        Ok(()) | Err(Errno::ESRCH) => Ok(()),
        Err(errno) => Err(SignalError::Send { pgid, signal, errno }),
    }
}

/// Polls `done` until it holds (true) or `limit` passes (false).
pub(crate) async fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if done() {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        tokio::time::sleep(POLL.min(deadline - now)).await;
    }
}

/// Stops process group `pgid` led by a process that `leader_gone` watches:
/// SIGTERM to the group, up to `grace` for every member to exit, then
/// SIGKILL to the group and up to [`KILL_WAIT`] more. Succeeds once the
/// leader is gone, even if unreaped members linger after SIGKILL.
pub(crate) async fn terminate(pgid: i32, grace: Duration, leader_gone: impl Fn() -> bool) -> Result<(), SignalError> {
    let gone = || leader_gone() && !group_alive(pgid);
    if gone() {
        return Ok(());
    }
    signal_group(pgid, Signal::SIGTERM)?;
    if wait_until(grace, gone).await {
        return Ok(());
    }
    tracing::info!(pgid, grace_s = grace.as_secs_f64(), "instance still runs after SIGTERM, sending SIGKILL");
    signal_group(pgid, Signal::SIGKILL)?;
    if wait_until(KILL_WAIT, gone).await {
        return Ok(());
    }
    if leader_gone() {
        tracing::warn!(pgid, "members of the instance's process group remain after SIGKILL (unreaped?)");
        return Ok(());
    }
    Err(SignalError::StillRuns { pgid, waited: KILL_WAIT })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_are_parsed_from_the_last_parenthesis() {
        let line = "4242 (we ird) (name)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(parse_stat(line), Some(ProcInfo { state: 'S', pgrp: 4242, start: 987_654 }));
        assert_eq!(parse_stat("12 (x) Z 1 12"), None);
        assert_eq!(parse_stat(""), None);
        assert_eq!(parse_stat("1 (x) S a b c"), None);
    }

    #[test]
    fn our_own_process_is_seen_and_never_signalled() {
        let me = getpid().as_raw();
        let info = proc_info(me).unwrap();
        assert_ne!(info.state, 'Z');
        assert!(signal_group(getpgrp().as_raw(), Signal::SIGTERM).is_err());
        assert!(signal_group(0, Signal::SIGTERM).is_err());
        assert_eq!(signal_group(1, Signal::SIGTERM), Err(SignalError::Refused(1)));
        assert!(signal_group(-5, Signal::SIGTERM).is_err());
        assert!(!leader_alive(0, None));
        assert!(!leader_alive(-1, None));
        assert!(!group_alive(1));
        // A pid far beyond pid_max is never alive.
        assert!(!leader_alive(i32::MAX, None));
        assert!(!group_alive(i32::MAX));
    }
}

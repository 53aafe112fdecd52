//! The `process` provider (the embedded default): each instance is a local
//! process started from a command template.
//!
//! - `start` picks the first port of the range that no live instance of
//!   this provider holds and that 127.0.0.1 can bind, replaces `{port}`,
//!   `{id}` and `{service}` in every argument, and spawns the command in its
//!   own process group with stdin from `/dev/null` and stdout and stderr
//!   appended to `{state_dir}/{service}-{id}.log`. That file is bounded:
//!   checked four times a second (at every `alive` for an instance adopted
//!   after a restart), once over [`OUTPUT_FILE_BYTES`] it is copied to
//!   `{service}-{id}.log.1` (replacing the previous copy) and emptied, so
//!   an instance has at most two files of about that size. When it is
//!   stopped (or found gone), its current file is kept as
//!   `{state_dir}/{service}.last.log` (the last stopped instance's
//!   output, for start failures) and the others are removed. The instance listens on
//!   `127.0.0.1:{port}`; its handle is its pid. The variables are also in
//!   the environment as `TIDEGATE_PORT`, `TIDEGATE_ID`, `TIDEGATE_SERVICE`.
//!   The command must stay in the foreground: when it exits the instance
//!   counts as exited.
//! - A background task per child reaps it, so `alive` answers `Some(false)`
//!   as soon as it exits.
//! - `stop` sends SIGTERM to the process group, waits up to `grace_s`,
//!   sends SIGKILL to the group and waits (bounded) for it to go.
//! - Started instances are recorded in `{state_dir}/{service}.instances.json`;
//!   `list` returns the recorded ones that still run, so that after a
//!   restart they can be adopted (and `alive`, `stop` work on them by pid).

use std::collections::{HashMap, HashSet};
use std::fs::OpenOptions;
use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tidegate_model::PortRange;
use tokio::sync::watch;

use super::state::{Record, StateStore};
use super::unix::{leader_alive, proc_info, terminate};
use super::{file_part, fill};
use crate::provider::{BoxFuture, Instance, Provider, ProviderError, ProviderErrorKind, StartRequest};

/// The longest grace period honoured, s.
const MAX_GRACE_S: u64 = 3_600;

/// An instance's output file is rotated once over this size, bytes.
pub const OUTPUT_FILE_BYTES: u64 = 4 * 1024 * 1024;
/// How often a running instance's output file is checked.
const ROTATE_EVERY: Duration = Duration::from_millis(250);

/// Local processes, one port each.
pub struct ProcessProvider {
    service: String,
    command: Vec<String>,
    ports: PortRange,
    grace: Duration,
    state_dir: PathBuf,
    store: StateStore,
    children: Mutex<HashMap<String, Child>>,
}

/// A process this provider spawned (and reaps).
struct Child {
    pid: i32,
    port: u16,
    start_time: Option<u64>,
    exited: watch::Receiver<bool>,
}

impl Child {
    fn running(&self) -> bool {
        !*self.exited.borrow() && leader_alive(self.pid, self.start_time)
    }
}

impl ProcessProvider {
    /// A provider for `service` running `command` (placeholders `{port}`,
    /// `{id}`, `{service}`) on ports from `ports`, with `grace_s` seconds
    /// (at most an hour) between SIGTERM and SIGKILL, keeping its state
    /// file and the instances' logs in `state_dir`.
    pub fn new(service: &str, command: Vec<String>, ports: PortRange, grace_s: u64, state_dir: &Path) -> Self {
        ProcessProvider {
            service: service.to_string(),
            command,
            ports,
            grace: Duration::from_secs(grace_s.min(MAX_GRACE_S)),
            state_dir: state_dir.to_path_buf(),
            store: StateStore::new(state_dir, service),
            children: Mutex::new(HashMap::new()),
        }
    }

    /// The log file of instance `id`.
    pub fn log_path(&self, id: &str) -> PathBuf {
        self.state_dir.join(format!("{}-{}.log", file_part(&self.service), file_part(id)))
    }

    /// Where the output of the last instance stopped is kept.
    pub fn last_log_path(&self) -> PathBuf {
        self.state_dir.join(format!("{}.last.log", file_part(&self.service)))
    }

    /// Keeps the current output file of a stopped instance as the
    /// service's last one and removes the rest.
    fn retire_output(&self, id: &str) {
        let log = self.log_path(id);
        let _ = std::fs::remove_file(rotated(&log));
        match std::fs::rename(&log, self.last_log_path()) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(service = %self.service, id, error = %e, "cannot keep the instance's output; removing it");
                let _ = std::fs::remove_file(&log);
            }
        }
    }

    fn children(&self) -> MutexGuard<'_, HashMap<String, Child>> {
        self.children.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn spawn_instance(&self, req: &StartRequest) -> Result<Instance, ProviderError> {
        let err = |kind: ProviderErrorKind| ProviderError::new(format!("process provider for {}", self.service), kind);
        let io = |doing: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| err(ProviderErrorKind::Io { doing, path, source })
        };
        std::fs::create_dir_all(&self.state_dir).map_err(io("creating", &self.state_dir))?;
        // Held until the child is registered, so concurrent starts get different ports.
        let mut children = self.children();
        if children.get(&req.id).is_some_and(Child::running) {
            return Err(err(ProviderErrorKind::AlreadyRuns(req.id.clone())));
        }
        let records = self.store.load();
        let live: Vec<&Record> = records.iter().filter(|r| leader_alive(r.pid, r.start_time)).collect();
        if live.iter().any(|r| r.id == req.id) {
            return Err(err(ProviderErrorKind::AlreadyRuns(req.id.clone())));
        }
        let taken: HashSet<u16> =
            children.values().filter(|c| c.running()).map(|c| c.port).chain(live.iter().map(|r| r.port)).collect();
        let port = (self.ports.from..=self.ports.to)
            .find(|p| *p != 0 && !taken.contains(p) && TcpListener::bind(("127.0.0.1", *p)).is_ok())
            .ok_or_else(|| err(ProviderErrorKind::NoFreePort { from: self.ports.from, to: self.ports.to }))?;

        let port_text = port.to_string();
        let vars = [("port", port_text.as_str()), ("id", req.id.as_str()), ("service", self.service.as_str())];
        let argv: Vec<String> = self.command.iter().map(|arg| fill(arg, &vars)).collect();
        let Some((program, args)) = argv.split_first().filter(|(p, _)| !p.is_empty()) else {
            return Err(err(ProviderErrorKind::NotConfigured("command")));
        };
        let log_path = self.log_path(&req.id);
        let mut log = OpenOptions::new().create(true).append(true).open(&log_path).map_err(io("opening", &log_path))?;
        let _ = writeln!(log, "# tidegate: starting instance {} on port {port}: {argv:?}", req.id);
        let log_too = log.try_clone().map_err(io("opening", &log_path))?;
        let mut command = tokio::process::Command::new(program);
        super::clean_env(&mut command);
        let child = command
            .args(args)
            .env("TIDEGATE_PORT", &port_text)
            .env("TIDEGATE_ID", &req.id)
            .env("TIDEGATE_SERVICE", &self.service)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_too)
            .process_group(0)
            .spawn();
        let mut child = match child {
            Ok(child) => child,
            Err(e) => {
                // No instance: its output file goes now (kept as the last).
                self.retire_output(&req.id);
                return Err(err(ProviderErrorKind::Spawn { doing: "starting", program: program.clone(), source: e }));
            }
        };
        let pid = child.id().and_then(|p| i32::try_from(p).ok()).ok_or_else(|| err(ProviderErrorKind::NoPid))?;
        let start_time = proc_info(pid).map(|info| info.start);
        let (exited_tx, exited) = watch::channel(false);
        let label = format!("{}/{}", self.service, req.id);
        let output = log_path.clone();
        tokio::spawn(async move {
            // Reaps the child, keeping its output bounded meanwhile.
            let mut check = tokio::time::interval(ROTATE_EVERY);
            check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let status = loop {
                tokio::select! {
                    status = child.wait() => break status,
                    _ = check.tick() => {
                        let output = output.clone();
                        let rotated = tokio::task::spawn_blocking(move || rotate_output(&output, OUTPUT_FILE_BYTES)).await;
                        if let Ok(Err(e)) = rotated {
                            tracing::warn!(instance = %label, error = %e, "cannot rotate the instance's output");
                        }
                    }
                }
            };
            match status {
                Ok(status) => tracing::info!(instance = %label, pid, %status, "instance exited"),
                Err(e) => tracing::warn!(instance = %label, pid, error = %e, "cannot wait for instance"),
            }
            exited_tx.send_replace(true);
        });
        children.insert(req.id.clone(), Child { pid, port, start_time, exited });
        drop(children);

        let addr = format!("127.0.0.1:{port}");
        let record = Record { id: req.id.clone(), addr: addr.clone(), port, pid, start_time };
        let saved = self.store.update(|records| {
            records.retain(|r| r.id != record.id && leader_alive(r.pid, r.start_time));
            records.push(record);
        });
        if let Err(e) = saved {
            tracing::warn!(service = %self.service, id = %req.id, error = %e, "instance not recorded; it cannot be adopted after a restart");
        }
        tracing::info!(service = %self.service, id = %req.id, pid, %addr, "instance started");
        Ok(Instance { id: req.id.clone(), addr, handle: Some(pid.to_string()) })
    }

    async fn stop_instance(&self, instance: &Instance) -> Result<(), ProviderError> {
        let own = self.children().get(&instance.id).map(|c| (c.pid, c.start_time, c.exited.clone()));
        let (pid, start_time, exited) = match own {
            Some((pid, start_time, exited)) => (pid, start_time, Some(exited)),
            None => match self.store.load().into_iter().find(|r| r.id == instance.id) {
                Some(r) if leader_alive(r.pid, r.start_time) => (r.pid, r.start_time, None),
                // Not running (any more): nothing to stop.
                _ => {
                    self.forget(&instance.id);
                    return Ok(());
                }
            },
        };
        let leader_gone = || exited.as_ref().is_some_and(|rx| *rx.borrow()) || !leader_alive(pid, start_time);
        terminate(pid, self.grace, leader_gone)
            .await
            .map_err(|e| ProviderError::new(format!("stopping {}/{}", self.service, instance.id), e.into()))?;
        if let Some(mut rx) = exited {
            // Let the reaper catch up, so the pid is no longer a zombie.
            let _ = tokio::time::timeout(Duration::from_secs(1), rx.wait_for(|done| *done)).await;
        }
        self.forget(&instance.id);
        tracing::info!(service = %self.service, id = %instance.id, pid, "instance stopped");
        Ok(())
    }

    /// Drops an instance from memory and from the state file, and its
    /// output files (the current one kept as the service's last).
    fn forget(&self, id: &str) {
        self.children().remove(id);
        self.retire_output(id);
        if let Err(e) = self.store.update(|records| records.retain(|r| r.id != id)) {
            tracing::warn!(service = %self.service, id, error = %e, "cannot update the instances file");
        }
    }

    fn running(&self) -> Vec<Instance> {
        let children = self.children();
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for r in self.store.load() {
            let running = match children.get(&r.id) {
                Some(c) => c.pid == r.pid && c.running(),
                None => leader_alive(r.pid, r.start_time),
            };
            if running && seen.insert(r.id.clone()) {
                out.push(Instance { id: r.id, addr: r.addr, handle: Some(r.pid.to_string()) });
            }
        }
        // Children whose record could not be written.
        for (id, c) in children.iter() {
            if c.running() && seen.insert(id.clone()) {
                out.push(Instance {
                    id: id.clone(),
                    addr: format!("127.0.0.1:{}", c.port),
                    handle: Some(c.pid.to_string()),
                });
            }
        }
        out
    }

    fn is_alive(&self, instance: &Instance) -> Option<bool> {
        if let Some(c) = self.children().get(&instance.id) {
            return Some(c.running());
        }
        let record = self.store.load().into_iter().find(|r| r.id == instance.id)?;
        let alive = leader_alive(record.pid, record.start_time);
        if alive {
            // Adopted after a restart: no reaper of ours checks its output.
            if let Err(e) = rotate_output(&self.log_path(&instance.id), OUTPUT_FILE_BYTES) {
                tracing::warn!(service = %self.service, id = %instance.id, error = %e, "cannot rotate the instance's output");
            }
        }
        Some(alive)
    }
}

/// The previous output file of the instance writing `log`.
fn rotated(log: &Path) -> PathBuf {
    let mut name = log.as_os_str().to_os_string();
    name.push(".1");
    PathBuf::from(name)
}

/// If `log` is over `limit` bytes, copies it to `log.1` (replacing that)
/// and empties it; the instance, which appends, goes on writing at its new
/// end. Returns whether it rotated. Output written between the copy and
/// the truncation (a fraction of a millisecond) is lost.
fn rotate_output(log: &Path, limit: u64) -> std::io::Result<bool> {
    let len = match std::fs::metadata(log) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    if len <= limit {
        return Ok(false);
    }
    std::fs::copy(log, rotated(log))?;
    OpenOptions::new().write(true).open(log)?.set_len(0)?;
    Ok(true)
}

impl Provider for ProcessProvider {
    fn start(&self, req: StartRequest) -> BoxFuture<'_, Result<Instance, ProviderError>> {
        Box::pin(async move { self.spawn_instance(&req) })
    }

    fn stop<'a>(&'a self, instance: &'a Instance) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(self.stop_instance(instance))
    }

    fn list(&self) -> BoxFuture<'_, Result<Vec<Instance>, ProviderError>> {
        Box::pin(async move { Ok(self.running()) })
    }

    /// `Some` for instances this provider started or finds in its state
    /// file; `None` for ids it never heard of.
    fn alive<'a>(&'a self, instance: &'a Instance) -> BoxFuture<'a, Option<bool>> {
        Box::pin(async move { self.is_alive(instance) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::signal::{killpg, Signal};
    use nix::unistd::Pid;
    use std::net::TcpStream;
    use std::time::Instant;

    /// Kills the process groups of the instances a test started, whatever
    /// happens to the test.
    #[derive(Default)]
    struct Cleanup(Vec<i32>);

    impl Cleanup {
        fn add(&mut self, instance: &Instance) -> i32 {
            let pid = instance.handle.as_deref().unwrap().parse().unwrap();
            self.0.push(pid);
            pid
        }
    }

    impl Drop for Cleanup {
        fn drop(&mut self) {
            for pid in &self.0 {
                let _ = killpg(Pid::from_raw(*pid), Signal::SIGKILL);
            }
        }
    }

    fn provider(dir: &Path, command: &[&str], from: u16, grace_s: u64) -> ProcessProvider {
        let command = command.iter().map(|s| s.to_string()).collect();
        ProcessProvider::new("web", command, PortRange { from, to: from + 9 }, grace_s, dir)
    }

    fn req(id: &str) -> StartRequest {
        StartRequest { service: "web".into(), id: id.into() }
    }

    async fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
        super::super::unix::wait_until(limit, &mut f).await
    }

    fn gone(pid: i32) -> bool {
        nix::sys::signal::kill(Pid::from_raw(pid), None).is_err()
    }

    #[tokio::test]
    async fn serves_on_its_port_until_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let mut cleanup = Cleanup::default();
        let command = ["python3", "-m", "http.server", "{port}", "--bind", "127.0.0.1"];
        let p = provider(dir.path(), &command, 27_100, 5);
        // A port in use is skipped.
        let busy = TcpListener::bind("127.0.0.1:27100");
        let a = p.start(req("a")).await.unwrap();
        let a_pid = cleanup.add(&a);
        if busy.is_ok() {
            assert_ne!(a.addr, "127.0.0.1:27100");
        }
        let b = p.start(req("b")).await.unwrap();
        cleanup.add(&b);
        assert_ne!(a.addr, b.addr);
        assert!(a.addr.starts_with("127.0.0.1:271"), "{}", a.addr);
        assert!(eventually(Duration::from_secs(20), || TcpStream::connect(&a.addr).is_ok()).await, "nobody answers");
        assert_eq!(p.alive(&a).await, Some(true));
        let mut listed: Vec<String> = p.list().await.unwrap().into_iter().map(|i| i.id).collect();
        listed.sort();
        assert_eq!(listed, ["a", "b"]);
        assert!(p.start(req("a")).await.is_err(), "the same id twice");
        let log = std::fs::read_to_string(p.log_path("a")).unwrap();
        assert!(log.contains("starting instance a"), "{log}");

        p.stop(&a).await.unwrap();
        assert!(gone(a_pid));
        assert!(TcpListener::bind(&a.addr).is_ok(), "the port is still taken");
        assert_eq!(p.list().await.unwrap().len(), 1);
        p.stop(&b).await.unwrap();
        assert!(p.list().await.unwrap().is_empty());
        // Stopping twice is fine.
        p.stop(&b).await.unwrap();
    }

    #[tokio::test]
    async fn an_instance_that_exits_is_not_alive() {
        let dir = tempfile::tempdir().unwrap();
        let mut cleanup = Cleanup::default();
        let p = provider(dir.path(), &["sh", "-c", "echo bye {id} {service} {port}; exit 3"], 27_110, 1);
        let i = p.start(req("x")).await.unwrap();
        cleanup.add(&i);
        let mut alive = Some(true);
        for _ in 0..100 {
            alive = p.alive(&i).await;
            if alive == Some(false) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(alive, Some(false));
        assert!(p.list().await.unwrap().is_empty());
        let log = std::fs::read_to_string(p.log_path("x")).unwrap();
        assert!(log.contains(&format!("bye x web {}", &i.addr[10..])), "{log}");
        p.stop(&i).await.unwrap();
        let unknown = Instance { id: "nobody".into(), addr: "127.0.0.1:1".into(), handle: None };
        assert_eq!(p.alive(&unknown).await, None);
    }

    #[test]
    fn output_over_the_limit_is_rotated_into_one_previous_file() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("web-a.log");
        assert!(!rotate_output(&log, 10).unwrap(), "no file yet");
        // Opened for appending, as the instance has it.
        let mut writer = OpenOptions::new().create(true).append(true).open(&log).unwrap();
        writer.write_all(b"0123456789").unwrap();
        assert!(!rotate_output(&log, 10).unwrap());
        writer.write_all(b"abc").unwrap();
        assert!(rotate_output(&log, 10).unwrap());
        assert_eq!(std::fs::read(rotated(&log)).unwrap(), b"0123456789abc");
        assert_eq!(std::fs::metadata(&log).unwrap().len(), 0);
        // The writer goes on at the start of the emptied file, not at its old offset.
        writer.write_all(b"next").unwrap();
        assert_eq!(std::fs::read(&log).unwrap(), b"next");
        writer.write_all(b" and more output").unwrap();
        assert!(rotate_output(&log, 10).unwrap());
        assert_eq!(std::fs::read(rotated(&log)).unwrap(), b"next and more output");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2, "two files, never more");
    }

    #[tokio::test]
    async fn a_loud_instance_keeps_two_bounded_files_removed_when_it_stops() {
        let dir = tempfile::tempdir().unwrap();
        let mut cleanup = Cleanup::default();
        // About 20 MiB of output in 4 s, and it keeps running.
        let loud =
            "i=0; while [ $i -lt 40 ]; do head -c 524288 /dev/zero | tr '\\0' x; sleep 0.1; i=$((i+1)); done; sleep 30";
        let p = provider(dir.path(), &["sh", "-c", loud], 27_150, 1);
        let i = p.start(req("loud")).await.unwrap();
        cleanup.add(&i);
        let log = p.log_path("loud");
        let limit = OUTPUT_FILE_BYTES + 4 * 1024 * 1024;
        let began = Instant::now();
        while began.elapsed() < Duration::from_secs(6) {
            let current = std::fs::metadata(&log).map_or(0, |m| m.len());
            let previous = std::fs::metadata(rotated(&log)).map_or(0, |m| m.len());
            assert!(current <= limit && previous <= limit, "{current} and {previous} bytes");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(rotated(&log).exists(), "never rotated");
        p.stop(&i).await.unwrap();
        assert!(!log.exists() && !rotated(&log).exists(), "the instance's files are left");
        assert!(p.last_log_path().exists(), "the last output is kept");
    }

    #[tokio::test]
    async fn a_missing_program_fails_to_start() {
        let dir = tempfile::tempdir().unwrap();
        let p = provider(dir.path(), &["/nonexistent/tidegate-server", "{port}"], 27_120, 1);
        let e = p.start(req("x")).await.unwrap_err();
        assert!(
            matches!(&e.kind, ProviderErrorKind::Spawn { doing: "starting", program, .. } if program.ends_with("tidegate-server")),
            "{e:?}"
        );
        assert!(
            e.to_string().starts_with("process provider for web: starting \"/nonexistent/tidegate-server\""),
            "{e}"
        );
        // No file is left behind per failed start; the last one is kept.
        assert!(!p.log_path("x").exists());
        assert!(std::fs::read_to_string(p.last_log_path()).unwrap().contains("starting instance x"));
        assert!(p.list().await.unwrap().is_empty());
        let empty = ProcessProvider::new("web", vec![], PortRange { from: 27_120, to: 27_121 }, 1, dir.path());
        assert!(matches!(empty.start(req("x")).await.unwrap_err().kind, ProviderErrorKind::NotConfigured("command")));
        for (from, to) in [(0, 0), (27_122, 27_121)] {
            let none = ProcessProvider::new("web", vec!["true".into()], PortRange { from, to }, 1, dir.path());
            let e = none.start(req("x")).await.unwrap_err();
            assert!(matches!(e.kind, ProviderErrorKind::NoFreePort { .. }), "{e:?}");
            assert!(e.to_string().contains("no free port"), "{e}");
        }
    }

    #[tokio::test]
    async fn sigterm_is_followed_by_sigkill_after_the_grace_period() {
        let dir = tempfile::tempdir().unwrap();
        let mut cleanup = Cleanup::default();
        let p = provider(dir.path(), &["sh", "-c", "trap '' TERM; echo trapped; sleep 60; true"], 27_130, 1);
        let i = p.start(req("stubborn")).await.unwrap();
        let pid = cleanup.add(&i);
        // Once the shell says so, its trap is installed (a line of its own:
        // the log's first line quotes the command).
        let log = p.log_path("stubborn");
        let trapped = || std::fs::read_to_string(&log).is_ok_and(|l| l.lines().any(|l| l == "trapped"));
        assert!(eventually(Duration::from_secs(10), trapped).await, "the shell never installed its trap");
        let began = Instant::now();
        p.stop(&i).await.unwrap();
        let took = began.elapsed();
        assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(4), "{took:?}");
        assert!(gone(pid));
        assert!(!super::super::unix::group_alive(pid));
    }

    #[tokio::test]
    async fn a_new_provider_adopts_what_the_state_file_lists() {
        let dir = tempfile::tempdir().unwrap();
        let mut cleanup = Cleanup::default();
        let first = provider(dir.path(), &["sh", "-c", "sleep 30; true"], 27_140, 2);
        let i = first.start(req("kept")).await.unwrap();
        let pid = cleanup.add(&i);
        let state = std::fs::read_to_string(dir.path().join("web.instances.json")).unwrap();
        let json: serde_json::Value = serde_json::from_str(&state).unwrap();
        assert_eq!(json["instances"][0]["id"], "kept");
        assert_eq!(json["instances"][0]["pid"], pid);
        assert_eq!(json["instances"][0]["addr"], i.addr.as_str());

        // "Restart": a new provider on the same directory.
        let second = provider(dir.path(), &["sh", "-c", "sleep 30; true"], 27_140, 2);
        assert_eq!(second.list().await.unwrap(), vec![i.clone()]);
        assert_eq!(second.alive(&i).await, Some(true));
        // It does not hand out the adopted instance's port again.
        let other = second.start(req("other")).await.unwrap();
        cleanup.add(&other);
        assert_ne!(other.addr, i.addr);
        second.stop(&i).await.unwrap();
        // Gone, though in this test it is still the first provider's child to reap.
        assert!(!leader_alive(pid, None));
        assert!(eventually(Duration::from_secs(2), || gone(pid)).await);
        assert_eq!(second.list().await.unwrap(), vec![other.clone()]);
        assert!(eventually(Duration::from_secs(2), || first.is_alive(&i) == Some(false)).await);
        second.stop(&other).await.unwrap();

        // A recorded pid that now belongs to another process is not adopted.
        let store = StateStore::new(dir.path(), "web");
        let me = nix::unistd::getpid().as_raw();
        let start_time = proc_info(me).map(|info| info.start + 1);
        let stale = |id: &str, pid| Record { id: id.into(), addr: "127.0.0.1:1".into(), port: 1, pid, start_time };
        store.update(|r| r.extend([stale("reused", me), stale("init", 1), stale("gone", i32::MAX)])).unwrap();
        assert!(provider(dir.path(), &["true"], 27_140, 1).list().await.unwrap().is_empty());
    }
}

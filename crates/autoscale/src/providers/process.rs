//! The `process` provider (the embedded default): each instance is a local
//! process started from a command template.
//!
//! - `start` picks the first port of the range that no live instance of
//!   this provider holds and that 127.0.0.1 can bind, replaces `{port}`,
//!   `{id}` and `{service}` in every argument, and spawns the command in its
//!   own process group with stdin from `/dev/null` and stdout and stderr
//!   appended to `{state_dir}/{service}-{id}.log`. The instance listens on
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
use crate::provider::{BoxFuture, Instance, Provider, ProviderError, StartRequest};

/// The longest grace period honoured, s.
const MAX_GRACE_S: u64 = 3_600;

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

    fn children(&self) -> MutexGuard<'_, HashMap<String, Child>> {
        self.children.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn spawn_instance(&self, req: &StartRequest) -> Result<Instance, ProviderError> {
        let err = |msg: String| ProviderError(format!("process provider for {}: {msg}", self.service));
        std::fs::create_dir_all(&self.state_dir)
            .map_err(|e| err(format!("creating {}: {e}", self.state_dir.display())))?;
        // Held until the child is registered, so concurrent starts get different ports.
        let mut children = self.children();
        if children.get(&req.id).is_some_and(Child::running) {
            return Err(err(format!("instance {} already runs", req.id)));
        }
        let records = self.store.load();
        let live: Vec<&Record> = records.iter().filter(|r| leader_alive(r.pid, r.start_time)).collect();
        if live.iter().any(|r| r.id == req.id) {
            return Err(err(format!("instance {} already runs", req.id)));
        }
        let taken: HashSet<u16> =
            children.values().filter(|c| c.running()).map(|c| c.port).chain(live.iter().map(|r| r.port)).collect();
        let port = (self.ports.from..=self.ports.to)
            .find(|p| !taken.contains(p) && TcpListener::bind(("127.0.0.1", *p)).is_ok())
            .ok_or_else(|| err(format!("no free port in {}-{}", self.ports.from, self.ports.to)))?;

        let port_text = port.to_string();
        let vars = [("port", port_text.as_str()), ("id", req.id.as_str()), ("service", self.service.as_str())];
        let argv: Vec<String> = self.command.iter().map(|arg| fill(arg, &vars)).collect();
        let Some((program, args)) = argv.split_first().filter(|(p, _)| !p.is_empty()) else {
            return Err(err("no command configured".into()));
        };
        let log_path = self.log_path(&req.id);
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| err(format!("opening {}: {e}", log_path.display())))?;
        let _ = writeln!(log, "# tidegate: starting instance {} on port {port}: {argv:?}", req.id);
        let log_too = log.try_clone().map_err(|e| err(format!("opening {}: {e}", log_path.display())))?;
        let mut child = tokio::process::Command::new(program)
            .args(args)
            .env("TIDEGATE_PORT", &port_text)
            .env("TIDEGATE_ID", &req.id)
            .env("TIDEGATE_SERVICE", &self.service)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_too)
            .process_group(0)
            .spawn()
            .map_err(|e| err(format!("starting {program:?}: {e}")))?;
        let pid = child.id().and_then(|p| i32::try_from(p).ok()).ok_or_else(|| err("the child has no pid".into()))?;
        let start_time = proc_info(pid).map(|info| info.start);
        let (exited_tx, exited) = watch::channel(false);
        let label = format!("{}/{}", self.service, req.id);
        tokio::spawn(async move {
            match child.wait().await {
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
            .map_err(|e| ProviderError(format!("stopping {}/{}: {e}", self.service, instance.id)))?;
        if let Some(mut rx) = exited {
            // Let the reaper catch up, so the pid is no longer a zombie.
            let _ = tokio::time::timeout(Duration::from_secs(1), rx.wait_for(|done| *done)).await;
        }
        self.forget(&instance.id);
        tracing::info!(service = %self.service, id = %instance.id, pid, "instance stopped");
        Ok(())
    }

    /// Drops an instance from memory and from the state file.
    fn forget(&self, id: &str) {
        self.children().remove(id);
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
                out.push(Instance { id: id.clone(), addr: format!("127.0.0.1:{}", c.port), handle: Some(c.pid.to_string()) });
            }
        }
        out
    }

    fn is_alive(&self, instance: &Instance) -> Option<bool> {
        if let Some(c) = self.children().get(&instance.id) {
            return Some(c.running());
        }
        let record = self.store.load().into_iter().find(|r| r.id == instance.id)?;
        Some(leader_alive(record.pid, record.start_time))
    }
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

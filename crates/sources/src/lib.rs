//! Tidegate's background load sources and weight refresher.
//!
//! [`spawn`] starts one supervisor task on the caller's tokio runtime. It
//!
//! - calls [`ServiceSelector::refresh`](tidegate_balance::ServiceSelector::refresh)
//!   every 100 ms on the services whose policy computes weights from load
//!   (`dynamic_feedback`, `orca_wrr`), while there are any;
//! - when a snapshot is published (at most once per 500 ms), derives the
//!   load-source targets from the services' `load_metrics` and starts,
//!   updates or stops one task per target:
//!   - `node_exporter`: one task per distinct backend host and exporter port,
//!     scraping `http://HOST:PORT/metrics` each interval. CPU utilization is
//!     1 - idle / total of the `node_cpu_seconds_total` growth between two
//!     scrapes, memory 1 - `MemAvailable` / `MemTotal`, network the growth of
//!     the byte counters (non-`lo` devices, or `lo` when nothing else has
//!     traffic) per second over the service's `link_bytes_per_s`, capped at 1.
//!   - Prequal: one task per service on the `prequal` policy, probing its
//!     backends at a rate that follows its traffic (see [`prober`]).
//!   - Ganglia: one task per gmond address, reading its XML dump each
//!     interval and writing each `<HOST>`'s CPU (`cpu_idle`), memory
//!     (`mem_free` + `mem_cached` + `mem_buffers` over `mem_total`) and network
//!     (`bytes_in` + `bytes_out` over the link) into the backends whose host
//!     is the HOST's `IP` or `NAME`, or into every backend when the dump has a
//!     single host.
//!
//! Values go into each backend's [`LoadReport`](tidegate_balance::LoadReport)
//! atomics, which policies read without waiting: a source never blocks the
//! data plane. A failed poll leaves the last values in place (and is logged
//! at most once a minute per target); values older than three intervals are
//! reset to unknown (NaN), and so are those of backends no source feeds any
//! more.
//!
//! The parsing and the arithmetic are pure and live in `tidegate-scrape`
//! (node_exporter pages), [`gmond`] and [`load`].

mod ganglia;
pub mod gmond;
pub mod load;
mod node_exporter;
pub mod prober;
mod targets;
mod throttle;

use std::collections::HashMap;
use std::hash::Hash;
use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use tidegate_balance::{clock, BackendStats};
use tidegate_snapshot::{Changes, Snapshot};
use tidegate_upstream::HttpClient;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};

use crate::targets::{NodeKey, Sink, Targets};

/// How often the selectors of services whose policy computes weights from
/// load (`dynamic_feedback`, `orca_wrr`) are refreshed, while there are any.
pub const REFRESH_INTERVAL: Duration = Duration::from_millis(100);

/// The least time between two reconciliations of the source tasks with the
/// snapshot: a burst of changes is reconciled once per this. While tasks
/// run, they are also looked at this often (one that ended is restarted).
pub const RECONCILE_INTERVAL: Duration = Duration::from_millis(500);

/// A value not refreshed for this many of its source's intervals is reset
/// to unknown.
pub const STALE_AFTER_INTERVALS: u32 = 3;

/// Starts the refresher and the load sources for the snapshots published in
/// `snapshots`, on the current tokio runtime; they run until the returned
/// handle is aborted (which stops every source task too). `changes` tells
/// when a new snapshot is published: with no source and no refreshing
/// policy configured, the task sleeps until then.
///
/// # Panics
///
/// When called outside a tokio runtime.
pub fn spawn(snapshots: Arc<ArcSwap<Snapshot>>, changes: Changes) -> JoinHandle<()> {
    tokio::spawn(run(snapshots, changes))
}

async fn run(snapshots: Arc<ArcSwap<Snapshot>>, mut changes: Changes) {
    let mut supervisor = Supervisor::new();
    let mut tick = tokio::time::interval(REFRESH_INTERVAL);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    // A reconciliation is wanted for a new snapshot, and while tasks run;
    // it happens at most once per interval.
    let mut changed = true;
    let mut next_allowed = Instant::now();
    loop {
        let snapshot = snapshots.load_full();
        let wanted = changed || !supervisor.is_idle();
        if wanted && Instant::now() >= next_allowed {
            supervisor.reconcile(&snapshot).await;
            changed = false;
            next_allowed = Instant::now() + RECONCILE_INTERVAL;
            continue;
        }
        let refreshing = snapshot.refreshing().next().is_some();
        drop(snapshot);
        tokio::select! {
            _ = tick.tick(), if refreshing => {
                let now_ms = clock::now_ms();
                for service in snapshots.load().refreshing() {
                    service.selector.refresh(now_ms);
                }
            }
            () = tokio::time::sleep_until(next_allowed), if wanted => {}
            _ = changes.next(), if !changed => changed = true,
        }
    }
}

/// A task that is aborted when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl AbortOnDrop {
    /// Aborts the task and waits (briefly) until it has stopped, so that it
    /// writes nothing afterwards.
    async fn stop(mut self) {
        self.0.abort();
        let _ = tokio::time::timeout(Duration::from_secs(1), &mut self.0).await;
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A running source task and the channel that hands it its target.
struct Running<T> {
    target: watch::Sender<Arc<T>>,
    task: AbortOnDrop,
}

/// The source tasks, kept in line with the snapshot.
struct Supervisor {
    /// The snapshot the tasks were last reconciled with (weak, so an old
    /// snapshot is not kept alive, and its address is not reused while held).
    seen: Weak<Snapshot>,
    client: HttpClient,
    node: HashMap<NodeKey, Running<targets::NodeTarget>>,
    ganglia: HashMap<SocketAddr, Running<targets::GangliaTarget>>,
    probe_client: prober::ProbeClient,
    probers: HashMap<tidegate_model::ServiceName, Running<prober::ProbeTarget>>,
    /// Every backend fed by some task, by stats address.
    fed: HashMap<usize, Arc<BackendStats>>,
}

impl Supervisor {
    fn new() -> Supervisor {
        Supervisor {
            seen: Weak::new(),
            client: tidegate_scrape::client(),
            node: HashMap::new(),
            ganglia: HashMap::new(),
            probe_client: prober::client(),
            probers: HashMap::new(),
            fed: HashMap::new(),
        }
    }

    /// No source task runs.
    fn is_idle(&self) -> bool {
        self.node.is_empty() && self.ganglia.is_empty() && self.probers.is_empty()
    }

    async fn reconcile(&mut self, snapshot: &Arc<Snapshot>) {
        let client = self.client.clone();
        let start_node = |key: &NodeKey, rx| tokio::spawn(node_exporter::run(client.clone(), key.clone(), rx));
        let start_ganglia = |addr: &SocketAddr, rx| tokio::spawn(ganglia::run(*addr, rx));
        let probe_client = self.probe_client.clone();
        let start_prober = |_: &tidegate_model::ServiceName, rx| tokio::spawn(prober::run(probe_client.clone(), rx));
        if std::ptr::eq(self.seen.as_ptr(), Arc::as_ptr(snapshot)) {
            // Unchanged: only restart a task that ended (it never should).
            restart_finished(&mut self.node, start_node);
            restart_finished(&mut self.ganglia, start_ganglia);
            restart_finished(&mut self.probers, start_prober);
            return;
        }
        self.seen = Arc::downgrade(snapshot);
        let targets = Targets::of(snapshot);
        let fed = targets.fed();
        let mut stopped = sync(&mut self.node, targets.node, start_node);
        stopped.extend(sync(&mut self.ganglia, targets.ganglia, start_ganglia));
        let prequal = snapshot
            .services()
            .filter(|s| matches!(s.settings.policy, tidegate_model::PolicySpec::Prequal(_)))
            .map(|s| (s.name.clone(), prober::ProbeTarget(s.clone())))
            .collect();
        stopped.extend(sync(&mut self.probers, prequal, start_prober));
        for task in stopped {
            task.stop().await;
        }
        for (key, stats) in &self.fed {
            if !fed.contains_key(key) {
                load::forget(&stats.load);
            }
        }
        self.fed = fed;
    }
}

/// Brings `running` in line with `desired`: new keys get a task from
/// `start`, kept ones their new target, and the tasks of the keys gone are
/// returned to be stopped.
fn sync<K: Hash + Eq + Clone, T>(
    running: &mut HashMap<K, Running<T>>,
    mut desired: HashMap<K, T>,
    mut start: impl FnMut(&K, watch::Receiver<Arc<T>>) -> JoinHandle<()>,
) -> Vec<AbortOnDrop> {
    let gone: Vec<K> = running.keys().filter(|k| !desired.contains_key(*k)).cloned().collect();
    let stopped = gone.iter().filter_map(|k| running.remove(k)).map(|r| r.task).collect();
    for (key, target) in desired.drain() {
        match running.get(&key) {
            Some(r) => {
                r.target.send_replace(Arc::new(target));
            }
            None => {
                let (tx, rx) = watch::channel(Arc::new(target));
                let task = AbortOnDrop(start(&key, rx));
                running.insert(key, Running { target: tx, task });
            }
        }
    }
    stopped
}

fn restart_finished<K, T>(
    running: &mut HashMap<K, Running<T>>,
    mut start: impl FnMut(&K, watch::Receiver<Arc<T>>) -> JoinHandle<()>,
) {
    for (key, r) in running.iter_mut() {
        if r.task.0.is_finished() {
            r.task = AbortOnDrop(start(key, r.target.subscribe()));
        }
    }
}

/// Resets the values of `sinks` that were not refreshed for
/// [`STALE_AFTER_INTERVALS`] intervals.
fn expire_all<'a>(sinks: impl Iterator<Item = &'a Sink>, interval: Duration) {
    let max_age = interval.as_millis() as u64 * u64::from(STALE_AFTER_INTERVALS);
    let now = clock::now_ms();
    for sink in sinks {
        load::expire(&sink.stats.load, now, max_age);
    }
}

/// How long one poll may take: the interval, within 1..=10 s.
fn poll_timeout(interval: Duration) -> Duration {
    interval.clamp(Duration::from_secs(1), Duration::from_secs(10))
}

#[cfg(test)]
mod tests;

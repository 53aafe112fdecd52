//! Tidegate's configuration writer.
//!
//! [`Control`] is the only way configuration changes. Submitters put change
//! sets on a queue; one writer thread takes everything that queued while its
//! previous commit ran (adaptive group commit: the batch grows with the load,
//! and an idle writer commits a lone change at once), then
//!
//! 1. validates each change set on its own against the state left by the
//!    ones before it (a bad one fails alone, with nothing of it applied),
//! 2. persists all valid ones in one durable store transaction,
//! 3. publishes one new [`Snapshot`], built incrementally from the delta,
//! 4. answers every submitter with its revision and feeds watchers.
//!
//! So an answer means: durable and live in the data plane.
//!
//! A change set that arrives alone, with an embedded store, skips the
//! queue: its submitter takes the writer's turn and runs the same steps on
//! its own thread, saving the two thread wake-ups of the hand-off (see
//! [`Control::submit`]).
//!
//! With a store shared by several instances (cluster mode), the writer also
//! applies what other instances committed: the store wakes it, and it reads
//! the change sets it has not applied, in order, and publishes them as it
//! does its own. A commit built on a revision that is no longer the newest
//! is refused by the store; the writer then catches up and validates the
//! group again on top, so `if_revision` means the cluster's revision.

mod campaigns;
mod watch;
mod writer;

use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::Arc;

use arc_swap::ArcSwap;
use tidegate_metrics::Histogram;
use tidegate_model::{ChangeError, ChangeSet, ConfigState};
use tidegate_snapshot::{Changes, Publications, Snapshot};
use tidegate_store::{Store, StoreError};
use tokio::sync::{broadcast, mpsc, oneshot};

pub use campaigns::Campaigns;
pub use tidegate_store::AppliedChange;
pub use watch::{WatchError, WatchItem, WatchLimits, WatchStats, WatchStream, Watchers};

/// The configuration as of one revision, for readers.
#[derive(Debug, Clone, Default)]
pub struct ConfigView {
    /// The revision.
    pub revision: u64,
    /// The configuration.
    pub state: ConfigState,
}

/// Why a change set was not applied.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The change set is invalid or conflicts with the configuration.
    #[error(transparent)]
    Rejected(#[from] ChangeError),
    /// The store failed to persist it; nothing was applied.
    #[error("not persisted: {0}")]
    Store(String),
    /// The store cannot be reached (cluster mode: etcd is down or has no
    /// quorum); nothing was applied here, and the data plane keeps serving
    /// the last configuration.
    #[error("{0}")]
    Unavailable(String),
    /// The change set is larger than the store takes in one transaction.
    #[error("{0}")]
    TooLarge(String),
    /// The writer is shutting down.
    #[error("the configuration writer has stopped")]
    Closed,
    /// The store was handed over to a new process of this data directory
    /// (`tidegate serve --takeover`): nothing was applied here; the same
    /// change sent again reaches the new process.
    #[error("the configuration store is being handed over to a new Tidegate process (serve --takeover); nothing was applied: send the change again in a moment")]
    HandedOver,
}

/// Counters of the writer, for `/metrics`.
#[derive(Debug, Default)]
pub struct WriterMetrics {
    /// Durable commits (each may carry many change sets).
    pub commits: AtomicU64,
    /// Of those, commits of a lone change set made on its submitter's
    /// thread (see [`Control::submit`]).
    pub commits_by_submitter: AtomicU64,
    /// Change sets applied.
    pub change_sets: AtomicU64,
    /// Change sets rejected.
    pub rejected: AtomicU64,
    /// Operations applied.
    pub ops: AtomicU64,
    /// Time spent in store commits, nanoseconds.
    pub commit_nanos: AtomicU64,
    /// Time from dequeue to publication of each group, nanoseconds.
    pub apply_nanos: AtomicU64,
    /// Panics of the writer it recovered from (by reloading the store).
    pub panics: AtomicU64,
    /// Change sets applied that other instances committed (cluster mode).
    pub remote_change_sets: AtomicU64,
    /// Commits refused because another instance committed first (each is
    /// followed by a catch-up and a new attempt).
    pub conflicts: AtomicU64,
    /// Whole reloads from the store (history to catch up from was gone).
    pub reloads: AtomicU64,
    /// Durations of store commits.
    pub commit_seconds: Histogram,
    /// Durations from dequeue to publication of each group.
    pub apply_seconds: Histogram,
}

impl WriterMetrics {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }

    /// Counts a store commit that took `ns`.
    fn committed(&self, ns: u64) {
        Self::add(&self.commit_nanos, ns);
        self.commit_seconds.observe_ns(ns);
    }

    /// Counts a group applied and published `ns` after it was dequeued.
    fn applied(&self, ns: u64) {
        Self::add(&self.apply_nanos, ns);
        self.apply_seconds.observe_ns(ns);
    }
}

type Reply = oneshot::Sender<Result<u64, SubmitError>>;

struct Pending {
    change: ChangeSet,
    reply: Reply,
}

/// What the writer is asked to do.
enum Work {
    /// Apply a change set submitted here.
    Submit(Pending),
    /// Another instance committed: catch up with the store.
    CatchUp,
    /// The store has housekeeping due (after commits made by submitters).
    Maintain,
    /// Commit what was queued before, then close the store for a new
    /// process ([`Control::hand_over`]).
    Release(oneshot::Sender<Result<bool, StoreError>>),
    /// Open the store again ([`Control::take_back`]).
    Reacquire(oneshot::Sender<Result<(), StoreError>>),
}

/// Shared by the writer thread and the handles.
struct Shared {
    snapshot: Arc<ArcSwap<Snapshot>>,
    /// Announces each snapshot published, to [`Control::snapshot_changes`].
    publications: Publications,
    config: ArcSwap<ConfigView>,
    feed: broadcast::Sender<Arc<AppliedChange>>,
    store: Arc<dyn Store>,
    metrics: WriterMetrics,
    /// The right to commit: the writer thread holds it for each group, a
    /// submitter committing its lone change set for that commit.
    turn: std::sync::Mutex<()>,
    /// A submitter is about to commit its change set itself (see
    /// [`Control::submit`]); the others queue for the writer meanwhile.
    candidate: AtomicBool,
    /// How long the last store commit took, nanoseconds.
    last_commit_nanos: AtomicU64,
    /// Submissions handed to the writer thread that have not returned to
    /// their submitters yet.
    handed: AtomicUsize,
    /// The store is being handed over, or was: new submissions are refused
    /// with [`SubmitError::HandedOver`].
    sealed: AtomicBool,
}

/// A handle on the configuration: submit changes, read, watch. Cheap to clone.
#[derive(Clone)]
pub struct Control {
    queue: mpsc::Sender<Work>,
    shared: Arc<Shared>,
}

/// A store commit slower than this (a stalled disk) stops submitters from
/// committing on their own threads until one is fast again.
const SLOW_COMMIT_NANOS: u64 = 2_000_000;

/// The claim of one submitter to commit its change set itself; given up
/// when dropped, also when the submission is cancelled.
struct Candidate<'a>(&'a AtomicBool);

impl<'a> Candidate<'a> {
    fn claim(flag: &'a AtomicBool) -> Option<Candidate<'a>> {
        (!flag.swap(true, Acquire)).then_some(Candidate(flag))
    }
}

impl Drop for Candidate<'_> {
    fn drop(&mut self) {
        self.0.store(false, Release);
    }
}

/// One submission handed to the writer thread, counted until it returns
/// (answered, failed or cancelled).
struct Handed<'a>(&'a AtomicUsize);

impl<'a> Handed<'a> {
    fn count(handed: &'a AtomicUsize) -> Handed<'a> {
        handed.fetch_add(1, AcqRel);
        Handed(handed)
    }
}

impl Drop for Handed<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, AcqRel);
    }
}

/// How many change sets may wait for the writer before submitters wait too.
const QUEUE_CAPACITY: usize = 65_536;
/// How many applied change sets a slow watcher may fall behind.
const FEED_CAPACITY: usize = 16_384;

impl Control {
    /// Loads the configuration from `store` and starts the writer thread.
    pub fn start(store: Arc<dyn Store>) -> Result<Control, StoreError> {
        let loaded = store.load()?;
        let snapshot = Snapshot::from_state(&loaded.state, loaded.revision);
        let (queue, rx) = mpsc::channel(QUEUE_CAPACITY);
        let shared = Arc::new(Shared {
            snapshot: Arc::new(ArcSwap::from_pointee(snapshot)),
            publications: Publications::new(loaded.revision),
            config: ArcSwap::from_pointee(ConfigView { revision: loaded.revision, state: loaded.state }),
            feed: broadcast::channel(FEED_CAPACITY).0,
            store,
            metrics: WriterMetrics::default(),
            turn: std::sync::Mutex::new(()),
            candidate: AtomicBool::new(false),
            last_commit_nanos: AtomicU64::new(0),
            handed: AtomicUsize::new(0),
            sealed: AtomicBool::new(false),
        });
        let wake = queue.clone();
        let applied = shared.clone();
        shared.store.follow(tidegate_store::Follow {
            // A full queue is fine: the writer checks the store's revision
            // after every group anyway.
            wake: Box::new(move || {
                let _ = wake.try_send(Work::CatchUp);
            }),
            applied: Box::new(move || applied.config.load().revision),
            in_flight: {
                let shared = shared.clone();
                Box::new(move || autoscaled_in_flight(&shared))
            },
            // Rate limits with `per_instance_share` divide their rate by it.
            instances: Box::new(|n| tidegate_rules::set_live_instances(u32::try_from(n).unwrap_or(u32::MAX))),
        });
        let writer = writer::Writer::new(shared.clone(), rx);
        std::thread::Builder::new()
            .name("tidegate-writer".into())
            .spawn(move || writer.run())
            .map_err(|e| StoreError::Backend(format!("cannot start the writer thread: {e}")))?;
        Ok(Control { queue, shared })
    }

    /// Submits a change set; resolves once it is durable and live, with the
    /// revision it produced.
    ///
    /// A change set that arrives alone (no other submission with the
    /// writer, the writer idle) with a store that commits locally (the
    /// embedded database) is committed on the caller's thread: the
    /// hand-offs to the writer thread and back would cost two thread
    /// wake-ups (docs/benchmarks.md, churn). The caller first yields once,
    /// so change sets submitted by the other ready tasks of its runtime
    /// still go to the writer as one group; and a store whose last commit
    /// was slow (a stalled disk) gets no such commit until one is fast
    /// again, so a runtime is never held long.
    pub async fn submit(&self, change: ChangeSet) -> Result<u64, SubmitError> {
        if self.shared.sealed.load(Acquire) {
            return Err(SubmitError::HandedOver);
        }
        let (reply, answer) = oneshot::channel();
        let pending = Pending { change, reply };
        let pending = match self.commit_here(pending).await {
            Some(pending) => pending,
            None => return answer.await.map_err(|_| SubmitError::Closed)?,
        };
        let _handed = Handed::count(&self.shared.handed);
        self.queue.send(Work::Submit(pending)).await.map_err(|_| SubmitError::Closed)?;
        answer.await.map_err(|_| SubmitError::Closed)?
    }

    /// Commits `pending` on this thread if it is alone (see
    /// [`Control::submit`]); gives it back otherwise.
    async fn commit_here(&self, pending: Pending) -> Option<Pending> {
        let shared = &self.shared;
        let fast = shared.last_commit_nanos.load(Relaxed) <= SLOW_COMMIT_NANOS;
        if !(shared.store.commits_locally() && fast && self.alone()) {
            return Some(pending);
        }
        let Some(_candidate) = Candidate::claim(&shared.candidate) else {
            return Some(pending);
        };
        tokio::task::yield_now().await;
        if !self.alone() {
            return Some(pending);
        }
        // The writer thread recovers from a panic while it holds the turn,
        // so a poisoned turn is as good as a free one.
        let _turn = match shared.turn.try_lock() {
            Ok(turn) => turn,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Some(pending),
        };
        // Sealed before the writer took the turn to close the store: the
        // store may be closed already.
        if shared.sealed.load(Acquire) {
            let _ = pending.reply.send(Err(SubmitError::HandedOver));
            return None;
        }
        shared.commit_alone(pending);
        if shared.store.maintenance_due() {
            let _ = self.queue.try_send(Work::Maintain);
        }
        None
    }

    /// No other submission is with the writer: none queued, none being
    /// committed, no answer given that its submitter has not taken yet (a
    /// commit here would hold that answer back on this thread).
    fn alone(&self) -> bool {
        self.shared.handed.load(Acquire) == 0
    }

    /// Stops taking change sets and closes the store for a new process of
    /// the same data directory (`serve --takeover`). Every change set
    /// submitted before is committed and answered first; every one after
    /// is refused with [`SubmitError::HandedOver`] (retryable: nothing of
    /// it was applied). Returns whether the store was closed: false for a
    /// store shared by several instances (etcd), which needs no hand-over
    /// (submissions are then taken again).
    ///
    /// Blocking: call it from a thread that is not a runtime's.
    pub fn hand_over(&self) -> Result<bool, SubmitError> {
        self.shared.sealed.store(true, Release);
        let (reply, answer) = oneshot::channel();
        let outcome = match self.queue.blocking_send(Work::Release(reply)) {
            Ok(()) => answer
                .blocking_recv()
                .map_err(|_| SubmitError::Closed)
                .and_then(|r| r.map_err(|e| SubmitError::Store(format!("closing the store for the new process: {e}")))),
            Err(_) => Err(SubmitError::Closed),
        };
        if !matches!(outcome, Ok(true)) {
            self.shared.sealed.store(false, Release);
        }
        outcome
    }

    /// Opens the store again after [`Control::hand_over`] (the new process
    /// failed and is gone), reloads what it holds, and takes change sets
    /// again. Blocking, as `hand_over`.
    pub fn take_back(&self) -> Result<(), SubmitError> {
        let (reply, answer) = oneshot::channel();
        self.queue.blocking_send(Work::Reacquire(reply)).map_err(|_| SubmitError::Closed)?;
        answer
            .blocking_recv()
            .map_err(|_| SubmitError::Closed)?
            .map_err(|e| SubmitError::Store(format!("opening the store again: {e}")))?;
        self.shared.sealed.store(false, Release);
        Ok(())
    }

    /// The current configuration.
    pub fn config(&self) -> Arc<ConfigView> {
        self.shared.config.load_full()
    }

    /// The handle the data plane reads snapshots from.
    pub fn snapshots(&self) -> Arc<ArcSwap<Snapshot>> {
        self.shared.snapshot.clone()
    }

    /// Wakes its holder each time a new snapshot is published (a burst
    /// of them wakes it once): for background work that follows the
    /// configuration without polling [`Control::snapshots`].
    pub fn snapshot_changes(&self) -> Changes {
        self.shared.publications.follow()
    }

    /// How the store is doing, with this instance's applied revision.
    pub fn store_status(&self) -> tidegate_store::StoreStatus {
        let mut status = self.shared.store.status();
        status.latest_revision = status.latest_revision.max(self.shared.config.load().revision);
        status
    }

    /// Announces this instance to the others sharing the store.
    pub fn announce(&self, name: String, admin: String) {
        self.shared.store.announce(name, admin);
    }

    /// Asks to lead `role` across the cluster (see [`Store::campaign`]).
    pub fn campaign(&self, role: &str) {
        self.shared.store.campaign(role);
    }

    /// Whether this instance leads `role` now (always, with an embedded store).
    pub fn leads(&self, role: &str) -> bool {
        self.shared.store.leads(role)
    }

    /// Gives `role` up.
    pub fn resign(&self, role: &str) {
        self.shared.store.resign(role);
    }

    /// Requests in flight to `service` through the other instances of the
    /// cluster, as they last reported (0 with an embedded store).
    pub fn peers_in_flight(&self, service: &str) -> f64 {
        let status = self.shared.store.status();
        let me = self.shared.store.name();
        status
            .instances
            .iter()
            .filter(|i| Some(i.name.as_str()) != me.as_deref())
            .filter_map(|i| i.in_flight.get(service))
            .map(|&n| n as f64)
            .sum()
    }

    /// Leaves the cluster now (at shutdown).
    pub fn retire(&self) {
        self.shared.store.retire();
    }

    /// This instance's lease in a shared store, for a successor to adopt
    /// (see [`Store::lease`]).
    pub fn lease(&self) -> Option<i64> {
        self.shared.store.lease()
    }

    /// Goes on with a predecessor's lease (see [`Store::adopt_lease`]).
    pub fn adopt_lease(&self, id: i64) {
        self.shared.store.adopt_lease(id);
    }

    /// The writer's counters.
    pub fn metrics(&self) -> &WriterMetrics {
        &self.shared.metrics
    }
}

/// Requests in flight through this instance to each autoscaled service.
fn autoscaled_in_flight(shared: &Shared) -> std::collections::BTreeMap<String, u64> {
    let config = shared.config.load();
    let snapshot = shared.snapshot.load();
    config
        .state
        .services()
        .iter()
        .filter(|(_, spec)| spec.settings.autoscale.is_some())
        .filter_map(|(name, _)| {
            let rt = snapshot.service(name.as_str())?;
            let n: u64 = rt.selector.primaries().map(|b| b.stats.in_flight()).sum();
            Some((name.to_string(), n))
        })
        .collect()
}

#[cfg(test)]
mod tests;

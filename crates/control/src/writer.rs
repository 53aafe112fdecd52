//! The writer thread (adaptive group commit), and the steps of a commit
//! it shares with submitters that commit a lone change set themselves.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use imbl::{OrdMap, OrdSet};
use tidegate_model::{ConfigState, Delta};
use tidegate_store::{AppliedChange, Commit, CommitCost, StoreError};
use tokio::sync::mpsc;

use crate::{Pending, Reply, Shared, SubmitError, Work, WriterMetrics};

/// The most change sets one group takes, so one huge burst cannot delay
/// every answer in it without bound.
const MAX_GROUP: usize = 4_096;

/// How long a group is built again and again while other instances keep
/// committing first, before its submitters are told to try again later.
const MAX_CONFLICT_TIME: Duration = Duration::from_secs(5);

/// Change sets read per page when catching up.
const CATCH_UP_PAGE: usize = 1_000;

pub(crate) struct Writer {
    shared: Arc<Shared>,
    rx: mpsc::Receiver<Work>,
    /// The store is closed for a new process ([`Work::Release`]): change
    /// sets are refused until it is opened again.
    released: bool,
}

impl Writer {
    pub(crate) fn new(shared: Arc<Shared>, rx: mpsc::Receiver<Work>) -> Writer {
        Writer { shared, rx, released: false }
    }

    /// Runs until every handle is dropped. A panic while a group is
    /// applied (a bug) fails that group's submitters (their answers are
    /// dropped), is logged and counted, and the writer carries on from what
    /// the store holds: the configuration is reloaded and republished, so
    /// memory never runs ahead of or behind the disk.
    pub(crate) fn run(mut self) {
        loop {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.serve())) {
                Ok(()) => return,
                Err(panic) => self.shared.recover(panic),
            }
        }
    }

    /// Takes groups off the queue until every handle is dropped.
    fn serve(&mut self) {
        let mut group = Vec::new();
        while let Some(first) = self.rx.blocking_recv() {
            let mut next = Some(first);
            // A hand-over's step, taken after the change sets queued before it.
            let mut step = None;
            while let Some(work) = next.take() {
                match work {
                    Work::Submit(p) if self.released => {
                        let _ = p.reply.send(Err(SubmitError::HandedOver));
                    }
                    Work::Submit(p) => group.push(p),
                    Work::Release(_) | Work::Reacquire(_) => {
                        step = Some(work);
                        break;
                    }
                    Work::CatchUp | Work::Maintain => {}
                }
                if group.len() >= MAX_GROUP {
                    break;
                }
                next = self.rx.try_recv().ok();
            }
            // A submitter committing its lone change set here holds the
            // turn for that one commit.
            let _turn = self.shared.turn.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if !self.released {
                self.shared.catch_up();
            }
            if !group.is_empty() {
                let _ = self.shared.commit_group(std::mem::take(&mut group));
            }
            match step {
                Some(Work::Release(reply)) => {
                    let outcome = self.shared.store.release();
                    self.released = matches!(outcome, Ok(true));
                    let _ = reply.send(outcome);
                    continue;
                }
                Some(Work::Reacquire(reply)) => {
                    let outcome = self.shared.store.reacquire().and_then(|()| self.shared.reload());
                    if outcome.is_ok() {
                        self.released = false;
                    }
                    let _ = reply.send(outcome);
                    continue;
                }
                _ => {}
            }
            if self.released {
                continue;
            }
            // Housekeeping only between groups, so it delays no answer
            // (unless a change set arrives during it).
            if self.rx.is_empty() {
                self.shared.store.maintain();
            }
        }
    }
}

impl Shared {
    /// Commits one change set on the caller's thread, which holds the
    /// turn; its answer is in `pending.reply` when this returns. A panic is
    /// recovered from as the writer thread does.
    pub(crate) fn commit_alone(&self, pending: Pending) {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.catch_up();
            self.commit_group(vec![pending])
        }));
        match outcome {
            Ok(commits) => WriterMetrics::add(&self.metrics.commits_by_submitter, commits),
            Err(panic) => self.recover(panic),
        }
    }

    /// After a panic while a group was applied: counts and logs it, and
    /// makes memory match the store again; exits the process if it cannot.
    fn recover(&self, panic: Box<dyn std::any::Any + Send>) {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        WriterMetrics::add(&self.metrics.panics, 1);
        tracing::error!(panic = %what, "the configuration writer panicked; reloading from the store");
        if let Err(e) = self.reload() {
            // Without a consistent view, answering writes would lie: stop
            // the process rather than serve 503s forever.
            tracing::error!(error = %e, "cannot reload the configuration after a panic; exiting");
            std::process::exit(70);
        }
    }

    /// Makes `state` at `revision` the live configuration: the next
    /// snapshot, built from the current one and `delta`, for the data
    /// plane; the view for readers; and word to the background tasks that
    /// follow snapshots.
    fn publish(&self, state: ConfigState, delta: &Delta, revision: u64) {
        let snapshot = self.snapshot.load().next(&state, delta, revision);
        self.snapshot.store(Arc::new(snapshot));
        self.config.store(Arc::new(crate::ConfigView { revision, state }));
        self.publications.announce(revision);
    }

    /// Makes memory match the store again: after a panic, or when the
    /// history to catch up from is gone. Only what differs is rebuilt, so
    /// live statistics of everything else carry over.
    fn reload(&self) -> Result<(), StoreError> {
        let loaded = self.store.load()?;
        let old = self.config.load_full();
        let delta = difference(&old.state, &loaded.state);
        self.publish(loaded.state, &delta, loaded.revision);
        WriterMetrics::add(&self.metrics.reloads, 1);
        Ok(())
    }

    /// Applies what other instances committed, if the store holds a newer
    /// revision than this writer has applied (cluster mode).
    fn catch_up(&self) {
        while self.store.latest_revision() > self.config.load().revision {
            let started = Instant::now();
            let current = self.config.load_full();
            let page = match self.store.changes_since(current.revision, CATCH_UP_PAGE) {
                Ok(page) => page,
                Err(StoreError::Compacted { oldest }) => {
                    tracing::warn!(
                        applied = current.revision,
                        oldest,
                        "history to catch up from is gone; reloading the configuration"
                    );
                    if let Err(e) = self.reload() {
                        tracing::warn!(error = %e, "cannot reload the configuration; serving the last one");
                    }
                    return;
                }
                Err(e) => {
                    // The follower retries; until then, serve what we have.
                    tracing::warn!(error = %e, "cannot read changes made elsewhere; serving the last configuration");
                    return;
                }
            };
            if page.is_empty() {
                return;
            }
            let mut state = current.state.clone();
            let mut revision = current.revision;
            let mut delta = Delta::default();
            for a in &page {
                match state.apply(&a.change, revision) {
                    Ok((next, d)) => {
                        state = next;
                        revision = a.revision;
                        delta.merge(d);
                    }
                    Err(e) => {
                        // It applied where it was made: this instance has
                        // drifted. Take the store's configuration whole.
                        tracing::error!(revision = a.revision, error = %e, "a change made elsewhere does not apply here; reloading");
                        if let Err(e) = self.reload() {
                            tracing::warn!(error = %e, "cannot reload the configuration; serving the last one");
                        }
                        return;
                    }
                }
            }
            self.publish(state, &delta, revision);
            let m = &self.metrics;
            WriterMetrics::add(&m.remote_change_sets, page.len() as u64);
            for a in page {
                let _ = self.feed.send(Arc::new(a));
            }
            m.applied(started.elapsed().as_nanos() as u64);
        }
    }

    /// Validates, persists and publishes one group, in as many commits as
    /// the store's bound on one commit needs. When another instance
    /// committed first, catches up and builds the rest again on top.
    /// Returns the number of durable commits made.
    fn commit_group(&self, group: Vec<Pending>) -> u64 {
        let m = &self.metrics;
        let store = &self.store;
        let max = store.max_commit_cost();
        let mut queue: VecDeque<Pending> = group.into();
        let mut conflicts: u32 = 0;
        let first_try = Instant::now();
        let mut commits = 0;
        while !queue.is_empty() {
            let started = Instant::now();
            let current = self.config.load_full();
            let mut state = current.state.clone();
            let mut revision = current.revision;
            let mut delta = Delta::default();
            let mut cost = CommitCost::default();
            let mut applied: Vec<AppliedChange> = Vec::new();
            let mut waiting: Vec<Reply> = Vec::new();
            while let Some(Pending { change, reply }) = queue.pop_front() {
                let more = store.commit_cost(&change, &state);
                if !applied.is_empty() && !cost.plus(more).within(max) {
                    // The next commit takes it.
                    queue.push_front(Pending { change, reply });
                    break;
                }
                match state.apply(&change, revision) {
                    Ok((next, d)) => {
                        cost = cost.plus(more);
                        state = next;
                        revision += 1;
                        delta.merge(d);
                        applied.push(AppliedChange { revision, change });
                        waiting.push(reply);
                    }
                    Err(e) => {
                        WriterMetrics::add(&m.rejected, 1);
                        let _ = reply.send(Err(SubmitError::Rejected(e)));
                    }
                }
            }
            if applied.is_empty() {
                break;
            }
            let commit_started = Instant::now();
            let commit = Commit { base: current.revision, changes: &applied, before: &current.state, after: &state };
            let outcome = store.commit(&commit);
            let took = commit_started.elapsed().as_nanos() as u64;
            // A failed commit that took long says the disk is slow too.
            self.last_commit_nanos.store(took, Relaxed);
            match outcome {
                Ok(()) => {}
                Err(StoreError::Conflict { .. }) if first_try.elapsed() < MAX_CONFLICT_TIME => {
                    conflicts += 1;
                    WriterMetrics::add(&m.conflicts, 1);
                    for (a, reply) in applied.into_iter().zip(waiting).rev() {
                        queue.push_front(Pending { change: a.change, reply });
                    }
                    // Writers that keep colliding step aside for a random
                    // moment, growing with the collisions, so one gets through.
                    if conflicts > 1 {
                        std::thread::sleep(jitter(conflicts));
                    }
                    self.catch_up();
                    continue;
                }
                Err(e) => {
                    tracing::error!(error = %e, "configuration commit failed; nothing applied");
                    let error = || {
                        match &e {
                        StoreError::Unavailable(_) => SubmitError::Unavailable(format!(
                            "{e}; nothing was applied here (if the store received it before the failure, it will appear in a moment: read the configuration before retrying)"
                        )),
                        StoreError::Conflict { .. } => SubmitError::Unavailable(
                            "other instances kept changing the configuration first; try again".into(),
                        ),
                        StoreError::TooLarge(m) => SubmitError::TooLarge(m.clone()),
                        _ => SubmitError::Store(e.to_string()),
                    }
                    };
                    // Too large concerns this commit alone; any other
                    // failure would fail the rest the same way.
                    let failed = waiting.into_iter().chain(if matches!(e, StoreError::TooLarge(_)) {
                        Vec::new()
                    } else {
                        queue.drain(..).map(|p| p.reply).collect()
                    });
                    for reply in failed {
                        let _ = reply.send(Err(error()));
                    }
                    continue;
                }
            }
            m.committed(took);

            self.publish(state, &delta, revision);

            WriterMetrics::add(&m.commits, 1);
            commits += 1;
            WriterMetrics::add(&m.change_sets, applied.len() as u64);
            let ops: usize = applied.iter().map(|a| a.change.ops.len()).sum();
            WriterMetrics::add(&m.ops, ops as u64);
            for (a, reply) in applied.into_iter().zip(waiting) {
                let _ = reply.send(Ok(a.revision));
                // No watcher is fine: send only fails when nobody listens.
                let _ = self.feed.send(Arc::new(a));
            }
            m.applied(started.elapsed().as_nanos() as u64);
        }
        commits
    }
}

/// A random pause of up to 250 µs per collision so far (at most 2 ms).
fn jitter(conflicts: u32) -> Duration {
    let span = 250 * u64::from(conflicts.min(8));
    let noise = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    Duration::from_micros(u64::from(noise) % span)
}

/// What differs between two configurations, as a delta to rebuild.
fn difference(old: &ConfigState, new: &ConfigState) -> Delta {
    Delta {
        services: changed(old.services(), new.services()),
        routes: changed(old.routes(), new.routes()),
        certificates: changed(old.certificates(), new.certificates()),
        rules: changed(old.rules(), new.rules()),
        listeners: changed(old.listeners(), new.listeners()),
    }
}

/// The keys whose values differ between `old` and `new`, or that only one has.
fn changed<K: Ord + Clone, V: PartialEq>(old: &OrdMap<K, V>, new: &OrdMap<K, V>) -> OrdSet<K> {
    let gone_or_changed = old.iter().filter(|(k, v)| new.get(*k) != Some(*v)).map(|(k, _)| k.clone());
    let added = new.keys().filter(|k| !old.contains_key(*k)).cloned();
    gone_or_changed.chain(added).collect()
}

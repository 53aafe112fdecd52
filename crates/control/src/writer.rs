//! The writer thread: adaptive group commit.

use std::sync::Arc;
use std::time::Instant;

use tidegate_model::Delta;
use tidegate_store::AppliedChange;
use tokio::sync::mpsc;

use crate::{Pending, Reply, Shared, SubmitError, WriterMetrics};

/// The most change sets one group takes, so one huge burst cannot delay
/// every answer in it without bound.
const MAX_GROUP: usize = 4_096;

pub(crate) struct Writer {
    shared: Arc<Shared>,
    rx: mpsc::Receiver<Pending>,
}

impl Writer {
    pub(crate) fn new(shared: Arc<Shared>, rx: mpsc::Receiver<Pending>) -> Writer {
        Writer { shared, rx }
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
                Err(panic) => {
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    WriterMetrics::add(&self.shared.metrics.panics, 1);
                    tracing::error!(panic = %what, "the configuration writer panicked; reloading from the store");
                    if let Err(e) = self.reload() {
                        // Without a consistent view, answering writes would
                        // lie: stop the process rather than serve 503s forever.
                        tracing::error!(error = %e, "cannot reload the configuration after a panic; exiting");
                        std::process::exit(70);
                    }
                }
            }
        }
    }

    /// Makes memory match the store again (after a panic).
    fn reload(&self) -> Result<(), tidegate_store::StoreError> {
        let loaded = self.shared.store.load()?;
        // Rebuild every service and route the old or the new view has,
        // from the current snapshot, so live statistics carry over.
        let old = self.shared.config.load_full();
        let mut all = Delta::default();
        for state in [&old.state, &loaded.state] {
            all.services.extend(state.services().keys().cloned());
            all.routes.extend(state.routes().keys().cloned());
        }
        let snapshot = self.shared.snapshot.load().next(&loaded.state, &all, loaded.revision);
        self.shared.snapshot.store(Arc::new(snapshot));
        self.shared.config.store(Arc::new(crate::ConfigView { revision: loaded.revision, state: loaded.state }));
        Ok(())
    }

    /// Takes groups off the queue until every handle is dropped.
    fn serve(&mut self) {
        let mut group = Vec::new();
        while let Some(first) = self.rx.blocking_recv() {
            group.push(first);
            while group.len() < MAX_GROUP {
                match self.rx.try_recv() {
                    Ok(p) => group.push(p),
                    Err(_) => break,
                }
            }
            self.commit_group(std::mem::take(&mut group));
        }
    }

    fn commit_group(&self, group: Vec<Pending>) {
        let started = Instant::now();
        let m = &self.shared.metrics;
        let current = self.shared.config.load_full();
        let mut state = current.state.clone();
        let mut revision = current.revision;
        let mut delta = Delta::default();
        let mut applied: Vec<AppliedChange> = Vec::with_capacity(group.len());
        let mut replies: Vec<Reply> = Vec::with_capacity(group.len());
        for Pending { change, reply } in group {
            match state.apply(&change, revision) {
                Ok((next, d)) => {
                    state = next;
                    revision += 1;
                    delta.merge(d);
                    applied.push(AppliedChange { revision, change });
                    replies.push(reply);
                }
                Err(e) => {
                    WriterMetrics::add(&m.rejected, 1);
                    let _ = reply.send(Err(SubmitError::Rejected(e)));
                }
            }
        }
        if applied.is_empty() {
            return;
        }
        let commit_started = Instant::now();
        if let Err(e) = self.shared.store.commit(&applied) {
            tracing::error!(error = %e, "configuration commit failed; nothing applied");
            for reply in replies {
                let _ = reply.send(Err(SubmitError::Store(e.to_string())));
            }
            return;
        }
        WriterMetrics::add(&m.commit_nanos, commit_started.elapsed().as_nanos() as u64);

        let snapshot = self.shared.snapshot.load().next(&state, &delta, revision);
        self.shared.snapshot.store(Arc::new(snapshot));
        self.shared.config.store(Arc::new(crate::ConfigView { revision, state }));

        WriterMetrics::add(&m.commits, 1);
        WriterMetrics::add(&m.change_sets, applied.len() as u64);
        let ops: usize = applied.iter().map(|a| a.change.ops.len()).sum();
        WriterMetrics::add(&m.ops, ops as u64);
        for (a, reply) in applied.into_iter().zip(replies) {
            let _ = reply.send(Ok(a.revision));
            // No watcher is fine: send only fails when nobody listens.
            let _ = self.shared.feed.send(Arc::new(a));
        }
        WriterMetrics::add(&m.apply_nanos, started.elapsed().as_nanos() as u64);
    }
}

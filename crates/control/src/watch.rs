//! The watch feed: applied change sets from a revision on, replayed from the
//! store's log and then followed live.
//!
//! Every watcher is bounded:
//!
//! - its events are encoded as they are queued, and the queue between the
//!   task that reads the store (or the live feed) and the connection holds
//!   at most [`WatchLimits::queue_bytes`] of them (one event larger than
//!   that still passes, alone);
//! - history is read from the store in pages sized to that budget, and only
//!   [`WatchLimits::max_replays`] watchers replay history at once (the
//!   others are refused with [`WatchError::Busy`]);
//! - a watcher whose queue is full and whose connection takes nothing for
//!   [`WatchLimits::stall`], or that falls behind the live feed, is cut:
//!   what it had queued is dropped and its stream ends with
//!   [`WatchError::Lagged`], naming the revision to watch again from (the
//!   last one its connection took).

use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tidegate_store::{AppliedChange, StoreError};
use tokio::sync::{broadcast, Notify, OwnedSemaphorePermit, Semaphore};

use crate::Control;

/// Why a watch ended or could not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WatchError {
    /// The requested revision is older than the kept history.
    #[error("history before revision {oldest} is no longer kept; read /v1/config and watch from its revision")]
    Compacted {
        /// The oldest revision that can be replayed.
        oldest: u64,
    },
    /// The watcher fell behind and was cut; what it had queued was dropped.
    #[error(
        "the watcher fell behind ({cause}) and was cut; watch again from revision {resume_from} \
         (?from={resume_from}), or read /v1/config"
    )]
    Lagged {
        /// The last revision the connection took: watch again from it.
        resume_from: u64,
        /// What happened.
        cause: String,
    },
    /// Too many watchers replay history at the moment.
    #[error("{replays} watchers already replay history, the most at once; try again in a moment")]
    Busy {
        /// The limit.
        replays: usize,
    },
    /// The store failed.
    #[error("{0}")]
    Store(String),
}

/// Bounds on every watcher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchLimits {
    /// Encoded events one watcher may have waiting for its connection,
    /// bytes.
    pub queue_bytes: usize,
    /// How many watchers may replay history at once.
    pub max_replays: usize,
    /// How long a watcher's full queue may wait for its connection to take
    /// anything before the watcher is cut.
    pub stall: Duration,
}

impl Default for WatchLimits {
    fn default() -> Self {
        WatchLimits { queue_bytes: 8 * 1024 * 1024, max_replays: 8, stall: Duration::from_secs(30) }
    }
}

/// What the watchers hold, for metrics.
#[derive(Debug, Default)]
pub struct WatchStats {
    /// Open watch streams.
    pub streams: AtomicU64,
    /// Of those, the ones replaying history now.
    pub replays: AtomicU64,
    /// Encoded events queued for watchers' connections, bytes (all
    /// watchers).
    pub queued_bytes: AtomicU64,
    /// Watchers cut for falling behind.
    pub cut: AtomicU64,
    /// Watches refused because [`WatchLimits::max_replays`] watchers were
    /// replaying.
    pub refused: AtomicU64,
}

/// The watchers' limits and shared accounting; one per admin API.
#[derive(Debug, Clone)]
pub struct Watchers {
    limits: WatchLimits,
    replays: Arc<Semaphore>,
    stats: Arc<WatchStats>,
}

impl Watchers {
    /// Watchers bounded by `limits` (a zero budget or replay count is
    /// taken as 1).
    pub fn new(limits: WatchLimits) -> Watchers {
        let limits = WatchLimits {
            queue_bytes: limits.queue_bytes.max(1),
            max_replays: limits.max_replays.clamp(1, Semaphore::MAX_PERMITS),
            stall: limits.stall,
        };
        Watchers { limits, replays: Arc::new(Semaphore::new(limits.max_replays)), stats: Arc::default() }
    }

    /// The limits in force.
    pub fn limits(&self) -> WatchLimits {
        self.limits
    }

    /// What the watchers hold now.
    pub fn stats(&self) -> &WatchStats {
        &self.stats
    }
}

impl Default for Watchers {
    fn default() -> Self {
        Watchers::new(WatchLimits::default())
    }
}

/// One item of a watch stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchItem {
    /// An applied change set, as the encoder wrote it.
    Event(String),
    /// The last item: why the stream ends.
    End(WatchError),
}

/// The first page of history read for a watcher, in change sets; later
/// pages are sized from the bytes the earlier ones encoded to.
const FIRST_PAGE: usize = 4;
/// The largest page read.
const MAX_PAGE: usize = 1_000;

impl Control {
    /// Streams every change set with a revision above `after`, then live
    /// ones, in revision order, each encoded by `encode` as it is queued.
    ///
    /// Refused with [`WatchError::Busy`] when history is to be replayed
    /// (`after` is below the current revision) and the most watchers
    /// allowed already replay. The stream ends with an
    /// [`WatchItem::End`] if the watcher falls behind or the store fails;
    /// the work behind it stops when the stream is dropped.
    pub fn watch<E>(&self, watchers: &Watchers, after: u64, encode: E) -> Result<WatchStream, WatchError>
    where
        E: FnMut(&AppliedChange) -> String + Send + 'static,
    {
        let replay = if after < self.config().revision {
            match watchers.replays.clone().try_acquire_owned() {
                Ok(permit) => Some(Replay::start(permit, watchers.stats.clone())),
                Err(_) => {
                    watchers.stats.refused.fetch_add(1, Relaxed);
                    return Err(WatchError::Busy { replays: watchers.limits.max_replays });
                }
            }
        } else {
            None
        };
        let queue = Arc::new(Queue::new(watchers.limits, watchers.stats.clone(), after));
        // Subscribe before reading history, so nothing falls in between.
        let live = self.shared.feed.subscribe();
        let store = self.shared.store.clone();
        let producer = Producer { queue: queue.clone(), encode, last: after };
        tokio::spawn(producer.run(store, live, replay));
        Ok(WatchStream { queue })
    }
}

/// A replay in progress: holds one of the replay permits and counts in
/// [`WatchStats::replays`] until dropped.
struct Replay {
    _permit: OwnedSemaphorePermit,
    stats: Arc<WatchStats>,
}

impl Replay {
    fn start(permit: OwnedSemaphorePermit, stats: Arc<WatchStats>) -> Replay {
        stats.replays.fetch_add(1, Relaxed);
        Replay { _permit: permit, stats }
    }
}

impl Drop for Replay {
    fn drop(&mut self) {
        self.stats.replays.fetch_sub(1, Relaxed);
    }
}

/// Why the producer stops.
enum Stop {
    /// The stream was dropped.
    Gone,
    /// The stream ends with this.
    End(WatchError),
}

/// The task that reads history and the live feed into a watcher's queue.
struct Producer<E> {
    queue: Arc<Queue>,
    encode: E,
    /// The last revision queued.
    last: u64,
}

impl<E: FnMut(&AppliedChange) -> String> Producer<E> {
    async fn run(
        mut self,
        store: Arc<dyn tidegate_store::Store>,
        live: broadcast::Receiver<Arc<AppliedChange>>,
        replay: Option<Replay>,
    ) {
        let outcome = match self.replay(store, replay).await {
            Ok(()) => self.follow(live).await,
            Err(stop) => stop,
        };
        match outcome {
            Stop::End(e) => self.queue.end(e),
            Stop::Gone => self.queue.finish(),
        }
    }

    /// Queues the history after `self.last`, in pages sized to the budget.
    async fn replay(&mut self, store: Arc<dyn tidegate_store::Store>, replay: Option<Replay>) -> Result<(), Stop> {
        let Some(_replay) = replay else { return Ok(()) };
        let budget = self.queue.limits.queue_bytes;
        let mut page_len = FIRST_PAGE;
        loop {
            let (store, after) = (store.clone(), self.last);
            let page = match tokio::task::spawn_blocking(move || store.changes_since(after, page_len)).await {
                Ok(Ok(p)) => p,
                Ok(Err(StoreError::Compacted { oldest })) => return Err(Stop::End(WatchError::Compacted { oldest })),
                Ok(Err(e)) => return Err(Stop::End(WatchError::Store(e.to_string()))),
                Err(e) => return Err(Stop::End(WatchError::Store(e.to_string()))),
            };
            let full = page.len() == page_len;
            let mut bytes = 0usize;
            let mut count = 0usize;
            for change in page {
                let text = (self.encode)(&change);
                bytes = bytes.saturating_add(text.len());
                count += 1;
                self.push(change.revision, text).await?;
            }
            if !full {
                return Ok(());
            }
            page_len = next_page(budget, bytes, count);
        }
    }

    /// Queues live change sets until the stream is dropped or falls behind.
    async fn follow(&mut self, mut live: broadcast::Receiver<Arc<AppliedChange>>) -> Stop {
        loop {
            let item = tokio::select! {
                item = live.recv() => item,
                () = self.queue.gone.notified() => return Stop::Gone,
            };
            match item {
                Ok(change) if change.revision <= self.last => {}
                Ok(change) => {
                    let text = (self.encode)(&change);
                    if let Err(stop) = self.push(change.revision, text).await {
                        return stop;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    return Stop::End(self.queue.cut(format!("{n} change sets behind the live feed")));
                }
                Err(broadcast::error::RecvError::Closed) => return Stop::Gone,
            }
        }
    }

    /// Queues one event, waiting for room; cuts the watcher if its
    /// connection takes nothing for the stall timeout meanwhile.
    async fn push(&mut self, revision: u64, text: String) -> Result<(), Stop> {
        let queue = &self.queue;
        let mut text = Some(text);
        loop {
            // Registered before the check, so a wake-up in between counts.
            let room = queue.room.notified();
            match queue.try_push(revision, &mut text) {
                Pushed::Yes => {
                    self.last = revision;
                    return Ok(());
                }
                Pushed::Gone => return Err(Stop::Gone),
                Pushed::Full => {}
            }
            if tokio::time::timeout(queue.limits.stall, room).await.is_err() {
                let waiting = queue.state().bytes;
                let cause = format!(
                    "its connection took nothing for {} s with {waiting} bytes of events waiting",
                    queue.limits.stall.as_secs_f64()
                );
                return Err(Stop::End(queue.cut(cause)));
            }
        }
    }
}

/// The size of the next page of history: about one budget's worth of
/// events at the mean size of the last page.
fn next_page(budget: usize, bytes: usize, count: usize) -> usize {
    let mean = (bytes / count.max(1)).max(1);
    (budget / mean).clamp(1, MAX_PAGE)
}

enum Pushed {
    Yes,
    Full,
    Gone,
}

/// The queue between a watcher's producer and its connection.
struct Queue {
    limits: WatchLimits,
    stats: Arc<WatchStats>,
    state: Mutex<State>,
    /// The connection took something (or went away).
    room: Notify,
    /// Something was queued, or the stream ended.
    ready: Notify,
    /// The stream was dropped.
    gone: Notify,
}

struct State {
    events: VecDeque<(u64, String)>,
    bytes: usize,
    /// The last item, once the producer ended the stream.
    end: Option<WatchError>,
    /// The producer stopped: nothing more will come.
    done: bool,
    /// The stream was dropped.
    gone: bool,
    /// The last revision the connection took.
    taken: u64,
}

impl Queue {
    fn new(limits: WatchLimits, stats: Arc<WatchStats>, after: u64) -> Queue {
        stats.streams.fetch_add(1, Relaxed);
        Queue {
            limits,
            stats,
            state: Mutex::new(State {
                events: VecDeque::new(),
                bytes: 0,
                end: None,
                done: false,
                gone: false,
                taken: after,
            }),
            room: Notify::new(),
            ready: Notify::new(),
            gone: Notify::new(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `text` if the budget has room for it (an event alone always
    /// fits).
    fn try_push(&self, revision: u64, text: &mut Option<String>) -> Pushed {
        let mut s = self.state();
        if s.gone {
            return Pushed::Gone;
        }
        let len = text.as_ref().map_or(0, String::len);
        if !s.events.is_empty() && s.bytes.saturating_add(len) > self.limits.queue_bytes {
            return Pushed::Full;
        }
        if let Some(text) = text.take() {
            s.events.push_back((revision, text));
            s.bytes += len;
            self.stats.queued_bytes.fetch_add(len as u64, Relaxed);
        }
        drop(s);
        self.ready.notify_one();
        Pushed::Yes
    }

    /// Drops what is queued and names the revision to resume from.
    fn cut(&self, cause: String) -> WatchError {
        let mut s = self.state();
        self.stats.queued_bytes.fetch_sub(s.bytes as u64, Relaxed);
        s.events.clear();
        s.bytes = 0;
        self.stats.cut.fetch_add(1, Relaxed);
        WatchError::Lagged { resume_from: s.taken, cause }
    }

    /// The producer stopped; `e` is the stream's last item.
    fn end(&self, e: WatchError) {
        let mut s = self.state();
        s.end = Some(e);
        s.done = true;
        drop(s);
        self.ready.notify_one();
    }

    /// The producer stopped without a last item (the feed closed).
    fn finish(&self) {
        self.state().done = true;
        self.ready.notify_one();
    }
}

/// A watcher's stream of events; see [`Control::watch`].
pub struct WatchStream {
    queue: Arc<Queue>,
}

impl WatchStream {
    /// The next item; `None` once the stream has ended.
    pub async fn next(&mut self) -> Option<WatchItem> {
        let queue = &self.queue;
        loop {
            let ready = queue.ready.notified();
            {
                let mut s = queue.state();
                if let Some((revision, text)) = s.events.pop_front() {
                    s.bytes -= text.len();
                    s.taken = revision;
                    queue.stats.queued_bytes.fetch_sub(text.len() as u64, Relaxed);
                    drop(s);
                    queue.room.notify_one();
                    return Some(WatchItem::Event(text));
                }
                if let Some(e) = s.end.take() {
                    return Some(WatchItem::End(e));
                }
                if s.done {
                    return None;
                }
            }
            ready.await;
        }
    }

    /// Encoded events waiting in this stream's queue, bytes.
    pub fn queued_bytes(&self) -> usize {
        self.queue.state().bytes
    }
}

impl Drop for WatchStream {
    fn drop(&mut self) {
        let queue = &self.queue;
        let mut s = queue.state();
        s.gone = true;
        queue.stats.queued_bytes.fetch_sub(s.bytes as u64, Relaxed);
        s.events.clear();
        s.bytes = 0;
        drop(s);
        queue.stats.streams.fetch_sub(1, Relaxed);
        queue.room.notify_one();
        queue.gone.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_follow_the_mean_event_size() {
        assert_eq!(next_page(8 << 20, 16 * 100, 16), MAX_PAGE);
        assert_eq!(next_page(8 << 20, 16 << 20, 16), 8);
        assert_eq!(next_page(8 << 20, 16 * (64 << 20), 16), 1);
        assert_eq!(next_page(100, 0, 0), 100);
    }
}

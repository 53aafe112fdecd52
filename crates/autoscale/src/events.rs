//! Autoscaling events: every decision and action, with why and the signals.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use serde::Serialize;
use tokio::sync::broadcast;

use crate::decide::Decision;

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// The decision asked for more instances.
    ScaleOut,
    /// The decision asked for one fewer.
    ScaleIn,
    /// An instance was started (not ready yet).
    Started,
    /// Its readiness probe passed: it now takes traffic.
    Ready,
    /// It failed to start or to become ready; it was stopped.
    StartFailed,
    /// It takes no new requests; in-flight ones finish.
    Draining,
    /// Load came back: a draining instance serves again.
    Restored,
    /// It was stopped after draining.
    Stopped,
    /// It exited or stopped answering on its own.
    Died,
    /// An instance from before a restart was taken over.
    Adopted,
    /// This instance leads the service's scaling now (cluster mode).
    Leader,
    /// Another instance leads it now; this one stopped scaling it.
    Follower,
}

/// One event.
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
pub struct Event {
    /// Increasing number, for `GET /v1/events?after=N`.
    pub seq: u64,
    /// Wall-clock time, ms since the Unix epoch.
    pub at_unix_ms: u64,
    /// The service.
    pub service: String,
    /// What happened.
    pub kind: EventKind,
    /// The instance concerned, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// Human-readable detail.
    pub detail: String,
    /// The decision and its signal values, for scaling decisions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decision: Option<Decision>,
}

/// The event log: the last events in memory, a live feed, and counters.
pub struct Events {
    recent: Mutex<VecDeque<Event>>,
    next: AtomicU64,
    feed: broadcast::Sender<Event>,
    counts: Mutex<std::collections::BTreeMap<(String, &'static str), u64>>,
}

/// How many events are kept for `GET /v1/events`.
const KEEP: usize = 1_000;

impl Default for Events {
    fn default() -> Self {
        Events {
            recent: Mutex::new(VecDeque::new()),
            next: AtomicU64::new(1),
            feed: broadcast::channel(1_024).0,
            counts: Mutex::new(Default::default()),
        }
    }
}

fn kind_name(k: EventKind) -> &'static str {
    match k {
        EventKind::ScaleOut => "scale_out",
        EventKind::ScaleIn => "scale_in",
        EventKind::Started => "started",
        EventKind::Ready => "ready",
        EventKind::StartFailed => "start_failed",
        EventKind::Draining => "draining",
        EventKind::Restored => "restored",
        EventKind::Stopped => "stopped",
        EventKind::Died => "died",
        EventKind::Adopted => "adopted",
        EventKind::Leader => "leader",
        EventKind::Follower => "follower",
    }
}

impl Events {
    /// Records an event (and logs it).
    pub fn record(
        &self,
        service: &str,
        kind: EventKind,
        instance: Option<&str>,
        detail: String,
        decision: Option<Decision>,
    ) {
        let at_unix_ms =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let event = Event {
            seq: self.next.fetch_add(1, Relaxed),
            at_unix_ms,
            service: service.to_string(),
            kind,
            instance: instance.map(str::to_string),
            detail,
            decision,
        };
        tracing::info!(service, kind = kind_name(kind), instance, detail = %event.detail, "autoscale");
        if let Ok(mut c) = self.counts.lock() {
            *c.entry((service.to_string(), kind_name(kind))).or_default() += 1;
        }
        if let Ok(mut r) = self.recent.lock() {
            if r.len() == KEEP {
                r.pop_front();
            }
            r.push_back(event.clone());
        }
        let _ = self.feed.send(event);
    }

    /// Events with `seq` above `after`, oldest first.
    pub fn since(&self, after: u64) -> Vec<Event> {
        self.recent.lock().map(|r| r.iter().filter(|e| e.seq > after).cloned().collect()).unwrap_or_default()
    }

    /// Live events.
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.feed.subscribe()
    }

    /// How many events of each kind each service had, by (service, kind).
    pub fn counts(&self) -> Vec<((String, &'static str), u64)> {
        self.counts.lock().map(|c| c.iter().map(|(k, n)| (k.clone(), *n)).collect()).unwrap_or_default()
    }
}

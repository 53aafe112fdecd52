//! The event log: every autoscaling decision and action, with why and the
//! signals, and what happened to the managed certificates (their orders).

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
    /// A managed certificate's order was placed with its CA.
    CertificateOrdering,
    /// A managed certificate was issued; it is served from the next
    /// handshake.
    CertificateIssued,
    /// A managed certificate's order failed (the one issued before, if
    /// any, is still served).
    CertificateFailed,
    /// The CA's renewal information (RFC 9773) brought a managed
    /// certificate's renewal forward.
    CertificateRenewalMoved,
}

/// One event.
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
pub struct Event {
    /// Increasing number, for `GET /v1/events?after=N`.
    pub seq: u64,
    /// Wall-clock time, ms since the Unix epoch.
    pub at_unix_ms: u64,
    /// The service (absent for a certificate's event).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub service: String,
    /// The managed certificate, for a certificate's event.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub certificate: Option<String>,
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
    /// How many times the same event happened again without being
    /// recorded (while starts backed off after failures) before this one;
    /// absent when none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub repeats: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The event log: the last events in memory, a live feed, and counters.
pub struct Events {
    recent: Mutex<VecDeque<Event>>,
    next: AtomicU64,
    feed: broadcast::Sender<Event>,
    counts: Mutex<std::collections::BTreeMap<(String, &'static str), u64>>,
}

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
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
        EventKind::CertificateOrdering => "certificate_ordering",
        EventKind::CertificateIssued => "certificate_issued",
        EventKind::CertificateFailed => "certificate_failed",
        EventKind::CertificateRenewalMoved => "certificate_renewal_moved",
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
        self.record_repeated(service, kind, instance, detail, decision, 0);
    }

    /// Records an event that stands for `repeats` more of the same that
    /// were not recorded (see [`Coalescer`]).
    pub fn record_repeated(
        &self,
        service: &str,
        kind: EventKind,
        instance: Option<&str>,
        detail: String,
        decision: Option<Decision>,
        repeats: u64,
    ) {
        let event = Event {
            seq: self.next.fetch_add(1, Relaxed),
            at_unix_ms: now_unix_ms(),
            service: service.to_string(),
            certificate: None,
            kind,
            instance: instance.map(str::to_string),
            detail,
            decision,
            repeats,
        };
        tracing::info!(service, kind = kind_name(kind), instance, detail = %event.detail, repeats, "autoscale");
        if let Ok(mut c) = self.counts.lock() {
            *c.entry((service.to_string(), kind_name(kind))).or_default() += 1;
        }
        self.keep(event);
    }

    /// Records an event of the managed certificate `name` (the ACME
    /// manager's; logged by the manager itself).
    pub fn record_certificate(&self, name: &str, kind: EventKind, detail: String) {
        let event = Event {
            seq: self.next.fetch_add(1, Relaxed),
            at_unix_ms: now_unix_ms(),
            service: String::new(),
            certificate: Some(name.to_string()),
            kind,
            instance: None,
            detail,
            decision: None,
            repeats: 0,
        };
        self.keep(event);
    }

    fn keep(&self, event: Event) {
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

/// Coalesces an event that repeats while nothing can change (a scaling
/// decision taken every second while starts back off after failures): the
/// first is recorded, the identical ones after it are only counted, and
/// the count goes with the next one recorded.
#[derive(Debug, Default)]
pub struct Coalescer {
    held: Option<Held>,
}

#[derive(Debug)]
struct Held {
    detail: String,
    repeats: u64,
}

/// What to record for an event noted with [`Coalescer::note`].
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Noted {
    /// An earlier, different event that repeated unrecorded: its detail
    /// and how often, to record as a summary first.
    pub summary: Option<(String, u64)>,
    /// Record this event, standing for this many unrecorded repeats
    /// before it; `None`: it is one of them (counted, not recorded).
    pub record: Option<u64>,
}

impl Coalescer {
    /// Notes an event with `detail`. While `quiet`, an event equal to the
    /// last one recorded is counted instead of recorded.
    pub fn note(&mut self, detail: &str, quiet: bool) -> Noted {
        if let Some(h) = self.held.as_mut().filter(|h| h.detail == detail) {
            if quiet {
                h.repeats += 1;
                return Noted { summary: None, record: None };
            }
            let repeats = h.repeats;
            self.held = None;
            return Noted { summary: None, record: Some(repeats) };
        }
        let summary = self.settle();
        self.held = quiet.then(|| Held { detail: detail.to_string(), repeats: 0 });
        Noted { summary, record: Some(0) }
    }

    /// The event stopped happening: the repeats not recorded yet, if any,
    /// with the event's detail, to record as a summary.
    pub fn settle(&mut self) -> Option<(String, u64)> {
        self.held.take().filter(|h| h.repeats > 0).map(|h| (h.detail, h.repeats))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeats_while_quiet_are_counted_and_go_with_the_next_record() {
        let mut c = Coalescer::default();
        assert_eq!(c.note("1 -> 2", false), Noted { summary: None, record: Some(0) });
        // Back-off: the first is recorded, the next three only counted.
        assert_eq!(c.note("1 -> 2", true), Noted { summary: None, record: Some(0) });
        for _ in 0..3 {
            assert_eq!(c.note("1 -> 2", true), Noted { summary: None, record: None });
        }
        // Back-off over: one event carrying the count.
        assert_eq!(c.note("1 -> 2", false), Noted { summary: None, record: Some(3) });
        assert_eq!(c.note("1 -> 2", false), Noted { summary: None, record: Some(0) });
    }

    #[test]
    fn a_different_event_or_the_end_of_it_summarizes_the_held_repeats() {
        let mut c = Coalescer::default();
        c.note("1 -> 2", true);
        c.note("1 -> 2", true);
        c.note("1 -> 2", true);
        assert_eq!(c.note("1 -> 3", true), Noted { summary: Some(("1 -> 2".into(), 2)), record: Some(0) });
        assert_eq!(c.note("1 -> 3", true).record, None);
        assert_eq!(c.settle(), Some(("1 -> 3".into(), 1)));
        assert_eq!(c.settle(), None);
        c.note("1 -> 2", true);
        assert_eq!(c.settle(), None, "nothing repeated: nothing to summarize");
    }

    #[test]
    fn a_recorded_event_carries_its_repeats() {
        let events = Events::default();
        events.record_repeated("web", EventKind::ScaleOut, None, "1 -> 2".into(), None, 4);
        let e = &events.since(0)[0];
        assert_eq!(e.repeats, 4);
        assert_eq!(serde_json::to_value(e).unwrap()["repeats"], 4);
        events.record("web", EventKind::ScaleOut, None, "1 -> 2".into(), None);
        assert!(serde_json::to_value(&events.since(1)[0]).unwrap().get("repeats").is_none());
    }
}

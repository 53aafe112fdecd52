//! The spans the proxy records: what happened, when, with its attributes
//! (OpenTelemetry's semantic conventions for HTTP where they apply, and
//! `tidegate.*` for the proxy's own facts).

use std::borrow::Cow;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::context::{SpanId, TraceId};

/// What a span stands for, in OpenTelemetry's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A request the proxy served (its span for the whole request).
    Server,
    /// A request the proxy sent: one attempt to a backend.
    Client,
    /// Work inside the proxy (waiting in a service's queue).
    Internal,
}

/// An attribute's value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Text (a constant borrowed, anything else owned).
    Str(Cow<'static, str>),
    /// A whole number.
    Int(i64),
    /// A flag.
    Bool(bool),
}

impl Value {
    /// A copy of `s`.
    pub fn text(s: &str) -> Value {
        Value::Str(Cow::Owned(s.to_owned()))
    }
}

impl From<&'static str> for Value {
    fn from(s: &'static str) -> Value {
        Value::Str(Cow::Borrowed(s))
    }
}
impl From<String> for Value {
    fn from(s: String) -> Value {
        Value::Str(Cow::Owned(s))
    }
}
impl From<i64> for Value {
    fn from(n: i64) -> Value {
        Value::Int(n)
    }
}
impl From<u16> for Value {
    fn from(n: u16) -> Value {
        Value::Int(i64::from(n))
    }
}
impl From<u32> for Value {
    fn from(n: u32) -> Value {
        Value::Int(i64::from(n))
    }
}
impl From<bool> for Value {
    fn from(b: bool) -> Value {
        Value::Bool(b)
    }
}

/// One finished span.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// The trace it belongs to.
    pub trace_id: TraceId,
    /// Its own id.
    pub span_id: SpanId,
    /// Its parent (the caller's span for a request; the request's span for
    /// an attempt or a wait).
    pub parent_id: Option<SpanId>,
    /// The caller's `tracestate`, on the request's span.
    pub trace_state: String,
    /// Its name (`GET route`, an attempt's method, `queue`).
    pub name: String,
    /// What it stands for.
    pub kind: Kind,
    /// When it started and ended, in nanoseconds since the Unix epoch.
    pub start_unix_ns: u64,
    /// See `start_unix_ns`.
    pub end_unix_ns: u64,
    /// Its attributes.
    pub attributes: Vec<(&'static str, Value)>,
    /// Set when it failed: the reason (the span's status is then an error).
    pub error: Option<String>,
}

/// Turns the monotonic clock's instants into wall-clock times, from one
/// reading of both clocks (each span's times are then consistent with
/// each other, whatever the wall clock does meanwhile).
#[derive(Debug, Clone, Copy)]
pub struct WallClock {
    instant: Instant,
    unix_ns: u64,
}

impl WallClock {
    /// Both clocks, now.
    pub fn now() -> WallClock {
        let unix = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
        WallClock { instant: Instant::now(), unix_ns: u64::try_from(unix.as_nanos()).unwrap_or(u64::MAX) }
    }

    /// `at` in nanoseconds since the Unix epoch.
    pub fn unix_ns(&self, at: Instant) -> u64 {
        match at.checked_duration_since(self.instant) {
            Some(after) => self.unix_ns.saturating_add(nanos(after)),
            None => self.unix_ns.saturating_sub(nanos(self.instant.duration_since(at))),
        }
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instants_become_unix_times_on_both_sides_of_the_reading() {
        let clock = WallClock { instant: Instant::now(), unix_ns: 1_000_000_000_000 };
        let later = clock.instant + Duration::from_millis(5);
        assert_eq!(clock.unix_ns(later), 1_000_005_000_000);
        let earlier = clock.instant.checked_sub(Duration::from_millis(3)).expect("an earlier instant");
        assert_eq!(clock.unix_ns(earlier), 999_997_000_000);
    }
}

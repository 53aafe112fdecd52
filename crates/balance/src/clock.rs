//! A cheap monotonic clock shared by the data plane and background tasks.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// An hour before the first reading (when the system's clock goes back
/// that far): times a predecessor handed over (an ejection that ended a
/// minute ago, a slow start begun before) stay representable in this
/// process's clock, which never reads below zero.
const HEADROOM: Duration = Duration::from_secs(3600);

fn origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(|| {
        let now = Instant::now();
        now.checked_sub(HEADROOM).unwrap_or(now)
    })
}

/// Milliseconds since the clock's origin, an hour before the first call
/// in this process (monotonic).
pub fn now_ms() -> u64 {
    ms_at(Instant::now())
}

/// Nanoseconds since the clock's origin (monotonic).
pub fn now_ns() -> u64 {
    ns_at(Instant::now())
}

/// [`now_ns`] for an instant the caller already read: one clock read can
/// serve several uses on the request path.
pub fn ns_at(at: Instant) -> u64 {
    at.saturating_duration_since(origin()).as_nanos() as u64
}

/// [`now_ms`] for an instant the caller already read.
pub fn ms_at(at: Instant) -> u64 {
    at.saturating_duration_since(origin()).as_millis() as u64
}

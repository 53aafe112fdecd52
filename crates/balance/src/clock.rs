//! A cheap monotonic clock shared by the data plane and background tasks.

use std::sync::OnceLock;
use std::time::Instant;

fn origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

/// Milliseconds since the first call in this process (monotonic).
pub fn now_ms() -> u64 {
    ms_at(Instant::now())
}

/// Nanoseconds since the first call in this process (monotonic).
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

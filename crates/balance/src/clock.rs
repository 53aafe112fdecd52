//! A cheap monotonic clock shared by the data plane and background tasks.

use std::sync::OnceLock;
use std::time::Instant;

fn origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

/// Milliseconds since the first call in this process (monotonic).
pub fn now_ms() -> u64 {
    origin().elapsed().as_millis() as u64
}

/// Nanoseconds since the first call in this process (monotonic).
pub fn now_ns() -> u64 {
    origin().elapsed().as_nanos() as u64
}

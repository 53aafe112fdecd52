//! Tidegate's metrics.
//!
//! The request path writes plain atomics: counters, and [`Histogram`]s of
//! fixed buckets (two relaxed additions per observation, no lock). At
//! scrape time, collectors read them and encode them into one
//! [`prometheus_client`] registry (OpenMetrics text); this crate holds the
//! histogram, the helpers that encode families of labelled samples, and
//! the process metrics every exporter is expected to have.

mod family;
mod histogram;
mod process;

pub use family::{counter, gauge, histogram, info, Labels};
pub use histogram::{Histogram, HistogramSnapshot, LazyHistogram, BOUNDS_S};
pub use process::ProcessCollector;
pub use prometheus_client::collector::Collector;
pub use prometheus_client::encoding::DescriptorEncoder;
pub use prometheus_client::registry::Registry;

/// The status classes, as labels, by [`status_class`].
pub const STATUS_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

/// The class of an HTTP status, 0 (1xx) to 4 (5xx); out-of-range codes
/// count in the nearest class.
pub fn status_class(status: u16) -> usize {
    usize::from(status / 100).clamp(1, 5) - 1
}

/// The content type of [`encode`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Renders every metric of `registry` in the OpenMetrics text format.
pub fn encode(registry: &Registry) -> String {
    let mut out = String::with_capacity(16 * 1024);
    // Writing to a String cannot fail; a collector's error ends the text early.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

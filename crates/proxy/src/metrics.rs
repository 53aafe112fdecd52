//! Data-plane counters, rendered in Prometheus' text format.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use http::StatusCode;

use crate::error::{ErrorKind, Source};

/// Counters of the data plane: one shard per worker, so workers never write
/// the same cache line; summed when rendered.
#[derive(Debug, Default)]
pub struct ProxyMetrics {
    shards: Mutex<Vec<Arc<Counters>>>,
}

impl ProxyMetrics {
    /// A new shard for one worker.
    pub(crate) fn worker(&self) -> Arc<Counters> {
        let shard = Arc::new(Counters::default());
        if let Ok(mut s) = self.shards.lock() {
            s.push(shard.clone());
        }
        shard
    }

    /// Appends the counters, summed over workers, in Prometheus' text format.
    pub fn render(&self, out: &mut String) {
        let total = Counters::default();
        if let Ok(shards) = self.shards.lock() {
            for s in shards.iter() {
                total.add(s);
            }
        }
        total.render(out);
    }
}

/// One worker's counters.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Responses by status class: 1xx, 2xx, 3xx, 4xx, 5xx.
    responses: [AtomicU64; 5],
    /// Requests answered by the proxy itself, by [`ErrorKind::index`].
    errors: [AtomicU64; ErrorKind::ALL.len()],
    /// Attempts beyond the first.
    retries: AtomicU64,
    /// Downstream connections accepted.
    connections: AtomicU64,
    /// TLS handshakes that succeeded, and that failed (or timed out).
    tls_ok: AtomicU64,
    tls_failed: AtomicU64,
}

impl Counters {
    fn add(&self, other: &Counters) {
        let pairs = self.responses.iter().zip(&other.responses).chain(self.errors.iter().zip(&other.errors)).chain([
            (&self.retries, &other.retries),
            (&self.connections, &other.connections),
            (&self.tls_ok, &other.tls_ok),
            (&self.tls_failed, &other.tls_failed),
        ]);
        for (mine, theirs) in pairs {
            mine.fetch_add(theirs.load(Relaxed), Relaxed);
        }
    }

    pub(crate) fn response(&self, status: StatusCode) {
        let class = (status.as_u16() / 100).clamp(1, 5) as usize - 1;
        self.responses[class].fetch_add(1, Relaxed);
    }

    pub(crate) fn error(&self, e: ErrorKind) {
        self.errors[e.index()].fetch_add(1, Relaxed);
    }

    pub(crate) fn retry(&self) {
        self.retries.fetch_add(1, Relaxed);
    }

    pub(crate) fn connection(&self) {
        self.connections.fetch_add(1, Relaxed);
    }

    pub(crate) fn tls_handshake(&self, ok: bool) {
        let c = if ok { &self.tls_ok } else { &self.tls_failed };
        c.fetch_add(1, Relaxed);
    }

    fn render(&self, out: &mut String) {
        let _ = writeln!(out, "# HELP tidegate_responses_total Responses sent to clients, by status class.");
        let _ = writeln!(out, "# TYPE tidegate_responses_total counter");
        for (i, c) in self.responses.iter().enumerate() {
            let _ = writeln!(out, "tidegate_responses_total{{class=\"{}xx\"}} {}", i + 1, c.load(Relaxed));
        }
        let _ = writeln!(
            out,
            "# HELP tidegate_proxy_errors_total Requests the proxy answered itself, by reason and where the failure came from."
        );
        let _ = writeln!(out, "# TYPE tidegate_proxy_errors_total counter");
        for (kind, c) in ErrorKind::ALL.iter().zip(&self.errors) {
            let source = match kind.source() {
                Source::Client => "client",
                Source::Upstream => "upstream",
                Source::Local => "local",
            };
            let (reason, n) = (kind.name(), c.load(Relaxed));
            let _ = writeln!(out, "tidegate_proxy_errors_total{{reason=\"{reason}\",source=\"{source}\"}} {n}");
        }
        for (name, help, c) in [
            ("tidegate_retries_total", "Upstream attempts beyond the first.", &self.retries),
            ("tidegate_connections_total", "Client connections accepted.", &self.connections),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", c.load(Relaxed));
        }
        let name = "tidegate_tls_handshakes_total";
        let _ = writeln!(out, "# HELP {name} TLS handshakes on the TLS listener, by result.\n# TYPE {name} counter");
        let _ = writeln!(out, "{name}{{result=\"ok\"}} {}", self.tls_ok.load(Relaxed));
        let _ = writeln!(out, "{name}{{result=\"failed\"}} {}", self.tls_failed.load(Relaxed));
    }
}

//! Data-plane counters: written lock-free by the workers, read at scrape
//! time by [`DataPlaneCollector`] into the admin API's registry.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};

use arc_swap::ArcSwap;
use http::StatusCode;
use tidegate_metrics::{counter, gauge, histogram, Collector, DescriptorEncoder, HistogramSnapshot};
use tidegate_snapshot::{RouteStats, Snapshot};

use crate::access_log::AccessLog;
use crate::admission::BufferBudget;
use crate::error::{ErrorKind, Source};

/// Counters of the data plane: one shard per worker, so workers never write
/// the same cache line; summed when read.
#[derive(Debug, Default)]
pub struct ProxyMetrics {
    shards: Mutex<Vec<Arc<Counters>>>,
    access_log: OnceLock<Arc<AccessLog>>,
    /// The memory budget of request bodies read ahead.
    buffers: OnceLock<Arc<BufferBudget>>,
    /// The span exporter, when tracing is on.
    traces: OnceLock<tidegate_trace::Exporter>,
    /// The QUIC side, when HTTP/3 is on.
    quic: OnceLock<Arc<crate::h3::QuicCounters>>,
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

    /// Reports the access log's counters with the data plane's.
    pub(crate) fn set_access_log(&self, log: Arc<AccessLog>) {
        let _ = self.access_log.set(log);
    }

    /// Reports the QUIC side's counters with the data plane's.
    pub(crate) fn set_quic(&self, counters: Arc<crate::h3::QuicCounters>) {
        let _ = self.quic.set(counters);
    }

    /// QUIC connections open now (HTTP/3), when it is on.
    pub fn quic_open(&self) -> Option<u64> {
        self.quic.get().map(|q| q.open.load(Relaxed) as u64)
    }

    /// Reports the span exporter's counters with the data plane's.
    pub(crate) fn set_tracing(&self, exporter: tidegate_trace::Exporter) {
        let _ = self.traces.set(exporter);
    }

    /// Reports the bodies read ahead with the data plane's metrics.
    pub(crate) fn set_buffers(&self, budget: Arc<BufferBudget>) {
        let _ = self.buffers.set(budget);
    }

    /// A collector of the data plane's metrics, reading routes from
    /// `snapshots`.
    pub fn collector(self: &Arc<Self>, snapshots: Arc<ArcSwap<Snapshot>>) -> DataPlaneCollector {
        DataPlaneCollector { metrics: self.clone(), snapshots }
    }

    fn each_shard(&self, mut f: impl FnMut(&Counters)) {
        if let Ok(shards) = self.shards.lock() {
            for s in shards.iter() {
                f(s);
            }
        }
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
    /// HTTP/1.1 connections opened to backends.
    upstream_opened: AtomicU64,
    /// TLS handshakes that succeeded, and that failed (or timed out).
    tls_ok: AtomicU64,
    tls_failed: AtomicU64,
    /// PROXY protocol headers read from trusted balancers, and connections
    /// closed for a missing, malformed or late one.
    proxy_headers_ok: AtomicU64,
    proxy_headers_failed: AtomicU64,
    /// Durations of requests that matched no route.
    pub(crate) unrouted: RouteStats,
}

impl Counters {
    pub(crate) fn response(&self, status: StatusCode) {
        self.responses[tidegate_metrics::status_class(status.as_u16())].fetch_add(1, Relaxed);
    }

    pub(crate) fn error(&self, e: ErrorKind) {
        self.errors[e.index()].fetch_add(1, Relaxed);
    }

    pub(crate) fn retried(&self, n: u64) {
        self.retries.fetch_add(n, Relaxed);
    }

    pub(crate) fn connection(&self) {
        self.connections.fetch_add(1, Relaxed);
    }

    pub(crate) fn upstream_opened(&self) {
        self.upstream_opened.fetch_add(1, Relaxed);
    }

    #[cfg(test)]
    pub(crate) fn upstream_opened_total(&self) -> u64 {
        self.upstream_opened.load(Relaxed)
    }

    pub(crate) fn tls_handshake(&self, ok: bool) {
        let c = if ok { &self.tls_ok } else { &self.tls_failed };
        c.fetch_add(1, Relaxed);
    }

    pub(crate) fn proxy_header(&self, ok: bool) {
        let c = if ok { &self.proxy_headers_ok } else { &self.proxy_headers_failed };
        c.fetch_add(1, Relaxed);
    }
}

use tidegate_metrics::STATUS_CLASSES as CLASSES;

/// Encodes the data plane's metrics: responses, errors, retries,
/// connections, TLS handshakes, request durations by route, and the
/// access log's counters.
#[derive(Debug)]
pub struct DataPlaneCollector {
    metrics: Arc<ProxyMetrics>,
    snapshots: Arc<ArcSwap<Snapshot>>,
}

impl Collector for DataPlaneCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let m = &self.metrics;
        let sum = |pick: fn(&Counters) -> &AtomicU64| {
            let mut n = 0;
            m.each_shard(|c| n += pick(c).load(Relaxed));
            n
        };
        let mut responses = [0u64; 5];
        let mut errors = [0u64; ErrorKind::ALL.len()];
        let mut unrouted: [HistogramSnapshot; 5] = Default::default();
        m.each_shard(|c| {
            for (to, from) in responses.iter_mut().zip(&c.responses) {
                *to += from.load(Relaxed);
            }
            for (to, from) in errors.iter_mut().zip(&c.errors) {
                *to += from.load(Relaxed);
            }
            for (to, from) in unrouted.iter_mut().zip(&c.unrouted.durations) {
                if let Some(h) = from.snapshot() {
                    to.add(&h);
                }
            }
        });
        let help = "Responses sent to clients, by status class.";
        counter(
            &mut enc,
            "tidegate_responses",
            help,
            CLASSES.iter().zip(responses).map(|(c, n)| ([("class", *c)], n)),
        )?;
        let help = "Requests the proxy answered itself, by reason and where the failure came from.";
        let errors = ErrorKind::ALL.iter().zip(errors).map(|(kind, n)| {
            let source = match kind.source() {
                Source::Client => "client",
                Source::Upstream => "upstream",
                Source::Local => "local",
            };
            ([("reason", kind.name()), ("source", source)], n)
        });
        counter(&mut enc, "tidegate_proxy_errors", help, errors)?;
        counter(&mut enc, "tidegate_retries", "Upstream attempts beyond the first.", [([], sum(|c| &c.retries))])?;
        counter(&mut enc, "tidegate_connections", "Client connections accepted.", [([], sum(|c| &c.connections))])?;
        let help = "HTTP/1.1 connections opened to backends (a count that grows with the requests means little reuse).";
        counter(&mut enc, "tidegate_upstream_connections_opened", help, [([], sum(|c| &c.upstream_opened))])?;
        let tls = [([("result", "ok")], sum(|c| &c.tls_ok)), ([("result", "failed")], sum(|c| &c.tls_failed))];
        counter(&mut enc, "tidegate_tls_handshakes", "TLS handshakes on the TLS listener, by result.", tls)?;
        let headers = [
            ([("result", "ok")], sum(|c| &c.proxy_headers_ok)),
            ([("result", "failed")], sum(|c| &c.proxy_headers_failed)),
        ];
        let help = "PROXY protocol headers from trusted balancers (--proxy-protocol-from), by result (failed: \
                    missing, malformed or late; the connection was closed).";
        counter(&mut enc, "tidegate_proxy_protocol_headers", help, headers)?;
        if let Some(q) = m.quic.get() {
            let help = "QUIC connections (HTTP/3) whose handshake completed.";
            counter(&mut enc, "tidegate_quic_connections", help, [([], q.accepted.load(Relaxed) as u64)])?;
            let help = "QUIC connections (HTTP/3) open now.";
            gauge(&mut enc, "tidegate_quic_connections_open", help, [([], q.open.load(Relaxed) as u64)])?;
            let help = "Retry packets sent: clients asked to prove their address while many handshakes were in \
                        progress (--http3-retry-above).";
            counter(&mut enc, "tidegate_quic_retries", help, [([], q.retries.load(Relaxed) as u64)])?;
            let help =
                "QUIC handshakes in progress now (above --http3-retry-above on a worker, new clients get a Retry).";
            gauge(&mut enc, "tidegate_quic_handshakes_in_progress", help, [([], q.handshaking.load(Relaxed) as u64)])?;
            let help = "QUIC connections refused at --max-connections.";
            counter(&mut enc, "tidegate_quic_refused", help, [([], q.refused.load(Relaxed) as u64)])?;
        }
        if let Some(b) = m.buffers.get() {
            let help = "Bytes of request bodies held in memory before a backend was chosen (all workers), \
                        out of --request-buffer-total-bytes.";
            gauge(&mut enc, "tidegate_request_buffer_bytes", help, [([], b.used() as u64)])?;
        }
        if let Some(exporter) = m.traces.get() {
            let st = exporter.stats();
            let spans = [
                ([("result", "exported")], st.exported.load(Relaxed)),
                ([("result", "dropped_queue_full")], st.dropped_queue_full.load(Relaxed)),
                ([("result", "dropped_export_failed")], st.dropped_export_failed.load(Relaxed)),
            ];
            let help = "Spans of recorded requests, by result (dropped_queue_full: the exporter was behind and \
                        its buffer full; dropped_export_failed: the OTLP receiver did not accept their batch).";
            counter(&mut enc, "tidegate_trace_spans", help, spans)?;
            let exports = [
                ([("result", "ok")], st.exports_ok.load(Relaxed)),
                ([("result", "failed")], st.exports_failed.load(Relaxed)),
            ];
            let help = "Batches of spans posted to the OTLP receiver, by result.";
            counter(&mut enc, "tidegate_trace_exports", help, exports)?;
        }
        self.request_durations(&mut enc, &unrouted)?;
        self.rule_steps(&mut enc)?;
        if let Some(log) = m.access_log.get() {
            let lines = [([("result", "written")], log.written()), ([("result", "dropped")], log.dropped())];
            let help = "Access log lines, by result (dropped: the writer was behind and the line was not kept).";
            counter(&mut enc, "tidegate_access_log_lines", help, lines)?;
            let help = "Access log writes or reopens that failed.";
            counter(&mut enc, "tidegate_access_log_write_errors", help, [([], log.failed_writes())])?;
        }
        Ok(())
    }
}

impl DataPlaneCollector {
    /// `tidegate_rule_steps_total{route, rule_set, step, kind, outcome}`:
    /// what each step of each route's rules did (`answered`: it gave the
    /// answer; `changed`: it edited the request), since the route's chain
    /// was compiled (a change to the route or its rule sets starts it
    /// again from zero, as a restart would).
    fn rule_steps(&self, enc: &mut DescriptorEncoder<'_>) -> fmt::Result {
        let snapshot = self.snapshots.load_full();
        let mut rows = Vec::new();
        for route in snapshot.routes() {
            let Some(chain) = &route.attached else { continue };
            for c in chain.counts() {
                let (set, step) = (c.rule.set.as_str().to_string(), c.rule.step.to_string());
                for (outcome, n) in [("answered", c.answered), ("changed", c.changed)] {
                    rows.push((route.name.as_str().to_string(), set.clone(), step.clone(), c.rule.kind, outcome, n));
                }
            }
        }
        rows.sort();
        let samples = rows.iter().map(|(route, set, step, kind, outcome, n)| {
            (
                [
                    ("route", route.as_str()),
                    ("rule_set", set.as_str()),
                    ("step", step.as_str()),
                    ("kind", *kind),
                    ("outcome", *outcome),
                ],
                *n,
            )
        });
        let help = "Requests each step of a route's rules answered or changed, since the route's chain was \
                    compiled (by route, rule set, step index, kind and outcome).";
        counter(enc, "tidegate_rule_steps", help, samples)
    }

    /// `tidegate_request_duration_seconds{service, route, class}`: every
    /// route that saw requests, and `route=""` for requests that matched
    /// none.
    fn request_durations(&self, enc: &mut DescriptorEncoder<'_>, unrouted: &[HistogramSnapshot; 5]) -> fmt::Result {
        let snapshot = self.snapshots.load_full();
        let mut routes: Vec<_> = snapshot.routes().collect();
        routes.sort_by(|a, b| a.name.cmp(&b.name));
        let mut samples = Vec::new();
        for (class, h) in CLASSES.iter().zip(unrouted) {
            if h.count() > 0 {
                samples.push(([("service", ""), ("route", ""), ("class", *class)], h.clone()));
            }
        }
        for r in &routes {
            let service = r.spec.service().map_or("", |s| s.as_str());
            for (class, h) in CLASSES.iter().zip(&r.stats.durations) {
                if let Some(h) = h.snapshot() {
                    samples.push(([("service", service), ("route", r.name.as_str()), ("class", *class)], h));
                }
            }
        }
        let help = "Requests from head received to response written, by service, route and status class \
                    (route \"\": no route matched).";
        histogram(enc, "tidegate_request_duration_seconds", help, samples)
    }
}

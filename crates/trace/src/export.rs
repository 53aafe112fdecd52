//! Spans leave the request path through a bounded queue; one task batches
//! them and posts each batch to an OTLP/HTTP receiver
//! (`POST /v1/traces`, `application/x-protobuf`). When the receiver is
//! slow or down, the queue fills and further spans are dropped and
//! counted: tracing never holds a request or grows memory without bound.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, USER_AGENT};
use http::{Method, Request, Uri};
use http_body_util::Full;
use tidegate_upstream::{ErrorChain, HttpClient, HttpOptions};
use tokio::sync::mpsc;

use crate::otlp;
use crate::span::{Span, Value};

/// Where and how spans are exported.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// The receiver's traces URL (`http://HOST:4318/v1/traces`).
    pub endpoint: Uri,
    /// Requests whose spans may wait for export; past it, spans are dropped.
    pub queue_requests: usize,
    /// Spans sent in one export at most.
    pub batch_spans: usize,
    /// Spans waiting are sent at least this often.
    pub interval: Duration,
    /// An export not answered within this fails (its spans dropped).
    pub timeout: Duration,
    /// The resource the spans come from (`service.name` first).
    pub resource: Vec<(&'static str, Value)>,
}

impl ExportOptions {
    /// The defaults for `endpoint`: a queue of 4,096 requests' spans,
    /// batches of up to 512 spans sent at least every second, 10 s per
    /// export, resource `service.name=tidegate`.
    pub fn new(endpoint: Uri) -> ExportOptions {
        ExportOptions {
            endpoint,
            queue_requests: 4096,
            batch_spans: 512,
            interval: Duration::from_secs(1),
            timeout: Duration::from_secs(10),
            resource: vec![("service.name", Value::from("tidegate"))],
        }
    }
}

/// What the exporter did, for metrics.
#[derive(Debug, Default)]
pub struct ExportStats {
    /// Spans the receiver accepted.
    pub exported: AtomicU64,
    /// Spans dropped because the queue was full (the receiver behind).
    pub dropped_queue_full: AtomicU64,
    /// Spans dropped because their export failed.
    pub dropped_export_failed: AtomicU64,
    /// Exports answered with a 2xx.
    pub exports_ok: AtomicU64,
    /// Exports that failed (no answer, or not a 2xx).
    pub exports_failed: AtomicU64,
}

/// The request path's end of the exporter. Cloning shares the queue.
#[derive(Debug, Clone)]
pub struct Exporter {
    tx: mpsc::Sender<Vec<Span>>,
    stats: Arc<ExportStats>,
}

impl Exporter {
    /// Starts the export task, on a thread of its own (export work never
    /// runs on the data plane's workers). It ends when every `Exporter` is
    /// dropped, after sending what is queued.
    pub fn start(options: ExportOptions) -> std::io::Result<Exporter> {
        let (tx, rx) = mpsc::channel(options.queue_requests.max(1));
        let stats = Arc::new(ExportStats::default());
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let task_stats = stats.clone();
        std::thread::Builder::new()
            .name("tidegate-traces".into())
            .spawn(move || runtime.block_on(run(options, rx, task_stats)))?;
        Ok(Exporter { tx, stats })
    }

    /// Queues one request's spans for export; drops (and counts) them when
    /// the queue is full. Never waits.
    pub fn record(&self, spans: Vec<Span>) {
        if let Err(e) = self.tx.try_send(spans) {
            let n = match e {
                mpsc::error::TrySendError::Full(s) | mpsc::error::TrySendError::Closed(s) => s.len(),
            };
            self.stats.dropped_queue_full.fetch_add(n as u64, Relaxed);
        }
    }

    /// What it did so far.
    pub fn stats(&self) -> &ExportStats {
        &self.stats
    }
}

async fn run(options: ExportOptions, mut rx: mpsc::Receiver<Vec<Span>>, stats: Arc<ExportStats>) {
    let client = HttpClient::new(HttpOptions { idle_per_host: 2, ..HttpOptions::default() });
    let batch = options.batch_spans.max(1);
    let mut pending: Vec<Span> = Vec::new();
    let mut tick = tokio::time::interval(options.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // A full batch goes at once; what is left goes at each tick, and
        // everything when the exporter is dropped.
        let (min, done) = tokio::select! {
            got = rx.recv() => match got {
                Some(spans) => {
                    pending.extend(spans);
                    (batch, false)
                }
                None => (1, true),
            },
            _ = tick.tick() => (1, false),
        };
        while pending.len() >= min {
            let n = pending.len().min(batch);
            let sent: Vec<Span> = pending.drain(..n).collect();
            export(&client, &options, &sent, &stats).await;
        }
        if done {
            return;
        }
    }
}

async fn export(client: &HttpClient, options: &ExportOptions, spans: &[Span], stats: &ExportStats) {
    let body = Bytes::from(otlp::encode(&options.resource, spans));
    let request = Request::builder()
        .method(Method::POST)
        .uri(options.endpoint.clone())
        .header(CONTENT_TYPE, HeaderValue::from_static("application/x-protobuf"))
        .header(USER_AGENT, HeaderValue::from_static("tidegate"))
        .body(Full::new(body));
    let n = spans.len() as u64;
    let failed = |why: String| {
        stats.exports_failed.fetch_add(1, Relaxed);
        stats.dropped_export_failed.fetch_add(n, Relaxed);
        tracing::debug!(spans = n, %why, "a trace export failed; its spans are dropped");
    };
    let Ok(request) = request else {
        return failed("the request could not be built".into());
    };
    match client.send(request, options.timeout, 64 * 1024).await {
        Ok(resp) if resp.status().is_success() => {
            stats.exports_ok.fetch_add(1, Relaxed);
            stats.exported.fetch_add(n, Relaxed);
        }
        Ok(resp) => failed(format!("HTTP status {}", resp.status())),
        Err(e) => failed(ErrorChain(&e).to_string()),
    }
}

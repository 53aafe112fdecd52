//! Recorded requests leave the request path through a bounded buffer that
//! the request path only appends to (under a lock no one holds for long,
//! and without waking anyone: a wake-up per request would cost a system
//! call each); one thread takes what is there every
//! [`ExportOptions::interval`], builds the spans ([`Recording::spans`]:
//! their attributes, texts and ids are made there, not on the request
//! path) and posts them in batches to an OTLP/HTTP receiver (`POST
//! /v1/traces`, `application/x-protobuf`). When the receiver is slow or
//! down, the buffer fills and further spans are dropped and counted:
//! tracing never holds a request or grows memory without bound.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, USER_AGENT};
use http::{Method, Request, Uri};
use http_body_util::Full;
use tidegate_upstream::{ErrorChain, HttpClient, HttpOptions};

use crate::otlp;
use crate::span::{Span, Value};

/// Where and how spans are exported.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// The receiver's traces URL (`http://HOST:4318/v1/traces`).
    pub endpoint: Uri,
    /// Spans that may wait for export; past it, spans are dropped.
    pub max_pending: usize,
    /// Spans sent in one export at most.
    pub batch_spans: usize,
    /// How often the spans waiting are taken and sent.
    pub interval: Duration,
    /// An export not answered within this fails (its spans dropped).
    pub timeout: Duration,
    /// The resource the spans come from (`service.name` first).
    pub resource: Vec<(&'static str, Value)>,
}

impl ExportOptions {
    /// The defaults for `endpoint`: at most 16,384 spans waiting, taken
    /// every 200 ms and sent in batches of up to 512, 10 s per export,
    /// resource `service.name=tidegate`.
    pub fn new(endpoint: Uri) -> ExportOptions {
        ExportOptions {
            endpoint,
            max_pending: 16_384,
            batch_spans: 512,
            interval: Duration::from_millis(200),
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
    /// Spans dropped because the buffer was full (the receiver behind).
    pub dropped_queue_full: AtomicU64,
    /// Spans dropped because their export failed.
    pub dropped_export_failed: AtomicU64,
    /// Exports answered with a 2xx.
    pub exports_ok: AtomicU64,
    /// Exports that failed (no answer, or not a 2xx).
    pub exports_failed: AtomicU64,
}

/// What the request path hands the exporter for one recorded request:
/// what it saw, from which the export thread builds the spans.
pub trait Recording: Send {
    /// How many spans it makes (what is counted when it is dropped).
    fn span_count(&self) -> usize;
    /// Appends its spans to `out`.
    fn spans(self: Box<Self>, out: &mut Vec<Span>);
}

/// The buffer between the request path and the export thread.
#[derive(Default)]
struct Pending {
    records: Vec<Box<dyn Recording>>,
    /// The spans they make.
    spans: usize,
}

/// What the request path and the export thread share.
struct Shared {
    pending: Mutex<Pending>,
    max_pending: usize,
    stats: ExportStats,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("max_pending", &self.max_pending).finish_non_exhaustive()
    }
}

/// The request path's end of the exporter. Cloning shares the buffer; the
/// export thread ends, after sending what is left, once every clone is
/// dropped.
#[derive(Debug, Clone)]
pub struct Exporter {
    shared: Arc<Shared>,
    /// Counts the clones (the thread watches it).
    _handle: Arc<()>,
}

impl Exporter {
    /// Starts the export thread (export work never runs on the data
    /// plane's workers).
    pub fn start(options: ExportOptions) -> std::io::Result<Exporter> {
        let shared = Arc::new(Shared {
            pending: Mutex::new(Pending::default()),
            max_pending: options.max_pending.max(1),
            stats: ExportStats::default(),
        });
        let handle = Arc::new(());
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let (task_shared, watch) = (shared.clone(), Arc::downgrade(&handle));
        std::thread::Builder::new()
            .name("tidegate-traces".into())
            .spawn(move || runtime.block_on(run(options, task_shared, watch)))?;
        Ok(Exporter { shared, _handle: handle })
    }

    /// Adds one recorded request to the buffer (its spans are built on
    /// the export thread); drops it, counting its spans, when the buffer
    /// is full. Never waits for the export.
    pub fn record_request(&self, request: Box<dyn Recording>) {
        let n = request.span_count();
        let mut pending = self.shared.pending.lock().unwrap_or_else(|p| p.into_inner());
        if pending.spans + n > self.shared.max_pending {
            drop(pending);
            self.shared.stats.dropped_queue_full.fetch_add(n as u64, Relaxed);
            return;
        }
        pending.spans += n;
        pending.records.push(request);
    }

    /// What it did so far.
    pub fn stats(&self) -> &ExportStats {
        &self.shared.stats
    }
}

async fn run(options: ExportOptions, shared: Arc<Shared>, alive: std::sync::Weak<()>) {
    let client = HttpClient::new(HttpOptions { idle_per_host: 2, ..HttpOptions::default() });
    let batch = options.batch_spans.max(1);
    let mut tick = tokio::time::interval(options.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Two buffers in turn: the one the request path appends to keeps the
    // room the last interval needed, so that it does not grow (copying
    // itself under the lock) every interval.
    let mut taken: Vec<Box<dyn Recording>> = Vec::new();
    let mut spans: Vec<Span> = Vec::new();
    loop {
        tick.tick().await;
        let last = alive.strong_count() == 0;
        {
            let mut pending = shared.pending.lock().unwrap_or_else(|p| p.into_inner());
            std::mem::swap(&mut pending.records, &mut taken);
            pending.spans = 0;
        }
        for request in taken.drain(..) {
            request.spans(&mut spans);
        }
        for chunk in spans.chunks(batch) {
            export(&client, &options, chunk, &shared.stats).await;
        }
        spans.clear();
        if last {
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

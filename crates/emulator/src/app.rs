//! Shared emulator state and response helpers.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE};
use http::{Response, StatusCode};
use http_body_util::Full;

use crate::admission::Admission;
use crate::cli::Args;
use crate::dist::ServiceTime;
use crate::rate::RateMeter;

/// Response type produced by every handler.
pub type Resp = Response<Full<Bytes>>;

/// Header naming the backend that answered.
pub const X_BACKEND: HeaderName = HeaderName::from_static("x-backend");
/// ORCA load report header.
pub const LOAD_METRICS: HeaderName = HeaderName::from_static("endpoint-load-metrics");

/// State shared by every connection of one emulator.
#[derive(Debug)]
pub struct AppState {
    /// Backend name.
    pub name: String,
    /// The name, as the `x-backend` value.
    pub name_header: HeaderValue,
    /// Body of normal responses.
    pub body: Bytes,
    /// Service-time distribution.
    pub service: ServiceTime,
    /// Health-check path.
    pub health_path: String,
    /// Whether to add ORCA load reports.
    pub orca: bool,
    /// Slot and queue admission.
    pub admission: Arc<Admission>,
    /// Health result; false makes the health path answer 503.
    pub healthy: AtomicBool,
    /// Requests answered 200 after service.
    pub served: AtomicU64,
    /// Client connections open now.
    pub connections_open: AtomicU64,
    /// Requests rejected with 503 because the queue was full.
    pub rejected: AtomicU64,
    /// Recent completions per second.
    pub completions: RateMeter,
    /// Latency of served requests (queueing and service), EWMA in
    /// microseconds as f64 bits; 0 before the first.
    pub latency_ewma_us: AtomicU64,
}

impl AppState {
    /// Builds the state from the options; fails if the name is not a valid header value.
    pub fn new(args: &Args) -> io::Result<Arc<Self>> {
        let name_header = HeaderValue::from_str(&args.name)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "--name must be a valid header value"))?;
        let body = match args.body_size {
            Some(n) => Bytes::from(vec![b'x'; n]),
            None => Bytes::from(format!("{}\n", args.name)),
        };
        Ok(Arc::new(Self {
            name: args.name.clone(),
            name_header,
            body,
            service: args.service_time,
            health_path: args.health_path.clone(),
            orca: args.orca,
            admission: Admission::new(args.slots, args.queue),
            healthy: AtomicBool::new(true),
            served: AtomicU64::new(0),
            connections_open: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            completions: RateMeter::new(),
            latency_ewma_us: AtomicU64::new(0),
        }))
    }

    /// Folds one served request's latency into the EWMA (weight 0.1).
    pub fn record_latency(&self, latency: std::time::Duration) {
        let sample = latency.as_secs_f64() * 1e6;
        let _ = self.latency_ewma_us.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
            let old = f64::from_bits(bits);
            Some(if old > 0.0 { old + 0.1 * (sample - old) } else { sample }.to_bits())
        });
    }

    /// Adds `x-backend` and, with `--orca`, the load report to a response.
    pub fn decorate(&self, resp: &mut Resp) {
        let headers = resp.headers_mut();
        headers.insert(X_BACKEND, self.name_header.clone());
        if self.orca {
            if let Ok(value) = HeaderValue::from_str(&self.load_report()) {
                headers.insert(LOAD_METRICS, value);
            }
        }
    }

    /// ORCA text-format load report, with the requests in flight (busy
    /// and queued) and the latency EWMA as named metrics (for Prequal).
    pub fn load_report(&self) -> String {
        let load = self.admission.load();
        let cpu = load.utilization();
        let rps = self.completions.rate();
        let rif = load.busy + load.queued;
        let latency_ms = f64::from_bits(self.latency_ewma_us.load(Ordering::Relaxed)) / 1e3;
        format!(
            "TEXT cpu_utilization={cpu:.3}, rps_fractional={rps:.3}, named_metrics.rif={rif}, \
             named_metrics.latency_ms={latency_ms:.3}"
        )
    }

    /// The `/_emulator/stats` document.
    pub fn stats(&self) -> serde_json::Value {
        let load = self.admission.load();
        serde_json::json!({
            "name": self.name,
            "served": self.served.load(Ordering::Relaxed),
            "rejected": self.rejected.load(Ordering::Relaxed),
            "in_flight": load.busy,
            "queued": load.queued,
            "slots": load.slots,
            "connections_open": self.connections_open.load(Ordering::Relaxed),
        })
    }
}

/// A response with a status and a plain-text body.
pub fn text(status: StatusCode, body: impl Into<Bytes>) -> Resp {
    let mut resp = Response::new(Full::new(body.into()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    resp
}

/// A response with a status and a JSON body.
pub fn json(status: StatusCode, value: &serde_json::Value) -> Resp {
    let mut body = serde_json::to_vec(value).unwrap_or_default();
    body.push(b'\n');
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

/// The value of query parameter `key`, if present (no percent-decoding).
pub fn query_param<'a>(query: Option<&'a str>, key: &str) -> Option<&'a str> {
    query?.split('&').map(|pair| pair.split_once('=').unwrap_or((pair, ""))).find(|(k, _)| *k == key).map(|(_, v)| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_params_are_found() {
        let q = Some("a=1&delay_ms=250&flag");
        assert_eq!(query_param(q, "delay_ms"), Some("250"));
        assert_eq!(query_param(q, "a"), Some("1"));
        assert_eq!(query_param(q, "flag"), Some(""));
        assert_eq!(query_param(q, "missing"), None);
        assert_eq!(query_param(None, "a"), None);
    }

    #[test]
    fn orca_report_reflects_load() {
        let args = Args { slots: 2, orca: true, ..Args::default() };
        let state = AppState::new(&args).expect("state");
        assert_eq!(
            state.load_report(),
            "TEXT cpu_utilization=0.000, rps_fractional=0.000, named_metrics.rif=0, named_metrics.latency_ms=0.000"
        );
        let mut resp = text(StatusCode::OK, "x");
        state.decorate(&mut resp);
        assert_eq!(resp.headers()[X_BACKEND], "emu");
        assert!(resp.headers().contains_key(LOAD_METRICS));
    }

    #[test]
    fn body_size_overrides_the_name_line() {
        let sized = Args { body_size: Some(5), ..Args::default() };
        assert_eq!(AppState::new(&sized).expect("state").body, "xxxxx");
        assert_eq!(AppState::new(&Args::default()).expect("state").body, "emu\n");
        let bad = Args { name: "bad\nname".to_owned(), ..Args::default() };
        assert!(AppState::new(&bad).is_err());
    }
}

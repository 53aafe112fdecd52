//! The `node_exporter` scraper: one task per distinct (host, port), writing
//! the host's load into every backend on that host.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Request, Uri};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tidegate_balance::clock;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::load::HostLoad;
use crate::prometheus::NodeSample;
use crate::targets::{NodeKey, NodeTarget};
use crate::throttle::Throttle;
use crate::{expire_all, poll_timeout};

const SOURCE: &str = "node_exporter";

/// A scrape larger than this is refused (node_exporter serves ~100 KB).
const MAX_BODY: usize = 4 << 20;

/// The HTTP client shared by all scrapes.
pub(crate) type HttpClient = Client<HttpConnector, Empty<Bytes>>;

/// A pooled client: one idle keep-alive connection per exporter.
pub(crate) fn client() -> HttpClient {
    pooled_client(Duration::from_secs(2), 1)
}

/// A client keeping up to `idle_per_host` keep-alive connections per host
/// (idle for at most 30 s), connecting within `connect_timeout`.
pub(crate) fn pooled_client(connect_timeout: Duration, idle_per_host: usize) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(idle_per_host)
        .build(connector)
}

/// Scrapes `http://HOST:PORT/metrics` every interval until aborted; the
/// backends to feed and the interval come from `target`.
pub(crate) async fn run(client: HttpClient, key: NodeKey, mut target: watch::Receiver<Arc<NodeTarget>>) {
    let name = format!("{}:{}", key.0, key.1);
    let uri: Uri = match format!("http://{name}/metrics").parse() {
        Ok(uri) => uri,
        Err(e) => {
            // Stay alive so that the supervisor does not restart (and log) it.
            tracing::warn!(source = SOURCE, target = name, error = %e, "cannot build the scrape URL");
            return std::future::pending().await;
        }
    };
    let mut prev: Option<(NodeSample, Instant)> = None;
    let mut throttle = Throttle::default();
    loop {
        let t = target.borrow_and_update().clone();
        let started = Instant::now();
        match scrape(&client, &uri, poll_timeout(t.interval)).await {
            Ok(sample) => {
                let at = Instant::now();
                let dt = prev.as_ref().map_or(0.0, |(_, t0)| at.duration_since(*t0).as_secs_f64());
                let load = HostLoad::from_node(prev.as_ref().map(|(s, _)| s), &sample, dt);
                let now = clock::now_ms();
                for sink in &t.sinks {
                    load.write(&sink.stats.load, sink.link_bytes_per_s, now);
                }
                prev = Some((sample, at));
                throttle.success(SOURCE, &name);
            }
            Err(e) => throttle.failure(SOURCE, &name, &e),
        }
        expire_all(t.sinks.iter(), t.interval);
        tokio::time::sleep_until(started + t.interval).await;
    }
}

/// One scrape, bounded by `timeout`.
async fn scrape(client: &HttpClient, uri: &Uri, timeout: Duration) -> Result<NodeSample, String> {
    let request = Request::get(uri.clone())
        .header(header::ACCEPT, "text/plain; version=0.0.4")
        .header(header::USER_AGENT, "tidegate")
        .body(Empty::new())
        .map_err(|e| e.to_string())?;
    let fetch = async {
        let response = client.request(request).await.map_err(|e| with_sources(&e))?;
        if !response.status().is_success() {
            return Err(format!("HTTP status {}", response.status()));
        }
        let body = Limited::new(response.into_body(), MAX_BODY).collect().await.map_err(|e| with_sources(&*e))?;
        Ok(body.to_bytes())
    };
    let body = tokio::time::timeout(timeout, fetch).await.map_err(|_| format!("no answer within {timeout:?}"))??;
    let text = std::str::from_utf8(&body).map_err(|e| format!("not UTF-8: {e}"))?;
    let sample = NodeSample::parse(text);
    if sample.is_empty() {
        return Err("the answer has no node_exporter CPU, memory or network metrics".into());
    }
    Ok(sample)
}

/// An error and its causes, `outer: inner: ...`.
fn with_sources(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

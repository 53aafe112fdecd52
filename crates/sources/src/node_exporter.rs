//! The `node_exporter` scraper: one task per distinct (host, port), writing
//! the host's load into every backend on that host.

use std::sync::Arc;

use http::Uri;
use tidegate_balance::clock;
use tidegate_scrape::{scrape_node, NodeSample};
use tidegate_upstream::{ErrorChain, HttpClient};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::load::HostLoad;
use crate::targets::{NodeKey, NodeTarget};
use crate::throttle::Throttle;
use crate::{expire_all, poll_timeout};

const SOURCE: &str = "node_exporter";

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
        match scrape_node(&client, &uri, poll_timeout(t.interval)).await {
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
            Err(e) => throttle.failure(SOURCE, &name, &ErrorChain(&e).to_string()),
        }
        expire_all(t.sinks.iter(), t.interval);
        tokio::time::sleep_until(started + t.interval).await;
    }
}

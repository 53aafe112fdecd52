//! Host metrics for `least_cpu`: background scrapes of Prometheus
//! node_exporter endpoints, written into the [`LoadTable`].
//!
//! Each distinct scrape URL gets one task. Every interval it scrapes the
//! page with `tidegate-scrape` (the one node_exporter parser and scrape,
//! shared with the load sources), sums `node_cpu_seconds_total` over all
//! CPUs and modes (the total) and over `mode="idle"` (the idle time), and
//! writes `1 - Δidle / Δtotal` for every backend scraped at that URL. The
//! first scrape, a failed scrape or a counter reset leaves the value
//! unknown.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use http::Uri;
use tidegate_scrape::{cpu_busy, scrape_node, NodeSample};
use tidegate_upstream::{ErrorChain, HttpClient};

use crate::policies::LoadTable;

/// `BACKEND=URL`: scrape `URL` (an `http://` node_exporter metrics page) for
/// `BACKEND`'s host metrics instead of `http://BACKEND_IP:PORT/metrics`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsUrl {
    /// The backend, as given to `--backend`.
    pub backend: SocketAddr,
    /// Its metrics page.
    pub url: Uri,
}

// A clap value parser: its error is printed as it is.
impl FromStr for MetricsUrl {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (backend, url) = s.split_once('=').ok_or_else(|| format!("{s:?}: expected BACKEND=URL"))?;
        let backend = backend.parse().map_err(|e| format!("{backend:?}: {e}"))?;
        let url: Uri = url.parse().map_err(|e| format!("{url:?}: {e}"))?;
        if url.scheme_str() != Some("http") || url.authority().is_none() {
            return Err(format!("{url}: expected an http://HOST:PORT/PATH URL"));
        }
        Ok(MetricsUrl { backend, url })
    }
}

impl fmt::Display for MetricsUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.backend, self.url)
    }
}

/// A `--metrics-url` whose backend is not one of the `--backend`s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--metrics-url {0}: {backend} is not one of the --backend addresses", backend = .0.backend)]
pub(crate) struct UnknownBackend(pub(crate) MetricsUrl);

/// Which URL to scrape for which backends (by index): an explicit
/// [`MetricsUrl`], else node_exporter on the backend's host at
/// `node_exporter_port`, else none (the backend's load stays unknown).
pub(crate) fn scrape_plan(
    backends: &[SocketAddr],
    node_exporter_port: Option<u16>,
    overrides: &[MetricsUrl],
) -> Result<BTreeMap<String, Vec<usize>>, UnknownBackend> {
    if let Some(o) = overrides.iter().find(|o| !backends.contains(&o.backend)) {
        return Err(UnknownBackend(o.clone()));
    }
    let mut plan: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (i, b) in backends.iter().enumerate() {
        let url = match overrides.iter().rev().find(|o| o.backend == *b) {
            Some(o) => o.url.to_string(),
            None => match node_exporter_port {
                Some(port) => format!("http://{}/metrics", SocketAddr::new(b.ip(), port)),
                None => continue,
            },
        };
        plan.entry(url).or_default().push(i);
    }
    Ok(plan)
}

/// Scrapes `url` every `interval` forever, writing the utilization of the
/// host behind it to `indices` in `table`.
pub(crate) async fn scrape_loop(
    client: HttpClient,
    url: Uri,
    indices: Vec<usize>,
    table: Arc<LoadTable>,
    interval: Duration,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let timeout = interval.clamp(Duration::from_millis(100), Duration::from_secs(5));
    let mut prev: Option<NodeSample> = None;
    let mut failing = false;
    loop {
        ticker.tick().await;
        let cur = scrape_node(&client, &url, timeout).await;
        match &cur {
            Err(e) if !failing => tracing::warn!(%url, error = %ErrorChain(e), "distributor: metrics scrape failed"),
            Ok(_) if failing => tracing::info!(%url, "distributor: metrics scrape recovered"),
            _ => {}
        }
        failing = cur.is_err();
        let cur = cur.ok();
        let cpu = prev.as_ref().zip(cur.as_ref()).and_then(|(p, c)| cpu_busy(p, c));
        for &i in &indices {
            table.set(i, cpu);
        }
        prev = cur;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const PAGE_1: &str = "\
# HELP node_cpu_seconds_total Seconds the CPUs spent in each mode.
# TYPE node_cpu_seconds_total counter
node_cpu_seconds_total{cpu=\"0\",mode=\"idle\"} 100
node_cpu_seconds_total{cpu=\"0\",mode=\"iowait\"} 1
node_cpu_seconds_total{cpu=\"0\",mode=\"system\"} 10
node_cpu_seconds_total{cpu=\"0\",mode=\"user\"} 9
node_cpu_seconds_total{cpu=\"1\",mode=\"idle\"} 100
node_cpu_seconds_total{cpu=\"1\",mode=\"user\"} 20
node_cpu_seconds_total_extra{cpu=\"1\",mode=\"idle\"} 5000
node_cpu_guest_seconds_total{cpu=\"0\",mode=\"user\"} 7
node_memory_MemAvailable_bytes 1.2e+09
";

    const PAGE_2: &str = "\
node_cpu_seconds_total{cpu=\"0\",mode=\"idle\"} 105
node_cpu_seconds_total{cpu=\"0\",mode=\"iowait\"} 1
node_cpu_seconds_total{cpu=\"0\",mode=\"system\"} 12
node_cpu_seconds_total{cpu=\"0\",mode=\"user\"} 12
node_cpu_seconds_total{cpu=\"1\",note=\"a}b, c\",mode=\"idle\"} 110
node_cpu_seconds_total{cpu=\"1\",mode=\"user\"} 20 1700000000000
";

    #[test]
    fn pages_give_the_busy_share_even_with_a_brace_in_a_label_value() {
        let (a, b) = (NodeSample::parse(PAGE_1), NodeSample::parse(PAGE_2));
        assert_eq!((a.cpu_total_s, a.cpu_idle_s), (Some(240.0), 200.0));
        assert_eq!((b.cpu_total_s, b.cpu_idle_s), (Some(260.0), 215.0));
        // 20 s of CPU time passed, 15 of them idle: 25 % busy.
        let u = cpu_busy(&a, &b).expect("progress");
        assert!((u - 0.25).abs() < 1e-9, "{u}");
    }

    #[test]
    fn plan_groups_backends_by_url_and_honours_overrides() {
        let b: Vec<SocketAddr> =
            ["127.0.0.1:9001", "127.0.0.1:9002", "10.0.0.2:80"].iter().map(|s| s.parse().expect("addr")).collect();
        let o: MetricsUrl = "10.0.0.2:80=http://127.0.0.1:9200/metrics".parse().expect("override");
        let plan = scrape_plan(&b, Some(9100), &[o]).expect("plan");
        assert_eq!(plan.get("http://127.0.0.1:9100/metrics"), Some(&vec![0, 1]));
        assert_eq!(plan.get("http://127.0.0.1:9200/metrics"), Some(&vec![2]));
        assert_eq!(scrape_plan(&b, None, &[]).expect("plan").len(), 0);
        let stranger: MetricsUrl = "10.9.9.9:80=http://x:1/metrics".parse().expect("override");
        assert_eq!(scrape_plan(&b, None, std::slice::from_ref(&stranger)), Err(UnknownBackend(stranger)));
        assert!("10.0.0.2:80=https://x/metrics".parse::<MetricsUrl>().is_err());
        assert!("10.0.0.2:80".parse::<MetricsUrl>().is_err());
    }

    /// An HTTP server answering each connection with the next page; after the
    /// last page it stops answering (scrapes then time out), holding the
    /// last utilization in the table for at least the scrape timeout.
    async fn page_server(pages: Vec<&'static str>) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            for page in pages {
                let Ok((mut conn, _)) = listener.accept().await else { return };
                let mut buf = [0u8; 4096];
                let mut seen = Vec::new();
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                let response = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{page}",
                    page.len()
                );
                let _ = conn.write_all(response.as_bytes()).await;
            }
            std::future::pending::<()>().await;
            drop(listener);
        });
        addr
    }

    #[tokio::test]
    async fn scraper_fills_the_table_in_the_background() {
        let addr = page_server(vec![PAGE_1, PAGE_2]).await;
        let table = Arc::new(LoadTable::new(2));
        let url: Uri = format!("http://{addr}/metrics").parse().expect("url");
        let task = tokio::spawn(scrape_loop(
            tidegate_scrape::client(),
            url,
            vec![1],
            table.clone(),
            Duration::from_millis(20),
        ));
        let mut got = None;
        for _ in 0..500 {
            got = table.get(1);
            if got.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        task.abort();
        let u = got.expect("a utilization after two scrapes");
        // PAGE_1 -> PAGE_2 is 25 % busy.
        assert!((u - 0.25).abs() < 1e-9, "{u}");
        assert_eq!(table.get(0), None);
    }

    #[tokio::test]
    async fn unreachable_exporter_leaves_load_unknown() {
        let table = Arc::new(LoadTable::new(1));
        table.set(0, Some(0.5));
        let url: Uri = "http://127.0.0.1:1/metrics".parse().expect("url");
        let task = tokio::spawn(scrape_loop(
            tidegate_scrape::client(),
            url,
            vec![0],
            table.clone(),
            Duration::from_millis(20),
        ));
        for _ in 0..500 {
            if table.get(0).is_none() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        task.abort();
        assert_eq!(table.get(0), None);
    }
}

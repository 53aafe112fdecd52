//! Scrapes of Prometheus exporters: the text exposition format's parser
//! ([`text`]), what a `node_exporter` page says about its host ([`node`]),
//! and one scrape of a page over the shared upstream-HTTP helper
//! ([`scrape_node`]).
//!
//! Both users of node_exporter read it through this crate: the load
//! sources (`tidegate-sources`, feeding the `least_*` policies and the
//! dynamic weights) and the reference distributor's `least_cpu` policy.

pub mod node;
pub mod text;

use std::time::Duration;

use http::header::ACCEPT;
use http::Uri;
use tidegate_upstream::{HttpClient, HttpError, HttpOptions};

pub use node::{cpu_busy, NetCounters, NodeSample};
pub use text::{samples, Sample};

/// A page larger than this is refused (the read stops there);
/// node_exporter serves about 100 KiB.
pub const MAX_PAGE: usize = 4 << 20;

/// The `User-Agent` of scrapes.
pub const USER_AGENT: &str = "tidegate";

/// The media type asked for: the text format, version 0.0.4.
const ACCEPT_TEXT: &str = "text/plain; version=0.0.4";

/// Why a scrape gave nothing.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// The page could not be fetched.
    #[error(transparent)]
    Http(#[from] HttpError),
    /// The page is not UTF-8 text.
    #[error("the page is not UTF-8: {0}")]
    NotUtf8(#[from] std::str::Utf8Error),
    /// The page has none of the metrics used.
    #[error("the answer has no node_exporter CPU, memory or network metrics")]
    NoNodeMetrics,
}

/// The client scrapes share: TCP connects bounded by 2 s, one idle
/// keep-alive connection per exporter kept for 30 s.
pub fn client() -> HttpClient {
    HttpClient::new(HttpOptions { connect_timeout: Duration::from_secs(2), idle_per_host: 1, ..HttpOptions::default() })
}

/// One scrape of a node_exporter page (`GET uri`, 2xx, at most
/// [`MAX_PAGE`] bytes), all within `timeout`.
pub async fn scrape_node(client: &HttpClient, uri: &Uri, timeout: Duration) -> Result<NodeSample, ScrapeError> {
    let page = client.get(uri, USER_AGENT, &[(ACCEPT, ACCEPT_TEXT)], timeout, MAX_PAGE).await?;
    let sample = NodeSample::parse(std::str::from_utf8(&page)?);
    if sample.is_empty() {
        return Err(ScrapeError::NoNodeMetrics);
    }
    Ok(sample)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Answers each connection with `body` (status 200).
    async fn page_server(body: &'static [u8]) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
                let _ = conn.write_all(head.as_bytes()).await;
                let _ = conn.write_all(body).await;
            }
        });
        addr
    }

    const SECOND: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn a_page_is_scraped_and_read() {
        let addr = page_server(include_bytes!("../testdata/node-exporter-1.txt")).await;
        let uri: Uri = format!("http://{addr}/metrics").parse().expect("uri");
        let s = scrape_node(&client(), &uri, SECOND).await.expect("scrape");
        assert!(s.cpu_total_s.is_some() && s.mem_total.is_some() && s.net.is_some(), "{s:?}");
    }

    #[tokio::test]
    async fn pages_without_node_metrics_or_not_text_are_errors() {
        let addr = page_server(b"other_metric 1\n").await;
        let uri: Uri = format!("http://{addr}/metrics").parse().expect("uri");
        assert!(matches!(scrape_node(&client(), &uri, SECOND).await, Err(ScrapeError::NoNodeMetrics)));
        let addr = page_server(b"node_memory_MemTotal_bytes 1\n\xff\n").await;
        let uri: Uri = format!("http://{addr}/metrics").parse().expect("uri");
        assert!(matches!(scrape_node(&client(), &uri, SECOND).await, Err(ScrapeError::NotUtf8(_))));
        let uri: Uri = "http://127.0.0.1:1/metrics".parse().expect("uri");
        assert!(matches!(scrape_node(&client(), &uri, SECOND).await, Err(ScrapeError::Http(HttpError::Exchange(_)))));
    }
}

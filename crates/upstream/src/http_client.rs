//! The small HTTP/1.1 clients' shared helper: node_exporter scrapes, the
//! Prequal prober's plain probes, the reference distributor's metrics
//! scrapes and the autoscaler's webhook. Plain `http://` only (what those
//! endpoints speak); every exchange is bounded in time and in the size of
//! the answer read, and fails with a typed [`HttpError`].
//!
//! Requests to a service's backends that must follow its upstream settings
//! (TLS, HTTP/2) go through [`Profile::connect`](crate::Profile::connect)
//! instead.

use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, USER_AGENT};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

/// How a client connects and pools its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpOptions {
    /// A TCP connect taking longer fails.
    pub connect_timeout: Duration,
    /// Idle keep-alive connections kept per host.
    pub idle_per_host: usize,
    /// An idle connection is closed after this long.
    pub idle_timeout: Duration,
}

impl Default for HttpOptions {
    fn default() -> Self {
        HttpOptions { connect_timeout: Duration::from_secs(2), idle_per_host: 1, idle_timeout: Duration::from_secs(30) }
    }
}

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The URL is not an absolute `http://host[:port]/...` URL.
    #[error("bad URL {url:?}: {why}")]
    Url {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        why: String,
    },
    /// The request could not be built (a header value not allowed).
    #[error("building the request: {0}")]
    Build(#[source] http::Error),
    /// Connecting, sending or reading the answer's head failed; its
    /// [`source`](std::error::Error::source) chain says why.
    #[error(transparent)]
    Exchange(hyper_util::client::legacy::Error),
    /// Reading the answer's body failed.
    #[error("reading the answer")]
    Body(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The answer's body is larger than the limit.
    #[error("the answer is larger than {limit} bytes")]
    TooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// No complete answer within the time limit.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The answer's status is not a success (only from [`HttpClient::get`]).
    #[error("HTTP status {0}")]
    Status(StatusCode),
}

/// Parses an absolute `http://host[:port]/...` URL.
pub fn parse_http_url(url: &str) -> Result<Uri, HttpError> {
    let bad = |why: String| HttpError::Url { url: url.to_string(), why };
    let uri: Uri = url.parse().map_err(|e: http::uri::InvalidUri| bad(e.to_string()))?;
    if uri.scheme_str() != Some("http") || uri.authority().is_none() {
        return Err(bad("only http://host[:port]/... is supported".into()));
    }
    Ok(uri)
}

/// An HTTP/1.1 client with a keep-alive pool. Cloning is cheap and shares
/// the pool; building needs no runtime, exchanges run on tokio.
#[derive(Clone, Debug)]
pub struct HttpClient {
    inner: Client<HttpConnector, Full<Bytes>>,
}

impl HttpClient {
    /// A client with its own pool.
    pub fn new(options: HttpOptions) -> HttpClient {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(options.connect_timeout));
        connector.set_nodelay(true);
        let inner = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(options.idle_timeout)
            .pool_max_idle_per_host(options.idle_per_host)
            .pool_timer(TokioTimer::new())
            .build(connector);
        HttpClient { inner }
    }

    /// Sends `request` and answers the response's head, its body unread
    /// (for a caller that streams or discards it), within `timeout`.
    pub async fn head(
        &self,
        request: Request<Full<Bytes>>,
        timeout: Duration,
    ) -> Result<Response<Incoming>, HttpError> {
        tokio::time::timeout(timeout, self.inner.request(request))
            .await
            .map_err(|_| HttpError::Timeout(timeout))?
            .map_err(HttpError::Exchange)
    }

    /// Sends `request` and reads the whole answer, its body up to
    /// `max_body` bytes, all within `timeout`. Any status is an answer.
    pub async fn send(
        &self,
        request: Request<Full<Bytes>>,
        timeout: Duration,
        max_body: usize,
    ) -> Result<Response<Bytes>, HttpError> {
        let exchange = async {
            let response = self.inner.request(request).await.map_err(HttpError::Exchange)?;
            let (head, body) = response.into_parts();
            let body = Limited::new(body, max_body).collect().await.map_err(|e| {
                if e.is::<LengthLimitError>() {
                    HttpError::TooLarge { limit: max_body }
                } else {
                    HttpError::Body(e)
                }
            })?;
            Ok(Response::from_parts(head, body.to_bytes()))
        };
        tokio::time::timeout(timeout, exchange).await.map_err(|_| HttpError::Timeout(timeout))?
    }

    /// `GET uri` with `User-Agent: user_agent` and the `headers` given;
    /// answers the body of a 2xx answer (else [`HttpError::Status`]), read
    /// up to `max_body` bytes, all within `timeout`.
    pub async fn get(
        &self,
        uri: &Uri,
        user_agent: &'static str,
        headers: &[(HeaderName, &'static str)],
        timeout: Duration,
        max_body: usize,
    ) -> Result<Bytes, HttpError> {
        let mut request = Request::builder().method(Method::GET).uri(uri.clone());
        if let Some(h) = request.headers_mut() {
            h.insert(USER_AGENT, HeaderValue::from_static(user_agent));
            for (name, value) in headers {
                h.insert(name.clone(), HeaderValue::from_static(value));
            }
        }
        let request = request.body(Full::new(Bytes::new())).map_err(HttpError::Build)?;
        let response = self.send(request, timeout, max_body).await?;
        if !response.status().is_success() {
            return Err(HttpError::Status(response.status()));
        }
        Ok(response.into_body())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorChain;
    use http::header::ACCEPT;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// Answers every connection once with `answer` (after reading the head),
    /// or never when `answer` is `None`; sends each request head seen on `seen`.
    async fn server(answer: Option<String>) -> (std::net::SocketAddr, tokio::sync::mpsc::UnboundedReceiver<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let (answer, tx) = (answer.clone(), tx.clone());
                tokio::spawn(async move {
                    let mut seen = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                    }
                    let _ = tx.send(String::from_utf8_lossy(&seen).into_owned());
                    match answer {
                        Some(a) => {
                            let _ = conn.write_all(a.as_bytes()).await;
                        }
                        None => std::future::pending::<()>().await,
                    }
                });
            }
        });
        (addr, rx)
    }

    fn ok(body: &str) -> Option<String> {
        Some(format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()))
    }

    const SECOND: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn get_reads_the_body_and_sends_the_headers() {
        let (addr, mut seen) = server(ok("hello")).await;
        let client = HttpClient::new(HttpOptions::default());
        let uri = parse_http_url(&format!("http://{addr}/metrics")).expect("url");
        let body = client.get(&uri, "tidegate-test", &[(ACCEPT, "text/plain")], SECOND, 5).await.expect("get");
        assert_eq!(&body[..], b"hello");
        let head = seen.recv().await.expect("head").to_ascii_lowercase();
        assert!(head.starts_with("get /metrics http/1.1\r\n"), "{head}");
        assert!(head.contains("user-agent: tidegate-test\r\n") && head.contains("accept: text/plain\r\n"), "{head}");
    }

    #[tokio::test]
    async fn failures_are_typed() {
        let client = HttpClient::new(HttpOptions::default());
        let (addr, _seen) = server(ok("hello")).await;
        let uri = parse_http_url(&format!("http://{addr}/")).expect("url");
        let e = client.get(&uri, "t", &[], SECOND, 4).await.expect_err("too large");
        assert!(matches!(e, HttpError::TooLarge { limit: 4 }), "{e:?}");

        let (addr, _seen) = server(Some("HTTP/1.1 503 No\r\nContent-Length: 0\r\n\r\n".into())).await;
        let uri = parse_http_url(&format!("http://{addr}/")).expect("url");
        let e = client.get(&uri, "t", &[], SECOND, 4).await.expect_err("status");
        assert!(matches!(e, HttpError::Status(StatusCode::SERVICE_UNAVAILABLE)), "{e:?}");
        let request = Request::get(uri.clone()).body(Full::new(Bytes::new())).expect("request");
        let answer = client.send(request, SECOND, 4).await.expect("any status is an answer");
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);

        let (addr, _seen) = server(None).await;
        let uri = parse_http_url(&format!("http://{addr}/")).expect("url");
        let e = client.get(&uri, "t", &[], Duration::from_millis(100), 4).await.expect_err("silent");
        assert!(matches!(e, HttpError::Timeout(_)), "{e:?}");

        let uri = parse_http_url("http://127.0.0.1:1/").expect("url");
        let e = client.get(&uri, "t", &[], SECOND, 4).await.expect_err("refused");
        let text = ErrorChain(&e).to_string();
        assert!(matches!(e, HttpError::Exchange(_)) && text.contains("onnect"), "{text}");

        for url in ["https://127.0.0.1/", "not a url", "/relative", ""] {
            assert!(matches!(parse_http_url(url), Err(HttpError::Url { .. })), "{url}");
        }
    }
}

//! One probe: an HTTP `GET` or a TCP connect, bounded by the check's timeout.
//!
//! A probe reaches the backend as the service's requests do: over TLS with
//! the same trust settings, and in HTTP/2 when the service speaks it.
//! Plain HTTP/1.1 probes share a keep-alive pool; the others open a
//! connection per probe, so every TLS probe also checks the handshake.

use std::time::Duration;

use bytes::Bytes;
use http::header::{HOST, USER_AGENT};
use http::{Request, Uri};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tidegate_model::{ActiveCheck, BackendAddr, CheckKind, UpstreamProtocol};
use tidegate_upstream::{ConnectError, ErrorChain, Profile};

/// The `User-Agent` of HTTP probes.
pub const PROBE_USER_AGENT: &str = "tidegate-health";

/// At most this much of a probe response's body is read (and discarded);
/// past it the connection is dropped instead of being reused.
pub const MAX_PROBE_BODY: usize = 64 * 1024;

/// Idle pooled connections older than this are not reused. Kept below the
/// idle timeouts common on backends (gunicorn 2 s, Node.js and Apache 5 s),
/// so that a probe rarely meets a connection the backend is just closing,
/// which would count as a failure that the backend did not cause.
const POOL_IDLE: Duration = Duration::from_millis(1_500);

/// The HTTP client shared by all probes: one connection pool, keep-alive.
/// Cloning is cheap and shares the pool.
#[derive(Clone, Debug)]
pub struct ProbeClient {
    http: Client<HttpConnector, Empty<Bytes>>,
}

impl ProbeClient {
    /// A client with its own connection pool. Needs no runtime to be built;
    /// probes must run on a tokio runtime.
    pub fn new() -> ProbeClient {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let http = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE)
            .pool_max_idle_per_host(4)
            .pool_timer(TokioTimer::new())
            .build(connector);
        ProbeClient { http }
    }
}

impl Default for ProbeClient {
    fn default() -> Self {
        ProbeClient::new()
    }
}

/// The result of one probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Whether the probe passed.
    pub passed: bool,
    /// What was seen, for logs: `status 200`, `unexpected status 503`,
    /// `timed out after 1000 ms`, a connect error...
    pub detail: String,
}

impl Verdict {
    fn pass(detail: impl Into<String>) -> Verdict {
        Verdict { passed: true, detail: detail.into() }
    }

    fn fail(detail: impl Into<String>) -> Verdict {
        Verdict { passed: false, detail: detail.into() }
    }
}

/// Whether an HTTP status passes a check: one of `expect`, or any 2xx or
/// 3xx when `expect` is empty.
pub fn status_expected(status: u16, expect: &[u16]) -> bool {
    if expect.is_empty() {
        (200..400).contains(&status)
    } else {
        expect.contains(&status)
    }
}

/// Probes `addr` once as `check` says, within `check.timeout_ms`, reaching
/// it as `upstream` says.
///
/// HTTP: `GET {scheme}://{addr}{path}` with `Host: {addr}` and
/// `User-Agent: tidegate-health`; passes on an expected status, once the
/// body (up to [`MAX_PROBE_BODY`]) has been read, all within the timeout.
/// TCP: passes when a connection opens within the timeout (and, for a TLS
/// service, its handshake succeeds).
pub async fn probe(client: &ProbeClient, addr: &BackendAddr, upstream: &Profile, check: &ActiveCheck) -> Verdict {
    let limit = Duration::from_millis(check.timeout_ms);
    let plain = upstream.is_plain_http1();
    let verdict = match check.kind {
        CheckKind::Http if plain => tokio::time::timeout(limit, http_probe(client, addr, check)).await,
        CheckKind::Http => tokio::time::timeout(limit, profile_probe(addr, upstream, check, limit)).await,
        CheckKind::Tcp if plain => tokio::time::timeout(limit, tcp_probe(addr)).await,
        CheckKind::Tcp => {
            tokio::time::timeout(limit, async {
                match upstream.connect(addr, limit).await {
                    Ok(_) => Verdict::pass("connected"),
                    Err(e) => Verdict::fail(format!("connect: {e}")),
                }
            })
            .await
        }
    };
    verdict.unwrap_or_else(|_| Verdict::fail(format!("timed out after {} ms", check.timeout_ms)))
}

/// An HTTP probe on a connection of its own, opened as `upstream` says.
async fn profile_probe(addr: &BackendAddr, upstream: &Profile, check: &ActiveCheck, limit: Duration) -> Verdict {
    match get_via(addr, upstream, &check.path, PROBE_USER_AGENT, limit).await {
        Ok(response) => judge(response, check).await,
        Err(e) => Verdict::fail(e.to_string()),
    }
}

/// Why [`get_via`] got no response head.
#[derive(Debug, thiserror::Error)]
pub enum GetError {
    /// The connection (TCP, TLS) could not be opened.
    #[error("connect: {0}")]
    Connect(#[source] ConnectError),
    /// The request could not be built from the path.
    #[error("invalid probe request: {0}")]
    Request(#[source] http::Error),
    /// The exchange failed: the handshake, sending, or reading the head.
    #[error("{}", ErrorChain(.0))]
    Exchange(hyper::Error),
}

/// Sends `GET path` (with `user_agent`) to `addr` on a connection of its
/// own, opened as `upstream` says: TCP or TLS, HTTP/1.1 or HTTP/2, as the
/// service's requests go; `limit` bounds the connect. Returns the response
/// head, its body still to read, or why there is none.
pub async fn get_via(
    addr: &BackendAddr,
    upstream: &Profile,
    path: &str,
    user_agent: &'static str,
    limit: Duration,
) -> Result<http::Response<Incoming>, GetError> {
    let stream = TokioIo::new(upstream.connect(addr, limit).await.map_err(GetError::Connect)?);
    // HTTP/1.1 sends the origin form and `Host`; HTTP/2 the absolute form
    // (its `:scheme` and `:authority`).
    let request = match upstream.protocol() {
        UpstreamProtocol::Http1 => Request::get(path).header(HOST, addr.as_str()),
        UpstreamProtocol::Http2 => Request::get(format!("{}://{}{}", upstream.scheme(), addr.as_str(), path)),
    };
    let request = request.header(USER_AGENT, user_agent).body(Empty::<Bytes>::new()).map_err(GetError::Request)?;
    let sent = match upstream.protocol() {
        UpstreamProtocol::Http1 => match hyper::client::conn::http1::handshake(stream).await {
            Ok((mut sender, conn)) => {
                tokio::spawn(conn);
                sender.send_request(request).await
            }
            Err(e) => Err(e),
        },
        UpstreamProtocol::Http2 => match hyper::client::conn::http2::handshake(TokioExecutor::new(), stream).await {
            Ok((mut sender, conn)) => {
                tokio::spawn(conn);
                sender.send_request(request).await
            }
            Err(e) => Err(e),
        },
    };
    sent.map_err(GetError::Exchange)
}

async fn http_probe(client: &ProbeClient, addr: &BackendAddr, check: &ActiveCheck) -> Verdict {
    let uri = match Uri::try_from(format!("http://{}{}", addr.as_str(), check.path)) {
        Ok(uri) => uri,
        Err(e) => return Verdict::fail(format!("invalid probe URI: {e}")),
    };
    let request =
        Request::get(uri).header(HOST, addr.as_str()).header(USER_AGENT, PROBE_USER_AGENT).body(Empty::<Bytes>::new());
    let request = match request {
        Ok(r) => r,
        Err(e) => return Verdict::fail(format!("invalid probe request: {e}")),
    };
    match client.http.request(request).await {
        Ok(r) => judge(r, check).await,
        Err(e) => Verdict::fail(ErrorChain(&e).to_string()),
    }
}

/// Reads a probe's response and judges its status.
async fn judge(response: http::Response<Incoming>, check: &ActiveCheck) -> Verdict {
    let status = response.status().as_u16();
    if let Err(e) = drain(response.into_body(), MAX_PROBE_BODY).await {
        return Verdict::fail(format!("status {status}, then reading the body: {}", ErrorChain(&e)));
    }
    if status_expected(status, &check.expect_status) {
        Verdict::pass(format!("status {status}"))
    } else {
        Verdict::fail(format!("unexpected status {status}"))
    }
}

/// Reads and discards up to about `limit` bytes of `body`.
async fn drain(mut body: Incoming, limit: usize) -> Result<(), hyper::Error> {
    let mut seen = 0usize;
    while let Some(frame) = body.frame().await {
        if let Some(data) = frame?.data_ref() {
            seen = seen.saturating_add(data.len());
            if seen > limit {
                break;
            }
        }
    }
    Ok(())
}

async fn tcp_probe(addr: &BackendAddr) -> Verdict {
    match tokio::net::TcpStream::connect(addr.as_str()).await {
        Ok(_) => Verdict::pass("connected"),
        Err(e) => Verdict::fail(format!("connect: {e}")),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpListener;

    fn check(kind: CheckKind, timeout_ms: u64) -> ActiveCheck {
        ActiveCheck { kind, path: "/".into(), expect_status: vec![], interval_ms: 1_000, timeout_ms, rise: 1, fall: 1 }
    }

    /// A port that refuses connections: bound, never listening, and held
    /// by the socket returned (a released port could be a listener of a
    /// test running beside by the time it is probed).
    pub(crate) fn closed_port() -> (tokio::net::TcpSocket, BackendAddr) {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = BackendAddr::new(&socket.local_addr().unwrap().to_string()).unwrap();
        (socket, addr)
    }

    #[test]
    fn expected_statuses() {
        for ok in [200, 204, 301, 399] {
            assert!(status_expected(ok, &[]), "{ok}");
        }
        for bad in [100, 199, 400, 404, 500, 503] {
            assert!(!status_expected(bad, &[]), "{bad}");
        }
        assert!(status_expected(503, &[200, 503]));
        assert!(!status_expected(200, &[204]));
        assert!(!status_expected(302, &[200]));
    }

    #[tokio::test]
    async fn tcp_probe_passes_on_an_open_port_and_fails_on_a_closed_one() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let open = BackendAddr::new(&listener.local_addr().unwrap().to_string()).unwrap();
        let client = ProbeClient::new();
        let v = probe(&client, &open, &Profile::default(), &check(CheckKind::Tcp, 500)).await;
        assert!(v.passed, "{v:?}");
        let (_held, closed) = closed_port();
        let v = probe(&client, &closed, &Profile::default(), &check(CheckKind::Tcp, 500)).await;
        assert!(!v.passed);
        assert!(v.detail.starts_with("connect: "), "{v:?}");
    }

    #[tokio::test]
    async fn http_probe_fails_on_refusal_and_on_silence() {
        let client = ProbeClient::new();
        let (_held, closed) = closed_port();
        let v = probe(&client, &closed, &Profile::default(), &check(CheckKind::Http, 500)).await;
        assert!(!v.passed);
        assert!(v.detail.contains("refused"), "{v:?}");

        // A backend that accepts and reads but never answers.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let silent = BackendAddr::new(&listener.local_addr().unwrap().to_string()).unwrap();
        let server = tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut sink = vec![0u8; 1024];
            while conn.read(&mut sink).await.is_ok_and(|n| n > 0) {}
        });
        let v = probe(&client, &silent, &Profile::default(), &check(CheckKind::Http, 50)).await;
        assert_eq!(v, Verdict::fail("timed out after 50 ms"));
        server.abort();
    }

    #[tokio::test]
    async fn get_via_says_which_step_failed() {
        let (_held, closed) = closed_port();
        let e = get_via(&closed, &Profile::default(), "/", PROBE_USER_AGENT, Duration::from_millis(500)).await;
        assert!(matches!(e, Err(GetError::Connect(ConnectError::Failed(_)))), "{e:?}");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let open = BackendAddr::new(&listener.local_addr().unwrap().to_string()).unwrap();
        let e = get_via(&open, &Profile::default(), "no path", PROBE_USER_AGENT, Duration::from_millis(500)).await;
        assert!(matches!(e, Err(GetError::Request(_))), "{e:?}");
    }
}

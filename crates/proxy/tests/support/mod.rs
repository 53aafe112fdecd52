//! The loopback harness of `engines_inprocess.rs`: the data plane started
//! in-process through the crate's public API, in-process backends on
//! ephemeral ports of 127.0.0.1, and clients that speak raw HTTP/1.1 or
//! h2c (prior knowledge, through hyper's client).
//!
//! Everything a test starts is dropped at its end: a backend's tasks are
//! aborted with it, and [`Proxy::stop`] shuts the data plane down.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tidegate_model::{parse_change_set, ConfigState};
use tidegate_proxy::{serve, Http1Engine, Limits, ProxyMetrics, RuntimeMode, ServerHandle, ServerOptions};
use tidegate_snapshot::Snapshot;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

/// How long any one read or exchange may take before a test gives up on
/// it. Only reached when something is broken.
pub const DEADLINE: Duration = Duration::from_secs(5);

/// The data plane, started in-process on an ephemeral port of 127.0.0.1.
pub struct Proxy {
    handle: Option<ServerHandle>,
    /// Where clients connect.
    pub addr: SocketAddr,
}

impl Proxy {
    /// Starts one worker of `engine` with `limits`, serving the
    /// configuration `changes` (a change set as `POST /v1/changes` takes
    /// it), built as the binary builds it: parsed and checked, applied to
    /// an empty configuration, its static roots checked, and made a
    /// snapshot.
    pub fn start(engine: Http1Engine, limits: Limits, changes: serde_json::Value) -> Proxy {
        let bytes = serde_json::to_vec(&changes).expect("a change set encodes");
        let cs = parse_change_set(&bytes).unwrap_or_else(|e| panic!("the test's change set is refused: {e}"));
        let (state, _) = ConfigState::default().apply(&cs, 1).expect("the test's change set applies");
        for route in state.routes().values() {
            if let tidegate_model::RouteAction::Static(dir) = &route.action {
                tidegate_model::check_static_root(&dir.root, &[]).expect("a servable static root");
            }
        }
        let snapshots = Arc::new(ArcSwap::from_pointee(Snapshot::from_state(&state, 1)));
        let opts = ServerOptions {
            listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            listen_tls: None,
            workers: 1,
            // Per-core mode binds an ephemeral port twice (a probe without
            // `SO_REUSEPORT`, then the worker's listener with it): a bind
            // of port 0 elsewhere in the meantime, such as a backend of a
            // case running beside this one, could take it. One runtime
            // binds once.
            mode: RuntimeMode::MultiThread,
            http1: engine,
            limits,
            drain_timeout: Duration::from_secs(2),
            health_path: None,
            access_log: None,
            on_demand: None,
            tracing: None,
            listener_changes: None,
            listener_board: Default::default(),
            named_sockets: Default::default(),
            http3: None,
        };
        let handle = serve(opts, snapshots, Arc::new(ProxyMetrics::default())).expect("the data plane starts");
        let addr = handle.local_addr().expect("a plain listener");
        Proxy { handle: Some(handle), addr }
    }

    /// Stops accepting, lets open connections finish, and waits for the
    /// worker thread.
    pub async fn stop(mut self) {
        if let Some(h) = self.handle.take() {
            tokio::task::spawn_blocking(move || h.shutdown()).await.expect("the shutdown completes");
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        // A test that panicked before `stop`: shut down off the runtime.
        if let Some(h) = self.handle.take() {
            std::thread::spawn(move || h.shutdown());
        }
    }
}

/// A change set with one service per `(name, backend addresses)` and a
/// route `/{name}` to it, plus `extra` operations.
pub fn config(services: &[(&str, &[SocketAddr])], extra: Vec<serde_json::Value>) -> serde_json::Value {
    let mut ops: Vec<_> =
        services.iter().flat_map(|(name, addrs)| service(name, addrs, serde_json::json!({}))).collect();
    ops.extend(extra);
    serde_json::json!({ "ops": ops })
}

/// The operations that put service `name` (round robin over `addrs`, ids
/// `b0`, `b1`..., with `settings`' fields besides) and a route `/{name}`
/// to it.
pub fn service(name: &str, addrs: &[SocketAddr], settings: serde_json::Value) -> [serde_json::Value; 2] {
    let backends: Vec<_> = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| serde_json::json!({ "id": format!("b{i}"), "addr": a.to_string() }))
        .collect();
    let mut spec = serde_json::json!({ "policy": { "kind": "round_robin" }, "backends": backends });
    if let (Some(spec), serde_json::Value::Object(more)) = (spec.as_object_mut(), settings) {
        spec.extend(more);
    }
    [
        serde_json::json!({ "op": "put_service", "name": name, "spec": spec }),
        serde_json::json!({
            "op": "put_route", "name": name,
            "spec": { "match": { "path_prefix": format!("/{name}") }, "service": name },
        }),
    ]
}

/// Polls `check` until it holds; panics past [`DEADLINE`].
pub async fn wait_until(what: &str, check: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !check() {
        assert!(tokio::time::Instant::now() < deadline, "{what}: not within {DEADLINE:?}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A port that refuses connections: bound, never listening, and kept
/// bound while this lives, so that no listener of a case running beside
/// can take it (a released port could be given to the next bind).
pub struct DownPort {
    _socket: tokio::net::TcpSocket,
    /// The port's address.
    pub addr: SocketAddr,
}

impl DownPort {
    /// Binds one.
    pub fn new() -> DownPort {
        let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
        socket.bind(SocketAddr::from(([127, 0, 0, 1], 0))).expect("bind");
        let addr = socket.local_addr().expect("local address");
        DownPort { _socket: socket, addr }
    }
}

// ---------------------------------------------------------------------------
// Backends.

/// What a backend received.
#[derive(Debug, Clone)]
pub struct Seen {
    /// Method.
    pub method: String,
    /// Path and query.
    pub uri: String,
    /// Headers.
    pub headers: HeaderMap,
    /// The body, whole.
    pub body: Bytes,
}

impl Seen {
    /// A header as the backend got it, `-` when absent, values joined by
    /// `, ` when repeated.
    pub fn header(&self, name: &str) -> String {
        let values: Vec<_> = self.headers.get_all(name).iter().map(|v| String::from_utf8_lossy(v.as_bytes())).collect();
        if values.is_empty() {
            "-".to_string()
        } else {
            values.join(", ")
        }
    }
}

/// How a [`HyperBackend`] answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    /// `200`: the request body echoed, or `hello` when it had none, with
    /// the `Content-Type` the request's `X-Content-Type` names; an upgrade
    /// request (`Upgrade` header) gets `101` and its bytes echoed.
    Echo,
    /// `503 busy` to everything (a backend shedding load).
    Shed,
}

/// A hyper HTTP/1.1 backend that records every request it reads.
pub struct HyperBackend {
    /// Where it listens.
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: tokio::task::JoinHandle<()>,
}

impl HyperBackend {
    /// Starts a backend named `name` (sent back in `x-backend`).
    pub async fn start(name: &'static str, behaviour: Behaviour) -> HyperBackend {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local address");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        let task = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            while let Ok((stream, _)) = listener.accept().await {
                let record = record.clone();
                conns.spawn(async move {
                    let svc = service_fn(move |req| answer(name, behaviour, record.clone(), req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .with_upgrades()
                        .await;
                });
            }
        });
        HyperBackend { addr, seen, task }
    }

    /// What it received so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("not poisoned").clone()
    }
}

impl Drop for HyperBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn answer(
    name: &'static str,
    behaviour: Behaviour,
    record: Arc<Mutex<Vec<Seen>>>,
    mut req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let upgrade = req.headers().contains_key(http::header::UPGRADE);
    let on_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (parts, body) = req.into_parts();
    // The body is read whole before answering (upgrades have none).
    let body = if upgrade { Bytes::new() } else { body.collect().await.map(|c| c.to_bytes()).unwrap_or_default() };
    record.lock().expect("not poisoned").push(Seen {
        method: parts.method.to_string(),
        uri: parts.uri.path_and_query().map_or("", |p| p.as_str()).to_string(),
        headers: parts.headers.clone(),
        body: body.clone(),
    });
    let mut resp = match (behaviour, on_upgrade) {
        (Behaviour::Shed, _) => {
            let mut r = Response::new(Full::new(Bytes::from_static(b"busy\n")));
            *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            r
        }
        (Behaviour::Echo, Some(on_upgrade)) => {
            tokio::spawn(async move {
                if let Ok(up) = on_upgrade.await {
                    let mut io = TokioIo::new(up);
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = io.read(&mut buf).await {
                        if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                }
            });
            let mut r = Response::new(Full::new(Bytes::new()));
            *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
            r.headers_mut().insert(http::header::CONNECTION, http::HeaderValue::from_static("upgrade"));
            if let Some(v) = parts.headers.get(http::header::UPGRADE) {
                r.headers_mut().insert(http::header::UPGRADE, v.clone());
            }
            r
        }
        (Behaviour::Echo, None) if body.is_empty() => Response::new(Full::new(Bytes::from_static(b"hello"))),
        (Behaviour::Echo, None) => Response::new(Full::new(body)),
    };
    resp.headers_mut().insert("x-backend", http::HeaderValue::from_static(name));
    // A test's knob: the answer's `Content-Type`.
    if let Some(ct) = parts.headers.get("x-content-type") {
        resp.headers_mut().insert(http::header::CONTENT_TYPE, ct.clone());
    }
    Ok(resp)
}

/// How a [`RawBackend`] answers bodiless requests, written by hand for
/// what hyper's server does not produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Script {
    /// By path: `/…/chunked`: chunks with an extension and a trailer;
    /// `/…/garbage`: not HTTP; `/…/switch`: `101` to any request;
    /// `/…/both`: `Content-Length` and chunked; `/…/silent`: no answer;
    /// `/…/early`: `103 Early Hints`, then `200 ok`; `/…/short` and
    /// `/…/shortchunks`: a body cut short by the close (framed by length,
    /// chunked);
    /// `/…/close`: no length (the body ends with the connection);
    /// `/…/big`: [`BIG`] bytes by length; `/…/pieces`: [`PIECES`] bytes by
    /// length, sent in three writes a moment apart (the head with the
    /// first piece); `/…/hop`: hop-by-hop response
    /// headers; anything else: `200 fine` by length. Keep-alive.
    Framings,
    /// Answers the first request of each connection (`200 fine`, kept
    /// alive), then closes the connection when the second arrives, without
    /// answering: a pooled connection the backend closed.
    CloseSecond,
    /// Closes every connection as soon as it is accepted.
    Refuse,
}

/// The length of `/…/big` (1 MiB of `x`).
pub const BIG: usize = 1024 * 1024;
/// The length of `/…/pieces` (40 KiB of `y`).
pub const PIECES: usize = 40 * 1024;

/// A backend written by hand on a tokio listener.
pub struct RawBackend {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Connections accepted.
    pub connections: Arc<AtomicUsize>,
    /// Request heads read.
    pub requests: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl RawBackend {
    /// Starts it.
    pub async fn start(script: Script) -> RawBackend {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local address");
        let (connections, requests) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (c, r) = (connections.clone(), requests.clone());
        let task = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            while let Ok((stream, _)) = listener.accept().await {
                c.fetch_add(1, Ordering::SeqCst);
                if script == Script::Refuse {
                    drop(stream);
                    continue;
                }
                conns.spawn(raw_serve(stream, script, r.clone()));
            }
        });
        RawBackend { addr, connections, requests, task }
    }
}

impl Drop for RawBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn raw_serve(mut s: TcpStream, script: Script, requests: Arc<AtomicUsize>) {
    let mut buf = Vec::new();
    let mut on_this_connection = 0;
    loop {
        let Some(end) = read_head(&mut s, &mut buf).await else { return };
        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
        buf.drain(..end);
        requests.fetch_add(1, Ordering::SeqCst);
        on_this_connection += 1;
        let line = head.lines().next().unwrap_or("");
        let is_head = line.starts_with("HEAD ");
        let path = line.split(' ').nth(1).unwrap_or("");
        let reply: Vec<u8> = match script {
            Script::CloseSecond if on_this_connection > 1 => return,
            Script::Framings if path.ends_with("/chunked") => b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
                  5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nx-trailer: t\r\n\r\n"
                .to_vec(),
            Script::Framings if path.ends_with("/close") => {
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\nuntil close").await;
                return;
            }
            Script::Framings if path.ends_with("/garbage") => {
                let _ = s.write_all(b"NOT HTTP AT ALL\r\n\r\n").await;
                return;
            }
            Script::Framings if path.ends_with("/switch") => {
                b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: x\r\n\r\n".to_vec()
            }
            Script::Framings if path.ends_with("/both") => b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\
                  transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
                .to_vec(),
            Script::Framings if path.ends_with("/silent") => {
                // Never answers; holds the connection until the proxy or
                // the end of the test closes it.
                let mut sink = [0u8; 1024];
                while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
                return;
            }
            Script::Framings if path.ends_with("/early") => b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>\r\n\r\n\
                  HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
                .to_vec(),
            Script::Framings if path.ends_with("/short") => {
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten..").await;
                return;
            }
            Script::Framings if path.ends_with("/shortchunks") => {
                let _ =
                    s.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n10\r\nonly").await;
                return;
            }
            Script::Framings if path.ends_with("/big") => {
                let mut r = format!("HTTP/1.1 200 OK\r\ncontent-length: {BIG}\r\n\r\n").into_bytes();
                if !is_head {
                    r.resize(r.len() + BIG, b'x');
                }
                r
            }
            Script::Framings if path.ends_with("/pieces") => {
                let mut first = format!("HTTP/1.1 200 OK\r\ncontent-length: {PIECES}\r\n\r\n").into_bytes();
                first.resize(first.len() + PIECES / 4, b'y');
                for piece in [&first[..], &[b'y'; PIECES / 2][..]] {
                    if s.write_all(piece).await.is_err() {
                        return;
                    }
                    // (The proxy may or may not have read the piece before
                    // the next comes: the answer is the same either way.)
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
                vec![b'y'; PIECES / 4]
            }
            Script::Framings if path.ends_with("/hop") => b"HTTP/1.1 200 OK\r\nconnection: x-secret\r\n\
                  x-secret: 1\r\nkeep-alive: timeout=5\r\nx-kept: 1\r\ncontent-length: 2\r\n\r\nok"
                .to_vec(),
            _ if is_head => b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n".to_vec(),
            _ => b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nfine".to_vec(),
        };
        if s.write_all(&reply).await.is_err() {
            return;
        }
    }
}

/// Reads until `buf` holds a whole head; returns its length.
async fn read_head(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<usize> {
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some(p + 4);
        }
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

// ---------------------------------------------------------------------------
// Clients.

/// A response as a client got it.
#[derive(Debug, Clone, Default)]
pub struct Reply {
    /// `HTTP/1.1`, `HTTP/1.0` or `HTTP/2`.
    pub version: String,
    /// Status code.
    pub status: u16,
    /// Headers, names lowercase, in order.
    pub headers: Vec<(String, String)>,
    /// The body, decoded from its framing.
    pub body: Vec<u8>,
    /// The body broke off: the connection ended (or the HTTP/2 stream was
    /// reset) before its framing said it was complete.
    pub cut: bool,
}

impl Reply {
    /// A header's value, `-` when absent, values joined by `, `.
    pub fn header(&self, name: &str) -> String {
        let values: Vec<_> = self.headers.iter().filter(|(n, _)| n == name).map(|(_, v)| v.as_str()).collect();
        if values.is_empty() {
            "-".to_string()
        } else {
            values.join(", ")
        }
    }
}

/// A request, sent over HTTP/1.1 or HTTP/2 alike.
#[derive(Debug, Clone)]
pub struct Req {
    /// Method.
    pub method: &'static str,
    /// Path and query.
    pub path: String,
    /// `Host` (HTTP/1.1) or the authority (HTTP/2).
    pub host: &'static str,
    /// More headers.
    pub headers: Vec<(&'static str, String)>,
    /// The body (sent with a `Content-Length` when not empty, or for POST).
    pub body: Vec<u8>,
}

impl Req {
    /// A bodiless request.
    pub fn new(method: &'static str, path: &str) -> Req {
        Req { method, path: path.to_string(), host: "app.test", headers: Vec::new(), body: Vec::new() }
    }

    /// With a header.
    pub fn header(mut self, name: &'static str, value: &str) -> Req {
        self.headers.push((name, value.to_string()));
        self
    }

    /// With a body.
    pub fn body(mut self, body: impl Into<Vec<u8>>) -> Req {
        self.body = body.into();
        self
    }

    /// With a host.
    pub fn host(mut self, host: &'static str) -> Req {
        self.host = host;
        self
    }

    /// The request in HTTP/1.1 bytes, closing the connection after it.
    pub fn h1_bytes(&self) -> Vec<u8> {
        let mut out = format!("{} {} HTTP/1.1\r\nhost: {}\r\n", self.method, self.path, self.host).into_bytes();
        for (n, v) in &self.headers {
            out.extend_from_slice(format!("{n}: {v}\r\n").as_bytes());
        }
        if !self.body.is_empty() || self.method == "POST" {
            out.extend_from_slice(format!("content-length: {}\r\n", self.body.len()).as_bytes());
        }
        out.extend_from_slice(b"connection: close\r\n\r\n");
        out.extend_from_slice(&self.body);
        out
    }
}

/// Sends `req` on a new HTTP/1.1 connection and reads one response.
pub async fn h1(addr: SocketAddr, req: &Req) -> Reply {
    let mut s = connect(addr).await;
    s.write_all(&req.h1_bytes()).await.expect("the request is written");
    read_reply(&mut s, &mut Vec::new(), req.method == "HEAD").await
}

/// Sends raw bytes on a new connection and reads one response
/// (`head`: it answers a HEAD request).
pub async fn h1_raw(addr: SocketAddr, bytes: &[u8], head: bool) -> Reply {
    let mut s = connect(addr).await;
    s.write_all(bytes).await.expect("the request is written");
    read_reply(&mut s, &mut Vec::new(), head).await
}

/// A TCP connection to `addr`.
pub async fn connect(addr: SocketAddr) -> TcpStream {
    tokio::time::timeout(DEADLINE, TcpStream::connect(addr)).await.expect("connects in time").expect("connects")
}

/// Sends `req` over h2c with prior knowledge (hyper's client).
pub async fn h2(addr: SocketAddr, req: &Req) -> Reply {
    h2_with_body(addr, req, req.body.len(), Full::new(Bytes::from(req.body.clone()))).await
}

/// Sends `req`'s head over h2c with prior knowledge, declaring a body of
/// `length` bytes (for a POST or when not 0), and `body` as its body.
pub async fn h2_with_body<B>(addr: SocketAddr, req: &Req, length: usize, body: B) -> Reply
where
    B: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let io = TokioIo::new(connect(addr).await);
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await.expect("the HTTP/2 handshake");
    let driver = tokio::spawn(conn);
    let mut r = Request::builder().method(req.method).uri(format!("http://{}{}", req.host, req.path));
    for (n, v) in &req.headers {
        r = r.header(*n, v.as_str());
    }
    if length > 0 || req.method == "POST" {
        r = r.header("content-length", length);
    }
    let r = r.body(body).expect("a valid request");
    let reply = match tokio::time::timeout(DEADLINE, send.send_request(r)).await {
        Err(_) => Reply { status: 0, body: b"<no response in time>".to_vec(), ..Reply::default() },
        Ok(Err(e)) => Reply { status: 0, body: format!("<{e}>").into_bytes(), ..Reply::default() },
        Ok(Ok(resp)) => {
            let (parts, body) = resp.into_parts();
            let headers = parts
                .headers
                .iter()
                .map(|(n, v)| (n.to_string(), String::from_utf8_lossy(v.as_bytes()).into()))
                .collect();
            let (body, cut) = match tokio::time::timeout(DEADLINE, body.collect()).await {
                Ok(Ok(b)) => (b.to_bytes().to_vec(), false),
                Ok(Err(_)) => (Vec::new(), true),
                Err(_) => (b"<no body in time>".to_vec(), false),
            };
            Reply { version: "HTTP/2".into(), status: parts.status.as_u16(), headers, body, cut }
        }
    };
    drop(send);
    driver.abort();
    reply
}

/// A request body that yields one piece, then nothing, ever (a client
/// that stalls).
pub struct Stalling(pub Option<Bytes>);

impl http_body::Body for Stalling {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        match self.0.take() {
            Some(piece) => std::task::Poll::Ready(Some(Ok(http_body::Frame::data(piece)))),
            None => std::task::Poll::Pending,
        }
    }
}

/// Reads one response from `s` (`buf`: bytes already read past the last
/// one), its body decoded by its framing. A broken or missing response is
/// status 0 and what was read.
pub async fn read_reply(s: &mut TcpStream, buf: &mut Vec<u8>, head_request: bool) -> Reply {
    match tokio::time::timeout(DEADLINE, read_reply_inner(s, buf, head_request)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => Reply {
            status: 0,
            body: format!("<{e}: {}>", String::from_utf8_lossy(buf)).into_bytes(),
            ..Reply::default()
        },
        Err(_) => Reply { status: 0, body: b"<no response in time>".to_vec(), ..Reply::default() },
    }
}

async fn fill(s: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<usize> {
    let mut chunk = [0u8; 16 * 1024];
    let n = s.read(&mut chunk).await?;
    buf.extend_from_slice(&chunk[..n]);
    Ok(n)
}

fn eof(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::UnexpectedEof, format!("closed {what}"))
}

async fn read_reply_inner(s: &mut TcpStream, buf: &mut Vec<u8>, head_request: bool) -> std::io::Result<Reply> {
    let end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
        if fill(s, buf).await? == 0 {
            return Err(eof("before a whole response head"));
        }
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    buf.drain(..end);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or("").to_string();
    let status = parts.next().and_then(|c| c.parse().ok()).unwrap_or(0);
    let headers: Vec<(String, String)> = lines
        .filter(|l| !l.is_empty())
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut reply = Reply { version, status, headers, body: Vec::new(), cut: false };
    if head_request || (100..200).contains(&status) || status == 204 || status == 304 {
        return Ok(reply);
    }
    let chunked = reply.header("transfer-encoding").to_ascii_lowercase().contains("chunked");
    let length = reply.header("content-length").parse::<usize>().ok();
    match read_body(s, buf, chunked, length).await {
        Ok(body) => reply.body = body,
        Err(_) => reply.cut = true,
    }
    Ok(reply)
}

async fn read_body(
    s: &mut TcpStream,
    buf: &mut Vec<u8>,
    chunked: bool,
    length: Option<usize>,
) -> std::io::Result<Vec<u8>> {
    if chunked {
        return read_chunked(s, buf).await;
    }
    if let Some(len) = length {
        while buf.len() < len {
            if fill(s, buf).await? == 0 {
                return Err(eof("inside a body framed by length"));
            }
        }
        return Ok(buf.drain(..len).collect());
    }
    while fill(s, buf).await? > 0 {}
    Ok(std::mem::take(buf))
}

async fn read_chunked(s: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = loop {
            if let Some(p) = buf.windows(2).position(|w| w == b"\r\n") {
                break p;
            }
            if fill(s, buf).await? == 0 {
                return Err(eof("inside a chunk size"));
            }
        };
        let line = String::from_utf8_lossy(&buf[..line_end]).into_owned();
        buf.drain(..line_end + 2);
        let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("chunk size {line:?}")))?;
        if size == 0 {
            // Trailers, up to the empty line.
            loop {
                if let Some(p) = buf.windows(2).position(|w| w == b"\r\n") {
                    let empty = p == 0;
                    buf.drain(..p + 2);
                    if empty {
                        return Ok(body);
                    }
                    continue;
                }
                if fill(s, buf).await? == 0 {
                    return Err(eof("inside the trailers"));
                }
            }
        }
        while buf.len() < size + 2 {
            if fill(s, buf).await? == 0 {
                return Err(eof("inside a chunk"));
            }
        }
        body.extend(buf.drain(..size));
        buf.drain(..2);
    }
}

/// Whether the peer closed `s` (reads to its end, within the deadline).
pub async fn closed(s: &mut TcpStream) -> bool {
    let mut chunk = [0u8; 1024];
    matches!(tokio::time::timeout(DEADLINE, s.read(&mut chunk)).await, Ok(Ok(0)) | Ok(Err(_)))
}

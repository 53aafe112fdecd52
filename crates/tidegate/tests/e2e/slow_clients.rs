//! Clients that are slow on purpose: uploads that trickle, HTTP/2 readers
//! that never open their flow-control window, and one address that takes
//! every connection it can. None of them may hold a backend's capacity
//! that normal traffic needs (issue 35).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame};
use serde_json::{json, Value};

use crate::support::*;

/// A service `web` with one backend capped at `max_conns` connections
/// (and a learned concurrency limit, when `learn`), and a catch-all route
/// to it.
async fn capped_service(tg: &Tidegate, b: &Backend, max_conns: u32, learn: bool) {
    let spec = json!({
        "policy": { "kind": "round_robin" },
        "concurrency": { "learn": learn },
        "backends": [{ "id": "b0", "addr": b.addr.to_string(), "max_conns": max_conns }],
    });
    let (s, v) = tg.api("PUT", "/v1/services/web", Some(spec)).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) =
        tg.api("PUT", "/v1/routes/web", Some(json!({ "match": { "path_prefix": "/" }, "service": "web" }))).await;
    assert_eq!(s, 200, "{v}");
}

/// A request body that sends a few bytes of its declared length and then
/// nothing, for ever.
struct Trickle(Option<Bytes>);

impl Body for Trickle {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.0.take() {
            Some(b) => Poll::Ready(Some(Ok(Frame::data(b)))),
            None => Poll::Pending,
        }
    }
}

/// Reads from `s` until a response head is complete, the connection
/// ends, or `within` passes; what came, as text.
fn response_head(s: &mut TcpStream, within: Duration) -> String {
    s.set_read_timeout(Some(within)).expect("timeout");
    let (mut reply, mut buf) = (Vec::new(), [0u8; 4096]);
    while !reply.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => reply.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&reply).into_owned()
}

/// Reads one response framed by `Content-Length` from `s` (10 s at
/// most): its status and its head, lowercased.
fn whole_response(s: &mut TcpStream) -> (u16, String) {
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let (mut got, mut buf) = (Vec::new(), [0u8; 4096]);
    loop {
        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if got.len() >= end + 4 + len {
                let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("a status");
                return (status, head);
            }
        }
        let n = s.read(&mut buf).expect("a response");
        assert!(n > 0, "the connection closed mid-response: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
}

/// An HTTP/2 (prior knowledge) connection to `addr`, with the client's
/// stream flow-control window set to `window`.
async fn h2_client<B>(
    addr: SocketAddr,
    window: Option<u32>,
) -> (hyper::client::conn::http2::SendRequest<B>, tokio::task::JoinHandle<()>)
where
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut builder = hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new());
    if let Some(w) = window {
        builder.initial_stream_window_size(w);
    }
    let (h2, conn) = builder.handshake(hyper_util::rt::TokioIo::new(tcp)).await.expect("h2 handshake");
    (
        h2,
        tokio::spawn(async move {
            let _ = conn.await;
        }),
    )
}

/// 20 HTTP/1.1 uploads and 40 HTTP/2 upload streams that send 10 bytes of
/// 100,000 and stop: they wait in the proxy, not at the backend, whose two
/// connections stay free for normal traffic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_uploads_hold_no_backend_and_normal_traffic_flows() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let b = Backend::start("calm", &[]);
    capped_service(&tg, &b, 2, true).await;
    let head = b"POST /upload HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n0123456789";
    let mut slow: Vec<TcpStream> = (0..20)
        .map(|_| {
            let mut s = TcpStream::connect(tg.proxy).expect("connect");
            s.write_all(head).expect("write");
            s
        })
        .collect();
    let (h2, _conn) = h2_client::<Trickle>(tg.proxy, None).await;
    let mut streams = Vec::new();
    for _ in 0..40 {
        let mut h2 = h2.clone();
        let req = http::Request::post(format!("http://{}/upload", tg.proxy))
            .header("content-length", "100000")
            .body(Trickle(Some(Bytes::from_static(b"0123456789"))))
            .expect("request");
        streams.push(tokio::spawn(async move { h2.send_request(req).await.map(|r| r.status()) }));
    }
    // Every upload is being read by the proxy (its body's memory is
    // reserved) before normal traffic starts.
    wait_for("the proxy reads all 60 uploads", Duration::from_secs(10), async || {
        let metrics = send("GET", &tg.admin_url("/metrics"), Some(TOKEN), Vec::new(), &[]).await.text();
        let line = metrics.lines().find(|l| l.starts_with("tidegate_request_buffer_bytes "))?;
        let bytes: u64 = line.split(' ').nth(1)?.parse().ok()?;
        (bytes >= 60 * 100_000).then_some(())
    })
    .await;
    for _ in 0..30 {
        let r = get(&tg.url("/")).await;
        assert_eq!(r.status, 200, "normal traffic failed during the slow uploads: {}", r.text());
    }
    // The last answer's slot is given back just after its last byte is
    // written, which the client may read first: wait for it (a slow upload
    // holding the backend would keep it at 1 or more until the uploads end).
    web_status_until(&tg, "no upload holds the backend", |web| web["backends"][0]["in_flight"] == 0).await;
    for s in &mut slow {
        assert!(s.set_read_timeout(Some(Duration::from_millis(1))).is_ok());
        let mut buf = [0u8; 64];
        assert!(s.read(&mut buf).is_err(), "a slow upload was answered before its body arrived");
    }
    assert!(streams.iter().all(|s| !s.is_finished()), "an HTTP/2 slow upload was answered before its body arrived");
    for s in streams {
        s.abort();
    }
}

/// A body that streams to the backend (larger than the request buffer)
/// and falls under the minimum pace is cut with 408; its backend is freed
/// and not blamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_upload_under_the_minimum_pace_gets_408_and_frees_its_backend() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start_with(
        dir.path(),
        &["--request-buffer-bytes", "1000", "--min-upload-rate", "1000", "--min-upload-rate-window-s", "1"],
    );
    let b = Backend::start("calm", &[]);
    capped_service(&tg, &b, 2, false).await;
    let mut s = TcpStream::connect(tg.proxy).expect("connect");
    s.write_all(b"POST /upload HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n").expect("head");
    // The first 1,000 bytes are read ahead; then 100 bytes every 200 ms
    // (500 bytes/s, half the pace) hold the backend.
    s.write_all(&[b'a'; 1000]).expect("ahead");
    let mut writer = s.try_clone().expect("clone");
    let trickle = std::thread::spawn(move || {
        for _ in 0..100 {
            if writer.write_all(&[b'b'; 100]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    in_flight_reaches(&tg, 1, "the streamed upload holds the backend").await;
    let reply = response_head(&mut s, Duration::from_secs(15));
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    drop(s);
    let _ = trickle.join();
    in_flight_reaches(&tg, 0, "the backend is freed").await;
    let (_, status) = tg.api("GET", "/v1/status", None).await;
    let backend = &status["services"]["web"]["backends"][0];
    assert_eq!(backend["ejections"], 0, "the client's slowness blamed the backend: {backend}");
    assert_eq!(get(&tg.url("/")).await.status, 200);
}

/// A client at its caps: its extra connection is closed, its extra
/// request gets 429 with Retry-After, and another address is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_is_held_to_its_connection_and_request_caps() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start_with(
        dir.path(),
        &["--max-connections-per-client", "3", "--max-requests-per-client", "2", "--request-buffer-bytes", "0"],
    );
    let b = Backend::start("calm", &[]);
    capped_service(&tg, &b, 100, false).await;
    let from = |ip: &str| {
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
        sock.bind(&format!("{ip}:0").parse::<SocketAddr>().expect("addr").into()).expect("bind");
        sock.connect(&tg.proxy.into()).expect("connect");
        TcpStream::from(sock)
    };
    let mut conns: Vec<TcpStream> = (0..3).map(|_| from("127.0.0.2")).collect();
    // Two uploads that stream (no request buffer) and stay in progress.
    for c in &mut conns[..2] {
        c.write_all(b"POST /upload HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\nabc").expect("write");
    }
    in_flight_reaches(&tg, 2, "both uploads reach the backend").await;
    let third = &mut conns[2];
    third.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").expect("write");
    third.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let mut buf = [0u8; 4096];
    let n = third.read(&mut buf).expect("an answer");
    let reply = String::from_utf8_lossy(&buf[..n]).to_lowercase();
    assert!(reply.starts_with("http/1.1 429"), "{reply}");
    assert!(reply.contains("retry-after: 1"), "{reply}");
    // A fourth connection from the same address is closed at once.
    let mut fourth = from("127.0.0.2");
    fourth.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let _ = fourth.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n");
    let closed = matches!(fourth.read(&mut buf), Ok(0) | Err(_));
    assert!(closed, "the connection over the cap was served");
    // Other clients are not affected.
    assert_eq!(get(&tg.url("/")).await.status, 200);
    // Once the connections close, the address may connect again.
    drop(conns);
    drop(fourth);
    wait_for("127.0.0.2 is served again", Duration::from_secs(10), async || {
        let mut s = from("127.0.0.2");
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").ok()?;
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out.starts_with("HTTP/1.1 200").then_some(())
    })
    .await;
}

/// One address sending faster than `--max-request-rate-per-client` gets
/// `429` with `Retry-After` for what goes over its bucket, on the same
/// connection, while another address is served; the refusals are counted
/// as `client_rate`. The backend answers at once, so a cap on requests in
/// progress would never bind here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_is_held_to_its_request_rate() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start_with(
        dir.path(),
        &["--max-request-rate-per-client", "1", "--request-burst-per-client", "5", "--max-requests-per-client", "100"],
    );
    let b = Backend::start("calm", &[]);
    capped_service(&tg, &b, 100, false).await;
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    sock.bind(&"127.0.0.2:0".parse::<SocketAddr>().expect("addr").into()).expect("bind");
    sock.connect(&tg.proxy.into()).expect("connect");
    let mut conn = TcpStream::from(sock);
    // Twenty requests on one kept-alive connection, each answered before
    // the next: the bucket's five, then (at one token a second) only the
    // ones a refill allows.
    let mut statuses = Vec::new();
    for _ in 0..20 {
        conn.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").expect("write");
        let (status, head) = whole_response(&mut conn);
        if status == 429 {
            assert!(head.contains("retry-after: 1"), "{head}");
        }
        statuses.push(status);
    }
    let ok = statuses.iter().filter(|s| **s == 200).count();
    let refused = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!(ok + refused, 20, "{statuses:?}");
    assert!(statuses[..5].iter().all(|s| *s == 200), "the burst is served: {statuses:?}");
    assert!(refused >= 5, "the rate was not enforced: {statuses:?}");
    // Another address is not affected.
    assert_eq!(request_from("127.0.0.3", tg.proxy, "/").await, Some(200));
    let metrics = send("GET", &tg.admin_url("/metrics"), Some(TOKEN), Vec::new(), &[]).await.text();
    let counted = metrics
        .lines()
        .filter(|l| l.contains(r#"reason="client_rate""#) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>();
    assert!(counted >= refused as f64, "{refused} refusals, {counted} counted: {metrics}");
}

/// HTTP/2 readers whose stream window is zero: their backends are
/// released after the write timeout, and the connection, all of whose
/// streams are stalled, is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_streams_stalled_by_a_zero_window_release_their_backends() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start_with(dir.path(), &["--write-timeout-s", "2"]);
    let b = Backend::start("big", &["--body-size", "20000000"]);
    capped_service(&tg, &b, 100, false).await;
    let (h2, conn) = h2_client::<http_body_util::Empty<Bytes>>(tg.proxy, Some(0)).await;
    let mut heads = Vec::new();
    for _ in 0..10 {
        let mut h2 = h2.clone();
        let req = http::Request::get(format!("http://{}/big", tg.proxy))
            .body(http_body_util::Empty::<Bytes>::new())
            .expect("request");
        heads.push(tokio::spawn(async move { h2.send_request(req).await }));
    }
    let mut responses = Vec::new();
    for h in heads {
        let resp = h.await.expect("task").expect("a response head");
        assert_eq!(resp.status(), 200);
        responses.push(resp); // never read: the window stays shut
    }
    in_flight_reaches(&tg, 10, "ten streams hold the backend").await;
    wait_for("the stalled streams release the backend", Duration::from_secs(20), async || {
        let (_, status) = tg.api("GET", "/v1/status", None).await;
        (status["services"]["web"]["backends"][0]["in_flight"] == 0).then_some(())
    })
    .await;
    let closed = tokio::time::timeout(Duration::from_secs(20), conn).await;
    assert!(closed.is_ok(), "the connection whose every stream is stalled stayed open");
    drop(responses);
    assert_eq!(get(&tg.url("/")).await.status, 200);
}

/// A backend that refuses a large upload as soon as it sees the head
/// (413) and closes: the client gets that answer, over HTTP/1.1 and
/// HTTP/2, not a 502.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backends_early_answer_to_an_upload_reaches_the_client() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let b = Backend::start("strict", &["--faults"]);
    route_to(&tg, "web", &[&b], "round_robin").await;
    const SIZE: usize = 5 * 1024 * 1024;
    // HTTP/1.1, sent raw: the body is written by another thread while
    // the answer is read.
    let mut s = TcpStream::connect(tg.proxy).expect("connect");
    s.write_all(format!("POST /_fault/early-413 HTTP/1.1\r\nhost: x\r\ncontent-length: {SIZE}\r\n\r\n").as_bytes())
        .expect("head");
    let mut writer = s.try_clone().expect("clone");
    let sender = std::thread::spawn(move || {
        let chunk = vec![b'x'; 64 * 1024];
        for _ in 0..SIZE / chunk.len() {
            if writer.write_all(&chunk).is_err() {
                return;
            }
        }
    });
    let reply = response_head(&mut s, Duration::from_secs(20));
    assert!(reply.starts_with("HTTP/1.1 413"), "HTTP/1.1: {reply}");
    drop(s);
    let _ = sender.join();
    // HTTP/2.
    let (mut h2, _conn) = h2_client::<http_body_util::Full<Bytes>>(tg.proxy, None).await;
    let req = http::Request::post(format!("http://{}/_fault/early-413", tg.proxy))
        .body(http_body_util::Full::new(Bytes::from(vec![b'y'; SIZE])))
        .expect("request");
    let resp = tokio::time::timeout(Duration::from_secs(20), h2.send_request(req)).await.expect("in time");
    assert_eq!(resp.expect("a response").status(), 413, "HTTP/2");
    let (_, status) = tg.api("GET", "/v1/status", None).await;
    let backend: &Value = &status["services"]["web"]["backends"][0];
    assert_eq!(backend["ejections"], 0, "{backend}");
}

/// One request from `ip` to `proxy` on a connection of its own: the
/// answer's status, `None` when there was no answer within 10 s.
async fn request_from(ip: &str, proxy: SocketAddr, path: &str) -> Option<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let sock = tokio::net::TcpSocket::new_v4().ok()?;
        sock.bind(format!("{ip}:0").parse().ok()?).ok()?;
        let mut s = sock.connect(proxy).await.ok()?;
        s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes()).await.ok()?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.ok()?;
        String::from_utf8_lossy(&out).split(' ').nth(1)?.parse().ok()
    };
    tokio::time::timeout(Duration::from_secs(10), exchange).await.ok().flatten()
}

/// One address floods a service whose backend takes one request at a
/// time and whose queue holds 4, keeping the queue full. Another
/// address's requests each take the flood's newest place and get the next
/// turn: all of them are served. (A first-come, first-served queue
/// answered them 503 queue full.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_from_one_address_does_not_keep_another_out_of_the_queue() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let b = Backend::start("one", &[]);
    let spec = json!({
        "policy": { "kind": "round_robin" },
        "concurrency": { "learn": false },
        "queue": { "max": 4, "timeout_ms": 10000 },
        "backends": [{ "id": "b0", "addr": b.addr.to_string(), "max_conns": 1 }],
    });
    let (s, v) = tg.api("PUT", "/v1/services/web", Some(spec)).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) =
        tg.api("PUT", "/v1/routes/web", Some(json!({ "match": { "path_prefix": "/" }, "service": "web" }))).await;
    assert_eq!(s, 200, "{v}");
    // Twelve flooders from 127.0.0.2, each sending its next request as
    // soon as the last is answered (at most 60 s).
    let stop = Arc::new(AtomicBool::new(false));
    let (flood_ok, flood_503) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let proxy = tg.proxy;
    let flooders: Vec<_> = (0..12)
        .map(|_| {
            let (stop, ok, shed) = (stop.clone(), flood_ok.clone(), flood_503.clone());
            tokio::spawn(async move {
                let deadline = std::time::Instant::now() + Duration::from_secs(60);
                while !stop.load(Relaxed) && std::time::Instant::now() < deadline {
                    match request_from("127.0.0.2", proxy, "/flood?delay_ms=20").await {
                        Some(200) => ok.fetch_add(1, Relaxed),
                        Some(503) => shed.fetch_add(1, Relaxed),
                        _ => 0,
                    };
                }
            })
        })
        .collect();
    web_status_until(&tg, "the flood fills the queue", |web| web["queued"] == 4).await;
    let mut polite = Vec::new();
    for _ in 0..10 {
        polite.push(request_from("127.0.0.1", proxy, "/polite?delay_ms=20").await);
    }
    let (_, status) = tg.api("GET", "/v1/status", None).await;
    stop.store(true, Relaxed);
    for f in flooders {
        f.await.expect("flooder");
    }
    assert_eq!(polite, [Some(200); 10], "the polite client was refused or starved");
    let web = &status["services"]["web"];
    assert!(web["queue_displaced"].as_u64() >= Some(1), "no flood request was displaced: {web}");
    let metrics = send("GET", &tg.admin_url("/metrics"), Some(TOKEN), Vec::new(), &[]).await.text();
    let displaced = metrics
        .lines()
        .find_map(|l| l.strip_prefix(r#"tidegate_service_queue_displaced_total{service="web"} "#))
        .and_then(|v| v.trim().parse::<f64>().ok());
    assert!(displaced >= Some(1.0), "{metrics}");
    assert!(flood_ok.load(Relaxed) > 0 && flood_503.load(Relaxed) > 0, "the flood was served and refused");
}

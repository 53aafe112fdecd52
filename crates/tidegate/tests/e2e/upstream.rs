//! The upstream side of the request path: pooled keep-alive connections,
//! backends that break the exchange, and blame (a client's broken request
//! never counts against a backend).

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::*;

/// A service `web` over `backend` with a catch-all route; `settings` are
/// merged into the service body.
async fn service(tg: &Tidegate, backend: &Backend, settings: Value) {
    let mut body = json!({ "backends": [{ "id": "b0", "addr": backend.addr.to_string() }] });
    if let (Some(b), Some(s)) = (body.as_object_mut(), settings.as_object()) {
        b.extend(s.clone());
    }
    let (s, v) = tg.api("PUT", "/v1/services/web", Some(body)).await;
    assert_eq!(s, 200, "{v}");
    let route = json!({ "match": { "path_prefix": "/" }, "service": "web" });
    let (s, v) = tg.api("PUT", "/v1/routes/web", Some(route)).await;
    assert_eq!(s, 200, "{v}");
}

/// A proxy-error counter from `/metrics`.
async fn proxy_errors(tg: &Tidegate, reason: &str) -> u64 {
    let (_, _) = tg.api("GET", "/v1/status", None).await;
    let r = send("GET", &tg.admin_url("/metrics"), Some(TOKEN), Vec::new(), &[]).await;
    let needle = format!("tidegate_proxy_errors_total{{reason=\"{reason}\"");
    r.text()
        .lines()
        .find(|l| l.starts_with(&needle))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no {needle} in /metrics"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_closing_idle_keepalive_connections_costs_no_failed_request() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    // The backend closes connections idle for 100 ms; requests arrive
    // around that age, so some meet a connection at the moment it closes.
    let b = Backend::start("short-keepalive", &["--faults", "--idle-close", "100ms"]);
    service(&tg, &b, json!({ "retries": 0 })).await;
    for i in 0..40u64 {
        let r = get(&tg.url("/")).await;
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        assert_eq!(r.text(), "ok short-keepalive\n");
        tokio::time::sleep(Duration::from_millis(85 + (i * 7) % 30)).await;
    }
    assert_eq!(proxy_errors(&tg, "upstream_closed").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_backend_response_never_reaches_the_client_as_a_clean_answer() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let b = Backend::start("broken", &["--faults"]);
    service(&tg, &b, json!({ "retries": 0 })).await;

    // Dies mid-body: the client sees the connection break, never a
    // complete-looking 200.
    let got = try_send("GET", &tg.url("/_fault/truncate"), None, Vec::new(), &[]).await;
    assert!(got.is_err(), "a truncated body must not look complete: {:?}", got.map(|r| r.status));

    // Both Content-Length and chunked: framed by the chunks, whole.
    let r = get(&tg.url("/_fault/cl-te")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.text(), "abcdefghijklmnopqrstuvwxyz");
    assert!(r.headers.get("content-length").is_none_or(|v| v == "26"), "{:?}", r.headers);

    // Not HTTP at all, or no answer: 502 that says so.
    let r = get(&tg.url("/_fault/garbage")).await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert!(r.text().contains("invalid response"), "{}", r.text());
    let r = get(&tg.url("/_fault/close")).await;
    assert_eq!(r.status, 502, "{}", r.text());

    // The proxy and the backend still serve normally.
    assert_eq!(get(&tg.url("/")).await.status, 200);
}

/// What a client reading a response delimited by the close sees at its end.
#[derive(Debug, PartialEq)]
enum End {
    /// A clean close: the body looks complete.
    Clean,
    /// The connection was reset: the client knows the body is cut short.
    Reset,
}

/// Sends `req` and reads everything until the end, and how it ended.
fn read_to_end(proxy: std::net::SocketAddr, req: &[u8]) -> (String, End) {
    use std::io::Read;
    let mut s = TcpStream::connect(proxy).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("set a read timeout");
    s.write_all(req).expect("write");
    let (mut got, mut buf) = (Vec::new(), [0u8; 4096]);
    let end = loop {
        match s.read(&mut buf) {
            Ok(0) => break End::Clean,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break End::Reset,
            Err(e) => panic!("no end within 5 s: {e}: {:?}", String::from_utf8_lossy(&got)),
        }
    };
    (String::from_utf8_lossy(&got).into_owned(), end)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_breaks_http_framing_never_passes_it_on() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let b = Backend::start("broken", &["--faults"]);
    service(&tg, &b, json!({ "retries": 0 })).await;
    let proxy = tg.proxy;
    tokio::task::spawn_blocking(move || {
        let wait = Duration::from_secs(5);
        let get = |path: &str, extra: &str| {
            let req = format!("GET {path} HTTP/1.1\r\nhost: x\r\n{extra}connection: close\r\n\r\n");
            raw_exchange(proxy, req.as_bytes(), wait)
        };
        // A coding the proxy cannot remove, a status out of range, a
        // switch to h2c: 502.
        for path in ["/_fault/gzip", "/_fault/status-000"] {
            let reply = get(path, "");
            assert!(reply.starts_with("HTTP/1.1 502"), "{path}: {reply:?}");
        }
        let reply = get("/_fault/h2c", "upgrade: websocket\r\nconnection: upgrade\r\n");
        assert!(reply.starts_with("HTTP/1.1 502"), "a switch to a protocol not offered: {reply:?}");
        // Lengths: one field, the proxy's own; none on a 204.
        let reply = get("/_fault/lengths", "");
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply:?}");
        assert_eq!(reply.to_ascii_lowercase().matches("content-length").count(), 1, "{reply:?}");
        assert!(reply.contains("content-length: 2\r\n") && reply.ends_with("\r\n\r\nok"), "{reply:?}");
        let reply = get("/_fault/204-length", "");
        assert!(reply.starts_with("HTTP/1.1 204"), "{reply:?}");
        assert!(!reply.to_ascii_lowercase().contains("content-length"), "{reply:?}");
        // A body cut short, to an HTTP/1.0 client (delimited by the close):
        // the connection is reset, never closed as if the body were whole.
        let (got, end) = read_to_end(proxy, b"GET /_fault/chunked-cut HTTP/1.0\r\nhost: x\r\n\r\n");
        assert!(got.starts_with("HTTP/1.1 200"), "{got:?}");
        assert_eq!(end, End::Reset, "{got:?}");
    })
    .await
    .unwrap();
    assert_eq!(get(&tg.url("/")).await.status, 200, "the proxy and the backend still serve");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_streaming_past_the_idle_timeout_reaches_an_http2_client_whole() {
    use http_body_util::BodyExt;
    let dir = tempfile::tempdir().unwrap();
    // Idle after 1 s; the backend takes 3 s to send its 30 bytes.
    let tg = Tidegate::start_with(dir.path(), &["--header-timeout-s", "1"]);
    let b = Backend::start("drip", &["--faults"]);
    service(&tg, &b, json!({ "retries": 0 })).await;
    let tcp = tokio::net::TcpStream::connect(tg.proxy).await.expect("connect");
    let (mut h2, conn) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), hyper_util::rt::TokioIo::new(tcp))
            .await
            .expect("h2 handshake");
    tokio::spawn(conn);
    let req = http::Request::get(format!("http://{}/_fault/drip", tg.proxy))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .expect("request");
    let resp = h2.send_request(req).await.expect("response head");
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.expect("the whole body, not a reset stream").to_bytes();
    assert_eq!(body.len(), 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_whose_body_breaks_gets_400_and_ejects_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let b = Backend::start("victim", &[]);
    let passive = json!({ "health": { "passive": { "consecutive_failures": 2 } } });
    service(&tg, &b, passive).await;
    for i in 0..6 {
        // Broken chunked encoding (streamed), then a short fixed-length
        // body whose client stops sending (buffered).
        let chunked = b"POST /upload HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n\r\n";
        let answer = raw_exchange(tg.proxy, chunked, Duration::from_secs(3));
        assert!(answer.starts_with("HTTP/1.1 400"), "try {i}: {answer:?}");
        let mut s = TcpStream::connect(tg.proxy).unwrap();
        s.write_all(b"POST /upload HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\nonly ten b").unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        drop(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (_, status) = tg.api("GET", "/v1/status", None).await;
    let backend = &status["services"]["web"]["backends"][0];
    assert_eq!(backend["ejections"], 0, "{status}");
    assert_eq!(backend["failures"], 0, "{status}");
    assert!(proxy_errors(&tg, "client_body").await >= 6);
    assert_eq!(get(&tg.url("/")).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_upstream_connections_are_closed_after_their_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let tg = Tidegate::start(dir.path());
    let b = Backend::start("pooled", &[]);
    service(&tg, &b, json!({ "timeouts": { "idle_ms": 300 } })).await;
    let open = || {
        let reply = raw_exchange(
            b.addr,
            b"GET /_emulator/stats HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
            Duration::from_secs(3),
        );
        let body = reply.split("\r\n\r\n").nth(1).unwrap_or("");
        let v: Value = serde_json::from_str(body).unwrap_or_else(|_| panic!("stats: {reply:?}"));
        // Minus the connection asking.
        v["connections_open"].as_u64().unwrap() - 1
    };
    for _ in 0..5 {
        assert_eq!(get(&tg.url("/")).await.status, 200);
    }
    let pooled = open();
    assert!(pooled >= 1, "the proxy keeps its connection after the response");
    // Sequential requests reuse one connection per worker at most.
    assert!(pooled <= 2, "{pooled} connections for 5 sequential requests");
    // The pool's sweep runs every second: closed within a few of them.
    wait_for("idle connections closed after timeouts.idle_ms", Duration::from_secs(10), async || {
        (open() == 0).then_some(())
    })
    .await;
    // And the next request opens a new one without trouble.
    assert_eq!(get(&tg.url("/")).await.status, 200);
}

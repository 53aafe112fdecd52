//! Both HTTP/1.1 engines (`--http1 native`, the default, and `--http1
//! hyper`) against the same cases: request bodies framed by length,
//! chunked, and large enough to stream; responses chunked, large,
//! delimited by the close, to HTTP/1.0 clients and to HEAD; and
//! `Expect: 100-continue`, met by the proxy and not forwarded.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use serde_json::json;

use crate::support::*;

/// A backend written by hand, for response framings the emulator does not
/// produce: `/chunked` (chunks with an extension, and a trailer), `/big`
/// (1 MiB by length), `/close` (no length: the body ends with the
/// connection). Serves bodiless requests, keep-alive, until dropped.
struct RawBackend {
    addr: SocketAddr,
}

const BIG: usize = 1024 * 1024;

impl RawBackend {
    fn start() -> RawBackend {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("local address");
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                std::thread::spawn(move || RawBackend::serve(s));
            }
        });
        RawBackend { addr }
    }

    fn serve(mut s: TcpStream) {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut chunk) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
            let end = buf.windows(4).position(|w| w == b"\r\n\r\n").expect("a complete head") + 4;
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            buf.drain(..end);
            let line = head.lines().next().unwrap_or("");
            let is_head = line.starts_with("HEAD ");
            let written = if line.contains("/chunked ") {
                s.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nx-trailer: t\r\n\r\n")
            } else if line.contains("/big ") {
                let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {BIG}\r\n\r\n");
                let body = if is_head { Vec::new() } else { vec![b'x'; BIG] };
                s.write_all(head.as_bytes()).and_then(|()| s.write_all(&body))
            } else {
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\nuntil close");
                return;
            };
            if written.is_err() {
                return;
            }
        }
    }
}

async fn carries_every_framing(engine: &str) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let tg = Tidegate::start_with(dir.path(), &["--http1", engine]);
    let emu = Backend::start("echo", &[]);
    let raw = RawBackend::start();
    for (name, addr, prefix) in [("e", emu.addr.to_string(), "/e"), ("r", raw.addr.to_string(), "/r")] {
        let spec = json!({ "backends": [{ "id": "b0", "addr": addr }] });
        assert_eq!(tg.api("PUT", &format!("/v1/services/{name}"), Some(spec)).await.0, 200);
        let route = json!({ "match": { "path_prefix": prefix }, "service": name });
        assert_eq!(tg.api("PUT", &format!("/v1/routes/{name}"), Some(route)).await.0, 200);
    }
    let echoed =
        |r: &Reply| serde_json::from_slice::<serde_json::Value>(&r.body).expect("an echo")["body_bytes"].clone();
    // Request bodies: small (held for retries), large (streamed), chunked.
    let r = send("POST", &tg.url("/e/echo"), None, b"12345".to_vec(), &[]).await;
    assert_eq!((r.status, echoed(&r)), (200, json!(5)), "{engine}");
    let r = send("POST", &tg.url("/e/echo"), None, vec![b'b'; 200 * 1024], &[]).await;
    assert_eq!((r.status, echoed(&r)), (200, json!(200 * 1024)), "{engine}");
    let chunked = "POST /e/echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n\
                   3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n";
    let reply = raw_exchange(tg.proxy, chunked.as_bytes(), Duration::from_secs(5));
    assert!(reply.starts_with("HTTP/1.1 200") && reply.contains("\"body_bytes\":7"), "{engine}: {reply}");
    // Response framings.
    let r = get(&tg.url("/r/chunked")).await;
    assert_eq!((r.status, r.text().as_str()), (200, "hello, world"), "{engine}");
    let r = get(&tg.url("/r/big")).await;
    assert_eq!(r.body.len(), BIG, "{engine}");
    assert!(r.body.iter().all(|b| *b == b'x'), "{engine}");
    let r = get(&tg.url("/r/close")).await;
    assert_eq!((r.status, r.text().as_str()), (200, "until close"), "{engine}");
    let r = send("HEAD", &tg.url("/r/big"), None, Vec::new(), &[]).await;
    assert_eq!(r.headers.get("content-length").map(|v| v.as_bytes()), Some(BIG.to_string().as_bytes()), "{engine}");
    assert!(r.body.is_empty(), "{engine}");
    // An HTTP/1.0 client gets the body delimited by the close.
    let reply = raw_exchange(tg.proxy, b"GET /r/chunked HTTP/1.0\r\nhost: x\r\n\r\n", Duration::from_secs(5));
    assert!(reply.starts_with("HTTP/1.") && reply.ends_with("\r\n\r\nhello, world"), "{engine}: {reply:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_native_engine_carries_every_framing() {
    carries_every_framing("native").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hyper_engine_carries_every_framing() {
    carries_every_framing("hyper").await;
}

/// Sends a `POST` of `body` with `Expect: 100-continue` to the echo route,
/// and the body only after the proxy's interim answer. Returns that answer's
/// head, the final answer's status line and what the echo backend saw (its
/// request's headers and body length).
fn post_expecting_continue(proxy: SocketAddr, body: &[u8]) -> (String, String, serde_json::Value) {
    let mut s = TcpStream::connect(proxy).expect("connect");
    // Bounds every wait below: a proxy that never answers fails the test.
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("a read timeout");
    let head = format!(
        "POST /e/echo HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("the head is written");
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&chunk[..n]),
        }
    }
    let interim = String::from_utf8_lossy(&got).into_owned();
    s.write_all(body).expect("the body is written");
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    let reply = String::from_utf8_lossy(&rest).into_owned();
    let status = reply.lines().next().unwrap_or_default().to_string();
    let echoed = reply.split_once("\r\n\r\n").and_then(|(_, b)| serde_json::from_str(b).ok()).unwrap_or_default();
    (interim, status, echoed)
}

/// The proxy answers `Expect: 100-continue` itself, so it must not forward
/// the expectation (RFC 9110, section 10.1.1): the backend sees none, for a
/// body read ahead whole and for one larger than the read-ahead (streamed).
async fn meets_the_expectation(engine: &str) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let tg = Tidegate::start_with(dir.path(), &["--http1", engine, "--request-buffer-bytes", "4096"]);
    let emu = Backend::start("echo", &[]);
    let spec = json!({ "backends": [{ "id": "b0", "addr": emu.addr.to_string() }] });
    assert_eq!(tg.api("PUT", "/v1/services/e", Some(spec)).await.0, 200);
    let route = json!({ "match": { "path_prefix": "/e" }, "service": "e" });
    assert_eq!(tg.api("PUT", "/v1/routes/e", Some(route)).await.0, 200);
    for size in [5, 256 * 1024] {
        let body = vec![b'b'; size];
        let (interim, status, echoed) = post_expecting_continue(tg.proxy, &body);
        assert!(interim.starts_with("HTTP/1.1 100 "), "{engine}, {size} bytes: {interim:?}");
        assert!(status.starts_with("HTTP/1.1 200 "), "{engine}, {size} bytes: {status:?}");
        assert_eq!(echoed["body_bytes"], json!(size), "{engine}, {size} bytes: {echoed}");
        assert!(echoed["headers"].is_object(), "{engine}, {size} bytes: {echoed}");
        assert_eq!(echoed["headers"].get("expect"), None, "{engine}, {size} bytes: the backend got {echoed}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_native_engine_meets_the_expectation() {
    meets_the_expectation("native").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hyper_engine_meets_the_expectation() {
    meets_the_expectation("hyper").await;
}

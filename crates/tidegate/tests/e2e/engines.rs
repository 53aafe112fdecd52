//! Both HTTP/1.1 engines (`--http1 native`, the default, and `--http1
//! hyper`) against the same cases: request bodies framed by length,
//! chunked, and large enough to stream; responses chunked, large,
//! delimited by the close, to HTTP/1.0 clients and to HEAD.

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

//! A misbehaving backend (`--faults`): raw HTTP/1.1 written byte by byte,
//! so responses can break the rules a well-behaved server library never
//! would. The proxy's tests point at it to check that a broken backend
//! never turns into a clean-looking answer for the client.
//!
//! Each connection serves keep-alive requests; the path picks the answer:
//! - `/_fault/truncate`: `200` with `Content-Length: 1000`, 100 bytes, close;
//! - `/_fault/cl-te`: `200` with both `Content-Length: 5` and chunked
//!   encoding, whose decoded body is 26 bytes;
//! - `/_fault/garbage`: bytes that are not HTTP, then close;
//! - `/_fault/close`: close without answering;
//! - `/_fault/gzip`: `200` framed by `Transfer-Encoding: gzip, chunked`;
//! - `/_fault/lengths`: `200` with `Content-Length: 2, 02` and another
//!   `Content-Length: 2` (equal values: valid, and to be sent on as one);
//! - `/_fault/204-length`: `204` with a `Content-Length: 5` it must not have;
//! - `/_fault/chunked-cut`: `200` chunked, one chunk, then close;
//! - `/_fault/h2c`: `101 Switching Protocols` to `h2c`;
//! - `/_fault/status-000`: the status code `000`;
//! - `/_fault/drip`: `200` with a 30-byte body sent one byte every 100 ms;
//! - `/_fault/early-413`: `413` as soon as the head arrives, without
//!   reading the body, then close (a server refusing a large upload);
//! - anything else: `200` with the body `ok NAME\n`.
//!
//! With `--idle-close D`, a connection that waits longer than `D` for its
//! next request is closed by the backend, as servers with a short
//! keep-alive timeout do.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Largest request head accepted.
const MAX_HEAD: usize = 64 * 1024;

/// Counters of the fault server, for logs and tests.
#[derive(Debug, Default)]
pub struct FaultStats {
    /// Connections accepted.
    pub connections: AtomicU64,
    /// Connections closed for idleness.
    pub idle_closed: AtomicU64,
}

/// Serves the fault backend on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, name: String, idle_close: Option<Duration>, stats: Arc<FaultStats>) {
    let name: Arc<str> = Arc::from(name);
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        stats.connections.fetch_add(1, Relaxed);
        let (name, stats) = (name.clone(), stats.clone());
        tokio::spawn(async move {
            let _ = connection(stream, &name, idle_close, &stats).await;
        });
    }
}

/// What a request asks the fault server for.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    Normal,
    Truncate,
    ClTe,
    Garbage,
    Close,
    /// A fixed answer, after which the connection closes.
    Raw(&'static [u8]),
    Drip,
}

fn answer_for(path: &str) -> Answer {
    match path.split('?').next().unwrap_or("") {
        "/_fault/truncate" => Answer::Truncate,
        "/_fault/cl-te" => Answer::ClTe,
        "/_fault/garbage" => Answer::Garbage,
        "/_fault/close" => Answer::Close,
        "/_fault/gzip" => {
            Answer::Raw(b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n4\r\nGZIP\r\n0\r\n\r\n")
        }
        "/_fault/lengths" => Answer::Raw(b"HTTP/1.1 200 OK\r\ncontent-length: 2, 02\r\ncontent-length: 2\r\n\r\nok"),
        "/_fault/204-length" => Answer::Raw(b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n"),
        "/_fault/chunked-cut" => Answer::Raw(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"),
        "/_fault/h2c" => {
            Answer::Raw(b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n")
        }
        "/_fault/drip" => Answer::Drip,
        "/_fault/status-000" => Answer::Raw(b"HTTP/1.1 000 Zero\r\ncontent-length: 0\r\n\r\n"),
        _ => Answer::Normal,
    }
}

/// A parsed request head: the path, the body length, and whether the
/// client can keep the connection.
#[derive(Debug, PartialEq, Eq)]
struct Head {
    path: String,
    content_length: usize,
    /// Chunked or otherwise unframed bodies are not read: the connection
    /// is closed after the answer instead.
    close: bool,
}

fn parse_head(head: &[u8]) -> Option<Head> {
    let text = std::str::from_utf8(head).ok()?;
    let mut lines = text.split("\r\n");
    let path = lines.next()?.split(' ').nth(1)?.to_owned();
    let (mut content_length, mut close) = (0, false);
    for line in lines {
        let Some((name, value)) = line.split_once(':') else { continue };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            content_length = value.parse().ok()?;
        } else if name.eq_ignore_ascii_case("transfer-encoding")
            || (name.eq_ignore_ascii_case("connection") && value.eq_ignore_ascii_case("close"))
        {
            close = true;
        }
    }
    Some(Head { path, content_length, close })
}

async fn connection(mut s: TcpStream, name: &str, idle_close: Option<Duration>, stats: &FaultStats) -> io::Result<()> {
    let _ = s.set_nodelay(true);
    let mut buf = Vec::with_capacity(4096);
    loop {
        // Read one request head (and what follows it, kept for the next).
        let end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            if buf.len() > MAX_HEAD {
                return Ok(());
            }
            let mut chunk = [0u8; 4096];
            let read = s.read(&mut chunk);
            let n = match (idle_close, buf.is_empty()) {
                (Some(d), true) => match tokio::time::timeout(d, read).await {
                    Ok(r) => r?,
                    Err(_) => {
                        stats.idle_closed.fetch_add(1, Relaxed);
                        return Ok(()); // idle too long: close, as a server would
                    }
                },
                _ => read.await?,
            };
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let Some(head) = parse_head(&buf[..end]) else { return Ok(()) };
        buf.drain(..end);
        if head.path.split('?').next() == Some("/_fault/early-413") {
            let text = b"too large\n";
            let resp = format!(
                "HTTP/1.1 413 Content Too Large\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                text.len()
            );
            s.write_all(resp.as_bytes()).await?;
            s.write_all(text).await?;
            return Ok(()); // the body unread: the close resets the sender
        }
        while buf.len() < head.content_length {
            let mut chunk = [0u8; 4096];
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        buf.drain(..head.content_length);
        match answer_for(&head.path) {
            Answer::Normal => {
                let body = format!("ok {name}\n");
                let resp =
                    format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\nx-backend: {name}\r\n\r\n{body}", body.len());
                s.write_all(resp.as_bytes()).await?;
            }
            Answer::Truncate => {
                s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n").await?;
                s.write_all(&[b'x'; 100]).await?;
                return Ok(());
            }
            Answer::ClTe => {
                let body = b"1a\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\n\r\n";
                s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n").await?;
                s.write_all(body).await?;
                return Ok(()); // a conflicting message: never reuse the connection
            }
            Answer::Garbage => {
                s.write_all(b"\x00\x01 this is not http \r\n\r\n").await?;
                return Ok(());
            }
            Answer::Close => return Ok(()),
            Answer::Raw(bytes) => {
                s.write_all(bytes).await?;
                return Ok(());
            }
            Answer::Drip => {
                s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 30\r\n\r\n").await?;
                for _ in 0..30 {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    s.write_all(b"x").await?;
                }
            }
        }
        if head.close {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_are_parsed() {
        let h = parse_head(b"POST /x?y=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 12\r\n\r\n").unwrap();
        assert_eq!(h, Head { path: "/x?y=1".into(), content_length: 12, close: false });
        let h = parse_head(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n").unwrap();
        assert!(h.close);
        assert!(parse_head(b"GET / HTTP/1.1\r\nContent-Length: x\r\n\r\n").is_none());
        assert_eq!(answer_for("/_fault/cl-te?n=1"), Answer::ClTe);
        assert_eq!(answer_for("/"), Answer::Normal);
    }

    #[tokio::test]
    async fn idle_connections_are_closed() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let stats = Arc::new(FaultStats::default());
        tokio::spawn(serve(l, "f".into(), Some(Duration::from_millis(50)), stats.clone()));
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        let mut got = vec![0u8; 256];
        let n = c.read(&mut got).await.unwrap();
        assert!(got[..n].starts_with(b"HTTP/1.1 200 OK"));
        // Then nothing: the server closes after the idle time.
        let n = tokio::time::timeout(Duration::from_secs(2), c.read(&mut got)).await.unwrap().unwrap();
        assert_eq!(n, 0);
        assert_eq!(stats.idle_closed.load(Relaxed), 1);
    }
}

//! A lean HTTP/1.1 client for admin writes (`saturate`, `churn`): keep-alive
//! connections, each request written as prepared bytes, each answer's head
//! parsed with `httparse` and its body skipped by its length.
//!
//! The load generator shares the machine's two cores with Tidegate, so
//! its own cost per request bounds what a benchmark can measure. With
//! hyper-util's pooled client (a connection task and a channel hop per
//! request) `saturate` used about half a core and measured 40-44k change
//! sets/s where wrk, driving the same binary with the same requests in the
//! same run, measured 48-52k (docs/benchmarks.md).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::client::Failure;

/// The most header bytes an answer may have.
const MAX_HEAD: usize = 16 * 1024;

/// One keep-alive connection to `addr`, opened when first needed and again
/// after any failure.
pub struct RawConn {
    addr: SocketAddr,
    timeout: Duration,
    stream: Option<TcpStream>,
    inbox: Vec<u8>,
}

impl RawConn {
    /// A connection to `addr`; every exchange must finish within `timeout`.
    pub fn new(addr: SocketAddr, timeout: Duration) -> RawConn {
        RawConn { addr, timeout, stream: None, inbox: Vec::with_capacity(4096) }
    }

    /// Sends `request` (a whole HTTP/1.1 message, see [`request`]) and
    /// returns the answer's status once its body is read.
    pub async fn send(&mut self, request: &[u8]) -> Result<u16, Failure> {
        let outcome = tokio::time::timeout(self.timeout, self.exchange(request)).await;
        let result = outcome.unwrap_or(Err(Failure::Timeout));
        if result.is_err() {
            // Whatever is left on it cannot be trusted: start afresh.
            self.stream = None;
        }
        result
    }

    async fn exchange(&mut self, request: &[u8]) -> Result<u16, Failure> {
        let stream = match &mut self.stream {
            Some(s) => s,
            None => {
                let s = TcpStream::connect(self.addr).await.map_err(|_| Failure::Connect)?;
                s.set_nodelay(true).map_err(|_| Failure::Connect)?;
                self.inbox.clear();
                self.stream.insert(s)
            }
        };
        stream.write_all(request).await.map_err(|_| Failure::Transport)?;
        let (status, head_len, body_len, close) = loop {
            if let Some(parsed) = parse_head(&self.inbox)? {
                break parsed;
            }
            if self.inbox.len() >= MAX_HEAD {
                return Err(Failure::Transport);
            }
            read_more(stream, &mut self.inbox).await?;
        };
        while self.inbox.len() < head_len + body_len {
            read_more(stream, &mut self.inbox).await?;
        }
        self.inbox.drain(..head_len + body_len);
        if close {
            self.stream = None;
        }
        Ok(status)
    }
}

/// Keep-alive connections to one address shared by concurrent senders:
/// each send takes an idle connection (or opens one) and puts it back.
pub struct RawPool {
    addr: SocketAddr,
    timeout: Duration,
    idle: std::sync::Mutex<Vec<RawConn>>,
}

impl RawPool {
    /// A pool of connections to `addr`; see [`RawConn::new`].
    pub fn new(addr: SocketAddr, timeout: Duration) -> RawPool {
        RawPool { addr, timeout, idle: std::sync::Mutex::default() }
    }

    /// The address requests go to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// [`RawConn::send`] on an idle connection of the pool.
    pub async fn send(&self, request: &[u8]) -> Result<u16, Failure> {
        let idle = self.idle.lock().ok().and_then(|mut idle| idle.pop());
        let mut conn = idle.unwrap_or_else(|| RawConn::new(self.addr, self.timeout));
        let result = conn.send(request).await;
        if let Ok(mut idle) = self.idle.lock() {
            idle.push(conn);
        }
        result
    }
}

async fn read_more(stream: &mut TcpStream, inbox: &mut Vec<u8>) -> Result<(), Failure> {
    inbox.reserve(4096);
    match stream.read_buf(inbox).await {
        Ok(0) | Err(_) => Err(Failure::Transport),
        Ok(_) => Ok(()),
    }
}

/// The status, head length, body length and whether the server closes,
/// once the head is complete. Only `Content-Length` framing is taken (the
/// admin API's answers have it); anything else is a transport failure.
fn parse_head(bytes: &[u8]) -> Result<Option<(u16, usize, usize, bool)>, Failure> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut resp = httparse::Response::new(&mut headers);
    let head_len = match resp.parse(bytes) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(_) => return Err(Failure::Transport),
    };
    let status = resp.code.ok_or(Failure::Transport)?;
    if status < 200 {
        // Nothing sent asks for an interim answer; one would leave the
        // final answer unread on the connection.
        return Err(Failure::Transport);
    }
    let (mut length, mut close) = (None, false);
    for h in resp.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            let n = std::str::from_utf8(h.value).ok().and_then(|v| v.trim().parse().ok());
            length = Some(n.ok_or(Failure::Transport)?);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(Failure::Transport);
        } else if h.name.eq_ignore_ascii_case("connection") && h.value.eq_ignore_ascii_case(b"close") {
            close = true;
        }
    }
    let length = match (length, status) {
        (Some(n), _) => n,
        (None, 204 | 304) => 0,
        (None, _) => return Err(Failure::Transport),
    };
    Ok(Some((status, head_len, length, close)))
}

/// A whole request: `METHOD path` to `host` with a bearer `token` and a
/// JSON `body`.
pub fn request(method: &str, path: &str, host: SocketAddr, token: &str, body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "{method} {path} HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {token}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_are_read_with_their_length_and_close() {
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello";
        assert_eq!(parse_head(ok), Ok(Some((200, 38, 5, false))));
        assert_eq!(parse_head(&ok[..20]), Ok(None));
        let closing = b"HTTP/1.1 503 Busy\r\nConnection: close\r\nContent-Length: 0\r\n\r\n";
        assert_eq!(parse_head(closing), Ok(Some((503, closing.len(), 0, true))));
        assert_eq!(parse_head(b"HTTP/1.1 204 No Content\r\n\r\n"), Ok(Some((204, 27, 0, false))));
    }

    #[test]
    fn other_framings_and_garbage_fail() {
        assert_eq!(parse_head(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"), Err(Failure::Transport));
        assert_eq!(parse_head(b"HTTP/1.1 200 OK\r\n\r\n"), Err(Failure::Transport));
        assert_eq!(parse_head(b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n"), Err(Failure::Transport));
        assert_eq!(parse_head(b"\x00\x01garbage\r\n\r\n"), Err(Failure::Transport));
        assert_eq!(parse_head(b"HTTP/1.1 100 Continue\r\n\r\n"), Err(Failure::Transport));
    }

    #[tokio::test]
    async fn an_exchange_reads_the_whole_answer_and_reuses_the_connection() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let mut seen = Vec::new();
            for answer in [
                &b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"[..],
                b"HTTP/1.1 409 Conflict\r\ncontent-length: 0\r\n\r\n",
            ] {
                while !seen.windows(6).any(|w| w == b"\r\n\r\n{}") {
                    let n = s.read(&mut buf).await.unwrap();
                    seen.extend_from_slice(&buf[..n]);
                }
                seen.clear();
                s.write_all(answer).await.unwrap();
            }
        });
        let mut conn = RawConn::new(addr, Duration::from_secs(5));
        let req = request("PUT", "/v1/x", addr, "t", b"{}");
        assert_eq!(conn.send(&req).await, Ok(200));
        assert_eq!(conn.send(&req).await, Ok(409));
    }
}

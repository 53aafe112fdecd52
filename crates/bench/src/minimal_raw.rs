//! Issue 42's io_uring experiment: two minimal HTTP/1.1 keep-alive
//! proxies that differ in their IO model only.
//!
//! Both run one thread per worker with its own `SO_REUSEPORT` listener,
//! and per client connection one task that reads a whole request (its head
//! found by `httparse`, its body by `Content-Length`), writes it as it is
//! to its own upstream connection, reads the whole response the same way
//! and writes it back; no routing, header rewriting, limits or metrics
//! (Tidegate's native path does all of that on top of the same four
//! calls). The message framing below is shared; only the IO differs:
//!
//! - [`run_epoll`]: tokio's current-thread runtime, readiness through
//!   epoll and a `read`/`write` system call per operation, as Tidegate's
//!   native path does;
//! - [`run_uring`]: monoio's thread-per-core runtime on io_uring
//!   (completion-based: each operation is a submission-queue entry, and
//!   the entries of a loop iteration go to the kernel in one
//!   `io_uring_enter`).
//!
//! monoio because it is the most used thread-per-core io_uring runtime
//! on the stable toolchain (tokio-uring has been without a release since
//! 2024; compio is younger). It relays what the benchmark sends only:
//! `GET`s answered with a `Content-Length` body, one request at a time.
//! Chunked bodies are refused (the connection is closed); a response
//! without a length is taken as empty, and one to `HEAD`, 204 or 304 as
//! carrying the body its length announces; pipelined requests are
//! relayed one after another.

use std::net::SocketAddr;

use anyhow::Context as _;

use crate::cli::MinimalProxyArgs;

/// The bytes a read asks for.
const READ: usize = 16 * 1024;

/// The length of the first complete message in `buf` (head and body), if
/// it is all there; `Err` for a message this proxy does not carry (no
/// length, chunked, malformed).
fn message_len(buf: &[u8], request: bool) -> Result<Option<usize>, ()> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let parsed = match request {
        true => httparse::Request::new(&mut headers).parse(buf),
        false => httparse::Response::new(&mut headers).parse(buf),
    };
    let head = match parsed.map_err(|_| ())? {
        httparse::Status::Complete(n) => n,
        httparse::Status::Partial => return Ok(None),
    };
    let mut body = 0usize;
    for h in headers.iter().take_while(|h| !h.name.is_empty()) {
        if h.name.eq_ignore_ascii_case("content-length") {
            body = std::str::from_utf8(h.value).ok().and_then(|v| v.trim().parse().ok()).ok_or(())?;
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(());
        }
    }
    let total = head.checked_add(body).ok_or(())?;
    Ok((buf.len() >= total).then_some(total))
}

/// Serves with tokio (epoll) until the process is killed.
pub fn run_epoll(args: &MinimalProxyArgs) -> anyhow::Result<()> {
    workers(args, |listener, upstream| {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener)?;
            loop {
                let (stream, _) = listener.accept().await?;
                let _ = stream.set_nodelay(true);
                tokio::spawn(async move {
                    let _ = epoll_conn(stream, upstream).await;
                });
            }
        })
    })
}

async fn epoll_conn(mut client: tokio::net::TcpStream, upstream: SocketAddr) -> anyhow::Result<()> {
    use tokio::io::AsyncWriteExt;
    let mut up = tokio::net::TcpStream::connect(upstream).await?;
    up.set_nodelay(true)?;
    let (mut cbuf, mut ubuf) = (Vec::with_capacity(READ), Vec::with_capacity(READ));
    loop {
        let Some(n) = epoll_message(&mut client, &mut cbuf, true).await? else { return Ok(()) };
        up.write_all(&cbuf[..n]).await?;
        cbuf.drain(..n);
        let n = epoll_message(&mut up, &mut ubuf, false).await?.context("upstream closed")?;
        client.write_all(&ubuf[..n]).await?;
        ubuf.drain(..n);
    }
}

/// Reads until `buf` holds a whole message; `None` when the peer closed
/// before one began.
async fn epoll_message(
    s: &mut tokio::net::TcpStream,
    buf: &mut Vec<u8>,
    request: bool,
) -> anyhow::Result<Option<usize>> {
    use tokio::io::AsyncReadExt;
    loop {
        if let Some(n) = message_len(buf, request).map_err(|()| anyhow::anyhow!("unsupported message"))? {
            return Ok(Some(n));
        }
        if buf.capacity() - buf.len() < READ / 4 {
            buf.reserve(READ);
        }
        if s.read_buf(buf).await? == 0 {
            anyhow::ensure!(buf.is_empty(), "closed within a message");
            return Ok(None);
        }
    }
}

/// Serves with monoio (io_uring) until the process is killed.
pub fn run_uring(args: &MinimalProxyArgs) -> anyhow::Result<()> {
    workers(args, |listener, upstream| {
        let mut rt = monoio::RuntimeBuilder::<monoio::IoUringDriver>::new()
            .with_entries(1024)
            .build()
            .context("starting an io_uring runtime")?;
        rt.block_on(async move {
            let listener = monoio::net::TcpListener::from_std(listener)?;
            loop {
                let (stream, _) = listener.accept().await?;
                let _ = stream.set_nodelay(true);
                monoio::spawn(async move {
                    let _ = uring_conn(stream, upstream).await;
                });
            }
        })
    })
}

async fn uring_conn(mut client: monoio::net::TcpStream, upstream: SocketAddr) -> anyhow::Result<()> {
    let mut up = monoio::net::TcpStream::connect(upstream).await?;
    up.set_nodelay(true)?;
    let (mut cbuf, mut ubuf) = (Vec::with_capacity(READ), Vec::with_capacity(READ));
    let mut scratch = Vec::with_capacity(READ);
    loop {
        let Some(n) = uring_message(&mut client, &mut cbuf, &mut scratch, true).await? else { return Ok(()) };
        cbuf = uring_write(&mut up, cbuf, n).await?;
        let n = uring_message(&mut up, &mut ubuf, &mut scratch, false).await?.context("upstream closed")?;
        ubuf = uring_write(&mut client, ubuf, n).await?;
    }
}

/// Writes the first `n` bytes of `buf` (owned: the kernel reads it while
/// the write is in flight) and gives back what follows them.
async fn uring_write(s: &mut monoio::net::TcpStream, mut buf: Vec<u8>, n: usize) -> anyhow::Result<Vec<u8>> {
    use monoio::io::AsyncWriteRentExt;
    let rest = buf.split_off(n);
    let (res, mut buf) = s.write_all(buf).await;
    res?;
    buf.clear();
    buf.extend_from_slice(&rest);
    Ok(buf)
}

/// Reads until `buf` holds a whole message; `None` when the peer closed
/// before one began. The buffer a read fills is owned by the kernel while
/// the read is in flight, and filled from its start: an empty `buf` is
/// read into directly, else the read lands in `scratch` and is appended.
async fn uring_message(
    s: &mut monoio::net::TcpStream,
    buf: &mut Vec<u8>,
    scratch: &mut Vec<u8>,
    request: bool,
) -> anyhow::Result<Option<usize>> {
    use monoio::io::AsyncReadRent;
    loop {
        if let Some(n) = message_len(buf, request).map_err(|()| anyhow::anyhow!("unsupported message"))? {
            return Ok(Some(n));
        }
        let direct = buf.is_empty();
        let target = if direct { &mut *buf } else { &mut *scratch };
        let mut owned = std::mem::take(target);
        owned.clear();
        let (res, owned) = s.read(owned).await;
        *target = owned;
        if res? == 0 {
            anyhow::ensure!(buf.is_empty(), "closed within a message");
            return Ok(None);
        }
        if !direct {
            buf.extend_from_slice(scratch);
        }
    }
}

/// Starts `args.workers` threads, each serving its own `SO_REUSEPORT`
/// listener with `serve`, and waits for them.
fn workers(
    args: &MinimalProxyArgs,
    serve: impl Fn(std::net::TcpListener, SocketAddr) -> anyhow::Result<()> + Copy + Send + 'static,
) -> anyhow::Result<()> {
    let mut threads = Vec::new();
    for _ in 0..args.workers.max(1) {
        let listener = crate::minimal::bind(args.listen).with_context(|| format!("binding {}", args.listen))?;
        let upstream = args.upstream;
        threads.push(std::thread::spawn(move || serve(listener, upstream)));
    }
    for t in threads {
        t.join().map_err(|_| anyhow::anyhow!("a worker panicked"))??;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::message_len;

    #[test]
    fn a_message_is_whole_with_its_head_and_its_length() {
        let req = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc";
        assert_eq!(message_len(&req[..20], true), Ok(None), "a partial head");
        assert_eq!(message_len(&req[..req.len() - 1], true), Ok(None), "a partial body");
        assert_eq!(message_len(req, true), Ok(Some(req.len())));
        let resp = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\nGET";
        assert_eq!(message_len(resp, false), Ok(Some(resp.len() - 3)), "what follows is the next one's");
        assert_eq!(message_len(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", false), Err(()));
        assert_eq!(message_len(b"GET / HTTP/1.1\r\nContent-Length: x\r\n\r\n", true), Err(()));
    }
}

//! Moving bytes: reading into a connection's inbox, writing several
//! slices at once, and relaying a body from one connection to another
//! under its framing (a length, chunked, or until the close), re-framing
//! it when the two sides need different framings.

use std::future::Future;
use std::io::{self, IoSlice};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use tidegate_h1::{chunk_size_line, ChunkedDecoder, CHUNKED_END};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;

use super::timer::Timer;
use crate::admission::Pace;

pub(crate) use tidegate_upstream::buffers::{fill, READ_CHUNK};

/// The most one read takes of a backend's response body of known length,
/// and the largest such body gathered whole before its head is written:
/// a body of a few pieces then costs one read and one write instead of a
/// read and a write per [`READ_CHUNK`] (and a wakeup of the client per
/// write). A client's body is read in [`READ_CHUNK`]s, so a slow upload
/// holds little.
pub(crate) const GATHER: usize = 64 * 1024;

/// Why a relay stopped early.
#[derive(Debug)]
pub(crate) enum RelayError {
    /// The sending side closed before the body ended.
    Eof,
    /// The sending side failed.
    Read(io::Error),
    /// The sending side was too slow: a gap or the whole body too long.
    Timeout,
    /// The sending side fell under its minimum pace.
    TooSlow(crate::admission::TooSlow),
    /// The body's framing is malformed.
    Malformed,
    /// The body carried more than the route's `max_body_bytes` takes.
    TooLarge,
    /// The receiving side failed.
    Write(io::Error),
}

impl std::fmt::Display for RelayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RelayError::Eof => f.write_str("the sender closed before the end of the body"),
            RelayError::Read(e) => write!(f, "reading the body: {e}"),
            RelayError::Timeout => f.write_str("the sender was too slow"),
            RelayError::TooSlow(e) => e.fmt(f),
            RelayError::Malformed => f.write_str("malformed chunked body"),
            RelayError::TooLarge => f.write_str("a body larger than the route takes"),
            RelayError::Write(e) => write!(f, "writing the body: {e}"),
        }
    }
}

/// Writes every slice, in order, with as few writes as the socket allows.
/// Empty slices at the end are no part of the writes (a request head with
/// no body is one `write`, not a `writev` of two buffers).
pub(crate) async fn write_all<W: AsyncWrite + Unpin>(w: &mut W, parts: &mut [&[u8]]) -> io::Result<()> {
    let end = parts.iter().rposition(|p| !p.is_empty()).map_or(0, |last| last + 1);
    let parts = &mut parts[..end];
    let mut first = 0;
    while first < parts.len() {
        if parts[first].is_empty() {
            first += 1;
            continue;
        }
        let n = if first + 1 == parts.len() {
            w.write(parts[first]).await?
        } else {
            let mut slices = [IoSlice::new(&[]); 4];
            let count = (parts.len() - first).min(slices.len());
            for (s, p) in slices.iter_mut().zip(&parts[first..first + count]) {
                *s = IoSlice::new(p);
            }
            w.write_vectored(&slices[..count]).await?
        };
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        let mut left = n;
        while left > 0 && first < parts.len() {
            let take = left.min(parts[first].len());
            parts[first] = &parts[first][take..];
            left -= take;
            if parts[first].is_empty() {
                first += 1;
            }
        }
    }
    Ok(())
}

/// The sending side of a relay: a socket, the bytes already read from it,
/// and how long it may take to send more.
pub(crate) struct Source<'a, R> {
    pub stream: &'a mut R,
    pub inbox: &'a mut BytesMut,
    pub timer: &'a mut Timer,
    /// Longest wait for the next bytes.
    pub gap: Duration,
    /// When the whole body must have arrived, if ever.
    pub until: Option<Instant>,
    /// The minimum pace the sender must keep, if any (a request body
    /// streamed to a backend).
    pub pace: Option<Pace>,
    /// The most one read of a body of known length takes:
    /// [`READ_CHUNK`] for a client's body, [`GATHER`] for a backend's.
    pub read_max: usize,
}

impl<R: AsyncRead + Unpin> Source<'_, R> {
    /// Reads more bytes into the inbox.
    async fn more(&mut self) -> Result<(), RelayError> {
        let gap = Instant::now() + self.gap;
        let deadline = self.until.map_or(gap, |u| u.min(gap));
        loop {
            // The pace is checked at the end of each of its windows, bytes
            // or not.
            let check = self.pace.as_mut().map(|p| p.deadline(Instant::now()));
            let wake = check.map_or(deadline, |c| c.min(deadline));
            let read = self.timer.run(wake, fill(self.stream, self.inbox)).await;
            let now = Instant::now();
            return match read {
                None if now < deadline && check.is_some() => {
                    if let Some(p) = &mut self.pace {
                        p.check(now).map_err(RelayError::TooSlow)?;
                    }
                    continue;
                }
                None => Err(RelayError::Timeout),
                Some(Ok(0)) => Err(RelayError::Eof),
                Some(Ok(n)) => match &mut self.pace {
                    Some(p) => p.arrived(n, now).map_err(RelayError::TooSlow),
                    None => Ok(()),
                },
                Some(Err(e)) => Err(RelayError::Read(e)),
            };
        }
    }

    /// Reads what the sender has sent already, without waiting: `true`
    /// when bytes came, `false` when none are there yet.
    fn read_ready(&mut self) -> Result<bool, RelayError> {
        let read = std::pin::pin!(fill(self.stream, self.inbox));
        // (A waker that does nothing: nobody waits on this poll; the
        // stream's next poll, by a task, registers its own.)
        match read.poll(&mut std::task::Context::from_waker(std::task::Waker::noop())) {
            std::task::Poll::Pending => Ok(false),
            std::task::Poll::Ready(Ok(0)) => Err(RelayError::Eof),
            std::task::Poll::Ready(Ok(n)) => match &mut self.pace {
                Some(p) => p.arrived(n, Instant::now()).map(|()| true).map_err(RelayError::TooSlow),
                None => Ok(true),
            },
            std::task::Poll::Ready(Err(e)) => Err(RelayError::Read(e)),
        }
    }

    /// Whether the inbox holds `n` bytes, after reading what the sender
    /// has sent already (without waiting) when `n` is at most
    /// [`GATHER`]. An error is left for the next read to meet.
    pub(crate) fn gather(&mut self, n: usize) -> bool {
        if n > self.inbox.len() && n <= GATHER {
            // (One byte more, as in `relay_length`: the read that ends the
            // body leaves the socket known to be drained.)
            self.inbox.reserve(n - self.inbox.len() + 1);
            while self.inbox.len() < n && self.read_ready().unwrap_or(false) {}
        }
        n <= self.inbox.len()
    }

    /// Reads until the inbox holds at least `n` bytes (the start of a body
    /// read ahead, left in the inbox for the relay).
    pub(crate) async fn fill_to(&mut self, n: usize) -> Result<(), RelayError> {
        while self.inbox.len() < n {
            self.inbox.reserve(n - self.inbox.len());
            self.more().await?;
        }
        Ok(())
    }

    /// Reads a chunked body ahead into the inbox, as it came (the relay
    /// decodes it later), until it is complete (`true`) or the inbox holds
    /// `bound` bytes (`false`). Malformed framing fails at once.
    pub(crate) async fn read_ahead_chunked(&mut self, bound: usize) -> Result<bool, RelayError> {
        let mut scan = ChunkedDecoder::default();
        let mut seen = 0;
        loop {
            while seen < self.inbox.len() {
                let step = scan.decode(&self.inbox[seen..]).map_err(|_| RelayError::Malformed)?;
                seen += step.consumed;
                if step.done {
                    return Ok(true);
                }
                if step.consumed == 0 {
                    break;
                }
            }
            if self.inbox.len() >= bound {
                return Ok(false);
            }
            self.more().await?;
        }
    }

    /// Reads exactly `n` bytes (some may be buffered already) and returns
    /// them; for small bodies that are held in memory.
    pub(crate) async fn read_exact(&mut self, n: usize) -> Result<bytes::Bytes, RelayError> {
        while self.inbox.len() < n {
            self.inbox.reserve(n - self.inbox.len());
            self.more().await?;
        }
        Ok(self.inbox.split_to(n).freeze())
    }
}

/// Relays a body of `n` bytes.
pub(crate) async fn relay_length<W: AsyncWrite + Unpin>(
    src: &mut Source<'_, impl AsyncRead + Unpin>,
    dst: &mut W,
    mut n: u64,
) -> Result<(), RelayError> {
    loop {
        let take = usize::try_from(n).unwrap_or(usize::MAX).min(src.inbox.len());
        if take > 0 {
            dst.write_all(&src.inbox[..take]).await.map_err(RelayError::Write)?;
            src.inbox.advance(take);
            n -= take as u64;
        }
        if n == 0 {
            return Ok(());
        }
        if src.read_max > READ_CHUNK {
            // (One byte more: a read that ends the body then does not fill
            // the buffer, which tells the reactor the socket is drained.)
            src.inbox.reserve(usize::try_from(n).unwrap_or(usize::MAX).min(src.read_max) + 1);
        }
        src.more().await?;
    }
}

/// Writes one piece of a body: as a chunk (`rechunk`) or as it is.
pub(crate) async fn write_piece<W: AsyncWrite + Unpin>(
    dst: &mut W,
    data: &[u8],
    rechunk: bool,
) -> Result<(), RelayError> {
    let written = if rechunk {
        let mut line = [0u8; 18];
        let size = chunk_size_line(data.len(), &mut line);
        write_all(dst, &mut [size, data, b"\r\n"]).await
    } else {
        dst.write_all(data).await
    };
    written.map_err(RelayError::Write)
}

/// Relays a chunked body: chunked again (`rechunk`) or as plain bytes;
/// one that carries more than `limit` bytes of data (a request body under
/// a `max_body_bytes` rule) fails with [`RelayError::TooLarge`] before the
/// piece that goes past it is written.
pub(crate) async fn relay_chunked<W: AsyncWrite + Unpin>(
    src: &mut Source<'_, impl AsyncRead + Unpin>,
    dst: &mut W,
    rechunk: bool,
    limit: Option<u64>,
) -> Result<(), RelayError> {
    let mut decoder = ChunkedDecoder::default();
    let mut left = limit.unwrap_or(u64::MAX);
    loop {
        let step = decoder.decode(src.inbox).map_err(|_| RelayError::Malformed)?;
        if let Some(range) = step.data.clone() {
            left = left.checked_sub(range.len() as u64).ok_or(RelayError::TooLarge)?;
            write_piece(dst, &src.inbox[range], rechunk).await?;
        }
        src.inbox.advance(step.consumed);
        if step.done {
            if rechunk {
                dst.write_all(CHUNKED_END).await.map_err(RelayError::Write)?;
            }
            return Ok(());
        }
        if src.inbox.is_empty() {
            src.more().await?;
        }
    }
}

/// Relays everything until the sender closes: chunked (`rechunk`) or as
/// plain bytes.
pub(crate) async fn relay_until_close<W: AsyncWrite + Unpin>(
    src: &mut Source<'_, impl AsyncRead + Unpin>,
    dst: &mut W,
    rechunk: bool,
) -> Result<(), RelayError> {
    loop {
        if !src.inbox.is_empty() {
            write_piece(dst, src.inbox, rechunk).await?;
            src.inbox.clear();
        }
        match src.more().await {
            Ok(()) => {}
            Err(RelayError::Eof) => break,
            Err(e) => return Err(e),
        }
    }
    if rechunk {
        dst.write_all(CHUNKED_END).await.map_err(RelayError::Write)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::pin::Pin;
    use std::task::{Context, Poll};
    use tokio::net::TcpStream;

    #[tokio::test]
    async fn write_all_handles_many_slices() {
        let mut out = Vec::new();
        write_all(&mut out, &mut [b"ab", b"", b"cd", b"e", b"f", b"gh"]).await.unwrap();
        assert_eq!(out, b"abcdefgh");
    }

    /// Records the buffers of each write it gets (0: a plain `write`).
    #[derive(Default)]
    struct Calls(Vec<usize>, Vec<u8>);

    impl AsyncWrite for Calls {
        fn poll_write(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            self.0.push(0);
            self.1.extend_from_slice(buf);
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_write_vectored(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            self.0.push(bufs.len());
            let n = bufs.iter().map(|b| b.len()).sum();
            for b in bufs {
                self.1.extend_from_slice(b);
            }
            Poll::Ready(Ok(n))
        }
        fn is_write_vectored(&self) -> bool {
            true
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn empty_slices_at_the_end_make_no_vectored_write() {
        let mut w = Calls::default();
        write_all(&mut w, &mut [b"head", b""]).await.unwrap();
        assert_eq!((w.0, w.1), (vec![0], b"head".to_vec()), "one plain write");
        let mut w = Calls::default();
        write_all(&mut w, &mut [b"head", b"", b"body", b""]).await.unwrap();
        assert_eq!((w.0, w.1), (vec![3], b"headbody".to_vec()), "one write of the slices up to the last");
        let mut w = Calls::default();
        write_all(&mut w, &mut [b"", b""]).await.unwrap();
        assert!(w.0.is_empty(), "nothing to write");
    }

    async fn pair() -> (TcpStream, TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (b, _) = l.accept().await.unwrap();
        (a, b)
    }

    #[tokio::test]
    async fn bodies_are_relayed_and_reframed() {
        let (mut tx, mut rx) = pair().await;
        tx.write_all(b"3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\nNEXT").await.unwrap();
        let mut inbox = BytesMut::new();
        let mut timer = Timer::new();
        let mut src = Source {
            stream: &mut rx,
            inbox: &mut inbox,
            timer: &mut timer,
            gap: Duration::from_secs(5),
            until: None,
            pace: None,
            read_max: READ_CHUNK,
        };
        let mut out = Vec::new();
        relay_chunked(&mut src, &mut out, true, None).await.unwrap();
        assert_eq!(out, b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n");
        let mut plain = Vec::new();
        tx.write_all(b"XYZ").await.unwrap();
        relay_length(&mut src, &mut plain, 7).await.unwrap();
        assert_eq!(plain, b"NEXTXYZ");
        drop(tx);
        let mut rest = Vec::new();
        relay_until_close(&mut src, &mut rest, true).await.unwrap();
        assert_eq!(rest, b"0\r\n\r\n");
    }

    #[tokio::test]
    async fn a_chunked_body_is_read_ahead_up_to_its_end_or_the_bound() {
        let (mut tx, mut rx) = pair().await;
        let (mut inbox, mut timer) = (BytesMut::new(), Timer::new());
        let gap = Duration::from_secs(5);
        let mut src = Source {
            stream: &mut rx,
            inbox: &mut inbox,
            timer: &mut timer,
            gap,
            until: None,
            pace: None,
            read_max: READ_CHUNK,
        };
        tx.write_all(b"3\r\nabc\r\n").await.unwrap();
        tx.write_all(b"0\r\n\r\nNEXT").await.unwrap();
        assert!(src.read_ahead_chunked(1024).await.unwrap(), "complete");
        let mut plain = Vec::new();
        relay_chunked(&mut src, &mut plain, false, None).await.unwrap();
        assert_eq!(plain, b"abc");
        assert_eq!(&src.inbox[..], b"NEXT", "what follows the body stays");
        src.inbox.clear();
        tx.write_all(b"10\r\n0123456789abcdef\r\n").await.unwrap();
        assert!(!src.read_ahead_chunked(8).await.unwrap(), "stopped at the bound");
        tx.write_all(b"zz").await.unwrap();
        assert!(matches!(src.read_ahead_chunked(1024).await, Err(RelayError::Malformed)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_sender_under_its_minimum_pace_is_cut() {
        use crate::admission::{MinRate, Pace};
        let (mut tx, mut rx) = pair().await;
        let (mut inbox, mut timer) = (BytesMut::new(), Timer::new());
        let rate = MinRate { bytes_per_s: 10, window: Duration::from_secs(2) };
        let mut src = Source {
            stream: &mut rx,
            inbox: &mut inbox,
            timer: &mut timer,
            gap: Duration::from_secs(30),
            until: None,
            pace: Some(Pace::new(rate)),
            read_max: READ_CHUNK,
        };
        let feeder = tokio::spawn(async move {
            // 5 bytes a second: half the pace, with no gap over 30 s.
            for _ in 0..10 {
                if tx.write_all(b"xxxxx").await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        let r = relay_length(&mut src, &mut Vec::new(), 1000).await;
        assert!(matches!(r, Err(RelayError::TooSlow(_))), "{r:?}");
        feeder.abort();
    }

    #[tokio::test]
    async fn a_silent_sender_times_out_and_a_short_one_is_an_eof() {
        let (tx, mut rx) = pair().await;
        let mut inbox = BytesMut::new();
        let mut timer = Timer::new();
        let mut src = Source {
            stream: &mut rx,
            inbox: &mut inbox,
            timer: &mut timer,
            gap: Duration::from_millis(200),
            until: None,
            pace: None,
            read_max: READ_CHUNK,
        };
        let r = relay_length(&mut src, &mut Vec::new(), 5).await;
        assert!(matches!(r, Err(RelayError::Timeout)), "{r:?}");
        drop(tx);
        let r = relay_length(&mut src, &mut Vec::new(), 5).await;
        assert!(matches!(r, Err(RelayError::Eof)), "{r:?}");
    }
}

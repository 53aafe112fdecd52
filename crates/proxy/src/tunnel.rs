//! Upgraded connections (WebSocket and the like): the client's and the
//! backend's sockets joined byte for byte.
//!
//! A tunnel keeps what a request whose body is still streaming keeps,
//! until it closes: its place in flight to its backend and under the
//! backend's `max_conns`, and its client connection's place under
//! `--max-connections`; not a place under the learned concurrency limit,
//! which bounds requests still awaiting their answer. It is closed when
//! neither side sends a byte for the tunnel idle timeout.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tidegate_balance::clock;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::body::Hold;
use crate::conn::ConnHold;

/// Joins the two sides once both upgrades complete, in a task of its own.
pub(crate) fn splice_hyper(
    down: hyper::upgrade::OnUpgrade,
    up: hyper::upgrade::OnUpgrade,
    hold: Hold,
    conn_slot: Option<Arc<ConnHold>>,
    idle: Duration,
) {
    tokio::spawn(async move {
        let _held = (hold, conn_slot);
        let (Ok(down), Ok(up)) = tokio::join!(down, up) else {
            return;
        };
        join(&mut TokioIo::new(down), &mut TokioIo::new(up), idle).await;
    });
}

/// Copies bytes both ways between `down` and `up` until either side
/// closes or neither sends a byte for `idle`.
pub(crate) async fn join<A, B>(down: &mut A, up: &mut B, idle: Duration)
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let last = Arc::new(AtomicU64::new(clock::now_ms()));
    let mut down = Stamped { io: down, last: last.clone() };
    let mut up = Stamped { io: up, last: last.clone() };
    let copy = tokio::io::copy_bidirectional(&mut down, &mut up);
    tokio::pin!(copy);
    let check = idle.clamp(Duration::from_millis(100), Duration::from_secs(5));
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + check, check);
    loop {
        tokio::select! {
            _ = &mut copy => return,
            _ = tick.tick() => {
                let quiet = clock::now_ms().saturating_sub(last.load(Relaxed));
                if quiet >= idle.as_millis() as u64 {
                    tracing::debug!(quiet_ms = quiet, "tunnel closed after its idle timeout");
                    return;
                }
            }
        }
    }
}

/// A socket that stamps the time of every byte moved through it.
struct Stamped<T> {
    io: T,
    last: Arc<AtomicU64>,
}

impl<T> Stamped<T> {
    fn stamp<R>(&self, polled: &Poll<std::io::Result<R>>) {
        if matches!(polled, Poll::Ready(Ok(_))) {
            self.last.store(clock::now_ms(), Relaxed);
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Stamped<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        self.stamp(&polled);
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Stamped<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        self.stamp(&polled);
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

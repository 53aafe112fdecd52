//! Bodies: what the proxy sends upstream and what it hands to hyper.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;

use crate::admission::{MinRate, Pace};
use crate::error::ClientBodyError;
use crate::observe::Finish;
use crate::pick::Slot;
use crate::pool::{Conn, HyperConn};
use crate::static_files::FileBody;

/// Errors while streaming a body.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A client's request body, read under the body timeouts: each piece must
/// arrive within `gap` of the previous one, and the whole body by
/// `deadline`; once it streams to a backend, at the minimum pace too
/// ([`crate::admission::Pace`]). What was read ahead before a backend was
/// chosen comes first. Its errors are [`ClientBodyError`]s, so a failed
/// attempt can tell the client broke the exchange.
#[derive(Debug)]
pub struct ClientBody {
    inner: Incoming,
    /// Read ahead before a backend was chosen, sent first.
    ahead: std::collections::VecDeque<Bytes>,
    ahead_len: u64,
    gap: Duration,
    /// When the next piece must have arrived by.
    gap_at: tokio::time::Instant,
    deadline: tokio::time::Instant,
    timer: Pin<Box<tokio::time::Sleep>>,
    pace: Option<Pace>,
}

impl ClientBody {
    /// Wraps a request body; the clocks start now.
    pub(crate) fn new(inner: Incoming, gap: Duration, total: Duration) -> ClientBody {
        let now = tokio::time::Instant::now();
        let deadline = now + total;
        let gap_at = deadline.min(now + gap);
        ClientBody {
            inner,
            ahead: Default::default(),
            ahead_len: 0,
            gap,
            gap_at,
            deadline,
            timer: Box::pin(tokio::time::sleep_until(gap_at)),
            pace: None,
        }
    }

    /// The body streams to a backend from now on: `read` (read ahead)
    /// goes first, and the rest must keep `rate`, if any.
    pub(crate) fn streamed(mut self, read: Vec<Bytes>, rate: Option<MinRate>) -> ClientBody {
        self.ahead_len = read.iter().map(|b| b.len() as u64).sum();
        self.ahead = read.into();
        self.pace = rate.map(Pace::new);
        self
    }

    /// When the timer must fire next: the gap, the whole body's deadline,
    /// or the end of the pace's window.
    fn next_wake(&mut self, now: tokio::time::Instant) -> tokio::time::Instant {
        let at = self.gap_at.min(self.deadline);
        self.pace.as_mut().map_or(at, |p| p.deadline(now).min(at))
    }
}

impl Body for ClientBody {
    type Data = Bytes;
    type Error = ClientBodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        let this = &mut *self;
        if let Some(b) = this.ahead.pop_front() {
            this.ahead_len -= b.len() as u64;
            return Poll::Ready(Some(Ok(Frame::data(b))));
        }
        if this.pace.as_ref().is_some_and(|p| !p.started()) {
            // The first read of a streamed body starts the pace's window.
            let wake = this.next_wake(tokio::time::Instant::now());
            this.timer.as_mut().reset(wake);
        }
        loop {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let now = tokio::time::Instant::now();
                    if let (Some(p), Some(d)) = (&mut this.pace, frame.data_ref()) {
                        if p.arrived(d.len(), now).is_err() {
                            return Poll::Ready(Some(Err(ClientBodyError::TimedOut)));
                        }
                    }
                    this.gap_at = this.deadline.min(now + this.gap);
                    let wake = this.next_wake(now);
                    this.timer.as_mut().reset(wake);
                    return Poll::Ready(Some(Ok(frame)));
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(ClientBodyError::Read(e)))),
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => {}
            }
            if this.timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let now = tokio::time::Instant::now();
            let paced = this.pace.as_mut().map(|p| p.check(now));
            if now >= this.gap_at || now >= this.deadline || matches!(paced, Some(Err(_))) {
                return Poll::Ready(Some(Err(ClientBodyError::TimedOut)));
            }
            // The end of a pace window that the body kept: the next one.
            let wake = this.next_wake(now);
            this.timer.as_mut().reset(wake);
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ahead.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let inner = self.inner.size_hint();
        match inner.exact() {
            Some(n) => SizeHint::with_exact(n + self.ahead_len),
            None => {
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower() + self.ahead_len);
                hint
            }
        }
    }
}

/// A request body sent to a backend: buffered (and so replayable) or the
/// client's body streamed through.
#[derive(Debug)]
pub enum UpBody {
    /// Held in memory.
    Buffered(Full<Bytes>),
    /// Streamed from the client.
    Streaming(ClientBody),
    /// Streamed from a native client connection through a channel.
    Channel(crate::upstream_h2::ChannelBody),
}

#[cfg(test)]
impl UpBody {
    /// An empty body.
    pub fn empty() -> UpBody {
        UpBody::Buffered(Full::new(Bytes::new()))
    }
}

impl Body for UpBody {
    type Data = Bytes;
    type Error = ClientBodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        match self.get_mut() {
            UpBody::Buffered(b) => Pin::new(b).poll_frame(cx).map_err(|never| match never {}),
            UpBody::Streaming(b) => Pin::new(b).poll_frame(cx),
            UpBody::Channel(b) => Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpBody::Buffered(b) => b.is_end_stream(),
            UpBody::Streaming(b) => b.is_end_stream(),
            UpBody::Channel(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpBody::Buffered(b) => b.size_hint(),
            UpBody::Streaming(b) => b.size_hint(),
            UpBody::Channel(b) => b.size_hint(),
        }
    }
}

/// What a backend's response body holds until it ends: the request's
/// in-flight mark and, for a keep-alive connection, the connection itself,
/// which goes back to the pool only after a clean end of the body.
#[derive(Debug)]
pub struct Hold {
    pub(crate) slot: Slot,
    pub(crate) conn: Option<Conn<HyperConn>>,
}

impl Hold {
    /// The body ended cleanly: the connection may serve another request.
    fn finish(self) {
        let Hold { slot, conn } = self;
        if let Some(c) = conn {
            c.release();
        }
        drop(slot); // after the release, so a woken queued request can reuse it
    }
}

/// A response body: from a backend, generated, or from a file.
#[derive(Debug)]
pub enum ProxyBody {
    /// A backend's body.
    Upstream {
        /// The body.
        body: Incoming,
        /// Released when the body ends, dropped if it breaks or the client
        /// goes away (which closes the connection).
        hold: Option<Hold>,
    },
    /// A body held in memory.
    Full(Full<Bytes>),
    /// A file (or a range of it).
    File(FileBody),
    /// A backend's body read from a native upstream connection.
    Native(crate::native::bridge::NativeBody),
    /// A body whose end finishes its request's record (the hyper path).
    Observed(Box<Observed>),
}

/// A response body that counts its bytes and, when it ends or is dropped,
/// finishes its request's record (duration histogram, access log: the
/// [`Finish`] it holds does that when dropped).
#[derive(Debug)]
pub struct Observed {
    body: ProxyBody,
    bytes: u64,
    finish: Option<Finish>,
}

impl Observed {
    /// Finishes the request's record now (dropping it again is a no-op).
    fn done(&mut self) {
        if let Some(mut f) = self.finish.take() {
            f.bytes_out = self.bytes;
        }
    }
}

impl ProxyBody {
    /// A short body from memory.
    pub fn text(s: impl Into<Bytes>) -> ProxyBody {
        ProxyBody::Full(Full::new(s.into()))
    }

    /// An empty body.
    pub fn empty() -> ProxyBody {
        ProxyBody::Full(Full::new(Bytes::new()))
    }

    /// `body`, finishing `finish` when it ends.
    pub(crate) fn observed(body: ProxyBody, finish: Finish) -> ProxyBody {
        ProxyBody::Observed(Box::new(Observed { body, bytes: 0, finish: Some(finish) }))
    }

    /// A backend's body. When it is already complete (no body, or an empty
    /// one), hyper may never poll it, so the connection is released now.
    pub(crate) fn upstream(body: Incoming, hold: Hold) -> ProxyBody {
        if body.is_end_stream() {
            hold.finish();
            return ProxyBody::Upstream { body, hold: None };
        }
        ProxyBody::Upstream { body, hold: Some(hold) }
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            ProxyBody::Upstream { body, hold } => {
                let polled = Pin::new(&mut *body).poll_frame(cx);
                match &polled {
                    Poll::Ready(None) => {
                        if let Some(h) = hold.take() {
                            h.finish();
                        }
                    }
                    Poll::Ready(Some(Ok(_))) if body.is_end_stream() => {
                        if let Some(h) = hold.take() {
                            h.finish();
                        }
                    }
                    // A broken body closes its connection with the hold.
                    Poll::Ready(Some(Err(_))) => drop(hold.take()),
                    _ => {}
                }
                polled.map_err(Into::into)
            }
            ProxyBody::Full(b) => Pin::new(b).poll_frame(cx).map_err(|never| match never {}),
            ProxyBody::File(f) => Pin::new(f).poll_frame(cx),
            ProxyBody::Native(n) => Pin::new(n).poll_frame(cx),
            ProxyBody::Observed(o) => {
                let polled = Pin::new(&mut o.body).poll_frame(cx);
                match &polled {
                    Poll::Ready(Some(Ok(frame))) => {
                        o.bytes += frame.data_ref().map_or(0, |d| d.len() as u64);
                        if o.body.is_end_stream() {
                            o.done();
                        }
                    }
                    Poll::Ready(None | Some(Err(_))) => o.done(),
                    Poll::Pending => {}
                }
                polled
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Upstream { body, .. } => body.is_end_stream(),
            ProxyBody::Full(b) => b.is_end_stream(),
            ProxyBody::File(f) => f.is_end_stream(),
            ProxyBody::Native(n) => n.is_end_stream(),
            ProxyBody::Observed(o) => o.body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Upstream { body, .. } => body.size_hint(),
            ProxyBody::Full(b) => b.size_hint(),
            ProxyBody::File(f) => f.size_hint(),
            ProxyBody::Native(n) => n.size_hint(),
            ProxyBody::Observed(o) => o.body.size_hint(),
        }
    }
}

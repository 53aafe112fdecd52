//! Request bodies as they go to a backend: the client's body ([`Inbound`],
//! hyper's or HTTP/3's) read under the body timeouts ([`ClientBody`]), fed
//! through a channel by the native engine ([`ChannelBody`]), or held in
//! memory ([`UpBody::Buffered`]).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use tokio::sync::mpsc;

use crate::admission::{MinRate, Pace};
use crate::upstream_error::ClientBodyError;

/// A client's request body as an engine hands it to the pipeline: hyper's
/// (HTTP/1.1 and HTTP/2 clients) or an HTTP/3 stream's.
#[derive(Debug)]
pub enum Inbound {
    /// hyper's.
    Hyper(Incoming),
    /// Any other engine's (HTTP/3).
    Boxed(InboundBox),
}

/// Another engine's request body.
pub struct InboundBox(Pin<Box<dyn Body<Data = Bytes, Error = BoxError> + Send + Sync>>);

impl std::fmt::Debug for InboundBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InboundBox")
    }
}

/// Why another engine's body broke off.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl Inbound {
    /// Another engine's body.
    pub fn boxed<B>(body: B) -> Inbound
    where
        B: Body<Data = Bytes> + Send + Sync + 'static,
        B::Error: std::error::Error + Send + Sync + 'static,
    {
        use http_body_util::BodyExt;
        Inbound::Boxed(InboundBox(Box::pin(body.map_err(|e| Box::new(e) as BoxError))))
    }
}

impl Body for Inbound {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            Inbound::Hyper(b) => Pin::new(b).poll_frame(cx).map_err(|e| Box::new(e) as BoxError),
            Inbound::Boxed(b) => b.0.as_mut().poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Inbound::Hyper(b) => b.is_end_stream(),
            Inbound::Boxed(b) => b.0.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Inbound::Hyper(b) => b.size_hint(),
            Inbound::Boxed(b) => b.0.size_hint(),
        }
    }
}

/// A client's request body, read under the body timeouts: each piece must
/// arrive within `gap` of the previous one, and the whole body by
/// `deadline`; once it streams to a backend, at the minimum pace too
/// ([`crate::admission::Pace`]). What was read ahead before a backend was
/// chosen comes first. Its errors are [`ClientBodyError`]s, so a failed
/// attempt can tell the client broke the exchange.
#[derive(Debug)]
pub struct ClientBody {
    inner: Inbound,
    /// Read ahead before a backend was chosen, sent first.
    ahead: std::collections::VecDeque<Bytes>,
    ahead_len: u64,
    gap: Duration,
    /// When the next piece must have arrived by.
    gap_at: tokio::time::Instant,
    deadline: tokio::time::Instant,
    timer: Pin<Box<tokio::time::Sleep>>,
    pace: Option<Pace>,
    /// The bytes the route's rules still take (`max_body_bytes`), if they
    /// limit the body.
    left: Option<u64>,
}

impl ClientBody {
    /// Wraps a request body; the clocks start now.
    pub(crate) fn new(inner: Inbound, gap: Duration, total: Duration) -> ClientBody {
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
            left: None,
        }
    }

    /// Refuses (with [`ClientBodyError::TooLarge`]) a body that carries
    /// more than `max` bytes, if a limit is given.
    pub(crate) fn limited(mut self, max: Option<u64>) -> ClientBody {
        self.left = max;
        self
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
                    if let (Some(left), Some(d)) = (&mut this.left, frame.data_ref()) {
                        match left.checked_sub(d.len() as u64) {
                            Some(rest) => *left = rest,
                            None => return Poll::Ready(Some(Err(ClientBodyError::TooLarge))),
                        }
                    }
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
        match inner.exact().and_then(|n| n.checked_add(self.ahead_len)) {
            Some(n) => SizeHint::with_exact(n),
            // (A length that overflows with what was read ahead is no
            // length: the body goes chunked.)
            None => {
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower().saturating_add(self.ahead_len));
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
    Channel(ChannelBody),
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

/// A request body fed from a client connection by another future of the
/// same task (the native HTTP/1 path reads the client's body while the
/// backend reads this). An `Err` item means the client broke off.
#[derive(Debug)]
pub struct ChannelBody {
    rx: mpsc::Receiver<Result<Bytes, ClientBodyError>>,
    /// The declared length, if any.
    length: Option<u64>,
}

impl ChannelBody {
    /// A body and the sender that feeds it.
    pub(crate) fn new(length: Option<u64>) -> (mpsc::Sender<Result<Bytes, ClientBodyError>>, ChannelBody) {
        let (tx, rx) = mpsc::channel(4);
        (tx, ChannelBody { rx, length })
    }
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = ClientBodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        self.rx.poll_recv(cx).map(|item| item.map(|r| r.map(Frame::data)))
    }

    fn size_hint(&self) -> SizeHint {
        self.length.map_or_else(SizeHint::default, SizeHint::with_exact)
    }
}

//! Bodies: what the proxy sends upstream and what it hands to hyper.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;

use crate::hyper_conn::HyperConn;
use crate::observe::Finish;
use crate::pick::Slot;
use tidegate_static::StaticBody;
use tidegate_upstream::pool::Conn;

/// Errors while streaming a body.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

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
    /// A static route's answer.
    Static(StaticBody),
    /// A backend's body read from a native upstream connection.
    Native(crate::native::bridge::NativeBody),
    /// A body whose end finishes its request's record (the hyper path).
    Observed(Box<Observed>),
    /// A body compressed as it streams (a route's `compress` step).
    Compressed(Box<crate::compress::CompressedBody>),
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
            ProxyBody::Static(f) => Pin::new(f).poll_frame(cx),
            ProxyBody::Native(n) => Pin::new(n).poll_frame(cx),
            ProxyBody::Compressed(c) => Pin::new(&mut **c).poll_frame(cx),
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
            ProxyBody::Static(f) => f.is_end_stream(),
            ProxyBody::Native(n) => n.is_end_stream(),
            ProxyBody::Compressed(c) => c.is_end_stream(),
            ProxyBody::Observed(o) => o.body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Upstream { body, .. } => body.size_hint(),
            ProxyBody::Full(b) => b.size_hint(),
            ProxyBody::Static(f) => f.size_hint(),
            ProxyBody::Native(n) => n.size_hint(),
            ProxyBody::Compressed(c) => c.size_hint(),
            ProxyBody::Observed(o) => o.body.size_hint(),
        }
    }
}

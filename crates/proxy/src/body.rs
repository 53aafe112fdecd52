//! Bodies: what the proxy sends upstream and what it hands to hyper.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;

use crate::error::ClientBodyError;
use crate::pick::Slot;
use crate::pool::Conn;
use crate::static_files::FileBody;

/// Errors while streaming a body.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A request body sent to a backend: buffered (and so replayable) or the
/// client's body streamed through. A streamed body's errors are wrapped in
/// [`ClientBodyError`], so a failed attempt can tell the client broke it.
#[derive(Debug)]
pub enum UpBody {
    /// Held in memory.
    Buffered(Full<Bytes>),
    /// Streamed from the client.
    Streaming(Incoming),
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
            UpBody::Streaming(b) => Pin::new(b).poll_frame(cx).map_err(ClientBodyError),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpBody::Buffered(b) => b.is_end_stream(),
            UpBody::Streaming(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpBody::Buffered(b) => b.size_hint(),
            UpBody::Streaming(b) => b.size_hint(),
        }
    }
}

/// What a backend's response body holds until it ends: the request's
/// in-flight mark and, for a keep-alive connection, the connection itself,
/// which goes back to the pool only after a clean end of the body.
#[derive(Debug)]
pub struct Hold {
    pub(crate) slot: Slot,
    pub(crate) conn: Option<Conn>,
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
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Upstream { body, .. } => body.is_end_stream(),
            ProxyBody::Full(b) => b.is_end_stream(),
            ProxyBody::File(f) => f.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Upstream { body, .. } => body.size_hint(),
            ProxyBody::Full(b) => b.size_hint(),
            ProxyBody::File(f) => f.size_hint(),
        }
    }
}

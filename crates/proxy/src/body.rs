//! The response body type the proxy hands to hyper.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;

use crate::forward::Slot;
use crate::static_files::FileBody;

/// Errors while streaming a body.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A response body: from a backend, generated, or from a file.
#[derive(Debug)]
pub enum ProxyBody {
    /// A backend's body; keeps the backend's in-flight mark until it ends.
    Upstream {
        /// The body.
        body: Incoming,
        /// Dropped when the body ends (or the client goes away).
        guard: Option<Slot>,
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
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            ProxyBody::Upstream { body, guard } => {
                let polled = Pin::new(body).poll_frame(cx);
                if let Poll::Ready(None | Some(Err(_))) = &polled {
                    guard.take();
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

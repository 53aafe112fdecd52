//! The native HTTP/1.1 upstream connections (Tidegate's own, on the
//! [`tidegate_h1`] codec): a socket and its read buffer, pooled per backend
//! ([`crate::pool`]), opened, and read for a response head. The proxy's
//! native engine and its bridge for hyper's requests send over them.

use bytes::BytesMut;
use tidegate_h1::{parse_response, HeadLimits, HeaderKind, ResponseHead};
use tidegate_model::{BackendAddr, UpstreamProtocol};

use crate::buffers::fill;
use crate::pool::{Conn, ConnSettings, Reusable, UpstreamPool};
use crate::{ConnectError, Profile, Stream};

/// Why no response head could be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    /// A connection reused from the pool ended before any byte of an
    /// answer: the backend closed it while it was idle.
    #[error("the backend had closed the idle connection")]
    Stale,
    /// The connection was reset or closed before a complete head.
    #[error("the backend closed the connection")]
    Closed,
    /// What came is not a valid HTTP/1.1 response head.
    #[error("the backend sent an invalid response head")]
    Invalid,
}

/// An upstream connection of the native path: the socket and what was
/// read from it but not used yet. Pooled boxed ([`Upstream`]): a request
/// moves its connection from the pool to the attempt, the response relay
/// and back, and a pointer moves for less than these 136 bytes.
pub struct NativeConn {
    /// The socket.
    pub stream: Stream,
    /// Bytes read and not used yet (unallocated while idle).
    pub inbox: BytesMut,
    /// The last response head read on it (its header list is reused).
    pub head: ResponseHead,
}

/// A native connection as the pool holds it.
pub type Upstream = Box<NativeConn>;

impl NativeConn {
    /// A connection just opened on `stream`, as the pool holds it.
    pub fn new(stream: Stream) -> Upstream {
        Box::new(NativeConn { stream, inbox: BytesMut::new(), head: ResponseHead::default() })
    }
}

impl Reusable for NativeConn {
    /// A keep-alive connection has nothing to say while idle: anything
    /// readable (bytes, the end of the stream, an error) means the backend
    /// closed it or broke the protocol.
    fn is_closed(&mut self) -> bool {
        !self.inbox.is_empty() || self.stream.closed_while_idle()
    }
}

impl NativeConn {
    /// Gives the read buffer of an idle connection back to the worker (it
    /// holds nothing), after a body relayed by the native engine: every
    /// chunk split off it has been written and dropped.
    pub fn park(&mut self) {
        if self.inbox.is_empty() {
            crate::buffers::give_back(std::mem::take(&mut self.inbox));
        }
    }

    /// Frees the read buffer of an idle connection whose body chunks were
    /// handed to hyper (HTTP/2 and `--http1 hyper` clients): some may still
    /// be queued there, so its memory is not reused.
    pub fn park_and_free(&mut self) {
        if self.inbox.is_empty() {
            self.inbox = BytesMut::new();
        }
    }
}

/// A backend's answer: the connection its body arrives on, with the
/// response head parsed into `conn.head` (its bytes are the first
/// `head.len` of the inbox).
pub struct NativeAnswer {
    /// The connection, with the head parsed into `conn.head`.
    pub conn: Conn<Upstream>,
}

impl NativeAnswer {
    /// The response's status code.
    pub fn status(&self) -> u16 {
        self.conn.conn.head.code
    }

    /// The first value of the response field `name` (an extension field,
    /// such as an ORCA load report), if it has one.
    pub fn field(&self, name: &str) -> Option<&[u8]> {
        let c = &self.conn.conn;
        c.head
            .headers
            .iter()
            .find(|h| h.kind == HeaderKind::Other && h.name.of(&c.inbox).eq_ignore_ascii_case(name.as_bytes()))
            .map(|h| h.value.of(&c.inbox))
    }
}

/// A connection whose backend answered before it read the whole request:
/// never reused (whatever it says, part of the request may still be in
/// flight towards it).
pub fn early_answer(mut conn: Conn<Upstream>) -> Conn<Upstream> {
    conn.conn.head.close = true;
    conn
}

/// A connection to `backend`: the most recently used idle one, unless
/// `fresh`, else a new one.
pub async fn open(
    pool: &UpstreamPool<Upstream>,
    addr: &BackendAddr,
    profile: &Profile,
    cs: ConnSettings,
    fresh: bool,
) -> Result<Conn<Upstream>, ConnectError> {
    match if fresh { None } else { pool.checkout(addr, cs) } {
        Some(c) => Ok(c),
        None => {
            // Native connections speak HTTP/1.1, whatever the service does
            // (an upgrade on an HTTP/2 service comes here).
            let stream = profile.connect_for(addr, cs.connect, UpstreamProtocol::Http1, cs.origin).await?;
            Ok(pool.fresh(NativeConn::new(stream), addr, cs))
        }
    }
}

/// Reads the response head from `conn`, skipping interim (1xx) answers.
pub async fn read_response(conn: &mut Conn<Upstream>, to_head: bool, limits: HeadLimits) -> Result<(), ReadError> {
    let reused = conn.reused;
    let c = &mut conn.conn;
    let mut got_any = false;
    loop {
        if !c.inbox.is_empty() {
            match parse_response(&c.inbox, limits, to_head, &mut c.head) {
                Ok(Some(())) if c.head.is_interim() => {
                    bytes::Buf::advance(&mut c.inbox, c.head.len);
                    continue;
                }
                Ok(Some(())) => return Ok(()),
                Ok(None) => {}
                Err(_) => return Err(ReadError::Invalid),
            }
        }
        // No read buffer until the answer is there: the requests waiting
        // for their backends hold none, and the one reading an answer gets
        // the buffer the last answer was read into, still in the caches.
        let read = async {
            if c.inbox.capacity() == 0 {
                c.stream.readable().await?;
            }
            fill(&mut c.stream, &mut c.inbox).await
        };
        match read.await {
            Ok(0) | Err(_) if reused && !got_any => return Err(ReadError::Stale),
            Ok(0) | Err(_) => return Err(ReadError::Closed),
            Ok(_) => got_any = true,
        }
    }
}

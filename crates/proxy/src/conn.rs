//! What the proxy knows of a client connection, shared by both engines
//! and the forwarders: the client's address and listener ([`Peer`]), what
//! the connection holds while it lives ([`ConnHold`]), and the largest
//! request body kept for a replay.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use http::header::HeaderValue;
use tidegate_upstream::h1::Upstream;
use tidegate_upstream::pool::UpstreamPool;

/// What a client connection holds while anything of it lives, a tunnel
/// that outlives its request included: its place under
/// `--max-connections`, and its worker's count of live connections, which
/// a stopping worker waits on (at most the drain timeout).
#[derive(Debug)]
pub struct ConnHold {
    _permit: tokio::sync::OwnedSemaphorePermit,
    _alive: tokio::sync::mpsc::Sender<()>,
}

impl ConnHold {
    /// Holds `permit` and one sender of the worker's `alive` channel.
    pub fn new(permit: tokio::sync::OwnedSemaphorePermit, alive: tokio::sync::mpsc::Sender<()>) -> ConnHold {
        ConnHold { _permit: permit, _alive: alive }
    }
}

/// The client end of a connection, prepared once per connection.
#[derive(Debug, Clone)]
pub struct Peer {
    /// The client's address.
    pub addr: SocketAddr,
    /// Its IP as a header value, for `X-Forwarded-For`.
    pub ip_header: HeaderValue,
    /// Whether it is a trusted proxy, whose forwarding headers are kept.
    pub trusted: bool,
    /// The connection's place under `--max-connections` and in its
    /// worker's count of live connections, shared with an upgraded tunnel
    /// so that the tunnel keeps both.
    pub conn_slot: Option<Arc<ConnHold>>,
    /// Whether the client connected over TLS (`X-Forwarded-Proto: https`).
    pub https: bool,
    /// The port the client connected to, as a header value
    /// (`X-Forwarded-Port`).
    pub port_header: HeaderValue,
    /// The client certificate its TLS handshake verified, if any.
    pub client_cert: Option<Arc<crate::tls::VerifiedClient>>,
    /// The named listener it came on (`None`: a default listener): only
    /// the routes bound to it match its requests.
    pub listener: Option<Arc<str>>,
    /// What the connection holds for all its requests (behind one pointer:
    /// every connection's task holds a `Peer`).
    pub(crate) own: Arc<Own>,
}

/// What a client connection holds for all its requests.
#[derive(Debug)]
pub(crate) struct Own {
    /// The address the client connected to: the listener's, or the one a
    /// balancer's PROXY protocol header names.
    pub(crate) local: SocketAddr,
    /// Upstream connections that carry this connection's requests only:
    /// those to services that send the PROXY protocol, whose header names
    /// this client. Made on first use, shared by the connection's requests
    /// (and HTTP/2 streams), closed when the connection ends.
    pub(crate) upstream: OnceLock<UpstreamPool<Upstream>>,
}

impl Peer {
    /// Describes a plain-HTTP client connection (untrusted), its local
    /// address unknown (unspecified).
    pub fn new(addr: SocketAddr) -> Peer {
        Peer::with_local(addr, SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), 0))
    }

    /// Describes a plain-HTTP client connection (untrusted) from `addr` to
    /// `local`.
    pub fn with_local(addr: SocketAddr, local: SocketAddr) -> Peer {
        let ip_header =
            HeaderValue::from_str(&addr.ip().to_string()).unwrap_or_else(|_| HeaderValue::from_static("unknown"));
        Peer {
            addr,
            ip_header,
            trusted: false,
            conn_slot: None,
            https: false,
            port_header: HeaderValue::from_static("0"),
            client_cert: None,
            listener: None,
            own: Arc::new(Own { local, upstream: OnceLock::new() }),
        }
    }

    /// The address the client connected to.
    pub fn local(&self) -> SocketAddr {
        self.own.local
    }

    /// Records the listener the client came through: its port, and whether
    /// it terminates TLS.
    pub fn set_listener(&mut self, port: u16, tls: bool) {
        self.https = tls;
        self.port_header = HeaderValue::from(port);
    }

    /// `https` or `http`.
    pub fn scheme(&self) -> &'static str {
        if self.https {
            "https"
        } else {
            "http"
        }
    }
}

/// Request bodies up to this size are buffered so a failed attempt can be
/// replayed on another backend; larger ones stream and are retried only
/// when no byte of them was sent.
pub(crate) const REPLAY_LIMIT: u64 = 64 * 1024;

//! Failures on the upstream side as [`ErrorKind`]s: connects and native
//! reads ([`tidegate_upstream`]'s typed errors), and exchanges over hyper's
//! client (HTTP/1.1 upgrades, HTTP/2); and the error a client's request
//! body yields while it is sent.

use tidegate_upstream::h1::ReadError;
use tidegate_upstream::ConnectError;

use crate::error::ErrorKind;

/// The kind of a failed connect.
pub(crate) fn connect_kind(e: &ConnectError) -> ErrorKind {
    match e {
        ConnectError::Failed(_) => ErrorKind::ConnectFailed,
        ConnectError::TimedOut => ErrorKind::ConnectTimeout,
        ConnectError::Tls(_) => ErrorKind::UpstreamTls,
    }
}

/// The kind of a failed read of a native connection's response head.
pub(crate) fn read_kind(e: ReadError) -> ErrorKind {
    match e {
        ReadError::Stale => ErrorKind::StaleConnection,
        ReadError::Closed => ErrorKind::UpstreamClosed,
        ReadError::Invalid => ErrorKind::InvalidResponse,
    }
}

/// The error a client's request body yields while it is read. Its own
/// type lets the attempt tell, from hyper's error chain, that the client
/// broke the exchange, not the backend.
#[derive(Debug)]
pub enum ClientBodyError {
    /// The body broke off or was malformed.
    Read(crate::upbody::BoxError),
    /// The body broke off or was malformed (read by the native path).
    Broken,
    /// The client sent too slowly (see [`crate::Limits`]' body timeouts).
    TimedOut,
    /// The body carried more than its route's `max_body_bytes` rule takes.
    TooLarge,
}

impl ClientBodyError {
    /// The kind of failure it causes.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ClientBodyError::Read(_) | ClientBodyError::Broken => ErrorKind::ClientBody,
            ClientBodyError::TimedOut => ErrorKind::ClientTimeout,
            ClientBodyError::TooLarge => ErrorKind::BodyTooLarge,
        }
    }
}

impl std::fmt::Display for ClientBodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientBodyError::Read(e) => write!(f, "client request body: {e}"),
            ClientBodyError::Broken => f.write_str("client request body: broken off or malformed"),
            ClientBodyError::TimedOut => f.write_str("client request body: too slow"),
            ClientBodyError::TooLarge => f.write_str("client request body: larger than the route takes"),
        }
    }
}

impl std::error::Error for ClientBodyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ClientBodyError::Read(e) => Some(&**e),
            ClientBodyError::TimedOut | ClientBodyError::Broken | ClientBodyError::TooLarge => None,
        }
    }
}

/// Classifies a failed exchange on an upstream HTTP/1 connection.
/// `reused`: the connection had served a request before.
pub(crate) fn classify_upstream(err: &hyper::Error, reused: bool) -> ErrorKind {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(err);
    while let Some(e) = source {
        if let Some(client) = e.downcast_ref::<ClientBodyError>() {
            return client.kind();
        }
        source = e.source();
    }
    if err.is_parse() {
        ErrorKind::InvalidResponse
    } else if reused && (err.is_incomplete_message() || err.is_canceled() || is_reset(err)) {
        ErrorKind::StaleConnection
    } else {
        ErrorKind::UpstreamClosed
    }
}

/// Whether the error is a connection reset or broken pipe.
fn is_reset(err: &hyper::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(err);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return matches!(io.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe);
        }
        source = e.source();
    }
    false
}

//! Requests to HTTP/2 backends, on the worker's shared connections
//! ([`tidegate_upstream::h2_pool`]): the request as such a backend gets
//! it, and the pool's failures as [`ErrorKind`]s.

use http::header::{self, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Uri, Version};
use tidegate_balance::Backend;
use tidegate_upstream::h2_pool::H2Error;

use crate::error::ErrorKind;
use crate::upbody::UpBody;
use crate::upstream_error::{classify_upstream, connect_kind};

/// A worker's shared HTTP/2 connections.
pub(crate) type H2Pool = tidegate_upstream::h2_pool::H2Pool<UpBody>;

/// The kind of a failed HTTP/2 exchange.
pub(crate) fn h2_kind(e: &H2Error) -> ErrorKind {
    match e {
        H2Error::Connect(c) => connect_kind(c),
        H2Error::NotH2 => ErrorKind::UpstreamTls,
        H2Error::Closed => ErrorKind::UpstreamClosed,
        H2Error::Refused => ErrorKind::StaleConnection,
        H2Error::Exchange { error, shared } => classify_upstream(error, *shared),
    }
}

/// The request as an HTTP/2 backend gets it: an absolute URI (the
/// `:scheme` and `:authority` pseudo-headers) instead of `Host`, and
/// `te: trailers` when the client asked for trailers (gRPC does; every
/// other hop-by-hop field is gone already).
pub(crate) fn request(
    parts: &http::request::Parts,
    backend: &Backend,
    scheme: &'static str,
    path_and_query: &PathAndQuery,
    te_trailers: bool,
    body: UpBody,
) -> Result<Request<UpBody>, ErrorKind> {
    let host = parts.headers.get(header::HOST).map(HeaderValue::as_bytes);
    let authority = match host {
        Some(h) => Authority::try_from(h).map_err(|_| ErrorKind::InvalidHost)?,
        None => Authority::try_from(backend.authority.as_str()).map_err(|_| ErrorKind::BadRequest)?,
    };
    let scheme = if scheme == "https" { Scheme::HTTPS } else { Scheme::HTTP };
    let uri = Uri::builder()
        .scheme(scheme)
        .authority(authority)
        .path_and_query(path_and_query.clone())
        .build()
        .map_err(|_| ErrorKind::BadRequest)?;
    let mut req = Request::new(body);
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = uri;
    *req.version_mut() = Version::HTTP_2;
    let headers = req.headers_mut();
    *headers = parts.headers.clone();
    headers.remove(header::HOST);
    if te_trailers {
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
    }
    Ok(req)
}

/// Whether a `TE` field asks for trailers.
pub(crate) fn wants_trailers(te: &[u8]) -> bool {
    te.split(|b| *b == b',').any(|t| t.trim_ascii().eq_ignore_ascii_case(b"trailers"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn te_trailers_is_recognised_among_others() {
        assert!(wants_trailers(b"trailers"));
        assert!(wants_trailers(b"gzip, Trailers"));
        assert!(!wants_trailers(b"gzip"));
        assert!(!wants_trailers(b""));
    }
}

//! The answers the proxy writes itself, on every engine: short plain-text
//! responses for errors and refusals, health checks and redirects.

use http::header::{self, HeaderValue};
use http::{Response, StatusCode};

use crate::body::ProxyBody;
use crate::error::ErrorKind;
use crate::pipeline::Local;

/// The response a client gets for a request that failed with `kind`.
pub(crate) fn error(kind: ErrorKind) -> Response<ProxyBody> {
    let (status, text) = kind.answer();
    let mut resp = plain(status, text);
    if kind == ErrorKind::ClientLimit {
        resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    resp
}

/// The answer to a request head over `--max-header-bytes` or
/// `--max-headers`, on either engine.
pub(crate) fn head_too_large() -> Response<ProxyBody> {
    plain(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, "431 the request head is too large\n")
}

/// A plain-text response.
pub(crate) fn plain(status: StatusCode, text: &'static str) -> Response<ProxyBody> {
    let mut resp = Response::new(ProxyBody::text(text));
    *resp.status_mut() = status;
    resp.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static("text/plain; charset=utf-8"));
    resp
}

/// The answer to a `CONNECT` request: `405 Method Not Allowed`. The proxy
/// opens no tunnels to arbitrary hosts, and a backend's 2xx to `CONNECT`
/// would start a tunnel that a response framed as usual cannot describe
/// (RFC 9110, section 9.3.6; nginx refuses it too).
pub(crate) fn refuse_connect() -> Response<ProxyBody> {
    let mut resp = plain(StatusCode::METHOD_NOT_ALLOWED, "405 CONNECT is not supported here\n");
    resp.headers_mut().insert(header::ALLOW, HeaderValue::from_static("GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"));
    resp
}

/// The answer of a `redirect_https` route to a request that came over
/// plain HTTP: `308 Permanent Redirect` (the method and body are kept by
/// the client) to `location` ([`crate::pipeline`] builds it).
pub(crate) fn https_redirect(location: HeaderValue) -> Response<ProxyBody> {
    let mut resp = plain(StatusCode::PERMANENT_REDIRECT, "308 this route is served over HTTPS\n");
    resp.headers_mut().insert(header::LOCATION, location);
    resp
}

/// The response to a local answer of the pipeline; a refusal counted as an
/// error is the `Err`.
pub(crate) fn local_response(answer: Local) -> Result<Response<ProxyBody>, ErrorKind> {
    Ok(match answer {
        Local::Health { draining: false } => plain(StatusCode::OK, "ok\n"),
        Local::Health { draining: true } => plain(StatusCode::SERVICE_UNAVAILABLE, "draining\n"),
        Local::ConnectRefused => refuse_connect(),
        Local::HeadTooLarge => head_too_large(),
        Local::HttpsRedirect(location) => https_redirect(location),
        Local::Error(kind) => return Err(kind),
    })
}

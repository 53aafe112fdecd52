//! The proxy's own answers: short plain-text bodies that say what went wrong.

use http::{header, Response, StatusCode};

use crate::body::ProxyBody;

/// Why the proxy answered by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyError {
    /// No route matches the request.
    NoRoute,
    /// The route's service has no backend that can take the request.
    NoBackend,
    /// Every attempt to connect to a backend failed.
    ConnectFailed,
    /// The backend failed after the request was sent (reset, bad response).
    UpstreamFailed,
    /// The backend did not answer within the service's response timeout.
    Timeout,
    /// The request itself could not be forwarded (bad URI, oversized, ...).
    BadRequest,
    /// Every backend is at its `max_conns` and the queue is full (or off).
    QueueFull,
    /// The request waited in the queue for `queue.timeout_ms` in vain.
    QueueTimeout,
}

impl ProxyError {
    fn parts(self) -> (StatusCode, &'static str) {
        match self {
            ProxyError::NoRoute => (StatusCode::NOT_FOUND, "404 no route matches this request\n"),
            ProxyError::NoBackend => (StatusCode::SERVICE_UNAVAILABLE, "503 no backend available for this service\n"),
            ProxyError::ConnectFailed => (StatusCode::BAD_GATEWAY, "502 could not connect to a backend\n"),
            ProxyError::UpstreamFailed => (StatusCode::BAD_GATEWAY, "502 the backend failed to answer\n"),
            ProxyError::Timeout => (StatusCode::GATEWAY_TIMEOUT, "504 the backend did not answer in time\n"),
            ProxyError::BadRequest => (StatusCode::BAD_REQUEST, "400 the request cannot be forwarded\n"),
            ProxyError::QueueFull => (
                StatusCode::SERVICE_UNAVAILABLE,
                "503 every backend is at its connection limit and the queue is full\n",
            ),
            ProxyError::QueueTimeout => {
                (StatusCode::SERVICE_UNAVAILABLE, "503 no backend had room within the queue timeout\n")
            }
        }
    }

    /// The response the client gets.
    pub fn response(self) -> Response<ProxyBody> {
        let (status, text) = self.parts();
        plain(status, text)
    }
}

/// A plain-text response.
pub fn plain(status: StatusCode, text: &'static str) -> Response<ProxyBody> {
    let mut resp = Response::new(ProxyBody::text(text));
    *resp.status_mut() = status;
    resp.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static("text/plain; charset=utf-8"));
    resp
}

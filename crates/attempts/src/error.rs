//! One error type for the request path.
//!
//! Every way a request can fail is an [`ErrorKind`]. A kind says where the
//! failure came from ([`Source`]: the client, a backend, or the proxy
//! itself), whether a backend is to blame (passive health reads that),
//! whether and where the request may be tried again ([`Retry`], read by
//! `retry::decide`), and what the client is answered. Metrics, the
//! client's answer, passive health and retries all read this one value, so
//! they cannot disagree.

use http::StatusCode;
pub use tidegate_h1::FramingError;

/// Where a failure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The client: a malformed request, a body that broke off.
    Client,
    /// A backend: it refused, reset, timed out or answered garbage.
    Upstream,
    /// The proxy's own configuration or limits: no route, no backend, a
    /// full queue.
    Local,
}

/// Whether a failed attempt may be tried again, and where.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Never: the failure would repeat, or retrying could do harm.
    Never,
    /// Nothing reached a backend (a connect failure): any request may go to
    /// another backend.
    Unsent,
    /// The request may have been processed: only an idempotent request with
    /// a replayable body may go to another backend.
    IfIdempotent,
    /// A pooled keep-alive connection turned out to be closed by the
    /// backend: the same backend may be tried on a fresh connection.
    FreshConnection,
}

/// Why a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// No route matches the request.
    NoRoute,
    /// The route's service has no backend that can take the request.
    NoBackend,
    /// Every backend is at its `max_conns` and the queue is full (or off).
    QueueFull,
    /// The request waited in the queue for `queue.timeout_ms` in vain.
    QueueTimeout,
    /// The request cannot be forwarded as it is (it names no usable target).
    BadRequest,
    /// Two `Host` headers, none on HTTP/1.1, or one that is not a host.
    InvalidHost,
    /// A path that cannot be normalized safely (see `tidegate_model::normalize`).
    InvalidPath,
    /// The request's framing fields (`Content-Length`,
    /// `Transfer-Encoding`) conflict or are invalid: the cause says how.
    InvalidFraming(FramingError),
    /// The client's request body broke off or was malformed (bad chunked
    /// encoding, a connection closed mid-body).
    ClientBody,
    /// The client sent its request body too slowly: a gap or the whole
    /// body took too long, or a body streamed to a backend fell under the
    /// minimum pace.
    ClientTimeout,
    /// The client address has `--max-requests-per-client` requests in
    /// progress already.
    ClientLimit,
    /// The client address sent requests faster than
    /// `--max-request-rate-per-client`.
    ClientRate,
    /// The request body carried more than its route's `max_body_bytes`
    /// rule takes (a body without `Content-Length`, counted as it came; a
    /// declared one over the limit is answered by the rule itself).
    BodyTooLarge,
    /// The TCP connection to the backend was refused or failed.
    ConnectFailed,
    /// The TCP connection to the backend was not open within `connect_ms`.
    ConnectTimeout,
    /// The TLS handshake with the backend failed: its certificate is not
    /// trusted or does not name it, or it does not speak TLS.
    UpstreamTls,
    /// A reused keep-alive connection was closed by the backend before it
    /// answered (the race between its idle timeout and our request).
    StaleConnection,
    /// The backend reset the connection or closed it before a complete
    /// response head.
    UpstreamClosed,
    /// The backend answered something that is not valid HTTP.
    InvalidResponse,
    /// The backend did not answer within the service's `response_ms`.
    ResponseTimeout,
}

impl ErrorKind {
    /// Whether the client was refused for what it asked of its per-client
    /// caps or rate, not for anything wrong with the request: it may ask
    /// again on the same connection (after `Retry-After`).
    pub fn client_over_its_share(self) -> bool {
        matches!(self, ErrorKind::ClientLimit | ErrorKind::ClientRate)
    }

    /// Where the failure came from.
    pub fn source(self) -> Source {
        use ErrorKind::*;
        match self {
            BadRequest | InvalidHost | InvalidPath | InvalidFraming(_) | ClientBody | ClientTimeout | ClientLimit
            | ClientRate | BodyTooLarge => Source::Client,
            NoRoute | NoBackend | QueueFull | QueueTimeout => Source::Local,
            ConnectFailed | ConnectTimeout | UpstreamTls | StaleConnection | UpstreamClosed | InvalidResponse
            | ResponseTimeout => Source::Upstream,
        }
    }

    /// Whether passive health counts this failure against the backend. A
    /// stale pooled connection is a normal race of keep-alive, not a sign
    /// of a broken backend; the client's failures are never the backend's.
    pub fn blames_backend(self) -> bool {
        self.source() == Source::Upstream && self != ErrorKind::StaleConnection
    }

    /// Whether and where the request may be tried again.
    pub fn retry(self) -> Retry {
        use ErrorKind::*;
        match self {
            // Nothing of the request went out before the handshake ended.
            ConnectFailed | ConnectTimeout | UpstreamTls => Retry::Unsent,
            StaleConnection => Retry::FreshConnection,
            UpstreamClosed | InvalidResponse => Retry::IfIdempotent,
            // A timed-out backend is likely slow for the next request too,
            // and retrying multiplies the load on a struggling service.
            ResponseTimeout => Retry::Never,
            NoRoute | NoBackend | QueueFull | QueueTimeout | BadRequest | InvalidHost | InvalidPath
            | InvalidFraming(_) | ClientBody | ClientTimeout | ClientLimit | ClientRate | BodyTooLarge => Retry::Never,
        }
    }

    /// The short name used in metrics and logs.
    pub fn name(self) -> &'static str {
        use ErrorKind::*;
        match self {
            NoRoute => "no_route",
            NoBackend => "no_backend",
            QueueFull => "queue_full",
            QueueTimeout => "queue_timeout",
            BadRequest => "bad_request",
            InvalidHost => "invalid_host",
            InvalidPath => "invalid_path",
            InvalidFraming(_) => "invalid_framing",
            ClientBody => "client_body",
            ClientTimeout => "client_timeout",
            ClientLimit => "client_limit",
            ClientRate => "client_rate",
            BodyTooLarge => "body_too_large",
            ConnectFailed => "connect_failed",
            ConnectTimeout => "connect_timeout",
            UpstreamTls => "upstream_tls",
            StaleConnection => "stale_connection",
            UpstreamClosed => "upstream_closed",
            InvalidResponse => "invalid_response",
            ResponseTimeout => "response_timeout",
        }
    }

    /// Every kind, in a fixed order (for metrics; one `InvalidFraming`
    /// stands for all its causes).
    pub const ALL: [ErrorKind; 20] = [
        ErrorKind::NoRoute,
        ErrorKind::NoBackend,
        ErrorKind::QueueFull,
        ErrorKind::QueueTimeout,
        ErrorKind::BadRequest,
        ErrorKind::InvalidHost,
        ErrorKind::InvalidPath,
        ErrorKind::InvalidFraming(FramingError::LengthAndCoding),
        ErrorKind::ClientBody,
        ErrorKind::ClientTimeout,
        ErrorKind::ClientLimit,
        ErrorKind::ClientRate,
        ErrorKind::BodyTooLarge,
        ErrorKind::ConnectFailed,
        ErrorKind::ConnectTimeout,
        ErrorKind::UpstreamTls,
        ErrorKind::StaleConnection,
        ErrorKind::UpstreamClosed,
        ErrorKind::InvalidResponse,
        ErrorKind::ResponseTimeout,
    ];

    /// The position of this kind in [`ErrorKind::ALL`] (whatever its
    /// cause).
    pub fn index(self) -> usize {
        let this = std::mem::discriminant(&self);
        ErrorKind::ALL.iter().position(|k| std::mem::discriminant(k) == this).unwrap_or(0)
    }

    /// The status and the text the client is answered
    /// ([`ErrorKind::status`], and the body).
    pub fn answer(self) -> (StatusCode, &'static str) {
        use ErrorKind::*;
        match self {
            NoRoute => (StatusCode::NOT_FOUND, "404 no route matches this request\n"),
            NoBackend => (StatusCode::SERVICE_UNAVAILABLE, "503 no backend available for this service\n"),
            QueueFull => (
                StatusCode::SERVICE_UNAVAILABLE,
                "503 every backend is at its connection limit and the queue is full\n",
            ),
            QueueTimeout => (StatusCode::SERVICE_UNAVAILABLE, "503 no backend had room within the queue timeout\n"),
            BadRequest => (StatusCode::BAD_REQUEST, "400 the request cannot be forwarded\n"),
            InvalidHost => (StatusCode::BAD_REQUEST, "400 the request needs exactly one valid host\n"),
            InvalidPath => (StatusCode::BAD_REQUEST, "400 the request path is invalid\n"),
            InvalidFraming(cause) => (StatusCode::BAD_REQUEST, framing_text(cause)),
            ClientBody => (StatusCode::BAD_REQUEST, "400 the request body is malformed or incomplete\n"),
            ClientTimeout => (StatusCode::REQUEST_TIMEOUT, "408 the request body arrived too slowly\n"),
            ClientLimit => (StatusCode::TOO_MANY_REQUESTS, "429 this client has too many requests in progress\n"),
            ClientRate => (StatusCode::TOO_MANY_REQUESTS, "429 this client sends requests faster than its rate\n"),
            BodyTooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "413 the request body is larger than this route takes\n"),
            ConnectFailed | ConnectTimeout => (StatusCode::BAD_GATEWAY, "502 could not connect to a backend\n"),
            UpstreamTls => (StatusCode::BAD_GATEWAY, "502 the TLS handshake with the backend failed\n"),
            StaleConnection | UpstreamClosed => (StatusCode::BAD_GATEWAY, "502 the backend closed the connection\n"),
            InvalidResponse => (StatusCode::BAD_GATEWAY, "502 the backend sent an invalid response\n"),
            ResponseTimeout => (StatusCode::GATEWAY_TIMEOUT, "504 the backend did not answer in time\n"),
        }
    }

    /// The status the client gets.
    pub fn status(self) -> StatusCode {
        self.answer().0
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.answer().1.trim_end())
    }
}

impl std::error::Error for ErrorKind {}

/// The answer to a request refused for its framing: what was wrong.
fn framing_text(cause: FramingError) -> &'static str {
    use FramingError::*;
    match cause {
        LengthAndCoding => "400 the request has both Transfer-Encoding and Content-Length\n",
        CodingInHttp10 => "400 an HTTP/1.0 request cannot have a Transfer-Encoding\n",
        InvalidLength => "400 the request's Content-Length is not a valid length\n",
        DifferingLengths => "400 the request has differing Content-Length values\n",
        ChunkedTwice => "400 the request's Transfer-Encoding lists chunked more than once\n",
        ChunkedNotLast => "400 the request's Transfer-Encoding does not end with chunked\n",
        EmptyCoding => "400 the request's Transfer-Encoding is empty\n",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_failures_never_blame_a_backend() {
        for k in ErrorKind::ALL {
            if k.source() != Source::Upstream {
                assert!(!k.blames_backend(), "{k:?}");
                assert_eq!(k.retry(), Retry::Never, "{k:?}");
            }
        }
        assert!(!ErrorKind::StaleConnection.blames_backend());
        assert!(ErrorKind::ConnectFailed.blames_backend());
    }

    #[test]
    fn answers_follow_the_source() {
        assert_eq!(ErrorKind::ClientBody.status(), StatusCode::BAD_REQUEST);
        assert_eq!(ErrorKind::ConnectTimeout.status(), StatusCode::BAD_GATEWAY);
        assert_eq!(ErrorKind::ResponseTimeout.status(), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(ErrorKind::NoRoute.status(), StatusCode::NOT_FOUND);
        for (i, k) in ErrorKind::ALL.iter().enumerate() {
            assert_eq!(k.index(), i);
            assert!(k.status().as_u16() >= 400);
        }
    }

    #[test]
    fn each_framing_refusal_names_its_cause() {
        use FramingError::*;
        let causes = [
            LengthAndCoding,
            CodingInHttp10,
            InvalidLength,
            DifferingLengths,
            ChunkedTwice,
            ChunkedNotLast,
            EmptyCoding,
        ];
        let texts: std::collections::HashSet<_> = causes.iter().map(|c| framing_text(*c)).collect();
        assert_eq!(texts.len(), causes.len(), "one text per cause");
        for c in causes {
            let k = ErrorKind::InvalidFraming(c);
            assert_eq!(k.status(), StatusCode::BAD_REQUEST);
            assert_eq!(k.name(), "invalid_framing");
            // One metric for every cause.
            assert_eq!(k.index(), ErrorKind::InvalidFraming(LengthAndCoding).index());
        }
        let text = ErrorKind::InvalidFraming(InvalidLength).to_string();
        assert_eq!(text, "400 the request's Content-Length is not a valid length");
        assert_eq!(ErrorKind::QueueTimeout.index(), 3);
    }
}

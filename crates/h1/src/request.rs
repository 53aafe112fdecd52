//! Request heads.

use std::mem::MaybeUninit;

use crate::fields::{codings, content_length, Codings, ConnectionOptions};
use crate::{
    collect_headers, syntax, FramingError, HeadError, HeadLimits, Header, HeaderKind, Parsed, Span, MAX_HEADERS,
};

/// How a request's body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RequestBody {
    /// No body (no framing field, or `Content-Length: 0`).
    #[default]
    Empty,
    /// Exactly this many bytes.
    Length(u64),
    /// Chunked transfer coding.
    Chunked,
}

/// A parsed request head: spans into the buffer it was parsed from.
#[derive(Debug, Clone, Default)]
pub struct RequestHead {
    /// Bytes of the head, the final empty line included; the body (or the
    /// next request) starts here.
    pub len: usize,
    /// The method token.
    pub method: Span,
    /// The request target, as sent.
    pub target: Span,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor: u8,
    /// Every field, in order.
    pub headers: Vec<Header>,
    /// The body's framing.
    pub body: RequestBody,
    /// The value of the one `Host` field, if any.
    pub host: Option<Span>,
    /// The client asked to close the connection after this exchange
    /// (`Connection: close`, or HTTP/1.0 without `keep-alive`).
    pub close: bool,
    /// `Expect: 100-continue`.
    pub expect_continue: bool,
    /// What its `Connection` fields say.
    pub connection: ConnectionOptions,
}

/// Parses a request head from the start of `buf` into `head` (reusing its
/// header list). `Ok(None)`: the head is not complete yet (and within the
/// limits). The head's framing and host are checked here.
pub fn parse_request(buf: &[u8], limits: HeadLimits, head: &mut RequestHead) -> Parsed<()> {
    let max = limits.max_headers.min(MAX_HEADERS);
    let mut slots = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    let status = req.parse_with_uninit_headers(buf, &mut slots[..max]);
    let len = match status {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => {
            return if buf.len() >= limits.max_bytes { Err(HeadError::TooLarge) } else { Ok(None) };
        }
        Err(httparse::Error::TooManyHeaders) if buf.len() > limits.max_bytes => return Err(HeadError::TooLarge),
        Err(e) => return Err(syntax(e)),
    };
    if len > limits.max_bytes {
        return Err(HeadError::TooLarge);
    }
    let (Some(method), Some(target), Some(minor)) = (req.method, req.path, req.version) else {
        return Err(HeadError::Syntax("incomplete request line"));
    };
    if minor > 1 {
        return Err(HeadError::Version);
    }
    head.len = len;
    head.method = Span::within(buf, method.as_bytes());
    head.target = Span::within(buf, target.as_bytes());
    head.minor = minor;
    collect_headers(buf, req.headers, &mut head.headers);
    let headers = &head.headers;
    let mut hosts = headers.iter().filter(|h| h.kind == HeaderKind::Host);
    head.host = hosts.next().map(|h| h.value);
    if hosts.next().is_some() {
        return Err(HeadError::DuplicateHost);
    }
    let length = content_length(buf, headers)?;
    head.body = match codings(buf, headers)? {
        Codings::None => match length {
            None | Some(0) => RequestBody::Empty,
            Some(n) => RequestBody::Length(n),
        },
        _ if length.is_some() => return Err(HeadError::Framing(FramingError::LengthAndCoding)),
        _ if minor == 0 => return Err(HeadError::Framing(FramingError::CodingInHttp10)),
        Codings::Chunked => RequestBody::Chunked,
        // A request body's length must be known from its framing: only
        // chunked alone is accepted (as nginx does).
        Codings::OthersThenChunked | Codings::NotChunked => return Err(HeadError::UnsupportedCoding),
    };
    head.connection = ConnectionOptions::of(buf, headers);
    head.close = head.connection.closes(minor);
    head.expect_continue = minor == 1
        && headers
            .iter()
            .any(|h| h.kind == HeaderKind::Expect && h.value.of(buf).eq_ignore_ascii_case(b"100-continue"));
    Ok(Some(()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &str) -> Result<Option<RequestHead>, HeadError> {
        let mut head = RequestHead::default();
        parse_request(raw.as_bytes(), HeadLimits::default(), &mut head).map(|o| o.map(|()| head))
    }

    #[test]
    fn a_simple_request_parses_into_spans() {
        let raw = "GET /a?b HTTP/1.1\r\nHost: example.com \r\nX-Y: z\r\n\r\nrest";
        let head = parse(raw).unwrap().unwrap();
        let buf = raw.as_bytes();
        assert_eq!(head.method.of(buf), b"GET");
        assert_eq!(head.target.of(buf), b"/a?b");
        assert_eq!(head.host.unwrap().of(buf), b"example.com");
        assert_eq!(&buf[head.len..], b"rest");
        assert_eq!(head.headers.len(), 2);
        assert_eq!(head.body, RequestBody::Empty);
        assert!(!head.close);
    }

    #[test]
    fn partial_heads_wait_and_large_ones_are_refused() {
        assert!(parse("GET / HTTP/1.1\r\nHost: a\r\n").unwrap().is_none());
        let limits = HeadLimits { max_bytes: 32, max_headers: 100 };
        let mut head = RequestHead::default();
        let big = format!("GET / HTTP/1.1\r\nx: {}", "a".repeat(64));
        assert_eq!(parse_request(big.as_bytes(), limits, &mut head), Err(HeadError::TooLarge));
        let many: String = (0..101).map(|i| format!("x-{i}: 1\r\n")).collect();
        assert_eq!(parse(&format!("GET / HTTP/1.1\r\n{many}\r\n")).unwrap_err(), HeadError::TooManyHeaders);
    }

    #[test]
    fn framing_is_strict() {
        let framing =
            |extra: &str| parse(&format!("POST / HTTP/1.1\r\nhost: a\r\n{extra}\r\n")).map(|h| h.unwrap().body);
        assert_eq!(framing("content-length: 5\r\n"), Ok(RequestBody::Length(5)));
        assert_eq!(framing("content-length: 5\r\ncontent-length: 5\r\n"), Ok(RequestBody::Length(5)));
        assert_eq!(framing("content-length: 0\r\n"), Ok(RequestBody::Empty));
        assert_eq!(framing("transfer-encoding: chunked\r\n"), Ok(RequestBody::Chunked));
        assert_eq!(framing("transfer-encoding: Chunked\r\n"), Ok(RequestBody::Chunked));
        // Each refusal names its own cause.
        for (bad, cause) in [
            ("content-length: 5\r\ncontent-length: 6\r\n", FramingError::DifferingLengths),
            ("content-length: 5, 6\r\n", FramingError::DifferingLengths),
            ("content-length: +5\r\n", FramingError::InvalidLength),
            ("content-length: \r\n", FramingError::InvalidLength),
            ("content-length: 5\r\ntransfer-encoding: chunked\r\n", FramingError::LengthAndCoding),
            ("transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n", FramingError::ChunkedTwice),
            ("transfer-encoding: chunked, gzip\r\n", FramingError::ChunkedNotLast),
            ("transfer-encoding: ,\r\n", FramingError::EmptyCoding),
        ] {
            assert_eq!(framing(bad), Err(HeadError::Framing(cause)), "{bad:?}");
        }
        assert_eq!(framing("transfer-encoding: gzip\r\n"), Err(HeadError::UnsupportedCoding));
        assert_eq!(framing("transfer-encoding: gzip, chunked\r\n"), Err(HeadError::UnsupportedCoding));
        let old = parse("POST / HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n");
        assert_eq!(old.unwrap_err(), HeadError::Framing(FramingError::CodingInHttp10));
        assert_eq!(
            HeadError::Framing(FramingError::InvalidLength).to_string(),
            "invalid framing: invalid Content-Length"
        );
    }

    #[test]
    fn hosts_versions_and_connection_options() {
        assert_eq!(parse("GET / HTTP/1.1\r\nhost: a\r\nHost: b\r\n\r\n").unwrap_err(), HeadError::DuplicateHost);
        assert!(matches!(parse("GET / HTTP/2.0\r\n\r\n"), Err(HeadError::Version)));
        assert!(parse("GET / HTTP/1.0\r\n\r\n").unwrap().unwrap().close);
        assert!(!parse("GET / HTTP/1.0\r\nconnection: Keep-Alive\r\n\r\n").unwrap().unwrap().close);
        assert!(parse("GET / HTTP/1.0\r\nconnection: keep-alive, close\r\n\r\n").unwrap().unwrap().close);
        assert!(parse("GET / HTTP/1.1\r\nconnection: upgrade, close\r\n\r\n").unwrap().unwrap().close);
        assert!(parse("PUT / HTTP/1.1\r\nexpect: 100-continue\r\n\r\n").unwrap().unwrap().expect_continue);
    }

    #[test]
    fn obs_fold_and_bad_names_are_refused() {
        assert!(parse("GET / HTTP/1.1\r\nx: a\r\n b\r\n\r\n").is_err(), "obs-fold");
        assert!(parse("GET / HTTP/1.1\r\nx : a\r\n\r\n").is_err(), "space before colon");
        assert!(parse("GET / HTTP/1.1\r\nx: a\0b\r\n\r\n").is_err(), "NUL in a value");
        assert!(parse("GET  / HTTP/1.1\r\n\r\n").is_err(), "two spaces");
    }
}

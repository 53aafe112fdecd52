//! Tidegate's HTTP/1.1 codec: the parsing and framing rules of the native
//! HTTP/1 data path, with no IO.
//!
//! Request and response heads are parsed by [`httparse`] (the parser hyper
//! uses too) into [`RequestHead`] and [`ResponseHead`]: spans into the
//! caller's buffer, no copy, no allocation beyond the header list. On top
//! of the syntax this crate decides what a proxy must decide before it
//! forwards a byte, and it decides strictly (RFC 9112, section 6):
//!
//! - **One framing.** A request with both `Transfer-Encoding` and
//!   `Content-Length`, with differing `Content-Length`s, with a transfer
//!   coding other than `chunked`, or an HTTP/1.0 request with a transfer
//!   coding is refused; a response with both is framed by the coding (and
//!   its connection is not reused), one with a coding other than
//!   `chunked` or a status outside 100-599 is refused.
//! - **One host.** Two `Host` headers are refused.
//! - **Strict chunks.** [`ChunkedDecoder`] accepts only CRLF line ends, at
//!   most 16 hex digits of size, and bounded extensions and trailers.
//!
//! Everything a proxy reads off a header to route or rewrite a message is
//! classified once, while parsing ([`HeaderKind`]), so the forwarding code
//! never compares header names again.

mod chunked;
mod fields;
mod request;
mod response;

pub use chunked::{chunk_size_line, ChunkedDecoder, ChunkedError, Decoded, CHUNKED_END};
pub use fields::{connection_has, tokens, ConnectionOptions, HeaderKind};
pub use request::{parse_request, RequestBody, RequestHead};
pub use response::{parse_response, ResponseBody, ResponseHead};

/// A range of bytes in the buffer a head was parsed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Span {
    start: u32,
    end: u32,
}

impl Span {
    /// The span's bytes in `buf` (the buffer the head was parsed from).
    pub fn of<'a>(&self, buf: &'a [u8]) -> &'a [u8] {
        buf.get(self.start as usize..self.end as usize).unwrap_or_default()
    }

    /// The span of `part`, a sub-slice of `buf`.
    fn within(buf: &[u8], part: &[u8]) -> Span {
        let start = (part.as_ptr() as usize).saturating_sub(buf.as_ptr() as usize);
        Span { start: start as u32, end: (start + part.len()) as u32 }
    }

    /// Whether the span is empty.
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.end.saturating_sub(self.start) as usize
    }
}

/// One header field of a parsed head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The name, as sent.
    pub name: Span,
    /// The value, without surrounding whitespace.
    pub value: Span,
    /// What the name means to a proxy.
    pub kind: HeaderKind,
}

impl Header {
    /// The field's whole line in `buf`, its CRLF included, when it was sent
    /// as the name, a colon, one space, the value and CRLF: exactly what
    /// writing the field as `name: value` would give, so a proxy copies it
    /// in one piece. `None` for any other form (no space or more, space
    /// after the value, a bare LF).
    pub fn line<'a>(&self, buf: &'a [u8]) -> Option<&'a [u8]> {
        let (name_end, value_start, value_end) =
            (self.name.end as usize, self.value.start as usize, self.value.end as usize);
        let sent_so = value_start == name_end + 2
            && buf.get(name_end..value_start) == Some(b": ".as_slice())
            && buf.get(value_end..value_end + 2) == Some(b"\r\n".as_slice());
        if !sent_so {
            return None;
        }
        buf.get(self.name.start as usize..value_end + 2)
    }
}

/// Limits of a head.
#[derive(Debug, Clone, Copy)]
pub struct HeadLimits {
    /// Largest head (start line and fields), bytes.
    pub max_bytes: usize,
    /// Most header fields.
    pub max_headers: usize,
}

impl Default for HeadLimits {
    fn default() -> Self {
        HeadLimits { max_bytes: 64 * 1024, max_headers: 100 }
    }
}

/// The most header fields a head may have, whatever the limits say.
pub const MAX_HEADERS: usize = 512;

/// Why a head was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HeadError {
    /// The head is larger than `max_bytes` (answer 431).
    #[error("the head is too large")]
    TooLarge,
    /// More than `max_headers` fields (answer 431).
    #[error("too many header fields")]
    TooManyHeaders,
    /// Not valid HTTP/1.x syntax.
    #[error("malformed head: {0}")]
    Syntax(&'static str),
    /// Conflicting or invalid message framing (`Content-Length`,
    /// `Transfer-Encoding`), and which.
    #[error("invalid framing: {0}")]
    Framing(FramingError),
    /// A transfer coding other than `chunked` (answer 501).
    #[error("unsupported transfer coding")]
    UnsupportedCoding,
    /// Two `Host` fields.
    #[error("more than one Host")]
    DuplicateHost,
    /// An HTTP version other than 1.0 and 1.1.
    #[error("unsupported HTTP version")]
    Version,
}

/// What is wrong with a message's framing fields (RFC 9112, section 6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FramingError {
    /// A request with both `Transfer-Encoding` and `Content-Length`.
    #[error("both Transfer-Encoding and Content-Length")]
    LengthAndCoding,
    /// `Transfer-Encoding` in an HTTP/1.0 request.
    #[error("Transfer-Encoding in an HTTP/1.0 request")]
    CodingInHttp10,
    /// A `Content-Length` that is not 1 to 19 digits.
    #[error("invalid Content-Length")]
    InvalidLength,
    /// `Content-Length` fields (or list members) that differ.
    #[error("differing Content-Length values")]
    DifferingLengths,
    /// `chunked` listed more than once.
    #[error("chunked applied more than once")]
    ChunkedTwice,
    /// `chunked` listed, but not last.
    #[error("chunked is not the last transfer coding")]
    ChunkedNotLast,
    /// A `Transfer-Encoding` field that lists no coding.
    #[error("empty Transfer-Encoding")]
    EmptyCoding,
}

/// A head either parses, needs more bytes, or is refused.
pub type Parsed<T> = Result<Option<T>, HeadError>;

fn syntax(e: httparse::Error) -> HeadError {
    match e {
        httparse::Error::TooManyHeaders => HeadError::TooManyHeaders,
        httparse::Error::Version => HeadError::Version,
        httparse::Error::HeaderName => HeadError::Syntax("invalid header name"),
        httparse::Error::HeaderValue => HeadError::Syntax("invalid header value"),
        httparse::Error::NewLine => HeadError::Syntax("invalid line ending"),
        httparse::Error::Status => HeadError::Syntax("invalid status"),
        httparse::Error::Token => HeadError::Syntax("invalid token"),
    }
}

/// Turns httparse's header list into spans, classifying each name.
fn collect_headers(buf: &[u8], parsed: &[httparse::Header<'_>], out: &mut Vec<Header>) {
    out.clear();
    out.reserve(parsed.len());
    for h in parsed {
        out.push(Header {
            name: Span::within(buf, h.name.as_bytes()),
            value: Span::within(buf, trim(h.value)),
            kind: HeaderKind::of(h.name.as_bytes()),
        });
    }
}

/// `v` without leading and trailing spaces and tabs.
pub(crate) fn trim(v: &[u8]) -> &[u8] {
    let start = v.iter().position(|b| !matches!(b, b' ' | b'\t')).unwrap_or(v.len());
    let end = v.iter().rposition(|b| !matches!(b, b' ' | b'\t')).map_or(start, |i| i + 1);
    &v[start..end]
}

#[cfg(test)]
mod proptests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// No input makes the head parsers panic, and a head they accept
        /// has spans inside the input.
        #[test]
        fn arbitrary_heads_never_panic(input in proptest::collection::vec(any::<u8>(), 0..600)) {
            let mut req = RequestHead::default();
            if let Ok(Some(())) = parse_request(&input, HeadLimits::default(), &mut req) {
                prop_assert!(req.len <= input.len());
                for h in &req.headers {
                    prop_assert!(h.value.of(&input).len() <= input.len());
                }
            }
            let mut resp = ResponseHead::default();
            let _ = parse_response(&input, HeadLimits::default(), false, &mut resp);
        }

        #[test]
        fn request_lines_round_trip(
            method in "[A-Z]{1,7}",
            path in "/[a-zA-Z0-9._~%/-]{0,40}",
            value in "[ -~]{0,40}",
        ) {
            let raw = format!("{method} {path} HTTP/1.1\r\nhost: a\r\nx-v: {value}\r\n\r\n");
            let mut head = RequestHead::default();
            prop_assert_eq!(parse_request(raw.as_bytes(), HeadLimits::default(), &mut head), Ok(Some(())));
            prop_assert_eq!(head.method.of(raw.as_bytes()), method.as_bytes());
            prop_assert_eq!(head.target.of(raw.as_bytes()), path.as_bytes());
            prop_assert_eq!(head.headers[1].value.of(raw.as_bytes()), value.trim_matches([' ', '\t']).as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_field_sent_as_it_would_be_written_is_one_line() {
        let raw = b"GET / HTTP/1.1\r\nHost: a\r\nX-A:b\r\nX-B: c \r\nX-C:  d\r\nX-D: \r\nX-E: e f\r\n\r\n";
        let mut head = RequestHead::default();
        parse_request(raw, HeadLimits::default(), &mut head).unwrap().unwrap();
        let lines: Vec<_> =
            head.headers.iter().map(|h| h.line(raw).map(|l| String::from_utf8_lossy(l).into_owned())).collect();
        assert_eq!(
            lines,
            vec![
                Some("Host: a\r\n".to_string()),
                None,
                None,
                None,
                Some("X-D: \r\n".to_string()),
                Some("X-E: e f\r\n".to_string())
            ]
        );
    }
}

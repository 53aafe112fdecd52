//! Response heads.

use std::mem::MaybeUninit;

use crate::fields::{codings, content_length, Codings, ConnectionOptions};
use crate::{collect_headers, syntax, HeadError, HeadLimits, Header, HeaderKind, Parsed, Span, MAX_HEADERS};

/// How a response's body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ResponseBody {
    /// No body: an answer to `HEAD`, a 1xx, 204 or 304.
    #[default]
    None,
    /// Exactly this many bytes.
    Length(u64),
    /// Chunked transfer coding.
    Chunked,
    /// Everything until the backend closes the connection.
    UntilClose,
}

/// A parsed response head: spans into the buffer it was parsed from.
#[derive(Debug, Clone, Default)]
pub struct ResponseHead {
    /// Bytes of the head, the final empty line included.
    pub len: usize,
    /// The status code.
    pub code: u16,
    /// The reason phrase, as sent.
    pub reason: Span,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor: u8,
    /// Every field, in order.
    pub headers: Vec<Header>,
    /// The body's framing.
    pub body: ResponseBody,
    /// Whether the connection cannot carry another exchange after this
    /// one (`Connection: close`, HTTP/1.0 without `keep-alive`, or a body
    /// delimited by the close).
    pub close: bool,
    /// What its `Connection` fields say.
    pub connection: ConnectionOptions,
    /// The `Content-Length` (one valid value), unless a transfer coding
    /// frames the body (it wins: RFC 9112, section 6.3). Kept for bodiless
    /// answers too (`HEAD`, 304), where it only informs: a proxy writes its
    /// own field from it, never the backend's as sent.
    pub length: Option<u64>,
}

impl ResponseHead {
    /// A 1xx other than 101: an interim answer, followed by the real one.
    pub fn is_interim(&self) -> bool {
        (100..200).contains(&self.code) && self.code != 101
    }
}

/// Parses a response head from the start of `buf` into `head`.
/// `to_head`: the request was `HEAD` (the response has no body whatever
/// its fields say). `Ok(None)`: not complete yet.
pub fn parse_response(buf: &[u8], limits: HeadLimits, to_head: bool, head: &mut ResponseHead) -> Parsed<()> {
    let max = limits.max_headers.min(MAX_HEADERS);
    let mut slots = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let status =
        httparse::ParserConfig::default().parse_response_with_uninit_headers(&mut resp, buf, &mut slots[..max]);
    let len = match status {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => {
            return if buf.len() >= limits.max_bytes { Err(HeadError::TooLarge) } else { Ok(None) };
        }
        Err(e) => return Err(syntax(e)),
    };
    if len > limits.max_bytes {
        return Err(HeadError::TooLarge);
    }
    let (Some(code), Some(minor)) = (resp.code, resp.version) else {
        return Err(HeadError::Syntax("incomplete status line"));
    };
    if minor > 1 {
        return Err(HeadError::Version);
    }
    // RFC 9110, section 15: three digits, 100 to 599.
    if !(100..=599).contains(&code) {
        return Err(HeadError::Syntax("status code out of range"));
    }
    head.len = len;
    head.code = code;
    head.reason = Span::within(buf, resp.reason.unwrap_or_default().as_bytes());
    head.minor = minor;
    collect_headers(buf, resp.headers, &mut head.headers);
    let headers = &head.headers;
    let bodiless = to_head || (100..200).contains(&code) || code == 204 || code == 304;
    let chunked = match codings(buf, headers)? {
        Codings::None => false,
        Codings::Chunked => true,
        // The proxy decodes the chunks and frames the body again; a coding
        // it cannot remove would reach the client mislabelled (nginx
        // refuses these too).
        Codings::OthersThenChunked | Codings::NotChunked => return Err(HeadError::UnsupportedCoding),
    };
    // Checked even where it frames nothing (HEAD, 304): it is forwarded.
    head.length = if chunked { None } else { content_length(buf, headers)? };
    head.body = match (bodiless, chunked, head.length) {
        (true, _, _) => ResponseBody::None,
        (false, true, _) => ResponseBody::Chunked,
        (false, false, Some(n)) => ResponseBody::Length(n),
        // RFC 9112, section 6.3: read until the connection closes.
        (false, false, None) => ResponseBody::UntilClose,
    };
    head.connection = ConnectionOptions::of(buf, headers);
    // A coding in HTTP/1.0, or a length beside the coding: the framing is
    // faulty, and the connection is not used again (RFC 9112, sections 6.1
    // and 6.3).
    let faulty = chunked && (minor == 0 || headers.iter().any(|h| h.kind == HeaderKind::ContentLength));
    head.close = head.body == ResponseBody::UntilClose || faulty || head.connection.closes(minor);
    Ok(Some(()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &str, to_head: bool) -> Result<ResponseHead, HeadError> {
        let mut head = ResponseHead::default();
        parse_response(raw.as_bytes(), HeadLimits::default(), to_head, &mut head)?.expect("complete");
        Ok(head)
    }

    #[test]
    fn framing_follows_rfc_9112() {
        let body = |raw: &str| parse(raw, false).unwrap().body;
        assert_eq!(body("HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nabc"), ResponseBody::Length(3));
        assert_eq!(body("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"), ResponseBody::Chunked);
        assert_eq!(body("HTTP/1.1 200 OK\r\n\r\n"), ResponseBody::UntilClose);
        assert_eq!(body("HTTP/1.1 204 No Content\r\ncontent-length: 3\r\n\r\n"), ResponseBody::None);
        assert_eq!(body("HTTP/1.1 304 Not Modified\r\n\r\n"), ResponseBody::None);
        assert_eq!(body("HTTP/1.1 100 Continue\r\n\r\n"), ResponseBody::None);
        assert_eq!(parse("HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\n", true).unwrap().body, ResponseBody::None);
        // Both framings: the coding wins and the length is not forwarded.
        let both = parse("HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n", false).unwrap();
        assert_eq!(both.body, ResponseBody::Chunked);
        assert_eq!(both.length, None);
        assert!(both.close, "two framings: the connection is not reused");
        assert!(parse("HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\n", false).is_err());
        // The length of a bodiless answer is checked too, and kept.
        assert_eq!(parse("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", true).unwrap().length, Some(5));
        assert!(parse("HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 9\r\n\r\n", true).is_err());
        assert!(parse("HTTP/1.1 304 Not Modified\r\ncontent-length: x\r\n\r\n", false).is_err());
    }

    #[test]
    fn codings_the_proxy_cannot_remove_are_refused() {
        for coded in ["gzip", "gzip, chunked", "identity", "chunked\r\ntransfer-encoding: gzip"] {
            let raw = format!("HTTP/1.1 200 OK\r\ntransfer-encoding: {coded}\r\n\r\n");
            assert!(parse(&raw, false).is_err(), "{coded}");
        }
    }

    #[test]
    fn keep_alive_and_interim_answers() {
        assert!(!parse("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", false).unwrap().close);
        assert!(parse("HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n", false).unwrap().close);
        assert!(parse("HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n", false).unwrap().close);
        let ka = |c: &str| parse(&format!("HTTP/1.0 200 OK\r\nconnection: {c}\r\ncontent-length: 0\r\n\r\n"), false);
        assert!(!ka("keep-alive").unwrap().close);
        assert!(ka("keep-alive, close").unwrap().close, "close wins");
        let coded_10 = "HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ntransfer-encoding: chunked\r\n\r\n";
        assert!(parse(coded_10, false).unwrap().close, "a coding in HTTP/1.0: faulty framing");
        assert!(parse("HTTP/1.1 200 OK\r\n\r\n", false).unwrap().close, "close-delimited");
        assert!(parse("HTTP/1.1 103 Early Hints\r\n\r\n", false).unwrap().is_interim());
        assert!(!parse("HTTP/1.1 101 Switching Protocols\r\n\r\n", false).unwrap().is_interim());
    }

    #[test]
    fn garbage_is_refused() {
        for bad in [
            "HTTP/1.1 2000 OK\r\n\r\n",
            "HTTP/1.1 000 X\r\n\r\n",
            "HTTP/1.1 099 X\r\n\r\n",
            "HTTP/1.1 600 X\r\n\r\n",
            "HTTP/1.1 200 OK\r\nx: a\r\n b\r\n\r\n",
            "SSH-2.0-OpenSSH\r\n\r\n",
        ] {
            assert!(parse(bad, false).is_err(), "{bad:?}");
        }
    }
}

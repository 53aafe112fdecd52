//! Response heads.

use std::mem::MaybeUninit;

use crate::fields::{codings, content_length, Codings, ConnectionOptions};
use crate::{collect_headers, syntax, HeadError, HeadLimits, Header, Parsed, Span, MAX_HEADERS};

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
    /// Whether a `Content-Length` field must not be forwarded: the body is
    /// framed by its transfer coding, which wins (RFC 9112, section 6.3).
    pub drop_content_length: bool,
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
    head.len = len;
    head.code = code;
    head.reason = Span::within(buf, resp.reason.unwrap_or_default().as_bytes());
    head.minor = minor;
    collect_headers(buf, resp.headers, &mut head.headers);
    let headers = &head.headers;
    let bodiless = to_head || (100..200).contains(&code) || code == 204 || code == 304;
    let coded = codings(buf, headers)?;
    head.drop_content_length = !matches!(coded, Codings::None);
    head.body = if bodiless {
        ResponseBody::None
    } else {
        match coded {
            Codings::Chunked | Codings::OthersThenChunked => ResponseBody::Chunked,
            // RFC 9112, section 6.3: read until the connection closes.
            Codings::NotChunked => ResponseBody::UntilClose,
            Codings::None => match content_length(buf, headers)? {
                Some(n) => ResponseBody::Length(n),
                None => ResponseBody::UntilClose,
            },
        }
    };
    head.connection = ConnectionOptions::of(buf, headers);
    head.close = head.body == ResponseBody::UntilClose
        || if minor == 0 { !head.connection.keep_alive } else { head.connection.close };
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
        assert!(both.drop_content_length);
        assert_eq!(body("HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n"), ResponseBody::UntilClose);
        assert!(parse("HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\n", false).is_err());
    }

    #[test]
    fn keep_alive_and_interim_answers() {
        assert!(!parse("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", false).unwrap().close);
        assert!(parse("HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n", false).unwrap().close);
        assert!(parse("HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n", false).unwrap().close);
        assert!(parse("HTTP/1.1 200 OK\r\n\r\n", false).unwrap().close, "close-delimited");
        assert!(parse("HTTP/1.1 103 Early Hints\r\n\r\n", false).unwrap().is_interim());
        assert!(!parse("HTTP/1.1 101 Switching Protocols\r\n\r\n", false).unwrap().is_interim());
    }

    #[test]
    fn garbage_is_refused() {
        for bad in ["HTTP/1.1 2000 OK\r\n\r\n", "HTTP/1.1 200 OK\r\nx: a\r\n b\r\n\r\n", "SSH-2.0-OpenSSH\r\n\r\n"] {
            assert!(parse(bad, false).is_err(), "{bad:?}");
        }
    }
}

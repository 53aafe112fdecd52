//! What header names mean to a proxy, and the field values it must read:
//! `Connection` tokens, `Content-Length`, `Transfer-Encoding`.

use crate::{trim, FramingError, HeadError, Header};

/// The header names a proxy reads or rewrites; everything else is `Other`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderKind {
    /// `Host`.
    Host,
    /// `Content-Length`.
    ContentLength,
    /// `Transfer-Encoding` (hop-by-hop).
    TransferEncoding,
    /// `Connection` (hop-by-hop).
    Connection,
    /// `Keep-Alive` (hop-by-hop).
    KeepAlive,
    /// `Proxy-Connection` (hop-by-hop, legacy).
    ProxyConnection,
    /// `Proxy-Authorization` (hop-by-hop: credentials for this proxy).
    ProxyAuthorization,
    /// `Proxy-Authenticate` (hop-by-hop).
    ProxyAuthenticate,
    /// `TE` (hop-by-hop).
    Te,
    /// `Trailer` (hop-by-hop).
    Trailer,
    /// `Upgrade` (hop-by-hop; kept for an upgrade that is forwarded).
    Upgrade,
    /// `Expect`.
    Expect,
    /// `X-Forwarded-For`.
    XForwardedFor,
    /// `X-Forwarded-Proto`.
    XForwardedProto,
    /// `X-Forwarded-Host`.
    XForwardedHost,
    /// `X-Forwarded-Port`.
    XForwardedPort,
    /// `X-Real-IP`.
    XRealIp,
    /// `Forwarded`.
    Forwarded,
    /// `X-Request-Id`.
    XRequestId,
    /// Any other name.
    Other,
}

impl HeaderKind {
    /// Classifies a header name (ASCII case-insensitive).
    pub fn of(name: &[u8]) -> HeaderKind {
        use HeaderKind::*;
        let is = |known: &str| name.eq_ignore_ascii_case(known.as_bytes());
        // Bucketed by length: one or two comparisons per name.
        match name.len() {
            2 if is("te") => Te,
            4 if is("host") => Host,
            6 if is("expect") => Expect,
            7 if is("upgrade") => Upgrade,
            7 if is("trailer") => Trailer,
            9 if is("forwarded") => Forwarded,
            9 if is("x-real-ip") => XRealIp,
            10 if is("connection") => Connection,
            10 if is("keep-alive") => KeepAlive,
            12 if is("x-request-id") => XRequestId,
            14 if is("content-length") => ContentLength,
            15 if is("x-forwarded-for") => XForwardedFor,
            16 if is("proxy-connection") => ProxyConnection,
            16 if is("x-forwarded-host") => XForwardedHost,
            16 if is("x-forwarded-port") => XForwardedPort,
            17 if is("transfer-encoding") => TransferEncoding,
            17 if is("x-forwarded-proto") => XForwardedProto,
            18 if is("proxy-authenticate") => ProxyAuthenticate,
            19 if is("proxy-authorization") => ProxyAuthorization,
            _ => Other,
        }
    }

    /// Whether the field describes one connection and is never forwarded
    /// as it is (RFC 9110, section 7.6.1, and the legacy ones).
    pub fn is_hop_by_hop(self) -> bool {
        use HeaderKind::*;
        matches!(
            self,
            TransferEncoding
                | Connection
                | KeepAlive
                | ProxyConnection
                | ProxyAuthorization
                | ProxyAuthenticate
                | Te
                | Trailer
                | Upgrade
        )
    }
}

/// The comma-separated tokens of a list-valued field, trimmed, empty ones
/// skipped.
pub fn tokens(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value.split(|b| *b == b',').map(trim).filter(|t| !t.is_empty())
}

/// Whether any `Connection` field of `headers` (parsed from `buf`) lists
/// `token` (ASCII case-insensitive).
pub fn connection_has(buf: &[u8], headers: &[Header], token: &str) -> bool {
    headers
        .iter()
        .filter(|h| h.kind == HeaderKind::Connection)
        .any(|h| tokens(h.value.of(buf)).any(|t| t.eq_ignore_ascii_case(token.as_bytes())))
}

/// What the `Connection` fields of a message say, read in one pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnectionOptions {
    /// A `Connection` field is present (other fields it names are
    /// hop-by-hop).
    pub present: bool,
    /// It lists `close`.
    pub close: bool,
    /// It lists `keep-alive`.
    pub keep_alive: bool,
    /// It lists `upgrade`.
    pub upgrade: bool,
}

impl ConnectionOptions {
    /// Reads every `Connection` field of `headers` (parsed from `buf`).
    pub fn of(buf: &[u8], headers: &[Header]) -> ConnectionOptions {
        let mut o = ConnectionOptions::default();
        for h in headers.iter().filter(|h| h.kind == HeaderKind::Connection) {
            o.present = true;
            for t in tokens(h.value.of(buf)) {
                o.close |= t.eq_ignore_ascii_case(b"close");
                o.keep_alive |= t.eq_ignore_ascii_case(b"keep-alive");
                o.upgrade |= t.eq_ignore_ascii_case(b"upgrade");
            }
        }
        o
    }

    /// Whether a message of HTTP/1.`minor` with these options ends its
    /// connection: `close` is listed (it wins over `keep-alive`, RFC 9112
    /// section 9.3), or it is HTTP/1.0 without `keep-alive`.
    pub fn closes(&self, minor: u8) -> bool {
        self.close || (minor == 0 && !self.keep_alive)
    }
}

/// The one length every `Content-Length` field states, if any: repeated
/// fields (or a list) must all agree, and each must be 1 to 19 digits.
pub(crate) fn content_length(buf: &[u8], headers: &[Header]) -> Result<Option<u64>, HeadError> {
    let mut length = None;
    for h in headers.iter().filter(|h| h.kind == HeaderKind::ContentLength) {
        for t in h.value.of(buf).split(|b| *b == b',').map(trim) {
            let n = parse_digits(t).ok_or(HeadError::Framing(FramingError::InvalidLength))?;
            if length.is_some_and(|l| l != n) {
                return Err(HeadError::Framing(FramingError::DifferingLengths));
            }
            length = Some(n);
        }
    }
    Ok(length)
}

fn parse_digits(t: &[u8]) -> Option<u64> {
    if t.is_empty() || t.len() > 19 || !t.iter().all(u8::is_ascii_digit) {
        return None;
    }
    t.iter().try_fold(0u64, |n, d| n.checked_mul(10)?.checked_add(u64::from(d - b'0')))
}

/// The transfer codings of a message, in order.
pub(crate) enum Codings {
    /// No `Transfer-Encoding` field.
    None,
    /// Exactly `chunked`.
    Chunked,
    /// Codings whose last one is `chunked`, after others (`gzip, chunked`).
    OthersThenChunked,
    /// Codings whose last one is not `chunked`.
    NotChunked,
}

/// Reads every `Transfer-Encoding` field, as one list.
pub(crate) fn codings(buf: &[u8], headers: &[Header]) -> Result<Codings, HeadError> {
    let mut count = 0usize;
    let mut chunked_at = None;
    let mut any_field = false;
    for h in headers.iter().filter(|h| h.kind == HeaderKind::TransferEncoding) {
        any_field = true;
        for t in tokens(h.value.of(buf)) {
            if t.eq_ignore_ascii_case(b"chunked") {
                if chunked_at.is_some() {
                    return Err(HeadError::Framing(FramingError::ChunkedTwice));
                }
                chunked_at = Some(count);
            }
            count += 1;
        }
    }
    Ok(match (any_field, chunked_at) {
        (false, _) => Codings::None,
        (true, _) if count == 0 => return Err(HeadError::Framing(FramingError::EmptyCoding)),
        (true, Some(i)) if i + 1 == count => {
            if count == 1 {
                Codings::Chunked
            } else {
                Codings::OthersThenChunked
            }
        }
        (true, Some(_)) => return Err(HeadError::Framing(FramingError::ChunkedNotLast)),
        (true, None) => Codings::NotChunked,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_classified_case_insensitively() {
        assert_eq!(HeaderKind::of(b"Content-Length"), HeaderKind::ContentLength);
        assert_eq!(HeaderKind::of(b"TE"), HeaderKind::Te);
        assert_eq!(HeaderKind::of(b"x-forwarded-PROTO"), HeaderKind::XForwardedProto);
        assert_eq!(HeaderKind::of(b"content-lengthx"), HeaderKind::Other);
        assert!(HeaderKind::of(b"Proxy-Authorization").is_hop_by_hop());
        assert!(!HeaderKind::of(b"host").is_hop_by_hop());
    }

    #[test]
    fn digits_are_strict() {
        assert_eq!(parse_digits(b"0"), Some(0));
        assert_eq!(parse_digits(b"18446744073709551615"), None, "20 digits");
        assert_eq!(parse_digits(b"9999999999999999999"), Some(9_999_999_999_999_999_999));
        for bad in [&b""[..], b"+5", b"-1", b"5 ", b"0x10", b"1_0"] {
            assert_eq!(parse_digits(bad), None, "{bad:?}");
        }
    }
}

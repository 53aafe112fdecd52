//! Header rewriting between client and backend.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;

use crate::conn::Peer;

/// Hop-by-hop headers (RFC 9110 section 7.6.1, plus the legacy ones):
/// they describe one connection and are never forwarded.
static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
];

/// Removes hop-by-hop headers, including those named in `Connection`, and
/// `Upgrade` (put back by the caller for an upgrade it forwards).
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none: one pass over the names is cheaper than a
    // hashed removal per hop-by-hop name.
    if !headers.keys().any(|k| *k == header::UPGRADE || HOP_BY_HOP.contains(k)) {
        return;
    }
    if headers.contains_key(header::CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|s| s.split(','))
            .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
            .collect();
        for h in &named {
            headers.remove(h);
        }
    }
    for h in &HOP_BY_HOP {
        headers.remove(h);
    }
    headers.remove(header::UPGRADE);
}

/// Prepares a backend's response headers for the client. A response framed
/// by `Transfer-Encoding` must not keep a `Content-Length` (RFC 9112
/// section 6.3: the encoding wins); forwarding both would let the client
/// frame the decoded body by the wrong length.
pub(crate) fn response_headers(headers: &mut HeaderMap) {
    if headers.contains_key(header::TRANSFER_ENCODING) {
        headers.remove(header::CONTENT_LENGTH);
    }
    strip_hop_by_hop(headers);
}

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
static X_FORWARDED_PORT: HeaderName = HeaderName::from_static("x-forwarded-port");
pub(crate) static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The longest client `X-Request-Id` that is kept, in bytes.
pub(crate) const MAX_REQUEST_ID: usize = 128;

/// Whether a client's `X-Request-Id` value is kept as it is: 1 to
/// [`MAX_REQUEST_ID`] bytes of ASCII letters, digits and `-_.:/+=` (UUIDs,
/// hex and base64 ids, `trace:span` pairs). Anything else could break or
/// forge a line of a log that prints it, or bloat every log line of every
/// service the request goes through.
pub(crate) fn acceptable_request_id(value: &[u8]) -> bool {
    (1..=MAX_REQUEST_ID).contains(&value.len())
        && value
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':' | b'/' | b'+' | b'='))
}

/// The client's `X-Request-Id` (`values`: every value it sent), when it is
/// kept: exactly one value, and an acceptable one. Two values would let the
/// backend and the access log each believe a different one.
pub(crate) fn client_request_id<'a>(mut values: impl Iterator<Item = &'a [u8]>) -> Option<&'a [u8]> {
    let first = values.next()?;
    (values.next().is_none() && acceptable_request_id(first)).then_some(first)
}

/// Leaves exactly one `X-Request-Id` in `h`: the client's when
/// [`client_request_id`] keeps it, else a new one in place of every value
/// the client sent. Returns it. Calling it again keeps the same id.
pub(crate) fn settle_request_id(h: &mut HeaderMap) -> HeaderValue {
    if let Some(id) = client_request_id(h.get_all(&X_REQUEST_ID).iter().map(HeaderValue::as_bytes)) {
        // Checked above: it is a valid value.
        if let Ok(v) = HeaderValue::from_bytes(id) {
            return v;
        }
    }
    let id = new_request_id();
    // 32 hex digits: always a valid value.
    let v = HeaderValue::from_bytes(&id).unwrap_or_else(|_| HeaderValue::from_static("-"));
    h.insert(X_REQUEST_ID.clone(), v.clone());
    v
}

/// A new request id: 128 random bits as 32 lowercase hex digits, for a
/// request that arrives without an acceptable `X-Request-Id`. Not a secret (the
/// generator is fast, not cryptographic): it only has to be unique enough
/// to follow one request through the logs of the proxy and its backends.
pub(crate) fn new_request_id() -> [u8; 32] {
    let mut id = [0u8; 32];
    for (digits, byte) in id.chunks_exact_mut(2).zip(fastrand::u128(..).to_le_bytes()) {
        digits.copy_from_slice(&HEX_PAIRS[byte as usize]);
    }
    id
}

/// The two lowercase hex digits of each byte value: a request id takes
/// 16 lookups instead of 32 shifts of a 128-bit number.
const HEX_PAIRS: [[u8; 2]; 256] = {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut pairs = [[0u8; 2]; 256];
    let mut i = 0;
    while i < 256 {
        pairs[i] = [HEX[i >> 4], HEX[i & 0xf]];
        i += 1;
    }
    pairs
};

/// Joins several `Cookie` fields into one, `; ` between them: an HTTP/2
/// client may send each cookie as a field of its own, and an HTTP/1.1
/// backend must get one line (RFC 9113, section 8.2.3; many servers read
/// only the first).
fn join_cookies(h: &mut http::HeaderMap) {
    let mut values = h.get_all(header::COOKIE).iter();
    if values.nth(1).is_none() {
        return;
    }
    let joined = h.get_all(header::COOKIE).iter().map(HeaderValue::as_bytes).collect::<Vec<_>>().join(&b"; "[..]);
    if let Ok(v) = HeaderValue::from_bytes(&joined) {
        h.insert(header::COOKIE, v);
    }
}

/// Rewrites a request's headers for its backend: hop-by-hop headers out
/// (an upgrade's `Upgrade` kept), `Expect` out, `X-Forwarded-For`/`-Proto`/
/// `-Host` set, and `Host` present for HTTP/1.1 backends. `Expect` is the
/// proxy's to meet, never the backend's: both engines answer
/// `100-continue` themselves (hyper's when the body is first read, the
/// native engine before it reads it), and a proxy that has answered an
/// expectation must not forward it (RFC 9110, section 10.1.1), or the
/// backend would send a `100` of its own that no client asked for. The client's own
/// `X-Forwarded-For`, `Forwarded` and `X-Real-IP` are kept (and appended
/// to) only when it is a trusted proxy; otherwise they are replaced or
/// removed, so a backend can believe what it reads.
pub(crate) fn request_headers(parts: &mut Parts, peer: &Peer, upgrade: bool) {
    let h = &mut parts.headers;
    let upgrade_value = if upgrade { h.get(header::UPGRADE).cloned() } else { None };
    strip_hop_by_hop(h);
    h.remove(header::EXPECT);
    let refused: Vec<_> =
        h.keys().filter(|n| !crate::hygiene::forwards_request_field(n.as_str().as_bytes())).cloned().collect();
    for name in refused {
        h.remove(name);
    }
    join_cookies(h);
    if let Some(v) = upgrade_value {
        h.insert(header::UPGRADE, v);
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
    let appended = match h.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
        Some(prev) if peer.trusted => HeaderValue::from_str(&format!("{prev}, {}", peer.addr.ip())).ok(),
        _ => None,
    };
    if !peer.trusted {
        h.remove(header::FORWARDED);
        h.remove(&X_REAL_IP);
    }
    let xff = appended.or_else(|| Some(peer.ip_header.clone()));
    if let Some(v) = xff {
        h.insert(X_FORWARDED_FOR.clone(), v);
    }
    settle_request_id(h);
    h.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static(peer.scheme()));
    h.insert(X_FORWARDED_PORT.clone(), peer.port_header.clone());
    // HTTP/2 carries the host in the URI; HTTP/1.1 backends need the header.
    let original_host = h
        .get(header::HOST)
        .cloned()
        .or_else(|| parts.uri.authority().and_then(|a| HeaderValue::from_str(a.as_str()).ok()));
    if let Some(v) = original_host {
        h.insert(X_FORWARDED_HOST.clone(), v.clone());
        h.insert(header::HOST, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_32_lowercase_hex_digits_of_every_byte() {
        for (i, pair) in HEX_PAIRS.iter().enumerate() {
            assert_eq!(pair, format!("{i:02x}").as_bytes());
        }
        let id = new_request_id();
        assert!(id.iter().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b)), "{id:?}");
    }

    fn forwarded_for(trusted: bool) -> HeaderMap {
        let req = http::Request::builder()
            .uri("/")
            .header(header::HOST, "h")
            .header("x-forwarded-for", "198.51.100.1")
            .header("x-real-ip", "198.51.100.1")
            .header(header::FORWARDED, "for=198.51.100.1")
            .header("x_forwarded_for", "6.6.6.6")
            .header("x_real_ip", "6.6.6.6")
            .body(())
            .unwrap();
        let (mut parts, ()) = req.into_parts();
        let mut peer = Peer::new("192.0.2.9:5000".parse().unwrap());
        peer.trusted = trusted;
        request_headers(&mut parts, &peer, false);
        parts.headers
    }

    #[test]
    fn forwarding_headers_are_believed_only_from_trusted_peers() {
        let h = forwarded_for(false);
        assert_eq!(h["x-forwarded-for"], "192.0.2.9");
        assert!(!h.contains_key("x-real-ip") && !h.contains_key(header::FORWARDED));
        assert!(!h.contains_key("x_forwarded_for") && !h.contains_key("x_real_ip"), "underscores never pass");
        let h = forwarded_for(true);
        assert_eq!(h["x-forwarded-for"], "198.51.100.1, 192.0.2.9");
        assert_eq!(h["x-real-ip"], "198.51.100.1");
        assert_eq!(h["x-forwarded-host"], "h");
    }

    #[test]
    fn an_expectation_is_met_by_the_proxy_and_not_forwarded() {
        let req = http::Request::builder()
            .method("POST")
            .uri("/")
            .header(header::HOST, "h")
            .header(header::EXPECT, "100-continue")
            .header(header::CONTENT_LENGTH, "5")
            .body(())
            .unwrap();
        let (mut parts, ()) = req.into_parts();
        request_headers(&mut parts, &Peer::new("192.0.2.9:5000".parse().unwrap()), false);
        assert!(!parts.headers.contains_key(header::EXPECT), "{:?}", parts.headers);
        assert_eq!(parts.headers[header::CONTENT_LENGTH], "5", "the framing stays");
    }

    #[test]
    fn a_request_id_is_kept_only_when_it_is_one_short_safe_value() {
        for ok in ["req-42", "0f8fad5b-d9cb-469f-a165-70867728950e", "a:b/c+d=e_f.g", &"x".repeat(MAX_REQUEST_ID)] {
            assert!(acceptable_request_id(ok.as_bytes()), "{ok}");
        }
        let long = "x".repeat(MAX_REQUEST_ID + 1);
        for bad in ["", "a b", "a\"b", "a<b>", "\u{202e}abc", "a\u{2028}b", "é", "a;b", "a,b", "%41", long.as_str()] {
            assert!(!acceptable_request_id(bad.as_bytes()), "{bad:?}");
        }
        let one = [&b"abc"[..]];
        assert_eq!(client_request_id(one.into_iter()), Some(&b"abc"[..]));
        let two = [&b"abc"[..], b"def"];
        assert_eq!(client_request_id(two.into_iter()), None, "two values: neither is believed");
        assert_eq!(client_request_id(std::iter::empty()), None);
    }

    #[test]
    fn settling_leaves_one_id_the_clients_or_a_new_one() {
        let mut h = HeaderMap::new();
        h.insert(&X_REQUEST_ID, HeaderValue::from_static("req-1"));
        assert_eq!(settle_request_id(&mut h), "req-1");
        assert_eq!(h.get_all(&X_REQUEST_ID).iter().count(), 1);
        for sent in [&["a", "b"][..], &["a b"], &[]] {
            let mut h = HeaderMap::new();
            for v in sent {
                h.append(&X_REQUEST_ID, HeaderValue::from_static(v));
            }
            let id = settle_request_id(&mut h);
            assert_eq!(id.len(), 32, "{sent:?}: a generated id");
            assert_eq!(h.get_all(&X_REQUEST_ID).iter().collect::<Vec<_>>(), [&id], "{sent:?}");
            assert_eq!(settle_request_id(&mut h), id, "settling again keeps it");
        }
    }

    #[test]
    fn split_cookies_are_joined_into_one_field() {
        let mut h = HeaderMap::new();
        h.append(header::COOKIE, HeaderValue::from_static("a=1"));
        h.append(header::COOKIE, HeaderValue::from_static("b=2"));
        join_cookies(&mut h);
        assert_eq!(h.get_all(header::COOKIE).iter().collect::<Vec<_>>(), ["a=1; b=2"]);
        join_cookies(&mut h);
        assert_eq!(h[header::COOKIE], "a=1; b=2", "one field stays as it is");
    }

    #[test]
    fn hop_by_hop_and_connection_named_headers_go() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("close, x-secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert(header::PROXY_AUTHORIZATION, HeaderValue::from_static("Basic Zm9v"));
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn a_chunked_response_loses_its_content_length() {
        let mut h = HeaderMap::new();
        h.insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("5"));
        response_headers(&mut h);
        assert!(h.is_empty(), "{h:?}");
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("5"));
        response_headers(&mut h);
        assert_eq!(h.get(header::CONTENT_LENGTH).unwrap(), "5");
    }
}

//! Checks and rewrites every request gets before it is routed, so that
//! what the proxy routes on is exactly what the backend receives.
//!
//! - **One host.** The authority of an absolute-form or HTTP/2 request wins
//!   over a `Host` header (RFC 9112 section 3.2.3) and becomes the `Host`
//!   sent upstream; a request with two `Host` headers, an HTTP/1.1 request
//!   with none, or a host that is not a valid authority (with an empty
//!   name, or a port that is not 1 to 65535 in digits) is refused. Routes
//!   match the host lowercase, without its port and one trailing dot
//!   (`App.Example.:8080` is `app.example`).
//! - **One framing.** A request with both `Transfer-Encoding` and
//!   `Content-Length` is refused.
//! - **One path.** The path is normalized ([`crate::normalize`]) and the
//!   request's URI becomes origin-form with that path and the original
//!   query.

use http::header::{self, HeaderValue};
use http::uri::{Authority, PathAndQuery};
use http::{Request, Uri, Version};

use crate::error::{ErrorKind, FramingError};
use crate::normalize::normalize;

/// Applies the host and path rules to `req` in place.
pub(crate) fn sanitize<B>(req: &mut Request<B>) -> Result<(), ErrorKind> {
    // RFC 9112 section 6.1 allows framing by the encoding alone, but a
    // message with both is the classic smuggling vector: refuse it.
    if req.headers().contains_key(header::TRANSFER_ENCODING) && req.headers().contains_key(header::CONTENT_LENGTH) {
        return Err(ErrorKind::InvalidFraming(FramingError::LengthAndCoding));
    }
    // RFC 9113, section 8.2.1: a value that starts or ends with whitespace
    // is malformed (HTTP/1 parsers trim it; an HTTP/2 request would pass it
    // on, and a route's header match and the backend would read it apart).
    let padded = |v: &[u8]| matches!(v.first().zip(v.last()), Some((a, b)) if [*a, *b].iter().any(|c| *c == b' ' || *c == b'\t'));
    if req.headers().values().any(|v| padded(v.as_bytes())) {
        return Err(ErrorKind::BadRequest);
    }
    // `*` names no resource (it is OPTIONS' server-wide form): nothing to
    // route, as on the native path.
    if req.uri().path() == "*" {
        return Err(ErrorKind::InvalidPath);
    }
    let mut hosts = req.headers().get_all(header::HOST).iter();
    let host = hosts.next();
    if hosts.next().is_some() {
        return Err(ErrorKind::InvalidHost);
    }
    let authority = req.uri().authority().map(Authority::as_str);
    // RFC 9113, section 8.3.1: an HTTP/2 request whose `:authority` and
    // `Host` differ is malformed (HTTP/1.1's absolute form is different:
    // its target wins, RFC 9112 section 3.2.2).
    if let (Version::HTTP_2, Some(a), Some(h)) = (req.version(), authority, host) {
        if !a.as_bytes().eq_ignore_ascii_case(h.as_bytes()) {
            return Err(ErrorKind::InvalidHost);
        }
    }
    let http11 = req.version() == Version::HTTP_11;
    if let (Some(a), _) = (authority, effective_host(authority, host.map(HeaderValue::as_bytes), http11)?) {
        let v = HeaderValue::from_str(a).map_err(|_| ErrorKind::InvalidHost)?;
        req.headers_mut().insert(header::HOST, v);
    }
    let path = req.uri().path();
    let normal = normalize(path).map_err(|_| ErrorKind::InvalidPath)?;
    let origin_form = req.uri().scheme().is_none() && req.uri().authority().is_none();
    if origin_form && normal == path {
        return Ok(());
    }
    let target = match req.uri().query() {
        Some(q) => format!("{normal}?{q}"),
        None => normal.into_owned(),
    };
    let pq = PathAndQuery::try_from(target).map_err(|_| ErrorKind::InvalidPath)?;
    *req.uri_mut() = Uri::from(pq);
    Ok(())
}

/// The one host a request names: the authority of an absolute-form (or
/// HTTP/2) target wins over the `Host` header; without either, HTTP/1.1 is
/// refused and HTTP/1.0 names none. A host must be a valid authority with
/// no userinfo.
pub(crate) fn effective_host<'a>(
    authority: Option<&'a str>,
    host_header: Option<&'a [u8]>,
    http11: bool,
) -> Result<Option<&'a str>, ErrorKind> {
    // RFC 9112, section 3.2: an HTTP/1.1 request without `Host`, or with
    // an invalid one, is refused, even when its target names the authority.
    let header = match host_header {
        Some(h) if plain_host(h) => Some(std::str::from_utf8(h).map_err(|_| ErrorKind::InvalidHost)?),
        Some(h) => match Authority::try_from(h) {
            Ok(a) if !a.as_str().contains('@') && name_and_port_ok(h) => {
                Some(std::str::from_utf8(h).map_err(|_| ErrorKind::InvalidHost)?)
            }
            _ => return Err(ErrorKind::InvalidHost),
        },
        None if http11 => return Err(ErrorKind::InvalidHost),
        None => None,
    };
    match authority {
        Some(a) if a.contains('@') || !name_and_port_ok(a.as_bytes()) => Err(ErrorKind::InvalidHost),
        Some(a) => Ok(Some(a)),
        None => Ok(header),
    }
}

/// Whether an authority (`host[:port]`, already a valid
/// `http::uri::Authority`, which checks neither) has a name and a usable
/// port: none, or 1 to 5 digits naming 1 to 65535. `app.example:abc`,
/// `app.example:99999`, `app.example:`, `:80`, `:` and `[::1]:0` are
/// refused (RFC 9110, section 4.2.1: a port is digits; an empty one is no
/// port a client can mean).
fn name_and_port_ok(authority: &[u8]) -> bool {
    let (name, port) = if authority.first() == Some(&b'[') {
        let Some(end) = authority.iter().position(|&b| b == b']') else { return false };
        match &authority[end + 1..] {
            [] => (&authority[..=end], None),
            [b':', port @ ..] => (&authority[..=end], Some(port)),
            _ => return false,
        }
    } else {
        match authority.iter().position(|&b| b == b':') {
            Some(i) => (&authority[..i], Some(&authority[i + 1..])),
            None => (authority, None),
        }
    };
    !name.is_empty() && port.is_none_or(port_ok)
}

/// 1 to 5 digits naming a port from 1 to 65535.
fn port_ok(port: &[u8]) -> bool {
    (1..=5).contains(&port.len())
        && port.iter().all(u8::is_ascii_digit)
        && (1..=65_535).contains(&port.iter().fold(0u32, |n, d| n * 10 + u32::from(d - b'0')))
}

/// Whether `host` is a plain DNS name or IPv4 address with an optional
/// port (`example.com`, `10.0.0.1:8080`): letters, digits, `-` and `.`,
/// then `:` and a port (1 to 65535, at most five digits). Nearly every
/// `Host` is one, and each is a valid authority; checking this first
/// spares them the copy and full parse of `http::uri::Authority`, which
/// rules on everything else.
fn plain_host(host: &[u8]) -> bool {
    let (name, port) = match host.iter().position(|&b| b == b':') {
        Some(i) => (&host[..i], Some(&host[i + 1..])),
        None => (host, None),
    };
    !name.is_empty()
        && name.iter().all(|&b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        && port.is_none_or(port_ok)
}

/// Whether a request header named `name` is passed on. Not when the name
/// has an underscore: many backends (CGI, WSGI, Rack and the like) read
/// `X_Forwarded_For` and `X-Forwarded-For` as the same variable, so such a
/// name could stand in for a field the proxy sets or removes. nginx drops
/// them too, by default. Never a client's `X-Client-Cert-*` field: only the
/// proxy sets those, from a certificate it verified (a route's
/// `client_cert.forward_headers`), whether or not the route asks for them.
pub(crate) fn forwards_request_field(name: &[u8]) -> bool {
    !name.contains(&b'_') && !client_cert_field(name)
}

/// Whether `name` is one of the `X-Client-Cert-*` fields, which only the
/// proxy sets (any case).
pub(crate) fn client_cert_field(name: &[u8]) -> bool {
    let prefix = tidegate_model::CLIENT_CERT_HEADER_PREFIX.as_bytes();
    name.get(..prefix.len()).is_some_and(|p| p.eq_ignore_ascii_case(prefix))
}

/// Whether the protocols of an `Upgrade` request field (`value`) may be
/// offered to a backend: at least one is named, and none is `h2c`. The
/// proxy speaks HTTP/2 to clients itself, and a backend that switched a
/// connection to `h2c` would take requests the proxy never routed; a listed
/// `h2c` is refused too, since a backend may pick any protocol of the list.
pub(crate) fn upgrade_allowed(value: &[u8]) -> bool {
    let mut protocols = tidegate_h1::tokens(value).peekable();
    protocols.peek().is_some() && protocols.all(|p| !protocol_name(p).eq_ignore_ascii_case(b"h2c"))
}

/// Whether a backend's `101 Switching Protocols` switched to a protocol the
/// client offered (`asked`, the request's `Upgrade`): its own `Upgrade`
/// (`to`) names exactly one, by name (versions aside, case aside).
pub(crate) fn switched_as_asked(asked: &[u8], to: Option<&[u8]>) -> bool {
    let Some(to) = to else { return false };
    let mut chosen = tidegate_h1::tokens(to);
    let (Some(p), None) = (chosen.next(), chosen.next()) else { return false };
    upgrade_allowed(to) && tidegate_h1::tokens(asked).any(|a| protocol_name(a).eq_ignore_ascii_case(protocol_name(p)))
}

/// `websocket` of `websocket/13`.
fn protocol_name(protocol: &[u8]) -> &[u8] {
    protocol.split(|b| *b == b'/').next().unwrap_or_default()
}

/// The host to route on: the `Host` header (set by [`sanitize`]),
/// lowercase, without its port and one trailing dot.
pub(crate) fn request_routing_host<B>(req: &Request<B>) -> std::borrow::Cow<'_, str> {
    routing_host(req.headers().get(header::HOST).and_then(|h| h.to_str().ok()).unwrap_or(""))
}

/// `raw` (a host, maybe with a port) as routes match it: lowercase,
/// without its port, and without one trailing dot: `app.example.` is the
/// fully qualified form of `app.example` (RFC 1034, section 3.1), the
/// same host to DNS, to certificate selection by SNI and to a route.
pub(crate) fn routing_host(raw: &str) -> std::borrow::Cow<'_, str> {
    let without_port = if raw.starts_with('[') {
        raw.split_inclusive(']').next().unwrap_or(raw)
    } else {
        raw.rsplit_once(':').map_or(raw, |(h, _)| h)
    };
    let without_port = without_port.strip_suffix('.').unwrap_or(without_port);
    if without_port.bytes().any(|b| b.is_ascii_uppercase()) {
        std::borrow::Cow::Owned(without_port.to_ascii_lowercase())
    } else {
        std::borrow::Cow::Borrowed(without_port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The shortcut never accepts a host the full parse refuses.
        #[test]
        fn a_plain_host_is_a_valid_authority(host in "[a-zA-Z0-9.:-]{0,12}") {
            if plain_host(host.as_bytes()) {
                let a = Authority::try_from(host.as_bytes());
                prop_assert!(a.is_ok(), "{host:?}: {a:?}");
            }
        }
    }

    #[test]
    fn plain_hosts_are_names_or_addresses_with_a_port() {
        for h in ["example.com", "a", "10.0.0.1:8080", "x-y.z:1", "host:65535"] {
            assert!(plain_host(h.as_bytes()), "{h}");
        }
        for h in
            ["", ":80", "a:", "a:123456", "a:8a", "[::1]:80", "a b", "u@h", "a_b", "a:1:2", "é.com", "a:0", "a:65536"]
        {
            assert!(!plain_host(h.as_bytes()), "{h}");
        }
        // What the shortcut passes over still gets the full parse.
        assert_eq!(effective_host(None, Some(b"[::1]:80"), true), Ok(Some("[::1]:80")));
        assert_eq!(effective_host(None, Some(b"u@h"), true), Err(ErrorKind::InvalidHost));
        assert_eq!(effective_host(None, Some(b"a b"), true), Err(ErrorKind::InvalidHost));
        assert_eq!(effective_host(None, Some(b""), true), Err(ErrorKind::InvalidHost));
    }

    fn req(uri: &str, hosts: &[&str], version: Version) -> Request<()> {
        let mut b = Request::builder().uri(uri).version(version);
        for h in hosts {
            b = b.header(header::HOST, *h);
        }
        b.body(()).unwrap()
    }

    #[test]
    fn the_authority_is_the_host_sent_upstream() {
        let mut r = req("http://a.example/x", &["b.example"], Version::HTTP_11);
        sanitize(&mut r).unwrap();
        assert_eq!(r.headers()[header::HOST], "a.example");
        assert_eq!(r.uri(), "/x");
        assert_eq!(request_routing_host(&r), "a.example");
        let mut r = req("/x", &["Shop.Example:8080"], Version::HTTP_11);
        sanitize(&mut r).unwrap();
        assert_eq!(request_routing_host(&r), "shop.example");
    }

    #[test]
    fn bad_hosts_are_refused() {
        for (uri, hosts, v) in [
            ("/", &["a", "b"][..], Version::HTTP_11),
            ("/", &[][..], Version::HTTP_11),
            ("/", &["a b"][..], Version::HTTP_11),
            ("/", &["user@a"][..], Version::HTTP_11),
            // RFC 9112, section 3.2: the target's authority does not excuse
            // a missing or invalid `Host`.
            ("http://a.example/", &[][..], Version::HTTP_11),
            ("http://a.example/", &["x@y"][..], Version::HTTP_11),
        ] {
            assert_eq!(sanitize(&mut req(uri, hosts, v)), Err(ErrorKind::InvalidHost), "{uri} {hosts:?}");
        }
        // HTTP/1.0 needs no host.
        assert_eq!(sanitize(&mut req("/", &[], Version::HTTP_10)), Ok(()));
    }

    #[test]
    fn ports_are_digits_from_1_to_65535_and_names_are_not_empty() {
        for ok in ["a.example", "a.example:1", "a.example:65535", "a.example:080", "[::1]", "[::1]:8080", "a.example."]
        {
            assert!(name_and_port_ok(ok.as_bytes()), "{ok}");
            assert_eq!(effective_host(None, Some(ok.as_bytes()), true), Ok(Some(ok)), "{ok}");
            assert_eq!(effective_host(Some(ok), None, false), Ok(Some(ok)), "{ok} as an authority");
        }
        for bad in [
            "app.example:abc",
            "app.example:99999",
            "app.example:65536",
            "app.example:0",
            "app.example:",
            ":",
            ":80",
            "[::1]:",
            "[::1]x",
            "[::1]:abc",
            "a:1:2",
            "app.example:+80",
        ] {
            assert!(!name_and_port_ok(bad.as_bytes()), "{bad}");
            assert_eq!(effective_host(None, Some(bad.as_bytes()), true), Err(ErrorKind::InvalidHost), "{bad}");
            // The authority of an absolute-form or HTTP/2 target too.
            assert_eq!(effective_host(Some(bad), Some(b"a.example"), true), Err(ErrorKind::InvalidHost), "{bad}");
        }
    }

    proptest! {
        /// A port is accepted exactly when it is a number from 1 to 65535
        /// written in at most five digits.
        #[test]
        fn a_port_is_accepted_exactly_when_it_is_in_range(port in "[0-9a]{0,7}") {
            let expected = !port.is_empty() && port.len() <= 5 && port.parse::<u32>().is_ok_and(|p| (1..=65_535).contains(&p));
            let host = format!("h.example:{port}");
            prop_assert_eq!(effective_host(None, Some(host.as_bytes()), true).is_ok(), expected, "{}", host);
        }
    }

    #[test]
    fn routing_ignores_case_port_and_one_trailing_dot() {
        assert_eq!(routing_host("App.Example.:8080"), "app.example");
        assert_eq!(routing_host("app.example."), "app.example");
        assert_eq!(routing_host("app.example"), "app.example");
        assert_eq!(routing_host("app.example.."), "app.example.", "one dot only");
        assert_eq!(routing_host("[::1]:80"), "[::1]");
        let mut r = req("/x", &["Shop.Example.:8080"], Version::HTTP_11);
        sanitize(&mut r).unwrap();
        assert_eq!(request_routing_host(&r), "shop.example");
    }

    #[test]
    fn h2c_is_never_offered_nor_accepted() {
        assert!(upgrade_allowed(b"websocket"));
        assert!(upgrade_allowed(b"WebSocket/13, foo"));
        for refused in [&b"h2c"[..], b"websocket, h2c", b"H2C", b"h2c/1", b"", b" , "] {
            assert!(!upgrade_allowed(refused), "{:?}", String::from_utf8_lossy(refused));
        }
        assert!(switched_as_asked(b"websocket", Some(b"WebSocket")));
        assert!(switched_as_asked(b"foo, websocket/13", Some(b"websocket")));
        for (asked, to) in [
            (&b"websocket"[..], None),
            (b"websocket", Some(&b"h2c"[..])),
            (b"websocket", Some(b"foo")),
            (b"websocket, foo", Some(b"websocket, foo")),
        ] {
            assert!(!switched_as_asked(asked, to), "{asked:?} {to:?}");
        }
    }

    #[test]
    fn names_with_underscores_are_not_forwarded() {
        assert!(forwards_request_field(b"X-Forwarded-For"));
        assert!(!forwards_request_field(b"X_Forwarded_For"));
        assert!(!forwards_request_field(b"content_length"));
        assert!(!forwards_request_field(b"X-Client-Cert-Subject"));
        assert!(!forwards_request_field(b"x-client-cert-fingerprint"));
        assert!(!forwards_request_field(b"X-CLIENT-CERT-anything"));
        assert!(forwards_request_field(b"x-client-cert"));
        assert!(forwards_request_field(b"x-client"));
    }

    #[test]
    fn an_http2_authority_and_host_must_agree() {
        let mut r = req("http://a.example/x", &["b.example"], Version::HTTP_2);
        assert_eq!(sanitize(&mut r), Err(ErrorKind::InvalidHost));
        let mut r = req("http://a.example/x", &["A.example"], Version::HTTP_2);
        assert_eq!(sanitize(&mut r), Ok(()));
    }

    #[test]
    fn padded_values_and_the_asterisk_are_refused() {
        let mut r = req("/", &["h"], Version::HTTP_2);
        r.headers_mut().insert("x-canary", HeaderValue::from_static("1 "));
        assert_eq!(sanitize(&mut r), Err(ErrorKind::BadRequest));
        let mut r = req("/", &["h"], Version::HTTP_2);
        r.headers_mut().insert("x-canary", HeaderValue::from_static("a b"));
        assert_eq!(sanitize(&mut r), Ok(()), "inner whitespace is fine");
        assert_eq!(sanitize(&mut req("*", &["h"], Version::HTTP_11)), Err(ErrorKind::InvalidPath));
    }

    #[test]
    fn conflicting_framing_is_refused() {
        let mut r = req("/", &["h"], Version::HTTP_11);
        r.headers_mut().insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        r.headers_mut().insert(header::CONTENT_LENGTH, HeaderValue::from_static("4"));
        assert_eq!(sanitize(&mut r), Err(ErrorKind::InvalidFraming(FramingError::LengthAndCoding)));
    }

    #[test]
    fn the_path_is_normalized_and_the_query_kept() {
        let mut r = req("/public/%2e%2e/internal?a=%2e%2e", &["h"], Version::HTTP_11);
        sanitize(&mut r).unwrap();
        assert_eq!(r.uri(), "/internal?a=%2e%2e");
        let mut r = req("/public/..;/internal", &["h"], Version::HTTP_11);
        assert_eq!(sanitize(&mut r), Err(ErrorKind::InvalidPath));
    }
}

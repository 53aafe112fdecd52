//! The wire format: one UTF-8 JSON object per UDP datagram, at most
//! [`MAX_DATAGRAM`] bytes.
//!
//! Query (proxy to distributor):
//!
//! ```json
//! {"v":1,"id":7,"policy":"least_cpu","client":"1.2.3.4:5678","method":"GET",
//!  "path":"/x?y","headers":[["host","a"],["cookie","sid=1"]]}
//! ```
//!
//! Answer (distributor to proxy), with the query's `id`:
//! `{"v":1,"id":7,"backend":"127.0.0.1:9001"}` or `{"v":1,"id":7,"error":"..."}`.
//!
//! Unknown fields are ignored on both sides. A query too large for one
//! datagram loses headers, largest first, `host` and `cookie` last.
//! `docs/distributor.md` is the full specification.

use std::borrow::Cow;
use std::cmp::Reverse;
use std::fmt;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::ops::Deref;

use serde::de::{Deserializer, Visitor};
use serde::Deserialize;

/// The protocol version carried in every message's `"v"`.
pub const VERSION: u64 = 1;

/// Largest datagram either side sends or accepts, in bytes.
pub const MAX_DATAGRAM: usize = 8192;

/// Headers that trimming drops only when dropping every other header was not
/// enough: the ones session-aware and host-based policies need.
const KEPT_HEADERS: [&str; 2] = ["host", "cookie"];

/// Errors of encoding and decoding messages.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// The query exceeds [`MAX_DATAGRAM`] bytes even with every header dropped
    /// (an enormous path or policy name).
    #[error("query does not fit in {MAX_DATAGRAM} bytes even without headers")]
    TooLarge,
    /// Not JSON, or a required field is missing or of the wrong type.
    #[error("malformed message: {0}")]
    Malformed(#[from] serde_json::Error),
    /// A well-formed envelope of a version this side does not speak.
    #[error("unsupported protocol version {version} (message id {id})")]
    Version {
        /// The message's `"v"`.
        version: u64,
        /// The message's `"id"`, so that a query can still be answered.
        id: u64,
    },
    /// An answer with neither `"backend"` nor `"error"`.
    #[error("answer has neither \"backend\" nor \"error\"")]
    NoOutcome,
}

/// One request's query, as the proxy builds it: borrowed, nothing copied
/// until it is encoded.
#[derive(Debug, Clone, Copy)]
pub struct Query<'a> {
    /// The policy the distributor should run (`ExternalSpec::policy`).
    pub policy: &'a str,
    /// The client's address and port, as the proxy's listener saw them.
    pub client: SocketAddr,
    /// The request method (`"GET"`).
    pub method: &'a str,
    /// The request path with its query string (`"/x?y"`).
    pub path: &'a str,
    /// The request's authority. Sent as a `host` header when `headers` has
    /// none (HTTP/2 carries the authority in the URI, not in a `Host` header).
    pub host: Option<&'a str>,
    /// The request headers, sent in order (a repeated header is sent as
    /// several pairs). Values that are not UTF-8 are sent with U+FFFD in place
    /// of the invalid bytes.
    pub headers: &'a dyn tidegate_balance::Headers,
}

impl Query<'_> {
    /// The header pairs to send: the implicit `host` (if any), then `headers`.
    fn pairs(&self, f: &mut dyn FnMut(&str, &[u8])) {
        match self.host {
            Some(h) if self.headers.first("host").is_none() => f("host", h.as_bytes()),
            _ => {}
        }
        self.headers.each(f);
    }
}

/// Encodes `q` with `id` into `out` (cleared first), trimming headers to fit
/// [`MAX_DATAGRAM`]: headers other than `host` and `cookie` go first, largest
/// first; then `host` and `cookie`, largest first; then dropped headers that
/// fit again are put back (`host` and `cookie` first, then smallest first).
/// Fails with [`ProtocolError::TooLarge`] when even no headers do not fit.
pub fn encode_query(id: u64, q: &Query<'_>, out: &mut Vec<u8>) -> Result<(), ProtocolError> {
    out.clear();
    write_query_head(id, q, out);
    let mut first = true;
    q.pairs(&mut |name, value| {
        if !first {
            out.push(b',');
        }
        first = false;
        write_pair(out, name, value);
    });
    out.extend_from_slice(b"]}");
    if out.len() <= MAX_DATAGRAM {
        return Ok(());
    }
    encode_trimmed(id, q, out)
}

/// One encoded header pair inside the trimming scratch buffer.
struct Encoded {
    start: usize,
    end: usize,
    kept: bool,
    dropped: bool,
}

impl Encoded {
    fn len(&self) -> usize {
        self.end - self.start
    }
}

/// The slow path of [`encode_query`]: encode every pair on its own, choose
/// which to drop, then assemble what is left in the original order.
fn encode_trimmed(id: u64, q: &Query<'_>, out: &mut Vec<u8>) -> Result<(), ProtocolError> {
    let mut scratch = Vec::with_capacity(out.len());
    let mut pairs = Vec::new();
    q.pairs(&mut |name, value| {
        let start = scratch.len();
        write_pair(&mut scratch, name, value);
        let kept = KEPT_HEADERS.iter().any(|k| k.eq_ignore_ascii_case(name));
        pairs.push(Encoded { start, end: scratch.len(), kept, dropped: false });
    });
    out.clear();
    write_query_head(id, q, out);
    let fixed = out.len() + 2;
    let mut sum: usize = pairs.iter().map(Encoded::len).sum();
    let mut count = pairs.len();
    let size = |sum: usize, count: usize| fixed + sum + count.saturating_sub(1);
    let mut order: Vec<usize> = (0..pairs.len()).collect();
    order.sort_by_key(|&i| (pairs[i].kept, Reverse(pairs[i].len())));
    for i in order {
        if size(sum, count) <= MAX_DATAGRAM {
            break;
        }
        pairs[i].dropped = true;
        sum -= pairs[i].len();
        count -= 1;
    }
    if size(sum, count) > MAX_DATAGRAM {
        out.clear();
        return Err(ProtocolError::TooLarge);
    }
    // Dropping a large header may have made room for smaller ones dropped
    // before it (a small header goes before a large cookie): put back what
    // fits, host and cookie first, then smallest first.
    let mut dropped: Vec<usize> = (0..pairs.len()).filter(|&i| pairs[i].dropped).collect();
    dropped.sort_by_key(|&i| (!pairs[i].kept, pairs[i].len()));
    for i in dropped {
        if size(sum + pairs[i].len(), count + 1) <= MAX_DATAGRAM {
            pairs[i].dropped = false;
            sum += pairs[i].len();
            count += 1;
        }
    }
    for (n, p) in pairs.iter().filter(|p| !p.dropped).enumerate() {
        if n > 0 {
            out.push(b',');
        }
        out.extend_from_slice(&scratch[p.start..p.end]);
    }
    out.extend_from_slice(b"]}");
    Ok(())
}

/// Everything up to and including `"headers":[`.
fn write_query_head(id: u64, q: &Query<'_>, out: &mut Vec<u8>) {
    out.extend_from_slice(b"{\"v\":");
    write_u64(out, VERSION);
    out.extend_from_slice(b",\"id\":");
    write_u64(out, id);
    out.extend_from_slice(b",\"policy\":");
    write_str(out, q.policy);
    out.extend_from_slice(b",\"client\":");
    write_display(out, &q.client);
    out.extend_from_slice(b",\"method\":");
    write_str(out, q.method);
    out.extend_from_slice(b",\"path\":");
    write_str(out, q.path);
    out.extend_from_slice(b",\"headers\":[");
}

/// `["name","value"]`.
fn write_pair(out: &mut Vec<u8>, name: &str, value: &[u8]) {
    out.push(b'[');
    write_str(out, name);
    out.push(b',');
    write_str(out, &String::from_utf8_lossy(value));
    out.push(b']');
}

/// Encodes an answer to query `id` into `out` (cleared first): the chosen
/// backend, or an error message.
pub fn encode_answer(id: u64, result: Result<SocketAddr, &str>, out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(b"{\"v\":");
    write_u64(out, VERSION);
    out.extend_from_slice(b",\"id\":");
    write_u64(out, id);
    match result {
        Ok(backend) => {
            out.extend_from_slice(b",\"backend\":");
            write_display(out, &backend);
        }
        Err(message) => {
            // An error message is informational: cut it so the answer fits.
            let mut end = message.len().min(MAX_DATAGRAM / 8);
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            out.extend_from_slice(b",\"error\":");
            write_str(out, &message[..end]);
        }
    }
    out.push(b'}');
}

fn write_u64(out: &mut Vec<u8>, n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut n = n;
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

/// A quoted value whose `Display` needs no escaping (socket addresses).
fn write_display(out: &mut Vec<u8>, v: &dyn fmt::Display) {
    use std::io::Write;
    out.push(b'"');
    // Writing into a Vec cannot fail.
    let _ = write!(out, "{v}");
    out.push(b'"');
}

/// A JSON string literal: `"` and `\` escaped, control characters as `\uXXXX`
/// (or their short forms); everything else, non-ASCII included, as is.
fn write_str(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut plain = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[plain..i]);
        if escape.is_empty() {
            out.extend_from_slice(&[b'\\', b'u', b'0', b'0', HEX[usize::from(b >> 4)], HEX[usize::from(b & 0xf)]]);
        } else {
            out.extend_from_slice(escape);
        }
        plain = i + 1;
    }
    out.extend_from_slice(&bytes[plain..]);
    out.push(b'"');
}

/// A string borrowed from the datagram when it has no escapes, owned otherwise.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Text<'a>(pub Cow<'a, str>);

impl Text<'_> {
    /// The string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Deref for Text<'_> {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Text<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct TextVisitor<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for TextVisitor<'a> {
            type Value = Text<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Text<'a>, E> {
                Ok(Text(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Text<'a>, E> {
                Ok(Text(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E>(self, v: String) -> Result<Text<'a>, E> {
                Ok(Text(Cow::Owned(v)))
            }
        }
        d.deserialize_str(TextVisitor(PhantomData))
    }
}

/// A decoded query, borrowing from the datagram where it can.
#[derive(Debug, Deserialize)]
pub struct WireQuery<'a> {
    /// Protocol version; [`decode_query`] accepts only [`VERSION`].
    pub v: u64,
    /// Query id, echoed in the answer.
    pub id: u64,
    /// Policy name.
    #[serde(borrow)]
    pub policy: Text<'a>,
    /// The client's address and port.
    pub client: SocketAddr,
    /// Request method.
    #[serde(borrow)]
    pub method: Text<'a>,
    /// Request path and query string.
    #[serde(borrow)]
    pub path: Text<'a>,
    /// Header pairs, names in lower case, in request order (may be absent).
    #[serde(borrow, default)]
    pub headers: Vec<(Text<'a>, Text<'a>)>,
}

impl WireQuery<'_> {
    /// Values of every header named `name` (lower case), in order.
    pub fn header_values<'s>(&'s self, name: &'s str) -> impl Iterator<Item = &'s str> + 's {
        self.headers.iter().filter(move |(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

/// The fields every version shares.
#[derive(Deserialize)]
struct Envelope {
    v: u64,
    id: u64,
}

/// Decodes a query. A message of another version whose `v` and `id` can be
/// read yields [`ProtocolError::Version`], so that it can be answered.
pub fn decode_query(datagram: &[u8]) -> Result<WireQuery<'_>, ProtocolError> {
    match serde_json::from_slice::<WireQuery<'_>>(datagram) {
        Ok(q) if q.v == VERSION => Ok(q),
        Ok(q) => Err(ProtocolError::Version { version: q.v, id: q.id }),
        Err(e) => match serde_json::from_slice::<Envelope>(datagram) {
            Ok(env) if env.v != VERSION => Err(ProtocolError::Version { version: env.v, id: env.id }),
            _ => Err(ProtocolError::Malformed(e)),
        },
    }
}

/// A decoded answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer<'a> {
    /// The id of the query answered.
    pub id: u64,
    /// The chosen backend, or the distributor's error message (also when the
    /// `"backend"` given is not an `IP:port` address).
    pub result: Result<SocketAddr, Text<'a>>,
}

#[derive(Deserialize)]
struct WireAnswer<'a> {
    v: u64,
    id: u64,
    #[serde(borrow, default)]
    backend: Option<Text<'a>>,
    #[serde(borrow, default)]
    error: Option<Text<'a>>,
}

/// Decodes an answer. `"error"` wins over `"backend"` if both are present.
pub fn decode_answer(datagram: &[u8]) -> Result<Answer<'_>, ProtocolError> {
    let a: WireAnswer<'_> = serde_json::from_slice(datagram)?;
    if a.v != VERSION {
        return Err(ProtocolError::Version { version: a.v, id: a.id });
    }
    let result = match (a.error, a.backend) {
        (Some(e), _) => Err(e),
        (None, Some(b)) => b
            .parse::<SocketAddr>()
            .map_err(|_| Text(Cow::Owned(format!("backend {:?} is not an IP:port address", b.0)))),
        (None, None) => return Err(ProtocolError::NoOutcome),
    };
    Ok(Answer { id: a.id, result })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderMap, HeaderName, HeaderValue};

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(HeaderName::from_bytes(n.as_bytes()).expect("name"), HeaderValue::from_str(v).expect("value"));
        }
        h
    }

    fn query<'a>(h: &'a HeaderMap, path: &'a str) -> Query<'a> {
        Query {
            policy: "least_cpu",
            client: "1.2.3.4:5678".parse().expect("addr"),
            method: "GET",
            path,
            host: None,
            headers: h,
        }
    }

    #[test]
    fn query_round_trip_matches_the_documented_example() {
        let h = headers(&[("host", "a"), ("cookie", "sid=1")]);
        let mut out = Vec::new();
        encode_query(7, &query(&h, "/x?y"), &mut out).expect("encode");
        assert_eq!(
            std::str::from_utf8(&out).expect("utf8"),
            r#"{"v":1,"id":7,"policy":"least_cpu","client":"1.2.3.4:5678","method":"GET","path":"/x?y","headers":[["host","a"],["cookie","sid=1"]]}"#
        );
        let q = decode_query(&out).expect("decode");
        assert_eq!(
            (q.v, q.id, q.policy.as_str(), q.method.as_str(), q.path.as_str()),
            (1, 7, "least_cpu", "GET", "/x?y")
        );
        assert_eq!(q.client, "1.2.3.4:5678".parse::<SocketAddr>().expect("addr"));
        assert_eq!(q.header_values("cookie").collect::<Vec<_>>(), ["sid=1"]);
        assert!(matches!(q.policy.0, Cow::Borrowed(_)), "no escapes: borrowed");
    }

    #[test]
    fn escapes_survive_the_round_trip() {
        let h = headers(&[("x-quote", "a\"b\\c\td"), ("x-utf8", "caf\u{e9}")]);
        let mut out = Vec::new();
        let path = "/p\u{1}\"\\";
        let mut q = query(&h, path);
        q.client = "[::1]:80".parse().expect("v6");
        q.host = Some("h.example");
        encode_query(u64::MAX, &q, &mut out).expect("encode");
        let d = decode_query(&out).expect("decode");
        assert_eq!(d.id, u64::MAX);
        assert_eq!(d.path.as_str(), path);
        assert_eq!(d.client, q.client);
        let pairs: Vec<_> = d.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        assert_eq!(pairs, [("host", "h.example"), ("x-quote", "a\"b\\c\td"), ("x-utf8", "caf\u{e9}")]);
        // serde_json agrees with the hand-written encoder.
        let v: serde_json::Value = serde_json::from_slice(&out).expect("json");
        assert_eq!(v["path"], path);
    }

    #[test]
    fn non_utf8_header_values_are_replaced_not_dropped() {
        let mut h = HeaderMap::new();
        h.insert("x-bin", HeaderValue::from_bytes(b"a\xffb").expect("obs-text"));
        let mut out = Vec::new();
        encode_query(1, &query(&h, "/"), &mut out).expect("encode");
        let d = decode_query(&out).expect("decode");
        assert_eq!(d.header_values("x-bin").collect::<Vec<_>>(), ["a\u{fffd}b"]);
    }

    #[test]
    fn explicit_host_header_wins_over_the_authority() {
        let h = headers(&[("host", "from-header")]);
        let mut q = query(&h, "/");
        q.host = Some("from-uri");
        let mut out = Vec::new();
        encode_query(1, &q, &mut out).expect("encode");
        let d = decode_query(&out).expect("decode");
        assert_eq!(d.header_values("host").collect::<Vec<_>>(), ["from-header"]);
    }

    #[test]
    fn oversized_queries_drop_the_largest_headers_but_keep_host_and_cookie() {
        let big = "b".repeat(5000);
        let mid = "m".repeat(4500);
        let small = "s".repeat(100);
        let cookie = "sid=".to_owned() + &"c".repeat(4000);
        let h = headers(&[("host", "a"), ("x-big", &big), ("cookie", &cookie), ("x-small", &small), ("x-mid", &mid)]);
        let mut out = Vec::new();
        encode_query(9, &query(&h, "/x"), &mut out).expect("encode");
        assert!(out.len() <= MAX_DATAGRAM, "{}", out.len());
        let d = decode_query(&out).expect("decode");
        let names: Vec<_> = d.headers.iter().map(|(n, _)| n.as_str()).collect();
        // x-big went first; x-mid then still did not fit beside the cookie.
        // The order of the rest is preserved.
        assert_eq!(names, ["host", "cookie", "x-small"]);
        assert_eq!(d.header_values("cookie").collect::<Vec<_>>(), [cookie.as_str()]);
    }

    #[test]
    fn trimming_stops_as_soon_as_the_query_fits() {
        let h = headers(&[("x-a", &"a".repeat(4000)), ("x-b", &"b".repeat(4100)), ("x-c", &"c".repeat(10))]);
        let mut out = Vec::new();
        encode_query(1, &query(&h, "/"), &mut out).expect("encode");
        let d = decode_query(&out).expect("decode");
        let names: Vec<_> = d.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["x-a", "x-c"]);
    }

    #[test]
    fn kept_headers_go_last_and_a_huge_path_is_an_error() {
        let h = headers(&[("cookie", &"c".repeat(9000)), ("x-a", "1")]);
        let mut out = Vec::new();
        encode_query(1, &query(&h, "/"), &mut out).expect("encode");
        let d = decode_query(&out).expect("decode");
        let names: Vec<_> = d.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["x-a"]);

        let path = "/".repeat(MAX_DATAGRAM);
        assert!(matches!(encode_query(1, &query(&h, &path), &mut out), Err(ProtocolError::TooLarge)));
    }

    #[test]
    fn exactly_max_datagram_is_accepted() {
        // Find a value length that lands on exactly MAX_DATAGRAM bytes.
        let base = {
            let h = headers(&[("x-a", "")]);
            let mut out = Vec::new();
            encode_query(1, &query(&h, "/"), &mut out).expect("encode");
            out.len()
        };
        let h = headers(&[("x-a", &"a".repeat(MAX_DATAGRAM - base))]);
        let mut out = Vec::new();
        encode_query(1, &query(&h, "/"), &mut out).expect("encode");
        assert_eq!(out.len(), MAX_DATAGRAM);
        assert_eq!(decode_query(&out).expect("decode").headers.len(), 1);
    }

    #[test]
    fn unknown_fields_are_ignored_and_headers_may_be_absent() {
        let q = decode_query(
            br#"{"future":{"x":[1,2]},"v":1,"id":3,"policy":"round_robin","client":"10.0.0.1:1","method":"POST","path":"/","extra":true}"#,
        )
        .expect("decode");
        assert_eq!((q.id, q.headers.len()), (3, 0));
        let a = decode_answer(br#"{"v":1,"id":3,"backend":"127.0.0.1:9001","load":0.5}"#).expect("answer");
        assert_eq!(a, Answer { id: 3, result: Ok("127.0.0.1:9001".parse().expect("addr")) });
    }

    #[test]
    fn malformed_and_foreign_versions_are_told_apart() {
        for bad in [&b""[..], b"{", b"[]", b"null", b"{\"v\":1}", b"{\"v\":1,\"id\":-1,\"policy\":\"x\"}", b"\xff\xfe"]
        {
            assert!(matches!(decode_query(bad), Err(ProtocolError::Malformed(_))), "{bad:?}");
        }
        let missing_client = br#"{"v":1,"id":4,"policy":"round_robin","method":"GET","path":"/"}"#;
        assert!(matches!(decode_query(missing_client), Err(ProtocolError::Malformed(_))));
        let v2 = br#"{"v":2,"id":5,"something":"else"}"#;
        assert!(matches!(decode_query(v2), Err(ProtocolError::Version { version: 2, id: 5 })));
    }

    #[test]
    fn answers_round_trip() {
        let mut out = Vec::new();
        let b: SocketAddr = "[2001:db8::1]:443".parse().expect("v6");
        encode_answer(42, Ok(b), &mut out);
        assert_eq!(out, br#"{"v":1,"id":42,"backend":"[2001:db8::1]:443"}"#);
        assert_eq!(decode_answer(&out).expect("decode").result, Ok(b));

        encode_answer(43, Err("unknown policy \"x\""), &mut out);
        assert_eq!(out, br#"{"v":1,"id":43,"error":"unknown policy \"x\""}"#);
        let a = decode_answer(&out).expect("decode");
        assert_eq!((a.id, a.result.map_err(|e| e.0.into_owned())), (43, Err("unknown policy \"x\"".to_owned())));

        let a = decode_answer(br#"{"v":1,"id":1,"backend":"backend-1:80"}"#).expect("decode");
        assert!(a.result.is_err(), "host names are not addresses");
        assert!(matches!(decode_answer(br#"{"v":1,"id":1}"#), Err(ProtocolError::NoOutcome)));
        assert!(matches!(
            decode_answer(br#"{"v":9,"id":1,"backend":"1.1.1.1:1"}"#),
            Err(ProtocolError::Version { .. })
        ));
    }

    #[test]
    fn long_error_messages_are_cut_on_a_char_boundary() {
        let mut out = Vec::new();
        encode_answer(1, Err(&"\u{e9}".repeat(MAX_DATAGRAM)), &mut out);
        assert!(out.len() < MAX_DATAGRAM);
        assert!(decode_answer(&out).expect("decode").result.is_err());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1000))]

        /// Any datagram: decoded or refused with an error, never a panic.
        #[test]
        fn any_datagram_decodes_or_is_refused(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..1500)) {
            let _ = decode_query(&bytes);
            let _ = decode_answer(&bytes);
        }
    }
}

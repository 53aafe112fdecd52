//! The response phase: header edits, CORS and the compression choice.

use std::sync::Arc;

use http::{HeaderName, HeaderValue};
use tidegate_model::rules::{Algorithm, Compress, Cors};

/// One header edit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderEdit {
    /// Replace every value of the field with this one.
    Set(HeaderName, HeaderValue),
    /// Set it only if the message has no such field.
    SetIfAbsent(HeaderName, HeaderValue),
    /// Add a value, keeping those there.
    Add(HeaderName, HeaderValue),
    /// Remove the field.
    Remove(HeaderName),
}

impl HeaderEdit {
    /// Applies the edit to `headers`.
    pub fn apply(&self, headers: &mut http::HeaderMap) {
        match self {
            HeaderEdit::Set(n, v) => {
                headers.insert(n.clone(), v.clone());
            }
            HeaderEdit::SetIfAbsent(n, v) => {
                if !headers.contains_key(n) {
                    headers.insert(n.clone(), v.clone());
                }
            }
            HeaderEdit::Add(n, v) => {
                headers.append(n.clone(), v.clone());
            }
            HeaderEdit::Remove(n) => {
                headers.remove(n);
            }
        }
    }
}

/// How to compress the response of a request let through (its header
/// edits are [`Forward::response_edits`](crate::Forward::response_edits)).
#[derive(Debug, Clone, Default)]
pub struct ResponsePlan {
    /// How to compress, if a `compress` step ran.
    pub compress: Option<Arc<Compress>>,
}

impl ResponsePlan {
    /// The coding to compress this response with, if any: the request's
    /// `accept_encoding`; the response's `status`, `content_type`,
    /// `content_length` (`None`: unknown, streamed), whether it is already
    /// encoded (`Content-Encoding`) or a range (206 / `Content-Range`).
    /// The proxy then edits the head with [`compression_head`] and
    /// encodes the body with a [`Compressor`](crate::Compressor).
    pub fn compression(
        &self,
        accept_encoding: Option<&[u8]>,
        status: u16,
        content_type: Option<&[u8]>,
        content_length: Option<u64>,
        encoded_or_ranged: bool,
    ) -> Option<Algorithm> {
        let c = self.compressible_by(status, content_type, content_length, encoded_or_ranged)?;
        negotiate(&c.algorithms, accept_encoding?)
    }

    /// Whether the response would be compressed for a client that accepts
    /// a configured coding (the same facts as [`ResponsePlan::compression`]
    /// but the request's): such a response varies by `Accept-Encoding`,
    /// compressed or not, and [`compression_head`] says so.
    pub fn compressible(
        &self,
        status: u16,
        content_type: Option<&[u8]>,
        content_length: Option<u64>,
        encoded_or_ranged: bool,
    ) -> bool {
        self.compressible_by(status, content_type, content_length, encoded_or_ranged).is_some()
    }

    fn compressible_by(
        &self,
        status: u16,
        content_type: Option<&[u8]>,
        content_length: Option<u64>,
        encoded_or_ranged: bool,
    ) -> Option<&Compress> {
        let c = self.compress.as_deref()?;
        if encoded_or_ranged || status == 206 || status == 204 || status == 304 || status < 200 {
            return None;
        }
        if content_length.is_some_and(|n| n < u64::from(c.min_bytes.get())) {
            return None;
        }
        let ct = content_type?;
        c.types.iter().any(|t| t.matches(ct)).then_some(c)
    }
}

/// Edits the head of a [compressible](ResponsePlan::compressible)
/// response: `Vary` gains `Accept-Encoding` (merged into one field with
/// the values there, unless it lists it or `*`) whether it is compressed
/// or not; compressed with `coding`, it also gets `Content-Encoding`,
/// loses `Content-Length` (the body streams) and `Accept-Ranges` (ranges
/// of the compressed body are not served), and a strong `ETag` becomes
/// weak (the bytes differ from the backend's; as nginx does).
pub fn compression_head(headers: &mut http::HeaderMap, coding: Option<Algorithm>) {
    use http::header;
    let listed = headers
        .get_all(header::VARY)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(|t| t.trim_ascii())
        .any(|t| t == b"*" || t.eq_ignore_ascii_case(b"accept-encoding"));
    if !listed {
        let mut merged = Vec::new();
        for v in headers.get_all(header::VARY) {
            let v = v.as_bytes().trim_ascii();
            if !v.is_empty() {
                merged.extend_from_slice(v);
                merged.extend_from_slice(b", ");
            }
        }
        merged.extend_from_slice(b"Accept-Encoding");
        // The values came from a HeaderValue, and a comma and a token are
        // added: always valid.
        if let Ok(v) = HeaderValue::from_bytes(&merged) {
            headers.insert(header::VARY, v);
        }
    }
    let Some(coding) = coding else { return };
    headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static(coding.token()));
    headers.remove(header::CONTENT_LENGTH);
    headers.remove(header::ACCEPT_RANGES);
    if let Some(etag) = headers.get(header::ETAG) {
        if etag.as_bytes().starts_with(b"\"") {
            let mut weak = b"W/".to_vec();
            weak.extend_from_slice(etag.as_bytes());
            if let Ok(v) = HeaderValue::from_bytes(&weak) {
                headers.insert(header::ETAG, v);
            }
        }
    }
}

/// The configured algorithm the client prefers (highest `q`, then the
/// configured order); `q=0` refuses one, `*` stands for the unnamed.
pub fn negotiate(offered: &[Algorithm], accept: &[u8]) -> Option<Algorithm> {
    let text = std::str::from_utf8(accept).ok()?;
    let mut weights: Vec<(String, u32)> = Vec::new();
    for item in text.split(',') {
        let mut parts = item.split(';');
        let coding = parts.next().unwrap_or("").trim().to_ascii_lowercase();
        if coding.is_empty() {
            continue;
        }
        let mut q = 1000;
        for p in parts {
            if let Some(v) = p.trim().strip_prefix("q=").or_else(|| p.trim().strip_prefix("Q=")) {
                q = parse_q(v.trim()).unwrap_or(0);
            }
        }
        weights.push((coding, q));
    }
    let weight = |a: Algorithm| {
        weights
            .iter()
            .find(|(c, _)| c == a.token() || (a == Algorithm::Gzip && c == "x-gzip"))
            .or_else(|| weights.iter().find(|(c, _)| c == "*"))
            .map_or(0, |(_, q)| *q)
    };
    let mut best: Option<(Algorithm, u32)> = None;
    for a in offered {
        let q = weight(*a);
        if q > 0 && best.is_none_or(|(_, b)| q > b) {
            best = Some((*a, q));
        }
    }
    best.map(|(a, _)| a)
}

fn parse_q(v: &str) -> Option<u32> {
    let (int, frac) = v.split_once('.').unwrap_or((v, ""));
    if frac.len() > 3 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let int: u32 = int.parse().ok()?;
    let frac_val: u32 = if frac.is_empty() { 0 } else { format!("{frac:0<3}").parse().ok()? };
    let q = int * 1000 + frac_val;
    (q <= 1000).then_some(q)
}

/// A request's standing under a `cors` step.
pub(crate) enum CorsVerdict {
    /// No `Origin`, or one not allowed: nothing added.
    None,
    /// A preflight of an allowed origin: answer it with these headers.
    Preflight(Vec<(HeaderName, HeaderValue)>),
    /// An allowed origin's request: add these to the response.
    Simple(Vec<HeaderEdit>),
}

fn join<T: AsRef<str>>(items: &[T]) -> Option<HeaderValue> {
    let s = items.iter().map(|i| i.as_ref()).collect::<Vec<_>>().join(", ");
    HeaderValue::from_str(&s).ok()
}

pub(crate) fn cors(step: &Cors, method: &http::Method, origin: Option<&[u8]>, preflight: bool) -> CorsVerdict {
    use http::header;
    let Some(origin) = origin else { return CorsVerdict::None };
    let any = step.allow_origins.iter().any(|o| o.is_any());
    let listed = step.allow_origins.iter().any(|o| o.as_str().as_bytes().eq_ignore_ascii_case(origin));
    if !any && !listed {
        return CorsVerdict::None;
    }
    let Ok(origin_value) = HeaderValue::from_bytes(origin) else { return CorsVerdict::None };
    let allow = if any && !step.allow_credentials { HeaderValue::from_static("*") } else { origin_value };
    let mut common = vec![(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow)];
    if step.allow_credentials {
        common.push((header::ACCESS_CONTROL_ALLOW_CREDENTIALS, HeaderValue::from_static("true")));
    }
    if preflight && method == http::Method::OPTIONS {
        let mut h = common;
        let methods: Vec<String> = step.allow_methods.iter().map(|m| m.0.to_string()).collect();
        if let Some(v) = join(&methods) {
            h.push((header::ACCESS_CONTROL_ALLOW_METHODS, v));
        }
        let headers: Vec<&str> = step.allow_headers.iter().map(|n| n.0.as_str()).collect();
        if let Some(v) = join(&headers).filter(|_| !headers.is_empty()) {
            h.push((header::ACCESS_CONTROL_ALLOW_HEADERS, v));
        }
        h.push((header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from(step.max_age_s.get())));
        h.push((header::VARY, HeaderValue::from_static("Origin")));
        return CorsVerdict::Preflight(h);
    }
    let mut edits: Vec<HeaderEdit> = common.into_iter().map(|(n, v)| HeaderEdit::Set(n, v)).collect();
    let expose: Vec<&str> = step.expose_headers.iter().map(|n| n.0.as_str()).collect();
    if let Some(v) = join(&expose).filter(|_| !expose.is_empty()) {
        edits.push(HeaderEdit::Set(header::ACCESS_CONTROL_EXPOSE_HEADERS, v));
    }
    edits.push(HeaderEdit::Add(header::VARY, HeaderValue::from_static("Origin")));
    CorsVerdict::Simple(edits)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Algorithm; 3] = [Algorithm::Zstd, Algorithm::Br, Algorithm::Gzip];

    #[test]
    fn the_client_picks_by_q_then_the_configured_order() {
        assert_eq!(negotiate(&ALL, b"gzip, deflate, br"), Some(Algorithm::Br));
        assert_eq!(negotiate(&ALL, b"gzip;q=1.0, br;q=0.5"), Some(Algorithm::Gzip));
        assert_eq!(negotiate(&ALL, b"zstd;q=0, br;q=0, gzip;q=0"), None);
        assert_eq!(negotiate(&ALL, b"*"), Some(Algorithm::Zstd));
        assert_eq!(negotiate(&ALL, b"identity"), None);
        assert_eq!(negotiate(&[Algorithm::Gzip], b"x-gzip"), Some(Algorithm::Gzip));
        assert_eq!(negotiate(&ALL, b"br;q=2"), None, "a q above 1 is no q");
    }

    #[test]
    fn only_compressible_unencoded_responses_above_the_minimum() {
        let c: Compress = serde_json::from_value(serde_json::json!({"min_bytes": 100})).unwrap();
        let plan = ResponsePlan { compress: Some(Arc::new(c)) };
        let json = Some(&b"application/json; charset=utf-8"[..]);
        assert_eq!(plan.compression(Some(b"gzip"), 200, json, Some(1000), false), Some(Algorithm::Gzip));
        assert_eq!(plan.compression(Some(b"gzip"), 200, json, None, false), Some(Algorithm::Gzip));
        assert_eq!(plan.compression(Some(b"gzip"), 200, json, Some(10), false), None);
        assert_eq!(plan.compression(Some(b"gzip"), 200, json, Some(1000), true), None);
        assert_eq!(plan.compression(Some(b"gzip"), 206, json, Some(1000), false), None);
        assert_eq!(plan.compression(Some(b"gzip"), 200, Some(b"image/png"), Some(1000), false), None);
        assert_eq!(plan.compression(None, 200, json, Some(1000), false), None);
        assert_eq!(plan.compression(Some(b"gzip"), 200, Some(b"text/html"), Some(1000), false), Some(Algorithm::Gzip));
        assert!(plan.compressible(200, json, Some(1000), false), "whatever the client accepts");
        assert!(!plan.compressible(200, json, Some(10), false));
        assert!(!plan.compressible(304, json, None, false));
        assert!(!ResponsePlan::default().compressible(200, json, Some(1000), false), "no compress step");
    }

    fn head(fields: &[(&'static str, &'static str)]) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        for (n, v) in fields {
            h.append(*n, HeaderValue::from_static(v));
        }
        h
    }

    fn all(h: &http::HeaderMap, name: &str) -> Vec<String> {
        h.get_all(name).iter().map(|v| v.to_str().unwrap().to_string()).collect()
    }

    #[test]
    fn a_compressed_head_is_marked_and_loses_its_length() {
        let mut h = head(&[
            ("content-length", "5000"),
            ("content-type", "application/json"),
            ("etag", "\"v1\""),
            ("accept-ranges", "bytes"),
            ("vary", "Origin"),
            ("vary", "Cookie, X-A"),
        ]);
        compression_head(&mut h, Some(Algorithm::Br));
        assert_eq!(all(&h, "content-encoding"), ["br"]);
        assert!(h.get("content-length").is_none() && h.get("accept-ranges").is_none());
        assert_eq!(all(&h, "etag"), ["W/\"v1\""]);
        assert_eq!(all(&h, "vary"), ["Origin, Cookie, X-A, Accept-Encoding"]);
        assert_eq!(all(&h, "content-type"), ["application/json"]);

        let mut h = head(&[("etag", "W/\"v1\""), ("vary", "accept-encoding")]);
        compression_head(&mut h, Some(Algorithm::Gzip));
        assert_eq!(all(&h, "etag"), ["W/\"v1\""], "a weak ETag stays");
        assert_eq!(all(&h, "vary"), ["accept-encoding"], "listed already");
        let mut h = head(&[("vary", "*")]);
        compression_head(&mut h, Some(Algorithm::Zstd));
        assert_eq!(all(&h, "vary"), ["*"]);
        assert_eq!(all(&h, "content-encoding"), ["zstd"]);
    }

    #[test]
    fn an_uncompressed_compressible_head_only_varies() {
        let mut h = head(&[("content-length", "5000"), ("etag", "\"v1\""), ("accept-ranges", "bytes")]);
        compression_head(&mut h, None);
        assert_eq!(all(&h, "vary"), ["Accept-Encoding"]);
        assert_eq!(all(&h, "content-length"), ["5000"]);
        assert_eq!(all(&h, "etag"), ["\"v1\""]);
        assert!(h.get("content-encoding").is_none() && h.get("accept-ranges").is_some());
    }
}

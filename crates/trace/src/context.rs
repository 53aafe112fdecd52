//! W3C Trace Context (<https://www.w3.org/TR/trace-context/>): the
//! `traceparent` a request arrives with, the decision to record it, and the
//! `traceparent` its backend gets. Pure: bytes in, values out.

/// A trace's id: 16 bytes, never all zero.
pub type TraceId = [u8; 16];
/// A span's id: 8 bytes, never all zero.
pub type SpanId = [u8; 8];

/// The `sampled` bit of `trace-flags`.
const SAMPLED: u8 = 0x01;
/// A `traceparent` of version `00`: `00-` 32 hex `-` 16 hex `-` 2 hex.
pub const TRACEPARENT_LEN: usize = 55;

/// A valid `traceparent` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    /// The trace the request belongs to.
    pub trace_id: TraceId,
    /// The caller's span (the parent of the proxy's).
    pub parent_id: SpanId,
    /// The caller recorded its part of the trace.
    pub sampled: bool,
}

impl TraceParent {
    /// Parses one `traceparent` value; `None` when it is not valid (the
    /// request is then treated as starting a trace, and its `tracestate`
    /// is not passed on). Versions after `00` are read as `00` where they
    /// agree (the spec's rule for future versions); `ff` is refused.
    pub fn parse(value: &[u8]) -> Option<TraceParent> {
        let value = trim(value);
        if value.len() < TRACEPARENT_LEN {
            return None;
        }
        let version = hex_byte(&value[0..2])?;
        if version == 0xff || (version == 0 && value.len() != TRACEPARENT_LEN) {
            return None;
        }
        if value.len() > TRACEPARENT_LEN && value[TRACEPARENT_LEN] != b'-' {
            return None;
        }
        if value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
            return None;
        }
        let mut trace_id = [0u8; 16];
        hex_into(&value[3..35], &mut trace_id)?;
        let mut parent_id = [0u8; 8];
        hex_into(&value[36..52], &mut parent_id)?;
        let flags = hex_byte(&value[53..55])?;
        if trace_id == [0; 16] || parent_id == [0; 8] {
            return None;
        }
        Some(TraceParent { trace_id, parent_id, sampled: flags & SAMPLED != 0 })
    }

    /// The field's value for a request sent on with `span` as its parent.
    pub fn format(trace_id: &TraceId, span: &SpanId, sampled: bool) -> [u8; TRACEPARENT_LEN] {
        let mut out = [0u8; TRACEPARENT_LEN];
        out[0..3].copy_from_slice(b"00-");
        hex_out(trace_id, &mut out[3..35]);
        out[35] = b'-';
        hex_out(span, &mut out[36..52]);
        out[52] = b'-';
        out[53..55].copy_from_slice(if sampled { b"01" } else { b"00" });
        out
    }
}

/// Which requests are recorded: those whose caller recorded its part (a
/// valid `traceparent` with the sampled flag), and of the traces the proxy
/// starts, the given fraction (decided on the trace id, as OpenTelemetry's
/// `ParentBased(TraceIdRatioBased)` sampler does, so any two parties that
/// use the same ratio agree).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampler {
    /// Trace ids whose first 8 bytes (big-endian) are below this start a
    /// recorded trace.
    bound: u64,
}

impl Sampler {
    /// A sampler recording `ratio` (clamped to 0..=1) of new traces.
    pub fn ratio(ratio: f64) -> Sampler {
        let r = if ratio.is_nan() { 0.0 } else { ratio.clamp(0.0, 1.0) };
        // 2^64 * r, saturating: 1.0 records every trace.
        let bound = if r >= 1.0 { u64::MAX } else { (r * 18_446_744_073_709_551_616.0) as u64 };
        Sampler { bound }
    }

    /// Whether a new trace with this id is recorded.
    fn samples(&self, trace_id: &TraceId) -> bool {
        if self.bound == u64::MAX {
            return true;
        }
        let mut head = [0u8; 8];
        head.copy_from_slice(&trace_id[..8]);
        u64::from_be_bytes(head) < self.bound
    }

    /// The context of a request that arrived with `incoming` (its
    /// `traceparent` values; more than one is as none). `ids` gives new
    /// random ids.
    pub fn decide<'a>(&self, mut incoming: impl Iterator<Item = &'a [u8]>, ids: &mut impl Ids) -> Context {
        let parent = incoming.next().and_then(TraceParent::parse).filter(|_| incoming.next().is_none());
        let span_id = ids.span_id();
        match parent {
            Some(p) => Context { trace_id: p.trace_id, parent_id: Some(p.parent_id), span_id, sampled: p.sampled },
            None => {
                let trace_id = ids.trace_id();
                Context { trace_id, parent_id: None, span_id, sampled: self.samples(&trace_id) }
            }
        }
    }
}

/// Where new ids come from.
pub trait Ids {
    /// A new random trace id (never all zero).
    fn trace_id(&mut self) -> TraceId;
    /// A new random span id (never all zero).
    fn span_id(&mut self) -> SpanId;
}

/// Ids from a fast, non-cryptographic generator (fastrand, per thread):
/// ids must be unique, not secret.
#[derive(Debug, Default, Clone, Copy)]
pub struct RandomIds;

impl Ids for RandomIds {
    fn trace_id(&mut self) -> TraceId {
        fastrand::u128(1..).to_be_bytes()
    }
    fn span_id(&mut self) -> SpanId {
        fastrand::u64(1..).to_be_bytes()
    }
}

/// The trace context of one request as the proxy serves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Context {
    /// The trace (the caller's, or a new one).
    pub trace_id: TraceId,
    /// The caller's span, when the request came with a valid `traceparent`.
    pub parent_id: Option<SpanId>,
    /// The proxy's span for the request; the backend's parent.
    pub span_id: SpanId,
    /// Whether the proxy records the request's spans (and tells the
    /// backend it did).
    pub sampled: bool,
}

impl Context {
    /// The `traceparent` the backend gets.
    pub fn upstream_traceparent(&self) -> [u8; TRACEPARENT_LEN] {
        TraceParent::format(&self.trace_id, &self.span_id, self.sampled)
    }

    /// Whether the caller's `tracestate` goes on with the request: only
    /// with the caller's `traceparent` (the spec drops it otherwise).
    pub fn keeps_tracestate(&self) -> bool {
        self.parent_id.is_some()
    }

    /// The trace id as 32 lowercase hex digits (for the access log).
    pub fn trace_id_hex(&self) -> String {
        hex_string(&self.trace_id)
    }
}

/// `bytes` as lowercase hex.
pub fn hex_string(bytes: &[u8]) -> String {
    let mut out = vec![0u8; bytes.len() * 2];
    hex_out(bytes, &mut out);
    String::from_utf8(out).unwrap_or_default()
}

fn trim(v: &[u8]) -> &[u8] {
    let start = v.iter().position(|b| !matches!(b, b' ' | b'\t')).unwrap_or(v.len());
    let end = v.iter().rposition(|b| !matches!(b, b' ' | b'\t')).map_or(start, |e| e + 1);
    &v[start..end]
}

/// A lowercase hex digit's value (uppercase is invalid in trace context).
fn nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

fn hex_byte(two: &[u8]) -> Option<u8> {
    Some(nibble(two[0])? << 4 | nibble(two[1])?)
}

fn hex_into(digits: &[u8], out: &mut [u8]) -> Option<()> {
    for (i, o) in out.iter_mut().enumerate() {
        *o = hex_byte(&digits[2 * i..2 * i + 2])?;
    }
    Some(())
}

fn hex_out(bytes: &[u8], out: &mut [u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for (i, b) in bytes.iter().enumerate() {
        out[2 * i] = HEX[usize::from(b >> 4)];
        out[2 * i + 1] = HEX[usize::from(b & 0xf)];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    struct Fixed(u8);
    impl Ids for Fixed {
        fn trace_id(&mut self) -> TraceId {
            [self.0; 16]
        }
        fn span_id(&mut self) -> SpanId {
            [self.0 + 1; 8]
        }
    }

    #[test]
    fn the_specs_example_is_read_and_written_back() {
        let p = TraceParent::parse(EXAMPLE.as_bytes()).expect("valid");
        assert!(p.sampled);
        assert_eq!(hex_string(&p.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(hex_string(&p.parent_id), "00f067aa0ba902b7");
        assert_eq!(&TraceParent::format(&p.trace_id, &p.parent_id, true)[..], EXAMPLE.as_bytes());
    }

    #[test]
    fn invalid_values_are_refused() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
        ] {
            assert_eq!(TraceParent::parse(bad.as_bytes()), None, "{bad:?}");
        }
        // A later version with more fields is read as far as 00 goes.
        let future = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes";
        assert!(TraceParent::parse(future.as_bytes()).is_some());
        assert!(TraceParent::parse(format!("  {EXAMPLE} ").as_bytes()).is_some(), "optional whitespace");
    }

    #[test]
    fn a_callers_decision_is_followed_and_new_traces_use_the_ratio() {
        let never = Sampler::ratio(0.0);
        let ctx = never.decide([EXAMPLE.as_bytes()].into_iter(), &mut Fixed(7));
        assert!(ctx.sampled, "the caller sampled it");
        assert_eq!(hex_string(&ctx.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(ctx.span_id, [8; 8]);
        assert!(ctx.keeps_tracestate());
        let up = ctx.upstream_traceparent();
        assert_eq!(&up[..], b"00-4bf92f3577b34da6a3ce929d0e0e4736-0808080808080808-01");
        let unsampled = EXAMPLE.replace("-01", "-00");
        assert!(!Sampler::ratio(1.0).decide([unsampled.as_bytes()].into_iter(), &mut Fixed(7)).sampled);
        // None, or two values: a new trace.
        let fresh = Sampler::ratio(1.0).decide(std::iter::empty(), &mut Fixed(7));
        assert!(fresh.sampled && fresh.parent_id.is_none() && !fresh.keeps_tracestate());
        assert_eq!(fresh.trace_id, [7; 16]);
        let two = [EXAMPLE.as_bytes(), EXAMPLE.as_bytes()];
        assert_eq!(Sampler::ratio(1.0).decide(two.into_iter(), &mut Fixed(7)).parent_id, None);
        assert!(!never.decide(std::iter::empty(), &mut Fixed(7)).sampled);
    }

    #[test]
    fn the_ratio_records_about_its_share_of_new_traces() {
        let s = Sampler::ratio(0.25);
        let n = 20_000;
        let recorded = (0..n).filter(|_| s.decide(std::iter::empty(), &mut RandomIds).sampled).count();
        let share = recorded as f64 / n as f64;
        assert!((0.2..0.3).contains(&share), "{share}");
        assert_eq!(Sampler::ratio(f64::NAN), Sampler::ratio(0.0));
        assert_eq!(Sampler::ratio(7.0), Sampler::ratio(1.0));
    }

    proptest::proptest! {
        #[test]
        fn any_formatted_context_parses_back(t in proptest::array::uniform16(1u8..), s in proptest::array::uniform8(1u8..), sampled: bool) {
            let v = TraceParent::format(&t, &s, sampled);
            let p = TraceParent::parse(&v).expect("valid");
            proptest::prop_assert_eq!(p, TraceParent { trace_id: t, parent_id: s, sampled });
        }

        #[test]
        fn no_input_panics_the_parser(v in proptest::collection::vec(proptest::num::u8::ANY, 0..80)) {
            let _ = TraceParent::parse(&v);
        }
    }
}

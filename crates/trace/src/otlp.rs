//! OTLP's trace export request (opentelemetry-proto,
//! `collector/trace/v1`), written straight from the proxy's [`Span`]s into
//! protobuf bytes: only the fields the proxy sets, with the field numbers
//! of the official definitions, so any OTLP/HTTP receiver decodes them. No
//! message objects are built on the way (an export of 512 spans is one
//! buffer); the tests decode the output with message types derived by
//! prost from the same definitions.

use crate::span::{Kind, Span, Value};

/// Protobuf wire types.
const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const BYTES: u8 = 2;

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, u64::from(field) << 3 | u64::from(wire));
}

/// A length-delimited field: `bytes` as they are (a string, bytes, or an
/// encoded message).
fn bytes_field(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    key(out, field, BYTES);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A string or bytes field, left out when empty (proto3's default).
fn opt_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    if !bytes.is_empty() {
        bytes_field(out, field, bytes);
    }
}

/// A message field, its body written by `body` (through `scratch`, whose
/// allocation is reused).
fn message(out: &mut Vec<u8>, field: u32, scratch: &mut Vec<u8>, body: impl FnOnce(&mut Vec<u8>)) {
    scratch.clear();
    body(scratch);
    bytes_field(out, field, scratch);
}

/// `KeyValue { key = 1; AnyValue value = 2 }`, `AnyValue { string_value
/// = 1; bool_value = 2; int_value = 3 }` (through `scratch`).
fn key_value(out: &mut Vec<u8>, field: u32, name: &str, value: &Value, scratch: &mut Vec<u8>) {
    scratch.clear();
    bytes_field(scratch, 1, name.as_bytes());
    let any_len = match value {
        Value::Str(s) => 1 + varint_len(s.len() as u64) + s.len(),
        Value::Bool(_) => 2,
        Value::Int(n) => 1 + varint_len(*n as u64),
    };
    key(scratch, 2, BYTES);
    varint(scratch, any_len as u64);
    match value {
        Value::Str(s) => bytes_field(scratch, 1, s.as_bytes()),
        Value::Bool(b) => {
            key(scratch, 2, VARINT);
            varint(scratch, u64::from(*b));
        }
        Value::Int(n) => {
            key(scratch, 3, VARINT);
            // Negative numbers as their two's complement (proto's int64).
            varint(scratch, *n as u64);
        }
    }
    bytes_field(out, field, scratch);
}

fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

/// `Span` (opentelemetry.proto.trace.v1) into `out`.
fn span(out: &mut Vec<u8>, s: &Span, scratch: &mut Vec<u8>) {
    bytes_field(out, 1, &s.trace_id);
    bytes_field(out, 2, &s.span_id);
    opt_bytes(out, 3, s.trace_state.as_bytes());
    if let Some(parent) = &s.parent_id {
        bytes_field(out, 4, parent);
    }
    opt_bytes(out, 5, s.name.as_bytes());
    key(out, 6, VARINT);
    varint(
        out,
        match s.kind {
            Kind::Internal => 1,
            Kind::Server => 2,
            Kind::Client => 3,
        },
    );
    key(out, 7, FIXED64);
    out.extend_from_slice(&s.start_unix_ns.to_le_bytes());
    key(out, 8, FIXED64);
    out.extend_from_slice(&s.end_unix_ns.to_le_bytes());
    for (name, value) in &s.attributes {
        key_value(out, 9, name, value, scratch);
    }
    if let Some(why) = &s.error {
        // `Status { message = 2; code = 3 }`, code 2: error.
        message(out, 15, scratch, |st| {
            opt_bytes(st, 2, why.as_bytes());
            key(st, 3, VARINT);
            varint(st, 2);
        });
    }
}

/// The body of one export: `spans` from the resource `resource` describes
/// (`service.name` first), recorded by the scope `tidegate` at this
/// version, as an `ExportTraceServiceRequest` in protobuf.
pub fn encode(resource: &[(&'static str, Value)], spans: &[Span]) -> Vec<u8> {
    let (mut one, mut scratch) = (Vec::with_capacity(1024), Vec::new());
    // ScopeSpans { InstrumentationScope scope = 1; repeated Span spans = 2 }
    let mut scope_spans = Vec::with_capacity(spans.len() * 512 + 32);
    message(&mut scope_spans, 1, &mut scratch, |scope| {
        bytes_field(scope, 1, b"tidegate");
        bytes_field(scope, 2, env!("CARGO_PKG_VERSION").as_bytes());
    });
    for s in spans {
        one.clear();
        span(&mut one, s, &mut scratch);
        bytes_field(&mut scope_spans, 2, &one);
    }
    // ResourceSpans { Resource resource = 1; repeated ScopeSpans scope_spans = 2 }
    let mut resource_spans = Vec::with_capacity(scope_spans.len() + 256);
    let mut kv = Vec::new();
    message(&mut resource_spans, 1, &mut scratch, |r| {
        for (name, value) in resource {
            key_value(r, 1, name, value, &mut kv);
        }
    });
    bytes_field(&mut resource_spans, 2, &scope_spans);
    // ExportTraceServiceRequest { repeated ResourceSpans resource_spans = 1 }
    let mut out = Vec::with_capacity(resource_spans.len() + 8);
    bytes_field(&mut out, 1, &resource_spans);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    // The official messages, as far as the proxy writes them, derived by
    // prost: the test's decoder.
    /// `opentelemetry.proto.collector.trace.v1.ExportTraceServiceRequest`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ExportTraceServiceRequest {
        /// The spans, by resource.
        #[prost(message, repeated, tag = "1")]
        pub resource_spans: Vec<ResourceSpans>,
    }

    /// `opentelemetry.proto.trace.v1.ResourceSpans`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ResourceSpans {
        /// What produced the spans.
        #[prost(message, optional, tag = "1")]
        pub resource: Option<Resource>,
        /// The spans, by instrumentation scope.
        #[prost(message, repeated, tag = "2")]
        pub scope_spans: Vec<ScopeSpans>,
    }

    /// `opentelemetry.proto.resource.v1.Resource`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Resource {
        /// `service.name` and the like.
        #[prost(message, repeated, tag = "1")]
        pub attributes: Vec<KeyValue>,
    }

    /// `opentelemetry.proto.trace.v1.ScopeSpans`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ScopeSpans {
        /// The code that recorded them.
        #[prost(message, optional, tag = "1")]
        pub scope: Option<InstrumentationScope>,
        /// The spans.
        #[prost(message, repeated, tag = "2")]
        pub spans: Vec<OtlpSpan>,
    }

    /// `opentelemetry.proto.common.v1.InstrumentationScope`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct InstrumentationScope {
        /// Its name.
        #[prost(string, tag = "1")]
        pub name: String,
        /// Its version.
        #[prost(string, tag = "2")]
        pub version: String,
    }

    /// `opentelemetry.proto.trace.v1.Span`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct OtlpSpan {
        /// 16 bytes.
        #[prost(bytes = "vec", tag = "1")]
        pub trace_id: Vec<u8>,
        /// 8 bytes.
        #[prost(bytes = "vec", tag = "2")]
        pub span_id: Vec<u8>,
        /// The W3C `tracestate`.
        #[prost(string, tag = "3")]
        pub trace_state: String,
        /// 8 bytes, or empty for a root span.
        #[prost(bytes = "vec", tag = "4")]
        pub parent_span_id: Vec<u8>,
        /// Its name.
        #[prost(string, tag = "5")]
        pub name: String,
        /// `SpanKind`: 1 internal, 2 server, 3 client.
        #[prost(int32, tag = "6")]
        pub kind: i32,
        /// Nanoseconds since the Unix epoch.
        #[prost(fixed64, tag = "7")]
        pub start_time_unix_nano: u64,
        /// Nanoseconds since the Unix epoch.
        #[prost(fixed64, tag = "8")]
        pub end_time_unix_nano: u64,
        /// Its attributes.
        #[prost(message, repeated, tag = "9")]
        pub attributes: Vec<KeyValue>,
        /// Whether it failed.
        #[prost(message, optional, tag = "15")]
        pub status: Option<Status>,
    }

    /// `opentelemetry.proto.trace.v1.Status`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Status {
        /// Why, for an error.
        #[prost(string, tag = "2")]
        pub message: String,
        /// `StatusCode`: 0 unset, 1 ok, 2 error.
        #[prost(int32, tag = "3")]
        pub code: i32,
    }

    /// `opentelemetry.proto.common.v1.KeyValue`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct KeyValue {
        /// The attribute's name.
        #[prost(string, tag = "1")]
        pub key: String,
        /// Its value.
        #[prost(message, optional, tag = "2")]
        pub value: Option<AnyValue>,
    }

    /// `opentelemetry.proto.common.v1.AnyValue` (the kinds the proxy uses).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct AnyValue {
        /// The value.
        #[prost(oneof = "any_value::Value", tags = "1, 2, 3")]
        pub value: Option<any_value::Value>,
    }

    /// `AnyValue`'s `oneof`.
    pub mod any_value {
        /// One of the value kinds.
        #[derive(Clone, PartialEq, prost::Oneof)]
        pub enum Value {
            /// `string_value`.
            #[prost(string, tag = "1")]
            Str(String),
            /// `bool_value`.
            #[prost(bool, tag = "2")]
            Bool(bool),
            /// `int_value`.
            #[prost(int64, tag = "3")]
            Int(i64),
        }
    }

    #[test]
    fn spans_round_trip_through_the_wire_format() {
        let span = Span {
            trace_id: [1; 16],
            span_id: [2; 8],
            parent_id: Some([3; 8]),
            trace_state: "a=b".into(),
            name: "GET web".into(),
            kind: Kind::Server,
            start_unix_ns: 10,
            end_unix_ns: 20,
            attributes: vec![("http.response.status_code", Value::Int(502)), ("x", Value::Bool(true))],
            error: Some("connect_failed".into()),
        };
        let bytes = encode(&[("service.name", "tidegate".into())], std::slice::from_ref(&span));
        let back = ExportTraceServiceRequest::decode(&bytes[..]).expect("decodes");
        let rs = &back.resource_spans[0];
        assert_eq!(rs.resource.as_ref().unwrap().attributes[0].key, "service.name");
        let s = &rs.scope_spans[0].spans[0];
        assert_eq!((s.trace_id.len(), s.span_id.len(), &s.parent_span_id[..]), (16, 8, &[3u8; 8][..]));
        assert_eq!((s.kind, s.start_time_unix_nano, s.end_time_unix_nano), (2, 10, 20));
        assert_eq!(s.status.as_ref().map(|st| st.code), Some(2));
        assert_eq!(s.attributes[0].value.as_ref().unwrap().value, Some(any_value::Value::Int(502)));
        // Long texts (lengths of several varint bytes), negative numbers,
        // many spans in one export.
        let long = "x".repeat(300);
        let odd = Span {
            attributes: vec![("a", Value::Int(-7)), ("b", Value::from(long.clone())), ("c", Value::Bool(false))],
            name: long.clone(),
            ..span.clone()
        };
        let many = vec![odd; 600];
        let bytes = encode(&[("service.name", "tidegate".into())], &many);
        let back = ExportTraceServiceRequest::decode(&bytes[..]).expect("decodes");
        let spans = &back.resource_spans[0].scope_spans[0].spans;
        assert_eq!(spans.len(), 600);
        let attr = |i: usize| spans[599].attributes[i].value.as_ref().unwrap().value.clone();
        assert_eq!(attr(0), Some(any_value::Value::Int(-7)));
        assert_eq!(attr(1), Some(any_value::Value::Str(long.clone())));
        assert_eq!(attr(2), Some(any_value::Value::Bool(false)));
        assert_eq!(spans[599].name, long);
        // A root span has no parent bytes at all.
        let root = Span { parent_id: None, error: None, ..span };
        let bytes = encode(&[], &[root]);
        let s = &ExportTraceServiceRequest::decode(&bytes[..]).unwrap().resource_spans[0].scope_spans[0].spans[0];
        assert!(s.parent_span_id.is_empty() && s.status.is_none());
    }
}

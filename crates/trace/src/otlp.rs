//! OTLP's trace messages (opentelemetry-proto, `collector/trace/v1` and
//! the messages it uses), written out with prost's derive: only the fields
//! the proxy sets, with the field numbers of the official definitions, so
//! any OTLP/HTTP receiver decodes them.

use crate::span::{Kind, Span, Value};

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
        StringValue(String),
        /// `bool_value`.
        #[prost(bool, tag = "2")]
        BoolValue(bool),
        /// `int_value`.
        #[prost(int64, tag = "3")]
        IntValue(i64),
    }
}

fn key_value(key: &str, value: &Value) -> KeyValue {
    let v = match value {
        Value::Str(s) => any_value::Value::StringValue(s.clone()),
        Value::Int(n) => any_value::Value::IntValue(*n),
        Value::Bool(b) => any_value::Value::BoolValue(*b),
    };
    KeyValue { key: key.to_owned(), value: Some(AnyValue { value: Some(v) }) }
}

fn otlp_span(s: &Span) -> OtlpSpan {
    OtlpSpan {
        trace_id: s.trace_id.to_vec(),
        span_id: s.span_id.to_vec(),
        trace_state: s.trace_state.clone(),
        parent_span_id: s.parent_id.map(|p| p.to_vec()).unwrap_or_default(),
        name: s.name.clone(),
        kind: match s.kind {
            Kind::Internal => 1,
            Kind::Server => 2,
            Kind::Client => 3,
        },
        start_time_unix_nano: s.start_unix_ns,
        end_time_unix_nano: s.end_unix_ns,
        attributes: s.attributes.iter().map(|(k, v)| key_value(k, v)).collect(),
        status: s.error.as_ref().map(|m| Status { message: m.clone(), code: 2 }),
    }
}

/// The body of one export: `spans` from the resource `resource` describes
/// (`service.name` first), recorded by the scope `tidegate` at this
/// version, as protobuf.
pub fn encode(resource: &[(&'static str, Value)], spans: &[Span]) -> Vec<u8> {
    let request = ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource { attributes: resource.iter().map(|(k, v)| key_value(k, v)).collect() }),
            scope_spans: vec![ScopeSpans {
                scope: Some(InstrumentationScope {
                    name: "tidegate".to_owned(),
                    version: env!("CARGO_PKG_VERSION").to_owned(),
                }),
                spans: spans.iter().map(otlp_span).collect(),
            }],
        }],
    };
    prost::Message::encode_to_vec(&request)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

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
        assert_eq!(s.attributes[0].value.as_ref().unwrap().value, Some(any_value::Value::IntValue(502)));
        // A root span has no parent bytes at all.
        let root = Span { parent_id: None, error: None, ..span };
        let bytes = encode(&[], &[root]);
        let s = &ExportTraceServiceRequest::decode(&bytes[..]).unwrap().resource_spans[0].scope_spans[0].spans[0];
        assert!(s.parent_span_id.is_empty() && s.status.is_none());
    }
}

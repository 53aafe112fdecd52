//! The JSON shapes of etcd's gateway: bytes travel as base64, 64-bit
//! integers as strings (proto3's JSON mapping), and fields at their default
//! value are left out, so every field here has a default.

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde::{Deserialize, Deserializer};

use crate::EtcdError;

/// Base64 of raw bytes, as the gateway wants keys and values.
pub(crate) fn b64(bytes: &[u8]) -> String {
    B64.encode(bytes)
}

/// A 64-bit integer written as a string or a number.
fn int<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Int {
        Text(String),
        Number(i64),
    }
    match Int::deserialize(d)? {
        Int::Number(n) => Ok(n),
        Int::Text(s) => s.parse().map_err(serde::de::Error::custom),
    }
}

/// Bytes written as base64.
fn bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    let s = String::deserialize(d)?;
    B64.decode(s.as_bytes()).map_err(serde::de::Error::custom)
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct Header {
    #[serde(default, deserialize_with = "int")]
    pub revision: i64,
}

/// One key as stored.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct KeyValue {
    /// The key.
    #[serde(default, deserialize_with = "bytes")]
    pub key: Vec<u8>,
    /// The value.
    #[serde(default, deserialize_with = "bytes")]
    pub value: Vec<u8>,
    /// The etcd revision of the key's last change.
    #[serde(default, deserialize_with = "int")]
    pub mod_revision: i64,
    /// The etcd revision at which the key was created.
    #[serde(default, deserialize_with = "int")]
    pub create_revision: i64,
    /// How many times the key was written since it was created (1: once).
    #[serde(default, deserialize_with = "int")]
    pub version: i64,
    /// The lease the key is attached to (0: none).
    #[serde(default, deserialize_with = "int")]
    pub lease: i64,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct RangeWire {
    #[serde(default)]
    pub header: Header,
    #[serde(default)]
    pub kvs: Vec<KeyValue>,
    #[serde(default)]
    pub more: bool,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct TxnWire {
    #[serde(default)]
    pub header: Header,
    #[serde(default)]
    pub succeeded: bool,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct LeaseWire {
    #[serde(default, rename = "ID", deserialize_with = "int")]
    pub id: i64,
    #[serde(default, rename = "TTL", deserialize_with = "int")]
    pub ttl: i64,
    #[serde(default)]
    pub error: String,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct KeepAliveWire {
    #[serde(default)]
    pub result: LeaseWire,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct AuthWire {
    #[serde(default)]
    pub token: String,
}

/// An error answer of the gateway: `{"error": "...", "code": N, "message": "..."}`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct ErrorWire {
    #[serde(default)]
    pub code: i64,
    #[serde(default)]
    pub message: String,
    #[serde(default)]
    pub error: String,
}

impl ErrorWire {
    pub(crate) fn into_error(self) -> EtcdError {
        let message = if self.message.is_empty() { self.error } else { self.message };
        // gRPC codes: 4 deadline exceeded, 14 unavailable (no leader, no quorum).
        if matches!(self.code, 4 | 14) || message.contains("no leader") || message.contains("timed out") {
            EtcdError::Unavailable(message)
        } else {
            EtcdError::Refused { code: self.code, message }
        }
    }
}

/// What happened to a key, as a watch reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum EventKind {
    /// Created or changed (the wire leaves this default value out).
    #[default]
    #[serde(rename = "PUT")]
    Put,
    /// Deleted.
    #[serde(rename = "DELETE")]
    Delete,
}

/// One change of one key.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Event {
    /// Put or delete.
    #[serde(default, rename = "type")]
    pub kind: EventKind,
    /// The key after the change (for a delete: the key, with no value).
    #[serde(default)]
    pub kv: KeyValue,
}

/// One message of a watch stream.
#[derive(Debug, Default, Deserialize)]
pub struct WatchResponse {
    #[serde(default)]
    pub(crate) header: Header,
    /// The watch was just created (the first message).
    #[serde(default)]
    pub created: bool,
    /// The server ended the watch (see `compact_revision`).
    #[serde(default)]
    pub canceled: bool,
    /// Set when the start revision was compacted away: the oldest one left.
    #[serde(default, deserialize_with = "int")]
    pub compact_revision: i64,
    /// Why the server ended the watch, if it did.
    #[serde(default)]
    pub cancel_reason: String,
    /// The changes, in revision order.
    #[serde(default)]
    pub events: Vec<Event>,
}

impl WatchResponse {
    /// The etcd revision this message is current to.
    pub fn revision(&self) -> i64 {
        self.header.revision
    }
}

#[derive(Debug, Deserialize)]
struct WatchLine {
    #[serde(default)]
    result: Option<WatchResponse>,
    #[serde(default)]
    error: Option<ErrorWire>,
}

/// Splits a watch stream (one JSON object per line) into messages, however
/// the bytes arrive.
#[derive(Debug, Default)]
pub(crate) struct LineDecoder {
    buf: Vec<u8>,
}

/// The longest line a watch message may take (a big transaction's events).
const MAX_LINE: usize = 64 << 20;

impl LineDecoder {
    /// Adds bytes; returns the complete messages they finish.
    pub(crate) fn push(&mut self, bytes: &[u8]) -> Result<Vec<WatchResponse>, EtcdError> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(end) = self.buf[start..].iter().position(|&b| b == b'\n') {
            let line = &self.buf[start..start + end];
            start += end + 1;
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let parsed = serde_json::from_slice::<WatchLine>(line)
                .map_err(|e| EtcdError::Protocol(format!("a watch message is not the expected JSON: {e}")));
            match parsed {
                Ok(WatchLine { error: Some(err), .. }) => {
                    self.buf.drain(..start);
                    return Err(err.into_error());
                }
                Ok(WatchLine { result: Some(r), .. }) => out.push(r),
                Ok(_) => {}
                Err(e) => {
                    self.buf.drain(..start);
                    return Err(e);
                }
            }
        }
        self.buf.drain(..start);
        if self.buf.len() > MAX_LINE {
            return Err(EtcdError::Protocol("a watch message is larger than 64 MiB".into()));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_lines_split_anywhere_decode_alike() {
        let text = concat!(
            r#"{"result":{"header":{"revision":"2"},"created":true}}"#,
            "\n",
            r#"{"result":{"header":{"revision":"3"},"events":[{"kv":{"key":"dC9yZXY=","value":"Mg==","mod_revision":"3"}},{"type":"DELETE","kv":{"key":"dC94"}}]}}"#,
            "\n"
        );
        for cut in 0..text.len() {
            let mut d = LineDecoder::default();
            let mut got = d.push(&text.as_bytes()[..cut]).expect("decodes");
            got.extend(d.push(&text.as_bytes()[cut..]).expect("decodes"));
            assert_eq!(got.len(), 2, "cut at {cut}");
            assert!(got[0].created);
            assert_eq!(got[1].revision(), 3);
            assert_eq!(got[1].events[0].kind, EventKind::Put);
            assert_eq!(got[1].events[0].kv.key, b"t/rev");
            assert_eq!(got[1].events[0].kv.value, b"2");
            assert_eq!(got[1].events[0].kv.mod_revision, 3);
            assert_eq!(got[1].events[1].kind, EventKind::Delete);
        }
    }

    #[test]
    fn a_watch_error_line_is_an_error() {
        let mut d = LineDecoder::default();
        let e = d.push(b"{\"error\":{\"grpc_code\":14,\"code\":14,\"message\":\"etcdserver: no leader\"}}\n");
        assert!(matches!(e, Err(EtcdError::Unavailable(m)) if m.contains("no leader")));
        assert!(matches!(d.push(b"not json\n"), Err(EtcdError::Protocol(_))));
    }

    #[test]
    fn gateway_errors_say_whether_to_retry() {
        let busy = ErrorWire { code: 14, message: "etcdserver: request timed out".into(), error: String::new() };
        assert!(matches!(busy.into_error(), EtcdError::Unavailable(_)));
        let refused = ErrorWire {
            code: 3,
            message: "etcdserver: duplicate key given in txn request".into(),
            ..Default::default()
        };
        assert!(matches!(refused.into_error(), EtcdError::Refused { code: 3, .. }));
    }

    #[test]
    fn integers_come_as_text_or_numbers() {
        let r: RangeWire =
            serde_json::from_str(r#"{"header":{"revision":"42"},"kvs":[{"key":"YQ==","mod_revision":7,"create_revision":"5","version":"2"}],"more":true}"#)
                .expect("decodes");
        assert_eq!(r.header.revision, 42);
        assert_eq!(r.kvs[0].key, b"a");
        assert_eq!(r.kvs[0].mod_revision, 7);
        assert_eq!((r.kvs[0].create_revision, r.kvs[0].version), (5, 2));
        assert!(r.more);
        let empty: TxnWire = serde_json::from_str(r#"{"header":{"revision":"5"}}"#).expect("decodes");
        assert!(!empty.succeeded, "a failed transaction leaves `succeeded` out");
    }
}

#[cfg(test)]
mod fuzz;

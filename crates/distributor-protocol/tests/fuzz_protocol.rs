//! The distributor's datagrams: decoding never panics, whatever arrives,
//! and what one side encodes the other decodes to the same message
//! (headers trimmed to fit a datagram only as documented).
//!
//! Kept in its own file so it moves with the protocol (see
//! docs/fuzzing.md). Run long: `TIDEGATE_FUZZ_SECS=600 cargo test -p
//! tidegate-distributor-protocol --release --test fuzz_protocol`.

#[path = "../../../fuzz/campaign.rs"]
mod support;

use std::net::SocketAddr;

use proptest::prelude::*;
use tidegate_distributor_protocol::protocol::{decode_answer, decode_query, encode_answer, encode_query};
use tidegate_distributor_protocol::{ProtocolError, Query, MAX_DATAGRAM};

/// Header pairs as a proxy would pass them.
#[derive(Debug, Clone)]
struct Pairs(Vec<(String, Vec<u8>)>);

impl tidegate_balance::Headers for Pairs {
    fn first(&self, name: &str) -> Option<&[u8]> {
        self.0.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_slice())
    }
    fn any(&self, name: &str, f: &mut dyn FnMut(&[u8]) -> bool) -> bool {
        self.0.iter().filter(|(n, _)| n.eq_ignore_ascii_case(name)).any(|(_, v)| f(v))
    }
    fn each(&self, f: &mut dyn FnMut(&str, &[u8])) {
        for (n, v) in &self.0 {
            f(n, v);
        }
    }
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[ -~]{0,20}",
        1 => "\\PC{0,20}",
        1 => Just("\"\\\u{0}\u{1f}\u{7f}\u{2028}".to_string()),
        1 => "[a-z]{2000,3000}",
    ]
}

fn addr() -> impl Strategy<Value = SocketAddr> {
    prop_oneof![
        (any::<[u8; 4]>(), any::<u16>()).prop_map(|(ip, port)| SocketAddr::from((ip, port))),
        (any::<[u16; 8]>(), any::<u16>()).prop_map(|(ip, port)| SocketAddr::from((ip, port))),
    ]
}

fn headers() -> impl Strategy<Value = Pairs> {
    let name = prop_oneof![Just("host".to_string()), Just("cookie".to_string()), "[a-z-]{1,12}"];
    let value = prop_oneof![
        4 => "[ -~]{0,30}".prop_map(String::into_bytes),
        1 => proptest::collection::vec(any::<u8>(), 0..30),
        1 => "[a-z]{1000,4000}".prop_map(String::into_bytes),
    ];
    proptest::collection::vec((name, value), 0..8).prop_map(Pairs)
}

#[derive(Debug, Clone)]
struct QueryCase {
    id: u64,
    policy: String,
    client: SocketAddr,
    method: String,
    path: String,
    host: Option<String>,
    headers: Pairs,
}

fn query() -> impl Strategy<Value = QueryCase> {
    (any::<u64>(), text(), addr(), text(), text(), proptest::option::of(text()), headers()).prop_map(
        |(id, policy, client, method, path, host, headers)| QueryCase {
            id,
            policy,
            client,
            method,
            path,
            host,
            headers,
        },
    )
}

#[test]
fn queries_round_trip() {
    support::campaign("distributor_query", file!(), 512, query(), |c| {
        let q = Query {
            policy: &c.policy,
            client: c.client,
            method: &c.method,
            path: &c.path,
            host: c.host.as_deref(),
            headers: &c.headers,
        };
        let mut out = Vec::new();
        match encode_query(c.id, &q, &mut out) {
            Err(ProtocolError::TooLarge) => {
                prop_assert!(c.policy.len() + c.method.len() + c.path.len() > MAX_DATAGRAM / 2 - 200);
                return Ok(());
            }
            Err(e) => prop_assert!(false, "encoding failed: {}", e),
            Ok(()) => {}
        }
        prop_assert!(out.len() <= MAX_DATAGRAM);
        let w = decode_query(&out).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(w.id, c.id);
        prop_assert_eq!(&*w.policy, c.policy.as_str());
        prop_assert_eq!(w.client, c.client);
        prop_assert_eq!(&*w.method, c.method.as_str());
        prop_assert_eq!(&*w.path, c.path.as_str());
        // Every header sent is one of the request's (lossy UTF-8), or the
        // implicit host; in request order.
        let mut sent: Vec<(String, String)> = Vec::new();
        if let (Some(h), None) = (&c.host, c.headers.0.iter().find(|(n, _)| n.eq_ignore_ascii_case("host"))) {
            sent.push(("host".into(), h.clone()));
        }
        sent.extend(c.headers.0.iter().map(|(n, v)| (n.clone(), String::from_utf8_lossy(v).into_owned())));
        let mut rest = sent.iter();
        for (n, v) in &w.headers {
            prop_assert!(
                rest.any(|(sn, sv)| sn.eq_ignore_ascii_case(n) && sv == &**v),
                "header {} not sent in order",
                n
            );
        }
        let total: usize = sent.iter().map(|(n, v)| n.len() + v.len()).sum();
        if total + c.policy.len() + c.method.len() + c.path.len() < MAX_DATAGRAM / 4 {
            prop_assert_eq!(w.headers.len(), sent.len(), "headers dropped though they fit");
        }
        Ok(())
    });
}

#[test]
fn answers_round_trip() {
    let cases = (any::<u64>(), prop_oneof![addr().prop_map(Ok), text().prop_map(Err)]);
    support::campaign("distributor_answer", file!(), 512, cases, |(id, result)| {
        let mut out = Vec::new();
        encode_answer(id, result.as_ref().map(|a| *a).map_err(String::as_str), &mut out);
        prop_assert!(out.len() <= MAX_DATAGRAM);
        let a = decode_answer(&out).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(a.id, id);
        match (&result, &a.result) {
            (Ok(sent), Ok(got)) => prop_assert_eq!(sent, got),
            // A long message is cut, on a character boundary.
            (Err(sent), Err(got)) => {
                prop_assert!(sent.starts_with(&**got) && (got.len() == sent.len() || got.len() >= MAX_DATAGRAM / 8 - 4))
            }
            _ => prop_assert!(false, "answer kind changed"),
        }
        Ok(())
    });
}

/// Valid datagrams mutated byte by byte, and arbitrary bytes: decoded or
/// refused, never a panic.
#[test]
fn mutated_datagrams_never_panic() {
    let seeds = prop_oneof![
        Just(br#"{"v":1,"id":7,"policy":"least_cpu","client":"1.2.3.4:5678","method":"GET","path":"/x?y","headers":[["host","a"],["cookie","sid=1"]]}"#.to_vec()),
        Just(br#"{"v":1,"id":7,"backend":"127.0.0.1:9001"}"#.to_vec()),
        Just(br#"{"v":1,"id":7,"error":"no backend \u00e9"}"#.to_vec()),
        Just(br#"{"v":2,"id":18446744073709551615}"#.to_vec()),
        proptest::collection::vec(any::<u8>(), 0..200),
    ];
    let edits = proptest::collection::vec((any::<usize>(), any::<u8>(), 0u8..3), 0..6);
    support::campaign("distributor_mutated", file!(), 2048, (seeds, edits), |(mut d, edits)| {
        for (at, byte, op) in edits {
            match op {
                0 if !d.is_empty() => {
                    let i = at % d.len();
                    d[i] = byte;
                }
                1 => d.insert(at % (d.len() + 1), byte),
                _ if !d.is_empty() => {
                    d.remove(at % d.len());
                }
                _ => {}
            }
        }
        let _ = decode_query(&d);
        let _ = decode_answer(&d);
        Ok(())
    });
}

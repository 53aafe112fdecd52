//! gmond XML dumps under hostile input: never a panic, at most
//! `MAX_HOSTS` hosts, and no host or value larger than the input.
//!
//! Run long: `TIDEGATE_FUZZ_SECS=600 cargo test -p tidegate-sources
//! --release --test fuzz_gmond` (see docs/fuzzing.md).

#[path = "../../../fuzz/campaign.rs"]
mod support;

use proptest::prelude::*;
use tidegate_sources::gmond::{parse, MAX_HOSTS};

fn attr_value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("10".to_string()),
        Just("1e308".to_string()),
        Just("NaN".to_string()),
        Just("-inf".to_string()),
        Just("a&amp;b".to_string()),
        Just("&#x41;&#65;&#1114112;&#xffffffff;&bogus;&".to_string()),
        Just("\"".to_string()),
        "[ -~]{0,8}",
    ]
}

fn element() -> impl Strategy<Value = String> {
    let quote = prop_oneof![Just('"'), Just('\'')];
    let metric = (
        prop_oneof![
            Just("cpu_idle"),
            Just("mem_total"),
            Just("mem_free"),
            Just("mem_cached"),
            Just("bytes_in"),
            Just("x")
        ],
        attr_value(),
        quote.clone(),
    )
        .prop_map(|(name, val, q)| format!("<METRIC NAME={q}{name}{q} VAL={q}{val}{q} TYPE=\"float\"/>"));
    let host = (attr_value(), attr_value(), attr_value(), quote)
        .prop_map(|(name, ip, tn, q)| format!("<HOST NAME={q}{name}{q} IP={q}{ip}{q} TN={q}{tn}{q} TMAX=\"20\">"));
    prop_oneof![
        3 => metric,
        2 => host,
        2 => Just("</HOST>".to_string()),
        1 => Just("<GANGLIA_XML VERSION=\"3\"><CLUSTER NAME=\"c\">".to_string()),
        1 => Just("</CLUSTER></GANGLIA_XML>".to_string()),
        1 => Just("<!-- <HOST NAME=\"comment\"> -->".to_string()),
        1 => Just("<!DOCTYPE GANGLIA_XML [ <!ELEMENT x> ]>".to_string()),
        1 => Just("<![CDATA[<HOST NAME=\"c\">]]>".to_string()),
        1 => Just("<?xml version=\"1.0\"?>".to_string()),
        1 => Just("<HOST".to_string()),
        1 => Just("<".to_string()),
        1 => "[ -~]{0,10}",
    ]
}

fn document() -> impl Strategy<Value = Vec<u8>> {
    let edits = proptest::collection::vec((any::<usize>(), any::<u8>()), 0..3);
    (proptest::collection::vec(element(), 0..24), edits).prop_map(|(parts, edits)| {
        let mut d = parts.concat().into_bytes();
        for (at, b) in edits {
            if !d.is_empty() {
                let i = at % d.len();
                d[i] = b;
            }
        }
        d
    })
}

fn check(xml: &[u8]) -> Result<(), TestCaseError> {
    let hosts = parse(xml);
    prop_assert!(hosts.len() <= MAX_HOSTS);
    prop_assert!(hosts.len() <= xml.len() / 6 + 1, "more hosts than the input can hold");
    for h in &hosts {
        // Latin-1 to UTF-8 at most doubles a byte.
        prop_assert!(h.name.len() <= 2 * xml.len() && h.ip.len() <= 2 * xml.len());
    }
    Ok(())
}

#[test]
fn gmond_documents_parse_bounded() {
    support::campaign("gmond", file!(), 1024, document(), |xml| check(&xml));
}

#[test]
fn arbitrary_bytes_parse_bounded() {
    support::campaign("gmond_arbitrary", file!(), 1024, proptest::collection::vec(any::<u8>(), 0..800), |xml| {
        check(&xml)
    });
}

#[test]
fn many_hosts_stop_at_the_cap() {
    let xml = "<HOST NAME=\"h\" IP=\"1\"></HOST>".repeat(MAX_HOSTS + 5);
    assert_eq!(parse(xml.as_bytes()).len(), MAX_HOSTS);
}

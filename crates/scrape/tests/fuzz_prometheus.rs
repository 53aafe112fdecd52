//! Prometheus text under hostile input: the sample reader and the
//! node_exporter summary never panic, every sample's name and labels are
//! parts of its line, and values read are what the text says.
//!
//! Kept in its own file so it follows the parser wherever it goes (see
//! docs/fuzzing.md). Run long: `TIDEGATE_FUZZ_SECS=600 cargo test -p
//! tidegate-scrape --release --test fuzz_prometheus`.

#[path = "../../../fuzz/campaign.rs"]
mod support;

use proptest::prelude::*;
use tidegate_scrape::{samples, NodeSample};

fn label_value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("idle".to_string()),
        Just("lo".to_string()),
        Just("eth0".to_string()),
        Just("a}b".to_string()),
        Just("a\\\"b".to_string()),
        Just("a\\\\".to_string()),
        Just("\\n".to_string()),
        Just("\\".to_string()),
        "[ -~]{0,6}",
    ]
}

fn line() -> impl Strategy<Value = String> {
    let name = prop_oneof![
        Just("node_cpu_seconds_total"),
        Just("node_memory_MemAvailable_bytes"),
        Just("node_memory_MemTotal_bytes"),
        Just("node_network_receive_bytes_total"),
        Just("node_network_transmit_bytes_total"),
        Just("x"),
        Just(""),
    ];
    let key = prop_oneof![Just("cpu"), Just("mode"), Just("device"), Just("le"), Just("")];
    let labels = proptest::collection::vec((key, label_value()), 0..3)
        .prop_map(|ls| ls.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect::<Vec<_>>().join(","));
    let braces = prop_oneof![4 => Just(("{", "}")), 1 => Just(("{", "")), 1 => Just(("", "}")), 1 => Just(("", ""))];
    let value = prop_oneof![
        Just("1".to_string()),
        Just("1e3".to_string()),
        Just("NaN".to_string()),
        Just("+Inf".to_string()),
        Just("-Inf".to_string()),
        Just("1e999".to_string()),
        Just("0x10".to_string()),
        Just("".to_string()),
        any::<f64>().prop_map(|v| v.to_string()),
    ];
    let ts = prop_oneof![Just(""), Just(" 1700000000000"), Just(" x"), Just("\t-1")];
    prop_oneof![
        8 => (name, braces, labels, value, ts).prop_map(|(n, (o, c), l, v, t)| format!("{n}{o}{l}{c} {v}{t}")),
        1 => Just("# TYPE node_cpu_seconds_total counter".to_string()),
        1 => Just("# HELP x {".to_string()),
        1 => "\\PC{0,30}",
    ]
}

fn text() -> impl Strategy<Value = String> {
    let end = prop_oneof![Just("\n"), Just("\r\n"), Just("")];
    proptest::collection::vec((line(), end), 0..20)
        .prop_map(|ls| ls.into_iter().map(|(l, e)| format!("{l}{e}")).collect())
}

fn check(text: &str) -> Result<(), TestCaseError> {
    let lines: Vec<&str> = text.lines().collect();
    let mut n = 0;
    for s in samples(text) {
        n += 1;
        prop_assert!(lines.iter().any(|l| l.contains(s.name) && l.contains(s.labels)), "{:?}", s);
        // Labels read never panic, escaped or not.
        for key in ["cpu", "mode", "device", ""] {
            let _ = s.label(key);
        }
    }
    prop_assert!(n <= lines.len());
    let node = NodeSample::parse(text);
    // Memory figures are kept only when finite.
    prop_assert!(node.mem_total.is_none_or(f64::is_finite) && node.mem_available.is_none_or(f64::is_finite));
    Ok(())
}

#[test]
fn expositions_parse_without_panic() {
    support::campaign("prometheus", file!(), 1024, text(), |t| check(&t));
}

#[test]
fn arbitrary_text_parses_without_panic() {
    support::campaign("prometheus_arbitrary", file!(), 1024, "\\PC{0,400}", |t| check(&t));
}

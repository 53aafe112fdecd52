//! Watch-line decoding under hostile streams: never a panic, however the
//! bytes are split, and a split never changes what is decoded.
//!
//! Run long: `TIDEGATE_FUZZ_SECS=600 cargo test -p tidegate-etcd --release
//! --lib wire::fuzz` (see docs/fuzzing.md).

#[path = "../../../../fuzz/campaign.rs"]
mod support;

use proptest::prelude::*;

use super::LineDecoder;

/// Watch messages, valid and subtly not: revisions as strings and numbers,
/// base64 good and bad, events of unknown types, errors, blank lines.
fn line() -> impl Strategy<Value = String> {
    let revision = prop_oneof![
        Just("\"3\"".to_string()),
        Just("3".to_string()),
        Just("\"-1\"".to_string()),
        Just("\"99999999999999999999\"".to_string()),
        Just("\"x\"".to_string()),
        Just("null".to_string()),
        Just("1e3".to_string()),
    ];
    let b64 = prop_oneof![
        Just("\"dC9yZXY=\"".to_string()),
        Just("\"\"".to_string()),
        Just("\"!!\"".to_string()),
        Just("\"dC9yZXY\"".to_string()),
        Just("7".to_string()),
    ];
    let kind = prop_oneof![
        Just(""),
        Just(r#""type":"DELETE","#),
        Just(r#""type":"PUT","#),
        Just(r#""type":"OTHER","#),
        Just(r#""type":3,"#)
    ];
    let event = (kind, b64.clone(), b64, revision.clone()).prop_map(|(k, key, value, rev)| {
        format!(r#"{{{k}"kv":{{"key":{key},"value":{value},"mod_revision":{rev}}}}}"#)
    });
    prop_oneof![
        6 => (revision.clone(), any::<bool>(), proptest::collection::vec(event, 0..4)).prop_map(|(rev, created, events)| {
            format!(r#"{{"result":{{"header":{{"revision":{rev}}},"created":{created},"events":[{}]}}}}"#, events.join(","))
        }),
        1 => revision.prop_map(|rev| format!(r#"{{"result":{{"canceled":true,"compact_revision":{rev},"cancel_reason":"compacted"}}}}"#)),
        1 => Just(r#"{"error":{"grpc_code":14,"http_code":503,"message":"unavailable"}}"#.to_string()),
        1 => Just(r#"{"error":"bare"}"#.to_string()),
        1 => Just("   ".to_string()),
        1 => Just("{}".to_string()),
        1 => "\\PC{0,30}",
    ]
}

/// Lines joined into a stream, maybe mutated, with the cuts it arrives in.
fn stream() -> impl Strategy<Value = (Vec<u8>, Vec<usize>)> {
    let edits = proptest::collection::vec((any::<usize>(), any::<u8>()), 0..3);
    (proptest::collection::vec(line(), 0..6), edits, proptest::collection::vec(any::<usize>(), 0..6)).prop_map(
        |(lines, edits, cuts)| {
            let mut s = lines.join("\n").into_bytes();
            s.push(b'\n');
            for (at, b) in edits {
                let i = at % s.len();
                s[i] = b;
            }
            (s, cuts)
        },
    )
}

/// Messages decoded from `input` delivered in pieces, as revisions and
/// event counts, and the first error's position in the sequence.
fn decode(input: &[u8], cuts: &[usize]) -> (Vec<(i64, usize, bool)>, bool) {
    let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
    bounds.push(input.len());
    bounds.sort_unstable();
    let mut d = LineDecoder::default();
    let mut got = Vec::new();
    let mut at = 0;
    for b in bounds {
        match d.push(&input[at..b]) {
            Ok(msgs) => got.extend(msgs.iter().map(|m| (m.revision(), m.events.len(), m.canceled))),
            // The watch is dropped at the first error.
            Err(_) => return (got, true),
        }
        at = b;
    }
    (got, false)
}

#[test]
fn watch_streams_decode_alike_however_split() {
    support::campaign("etcd_watch", file!(), 1024, stream(), |(input, cuts)| {
        let whole = decode(&input, &[]);
        let split = decode(&input, &cuts);
        // Messages before an error may arrive in the same push as the
        // error and be lost with it: only compare what both saw.
        if whole.1 || split.1 {
            prop_assert_eq!(whole.1, split.1, "an error in one reading only");
            let n = whole.0.len().min(split.0.len());
            prop_assert_eq!(&whole.0[..n], &split.0[..n]);
        } else {
            prop_assert_eq!(whole, split);
        }
        Ok(())
    });
}

#[test]
fn arbitrary_bytes_never_panic() {
    let cases = (proptest::collection::vec(any::<u8>(), 0..600), proptest::collection::vec(any::<usize>(), 0..4));
    support::campaign("etcd_arbitrary", file!(), 1024, cases, |(input, cuts)| {
        let _ = decode(&input, &cuts);
        Ok(())
    });
}

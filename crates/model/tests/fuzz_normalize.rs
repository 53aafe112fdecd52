//! Path normalization under framing-biased inputs: it never panics, is
//! idempotent, and what it returns has no dot segment, no empty segment,
//! no encoded or raw separator, no escaped unreserved byte, even after
//! one more percent-decoding (what a backend does).
//!
//! Run long: `TIDEGATE_FUZZ_SECS=600 cargo test -p tidegate-model --release
//! --test fuzz_normalize` (see docs/fuzzing.md).

#[path = "../../../fuzz/campaign.rs"]
mod support;

use proptest::prelude::*;
use tidegate_model::normalize::normalize;

fn segment() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-zA-Z0-9_~-]{1,4}",
        1 => Just(".".to_string()),
        1 => Just("..".to_string()),
        1 => Just("".to_string()),
        1 => Just("%2e".to_string()),
        1 => Just("%2E%2e".to_string()),
        1 => Just(".%2e".to_string()),
        1 => Just("%2e.".to_string()),
        1 => Just("%252e%252e".to_string()),
        1 => Just("..;".to_string()),
        1 => Just("..;x=1".to_string()),
        1 => Just(".;".to_string()),
        1 => Just("a;b".to_string()),
        1 => Just("%2f".to_string()),
        1 => Just("%2F".to_string()),
        1 => Just("%5c".to_string()),
        1 => Just("\\".to_string()),
        1 => Just("%00".to_string()),
        1 => Just("%".to_string()),
        1 => Just("%z1".to_string()),
        1 => Just("%4".to_string()),
        1 => Just("%41%7e".to_string()),
        1 => Just("%c3%a9".to_string()),
        1 => Just("%ff".to_string()),
        1 => Just("é".to_string()),
        1 => "\\PC{1,3}",
    ]
}

fn path() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => (proptest::collection::vec(segment(), 0..10), any::<bool>())
            .prop_map(|(segs, slash)| format!("/{}{}", segs.join("/"), if slash { "/" } else { "" })),
        1 => "\\PC{0,40}",
        1 => Just("*".to_string()),
    ]
}

/// Decodes every escape once, as a backend would (invalid ones kept).
fn decode_once(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    out
}

#[test]
fn normalized_paths_are_safe_fixed_points() {
    support::campaign("normalize", file!(), 2048, path(), |p| {
        let Ok(n) = normalize(&p) else { return Ok(()) };
        let n = n.into_owned();
        if p == "*" {
            prop_assert_eq!(n, "*");
            return Ok(());
        }
        prop_assert_eq!(normalize(&n).map(|c| c.into_owned()), Ok(n.clone()), "not idempotent");
        prop_assert!(n.starts_with('/'));
        prop_assert!(!n.contains("//"), "{}", n);
        prop_assert!(!n.contains('\\'), "{}", n);
        let lower = n.to_ascii_lowercase();
        for enc in ["%2f", "%5c", "%00", "%2e", "%41"] {
            prop_assert!(!lower.contains(enc), "{} in {}", enc, n);
        }
        // Neither as it is nor after one decoding does it climb.
        let once = decode_once(&n);
        for seg in n.split('/').map(str::as_bytes).chain(once.split(|b| *b == b'/')) {
            let bare = seg.split(|b| *b == b';').next().unwrap_or_default();
            prop_assert!(bare != b"." && bare != b"..", "dot segment in {} ({:?})", n, String::from_utf8_lossy(&once));
        }
        Ok(())
    });
}

//! Chunked decoding, incrementally: any split of the input gives the same
//! payload, end and error as the whole input in one piece, and the decoder
//! never panics and never reports data outside its input.
//!
//! Run long: `TIDEGATE_FUZZ_SECS=600 cargo test -p tidegate-h1 --release
//! --test fuzz_chunked` (see docs/fuzzing.md).

#[path = "../../../fuzz/campaign.rs"]
mod support;

use proptest::prelude::*;
use tidegate_h1::ChunkedDecoder;

/// Bytes shown as an escaped string in failures.
#[derive(Clone)]
struct Raw(Vec<u8>);

impl std::fmt::Debug for Raw {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s: String = self.0.iter().flat_map(|b| std::ascii::escape_default(*b)).map(char::from).collect();
        write!(f, "b\"{s}\"")
    }
}

/// A chunked body biased toward the framing rules: sizes with leading
/// zeros, 16 and 17 hex digits, extensions, trailers, bare LF and CR.
fn chunked() -> impl Strategy<Value = Vec<u8>> {
    let size = prop_oneof![
        6 => (0usize..20).prop_map(|n| format!("{n:x}")),
        1 => (0usize..20).prop_map(|n| format!("{n:X}")),
        1 => (0usize..20).prop_map(|n| format!("000{n:x}")),
        1 => Just("ffffffffffffffff".to_string()),
        1 => Just("fffffffffffffffff".to_string()),
        1 => Just("00000000000000001".to_string()),
        1 => Just("".to_string()),
        1 => Just("g".to_string()),
    ];
    let ext = prop_oneof![6 => Just(""), 1 => Just(";a=b"), 1 => Just(" ;a"), 1 => Just("\t"), 1 => Just(";\x01")];
    let end = prop_oneof![12 => Just("\r\n"), 1 => Just("\n"), 1 => Just("\r"), 1 => Just("")];
    let chunk = (size, ext, end.clone(), proptest::collection::vec(any::<u8>(), 0..24), end.clone()).prop_map(
        |(size, ext, e1, data, e2)| [format!("{size}{ext}{e1}").into_bytes(), data, e2.as_bytes().to_vec()].concat(),
    );
    let trailers = proptest::collection::vec(
        prop_oneof![Just("x-t: 1\r\n"), Just("x-t: 1\n"), Just("bad\0\r\n"), Just(" x\r\n")],
        0..3,
    );
    let last = (end.clone(), trailers, end).prop_map(|(e1, t, e2)| format!("0{e1}{}{e2}", t.concat()).into_bytes());
    (proptest::collection::vec(chunk, 0..6), last, proptest::collection::vec(any::<u8>(), 0..8))
        .prop_map(|(chunks, last, after)| [chunks.concat(), last, after].concat())
}

/// The decoder's reading of `input` fed in pieces cut at `cuts`: the
/// payload, whether it ended, where (bytes used), and whether it failed.
fn decode(input: &[u8], cuts: &[usize]) -> (Vec<u8>, bool, usize, bool) {
    let mut d = ChunkedDecoder::default();
    let mut payload = Vec::new();
    let mut buffered: Vec<u8> = Vec::new();
    let mut used = 0;
    let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
    bounds.push(input.len());
    bounds.sort_unstable();
    let mut fed = 0;
    for b in bounds {
        buffered.extend_from_slice(&input[fed..b]);
        fed = b;
        // Like a connection: decode what is buffered until no progress.
        loop {
            match d.decode(&buffered) {
                // Where an error stops is not meaningful (the connection
                // is closed): only that it failed, and what came before.
                Err(_) => return (payload, false, 0, true),
                Ok(step) => {
                    assert!(step.consumed <= buffered.len());
                    if let Some(r) = &step.data {
                        assert!(r.end <= step.consumed && r.start <= r.end);
                        payload.extend_from_slice(&buffered[r.clone()]);
                    }
                    buffered.drain(..step.consumed);
                    used += step.consumed;
                    if step.done {
                        assert!(d.is_done());
                        return (payload, true, used, false);
                    }
                    if step.consumed == 0 {
                        break;
                    }
                }
            }
        }
    }
    (payload, false, used, false)
}

#[test]
fn any_split_reads_like_one_piece() {
    let cases = (chunked(), proptest::collection::vec(any::<usize>(), 0..8)).prop_map(|(b, cuts)| (Raw(b), cuts));
    support::campaign("chunked_splits", file!(), 1024, cases, |(Raw(input), cuts)| {
        let whole = decode(&input, &[]);
        let split = decode(&input, &cuts);
        prop_assert_eq!(&whole, &split);
        // Byte by byte, the slowest client.
        let every: Vec<usize> = (0..input.len()).collect();
        prop_assert_eq!(&whole, &decode(&input, &every));
        Ok(())
    });
}

#[test]
fn arbitrary_bytes_never_panic() {
    let cases =
        (proptest::collection::vec(any::<u8>(), 0..512).prop_map(Raw), proptest::collection::vec(any::<usize>(), 0..4));
    support::campaign("chunked_arbitrary", file!(), 1024, cases, |(Raw(input), cuts)| {
        prop_assert_eq!(decode(&input, &[]), decode(&input, &cuts));
        Ok(())
    });
}

#!/usr/bin/env bash
# The long run of the property-test campaign (docs/fuzzing.md): each
# target for SECS seconds (default 600), one after the other, in the
# debug profile the short CI pass uses. Prints each target's case count.
#   fuzz/long-run.sh [SECS] [TARGET-FILTER]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-600}
filter=${2:-}
run() { # package, test selector..., test name
    local name=${*: -1}
    [[ -n $filter && $name != *$filter* ]] && return 0
    TIDEGATE_FUZZ_SECS=$secs cargo test --locked -q -p "$@" -- --exact --nocapture --test-threads=1 2>&1 \
        | grep -E '^fuzz |panicked|minimal failing|test result: FAILED' || true
}
run tidegate-h1 --test fuzz_heads request_heads_against_httparse_and_hyper
run tidegate-h1 --test fuzz_heads response_heads_against_httparse_and_hyper
run tidegate-h1 --test fuzz_heads arbitrary_bytes_as_heads
run tidegate-h1 --test fuzz_chunked any_split_reads_like_one_piece
run tidegate-h1 --test fuzz_chunked arbitrary_bytes_never_panic
run tidegate-model --test fuzz_normalize normalized_paths_are_safe_fixed_points
run tidegate-distributor-protocol --test fuzz_protocol queries_round_trip
run tidegate-distributor-protocol --test fuzz_protocol answers_round_trip
run tidegate-distributor-protocol --test fuzz_protocol mutated_datagrams_never_panic
run tidegate-etcd --lib wire::fuzz::watch_streams_decode_alike_however_split
run tidegate-etcd --lib wire::fuzz::arbitrary_bytes_never_panic
run tidegate-sources --test fuzz_gmond gmond_documents_parse_bounded
run tidegate-sources --test fuzz_gmond arbitrary_bytes_parse_bounded
run tidegate-scrape --test fuzz_prometheus expositions_parse_without_panic
run tidegate-scrape --test fuzz_prometheus arbitrary_text_parses_without_panic

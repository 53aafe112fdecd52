#!/usr/bin/env bash
# Where the time of a change goes in cluster mode, empty and loaded: one
# Tidegate instance on a 1-member etcd, 600 route changes/s for 5 s, then the
# same after 10,000 services / 100,000 backends / 10,000 routes were added.
# Prints the answer latency and, from the instance's metrics, the etcd
# commit time and the rest of the apply per commit.
#
#   bench/cluster_commit_cost.sh [--bin-dir DIR]   (default target/release)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=target/release BIN_DIR=""
[ "${1:-}" = --bin-dir ] && BIN=$2 BIN_DIR=$2
source bench/lib/run.sh
ensure_binaries
TOKEN=bench-token-0123456789abcdef0123456789
WORK=$(mktemp -d /tmp/tidegate-commit-cost.XXXXXX); PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; sleep 0.5; rm -rf "$WORK"' EXIT
start_emulator churn
E=$(emulator_addr churn)
start_etcd 1
TIDEGATE_ADMIN_TOKEN=$TOKEN TIDEGATE_LOG=warn "$BIN/tidegate" serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 --workers 1 \
  --data-dir "$WORK/data" --store "etcd://$ENDPOINTS/x?max_txn_ops=200000" > "$WORK/a.out" 2>&1 & PIDS+=($!)
for _ in $(seq 100); do grep -q ready "$WORK/a.out" 2>/dev/null && break; sleep 0.05; done
L=$(head -1 "$WORK/a.out"); AP=${L#*proxy=}; AP=${AP%% *}; AA=${L#*admin=}; AA=${AA%% *}
B="$BIN/tidegate-bench --token $TOKEN --admin $AA --proxy $AP"
metrics() { curl -s -H "Authorization: Bearer $TOKEN" "http://$AA/metrics" | awk '/^tidegate_config_(commits_total|commit_seconds_total|apply_seconds_total) /{printf "%s=%s ", $1, $2}'; }
measure() { # label
  local before after
  before=$(metrics)
  local answer; answer=$($B churn --rate 600 --duration-s 5 --service churnsvc --expect-backend churn \
    | python3 -c 'import json,sys; d=json.load(sys.stdin)["admin_us"]; print(d["p50"], d["p99"])')
  after=$(metrics)
  python3 - "$1" "$answer" "$before" "$after" <<'PY'
import sys
label, answer, before, after = sys.argv[1:]
parse = lambda s: {k: float(v) for k, v in (kv.split("=") for kv in s.split())}
b, a = parse(before), parse(after)
commits = a["tidegate_config_commits_total"] - b["tidegate_config_commits_total"]
commit = a["tidegate_config_commit_seconds_total"] - b["tidegate_config_commit_seconds_total"]
apply = a["tidegate_config_apply_seconds_total"] - b["tidegate_config_apply_seconds_total"]
p50, p99 = answer.split()
print(f"{label}: answer p50 {int(p50)/1e3:.2f} ms p99 {int(p99)/1e3:.2f} ms; {int(commits)} commits: "
      f"etcd commit {commit/commits*1e3:.2f} ms, rest of the apply {(apply-commit)/commits*1e6:.0f} us per commit")
PY
}
$B setup --service churnsvc --backend "$E" --no-catch-all > /dev/null
measure empty
$B setup --service churnsvc --backend "$E" --no-catch-all --preload-services 10000 --backends-per-service 10 --preload-routes 10000 > /dev/null
measure loaded

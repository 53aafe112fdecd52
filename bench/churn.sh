#!/usr/bin/env bash
# Configuration churn (paper S0): how fast a change becomes effective, and how
# many changes per second Tidegate sustains, on an empty configuration and
# with 10,000 services / 100,000 backends / 10,000 routes loaded. Live traffic
# runs during the open-loop churn and must see no error. After each rate, the
# disk's floor at the same rate and with the same live traffic
# (`tidegate-bench disk-floor`: a 4 KiB write and an fdatasync per change,
# nothing else), to read the answer times against.
# Writes one JSON line per measurement to OUT (default bench/results/churn-<time>.jsonl).
#
#   bench/churn.sh [--duration S] [--out FILE] [--rates "100 600 2000"] [--suites "empty loaded"]
#                  [--preload N] [--live-rate R] [--clients N] [--bin-dir DIR]
#
# --preload: services (10 backends each) and routes of the "loaded" suite;
# --bin-dir: where the binaries are (default target/release, built when missing).
# The comparison with nginx (reload) and HAProxy (runtime API) is
# bench/churn_peers.py, run next to this script by scripts/bench.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=10 OUT="" RATES="100 600 2000" SUITES="empty loaded" PRELOAD=10000 LIVE_RATE=1000 CLIENTS=64 BIN_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --duration) DURATION=$2; shift 2;;
    --out) OUT=$2; shift 2;;
    --rates) RATES=$2; shift 2;;
    --suites) SUITES=$2; shift 2;;
    --preload) PRELOAD=$2; shift 2;;
    --live-rate) LIVE_RATE=$2; shift 2;;
    --clients) CLIENTS=$2; shift 2;;
    --bin-dir) BIN_DIR=$2; shift 2;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
done
mkdir -p bench/results
OUT=${OUT:-bench/results/churn-$(date +%Y%m%d-%H%M%S).jsonl}
BIN=${BIN_DIR:-target/release}
source bench/lib/run.sh
ensure_binaries
make_work tidegate-churn

start_emulator churn; start_emulator live
CHURN_ADDR=$(emulator_addr churn); LIVE_ADDR=$(emulator_addr live)

run_suite() { # label
  local label=$1
  TIDEGATE_ADMIN_TOKEN=bench-token-0123456789abcdef0123456789 TIDEGATE_LOG=warn "$BIN/tidegate" serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 \
    --data-dir "$WORK/data-$label" > "$WORK/tg-$label.out" & local tg=$!; PIDS+=($tg)
  for _ in $(seq 100); do grep -q ready "$WORK/tg-$label.out" 2>/dev/null && break; sleep 0.05; done
  local line; line=$(head -1 "$WORK/tg-$label.out")
  local proxy=${line#*proxy=}; proxy=${proxy%% *}; local admin=${line#*admin=}; admin=${admin%% *}
  local B="$BIN/tidegate-bench --admin $admin --proxy $proxy --token bench-token-0123456789abcdef0123456789"
  emit() { python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); d["suite"]=sys.argv[1]; d["label"]=sys.argv[2]; print(json.dumps(d))' "$label" "$1" | tee -a "$OUT" | cut -c1-300; }
  $B setup --service live --backend "$LIVE_ADDR" | emit setup-live
  $B setup --service churnsvc --backend "$CHURN_ADDR" --no-catch-all | emit setup-churn
  if [ "$label" = loaded ]; then
    $B setup --service churnsvc --backend "$CHURN_ADDR" --no-catch-all \
      --preload-services "$PRELOAD" --backends-per-service 10 --preload-routes "$PRELOAD" | emit preload
  fi
  for rate in $RATES; do
    $B traffic --rate "$LIVE_RATE" --duration-s "$DURATION" --path / --expect-backend live > "$WORK/traffic.json" &
    local tp=$!
    $B churn --rate "$rate" --duration-s "$DURATION" --service churnsvc --expect-backend churn | emit "churn-$rate"
    wait $tp; emit "traffic-during-churn-$rate" < "$WORK/traffic.json"
    $B traffic --rate "$LIVE_RATE" --duration-s "$DURATION" --path / --expect-backend live > "$WORK/traffic.json" &
    tp=$!
    $B disk-floor --rate "$rate" --duration-s "$DURATION" --dir "$WORK" | emit "disk-floor-$rate"
    wait $tp; emit "traffic-during-disk-floor-$rate" < "$WORK/traffic.json"
  done
  $B saturate --clients "$CLIENTS" --duration-s "$DURATION" --service churnsvc --weight 0 | emit saturate-single
  $B saturate --clients "$CLIENTS" --duration-s "$DURATION" --service churnsvc --weight 0 --batch 1000 | emit saturate-batch-1000
  kill $tg; wait $tg 2>/dev/null || true
}
for suite in $SUITES; do run_suite "$suite"; done
echo "results: $OUT"

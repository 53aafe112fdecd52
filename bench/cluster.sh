#!/usr/bin/env bash
# Cluster mode (issue 11): three Tidegate instances sharing one etcd prefix.
# For a 1-member and a 3-member etcd (real `etcd` processes on loopback):
#   - propagation: open-loop route creation through instance A at --rate;
#     each change counts once A, B and C all serve it (time_to_effective_us
#     is until the last one does), with live traffic through B meanwhile;
#   - sustained changes/s, closed loop: through A alone, then through A, B
#     and C at once;
#   - the same propagation with 10,000 services / 100,000 backends / 10,000
#     routes loaded (apply cost against configuration size).
# The embedded store's propagation on one instance runs in the same run, as
# the baseline. One JSON line per measurement in OUT.
#
#   bench/cluster.sh [--duration S] [--rate R] [--members "1 3"] [--preload N]
#                    [--clients N] [--out FILE] [--bin-dir DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=10 RATE=600 MEMBERS="1 3" PRELOAD=10000 CLIENTS=32 OUT="" BIN_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --duration) DURATION=$2; shift 2;;
    --rate) RATE=$2; shift 2;;
    --members) MEMBERS=$2; shift 2;;
    --preload) PRELOAD=$2; shift 2;;
    --clients) CLIENTS=$2; shift 2;;
    --out) OUT=$2; shift 2;;
    --bin-dir) BIN_DIR=$2; shift 2;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
done
mkdir -p bench/results
OUT=${OUT:-bench/results/cluster-$(date +%Y%m%d-%H%M%S).jsonl}
BIN=${BIN_DIR:-target/release}
source bench/lib/run.sh
ensure_binaries
TOKEN=bench-token-0123456789abcdef0123456789
WORK=$(mktemp -d /tmp/tidegate-cluster.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; sleep 0.5; rm -rf "$WORK"; }
trap cleanup EXIT

emit() { # suite label: adds them to the JSON on stdin, appends it to OUT
  python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); d["suite"]=sys.argv[1]; d["label"]=sys.argv[2]; print(json.dumps(d))' "$1" "$2" \
    | tee -a "$OUT" | cut -c1-300
}

start_emulator churn; start_emulator live
CHURN_ADDR=$(emulator_addr churn); LIVE_ADDR=$(emulator_addr live)

TG_PIDS=()
start_tidegate() { # name store... -> sets PROXY and ADMIN (in this shell, so cleanup knows the pid)
  local name=$1; shift
  TIDEGATE_ADMIN_TOKEN=$TOKEN TIDEGATE_LOG=warn "$BIN/tidegate" serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 \
    --data-dir "$WORK/data-$name" --workers 1 "$@" > "$WORK/tg-$name.out" & PIDS+=($!); TG_PIDS+=($!)
  for _ in $(seq 200); do grep -q ready "$WORK/tg-$name.out" 2>/dev/null && break; sleep 0.05; done
  local line; line=$(head -1 "$WORK/tg-$name.out")
  PROXY=${line#*proxy=}; PROXY=${PROXY%% *}; ADMIN=${line#*admin=}; ADMIN=${ADMIN%% *}
}
stop_tidegates() { for p in "${TG_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; TG_PIDS=(); sleep 0.3; }
bench() { "$BIN/tidegate-bench" --token "$TOKEN" "$@"; }

# Propagation through A to A, B and C, with live traffic through B (or A alone).
propagation() { # suite label
  bench --admin "$A_ADMIN" --proxy "${B_PROXY:-$A_PROXY}" traffic --rate 500 --duration-s "$DURATION" --path / --expect-backend live > "$WORK/traffic.json" &
  local tp=$!
  bench --admin "$A_ADMIN" --proxy "$A_PROXY" churn --rate "$RATE" --duration-s "$DURATION" --service churnsvc \
    --expect-backend churn ${B_PROXY:+--also-proxy "$B_PROXY"} ${C_PROXY:+--also-proxy "$C_PROXY"} | emit "$1" "$2"
  wait $tp; emit "$1" "traffic-during-$2" < "$WORK/traffic.json"
}

setup() {
  bench --admin "$A_ADMIN" --proxy "$A_PROXY" setup --service live --backend "$LIVE_ADDR" > /dev/null
  bench --admin "$A_ADMIN" --proxy "$A_PROXY" setup --service churnsvc --backend "$CHURN_ADDR" --no-catch-all > /dev/null
}

# Baseline: the embedded store, one instance.
start_tidegate embedded; A_PROXY=$PROXY A_ADMIN=$ADMIN
B_PROXY="" C_PROXY=""
setup
propagation embedded "propagation-$RATE"
stop_tidegates

for n in $MEMBERS; do
  start_etcd "$n"
  store="etcd://$ENDPOINTS/bench?max_txn_ops=200000"
  start_tidegate "a$n" --store "$store" --instance-name a; A_PROXY=$PROXY A_ADMIN=$ADMIN
  start_tidegate "b$n" --store "$store" --instance-name b; B_PROXY=$PROXY B_ADMIN=$ADMIN
  start_tidegate "c$n" --store "$store" --instance-name c; C_PROXY=$PROXY C_ADMIN=$ADMIN
  setup
  propagation "etcd-$n" "propagation-$RATE"
  bench --admin "$A_ADMIN" saturate --clients "$CLIENTS" --duration-s "$DURATION" --service churnsvc --weight 0 | emit "etcd-$n" saturate-one
  sat=()
  for x in A B C; do
    admin_var="${x}_ADMIN"
    bench --admin "${!admin_var}" saturate --clients "$CLIENTS" --duration-s "$DURATION" --service churnsvc --weight 0 \
      > "$WORK/sat-$x.json" & sat+=($!)
  done
  wait "${sat[@]}"
  for x in A B C; do emit "etcd-$n" "saturate-all-$x" < "$WORK/sat-$x.json"; done
  bench --admin "$A_ADMIN" --proxy "$A_PROXY" setup --service churnsvc --backend "$CHURN_ADDR" --no-catch-all \
    --preload-services "$PRELOAD" --backends-per-service 10 --preload-routes "$PRELOAD" | emit "etcd-$n" preload
  propagation "etcd-$n" "loaded-propagation-$RATE"
  stop_tidegates
  stop_etcd
done
echo "results: $OUT"

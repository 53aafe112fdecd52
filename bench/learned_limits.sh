#!/usr/bin/env bash
# A closed loop against a freshly created service that learns its backends'
# limits: three tidegate-emulator backends of 1, 2 and 4 slots (exponential
# 20 ms jobs, backend queue 20), 500 users with an exponential think time of
# 1.8 s (0.77 of the 350 req/s capacity) for 10 s. Prints each backend's
# learned limit, requests in flight and no-load latency every 0.25 s, then
# the users' failures, p50, p99 and requests/s. To see how the estimator
# learns from nothing; run it several times: the first seconds vary.
#
#   bench/learned_limits.sh [--policy round_robin] [--bin-dir target/release]
set -euo pipefail
cd "$(dirname "$0")/.."
POLICY=round_robin BIN_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --policy) POLICY=$2; shift 2;;
    --bin-dir) BIN_DIR=$2; shift 2;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
done
BIN=${BIN_DIR:-target/release}
source bench/lib/run.sh
ensure_binaries
make_work tidegate-learn

declare -A ADDR
for spec in c1:1 c2:2 c4:4; do
  n=${spec%%:*}; s=${spec#*:}
  "$BIN/tidegate-emulator" --listen 127.0.0.1:0 --name "$n" --threads 1 --slots "$s" --queue 20 \
    --service-time exp:20ms > "$WORK/$n.out" & PIDS+=($!)
done
for n in c1 c2 c4; do
  for _ in $(seq 50); do grep -q listening "$WORK/$n.out" 2>/dev/null && break; sleep 0.05; done
  ADDR[$n]=$(emulator_addr "$n")
done
TOKEN=learn-token-0123456789abcdef0123456789abcdef
TIDEGATE_ADMIN_TOKEN=$TOKEN TIDEGATE_LOG=warn "$BIN/tidegate" serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 \
  --data-dir "$WORK/tg" > "$WORK/tg.out" & PIDS+=($!)
for _ in $(seq 100); do grep -q ready "$WORK/tg.out" 2>/dev/null && break; sleep 0.05; done
line=$(head -1 "$WORK/tg.out"); PROXY=${line#*proxy=}; PROXY=${PROXY%% *}; ADMIN=${line#*admin=}; ADMIN=${ADMIN%% *}
AUTH="Authorization: Bearer $TOKEN"
curl -sf -XPUT -H "$AUTH" "http://$ADMIN/v1/services/app" -d "{\"policy\": {\"kind\": \"$POLICY\"},
  \"concurrency\": {\"learn\": true}, \"queue\": {\"max\": 10000, \"timeout_ms\": 5000}, \"backends\": [
  {\"id\":\"c1\",\"addr\":\"${ADDR[c1]}\"},{\"id\":\"c2\",\"addr\":\"${ADDR[c2]}\"},{\"id\":\"c4\",\"addr\":\"${ADDR[c4]}\"}]}" >/dev/null
curl -sf -XPUT -H "$AUTH" "http://$ADMIN/v1/routes/app" -d '{"service":"app"}' >/dev/null
"$BIN/tidegate-bench" --proxy "$PROXY" --threads 2 --timeout-ms 10000 users --users 500 --duration-s 10 \
  --think-ms 1800 > "$WORK/users.json" &
users=$!
while kill -0 "$users" 2>/dev/null; do
  curl -sf -H "$AUTH" "http://$ADMIN/v1/status" | python3 -c '
import json, sys
s = json.load(sys.stdin)["services"]["app"]
print("queued %4d  " % s["queued"] + "  ".join("%s: limit %s in flight %s no-load %.1f ms" % (b["id"],
      b["concurrency_limit"], b["in_flight"], b["no_load_latency_ms"] or 0) for b in s["backends"]))'
  sleep 0.25
done
wait "$users"
python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); l = d["latency_us"]
print("failed %.2f %%  p50 %.1f ms  p99 %.1f ms  %.1f req/s" % (d["failure_pct"], l["p50"] / 1e3, l["p99"] / 1e3,
      d["requests_per_s"]))' "$WORK/users.json"

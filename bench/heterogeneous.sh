#!/usr/bin/env bash
# Paper S3's experiment: three backends of capacity 1:2:4 (tidegate-emulator:
# 1, 2 and 4 service slots, exponential service time, bounded queue that
# answers 503 when full), a closed loop of concurrent users, and every
# Tidegate policy next to nginx (round robin, weighted 1:2:4, least_conn,
# ip_hash) and HAProxy (roundrobin, leastconn, leastconn + maxconn), all in the
# same run against the same backends. Then, per variant, an open-loop Poisson
# sweep (tidegate-bench ramp --poisson) at fractions of the total capacity
# (7 slots / mean service time). Prints a table; writes JSON lines to OUT
# ("mode": "users" or "sweep").
#
#   bench/heterogeneous.sh [--users 500] [--think-ms 1800] [--duration 10] [--out FILE]
#                          [--sweep "0.5 0.8 0.95 1.05"] [--sweep-duration S] [--pause S]
#                          [--variants "tidegate-round_robin nginx-rr ..."] [--bin-dir DIR] [--port-base N]
#                          [--no-halve]
# Variants: tidegate-default (no policy named), tidegate-P and
# tidegate-P+learned for every policy P (without and with learned
# concurrency limits), tidegate-round_robin-weighted,
# tidegate-least_conn-max_conns, nginx-*, haproxy-*; then the runs in which
# c4's capacity halves mid-run (*-halved; skipped with --no-halve).
set -euo pipefail
cd "$(dirname "$0")/.."
USERS=500 THINK=1800 DURATION=10 SERVICE="exp:20ms" QUEUE=20 OUT=""
SWEEP="0.5 0.8 0.95 1.05" SWEEP_DURATION="" PAUSE=1 VARIANTS="" BIN_DIR="" PORT_BASE=19300 HALVE=1
while [ $# -gt 0 ]; do
  case "$1" in
    --sweep) SWEEP=$2; shift 2;;
    --sweep-duration) SWEEP_DURATION=$2; shift 2;;
    --pause) PAUSE=$2; shift 2;;
    --no-halve) HALVE=""; shift;;
    --variants) VARIANTS=$2; shift 2;;
    --bin-dir) BIN_DIR=$2; shift 2;;
    --port-base) PORT_BASE=$2; shift 2;;
    --users) USERS=$2; shift 2;;
    --think-ms) THINK=$2; shift 2;;
    --duration) DURATION=$2; shift 2;;
    --service-time) SERVICE=$2; shift 2;;
    --queue) QUEUE=$2; shift 2;;
    --out) OUT=$2; shift 2;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
done
mkdir -p bench/results
OUT=${OUT:-bench/results/heterogeneous-$(date +%Y%m%d-%H%M%S).jsonl}
SWEEP_DURATION=${SWEEP_DURATION:-$DURATION}
export PATH=$PATH:/usr/sbin
command -v nginx >/dev/null && command -v haproxy >/dev/null || {
  apt-get update -qq && RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx haproxy; }
BIN=${BIN_DIR:-target/release}
source bench/lib/run.sh
ensure_binaries
wanted() { [ -z "$VARIANTS" ] || [[ " $VARIANTS " == *" $1 "* ]]; }
make_work tidegate-s3

declare -A ADDR
for spec in c1:1 c2:2 c4:4; do
  name=${spec%%:*}; slots=${spec#*:}
  "$BIN/tidegate-emulator" --listen 127.0.0.1:0 --name "$name" --threads 1 --slots "$slots" \
    --queue "$QUEUE" --service-time "$SERVICE" --orca > "$WORK/$name.out" & PIDS+=($!)
done
for name in c1 c2 c4; do
  for _ in $(seq 50); do grep -q listening "$WORK/$name.out" 2>/dev/null && break; sleep 0.05; done
  ADDR[$name]=$(sed 's/listening on //' "$WORK/$name.out")
done

# nginx: one instance per variant, each on its own port. A 503 (queue full)
# goes to the next server (as HAProxy's retry-on 503); max_fails=0 keeps nginx
# from counting those 503s as server failures and disabling servers.
port=$PORT_BASE
declare -A PEER_PORT
nginx_variant() { # name upstream-options server-suffix-c1 c2 c4
  local name=$1 opts=$2; port=$((port + 1)); PEER_PORT[$name]=$port
  cat > "$WORK/$name.conf" <<CONF
worker_processes 2; daemon off; pid $WORK/$name.pid; error_log $WORK/$name.err warn;
events { worker_connections 4096; }
http { access_log off;
  upstream app { $opts server ${ADDR[c1]} max_fails=0 $3; server ${ADDR[c2]} max_fails=0 $4;
    server ${ADDR[c4]} max_fails=0 $5; keepalive 256; }
  server { listen 127.0.0.1:$port; location / { proxy_pass http://app; proxy_http_version 1.1;
    proxy_set_header Connection ""; proxy_next_upstream error timeout http_503; } } }
CONF
  nginx -c "$WORK/$name.conf" & PIDS+=($!)
}
nginx_variant nginx-rr "" "" "" ""
nginx_variant nginx-weighted "" "weight=1" "weight=2" "weight=4"
nginx_variant nginx-least_conn "least_conn;" "" "" ""
nginx_variant nginx-ip_hash "ip_hash;" "" "" ""

# HAProxy: one process, a frontend per variant.
{
  echo "global"; echo "  nbthread 2"; echo "  maxconn 8000"
  echo "defaults"; echo "  mode http"; echo "  timeout connect 5s"; echo "  timeout client 30s"
  echo "  timeout server 30s"; echo "  timeout queue 5s"; echo "  option http-keep-alive"; echo "  http-reuse always"
  echo "  retry-on conn-failure response-timeout 503"; echo "  retries 2"; echo "  option redispatch"
  for v in "haproxy-roundrobin:roundrobin:" "haproxy-leastconn:leastconn:" "haproxy-leastconn-maxconn:leastconn:maxconn"; do
    IFS=: read -r name algo extra <<<"$v"; port=$((port + 1)); PEER_PORT[$name]=$port
    echo "frontend f-$name"; echo "  bind 127.0.0.1:$port"; echo "  default_backend b-$name"
    echo "backend b-$name"; echo "  balance $algo"
    for s in c1:1 c2:2 c4:4; do
      n=${s%%:*}; slots=${s#*:}
      if [ -n "$extra" ]; then echo "  server $n ${ADDR[$n]} maxconn $slots"; else echo "  server $n ${ADDR[$n]}"; fi
    done
  done
} > "$WORK/haproxy.cfg"
haproxy -f "$WORK/haproxy.cfg" -db > /dev/null 2>&1 & PIDS+=($!)

TIDEGATE_ADMIN_TOKEN=bench-token-0123456789abcdef0123456789 TIDEGATE_LOG=warn "$BIN/tidegate" serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 \
  --data-dir "$WORK/tg" > "$WORK/tg.out" & PIDS+=($!)
for _ in $(seq 100); do grep -q ready "$WORK/tg.out" 2>/dev/null && break; sleep 0.05; done
line=$(head -1 "$WORK/tg.out"); TG_PROXY=${line#*proxy=}; TG_PROXY=${TG_PROXY%% *}; TG_ADMIN=${line#*admin=}; TG_ADMIN=${TG_ADMIN%% *}
sleep 0.5

TG_AUTH="Authorization: Bearer bench-token-0123456789abcdef0123456789"
tg_policy() { # settings-json (policy, concurrency) weights(c1 c2 c4) [max_conns(c1 c2 c4)]
  local w=($2) m=(${3:-})
  local lim=("" "" "")
  if [ ${#m[@]} -eq 3 ]; then lim=(",\"max_conns\":${m[0]}" ",\"max_conns\":${m[1]}" ",\"max_conns\":${m[2]}"); fi
  # A new service per variant: nothing learned by the previous one carries over.
  curl -s -XDELETE -H "$TG_AUTH" "http://$TG_ADMIN/v1/routes/app" > /dev/null
  curl -s -XDELETE -H "$TG_AUTH" "http://$TG_ADMIN/v1/services/app" > /dev/null
  curl -sf -XPUT -H "$TG_AUTH" "http://$TG_ADMIN/v1/services/app" -d "{$1
    \"queue\": {\"max\": 10000, \"timeout_ms\": 5000},
    \"backends\": [{\"id\":\"c1\",\"addr\":\"${ADDR[c1]}\",\"weight\":${w[0]}${lim[0]}},
                   {\"id\":\"c2\",\"addr\":\"${ADDR[c2]}\",\"weight\":${w[1]}${lim[1]}},
                   {\"id\":\"c4\",\"addr\":\"${ADDR[c4]}\",\"weight\":${w[2]}${lim[2]}}]}" > /dev/null
  curl -sf -XPUT -H "$TG_AUTH" "http://$TG_ADMIN/v1/routes/app" -d '{"service":"app"}' > /dev/null
}

# Total capacity in requests/s: 7 slots over the mean service time.
CAPACITY=$(python3 -c 'import re,sys; m=re.search(r"([\d.]+)(us|ms|s)", sys.argv[1]); \
  print(7 / (float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1}[m.group(2)]))' "$SERVICE")

run() { # label proxy-addr
  wanted "$1" || return 0
  sleep "$PAUSE"  # let backend queues drain between runs
  "$BIN/tidegate-bench" --proxy "$2" --threads 2 --timeout-ms 10000 users --users "$USERS" \
    --duration-s "$DURATION" --think-ms "$THINK" \
  | python3 -c 'import json,sys; d=json.load(sys.stdin); d["label"]=sys.argv[1]; d["mode"]="users"; print(json.dumps(d))' "$1" | tee -a "$OUT" > /dev/null
  python3 - "$OUT" <<'PY'
import json, sys
d = [json.loads(l) for l in open(sys.argv[1])][-1]
lat = d["latency_us"]; share = d["share"]; total = sum(share.values()) or 1
print(f'{d["label"]:28} fail {d["failure_pct"]:6.2f}%  p50 {lat["p50"]/1e3:7.1f}  p99 {lat["p99"]/1e3:7.1f}  max {lat["max"]/1e3:7.1f} ms  '
      f'rps {d["requests_per_s"]:6.0f}  share ' + " ".join(f'{k}:{v*100/total:4.1f}%' for k, v in sorted(share.items())))
PY
  for load in $SWEEP; do
    sleep "$PAUSE"
    local rate; rate=$(python3 -c 'import sys; print(round(float(sys.argv[1]) * float(sys.argv[2]), 1))' "$load" "$CAPACITY")
    "$BIN/tidegate-bench" --proxy "$2" --threads 2 --timeout-ms 10000 ramp --poisson --steps "$rate:$SWEEP_DURATION" \
    | python3 -c '
import json, sys
d = json.load(sys.stdin); t = d["total"]; n = t["planned"] or 1
row = {"label": sys.argv[1], "mode": "sweep", "load": float(sys.argv[2]), "rate": float(sys.argv[3]),
       "requests": t["planned"], "ok": t["ok"], "failed": t["failed"] + t["missing"],
       "failure_pct": round((t["failed"] + t["missing"]) * 100 / n, 3), "latency_us": t["latency_us"],
       "outcomes": t["outcomes"], "share": t["share"], "sending": d["sending"]}
print(json.dumps(row))
lat = row["latency_us"]
print("%-28s load %4.2f (%5.0f/s) fail %6.2f%%  p50 %7.1f  p99 %7.1f  max %7.1f ms" % (row["label"], row["load"],
      row["rate"], row["failure_pct"], lat["p50"] / 1e3, lat["p99"] / 1e3, lat["max"] / 1e3), file=sys.stderr)
' "$1" "$load" "$rate" >> "$OUT"
  done
}

# One closed-loop run in which c4 loses half its slots (4 -> 2) halfway
# through (the emulator's runtime control), restored afterwards. For
# Tidegate, how long until c4's learned limit is at most 3 (1.5 x 2 slots).
run_halved() { # label proxy-addr
  wanted "$1" || return 0
  sleep "$PAUSE"
  "$BIN/tidegate-bench" --proxy "$2" --threads 2 --timeout-ms 10000 users --users "$USERS" \
    --duration-s "$DURATION" --think-ms "$THINK" > "$WORK/halved.json" &
  local users=$!
  sleep "$(python3 -c "print($DURATION / 2)")"
  curl -sf -XPOST "http://${ADDR[c4]}/_emulator/slots?n=2" > /dev/null
  local t0 follow="null"; t0=$(date +%s.%N)
  if [[ $1 == tidegate* ]]; then
    for _ in $(seq 80); do
      limit=$(curl -sf -H "$TG_AUTH" "http://$TG_ADMIN/v1/status" | python3 -c '
import json, sys
b = [b for b in json.load(sys.stdin)["services"]["app"]["backends"] if b["id"] == "c4"][0]
print(b["concurrency_limit"] if b["concurrency_limit"] is not None else 99999)')
      if [ "$limit" -le 3 ]; then follow=$(python3 -c "print(round($(date +%s.%N) - $t0, 2))"); break; fi
      sleep 0.25
    done
  fi
  wait "$users"
  curl -sf -XPOST "http://${ADDR[c4]}/_emulator/slots?n=4" > /dev/null
  python3 -c '
import json, sys
d = json.load(open(sys.argv[1])); d["label"] = sys.argv[2]; d["mode"] = "halve"
d["limit_follow_s"] = None if sys.argv[3] == "null" else float(sys.argv[3])
print(json.dumps(d))
lat = d["latency_us"]
print("%-28s c4 halved mid-run: fail %6.2f%%  p99 %7.1f ms  limit followed in %s s" % (d["label"], d["failure_pct"],
      lat["p99"] / 1e3, sys.argv[3]), file=sys.stderr)' "$WORK/halved.json" "$1" "$follow" >> "$OUT"
}

echo "S3: capacities 1:2:4 (slots), service $SERVICE, queue $QUEUE, $USERS users, think ${THINK} ms, ${DURATION}s per run; sweep ${SWEEP:-none} x ${CAPACITY} req/s"
# tidegate-P: policy P alone; tidegate-P+learned: with learned concurrency
# limits; tidegate-default: a service that names no policy (the defaults).
if wanted tidegate-default; then
  tg_policy '' "1 1 1"; run "tidegate-default" "$TG_PROXY"
fi
for p in round_robin least_conn least_time p2c_ewma dynamic_feedback ip_hash prequal; do
  if wanted "tidegate-$p"; then
    tg_policy "\"policy\": {\"kind\":\"$p\"}, \"concurrency\": {\"learn\": false}," "1 1 1"; run "tidegate-$p" "$TG_PROXY"
  fi
  if wanted "tidegate-$p+learned"; then
    tg_policy "\"policy\": {\"kind\":\"$p\"}, \"concurrency\": {\"learn\": true}," "1 1 1"
    run "tidegate-$p+learned" "$TG_PROXY"
  fi
done
# The paper's policy with its weights recomputed every 100 ms instead of
# every 500 ms (the refresh tick's floor), without learned limits.
if wanted tidegate-dynamic_feedback-100ms; then
  tg_policy '"policy": {"kind":"dynamic_feedback","interval_ms":100}, "concurrency": {"learn": false},' "1 1 1"
  run "tidegate-dynamic_feedback-100ms" "$TG_PROXY"
fi
if wanted tidegate-round_robin-weighted; then
  tg_policy '"policy": {"kind":"round_robin"}, "concurrency": {"learn": false},' "1 2 4"
  run "tidegate-round_robin-weighted" "$TG_PROXY"
fi
if wanted tidegate-least_conn-max_conns; then
  tg_policy '"policy": {"kind":"least_conn"}, "concurrency": {"learn": false},' "1 1 1" "1 2 4"
  run "tidegate-least_conn-max_conns" "$TG_PROXY"
fi
for name in nginx-rr nginx-weighted nginx-least_conn nginx-ip_hash haproxy-roundrobin haproxy-leastconn haproxy-leastconn-maxconn; do
  run "$name" "127.0.0.1:${PEER_PORT[$name]}"
done
# Capacity that changes at run time: the defaults, and the oracles told the
# old capacities.
if [ -n "$HALVE" ]; then
  if wanted tidegate-default-halved; then tg_policy '' "1 1 1"; run_halved tidegate-default-halved "$TG_PROXY"; fi
  run_halved nginx-weighted-halved "127.0.0.1:${PEER_PORT[nginx-weighted]}"
  run_halved haproxy-leastconn-maxconn-halved "127.0.0.1:${PEER_PORT[haproxy-leastconn-maxconn]}"
fi
echo "results: $OUT"

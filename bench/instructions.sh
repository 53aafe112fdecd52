#!/usr/bin/env bash
# User-space instructions per proxied request, counted by callgrind: one
# or more Tidegate binaries and nginx, each proxying sequential keep-alive
# GETs (one connection, one request at a time) to one backend emulator.
# Unlike requests/s on a shared 2-core machine, the count barely moves
# between runs (a few instructions per request), so it tells a change's
# CPU cost apart from the machine's noise. It is not time: the kernel's
# work (the syscalls) is not counted, and under callgrind everything runs
# about 50 times slower. Tidegate runs with one worker, nginx with one
# process (`master_process off`); the counts cover every thread of the
# process, from after a warm-up to the last measured request.
#
#   bench/instructions.sh [TIDEGATE_BINARY...] [--requests 2000] [--cache]
#                         [--path /rr] [--no-nginx] [--users N [--duration S]] [--rules]
#                         [--bin-dir DIR] [--keep DIR]
#
# --keep DIR: keeps each measured profile as DIR/callgrind.out.NAME, for
# callgrind_annotate.
#
# --bin-dir DIR: the emulator (and, without a binary, tidegate) from DIR
# instead of target/release (built when missing).
#
# --rules: Tidegate also gets issue 37's typical rule chain on `/api`
# (`--path /api/x` measures it; nginx always has the same chain on /api/:
# allow/deny, limit_req, proxy_pass with the prefix replaced, two
# proxy_set_header, add_header).
#
# --users N: instead of sequential requests, N concurrent keep-alive
# connections (`tidegate-bench users`, a closed loop) for S seconds (10);
# counts per answered request, so the per-connection state of N
# connections is in the cache simulation. Under callgrind the proxy is the
# bottleneck, so most of the N requests wait in it or in the kernel.
#
# --cache: also simulate the caches (callgrind's --cache-sim): first-level
# instruction and data misses per request (I1mr, D1mr + D1mw) and
# last-level misses (ILmr + DLmr + DLmw), for the
# host's cache sizes and with nothing else running, so the misses of a
# request's own footprint only.
# Without a binary: target/release/tidegate. Needs valgrind (apt-get
# install valgrind when missing) and nginx.
set -euo pipefail
cd "$(dirname "$0")/.."
BINS=() REQUESTS=2000 CACHE="" PATHQ=/rr NGINX=1 USERS=0 DURATION=10 RULES="" KEEP=""
while [ $# -gt 0 ]; do
  case "$1" in
    --requests) REQUESTS=$2; shift 2;;
    --cache) CACHE=--cache-sim=yes; shift;;
    --path) PATHQ=$2; shift 2;;
    --no-nginx) NGINX=""; shift;;
    --rules) RULES=1; shift;;
    --bin-dir) BIN_OVERRIDE=$2; shift 2;;
    --keep) KEEP=$2; shift 2;;
    --users) USERS=$2; shift 2;;
    --duration) DURATION=$2; shift 2;;
    -*) echo "unknown option $1" >&2; exit 2;;
    *) BINS+=("$1"); shift;;
  esac
done
[ ${#BINS[@]} -gt 0 ] || BINS=("${BIN_OVERRIDE:-target/release}/tidegate")
export PATH=$PATH:/usr/sbin
command -v valgrind >/dev/null && { [ -z "$NGINX" ] || command -v nginx >/dev/null; } || {
  apt-get update -qq && RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind nginx; }
BIN=target/release BIN_DIR=""
if [ -n "${BIN_OVERRIDE:-}" ]; then BIN=$BIN_OVERRIDE BIN_DIR=$BIN_OVERRIDE; fi
source bench/lib/run.sh
ensure_binaries
make_work tidegate-instructions

start_emulator app
EMU=$(emulator_addr app)
sequential() { # addr requests
  "$BIN/tidegate-bench" --threads 1 --timeout-ms 30000 --proxy "$1" sequential --requests "$2" --warmup 0 \
    --path "$PATHQ" > "$WORK/seq.json"
  python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); sys.exit(1 if r["failed"] else 0)' "$WORK/seq.json" ||
    { echo "requests failed through $1" >&2; exit 1; }
}
# N concurrent users through ADDR for SECONDS; prints the requests
# answered (exits if any failed).
users() { # addr seconds
  "$BIN/tidegate-bench" --threads 1 --timeout-ms 60000 --proxy "$1" users --users "$USERS" --duration-s "$2" \
    --path "$PATHQ" > "$WORK/users.json"
  python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); sys.exit(1) if r["failed"] else print(r["ok"])' \
    "$WORK/users.json" || { echo "requests failed through $1" >&2; exit 1; }
}
# Zeroes the counters of callgrind process PID after a warm-up through
# ADDR, sends the measured requests, dumps, and prints one result line.
measure() { # name pid addr
  local n=$REQUESTS
  if [ "$USERS" -gt 0 ]; then
    users "$3" 3 >/dev/null
    callgrind_control -z "$2" >/dev/null 2>&1
    n=$(users "$3" "$DURATION")
  else
    sequential "$3" 300
    callgrind_control -z "$2" >/dev/null 2>&1
    sequential "$3" "$REQUESTS"
  fi
  callgrind_control -d "$2" >/dev/null 2>&1
  local dump; dump=$(ls -t "$WORK"/cg."$1".* | head -1)
  [ -z "$KEEP" ] || cp "$dump" "$KEEP/callgrind.out.$1"
  python3 - "$1" "$dump" "$n" <<'PY'
import sys
name, dump, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
events = totals = None
for line in open(dump):
    if line.startswith("events:"):
        events = line.split()[1:]
    elif line.startswith(("summary:", "totals:")):
        totals = [int(x) for x in line.split()[1:]]
        break
v = dict(zip(events, totals))
out = f"{name:<28} {v['Ir'] / n:9,.0f} instructions/request"
if "I1mr" in v:
    out += f"  I1 misses {v['I1mr'] / n:7,.1f}  D1 misses {(v['D1mr'] + v['D1mw']) / n:6,.1f}"
    out += f"  LL misses {(v['ILmr'] + v['DLmr'] + v['DLmw']) / n:6,.1f}"
out += f"  ({n:,} requests)"
print(out)
PY
}

for b in "${BINS[@]}"; do
  name=$(basename "$b"); dir="$WORK/tg-$name"
  # shellcheck disable=SC2086 # $CACHE: empty or one flag
  TIDEGATE_ADMIN_TOKEN=$BENCH_TOKEN TIDEGATE_LOG=warn valgrind --tool=callgrind $CACHE \
    --callgrind-out-file="$WORK/cg.$name.%p" "$b" serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 --workers 1 \
    --data-dir "$dir" > "$WORK/$name.out" 2> "$WORK/$name.err" &
  pid=$!; PIDS+=("$pid")
  for _ in $(seq 600); do grep -q ready "$WORK/$name.out" 2>/dev/null && break; sleep 0.1; done
  line=$(head -1 "$WORK/$name.out")
  proxy=${line#*proxy=}; proxy=${proxy%% *}; admin=${line#*admin=}; admin=${admin%% *}
  curl -sf -XPUT -H "Authorization: Bearer $BENCH_TOKEN" "http://$admin/v1/services/rr" \
    -d "{\"policy\":{\"kind\":\"round_robin\"},\"backends\":[{\"id\":\"app\",\"addr\":\"$EMU\"}]}" >/dev/null
  curl -sf -XPUT -H "Authorization: Bearer $BENCH_TOKEN" "http://$admin/v1/routes/rr" \
    -d '{"match":{"path_prefix":"/"},"service":"rr"}' >/dev/null
  if [ -n "$RULES" ]; then
    # Issue 37's typical chain on /api/ (bench/lib/rules.py's TYPICAL_STEPS).
    curl -sf -XPOST -H "Authorization: Bearer $BENCH_TOKEN" "http://$admin/v1/changes" -d '{"ops":[
      {"op":"put_rules","name":"typical","spec":{"steps":[
        {"kind":"ip_allow","cidrs":["127.0.0.0/8"]},
        {"kind":"rate_limit","key":"client_ip","rate_per_s":1000000,"burst":1000000},
        {"kind":"strip_prefix","prefix":"/api"},
        {"kind":"set_request_header","name":"X-A","value":"1"},
        {"kind":"set_request_header","name":"X-B","value":"2"},
        {"kind":"set_response_header","name":"Strict-Transport-Security","value":"max-age=63072000; includeSubDomains"}]}},
      {"op":"put_route","name":"api","spec":{"match":{"path_prefix":"/api"},"service":"rr","rules":["typical"]}}]}' >/dev/null
  fi
  measure "$name" "$pid" "$proxy"
  kill "$pid"; wait "$pid" 2>/dev/null || true
done

if [ -n "$NGINX" ]; then
  port=$(free_port)
  cat > "$WORK/nginx.conf" <<CONF
worker_processes 1; master_process off; daemon off; pid $WORK/nginx.pid; error_log $WORK/nginx.err warn;
events { worker_connections 4096; }
http { access_log off; keepalive_requests 1000000;
  upstream app { server $EMU; keepalive 256; }
  limit_req_zone \$binary_remote_addr zone=typical:10m rate=1000000r/s;
  server { listen 127.0.0.1:$port;
    location / { proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection ""; }
    # The typical chain's equivalent (measured with --rules --path /api/x).
    location /api/ { allow 127.0.0.0/8; deny all; limit_req zone=typical burst=1000000 nodelay;
      proxy_pass http://app/; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_set_header X-A 1; proxy_set_header X-B 2;
      add_header Strict-Transport-Security "max-age=63072000; includeSubDomains" always; } } }
CONF
  # shellcheck disable=SC2086
  valgrind --tool=callgrind $CACHE --callgrind-out-file="$WORK/cg.nginx.%p" nginx -c "$WORK/nginx.conf" \
    > "$WORK/nginx.out" 2>&1 &
  pid=$!; PIDS+=("$pid")
  for _ in $(seq 600); do curl -s -o /dev/null "http://127.0.0.1:$port$PATHQ" && break; sleep 0.1; done
  measure nginx "$pid" "127.0.0.1:$port"
fi

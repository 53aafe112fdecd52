#!/usr/bin/env bash
# A/B of two Tidegate binaries on the data plane: the same three backends
# (one nginx serving a 13-byte body on three ports), each binary with 2
# workers and a catch-all route, wrk -t2 closed loop, runs alternated
# (A, B, B, A, ...), medians and the ratio B / A per concurrency. For
# telling a regression from the machine's run-to-run spread: the two
# binaries share every run's conditions.
#
#   bench/ab.sh A_BINARY B_BINARY [--reps 5] [--duration 8] [--conns "64 500"]
#               [--spec-a 'JSON fields,' --spec-b 'JSON fields,'] [--args-b "serve flags"]
#               [-- extra serve args for both]
#
# --spec-a/--spec-b: extra fields of the service for A or B (such as
# '"concurrency": {"learn": false},'), to compare two settings of one binary;
# --args-b: extra serve flags for B only (such as "--access-log /tmp/x.log").
set -euo pipefail
cd "$(dirname "$0")/.."
A=$1 B=$2; shift 2
REPS=5 DURATION=8 CONNS="64 500" EXTRA=() SPEC_A="" SPEC_B="" ARGS_B=""
while [ $# -gt 0 ]; do
  case "$1" in
    --reps) REPS=$2; shift 2;;
    --duration) DURATION=$2; shift 2;;
    --conns) CONNS=$2; shift 2;;
    --spec-a) SPEC_A=$2; shift 2;;
    --spec-b) SPEC_B=$2; shift 2;;
    --args-b) ARGS_B=$2; shift 2;;
    --) shift; EXTRA=("$@"); break;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
done
export PATH=$PATH:/usr/sbin
command -v nginx >/dev/null && command -v wrk >/dev/null || {
  apt-get update -qq && RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx wrk; }
source bench/lib/run.sh
WORK=$(mktemp -d /tmp/tidegate-ab.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}" $(cat "$WORK"/*.pid 2>/dev/null); do kill "$p" 2>/dev/null || true; done
  sleep 0.3; rm -rf "$WORK"
}
trap cleanup EXIT

P1=$(free_port) P2=$(free_port) P3=$(free_port)
cat > "$WORK/backends.conf" <<CONF
worker_processes 1; daemon off; pid $WORK/nginx.pid; error_log $WORK/nginx.err warn;
events { worker_connections 8192; }
http { access_log off; keepalive_requests 1000000;
  server { listen 127.0.0.1:$P1; listen 127.0.0.1:$P2; listen 127.0.0.1:$P3;
           location / { return 200 "hello, world\n"; } } }
CONF
nginx -c "$WORK/backends.conf" & PIDS+=($!)
TOKEN=ab-token-0123456789abcdef0123456789abcdef
start() { # binary name spec [serve flags] -> proxy address (runs in a subshell: its pid goes to a file)
  # shellcheck disable=SC2086 # $4: flags, split on purpose
  TIDEGATE_ADMIN_TOKEN=$TOKEN TIDEGATE_LOG=warn "$1" serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 \
    --workers 2 --data-dir "$WORK/$2" "${EXTRA[@]}" ${4:-} > "$WORK/$2.out" 2> "$WORK/$2.err" &
  echo $! > "$WORK/$2.pid"
  for _ in $(seq 100); do grep -q ready "$WORK/$2.out" 2>/dev/null && break; sleep 0.05; done
  local line; line=$(head -1 "$WORK/$2.out")
  local proxy=${line#*proxy=}; proxy=${proxy%% *}; local admin=${line#*admin=}; admin=${admin%% *}
  curl -sf -XPUT -H "Authorization: Bearer $TOKEN" "http://$admin/v1/services/web" -d "{$3 \"backends\": [
    {\"id\":\"a\",\"addr\":\"127.0.0.1:$P1\"},{\"id\":\"b\",\"addr\":\"127.0.0.1:$P2\"},{\"id\":\"c\",\"addr\":\"127.0.0.1:$P3\"}]}" >/dev/null
  curl -sf -XPUT -H "Authorization: Bearer $TOKEN" "http://$admin/v1/routes/web" -d '{"service":"web"}' >/dev/null
  echo "$proxy"
}
PA=$(start "$A" a "$SPEC_A") PB=$(start "$B" b "$SPEC_B" "$ARGS_B")
run() { # addr conns -> req/s
  wrk -t2 -c"$2" -d"${DURATION}s" "http://$1/" 2>/dev/null | awk '/Requests\/sec/ {print $2}'
}
echo "A=$A ${SPEC_A:+($SPEC_A) }B=$B ${SPEC_B:+($SPEC_B) }${ARGS_B:+($ARGS_B) }reps=$REPS duration=${DURATION}s"
for c in $CONNS; do
  run "$PA" "$c" >/dev/null; run "$PB" "$c" >/dev/null  # warm both
  : > "$WORK/a.$c"; : > "$WORK/b.$c"
  for i in $(seq "$REPS"); do
    if [ $((i % 2)) -eq 1 ]; then first=a; second=b; else first=b; second=a; fi
    for who in $first $second; do
      addr=$PA; [ $who = b ] && addr=$PB
      r=$(run "$addr" "$c"); echo "$r" >> "$WORK/$who.$c"
      echo "  c=$c rep $i $who $r req/s"
    done
  done
  python3 - "$WORK/a.$c" "$WORK/b.$c" "$c" <<'PY'
import statistics, sys
a = [float(x) for x in open(sys.argv[1]) if x.strip()]
b = [float(x) for x in open(sys.argv[2]) if x.strip()]
ma, mb = statistics.median(a), statistics.median(b)
print(f"c={sys.argv[3]}: A median {ma:,.0f} req/s, B median {mb:,.0f} req/s, B/A {mb / ma:.3f}")
PY
done

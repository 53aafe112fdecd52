#!/usr/bin/env bash
# What an access log costs, in Tidegate and in nginx, in the same run:
# each proxy twice (log off, log on to a file in /tmp), 2 workers each,
# in front of the same three nginx backends; wrk -t2, repetitions
# alternated, medians of requests/s. nginx writes the combined format
# with `buffer=64k` (the usual production setting); Tidegate its JSON
# lines (--access-log-format json, the richer of its two formats).
#
#   bench/access_log.sh [--bin target/release/tidegate] [--reps 5] [--duration 6] [--conns "64 500"]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=target/release/tidegate REPS=5 DURATION=6 CONNS="64 500"
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) BIN=$2; shift 2;;
    --reps) REPS=$2; shift 2;;
    --duration) DURATION=$2; shift 2;;
    --conns) CONNS=$2; shift 2;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
done
source bench/lib/run.sh
make_work tidegate-accesslog

start_nginx_backends

declare -A ADDR
nginx_proxy() { # name access_log-directive
  local port; port=$(free_port)
  cat > "$WORK/$1.conf" <<CONF
worker_processes 2; daemon off; pid $WORK/$1.nginx.pid; error_log $WORK/$1.err warn;
events { worker_connections 8192; }
http { $2 keepalive_requests 1000000;
  upstream b { server 127.0.0.1:$P1; server 127.0.0.1:$P2; server 127.0.0.1:$P3; keepalive 256; }
  server { listen 127.0.0.1:$port; location / { proxy_pass http://b; proxy_http_version 1.1;
           proxy_set_header Connection ""; } } }
CONF
  nginx -c "$WORK/$1.conf" & PIDS+=($!)
  ADDR[$1]=127.0.0.1:$port
}
nginx_proxy nginx-off "access_log off;"
nginx_proxy nginx-on "access_log $WORK/nginx-access.log combined buffer=64k;"
ADDR[tidegate-off]=$(start_tidegate_web "$BIN" tidegate-off)
ADDR[tidegate-on]=$(start_tidegate_web "$BIN" tidegate-on "" "--access-log $WORK/tidegate-access.log --access-log-format json")
sleep 0.5
NAMES="tidegate-off tidegate-on nginx-off nginx-on"
run() { wrk -t2 -c"$2" -d"${DURATION}s" "http://$1/" 2>/dev/null | awk '/Requests\/sec/ {print $2}'; }
echo "bin=$BIN reps=$REPS duration=${DURATION}s"
for c in $CONNS; do
  for n in $NAMES; do run "${ADDR[$n]}" "$c" > /dev/null; done # warm every one
  for n in $NAMES; do : > "$WORK/$n.$c"; done
  for i in $(seq "$REPS"); do
    # Rotate the order so that no proxy always runs first.
    order=$(echo $NAMES | tr ' ' '\n' | awk -v s="$i" '{a[NR]=$0} END {for (k = 0; k < NR; k++) print a[(k + s) % NR + 1]}')
    for n in $order; do
      r=$(run "${ADDR[$n]}" "$c"); echo "$r" >> "$WORK/$n.$c"
      echo "  c=$c rep $i $n $r req/s"
    done
  done
  python3 - "$WORK" "$c" <<'PY'
import statistics, sys
work, c = sys.argv[1], sys.argv[2]
m = {n: statistics.median(float(x) for x in open(f"{work}/{n}.{c}") if x.strip())
     for n in ("tidegate-off", "tidegate-on", "nginx-off", "nginx-on")}
print(f"c={c}: Tidegate {m['tidegate-off']:,.0f} -> {m['tidegate-on']:,.0f} req/s with the log "
      f"({m['tidegate-on'] / m['tidegate-off']:.3f}); nginx {m['nginx-off']:,.0f} -> {m['nginx-on']:,.0f} "
      f"({m['nginx-on'] / m['nginx-off']:.3f}); Tidegate / nginx, both logging: {m['tidegate-on'] / m['nginx-on']:.3f}")
PY
done
wc -l "$WORK"/*access.log | sed 's/^/  /'

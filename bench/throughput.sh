#!/usr/bin/env bash
# Proxy throughput, Tidegate vs nginx vs HAProxy (paper S2's setup, scaled to
# this machine): three backends (one nginx process serving a fixed 13-byte body
# on three ports), each proxy with the same worker count, wrk closed loop at
# each concurrency, runs alternated, REPS repetitions; prints one line per run
# and a median summary. Everything on 127.0.0.1; every process it starts is
# stopped at exit.
#
#   bench/throughput.sh [--reps N] [--duration S] [--conns "64 256"] [--workers N]
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=3 DURATION=10 CONNS="64 256" WORKERS=2 OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --reps) REPS=$2; shift 2;;
    --duration) DURATION=$2; shift 2;;
    --conns) CONNS=$2; shift 2;;
    --workers) WORKERS=$2; shift 2;;
    --out) OUT=$2; shift 2;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
done
for tool in nginx haproxy wrk; do
  command -v $tool >/dev/null || PATH=$PATH:/usr/sbin
  command -v $tool >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx haproxy wrk; break; }
done
TG=${TIDEGATE_BIN:-target/release/tidegate}
[ -x "$TG" ] || cargo build --release -p tidegate
WORK=$(mktemp -d /tmp/tidegate-bench.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; sleep 0.3; rm -rf "$WORK"; }
trap cleanup EXIT

B1=19101 B2=19102 B3=19103 P_NGINX=19180 P_HAPROXY=19181 P_TG=19182 A_TG=19190
cat > "$WORK/backends.conf" <<CONF
worker_processes 2;
daemon off; pid $WORK/backends.pid; error_log $WORK/backends.err warn;
events { worker_connections 8192; }
http { access_log off; keepalive_requests 1000000;
  server { listen 127.0.0.1:$B1 reuseport; listen 127.0.0.1:$B2 reuseport; listen 127.0.0.1:$B3 reuseport;
    location / { return 200 "hello world!\n"; } } }
CONF
cat > "$WORK/nginx.conf" <<CONF
worker_processes $WORKERS;
daemon off; pid $WORK/nginx.pid; error_log $WORK/nginx.err warn;
events { worker_connections 16384; }
http { access_log off; keepalive_requests 1000000;
  upstream app { server 127.0.0.1:$B1; server 127.0.0.1:$B2; server 127.0.0.1:$B3; keepalive 256; }
  server { listen 127.0.0.1:$P_NGINX reuseport;
    location / { proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection ""; } } }
CONF
cat > "$WORK/haproxy.cfg" <<CONF
global
  nbthread $WORKERS
  maxconn 8000
defaults
  mode http
  timeout connect 5s
  timeout client 30s
  timeout server 30s
  option http-keep-alive
  http-reuse always
frontend fe
  bind 127.0.0.1:$P_HAPROXY
  default_backend app
backend app
  balance roundrobin
  server b1 127.0.0.1:$B1
  server b2 127.0.0.1:$B2
  server b3 127.0.0.1:$B3
CONF
nginx -c "$WORK/backends.conf" & PIDS+=($!)
nginx -c "$WORK/nginx.conf" & PIDS+=($!)
haproxy -f "$WORK/haproxy.cfg" -db >/dev/null 2>&1 & PIDS+=($!)
TIDEGATE_ADMIN_TOKEN=bench TIDEGATE_LOG=warn "$TG" serve --listen 127.0.0.1:$P_TG --admin 127.0.0.1:$A_TG \
  --data-dir "$WORK/tg" --workers "$WORKERS" ${TG_ARGS:-} > "$WORK/tg.out" & PIDS+=($!)
for _ in $(seq 50); do grep -q ready "$WORK/tg.out" 2>/dev/null && break; sleep 0.1; done
curl -sf -XPOST -H "Authorization: Bearer bench" "127.0.0.1:$A_TG/v1/changes" -d "{\"ops\":[
 {\"op\":\"put_service\",\"name\":\"app\",\"spec\":{\"backends\":[{\"id\":\"b1\",\"addr\":\"127.0.0.1:$B1\"},{\"id\":\"b2\",\"addr\":\"127.0.0.1:$B2\"},{\"id\":\"b3\",\"addr\":\"127.0.0.1:$B3\"}]}},
 {\"op\":\"put_route\",\"name\":\"app\",\"spec\":{\"match\":{\"path_prefix\":\"/\"},\"service\":\"app\"}}]}" >/dev/null
sleep 0.5
for p in $P_NGINX $P_HAPROXY $P_TG; do curl -sf "127.0.0.1:$p/" >/dev/null || { echo "proxy on $p not answering" >&2; exit 1; }; done

RESULTS="$WORK/results.txt"; : > "$RESULTS"
run() { # name port conns
  local out rps p99 errs
  out=$(wrk -t2 -c"$3" -d"${DURATION}s" --latency "http://127.0.0.1:$2/" 2>&1)
  rps=$(awk '/Requests\/sec/ {print $2}' <<<"$out")
  p99=$(awk '$1=="99%" {print $2}' <<<"$out")
  errs=$(awk '/Non-2xx|Socket errors/ {print}' <<<"$out" | tr '\n' ' ')
  echo "$1 c=$3 rps=$rps p99=$p99 ${errs}" | tee -a "$RESULTS"
}
for c in $CONNS; do
  for r in $(seq "$REPS"); do
    # Alternate the order each repetition so no proxy always runs first.
    case $((r % 3)) in
      1) order="tidegate nginx haproxy";; 2) order="nginx haproxy tidegate";; 0) order="haproxy tidegate nginx";;
    esac
    for name in $order; do
      case $name in tidegate) port=$P_TG;; nginx) port=$P_NGINX;; haproxy) port=$P_HAPROXY;; esac
      run "$name" "$port" "$c"
    done
  done
done
echo "== medians (requests/s, p99) over $REPS runs of ${DURATION}s, $WORKERS workers each"
python3 - "$RESULTS" <<'PY'
import re, statistics, sys
rows = {}
def ms(v):
    m = re.match(r"([\d.]+)(us|ms|s)", v)
    return float(m.group(1)) * {"us": 0.001, "ms": 1, "s": 1000}[m.group(2)] if m else float("nan")
for line in open(sys.argv[1]):
    f = dict(kv.split("=", 1) for kv in line.split()[1:3] + [line.split()[3]])
    rows.setdefault((line.split()[0], f["c"]), []).append((float(f["rps"]), ms(f["p99"])))
for c in sorted({k[1] for k in rows}, key=int):
    base = statistics.median(r for r, _ in rows.get(("nginx", c), [(float("nan"), 0)]))
    for name in ("tidegate", "nginx", "haproxy"):
        v = rows.get((name, c))
        if not v: continue
        rps = statistics.median(r for r, _ in v); p99 = statistics.median(p for _, p in v)
        print(f"c={c:>4} {name:9} {rps:10.0f} req/s  p99 {p99:7.2f} ms  ({rps/base:5.2f}x nginx)")
PY
[ -n "$OUT" ] && cp "$RESULTS" "$OUT" || true

#!/usr/bin/env bash
# The PROXY protocol's cost (issue 40's goal: requests/s with it on within
# 3 % of off, same run). One Tidegate (--proxy-protocol-from 127.0.0.2)
# in front of one nginx backend (a 13-byte answer, upstream keep-alive);
# HAProxy in TCP mode in front of it twice: frontend `on` connects from
# 127.0.0.2 with `send-proxy-v2`, frontend `off` from 127.0.0.3 with no
# header. Same Tidegate, same listener, same HAProxy: only the header
# differs. The same for nginx as the proxy (the peer: a listener with
# `proxy_protocol` and `set_real_ip_from`, and one without; 2 workers,
# upstream keep-alive). wrk through each frontend, alternated, REPS
# repetitions, medians, two modes:
#   keepalive  64 keep-alive connections (one header per connection)
#   close      `Connection: close`: a new connection, so a new header,
#              per request (the protocol's whole cost)
# Prints one JSON line per run and the medians with on/off ratios.
#
# Then the other direction (`upstream.proxy_protocol`): wrk straight to
# the proxy, whose route `/pp` goes to a second nginx backend that reads
# a PROXY v2 header (`listen ... proxy_protocol`) and `/` to the first,
# which reads none. The peer is HAProxy in HTTP mode (nginx's http proxy
# cannot send the header): `send-proxy-v2` on the server of `/pp`. A
# connection that names a client carries that client's requests only, so
# with `close` every request opens a backend connection with the header,
# where `off` reuses the worker's pool.
#
#   bench/proxy_protocol.sh [--reps N] [--duration S] [--conns N] [--workers N]
#                           [--bin-dir DIR] [--port-base N] [--out FILE.jsonl]
#                           [--direction in|out|both]
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=3 DURATION=8 CONNS=64 WORKERS=2 BIN_DIR="" PORT_BASE=19700 OUT="" DIRECTION=both
while [ $# -gt 0 ]; do
  case "$1" in
    --reps) REPS=$2; shift 2;;
    --duration) DURATION=$2; shift 2;;
    --conns) CONNS=$2; shift 2;;
    --workers) WORKERS=$2; shift 2;;
    --bin-dir) BIN_DIR=$2; shift 2;;
    --port-base) PORT_BASE=$2; shift 2;;
    --out) OUT=$2; shift 2;;
    --direction) DIRECTION=$2; shift 2;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
done
export PATH=$PATH:/usr/sbin
for tool in nginx haproxy wrk; do
  command -v $tool >/dev/null || { apt-get update -qq && RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq nginx haproxy wrk; break; }
done
TG=${BIN_DIR:-target/release}/tidegate
[ -x "$TG" ] || { echo "no $TG (cargo build --release)" >&2; exit 1; }
WORK=$(mktemp -d /tmp/tidegate-pp.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; sleep 0.3; rm -rf "$WORK"; }
trap cleanup EXIT
B1=$((PORT_BASE + 1)) P_TG=$((PORT_BASE + 2)) A_TG=$((PORT_BASE + 3)) F_ON=$((PORT_BASE + 4)) F_OFF=$((PORT_BASE + 5))
P_NG_ON=$((PORT_BASE + 6)) P_NG_OFF=$((PORT_BASE + 7)) F_NG_ON=$((PORT_BASE + 8)) F_NG_OFF=$((PORT_BASE + 9))
B_PP=$((PORT_BASE + 10)) P_HA=$((PORT_BASE + 11))
TOKEN=bench-token-0123456789abcdef0123456789

cat > "$WORK/backend.conf" <<CONF
worker_processes 2;
daemon off; pid $WORK/backend.pid; error_log $WORK/backend.err warn;
events { worker_connections 8192; }
http { access_log off; keepalive_requests 1000000;
  server { listen 127.0.0.1:$B1 reuseport; location / { return 200 "hello world!\n"; } }
  server { listen 127.0.0.1:$B_PP proxy_protocol reuseport; location / { return 200 "hello world!\n"; } } }
CONF
nginx -c "$WORK/backend.conf" -e "$WORK/backend.err" & PIDS+=($!)
cat > "$WORK/nginx.conf" <<CONF
worker_processes $WORKERS;
daemon off; pid $WORK/nginx.pid; error_log $WORK/nginx.err warn;
events { worker_connections 16384; }
http { access_log off; keepalive_requests 1000000;
  upstream app { server 127.0.0.1:$B1; keepalive 256; }
  server { listen 127.0.0.1:$P_NG_ON proxy_protocol reuseport; set_real_ip_from 127.0.0.2; real_ip_header proxy_protocol;
    location / { proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for; } }
  server { listen 127.0.0.1:$P_NG_OFF reuseport;
    location / { proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for; } } }
CONF
nginx -c "$WORK/nginx.conf" -e "$WORK/nginx.err" & PID_NGINX=$!; PIDS+=($PID_NGINX)
cat > "$WORK/haproxy.cfg" <<CONF
global
  nbthread $WORKERS
  maxconn 8000
defaults
  mode tcp
  timeout connect 5s
  timeout client 30s
  timeout server 30s
CONF
# One frontend per (proxy, header): NAME FRONT_PORT TARGET_PORT EXTRA.
relay() { printf 'frontend %s\n  bind 127.0.0.1:%s\n  default_backend %s\nbackend %s\n  server s 127.0.0.1:%s %s\n' \
  "$1" "$2" "$1" "$1" "$3" "$4" >> "$WORK/haproxy.cfg"; }
relay tg_on "$F_ON" "$P_TG" "send-proxy-v2 source 127.0.0.2"
relay tg_off "$F_OFF" "$P_TG" "source 127.0.0.3"
relay ng_on "$F_NG_ON" "$P_NG_ON" "send-proxy-v2 source 127.0.0.2"
relay ng_off "$F_NG_OFF" "$P_NG_OFF" "source 127.0.0.3"
# HAProxy as an HTTP proxy: `/pp` to the backend that reads the header.
cat >> "$WORK/haproxy.cfg" <<CONF
frontend http_proxy
  mode http
  bind 127.0.0.1:$P_HA
  use_backend pp if { path_beg /pp }
  default_backend plain
backend plain
  mode http
  http-reuse always
  server s 127.0.0.1:$B1
backend pp
  mode http
  http-reuse always
  server s 127.0.0.1:$B_PP send-proxy-v2
CONF
haproxy -f "$WORK/haproxy.cfg" -db >/dev/null 2>&1 & PID_HA=$!; PIDS+=($PID_HA)
TIDEGATE_ADMIN_TOKEN=$TOKEN TIDEGATE_LOG=warn "$TG" serve --listen 127.0.0.1:$P_TG --admin 127.0.0.1:$A_TG \
  --proxy-protocol-from 127.0.0.2 --data-dir "$WORK/tg" --workers "$WORKERS" > "$WORK/tg.out" & PID_TG=$!; PIDS+=($PID_TG)
for _ in $(seq 100); do grep -q ready "$WORK/tg.out" 2>/dev/null && break; sleep 0.1; done
curl -sf -XPOST -H "Authorization: Bearer $TOKEN" "127.0.0.1:$A_TG/v1/changes" --data-binary @- >/dev/null <<JSON
{"ops": [{"op": "put_service", "name": "app", "spec": {"backends": [{"id": "b1", "addr": "127.0.0.1:$B1"}]}},
         {"op": "put_route", "name": "app", "spec": {"match": {"path_prefix": "/"}, "service": "app"}},
         {"op": "put_service", "name": "pp", "spec": {"backends": [{"id": "b1", "addr": "127.0.0.1:$B_PP"}],
                                                     "upstream": {"proxy_protocol": "v2"}}},
         {"op": "put_route", "name": "pp", "spec": {"match": {"path_prefix": "/pp"}, "service": "pp"}}]}
JSON
for p in $F_ON $F_OFF $F_NG_ON $F_NG_OFF $P_TG/pp $P_HA/pp; do
  for _ in $(seq 200); do curl -sf "http://127.0.0.1:$p/" >/dev/null && break; sleep 0.1; done
  curl -sf "http://127.0.0.1:$p/" >/dev/null || { echo "no answer through HAProxy on $p" >&2; exit 1; }
done
RESULTS="$WORK/results.jsonl"; : > "$RESULTS"
. bench/lib/proc.sh
run() { # proxy name port[/path] mode rep pid
  local before after out proxy=$1 pid=$6
  shift
  before=$(cpu_ticks $pid)
  case $3 in
    keepalive) out=$(wrk -t2 -c"$CONNS" -d"${DURATION}s" --latency "http://127.0.0.1:$2" 2>&1);;
    close) out=$(wrk -t2 -c"$CONNS" -d"${DURATION}s" --latency -H "Connection: close" "http://127.0.0.1:$2" 2>&1);;
  esac
  after=$(cpu_ticks $pid)
  python3 - "$proxy" "$1" "$3" "$4" "$DURATION" "$((after - before))" "$(getconf CLK_TCK)" "$out" <<'PY' | tee -a "$RESULTS"
import json, re, sys
proxy, name, mode, rep, duration, ticks, hz, out = sys.argv[1:]
rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
m = re.search(r"99%\s+([\d.]+)(us|ms|s)", out)
p99 = float(m.group(1)) * {"us": 1e-3, "ms": 1, "s": 1e3}[m.group(2)] if m else None
non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
requests = int(re.search(r"(\d+) requests in", out).group(1))
closes = int(sock.group(2)) if sock and mode == "close" else 0
errors = (int(non2xx.group(1)) if non2xx else 0) + (sum(int(x) for x in sock.groups()) - closes if sock else 0)
cpu = int(ticks) / int(hz)
print(json.dumps({"proxy": proxy, "header": name, "mode": mode, "rep": int(rep), "rps": rps, "p99_ms": p99,
                  "requests": requests, "errors": errors, "cpu_us_per_req": round(cpu * 1e6 / max(requests, 1), 1)}))
PY
}
if [ "$DIRECTION" != out ]; then
for mode in keepalive close; do
  for r in $(seq "$REPS"); do
    if [ $((r % 2)) -eq 1 ]; then order="on off"; else order="off on"; fi
    for name in $order; do
      port=$F_ON/; [ "$name" = off ] && port=$F_OFF/
      run tidegate "$name" "$port" "$mode" "$r" $PID_TG
      port=$F_NG_ON/; [ "$name" = off ] && port=$F_NG_OFF/
      run nginx "$name" "$port" "$mode" "$r" $PID_NGINX
    done
  done
done
fi
if [ "$DIRECTION" != in ]; then
for mode in keepalive close; do
  for r in $(seq "$REPS"); do
    if [ $((r % 2)) -eq 1 ]; then order="on off"; else order="off on"; fi
    for name in $order; do
      path=/pp; [ "$name" = off ] && path=/
      run tidegate-out "$name" "$P_TG$path" "$mode" "$r" $PID_TG
      run haproxy-out "$name" "$P_HA$path" "$mode" "$r" "$PID_HA"
    done
  done
done
fi
echo "== medians over $REPS runs of ${DURATION}s, $CONNS connections; CPU: the proxy's"
echo "   (tidegate, nginx: the header from HAProxy in TCP mode in front; *-out: the header sent to the backend)"
python3 - "$RESULTS" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for proxy in ("tidegate", "nginx", "tidegate-out", "haproxy-out"):
    for mode in ("keepalive", "close"):
        rs = [r for r in rows if r["mode"] == mode and r["proxy"] == proxy]
        if not rs:
            continue
        med = {h: {k: statistics.median(r[k] for r in rs if r["header"] == h) for k in ("rps", "p99_ms", "cpu_us_per_req")}
               for h in ("on", "off")}
        errors = sum(r["errors"] for r in rs)
        print(f"{proxy:12} {mode:9} header on {med['on']['rps']:8.0f} req/s, off {med['off']['rps']:8.0f} req/s:"
              f" on/off {med['on']['rps'] / med['off']['rps']:.3f}; p99 {med['on']['p99_ms']:.2f} / {med['off']['p99_ms']:.2f} ms;"
              f" CPU {med['on']['cpu_us_per_req']} / {med['off']['cpu_us_per_req']} us/req; errors {errors}")
PY
[ -n "$OUT" ] && cp "$RESULTS" "$OUT" || true

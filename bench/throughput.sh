#!/usr/bin/env bash
# Proxy throughput, Tidegate vs nginx vs HAProxy vs direct (paper S2's setup,
# scaled to this machine): three backends (one nginx process serving a fixed
# 13-byte body on three ports), each proxy with the same worker count, wrk
# closed loop at each concurrency, runs alternated, REPS repetitions; prints
# one line per run and a median summary. Per run it also samples each
# proxy's resident memory (all its processes) and CPU use (cores busy during
# the run, from /proc). Everything on 127.0.0.1; every process it starts is
# stopped at exit.
#
#   bench/throughput.sh [--reps N] [--duration S] [--conns "64 256"] [--workers N]
#                       [--out FILE.jsonl] [--bin-dir DIR] [--port-base N]
#
# --bin-dir: where the tidegate binary is (default target/release, built
# when missing; TIDEGATE_BIN still overrides the binary itself).
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=3 DURATION=10 CONNS="64 256" WORKERS=2 OUT="" BIN_DIR="" PORT_BASE=19100
while [ $# -gt 0 ]; do
  case "$1" in
    --reps) REPS=$2; shift 2;;
    --duration) DURATION=$2; shift 2;;
    --conns) CONNS=$2; shift 2;;
    --workers) WORKERS=$2; shift 2;;
    --out) OUT=$2; shift 2;;
    --bin-dir) BIN_DIR=$2; shift 2;;
    --port-base) PORT_BASE=$2; shift 2;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
done
export PATH=$PATH:/usr/sbin
for tool in nginx haproxy wrk; do
  command -v $tool >/dev/null || { apt-get update -qq && RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx haproxy wrk; break; }
done
TG=${TIDEGATE_BIN:-${BIN_DIR:-target/release}/tidegate}
BENCH_BIN=$(dirname "$TG")/tidegate-bench
if [ ! -x "$TG" ] || [ ! -x "$BENCH_BIN" ]; then
  [ -z "$BIN_DIR" ] && [ -z "${TIDEGATE_BIN:-}" ] || { echo "no $TG or $BENCH_BIN" >&2; exit 1; }
  cargo build --release -p tidegate -p tidegate-bench
fi
# Peers: Tidegate (its default engine), Tidegate on hyper's HTTP/1
# (--http1 hyper), the minimal hyper proxy (the library ceiling: no
# routing, balancing, limits or metrics), nginx, HAProxy, and the backend
# directly. PEERS narrows the list, or adds issue 42's io_uring
# experiment: raw-epoll and raw-uring, one raw HTTP/1.1 relay (no
# routing, rewriting or limits) on tokio's epoll and on monoio's io_uring
# (`tidegate-bench minimal-proxy --engine epoll|uring`).
PEERS=${PEERS:-"tidegate tidegate-hyper hyper-min nginx haproxy direct"}
WORK=$(mktemp -d /tmp/tidegate-bench.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; sleep 0.3; rm -rf "$WORK"; }
trap cleanup EXIT

B1=$((PORT_BASE + 1)) B2=$((PORT_BASE + 2)) B3=$((PORT_BASE + 3))
P_NGINX=$((PORT_BASE + 80)) P_HAPROXY=$((PORT_BASE + 81)) P_TG=$((PORT_BASE + 82)) A_TG=$((PORT_BASE + 90))
P_TGH=$((PORT_BASE + 83)) A_TGH=$((PORT_BASE + 91)) P_MIN=$((PORT_BASE + 84))
P_RAWE=$((PORT_BASE + 85)) P_RAWU=$((PORT_BASE + 86))
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
nginx -c "$WORK/nginx.conf" & PID_NGINX=$!; PIDS+=($PID_NGINX)
haproxy -f "$WORK/haproxy.cfg" -db >/dev/null 2>&1 & PID_HAPROXY=$!; PIDS+=($PID_HAPROXY)
start_tidegate() { # name proxy-port admin-port extra-args...
  local name=$1 port=$2 admin=$3; shift 3
  TIDEGATE_ADMIN_TOKEN=bench-token-0123456789abcdef0123456789 TIDEGATE_LOG=warn "$TG" serve --listen 127.0.0.1:$port \
    --admin 127.0.0.1:$admin --data-dir "$WORK/$name" --workers "$WORKERS" "$@" ${TG_ARGS:-} > "$WORK/$name.out" &
  PIDS+=($!)
  for _ in $(seq 100); do grep -q ready "$WORK/$name.out" 2>/dev/null && break; sleep 0.1; done
  curl -sf -XPOST -H "Authorization: Bearer bench-token-0123456789abcdef0123456789" "127.0.0.1:$admin/v1/changes" -d "{\"ops\":[
   {\"op\":\"put_service\",\"name\":\"app\",\"spec\":{\"backends\":[{\"id\":\"b1\",\"addr\":\"127.0.0.1:$B1\"},{\"id\":\"b2\",\"addr\":\"127.0.0.1:$B2\"},{\"id\":\"b3\",\"addr\":\"127.0.0.1:$B3\"}]}},
   {\"op\":\"put_route\",\"name\":\"app\",\"spec\":{\"match\":{\"path_prefix\":\"/\"},\"service\":\"app\"}}]}" >/dev/null
}
start_tidegate tg $P_TG $A_TG; PID_TG=${PIDS[-1]}
PID_TGH=0 PID_MIN=0
case " $PEERS " in *" tidegate-hyper "*) start_tidegate tgh $P_TGH $A_TGH --http1 hyper; PID_TGH=${PIDS[-1]};; esac
case " $PEERS " in *" hyper-min "*)
  "$BENCH_BIN" minimal-proxy --listen 127.0.0.1:$P_MIN --upstream 127.0.0.1:$B1 --workers "$WORKERS" & PID_MIN=$!; PIDS+=($PID_MIN);;
esac
PID_RAWE=0 PID_RAWU=0
case " $PEERS " in *" raw-epoll "*)
  "$BENCH_BIN" minimal-proxy --engine epoll --listen 127.0.0.1:$P_RAWE --upstream 127.0.0.1:$B1 --workers "$WORKERS" &
  PID_RAWE=$!; PIDS+=($PID_RAWE);;
esac
case " $PEERS " in *" raw-uring "*)
  "$BENCH_BIN" minimal-proxy --engine uring --listen 127.0.0.1:$P_RAWU --upstream 127.0.0.1:$B1 --workers "$WORKERS" &
  PID_RAWU=$!; PIDS+=($PID_RAWU);;
esac
sleep 0.5
for p in $B1 $P_NGINX $P_HAPROXY $P_TG; do curl -sf "127.0.0.1:$p/" >/dev/null || { echo "server on $p not answering" >&2; exit 1; }; done
[ "$PID_TGH" = 0 ] || curl -sf "127.0.0.1:$P_TGH/" >/dev/null || { echo "tidegate --http1 hyper not answering" >&2; exit 1; }
[ "$PID_MIN" = 0 ] || curl -sf "127.0.0.1:$P_MIN/" >/dev/null || { echo "minimal hyper proxy not answering" >&2; exit 1; }
[ "$PID_RAWE" = 0 ] || curl -sf "127.0.0.1:$P_RAWE/" >/dev/null || { echo "raw epoll relay not answering" >&2; exit 1; }
[ "$PID_RAWU" = 0 ] || curl -sf "127.0.0.1:$P_RAWU/" >/dev/null || { echo "raw io_uring relay not answering" >&2; exit 1; }

# A process and its children (nginx master + workers), for RSS and CPU.
. bench/lib/proc.sh

RESULTS="$WORK/results.jsonl"; : > "$RESULTS"
run() { # name port conns rep pid
  local out before after rss sys_before sys_after
  before=$(cpu_ticks "$5"); sys_before=$(sys_ticks "$5")
  out=$(wrk -t2 -c"$3" -d"${DURATION}s" --latency "http://127.0.0.1:$2/" 2>&1)
  after=$(cpu_ticks "$5"); sys_after=$(sys_ticks "$5"); rss=$(rss_kb "$5")
  python3 - "$1" "$3" "$4" "$DURATION" "$((after - before))" "$HZ" "$rss" "$out" "$((sys_after - sys_before))" <<'PY' | tee -a "$RESULTS" | cut -c1-200
import json, re, sys
name, conns, rep, duration, ticks, hz, rss, out, sys_ticks = sys.argv[1:]
def ms(v):
    m = re.match(r"([\d.]+)(us|ms|s)$", v)
    return round(float(m.group(1)) * {"us": 0.001, "ms": 1, "s": 1000}[m.group(2)], 3) if m else None
lat = {}
for line in out.splitlines():
    f = line.split()
    if len(f) >= 2 and f[0] in ("50%", "75%", "90%", "99%"):
        lat["p" + f[0][:-1] + "_ms"] = ms(f[1])
    if len(f) >= 2 and f[0] == "Latency" and "mean_ms" not in lat:
        lat["mean_ms"] = ms(f[1])
rps = re.search(r"Requests/sec:\s*([\d.]+)", out)
requests = re.search(r"(\d+) requests in", out)
non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
errors = (int(non2xx.group(1)) if non2xx else 0) + (sum(int(x) for x in sock.groups()) if sock else 0)
print(json.dumps({"proxy": name, "conns": int(conns), "rep": int(rep), "duration_s": float(duration),
                  "rps": float(rps.group(1)) if rps else 0.0, "requests": int(requests.group(1)) if requests else 0,
                  **lat, "errors": errors, "rss_kb": int(rss),
                  "cpu_cores": round(int(ticks) / int(hz) / float(duration), 3),
                  "cpu_us_per_req": round(int(ticks) / int(hz) / max(int(requests.group(1)) if requests else 1, 1) * 1e6, 2),
                  "sys_us_per_req": round(int(sys_ticks) / int(hz) / max(int(requests.group(1)) if requests else 1, 1) * 1e6, 2)}))
PY
}
read -ra peers <<< "$PEERS"
for c in $CONNS; do
  for r in $(seq "$REPS"); do
    # Rotate the order each repetition so no proxy always runs first.
    k=$(( (r - 1) % ${#peers[@]} ))
    for name in "${peers[@]:$k}" "${peers[@]:0:$k}"; do
      case $name in
        tidegate) run tidegate $P_TG "$c" "$r" $PID_TG;;
        tidegate-hyper) run tidegate-hyper $P_TGH "$c" "$r" $PID_TGH;;
        hyper-min) run hyper-min $P_MIN "$c" "$r" $PID_MIN;;
        raw-epoll) run raw-epoll $P_RAWE "$c" "$r" $PID_RAWE;;
        raw-uring) run raw-uring $P_RAWU "$c" "$r" $PID_RAWU;;
        nginx) run nginx $P_NGINX "$c" "$r" $PID_NGINX;;
        haproxy) run haproxy $P_HAPROXY "$c" "$r" $PID_HAPROXY;;
        direct) run direct $B1 "$c" "$r" 0;;
      esac
    done
  done
done
echo "== medians (requests/s, p99) over $REPS runs of ${DURATION}s, $WORKERS workers each"
python3 - "$RESULTS" <<'PY'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    rows.setdefault((d["proxy"], d["conns"]), []).append(d)
med = lambda v, k: statistics.median(x.get(k) or 0 for x in v)
for c in sorted({k[1] for k in rows}):
    base = med(rows.get(("nginx", c), [{}]), "rps") or float("nan")
    for name in ("tidegate", "tidegate-hyper", "hyper-min", "raw-epoll", "raw-uring", "nginx", "haproxy", "direct"):
        v = rows.get((name, c))
        if not v: continue
        rps = med(v, "rps")
        print(f"c={c:>4} {name:14} {rps:10.0f} req/s  p99 {med(v, 'p99_ms'):7.2f} ms  ({rps/base:5.2f}x nginx)"
              f"  rss {med(v, 'rss_kb')/1024:6.1f} MiB  cpu {med(v, 'cpu_cores'):4.2f} cores"
              f"  {med(v, 'cpu_us_per_req'):5.1f} us/req (sys {med(v, 'sys_us_per_req'):5.1f})"
              f"  errors {sum(x.get('errors') or 0 for x in v)}")
PY
[ -n "$OUT" ] && cp "$RESULTS" "$OUT" || true

#!/usr/bin/env bash
# HTTP/3 (issue 41), Tidegate against Caddy (Debian's `caddy`, HTTP/3 on
# by default), the same ECDSA P-256 certificate (bench/lib/certs.sh), the
# same backend (one nginx serving a 13-byte body), 2 workers / GOMAXPROCS=2.
# The load generator is the project's own (`tidegate-bench h3`, on quinn
# and h3 as a client), run the same way against both. Modes, runs
# alternated, REPS repetitions, medians:
#   h3_64     8 QUIC connections x 8 busy streams
#   h3_256    32 connections x 8 streams
#   h3_hs     QUIC handshakes per second: 8 loops, each a new connection,
#             one GET, closed
#   tls_hs    TLS-over-TCP handshakes per second beside it: wrk with
#             `Connection: close` over HTTPS (a full handshake each)
#   ab_h1     HTTP/1.1 over TLS (wrk -c64, keep-alive) to a Tidegate with
#             --http3 and to one without (the same build): HTTP/3 being on
#             must cost TCP clients nothing
#   ab_h2     the same over HTTP/2 (h2load -c64 -m10)
# Prints one JSON line per run and a median summary. Everything on
# 127.0.0.1; every process it starts is stopped at exit.
#
#   bench/http3.sh [--reps N] [--duration S] [--bin-dir DIR] [--port-base N] [--out FILE.jsonl]
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=3 DURATION=8 BIN_DIR="" PORT_BASE=19800 OUT="" MODES=${MODES:-"h3_64 h3_256 h3_hs tls_hs ab_h1 ab_h2"}
while [ $# -gt 0 ]; do
  case "$1" in
    --reps) REPS=$2; shift 2;;
    --duration) DURATION=$2; shift 2;;
    --bin-dir) BIN_DIR=$2; shift 2;;
    --port-base) PORT_BASE=$2; shift 2;;
    --out) OUT=$2; shift 2;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
done
export PATH=$PATH:/usr/sbin
for tool in nginx caddy wrk h2load openssl; do
  command -v $tool >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq nginx caddy wrk nghttp2-client openssl; break; }
done
DIR=${BIN_DIR:-target/release}
TG=$DIR/tidegate BENCH=$DIR/tidegate-bench
[ -x "$TG" ] && [ -x "$BENCH" ] || { echo "no $TG or $BENCH (cargo build --release)" >&2; exit 1; }
WORK=$(mktemp -d /tmp/tidegate-h3.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; sleep 0.3; rm -rf "$WORK"; }
trap cleanup EXIT
. bench/lib/certs.sh
. bench/lib/proc.sh
make_certs "$WORK"
B1=$((PORT_BASE + 1)) TG_TLS=$((PORT_BASE + 2)) TG_ADMIN=$((PORT_BASE + 3)) CADDY=$((PORT_BASE + 4))
TG0_TLS=$((PORT_BASE + 5)) TG0_ADMIN=$((PORT_BASE + 6)) TG_PLAIN=$((PORT_BASE + 7)) TG0_PLAIN=$((PORT_BASE + 8))
TOKEN=bench-token-0123456789abcdef0123456789
# The leaf signed by the private CA (webpki, quinn's verifier, refuses a
# self-signed CA certificate as a server's).
NAME=backend.example CERT=$WORK/backend.pem KEY=$WORK/backend.key

cat > "$WORK/backend.conf" <<CONF
worker_processes 1;
daemon off; pid $WORK/backend.pid; error_log $WORK/backend.err warn;
events { worker_connections 8192; }
http { access_log off; keepalive_requests 1000000;
  server { listen 127.0.0.1:$B1 reuseport; location / { return 200 "hello world!\n"; } } }
CONF
nginx -c "$WORK/backend.conf" -e "$WORK/backend.err" & PIDS+=($!)

cat > "$WORK/Caddyfile" <<CONF
{
  admin off
  auto_https off
  servers {
    protocols h1 h2 h3
  }
}
# No host in the address: a handshake without SNI (wrk to an IP address)
# is served this site's certificate too.
https://:$CADDY {
  bind 127.0.0.1
  tls $CERT $KEY
  reverse_proxy 127.0.0.1:$B1
}
CONF
GOMAXPROCS=2 caddy run --config "$WORK/Caddyfile" --adapter caddyfile > "$WORK/caddy.log" 2>&1 & PID_CADDY=$!; PIDS+=($PID_CADDY)

start_tidegate() { # tls_port admin_port plain_port data_dir extra...
  local tls=$1 admin=$2 plain=$3 data=$4; shift 4
  TIDEGATE_ADMIN_TOKEN=$TOKEN TIDEGATE_LOG=warn "$TG" serve --listen 127.0.0.1:$plain --listen-tls 127.0.0.1:$tls \
    --admin 127.0.0.1:$admin --data-dir "$data" --workers 2 "$@" > "$data.out" 2>&1 &
  local pid=$!; PIDS+=($pid)
  for _ in $(seq 100); do grep -q ready "$data.out" 2>/dev/null && break; sleep 0.1; done
  python3 - "$admin" "$TOKEN" "$CERT" "$KEY" "$B1" <<'PY'
import json, sys, urllib.request
admin, token, cert, key, backend = sys.argv[1:]
def call(method, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{admin}{path}", data=json.dumps(body).encode(), method=method,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).read()
# The default certificate: wrk sends no SNI to an IP address.
call("PUT", "/v1/certificates/bench", {"cert_pem": open(cert).read(), "key_pem": open(key).read(), "default": True})
call("POST", "/v1/changes", {"ops": [
    {"op": "put_service", "name": "app", "spec": {"backends": [{"id": "b1", "addr": f"127.0.0.1:{backend}"}]}},
    {"op": "put_route", "name": "app", "spec": {"match": {"path_prefix": "/"}, "service": "app"}}]})
PY
  echo $pid
}
PID_TG=$(start_tidegate $TG_TLS $TG_ADMIN $TG_PLAIN "$WORK/tg" --http3)
PID_TG0=$(start_tidegate $TG0_TLS $TG0_ADMIN $TG0_PLAIN "$WORK/tg0")
PIDS+=("$PID_TG" "$PID_TG0")
for p in $CADDY $TG_TLS $TG0_TLS; do
  for _ in $(seq 100); do curl -skf --resolve "$NAME:$p:127.0.0.1" "https://$NAME:$p/" >/dev/null && break; sleep 0.1; done
  curl -skf --resolve "$NAME:$p:127.0.0.1" "https://$NAME:$p/" >/dev/null || { echo "no answer on $p" >&2; exit 1; }
done

RESULTS="$WORK/results.jsonl"; : > "$RESULTS"
row() { # proxy mode rep cpu_ticks json_or_wrk_text kind
  python3 - "$@" "$HZ" <<'PY' | tee -a "$RESULTS"
import json, re, sys
proxy, mode, rep, ticks, out, kind, hz = sys.argv[1:]
if kind == "h3":
    r = json.loads(out.strip().splitlines()[-1])
    count, rate, p99, errors = r["ok"], r["per_s"], r["latency_us"]["p99"] / 1000, sum(r["errors"].values())
elif kind == "h2load":
    rate = float(re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out).group(1))
    m = re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored", out)
    count, errors, p99 = int(m.group(2)), int(m.group(3)) + int(m.group(4)), 0.0  # h2load reports no percentiles
else:
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    count = int(re.search(r"(\d+) requests in", out).group(1))
    m = re.search(r"99%\s+([\d.]+)(us|ms|s)", out)
    p99 = float(m.group(1)) * {"us": 1e-3, "ms": 1, "s": 1e3}[m.group(2)] if m else None
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = int(non2xx.group(1)) if non2xx else 0
cpu_us = int(ticks) / int(hz) * 1e6 / max(count, 1)
print(json.dumps({"proxy": proxy, "mode": mode, "rep": int(rep), "per_s": rate, "p99_ms": p99,
                  "count": count, "errors": errors, "cpu_us_each": round(cpu_us, 1)}))
PY
}
measure() { # proxy port pid mode rep
  local proxy=$1 port=$2 pid=$3 mode=$4 rep=$5 before after out kind=h3
  before=$(cpu_ticks "$pid")
  case $mode in
    h3_64) out=$("$BENCH" --proxy 127.0.0.1:$port --threads 2 h3 --connections 8 --streams 8 \
             --duration-s "$DURATION" --server-name $NAME --ca "$WORK/ca.pem");;
    h3_256) out=$("$BENCH" --proxy 127.0.0.1:$port --threads 2 h3 --connections 32 --streams 8 \
             --duration-s "$DURATION" --server-name $NAME --ca "$WORK/ca.pem");;
    h3_hs) out=$("$BENCH" --proxy 127.0.0.1:$port --threads 2 h3 --handshakes --connections 8 \
             --duration-s "$DURATION" --server-name $NAME --ca "$WORK/ca.pem");;
    tls_hs) kind=wrk; out=$(wrk -t2 -c8 -d"${DURATION}s" --latency -H "Connection: close" -H "Host: $NAME" \
             "https://127.0.0.1:$port/" 2>&1);;
    ab_h1) kind=wrk; out=$(wrk -t2 -c64 -d"${DURATION}s" --latency -H "Host: $NAME" "https://127.0.0.1:$port/" 2>&1);;
    ab_h2) kind=h2load; out=$(h2load -t2 -c64 -m10 -D"$DURATION" "https://127.0.0.1:$port/" 2>&1);;
  esac
  after=$(cpu_ticks "$pid")
  row "$proxy" "$mode" "$rep" "$((after - before))" "$out" "$kind"
}
for mode in $MODES; do
  for r in $(seq "$REPS"); do
    if [ "$mode" = ab_h1 ] || [ "$mode" = ab_h2 ]; then
      pairs=("tidegate-h3 $TG_TLS $PID_TG" "tidegate-no-h3 $TG0_TLS $PID_TG0")
    else
      pairs=("tidegate $TG_TLS $PID_TG" "caddy $CADDY $PID_CADDY")
    fi
    if [ $((r % 2)) -eq 0 ]; then pairs=("${pairs[1]}" "${pairs[0]}"); fi
    for p in "${pairs[@]}"; do
      # shellcheck disable=SC2086
      measure $p "$mode" "$r"
    done
  done
done
echo "== medians over $REPS alternated runs of ${DURATION}s (per_s: requests, or handshakes for *_hs; CPU: the server's, per request)"
python3 - "$RESULTS" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for mode in dict.fromkeys(r["mode"] for r in rows):
    rs = [r for r in rows if r["mode"] == mode]
    meds = {}
    for proxy in dict.fromkeys(r["proxy"] for r in rs):
        mine = [r for r in rs if r["proxy"] == proxy]
        meds[proxy] = {k: statistics.median(r[k] for r in mine) for k in ("per_s", "p99_ms", "cpu_us_each")}
        errors = sum(r["errors"] for r in mine)
        print(f"{mode:7} {proxy:15} {meds[proxy]['per_s']:9.0f}/s  p99 {meds[proxy]['p99_ms']:7.2f} ms"
              f"  CPU {meds[proxy]['cpu_us_each']:6.1f} us  errors {errors}")
    names = list(meds)
    if len(names) == 2 and all(m["per_s"] > 0 for m in meds.values()):
        a, b = names
        print(f"{mode:7} {a}/{b}: {meds[a]['per_s'] / meds[b]['per_s']:.3f}")
PY
[ -n "$OUT" ] && cp "$RESULTS" "$OUT" || true

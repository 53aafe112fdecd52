#!/usr/bin/env bash
# TLS termination, Tidegate vs nginx vs HAProxy, same ECDSA P-256
# certificate (generated here with openssl), same backend (one nginx serving
# a 13-byte body), 2 workers each, upstream keep-alive. Three modes, runs
# alternated, REPS repetitions, medians:
#   handshake  wrk with `Connection: close`: every request a new TCP
#              connection and a full TLS handshake (no resumption)
#   h1         wrk over HTTPS, keep-alive
#   h2         h2load over HTTPS (ALPN h2), CONNS connections, 10 streams each
#   up_h1      TLS to the backend instead: wrk over plain HTTP to each proxy,
#              which reaches an HTTPS backend (nginx, certificate from a
#              private CA, verified by every proxy) over HTTP/1.1 keep-alive
#   up_h2      the same over HTTP/2 to the backend (ALPN h2): Tidegate
#              `protocol: http2`, HAProxy `proto h2` (nginx proxies HTTP/2
#              only for gRPC, so it sits this one out; ratios are then to
#              HAProxy)
# In handshake mode a second Tidegate, `tidegate_acme`, serves a managed
# certificate instead: issued at the start by Pebble (Debian's `pebble`,
# Let's Encrypt's test CA, through TLS-ALPN-01 on loopback), the same key
# type (ECDSA P-256), so the two show what a managed certificate costs a
# handshake against an uploaded one (skipped without pebble). Then, on that
# Tidegate, on-demand TLS under a flood (bench/lib/on_demand_flood.py):
# FLOOD handshakes with made-up server names that an on-demand template's
# `ask` endpoint refuses, started at FLOOD_RATE/s, while a normal client
# makes HTTPS requests at NORMAL_RATE/s on new connections; its p50/p99
# quiet, during a control flood for the certificate's own name, and during
# the flood of refused names; the orders Pebble got (0 is the goal) and the
# questions per name.
# And, for Tidegate alone, certificate churn: PUTS certificate replacements
# through the API (two certificates for the same name, alternated), each
# followed by a new verifying handshake that must be served the one just
# put; the API's answer time (p50, p99) and how many handshakes saw it.
# Prints one JSON line per run and a median summary. Everything on
# 127.0.0.1; every process it starts is stopped at exit.
#
#   bench/tls.sh [--reps N] [--duration S] [--conns N] [--workers N] [--out FILE.jsonl]
#                [--bin-dir DIR] [--port-base N] [--flood N] [--flood-quiet S]
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=3 DURATION=8 CONNS=64 WORKERS=2 OUT="" BIN_DIR="" PORT_BASE=19400 MODES=${MODES:-"handshake h1 h2 up_h1 up_h2"} PUTS=${PUTS:-200}
FLOOD=1000 FLOOD_QUIET=5 FLOOD_RATE=${FLOOD_RATE:-200} NORMAL_RATE=${NORMAL_RATE:-50}
while [ $# -gt 0 ]; do
  case "$1" in
    --reps) REPS=$2; shift 2;;
    --duration) DURATION=$2; shift 2;;
    --conns) CONNS=$2; shift 2;;
    --workers) WORKERS=$2; shift 2;;
    --out) OUT=$2; shift 2;;
    --bin-dir) BIN_DIR=$2; shift 2;;
    --port-base) PORT_BASE=$2; shift 2;;
    --flood) FLOOD=$2; shift 2;;
    --flood-quiet) FLOOD_QUIET=$2; shift 2;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
done
export PATH=$PATH:/usr/sbin
for tool in nginx haproxy wrk h2load openssl; do
  command -v $tool >/dev/null || { apt-get update -qq && RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq nginx haproxy wrk nghttp2-client openssl; break; }
done
TG=${TIDEGATE_BIN:-${BIN_DIR:-target/release}/tidegate}
if [ ! -x "$TG" ]; then
  [ -z "$BIN_DIR" ] && [ -z "${TIDEGATE_BIN:-}" ] || { echo "no $TG" >&2; exit 1; }
  cargo build --release -p tidegate
fi
WORK=$(mktemp -d /tmp/tidegate-tls.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; sleep 0.3; rm -rf "$WORK"; }
trap cleanup EXIT

B1=$((PORT_BASE + 1)) B2=$((PORT_BASE + 2)) P_NGINX=$((PORT_BASE + 80)) P_HAPROXY=$((PORT_BASE + 81))
P_TG=$((PORT_BASE + 82)) U_NGINX=$((PORT_BASE + 83)) U_HAPROXY=$((PORT_BASE + 84)) U_TG=$((PORT_BASE + 85))
A_TG=$((PORT_BASE + 90))
P_TGM=$((PORT_BASE + 86)) A_TGM=$((PORT_BASE + 91)) P_PEBBLE=$((PORT_BASE + 92)) M_PEBBLE=$((PORT_BASE + 93))
D_CHALL=$((PORT_BASE + 94)) M_CHALL=$((PORT_BASE + 95))
# The front door's certificate, and the HTTPS backend's from a private CA
# the proxies trust.
. bench/lib/certs.sh
make_certs "$WORK"
cat "$WORK/cert.pem" "$WORK/key.pem" > "$WORK/haproxy.pem"
for alt in a b; do
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj "/CN=churn-$alt" \
    -addext "subjectAltName=DNS:churn.example" -keyout "$WORK/churn-$alt.key" -out "$WORK/churn-$alt.pem" 2>/dev/null
done
cat > "$WORK/backend.conf" <<CONF
worker_processes 2;
daemon off; pid $WORK/backend.pid; error_log $WORK/backend.err warn;
events { worker_connections 8192; }
http { access_log off; keepalive_requests 1000000;
  server { listen 127.0.0.1:$B1 reuseport; location / { return 200 "hello world!\n"; } }
  server { listen 127.0.0.1:$B2 ssl http2 reuseport;
    ssl_certificate $WORK/backend.pem; ssl_certificate_key $WORK/backend.key;
    ssl_session_cache shared:B:10m;
    location / { return 200 "hello world!\n"; } } }
CONF
cat > "$WORK/nginx.conf" <<CONF
worker_processes $WORKERS;
daemon off; pid $WORK/nginx.pid; error_log $WORK/nginx.err warn;
events { worker_connections 16384; }
http { access_log off; keepalive_requests 1000000;
  upstream app { server 127.0.0.1:$B1; keepalive 256; }
  server { listen 127.0.0.1:$P_NGINX ssl http2 reuseport;
    ssl_certificate $WORK/cert.pem; ssl_certificate_key $WORK/key.pem;
    ssl_protocols TLSv1.2 TLSv1.3; ssl_session_cache shared:SSL:10m; ssl_session_tickets on;
    location / { proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection ""; } }
  upstream app_tls { server 127.0.0.1:$B2; keepalive 256; }
  server { listen 127.0.0.1:$U_NGINX reuseport;
    location / { proxy_pass https://app_tls; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_ssl_verify on; proxy_ssl_trusted_certificate $WORK/ca.pem; proxy_ssl_name backend.example;
      proxy_ssl_server_name on; proxy_ssl_session_reuse on; } } }
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
  bind 127.0.0.1:$P_HAPROXY ssl crt $WORK/haproxy.pem alpn h2,http/1.1
  default_backend app
backend app
  server b1 127.0.0.1:$B1
frontend fe_up
  bind 127.0.0.1:$U_HAPROXY
  use_backend app_h2 if { path_beg /h2/ }
  default_backend app_tls
backend app_tls
  server b2 127.0.0.1:$B2 ssl verify required ca-file $WORK/ca.pem sni str(backend.example) alpn http/1.1
backend app_h2
  server b2 127.0.0.1:$B2 ssl verify required ca-file $WORK/ca.pem sni str(backend.example) alpn h2 proto h2
CONF
nginx -c "$WORK/backend.conf" & PIDS+=($!)
nginx -c "$WORK/nginx.conf" & PID_NGINX=$!; PIDS+=($PID_NGINX)
haproxy -f "$WORK/haproxy.cfg" -db >/dev/null 2>&1 & PID_HAPROXY=$!; PIDS+=($PID_HAPROXY)
TOKEN=bench-token-0123456789abcdef0123456789
TIDEGATE_ADMIN_TOKEN=$TOKEN TIDEGATE_LOG=warn "$TG" serve --listen-tls 127.0.0.1:$P_TG --listen 127.0.0.1:$U_TG \
  --admin 127.0.0.1:$A_TG \
  --data-dir "$WORK/tg" --workers "$WORKERS" > "$WORK/tg.out" & PID_TG=$!; PIDS+=($PID_TG)
for _ in $(seq 100); do grep -q ready "$WORK/tg.out" 2>/dev/null && break; sleep 0.1; done
python3 - "$WORK" "$B1" "$B2" > "$WORK/changes.json" <<'PY'
import json, sys
work, b1, b2 = sys.argv[1], sys.argv[2], sys.argv[3]
cert, key = open(f"{work}/cert.pem").read(), open(f"{work}/key.pem").read()
tls = {"ca_pem": open(f"{work}/ca.pem").read(), "sni": "backend.example"}
tls_backend = [{"id": "b2", "addr": f"127.0.0.1:{b2}"}]
print(json.dumps({"ops": [
    {"op": "put_service", "name": "app", "spec": {"backends": [{"id": "b1", "addr": f"127.0.0.1:{b1}"}]}},
    {"op": "put_route", "name": "app", "spec": {"match": {"path_prefix": "/"}, "service": "app"}},
    {"op": "put_service", "name": "app_tls", "spec": {"backends": tls_backend, "upstream": {"tls": tls}}},
    {"op": "put_route", "name": "app_tls", "spec": {"match": {"path_prefix": "/h1/"}, "service": "app_tls"}},
    {"op": "put_service", "name": "app_h2", "spec": {"backends": tls_backend,
                                                     "upstream": {"tls": tls, "protocol": "http2"}}},
    {"op": "put_route", "name": "app_h2", "spec": {"match": {"path_prefix": "/h2/"}, "service": "app_h2"}},
    {"op": "put_certificate", "name": "bench", "spec": {"cert_pem": cert, "key_pem": key, "default": True}}]}))
PY
curl -sf -XPOST -H "Authorization: Bearer $TOKEN" "127.0.0.1:$A_TG/v1/changes" --data-binary @"$WORK/changes.json" >/dev/null
sleep 0.5
# The managed certificate's Tidegate and its CA.
ACME=""
if command -v pebble >/dev/null && [[ " $MODES " == *" handshake "* ]]; then
  # Pebble's own HTTPS, signed by the private CA make_certs made.
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=pebble" \
    -keyout "$WORK/pebble.key" -out "$WORK/pebble.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' > "$WORK/pebble.ext"
  openssl x509 -req -in "$WORK/pebble.csr" -CA "$WORK/ca.pem" -CAkey "$WORK/ca.key" -CAcreateserial -days 2 \
    -extfile "$WORK/pebble.ext" -out "$WORK/pebble.pem" 2>/dev/null
  printf '{"pebble": {"listenAddress": "127.0.0.1:%s", "managementListenAddress": "127.0.0.1:%s", "certificate": "%s", "privateKey": "%s", "httpPort": 1, "tlsPort": %s, "ocspResponderURL": "", "externalAccountBindingRequired": false}}' \
    "$P_PEBBLE" "$M_PEBBLE" "$WORK/pebble.pem" "$WORK/pebble.key" "$P_TGM" > "$WORK/pebble.json"
  pebble-challtestsrv -defaultIPv4 127.0.0.1 -defaultIPv6 "" -http01 "" -https01 "" -tlsalpn01 "" \
    -dns01 127.0.0.1:$D_CHALL -management 127.0.0.1:$M_CHALL >/dev/null 2>&1 & PIDS+=($!)
  PEBBLE_VA_NOSLEEP=1 PEBBLE_WFE_NONCEREJECT=0 pebble -config "$WORK/pebble.json" -dnsserver 127.0.0.1:$D_CHALL \
    >"$WORK/pebble.out" 2>&1 & PIDS+=($!)
  TIDEGATE_ADMIN_TOKEN=$TOKEN TIDEGATE_LOG=warn "$TG" serve --listen-tls 127.0.0.1:$P_TGM --admin 127.0.0.1:$A_TGM \
    --data-dir "$WORK/tgm" --workers "$WORKERS" > "$WORK/tgm.out" & PID_TGM=$!; PIDS+=($PID_TGM)
  for _ in $(seq 100); do grep -q ready "$WORK/tgm.out" 2>/dev/null && grep -q "Listening" "$WORK/pebble.out" 2>/dev/null && break; sleep 0.1; done
  python3 - "$WORK" "$B1" "$P_PEBBLE" > "$WORK/managed.json" <<'PY'
import json, sys
work, b1, pebble = sys.argv[1], sys.argv[2], sys.argv[3]
acme = {"hosts": ["bench.example"], "directory": f"https://127.0.0.1:{pebble}/dir", "challenge": "tls-alpn-01",
        "directory_ca_pem": open(f"{work}/ca.pem").read()}
print(json.dumps({"ops": [
    {"op": "put_service", "name": "app", "spec": {"backends": [{"id": "b1", "addr": f"127.0.0.1:{b1}"}]}},
    {"op": "put_route", "name": "app", "spec": {"match": {"path_prefix": "/"}, "service": "app"}},
    {"op": "put_certificate", "name": "bench", "spec": {"acme": acme, "default": True}}]}))
PY
  curl -sf -XPOST -H "Authorization: Bearer $TOKEN" "127.0.0.1:$A_TGM/v1/changes" --data-binary @"$WORK/managed.json" >/dev/null
  for _ in $(seq 300); do
    curl -sf -H "Authorization: Bearer $TOKEN" "127.0.0.1:$A_TGM/v1/certificates/bench" | grep -q '"status":"valid"' && ACME=1 && break
    sleep 0.1
  done
  [ -n "$ACME" ] || { echo "the managed certificate was not issued" >&2; curl -s -H "Authorization: Bearer $TOKEN" "127.0.0.1:$A_TGM/v1/certificates/bench" >&2; exit 1; }
fi
for p in $P_NGINX $P_HAPROXY $P_TG ${ACME:+$P_TGM}; do
  curl -sfk --http1.1 "https://127.0.0.1:$p/" >/dev/null || { echo "TLS server on $p not answering" >&2; exit 1; }
done
for p in $U_NGINX $U_HAPROXY $U_TG; do
  curl -sf "http://127.0.0.1:$p/h1/" >/dev/null || { echo "no answer over the HTTPS upstream from $p" >&2; exit 1; }
done
for p in $U_HAPROXY $U_TG; do
  curl -sf "http://127.0.0.1:$p/h2/" >/dev/null || { echo "no answer over the HTTP/2 upstream from $p" >&2; exit 1; }
done

. bench/lib/proc.sh
RESULTS="$WORK/results.jsonl"; : > "$RESULTS"
run() { # name port mode rep pid
  local out before after
  before=$(cpu_ticks "$5")
  case $3 in
    handshake) out=$(wrk -t2 -c"$CONNS" -d"${DURATION}s" --latency -H "Connection: close" "https://127.0.0.1:$2/" 2>&1);;
    h1) out=$(wrk -t2 -c"$CONNS" -d"${DURATION}s" --latency "https://127.0.0.1:$2/" 2>&1);;
    h2) out=$(h2load -t2 -c"$CONNS" -m10 -D"$DURATION" "https://127.0.0.1:$2/" 2>&1);;
    up_h1) out=$(wrk -t2 -c"$CONNS" -d"${DURATION}s" --latency "http://127.0.0.1:$2/h1/" 2>&1);;
    up_h2) out=$(wrk -t2 -c"$CONNS" -d"${DURATION}s" --latency "http://127.0.0.1:$2/h2/" 2>&1);;
  esac
  after=$(cpu_ticks "$5")
  python3 - "$1" "$3" "$CONNS" "$4" "$DURATION" "$((after - before))" "$HZ" "$out" <<'PY' | tee -a "$RESULTS" | cut -c1-200
import json, re, sys
name, mode, conns, rep, duration, ticks, hz, out = sys.argv[1:]
def ms(v, unit):
    return round(float(v) * {"us": 0.001, "ms": 1, "s": 1000}[unit], 3)
row = {"proxy": name, "mode": mode, "conns": int(conns), "rep": int(rep), "duration_s": float(duration)}
if mode == "h2":
    m = re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out)
    row["rps"] = float(m.group(1)) if m else 0.0
    m = re.search(r"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored", out)
    row["requests"] = int(m.group(3)) if m else 0
    row["errors"] = (int(m.group(4)) + int(m.group(5))) if m else 0
    m = re.search(r"time for request:\s+([\d.]+)(us|ms|s)\s+([\d.]+)(us|ms|s)\s+([\d.]+)(us|ms|s)", out)
    row["mean_ms"] = ms(m.group(5), m.group(6)) if m else None
    row["p99_ms"] = None  # h2load reports no percentiles
else:
    m = re.search(r"Requests/sec:\s*([\d.]+)", out)
    row["rps"] = float(m.group(1)) if m else 0.0
    m = re.search(r"(\d+) requests in", out)
    row["requests"] = int(m.group(1)) if m else 0
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 2 and f[0] == "99%":
            u = re.match(r"([\d.]+)(us|ms|s)$", f[1])
            row["p99_ms"] = ms(u.group(1), u.group(2)) if u else None
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    # With Connection: close, wrk counts each server close as a read error.
    closes = 0 if mode != "handshake" or not sock else int(sock.group(2))
    row["errors"] = (int(non2xx.group(1)) if non2xx else 0) + (sum(int(x) for x in sock.groups()) - closes if sock else 0)
cpu = int(ticks) / int(hz)
row["cpu_cores"] = round(cpu / float(duration), 3)
row["cpu_us_per_req"] = round(cpu / max(row["requests"], 1) * 1e6, 2)
print(json.dumps(row))
PY
}
for mode in $MODES; do
  peers=(tidegate nginx haproxy)
  [ "$mode" = up_h2 ] && peers=(tidegate haproxy)
  [ "$mode" = handshake ] && [ -n "$ACME" ] && peers=(tidegate tidegate_acme nginx haproxy)
  for r in $(seq "$REPS"); do
    k=$(( (r - 1) % ${#peers[@]} ))
    for name in "${peers[@]:$k}" "${peers[@]:0:$k}"; do
      case $name:$mode in
        tidegate:up_*) run tidegate $U_TG "$mode" "$r" $PID_TG;;
        nginx:up_*) run nginx $U_NGINX "$mode" "$r" $PID_NGINX;;
        haproxy:up_*) run haproxy $U_HAPROXY "$mode" "$r" $PID_HAPROXY;;
        tidegate_acme:*) run tidegate_acme $P_TGM "$mode" "$r" $PID_TGM;;
        tidegate:*) run tidegate $P_TG "$mode" "$r" $PID_TG;;
        nginx:*) run nginx $P_NGINX "$mode" "$r" $PID_NGINX;;
        haproxy:*) run haproxy $P_HAPROXY "$mode" "$r" $PID_HAPROXY;;
      esac
    done
  done
done
# Certificate churn against Tidegate: each PUT answered, then a handshake.
python3 - "$WORK" "$A_TG" "$P_TG" "$TOKEN" "$PUTS" <<'PY' | tee -a "$RESULTS" | cut -c1-200
import json, socket, ssl, sys, time, urllib.request
work, admin, port, token, puts = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
pems = {alt: (open(f"{work}/churn-{alt}.pem").read(), open(f"{work}/churn-{alt}.key").read()) for alt in "ab"}
ders = {alt: ssl.PEM_cert_to_DER_cert(pems[alt][0]) for alt in "ab"}
ctx = ssl.create_default_context()
ctx.load_verify_locations(cadata=pems["a"][0] + pems["b"][0])
ctx.check_hostname = True
def put(alt):
    body = json.dumps({"cert_pem": pems[alt][0], "key_pem": pems[alt][1]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{admin}/v1/certificates/churn", data=body, method="PUT",
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    t = time.perf_counter()
    urllib.request.urlopen(req, timeout=5).read()
    return (time.perf_counter() - t) * 1000
times, live = [], 0
for i in range(puts):
    alt = "ab"[i % 2]
    times.append(put(alt))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="churn.example") as s:
            live += s.getpeercert(binary_form=True) == ders[alt]
times.sort()
pct = lambda q: round(times[min(len(times) - 1, int(q * len(times)))], 3)
print(json.dumps({"proxy": "tidegate", "mode": "cert_put", "puts": puts, "live_on_next_handshake": live,
                  "answer_p50_ms": pct(0.5), "answer_p99_ms": pct(0.99), "answer_max_ms": round(times[-1], 3),
                  "rps": 0.0, "requests": puts, "errors": puts - live}))
PY
# On-demand TLS under a flood of refused names (the managed certificate's Tidegate).
if [ -n "$ACME" ] && [ "$FLOOD" -gt 0 ]; then
  python3 bench/lib/on_demand_flood.py --admin "127.0.0.1:$A_TGM" --token "$TOKEN" --tls-port "$P_TGM" \
    --sni bench.example --directory "https://127.0.0.1:$P_PEBBLE/dir" --directory-ca "$WORK/ca.pem" \
    --pebble-log "$WORK/pebble.out" --work "$WORK" --flood "$FLOOD" --rate "$NORMAL_RATE" --flood-rate "$FLOOD_RATE" \
    --quiet-s "$FLOOD_QUIET" | tee -a "$RESULTS" | cut -c1-200
fi
echo "== medians over $REPS runs of ${DURATION}s, $CONNS connections, $WORKERS workers each"
python3 - "$RESULTS" <<'PY'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    rows.setdefault((d["mode"], d["proxy"]), []).append(d)
med = lambda v, k: statistics.median(x.get(k) or 0 for x in v)
for mode in ("handshake", "h1", "h2", "up_h1", "up_h2"):
    peer = "nginx" if (mode, "nginx") in rows else "haproxy"
    base = med(rows.get((mode, peer), [{}]), "rps") or float("nan")
    for name in ("tidegate", "tidegate_acme", "nginx", "haproxy"):
        v = rows.get((mode, name))
        if not v: continue
        rps = med(v, "rps")
        print(f"{mode:9} {name:13} {rps:9.0f} req/s ({rps/base:4.2f}x {peer})  p99 {med(v, 'p99_ms'):7.2f} ms"
              f"  cpu {med(v, 'cpu_us_per_req'):6.1f} us/req  errors {sum(x['errors'] for x in v)}")
for c in rows.get(("on_demand", "tidegate_acme"), []):
    print(f"on_demand tidegate  {c['flood_handshakes']} refused names in {c['flood_s']} s: normal client p99"
          f" {c['quiet_p99_ms']} ms quiet, {c['flood_p99_ms']} ms flooded ({c['p99_ratio']}x);"
          f" {c['orders_during_flood']} orders, at most {c['most_questions_per_name']} question(s) per name")
for c in rows.get(("cert_put", "tidegate"), []):
    print(f"cert_put  tidegate  {c['puts']} PUTs: answer p50 {c['answer_p50_ms']} ms, p99 {c['answer_p99_ms']} ms;"
          f" {c['live_on_next_handshake']}/{c['puts']} live on the next handshake")
PY
[ -n "$OUT" ] && cp "$RESULTS" "$OUT" || true

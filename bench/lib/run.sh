# Helpers shared by the benchmark scripts (sourced). They expect BIN (where
# the binaries are), BIN_DIR (as given, maybe empty), WORK (a scratch
# directory) and PIDS (an array the script's exit trap kills).

# A scratch directory WORK (/tmp/PREFIX.XXXXXX) and an exit trap that kills
# the processes in PIDS and those whose pid is in a WORK/*.pid file, then
# removes WORK.
make_work() { # prefix
  WORK=$(mktemp -d "/tmp/$1.XXXXXX")
  PIDS=()
  trap bench_cleanup EXIT
}
bench_cleanup() {
  local p
  for p in "${PIDS[@]}" $(cat "$WORK"/*.pid 2>/dev/null); do kill "$p" 2>/dev/null || true; done
  sleep 0.3; rm -rf "$WORK"
}

# Builds the release binaries when BIN is the default and one is missing.
ensure_binaries() {
  for b in tidegate tidegate-emulator tidegate-bench; do
    [ -x "$BIN/$b" ] && continue
    [ -z "$BIN_DIR" ] || { echo "no $BIN/$b" >&2; exit 1; }
    cargo build --release -p tidegate -p tidegate-emulator -p tidegate-bench; break
  done
}

# A loopback port nobody listens on right now.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# A backend emulator named NAME on a free port; its address in $WORK/NAME.out.
start_emulator() { # name
  "$BIN/tidegate-emulator" --listen 127.0.0.1:0 --name "$1" --threads 1 > "$WORK/$1.out" & PIDS+=($!)
  for _ in $(seq 50); do grep -q listening "$WORK/$1.out" 2>/dev/null && break; sleep 0.05; done
}
emulator_addr() { sed 's/listening on //' "$WORK/$1.out"; }

# One nginx worker answering 13 bytes on three free ports: P1, P2, P3.
start_nginx_backends() {
  P1=$(free_port) P2=$(free_port) P3=$(free_port)
  cat > "$WORK/backends.conf" <<CONF
worker_processes 1; daemon off; pid $WORK/backends.nginx.pid; error_log $WORK/backends.err warn;
events { worker_connections 8192; }
http { access_log off; keepalive_requests 1000000;
  server { listen 127.0.0.1:$P1; listen 127.0.0.1:$P2; listen 127.0.0.1:$P3;
           location / { return 200 "hello, world\n"; } } }
CONF
  nginx -c "$WORK/backends.conf" & PIDS+=($!)
}

# Tidegate (BINARY, 2 workers, data in $WORK/NAME) with a service and route
# "web" over the three backends of start_nginx_backends; SPEC: extra fields
# of the service ('"concurrency": {"learn": false},'), FLAGS: extra serve
# flags. Prints the proxy's address; its pid goes to $WORK/NAME.pid (the
# function runs in a command substitution: kill that pid on exit).
BENCH_TOKEN=bench-token-0123456789abcdef0123456789abcdef
start_tidegate_web() { # binary name [spec] [flags]
  local proxy admin
  read -r proxy admin < <(start_tidegate_bare "$1" "$2" "${4:-}")
  curl -sf -XPUT -H "Authorization: Bearer $BENCH_TOKEN" "http://$admin/v1/services/web" -d "{${3:-} \"backends\": [
    {\"id\":\"a\",\"addr\":\"127.0.0.1:$P1\"},{\"id\":\"b\",\"addr\":\"127.0.0.1:$P2\"},{\"id\":\"c\",\"addr\":\"127.0.0.1:$P3\"}]}" >/dev/null
  curl -sf -XPUT -H "Authorization: Bearer $BENCH_TOKEN" "http://$admin/v1/routes/web" -d '{"service":"web"}' >/dev/null
  echo "$proxy"
}

# Tidegate (BINARY, 2 workers, an empty configuration in $WORK/NAME), with
# FLAGS: extra serve flags. Prints "PROXY ADMIN" (its addresses); its pid
# goes to $WORK/NAME.pid (kill that pid on exit).
start_tidegate_bare() { # binary name [flags]
  # shellcheck disable=SC2086 # $3: flags, split on purpose
  TIDEGATE_ADMIN_TOKEN=$BENCH_TOKEN TIDEGATE_LOG=warn "$1" serve --listen 127.0.0.1:0 --admin 127.0.0.1:0 \
    --workers 2 --data-dir "$WORK/$2" ${3:-} > "$WORK/$2.out" 2> "$WORK/$2.err" &
  echo $! > "$WORK/$2.pid"
  for _ in $(seq 100); do grep -q ready "$WORK/$2.out" 2>/dev/null && break; sleep 0.05; done
  local line; line=$(head -1 "$WORK/$2.out")
  local proxy=${line#*proxy=}; proxy=${proxy%% *}; local admin=${line#*admin=}; admin=${admin%% *}
  echo "$proxy $admin"
}

# An etcd cluster of N members on loopback, sized for large change sets;
# sets ENDPOINTS (HOST:PORT,...) and appends the members' pids to ETCD_PIDS.
ETCD_PIDS=()
start_etcd() { # members
  command -v etcd >/dev/null || { echo "etcd is needed (apt-get install etcd-server)" >&2; exit 1; }
  local n=$1 initial="" clients=() peers=() i
  for i in $(seq 0 $((n - 1))); do clients+=("$(free_port)"); peers+=("$(free_port)"); done
  for i in $(seq 0 $((n - 1))); do initial+="${initial:+,}m$i=http://127.0.0.1:${peers[$i]}"; done
  ENDPOINTS=""
  for i in $(seq 0 $((n - 1))); do
    etcd --name "m$i" --data-dir "$WORK/etcd-$n-$i" \
      --listen-client-urls "http://127.0.0.1:${clients[$i]}" --advertise-client-urls "http://127.0.0.1:${clients[$i]}" \
      --listen-peer-urls "http://127.0.0.1:${peers[$i]}" --initial-advertise-peer-urls "http://127.0.0.1:${peers[$i]}" \
      --initial-cluster "$initial" --initial-cluster-state new --initial-cluster-token "bench-$n-$$" \
      --max-txn-ops 200000 --max-request-bytes 67108864 --quota-backend-bytes 4294967296 \
      --logger zap --log-level error > "$WORK/etcd-$n-$i.log" 2>&1 & PIDS+=($!); ETCD_PIDS+=($!)
    ENDPOINTS+="${ENDPOINTS:+,}127.0.0.1:${clients[$i]}"
  done
  for i in $(seq 0 $((n - 1))); do
    for _ in $(seq 200); do curl -sf "http://127.0.0.1:${clients[$i]}/health" | grep -q true && break; sleep 0.1; done
  done
}
stop_etcd() { for p in "${ETCD_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; ETCD_PIDS=(); sleep 0.5; }

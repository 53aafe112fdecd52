# Helpers shared by the benchmark scripts (sourced). They expect BIN (where
# the binaries are), BIN_DIR (as given, maybe empty), WORK (a scratch
# directory) and PIDS (an array the script's exit trap kills).

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

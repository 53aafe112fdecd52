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
make_work tidegate-ab

start_nginx_backends
PA=$(start_tidegate_web "$A" a "$SPEC_A" "${EXTRA[*]}") PB=$(start_tidegate_web "$B" b "$SPEC_B" "${EXTRA[*]} $ARGS_B")
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

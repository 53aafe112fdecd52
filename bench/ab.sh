#!/usr/bin/env bash
# A/B of two Tidegate binaries in the same run: each measurement is taken
# with both, alternated (A, B, B, A, ...), and the script prints per
# measurement each side's median and spread (lowest-highest) and the
# ratio of the medians B / A. For telling a regression from the machine's
# run-to-run spread: the two binaries share every run's conditions. Only
# `tidegate` differs: the helpers (`tidegate-bench`, `tidegate-emulator`)
# are the same for both, from --bin-dir (default: B's directory), so an
# older A needs only its `tidegate`.
#
#   bench/ab.sh A_BINARY B_BINARY [--scenarios "throughput overhead churn"] [--reps 5]
#               [--duration 8] [--conns "64 500"] [--bin-dir DIR] [--out FILE.jsonl]
#               [--overhead-rate 50] [--overhead-requests 1500]
#               [--churn-rate 600] [--live-rate 1000] [--preload 0]
#               [--spec-a 'JSON fields,' --spec-b 'JSON fields,'] [--args-b "serve flags"]
#               [-- extra serve args for both]
#
# Scenarios (default: throughput only), each a reduced form of
# scripts/bench's scenario of the same name with Tidegate alone:
# - throughput: the same three backends (one nginx serving a 13-byte body
#   on three ports), each binary with 2 workers and a catch-all route, wrk
#   -t2 closed loop for --duration s at each of --conns; requests/s.
# - overhead: one backend emulator; each binary with the service `rr`
#   (round_robin, one backend, learned limits) on a catch-all route;
#   `tidegate-bench sequential` sends one request at a time to the
#   emulator directly, through A and through B in turn (a new random
#   order every round), --overhead-requests each, at --overhead-rate
#   requests/s per path and then back to back; per repetition the added
#   p50 and p99 (each path's minus direct's, the same seconds). Both
#   binaries are measured in the same rounds, so alternation is built in.
# - churn: per repetition and binary (alternated), a fresh instance with
#   the services `live` and `churnsvc` (one emulator each; --preload N
#   also preloads N services of 10 backends and N routes, as churn.sh's
#   "loaded" suite), `tidegate-bench churn` at --churn-rate changes/s for
#   --duration s while `tidegate-bench traffic` sends --live-rate
#   requests/s to `live` (time until a new route answers, p50/p99; the
#   admin answer, p50/p99; live traffic's failures and p99), then
#   `tidegate-bench saturate` (64 clients, single changes) for --duration s
#   (change sets/s).
#
# --spec-a/--spec-b: extra fields of the throughput service for A or B (such
# as '"concurrency": {"learn": false},'), to compare two settings of one
# binary; --args-b: extra serve flags for B only (such as "--access-log
# /tmp/x.log"); --out: every measurement as a JSON line (scenario, metric,
# side, rep, value).
set -euo pipefail
cd "$(dirname "$0")/.."
A=$1 B=$2; shift 2
REPS=5 DURATION=8 CONNS="64 500" EXTRA=() SPEC_A="" SPEC_B="" ARGS_B="" SCENARIOS=throughput BIN_DIR="" OUT=""
OV_RATE=50 OV_REQUESTS=1500 CHURN_RATE=600 LIVE_RATE=1000 PRELOAD=0
while [ $# -gt 0 ]; do
  case "$1" in
    --reps) REPS=$2; shift 2;;
    --duration) DURATION=$2; shift 2;;
    --conns) CONNS=$2; shift 2;;
    --scenarios) SCENARIOS=$2; shift 2;;
    --bin-dir) BIN_DIR=$2; shift 2;;
    --out) OUT=$2; shift 2;;
    --overhead-rate) OV_RATE=$2; shift 2;;
    --overhead-requests) OV_REQUESTS=$2; shift 2;;
    --churn-rate) CHURN_RATE=$2; shift 2;;
    --live-rate) LIVE_RATE=$2; shift 2;;
    --preload) PRELOAD=$2; shift 2;;
    --spec-a) SPEC_A=$2; shift 2;;
    --spec-b) SPEC_B=$2; shift 2;;
    --args-b) ARGS_B=$2; shift 2;;
    --) shift; EXTRA=("$@"); break;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
done
for s in $SCENARIOS; do
  case $s in throughput|overhead|churn) ;; *) echo "unknown scenario $s (throughput, overhead, churn)" >&2; exit 2;; esac
done
BIN=${BIN_DIR:-$(dirname "$B")}
case " $SCENARIOS " in *" overhead "*|*" churn "*)
  for b in tidegate-bench tidegate-emulator; do [ -x "$BIN/$b" ] || { echo "no $BIN/$b (--bin-dir)" >&2; exit 1; }; done;;
esac
export PATH=$PATH:/usr/sbin
command -v nginx >/dev/null && command -v wrk >/dev/null || {
  apt-get update -qq && RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx wrk; }
source bench/lib/run.sh
make_work tidegate-ab
RESULTS=$WORK/ab.jsonl; : > "$RESULTS"
record() { # scenario metric side rep value
  printf '{"scenario":"%s","metric":"%s","side":"%s","rep":%s,"value":%s}\n' "$@" >> "$RESULTS"
}
# The order of repetition I: A then B when I is odd, B then A when even.
order() { if [ $(($1 % 2)) -eq 1 ]; then echo a b; else echo b a; fi; }
binary_of() { if [ "$1" = a ]; then echo "$A"; else echo "$B"; fi; }
echo "A=$A ${SPEC_A:+($SPEC_A) }B=$B ${SPEC_B:+($SPEC_B) }${ARGS_B:+($ARGS_B) }reps=$REPS scenarios=$SCENARIOS" \
  "helpers from $BIN; load: $(cut -d' ' -f1-3 /proc/loadavg)"

throughput() {
  start_nginx_backends
  local PA PB c i who addr r
  PA=$(start_tidegate_web "$A" a "$SPEC_A" "${EXTRA[*]}") PB=$(start_tidegate_web "$B" b "$SPEC_B" "${EXTRA[*]} $ARGS_B")
  run() { # addr conns -> req/s
    wrk -t2 -c"$2" -d"${DURATION}s" "http://$1/" 2>/dev/null | awk '/Requests\/sec/ {print $2}'
  }
  for c in $CONNS; do
    run "$PA" "$c" >/dev/null; run "$PB" "$c" >/dev/null  # warm both
    for i in $(seq "$REPS"); do
      for who in $(order "$i"); do
        addr=$PA; [ "$who" = b ] && addr=$PB
        r=$(run "$addr" "$c"); record throughput "req/s c=$c" "$who" "$i" "${r:-0}"
        echo "  throughput c=$c rep $i $who $r req/s"
      done
    done
  done
  kill "$(cat "$WORK/a.pid")" "$(cat "$WORK/b.pid")"
}

overhead() {
  start_emulator app
  local emu addrs=() who proxy admin i pace
  emu=$(emulator_addr app)
  for who in a b; do
    read -r proxy admin < <(start_tidegate_bare "$(binary_of "$who")" "ov-$who" "${EXTRA[*]}")
    curl -sf -XPUT -H "Authorization: Bearer $BENCH_TOKEN" "http://$admin/v1/services/rr" \
      -d "{\"policy\":{\"kind\":\"round_robin\"},\"backends\":[{\"id\":\"app\",\"addr\":\"$emu\"}]}" >/dev/null
    curl -sf -XPUT -H "Authorization: Bearer $BENCH_TOKEN" "http://$admin/v1/routes/rr" \
      -d '{"match":{"path_prefix":"/"},"service":"rr"}' >/dev/null
    addrs+=("$proxy")
  done
  for i in $(seq "$REPS"); do
    for pace in "$OV_RATE" 0; do
      "$BIN/tidegate-bench" --threads 1 --timeout-ms 5000 sequential --requests "$OV_REQUESTS" --warmup 200 \
        --rate "$pace" --expect-backend app --target="direct=$emu/" --target="a=${addrs[0]}/" \
        --target="b=${addrs[1]}/" > "$WORK/seq.json"
      python3 - "$WORK/seq.json" "$i" "$pace" "$RESULTS" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
t = {x["name"]: x for x in r["targets"]}
pace = f"{float(sys.argv[3]):g} req/s" if float(sys.argv[3]) else "back to back"
for side in ("a", "b"):
    if t[side]["failed"]:
        sys.exit(f"{t[side]['failed']} requests failed through {side}")
    for k in ("p50", "p99"):
        d = {"scenario": "overhead", "metric": f"added {k} us, {pace}", "side": side, "rep": int(sys.argv[2]),
             "value": round(t[side][f"{k}_us"] - t["direct"][f"{k}_us"], 1)}
        print(json.dumps(d), file=open(sys.argv[4], "a"))
        print(f"  overhead {d['metric']:32} rep {d['rep']} {side} {d['value']:8.1f}")
PY
    done
  done
  kill "$(cat "$WORK/ov-a.pid")" "$(cat "$WORK/ov-b.pid")"
}

churn() {
  start_emulator churn; start_emulator live
  local churn_addr live_addr i who proxy admin tg tb tp
  churn_addr=$(emulator_addr churn) live_addr=$(emulator_addr live)
  for i in $(seq "$REPS"); do
    for who in $(order "$i"); do
      read -r proxy admin < <(start_tidegate_bare "$(binary_of "$who")" "churn-$who-$i" "${EXTRA[*]}")
      tg=$(cat "$WORK/churn-$who-$i.pid")
      tb="$BIN/tidegate-bench --admin $admin --proxy $proxy --token $BENCH_TOKEN"
      $tb setup --service live --backend "$live_addr" > /dev/null
      $tb setup --service churnsvc --backend "$churn_addr" --no-catch-all --preload-services "$PRELOAD" \
        --backends-per-service 10 --preload-routes "$PRELOAD" > /dev/null
      $tb traffic --rate "$LIVE_RATE" --duration-s "$DURATION" --path / --expect-backend live > "$WORK/traffic.json" &
      tp=$!
      $tb churn --rate "$CHURN_RATE" --duration-s "$DURATION" --service churnsvc --expect-backend churn \
        > "$WORK/churn.json"
      wait $tp
      $tb saturate --clients 64 --duration-s "$DURATION" --service churnsvc --weight 0 > "$WORK/saturate.json"
      kill "$tg"; wait "$tg" 2>/dev/null || true
      python3 - "$WORK" "$who" "$i" "$RESULTS" <<'PY'
import json, sys
work, side, rep = sys.argv[1], sys.argv[2], int(sys.argv[3])
last = lambda name: json.loads(open(f"{work}/{name}.json").read().strip().splitlines()[-1])
c, t, s = last("churn"), last("traffic"), last("saturate")
rows = {"effective ms p50": c["time_to_effective_us"]["p50"] / 1e3,
        "effective ms p99": c["time_to_effective_us"]["p99"] / 1e3,
        "admin answer ms p50": c["admin_from_send_us"]["p50"] / 1e3,
        "admin answer ms p99": c["admin_from_send_us"]["p99"] / 1e3,
        "not effective": c["sending"]["planned"] - c["effective"],
        "live failures": t["error_total"] + t["non_200"], "live p99 ms": t["latency_us"]["p99"] / 1e3,
        "saturate change sets/s": s["change_sets_per_s"]}
with open(sys.argv[4], "a") as f:
    for k, v in rows.items():
        print(json.dumps({"scenario": "churn", "metric": k, "side": side, "rep": rep, "value": v}), file=f)
print(f"  churn rep {rep} {side}: " + ", ".join(f"{k} {v:,.2f}" for k, v in rows.items()))
PY
    done
  done
}

for s in $SCENARIOS; do echo "== $s (load: $(cut -d' ' -f1-3 /proc/loadavg))"; $s; done
[ -z "$OUT" ] || cp "$RESULTS" "$OUT"
echo "== medians over $REPS repetitions (lowest-highest); load at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$RESULTS" <<'PY'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    rows.setdefault((d["scenario"], d["metric"]), {}).setdefault(d["side"], []).append(d["value"])
fmt = lambda v: f"{v:,.0f}" if abs(v) >= 1000 else f"{v:,.2f}" if abs(v) < 100 else f"{v:,.1f}"
for (scenario, metric), by in rows.items():
    a, b = by.get("a", []), by.get("b", [])
    if not a or not b:
        continue
    ma, mb = statistics.median(a), statistics.median(b)
    ratio = f"{mb / ma:.3f}" if ma else "-"
    print(f"{scenario:10} {metric:32} A {fmt(ma):>9} ({fmt(min(a))}-{fmt(max(a))})  "
          f"B {fmt(mb):>9} ({fmt(min(b))}-{fmt(max(b))})  B/A {ratio}")
PY

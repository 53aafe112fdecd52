#!/usr/bin/env python3
"""What each part of issue 37's typical chain costs Tidegate, in wrk runs.

    python3 bench/rules_parts.py BIN_DIR [SECONDS] [REPS] [CONNS]

Starts the rules scenario's backend, nginx and Tidegate (bench/lib/rules.py
`Setup`), adds routes that run parts of the typical chain (without its
rate limit, the rate limit alone, the strip and the two request headers,
HSTS alone), then runs wrk -t2 against each route and the rule-less one in
a rotating order, REPS times (default 8) for SECONDS each (default 4), at
CONNS connections (default 64), and prints Tidegate's requests/s and CPU
per request, and the CPU each route adds to the rule-less route's
(medians). Everything it starts is stopped at the end.
"""

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.dont_write_bytecode = True
sys.path.insert(0, str(ROOT / "bench" / "lib"))

import rules  # noqa: E402

PARTS = {
    "norate": [s for s in rules.TYPICAL_STEPS if s["kind"] != "rate_limit"],
    "rate": [s for s in rules.TYPICAL_STEPS if s["kind"] == "rate_limit"],
    "edits": [s for s in rules.TYPICAL_STEPS if s["kind"] in ("strip_prefix", "set_request_header")],
    "hsts": [s for s in rules.TYPICAL_STEPS if s["kind"] == "set_response_header"],
}


def main() -> None:
    bin_dir = Path(sys.argv[1])
    given = sys.argv[2:5]
    secs, reps, conns = (int(a) for a in given + ["4", "8", "64"][len(given):])
    with rules.standalone(bin_dir, "rules-parts-") as s:
        for name, steps in PARTS.items():
            status, answer = rules.post_json(s.tg.admin_addr, "/v1/changes", {"ops": [
                {"op": "put_rules", "name": name, "spec": {"steps": steps}},
                {"op": "put_route", "name": name,
                 "spec": {"match": {"path_prefix": f"/{name}"}, "service": "app", "rules": [name]}}]})
            if status != 200:
                raise SystemExit(f"the rule set {name} was refused: {answer}")
        paths = {"plain": "/", "typical": "/api/x", **{n: f"/{n}/x" for n in PARTS}}
        got: dict[str, list[tuple[float, float]]] = {k: [] for k in paths}
        for rep in range(reps):
            for k in rules.rotate(list(paths), rep):
                r = rules.measured(s, "tidegate", paths[k], conns, secs)
                got[k].append((r["rps"], r["cpu_us_per_req"]))
                print(f"{rep} {k:8} {r['rps']:9.0f} req/s {r['cpu_us_per_req']:6.2f} us/req", flush=True)
        base = statistics.median(c for _, c in got["plain"])
        for k, v in got.items():
            cpu = statistics.median(c for _, c in v)
            print(f"{k:8} {statistics.median(r for r, _ in v):9.0f} req/s {cpu:6.2f} us/req  {cpu - base:+5.2f} us")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The rules scenario's 20 KiB JSON through Tidegate and nginx, uncompressed
and with gzip, for comparing builds quickly (an A/B of the relay path).

    python3 bench/json_relay.py BIN_DIR [SECONDS]     # env REPS (default 2)

BIN_DIR holds the `tidegate` binary to measure. It starts the rules
scenario's backend, nginx and Tidegate (bench/lib/rules.py `Setup`), runs
wrk -t2 -c64 for SECONDS (default 5) per variant and prints requests/s and
each proxy's CPU per request; everything it starts is stopped at the end.
Run it for two builds in turn, several times, and compare medians.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.dont_write_bytecode = True
sys.path.insert(0, str(ROOT / "bench" / "lib"))

import rules  # noqa: E402


def main() -> None:
    bin_dir = Path(sys.argv[1])
    secs = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    with rules.standalone(bin_dir, "json-relay-") as s:
        for rep in range(int(os.environ.get("REPS", "2"))):
            for coding in ("identity", "gzip"):
                headers = {"Accept-Encoding": "gzip"} if coding == "gzip" else {}
                for proxy in ("tidegate", "nginx"):
                    r = rules.measured(s, proxy, rules.JSON_PATH, 64, secs, headers)
                    print(f"{rep} {proxy:8} {coding:8} {r['rps']:9.0f} req/s {r['cpu_us_per_req']:7.1f} us/req",
                          flush=True)


if __name__ == "__main__":
    main()

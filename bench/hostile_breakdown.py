#!/usr/bin/env python3
"""Where the normal traffic's p99 under `scripts/bench hostile`'s
every-attacker window comes from: the hostile scenario's Tidegate (its
defaults and per-client caps and rate, bench/lib/hostile.py's
`client_caps`), its
backends and normal traffic (the full profile's rate and sources), in
windows of `--duration` s: quiet, each attacker kind alone, every attacker
at once, quiet again; with `--nginx`, nginx quiet and under every
attacker after. Per window it prints the normal traffic's failures, p50,
p99 and p99 over the first quiet window's, and the CPU seconds the proxy
and the attackers (this process's threads) used.

    bench/hostile_breakdown.py [--bin-dir DIR] [--duration 30] [--pin] [--nginx]
                               [--attackers NAME,...] [--without NAME,...] [--rate-limit N]
                               [--client-rate N] [--tarpit-ms N] [--out FILE.json]

--pin: as `scripts/bench hostile --pin`: the proxy, the backends and the
normal traffic's generator on the first CPU, the attackers on the others,
in every window. --attackers: the kinds measured alone (default: all of
them: slowloris, silent, header_flood, smuggling, garbage, slow_body,
slow_upload_h1, slow_upload_h2, zero_window_h2, flood); --without: one
more window, every attacker but those named. --rate-limit N: the route
to the service also gets a rule set limiting each client address to N
requests/s (a `rate_limit` step keyed by `client_ip`, burst N; the normal
traffic sends 1,000 requests/s from 64 addresses, about 16 each).
--client-rate N: `--max-request-rate-per-client N` instead of the
scenario's (0: none, as before that flag); --tarpit-ms N:
`--request-rate-tarpit-ms N` instead of the scenario's. The windows are
shorter than the scenario's 80 s, so a zero-window reader is not cut at
the 60 s write timeout here. Everything on 127.0.0.0/8; every process it
starts is stopped by pid.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.dont_write_bytecode = True
sys.path.insert(0, str(ROOT / "bench" / "lib"))

import hostile  # noqa: E402
from harness import Ctx, Procs, log, make_work_dir, pin_split, start_emulator  # noqa: E402
from scenarios import PARAMS  # noqa: E402

KINDS = [*hostile.MIX, "slow_upload_h1", "slow_upload_h2", "zero_window_h2", "flood"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", type=Path, default=ROOT / "target" / "release")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--pin", action="store_true")
    ap.add_argument("--nginx", action="store_true")
    ap.add_argument("--attackers", default=",".join(KINDS))
    ap.add_argument("--without", default="")
    ap.add_argument("--rate-limit", type=int, default=0)
    ap.add_argument("--client-rate", type=int, default=None)
    ap.add_argument("--tarpit-ms", type=int, default=None)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    kinds = [k for k in args.attackers.split(",") if k]
    without = [k for k in args.without.split(",") if k]
    unknown = [k for k in kinds + without if k not in KINDS]
    if unknown:
        ap.error(f"unknown attacker(s) {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    p = dict(PARAMS["hostile"]["full"])
    ctx = Ctx("full", args.bin_dir.resolve(), Path("/dev/null"), make_work_dir(), Procs(), pin=args.pin)
    runs: dict[str, dict] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(130))  # through the `finally` below
    try:
        with pin_split(ctx):
            _, emu = start_emulator(ctx, "app")
            _, big = start_emulator(ctx, "bulk", "--body-size", str(p["bulk_body_bytes"]))
            if args.client_rate is not None:
                p["per_client_rate"] = args.client_rate
            if args.tarpit_ms is not None:
                p["per_client_tarpit_ms"] = args.tarpit_ms
            tg, admin = hostile.tidegate_up(ctx, "breakdown", hostile.client_caps(p), emu, big, p["max_conns"])
            if args.rate_limit:
                tg.admin.call("POST", "/v1/changes", {"ops": [
                    {"op": "put_rules", "name": "per-client", "spec": {"steps": [
                        {"kind": "rate_limit", "key": "client_ip", "rate_per_s": args.rate_limit,
                         "burst": args.rate_limit}]}},
                    {"op": "put_route", "name": "app", "spec": {"match": {"path_prefix": "/"}, "service": "app",
                                                                "rules": ["per-client"]}}]})
            rss = lambda: hostile.rss_kib(tg.proc.pid)  # noqa: E731
            cpu = lambda: hostile.tree_cpu_s(tg.proc.pid)  # noqa: E731

            def win(label: str, kind: str | None, only: list[str] | None = None) -> None:
                runs[label] = hostile.window(ctx, label, tg.proxy, kind, p, args.duration, rss, emu, admin,
                                             only=only, cpu=cpu)
                hostile.settle(emu, admin)

            win("quiet", None)
            for k in kinds:
                win(k, "all", [k])
            win("every attacker", "all")
            if without:
                win(f"all but {','.join(without)}", "all", [k for k in KINDS if k not in without])
            win("quiet again", None)
            admin.close()
            hostile.stop_tidegate(ctx, tg)
            if args.nginx:
                nginx, proxy, h2_proxy = hostile.nginx_up(ctx, emu, p["max_conns"])
                nrss = lambda: hostile.tree_rss_kib(nginx.pid)  # noqa: E731
                ncpu = lambda: hostile.tree_cpu_s(nginx.pid)  # noqa: E731
                for label, kind in (("nginx quiet", None), ("nginx every attacker", "all"),
                                    ("nginx quiet again", None)):
                    runs[label] = hostile.window(ctx, label, proxy, kind, p, args.duration, nrss, emu,
                                                 h2_proxy=h2_proxy, cpu=ncpu)
                    hostile.settle(emu)
    finally:
        ctx.procs.stop_all()
        shutil.rmtree(ctx.work, ignore_errors=True)
    for r in runs.values():
        r.pop("samples", None)
    print(f"{'window':22} {'failed':>7} {'p50 us':>8} {'p99 us':>8} {'p99/quiet':>9} {'proxy CPU s':>11} "
          f"{'attackers CPU s':>15}")
    for label, r in runs.items():
        base = runs["nginx quiet" if label.startswith("nginx") else "quiet"]
        ratio = hostile.ratio(r, base)
        print(f"{label:22} {hostile.failures(r):>7} {r['p50_us'] or 0:>8} {r['p99_us'] or 0:>8} "
              f"{ratio if ratio is not None else '-':>9} {r['proxy_cpu_s']:>11} {r['attackers_cpu_s']:>15}")
    if args.out:
        args.out.write_text(json.dumps({"params": p, "duration_s": args.duration, "pinned": args.pin,
                                        "rate_limit": args.rate_limit, "runs": runs}, indent=1))
        log(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

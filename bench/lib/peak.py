"""Peak (paper S1): a service that slows with concurrency (the emulator with
2 service slots and a fixed 20 ms service time: 100 requests/s per
instance), an open-loop ramp (tidegate-bench ramp, Poisson arrivals) past one instance's
capacity and back down, in three variants, each with a fresh Tidegate:

- fixed_1: one static instance;
- fixed_max: `max` static instances;
- autoscaled: one static instance plus an `autoscale` block whose process
  provider runs more emulators (up to `max` in all).

From the ramp's per-request log and Tidegate's `GET /v1/events`: time from
the overload's start to the first scale-out decision, from that decision to
the new instance's `ready` event and to the first answer it served,
latency during the peak, failures during scale-in (must be zero), and the
latency the proxy adds at low load (versus the same ramp sent directly).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import time
from pathlib import Path

from harness import (Ctx, bench, free_port, log, percentile, start_emulator, start_nginx, start_tidegate,
                     stop_tidegate, wait_http)

SLOTS = 2
SERVICE_MS = 20
CAPACITY = SLOTS * 1000 / SERVICE_MS  # requests/s one instance serves
EMU_ARGS = ["--slots", str(SLOTS), "--service-time", f"fixed:{SERVICE_MS}ms"]
PORTS = "24000-24099"

PROFILES = {
    "full": {
        # Half of one instance's capacity, then 1.5x and 3x, and back down
        # (no step near the capacity: with Poisson arrivals, 80 % already
        # queues enough to scale out before the "overload" starts).
        "steps": [(50, 10), (150, 10), (300, 15), (150, 10), (50, 40)],
        "fixed_steps": None,  # the same
        "autoscale": {"peak_hold_s": 10, "stable_window_s": 10, "panic_window_s": 2, "drain_timeout_s": 10},
        "max": 4,
    },
    "smoke": {
        "steps": [(50, 1), (250, 3), (50, 4)],
        "fixed_steps": [(50, 1), (250, 1), (50, 1)],
        "autoscale": {"peak_hold_s": 2, "stable_window_s": 3, "panic_window_s": 1, "drain_timeout_s": 3},
        "max": 3,
    },
}


def steps_arg(steps) -> str:
    return ",".join(f"{r}:{d}" for r, d in steps)


def autoscale_block(ctx: Ctx, p: dict) -> dict:
    cmd = [str(Path(ctx.bin("tidegate-emulator")).resolve()), "--listen", "127.0.0.1:{port}", "--name", "{id}",
           "--threads", "1", *EMU_ARGS]
    return {"provider": {"kind": "process", "command": cmd, "ports": PORTS, "grace_s": 2},
            "min": 1, "max": p["max"], "target_in_flight": SLOTS, "latency_threshold_ms": 50,
            "ready": {"path": "/health", "interval_ms": 100, "timeout_s": 10}, **p["autoscale"]}


def stop_instances(ctx: Ctx, data_dir: Path) -> list[int]:
    """Stops the emulators Tidegate's process provider started and left
    running (they outlive Tidegate by design, to be adopted after a
    restart): the pids its state file lists, if they still run the
    emulator."""
    stopped = []
    for f in (data_dir / "instances").glob("*.instances.json"):
        try:
            records = json.loads(f.read_text()).get("instances", [])
        except (OSError, json.JSONDecodeError):
            continue
        for r in records:
            pid = int(r.get("pid", 0))
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if pid > 1 and b"tidegate-emulator" in cmdline:
                try:
                    os.kill(pid, signal.SIGTERM)
                    stopped.append(pid)
                except ProcessLookupError:
                    pass
    for pid in stopped:
        for _ in range(50):
            if not Path(f"/proc/{pid}").exists() or b"zombie" in _state(pid):
                break
            time.sleep(0.05)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return stopped


def _state(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/status").read_bytes().lower()
    except OSError:
        return b""


def read_log(path: Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for r in csv.DictReader(f):
            rows.append({"due": int(r["due_unix_ms"]), "done": int(r["done_unix_ms"]),
                         "lat_ms": int(r["latency_us"]) / 1e3, "outcome": r["outcome"], "backend": r["backend"]})
    return rows


def ok(row) -> bool:
    return row["outcome"].isdigit() and 200 <= int(row["outcome"]) < 300


def window_stats(rows: list[dict], start_ms: float, end_ms: float) -> dict:
    inside = [r for r in rows if start_ms <= r["due"] < end_ms]
    lat = [r["lat_ms"] for r in inside if ok(r)]
    return {"requests": len(inside), "failed": sum(1 for r in inside if not ok(r)),
            "mean_ms": round(sum(lat) / len(lat), 3) if lat else None,
            "p50_ms": round(percentile(lat, 50), 3) if lat else None,
            "p99_ms": round(percentile(lat, 99), 2) if lat else None,
            "max_ms": round(max(lat), 2) if lat else None}


def run_variant(ctx: Ctx, name: str, p: dict, steps) -> dict:
    tg = start_tidegate(ctx, f"peak-{name}")
    extra = []
    try:
        _, base = start_emulator(ctx, f"{name}-base", *EMU_ARGS)
        backends = [{"id": "base", "addr": base}]
        spec = {"policy": {"kind": "least_conn"}, "backends": backends}
        if name == "fixed_max":
            for k in range(2, p["max"] + 1):
                _, addr = start_emulator(ctx, f"{name}-b{k}", *EMU_ARGS)
                backends.append({"id": f"b{k}", "addr": addr})
        if name == "autoscaled":
            spec["autoscale"] = autoscale_block(ctx, p)
        tg.admin.call("PUT", "/v1/services/app", spec)
        tg.admin.call("PUT", "/v1/routes/app", {"service": "app"})
        wait_http(tg.proxy, "/")
        time.sleep(1.0)  # one autoscaler tick with no load
        csv_path = ctx.work / f"peak-{name}.csv"
        # Poisson arrivals (the same seed for every variant): evenly spaced
        # ones are periodic like the autoscaler's 1 s sampling of requests
        # in flight, and the two can alias (every sample at the same phase).
        ramp = bench(ctx, ["ramp", "--steps", steps_arg(steps), "--poisson", "--seed", "7", "--log", str(csv_path)],
                     proxy=tg.proxy,
                     threads=2, timeout_ms=5000, wall_timeout=sum(d for _, d in steps) + 120)
        events = tg.admin.call("GET", "/v1/events").get("events", [])
        status = tg.admin.call("GET", "/v1/status")
    finally:
        stop_tidegate(ctx, tg)
        stopped = stop_instances(ctx, tg.data_dir)
        if stopped:
            log(f"  peak {name}: stopped {len(stopped)} autoscaled emulator(s) left running: {stopped}")
    rows = read_log(csv_path)
    return analyse(name, steps, ramp, rows, events, status, static=len(backends))


def analyse(name, steps, ramp, rows, events, status, static) -> dict:
    start = ramp["start_unix_ms"]
    bounds, t = [], start
    for rate, dur in steps:
        bounds.append((rate, t, t + dur * 1000))
        t += dur * 1000
    over = [b for b in bounds if b[0] > CAPACITY]
    overload_start = over[0][1] if over else None
    peak = window_stats(rows, over[0][1], over[-1][2]) if over else None
    warm = window_stats(rows, bounds[0][1] + 1000 * min(1, steps[0][1] / 2), bounds[0][2])
    failed_total = sum(1 for r in rows if not ok(r)) + ramp["total"]["missing"]

    def ev(kind):
        return [e for e in events if e.get("kind") == kind]

    out = {"variant": name, "static_instances": static, "steps": [{"rate": r, "duration_s": d} for r, d in steps],
           "capacity_per_instance": CAPACITY, "start_unix_ms": start, "overload_start_unix_ms": overload_start,
           "requests": len(rows) + ramp["total"]["missing"], "failed_total": failed_total,
           "outcomes": ramp["total"]["outcomes"], "share": ramp["total"]["share"],
           "warm": warm, "peak": peak, "timeline": ramp["timeline"], "steps_report": ramp["steps"]}
    if name == "autoscaled":
        outs, ready, stopped, scale_in = ev("scale_out"), ev("ready"), ev("stopped"), ev("scale_in")
        first_out = outs[0] if outs else None
        first_ready = ready[0] if ready else None
        served = ramp.get("first_served_unix_ms", {})
        new_id = first_ready.get("instance") if first_ready else None
        serve_at = served.get(new_id) if new_id else None
        # Scale-in window: first scale-in decision until the last instance
        # stopped (plus a second for answers in flight).
        si_window = None
        if scale_in:
            si_end = (stopped[-1]["at_unix_ms"] if stopped else max(r["done"] for r in rows)) + 1000
            si_window = (scale_in[0]["at_unix_ms"], si_end)
        si_failed = None
        if si_window:
            si_failed = sum(1 for r in rows if not ok(r) and (si_window[0] <= r["due"] <= si_window[1]
                                                              or si_window[0] <= r["done"] <= si_window[1]))
        out["autoscale"] = {
            "scale_out_events": [{"at_unix_ms": e["at_unix_ms"], "desired": (e.get("decision") or {}).get("desired"),
                                  "reason": ((e.get("decision") or {}).get("reason") or {}).get("why")
                                  if isinstance((e.get("decision") or {}).get("reason"), dict)
                                  else (e.get("decision") or {}).get("reason"),
                                  "demand_short": (e.get("decision") or {}).get("demand_short")} for e in outs],
            "time_to_detect_ms": (first_out["at_unix_ms"] - overload_start) if first_out and overload_start else None,
            "decision_to_ready_ms": (first_ready["at_unix_ms"] - first_out["at_unix_ms"])
            if first_out and first_ready else None,
            "decision_to_first_served_ms": (serve_at - first_out["at_unix_ms"]) if first_out and serve_at else None,
            "first_instance": new_id,
            "max_instances": max_instances(events, static),
            "instances_at_end": instances_timeline(events, static, start)[-1][1],
            "scale_in_window_unix_ms": si_window,
            "failed_during_scale_in": si_failed,
            "instances_timeline": instances_timeline(events, static, start),
            "event_counts": {k: len(ev(k)) for k in sorted({e.get("kind") for e in events})},
            "final_scaling": (status.get("services", {}).get("app", {}) or {}).get("scaling"),
        }
    return out


def instances_timeline(events, static, start_ms) -> list[tuple[float, int]]:
    """Serving instances over time (seconds from the ramp's start)."""
    n, points = static, [(0.0, static)]
    for e in sorted(events, key=lambda e: e.get("seq", 0)):
        k = e.get("kind")
        if k in ("ready", "restored"):
            n += 1
        elif k in ("draining", "died"):
            n -= 1
        else:
            continue
        points.append((round((e["at_unix_ms"] - start_ms) / 1000, 3), n))
    return points


def max_instances(events, static) -> int:
    return max(n for _, n in instances_timeline(events, static, 0))


def run(ctx: Ctx) -> dict:
    p = PROFILES[ctx.profile]
    steps = p["steps"]
    fixed_steps = p["fixed_steps"] or steps
    # The proxy's added latency: the warm-up step sent straight to an emulator.
    _, direct = start_emulator(ctx, "peak-direct", *EMU_ARGS)
    warm_rate, warm_s = steps[0]
    csv_path = ctx.work / "peak-direct.csv"
    warm = ["ramp", "--steps", f"{warm_rate}:{warm_s}", "--poisson", "--seed", "7", "--log"]
    d = bench(ctx, [*warm, str(csv_path)], proxy=direct, threads=2)
    rows = read_log(csv_path)
    skip = 1000 * min(1, warm_s / 2)
    direct_warm = window_stats(rows, d["start_unix_ms"] + skip, d["start_unix_ms"] + warm_s * 1000)
    # The same step through nginx (upstream keep-alive), for reference.
    port = free_port()
    nginx, _ = start_nginx(ctx, "nginx-peak", f"""events {{ worker_connections 1024; }}
http {{ access_log off;
  upstream app {{ server {direct}; keepalive 16; }}
  server {{ listen 127.0.0.1:{port};
    location / {{ proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection ""; }} }} }}""")
    wait_http(f"127.0.0.1:{port}", "/health")
    csv_path = ctx.work / "peak-nginx.csv"
    n = bench(ctx, [*warm, str(csv_path)], proxy=f"127.0.0.1:{port}", threads=2)
    ctx.procs.stop(nginx)
    nginx_warm = window_stats(read_log(csv_path), n["start_unix_ms"] + skip, n["start_unix_ms"] + warm_s * 1000)
    variants = {}
    for name in ("fixed_1", "fixed_max", "autoscaled"):
        v = run_variant(ctx, name, p, steps if name == "autoscaled" else fixed_steps)
        variants[name] = v
        pk = v["peak"] or {}
        log(f"  peak {name:10}: peak p50 {pk.get('p50_ms')} ms p99 {pk.get('p99_ms')} ms, "
            f"failed {v['failed_total']}/{v['requests']}")
        if name == "autoscaled":
            a = v["autoscale"]
            log(f"  peak autoscaled: detect {a['time_to_detect_ms']} ms, ready {a['decision_to_ready_ms']} ms, "
                f"served {a['decision_to_first_served_ms']} ms after the decision; max {a['max_instances']} "
                f"instances; failed during scale-in {a['failed_during_scale_in']}")
    def added(v, key):
        w = v["warm"].get(key)
        return round((w - direct_warm[key]) * 1000, 1) if w is not None and direct_warm[key] is not None else None
    # Against the same number of instances only: fixed_max serves the first
    # step with 4 instances, so less queueing, not less proxy.
    same = {k: v for k, v in variants.items() if k != "fixed_max"}
    added_p50 = {k: added(v, "p50_ms") for k, v in same.items()}
    added_mean = {k: added(v, "mean_ms") for k, v in same.items()}
    added_p50["nginx (reference)"] = added({"warm": nginx_warm}, "p50_ms")
    added_mean["nginx (reference)"] = added({"warm": nginx_warm}, "mean_ms")
    a = variants["autoscaled"]["autoscale"]
    return {"profile": ctx.profile, "capacity_per_instance": CAPACITY, "slots": SLOTS, "service_ms": SERVICE_MS,
            "max": p["max"], "autoscale_block": autoscale_block(ctx, p), "direct_warm": direct_warm,
            "added_latency_us_at_warm_p50": added_p50, "added_latency_us_at_warm_mean": added_mean,
            "variants": variants,
            "summary": {
                "time_to_detect_ms": a["time_to_detect_ms"],
                "decision_to_ready_ms": a["decision_to_ready_ms"],
                "decision_to_first_served_ms": a["decision_to_first_served_ms"],
                "failed_during_scale_in": a["failed_during_scale_in"],
                "max_instances": a["max_instances"],
                "peak": {k: v["peak"] for k, v in variants.items()},
                "failed_total": {k: v["failed_total"] for k, v in variants.items()},
                "requests": {k: v["requests"] for k, v in variants.items()},
            }}

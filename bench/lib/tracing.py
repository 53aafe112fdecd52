"""Tracing (issue 40): what recording and exporting spans costs, as
requests/s at `conns` connections with tracing off, at a 1 % and at a
100 % sampling ratio, same run, same backends.

One backend process (nginx, 2 workers, three ports, 13 bytes at any path)
and one OTLP/HTTP receiver (a Python sink on loopback: it reads each
`POST /v1/traces` body whole, counts it and answers 200; decoding is the
collector's cost, not the proxy's) serve three Tidegate processes started
side by side (2 workers each), identical but for `--otlp-endpoint` and
`--trace-sample-ratio`. Requests carry no `traceparent`: every one starts
a trace, and the ratio decides. wrk (`-t2`, closed loop) runs against each
variant in a rotating order per repetition; medians over repetitions;
each variant's ratio to tracing off. Each variant's exporter counters
(spans exported, dropped) are read from its `/metrics` after the runs.
Then the receiver is stopped and the 100 % variant measured once more:
its requests/s and the spans it dropped, counted. Per run also
Tidegate's CPU per request (its process's CPU ticks over wrk's requests)
and the receiver's CPU seconds: the receiver shares the 2 cores, so the
requests/s ratio includes its work; the CPU per request is the proxy's
own cost.

Everything on 127.0.0.1; every process is stopped by its pid.
"""

from __future__ import annotations

import re
import resource
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from harness import Ctx, free_port, log, median, start_nginx, start_tidegate, stop_tidegate, wait_http, which
from rules import HZ, cpu_ticks, parse_wrk, rotate, wrk

VARIANTS = (("off", None), ("ratio_0.01", 0.01), ("ratio_1", 1.0))


def own_cpu_s() -> float:
    """CPU seconds of this process (the sink's threads, and the harness
    waiting on wrk)."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


class Sink:
    """An OTLP/HTTP receiver that only counts what it is sent."""

    def __init__(self) -> None:
        counts = self.counts = {"posts": 0, "bytes": 0}

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                n = int(self.headers.get("content-length", "0"))
                self.rfile.read(n)
                counts["posts"] += 1
                counts["bytes"] += n
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def span_counts(tg) -> dict:
    """The exporter's counters from a Tidegate's /metrics."""
    text = tg.admin.text("/metrics")
    out = {}
    for m in re.finditer(r'^tidegate_trace_spans_total\{result="(\w+)"\} (\S+)$', text, re.M):
        out[m.group(1)] = int(float(m.group(2)))
    return out


def run(ctx: Ctx, p: dict) -> dict:
    if not which("wrk"):
        raise RuntimeError("wrk is needed (apt-get install wrk)")
    backends = [free_port() for _ in range(3)]
    listens = " ".join(f"listen 127.0.0.1:{b} reuseport;" for b in backends)
    backend, _ = start_nginx(ctx, "tracing-backends", f"""events {{ worker_connections 8192; }}
http {{ access_log off; keepalive_requests 1000000;
  server {{ {listens} location / {{ return 200 "hello world!\\n"; }} }} }}""")
    sink = Sink()
    proxies = {}
    try:
        for name, ratio in VARIANTS:
            args = [] if ratio is None else ["--otlp-endpoint", f"http://127.0.0.1:{sink.port}",
                                             "--trace-sample-ratio", str(ratio)]
            tg = start_tidegate(ctx, f"tracing-{name}", workers=p["workers"], args=args)
            proxies[name] = tg
            tg.admin.call("PUT", "/v1/services/app", {"backends": [{"id": f"b{i + 1}", "addr": f"127.0.0.1:{b}"}
                                                                   for i, b in enumerate(backends)]})
            tg.admin.call("PUT", "/v1/routes/app", {"match": {"path_prefix": "/"}, "service": "app"})
            wait_http(tg.proxy)
        runs = []
        names = [n for n, _ in VARIANTS]
        for rep in range(p["reps"]):
            for name in rotate(names, rep):
                pid = proxies[name].proc.pid
                ticks, sink_cpu = cpu_ticks(pid), own_cpu_s()
                r = parse_wrk(wrk(f"http://{proxies[name].proxy}/", p["conns"], p["duration"]))
                ticks, sink_cpu = cpu_ticks(pid) - ticks, own_cpu_s() - sink_cpu
                r.update({"variant": name, "rep": rep, "conns": p["conns"],
                          "cpu_us_per_req": round(ticks / HZ / max(r["requests"], 1) * 1e6, 2),
                          "sink_cpu_s": round(sink_cpu, 2)})
                log(f"  {name:12} rep {rep}: {r['rps']:.0f} req/s, p99 {r.get('p99_ms')} ms, errors {r.get('errors')}, "
                    f"Tidegate {r['cpu_us_per_req']} µs CPU/request, receiver {r['sink_cpu_s']} CPU s")
                runs.append(r)
        summary = {}
        for name in names:
            rps = [r["rps"] for r in runs if r["variant"] == name]
            mine = [r for r in runs if r["variant"] == name]
            summary[name] = {"rps_median": median(rps), "rps_min": min(rps), "rps_max": max(rps),
                             "cpu_us_per_req": median([r["cpu_us_per_req"] for r in mine]),
                             "sink_cpu_s": median([r["sink_cpu_s"] for r in mine]),
                             "spans": span_counts(proxies[name]) if name != "off" else None}
        off = summary["off"]["rps_median"]
        off_cpu = summary["off"]["cpu_us_per_req"]
        for name in names:
            summary[name]["vs_off"] = round(summary[name]["rps_median"] / off, 3) if off else None
            # The proxy's own cost: CPU per request, tracing off over on
            # (the receiver's CPU, on the same 2 cores, is left out).
            summary[name]["cpu_vs_off"] = round(off_cpu / summary[name]["cpu_us_per_req"], 3) if off_cpu else None
        summary["sink"] = dict(sink.counts)
        # The receiver gone: the 100 % variant once more.
        sink.stop()
        before = span_counts(proxies["ratio_1"])
        r = parse_wrk(wrk(f"http://{proxies['ratio_1'].proxy}/", p["conns"], p["duration"]))
        after = span_counts(proxies["ratio_1"])
        stopped = {"rps": r["rps"], "errors": r.get("errors"),
                   "vs_off": round(r["rps"] / off, 3) if off else None,
                   "dropped": {k: after.get(k, 0) - before.get(k, 0)
                               for k in ("dropped_queue_full", "dropped_export_failed")},
                   "exported": after.get("exported", 0) - before.get("exported", 0)}
        log(f"  receiver stopped, ratio_1: {r['rps']:.0f} req/s, dropped {stopped['dropped']}")
    finally:
        for tg in proxies.values():
            stop_tidegate(ctx, tg)
        ctx.procs.stop(backend)
        try:
            sink.stop()
        except OSError:
            pass
    goal = {"ratio_0.01_within_3pct": summary["ratio_0.01"]["vs_off"] >= 0.97,
            "ratio_1_within_15pct": summary["ratio_1"]["vs_off"] >= 0.85}
    return {"params": p, "runs": runs, "summary": summary, "receiver_stopped": stopped, "goal": goal}

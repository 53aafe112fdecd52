"""Overhead (paper S4, Table 1): sequential requests, one at a time over a
keep-alive connection (tidegate-bench sequential), to one backend emulator
directly, through Tidegate (round_robin, which learns concurrency limits
by default), through Tidegate without learned limits, through Tidegate asking the
external distributor (UDP) for every request, through nginx and through
HAProxy (upstream keep-alive for both). Mean, standard deviation and
percentiles; the added microseconds are each path's minus direct's, per
repetition (targets alternate), then the median over repetitions.
"""

from __future__ import annotations

from harness import (Ctx, bench, free_port, log, median, start_emulator, start_haproxy, start_nginx,
                     start_tidegate, stop_tidegate, wait_for_line, wait_http)

PAPER = {"direct": {"mean_ms": 78.5, "stddev_ms": 7.7}, "nginx": {"mean_ms": 80.2, "stddev_ms": 10.6, "added_pct": 2},
         "distributor": {"mean_ms": 82.6, "stddev_ms": 7.5, "added_pct": 5}}


def run(ctx: Ctx, requests: int, reps: int, service_time: str = "fixed:0ms", warmup: int = 200) -> dict:
    _, emu = start_emulator(ctx, "app", "--service-time", service_time)
    dist_out = ctx.work / "distributor.out"
    dist = ctx.procs.start([ctx.bin("tidegate"), "distributor", "--listen", "127.0.0.1:0", "--backend", emu],
                           out=dist_out)
    dist_addr = wait_for_line(dist_out, r"distributor listening on (\S+)", 10, dist).group(1)

    tg = start_tidegate(ctx, "overhead", workers=2)
    a = tg.admin
    a.call("PUT", "/v1/services/rr", {"policy": {"kind": "round_robin"}, "backends": [{"id": "app", "addr": emu}]})
    a.call("PUT", "/v1/services/ext", {"policy": {"kind": "external", "addr": dist_addr, "policy": "round_robin"},
                                       "backends": [{"id": "app", "addr": emu}]})
    a.call("PUT", "/v1/services/plain", {"policy": {"kind": "round_robin"}, "concurrency": {"learn": False},
                                         "backends": [{"id": "app", "addr": emu}]})
    a.call("PUT", "/v1/routes/rr", {"match": {"path_prefix": "/rr"}, "service": "rr"})
    a.call("PUT", "/v1/routes/plain", {"match": {"path_prefix": "/plain"}, "service": "plain"})
    a.call("PUT", "/v1/routes/ext", {"match": {"path_prefix": "/ext"}, "service": "ext"})

    nginx_port, haproxy_port = free_port(), free_port()
    nginx, _ = start_nginx(ctx, "nginx-overhead", f"""events {{ worker_connections 1024; }}
http {{ access_log off;
  upstream app {{ server {emu}; keepalive 16; }}
  server {{ listen 127.0.0.1:{nginx_port};
    location / {{ proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection ""; }} }} }}""")
    haproxy = start_haproxy(ctx, "haproxy-overhead", f"""global
  nbthread 2
defaults
  mode http
  timeout connect 5s
  timeout client 30s
  timeout server 30s
  option http-keep-alive
  http-reuse always
frontend fe
  bind 127.0.0.1:{haproxy_port}
  default_backend app
backend app
  server app {emu}
""")
    targets = {
        "direct": (emu, "/rr"),
        "tidegate": (tg.proxy, "/rr"),
        "tidegate_no_learning": (tg.proxy, "/plain"),
        "tidegate_distributor": (tg.proxy, "/ext"),
        "nginx": (f"127.0.0.1:{nginx_port}", "/rr"),
        "haproxy": (f"127.0.0.1:{haproxy_port}", "/rr"),
    }
    for addr, path in targets.values():
        wait_http(addr, path)

    names = list(targets)
    runs = []
    try:
        for rep in range(reps):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                addr, path = targets[name]
                r = bench(ctx, ["sequential", "--requests", str(requests), "--warmup", str(warmup), "--path", path,
                                "--expect-backend", "app"], proxy=addr, timeout_ms=5000)
                r.update({"system": name, "rep": rep})
                runs.append(r)
                log(f"  overhead {name:21} rep {rep}: mean {r['mean_us']:8.1f} us  sd {r['stddev_us']:7.1f}  "
                    f"p50 {r['p50_us']:8.1f}  p99 {r['p99_us']:8.1f}  failed {r['failed']}")
    finally:
        stop_tidegate(ctx, tg)
        for p in (nginx, haproxy, dist):
            ctx.procs.stop(p)

    summary = {}
    direct = {r["rep"]: r for r in runs if r["system"] == "direct"}
    for name in names:
        rs = [r for r in runs if r["system"] == name]
        summary[name] = {
            "reps": len(rs), "requests": sum(r["requests"] for r in rs), "failed": sum(r["failed"] for r in rs),
            **{k: median([r[k] for r in rs]) for k in ("mean_us", "stddev_us", "p50_us", "p90_us", "p99_us")},
            "added_mean_us": median([r["mean_us"] - direct[r["rep"]]["mean_us"] for r in rs]),
            "added_p50_us": median([r["p50_us"] - direct[r["rep"]]["p50_us"] for r in rs]),
            "added_p99_us": median([r["p99_us"] - direct[r["rep"]]["p99_us"] for r in rs]),
        }
        d = summary["direct"]["mean_us"] if "direct" in summary else None
        summary[name]["added_pct"] = round(100 * summary[name]["added_mean_us"] / d, 1) if d else None
    goal = summary["tidegate"]["added_p50_us"]
    # What the learned limits cost per request: the same path with and
    # without them (issue 12: at most 2 us at p50).
    learning = median([r["p50_us"] - next(x["p50_us"] for x in runs if x["system"] == "tidegate_no_learning"
                                           and x["rep"] == r["rep"]) for r in runs if r["system"] == "tidegate"])
    return {"learned_limits_added_p50_us": learning,"requests": requests, "warmup": warmup, "reps": reps, "service_time": service_time,
            "distributor": dist_addr, "runs": runs, "summary": summary, "paper": PAPER,
            "goal": {"added_p50_us_max": 100, "tidegate_added_p50_us": goal, "met": goal is not None and goal < 100}}

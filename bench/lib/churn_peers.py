"""Config churn versus peers (paper S0): the same open-loop stream of
changes sent to Tidegate (admin API), nginx (rewrite the config file with one
more `location`, `nginx -c FILE -s reload`) and HAProxy (runtime API
`set server` over its stats socket), measured the same way: from each
change's scheduled time until a fresh connection through the proxy gets the
new answer. Changes are applied one at a time, in order (nginx's config file
and reload cannot run concurrently), so a change waits for the previous ones:
the latency includes that queueing, as the paper's. Live traffic
(tidegate-bench traffic) runs through each proxy meanwhile.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time

from harness import (Ctx, bench_async, haproxy_command, http_get, log, median, percentile, read_json_output,
                     start_emulator, start_haproxy, start_nginx, start_tidegate, stop_tidegate, wait_http, which)

POLL_S = 0.001
EFFECTIVE_WINDOW_S = 5.0


class TidegateTarget:
    name = "tidegate"

    def __init__(self, ctx: Ctx, churn: str, live: str) -> None:
        self.tg = start_tidegate(ctx, "churn-peers")
        a = self.tg.admin
        a.call("PUT", "/v1/services/churnsvc", {"backends": [{"id": "a", "addr": churn}]})
        a.call("PUT", "/v1/services/live", {"backends": [{"id": "a", "addr": live}]})
        a.call("PUT", "/v1/routes/live", {"match": {"path_prefix": "/live"}, "service": "live"})
        self.proxy = self.tg.proxy
        wait_http(self.proxy, "/live")

    def change(self, tag: str, i: int) -> tuple[str, str]:
        path = f"/churn/{tag}/{i}"
        self.tg.admin.call("PUT", f"/v1/routes/churn-{tag}-{i}", {"match": {"path": path}, "service": "churnsvc"})
        return path, "churn"


class NginxTarget:
    name = "nginx"

    def __init__(self, ctx: Ctx, churn: str, live: str, port: int) -> None:
        self.ctx, self.port, self.locations = ctx, port, []
        self.upstreams = (f"upstream churn {{ server {churn}; keepalive 16; }}\n"
                          f"upstream live {{ server {live}; keepalive 64; }}\n")
        self.proc, self.conf = start_nginx(ctx, "nginx-churn", self.body())
        self.proxy = f"127.0.0.1:{port}"
        wait_http(self.proxy, "/live")
        self.nginx = which("nginx") or "nginx"

    def body(self) -> str:
        proxy = 'proxy_http_version 1.1; proxy_set_header Connection "";'
        locs = "".join(f"    location = {p} {{ proxy_pass http://churn; {proxy} }}\n" for p in self.locations)
        return ("events { worker_connections 4096; }\n"
                f"http {{ access_log off;\n{self.upstreams}"
                f"  server {{ listen 127.0.0.1:{self.port};\n"
                f"    location /live {{ proxy_pass http://live; {proxy} }}\n{locs}  }}\n}}")

    def change(self, tag: str, i: int) -> tuple[str, str]:
        from harness import nginx_conf
        path = f"/churn/{tag}/{i}"
        self.locations.append(path)
        tmp = self.conf.with_suffix(".tmp")
        tmp.write_text(nginx_conf(self.ctx, "nginx-churn", self.body()))
        os.replace(tmp, self.conf)
        r = subprocess.run([self.nginx, "-c", str(self.conf), "-e", str(self.ctx.work / "nginx-churn.err"),
                            "-s", "reload"], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"nginx -s reload: {r.stderr.strip()}")
        return path, "churn"


class HaproxyTarget:
    name = "haproxy"

    def __init__(self, ctx: Ctx, churn: str, alt: str, live: str, port: int) -> None:
        self.sock = ctx.work / "haproxy-churn.sock"
        self.addrs = {"churn": churn, "alt": alt}
        cfg = f"""global
  nbthread 2
  maxconn 8000
  stats socket {self.sock} level admin
defaults
  mode http
  timeout connect 5s
  timeout client 30s
  timeout server 30s
  option http-keep-alive
  http-reuse safe
frontend fe
  bind 127.0.0.1:{port}
  use_backend be if {{ path_beg /churn }}
  default_backend live
backend be
  server s1 {churn}
backend live
  server l1 {live}
"""
        self.proc = start_haproxy(ctx, "haproxy-churn", cfg)
        self.proxy = f"127.0.0.1:{port}"
        wait_http(self.proxy, "/live")
        wait_http(self.proxy, "/churn/x")

    def change(self, tag: str, i: int) -> tuple[str, str]:
        # Alternate s1 between the two emulators; the answer's x-backend
        # tells which one served.
        target = "alt" if i % 2 == 0 else "churn"
        host, port = self.addrs[target].rsplit(":", 1)
        answer = haproxy_command(self.sock, f"set server be/s1 addr {host} port {port}")
        if "not" in answer.lower() and "changed" not in answer.lower():
            raise RuntimeError(f"haproxy set server: {answer.strip()}")
        return f"/churn/{tag}/{i}", target


def churn_once(target, tag: str, rate: float, duration: float) -> dict:
    """Open-loop schedule, changes applied in order; returns the samples."""
    n = max(1, int(rate * duration))
    t0 = time.monotonic() + 0.05
    effective, applied, commands, never, errors = [], [], [], 0, []
    for i in range(n):
        due = t0 + i / rate
        now = time.monotonic()
        if now < due:
            time.sleep(due - now)
        start = time.monotonic()
        try:
            path, want = target.change(tag, i)
        except Exception as e:  # count, keep going
            errors.append(str(e)[:200])
            continue
        commanded = time.monotonic()
        commands.append((commanded - start) * 1e3)
        deadline = commanded + EFFECTIVE_WINDOW_S
        while True:
            status, headers, _ = http_get(target.proxy, path, timeout=2)
            if status == 200 and headers.get("x-backend") == want:
                done = time.monotonic()
                effective.append((done - due) * 1e3)
                applied.append((done - start) * 1e3)
                break
            if time.monotonic() > deadline:
                never += 1
                break
            time.sleep(POLL_S)
    summary = lambda xs: ({"count": len(xs), "mean": round(statistics.fmean(xs), 3),
                           "p50": round(percentile(xs, 50), 3), "p90": round(percentile(xs, 90), 3),
                           "p99": round(percentile(xs, 99), 3), "max": round(max(xs), 3)} if xs else {"count": 0})
    return {"changes": n, "effective": len(effective), "never_effective": never, "change_errors": len(errors),
            "first_errors": errors[:3], "time_to_effective_ms": summary(effective),
            "apply_ms": summary(applied), "command_ms": summary(commands)}


def run(ctx: Ctx, rate: float, duration: float, reps: int, live_rate: float) -> dict:
    _, churn = start_emulator(ctx, "churn")
    _, alt = start_emulator(ctx, "alt")
    _, live = start_emulator(ctx, "live")
    from harness import free_port
    targets = {
        "tidegate": TidegateTarget(ctx, churn, live),
        "nginx": NginxTarget(ctx, churn, live, free_port()),
        "haproxy": HaproxyTarget(ctx, churn, alt, live, free_port()),
    }
    runs = []
    orders = [["tidegate", "nginx", "haproxy"], ["nginx", "haproxy", "tidegate"], ["haproxy", "tidegate", "nginx"]]
    try:
        for rep in range(reps):
            for name in orders[rep % 3]:
                t = targets[name]
                tag = f"r{rep}"
                out = ctx.work / f"live-{name}-{rep}.json"
                live_p = bench_async(ctx, ["traffic", "--rate", str(live_rate), "--duration-s", str(duration + 0.3),
                                           "--path", "/live", "--expect-backend", "live"], out, proxy=t.proxy)
                r = churn_once(t, tag, rate, duration)
                live_p.wait(timeout=duration + 30)
                lt = read_json_output(out)
                r.update({"system": name, "rep": rep, "rate": rate, "duration_s": duration,
                          "live": {"requests": lt["sending"]["sent"], "ok": lt["ok"],
                                   "errors": lt["error_total"] + lt["non_200"], "error_kinds": lt["errors"],
                                   "statuses": lt["statuses"], "p50_ms": lt["latency_us"]["p50"] / 1e3,
                                   "p99_ms": lt["latency_us"]["p99"] / 1e3}})
                tte = r["time_to_effective_ms"]
                log(f"  churn {name:8} rep {rep}: {r['effective']}/{r['changes']} effective, "
                    f"p50 {tte.get('p50')} ms p99 {tte.get('p99')} ms; live errors {r['live']['errors']}")
                runs.append(r)
    finally:
        stop_tidegate(ctx, targets["tidegate"].tg)
        ctx.procs.stop(targets["nginx"].proc)
        ctx.procs.stop(targets["haproxy"].proc)

    summary = {}
    for name in targets:
        rs = [r for r in runs if r["system"] == name]
        summary[name] = {
            "reps": len(rs),
            "changes": sum(r["changes"] for r in rs),
            "never_effective": sum(r["never_effective"] + r["change_errors"] for r in rs),
            "p50_ms": median([r["time_to_effective_ms"].get("p50") for r in rs]),
            "p99_ms": median([r["time_to_effective_ms"].get("p99") for r in rs]),
            "mean_ms": median([r["time_to_effective_ms"].get("mean") for r in rs]),
            "apply_p50_ms": median([r["apply_ms"].get("p50") for r in rs]),
            "command_p50_ms": median([r["command_ms"].get("p50") for r in rs]),
            "live_requests": sum(r["live"]["requests"] for r in rs),
            "live_errors": sum(r["live"]["errors"] for r in rs),
            "live_p99_ms": median([r["live"]["p99_ms"] for r in rs]),
        }
    ratios = {}
    base = summary["tidegate"]
    for name in ("nginx", "haproxy"):
        s = summary[name]
        ratios[f"{name}_over_tidegate"] = {
            k: (round(s[k] / base[k], 1) if s.get(k) and base.get(k) else None) for k in ("p50_ms", "p99_ms", "mean_ms")
        }
    return {"rate": rate, "duration_s": duration, "reps": reps, "live_rate": live_rate,
            "method": "changes applied in order at an open-loop schedule; time from the scheduled change until a new "
                      "connection through the proxy answers 200 from the expected backend (polled every 1 ms)",
            "runs": runs, "summary": summary, "ratios": ratios}

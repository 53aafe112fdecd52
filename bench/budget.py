#!/usr/bin/env python3
"""Where a proxied request's time goes (issue 42's per-request budget):
CPU, system calls by kind, and context switches per request, for Tidegate,
nginx and HAProxy, each proxying keep-alive requests to the same nginx
backends (13 bytes, three ports), at each connection count.

    python3 bench/budget.py BIN_DIR [--conns "64 256"] [--duration 6] [--body-bytes 0]
                           [--reps 2] [--allocs] [--where [--top 25]] [--json OUT]

BIN_DIR holds the `tidegate` binary to measure (a plain `cargo build
--release --bins` copy, or scripts/build-release's). For each proxy and
connection count, `perf stat -p PIDS` counts the proxy's processes (every
thread; nginx's workers) for exactly as long as a `wrk -t2` run lasts:
task-clock, context switches, and the entries of the system calls a proxy
makes per request (reads, writes, epoll, futex, accept, connect, close).
Divided by the requests wrk completed. `--body-bytes N` makes the
backends answer N bytes instead (a body the proxy relays in pieces). The
proxies and variants run in turn, `--reps` times; medians are printed
(and written as JSON with `--json`). Needs nginx, haproxy, wrk and perf;
loopback only; everything it starts is stopped at the end.

`--allocs` then counts Tidegate's heap allocations per request in runs
of their own: uprobes (`perf probe -x BIN_DIR/tidegate`) on the entries of
mimalloc's `mi_malloc_aligned`, `mi_zalloc_aligned` and
`mi_realloc_aligned`, which Rust's allocations all go through in
Tidegate (each hit traps, so these runs' requests/s and CPU are not
comparable and are not reported); the probes are removed at the end. nginx
and HAProxy allocate from their own pools, which such a count would not
see, so only Tidegate's is counted.

`--where` then samples where each proxy's CPU goes, in runs of their own
(`perf record -e cpu-clock -F 4999 -p PIDS` for the length of a `wrk`
run, no call graphs): each function's samples turned into microseconds
per request, the kernel's functions and the process's own apart, and the
kernel's side by side for the three proxies (the same system calls can
cost the kernel different work: how many events an `epoll_wait` returns,
what a write wakes). The sampling adds CPU of its own, so the totals are
higher than `perf stat`'s and compare the proxies within one invocation
only.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.dont_write_bytecode = True
sys.path.insert(0, str(ROOT / "bench" / "lib"))

from harness import (Ctx, Procs, free_port, log, start_haproxy_proxy, start_nginx, start_tidegate,  # noqa: E402
                     stop_tidegate, wait_http, which)
from rules import family, parse_wrk  # noqa: E402

# The system calls counted, by the name perf knows their entry by.
SYSCALLS = ["read", "recvfrom", "readv", "write", "sendto", "writev", "sendmsg", "recvmsg", "epoll_wait",
            "epoll_pwait", "epoll_ctl", "futex", "accept4", "connect", "close", "sched_yield", "io_uring_enter"]


def perf_events() -> list[str]:
    """task-clock, context switches, and each counted system call this
    kernel has a tracepoint for."""
    have = subprocess.run(["perf", "list", "syscalls:sys_enter_*"], capture_output=True, text=True).stdout
    calls = [f"syscalls:sys_enter_{c}" for c in SYSCALLS if f"sys_enter_{c} " in have or f"sys_enter_{c}\n" in have]
    return ["task-clock", "context-switches"] + calls


def wrk(conns: int, duration: int, url: str) -> list[str]:
    """The load of every run: `wrk -t2`, closed loop, keep-alive."""
    return ["wrk", "-t2", f"-c{conns}", f"-d{duration}s", "--latency", url]


def measure(pids: list[int], url: str, conns: int, duration: int, events: list[str]) -> dict:
    """One wrk run with perf counting `pids` meanwhile; per request."""
    argv = ["perf", "stat", "-x", ",", "-e", ",".join(events), "-p", ",".join(map(str, pids)), "--",
            *wrk(conns, duration, url)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60)
    w = parse_wrk(r.stdout)
    n = max(w.get("requests") or 0, 1)
    counts = {}
    for line in r.stderr.splitlines():
        f = line.split(",")
        if len(f) >= 3 and f[0].replace(".", "", 1).isdigit():
            counts[f[2].replace("syscalls:sys_enter_", "")] = float(f[0])
    out = {"rps": w.get("rps"), "requests": w.get("requests"), "p99_ms": w.get("p99_ms"),
           "cpu_us_per_req": round(counts.get("task-clock", 0) * 1000 / n, 2),  # task-clock is in ms
           "context_switches_per_req": round(counts.get("context-switches", 0) / n, 3),
           "syscalls_per_req": {c: round(counts[c] / n, 3) for c in SYSCALLS if counts.get(c)}}
    out["syscalls_total_per_req"] = round(sum(out["syscalls_per_req"].values()), 3)
    return out


ALLOC_CALLS = ["mi_malloc_aligned", "mi_zalloc_aligned", "mi_realloc_aligned"]


def count_allocs(binary: Path, tg, a) -> dict:
    """Tidegate's allocations per request at each connection count, with
    uprobes on mimalloc's entry points (added here, removed at the end)."""
    group = "probe_" + re.sub(r"[^A-Za-z0-9_]", "_", binary.name)
    out = {}
    try:
        for call in ALLOC_CALLS:
            subprocess.run(["perf", "probe", "-q", "-x", str(binary.resolve()), "--add", call], check=True,
                           capture_output=True, timeout=60)
        events = [f"{group}:{c}" for c in ALLOC_CALLS]
        for conns in [int(c) for c in a.conns.split()]:
            argv = ["perf", "stat", "-x", ",", "-e", ",".join(events), "-p", str(tg.proc.pid), "--",
                    *wrk(conns, a.duration, f"http://{tg.proxy}/")]
            r = subprocess.run(argv, capture_output=True, text=True, timeout=a.duration + 60)
            n = max(parse_wrk(r.stdout).get("requests") or 0, 1)
            by = {}
            for line in r.stderr.splitlines():
                f = line.split(",")
                if len(f) >= 3 and f[0].isdigit():
                    by[f[2].split(":")[-1]] = round(int(f[0]) / n, 3)
            out[f"tidegate c={conns} allocations"] = {"allocs_per_req": round(sum(by.values()), 3), "by_call": by}
            log(f"  tidegate c={conns:<4} allocations per request: {by}")
    finally:
        subprocess.run(["perf", "probe", "-q", "-d", f"{group}:*"], capture_output=True, timeout=60)
    return out


SAMPLE_HZ = 4999


def where(pids: list[int], url: str, conns: int, duration: int, out: Path) -> dict:
    """One wrk run with perf sampling `pids`: microseconds of CPU per
    request by function, `[k]` the kernel's and `[.]` the process's."""
    argv = ["perf", "record", "-q", "-e", "cpu-clock", "-F", str(SAMPLE_HZ), "-o", str(out),
            "-p", ",".join(map(str, pids)), "--", *wrk(conns, duration, url)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 120)
    n = max(parse_wrk(r.stdout).get("requests") or 0, 1)
    rep = subprocess.run(["perf", "report", "-i", str(out), "--stdio", "--no-children", "--sort", "sym",
                          "-F", "sample,sym", "--percent-limit", "0"], capture_output=True, text=True, timeout=300)
    by: dict[str, float] = {}
    for line in rep.stdout.splitlines():
        m = re.match(r"\s*(\d+)\s+\[([k.])\]\s+(.*\S)", line)
        if m:
            key = f"[{m.group(2)}] {m.group(3)}"
            by[key] = by.get(key, 0.0) + int(m.group(1)) * 1e6 / SAMPLE_HZ / n
    kernel = sum(v for k, v in by.items() if k.startswith("[k]"))
    return {"requests": n, "us_per_req": round(sum(by.values()), 2), "kernel_us_per_req": round(kernel, 2),
            "by_function": {k: round(v, 3) for k, v in sorted(by.items(), key=lambda kv: -kv[1])}}


def print_where(found: dict, top: int) -> None:
    """The kernel's top functions side by side, then each proxy's own."""
    for conns in sorted({c for _, c in found}):
        names = [p for p, c in found if c == conns]
        rows = {}
        for p in names:
            for k, v in found[(p, conns)]["by_function"].items():
                rows.setdefault(k, {})[p] = v
        totals = "  ".join(f"{p} {found[(p, conns)]['us_per_req']} µs ({found[(p, conns)]['kernel_us_per_req']} "
                           f"kernel)" for p in names)
        print(f"\nc={conns}: sampled CPU per request: {totals}")
        print(f"{'kernel function':44}" + "".join(f"{p:>10}" for p in names))
        kern = sorted((k for k in rows if k.startswith("[k]")), key=lambda k: -max(rows[k].values()))
        for k in kern[:top]:
            print(f"{k[4:][:44]:44}" + "".join(f"{rows[k].get(p, 0):10.3f}" for p in names))
        for p in names:
            own = [(k, v) for k, v in found[(p, conns)]["by_function"].items() if k.startswith("[.]")]
            print(f"{p}'s own, {sum(v for _, v in own):.2f} µs: " +
                  ", ".join(f"{k[4:][:60]} {v:.3f}" for k, v in own[:12]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bin_dir")
    ap.add_argument("--conns", default="64 256")
    ap.add_argument("--duration", type=int, default=6)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--body-bytes", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--allocs", action="store_true")
    ap.add_argument("--where", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json")
    a = ap.parse_args()
    for tool in ("nginx", "haproxy", "wrk", "perf"):
        if not which(tool):
            sys.exit(f"{tool} is needed")
    work = Path(tempfile.mkdtemp(prefix="budget-"))
    ctx = Ctx(profile="full", bin_dir=Path(a.bin_dir), out_dir=work, work=work, procs=Procs())
    try:
        backends = [free_port() for _ in range(3)]
        listens = " ".join(f"listen 127.0.0.1:{b} reuseport;" for b in backends)
        if a.body_bytes:
            (work / "www").mkdir()
            (work / "www" / "body").write_bytes(b"x" * a.body_bytes)
            work.chmod(0o711)
            (work / "www").chmod(0o755)
            (work / "www" / "body").chmod(0o644)
            answer = f"root {work / 'www'}; try_files /body =404;"
        else:
            answer = 'return 200 "hello world!\\n";'
        start_nginx(ctx, "budget-backends", f"""events {{ worker_connections 8192; }}
http {{ access_log off; keepalive_requests 1000000;
  server {{ {listens} location / {{ {answer} }} }} }}""")
        upstream = " ".join(f"server 127.0.0.1:{b};" for b in backends)
        nginx_port, haproxy_port = free_port(), free_port()
        nginx, _ = start_nginx(ctx, "budget-nginx", f"""events {{ worker_connections 16384; }}
http {{ access_log off; keepalive_requests 1000000;
  upstream app {{ {upstream} keepalive 256; }}
  server {{ listen 127.0.0.1:{nginx_port} reuseport;
    location / {{ proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection ""; }} }} }}""",
                               workers=a.workers)
        haproxy = start_haproxy_proxy(ctx, "budget-haproxy", haproxy_port, [f"127.0.0.1:{b}" for b in backends],
                                      threads=a.workers, maxconn=8000)
        tg = start_tidegate(ctx, "budget", workers=a.workers)
        tg.admin.call("PUT", "/v1/services/app", {"backends": [{"id": f"b{i}", "addr": f"127.0.0.1:{b}"}
                                                               for i, b in enumerate(backends)]})
        tg.admin.call("PUT", "/v1/routes/app", {"match": {"path_prefix": "/"}, "service": "app"})
        proxies = {"tidegate": (tg.proxy, lambda: [tg.proc.pid]),
                   "nginx": (f"127.0.0.1:{nginx_port}", lambda: family(nginx.pid)[1:] or [nginx.pid]),
                   "haproxy": (f"127.0.0.1:{haproxy_port}", lambda: [haproxy.pid])}
        for addr, _ in proxies.values():
            wait_http(addr)
        events = perf_events()
        runs = []
        for rep in range(a.reps):
            for conns in [int(c) for c in a.conns.split()]:
                order = list(proxies) if rep % 2 == 0 else list(reversed(proxies))
                for name in order:
                    addr, pids = proxies[name]
                    r = measure(pids(), f"http://{addr}/", conns, a.duration, events)
                    r.update({"proxy": name, "conns": conns, "rep": rep})
                    log(f"  {name:8} c={conns:<4} rep {rep}: {r['rps']:.0f} req/s, {r['cpu_us_per_req']} µs CPU, "
                        f"{r['syscalls_total_per_req']} syscalls, {r['context_switches_per_req']} switches per request")
                    runs.append(r)
                    time.sleep(0.5)
        summary = {}
        for conns in [int(c) for c in a.conns.split()]:
            for name in proxies:
                rs = [r for r in runs if r["proxy"] == name and r["conns"] == conns]
                if not rs:  # --reps 0: only the allocation or sampling runs
                    continue
                med = lambda k: round(statistics.median(r[k] for r in rs), 3)  # noqa: E731
                calls = {c: round(statistics.median(r["syscalls_per_req"].get(c, 0) for r in rs), 3)
                         for c in SYSCALLS if any(c in r["syscalls_per_req"] for r in rs)}
                summary[f"{name} c={conns}"] = {"rps": med("rps"), "cpu_us_per_req": med("cpu_us_per_req"),
                                                "syscalls_per_req": med("syscalls_total_per_req"),
                                                "context_switches_per_req": med("context_switches_per_req"),
                                                "by_call": calls}
        if a.allocs:
            summary.update(count_allocs(Path(a.bin_dir) / "tidegate", tg, a))
        if a.where:
            found = {}
            for conns in [int(c) for c in a.conns.split()]:
                for name, (addr, pids) in proxies.items():
                    found[(name, conns)] = where(pids(), f"http://{addr}/", conns, a.duration,
                                                 work / f"perf-{name}-{conns}.data")
                    log(f"  {name:8} c={conns:<4} sampled: {found[(name, conns)]['us_per_req']} µs per request")
            summary.update({f"{p} c={c} where": v for (p, c), v in found.items()})
            print_where(found, a.top)
        for key, v in summary.items():
            if "by_function" in v:
                continue
            if "allocs_per_req" in v:
                print(f"{key:16} {v['allocs_per_req']:6.2f} allocations per request ({v['by_call']})")
                continue
            calls = ", ".join(f"{c} {n}" for c, n in v["by_call"].items() if n >= 0.01)
            print(f"{key:16} {v['rps']:>9.0f} req/s  {v['cpu_us_per_req']:6.2f} µs CPU  "
                  f"{v['syscalls_per_req']:5.2f} syscalls  {v['context_switches_per_req']:5.3f} switches  ({calls})")
        if a.json:
            Path(a.json).write_text(json.dumps({"params": vars(a), "runs": runs, "summary": summary}, indent=1))
        stop_tidegate(ctx, tg)
    finally:
        for p in ctx.procs.started:
            if p.poll() is None:
                p.terminate()
        for p in ctx.procs.started:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()

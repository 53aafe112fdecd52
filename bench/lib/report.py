"""The Markdown report and the PNG plots of one results directory."""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path

from harness import ROOT, log, which

# The papers' numbers (../shared/seeds/), for reference beside ours.
PAPER_S0 = {  # mean delay per configuration request, ms, at requests/s (Tables I-III)
    100: {"original": 26.20, "BRC": 11.64, "BFP": 13.81, "IMC": 24.70},
    200: {"original": 29.75, "BRC": 6.14, "BFP": 8.09, "IMC": 25.21},
    300: {"original": 32.91, "BRC": 4.32, "BFP": 6.18, "IMC": 26.20},
    400: {"original": 40.78, "BRC": 3.37, "BFP": 5.40, "IMC": 31.76},
    500: {"original": 46.54, "BRC": 2.82, "BFP": 4.75, "IMC": 34.78},
    600: {"original": 52.62, "BRC": 2.41, "BFP": 4.26, "IMC": 38.50},
}
PAPER_S2 = {  # cluster response time, ms, by concurrent connections (Table II): single machine, CVM + nginx
    500: (6.08, 5.68), 1000: (8.98, 4.92), 1500: (30.86, 8.18), 2000: (69.3, 6.12), 2500: (127.9, 8.78),
    3000: (170.58, 9.9), 3500: (188.06, 11.64), 4000: (202.98, 18.22), 4500: (222.2, 16.7), 5000: (239.06, 24.52),
}
PAPER_S3 = {  # Table II, 500 LoadRunner users: failure rate %, max response time
    "IP_Hash": (50.19, 298), "Weighted Round-Robin": (3.36, 209), "Dynamic Feedback": (0.67, 84),
}
PAPER_S3_MAP = {"tidegate-ip_hash": "IP_Hash", "nginx-ip_hash": "IP_Hash",
                "tidegate-round_robin-weighted": "Weighted Round-Robin", "nginx-weighted": "Weighted Round-Robin",
                "tidegate-dynamic_feedback": "Dynamic Feedback"}
PAPER_S1 = [("100 B", 4.32, 10.24, 5.92), ("1 KB", 4.99, 9.74, 4.75), ("10 KB", 6.43, 14.85, 8.42)]
PAPER_S4 = {"direct": (78.5, 7.7, None), "nginx": (80.2, 10.6, 2), "tidegate_distributor": (82.6, 7.5, 5)}


def fmt(v, digits=2, unit=""):
    if v is None:
        return "—"
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}{unit}"
        return f"{v:.{digits}f}{unit}"
    if isinstance(v, int):
        return f"{v:,}{unit}"
    return f"{v}{unit}"


def table(header: list[str], rows: list[list]) -> str:
    out = ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def machine() -> dict:
    def cmd(argv):
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=10)
            return (r.stdout + r.stderr).strip().splitlines()[0] if (r.stdout + r.stderr).strip() else ""
        except (OSError, subprocess.TimeoutExpired):
            return ""
    cpu = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(open("/proc/meminfo").readline().split()[1])
        mem = f"{kb / 1024 / 1024:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    import os
    dirty = cmd(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
    return {"cpus": os.cpu_count(), "cpu": cpu, "memory": mem, "kernel": platform.release(),
            "python": platform.python_version(),
            "nginx": cmd([which("nginx") or "nginx", "-v"]), "haproxy": cmd([which("haproxy") or "haproxy", "-v"]),
            "wrk": cmd(["wrk", "--version"]).split(" [")[0],
            "commit": cmd(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]) + (" (with local changes)"
                                                                                       if dirty else "")}


# ---------------------------------------------------------------- plots

def plots(out: Path, results: dict) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is missing: no plots")
        return []
    made = []
    for name, fn in (("churn", plot_churn), ("throughput", plot_throughput), ("heterogeneous", plot_heterogeneous),
                     ("peak", plot_peak), ("overhead", plot_overhead), ("tls", plot_tls),
                     ("hostile", plot_hostile), ("cluster", plot_cluster), ("rules", plot_rules)):
        r = results.get(name)
        if not r or "error" in r:
            continue
        try:
            fig = fn(plt, r)
            path = out / f"{name}.png"
            fig.tight_layout()
            fig.savefig(path, dpi=80)
            plt.close(fig)
            made.append(path.name)
        except Exception as e:  # a plot never fails the run
            log(f"plot {name}: {e}")
    return made


def plot_churn(plt, r):
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    s = r["peers"]["summary"]
    names = [n for n in ("tidegate", "nginx", "haproxy") if n in s]
    x = range(len(names))
    a.bar([i - 0.2 for i in x], [s[n]["p50_ms"] or 0 for n in names], 0.4, label="p50")
    a.bar([i + 0.2 for i in x], [s[n]["p99_ms"] or 0 for n in names], 0.4, label="p99")
    a.set_xticks(list(x), names)
    a.set_yscale("log")
    a.set_ylabel("change → answered (ms)")
    a.set_title(f"vs peers at {r['peers']['rate']:g} changes/s")
    a.legend()
    rows = [x for x in r["tidegate_summary"] if "rate" in x]
    for suite in sorted({x["suite"] for x in rows}):
        rs = [x for x in rows if x["suite"] == suite]
        b.plot([x["rate"] for x in rs], [x["p99_ms"] for x in rs], "o-", label=f"Tidegate p99 ({suite})")
        b.plot([x["rate"] for x in rs], [x["p50_ms"] for x in rs], "s--", label=f"Tidegate p50 ({suite})")
        floor = [x for x in rs if x.get("floor_p99_ms")]
        if floor:
            b.plot([x["rate"] for x in floor], [x["floor_p99_ms"] for x in floor], "^:", color="grey",
                   label=f"disk floor p99 ({suite})")
    paper = sorted(PAPER_S0)
    b.plot(paper, [PAPER_S0[k]["BRC"] for k in paper], "k:", label="paper BRC (mean)")
    b.plot(paper, [PAPER_S0[k]["original"] for k in paper], "r:", label="paper nginx reload (mean)")
    b.set_xscale("log")
    b.set_yscale("log")
    b.set_xlabel("changes/s")
    b.set_ylabel("ms")
    b.set_title("time to effective")
    b.legend(fontsize=6)
    return fig


def plot_throughput(plt, r):
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    conns = sorted(r["summary"], key=int)
    for proxy in THROUGHPUT_TARGETS:
        ys = [r["summary"][c].get(proxy, {}).get("rps") for c in conns]
        ps = [r["summary"][c].get(proxy, {}).get("p99_ms") for c in conns]
        a.plot([int(c) for c in conns], ys, "o-", label=proxy)
        b.plot([int(c) for c in conns], ps, "o-", label=proxy)
    a.set_xlabel("connections")
    a.set_ylabel("requests/s")
    a.set_title("throughput (wrk, closed loop)")
    a.legend(fontsize=7)
    b.set_xlabel("connections")
    b.set_ylabel("p99 (ms)")
    b.set_yscale("log")
    b.set_title("p99 latency")
    for ax in (a, b):
        if len(conns) > 1:
            ax.set_xscale("log")
    return fig


def plot_heterogeneous(plt, r):
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    users = r["users"]
    labels = [u["label"] for u in users]
    a.barh(range(len(users)), [u["p99_ms"] for u in users])
    a.set_yticks(range(len(users)), labels, fontsize=6)
    for i, u in enumerate(users):
        a.text(u["p99_ms"], i, f" {u['failure_pct']:.2f}% failed", va="center", fontsize=6)
    a.set_xlabel("p99 (ms)")
    a.set_title("closed loop users")
    a.invert_yaxis()
    for label in sorted({s["label"] for s in r["sweep"]}):
        ss = sorted((s for s in r["sweep"] if s["label"] == label), key=lambda s: s["load"])
        b.plot([s["load"] for s in ss], [s["p99_ms"] for s in ss], "o-", label=label)
    b.set_xlabel("offered load / capacity (Poisson)")
    b.set_ylabel("p99 (ms)")
    b.set_yscale("log")
    b.set_title("open-loop sweep")
    b.legend(fontsize=5)
    return fig


def plot_peak(plt, r):
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for name, v in r["variants"].items():
        tl = v["timeline"]
        a.plot([x["t_s"] for x in tl], [x["p99_us"] / 1e3 if x["ok"] else float("nan") for x in tl],
               label=f"{name} p99")
    a.set_yscale("log")
    a.set_ylabel("p99 per second (ms)")
    a.legend(fontsize=7)
    auto = r["variants"]["autoscaled"]
    t, rates = 0, []
    for s in auto["steps"]:
        rates += [(t, s["rate"]), (t + s["duration_s"], s["rate"])]
        t += s["duration_s"]
    b.plot([x for x, _ in rates], [y for _, y in rates], "k-", label="offered (req/s)")
    f1 = r["variants"].get("fixed_1")
    if f1:
        b.plot([x["t_s"] for x in f1["timeline"]], [x["failed"] / r.get("bin_s", 1) for x in f1["timeline"]], "r:",
               label="fixed_1 failed/s")
    b.set_ylabel("requests/s")
    c = b.twinx()
    pts = auto["autoscale"]["instances_timeline"] + [(t, auto["autoscale"]["instances_timeline"][-1][1])]
    c.step([x for x, _ in pts], [y for _, y in pts], where="post", color="tab:green", label="serving instances")
    c.set_ylabel("instances")
    c.set_ylim(0, (r.get("max") or 4) + 1)
    b.set_xlabel("seconds since the ramp started")
    b.legend(loc="upper left", fontsize=7)
    c.legend(loc="upper right", fontsize=7)
    a.set_title(f"peak: {r['slots']} slots x {r['service_ms']} ms per instance ({r['capacity_per_instance']:g}/s)")
    return fig


def plot_overhead(plt, r):
    fig, ax = plt.subplots(figsize=(6, 3.2))
    s = r["summary"]
    names = list(s)
    x = range(len(names))
    pace = f"{r['rate']:g}/s" if r.get("rate") else "sequential"
    ax.bar(x, [s[n]["mean_us"] for n in names], yerr=[s[n]["stddev_us"] for n in names], capsize=3,
           label=f"{pace}: mean ± sd")
    ax.plot(x, [s[n]["p50_us"] for n in names], "kD", label=f"{pace}: p50")
    if r.get("back_to_back"):
        warm = r["back_to_back"]["summary"]
        ax.plot(x, [warm[n]["p50_us"] for n in names], "o", color="tab:orange", label="back to back: p50")
    ax.set_xticks(list(x), [n.replace("_", "\n") for n in names], fontsize=7)
    ax.set_ylabel("µs per request")
    how = ", paths in turn" if r.get("interleaved") else ""
    ax.set_title(f"sequential requests ({r['requests']} x {r['reps']}{how}), emulator {r['service_time']}",
                 fontsize=9)
    ax.legend(fontsize=7)
    return fig


# ---------------------------------------------------------------- markdown

def markdown(out: Path, results: dict, meta: dict, pngs: list[str]) -> str:
    m = meta["machine"]
    md = [f"# Tidegate benchmarks — {meta['started']} ({meta['profile']} profile)\n",
          f"Command: `{meta['command']}` — wall time {meta['elapsed_s']:.0f} s.\n",
          f"**Machine**: {m['cpus']} CPUs ({m['cpu']}), {m['memory']}, kernel {m['kernel']}, loopback only. "
          f"**Peers**: {m['nginx']}; {m['haproxy']}; {m['wrk']}. **Tidegate**: {meta['binaries']} binaries"
          f"{' (build: ' + meta['build'] + ')' if meta.get('build') else ''}, "
          f"commit {m['commit']}. No CPU pinning (`taskset` not used): load generator, backends and proxies share "
          "the same cores, under the same conditions for every contender. Configurations: the scripts in `bench/` "
          "(nginx and HAProxy configs are written inline there), and `configs/` beside this report for the "
          "Python-driven scenarios.\n"]
    if meta["profile"] == "smoke":
        md.append("> **Smoke profile**: seconds-long runs with small loads and debug binaries. These numbers only "
                  "show that the harness works; do not compare them.\n")
    for name, title, fn in (("churn", "1. Configuration churn (paper S0)", md_churn),
                            ("throughput", "2. Throughput and concurrency (paper S2)", md_throughput),
                            ("heterogeneous", "3. Heterogeneous backends (paper S3)", md_heterogeneous),
                            ("peak", "4. Peak and autoscaling (paper S1)", md_peak),
                            ("overhead", "5. Overhead (paper S4)", md_overhead),
                            ("hostile", "6. Hostile load (issues 9 and 35)", md_hostile),
                            ("tls", "7. TLS at the front door and to backends (issue 10)", md_tls),
                            ("cluster", "8. Cluster mode through etcd (issue 11)", md_cluster),
                            ("rules", "9. Traffic rules (issue 37)", md_rules),
                            ("upgrade", "10. Binary upgrades under load (issue 38)", md_upgrade),
                            ("tracing", "11. Tracing (issue 40)", md_tracing)):
        if name not in results:
            continue
        md.append(f"\n## {title}\n")
        r = results[name]
        if "error" in r:
            md.append(f"**Failed**: `{r['error'][:800]}`\n")
            continue
        try:
            md.append(fn(r))
        except Exception as e:
            md.append(f"(report section failed: {e})\n")
        if f"{name}.png" in pngs:
            md.append(f"\n![{name}]({name}.png)\n")
    text = "\n".join(md)
    (out / "report.md").write_text(text)
    return text


def md_churn(r):
    p = r["params"]
    s = ["A change is a new exact-path route. Time to effective: from the change's **scheduled** send time (open "
         f"loop) until the proxy serves the new route. Live traffic at {p['live_rate']} req/s meanwhile. "
         f"\"loaded\" = {p['preload']:,} services (10 backends each) and {p['preload']:,} routes preloaded. "
         "Answer: from the moment the client's task sends the change until Tidegate answers 200 (durable and live). "
         "Disk floor: the same rate and live traffic, no Tidegate: each change a 4 KiB write and an `fdatasync` "
         "by one group-committing thread (`tidegate-bench disk-floor`), timed the same way; the least a durable "
         "change costs on this disk.\n"]
    rows = []
    for x in r["tidegate_summary"]:
        if "rate" not in x:
            continue
        paper = PAPER_S0.get(int(x["rate"]))
        rows.append([x["suite"], f"{x['rate']:g}/s", x["p50_ms"], x["p90_ms"], x["p99_ms"],
                     f"{fmt(x.get('answer_p50_ms'), 3)} / {fmt(x.get('answer_p99_ms'), 3)}",
                     f"{fmt(x.get('floor_p50_ms'), 3)} / {fmt(x.get('floor_p99_ms'), 3)}",
                     f"{x['live_errors']} / {x['live_requests']}", x["live_p99_ms"],
                     f"{paper['original']:.1f} / {paper['BRC']:.1f}" if paper else "—"])
    s.append(table(["suite", "rate", "effective p50 ms", "p90 ms", "p99 ms", "answer p50 / p99 ms",
                    "disk floor p50 / p99 ms", "live errors", "live p99 ms", "paper mean ms (reload / best BRC)"],
                   rows))
    sat = [[x["suite"], x["saturate"], x["change_sets_per_s"], x["ops_per_s"], x["p50_ms"], x["p99_ms"], x["errors"]]
           for x in r["tidegate_summary"] if "saturate" in x]
    if sat:
        s.append(f"\nSustained (closed loop, {p['clients']} keep-alive clients):\n\n")
        s.append(table(["suite", "run", "change sets/s", "ops/s", "p50 ms", "p99 ms", "errors"], sat))
    pr = r["peers"]
    s.append(f"\n**Versus nginx and HAProxy**, same run, {pr['rate']:g} changes/s for {pr['duration_s']:g} s, "
             f"{pr['reps']} repetition(s) alternated (medians). {pr['method']}. nginx: rewrite the config with one "
             "more `location = /churn/...` and `nginx -c FILE -s reload`; HAProxy: `set server be/s1 addr ... port "
             "...` on the stats socket (in memory only, not persisted), alternating between two emulators; Tidegate:"
             " `PUT /v1/routes/...` (fsync'd before the answer). Live traffic at "
             f"{pr['live_rate']:g} req/s through each proxy meanwhile (tidegate-bench traffic, keep-alive).\n\n")
    rows = []
    for n, v in pr["summary"].items():
        ratio = pr["ratios"].get(f"{n}_over_tidegate", {})
        rows.append([n, v["p50_ms"], v["p99_ms"], v["mean_ms"], v["command_p50_ms"],
                     f"{v['never_effective']} / {v['changes']}", f"{v['live_errors']} / {v['live_requests']}",
                     v["live_p99_ms"], f"{fmt(ratio.get('p50_ms'), 1)}x / {fmt(ratio.get('p99_ms'), 1)}x"
                     if ratio else "1x"])
    s.append(table(["system", "p50 ms", "p99 ms", "mean ms", "command p50 ms", "failed changes", "live errors",
                    "live p99 ms", "p50 / p99 vs Tidegate"], rows))
    six = [x for x in r["tidegate_summary"] if x.get("rate") == 600.0]
    nginx_ratio = pr["ratios"].get("nginx_over_tidegate", {}).get("p50_ms")
    s.append("\nGoals: p99 < 1 ms at 600 changes/s: " + (", ".join(
        f"{x['suite']} {x['p99_ms']:.2f} ms ({'met' if x['p99_ms'] < 1 else 'not met'})" for x in six) or "not run")
        + "; the answer's p99 < 0.5 ms at 600 changes/s (issue 8): " + (", ".join(
            f"{x['suite']} {fmt(x.get('answer_p99_ms'), 3)} ms "
            f"({'met' if (x.get('answer_p99_ms') or 9) < 0.5 else 'not met'}; disk floor "
            f"{fmt(x.get('floor_p99_ms'), 3)} ms)" for x in six) or "not run")
        + f"; ≥ 100x faster than nginx reload: {fmt(nginx_ratio, 1)}x at p50 "
        f"({'met' if nginx_ratio and nginx_ratio >= 100 else 'not met'}); zero live errors: "
        + ("met" if all((x.get("live_errors") or 0) == 0 for x in r["tidegate_summary"] if "rate" in x)
           and pr["summary"]["tidegate"]["live_errors"] == 0 else "not met") + ".\n")
    return "".join(s)


# Throughput targets, in report order: Tidegate (its default HTTP/1 engine,
# the native one), Tidegate on hyper's HTTP/1 (`--http1 hyper`), the minimal
# hyper proxy (the library ceiling), the peers, and the backend directly.
THROUGHPUT_TARGETS = ("tidegate", "tidegate-hyper", "hyper-min", "nginx", "haproxy", "direct")


def md_throughput(r):
    p = r["params"]
    s = [f"Three backends (one nginx serving 13 bytes on three ports); each proxy with {p['workers']} workers "
         "(nginx `worker_processes`, upstream `keepalive 256`; HAProxy `nbthread`, `http-reuse always`; Tidegate "
         f"`--workers`); wrk `-t2` closed loop, {p['duration']} s per run, {p['reps']} repetition(s) alternated, "
         "medians. `tidegate` is the default (native HTTP/1) engine, `tidegate-hyper` the same binary with "
         "`--http1 hyper`, `hyper-min` the minimal hyper proxy (no routing, balancing, limits or metrics: the "
         "library ceiling). RSS = resident memory of all the proxy's processes at the end of the run; CPU = "
         "cores busy during the run, and per request. Paper S2 (Table II): mean response time of a CVM + nginx "
         "cluster vs a single machine; different hardware and workload, for the shape only.\n\n"]
    rows = []
    for c in sorted(r["summary"], key=int):
        row = r["summary"][c]
        paper = PAPER_S2.get(int(c))
        for proxy in THROUGHPUT_TARGETS:
            v = row.get(proxy)
            if not v:
                continue
            rows.append([c, proxy, v["rps"], v["mean_ms"], v["p99_ms"], v["errors"], v["rss_mib"], v["cpu_cores"],
                         v.get("cpu_us_per_req") if proxy != "direct" else "—",
                         fmt(v["vs_nginx"], 2) + "x" if v["vs_nginx"] else "—",
                         f"{paper[1]} (single {paper[0]})" if paper and proxy == "nginx" else ""])
    s.append(table(["conns", "target", "req/s", "mean ms", "p99 ms", "errors", "RSS MiB", "CPU cores", "CPU µs/req",
                    "vs nginx", "paper mean ms"], rows))
    worst = [(c, row["tidegate"]["vs_nginx"]) for c, row in r["summary"].items()
             if "tidegate" in row and row["tidegate"].get("vs_nginx")]
    if worst:
        s.append("\nGoal (≥ nginx req/s at every concurrency): " + ", ".join(f"c={c}: {v:.2f}x" for c, v in
                                                                             sorted(worst, key=lambda x: int(x[0])))
                 + (" — met" if all(v >= 1 for _, v in worst) else " — not met") + ".\n")
    return "".join(s)


def md_heterogeneous(r):
    p = r["params"]
    s = [f"Three emulators with 1, 2 and 4 service slots (capacity 1:2:4), exponential 20 ms service time, queue 20 "
         f"(503 beyond). Closed loop: {p['users']} users, exponential think time {p['think_ms']} ms, "
         f"{p['duration']} s per variant. Paper S3 Table II (LoadRunner, 500 users): failure rate and max response "
         "time.\n\n"]
    rows = []
    for u in r["users"]:
        paper = PAPER_S3.get(PAPER_S3_MAP.get(u["label"], ""))
        rows.append([u["label"], u["failure_pct"], u["p50_ms"], u["p99_ms"], u["max_ms"], u.get("rps"),
                     " ".join(f"{k}:{v:g}%" for k, v in u["share_pct"].items()),
                     f"{paper[0]}% / {paper[1]}" if paper else ""])
    s.append(table(["variant", "failed %", "p50 ms", "p99 ms", "max ms", "req/s", "share", "paper failed / max"],
                   rows))
    if r["sweep"]:
        loads = sorted({x["load"] for x in r["sweep"]})
        s.append(f"\nOpen-loop Poisson sweep ({p['sweep_duration']} s per level; load = offered rate / 350 req/s): "
                 "p99 ms (failed %).\n\n")
        rows = []
        for label in dict.fromkeys(x["label"] for x in r["sweep"]):
            cells = []
            for load in loads:
                x = next((x for x in r["sweep"] if x["label"] == label and x["load"] == load), None)
                cells.append(f"{x['p99_ms']:.1f} ({x['failure_pct']:.2f}%)" if x else "—")
            rows.append([label, *cells])
        s.append(table(["variant", *[f"{x:g}" for x in loads]], rows))
    if r.get("halved"):
        s.append(f"\nCapacity halved at run time: c4 goes from 4 to 2 slots halfway through a {p['duration']} s "
                 "closed-loop run (the emulator's runtime control); for Tidegate, the time until c4's learned limit "
                 "is at most 3.\n\n")
        rows = [[h["label"], h["failure_pct"], h["p50_ms"], h["p99_ms"], h.get("rps"),
                 "—" if h["limit_follow_s"] is None else h["limit_follow_s"]] for h in r["halved"]]
        s.append(table(["variant", "failed %", "p50 ms", "p99 ms", "req/s", "limit followed in s"], rows))
    return "".join(s)


def md_peak(r):
    v = r["variants"]
    a = v["autoscaled"]["autoscale"]
    steps = ", ".join(f"{x['rate']}/s x {x['duration_s']} s" for x in v["autoscaled"]["steps"])
    s = [f"Each instance: tidegate-emulator, {r['slots']} slots, fixed {r['service_ms']} ms "
         f"({r['capacity_per_instance']:g} req/s). Open-loop ramp (tidegate-bench ramp, Poisson arrivals, the same "
         f"seed for every variant): {steps}. Policy least_conn. "
         f"fixed_1 = one static instance; fixed_max = {r['max']} static instances; autoscaled = one static instance "
         f"plus the process provider (min 1, max {r['max']}, target_in_flight {r['slots']}, "
         f"peak_hold_s {r['autoscale_block']['peak_hold_s']}, stable_window_s "
         f"{r['autoscale_block']['stable_window_s']}, panic_window_s {r['autoscale_block']['panic_window_s']}). "
         "The peak = the steps above one instance's capacity.\n\n"]
    rows = []
    for name, x in v.items():
        pk = x["peak"] or {}
        rows.append([name, pk.get("p50_ms"), pk.get("p99_ms"), pk.get("max_ms"),
                     f"{pk.get('failed')} / {pk.get('requests')}", f"{x['failed_total']} / {x['requests']}",
                     f"{(x.get('autoscale') or {}).get('max_instances', x['static_instances'])} / "
                     f"{(x.get('autoscale') or {}).get('instances_at_end', x['static_instances'])}",
                     f"{fmt(r['added_latency_us_at_warm_p50'].get(name), 0)} / "
                     f"{fmt((r.get('added_latency_us_at_warm_mean') or {}).get(name), 0)}"])
    ref = "nginx (reference)"
    if ref in r["added_latency_us_at_warm_p50"]:
        rows.append([ref + ", first step only", "", "", "", "", "", "1 / 1",
                     f"{fmt(r['added_latency_us_at_warm_p50'][ref], 0)} / "
                     f"{fmt(r['added_latency_us_at_warm_mean'][ref], 0)}"])
    s.append(table(["variant", "peak p50 ms", "peak p99 ms", "peak max ms", "failed in peak", "failed overall",
                    "instances max / at end", "added µs p50 / mean (first step, vs direct)"], rows))
    s.append("\nFailed = non-2xx answers, transport errors and client timeouts (5 s). The added latency compares "
             "the first (low) step through the proxy with the same step sent straight to an emulator; the "
             "emulator's 20 ms sleep is quantised by its timer, so differences below ~100 µs are noise here; fixed_max is left out (it serves that step with "
             f"{r['max']} instances, so it queues less). At "
             "50 requests/s every hop also wakes idle threads, so a proxy adds more than in the busy sequential "
             "loop of section 5 (which measures the overhead precisely); nginx's figure in the same conditions "
             "is the reference.\n")
    s.append("\nAutoscaled, from `GET /v1/events` and the responses' `x-backend`:\n\n")
    s.append("Overload start = the start of the first step above one instance's capacity (a negative time: the "
             "autoscaler acted before it, on a step near capacity).\n")
    s.append(table(["overload start → scale-out decision", "decision → instance ready",
                    "decision → first answer from it", "failed during scale-in", "scale-out decisions"],
                   [[fmt(a["time_to_detect_ms"], 0, " ms"), fmt(a["decision_to_ready_ms"], 0, " ms"),
                     fmt(a["decision_to_first_served_ms"], 0, " ms"),
                     "no scale-in seen" if a["failed_during_scale_in"] is None else str(a["failed_during_scale_in"]),
                     "; ".join(f"→{e['desired']} ({e['reason']})" for e in a["scale_out_events"]) or "none"]]))
    s.append("\nPaper S1 (Table I): its middleware added 4.75–8.42 ms per request (e.g. 100 B: 4.32 → 10.24 ms); "
             "threshold 50 ms, peak mode held 5 minutes; no time-to-scale figures. "
             f"Scale-in goal (zero failed requests): "
             + ("met" if a["failed_during_scale_in"] == 0 else "not met" if a["failed_during_scale_in"] else
                "not observed") + ".\n")
    return "".join(s)


def md_overhead(r):
    if not r.get("interleaved"):
        return md_overhead_sequential(r)
    s = [f"{r['requests']} sequential requests per path and repetition (one keep-alive connection each, "
         f"tidegate-bench sequential, {r['warmup']} warm-up requests), at two paces: {r['rate']:g} requests/s per "
         "path, and back to back. The paths are measured in turn in the same seconds, one request on the machine at "
         "a time, in a new random order every round, in two groups with a direct path each: direct, Tidegate, nginx "
         f"and HAProxy; then direct and Tidegate's three paths. {r['reps']} repetition(s), medians. Backend: "
         f"tidegate-emulator, service time {r['service_time']}. Added = the path's value minus direct's in the same "
         "group and repetition. Paper S4 (Table 1, 3,000 requests, an application taking 78.5 ms): direct 78.5 ± "
         "7.7 ms, nginx 80.2 ± 10.6 ms (+2 %), nginx with the distributor 82.6 ± 7.5 ms (+5 %). \"% of 78.5 ms\" "
         "puts our added time against the paper's application time.\n\n"]
    for title, part in ((f"**{r['rate']:g} requests/s per path**", r),
                        ("**Back to back**", r["back_to_back"])):
        s.append(f"{title}:\n\n")
        s.append(overhead_table(part["summary"]))
        d = part.get("tidegate_minus_nginx_p50_us")
        if d is not None:
            s.append(f"\nTidegate's p50 minus nginx's, measured in the same seconds: {d:+.1f} µs.")
        if part.get("learned_limits_added_p50_us") is not None:
            s.append(f" Learned limits (`tidegate` against `tidegate_no_learning`): "
                     f"{part['learned_limits_added_p50_us']:+.1f} µs at p50.")
        s.append("\n\n")
    g = r["goal"]
    d = g["tidegate_minus_nginx_p50_us"]
    s.append(f"Goals: issue 8, added latency at {r['rate']:g} requests/s no worse than nginx's: "
             f"{fmt(d, 1)} µs against nginx — {'met' if g['no_worse_than_nginx'] else 'not met'}. Issue 12, learned "
             f"limits at most 2 µs at p50: {fmt(r['learned_limits_added_p50_us'], 1)} µs — "
             f"{'met' if (r['learned_limits_added_p50_us'] or 0) <= 2 else 'not met'}. Under 100 µs added at p50 back "
             f"to back: {fmt(g['tidegate_added_p50_us'], 1)} µs — {'met' if g['met'] else 'not met'}.\n")
    return "".join(s)


def overhead_table(summary: dict) -> str:
    rows = []
    for name, v in summary.items():
        paper = PAPER_S4.get(name)
        rows.append([name, v["mean_us"], v["stddev_us"], v["p50_us"], v["p99_us"], fmt(v["added_mean_us"], 1),
                     fmt(v["added_p50_us"], 1), f"{(v['added_mean_us'] or 0) / 785:.3f} %",
                     f"{paper[0]} ± {paper[1]} ms" + (f" (+{paper[2]} %)" if paper[2] else "") if paper else "",
                     v["failed"]])
    return table(["path", "mean µs", "sd µs", "p50 µs", "p99 µs", "added mean µs", "added p50 µs",
                  "% of 78.5 ms", "paper", "failed"], rows)


def md_overhead_sequential(r):
    """Runs before the paths were interleaved (one path after another)."""
    s = [f"{r['requests']} sequential requests per run (one keep-alive connection, tidegate-bench sequential, "
         f"{r['warmup']} warm-up requests), {r['reps']} repetition(s) with the order rotated, medians. Backend: "
         f"tidegate-emulator, service time {r['service_time']}. Added = the path's value minus direct's in the same "
         "repetition.\n\n", overhead_table(r["summary"])]
    g = r["goal"]
    s.append(f"\nGoal (< 100 µs added at p50 by Tidegate): {fmt(g['tidegate_added_p50_us'], 1)} µs — "
             f"{'met' if g['met'] else 'not met'}.\n")
    if r.get("learned_limits_added_p50_us") is not None:
        added = r["learned_limits_added_p50_us"]
        s.append(f"\nLearned concurrency limits (`tidegate` against `tidegate_no_learning`, same process): "
                 f"{added:+.1f} µs at p50 (goal: at most 2 µs) — {'met' if added <= 2 else 'not met'}.\n")
    return "".join(s)


def write(out: Path, results: dict, meta: dict) -> str:
    pngs = plots(out, results)
    text = markdown(out, results, meta, pngs)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return text


TLS_MODES = (("handshake", "new TLS handshakes (Connection: close, no resumption)"),
             ("h1", "HTTP/1.1 over TLS, keep-alive (wrk)"), ("h2", "HTTP/2 over TLS, 10 streams per connection (h2load)"),
             ("up_h1", "TLS to the backend, HTTP/1.1 keep-alive (wrk over plain HTTP)"),
             ("up_h2", "TLS to the backend, HTTP/2 (wrk over plain HTTP)"))
# Termination modes, where the goal is nginx's figure.
TLS_GOAL_MODES = ("handshake", "h1", "h2")


def vs_peer(row: dict, proxy: str):
    """A proxy's requests/s relative to nginx's, or to HAProxy's where nginx
    did not run (it has no HTTP/2 to backends outside gRPC)."""
    peer = "nginx" if "nginx" in row else "haproxy"
    base = (row.get(peer) or {}).get("rps")
    v = row.get(proxy)
    return (round(v["rps"] / base, 3) if v and base else None), peer


def md_tls(r):
    p = r["params"]
    s = [f"Same ECDSA P-256 certificate (openssl) for every proxy, one nginx backend, {p['workers']} workers each "
         f"(nginx `ssl_session_cache` and tickets; HAProxy `alpn h2,http/1.1`; Tidegate `--listen-tls`, the "
         f"certificate put through the API), {p['conns']} connections, {p['duration']} s per run, {p['reps']} "
         "repetition(s) alternated, medians. CPU µs/req = the proxy's CPU time over the requests served.\n\n"]
    rows = []
    names = {"tidegate_acme": "tidegate (managed certificate)"}
    for mode, label in TLS_MODES:
        for proxy in ("tidegate", "tidegate_acme", "nginx", "haproxy"):
            v = r["summary"].get(mode, {}).get(proxy)
            if not v:
                continue
            ratio, peer = vs_peer(r["summary"][mode], proxy)
            rows.append([label, names.get(proxy, proxy), v["rps"], v.get("p99_ms"), v.get("cpu_us_per_req"),
                         v["errors"], f"{fmt(ratio, 2)}x {peer}" if ratio else "—"])
    s.append(table(["mode", "proxy", "req/s", "p99 ms", "CPU µs/req", "errors", "vs peer"], rows))
    for c in (x for x in r["runs"] if x.get("mode") == "cert_put"):
        s.append(f"\nCertificate churn (Tidegate): {c['puts']} replacements of one certificate through the API, each "
                 f"followed by a new verifying handshake: answer p50 {c['answer_p50_ms']} ms, p99 "
                 f"{c['answer_p99_ms']} ms, max {c['answer_max_ms']} ms; **{c['live_on_next_handshake']} of "
                 f"{c['puts']}** handshakes after the answer were served the new certificate.\n")
    for c in (x for x in r["runs"] if x.get("mode") == "on_demand"):
        s.append(f"\nOn-demand TLS under a flood (Tidegate with the managed certificate and an on-demand template "
                 f"whose `ask` endpoint refuses every name): {c['flood_handshakes']} handshakes with made-up server "
                 f"names over {c['flood_s']} s ({c['flood_per_s']}/s of {c['flood_rate']}/s offered), while a normal client made HTTPS requests on "
                 f"new connections at {c['normal_rate']}/s: its p50/p99 {c['quiet_p50_ms']}/{c['quiet_p99_ms']} ms "
                 f"quiet, {c['control_p50_ms']}/{c['control_p99_ms']} ms during the same flood for the certificate's "
                 f"own name (the control: what the handshakes cost), {c['flood_p50_ms']}/{c['flood_p99_ms']} ms "
                 f"during the flood of refused names (**p99 {c['p99_ratio']}x quiet**, goal ≤ 2x; "
                 f"{c['p99_ratio_to_control']}x the control), {c['errors']} failed; "
                 f"**{c['orders_during_flood']} orders** at Pebble; "
                 f"{c['names_asked']} names asked, at most {c['most_questions_per_name']} question(s) each.\n")
    ratios = [(m, r["summary"].get(m, {}).get("tidegate", {}).get("vs_nginx")) for m in TLS_GOAL_MODES]
    ratios = [(m, v) for m, v in ratios if v]
    if ratios:
        s.append("\nGoal (≥ nginx in every mode): " + ", ".join(f"{m}: {v:.2f}x" for m, v in ratios)
                 + (" — met" if all(v >= 1 for _, v in ratios) else " — not met") + ".\n")
    return "".join(s)


def md_cluster(r):
    p = r["params"]
    s = [f"Three Tidegate instances (A, B, C; one worker each) on one etcd prefix, etcd with "
         f"{p['members']} member(s), everything on the same 2 cores. Propagation: {p['rate']} route changes/s "
         f"through A for {p['duration']} s, each counted once A, B and C all serve it, with live traffic through "
         "B; `embedded` is one instance on the embedded store in the same run. Saturation: closed-loop "
         f"single-op changes from {p['clients']} clients through A alone, then through A, B and C at once. "
         f"`loaded`: after {p['preload']} services (10 backends each) and routes were added.\n\n"]
    rows = []
    for x in r["summary"]:
        if "everywhere_p50_ms" in x:
            rows.append([x["suite"], x["what"], x["changes"], x["effective_everywhere"], x["admin_p50_ms"],
                         x["admin_p99_ms"], x["everywhere_p50_ms"], x["everywhere_p99_ms"], x["errors"]])
    s.append(table(["store", "run", "changes", "live everywhere", "answer p50 ms", "answer p99 ms",
                    "everywhere p50 ms", "everywhere p99 ms", "errors"], rows))
    rows = [[x["suite"], x["what"], x["requests"], x["errors"], x["p99_ms"]] for x in r["summary"] if "requests" in x]
    s.append("\n" + table(["store", "live traffic during", "requests", "errors", "p99 ms"], rows))
    rows = [[x["suite"], x["what"], x["change_sets_per_s"], x["p50_ms"], x["p99_ms"], x["errors"]]
            for x in r["summary"] if "change_sets_per_s" in x]
    s.append("\n" + table(["store", "saturation", "change sets/s", "p50 ms", "p99 ms", "errors"], rows))
    return "".join(s)


def plot_tls(plt, r):
    fig, ax = plt.subplots(figsize=(8, 4))
    proxies = ("tidegate", "nginx", "haproxy")
    modes = [m for m, _ in TLS_MODES if m in r["summary"]]
    for i, proxy in enumerate(proxies):
        ys = [vs_peer(r["summary"][m], proxy)[0] or 0 for m in modes]
        ax.bar([x + (i - 1) * 0.27 for x in range(len(modes))], ys, 0.27, label=proxy)
    ax.set_xticks(range(len(modes)), modes)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_ylabel("requests/s relative to nginx (up_h2: HAProxy)")
    ax.set_title("TLS at the front door and to the backend")
    ax.legend(fontsize=8)
    return fig


# Hostile windows in report order: (key, label, proxy, the quiet window it is compared with).
HOSTILE_WINDOWS = (("quiet", "quiet", "Tidegate", "quiet"),
                   ("hostile", "every attacker", "Tidegate", "quiet"),
                   ("uploads", "slow uploads", "Tidegate", "quiet"),
                   ("slow_flood", "flood of slow requests", "Tidegate", "quiet"),
                   ("uploads_no_cap", "slow uploads, defaults without the per-client cap", "Tidegate", "quiet"),
                   ("control_uploads", "slow uploads, old behaviour (control)", "Tidegate", "quiet"),
                   ("nginx_quiet", "quiet", "nginx", "nginx_quiet"),
                   ("nginx_uploads", "slow uploads", "nginx", "nginx_quiet"))


def plot_hostile(plt, r):
    runs = r["runs"]
    keys = [(k, label, proxy) for k, label, proxy, _ in HOSTILE_WINDOWS if k in runs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 1]})
    xs = range(len(keys))
    colors = ["C0" if proxy == "Tidegate" else "C2" for _, _, proxy in keys]
    a.bar(xs, [(runs[k]["p99_us"] or 0) / 1e3 for k, _, _ in keys], color=colors)
    for i, (k, _, _) in enumerate(keys):
        bad = (runs[k].get("non_200") or 0) + (runs[k].get("errors") or 0)
        a.annotate(f"{bad} failed" if bad else "0 failed", (i, (runs[k]["p99_us"] or 0) / 1e3), ha="center",
                   va="bottom", fontsize=7, color="red" if bad else "black")
    short = {"quiet": "quiet", "hostile": "every\nattacker", "uploads": "slow\nuploads", "slow_flood": "slow\nflood",
             "uploads_no_cap": "uploads,\nno cap", "control_uploads": "uploads,\nold (control)",
             "nginx_quiet": "quiet", "nginx_uploads": "slow\nuploads"}
    a.set_xticks(list(xs), [f"{proxy}\n{short.get(k, k)}" for k, _, proxy in keys], fontsize=6)
    a.set_yscale("log")
    a.set_ylabel("normal requests: p99 (ms)")
    a.set_title(f"{r['summary']['rate']:.0f} req/s of normal traffic to the attacked service", fontsize=9)
    b.bar(xs, [(runs[k].get("rss_peak_kib") or 0) / 1024 for k, _, _ in keys], color=colors)
    b.set_xticks(list(xs), [k for k, _, _ in keys], rotation=60, ha="right", fontsize=6)
    b.set_ylabel("proxy RSS peak (MiB)")
    return fig


def plot_cluster(plt, r):
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    rows = [x for x in r["summary"] if "everywhere_p50_ms" in x]
    names = [x["suite"] + (" loaded" if x["what"].startswith("loaded") else "") for x in rows]
    xs = range(len(rows))
    a.bar([i - 0.2 for i in xs], [x["everywhere_p50_ms"] for x in rows], 0.4, label="p50")
    a.bar([i + 0.2 for i in xs], [x["everywhere_p99_ms"] for x in rows], 0.4, label="p99")
    a.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=7)
    a.set_yscale("log")
    a.set_ylabel("change → live on every instance (ms)")
    a.set_title(f"{r['params']['rate']} changes/s through one instance", fontsize=9)
    a.legend(fontsize=8)
    sat = [x for x in r["summary"] if "change_sets_per_s" in x]
    b.barh(range(len(sat)), [x["change_sets_per_s"] for x in sat])
    b.set_yticks(range(len(sat)), [f"{x['suite']} {x['what']}" for x in sat], fontsize=6)
    b.invert_yaxis()
    b.set_xlabel("single-op change sets/s (closed loop)")
    b.set_title("saturation", fontsize=9)
    return fig


def md_hostile(r):
    runs, fmt = r["runs"], (lambda v: "-" if v is None else f"{v:,}")
    if "nginx_quiet" not in runs:  # a run from before issue 35: quiet and hostile only
        keys = [("quiet", "quiet", "Tidegate", "quiet"), ("hostile", "under attack", "Tidegate", "quiet")]
    else:
        keys = [w for w in HOSTILE_WINDOWS if w[0] in runs]
    rows = []
    for k, label, proxy, base in keys:
        x = runs[k]
        ratio = (f"{x['p99_us'] / runs[base]['p99_us']:.2f}" if k != base and x.get("p99_us")
                 and runs[base].get("p99_us") else "")
        rows.append([proxy, label, x.get("attackers", ""), fmt(x["ok"]), fmt(x["non_200"]), fmt(x["errors"]),
                     fmt(x["p50_us"]), fmt(x["p99_us"]), ratio, fmt(x["max_us"]),
                     f"{(x.get('rss_peak_kib') or 0) / 1024:.1f}", fmt(x.get("backend_conns_peak")),
                     fmt(x.get("in_flight_peak")), fmt(x.get("queued_peak")), fmt(x.get("queue_displaced"))])
    s = [table(["proxy", "window", "attackers", "ok", "non-200", "errors", "p50 µs", "p99 µs", "p99 / quiet",
                "max µs", "RSS peak MiB", "backend conns peak", "in flight peak", "queued peak", "displaced"], rows)]
    summ = r["summary"]
    p = r.get("params") or {}
    sources = (f"from {p['normal_sources']} addresses (127.0.1.1 and after, in turn)" if "normal_sources" in p
               else "from 127.0.0.1")
    s.append(f"\nNormal traffic: {summ['rate']:.0f} req/s (`tidegate-bench traffic`, open loop) {sources} to "
             "the attacked service; every attacker from its own loopback address.")
    if "max_conns" in p:
        s.append(f" The backend: `max_conns` {p['max_conns']} (Tidegate and nginx), Tidegate's default policy "
                 f"(learned limits), `--max-requests-per-client {p['per_client_cap']}`"
                 + (f", `--max-connections-per-client {p['per_client_conns']}`" if "per_client_conns" in p else "")
                 + ".")
    g = r.get("goal", {})
    s.append("\n\nGoals (Tidegate, every attacker against the quiet window): "
             + ", ".join(f"{k} **{'met' if v else 'NOT met'}**" for k, v in g.items()) + ".\n")
    s.append("\nWhat the attackers got (answers and how their tries ended):\n")
    for k, label, proxy, _ in keys:
        attacks = runs[k].get("attacks") or {}
        if attacks:
            s.append(f"\n*{proxy}, {label}*:\n\n" + "\n".join(f"- `{n}`: {v}" for n, v in attacks.items()) + "\n")
        held = runs[k].get("zero_window_closed_after_s")
        if held:
            s.append(f"- zero-window connections closed by the proxy after {held} s\n")
        bulk = runs[k].get("bulk_in_flight_peak")
        if bulk is not None and k == "hostile":
            s.append(f"- most requests in flight to the zero-window readers' backend: {bulk}\n")
    return "".join(s)


def md_rules(r):
    p = r["params"]
    steps = ", ".join(x["kind"] + (f" {x.get('prefix') or x.get('name') or ''}".rstrip()) for x in r["steps"])
    s = [f"One backend process (nginx, three ports) behind Tidegate and nginx ({p['workers']} workers each), the same "
         f"routes on both: `/` without rules, `/api/` with the typical chain ({steps}; nginx: `allow`/`deny`, "
         "`limit_req` far above the load, `proxy_pass http://app/`, `proxy_set_header` twice, `add_header "
         "Strict-Transport-Security ... always`), `/json/` compressing a "
         f"{r.get('json_bytes', 20480):,}-byte JSON document (nginx `gzip_comp_level {p['gzip_level']}`, the level "
         "of Tidegate's gzip), `/limited/` and `/keys/` rate limited by `X-Key`. wrk `-t2` closed loop, "
         f"{p['duration']} s per run, {p['reps']} repetition(s), the variants in a rotating order, medians. CPU "
         "µs/req: the proxy's CPU time over the requests it served.\n"]
    not_run = {k: v for k, v in (r.get("not_run") or {}).items() if k != "none"}
    if not_run:
        s.append("\n**Not run on Tidegate** (its admin API refused the rule set: the data plane does not apply "
                 "the step yet): " + "; ".join(f"`{k}`: {v}" for k, v in not_run.items()) + "\n")
    checks = r.get("checks") or {}
    bad = [k for k, v in checks.items() if not v.get("ok")]
    s.append("\nChecks before the load (the backend saw the stripped path and both headers, the client got HSTS, "
             "the plain route added nothing): " + ("all passed" if not bad else "**failed: " + ", ".join(
                 f"{k} {checks[k]}" for k in bad) + "**") + f" ({', '.join(checks)}).\n")
    rows = []
    for conns, row in sorted(r["summary"].items(), key=lambda x: int(x[0])):
        for key in ("tidegate_plain", "tidegate_rules", "nginx_plain", "nginx_rules"):
            v = row.get(key)
            if v:
                proxy, route = key.split("_")
                rows.append([conns, proxy, route, v["rps"], v["p99_ms"], v["cpu_us_per_req"], v["rss_mib"],
                             v["errors"]])
    s.append("\n**1. The typical chain**\n" + table(["conns", "proxy", "route", "req/s", "p99 ms", "CPU µs/req",
                                                       "RSS MiB", "errors"], rows))
    rows = [[c, row.get("tidegate_fraction"), row.get("nginx_fraction"), row.get("fraction_ratio"),
             row.get("tidegate_fraction_paired"), row.get("nginx_fraction_paired"), row.get("fraction_ratio_paired"),
             row.get("fraction_ratio_rep_median"),
             row.get("tidegate_cpu_fraction"), row.get("nginx_cpu_fraction"), row.get("cpu_fraction_ratio"),
             row.get("plain_vs_nginx")] for c, row in sorted(r["summary"].items(), key=lambda x: int(x[0]))]
    s.append("\nFractions: rules/plain requests/s (of the medians; then the median of each repetition's own), "
             "Tidegate's over nginx's within each repetition (the median of those is the goal's reading: the four "
             "runs of a repetition are the closest in time), and the same from CPU time per request "
             "(plain µs/rules µs)\n"
             + table(["conns", "Tidegate rules/plain", "nginx rules/plain", "ratio of medians",
                      "Tidegate, per rep", "nginx, per rep", "ratio of those", "ratio within reps (goal ≥ 1)",
                      "Tidegate CPU", "nginx CPU", "CPU ratio", "plain: Tidegate/nginx"], rows))
    per_rep = [f"c={c}: " + ", ".join(fmt(v, 3) for v in row.get("fraction_ratio_per_rep") or [])
               for c, row in sorted(r["summary"].items(), key=lambda x: int(x[0]))]
    s.append("\nRatio within each repetition, in order: " + "; ".join(per_rep) + ".\n")
    rows = []
    for key, v in r["compression"].items():
        proxy, enc = key.split("_", 1)
        rows.append([proxy, enc, v["rps"], v["p99_ms"], v["cpu_us_per_req"], v["errors"], v["bytes"],
                     v.get("content_encoding") or ("—" if enc == "identity" else "**none**"), v.get("vary") or "—",
                     {True: "yes", False: "**no**", None: "no decoder"}[v.get("round_trip")],
                     v.get("vs_nginx") or v.get("vs_nginx_gzip")])
    s.append(f"\n**2. Compression**, {p['compress_conns']} connections (`vs nginx`: the same encoding on nginx; for "
             "br and zstd, nginx's gzip)\n" + table(["proxy", "encoding", "req/s", "p99 ms", "CPU µs/req", "errors",
                                                     "bytes", "Content-Encoding", "Vary", "round trip",
                                                     "vs nginx"], rows))
    one = r["rate_limit"]["one_key"]
    rows = [[proxy, v["rate_per_s"], v["burst"], v["elapsed_s"], v["offered_per_s"], v["admitted"],
             v["admitted_per_s"], v["ideal_per_s"], f"{v['error_pct']:+.2f} %",
             ", ".join(f"{k}: {n:,}" for k, n in sorted(v["statuses"].items()))] for proxy, v in one.items()]
    s.append(f"\n**3. Rate limits.** One key (`X-Key: one`), {p['limit_conns']} connections closed loop for "
             f"{p['limit_duration']} s. Error: admitted/s against the rate (ideal: the burst, then the rate)\n"
             + table(["proxy", "rate/s", "burst", "s", "offered/s", "admitted", "admitted/s", "ideal/s", "error",
                      "answers"], rows))
    many = r["rate_limit"]["many_keys"]
    rows = [[proxy, v["keys"], v["elapsed_s"], round(v["rss_before_kib"] / 1024, 1),
             round(v["rss_peak_kib"] / 1024, 1), round(v["rss_after_kib"] / 1024, 1),
             round(v["rss_growth_kib"] / 1024, 1),
             ", ".join(f"{k}: {n:,}" for k, n in sorted(v["statuses"].items()))] for proxy, v in many.items()]
    s.append("\nDistinct keys: each request with its own `X-Key` value; the proxy's resident memory (all its "
             "processes) before, at the peak and 0.5 s after\n"
             + table(["proxy", "keys", "s", "RSS before MiB", "peak MiB", "after MiB", "growth MiB", "answers"], rows))
    g = r["goal"]

    def verdict(v):
        return "not run" if v is None else ("met" if v else "**not met**")
    ratios = [f"c={k[len('fraction_ratio_c'):]}: {fmt(v, 3)}" for k, v in g.items()
              if k.startswith("fraction_ratio_c") and v is not None]
    err = g.get("rate_limit_error_pct")
    s.append("\nGoals: the typical chain keeps at least nginx's fraction"
             + (f" ({', '.join(ratios)})" if ratios else "") + f": {verdict(g.get('typical_chain_met'))}; "
             "gzip at least nginx's req/s" + (f" ({fmt(g['gzip_vs_nginx'], 3)}x)" if g.get("gzip_vs_nginx") else "")
             + f": {verdict(g.get('compression_met'))}; one key within 5 %"
             + (f" ({err:+.2f} %)" if err is not None else "") + f": {verdict(g.get('rate_limit_met'))}; "
             "RSS growth over the distinct keys: "
             + (f"{g['many_keys_rss_growth_kib'] / 1024:.1f} MiB" if g.get("many_keys_rss_growth_kib") is not None
                else "not run") + ".\n")
    return "".join(s)


def plot_rules(plt, r):
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(12, 3.6))
    conns = sorted(r["summary"], key=int)
    keys = ("tidegate_plain", "tidegate_rules", "nginx_plain", "nginx_rules")
    for i, key in enumerate(keys):
        ys = [(r["summary"][cn].get(key) or {}).get("rps") or 0 for cn in conns]
        a.bar([x + (i - 1.5) * 0.2 for x in range(len(conns))], ys, 0.2, label=key.replace("_", " "))
    a.set_xticks(range(len(conns)), [f"{cn} conns" for cn in conns])
    a.set_ylabel("requests/s")
    a.set_title("typical chain vs no rules", fontsize=9)
    a.legend(fontsize=6)
    comp = r["compression"]
    names = list(comp)
    b.bar(range(len(names)), [comp[n]["rps"] or 0 for n in names],
          color=["C0" if n.startswith("tidegate") else "C2" for n in names])
    b.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names], fontsize=6)
    b.set_ylabel("requests/s")
    b.set_title(f"20 KiB JSON, {r['params']['compress_conns']} conns", fontsize=9)
    many = r["rate_limit"]["many_keys"]
    proxies = list(many)
    for i, (k, label) in enumerate((("rss_before_kib", "before"), ("rss_peak_kib", "peak"),
                                    ("rss_after_kib", "after"))):
        c.bar([x + (i - 1) * 0.27 for x in range(len(proxies))], [many[p][k] / 1024 for p in proxies], 0.27,
              label=label)
    c.set_xticks(range(len(proxies)), proxies)
    c.set_ylabel("RSS (MiB)")
    c.set_title(f"{max([many[p]['keys'] or 0 for p in proxies], default=0):,} distinct rate-limit keys", fontsize=9)
    c.legend(fontsize=6)
    return fig


def md_upgrade(r):
    p, b = r["params"], r["builds"]
    s = [f"{p['upgrades']} upgrades in a row, one every {p['interval_s']} s after {p['warmup_s']} s, alternating "
         f"two builds (Tidegate: `{b['a']}` and {b['b_is']}; nginx and HAProxy: two copies of the installed binary), "
         f"old process's grace {p['grace_s']} s. Load on each peer for the whole run: keep-alive HTTP/1.1 on "
         f"{p['ka_conns']} connections at {p['ka_rate']} req/s each, new connections at {p['new_rate']}/s, HTTP/2 "
         f"over TLS on {p['h2_conns']} connections at {p['h2_rate']} req/s each, one WebSocket sending every "
         f"{p['ws_interval_s']} s, and for Tidegate {p['change_rate']} configuration changes/s; every answer's "
         "status and body checked. Upgrade time: from the upgrade's start to the new process serving "
         "(Tidegate: its ready line; nginx, HAProxy: a new connection answered by the new process).\n"]
    rows = []
    for name, x in r["summary"].items():
        if "error" in x:
            rows.append([name, "**failed**: " + x["error"][:200].replace("|", "/")] + [""] * 10)
            continue
        kinds = ", ".join(f"{k} {v}" for k, v in x["by_kind"].items() if v) or "none"
        changes = ("N/A" if x["changes_lost"] is None
                   else f"{x['changes_lost']} lost, {x['changes_applied_twice']} twice")
        rows.append([name, f"{x['upgrades']}/{p['upgrades']}", x["requests"], x["failed"], kinds, x["resets"],
                     x["refused"], f"{x['resent']} / {x['idle_closed']}", x["websocket"], changes,
                     fmt(x["upgrade_p50_s"], 3), fmt(x["upgrade_max_s"], 3)])
    s.append(table(["peer", "upgrades", "requests", "failed", "failed by kind", "resets", "refused",
                    "resent / idle closed", "WebSocket", "changes", "upgrade p50 s", "upgrade max s"], rows))
    for name, x in r["peers"].items():
        for u in x.get("upgrades", []):
            if "error" in u:
                s.append(f"\n**{name}, upgrade {u['k']} failed** (the next ones not tried): "
                         f"`{u['error'][:300].strip()}`\n")
    s.append("\n*Resent*: a kept-alive HTTP/1.1 request that crossed the server's close of the idle connection "
             "(no byte of an answer), or an HTTP/2 request above a GOAWAY's last stream, sent again on a new "
             "connection as RFC 9112 9.3.1 / RFC 9113 6.8 allow; *idle closed*: a kept-alive connection found "
             "closed before the next request. Neither is a failure. WebSocket: the session open at each upgrade, "
             "how long after the upgrade it ended and how (`eof`: the connection closed with no close frame).\n")
    rows = []
    for name, x in r["peers"].items():
        if "error" in x:
            continue
        ch = x.get("changes")
        lat = x.get("latency_ms") or {}
        rows.append([name, x["load"]["keep_alive"]["requests"], x["load"]["new_conn"]["requests"],
                     x["load"]["h2"]["requests"], x["load"]["h2_connections"], x["load"]["h2_goaways"],
                     x["load"]["h2_closed_without_goaway"], " ".join(str(w) for w in x["window_failures"]),
                     fmt((lat.get("all") or {}).get("p99"), 1),
                     f"{fmt(lat.get('windows_p99_max'), 1)} / {fmt(lat.get('windows_max'), 1)}",
                     " ".join(fmt(u.get("old_exit_s"), 1) for u in x["upgrades"]),
                     (f"{ch['acked']}/{ch['sent']} acked, {ch['counts']['refused_503']} 503, "
                      f"{ch['ambiguous']} ambiguous, {ch['revisions_taken']} revisions for {ch['present']} present"
                      if ch else "N/A")])
    s.append("\n" + table(["peer", "keep-alive req", "new-conn req", "h2 req", "h2 conns", "h2 GOAWAYs",
                           "h2 closed without GOAWAY", f"failures in the {p['window_s']} s after each upgrade",
                           "p99 ms, whole run", f"worst p99 / max ms in the {p['window_s']} s after an upgrade",
                           "old process gone after (s)", "configuration changes"], rows))
    het = r.get("heterogeneous")
    if het and "error" in het:
        s.append(f"\n**Heterogeneous backends**: failed: `{het['error'][:300]}`\n")
    elif het:
        h = het["params"]
        rows = []
        for mode, x in het["runs"].items():
            wins = "; ".join(", ".join(f"{k} {v}" for k, v in w.items()) or "0" for w in x["windows"])
            lat = x.get("latency_ms") or {}
            rows.append([f"{mode} upgrades", len(x["upgrades"]), x["requests"], x["failed"],
                         het["after_upgrades_503_timeouts"][mode], wins, fmt((lat.get("all") or {}).get("p99"), 1),
                         f"{fmt(lat.get('windows_p99_max'), 1)} / {fmt(lat.get('windows_max'), 1)}"])
        s.append(f"\n**Heterogeneous backends** (Tidegate): capacities 1:2:4 (emulator slots, service "
                 f"{h['service']}, queues of 20; {het['capacity_per_s']} req/s in all), one service learning their "
                 f"limits (least_conn), {h['conns']} keep-alive connections at {h['rate']} req/s each; "
                 f"{h['upgrades']} upgrades every {h['interval_s']} s after {h['warmup_s']} s, against the same run "
                 f"without upgrades, failures in the {p['window_s']} s after each (the same instants in both)\n"
                 + table(["run", "upgrades", "requests", "failed", "503s + timeouts after the upgrades",
                          "failures per window", "p99 ms, whole run", "worst window p99 / max ms"], rows))
    return "".join(s)


def md_tracing(r):
    p, sm, st = r["params"], r["summary"], r["receiver_stopped"]
    s = [f"wrk -t2 -c{p['conns']}, {p['duration']} s per run, {p['reps']} repetitions in a rotating order; "
         "three Tidegate processes identical but for tracing, one nginx backend, an OTLP/HTTP sink that counts "
         "what it is sent. Requests carry no `traceparent` (each starts a trace; the ratio decides).\n"]
    rows = []
    for name in ("off", "ratio_0.01", "ratio_1"):
        x = sm[name]
        spans = x.get("spans") or {}
        rows.append([name, fmt(x["rps_median"], 0), f"{fmt(x['rps_min'], 0)}-{fmt(x['rps_max'], 0)}",
                     fmt(x["vs_off"], 3), fmt(x.get("cpu_us_per_req"), 2), fmt(x.get("cpu_vs_off"), 3),
                     fmt(x.get("sink_cpu_s"), 2), spans.get("exported", "-"),
                     spans.get("dropped_queue_full", "-"), spans.get("dropped_export_failed", "-")])
    s.append(table(["variant", "req/s (median)", "range", "/ off", "Tidegate CPU µs/req", "off / this (CPU)",
                    "receiver CPU s per run", "spans exported", "dropped (queue full)", "dropped (export failed)"],
                   rows))
    s.append(f"\nThe receiver stopped, tracing at 100 %: {fmt(st['rps'], 0)} req/s ({fmt(st['vs_off'], 3)} of off), "
             f"spans dropped {st['dropped']}, exported {st['exported']}.\n")
    g = r["goal"]
    s.append(f"Goals: 1 % within 3 % of off: **{g['ratio_0.01_within_3pct']}**; 100 % within 15 %: "
             f"**{g['ratio_1_within_15pct']}**.\n")
    return "\n".join(s)

"""The scenarios, each a function `(ctx) -> dict` whose result is
written to `<results>/<scenario>.json`. Throughput, churn (Tidegate alone)
and heterogeneous run the shell scripts beside this directory; churn versus
peers, peak, overhead, hostile and rules are Python modules here.
"""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict

import churn_peers
import hostile
import overhead
import peak
import rules
import tracing
import upgrade
from harness import ROOT, Ctx, free_port_block, log, median

# Per profile: the options each scenario runs with.
PARAMS = {
    "throughput": {
        "smoke": {"reps": 1, "duration": 2, "conns": "32", "workers": 2},
        "full": {"reps": 3, "duration": 8, "conns": "64 256 500 2000 5000", "workers": 2},
    },
    "churn": {
        "smoke": {"duration": 1, "rates": "600", "suites": "empty loaded", "preload": 500, "live_rate": 200,
                  "clients": 8, "peer_rate": 10, "peer_duration": 2, "peer_reps": 1, "peer_live_rate": 100},
        "full": {"duration": 8, "rates": "100 600 2000", "suites": "empty loaded", "preload": 10000,
                 "live_rate": 1000, "clients": 64, "peer_rate": 10, "peer_duration": 10, "peer_reps": 3,
                 "peer_live_rate": 200},
    },
    "heterogeneous": {
        "smoke": {"users": 50, "think_ms": 200, "duration": 1, "sweep": "0.8", "sweep_duration": 1, "pause": 0.2,
                  "variants": "tidegate-default tidegate-least_conn nginx-rr haproxy-leastconn", "halve": False},
        "full": {"users": 500, "think_ms": 1800, "duration": 10, "sweep": "0.5 0.8 0.95 1.05", "sweep_duration": 8,
                 "pause": 1, "variants": "", "halve": True},
    },
    "peak": {"smoke": {}, "full": {}},
    "overhead": {
        "smoke": {"requests": 100, "reps": 1, "warmup": 20, "rate": 200},
        "full": {"requests": 1500, "reps": 3, "warmup": 200, "rate": 50},
    },
    "tls": {
        "smoke": {"reps": 1, "duration": 1, "conns": 16, "workers": 2, "flood": 200, "flood_quiet": 1},
        "full": {"reps": 3, "duration": 8, "conns": 64, "workers": 2, "flood": 1000, "flood_quiet": 5},
    },
    # duration: the quiet window; hostile_duration: the window under every
    # attacker (longer than the 60 s write timeout in full, so that the
    # zero-window readers' streams are seen released); side_duration: the
    # slow uploads alone, the flood of slow requests, the control and
    # nginx. max_conns: the backend's cap (Tidegate and nginx);
    # per_client_cap: --max-requests-per-client; per_client_conns:
    # --max-connections-per-client; per_client_rate:
    # --max-request-rate-per-client (12x what each normal address sends in
    # full); per_client_tarpit_ms: --request-rate-tarpit-ms; normal_sources:
    # the addresses the
    # normal traffic comes from, in turn (so that the caps and the fair
    # queue see many users, not one); zero_window_tries: connections each
    # zero-window reader opens in its window at most.
    "hostile": {
        "smoke": {"duration": 2, "hostile_duration": 2, "side_duration": 1, "rate": 200, "attackers_scale": 0.1,
                  "uploads_h1": 4, "uploads_h2_streams": 8, "zero_window_conns": 1, "zero_window_streams": 10,
                  "zero_window_tries": 2, "flood_workers": 48, "slow_flood_delay_ms": 20, "per_client_cap": 32,
                  "per_client_conns": 64, "per_client_rate": 200, "per_client_tarpit_ms": 1000, "normal_sources": 16, "max_conns": 48, "bulk_body_bytes": 32 << 20},
        "full": {"duration": 60, "hostile_duration": 80, "side_duration": 30, "rate": 1000, "attackers_scale": 1.0,
                 "uploads_h1": 20, "uploads_h2_streams": 40, "zero_window_conns": 1, "zero_window_streams": 10,
                 "zero_window_tries": 2, "flood_workers": 64, "slow_flood_delay_ms": 20, "per_client_cap": 32,
                 "per_client_conns": 64, "per_client_rate": 200, "per_client_tarpit_ms": 1000, "normal_sources": 64, "max_conns": 48, "bulk_body_bytes": 32 << 20},
    },
    # rules (issue 37): conns: part 1's wrk connections; compress_conns:
    # part 2's; gzip_level: nginx's gzip_comp_level, the level Tidegate's
    # gzip uses (tidegate_rules::compress::GZIP_LEVEL; gzip_level_field:
    # the compress step's field for it, should the step gain one: then both
    # are set to it); limit_rate / limit_burst:
    # the one key's rate limit (both proxies), offered by limit_conns
    # closed-loop connections for limit_duration s; keys: distinct X-Key
    # values sent (by keys_conns connections, at most keys_max_s seconds).
    "rules": {
        "smoke": {"reps": 1, "duration": 1, "conns": "16", "compress_conns": 16, "workers": 2, "gzip_level": 6,
                  "gzip_level_field": None, "limit_rate": 500, "limit_burst": 10, "limit_duration": 1,
                  "limit_conns": 16, "keys": 2000, "keys_conns": 16, "keys_max_s": 60},
        "full": {"reps": 10, "duration": 4, "conns": "64 256", "compress_conns": 64, "workers": 2, "gzip_level": 6,
                 "gzip_level_field": None, "limit_rate": 2000, "limit_burst": 20, "limit_duration": 10,
                 "limit_conns": 64, "keys": 100000, "keys_conns": 64, "keys_max_s": 300},
    },
    # upgrade (issue 38): upgrades in a row every interval_s after
    # warmup_s, tail_s more of load; grace_s: the old process's grace
    # (Tidegate --drain-timeout-s, nginx worker_shutdown_timeout, HAProxy
    # hard-stop-after); ka_conns keep-alive connections at ka_rate
    # requests/s each; new_rate new connections/s; h2: h2_conns
    # TLS connections at h2_rate requests/s each, h2_streams at most in
    # flight;
    # change_rate configuration changes/s (Tidegate); window_s: the window
    # after each upgrade whose failures are counted apart. hetero (full
    # only): backends of 1, 2 and 4 slots (service: the emulator's service
    # time) behind a service learning their limits, conns connections at
    # rate requests/s each (32 x 8.4 = 0.77 of the 350/s capacity), a run
    # without and one with `upgrades` upgrades, compared over window_s.
    "upgrade": {
        "smoke": {"peers": "tidegate nginx haproxy", "upgrades": 2, "warmup_s": 0.3, "interval_s": 1.2, "tail_s": 0.4,
                  "grace_s": 1, "workers": 1, "ka_conns": 8, "ka_rate": 20, "new_rate": 40, "h2_conns": 1,
                  "h2_streams": 2, "h2_rate": 20, "ws_interval_s": 0.05, "change_rate": 20, "timeout_s": 5,
                  "window_s": 1},
        "full": {"peers": "tidegate nginx haproxy", "upgrades": 10, "warmup_s": 3, "interval_s": 8, "tail_s": 3,
                 "grace_s": 5, "workers": 2, "ka_conns": 64, "ka_rate": 25, "new_rate": 200, "h2_conns": 4,
                 "h2_streams": 4, "h2_rate": 50, "ws_interval_s": 0.05, "change_rate": 100, "timeout_s": 5,
                 "window_s": 5,
                 "hetero": {"upgrades": 3, "warmup_s": 10, "interval_s": 8, "tail_s": 5, "conns": 32, "rate": 8.4,
                            "service": "exp:20ms"}},
    },
    # tracing (issue 40): wrk at `conns` against tracing off, 1 % and 100 %.
    "tracing": {
        "smoke": {"reps": 1, "duration": 1, "conns": 16, "workers": 2},
        "full": {"reps": 5, "duration": 8, "conns": 64, "workers": 2},
    },
    "cluster": {
        "smoke": {"duration": 1, "rate": 100, "members": "1", "preload": 200, "clients": 4},
        "full": {"duration": 10, "rate": 600, "members": "1 3", "preload": 10000, "clients": 32},
    },
}

# What each scenario's JSON must contain (the smoke profile checks these).
EXPECTED = {
    "throughput": ["runs", "summary"],
    "churn": ["tidegate", "tidegate_summary", "peers"],
    "heterogeneous": ["runs", "users", "sweep"],
    "peak": ["variants", "summary", "added_latency_us_at_warm_p50"],
    "overhead": ["runs", "summary", "goal"],
    "hostile": ["runs", "summary", "goal"],
    "tls": ["runs", "summary"],
    "cluster": ["runs", "summary"],
    "rules": ["checks", "runs", "summary", "compression", "rate_limit", "goal"],
    "upgrade": ["builds", "peers", "summary"],
    "tracing": ["runs", "summary", "receiver_stopped", "goal"],
}


def sh(ctx: Ctx, script: str, args: list[str], name: str) -> None:
    """Runs a bench/*.sh script; its output goes to <results>/<name>.log."""
    logfile = ctx.out_dir / f"{name}.log"
    argv = ["bash", str(ROOT / "bench" / script), *args, "--bin-dir", str(ctx.bin_dir)]
    log(f"  $ {' '.join(argv[1:])}")
    # Started through ctx.procs, so an interrupted run stops it too (the
    # script's exit trap then stops what it started).
    p = ctx.procs.start(argv, out=logfile, cwd=ROOT)
    try:
        rc = p.wait(timeout=3 * 3600)
    except subprocess.TimeoutExpired:
        ctx.procs.stop(p)
        raise RuntimeError(f"bench/{script} did not finish within 3 hours")
    ctx.procs.stop(p)
    if rc != 0:
        tail = logfile.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"bench/{script} failed (exit {rc}); end of {logfile.name}:\n{tail}")


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in open(path) if line.strip()]


def throughput(ctx: Ctx) -> dict:
    p = PARAMS["throughput"][ctx.profile]
    out = ctx.work / "throughput.jsonl"
    sh(ctx, "throughput.sh", ["--reps", str(p["reps"]), "--duration", str(p["duration"]), "--conns", p["conns"],
                              "--workers", str(p["workers"]), "--port-base", str(free_port_block()),
                              "--out", str(out)], "throughput")
    runs = jsonl(out)
    summary = summarize(runs, lambda r: str(r["conns"]), lambda rs: {
        "p50_ms": median([r.get("p50_ms") for r in rs]),
        "rss_mib": round(median([r["rss_kb"] for r in rs]) / 1024, 1),
        "cpu_cores": median([r["cpu_cores"] for r in rs])})
    return {"params": p, "runs": runs, "summary": summary}


def summarize(runs: list[dict], group, extra) -> dict:
    """Medians per (group, proxy) of a wrk-style scenario's runs, with each
    proxy's requests/s relative to nginx's in the same group. `group` picks
    a run's group key, `extra` adds fields from a group's runs."""
    by = defaultdict(list)
    for r in runs:
        by[(group(r), r["proxy"])].append(r)
    summary = {}
    for (key, proxy), rs in sorted(by.items()):
        summary.setdefault(key, {})[proxy] = {
            "rps": median([r["rps"] for r in rs]), "mean_ms": median([r.get("mean_ms") for r in rs]),
            "p99_ms": median([r.get("p99_ms") for r in rs]), "errors": sum(r["errors"] for r in rs),
            "cpu_us_per_req": median([r.get("cpu_us_per_req") for r in rs]), "reps": len(rs), **extra(rs)}
    for row in summary.values():
        base = (row.get("nginx") or {}).get("rps")
        for v in row.values():
            v["vs_nginx"] = round(v["rps"] / base, 3) if base else None
    return summary


def churn(ctx: Ctx) -> dict:
    p = PARAMS["churn"][ctx.profile]
    out = ctx.work / "churn.jsonl"
    sh(ctx, "churn.sh", ["--duration", str(p["duration"]), "--rates", p["rates"], "--suites", p["suites"],
                         "--preload", str(p["preload"]), "--live-rate", str(p["live_rate"]),
                         "--clients", str(p["clients"]), "--out", str(out)], "churn")
    records = jsonl(out)
    rows = []
    for suite in p["suites"].split():
        rs = {r["label"]: r for r in records if r.get("suite") == suite}
        for rate in p["rates"].split():
            c, t = rs.get(f"churn-{rate}"), rs.get(f"traffic-during-churn-{rate}")
            if not c:
                continue
            lat, answer = c["time_to_effective_us"], c["admin_from_send_us"]
            floor = (rs.get(f"disk-floor-{rate}") or {}).get("from_send_us")
            rows.append({"suite": suite, "rate": float(rate), "changes": c["sending"]["planned"],
                         "effective": c["effective"], "needed_retry": c["needed_retry"],
                         "p50_ms": lat["p50"] / 1e3, "p90_ms": lat["p90"] / 1e3, "p99_ms": lat["p99"] / 1e3,
                         "mean_ms": lat["mean"] / 1e3,
                         "answer_p50_ms": answer["p50"] / 1e3, "answer_p99_ms": answer["p99"] / 1e3,
                         "floor_p50_ms": floor["p50"] / 1e3 if floor else None,
                         "floor_p99_ms": floor["p99"] / 1e3 if floor else None,
                         "live_requests": t["sending"]["sent"] if t else None,
                         "live_errors": (t["error_total"] + t["non_200"]) if t else None,
                         "live_p99_ms": t["latency_us"]["p99"] / 1e3 if t else None})
        for label in ("saturate-single", "saturate-batch-1000"):
            s = rs.get(label)
            if s:
                rows.append({"suite": suite, "saturate": label, "change_sets_per_s": s["change_sets_per_s"],
                             "ops_per_s": s["ops_per_s"], "p50_ms": s["latency_us"]["p50"] / 1e3,
                             "p99_ms": s["latency_us"]["p99"] / 1e3, "errors": s["error_total"]})
    log("  churn versus nginx and HAProxy")
    peers = churn_peers.run(ctx, p["peer_rate"], p["peer_duration"], p["peer_reps"], p["peer_live_rate"])
    return {"params": p, "tidegate": records, "tidegate_summary": rows, "peers": peers}


def heterogeneous(ctx: Ctx) -> dict:
    p = PARAMS["heterogeneous"][ctx.profile]
    out = ctx.work / "heterogeneous.jsonl"
    args = ["--users", str(p["users"]), "--think-ms", str(p["think_ms"]), "--duration", str(p["duration"]),
            "--sweep", p["sweep"], "--sweep-duration", str(p["sweep_duration"]), "--pause", str(p["pause"]),
            "--port-base", str(free_port_block()), "--out", str(out)]
    if p["variants"]:
        args += ["--variants", p["variants"]]
    if not p["halve"]:
        args.append("--no-halve")
    sh(ctx, "heterogeneous.sh", args, "heterogeneous")
    runs = jsonl(out)

    def row(r):
        lat = r["latency_us"]
        share = r.get("share") or {}
        total = sum(share.values()) or 1
        return {"label": r["label"], "failure_pct": round(r["failure_pct"], 3), "p50_ms": lat["p50"] / 1e3,
                "p99_ms": lat["p99"] / 1e3, "max_ms": lat["max"] / 1e3,
                "share_pct": {k: round(v * 100 / total, 1) for k, v in sorted(share.items())},
                **({"rps": r["requests_per_s"]} if "requests_per_s" in r else {"load": r["load"], "rate": r["rate"]})}
    return {"params": p, "runs": runs, "users": [row(r) for r in runs if r.get("mode") == "users"],
            "sweep": [row(r) for r in runs if r.get("mode") == "sweep"],
            "halved": [{**row(r), "limit_follow_s": r.get("limit_follow_s")} for r in runs if r.get("mode") == "halve"]}


def peak_scenario(ctx: Ctx) -> dict:
    return peak.run(ctx)


def overhead_scenario(ctx: Ctx) -> dict:
    p = PARAMS["overhead"][ctx.profile]
    return overhead.run(ctx, p["requests"], p["reps"], p["rate"], warmup=p["warmup"])


def tls(ctx: Ctx) -> dict:
    p = PARAMS["tls"][ctx.profile]
    out = ctx.work / "tls.jsonl"
    sh(ctx, "tls.sh", ["--reps", str(p["reps"]), "--duration", str(p["duration"]), "--conns", str(p["conns"]),
                       "--workers", str(p["workers"]), "--port-base", str(free_port_block()), "--out", str(out),
                       "--flood", str(p["flood"]), "--flood-quiet", str(p["flood_quiet"])], "tls")
    runs = jsonl(out)
    return {"params": p, "runs": runs, "summary": summarize(runs, lambda r: r["mode"], lambda rs: {})}


def cluster(ctx: Ctx) -> dict:
    """Cluster mode: propagation from one instance to three through etcd,
    sustained changes/s, next to the embedded store (bench/cluster.sh)."""
    p = PARAMS["cluster"][ctx.profile]
    out = ctx.work / "cluster.jsonl"
    sh(ctx, "cluster.sh", ["--duration", str(p["duration"]), "--rate", str(p["rate"]), "--members", p["members"],
                           "--preload", str(p["preload"]), "--clients", str(p["clients"]), "--out", str(out)],
       "cluster")
    runs = jsonl(out)
    summary = []
    for r in runs:
        label, suite = r["label"], r["suite"]
        if r.get("scenario") == "churn":
            lat, adm = r["time_to_effective_us"], r["admin_us"]
            summary.append({"suite": suite, "what": label, "changes": r["sending"]["planned"],
                            "effective_everywhere": r["effective"], "admin_p50_ms": adm["p50"] / 1e3,
                            "admin_p99_ms": adm["p99"] / 1e3, "everywhere_p50_ms": lat["p50"] / 1e3,
                            "everywhere_p99_ms": lat["p99"] / 1e3, "errors": r["error_total"]})
        elif r.get("scenario") == "traffic":
            summary.append({"suite": suite, "what": label, "requests": r["sending"]["sent"],
                            "errors": r["error_total"] + r["non_200"], "p99_ms": r["latency_us"]["p99"] / 1e3})
        elif "change_sets_per_s" in r:
            summary.append({"suite": suite, "what": label, "change_sets_per_s": r["change_sets_per_s"],
                            "p50_ms": r["latency_us"]["p50"] / 1e3, "p99_ms": r["latency_us"]["p99"] / 1e3,
                            "errors": r["error_total"]})
    return {"params": p, "runs": runs, "summary": summary}


def hostile_scenario(ctx: Ctx) -> dict:
    return hostile.run(ctx, PARAMS["hostile"][ctx.profile])


def rules_scenario(ctx: Ctx) -> dict:
    return rules.run(ctx, PARAMS["rules"][ctx.profile])


def tracing_scenario(ctx: Ctx) -> dict:
    return tracing.run(ctx, PARAMS["tracing"][ctx.profile])


def upgrade_scenario(ctx: Ctx) -> dict:
    return upgrade.run(ctx, PARAMS["upgrade"][ctx.profile])


SCENARIOS = {
    "churn": churn,
    "throughput": throughput,
    "heterogeneous": heterogeneous,
    "peak": peak_scenario,
    "overhead": overhead_scenario,
    "hostile": hostile_scenario,
    "tls": tls,
    "cluster": cluster,
    "rules": rules_scenario,
    "upgrade": upgrade_scenario,
    "tracing": tracing_scenario,
}

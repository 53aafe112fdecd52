"""Binary upgrades under load (issue 38): `upgrades` upgrades in a row,
alternating two builds, for Tidegate, nginx and HAProxy in the same run,
with every client checking every answer.

One backend emulator (`tidegate-emulator`, its name line as the body) and
one WebSocket echo server (bench/lib/upgrade_load.py, framing written
there) serve every peer. Each peer in turn gets, for the same
`duration` (warm-up, the upgrades every `interval_s`, a tail):

- keep-alive HTTP/1.1 on `ka_conns` connections at `ka_rate` requests/s
  each, new connections at `new_rate`/s (one GET each), one WebSocket that
  keeps sending and checks every echo, and, for Tidegate, configuration
  changes at `change_rate`/s (upgrade_load.py, one asyncio process);
- HTTP/2 over TLS: `h2_conns` connections at `h2_rate` requests/s each,
  at most `h2_streams` in flight (upgrade_load.py with the `h2` package:
  h2load does not open a new connection after a GOAWAY, so it would stop
  sending at the first upgrade), every answer checked too.

The upgrades, from build A to B, B to A, ...:

- Tidegate: `tidegate serve <the same flags> --takeover` started from the
  other build (docs/operations.md, "Upgrading without dropping
  connections"); it serves when it prints its ready line; the old process
  drains (`--drain-timeout-s` = `grace_s`) and exits by itself.
- nginx (binary upgrade, as its documentation describes): the other
  build is put in place of the binary the master was started from (a new
  file renamed over it), `USR2` to the master, which starts the new one
  with the listening sockets inherited; once a new connection is answered
  by a worker of the new master, `WINCH` and `QUIT` to the old master
  (`worker_shutdown_timeout` = `grace_s`). nginx runs as a daemon: it
  ignores `USR2` while its parent is the process that started it.
- HAProxy 2.6: the other build started with `-x <stats socket>` (a stats
  socket with `expose-fd listeners`: the new process takes the listening
  sockets from the old one, so no connection waiting in a backlog is
  lost) and `-sf <old pid>` (the old one then finishes its connections,
  `hard-stop-after` = `grace_s`), with `option idle-close-on-response`
  (2.6: an idle keep-alive connection of the old process is kept until
  its next answer, which closes it, instead of being closed as a request
  may be crossing). Chosen over master-worker's reload (`SIGUSR2` to the
  master) because that re-executes the master's own binary path: the
  `-x`/`-sf` reload starts the given build, as the other two do, and is
  the mechanism master-worker uses inside. It serves when a new
  connection is answered with its generation in a header (`X-Gen`, from
  the environment: HAProxy 2.6 has no `pid` sample).

nginx and HAProxy are one build each here: the two "builds" are two
copies of the installed binary (each upgrade execs a new file). Tidegate's
second build is `ctx.alt_bin_dir` (scripts/bench --alt-bin-dir) or, by
default, a copy of the first.

Measured per peer: requests and failures by kind for each load
(upgrade_load.py's kinds),
keep-alive requests sent again after an idle close (not failures), each
upgrade's time from its start to the new process serving (p50 and max),
when the old process exited, each WebSocket session's end (when, how),
and for Tidegate the configuration changes: every acknowledged one
present after the run (none lost), and the revisions taken against the
changes present (none applied twice), and the answers' latency over the
run and in the `window_s` after each upgrade. With `hetero` (the full
profile), Tidegate alone before backends of capacities 1:2:4 that a
service learns the limits of: 503s, timeouts and latency after each
upgrade against the same instants of a run without upgrades. Everything
on 127.0.0.1; every process started is stopped by its pid, nginx's
daemonized masters too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness import (TOKEN, Admin, Ctx, free_port, http_get, log, percentile, read_json_output, wait_for_line,
                     wait_port, which)

HERE = Path(__file__).resolve().parent
LOAD = HERE / "upgrade_load.py"
KINDS = ("refused", "reset", "timeout", "bad_status", "short_body", "bad_body")


def run(ctx: Ctx, p: dict) -> dict:
    certs(ctx)
    emu_name = "upgrade-backend"
    emu = ctx.procs.start([ctx.bin("tidegate-emulator"), "--listen", "127.0.0.1:0", "--name", emu_name,
                           "--threads", "1"], out=ctx.work / "upgrade-emu.out")
    emu_addr = wait_for_line(ctx.work / "upgrade-emu.out", r"listening on (\S+)", 10, emu).group(1)
    ws_port = free_port()
    ws = ctx.procs.start([sys.executable, str(LOAD), "ws-echo", "--port", str(ws_port)],
                         out=ctx.work / "upgrade-ws.out")
    wait_for_line(ctx.work / "upgrade-ws.out", r"ws-echo listening", 10, ws)
    status, _, body = http_get(emu_addr, "/")
    if status != 200:
        raise RuntimeError(f"the emulator at {emu_addr} answered {status}")
    backends = {"app": emu_addr, "ws": f"127.0.0.1:{ws_port}", "body": body.decode()}
    builds = tidegate_builds(ctx)
    peers = {}
    for name in p["peers"].split():
        log(f"  upgrade: {name}, {p['upgrades']} upgrades")
        cls = {"tidegate": TidegatePeer, "nginx": NginxPeer, "haproxy": HaproxyPeer}[name]
        peer = cls(ctx, p, backends, builds)
        try:
            peers[name] = run_peer(ctx, p, peer, backends)
        except Exception as e:  # the other peers still run
            log(f"  upgrade: {name} failed: {e}")
            peers[name] = {"error": str(e)[:2000]}
        finally:
            peer.stop()
    out = {"params": p, "builds": {k: v for k, v in builds.items() if k != "dirs"}, "peers": peers,
           "summary": summarize(peers)}
    if p.get("hetero"):
        log("  upgrade: heterogeneous backends (1:2:4, learned limits), with and without upgrades")
        try:
            out["heterogeneous"] = heterogeneous(ctx, p, backends, builds)
        except Exception as e:
            log(f"  upgrade: heterogeneous part failed: {e}")
            out["heterogeneous"] = {"error": str(e)[:2000]}
    return out


def heterogeneous(ctx: Ctx, p: dict, backends: dict, builds: dict) -> dict:
    """Paper S3's backends (1, 2 and 4 slots, exponential 20 ms jobs,
    queues of 20) behind a Tidegate service that learns their limits
    (least_conn): the same paced keep-alive load twice, without upgrades and with
    `hetero["upgrades"]` of them, and the 503s and timeouts in the
    `window_s` after each upgrade (the same instants in the run without)."""
    h = p["hetero"]
    addrs, bodies, procs = [], [], []
    for name, slots in (("c1", 1), ("c2", 2), ("c4", 4)):
        out = ctx.work / f"upgrade-hetero-{name}.out"
        proc = ctx.procs.start([ctx.bin("tidegate-emulator"), "--listen", "127.0.0.1:0", "--name", name, "--threads",
                                "1", "--slots", str(slots), "--queue", "20", "--service-time", h["service"]], out=out)
        procs.append(proc)
        addrs.append((name, wait_for_line(out, r"listening on (\S+)", 10, proc).group(1)))
        bodies.append(f"{name}\n")
    service = {"policy": {"kind": "least_conn"}, "concurrency": {"learn": True},
               "queue": {"max": 10000, "timeout_ms": int(p["timeout_s"] * 1000)},
               "backends": [{"id": n, "addr": a} for n, a in addrs]}
    hb = {**backends, "service": service, "bodies": bodies}
    runs = {}
    for mode, n in (("without", 0), ("with", h["upgrades"])):
        q = {**p, "upgrades": n, "schedule_n": h["upgrades"], "warmup_s": h["warmup_s"],
             "interval_s": h["interval_s"], "tail_s": h["tail_s"], "ka_conns": h["conns"], "ka_rate": h["rate"],
             "new_rate": 0, "h2_conns": 0, "change_rate": 0, "websocket": False}
        peer = TidegatePeer(ctx, q, hb, builds, tag=f"-hetero-{mode}")
        try:
            r = run_peer(ctx, q, peer, hb)
        finally:
            peer.stop()
        runs[mode] = {"requests": r["totals"]["requests"], "failed": r["totals"]["failed"],
                      "by_kind": r["totals"]["by_kind"], "windows": r["schedule_windows"],
                      "latency_ms": {k: r["latency_ms"][k] for k in ("all", "windows", "windows_p99_max",
                                                                      "windows_max")},
                      "upgrades": r["upgrades"]}
    for proc in procs:
        ctx.procs.stop(proc)

    def burst(w):
        return sum(x.get("bad_status", 0) + x.get("timeout", 0) for x in w)
    return {"params": h, "capacity_per_s": round(7 / parse_ms(h["service"]) * 1000, 1), "runs": runs,
            "after_upgrades_503_timeouts": {m: burst(r["windows"]) for m, r in runs.items()}}


def parse_ms(spec: str) -> float:
    """The mean of an emulator service time `exp:20ms` / `fixed:5ms`, ms."""
    v = spec.split(":")[1]
    return float(v[:-2]) if v.endswith("ms") else float(v[:-2]) / 1000 if v.endswith("us") else float(v[:-1]) * 1000


def tidegate_builds(ctx: Ctx) -> dict:
    a = Path(ctx.bin("tidegate"))
    alt = getattr(ctx, "alt_bin_dir", None)
    if alt:
        b = Path(alt) / "tidegate"
        if not b.exists():
            raise RuntimeError(f"no tidegate in the alternate build directory {alt}")
        note = f"{b}"
    else:
        d = ctx.work / "tidegate-b"
        d.mkdir(exist_ok=True)
        b = d / "tidegate"
        shutil.copy2(a, b)
        note = f"a copy of {a} (no second build given)"
    return {"a": str(a), "b": str(b), "b_is": note, "dirs": (a, b)}


def certs(ctx: Ctx) -> None:
    subprocess.run(["bash", "-c", f'source "{HERE / "certs.sh"}" && make_certs "{ctx.work}"'], check=True)
    (ctx.work / "haproxy.pem").write_text((ctx.work / "cert.pem").read_text() + (ctx.work / "key.pem").read_text())


def run_peer(ctx: Ctx, p: dict, peer, backends: dict) -> dict:
    peer.start()
    wait_serving(peer.proxy, backends.get("bodies") or [backends["body"]])
    n, interval = p["upgrades"], p["interval_s"]
    duration = p["warmup_s"] + p.get("schedule_n", n) * interval + p["tail_s"]
    load_cfg = {"proxy": peer.proxy, "body": backends["body"], "duration": duration, "timeout_s": p["timeout_s"],
                "bodies": backends.get("bodies"),
                "ka_conns": p["ka_conns"], "ka_rate": p["ka_rate"], "new_rate": p["new_rate"],
                "ws_path": "/ws" if p.get("websocket", True) else None,
                "ws_interval_s": p["ws_interval_s"], "tls": peer.tls, "ca": str(ctx.work / "cert.pem"),
                "h2_conns": p["h2_conns"], "h2_rate": p["h2_rate"], "h2_streams": p["h2_streams"]}
    if peer.name == "tidegate":
        load_cfg.update(change_rate=p["change_rate"], admin=peer.admin_addr, token=TOKEN)
        rev_start = peer.admin().call("GET", "/v1/routes")["revision"]
    # Two client processes (Python runs one core each): the HTTP/1.1 load
    # in one, HTTP/2, the WebSocket and the changes in the other.
    shards = [{**load_cfg, "h2_conns": 0, "ws_path": None, "change_rate": 0},
              {**load_cfg, "ka_conns": 0, "new_rate": 0}]
    loads = []
    for i, cfg in enumerate(shards):
        out_path = ctx.work / f"upgrade-load-{peer.name}-{i}.out"
        loads.append((ctx.procs.start([sys.executable, str(LOAD), "load", "--config", json.dumps(cfg)],
                                      out=out_path), out_path))
    for proc, path in loads:
        wait_for_line(path, r"load started", 30, proc)
    t0 = time.monotonic()
    upgrades = []
    for k in range(n):
        due = t0 + p["warmup_s"] + k * interval
        time.sleep(max(0.0, due - time.monotonic()))
        started = time.monotonic()
        rec = {"k": k + 1, "to": "b" if k % 2 == 0 else "a", "t": started, "late_s": round(started - due, 3)}
        try:
            rec.update(peer.upgrade(k + 1, rec["to"], started))
        except Exception as e:
            rec["error"] = str(e)[:1000]
            log(f"  upgrade {peer.name} #{k + 1} failed: {e}")
        upgrades.append(rec)
        if "error" in rec:
            break
    # The loads end by themselves after `duration`.
    deadline = time.monotonic() + duration + 60
    for proc, _ in loads:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            ctx.procs.stop(proc)
    res = merge([read_json_output(path) for _, path in loads])
    out = {"upgrades": upgrades, "completed": sum(1 for u in upgrades if "serving_s" in u),
           "load": {**res["counts"], "h2_connections": res["h2_connections"], "h2_goaways": res["h2_goaways"],
                    "h2_closed_without_goaway": res["h2_closed_without_goaway"], "h2_ends": res["h2_ends"]},
           "failures": [{**f, "t": round(f["t"] - t0, 3)} for f in res["failures"][:200]],
           "websocket": websocket_outcome(res["ws_sessions"], upgrades, t0, p["grace_s"]),
           "window_failures": windows(res["failures"], upgrades, p["window_s"]),
           "schedule_windows": schedule_windows(res["failures"], t0, p),
           "latency_ms": latency_summary(res["latency"], upgrades, t0, p)}
    serving = [u["serving_s"] for u in upgrades if "serving_s" in u]
    out["upgrade_time_s"] = {"p50": percentile(serving, 50) if serving else None, "max": max(serving, default=None)}
    if peer.name == "tidegate":
        out["changes"] = check_changes(peer, res, rev_start)
    out["totals"] = totals(out)
    return out


def merge(results: list[dict]) -> dict:
    """One result from the client processes' results."""
    out = dict(results[0])
    out["counts"] = {part: {k: sum(r["counts"][part][k] for r in results) for k in results[0]["counts"][part]}
                     for part in results[0]["counts"]}
    out["failures"] = sorted((f for r in results for f in r["failures"]), key=lambda f: f["t"])
    for key in ("ws_sessions",):
        out[key] = [x for r in results for x in r[key]]
    out["changes"] = {k: v for r in results for k, v in r["changes"].items()}
    for key in ("h2_connections", "h2_goaways", "h2_closed_without_goaway", "inflight_skipped"):
        out[key] = sum(r[key] for r in results)
    out["latency"] = {part: [tuple(x) for r in results for x in shift(r["latency"][part], r["t0"])]
                      for part in results[0]["latency"]}
    out["h2_ends"] = {}
    for r in results:
        for k, v in r["h2_ends"].items():
            out["h2_ends"][k] = out["h2_ends"].get(k, 0) + v
    out["change_counts"] = next((r["change_counts"] for r in results if r["changes"]), results[0]["change_counts"])
    return out


def shift(samples: list, t0: float) -> list[tuple[float, float]]:
    """(ms since a load's t0, µs) to (monotonic s, ms)."""
    return [(t0 + t / 1000, us / 1000) for t, us in samples]


def latency_summary(latency: dict, upgrades: list[dict], t0: float, p: dict) -> dict:
    """Latency of the answers (200) per load, and of every load together
    in the `window_s` after each planned upgrade instant, ms."""
    def stats(xs):
        return {"n": len(xs), "p50": percentile(xs, 50), "p99": percentile(xs, 99), "max": max(xs)} if xs else None
    out = {"overall": {part: stats([ms for _, ms in v]) for part, v in latency.items()}}
    every = [x for v in latency.values() for x in v]
    out["all"] = stats([ms for _, ms in every])
    wins = []
    for k in range(p.get("schedule_n", p["upgrades"])):
        start = t0 + p["warmup_s"] + k * p["interval_s"]
        if k < len(upgrades):
            start = upgrades[k]["t"]
        wins.append(stats([ms for t, ms in every if start <= t < start + p["window_s"]]))
    out["windows"] = wins
    out["windows_p99_max"] = max((w["p99"] for w in wins if w), default=None)
    out["windows_max"] = max((w["max"] for w in wins if w), default=None)
    return out


def wait_serving(proxy: str, bodies: list[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = http_get(proxy, "/warm", timeout=2)
        if last[0] == 200 and last[2].decode(errors="replace") in bodies:
            return
        time.sleep(0.05)
    raise RuntimeError(f"{proxy} does not serve the backend's answer: {last}")


def websocket_outcome(sessions: list[dict], upgrades: list[dict], t0: float, grace: float) -> dict:
    """Each session's span and end, and for each upgrade the session open
    when it started: how long after the upgrade it ended, and how."""
    rows = [{"start": round(s["start"] - t0, 3), "end": round(s["end"] - t0, 3) if s["end"] else None,
             "how": s["how"], "echoed": s["echoed"], "detail": s.get("detail", "")} for s in sessions]
    per = []
    used: set[int] = set()
    for u in upgrades:
        # The session the old process held: open when the upgrade began, or
        # opened before the new process served; not one already counted for
        # the upgrade before (whose grace may end just as this one begins).
        served = u["t"] + (u.get("serving_s") or 0)
        open_then = [i for i, s in enumerate(sessions) if i not in used and s["start"] <= served
                     and (s["end"] is None or s["end"] > u["t"])]
        if not open_then:
            per.append({"k": u["k"], "session": None})
            continue
        used.add(open_then[0])
        s = sessions[open_then[0]]
        per.append({"k": u["k"], "ended_after_s": round(s["end"] - u["t"], 3) if s["end"] else None,
                    "how": s["how"], "echoed": s["echoed"]})
    ended = [x["ended_after_s"] for x in per if x.get("ended_after_s") is not None and x["how"] != "open_at_end"]
    bad = [s for s in sessions if s["how"] in ("bad_echo", "timeout", "bad_status", "refused", "error")]
    hows = sorted({x["how"] for x in per if x.get("how")})
    return {"sessions": rows[:100], "per_upgrade": per, "grace_s": grace,
            "ended_after_s_min": min(ended, default=None), "ended_after_s_max": max(ended, default=None),
            "ends": hows, "bad_sessions": len(bad),
            "summary": (f"{len(ended)}/{len(per)} ended {min(ended):.1f}-{max(ended):.1f} s after their upgrade "
                        f"({', '.join(hows)})" if ended else "none ended") + (f"; {len(bad)} failed" if bad else "")}


def windows(failures: list[dict], upgrades: list[dict], window: float) -> list[int]:
    """Failures in the `window` s after each upgrade's start."""
    return [sum(1 for f in failures if u["t"] <= f["t"] < u["t"] + window) for u in upgrades]


def schedule_windows(failures: list[dict], t0: float, p: dict) -> list[dict]:
    """Failures by kind in the `window_s` after each planned upgrade time
    (`schedule_n` of them: the same instants in a run without upgrades)."""
    out = []
    for k in range(p.get("schedule_n", p["upgrades"])):
        start = t0 + p["warmup_s"] + k * p["interval_s"]
        counts: dict[str, int] = {}
        for f in failures:
            if start <= f["t"] < start + p["window_s"]:
                counts[f["kind"]] = counts.get(f["kind"], 0) + 1
        out.append(counts)
    return out


def check_changes(peer, res: dict, rev_start: int) -> dict:
    admin = peer.admin()
    routes = admin.call("GET", "/v1/routes")
    admin.close()
    present = {n for n in routes["routes"] if n.startswith("chg-")}
    changes = res["changes"]
    acked = {n for n, c in changes.items() if c["revision"] is not None}
    ambiguous = {n for n, c in changes.items() if c["ambiguous"]}
    lost = sorted(acked - present)
    unacked_present = sorted(present - acked)
    revs = [c["revision"] for c in changes.values() if c["revision"] is not None]
    taken = routes["revision"] - rev_start
    # Every change present took at least one revision; more revisions than
    # changes present means one was applied twice (the client's own resends
    # of ambiguous changes may account for some of them).
    extra = taken - len(present)
    return {"sent": len(changes), "acked": len(acked), "present": len(present), "lost": len(lost),
            "lost_names": lost[:20], "present_unacked": len(unacked_present),
            "present_unacked_not_ambiguous": len(set(unacked_present) - ambiguous),
            "ambiguous": len(ambiguous), "revisions_taken": taken, "extra_revisions": extra,
            "applied_twice_max": max(0, extra), "applied_twice_beyond_ambiguous": max(0, extra - len(ambiguous)),
            "duplicate_ack_revisions": len(revs) - len(set(revs)), "counts": res["change_counts"],
            "other_errors": [c.get("error") for c in changes.values() if c.get("error")][:5]}


def totals(out: dict) -> dict:
    parts = [out["load"][k] for k in ("keep_alive", "new_conn", "h2")]
    by_kind = {k: sum(x[k] for x in parts) for k in KINDS}
    return {"requests": sum(x["requests"] for x in parts), "failed": sum(by_kind.values()), "by_kind": by_kind,
            "resent": sum(x["resent"] for x in parts), "idle_closed": out["load"]["keep_alive"]["idle_closed"],
            "resets": by_kind["reset"], "refused": by_kind["refused"]}


def summarize(peers: dict) -> dict:
    out = {}
    for name, r in peers.items():
        if "error" in r:
            out[name] = {"error": r["error"][:300]}
            continue
        ws, ch = r["websocket"], r.get("changes")
        out[name] = {"upgrades": r["completed"], "requests": r["totals"]["requests"], "failed": r["totals"]["failed"],
                     "by_kind": r["totals"]["by_kind"],
                     "resets": r["totals"]["resets"], "refused": r["totals"]["refused"],
                     "resent": r["totals"]["resent"], "idle_closed": r["totals"]["idle_closed"],
                     "h2_goaways": r["load"]["h2_goaways"],
                     "h2_closed_without_goaway": r["load"]["h2_closed_without_goaway"], "websocket": ws["summary"],
                     "changes_lost": ch["lost"] if ch else None,
                     "changes_applied_twice": ch["applied_twice_beyond_ambiguous"] if ch else None,
                     "upgrade_p50_s": r["upgrade_time_s"]["p50"], "upgrade_max_s": r["upgrade_time_s"]["max"],
                     "latency_p99_ms": (r["latency_ms"]["all"] or {}).get("p99"),
                     "after_upgrade_p99_ms": r["latency_ms"]["windows_p99_max"],
                     "after_upgrade_max_ms": r["latency_ms"]["windows_max"]}
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def ppid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def wait_gone(pid: int, timeout: float) -> float | None:
    """Seconds until `pid` is gone (None: still there at `timeout`)."""
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if not alive(pid):
            return time.monotonic() - t
        time.sleep(0.01)
    return None


def poll_new_answer(proxy: str, is_new, started: float, timeout: float = 30) -> float:
    """Seconds from `started` until a new connection is answered 200 by
    the new process (`is_new(headers)`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, headers, _ = http_get(proxy, "/upgrade-probe", timeout=1)
        if status == 200 and is_new(headers):
            return time.monotonic() - started
        time.sleep(0.003)
    raise RuntimeError(f"no answer from the new process within {timeout} s")


def old_gone(old: subprocess.Popen, serving: float, started: float, grace_s: float) -> dict:
    """Waits for the old process of an upgrade to exit (its grace and 30 s
    more); the upgrade's times: to the new process serving, to the old
    one gone (None if it did not exit in time), and its exit code."""
    try:
        old.wait(timeout=grace_s + 30)
    except subprocess.TimeoutExpired:
        return {"serving_s": round(serving, 4), "old_exit_s": None}
    return {"serving_s": round(serving, 4), "old_exit_s": round(time.monotonic() - started, 3),
            "old_exit_code": old.returncode}


class TidegatePeer:
    name = "tidegate"

    def __init__(self, ctx: Ctx, p: dict, backends: dict, builds: dict, tag: str = "") -> None:
        self.ctx, self.p, self.backends, self.tag = ctx, p, backends, tag
        self.bins = {"a": builds["a"], "b": builds["b"]}
        self.proxy = f"127.0.0.1:{free_port()}"
        self.tls = f"127.0.0.1:{free_port()}"
        self.admin_addr = f"127.0.0.1:{free_port()}"
        self.data = ctx.work / f"upgrade-tg{tag}"
        self.current = None

    def argv(self, build: str) -> list[str]:
        return [self.bins[build], "serve", "--listen", self.proxy, "--listen-tls", self.tls, "--admin", self.admin_addr,
                "--data-dir", str(self.data), "--workers", str(self.p["workers"]),
                "--drain-timeout-s", str(self.p["grace_s"])]

    def spawn(self, argv: list[str], k: int):
        out = self.ctx.work / f"upgrade-tg{self.tag}-{k}.out"
        env = {"TIDEGATE_ADMIN_TOKEN": TOKEN, "TIDEGATE_LOG": "warn"}
        return self.ctx.procs.start(argv, out=out, env=env), out

    def admin(self) -> Admin:
        return Admin(self.admin_addr)

    def start(self) -> None:
        self.current, out = self.spawn(self.argv("a"), 0)
        wait_for_line(out, r"tidegate ready", 60, self.current)
        cert, key = (self.ctx.work / "cert.pem").read_text(), (self.ctx.work / "key.pem").read_text()
        app = self.backends.get("service") or {"backends": [{"id": "e", "addr": self.backends["app"]}]}
        ops = [{"op": "put_service", "name": "app", "spec": app},
               {"op": "put_route", "name": "app", "spec": {"match": {"path_prefix": "/"}, "service": "app"}},
               {"op": "put_service", "name": "ws", "spec": {"backends": [{"id": "w", "addr": self.backends["ws"]}]}},
               {"op": "put_route", "name": "ws", "spec": {"match": {"path_prefix": "/ws"}, "service": "ws"}},
               {"op": "put_certificate", "name": "bench",
                "spec": {"cert_pem": cert, "key_pem": key, "default": True}}]
        a = self.admin()
        a.call("POST", "/v1/changes", {"ops": ops})
        a.close()

    def upgrade(self, k: int, to: str, started: float) -> dict:
        old = self.current
        new, out = self.spawn(self.argv(to) + ["--takeover"], k)
        rx = re.compile(r"tidegate ready")
        while True:
            text = out.read_text(errors="replace") if out.exists() else ""
            if rx.search(text):
                serving = time.monotonic() - started
                break
            if new.poll() is not None:
                raise RuntimeError(f"the new process exited ({new.returncode}): {text[-1000:]}")
            if time.monotonic() - started > 60:
                raise RuntimeError(f"no ready line within 60 s: {text[-1000:]}")
            time.sleep(0.002)
        self.current = new
        return old_gone(old, serving, started, self.p["grace_s"])

    def stop(self) -> None:
        for proc in list(self.ctx.procs.started):
            if proc.args and str(proc.args[0]) in self.bins.values():
                self.ctx.procs.stop(proc, grace=self.p["grace_s"] + 5)


class NginxPeer:
    name = "nginx"

    def __init__(self, ctx: Ctx, p: dict, backends: dict, builds: dict) -> None:
        self.ctx, self.p, self.backends = ctx, p, backends
        nginx = which("nginx") or "nginx"
        self.copies = {}
        for b in ("a", "b"):
            path = ctx.work / f"nginx-{b}"
            shutil.copy2(nginx, path)
            self.copies[b] = path
        self.bin = ctx.work / "nginx-run" / "nginx"
        self.bin.parent.mkdir(exist_ok=True)
        self.proxy = f"127.0.0.1:{free_port()}"
        self.tls = f"127.0.0.1:{free_port()}"
        self.pidfile = ctx.work / "upgrade-nginx.pid"
        self.conf = ctx.work / "upgrade-nginx.conf"
        self.masters: list[int] = []

    def put(self, build: str) -> None:
        tmp = self.bin.with_suffix(".new")
        shutil.copy2(self.copies[build], tmp)
        os.replace(tmp, self.bin)

    def start(self) -> None:
        w, g = self.ctx.work, self.p["grace_s"]
        self.conf.write_text(f"""worker_processes {self.p['workers']}; daemon on; pid {self.pidfile};
error_log {w / 'upgrade-nginx.err'} warn;
worker_shutdown_timeout {g}s;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  upstream app {{ server {self.backends['app']}; keepalive 64; }}
  upstream ws {{ server {self.backends['ws']}; }}
  server {{
    listen {self.proxy} backlog=4096;
    listen {self.tls} ssl http2 backlog=4096;
    ssl_certificate {w / 'cert.pem'}; ssl_certificate_key {w / 'key.pem'};
    keepalive_requests 1000000; keepalive_timeout 60s;
    add_header X-Pid $pid always;
    location /ws {{ proxy_pass http://ws; proxy_http_version 1.1; proxy_set_header Upgrade $http_upgrade;
      proxy_set_header Connection "upgrade"; proxy_read_timeout 1h; }}
    location / {{ proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection ""; }}
  }}
}}
""")
        self.put("a")
        r = subprocess.run([str(self.bin), "-c", str(self.conf), "-e", str(w / "upgrade-nginx.err")],
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"nginx did not start: {r.stderr[-1000:]}")
        self.masters.append(self.read_pid(self.pidfile, None, 10))
        wait_port(int(self.proxy.rsplit(":", 1)[1]))

    def read_pid(self, path: Path, other_than: int | None, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                pid = int(path.read_text().strip())
                if pid != other_than and alive(pid):
                    return pid
            except (OSError, ValueError):
                pass
            time.sleep(0.003)
        raise RuntimeError(f"no new pid in {path} within {timeout} s")

    def upgrade(self, k: int, to: str, started: float) -> dict:
        old = self.masters[-1]
        self.put(to)
        started = time.monotonic()
        os.kill(old, signal.SIGUSR2)
        new = self.read_pid(self.pidfile, old, 30)
        self.masters.append(new)

        def is_new(headers: dict) -> bool:
            pid = headers.get("x-pid")
            return pid is not None and pid.isdigit() and ppid_of(int(pid)) == new
        serving = poll_new_answer(self.proxy, is_new, started)
        os.kill(old, signal.SIGWINCH)
        os.kill(old, signal.SIGQUIT)
        gone = wait_gone(old, self.p["grace_s"] + 30)
        return {"serving_s": round(serving, 4),
                "old_exit_s": round(time.monotonic() - started, 3) if gone is not None else None}

    def stop(self) -> None:
        for pid in self.masters:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for pid in self.masters:
            if wait_gone(pid, 10) is None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        # Its workers exit with their master; any left are killed by pid.
        for pid in self.masters:
            for child in children_of(pid):
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def children_of(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and ppid_of(int(d)) == pid:
            out.append(int(d))
    return out


class HaproxyPeer:
    name = "haproxy"

    def __init__(self, ctx: Ctx, p: dict, backends: dict, builds: dict) -> None:
        self.ctx, self.p, self.backends = ctx, p, backends
        haproxy = which("haproxy") or "haproxy"
        self.copies = {}
        for b in ("a", "b"):
            path = ctx.work / f"haproxy-{b}"
            shutil.copy2(haproxy, path)
            self.copies[b] = str(path)
        self.proxy = f"127.0.0.1:{free_port()}"
        self.tls = f"127.0.0.1:{free_port()}"
        self.sock = ctx.work / "upgrade-haproxy.sock"
        self.cfg = ctx.work / "upgrade-haproxy.cfg"
        self.current = None

    def spawn(self, build: str, gen: int, extra: list[str]):
        return self.ctx.procs.start([self.copies[build], "-f", str(self.cfg), "-db", *extra],
                                    out=self.ctx.work / f"upgrade-haproxy-{gen}.out", env={"UPGRADE_GEN": str(gen)})

    def start(self) -> None:
        w = self.ctx.work
        self.cfg.write_text(f"""global
  stats socket {self.sock} mode 600 level admin expose-fd listeners
  hard-stop-after {self.p['grace_s']}s
  nbthread {self.p['workers']}
  maxconn 4000
defaults
  mode http
  option idle-close-on-response
  timeout connect 5s
  timeout client 60s
  timeout server 60s
  timeout tunnel 1h
  timeout http-keep-alive 60s
frontend fe
  bind {self.proxy}
  bind {self.tls} ssl crt {w / 'haproxy.pem'} alpn h2,http/1.1
  http-response set-header X-Gen %[env(UPGRADE_GEN)]
  use_backend ws if {{ path_beg /ws }}
  default_backend app
backend app
  http-reuse always
  server e {self.backends['app']}
backend ws
  server w {self.backends['ws']}
""")
        self.current = self.spawn("a", 0, [])
        wait_port(int(self.proxy.rsplit(":", 1)[1]))

    def upgrade(self, k: int, to: str, started: float) -> dict:
        old = self.current
        self.current = self.spawn(to, k, ["-x", str(self.sock), "-sf", str(old.pid)])
        serving = poll_new_answer(self.proxy, lambda h: h.get("x-gen") == str(k), started)
        return old_gone(old, serving, started, self.p["grace_s"])

    def stop(self) -> None:
        for proc in list(self.ctx.procs.started):
            if proc.args and str(proc.args[0]) in self.copies.values():
                self.ctx.procs.stop(proc, grace=5)

"""Hostile load (issue 9): normal open-loop traffic through Tidegate, first
alone (quiet), then while attackers run on the same listener: slowloris
(headers trickled a byte at a time), silent connections, header floods
(100 KiB of headers), smuggling attempts (CL+TE, duplicate Content-Length),
garbage bytes, and request bodies trickled slower than the body timeout.
Reports the normal traffic's errors and latency in both runs, Tidegate's
largest resident memory while under attack, and what the attackers were
answered. Everything on 127.0.0.1; attackers stop by themselves at the end
of the window.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time

from harness import Ctx, bench_async, log, read_json_output, start_emulator, start_tidegate, stop_tidegate, wait_http


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Attack:
    """One kind of attacker: `workers` threads, each repeating `once` until
    the deadline; counts what came back."""

    def __init__(self, name: str, addr: tuple[str, int], deadline: float, workers: int, once, pace: float) -> None:
        self.name, self.addr, self.deadline, self.once, self.pace = name, addr, deadline, once, pace
        self.answers: dict[str, int] = {}
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.loop, daemon=True) for _ in range(workers)]

    def count(self, what: str) -> None:
        with self.lock:
            self.answers[what] = self.answers.get(what, 0) + 1

    def loop(self) -> None:
        while time.monotonic() < self.deadline:
            try:
                self.count(self.once(self))
            except OSError as e:
                self.count(type(e).__name__)
            time.sleep(self.pace)

    def connect(self, timeout: float = 5.0) -> socket.socket:
        s = socket.create_connection(self.addr, timeout=timeout)
        s.settimeout(timeout)
        return s

    def status_of(self, s: socket.socket) -> str:
        """The status code of the first answer, or how the connection ended."""
        try:
            data = s.recv(64)
        except socket.timeout:
            return "no answer"
        except OSError as e:
            return type(e).__name__
        if not data:
            return "closed"
        parts = data.split(b" ", 2)
        return parts[1].decode(errors="replace") if len(parts) > 1 and data.startswith(b"HTTP/") else "garbage"


def slowloris(a: Attack) -> str:
    s = a.connect(timeout=60)
    try:
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n")
        while time.monotonic() < a.deadline:
            time.sleep(2)
            s.sendall(b"x-a: b\r\n")
        return "held to the end"
    except OSError:
        return "closed by proxy"
    finally:
        s.close()


def silent(a: Attack) -> str:
    s = a.connect(timeout=max(0.1, a.deadline - time.monotonic()))
    try:
        return "closed by proxy" if s.recv(1) == b"" else "data"
    except socket.timeout:
        return "held to the end"
    except OSError:
        return "closed by proxy"
    finally:
        s.close()


def header_flood(a: Attack) -> str:
    s = a.connect()
    try:
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (100 * 1024) + b"\r\n\r\n")
        return a.status_of(s)
    finally:
        s.close()


def smuggle(a: Attack) -> str:
    s = a.connect()
    try:
        if random.random() < 0.5:
            s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n"
                      b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n")
        else:
            s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\ncontent-length: 40\r\n\r\nabcd")
        return a.status_of(s)
    finally:
        s.close()


def garbage(a: Attack) -> str:
    s = a.connect()
    try:
        s.sendall(os.urandom(512))
        return a.status_of(s)
    finally:
        s.close()


def slow_body(a: Attack) -> str:
    """A 64 KiB body sent two bytes every three seconds."""
    s = a.connect(timeout=3)
    try:
        s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 65536\r\n\r\n")
        while time.monotonic() < a.deadline:
            s.sendall(b"xx")
            try:
                data = s.recv(64)
            except socket.timeout:
                continue
            if data.startswith(b"HTTP/"):
                return data.split(b" ")[1].decode(errors="replace")
            return "closed by proxy"
        return "held to the end"
    except OSError:
        return "closed by proxy"
    finally:
        s.close()


# name: (function, threads, pause between tries in seconds). The floods
# are paced (about 100 tries a second each): the point is hostile requests
# next to normal ones, not a bandwidth flood that only measures who gets
# the CPU of a 2-core machine.
ATTACKS = {
    "slowloris": (slowloris, 200, 0.0),
    "silent": (silent, 200, 0.0),
    "header_flood": (header_flood, 2, 0.02),
    "smuggling": (smuggle, 2, 0.02),
    "garbage": (garbage, 2, 0.02),
    "slow_body": (slow_body, 50, 0.0),
}


def run(ctx: Ctx, duration: float, rate: float, attackers_scale: float = 1.0) -> dict:
    _, b1 = start_emulator(ctx, "h1")
    _, b2 = start_emulator(ctx, "h2")
    tg = start_tidegate(ctx, "hostile")
    tg.admin.call("PUT", "/v1/services/app", {"backends": [{"id": "a", "addr": b1}, {"id": "b", "addr": b2}]})
    tg.admin.call("PUT", "/v1/routes/app", {"match": {"path_prefix": "/"}, "service": "app"})
    wait_http(tg.proxy, "/")
    host, port = tg.proxy.rsplit(":", 1)
    addr = (host, int(port))
    runs = {}
    try:
        for phase in ("quiet", "hostile"):
            out = ctx.work / f"hostile-{phase}.json"
            traffic = bench_async(ctx, ["traffic", "--rate", str(rate), "--duration-s", str(duration), "--path", "/"],
                                  out, proxy=tg.proxy, threads=1)
            attacks = []
            if phase == "hostile":
                deadline = time.monotonic() + duration
                for name, (fn, workers, pace) in ATTACKS.items():
                    n = max(1, int(workers * attackers_scale))
                    attacks.append(Attack(name, addr, deadline, n, fn, pace))
                for a in attacks:
                    for t in a.threads:
                        t.start()
            peak = rss_kib(tg.proc.pid)
            while traffic.poll() is None:
                time.sleep(0.5)
                peak = max(peak, rss_kib(tg.proc.pid))
            for a in attacks:
                for t in a.threads:
                    t.join(timeout=5)
            r = read_json_output(out)
            lat = r.get("latency_us", {})
            runs[phase] = {
                "ok": r.get("ok"), "non_200": r.get("non_200"), "errors": r.get("error_total"),
                "p50_us": lat.get("p50"), "p99_us": lat.get("p99"), "max_us": lat.get("max"),
                "rss_peak_kib": peak,
                "attacks": {a.name: a.answers for a in attacks},
            }
            log(f"  hostile {phase:7}: ok {r.get('ok')} non-200 {r.get('non_200')} errors {r.get('error_total')} "
                f"p50 {lat.get('p50')} us p99 {lat.get('p99')} us, RSS peak {peak / 1024:.1f} MiB")
            for a in attacks:
                log(f"    {a.name:13} {a.answers}")
    finally:
        stop_tidegate(ctx, tg)
    q, h = runs["quiet"], runs["hostile"]
    ratio = (h["p99_us"] / q["p99_us"]) if q.get("p99_us") and h.get("p99_us") else None
    return {
        "runs": runs,
        "summary": {"duration_s": duration, "rate": rate, "p99_ratio": ratio,
                    "normal_failures_under_attack": (h["non_200"] or 0) + (h["errors"] or 0),
                    "rss_peak_mib": round(h["rss_peak_kib"] / 1024, 1)},
        "goal": {"zero_errors": (h["non_200"] or 0) + (h["errors"] or 0) == 0,
                 "p99_within_2x": ratio is not None and ratio <= 2.0},
    }

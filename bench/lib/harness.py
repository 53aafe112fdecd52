"""Shared pieces of the benchmark harness: processes it starts (and stops,
by pid), free loopback ports, a tiny HTTP client, Tidegate's admin API, and
the tidegate-bench driver.

Everything listens on 127.0.0.1. Every process started here is recorded and
stopped by its pid at the end (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "bench-token-0123456789abcdef0123456789"


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


@dataclass
class Ctx:
    """What every scenario gets."""

    profile: str  # "smoke" or "full"
    bin_dir: Path
    out_dir: Path  # bench/results/<timestamp>
    work: Path  # a temporary directory, removed at the end
    procs: "Procs"
    notes: list[str] = field(default_factory=list)
    # A second build of tidegate (a directory holding it) for the upgrade
    # scenario's alternation; None: a copy of the first.
    alt_bin_dir: Path | None = None
    # `--pin`: scenarios that run attackers in the harness (hostile) keep
    # them on CPUs of their own (see `pin_split`).
    pin: bool = False

    @property
    def smoke(self) -> bool:
        return self.profile == "smoke"

    def bin(self, name: str) -> str:
        return str(self.bin_dir / name)


class Procs:
    """Processes started by the harness, stopped by pid. `cpus`, when set,
    is the CPU set every process started from then on runs on."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen] = []
        self.cpus: set[int] | None = None

    def start(self, argv: list[str], out: Path | None = None, env: dict | None = None, cwd=None) -> subprocess.Popen:
        full_env = dict(os.environ)
        full_env.update(env or {})
        stdout = open(out, "wb") if out else subprocess.DEVNULL
        cpus = self.cpus
        p = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.STDOUT, env=full_env, cwd=cwd,
                             stdin=subprocess.DEVNULL,
                             preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        if out:
            stdout.close()
        self.started.append(p)
        return p

    def stop(self, p: subprocess.Popen, grace: float = 3.0) -> None:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=5)
        if p in self.started:
            self.started.remove(p)

    def stop_all(self) -> None:
        for p in list(reversed(self.started)):
            try:
                self.stop(p)
            except Exception as e:  # keep stopping the others
                log(f"stopping pid {p.pid}: {e}")


class pin_split:
    """`with pin_split(ctx):` when `ctx.pin`: the processes the harness
    starts inside (proxies, backends, the normal traffic's generator) run
    on the first CPU this process may use, and this thread and the threads
    it starts inside (attackers, samplers) on the others; both are
    restored on exit. Real attackers run on other machines: pinned, the
    CPU their generators take is not taken from the proxy or from the
    normal traffic's client. Without `ctx.pin` (or with fewer than 2
    CPUs) it does nothing."""

    def __init__(self, ctx: "Ctx") -> None:
        self.ctx = ctx
        self.saved: set[int] | None = None

    def __enter__(self) -> "pin_split":
        cpus = sorted(os.sched_getaffinity(0))
        if self.ctx.pin and len(cpus) >= 2:
            self.saved = set(cpus)
            self.ctx.procs.cpus = {cpus[0]}
            os.sched_setaffinity(0, set(cpus[1:]))
            log(f"  pinned: proxies, backends and the normal traffic on CPU {cpus[0]}, "
                f"attackers on CPU {','.join(map(str, cpus[1:]))}")
        return self

    def __exit__(self, *_exc) -> None:
        if self.saved is not None:
            self.ctx.procs.cpus = None
            os.sched_setaffinity(0, self.saved)


def wait_for_line(path: Path, pattern: str, timeout: float = 15.0, proc: subprocess.Popen | None = None) -> re.Match:
    """Waits until a line of `path` matches `pattern`; returns the match."""
    deadline = time.monotonic() + timeout
    rx = re.compile(pattern)
    while time.monotonic() < deadline:
        try:
            for line in path.read_text(errors="replace").splitlines():
                m = rx.search(line)
                if m:
                    return m
        except FileNotFoundError:
            pass
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.02)
    text = path.read_text(errors="replace")[-2000:] if path.exists() else "(no output)"
    raise RuntimeError(f"no line matching {pattern!r} in {path} within {timeout}s:\n{text}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port_block(size: int = 100) -> int:
    """A base port B such that B..B+size-1 are free now (below the
    ephemeral range, away from the autoscaler's 24000-24099)."""
    for _ in range(200):
        base = random.randrange(25000, 32000 - size, 100)
        if all(port_is_free(base + i) for i in range(size)):
            return base
    raise RuntimeError("no free block of ports")


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def split_addr(addr: str) -> tuple[str, int]:
    host, port = addr.rsplit(":", 1)
    return host, int(port)


def http_get(addr: str, path: str, timeout: float = 2.0) -> tuple[int, dict, bytes]:
    """One GET on a new connection: (status, lower-case headers, body);
    status 0 on a transport failure."""
    host, port = split_addr(addr)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        r = conn.getresponse()
        body = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, body
    except (OSError, http.client.HTTPException):
        return 0, {}, b""
    finally:
        conn.close()


class Admin:
    """Tidegate's admin API over one keep-alive connection."""

    def __init__(self, addr: str, token: str = TOKEN) -> None:
        self.host, self.port = split_addr(addr)
        self.token = token
        self.conn: http.client.HTTPConnection | None = None

    def call(self, method: str, path: str, body=None, ok=(200,)) -> dict:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.token}"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
            try:
                self.conn.request(method, path, body=data, headers=headers)
                r = self.conn.getresponse()
                text = r.read()
                break
            except (OSError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt == 1:
                    raise
        value = json.loads(text) if text.strip() else {}
        if ok and r.status not in ok:
            raise RuntimeError(f"{method} {path}: HTTP {r.status}: {text[:500]!r}")
        return value

    def text(self, path: str) -> str:
        """`GET path` (its body as text), e.g. `/metrics`."""
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
            try:
                self.conn.request("GET", path, headers={"Authorization": f"Bearer {self.token}"})
                return self.conn.getresponse().read().decode(errors="replace")
            except (OSError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt == 1:
                    raise
        return ""

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


@dataclass
class Tidegate:
    proc: subprocess.Popen
    proxy: str
    admin_addr: str
    data_dir: Path
    admin: Admin


def start_tidegate(ctx: Ctx, name: str, workers: int = 2, extra_env: dict | None = None,
                   args: list[str] | tuple[str, ...] = ()) -> Tidegate:
    """Starts `tidegate serve` on free loopback ports; `args` are more
    options of `serve`."""
    data = ctx.work / f"tg-{name}"
    out = ctx.work / f"tg-{name}.out"
    env = {"TIDEGATE_ADMIN_TOKEN": TOKEN, "TIDEGATE_LOG": "warn"}
    env.update(extra_env or {})
    p = ctx.procs.start([ctx.bin("tidegate"), "serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0",
                         "--data-dir", str(data), "--workers", str(workers), *args], out=out, env=env)
    m = wait_for_line(out, r"tidegate ready proxy=(\S+) admin=(\S+)", 30, p)
    return Tidegate(p, m.group(1), m.group(2), data, Admin(m.group(2)))


def stop_tidegate(ctx: Ctx, tg: Tidegate) -> None:
    tg.admin.close()
    ctx.procs.stop(tg.proc, grace=12)


def start_emulator(ctx: Ctx, name: str, *args: str) -> tuple[subprocess.Popen, str]:
    out = ctx.work / f"emu-{name}.out"
    p = ctx.procs.start([ctx.bin("tidegate-emulator"), "--listen", "127.0.0.1:0", "--name", name,
                         "--threads", "1", *args], out=out)
    m = wait_for_line(out, r"listening on (\S+)", 10, p)
    return p, m.group(1)


def bench(ctx: Ctx, args: list[str], proxy: str | None = None, admin: str | None = None,
          threads: int = 1, timeout_ms: int = 5000, wall_timeout: float = 900) -> dict:
    """Runs tidegate-bench; returns its JSON (raises on an error)."""
    argv = [ctx.bin("tidegate-bench"), "--threads", str(threads), "--timeout-ms", str(timeout_ms), "--token", TOKEN]
    if proxy:
        argv += ["--proxy", proxy]
    if admin:
        argv += ["--admin", admin]
    argv += args
    r = subprocess.run(argv, capture_output=True, text=True, timeout=wall_timeout)
    try:
        value = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise RuntimeError(f"tidegate-bench {' '.join(args)}: no JSON (exit {r.returncode}): {r.stderr[-2000:]}")
    if r.returncode != 0 or "error" in value:
        raise RuntimeError(f"tidegate-bench {' '.join(args)}: {value.get('error')} {r.stderr[-1000:]}")
    return value


def bench_async(ctx: Ctx, args: list[str], out: Path, proxy: str | None = None, threads: int = 1,
                timeout_ms: int = 5000) -> subprocess.Popen:
    """Starts tidegate-bench in the background; its JSON goes to `out`."""
    argv = [ctx.bin("tidegate-bench"), "--threads", str(threads), "--timeout-ms", str(timeout_ms), "--token", TOKEN]
    if proxy:
        argv += ["--proxy", proxy]
    return ctx.procs.start(argv + args, out=out)


def read_json_output(path: Path) -> dict:
    for line in reversed(path.read_text(errors="replace").splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON in {path}: {path.read_text(errors='replace')[-1000:]}")


def which(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/usr/local/sbin:/sbin")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    rank = max(1, min(len(xs), int(-(-q * len(xs) // 100))))
    return xs[rank - 1]


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def make_work_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="tidegate-bench."))


def start_nginx(ctx: Ctx, name: str, body: str, workers: int = 2) -> tuple[subprocess.Popen, Path]:
    """Starts nginx in the foreground with `body` (the events and http
    blocks); returns the process and its config file (for reloads)."""
    conf = ctx.work / f"{name}.conf"
    conf.write_text(nginx_conf(ctx, name, body, workers))
    p = ctx.procs.start([which("nginx") or "nginx", "-c", str(conf), "-e", str(ctx.work / f"{name}.err")],
                        out=ctx.work / f"{name}.out")
    return p, conf


def nginx_conf(ctx: Ctx, name: str, body: str, workers: int = 2) -> str:
    return (f"worker_processes {workers}; daemon off; pid {ctx.work / (name + '.pid')};\n"
            f"error_log {ctx.work / (name + '.err')} warn;\n{body}\n")


def start_haproxy(ctx: Ctx, name: str, cfg: str) -> subprocess.Popen:
    path = ctx.work / f"{name}.cfg"
    path.write_text(cfg)
    return ctx.procs.start([which("haproxy") or "haproxy", "-f", str(path), "-db"], out=ctx.work / f"{name}.out")


def start_haproxy_proxy(ctx: Ctx, name: str, port: int, servers: list[str], threads: int = 2,
                        maxconn: int | None = None) -> subprocess.Popen:
    """HAProxy as the peers' HTTP reverse proxy: `threads` threads,
    keep-alive to the clients and `http-reuse always` to `servers`
    (`HOST:PORT`, round robin), on 127.0.0.1:`port`."""
    limit = f"  maxconn {maxconn}\n" if maxconn else ""
    backends = "".join(f"  server s{i} {addr}\n" for i, addr in enumerate(servers))
    return start_haproxy(ctx, name, f"""global
  nbthread {threads}
{limit}defaults
  mode http
  timeout connect 5s
  timeout client 30s
  timeout server 30s
  option http-keep-alive
  http-reuse always
frontend fe
  bind 127.0.0.1:{port}
  default_backend app
backend app
  balance roundrobin
{backends}""")


def haproxy_command(sock: Path, command: str, timeout: float = 5.0) -> str:
    """One runtime API command over the stats socket; returns the answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(sock))
        s.sendall(command.encode() + b"\n")
        chunks = []
        while True:
            data = s.recv(65536)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


def wait_http(addr: str, path: str = "/", timeout: float = 10.0, want=(200,)) -> None:
    deadline = time.monotonic() + timeout
    status = 0
    while time.monotonic() < deadline:
        status, _, _ = http_get(addr, path, timeout=1)
        if status in want:
            return
        time.sleep(0.05)
    raise RuntimeError(f"http://{addr}{path} did not answer {want} within {timeout}s (last {status})")

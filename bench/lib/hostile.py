"""Hostile load (issues 9 and 35): normal open-loop traffic through a proxy
to one service of small capacity, first alone (quiet), then while attackers
on the same machine run for the whole window, then a shorter window with
only the slow uploads. Tidegate runs with its defaults and per-client caps
on requests and connections; the slow uploads also run against Tidegate with
the old behaviour (every body streamed at once, no pace: the control) and
against nginx with its default request buffering.

The normal traffic comes from `normal_sources` addresses (127.0.1.1 and
the ones after it, in turn: `tidegate-bench traffic --sources`), as many
users would, so that per-client caps and the fair queue count each user
alone. Attackers (each kind from its own loopback address; loopback
accepts any source in 127.0.0.0/8):
- issue 9's mix: slowloris (headers trickled), silent connections, header
  floods (100 KiB of headers), smuggling attempts (CL+TE, duplicate
  Content-Length), garbage bytes, 64 KiB bodies trickled 2 bytes every 3 s;
- HTTP/1.1 slow uploads: `POST` with `Content-Length: 1000000`, one byte
  every 5 s, one connection each (issue 35's probe);
- HTTP/2 slow uploads: one cleartext HTTP/2 connection (prior knowledge)
  with many POST streams of declared length 1,000,000, a byte on each every
  5 s; a stream that is answered or reset is replaced at the next byte;
- zero-window HTTP/2 readers: connections with SETTINGS_INITIAL_WINDOW_SIZE
  0 that open streams for responses they never take, PINGs answered; each
  reader opens `zero_window_tries` connections in the window at most (a
  bounded attacker: after the proxy cuts one at its write timeout, it
  may come back that many times);
- a per-client flood: many keep-alive connections from one address, each
  sending the next request as soon as the last is answered (after a 429,
  0.1 s later); in a window of its own, to a path the backend holds for a
  while (`?delay_ms=`), so that the flood takes the backend's capacity.

Reports, per window: the normal traffic's answers and latency, the proxy's
largest resident memory, the most requests in flight to the backend and
waiting in Tidegate's queue, the backend's most open connections, and what
each attacker was answered. Everything on 127.0.0.0/8; every attacker is
bounded in count and stops by itself at the end of its window.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import threading
import time

from harness import (Ctx, bench_async, free_port, log, pin_split, read_json_output, start_emulator, start_nginx,
                     start_tidegate, stop_tidegate, wait_http, wait_port)

# Where each attacker connects from. The normal traffic comes from
# NORMAL_FROM and the addresses after it (`normal_sources` of them).
NORMAL_FROM = "127.0.1.1"
SOURCES = {
    "mix": "127.0.0.6",
    "slow_upload_h1": "127.0.0.3",
    "slow_upload_h2": "127.0.0.4",
    "zero_window_h2": "127.0.0.5",
    "flood": "127.0.0.2",
}
UPLOAD_SIZE = 1_000_000
UPLOAD_PAUSE_S = 5.0


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_rss_kib(pid: int) -> int:
    """The resident memory of a process and its children (nginx's master
    and workers)."""
    total = rss_kib(pid)
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                total += sum(rss_kib(int(c)) for c in f.read().split())
    except OSError:
        pass
    return total


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) of a process and its children."""
    def one(p: int) -> float:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return 0.0
    total = one(pid)
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                total += sum(one(int(c)) for c in f.read().split())
    except OSError:
        pass
    return total


class Attack:
    """One kind of attacker: `workers` threads, each repeating `once` until
    the deadline (or `tries` times, when given); counts what came back.
    `opts` are the attacker's own parameters."""

    def __init__(self, name: str, addr: tuple[str, int], deadline: float, workers: int, once, pace: float,
                 src: str = "127.0.0.1", tries: int | None = None, **opts) -> None:
        self.name, self.addr, self.deadline, self.once, self.pace = name, addr, deadline, once, pace
        self.src, self.tries, self.opts = src, tries, opts
        self.answers: dict[str, int] = {}
        self.held: list[float] = []  # zero-window connections: seconds until the proxy closed them
        self.lock = threading.Lock()
        self.local = threading.local()
        self.threads = [threading.Thread(target=self.loop, daemon=True) for _ in range(workers)]

    def count(self, what: str, n: int = 1) -> None:
        if n:
            with self.lock:
                self.answers[what] = self.answers.get(what, 0) + n

    def loop(self) -> None:
        tried = 0
        while time.monotonic() < self.deadline and (self.tries is None or tried < self.tries):
            tried += 1
            t0 = time.monotonic()
            try:
                self.count(self.once(self))
            except Exception as e:  # noqa: BLE001 (an attacker counts whatever ends its try)
                self.count(type(e).__name__)
            # A try that ended at once (refused, 429) waits a little, so
            # that no attacker spins on the shared cores.
            pause = self.pace or (0.2 if time.monotonic() - t0 < 0.2 else 0.0)
            time.sleep(min(pause, max(0.0, self.deadline - time.monotonic())))

    def connect(self, timeout: float = 5.0, addr: tuple[str, int] | None = None) -> socket.socket:
        s = socket.create_connection(addr or self.addr, timeout=timeout, source_address=(self.src, 0))
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


def slow_upload_h1(a: Attack) -> str:
    """Issue 35's probe: a 1,000,000-byte upload, one byte every 5 s."""
    s = a.connect()
    try:
        s.sendall(f"POST /upload HTTP/1.1\r\nhost: bench\r\ncontent-length: {UPLOAD_SIZE}\r\n\r\n".encode())
        while (now := time.monotonic()) < a.deadline:
            s.settimeout(max(0.01, min(UPLOAD_PAUSE_S, a.deadline - now)))
            try:
                data = s.recv(64)
            except socket.timeout:
                if time.monotonic() < a.deadline:
                    s.sendall(b"x")
                continue
            if not data:
                return "closed by proxy"
            parts = data.split(b" ", 2)
            return parts[1].decode(errors="replace") if data.startswith(b"HTTP/") and len(parts) > 1 else "garbage"
        return "held to the end"
    except OSError:
        return "closed by proxy"
    finally:
        s.close()


class H2Conn:
    """A cleartext HTTP/2 connection (prior knowledge) driven frame by
    frame with the `h2` package; PINGs are answered by `h2` itself."""

    def __init__(self, a: Attack, window: int | None = None) -> None:
        import h2.config
        import h2.connection
        import h2.settings
        self.sock = a.connect(addr=a.opts.get("h2_addr"))
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        if window is not None:
            codes = h2.settings.SettingCodes
            self.conn.local_settings = h2.settings.Settings(client=True, initial_values={
                codes.INITIAL_WINDOW_SIZE: window, codes.MAX_CONCURRENT_STREAMS: 100})
        self.conn.initiate_connection()
        self.flush()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def request(self, method: str, path: str, headers: tuple = ()) -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(":method", method), (":scheme", "http"), (":authority", "bench"),
                                     (":path", path), *headers], end_stream=method == "GET")
        return sid

    def events(self, timeout: float) -> list | None:
        """The events that arrive within `timeout` s (none: []); None when
        the proxy closed the connection."""
        self.sock.settimeout(max(0.01, timeout))
        try:
            data = self.sock.recv(65536)
        except socket.timeout:
            return []
        if not data:
            return None
        import h2.exceptions
        try:
            events = self.conn.receive_data(data)
            self.flush()
        except h2.exceptions.ProtocolError:
            # Frames after the proxy's GOAWAY (a PING sent with it, which
            # RFC 9113 allows), which the h2 package refuses: the proxy is
            # closing the connection.
            return None
        return events

    def close(self) -> None:
        self.sock.close()


def slow_upload_h2(a: Attack) -> str:
    """One HTTP/2 connection with `streams` uploads of 1,000,000 bytes, a
    byte on each every 5 s; an answered or reset stream is replaced at the
    next byte. Each stream's end is counted (`stream ...`)."""
    import h2.events
    import h2.exceptions
    c = H2Conn(a)
    live: set[int] = set()

    def top_up() -> None:
        while len(live) < a.opts["streams"]:
            live.add(c.request("POST", "/upload", (("content-length", str(UPLOAD_SIZE)),)))
        c.flush()

    try:
        top_up()
        tick = time.monotonic() + UPLOAD_PAUSE_S
        while (now := time.monotonic()) < a.deadline:
            events = c.events(min(tick, a.deadline) - now)
            if events is None:
                return "closed by proxy"
            for ev in events:
                if isinstance(ev, h2.events.ResponseReceived) and ev.stream_id in live:
                    a.count("stream " + dict(ev.headers).get(":status", "?"))
                    live.discard(ev.stream_id)
                    try:
                        c.conn.reset_stream(ev.stream_id)
                    except h2.exceptions.H2Error:
                        pass
                elif isinstance(ev, h2.events.StreamReset) and ev.stream_id in live:
                    a.count("stream reset by proxy")
                    live.discard(ev.stream_id)
                elif isinstance(ev, h2.events.ConnectionTerminated):
                    return "GOAWAY from proxy"
            if time.monotonic() >= tick and time.monotonic() < a.deadline:
                for sid in list(live):
                    try:
                        c.conn.send_data(sid, b"x")
                    except h2.exceptions.H2Error:
                        live.discard(sid)
                top_up()
                tick += UPLOAD_PAUSE_S
            c.flush()
        return "held to the end"
    except OSError:
        return "closed by proxy"
    finally:
        a.count("stream held to the end", len(live))
        c.close()


def zero_window_h2(a: Attack) -> str:
    """An HTTP/2 connection whose stream window is 0: `streams` GETs whose
    answers it never takes; it answers PINGs. The seconds until the proxy
    closes it are kept in `a.held`."""
    import h2.events
    c = H2Conn(a, window=0)
    opened = time.monotonic()
    try:
        for _ in range(a.opts["streams"]):
            c.request("GET", a.opts["path"])
        c.flush()
        while (now := time.monotonic()) < a.deadline:
            events = c.events(a.deadline - now)
            if events is None or any(isinstance(ev, h2.events.ConnectionTerminated) for ev in events):
                a.held.append(round(time.monotonic() - opened, 1))
                return "closed by proxy" if events is None else "GOAWAY from proxy"
            for ev in events:
                if isinstance(ev, h2.events.ResponseReceived):
                    a.count("stream head " + dict(ev.headers).get(":status", "?"))
                elif isinstance(ev, h2.events.StreamReset):
                    a.count("stream reset by proxy")
                elif isinstance(ev, h2.events.StreamEnded):
                    a.count("stream ended")
        return "held to the end"
    except OSError:
        a.held.append(round(time.monotonic() - opened, 1))
        return "closed by proxy"
    finally:
        c.close()


def flood(a: Attack) -> str:
    """One request of the flood on this worker's keep-alive connection."""
    conn = getattr(a.local, "conn", None)
    if conn is None:
        conn = a.local.conn = http.client.HTTPConnection(*a.addr, timeout=10, source_address=(a.src, 0))
    try:
        conn.request("GET", a.opts["path"], headers={"Host": "bench"})
        r = conn.getresponse()
        r.read()
        if r.status == 429:
            time.sleep(0.1)  # refused: try again soon, as a greedy client would
        if r.will_close:
            conn.close()
            a.local.conn = None
        return str(r.status)
    except (OSError, http.client.HTTPException) as e:
        conn.close()
        a.local.conn = None
        return type(e).__name__


# Issue 9's mix: name: (function, threads, pause between tries in seconds).
# The floods are paced (about 100 tries a second each): the point is
# hostile requests next to normal ones, not a bandwidth flood that only
# measures who gets the CPU of a 2-core machine.
MIX = {
    "slowloris": (slowloris, 200, 0.0),
    "silent": (silent, 200, 0.0),
    "header_flood": (header_flood, 2, 0.02),
    "smuggling": (smuggle, 2, 0.02),
    "garbage": (garbage, 2, 0.02),
    "slow_body": (slow_body, 50, 0.0),
}


def attackers(kind: str, p: dict, addr: tuple[str, int], h2_addr: tuple[str, int], deadline: float) -> list[Attack]:
    """The attackers of a window: `all` (issue 9's mix and issue 35's
    four), `uploads` (the HTTP/1.1 and HTTP/2 slow uploads) or
    `slow_flood` (the flood, to a path the backend holds for a while)."""
    if kind == "slow_flood":
        return [Attack("slow_flood", addr, deadline, p["flood_workers"], flood, 0.001, SOURCES["flood"],
                       path=f"/flood?delay_ms={p['slow_flood_delay_ms']}")]
    out = []
    if kind == "all":
        for name, (fn, workers, pace) in MIX.items():
            out.append(Attack(name, addr, deadline, max(1, int(workers * p["attackers_scale"])), fn, pace,
                              SOURCES["mix"]))
    out.append(Attack("slow_upload_h1", addr, deadline, p["uploads_h1"], slow_upload_h1, 0.2,
                      SOURCES["slow_upload_h1"]))
    out.append(Attack("slow_upload_h2", addr, deadline, 1, slow_upload_h2, 0.2, SOURCES["slow_upload_h2"],
                      streams=p["uploads_h2_streams"], h2_addr=h2_addr))
    if kind == "all":
        out.append(Attack("zero_window_h2", addr, deadline, p["zero_window_conns"], zero_window_h2, 0.5,
                          SOURCES["zero_window_h2"], tries=p["zero_window_tries"], streams=p["zero_window_streams"],
                          path="/bulk"))
        out.append(Attack("flood", addr, deadline, p["flood_workers"], flood, 0.001, SOURCES["flood"], path="/flood"))
    return out


class Sampler(threading.Thread):
    """Every 0.5 s: the proxy's resident memory, the backend's open
    connections (the emulator's stats) and, for Tidegate, the service's
    requests in flight and queued, the backend's learned limit and the
    requests in flight to the large-response service."""

    def __init__(self, rss, emu: str, admin=None) -> None:
        super().__init__(daemon=True)
        self.rss, self.emu, self.admin = rss, emu, admin
        self.samples: list[dict] = []
        self.done = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        from harness import http_get
        while not self.done.is_set():
            x = {"t": round(time.monotonic() - self.t0, 1), "rss_kib": self.rss()}
            status, _, body = http_get(self.emu, "/_emulator/stats", timeout=1)
            if status == 200:
                x["backend_conns"] = json.loads(body).get("connections_open")
            if self.admin is not None:
                try:
                    services = self.admin.call("GET", "/v1/status")["services"]
                    svc = services["app"]
                    x.update(in_flight=svc["in_flight"], queued=svc["queued"],
                             queued_clients=svc.get("queued_clients"), displaced=svc.get("queue_displaced"),
                             limit=svc["backends"][0].get("concurrency_limit"),
                             bulk_in_flight=services.get("bulk", {}).get("in_flight"))
                except (OSError, RuntimeError, KeyError, IndexError, ValueError):
                    pass
            self.samples.append(x)
            self.done.wait(0.5)

    def peak(self, key: str):
        values = [x[key] for x in self.samples if x.get(key) is not None]
        return max(values) if values else None

    def low(self, key: str):
        values = [x[key] for x in self.samples if x.get(key) is not None]
        return min(values) if values else None

    def growth(self, key: str):
        """How much a counter grew over the window (None without samples)."""
        values = [x[key] for x in self.samples if x.get(key) is not None]
        return values[-1] - values[0] if values else None


def window(ctx: Ctx, label: str, proxy: str, kind: str | None, p: dict, duration: float, rss, emu: str,
           admin=None, h2_proxy: str | None = None, only: list[str] | None = None, cpu=None) -> dict:
    """One window: normal traffic for `duration` s, with the attackers of
    `kind` (None: alone), only those named in `only` when given. `cpu`:
    the proxy's CPU seconds so far (its use in the window is reported, with
    this process's own: the attackers')."""
    out = ctx.work / f"hostile-{label}.json"
    cpu0, own0 = (cpu() if cpu else None), time.process_time()
    host, port = proxy.rsplit(":", 1)
    h2_host, h2_port = (h2_proxy or proxy).rsplit(":", 1)
    sampler = Sampler(rss, emu, admin)
    sampler.start()
    traffic = bench_async(ctx, ["traffic", "--rate", str(p["rate"]), "--duration-s", str(duration), "--path", "/",
                                "--sources", str(p["normal_sources"]), "--source-from", NORMAL_FROM],
                          out, proxy=proxy, threads=1)
    attacks = []
    if kind:
        attacks = attackers(kind, p, (host, int(port)), (h2_host, int(h2_port)), time.monotonic() + duration)
        if only is not None:
            attacks = [a for a in attacks if a.name in only]
        for a in attacks:
            for t in a.threads:
                t.start()
    while traffic.poll() is None:
        time.sleep(0.2)
    for a in attacks:
        for t in a.threads:
            t.join(timeout=10)
    sampler.done.set()
    sampler.join(timeout=5)
    proxy_cpu = round(cpu() - cpu0, 2) if cpu else None
    own_cpu = round(time.process_time() - own0, 2)
    r = read_json_output(out)
    lat = r.get("latency_us", {})
    res = {
        "attackers": kind or "none", **({"only": only} if only is not None else {}), "duration_s": duration,
        "pinned": ctx.procs.cpus is not None, "proxy_cpu_s": proxy_cpu, "attackers_cpu_s": own_cpu,
        "sent": (r.get("sending") or {}).get("sent"),
        "ok": r.get("ok"), "non_200": r.get("non_200"), "errors": r.get("error_total"),
        "statuses": r.get("statuses"), "error_kinds": r.get("errors"),
        "p50_us": lat.get("p50"), "p99_us": lat.get("p99"), "max_us": lat.get("max"),
        "rss_peak_kib": sampler.peak("rss_kib"), "backend_conns_peak": sampler.peak("backend_conns"),
        "in_flight_peak": sampler.peak("in_flight"), "queued_peak": sampler.peak("queued"),
        "queued_clients_peak": sampler.peak("queued_clients"), "queue_displaced": sampler.growth("displaced"),
        "bulk_in_flight_peak": sampler.peak("bulk_in_flight"),
        "learned_limit_low": sampler.low("limit"),
        "attacks": {a.name: a.answers for a in attacks},
        "zero_window_closed_after_s": [s for a in attacks for s in a.held],
        "samples": sampler.samples,
    }
    log(f"  {label:16}: ok {res['ok']} non-200 {res['non_200']} errors {res['errors']} p50 {res['p50_us']} us "
        f"p99 {res['p99_us']} us, RSS peak {(res['rss_peak_kib'] or 0) / 1024:.1f} MiB, backend conns peak "
        f"{res['backend_conns_peak']}, in flight peak {res['in_flight_peak']}, queued peak {res['queued_peak']} "
        f"(clients {res['queued_clients_peak']}, displaced {res['queue_displaced']}), CPU s proxy {proxy_cpu} "
        f"attackers {own_cpu}")
    for a in attacks:
        log(f"    {a.name:15} {a.answers}" + (f" closed after {a.held} s" if a.held else ""))
    return res


def settle(emu: str, admin=None, timeout: float = 20.0) -> None:
    """Waits (bounded) until the last window's attackers are gone: nothing
    in flight to the backend, nothing queued."""
    from harness import http_get
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = 0
        status, _, body = http_get(emu, "/_emulator/stats", timeout=1)
        if status == 200:
            busy += json.loads(body).get("in_flight", 0)
        if admin is not None:
            try:
                svc = admin.call("GET", "/v1/status")["services"]["app"]
                busy += svc["in_flight"] + svc["queued"]
            except (OSError, RuntimeError, KeyError):
                busy += 1
        if busy == 0:
            return
        time.sleep(0.2)
    log("  (the backend was still busy after the window; going on)")


def client_caps(p: dict) -> list[str]:
    """The per-client flags of the scenario's capped Tidegate: requests in
    progress, connections and request rate per client address, and the
    wait of a refusal for the rate."""
    return ["--max-requests-per-client", str(p["per_client_cap"]),
            "--max-connections-per-client", str(p["per_client_conns"]),
            "--max-request-rate-per-client", str(p["per_client_rate"]),
            "--request-rate-tarpit-ms", str(p["per_client_tarpit_ms"])]


def tidegate_up(ctx: Ctx, name: str, args: list[str], emu: str, big: str, max_conns: int):
    """Tidegate with `args`, the service `app` (one backend, the default
    policy, `max_conns`) at `/`, and `bulk` (the large-response backend)
    at `/bulk`."""
    from harness import Admin
    tg = start_tidegate(ctx, name, args=args)
    for svc, backend, prefix in (("app", emu, "/"), ("bulk", big, "/bulk")):
        tg.admin.call("PUT", f"/v1/services/{svc}",
                      {"backends": [{"id": "a", "addr": backend, "max_conns": max_conns}]})
        tg.admin.call("PUT", f"/v1/routes/{svc}", {"match": {"path_prefix": prefix}, "service": svc})
    wait_http(tg.proxy, "/")
    return tg, Admin(tg.admin_addr)


def nginx_up(ctx: Ctx, emu: str, max_conns: int):
    """nginx with its default request buffering (`client_max_body_size`
    2m, headroom over the 1,000,000-byte uploads: its default 1m is
    1,048,576 bytes), upstream
    keepalive, the same connection cap on the backend, and a second
    listener that speaks cleartext HTTP/2 (prior knowledge) for the HTTP/2
    uploads."""
    port, h2_port = free_port(), free_port()
    proc, _ = start_nginx(ctx, "nginx-hostile", f"""events {{ worker_connections 4096; }}
http {{ access_log off;
  client_max_body_size 2m;
  upstream app {{ server {emu} max_conns={max_conns}; keepalive 64; }}
  server {{ listen 127.0.0.1:{port}; listen 127.0.0.1:{h2_port} http2;
    location / {{ proxy_pass http://app; proxy_http_version 1.1; proxy_set_header Connection ""; }} }} }}""")
    wait_port(port)
    wait_port(h2_port)
    wait_http(f"127.0.0.1:{port}", "/")
    return proc, f"127.0.0.1:{port}", f"127.0.0.1:{h2_port}"


def run(ctx: Ctx, p: dict) -> dict:
    """The windows, in order: Tidegate (defaults and the per-client caps
    and rate)
    quiet, under every attacker, under the slow uploads alone, under a
    flood whose requests each hold the backend `slow_flood_delay_ms`;
    Tidegate with its defaults alone (no cap) under the slow uploads; Tidegate
    with the old behaviour (`--request-buffer-bytes 0 --min-upload-rate 0`,
    no cap) under the slow uploads (the control); nginx quiet and under
    the slow uploads. With `ctx.pin` (`scripts/bench --pin`), every window
    runs with the attackers on a CPU of their own (`pin_split`)."""
    with pin_split(ctx):
        return {**run_windows(ctx, p), "pinned": ctx.pin}


def run_windows(ctx: Ctx, p: dict) -> dict:
    _, emu = start_emulator(ctx, "app")
    # The zero-window readers need answers larger than what the proxy and
    # the sockets buffer (the emulator serves one body size, so they get
    # their own backend, `/bulk`).
    _, big = start_emulator(ctx, "bulk", "--body-size", str(p["bulk_body_bytes"]))
    runs = {}
    tg, sampler_admin = tidegate_up(ctx, "hostile", client_caps(p), emu, big, p["max_conns"])
    try:
        rss, cpu = (lambda: rss_kib(tg.proc.pid)), (lambda: tree_cpu_s(tg.proc.pid))  # noqa: E731
        runs["quiet"] = window(ctx, "quiet", tg.proxy, None, p, p["duration"], rss, emu, sampler_admin, cpu=cpu)
        runs["hostile"] = window(ctx, "hostile", tg.proxy, "all", p, p["hostile_duration"], rss, emu, sampler_admin,
                                 cpu=cpu)
        settle(emu, sampler_admin)
        runs["uploads"] = window(ctx, "uploads", tg.proxy, "uploads", p, p["side_duration"], rss, emu,
                                 sampler_admin, cpu=cpu)
        settle(emu, sampler_admin)
        runs["slow_flood"] = window(ctx, "slow flood", tg.proxy, "slow_flood", p, p["side_duration"], rss, emu,
                                    sampler_admin, cpu=cpu)
    finally:
        sampler_admin.close()
        stop_tidegate(ctx, tg)
    # The same slow uploads against Tidegate's defaults alone (no
    # per-client cap).
    tg, sampler_admin = tidegate_up(ctx, "hostile-defaults", [], emu, big, p["max_conns"])
    try:
        rss, cpu = (lambda: rss_kib(tg.proc.pid)), (lambda: tree_cpu_s(tg.proc.pid))  # noqa: E731
        runs["uploads_no_cap"] = window(ctx, "uploads, no cap", tg.proxy, "uploads", p, p["side_duration"], rss,
                                        emu, sampler_admin, cpu=cpu)
    finally:
        sampler_admin.close()
        stop_tidegate(ctx, tg)
    old = ["--request-buffer-bytes", "0", "--min-upload-rate", "0"]
    tg, sampler_admin = tidegate_up(ctx, "hostile-control", old, emu, big, p["max_conns"])
    try:
        rss, cpu = (lambda: rss_kib(tg.proc.pid)), (lambda: tree_cpu_s(tg.proc.pid))  # noqa: E731
        runs["control_uploads"] = window(ctx, "control uploads", tg.proxy, "uploads", p, p["side_duration"], rss,
                                         emu, sampler_admin, cpu=cpu)
    finally:
        sampler_admin.close()
        stop_tidegate(ctx, tg)
    settle(emu)
    nginx, proxy, h2_proxy = nginx_up(ctx, emu, p["max_conns"])
    try:
        rss, cpu = (lambda: tree_rss_kib(nginx.pid)), (lambda: tree_cpu_s(nginx.pid))  # noqa: E731
        runs["nginx_quiet"] = window(ctx, "nginx quiet", proxy, None, p, p["side_duration"], rss, emu, cpu=cpu)
        runs["nginx_uploads"] = window(ctx, "nginx uploads", proxy, "uploads", p, p["side_duration"], rss, emu,
                                       h2_proxy=h2_proxy, cpu=cpu)
    finally:
        ctx.procs.stop(nginx)
    return {"params": p, "runs": runs, "summary": summarize(runs, p), "goal": goals(runs, p)}


def failures(x: dict) -> int:
    return (x.get("non_200") or 0) + (x.get("errors") or 0)


def ratio(a: dict, b: dict) -> float | None:
    return round(a["p99_us"] / b["p99_us"], 2) if a.get("p99_us") and b.get("p99_us") else None


def summarize(runs: dict, p: dict) -> dict:
    q, h = runs["quiet"], runs["hostile"]
    return {
        "duration_s": p["duration"], "rate": p["rate"], "p99_ratio": ratio(h, q),
        "normal_failures_under_attack": failures(h),
        "rss_peak_mib": round((h["rss_peak_kib"] or 0) / 1024, 1),
        "windows": {name: {"failures": failures(runs[name]), "p99_us": runs[name]["p99_us"],
                           "p99_ratio": ratio(runs[name], runs[base])}
                    for name, base in (("uploads", "quiet"), ("slow_flood", "quiet"), ("uploads_no_cap", "quiet"),
                                       ("control_uploads", "quiet"), ("nginx_uploads", "nginx_quiet"))},
    }


def goals(runs: dict, p: dict) -> dict:
    """Issue 35's goals for Tidegate under every attacker: no failed normal
    request, p99 within 2x of the quiet run, memory bounded (the peak under
    attack at most the quiet peak plus the request-buffer budget, 256 MiB)."""
    q, h = runs["quiet"], runs["hostile"]
    r = ratio(h, q)
    return {"zero_errors": failures(h) == 0, "p99_within_2x": r is not None and r <= 2.0,
            "rss_bounded": (h["rss_peak_kib"] or 0) <= (q["rss_peak_kib"] or 0) + 256 * 1024,
            "uploads_zero_errors": failures(runs["uploads"]) == 0,
            "uploads_no_cap_zero_errors": failures(runs["uploads_no_cap"]) == 0,
            "control_starved": failures(runs["control_uploads"]) > 0}

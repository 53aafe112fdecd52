#!/usr/bin/env python3
"""The clients and the WebSocket backend of the upgrade scenario
(bench/lib/upgrade.py), in one asyncio process each, standard library
only:

    upgrade_load.py ws-echo --port P
        a WebSocket echo server (RFC 6455, framing written here): every
        text or binary message comes back as it was sent; pings get pongs;
        a close frame is answered and the connection closed.

    upgrade_load.py load --config JSON
        the load of one peer for `duration` seconds, every answer checked;
        prints one JSON object (see `Load.result`).

The load (each part off when its count or rate is 0):

- `ka_conns` keep-alive HTTP/1.1 connections, each sending `ka_rate` GETs
  per second (0: one after the other, closed loop), each answer checked:
  status 200 and the whole body equal to `body` (or one of `bodies`);
- new connections at `new_rate` per second (open loop), one GET each with
  `Connection: close`, checked the same way;
- one WebSocket at `ws_path` sending a numbered text message every
  `ws_interval_s` and checking that each comes back, in order; when it
  ends it is opened again, and every session's start, end and how it
  ended are recorded;
- `h2_conns` HTTP/2 connections over TLS (ALPN h2, the `h2` package),
  each sending `h2_rate` GETs per second with at most `h2_streams` in
  flight, each answer checked as above; a connection that gets a GOAWAY
  is replaced, and the requests above its last stream id are sent again
  (counted in `resent`);
- configuration changes at `change_rate` per second through Tidegate's
  admin API (`POST /v1/changes`, one new route each, on a new connection
  each), retried until acknowledged; each answer's revision is recorded so
  that the caller can check, after the run, that no acknowledged change is
  lost and none was applied twice.

Failures are counted by kind: `refused` (connection refused), `reset`
(connection reset or closed with no byte of an answer, on a new
connection), `timeout` (no whole answer within `timeout_s`), `bad_status`
(a status other than 200), `short_body` (the connection ended inside the
answer), `bad_body` (a whole answer with another body). A kept-alive
connection that the server closes between two requests, as the request
is sent and before any byte of its answer, is not a failure: the request
is sent again on a new connection and counted in `resent` (RFC 9112 9.3.1
lets a client repeat an idempotent request then, as browsers do; a
draining server closes idle keep-alive connections, and the client cannot
know that its next request crossed the close); one found closed before
the request is sent (the client saw the end of the stream) is counted in
`idle_closed` and the request goes on a new connection. Times are
`time.monotonic()` seconds (CLOCK_MONOTONIC, the same in every process of
the machine), so the caller can place each failure beside its upgrades.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import random
import signal
import struct
import sys
import time

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
KINDS = ("refused", "reset", "timeout", "bad_status", "short_body", "bad_body")


def ws_accept(key: bytes) -> bytes:
    return base64.b64encode(hashlib.sha1(key + WS_GUID).digest())


def ws_frame(opcode: int, payload: bytes, mask: bool) -> bytes:
    """One final frame; masked (as a client must) when `mask`."""
    head = bytes([0x80 | opcode])
    n = len(payload)
    m = 0x80 if mask else 0
    if n < 126:
        head += bytes([m | n])
    elif n < 65536:
        head += bytes([m | 126]) + struct.pack("!H", n)
    else:
        head += bytes([m | 127]) + struct.pack("!Q", n)
    if not mask:
        return head + payload
    key = os.urandom(4)
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


async def ws_read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """(opcode, payload) of the next frame, unmasked; raises
    asyncio.IncompleteReadError at the end of the stream."""
    b0, b1 = await reader.readexactly(2)
    n = b1 & 0x7F
    if n == 126:
        n = struct.unpack("!H", await reader.readexactly(2))[0]
    elif n == 127:
        n = struct.unpack("!Q", await reader.readexactly(8))[0]
    key = await reader.readexactly(4) if b1 & 0x80 else None
    payload = await reader.readexactly(n) if n else b""
    if key:
        payload = bytes(b ^ key[i % 4] for i, b in enumerate(payload))
    return b0 & 0x0F, payload


async def ws_echo_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        key = None
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"sec-websocket-key":
                key = value.strip()
        if key is None:
            writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await writer.drain()
            return
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"Sec-WebSocket-Accept: " + ws_accept(key) + b"\r\n\r\n")
        await writer.drain()
        while True:
            opcode, payload = await ws_read_frame(reader)
            if opcode == 8:
                writer.write(ws_frame(8, payload[:2], mask=False))
                await writer.drain()
                return
            if opcode == 9:
                writer.write(ws_frame(10, payload, mask=False))
            elif opcode in (1, 2):
                writer.write(ws_frame(opcode, payload, mask=False))
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
        pass
    finally:
        writer.close()


async def ws_echo(port: int) -> None:
    server = await asyncio.start_server(ws_echo_conn, "127.0.0.1", port, backlog=1024)
    print(f"ws-echo listening on 127.0.0.1:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


class Failure(Exception):
    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class Unanswered(Exception):
    """A kept-alive connection closed (or reset) before any byte of the
    answer."""


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bool, bytes]:
    """Reads one HTTP/1.1 answer with a Content-Length (what every peer
    sends for the emulator's answers; chunked is read too): (status,
    close, body). Raises Unanswered when the stream ends (or is reset)
    before any byte, Failure("short_body") when it ends inside."""
    try:
        first = await reader.readline()
    except (ConnectionResetError, BrokenPipeError):
        raise Unanswered()
    if not first:
        raise Unanswered()
    try:
        head = first + await reader.readuntil(b"\r\n\r\n")
        parts = first.split(b" ", 2)
        status = int(parts[1])
        length, chunked, close = None, False, False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value:
                chunked = True
            elif name == b"connection" and b"close" in value:
                close = True
        if chunked:
            body = b""
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    break
                body += await reader.readexactly(size + 2)
                body = body[:-2]
        elif length is not None:
            body = await reader.readexactly(length)
        else:
            body = await reader.read()
            close = True
        return status, close, body
    except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError) as e:
        raise Failure("short_body", type(e).__name__)
    except (ValueError, IndexError, asyncio.LimitOverrunError) as e:
        raise Failure("bad_status", f"unreadable head: {e}")


def connect_failure(e: BaseException) -> Failure:
    if isinstance(e, ConnectionRefusedError):
        return Failure("refused", str(e))
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
        return Failure("timeout", "connect")
    return Failure("reset", f"connect: {e!r}")


class Load:
    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.host, port = cfg["proxy"].rsplit(":", 1)
        self.port = int(port)
        self.bodies = {b.encode() for b in cfg.get("bodies") or [cfg["body"]]}
        self.timeout = cfg.get("timeout_s", 5.0)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + cfg["duration"]
        self.stopping = asyncio.Event()
        self.counts = {part: {"requests": 0, "ok": 0, "resent": 0, "idle_closed": 0, **{k: 0 for k in KINDS}}
                       for part in ("keep_alive", "new_conn", "h2")}
        self.h2_connections = 0
        self.h2_goaways = 0
        self.h2_closed_without_goaway = 0
        self.h2_ends: dict[str, int] = {}
        self.failures: list[dict] = []  # {"t", "part", "kind", "detail"}, the first 20,000
        self.ws_sessions: list[dict] = []
        self.changes: dict[str, dict] = {}
        self.change_counts = {"sent": 0, "acked": 0, "refused_503": 0, "refused_conn": 0, "ambiguous": 0,
                              "other_status": 0, "gave_up": 0, "attempts": 0}
        self.inflight_skipped = 0
        self.latency: dict[str, list[tuple[int, int]]] = {part: [] for part in self.counts}

    def done(self) -> bool:
        return self.stopping.is_set() or time.monotonic() >= self.deadline

    def fail(self, part: str, kind: str, detail: str = "") -> None:
        self.counts[part][kind] += 1
        if len(self.failures) < 20000:
            self.failures.append({"t": time.monotonic(), "part": part, "kind": kind, "detail": detail[:200]})

    def check(self, part: str, status: int, body: bytes, sent: float) -> None:
        if status == 200:
            # Latency from the request's first send (a resend included),
            # for requests answered 200, as (ms since t0, µs).
            now = time.monotonic()
            self.latency[part].append((int((sent - self.t0) * 1000), int((now - sent) * 1e6)))
        if status != 200:
            self.fail(part, "bad_status", f"{status}")
        elif body not in self.bodies:
            self.fail(part, "bad_body", repr(body[:60]))
        else:
            self.counts[part]["ok"] += 1

    async def keep_alive(self, i: int, rate: float) -> None:
        req = f"GET /ka/{i} HTTP/1.1\r\nHost: upgrade.bench\r\n\r\n".encode()
        reader = writer = None
        reused = False
        period = 1.0 / rate if rate > 0 else 0.0
        nxt = time.monotonic() + random.random() * period
        while not self.done():
            if period:
                delay = nxt - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                nxt = max(nxt + period, time.monotonic() - period)
                if self.done():
                    break
            self.counts["keep_alive"]["requests"] += 1
            sent = time.monotonic()
            while True:  # once, or again after an unanswered kept-alive close
                if writer is not None and (reader.at_eof() or reader.exception() is not None):
                    # Closed by the server while idle, seen before sending.
                    self.counts["keep_alive"]["idle_closed"] += 1
                    writer.close()
                    writer = None
                if writer is None:
                    try:
                        reader, writer = await asyncio.wait_for(
                            asyncio.open_connection(self.host, self.port), self.timeout)
                        reused = False
                    except (OSError, asyncio.TimeoutError) as e:
                        f = connect_failure(e)
                        self.fail("keep_alive", f.kind, f.detail)
                        await asyncio.sleep(0.01)
                        break
                try:
                    writer.write(req)
                    status, close, body = await asyncio.wait_for(read_answer(reader), self.timeout)
                except Unanswered:
                    writer.close()
                    writer = None
                    if reused:
                        self.counts["keep_alive"]["resent"] += 1
                        continue
                    self.fail("keep_alive", "reset", "closed with no answer on a new connection")
                    break
                except (ConnectionResetError, BrokenPipeError) as e:
                    writer.close()
                    writer = None
                    if reused:
                        self.counts["keep_alive"]["resent"] += 1
                        continue
                    self.fail("keep_alive", "reset", repr(e))
                    break
                except asyncio.TimeoutError:
                    writer.close()
                    writer = None
                    self.fail("keep_alive", "timeout")
                    break
                except Failure as f:
                    writer.close()
                    writer = None
                    self.fail("keep_alive", f.kind, f.detail)
                    break
                self.check("keep_alive", status, body, sent)
                reused = True
                if close:
                    writer.close()
                    writer = None
                break
        if writer is not None:
            writer.close()

    async def new_conn_one(self) -> None:
        self.counts["new_conn"]["requests"] += 1
        sent = time.monotonic()
        writer = None
        try:
            async def once():
                nonlocal writer
                try:
                    reader, writer = await asyncio.open_connection(self.host, self.port)
                except OSError as e:
                    raise connect_failure(e)
                writer.write(b"GET /new HTTP/1.1\r\nHost: upgrade.bench\r\nConnection: close\r\n\r\n")
                try:
                    return await read_answer(reader)
                except Unanswered:
                    raise Failure("reset", "closed with no answer")
                except (ConnectionResetError, BrokenPipeError) as e:
                    raise Failure("reset", repr(e))
            status, _, body = await asyncio.wait_for(once(), self.timeout)
            self.check("new_conn", status, body, sent)
        except asyncio.TimeoutError:
            self.fail("new_conn", "timeout")
        except Failure as f:
            self.fail("new_conn", f.kind, f.detail)
        finally:
            if writer is not None:
                writer.close()

    async def open_loop(self, rate: float, make, cap: int = 4000) -> None:
        """Starts `make()` `rate` times per second until the end; waits
        for the ones started."""
        tasks: set[asyncio.Task] = set()
        n = 0
        start = time.monotonic()
        while not self.done():
            due = start + n / rate
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
                continue
            n += 1
            if len(tasks) >= cap:
                self.inflight_skipped += 1
                continue
            t = asyncio.ensure_future(make())
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=self.timeout * 3 + 30)

    async def websocket(self, path: str, interval: float) -> None:
        while not self.done():
            session = {"start": time.monotonic(), "end": None, "how": None, "echoed": 0, "detail": ""}
            self.ws_sessions.append(session)
            writer = None
            try:
                try:
                    reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port),
                                                            self.timeout)
                except (OSError, asyncio.TimeoutError) as e:
                    raise Failure(connect_failure(e).kind, "connect")
                key = base64.b64encode(os.urandom(16))
                writer.write(f"GET {path} HTTP/1.1\r\nHost: upgrade.bench\r\nUpgrade: websocket\r\n"
                             f"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n".encode()
                             + b"Sec-WebSocket-Key: " + key + b"\r\n\r\n")
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.timeout)
                except asyncio.TimeoutError:
                    raise Failure("timeout", "handshake")
                except (asyncio.IncompleteReadError, ConnectionResetError) as e:
                    raise Failure("reset", f"handshake: {e!r}")
                status = int(head.split(b" ", 2)[1])
                if status != 101 or ws_accept(key) not in head:
                    raise Failure("bad_status", f"handshake answered {status}")
                session["opened"] = time.monotonic()
                seq = 0
                while not self.done():
                    seq += 1
                    msg = f"upgrade-bench {seq} ".encode() + b"x" * 64
                    writer.write(ws_frame(1, msg, mask=True))
                    try:
                        opcode, payload = await asyncio.wait_for(ws_read_frame(reader), self.timeout)
                    except asyncio.TimeoutError:
                        raise Failure("timeout", f"no echo of message {seq}")
                    except asyncio.IncompleteReadError:
                        raise Failure("eof", f"closed with message {seq} unanswered")
                    except (ConnectionResetError, BrokenPipeError) as e:
                        raise Failure("reset", repr(e))
                    if opcode == 8:
                        code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
                        raise Failure("close_frame", f"code {code}")
                    if payload != msg:
                        raise Failure("bad_echo", f"message {seq}: {payload[:40]!r}")
                    session["echoed"] += 1
                    await asyncio.sleep(interval)
                session["how"] = "open_at_end"
                if writer is not None:
                    writer.write(ws_frame(8, struct.pack("!H", 1000), mask=True))
            except Failure as f:
                session["how"] = f.kind
                session["detail"] = f.detail
            except (OSError, ValueError, IndexError) as e:
                session["how"] = "error"
                session["detail"] = repr(e)[:200]
            finally:
                session["end"] = time.monotonic()
                if writer is not None:
                    writer.close()
            if session["how"] not in ("open_at_end",):
                await asyncio.sleep(0.01)

    async def h2_client(self, i: int, rate: float, streams: int) -> None:
        """One HTTP/2 connection over TLS at a time, `rate` GETs per
        second with at most `streams` in flight; on a GOAWAY (or the end
        of the connection) a new one. A request the server never took (a
        stream above a GOAWAY's last stream id, or refused with
        REFUSED_STREAM) is sent again on the next connection and counted
        in `resent`, as RFC 9113 6.8 says it can safely be."""
        import ssl

        import h2.config
        import h2.connection
        import h2.events
        import h2.exceptions

        ctx = ssl.create_default_context(cafile=self.cfg["ca"])
        ctx.set_alpn_protocols(["h2"])
        host, port = self.cfg["tls"].rsplit(":", 1)
        period = 1.0 / rate
        nxt = time.monotonic() + random.random() * period
        backlog = 0  # requests to send again first
        while not self.done():
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, int(port), ssl=ctx, server_hostname=host), self.timeout)
            except (OSError, asyncio.TimeoutError, ssl.SSLError) as e:
                self.counts["h2"]["requests"] += 1
                f = connect_failure(e)
                self.fail("h2", f.kind, f.detail)
                await asyncio.sleep(0.05)
                continue
            self.h2_connections += 1
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
            conn.initiate_connection()
            writer.write(conn.data_to_send())
            inflight: dict[int, dict] = {}
            state = {"goaway": None, "closed": False}
            buf = bytearray()

            def finish(sid: int, kind: str | None, detail: str = "") -> None:
                st = inflight.pop(sid, None)
                if st is None:
                    return
                if kind is None:
                    self.check("h2", st["status"], st["body"], st["t"])
                else:
                    self.fail("h2", kind, detail)

            async def read_loop() -> None:
                while True:
                    try:
                        data = await reader.read(65536)
                    except (OSError, ssl.SSLError):
                        data = b""
                    if not data:
                        state["closed"] = True
                        state.setdefault("why", "eof" if state["goaway"] is None else "goaway, then eof")
                        if state["goaway"] is None:
                            self.h2_closed_without_goaway += 1
                        return
                    buf.extend(data)
                    feed = bytearray()
                    # GOAWAY frames are taken out and handled here: the h2
                    # package treats the connection as closed once it gets
                    # one and refuses the frames of the streams the server
                    # still finishes (and the PING of a graceful shutdown).
                    while len(buf) >= 9:
                        length = int.from_bytes(buf[0:3], "big")
                        if len(buf) < 9 + length:
                            break
                        frame = bytes(buf[:9 + length])
                        del buf[:9 + length]
                        if frame[3] == 0x7 and length >= 8:
                            last = int.from_bytes(frame[9:13], "big") & 0x7FFFFFFF
                            if state["goaway"] is None:
                                self.h2_goaways += 1
                            state["goaway"] = min(last, state["goaway"] if state["goaway"] is not None else last)
                            for sid in [x for x in inflight if x > state["goaway"]]:
                                inflight.pop(sid)
                                self.counts["h2"]["resent"] += 1
                                nonlocal_backlog[0] += 1
                        else:
                            feed.extend(frame)
                    try:
                        events = conn.receive_data(bytes(feed)) if feed else []
                    except h2.exceptions.ProtocolError as e:
                        state["closed"] = True
                        state["why"] = f"protocol error: {e}"[:120]
                        for sid in list(inflight):
                            finish(sid, "reset", f"protocol error: {e}")
                        return
                    for ev in events:
                        if isinstance(ev, h2.events.ResponseReceived):
                            st = inflight.get(ev.stream_id)
                            if st is not None:
                                st["status"] = int(dict(ev.headers).get(":status", "0"))
                        elif isinstance(ev, h2.events.DataReceived):
                            st = inflight.get(ev.stream_id)
                            if st is not None:
                                st["body"] += ev.data
                            conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                        elif isinstance(ev, h2.events.StreamEnded):
                            finish(ev.stream_id, None)
                        elif isinstance(ev, h2.events.StreamReset):
                            if ev.error_code == 7 and ev.stream_id in inflight:  # REFUSED_STREAM
                                inflight.pop(ev.stream_id)
                                self.counts["h2"]["resent"] += 1
                                nonlocal_backlog[0] += 1
                            else:
                                finish(ev.stream_id, "reset", f"RST_STREAM {ev.error_code}")
                        elif isinstance(ev, h2.events.ConnectionTerminated):  # not reached: taken out above
                            state["goaway"] = ev.last_stream_id or 0
                    out = conn.data_to_send()
                    if out:
                        writer.write(out)

            nonlocal_backlog = [backlog]
            rtask = asyncio.ensure_future(read_loop())
            try:
                while not self.done() and state["goaway"] is None and not state["closed"]:
                    if nonlocal_backlog[0] == 0:
                        delay = nxt - time.monotonic()
                        if delay > 0:
                            await asyncio.sleep(min(delay, 0.05))
                            continue
                        nxt = max(nxt + period, time.monotonic() - period)
                        self.counts["h2"]["requests"] += 1
                    else:
                        nonlocal_backlog[0] -= 1
                    if len(inflight) >= streams:  # sent when a stream is free
                        nonlocal_backlog[0] += 1
                        await asyncio.sleep(0.005)
                        continue
                    try:
                        sid = conn.get_next_available_stream_id()
                        conn.send_headers(sid, [(":method", "GET"), (":path", f"/h2/{i}"), (":scheme", "https"),
                                                (":authority", self.cfg["tls"])], end_stream=True)
                    except h2.exceptions.ProtocolError as e:
                        nonlocal_backlog[0] += 1
                        state.setdefault("why", f"send refused: {type(e).__name__}")
                        break
                    inflight[sid] = {"status": 0, "body": b"", "t": time.monotonic()}
                    writer.write(conn.data_to_send())
                    for sid2, st in list(inflight.items()):
                        if time.monotonic() - st["t"] > self.timeout:
                            finish(sid2, "timeout")
                # Wait for the streams in flight (those the server took).
                end = time.monotonic() + self.timeout
                while inflight and not state["closed"] and time.monotonic() < end:
                    await asyncio.sleep(0.01)
                for sid in list(inflight):
                    finish(sid, "short_body" if state["closed"] else "timeout",
                           "connection ended inside the answer" if state["closed"] else "")
            finally:
                why = state.get("why") or ("goaway" if state["goaway"] is not None else "end of run")
                self.h2_ends[why] = self.h2_ends.get(why, 0) + 1
                backlog = nonlocal_backlog[0]
                rtask.cancel()
                try:
                    conn.close_connection()
                    writer.write(conn.data_to_send())
                except (h2.exceptions.ProtocolError, OSError, RuntimeError):
                    pass
                writer.close()

    async def change_one(self, n: int) -> None:
        name = f"chg-{n}"
        rec = {"n": n, "sent": time.monotonic(), "revision": None, "attempts": 0, "ambiguous": False,
               "refused_503": 0, "acked": None}
        self.changes[name] = rec
        self.change_counts["sent"] += 1
        body = json.dumps({"ops": [{"op": "put_route", "name": name,
                                    "spec": {"match": {"path_prefix": f"/chg/{n}/"}, "service": "app"}}]}).encode()
        host, port = self.cfg["admin"].rsplit(":", 1)
        req = (f"POST /v1/changes HTTP/1.1\r\nHost: {self.cfg['admin']}\r\nAuthorization: Bearer {self.cfg['token']}"
               f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
               ).encode() + body
        give_up = time.monotonic() + self.cfg.get("change_give_up_s", 30)
        while time.monotonic() < give_up:
            rec["attempts"] += 1
            self.change_counts["attempts"] += 1
            writer = None
            sent = False
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), self.timeout)
                writer.write(req)
                sent = True
                status, _, text = await asyncio.wait_for(read_answer(reader), self.timeout * 2)
            except ConnectionRefusedError:
                self.change_counts["refused_conn"] += 1
                await asyncio.sleep(0.05)
                continue
            except (OSError, asyncio.TimeoutError, Unanswered, Failure) as e:
                # The change may or may not have been applied: sent again
                # (a second revision for the same route then, which the
                # caller's count allows for).
                if sent:
                    rec["ambiguous"] = True
                    self.change_counts["ambiguous"] += 1
                    why = ("timeout" if isinstance(e, asyncio.TimeoutError) else "closed unanswered"
                           if isinstance(e, Unanswered) else type(e).__name__)
                    key = f"ambiguous_{why}"
                    self.change_counts[key] = self.change_counts.get(key, 0) + 1
                await asyncio.sleep(0.05)
                continue
            finally:
                if writer is not None:
                    writer.close()
            if status == 200:
                try:
                    rec["revision"] = json.loads(text)["revision"]
                except (ValueError, KeyError, TypeError):
                    rec["revision"] = -1
                rec["acked"] = time.monotonic()
                self.change_counts["acked"] += 1
                return
            if status == 503:
                rec["refused_503"] += 1
                self.change_counts["refused_503"] += 1
                await asyncio.sleep(0.05)
                continue
            self.change_counts["other_status"] += 1
            rec["error"] = f"{status}: {text[:200]!r}"
            return
        self.change_counts["gave_up"] += 1

    async def run(self) -> dict:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        c = self.cfg
        tasks = [asyncio.ensure_future(self.keep_alive(i, c["ka_rate"])) for i in range(c.get("ka_conns", 0))]
        if c.get("new_rate"):
            tasks.append(asyncio.ensure_future(self.open_loop(c["new_rate"], self.new_conn_one)))
        if c.get("ws_path"):
            tasks.append(asyncio.ensure_future(self.websocket(c["ws_path"], c.get("ws_interval_s", 0.05))))
        for i in range(c.get("h2_conns", 0)):
            tasks.append(asyncio.ensure_future(self.h2_client(i, c["h2_rate"], c.get("h2_streams", 4))))
        if c.get("change_rate"):
            counter = iter(range(1, 1 << 40))
            tasks.append(asyncio.ensure_future(
                self.open_loop(c["change_rate"], lambda: self.change_one(next(counter)), cap=2000)))
        print("load started", flush=True)
        await asyncio.gather(*tasks)
        return self.result()

    def result(self) -> dict:
        return {"t0": self.t0, "t_end": time.monotonic(), "counts": self.counts, "failures": self.failures,
                "ws_sessions": self.ws_sessions, "changes": self.changes, "change_counts": self.change_counts,
                "inflight_skipped": self.inflight_skipped,
                "h2_connections": self.h2_connections, "h2_goaways": self.h2_goaways,
                "h2_closed_without_goaway": self.h2_closed_without_goaway, "h2_ends": self.h2_ends,
                "latency": self.latency}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("ws-echo")
    e.add_argument("--port", type=int, required=True)
    ld = sub.add_parser("load")
    ld.add_argument("--config", required=True, help="the load's settings, JSON")
    args = ap.parse_args()
    if args.cmd == "ws-echo":
        asyncio.run(ws_echo(args.port))
        return 0
    result = asyncio.run(Load(json.loads(args.config)).run())
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Traffic rules (issue 37): what a route's rule chain costs, against
nginx with the equivalent directives, same run, same backends.

One backend process (nginx, 2 workers, three ports) serves every proxy:
13 bytes at any path, a 20 KiB JSON document at `/json/data.json`, and at
`/echo` the request headers `X-A` and `X-B` and the path it got (to check,
before measuring, that both proxies did the same work). Tidegate and nginx
each get one process (2 workers) with the same routes:

- `/` without rules (the plain route);
- `/api/` with the typical chain of the issue: an IP allow list holding
  127.0.0.0/8, a rate limit by client address set far above the load,
  strip the prefix `/api`, set two request headers, set HSTS on the
  response. nginx: `allow 127.0.0.0/8; deny all;`, `limit_req` (a
  `$binary_remote_addr` zone at 1,000,000 r/s, `burst` 1,000,000,
  `nodelay`), `proxy_pass http://app/` (its cheapest prefix strip, no
  regex), `proxy_set_header` twice, `add_header Strict-Transport-Security
  ... always`;
- `/json/` with Tidegate's `compress` step (zstd, br, gzip) and nginx's
  `gzip on; gzip_types application/json; gzip_comp_level N` at the level
  Tidegate's gzip uses;
- `/limited/`: a rate limit of one key (`header:X-Key`, nginx
  `$http_x_key`) at `limit_rate` per second with a small burst;
- `/keys/`: a rate limit by `header:X-Key` that every request passes, for
  the flood of distinct keys.

Parts, each its own loop of wrk runs (`-t2`, closed loop), the variants of
a repetition in a rotating order, medians over repetitions:

1. requests/s at each `conns` for plain and rules on both proxies; each
   proxy's rules/plain fraction, and Tidegate's fraction over nginx's (the
   goal: at least 1), of the medians and within each repetition (the
   goal's reading is the median of the latter: a repetition's four runs
   are back to back, so the machine's drift between repetitions cancels);
2. requests/s at `compress_conns` for the JSON document sent as it is
   (no `Accept-Encoding`, both proxies), gzip (both), br and zstd (Tidegate
   only), and each answer's size;
3. one key offered far more than `limit_rate` for `limit_duration` seconds:
   the admitted rate (200s over wrk's elapsed time) against the configured
   rate; then `keys` requests each with its own `X-Key` value, the proxy's
   resident memory before, during (peak) and after.

A Tidegate part whose rule set the admin API refuses (a build from before
the data plane ran every step kind refused routes naming such steps with
409) is recorded as not run with the refusal, and nginx's side still runs. Everything on
127.0.0.1; every process is stopped by its pid.
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import json
import os
import random
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

from harness import TOKEN, Ctx, Procs, free_port, log, median, start_nginx, start_tidegate, stop_tidegate, wait_http, which
from hostile import rss_kib, tree_rss_kib

HSTS = "max-age=63072000"
# The typical chain of issue 37's goal; the rate limit never triggers.
TYPICAL_STEPS = [
    {"kind": "ip_allow", "cidrs": ["127.0.0.0/8"]},
    {"kind": "rate_limit", "key": "client_ip", "rate_per_s": 1000000, "burst": 1000000},
    {"kind": "strip_prefix", "prefix": "/api"},
    {"kind": "set_request_header", "name": "X-A", "value": "1"},
    {"kind": "set_request_header", "name": "X-B", "value": "2"},
    {"kind": "set_response_header", "name": "Strict-Transport-Security", "value": HSTS},
]
JSON_PATH = "/json/data.json"
JSON_BYTES = 20 * 1024
# The encodings of part 2: (variant, Accept-Encoding sent or None, proxies).
ENCODINGS = (("identity", None, ("tidegate", "nginx")), ("gzip", "gzip", ("tidegate", "nginx")),
             ("br", "br", ("tidegate",)), ("zstd", "zstd", ("tidegate",)))
HZ = os.sysconf("SC_CLK_TCK")

# wrk scripts. STATUS_LUA counts the answers by status across threads;
# KEYS_LUA also sends each request with its own X-Key value, each thread
# stops after its share of the requests and marks a file, and the
# harness then interrupts wrk (SIGINT: it prints its summary and exits).
STATUS_LUA = r"""
local threads = {}
function setup(thread) thread:set("id", #threads); table.insert(threads, thread) end
function init(args) st = {} end
function response(status, headers, body) st[status] = (st[status] or 0) + 1 end
function done(summary, latency, requests)
  local out = {}
  for _, t in ipairs(threads) do
    for k, v in pairs(t:get("st")) do out[k] = (out[k] or 0) + v end
  end
  for k, v in pairs(out) do io.write("STATUS ", k, " ", v, "\n") end
  io.write("DURATION_US ", summary.duration, "\n")
end
"""
KEYS_LUA = r"""
local threads = {}
function setup(thread) thread:set("id", #threads); table.insert(threads, thread) end
function init(args)
  st = {}; n = 0; answered = 0; limit = tonumber(args[1]); mark = args[2]; marked = false
end
function request()
  n = n + 1
  return wrk.format("GET", nil, {["X-Key"] = "key-" .. id .. "-" .. n})
end
function response(status, headers, body)
  st[status] = (st[status] or 0) + 1
  answered = answered + 1
  if answered >= limit and not marked then
    marked = true
    local f = io.open(mark .. "." .. id, "w"); f:write("done"); f:close()
    wrk.thread:stop()
  end
end
function done(summary, latency, requests)
  local out, sent = {}, 0
  for _, t in ipairs(threads) do
    for k, v in pairs(t:get("st")) do out[k] = (out[k] or 0) + v end
    sent = sent + t:get("n")
  end
  for k, v in pairs(out) do io.write("STATUS ", k, " ", v, "\n") end
  io.write("SENT ", sent, "\n")
  io.write("DURATION_US ", summary.duration, "\n")
end
"""


def json_document(size: int = JSON_BYTES) -> bytes:
    """A JSON array of user records, exactly `size` bytes, the same on
    every run (a fixed seed): what an API answers."""
    rng = random.Random(37)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    items, body = [], b""
    for i in range(10_000):
        items.append({"id": 100000 + i, "name": f"{rng.choice(words).title()} {rng.choice(words).title()}",
                      "email": f"user{rng.randrange(10**6)}@example.com", "active": rng.random() < 0.8,
                      "score": round(rng.uniform(0, 100), 2), "tags": rng.sample(words, 3),
                      "created": f"2026-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}T"
                                 f"{rng.randrange(24):02d}:{rng.randrange(60):02d}:00Z"})
        candidate = json.dumps({"items": items, "pad": ""}, separators=(",", ":")).encode()
        if len(candidate) > size:
            items.pop()
            break
        body = candidate
    pad = size - len(body)
    return json.dumps({"items": items, "pad": "x" * pad}, separators=(",", ":")).encode()


def family(pid: int) -> list[int]:
    """A process and its children (nginx's master and workers)."""
    pids = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return pids


def cpu_ticks(pid: int) -> int:
    total = 0
    for p in family(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total


def wrk_ms(v: str) -> float | None:
    m = re.match(r"([\d.]+)(us|ms|s)$", v)
    return round(float(m.group(1)) * {"us": 0.001, "ms": 1, "s": 1000}[m.group(2)], 3) if m else None


def parse_wrk(out: str) -> dict:
    """requests/s, requests, latency percentiles and errors from wrk's text."""
    lat = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 2 and f[0] in ("50%", "75%", "90%", "99%"):
            lat["p" + f[0][:-1] + "_ms"] = wrk_ms(f[1])
        if len(f) >= 2 and f[0] == "Latency" and "mean_ms" not in lat:
            lat["mean_ms"] = wrk_ms(f[1])
    rps = re.search(r"Requests/sec:\s*([\d.]+)", out)
    requests = re.search(r"(\d+) requests in", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    statuses = {m.group(1): int(m.group(2)) for m in re.finditer(r"^STATUS (\d+) (\d+)$", out, re.M)}
    dur = re.search(r"^DURATION_US (\d+)$", out, re.M)
    sent = re.search(r"^SENT (\d+)$", out, re.M)
    return {"rps": float(rps.group(1)) if rps else 0.0, "requests": int(requests.group(1)) if requests else 0,
            **lat, "non_2xx": int(non2xx.group(1)) if non2xx else 0,
            "socket_errors": sum(int(x) for x in sock.groups()) if sock else 0,
            "errors": (int(non2xx.group(1)) if non2xx else 0) + (sum(int(x) for x in sock.groups()) if sock else 0),
            **({"statuses": statuses} if statuses else {}),
            **({"elapsed_s": int(dur.group(1)) / 1e6} if dur else {}),
            **({"sent": int(sent.group(1))} if sent else {})}


def wrk(url: str, conns: int, duration: float, headers: dict | None = None, script: str | None = None,
        script_args: list[str] | None = None) -> str:
    argv = ["wrk", "-t2", f"-c{conns}", f"-d{duration}s", "--latency", "--timeout", "5s"]
    for k, v in (headers or {}).items():
        argv += ["-H", f"{k}: {v}"]
    if script:
        argv += ["-s", script]
    argv.append(url)
    if script_args:
        argv += ["--", *script_args]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60)
    if r.returncode != 0 or "requests in" not in r.stdout:
        raise RuntimeError(f"wrk {' '.join(argv[1:])} failed (exit {r.returncode}): {(r.stdout + r.stderr)[-1000:]}")
    return r.stdout


def fetch(addr: str, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("GET", path, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def post_json(addr: str, path: str, body: dict) -> tuple[int, dict]:
    """One admin API POST: (status, the answer's JSON)."""
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body),
                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        r = conn.getresponse()
        text = r.read()
    finally:
        conn.close()
    try:
        return r.status, json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return r.status, {"error": {"message": text[:300].decode(errors="replace")}}


def decode(encoding: str | None, body: bytes) -> bytes | None:
    """The body decoded, or None when no decoder is at hand (br and zstd:
    Python's `brotli` / `zstandard` modules, else the `brotli` / `zstd`
    command line tools)."""
    if encoding in (None, "identity"):
        return body
    if encoding == "gzip":
        return gzip.decompress(body)
    module, tool = {"br": ("brotli", "brotli"), "zstd": ("zstandard", "zstd")}.get(encoding, (None, None))
    if module is None:
        return None
    try:
        m = __import__(module)
        return m.decompress(body) if module == "brotli" else m.ZstdDecompressor().decompressobj().decompress(body)
    except ImportError:
        pass
    if which(tool):
        r = subprocess.run([tool, "-d", "-c"], input=body, capture_output=True, timeout=10)
        return r.stdout if r.returncode == 0 else None
    return None


class Setup:
    """The backend, Tidegate and nginx of the scenario, and which of
    Tidegate's rule routes the admin API took (the others: why not)."""

    def __init__(self, ctx: Ctx, p: dict) -> None:
        self.ctx, self.p = ctx, p
        www = ctx.work / "rules-www"
        (www / "json").mkdir(parents=True, exist_ok=True)
        self.document = json_document()
        (www / "json" / "data.json").write_bytes(self.document)
        # nginx's workers run as another user (nobody, when started as
        # root): let them reach the document through the private work dir.
        os.chmod(ctx.work, 0o711)
        for d in (www, www / "json"):
            os.chmod(d, 0o755)
        os.chmod(www / "json" / "data.json", 0o644)
        self.backends = [free_port() for _ in range(3)]
        listens = " ".join(f"listen 127.0.0.1:{b} reuseport;" for b in self.backends)
        self.backend, _ = start_nginx(ctx, "rules-backends", f"""events {{ worker_connections 8192; }}
http {{ access_log off; keepalive_requests 1000000; types {{ application/json json; }}
  server {{ {listens}
    location / {{ return 200 "hello world!\\n"; }}
    location /echo {{ return 200 "$http_x_a $http_x_b $uri\\n"; }}
    location /json/ {{ root {www}; }} }} }}""")
        self.nginx_port = free_port()
        upstream = " ".join(f"server 127.0.0.1:{b};" for b in self.backends)
        level, rate, burst = p["gzip_level"], p["limit_rate"], p["limit_burst"]
        self.nginx, _ = start_nginx(ctx, "rules-nginx", f"""events {{ worker_connections 16384; }}
http {{ access_log off; keepalive_requests 1000000;
  limit_req_zone $binary_remote_addr zone=typical:10m rate=1000000r/s;
  limit_req_zone $http_x_key zone=one:1m rate={rate}r/s;
  limit_req_zone $http_x_key zone=keys:64m rate=100r/s;
  limit_req_status 429;
  upstream app {{ {upstream} keepalive 256; }}
  server {{ listen 127.0.0.1:{self.nginx_port} reuseport;
    proxy_http_version 1.1; proxy_set_header Connection "";
    location / {{ proxy_pass http://app; }}
    location /api/ {{
      allow 127.0.0.0/8; deny all;
      limit_req zone=typical burst=1000000 nodelay;
      proxy_set_header Connection "";
      proxy_set_header X-A 1;
      proxy_set_header X-B 2;
      add_header Strict-Transport-Security "{HSTS}" always;
      proxy_pass http://app/; }}
    location /json/ {{
      gzip on; gzip_types application/json; gzip_comp_level {level}; gzip_min_length 1024;
      gzip_vary on; gzip_proxied any;
      proxy_pass http://app; }}
    location /limited/ {{ limit_req zone=one burst={burst} nodelay; proxy_pass http://app; }}
    location /keys/ {{ limit_req zone=keys burst=10 nodelay; proxy_pass http://app; }} }} }}""",
                                  workers=p["workers"])
        self.nginx_addr = f"127.0.0.1:{self.nginx_port}"
        self.tg = start_tidegate(ctx, "rules", workers=p["workers"])
        a = self.tg.admin
        a.call("PUT", "/v1/services/app", {"backends": [{"id": f"b{i + 1}", "addr": f"127.0.0.1:{b}"}
                                                        for i, b in enumerate(self.backends)]})
        a.call("PUT", "/v1/routes/plain", {"match": {"path_prefix": "/"}, "service": "app"})
        wait_http(f"127.0.0.1:{self.backends[0]}")
        wait_http(self.nginx_addr)
        wait_http(self.tg.proxy)
        compress = {"kind": "compress", "algorithms": ["zstd", "br", "gzip"]}
        if p.get("gzip_level_field"):
            compress[p["gzip_level_field"]] = level
        # Each rule route in its own change set: one refused (a step kind
        # not applied yet) leaves the others.
        self.refused: dict[str, str] = {}
        for name, prefix, steps in (
                ("typical", "/api", TYPICAL_STEPS),
                ("compress", "/json", [compress]),
                ("limited", "/limited", [{"kind": "rate_limit", "key": "header:X-Key", "rate_per_s": rate,
                                          "burst": burst}]),
                ("keys", "/keys", [{"kind": "rate_limit", "key": "header:X-Key", "rate_per_s": 100,
                                    "burst": 10}])):
            status, answer = post_json(self.tg.admin_addr, "/v1/changes", {"ops": [
                {"op": "put_rules", "name": name, "spec": {"steps": steps}},
                {"op": "put_route", "name": name,
                 "spec": {"match": {"path_prefix": prefix}, "service": "app", "rules": [name]}}]})
            if status != 200:
                why = f"HTTP {status}: " + str((answer.get("error") or {}).get("message") or answer)[:300]
                self.refused[name] = why
                log(f"  rules: Tidegate refused the rule set {name!r}: {why}")

    def stop(self) -> None:
        stop_tidegate(self.ctx, self.tg)
        for proc in (self.nginx, self.backend):
            self.ctx.procs.stop(proc)

    def addr(self, proxy: str) -> str:
        return self.tg.proxy if proxy == "tidegate" else self.nginx_addr

    def pid(self, proxy: str) -> int:
        return self.tg.proc.pid if proxy == "tidegate" else self.nginx.pid


@contextlib.contextmanager
def standalone(bin_dir: Path, prefix: str) -> Iterator[Setup]:
    """The scenario's setup for a script of its own (bench/json_relay.py,
    bench/rules_parts.py): the full profile's parameters, a fresh work
    directory, every process it started stopped at the end."""
    import scenarios  # (it imports this module: read when called)

    work = Path(tempfile.mkdtemp(prefix=prefix))
    ctx = Ctx(profile="full", bin_dir=bin_dir, out_dir=work, work=work, procs=Procs())
    s = Setup(ctx, dict(scenarios.PARAMS["rules"]["full"]))
    try:
        yield s
    finally:
        s.stop()
        for proc in ctx.procs.started:
            if proc.poll() is None:
                proc.kill()


def checks(s: Setup) -> dict:
    """What each proxy's rules route did to one request, before any load:
    the backend saw the stripped path and both headers, the client got
    HSTS; the plain route added nothing."""
    out = {}
    for proxy in ("tidegate", "nginx"):
        status, headers, body = fetch(s.addr(proxy), "/")
        out[f"{proxy}_plain"] = {"status": status, "hsts": headers.get("strict-transport-security"),
                                 "ok": status == 200 and "strict-transport-security" not in headers}
        if proxy == "tidegate" and "typical" in s.refused:
            continue
        status, headers, body = fetch(s.addr(proxy), "/api/echo")
        got = body.decode(errors="replace").strip()
        out[f"{proxy}_typical"] = {"status": status, "backend_saw": got, "hsts": headers.get("strict-transport-security"),
                                   "ok": status == 200 and got == "1 2 /echo" and headers.get(
                                       "strict-transport-security") == HSTS}
    return out


def sample_rss(pid: int, proc: subprocess.Popen) -> int:
    """The largest resident memory of `pid` (and children) while `proc` runs."""
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss_kib(pid))
        time.sleep(0.1)
    return max(peak, tree_rss_kib(pid))


def measured(s: Setup, proxy: str, url_path: str, conns: int, duration: float, headers: dict | None = None) -> dict:
    """One wrk run through `proxy`, with the proxy's CPU use and memory."""
    pid = s.pid(proxy)
    before = cpu_ticks(pid)
    out = wrk(f"http://{s.addr(proxy)}{url_path}", conns, duration, headers)
    ticks = cpu_ticks(pid) - before
    r = parse_wrk(out)
    r.update({"rss_kb": tree_rss_kib(pid), "cpu_cores": round(ticks / HZ / duration, 3),
              "cpu_us_per_req": round(ticks / HZ / max(r["requests"], 1) * 1e6, 2)})
    return r


def rotate(items: list, rep: int) -> list:
    """The variants of repetition `rep`: rotated by `rep`, every other
    repetition backwards (each variant runs early and late, after each
    other one)."""
    k = rep % len(items)
    order = items[k:] + items[:k]
    return order[::-1] if rep % 2 else order


def throughput_part(s: Setup, p: dict) -> tuple[list[dict], dict]:
    variants = [("tidegate", "plain", "/"), ("nginx", "plain", "/"), ("nginx", "rules", "/api/")]
    if "typical" not in s.refused:
        variants.insert(1, ("tidegate", "rules", "/api/"))
    runs = []
    for conns in [int(c) for c in str(p["conns"]).split()]:
        for rep in range(p["reps"]):
            for proxy, route, path in rotate(variants, rep):
                r = measured(s, proxy, path, conns, p["duration"])
                r.update({"part": "throughput", "proxy": proxy, "route": route, "conns": conns, "rep": rep})
                runs.append(r)
                log(f"  rules c={conns:<4} rep {rep} {proxy:8} {route:6} {r['rps']:10.0f} req/s  p99 "
                    f"{r.get('p99_ms') or 0:7.2f} ms  {r['cpu_us_per_req']:6.1f} us/req  errors {r['errors']}")
    summary = {}
    for conns in sorted({r["conns"] for r in runs}):
        at = [r for r in runs if r["conns"] == conns]
        row = {}
        for proxy in ("tidegate", "nginx"):
            for route in ("plain", "rules"):
                rs = [r for r in at if r["proxy"] == proxy and r["route"] == route]
                if rs:
                    row[f"{proxy}_{route}"] = {
                        "rps": median([r["rps"] for r in rs]), "p99_ms": median([r.get("p99_ms") for r in rs]),
                        "cpu_us_per_req": median([r["cpu_us_per_req"] for r in rs]),
                        "rss_mib": round(median([r["rss_kb"] for r in rs]) / 1024, 1),
                        "errors": sum(r["errors"] for r in rs), "reps": len(rs)}

        def fraction(proxy: str) -> tuple[float | None, float | None]:
            """rules/plain of the medians, and the median of each
            repetition's own rules/plain."""
            a, b = row.get(f"{proxy}_rules"), row.get(f"{proxy}_plain")
            of_medians = round(a["rps"] / b["rps"], 4) if a and b and b["rps"] else None
            plain = {r["rep"]: r["rps"] for r in at if r["proxy"] == proxy and r["route"] == "plain"}
            paired = median([r["rps"] / plain[r["rep"]] for r in at if r["proxy"] == proxy and r["route"] == "rules"
                             and plain.get(r["rep"])])
            return of_medians, (round(paired, 4) if paired is not None else None)

        tf, tp = fraction("tidegate")
        nf, np_ = fraction("nginx")
        row["tidegate_fraction"], row["tidegate_fraction_paired"] = tf, tp
        row["nginx_fraction"], row["nginx_fraction_paired"] = nf, np_
        row["fraction_ratio"] = round(tf / nf, 4) if tf and nf else None
        row["fraction_ratio_paired"] = round(tp / np_, 4) if tp and np_ else None
        # Per repetition, Tidegate's fraction over nginx's (the four runs
        # of a repetition are the closest in time: the machine's drift
        # between repetitions cancels), then the median: the goal's
        # reading.
        by = {(r["rep"], r["proxy"], r["route"]): r["rps"] for r in at}
        per_rep = [(by[(k, "tidegate", "rules")] / by[(k, "tidegate", "plain")])
                   / (by[(k, "nginx", "rules")] / by[(k, "nginx", "plain")])
                   for k in sorted({r["rep"] for r in at})
                   if all(by.get((k, x, y)) for x in ("tidegate", "nginx") for y in ("plain", "rules"))]
        row["fraction_ratio_per_rep"] = [round(v, 4) for v in per_rep]
        m = median(per_rep)
        row["fraction_ratio_rep_median"] = round(m, 4) if m is not None else None
        # The same from CPU time per request (plain's over rules': the
        # share of its rule-less throughput a CPU-bound proxy keeps), which
        # a shared machine's noise moves less than requests/s.
        for proxy in ("tidegate", "nginx"):
            a, b = row.get(f"{proxy}_rules"), row.get(f"{proxy}_plain")
            row[f"{proxy}_cpu_fraction"] = (round(b["cpu_us_per_req"] / a["cpu_us_per_req"], 4)
                                            if a and b and a["cpu_us_per_req"] else None)
        tc, nc = row["tidegate_cpu_fraction"], row["nginx_cpu_fraction"]
        row["cpu_fraction_ratio"] = round(tc / nc, 4) if tc and nc else None
        plain_t, plain_n = row.get("tidegate_plain"), row.get("nginx_plain")
        row["plain_vs_nginx"] = round(plain_t["rps"] / plain_n["rps"], 4) if plain_t and plain_n else None
        summary[str(conns)] = row
    return runs, summary


def compression_part(s: Setup, p: dict) -> tuple[list[dict], dict]:
    sizes = {}
    variants = []
    for enc, accept, proxies in ENCODINGS:
        for proxy in proxies:
            if proxy == "tidegate" and enc != "identity" and "compress" in s.refused:
                continue
            headers = {"Accept-Encoding": accept} if accept else {}
            status, h, body = fetch(s.addr(proxy), JSON_PATH, headers)
            got = h.get("content-encoding")
            plain = decode(got, body)
            sizes[f"{proxy}_{enc}"] = {
                "status": status, "content_encoding": got, "bytes": len(body), "vary": h.get("vary"),
                "ratio": round(len(body) / len(s.document), 4),
                "round_trip": None if plain is None else plain == s.document,
                "as_asked": status == 200 and (got == accept if accept else got is None)}
            variants.append((proxy, enc, headers))
    runs = []
    conns = p["compress_conns"]
    for rep in range(p["reps"]):
        for proxy, enc, headers in rotate(variants, rep):
            r = measured(s, proxy, JSON_PATH, conns, p["duration"], headers)
            r.update({"part": "compression", "proxy": proxy, "encoding": enc, "conns": conns, "rep": rep})
            runs.append(r)
            log(f"  rules json rep {rep} {proxy:8} {enc:8} {r['rps']:10.0f} req/s  p99 {r.get('p99_ms') or 0:7.2f} ms"
                f"  {r['cpu_us_per_req']:6.1f} us/req  errors {r['errors']}")
    summary = {}
    for proxy, enc, _ in variants:
        rs = [r for r in runs if r["proxy"] == proxy and r["encoding"] == enc]
        summary[f"{proxy}_{enc}"] = {"rps": median([r["rps"] for r in rs]), "p99_ms": median([r.get("p99_ms")
                                                                                            for r in rs]),
                                     "cpu_us_per_req": median([r["cpu_us_per_req"] for r in rs]),
                                     "errors": sum(r["errors"] for r in rs), "reps": len(rs),
                                     **sizes[f"{proxy}_{enc}"]}
    for enc in ("identity", "gzip", "br", "zstd"):
        t, n = summary.get(f"tidegate_{enc}"), summary.get("nginx_gzip" if enc in ("br", "zstd") else f"nginx_{enc}")
        if t and n and n["rps"]:
            t["vs_nginx_gzip" if enc in ("br", "zstd") else "vs_nginx"] = round(t["rps"] / n["rps"], 4)
    return runs, summary


def limit_part(s: Setup, p: dict) -> dict:
    """One key far over its rate, then a flood of distinct keys."""
    status_lua = s.ctx.work / "rules-status.lua"
    status_lua.write_text(STATUS_LUA)
    keys_lua = s.ctx.work / "rules-keys.lua"
    keys_lua.write_text(KEYS_LUA)
    rate, burst, secs = p["limit_rate"], p["limit_burst"], p["limit_duration"]
    out = {"one_key": {}, "many_keys": {}}
    for proxy in ("tidegate", "nginx"):
        if proxy == "tidegate" and "limited" in s.refused:
            continue
        r = parse_wrk(wrk(f"http://{s.addr(proxy)}/limited/", p["limit_conns"], secs, {"X-Key": "one"},
                          script=str(status_lua)))
        ok = r.get("statuses", {}).get("200", 0)
        elapsed = r.get("elapsed_s") or secs
        admitted = ok / elapsed
        out["one_key"][proxy] = {
            "rate_per_s": rate, "burst": burst, "elapsed_s": round(elapsed, 3), "offered_per_s": round(r["requests"] /
                                                                                                     elapsed, 1),
            "statuses": r.get("statuses", {}), "socket_errors": r["socket_errors"], "admitted": ok,
            "admitted_per_s": round(admitted, 2), "error_pct": round((admitted - rate) / rate * 100, 3),
            # What a perfect token bucket admits: the burst, then the rate.
            "ideal_per_s": round((rate * elapsed + burst) / elapsed, 2)}
        log(f"  rules one key {proxy:8} offered {out['one_key'][proxy]['offered_per_s']:9.0f}/s admitted "
            f"{admitted:8.1f}/s of {rate}/s ({out['one_key'][proxy]['error_pct']:+.2f} %)")
    for proxy in ("tidegate", "nginx"):
        if proxy == "tidegate" and "keys" in s.refused:
            continue
        pid = s.pid(proxy)
        mark = s.ctx.work / f"rules-keys-{proxy}"
        before = tree_rss_kib(pid)
        per_thread = -(-p["keys"] // 2)
        argv = ["wrk", "-t2", f"-c{p['keys_conns']}", f"-d{p['keys_max_s']}s", "--timeout", "5s", "-s",
                str(keys_lua), f"http://{s.addr(proxy)}/keys/", "--", str(per_thread), str(mark)]
        t0 = time.monotonic()
        wrk_out = s.ctx.work / f"rules-keys-{proxy}.out"
        w = s.ctx.procs.start(argv, out=wrk_out)
        peak = 0
        while w.poll() is None:
            peak = max(peak, tree_rss_kib(pid))
            if all((mark.parent / f"{mark.name}.{i}").exists() for i in range(2)):
                w.send_signal(signal.SIGINT)  # wrk prints its summary and exits
                break
            time.sleep(0.05)
        try:
            w.wait(timeout=30)
        finally:
            s.ctx.procs.stop(w)
        elapsed = time.monotonic() - t0
        time.sleep(0.5)
        after = tree_rss_kib(pid)
        peak = max(peak, after)
        r = parse_wrk(wrk_out.read_text(errors="replace"))
        out["many_keys"][proxy] = {
            "keys": r.get("sent"), "statuses": r.get("statuses", {}), "socket_errors": r["socket_errors"],
            "elapsed_s": round(elapsed, 2), "rss_before_kib": before, "rss_peak_kib": peak, "rss_after_kib": after,
            "rss_growth_kib": after - before, "hwm_kib": hwm_kib(pid) if proxy == "tidegate" else None}
        log(f"  rules {r.get('sent')} keys {proxy:8} RSS {before / 1024:.1f} -> {after / 1024:.1f} MiB "
            f"(peak {peak / 1024:.1f}) in {elapsed:.1f} s, statuses {r.get('statuses')}")
    return out


def hwm_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def run(ctx: Ctx, p: dict) -> dict:
    if not which("wrk"):
        raise RuntimeError("wrk is needed (apt-get install wrk)")
    s = Setup(ctx, p)
    try:
        check = checks(s)
        runs, summary = throughput_part(s, p)
        crun, compression = compression_part(s, p)
        limits = limit_part(s, p)
        rss_end = rss_kib(s.tg.proc.pid)
    finally:
        s.stop()
    not_run = {name: why for name, why in s.refused.items()}
    goal = {}
    for conns, row in summary.items():
        goal[f"fraction_ratio_c{conns}"] = row.get("fraction_ratio_rep_median")
    ratios = [v for v in goal.values() if v is not None]
    goal["typical_chain_met"] = (bool(ratios) and all(v >= 1 for v in ratios)
                                 and all(c["ok"] for c in check.values())) if ratios else None
    g = compression.get("tidegate_gzip", {}).get("vs_nginx")
    goal["gzip_vs_nginx"] = g
    tg_gzip = compression.get("tidegate_gzip", {})
    # Met only by gzip answers that decode to the document.
    goal["compression_met"] = (g >= 1 and bool(tg_gzip.get("as_asked")) and bool(tg_gzip.get("round_trip"))
                               if g else None)
    one = limits["one_key"].get("tidegate")
    goal["rate_limit_error_pct"] = one["error_pct"] if one else None
    goal["rate_limit_met"] = abs(one["error_pct"]) <= 5 if one else None
    many = limits["many_keys"].get("tidegate")
    goal["many_keys_rss_growth_kib"] = many["rss_growth_kib"] if many else None
    return {"params": p, "steps": TYPICAL_STEPS, "json_bytes": len(s.document), "checks": check,
            "not_run": not_run, "runs": runs + crun, "summary": summary,
            "compression": compression, "rate_limit": limits, "tidegate_rss_end_kib": rss_end, "goal": goal}

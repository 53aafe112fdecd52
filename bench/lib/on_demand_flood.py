#!/usr/bin/env python3
"""On-demand TLS under a flood of made-up server names (issue 39's goal:
"1,000 handshakes with random server names and an `ask` endpoint that
refuses them: 0 orders, the proxy keeps serving others, p99 of a normal
client within 2x of quiet").

Against a Tidegate with a managed certificate issued by Pebble (bench/tls.sh
sets them up): puts an on-demand template whose `ask` URL is a refusing
endpoint started here, then measures a normal client (a new verified-free
HTTPS connection per request to the managed certificate's name, at a fixed
rate) alone, during a control flood (`--flood` handshakes at
`--flood-rate`/s over up to `--flood-conns` connections, all for the
certificate's own name), and during the same flood with random server
names.
Counts the orders Pebble received meanwhile (its log) and the questions
the ask endpoint got per name. Prints one JSON row (bench/tls.sh's
results).

Processes, not threads, for the three parts (normal client, flood, ask
endpoint): a flood thread holding Python's interpreter lock would be
measured as the proxy's latency."""

import argparse
import http.server
import json
import multiprocessing
import random
import socket
import ssl
import string
import threading
import time
import urllib.request


def ask_endpoint(port_out, log_path):
    """Answers 403 to every question, logging the name asked."""
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            name = self.path.split("domain=", 1)[-1].split("&", 1)[0]
            with lock, open(log_path, "a") as f:
                f.write(name + "\n")
            self.send_response(403)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port_out.put(server.server_address[1])
    server.serve_forever()


def context():
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def one_request(port, sni, ctx):
    """A new connection, a handshake for `sni`, one GET; seconds taken."""
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=sni) as s:
            s.sendall(f"GET / HTTP/1.1\r\nhost: {sni}\r\nconnection: close\r\n\r\n".encode())
            got = b""
            while b"\r\n" not in got:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
    if not got.startswith(b"HTTP/1.1 200"):
        raise OSError(f"answer {got[:40]!r}")
    return time.perf_counter() - t


def normal_client(port, sni, rate, seconds, out):
    """Requests at `rate`/s (open loop, one at a time) for `seconds`."""
    ctx = context()
    lat, errors = [], 0
    start = time.perf_counter()
    n = 0
    while True:
        due = start + n / rate
        now = time.perf_counter()
        if due - start >= seconds:
            break
        if due > now:
            time.sleep(due - now)
        n += 1
        try:
            lat.append(one_request(port, sni, ctx))
        except OSError:
            errors += 1
    out.put((lat, errors))


def flood(port, total, conns, rate, fixed_name, out):
    """`total` handshakes, the i-th started at i/`rate` s (or at once when
    late) by one of `conns` threads; each for a random server name, or for
    `fixed_name` (the control)."""
    ctx = context()
    issued = [0]
    lock = threading.Lock()
    done = [0, 0]
    start = time.perf_counter()

    def worker():
        while True:
            with lock:
                if issued[0] == total:
                    return
                i = issued[0]
                issued[0] += 1
            wait = start + i / rate - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            name = fixed_name or "".join(random.choices(string.ascii_lowercase, k=12)) + ".flood.example"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
                    with ctx.wrap_socket(raw, server_hostname=name):
                        pass
                ok = 0
            except OSError:
                ok = 1
            with lock:
                done[ok] += 1

    threads = [threading.Thread(target=worker) for _ in range(conns)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    out.put((done[0], done[1], time.perf_counter() - start))


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000 if values else None


def orders(pebble_log):
    try:
        return open(pebble_log).read().count("POST /order-plz")
    except OSError:
        return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--admin", required=True, help="Tidegate's admin address")
    ap.add_argument("--token", required=True)
    ap.add_argument("--tls-port", type=int, required=True)
    ap.add_argument("--sni", required=True, help="the name of the managed certificate (the normal client's)")
    ap.add_argument("--directory", required=True, help="Pebble's directory URL")
    ap.add_argument("--directory-ca", required=True, help="PEM file of the CA of Pebble's HTTPS")
    ap.add_argument("--pebble-log", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--flood", type=int, default=1000)
    ap.add_argument("--flood-conns", type=int, default=32)
    ap.add_argument("--flood-rate", type=float, default=200, help="handshakes/s the flood starts")
    ap.add_argument("--rate", type=float, default=50)
    ap.add_argument("--quiet-s", type=float, default=5)
    a = ap.parse_args()

    log_path = f"{a.work}/ask.log"
    open(log_path, "w").close()
    ports = multiprocessing.Queue()
    ask = multiprocessing.Process(target=ask_endpoint, args=(ports, log_path), daemon=True)
    ask.start()
    ask_port = ports.get(timeout=10)
    acme = {"hosts": [], "directory": a.directory, "challenge": "tls-alpn-01",
            "directory_ca_pem": open(a.directory_ca).read(),
            "on_demand": {"ask": f"http://127.0.0.1:{ask_port}/check"}}
    req = urllib.request.Request(f"http://{a.admin}/v1/certificates/customers", method="PUT",
                                 data=json.dumps({"acme": acme}).encode(),
                                 headers={"Authorization": f"Bearer {a.token}", "Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).read()

    results = multiprocessing.Queue()

    def measured(seconds):
        client = multiprocessing.Process(target=normal_client, args=(a.tls_port, a.sni, a.rate, seconds, results))
        client.start()
        got = results.get(timeout=seconds + 120)
        client.join()
        return got

    def flooded(fixed_name):
        """The normal client's latencies while a flood runs (until it ends:
        its time is not known ahead), and the flood's outcome."""
        flood_out = multiprocessing.Queue()
        flooder = multiprocessing.Process(target=flood, args=(a.tls_port, a.flood, a.flood_conns, a.flood_rate,
                                                              fixed_name, flood_out))
        flooder.start()
        lat, errors, t0 = [], 0, time.perf_counter()
        while True:
            more, err = measured(1.0)
            lat += more
            errors += err
            if not flood_out.empty() or time.perf_counter() - t0 > 300:
                break
        outcome = flood_out.get(timeout=300)
        flooder.join()
        return lat, errors, outcome

    # Quiet: the normal client alone. Control: the same flood for the
    # certificate's own name (what the handshakes cost without on-demand
    # TLS). Then the flood of refused names.
    quiet_lat, quiet_err = measured(a.quiet_s)
    control_lat, control_err, _ = flooded(a.sni)
    before = orders(a.pebble_log)
    lat, errors, (ok, failed, flood_s) = flooded(None)
    time.sleep(1.5)  # one ACME manager tick: an order would have started
    ordered = orders(a.pebble_log) - before
    asked = [line for line in open(log_path).read().split("\n") if line]
    per_name = {}
    for name in asked:
        per_name[name] = per_name.get(name, 0) + 1
    ask.terminate()
    q99, f99, c99 = pct(quiet_lat, 0.99), pct(lat, 0.99), pct(control_lat, 0.99)
    print(json.dumps({
        "proxy": "tidegate_acme", "mode": "on_demand", "rps": 0.0,
        "requests": len(quiet_lat) + len(control_lat) + len(lat), "errors": quiet_err + control_err + errors,
        "normal_rate": a.rate, "flood_rate": a.flood_rate, "flood_conns": a.flood_conns,
        "quiet_p50_ms": round(pct(quiet_lat, 0.5), 3), "quiet_p99_ms": round(q99, 3),
        "control_p50_ms": round(pct(control_lat, 0.5), 3), "control_p99_ms": round(c99, 3),
        "flood_p50_ms": round(pct(lat, 0.5), 3), "flood_p99_ms": round(f99, 3),
        "p99_ratio": round(f99 / q99, 3) if q99 else None,
        "p99_ratio_to_control": round(f99 / c99, 3) if c99 else None,
        "flood_handshakes": a.flood, "flood_completed": ok, "flood_failed": failed,
        "flood_s": round(flood_s, 3), "flood_per_s": round(a.flood / flood_s, 1) if flood_s else None,
        "orders_during_flood": ordered, "names_asked": len(per_name),
        "most_questions_per_name": max(per_name.values(), default=0)}))


if __name__ == "__main__":
    main()

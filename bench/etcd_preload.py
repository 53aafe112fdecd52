#!/usr/bin/env python3
"""etcd alone, through the same JSON gateway Tidegate uses: the latency of a
3-key transaction guarded by a value compare (what one Tidegate change costs
etcd), on an empty etcd and after a preload shaped like the cluster
benchmark's (four transactions of 55,000 keys and a 1.3 MB value).

    bench/etcd_preload.py          # starts and stops its own etcd on loopback
"""
import base64
import http.client
import json
import os
import socket
import subprocess
import tempfile
import time


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def b(text):
    return base64.b64encode(text.encode()).decode()


def main():
    client, peer = free_port(), free_port()
    with tempfile.TemporaryDirectory() as d:
        etcd = subprocess.Popen(
            ["etcd", "--name", "m", "--data-dir", os.path.join(d, "etcd"),
             "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"m=http://127.0.0.1:{peer}", "--max-txn-ops", "200000",
             "--max-request-bytes", "67108864", "--logger", "zap", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(2)
            conn = http.client.HTTPConnection("127.0.0.1", client)

            def post(path, body):
                conn.request("POST", path, json.dumps(body))
                return conn.getresponse().read()

            n = [0]

            def change():
                n[0] += 1
                i = n[0]
                ops = [{"request_put": {"key": b(f"p/routes/x{i}"), "value": b("x" * 150)}},
                       {"request_put": {"key": b(f"p/log/{i:020}"), "value": b("y" * 300)}},
                       {"request_put": {"key": b("p/rev"), "value": b(str(i))}}]
                guard = [{"key": b("p/rev"), "result": "EQUAL", "target": "VALUE", "value": b(str(i - 1))}] if i > 1 else []
                post("/v3/kv/txn", {"compare": guard, "success": ops})

            def measure(label):
                ts = []
                for _ in range(400):
                    t = time.perf_counter()
                    change()
                    ts.append((time.perf_counter() - t) * 1e3)
                ts.sort()
                print(f"{label}: guarded 3-key transaction p50 {ts[200]:.2f} ms, p99 {ts[395]:.2f} ms")

            measure("empty")
            for k in range(4):
                ops = [{"request_put": {"key": b(f"p/services/pre{k}-{j}"), "value": b("s" * 200)}} for j in range(5000)]
                ops += [{"request_put": {"key": b(f"p/backends/pre{k}-{j}/{m}"), "value": b("z" * 60)}}
                        for j in range(5000) for m in range(10)]
                ops += [{"request_put": {"key": b(f"p/log/big{k}"), "value": b("L" * 1_300_000)}}]
                post("/v3/kv/txn", {"compare": [], "success": ops})
            measure("loaded")
        finally:
            etcd.terminate()
            etcd.wait()


if __name__ == "__main__":
    main()

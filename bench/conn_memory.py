#!/usr/bin/env python3
"""Memory per client connection of a running proxy: opens N connections to
ADDR, measures the proxy's resident memory (PID's VmRSS) with the
connections open and silent, then after one GET on each (all sent, then all
answers read), and prints KiB per connection for both. Loopback only.

    bench/conn_memory.py N HOST:PORT PID

The proxy needs a route for `/`; raise `ulimit -n` above N first.
"""

import socket
import sys
import time


def rss_kib(pid: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main() -> None:
    n, addr, pid = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    host, port = addr.rsplit(":", 1)
    if not host.startswith("127.") and host != "localhost":
        sys.exit("loopback addresses only")
    base = rss_kib(pid)
    socks = [socket.create_connection((host, int(port))) for _ in range(n)]
    time.sleep(0.5)
    silent = rss_kib(pid)
    for s in socks:
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    for s in socks:
        s.recv(4096)
    time.sleep(0.5)
    after = rss_kib(pid)
    print(f"base {base / 1024:.1f} MiB; {n} silent connections {silent / 1024:.1f} MiB "
          f"(+{(silent - base) / n:.1f} KiB each); after one request each {after / 1024:.1f} MiB "
          f"(+{(after - base) / n:.1f} KiB each)")
    for s in socks:
        s.close()


if __name__ == "__main__":
    main()

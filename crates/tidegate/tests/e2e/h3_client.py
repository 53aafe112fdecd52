"""An HTTP/3 client for the end-to-end tests, on aioquic (PyPI): a QUIC
implementation from outside the project.

    h3_client.py HOST:PORT SERVER_NAME CA_FILE REQUESTS_JSON
    h3_client.py --half-open HOST:PORT SERVER_NAME COUNT HOLD_S

REQUESTS_JSON is a list of {"method", "path", "headers": [[name, value]],
"body": text, "body_times": n (the body is the text n times), "repeat": n}; all requests go over one connection, at once
(each on its own stream). Prints one JSON object: {"answers": [{"status",
"headers", "body", "reset"}], "retry": bool} with the answers in the
order of the requests.
"""

import asyncio
import json
import ssl
import sys

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import StreamReset

TIMEOUT = 20


class Client(QuicConnectionProtocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.http = H3Connection(self._quic)
        self.answers = {}
        self.waiters = {}

    def quic_event_received(self, event):
        if isinstance(event, StreamReset) and event.stream_id in self.waiters:
            self.answers[event.stream_id]["reset"] = True
            self.done(event.stream_id)
        for h3 in self.http.handle_event(event):
            answer = self.answers.get(h3.stream_id)
            if answer is None:
                continue
            if isinstance(h3, HeadersReceived):
                for name, value in h3.headers:
                    if name == b":status":
                        answer["status"] = int(value)
                    else:
                        answer["headers"].append([name.decode(), value.decode()])
            elif isinstance(h3, DataReceived):
                answer["body"] += h3.data
            if getattr(h3, "stream_ended", False):
                self.done(h3.stream_id)

    def done(self, stream_id):
        waiter = self.waiters.pop(stream_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def send(self, authority, request):
        stream_id = self._quic.get_next_available_stream_id()
        body = (request.get("body", "") * request.get("body_times", 1)).encode()
        headers = [
            (b":method", request.get("method", "GET").encode()),
            (b":scheme", b"https"),
            (b":authority", authority.encode()),
            (b":path", request.get("path", "/").encode()),
        ] + [(n.encode(), v.encode()) for n, v in request.get("headers", [])]
        self.answers[stream_id] = {"status": None, "headers": [], "body": b"", "reset": False}
        self.waiters[stream_id] = asyncio.get_running_loop().create_future()
        self.http.send_headers(stream_id, headers, end_stream=not body)
        if body:
            self.http.send_data(stream_id, body, end_stream=True)
        return stream_id


def half_open(target, name, count, hold_s):
    """Starts `count` handshakes from as many UDP ports, answers none of
    them, and keeps the sockets for `hold_s` seconds."""
    import socket
    import time

    host, port = target.rsplit(":", 1)
    sockets = []
    for _ in range(count):
        config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name=name)
        conn = QuicConnection(configuration=config)
        now = time.time()
        conn.connect((host, int(port)), now=now)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        for data, addr in conn.datagrams_to_send(now=now):
            s.sendto(data, addr)
        sockets.append(s)
    print(json.dumps({"sent": count}), flush=True)
    time.sleep(hold_s)


async def main():
    if sys.argv[1] == "--half-open":
        return half_open(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
    target, name, ca, requests = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    host, port = target.rsplit(":", 1)
    config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name=name)
    config.load_verify_locations(ca)
    config.verify_mode = ssl.CERT_REQUIRED
    async with connect(host, int(port), configuration=config, create_protocol=Client) as client:
        ids = []
        for request in requests:
            for _ in range(request.get("repeat", 1)):
                ids.append(client.send(name, request))
        client.transmit()
        waiters = [client.waiters[i] for i in ids if i in client.waiters]
        await asyncio.wait_for(asyncio.gather(*waiters), TIMEOUT)
        answers = []
        for i in ids:
            a = client.answers[i]
            a["body"] = a["body"].decode(errors="replace")
            answers.append(a)
        retry = client._quic._retry_count > 0 if hasattr(client._quic, "_retry_count") else None
        print(json.dumps({"answers": answers, "retry": retry}))


asyncio.run(main())

#!/usr/bin/env python3
"""An OTLP/HTTP trace receiver for the end-to-end tests: decodes each
`POST /v1/traces` body with the official OpenTelemetry protobuf definitions
(PyPI's `opentelemetry-proto`) and appends every span to OUT as one JSON
line (ids in hex, attributes as a dict, the resource's attributes beside).
A body that does not decode is answered 400 and recorded as
{"undecodable": ...}. Prints `listening on PORT` first.

    otlp_receiver.py OUT
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2


def value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Handler(BaseHTTPRequestHandler):
    out = None

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        lines = []
        status = 200
        try:
            if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
                raise ValueError(f"{self.path} {self.headers.get('content-type')}")
            req = trace_service_pb2.ExportTraceServiceRequest()
            req.ParseFromString(body)
            for rs in req.resource_spans:
                resource = {kv.key: value(kv.value) for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        lines.append({
                            "resource": resource, "scope": ss.scope.name,
                            "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                            "parent_span_id": s.parent_span_id.hex(), "trace_state": s.trace_state,
                            "name": s.name, "kind": s.kind,
                            "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                            "attributes": {kv.key: value(kv.value) for kv in s.attributes},
                            "status": s.status.code, "status_message": s.status.message,
                        })
        except Exception as e:  # noqa: BLE001 - recorded for the test to see
            lines = [{"undecodable": str(e)}]
            status = 400
        with open(Handler.out, "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
        self.send_response(status)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()


def main():
    Handler.out = sys.argv[1]
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"listening on {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()

"""A collector that takes everything: answers ``200`` to every OTLP/HTTP ``POST``, decodes
nothing, keeps nothing (``icount.py --telemetry``'s peer, so the export's cost is the proxy's
and not a refused connection's retries).

    python bench/otlp_sink.py [PORT]        # default 4318, OTLP/HTTP's port
"""

from __future__ import annotations

import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 4318
    ThreadingHTTPServer(("127.0.0.1", port), Sink).serve_forever()

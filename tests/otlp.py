"""A real OTLP/HTTP receiver for tests: ``POST /v1/traces`` and ``/v1/metrics`` on 127.0.0.1,
each body decoded with ``opentelemetry-proto``'s ``ExportTraceServiceRequest`` and
``ExportMetricsServiceRequest`` (the collector's own message types), kept for the test to read.

It runs in a thread (``http.server``), as a collector would run beside the proxy; a test waits
for what it needs with :meth:`OtlpReceiver.wait_for` in a worker thread, woken by each request
that arrives (no polling).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

T = TypeVar("T")


class OtlpReceiver:
    """Spans and metric data points received, and the headers each request came with."""

    def __init__(self) -> None:
        self.traces: list[ExportTraceServiceRequest] = []
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.headers: list[dict[str, str]] = []
        self.changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                message: Any
                if self.path == "/v1/traces":
                    message = ExportTraceServiceRequest.FromString(body)
                elif self.path == "/v1/metrics":
                    message = ExportMetricsServiceRequest.FromString(body)
                else:
                    self.send_error(404)
                    return
                # Kept before the answer: once an exporter has its 200, the test sees it.
                with receiver.changed:
                    receiver.headers.append({k.lower(): v for k, v in self.headers.items()})
                    if self.path == "/v1/traces":
                        receiver.traces.append(message)
                    else:
                        receiver.metrics.append(message)
                    receiver.changed.notify_all()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def wait_for(self, found: Callable[[OtlpReceiver], T | None], timeout: float) -> T:
        """``found(self)`` once it is not None, re-checked at each request that arrives;
        raises ``TimeoutError`` after ``timeout`` seconds without it."""
        with self.changed:
            ended = self.changed.wait_for(lambda: found(self) is not None, timeout)
            if not ended:
                raise TimeoutError(f"the receiver did not get it in {timeout} s")
            result = found(self)
            assert result is not None
            return result

    def spans(self) -> Iterator[Any]:
        for request in self.traces:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    yield from scope.spans

    def points(self, name: str) -> Iterator[tuple[dict[str, Any], Any]]:
        """(attributes, histogram data point) of every point of the metric ``name``."""
        for request in self.metrics:
            for resource in request.resource_metrics:
                for scope in resource.scope_metrics:
                    for metric in scope.metrics:
                        if metric.name == name:
                            for point in metric.histogram.data_points:
                                yield attributes(point.attributes), point

    def service_names(self) -> set[str]:
        names = set()
        for request in [*self.traces, *self.metrics]:
            resources = getattr(request, "resource_spans", None) or request.resource_metrics
            for resource in resources:
                names.add(attributes(resource.resource.attributes).get("service.name"))
        return names


def attributes(pairs: Any) -> dict[str, Any]:
    """OTLP ``KeyValue``s as a dict of plain values."""
    out: dict[str, Any] = {}
    for pair in pairs:
        value = pair.value
        out[pair.key] = getattr(value, value.WhichOneof("value"))
    return out

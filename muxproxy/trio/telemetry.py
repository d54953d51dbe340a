"""OpenTelemetry export of finished exchanges: a span each and the GenAI metrics, over OTLP/HTTP.

Fed the access record (``core/observe/access.py``) as the log sink gets it, once per exchange
when it ends, never per chunk; with ``[telemetry]`` off this module is not imported, and
``opentelemetry`` is imported only here, when it is on (the optional extra ``otel``).

What it obeys:

- Spans (OpenTelemetry trace API; W3C Trace Context): one SERVER span per exchange with the
  trace id, span id and parent the core derived (``tracecontext.py``), so the span is the one
  the backend's ``traceparent`` named as its parent. Its start and end come from the record
  (the end is the wall time the record was written, the start that less its ``duration``).
  Only sampled spans are sent (the core's decision: the client's flag, or the ratio). The
  span goes to the SDK's batch processor finished, as its tracer would hand it over: a
  tracer would only redo what is decided (ids, sampling, times), at several times the cost.
- Metrics (OpenTelemetry GenAI semantic conventions, development status): for a request to
  an LLM API path, ``gen_ai.server.request.duration``, ``gen_ai.server.time_to_first_token``
  and ``gen_ai.server.time_per_output_token`` (seconds; the last two for successful
  streamed responses only) and ``gen_ai.client.token.usage`` (``{token}``, by
  ``gen_ai.token.type``), each a histogram with the buckets the conventions advise. Token
  counts and the models are recorded when the record has them (``input_tokens``,
  ``output_tokens``, ``model``, and ``served_model``: an alias's target); the conventions
  forbid guessing them.
- Export runs in the SDK's own threads (``BatchSpanProcessor``,
  ``PeriodicExportingMetricReader``): recording from the event loop takes a lock and
  appends; a slow or absent collector costs the proxy nothing but the spans the batch queue
  drops, and the SDK logs why (logger ``opentelemetry``). The collector's headers (a
  credential, often) go to the exporters and nowhere else.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from muxproxy.config.telemetry import TelemetrySettings
from muxproxy.core.apis.paths import Api, api_for

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

__all__ = ["Telemetry", "attributes_of", "operation_of"]

EXPORT_TIMEOUT = 5.0
"""Seconds one export request to the collector may take (the SDK's default is 10): a
collector that stops answering holds only the exporting thread, and a stop's last flush,
this long."""

TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0),
    *(7.5, 10.0),
)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = tuple(0.01 * 2**power for power in range(14))
TOKEN_BUCKETS = tuple(float(4**power) for power in range(14))
"""The bucket boundaries the GenAI conventions advise for each histogram (1 to 4**13 tokens)."""

OPERATIONS = {
    Api.CHAT_COMPLETIONS: "chat",
    Api.COMPLETIONS: "text_completion",
    Api.RESPONSES: "chat",
    Api.MESSAGES: "chat",
}
"""``gen_ai.operation.name`` per API (the conventions' well-known values)."""


def operation_of(target: str) -> str | None:
    """The GenAI operation a request target names, None for a path of no LLM API."""
    path = target.partition("?")[0].rstrip("/")
    if path.endswith("/v1/embeddings"):
        return "embeddings"
    api = api_for(path)
    return None if api is None else OPERATIONS[api]


def _server(address: Any) -> tuple[str, int] | None:
    """(host, port) of an access record's ``server`` (``host:port``, ``[v6]:port``)."""
    if not isinstance(address, str) or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def error_type(fields: Mapping[str, Any]) -> str | None:
    """``error.type`` of a finished exchange: its status from 400 on, else how it was cut;
    None for a whole answer below 400."""
    status = fields.get("status") or 0
    if status >= 400:
        return str(status)
    outcome = str(fields.get("outcome") or "")
    if outcome == "ok" or not outcome:
        return None
    if outcome.startswith("client aborted"):
        return "client_aborted"
    if outcome.startswith("upstream failed"):
        return "upstream_failed"
    return "_OTHER"


def attributes_of(fields: Mapping[str, Any], operation: str | None) -> dict[str, Any]:
    """The attributes every metric of the exchange carries (the conventions' metric
    attributes: operation, models, server, error)."""
    out: dict[str, Any] = {}
    if operation is not None:
        out["gen_ai.operation.name"] = operation
    model = fields.get("model")
    if model:
        out["gen_ai.request.model"] = model
    response_model = fields.get("served_model")
    if response_model:
        out["gen_ai.response.model"] = response_model
    server = _server(fields.get("server"))
    if server is not None:
        out["server.address"], out["server.port"] = server
    error = error_type(fields)
    if error is not None:
        out["error.type"] = error
    return out


class Telemetry:
    """The exporters of one ``[telemetry]`` configuration. Raises ``ImportError`` without
    the optional extra ``otel``."""

    def __init__(self, settings: TelemetrySettings) -> None:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.settings = settings
        headers = dict(settings.headers)
        base = settings.otlp_endpoint
        interval_ms = settings.export_interval * 1000
        # Each process (a worker of ``--workers``) is its own instance: cumulative series of
        # two workers under one identity would read as one series that keeps resetting.
        instance = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        resource = Resource.create(
            {"service.name": settings.service_name, "service.instance.id": instance}
        )
        self.resource = resource
        self.scope = InstrumentationScope("muxproxy")
        spans = OTLPSpanExporter(
            endpoint=f"{base}/v1/traces", headers=headers, timeout=EXPORT_TIMEOUT
        )
        self.spans: BatchSpanProcessor = BatchSpanProcessor(
            spans, schedule_delay_millis=interval_ms
        )
        metrics = OTLPMetricExporter(
            endpoint=f"{base}/v1/metrics", headers=headers, timeout=EXPORT_TIMEOUT
        )
        reader = PeriodicExportingMetricReader(metrics, export_interval_millis=interval_ms)
        self.meter_provider: MeterProvider = MeterProvider(
            resource=resource, metric_readers=[reader], shutdown_on_exit=False
        )
        meter = self.meter_provider.get_meter("muxproxy")
        self.duration = meter.create_histogram(
            "gen_ai.server.request.duration",
            unit="s",
            description="Generative AI server request duration such as time-to-last byte or"
            " last output token.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token",
            unit="s",
            description="Time to generate first token for successful responses.",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS,
        )
        self.tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token",
            unit="s",
            description="Time per output token generated after the first token for successful"
            " responses.",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS,
        )
        self.tokens = meter.create_histogram(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="Number of input and output tokens used.",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
        )

    def record(self, fields: Mapping[str, Any], wall: float) -> None:
        """One finished exchange's access record, written at wall-clock time ``wall``."""
        operation = operation_of(str(fields.get("target") or ""))
        attributes = attributes_of(fields, operation)
        if operation is not None:
            self._measure(fields, attributes)
        if fields.get("trace_sampled"):
            self._span(fields, wall, operation, attributes)

    def _measure(self, fields: Mapping[str, Any], attributes: dict[str, Any]) -> None:
        duration = fields.get("duration")
        if duration is not None:
            self.duration.record(duration, attributes)
        inputs, outputs = fields.get("input_tokens"), fields.get("output_tokens")
        if inputs is not None:
            self.tokens.record(inputs, {**attributes, "gen_ai.token.type": "input"})
        if outputs is not None:
            self.tokens.record(outputs, {**attributes, "gen_ai.token.type": "output"})
        ttft = fields.get("ttft")
        if ttft is None or "error.type" in attributes:
            return  # both are of successful streamed responses
        self.ttft.record(ttft, attributes)
        if duration is not None and outputs is not None and outputs > 1:
            self.tpot.record((duration - ttft) / (outputs - 1), attributes)

    def _span(
        self,
        fields: Mapping[str, Any],
        wall: float,
        operation: str | None,
        attributes: dict[str, Any],
    ) -> None:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        trace_id, span_id = int(fields["trace_id"], 16), int(fields["span_id"], 16)
        sampled = TraceFlags(TraceFlags.SAMPLED)
        parent_id = fields.get("parent_span_id")
        parent = None
        if parent_id:
            parent = SpanContext(trace_id, int(parent_id, 16), is_remote=True, trace_flags=sampled)
        end = int(wall * 1e9)
        start = end - int((fields.get("duration") or 0.0) * 1e9)
        model = fields.get("model")
        method = str(fields.get("method") or "")
        name = " ".join(filter(None, (operation, model))) if operation else method
        attributes = {
            **attributes,
            "http.request.method": method,
            "url.path": str(fields.get("target") or "").partition("?")[0],
            "http.response.status_code": fields.get("status") or 0,
            "muxproxy.request_id": fields.get("request_id") or "",
            "muxproxy.tries": fields.get("tries") or 0,
            "muxproxy.outcome": str(fields.get("outcome") or ""),
        }
        for key, attribute in (
            ("group", "muxproxy.group"),
            ("input_tokens", "gen_ai.usage.input_tokens"),
            ("output_tokens", "gen_ai.usage.output_tokens"),
            ("ttft", "muxproxy.time_to_first_token"),
        ):
            if fields.get(key) is not None:
                attributes[attribute] = fields[key]
        error = attributes.get("error.type")
        # A finished span handed to the batch processor as the SDK's tracer would hand it
        # over at its end: the ids, the sampling and both times are decided already (the
        # core's, the record's), which is all a tracer would add.
        span = ReadableSpan(
            name,
            context=SpanContext(trace_id, span_id, is_remote=False, trace_flags=sampled),
            parent=parent,
            resource=self.resource,
            attributes=attributes,
            kind=SpanKind.SERVER,
            status=Status(StatusCode.ERROR, error) if error else Status(StatusCode.UNSET),
            start_time=start,
            end_time=end,
            instrumentation_scope=self.scope,
        )
        self.spans.on_end(span)

    def shutdown(self) -> None:
        """Send what is left and stop the exporting threads (each export bounded by
        ``EXPORT_TIMEOUT``)."""
        self.spans.shutdown()  # type: ignore[no-untyped-call]  # unannotated in the SDK
        self.meter_provider.shutdown()

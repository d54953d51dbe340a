"""The OpenTelemetry export of access records (``muxproxy.trio.telemetry``), against a real
OTLP/HTTP receiver (``tests/otlp.py``) decoding what the SDK's exporters send."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from otlp import OtlpReceiver, attributes

from muxproxy.config import LogSettings
from muxproxy.config.telemetry import TelemetrySettings
from muxproxy.core.commands import Log
from muxproxy.trio.logs import LogSink
from muxproxy.trio.telemetry import TTFT_BUCKETS, Telemetry, operation_of

WALL = 1_800_000_000.0
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "a1b2c3d4e5f60718"
PARENT = "00f067aa0ba902b7"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


def settings(receiver: OtlpReceiver, **changes: Any) -> TelemetrySettings:
    base = TelemetrySettings(
        otlp_endpoint=receiver.endpoint,
        service_name="edge-test",
        export_interval=60.0,  # only the shutdown's flush exports: nothing to wait for
        headers=(("Authorization", "Bearer s3cret"),),
    )
    return attrs.evolve(base, **changes)


def record(**changes: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "request_id": "r-1",
        "method": "POST",
        "target": "/v1/chat/completions",
        "status": 200,
        "group": "gpus",
        "server": "10.0.0.7:8000",
        "tries": 2,
        "ttft": 0.25,
        "duration": 1.25,
        "outcome": "ok",
        "model": "llama-3.1-8b",
        "input_tokens": 12,
        "output_tokens": 11,
        "trace_id": TRACE,
        "span_id": SPAN,
        "parent_span_id": PARENT,
        "trace_sampled": True,
    }
    fields.update(changes)
    return fields


def export(receiver: OtlpReceiver, *records: dict[str, Any], **changes: Any) -> None:
    telemetry = Telemetry(settings(receiver, **changes))
    for fields in records:
        telemetry.record(fields, WALL)
    telemetry.shutdown()


def test_a_streamed_chat_is_one_span_under_the_client_parent_with_its_genai_attributes(
    receiver: OtlpReceiver,
) -> None:
    export(receiver, record())
    (span,) = receiver.spans()
    assert span.trace_id.hex() == TRACE and span.span_id.hex() == SPAN
    assert span.parent_span_id.hex() == PARENT
    assert span.name == "chat llama-3.1-8b" and span.kind == span.SPAN_KIND_SERVER
    assert span.end_time_unix_nano == int(WALL * 1e9)
    assert span.end_time_unix_nano - span.start_time_unix_nano == int(1.25 * 1e9)
    found = attributes(span.attributes)
    assert found["gen_ai.request.model"] == "llama-3.1-8b"
    assert found["gen_ai.usage.input_tokens"] == 12 and found["gen_ai.usage.output_tokens"] == 11
    assert found["server.address"] == "10.0.0.7" and found["server.port"] == 8000
    assert found["http.response.status_code"] == 200 and found["muxproxy.tries"] == 2
    assert "error.type" not in found
    assert receiver.service_names() == {"edge-test"}
    assert all(h["authorization"] == "Bearer s3cret" for h in receiver.headers)


def test_the_genai_metrics_carry_ttft_tokens_and_time_per_output_token(
    receiver: OtlpReceiver,
) -> None:
    export(receiver, record())
    (ttft_attributes, ttft), *_ = receiver.points("gen_ai.server.time_to_first_token")
    assert ttft.count == 1 and ttft.sum == 0.25
    assert list(ttft.explicit_bounds) == list(TTFT_BUCKETS)
    assert ttft_attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "llama-3.1-8b",
        "server.address": "10.0.0.7",
        "server.port": 8000,
    }
    tokens = {
        a["gen_ai.token.type"]: p.sum for a, p in receiver.points("gen_ai.client.token.usage")
    }
    assert tokens == {"input": 12, "output": 11}
    ((_, tpot),) = receiver.points("gen_ai.server.time_per_output_token")
    assert tpot.sum == pytest.approx((1.25 - 0.25) / 10)
    ((_, duration),) = receiver.points("gen_ai.server.request.duration")
    assert duration.sum == 1.25


def test_a_failure_has_its_error_type_and_no_ttft(receiver: OtlpReceiver) -> None:
    export(receiver, record(status=503, ttft=None, output_tokens=None, input_tokens=None))
    ((found, _),) = receiver.points("gen_ai.server.request.duration")
    assert found["error.type"] == "503"
    assert list(receiver.points("gen_ai.server.time_to_first_token")) == []
    (span,) = receiver.spans()
    assert span.status.code == span.status.STATUS_CODE_ERROR


def test_an_unsampled_exchange_is_measured_but_sends_no_span(receiver: OtlpReceiver) -> None:
    export(receiver, record(trace_sampled=False), record(target="/health", span_id=PARENT))
    assert [span.name for span in receiver.spans()] == ["POST"]  # the health check's
    ((_, duration),) = receiver.points("gen_ai.server.request.duration")
    assert duration.count == 1  # a path of no LLM API has no GenAI metrics


def test_operations_by_path() -> None:
    assert operation_of("/v1/chat/completions?x=1") == "chat"
    assert operation_of("/openai/v1/completions") == "text_completion"
    assert operation_of("/v1/messages") == operation_of("/v1/responses") == "chat"
    assert operation_of("/v1/embeddings") == "embeddings"
    assert operation_of("/v1/models") is None


def test_the_log_sink_exports_access_records(receiver: OtlpReceiver) -> None:
    out = io.StringIO()
    sink = LogSink(LogSettings(), stderr=out, telemetry=settings(receiver))
    sink(Log(event="access", fields=record()), WALL)
    sink.close()
    assert "request_id=r-1" in out.getvalue()
    assert [span.span_id.hex() for span in receiver.spans()] == [SPAN]


def test_a_root_span_keeps_the_ids_the_core_derived(receiver: OtlpReceiver) -> None:
    export(receiver, record(parent_span_id=None))
    (span,) = receiver.spans()
    assert (span.trace_id.hex(), span.span_id.hex(), span.parent_span_id) == (TRACE, SPAN, b"")


def test_an_export_that_raises_stops_the_export_not_the_logs(
    receiver: OtlpReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    out = io.StringIO()
    sink = LogSink(LogSettings(), stderr=out, telemetry=settings(receiver))
    sink(Log(event="access", fields=record(trace_id="not hex")), WALL)
    sink(Log(event="access", fields=record(request_id="r-2")), WALL)
    assert "request_id=r-1" in out.getvalue() and "request_id=r-2" in out.getvalue()
    assert sink.telemetry is None and "telemetry_error" in caplog.text
    sink.close()


def test_without_the_extra_the_logs_go_on_and_say_why(
    receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "muxproxy.trio.telemetry", None)  # import fails
    out = io.StringIO()
    sink = LogSink(LogSettings(), stderr=out, telemetry=settings(receiver))
    sink(Log(event="access", fields=record()), WALL)
    sink.close()
    assert "request_id=r-1" in out.getvalue()
    assert "telemetry_error" in caplog.text and "muxproxy[otel]" in caplog.text
    assert receiver.traces == [] and receiver.metrics == []


def test_a_reload_keeps_equal_exporters_and_replaces_others(receiver: OtlpReceiver) -> None:
    sink = LogSink(LogSettings(access="off"), telemetry=settings(receiver))
    first = sink.telemetry
    sink.export_to(settings(receiver))
    assert sink.telemetry is first is not None
    sink.export_to(settings(receiver, service_name="renamed"))
    assert sink.telemetry is not first and sink.telemetry is not None
    sink.export_to(None)
    assert sink.telemetry is None
    sink(Log(event="access", fields=record()), WALL)  # nothing to export to: no error
    sink.close()


def test_each_process_exports_as_its_own_instance(receiver: OtlpReceiver) -> None:
    export(receiver, record())
    export(receiver, record())
    instances = {
        attributes(resource.resource.attributes)["service.instance.id"]
        for request in receiver.metrics
        for resource in request.resource_metrics
    }
    assert len(instances) == 2

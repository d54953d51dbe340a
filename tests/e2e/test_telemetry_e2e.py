"""OpenTelemetry end to end: a real ``python -m muxproxy serve`` with ``[telemetry]``, the fake
LLM backend, an httpx client sending a W3C ``traceparent``, and a real OTLP/HTTP receiver
(``tests/otlp.py``) decoding what the proxy exports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio
from otlp import OtlpReceiver, attributes
from test_logs_e2e import config, serve, stream_chat

from muxproxy.core.observe.tracecontext import parse_traceparent

if TYPE_CHECKING:
    from conftest import StartBackend

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


def telemetry(receiver: OtlpReceiver) -> str:
    return (
        f'[telemetry]\notlp_endpoint = "{receiver.endpoint}"\nexport_interval = 0.2\n'
        'service_name = "edge-e2e"\nheaders = { "X-Collector-Key" = "k1" }\n'
    )


def the_span(trace: str) -> Any:
    def found(receiver: OtlpReceiver) -> Any:
        return next((s for s in receiver.spans() if s.trace_id.hex() == trace), None)

    return found


def ttft_point(receiver: OtlpReceiver) -> Any:
    return next(iter(receiver.points("gen_ai.server.time_to_first_token")), None)


async def test_the_span_continues_the_client_trace_and_parents_the_backend_request(
    tmp_path: Path, start_backend: StartBackend, receiver: OtlpReceiver
) -> None:
    fake, backend = await start_backend(tokens=3, delay=0.005, first_delay=0.05, role_chunk=True)
    text = config([backend], 'access = "off"') + telemetry(receiver)
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    async with serve(tmp_path, text) as proxy:
        with trio.fail_after(15):
            headers = {"traceparent": traceparent, "tracestate": "vendor=1"}
            response, _ = await stream_chat(proxy.port, headers)
            span = await trio.to_thread.run_sync(receiver.wait_for, the_span(CLIENT_TRACE), 10)
            found, point = await trio.to_thread.run_sync(receiver.wait_for, ttft_point, 10)
    assert response.status_code == 200
    # The backend got the client's trace, with the proxy's span as its parent.
    assert fake.last_request_headers is not None
    sent = parse_traceparent(fake.last_request_headers["traceparent"].encode())
    assert sent == (CLIENT_TRACE, span.span_id.hex(), True)
    assert fake.last_request_headers["tracestate"] == "vendor=1"
    # Named by the operation and the model the body names (read before routing).
    assert span.parent_span_id.hex() == CLIENT_SPAN and span.name == "chat m"
    spans = attributes(span.attributes)
    assert spans["gen_ai.request.model"] == "m"
    assert spans["http.response.status_code"] == 200 and spans["muxproxy.tries"] == 1
    assert spans["server.port"] == backend and spans["server.address"] == "127.0.0.1"
    assert spans["muxproxy.request_id"] == response.headers["x-request-id"]
    # The first token came after first_delay: the exported TTFT is the token's.
    assert point.count == 1 and 0.05 <= point.sum < 5
    assert found["gen_ai.operation.name"] == "chat" and found["server.port"] == backend
    assert receiver.service_names() == {"edge-e2e"}
    assert all(h["x-collector-key"] == "k1" for h in receiver.headers)


async def test_a_request_without_traceparent_starts_a_trace_the_backend_continues(
    tmp_path: Path, start_backend: StartBackend, receiver: OtlpReceiver
) -> None:
    fake, backend = await start_backend(tokens=2, delay=0, role_chunk=True)
    text = config([backend], 'access = "off"') + telemetry(receiver)
    async with serve(tmp_path, text) as proxy:
        with trio.fail_after(15):
            response, _ = await stream_chat(proxy.port, {})
            assert fake.last_request_headers is not None
            sent = parse_traceparent(fake.last_request_headers["traceparent"].encode())
            assert sent is not None
            trace, parent, sampled = sent
            span = await trio.to_thread.run_sync(receiver.wait_for, the_span(trace), 10)
    assert response.status_code == 200 and sampled
    assert span.span_id.hex() == parent and span.parent_span_id == b""

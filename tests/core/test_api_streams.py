"""What the proxy reads of each API's stream (``core/apis/streaming.py``) as the SSE meter, the
commit point and the usage scan use it: streams built by the fake LLM server's own wires
(``testing/fakellm``), fed whole and byte by byte."""

from __future__ import annotations

import json
from typing import Any

import pytest

from muxproxy.core.apis.streaming import split_event, stream_for
from muxproxy.core.exchange.admit import UsageScan
from muxproxy.core.observe.series import TokenTimes
from muxproxy.core.observe.ssemeter import SseMeter, meter_rules
from muxproxy.core.streams.commit import CommitPoint
from muxproxy.testing.fakellm.anthropic_messages import MessagesWire
from muxproxy.testing.fakellm.openai_responses import ResponsesWire

TOKENS = 4
PATHS = {"responses": b"/v1/responses", "messages": b"/v1/messages"}


def wire(api: str) -> Any:
    if api == "responses":
        return ResponsesWire.of({"input": "say hi there"}, "m1", "1", 0, TOKENS)
    return MessagesWire.of(
        {"messages": [{"role": "user", "content": "a b c"}]}, "m1", "1", 0, TOKENS
    )


def sse(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(data).encode() + b"\n\n"


def opening(api: str, w: Any) -> list[bytes]:
    return [sse(*event) for event in w.start()]


def stream(api: str) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """The events before the first token, the tokens' and the closing ones."""
    w = wire(api)
    start = opening(api, w)
    deltas = [sse(*event) for i in range(TOKENS) for event in w.delta(f"tok{i} ")]
    end = [sse(*event) for event in w.end("".join(f"tok{i} " for i in range(TOKENS)))]
    return start, deltas, end


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_the_first_token_is_the_first_content_event_not_the_opening(api: str) -> None:
    start, deltas, end = stream(api)
    meter = SseMeter(TokenTimes(), 0.0, *meter_rules(PATHS[api]))
    for n, event in enumerate(start):
        meter.feed(event, 1.0 + n)
    assert meter.first_token_at is None  # response.created, message_start, ping: not tokens
    meter.feed(deltas[0], 10.0)
    assert meter.first_token_at == 10.0
    for event in deltas[1:] + end:
        meter.feed(event, 11.0)
    assert meter.tokens == TOKENS  # the deltas alone, not the framing events
    assert meter.events == len(start) + len(deltas) + len(end)


CREATED = (
    b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
    b'"response":{"id":"resp_1","object":"response","status":"in_progress","output":[],'
    b'"text":{"format":{"type":"text"}},"usage":null}}\n\n'
)
"""OpenAI's opening event, with the ``text.format`` that the byte patterns take for text."""


def test_response_created_as_openai_sends_it_is_not_a_token() -> None:
    plain = SseMeter(TokenTimes(), 0.0)
    plain.feed(CREATED, 1.0)
    assert plain.first_token_at == 1.0  # the byte patterns alone: the old mistake
    meter = SseMeter(TokenTimes(), 0.0, *meter_rules(b"/v1/responses"))
    meter.feed(CREATED, 1.0)
    assert meter.first_token_at is None
    held = CommitPoint(1 << 16, stream_for(b"/v1/responses"))
    assert held.take(CREATED) is None


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_tokens_and_usage_byte_by_byte(api: str) -> None:
    start, deltas, end = stream(api)
    body = b"".join(start + deltas + end)
    meter = SseMeter(TokenTimes(), 0.0, *meter_rules(PATHS[api]))
    api_stream = stream_for(PATHS[api])
    assert api_stream is not None
    usage = UsageScan(api_stream)
    for i in range(len(body)):
        meter.feed(body[i : i + 1], float(i))
        usage.feed(body[i : i + 1])
    assert meter.tokens == TOKENS
    assert meter.first_token_at == float(len(b"".join(start + deltas[:1])) - 1)
    assert usage.output_tokens == TOKENS
    assert usage.input_tokens == 3


def test_chat_completions_keep_the_byte_patterns_and_count_events() -> None:
    is_content, marker = meter_rules(b"/v1/chat/completions")
    meter = SseMeter(TokenTimes(), 0.0, is_content, marker)
    meter.feed(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n', 1.0)
    meter.feed(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n', 2.0)
    meter.feed(b"data: [DONE]\n\n", 3.0)
    assert meter.first_token_at == 2.0
    assert meter.tokens == meter.events == 3  # as before: every event counted
    usage = UsageScan(stream_for(b"/v1/chat/completions"))  # type: ignore[arg-type]
    usage.feed(b'data: {"usage":{"prompt_tokens":7,"completion_tokens":2}}\n\n')
    assert (usage.input_tokens, usage.output_tokens) == (7, 2)


@pytest.mark.parametrize(
    ("path", "error", "expected"),
    [
        (
            b"/v1/messages",
            b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
            b'"message":"Overloaded"}}\n\n',
            "overloaded_error",
        ),
        (
            b"/v1/responses",
            b'event: error\ndata: {"type":"error","code":"server_error","message":"x",'
            b'"sequence_number":2}\n\n',
            "server_error",
        ),
        (
            b"/v1/responses",
            b'event: response.failed\ndata: {"type":"response.failed","response":'
            b'{"error":{"code":"rate_limit_exceeded","message":"x"}}}\n\n',
            "rate_limit_exceeded",
        ),
        (
            b"/v1/chat/completions",
            b'data: {"error":{"message":"x","type":"server_error","code":500}}\n\n',
            "server_error",
        ),
    ],
)
def test_an_error_event_before_content_is_noted_and_held(
    path: bytes, error: bytes, expected: str
) -> None:
    held = CommitPoint(1 << 16, stream_for(path))
    assert held.take(b": ping\n\n") is None
    assert held.error is None
    assert held.take(error) is None  # still held: the exchange decides (fail over or relay)
    assert held.error == expected


def test_content_after_an_error_is_relayed_whole() -> None:
    _, deltas, _ = stream("messages")
    held = CommitPoint(1 << 16, stream_for(b"/v1/messages"))
    error = b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error"}}\n\n'
    assert held.take(error) is None
    assert held.take(deltas[0]) == error + deltas[0]


def test_the_messages_opening_is_held_until_the_first_delta() -> None:
    start, deltas, _ = stream("messages")
    held = CommitPoint(1 << 16, stream_for(b"/v1/messages"))
    for event in start:
        assert held.take(event) is None
    assert held.take(deltas[0]) == b"".join(start) + deltas[0]
    assert held.error is None


def test_a_chat_stream_is_parsed_for_errors_only_when_it_names_one() -> None:
    api = stream_for(b"/v1/chat/completions")
    assert api is not None and api.is_content is None  # the meter's byte patterns
    assert api.error_of(b'data: {"choices":[{"delta":{"role":"assistant"}}]}') is None


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        (b"event: x\r\ndata: {}\r\ndata: 1", ("x", b"{}\n1")),
        (b"event:x\rdata:[]", ("x", b"[]")),
        (b": comment\nid: 3", None),
        (b"data", (None, b"")),
    ],
)
def test_split_event(event: bytes, expected: object) -> None:
    assert split_event(event) == expected


def test_a_path_of_no_known_api_keeps_the_byte_patterns() -> None:
    assert stream_for(b"/generate_stream") is None
    is_content, marker = meter_rules(b"/generate_stream")
    assert marker == b"" and is_content(b'data: {"token":{"text":"a"}}')

"""The SSE meter (``muxproxy.core.observe.ssemeter``): events, first tokens and gaps, fed bytes as a
backend would send them, whole, byte by byte and cut anywhere."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from muxproxy.core.observe.series import HEAD_BUCKETS, INTER_TOKEN_BUCKETS, TokenTimes
from muxproxy.core.observe.ssemeter import INSPECT_LIMIT, SseMeter, is_token_event

ROLE_ONLY = (
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}'
)
ROLE_ONLY_SPACED = (  # Python's json.dumps: a space after every colon
    b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": null}]}'
)
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}'
FINISH = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}'
DONE = b"data: [DONE]"


def meter() -> SseMeter:
    return SseMeter(TokenTimes(), started=0.0)


MULTI_LINE = b'event: delta\nid: 7\ndata: {"choices":[{"delta":{"content":"x"}}]}'


def events(*bodies: bytes, sep: bytes = b"\n") -> bytes:
    """The events of ``bodies``, their lines (and the empty line after each) ending in ``sep``."""
    return b"".join(body.replace(b"\n", sep) + sep + sep for body in bodies)


@pytest.mark.parametrize(
    "event",
    [
        TOKEN,
        b'data: {"choices": [{"delta": {"content": "x"}}]}',
        b'data: {"choices":[{"delta":{"reasoning_content":"thinking"}}]}',
        b'data: {"choices":[{"delta":{"tool_calls":[{"index":0,"function":{}}]}}]}',
        b'data: {"choices":[{"text":"tok","index":0}]}',
        b'data:{"token":{"id":12,"text":"a"}}',
        b'event: content_block_delta\ndata: {"delta":{"type":"text_delta","text":"Hi"}}',
        b'data: {"choices":[{"delta":{"content":"\\n"}}]}',
        b"data: plain text token",
        b"id: 7\r\ndata: x",
    ],
)
def test_events_that_carry_a_token(event: bytes) -> None:
    assert is_token_event(event)


@pytest.mark.parametrize(
    "event",
    [
        ROLE_ONLY,
        ROLE_ONLY_SPACED,
        FINISH,
        USAGE,
        DONE,
        b"data:[DONE]",
        b": keep-alive",
        b"event: ping",
        b"retry: 1000",
        b'data: {"choices":[{"delta":{"content":null}}]}',
        b'data: {"type":"message_start","message":{"content":[]}}',
        b'data: {"error":{"message":"overloaded"}}',
        # A field name inside a string value has its quotes escaped: not a field.
        b'data: {"choices":[{"delta":{"role":"assistant","note":"\\"content\\":\\"x\\""}}]}',
    ],
)
def test_events_that_carry_no_token(event: bytes) -> None:
    assert not is_token_event(event)


def test_first_token_skips_the_role_only_chunk() -> None:
    m = meter()
    m.feed(events(ROLE_ONLY), 0.1)
    assert m.first_token_at is None and m.events == 1
    m.feed(events(TOKEN), 0.25)
    assert m.first_token_at == 0.25
    assert m.stats.ttft.counts[HEAD_BUCKETS.index(0.25)] == 1
    assert m.events == 2


@pytest.mark.parametrize("sep", [b"\n", b"\r\n", b"\r"])
def test_events_are_counted_across_chunk_boundaries(sep: bytes) -> None:
    stream = events(ROLE_ONLY, TOKEN, TOKEN, FINISH, DONE, sep=sep)
    m = meter()
    for i, byte in enumerate(stream):  # one byte per chunk: every terminator is split
        m.feed(bytes([byte]), float(i))
    assert m.events == 5
    assert m.first_token_at is not None


@given(
    sep=st.sampled_from([b"\n", b"\r\n", b"\r"]),
    tokens=st.integers(min_value=0, max_value=12),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=40),
    role_first=st.booleans(),
    multi_line=st.integers(min_value=0, max_value=3),
)
def test_event_count_does_not_depend_on_chunking(
    sep: bytes, tokens: int, cuts: list[int], role_first: bool, multi_line: int
) -> None:
    bodies = ([ROLE_ONLY] if role_first else []) + [TOKEN] * tokens
    bodies += [MULTI_LINE] * multi_line + [FINISH, DONE]
    stream = events(*bodies, sep=sep)
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    m = meter()
    for at, (start, end) in enumerate(itertools.pairwise(points)):
        m.feed(stream[start:end], float(at))
    assert m.events == len(bodies)
    assert (m.first_token_at is not None) == (tokens + multi_line > 0)


def test_stream_with_no_line_end_in_the_inspect_limit_counts_as_a_token() -> None:
    m = meter()
    m.feed(b"data: " + b"x" * INSPECT_LIMIT, 1.0)
    assert m.first_token_at == 1.0
    m.feed(b"\n\n" + events(TOKEN), 2.0)
    assert m.events == 2


def test_inter_token_gaps_are_observed_per_chunk_that_completed_events() -> None:
    m = meter()
    m.feed(events(ROLE_ONLY), 0.0)
    m.feed(events(TOKEN), 0.1)  # the first token: no gap yet
    m.feed(events(TOKEN, TOKEN), 0.13)  # two events in one read: one observation, 30 ms
    m.feed(TOKEN[:10], 0.14)  # half an event: nothing completed, nothing observed
    m.feed(TOKEN[10:] + b"\n\n", 0.2)  # completed 70 ms after the last
    hist = m.stats.inter_token
    assert sum(hist.counts) == 2
    assert hist.counts[INTER_TOKEN_BUCKETS.index(0.035)] == 1
    assert hist.counts[INTER_TOKEN_BUCKETS.index(0.075)] == 1
    assert m.gap_sum == pytest.approx(0.1)
    assert m.events == 5

"""The SSE event-boundary tracker: heartbeats where it says "boundary" never change the events."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muxproxy.core.streams.sse import HEARTBEAT, EventBoundary

Dispatched = tuple[str, str, str]
"""(event type, data, last event id) of one dispatched event."""


def parse_event_stream(stream: bytes) -> tuple[list[Dispatched], int | None]:
    """A client parser per WHATWG HTML §9.2.6: the events dispatched and the last retry."""
    text = stream.decode("utf-8")
    text = text.removeprefix("\ufeff")
    lines = re.split(r"\r\n|\r|\n", text)
    lines.pop()  # what follows the last line end is an incomplete line, never processed
    events: list[Dispatched] = []
    data = event_type = ""
    last_id = ""
    retry: int | None = None
    for line in lines:
        if not line:
            if data:
                events.append((event_type or "message", data.removesuffix("\n"), last_id))
            data = event_type = ""
            continue
        if line.startswith(":"):
            continue
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            data += value + "\n"
        elif name == "event":
            event_type = value
        elif name == "id":
            if "\0" not in value:
                last_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            retry = int(value)
    return events, retry


def at_boundary_reference(prefix: bytes) -> bool:
    """Ground truth over the whole prefix: right after an empty line, or nothing yet."""
    if not prefix:
        return True
    parts = re.split(rb"\r\n|\r|\n", prefix)
    return len(parts) >= 2 and parts[-1] == b"" and parts[-2] == b""


EOL = st.sampled_from(["\r\n", "\n", "\r"])
VALUE = st.text(alphabet="ab :é\u2603x0", max_size=6)
FIELD = st.one_of(
    st.tuples(st.just("data"), VALUE),
    st.tuples(st.just("event"), st.text(alphabet="abc", max_size=3)),
    st.tuples(st.just("id"), st.text(alphabet="12x", max_size=3)),
    st.tuples(st.just("retry"), st.text(alphabet="12x", max_size=3)),
    st.tuples(st.just(""), VALUE),  # a comment line
    st.tuples(st.just("data"), st.just("")),  # "data" without a colon
)


@st.composite
def event_streams(draw: st.DrawFn) -> bytes:
    out = []
    for _ in range(draw(st.integers(0, 5))):
        for name, value in draw(st.lists(FIELD, max_size=4)):
            if name == "":
                line = ":" + value
            elif value == "" and draw(st.booleans()):
                line = name
            else:
                line = f"{name}:{draw(st.sampled_from(['', ' ']))}{value}"
            out.append(line + draw(EOL))
        out.append(draw(EOL))  # the empty line that dispatches
    if draw(st.booleans()):
        out.append("data: unfinished" + draw(st.sampled_from(["", "\n", "\r"])))
    return "".join(out).encode("utf-8")


@st.composite
def chunkings(draw: st.DrawFn, stream: bytes) -> list[bytes]:
    cuts = sorted(draw(st.sets(st.integers(0, len(stream)), max_size=12)))
    bounds = [0, *cuts, len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_heartbeats_at_every_boundary_leave_the_events_unchanged(data: st.DataObject) -> None:
    stream = data.draw(event_streams())
    chunks = data.draw(chunkings(stream))
    tracker = EventBoundary()
    with_heartbeats = [HEARTBEAT] if tracker.at_boundary else []
    seen = b""
    for chunk in chunks:
        tracker.feed(chunk)
        seen += chunk
        # Exact, not just safe: the tracker says "boundary" whenever the whole prefix does.
        assert tracker.at_boundary == at_boundary_reference(seen)
        with_heartbeats.append(chunk)
        if tracker.at_boundary:
            with_heartbeats.append(HEARTBEAT)
    assert parse_event_stream(b"".join(with_heartbeats)) == parse_event_stream(stream)


@pytest.mark.parametrize(
    ("chunks", "boundary"),
    [
        ([], True),
        ([b"data: x\n"], False),
        ([b"data: x\n\n"], True),
        ([b"data: x\r\n\r\n"], True),
        ([b"data: x\r", b"\n"], False),  # one CRLF split in two: one line end
        ([b"data: x\r", b"\n", b"\r\n"], True),
        ([b"data: x\r", b"\r"], True),  # CR then CR: an empty line
        ([b"data: x\n", b"\r"], True),
        ([b"data: x\n\r", b"\n"], True),  # the LF completes the CRLF of the empty line
        ([b": comment\n"], False),  # conservative: a comment block is not yet closed
        ([b"data: x\n\n", b"data: y"], False),
        ([b"data: x\n\n", b""], True),
        ([b"\n", b"\n", b"\r\n"], True),
    ],
)
def test_boundary_examples(chunks: list[bytes], boundary: bool) -> None:
    tracker = EventBoundary()
    for chunk in chunks:
        tracker.feed(chunk)
    assert tracker.at_boundary is boundary

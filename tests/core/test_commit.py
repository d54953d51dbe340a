"""The commit point of a held SSE response (``retry_until_first_event``,
``core/streams/commit.py``): the first complete content event, not the first byte. A backend that
sends a comment, half an event or a role-only chunk and then dies is retried, and the client sees
only the answer of the server that was used (its head included). Bytes only, through the whole core.
"""

from __future__ import annotations

import h11
import pytest
from test_routing_exchange import Rig, fleet, header, request_body

from muxproxy.core.streams.commit import CommitPoint

ROLE_ONLY = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
CONTENT = b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'


@pytest.mark.parametrize(
    "before_death",
    [
        pytest.param(b": ping\n\n", id="comment"),
        pytest.param(b'data: {"choices":[{"delta":{"content":"H', id="partial-event"),
        pytest.param(ROLE_ONLY, id="role-only-chunk"),
        pytest.param(b"event: start\n\n" + ROLE_ONLY + b"data: [DONE", id="no-content-yet"),
    ],
)
def test_backend_dying_before_its_first_content_event_is_retried(before_death: bytes) -> None:
    rig = Rig(fleet(retry_until_first_event=True))
    conn, client = rig.request()
    first = rig.last_open()
    rig.sse_start(first.conn, "gpu0")
    rig.chunk(first.conn, before_death)
    assert not rig.take(conn)  # held: neither the head nor the bytes went out
    second = rig.retry_after_close(first)
    assert rig.logs("retry")[0].fields["condition"] == "error"
    assert not rig.take(conn)
    rig.sse_start(second.conn, "gpu1")
    rig.chunk(second.conn, ROLE_ONLY)
    assert not rig.take(conn)
    rig.chunk(second.conn, CONTENT)
    rig.end(second.conn)
    head, body = rig.sole_response(conn, client)
    assert header(head, b"x-backend-id") == [b"gpu1"]
    assert body == ROLE_ONLY + CONTENT  # nothing of the first attempt
    assert rig.logs("access")[0].fields["outcome"] == "ok"


def test_held_bytes_go_out_with_the_first_content_event() -> None:
    rig = Rig(fleet(retry_until_first_event=True))
    conn, client = rig.request()
    up = rig.last_open().conn
    rig.sse_start(up, "gpu0")
    rig.chunk(up, b": ping\n\n")
    rig.chunk(up, ROLE_ONLY + CONTENT[:20])
    assert not rig.take(conn)
    rig.chunk(up, CONTENT[20:])
    events = client.events(rig.take(conn))
    assert isinstance(events[0], h11.Response)
    assert request_body(events) == b": ping\n\n" + ROLE_ONLY + CONTENT
    rig.chunk(up, b"data: [DONE]\n\n")  # streamed from here on, one chunk at a time
    assert request_body(client.events(rig.take(conn))) == b"data: [DONE]\n\n"


def test_held_response_that_ends_without_content_goes_out_whole() -> None:
    rig = Rig(fleet(retry_until_first_event=True))
    conn, client = rig.request()
    up = rig.last_open().conn
    rig.sse_start(up, "gpu0")
    rig.chunk(up, ROLE_ONLY + b"data: [DONE]\n\n")
    assert not rig.take(conn)
    rig.end(up)
    _, body = rig.sole_response(conn, client)
    assert body == ROLE_ONLY + b"data: [DONE]\n\n"


def test_held_bytes_are_bounded() -> None:
    """A backend that sends more than a stream's buffer before its first token is committed
    to with what it sent: holding more would be unbounded."""
    rig = Rig(fleet(retry_until_first_event=True))
    conn, client = rig.request()
    up = rig.last_open().conn
    rig.sse_start(up, "gpu0")
    comment = b": " + b"x" * 1000 + b"\n\n"
    high_water = rig.pb.core.fx.limits.high_water
    sent = b""
    while not (out := rig.take(conn)):
        rig.chunk(up, comment)
        sent += comment
        assert len(sent) <= high_water + len(comment)
    assert len(sent) > high_water
    events = client.events(out)
    assert isinstance(events[0], h11.Response)
    assert request_body(events) == sent


@pytest.mark.parametrize("sep", [b"\n", b"\r\n", b"\r"])
def test_commit_point_is_the_end_of_the_first_content_event_byte_by_byte(sep: bytes) -> None:
    """Fed one byte at a time, in the stream's own line ends: the held bytes come out with
    the byte that ends the first content event, and not before."""
    stream = b": ping" + sep + sep + b"event: x" + sep + sep + b"data: tok" + sep + sep
    point = CommitPoint(limit=1 << 16)
    out = [point.take(stream[i : i + 1]) for i in range(len(stream))]
    assert out[:-1] == [None] * (len(stream) - 1)
    assert out[-1] == stream

"""The commit point of a held SSE response (``retry_until_first_event``,
``core/streams/commit.py``): the first complete content event, not the first byte. A backend that
sends a comment, half an event or a role-only chunk and then dies is retried, and the client sees
only the answer of the server that was used (its head included). Bytes only, through the whole core,
as conversations: every command the core returns is asserted in order, timers included.
"""

from __future__ import annotations

import pytest
from checks import h1_response
from playbook import H1ClientPeer, Sends, closed, data
from test_routing_exchange import Routing, body_is, fleet

from muxproxy.core.commands import CancelTimer, CloseConnection, PauseReading, SetTimer
from muxproxy.core.streams.commit import CommitPoint

ROLE_ONLY = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
CONTENT = b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'


def held(rig: Routing, up: int, chunk: bytes) -> None:
    """The backend on ``up`` sends ``chunk``: it is held, and nothing at all goes out."""
    rig.pb >> data(up, rig.chunk(up, chunk))
    rig.pb.done()


def head_goes_out(rig: Routing, conn: int, client: H1ClientPeer, backend_id: bytes) -> None:
    """The held head (of the backend ``backend_id``) goes out; the read deadline restarts."""
    pb = rig.pb
    pb << SetTimer(timer=("send", conn), at=pb.now + rig.send_s)
    pb << Sends(conn, client, h1_response(200, headers={b"x-backend-id": backend_id}))
    pb << SetTimer(timer=("read", conn), at=pb.now + rig.read_s)


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
    rig = Routing(fleet(retry_until_first_event=True))
    pb = rig.pb
    conn, client, first = rig.ask()
    rig.accept(first.conn, conn)
    rig.sse_head(first.conn, conn, "gpu0")
    held(rig, first.conn, before_death)  # held: neither the head nor the bytes went out
    pb >> closed(first.conn)
    pb << CancelTimer(timer=("read", conn))
    second = rig.attempt(conn, avoid={first.server})
    pb.done()  # nothing of the first attempt reached the client
    assert rig.logs("retry")[0].fields["condition"] == "error"
    rig.accept(second.conn, conn)
    rig.sse_head(second.conn, conn, "gpu1")
    held(rig, second.conn, ROLE_ONLY)
    pb >> data(second.conn, rig.chunk(second.conn, CONTENT))
    head_goes_out(rig, conn, client, b"gpu1")
    pb << Sends(conn, client, body_is(ROLE_ONLY + CONTENT, end=False))  # nothing of the first
    pb.done()
    rig.stream_ends(second.conn, conn, client)
    assert rig.logs("access")[0].fields["outcome"] == "ok"


def test_held_bytes_go_out_with_the_first_content_event() -> None:
    rig = Routing(fleet(retry_until_first_event=True))
    pb = rig.pb
    conn, client, up = rig.ask()
    rig.accept(up.conn, conn)
    rig.sse_head(up.conn, conn, "gpu0")
    held(rig, up.conn, b": ping\n\n")
    held(rig, up.conn, ROLE_ONLY + CONTENT[:20])
    pb >> data(up.conn, rig.chunk(up.conn, CONTENT[20:]))
    head_goes_out(rig, conn, client, b"gpu0")
    pb << Sends(conn, client, body_is(b": ping\n\n" + ROLE_ONLY + CONTENT, end=False))
    pb.done()
    # Streamed from here on, one chunk at a time.
    pb >> data(up.conn, rig.chunk(up.conn, b"data: [DONE]\n\n"))
    pb << Sends(conn, client, body_is(b"data: [DONE]\n\n", end=False))
    pb.done()


def test_held_response_that_ends_without_content_goes_out_whole() -> None:
    rig = Routing(fleet(retry_until_first_event=True))
    pb = rig.pb
    conn, client, up = rig.ask()
    rig.accept(up.conn, conn)
    rig.sse_head(up.conn, conn, "gpu0")
    held(rig, up.conn, ROLE_ONLY + b"data: [DONE]\n\n")
    pb >> data(up.conn, rig.end(up.conn))
    head_goes_out(rig, conn, client, b"gpu0")
    pb << Sends(conn, client, body_is(ROLE_ONLY + b"data: [DONE]\n\n"))
    pb << CloseConnection(conn=up.conn)
    pb << CancelTimer(timer=("read", conn))
    pb << SetTimer(timer=("idle", conn), at=pb.now + rig.idle_s)
    pb.done()


def test_held_bytes_are_bounded() -> None:
    """A backend that sends more than a stream's buffer before its first token is committed
    to with what it sent: holding more would be unbounded."""
    rig = Routing(fleet(retry_until_first_event=True))
    pb = rig.pb
    conn, client, up = rig.ask()
    rig.accept(up.conn, conn)
    rig.sse_head(up.conn, conn, "gpu0")
    comment = b": " + b"x" * 1000 + b"\n\n"
    high_water = pb.core.fx.limits.high_water
    count = high_water // len(comment) + 1  # the first count of comments past the buffer
    for _ in range(count - 1):
        held(rig, up.conn, comment)
    pb >> data(up.conn, rig.chunk(up.conn, comment))
    head_goes_out(rig, conn, client, b"gpu0")
    pb << Sends(conn, client, body_is(comment * count, end=False))
    pb << PauseReading(conn=up.conn)  # the client has a buffer's worth to take first
    pb.done()


@pytest.mark.parametrize("sep", [b"\n", b"\r\n", b"\r"])
def test_commit_point_is_the_end_of_the_first_content_event_byte_by_byte(sep: bytes) -> None:
    """Fed one byte at a time, in the stream's own line ends: the held bytes come out with
    the byte that ends the first content event, and not before."""
    stream = b": ping" + sep + sep + b"event: x" + sep + sep + b"data: tok" + sep + sep
    point = CommitPoint(limit=1 << 16)
    out = [point.take(stream[i : i + 1]) for i in range(len(stream))]
    assert out[:-1] == [None] * (len(stream) - 1)
    assert out[-1] == stream

"""An exchange's backend timers (``core/exchange/deadlines.py``) count only the time in which the
proxy reads the backend: a backend the proxy paused because the client is behind (its connection
above ``connection_buffer``, or this stream's own buffer full) is not late, is not failed and
is not counted against its server's passive health; its timers count afresh once it is read
again. Bytes from real h2/h11 peers; time moves only through ``pb.now``, and every timer fires
when it falls due (``advance``).
"""

from __future__ import annotations

from typing import Any

import attrs
import h2.events
import h2.settings
import h11
from playbook import BACKEND, H1BackendPeer, H1ClientPeer, H2ClientPeer, default_config
from test_h2guard import Book, closed_conns

from muxproxy.config import Limits, Server, Timeouts
from muxproxy.core.commands import PauseReading, ResumeReading, SetTimer
from muxproxy.core.events import Wakeup

TIMEOUT = 5.0


def book(**limits: int) -> Book:
    """One server that is down after a single failure (so any blame shows), short timeouts."""
    config = default_config(
        timeouts=Timeouts(response_head=TIMEOUT, read=TIMEOUT),
        limits=attrs.evolve(Limits(), **limits),
    )
    group = config.upstreams["default"]
    one = Server(address=BACKEND, max_fails=1, fail_timeout=600)
    upstreams = {"default": attrs.evolve(group, servers=(one,), pool_max_idle=0)}
    pb = Book(attrs.evolve(config, upstreams=upstreams))
    pb.accept(1)
    return pb


def advance(pb: Book, now: float) -> None:
    """Time moves to ``now``, delivering every armed timer that falls due on the way, in order
    (as a driver would)."""
    while True:
        armed: dict[Any, float] = {}
        for command in pb.log:
            if isinstance(command, SetTimer):
                armed[command.timer] = command.at
        due = sorted(
            (at, str(timer[0]), timer)
            for timer, at in armed.items()
            if timer in pb.core.fx.timers and at <= now
        )
        if not due:
            break
        at, _, timer = due[0]
        pb.now = max(pb.now, at)
        pb.feed(Wakeup(now=pb.now, timer=timer))
    pb.now = now


def sse_chunk(text: bytes) -> bytes:
    return b"%x\r\n" % len(text) + text + b"\r\n"


def open_h2_stream(pb: Book, client: H2ClientPeer, data: bytes = b"") -> tuple[int, int, Any]:
    """A GET on connection 1 whose backend connection opened and took the request: (stream
    id, backend conn, backend peer)."""
    before = len(pb.opens())
    sid, request = client.request(b"GET", b"/v1/stream")
    pb.receive(1, data + request)
    up = pb.opens()[before].conn
    pb.opened(up)
    backend = H1BackendPeer()
    assert isinstance(backend.events(pb.take(up))[0], h11.Request)
    return sid, up, backend


def test_backend_paused_by_a_congested_connection_is_not_late_with_its_head() -> None:
    """Stream 2's backend is paused before its head came (stream 1 filled the connection):
    its head timeout passes many times while the client reads nothing; once the client reads,
    the head comes and the stream completes, and the server was never failed."""
    bound = 64 * 1024
    pb = book(connection_buffer=bound)
    client = H2ClientPeer()
    client.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
    client.conn.increment_flow_control_window(2**31 - 1 - 65535)
    sid1, up1, backend1 = open_h2_stream(pb, client, client.preface())
    sid2, up2, backend2 = open_h2_stream(pb, client)
    pb.receive(up1, backend1.sse_head())
    event = b"data: " + b"z" * 16000 + b"\n\n"
    while not any(c == PauseReading(conn=up2) for c in pb.log):
        pb.receive(up1, sse_chunk(event))
    advance(pb, 10 * TIMEOUT)  # the client reads nothing for ten head (and read) timeouts
    assert not {up1, up2} & closed_conns(pb)
    # The client reads everything: both backends are read again, and answer.
    down = pb.core.clients[1]
    resumed = {c.conn for c in pb.sent(1, down.pending) if isinstance(c, ResumeReading)}
    assert resumed == {up1, up2}
    advance(pb, 10 * TIMEOUT + TIMEOUT / 2)  # within a timeout of the resume: not late yet
    pb.receive(up2, backend2.sse_head() + sse_chunk(b"data: two\n\n") + backend2.end())
    pb.receive(up1, sse_chunk(b"data: one\n\n") + backend1.end())
    events = client.events(pb.fresh())
    heads = {
        e.stream_id: dict(e.headers) for e in events if isinstance(e, h2.events.ResponseReceived)
    }
    assert heads[sid2][b":status"] == b"200"
    ended = {e.stream_id for e in events if isinstance(e, h2.events.StreamEnded)}
    assert ended == {sid1, sid2}
    body2 = b"".join(
        e.data for e in events if isinstance(e, h2.events.DataReceived) and e.stream_id == sid2
    )
    assert body2 == b"data: two\n\n"
    # Not marked down: a new request still goes to the server (one failure would have).
    before = len(pb.opens())
    _, request = client.request(b"GET", b"/v1/again")
    pb.receive(1, request)
    assert len(pb.opens()) == before + 1


def test_backend_paused_by_a_slow_client_is_not_late() -> None:
    """A slow HTTP/1.1 client fills the stream's buffer: its backend is paused for longer than
    the read timeout, is not failed, and the stream completes once the client reads."""
    pb = book()
    client = H1ClientPeer()
    pb.receive(1, client.request("GET", "/v1/stream"))
    up = pb.opens()[0].conn
    pb.opened(up)
    backend = H1BackendPeer()
    backend.events(pb.take(up))
    pb.receive(up, backend.sse_head())
    event = b"data: " + b"z" * 16000 + b"\n\n"
    sent = b""
    while not any(c == PauseReading(conn=up) for c in pb.log):
        pb.receive(up, sse_chunk(event))
        sent += event
    advance(pb, 10 * TIMEOUT)
    assert up not in closed_conns(pb)
    pb.sent(1, pb.core.clients[1].pending)
    pb.receive(up, sse_chunk(b"data: end\n\n") + backend.end())
    events = client.events(pb.fresh())
    body = b"".join(bytes(e.data) for e in events if isinstance(e, h11.Data))
    assert body == sent + b"data: end\n\n"
    assert isinstance(events[-1], h11.EndOfMessage)

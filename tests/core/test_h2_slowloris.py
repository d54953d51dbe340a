"""HTTP/2 resource holding: graceful shutdown GOAWAY, the request-body idle deadline (slowloris
with HEADERS and no DATA) and the per-connection bound on unsent output, as whole conversations:
every command is asserted in order, timers included. Bytes from a real h2 client; raw frames
parsed with hyperframe where h2 as a client refuses frames after a GOAWAY; what reaches a
backend decoded by a real h11 server peer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import h2.errors
import h2.events
import h2.settings
import h11
import hyperframe.frame
from checks import Check, h1_request, h2_body, h2_resets, h2_response
from playbook import (
    H1BackendPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    data,
    default_config,
    opened,
    sent,
    wakeup,
)
from test_h2guard import ORIGIN, Book, Frames, acked, preface, settings, sse_stream

from muxproxy.config import Limits, Timeouts
from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    Command,
    OpenConnection,
    PauseReading,
    ResumeReading,
    SetTimer,
)
from muxproxy.core.events import ShutdownRequested
from muxproxy.core.http2.h2 import SHUTDOWN_PING

NO_ERROR = h2.errors.ErrorCodes.NO_ERROR
CANCEL = h2.errors.ErrorCodes.CANCEL
REFUSED = h2.errors.ErrorCodes.REFUSED_STREAM
UPLOAD = b"/v1/chat/completions"


def book(*, client_header: float = 5.0, **limits: int) -> Book:
    config = default_config(
        timeouts=Timeouts(client_header=client_header),
        limits=attrs.evolve(Limits(), **limits),
    )
    pb = Book(config)
    pb.accept(1)  # set-up: its header timer is not asserted
    return pb


# -- set-up helpers shared with other modules' tests (they feed events without asserting) ---


def sse_chunk(text: bytes) -> bytes:
    return b"%x\r\n" % len(text) + text + b"\r\n"


def data_of(frames: list[hyperframe.frame.Frame], sid: int) -> bytes:
    return b"".join(
        f.data for f in frames if isinstance(f, hyperframe.frame.DataFrame) and f.stream_id == sid
    )


def resets(frames: list[hyperframe.frame.Frame]) -> dict[int, int]:
    return {
        f.stream_id: f.error_code for f in frames if isinstance(f, hyperframe.frame.RstStreamFrame)
    }


def open_upload(pb: Book, client: H2ClientPeer, *, connect: bool = True) -> tuple[int, int]:
    """POST HEADERS without END_STREAM; return (stream, backend conn)."""
    before = len(pb.opens())
    sid = client.conn.get_next_available_stream_id()
    headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"a")]
    client.conn.send_headers(sid, [*headers, (b":path", UPLOAD)])
    pb.receive(1, client.conn.data_to_send())
    up = pb.opens()[before].conn
    if connect:
        pb.opened(up)
    return sid, up


def tick(pb: Book, now: float) -> None:
    """Time moves to ``now``; every exchange's ``body`` timer fires (the lazy handler re-arms
    those not due; the core ignores ones not armed)."""
    pb.now = now
    for ident in list(pb.core.exchanges):
        pb.wakeup("body", ident)


# -- checks on what a peer decoded ----------------------------------------------------------


def frames_carry(sid: int, body: bytes) -> Check:
    """Raw frames: stream ``sid``'s DATA is ``body``, and nothing is reset."""

    def check(frames: Sequence[Any]) -> None:
        assert data_of(list(frames), sid) == body, frames
        assert resets(list(frames)) == {}, frames

    return check


def one_goaway(last_stream_id: int) -> Check:
    """Raw frames: exactly one GOAWAY(NO_ERROR) naming ``last_stream_id``."""

    def check(frames: Sequence[Any]) -> None:
        (end,) = [f for f in frames if isinstance(f, hyperframe.frame.GoAwayFrame)]
        assert end.error_code == NO_ERROR and end.last_stream_id == last_stream_id, end

    return check


def upload_head(events: Sequence[Any]) -> None:
    """The backend got the upload's request head and no body yet."""
    assert len(events) == 1 and isinstance(events[0], h11.Request), events
    assert events[0].method == b"POST" and events[0].target == UPLOAD, events[0]


def body_bytes(body: bytes) -> Check:
    """The backend got these body bytes, and the request goes on."""
    return lambda events: [type(e) for e in events] == [h11.Data] and events[0].data == body


def body_end(events: Sequence[Any]) -> None:
    assert [type(e) for e in events] == [h11.EndOfMessage], events


class InAnyOrder:
    """The next ``len(expected)`` commands are ``expected`` in some order: for commands whose
    order among themselves is no part of the behaviour (a tie broken by a heap)."""

    def __init__(self, *expected: Command) -> None:
        self.expected = expected

    def take(self, queue: list[Command]) -> None:
        got, n = queue[: len(self.expected)], len(self.expected)
        assert sorted(map(repr, got)) == sorted(map(repr, self.expected)), (self.expected, queue)
        del queue[:n]


# -- the conversation's steps -----------------------------------------------------------------


def upload(
    pb: Playbook,
    client: H2ClientPeer,
    *,
    ex: int,
    connect: bool = True,
    gap: float = 5.0,
    head: float = 60.0,
) -> tuple[int, H1BackendPeer]:
    """POST HEADERS without END_STREAM on client connection 1 (exchange ``ex``, backend
    connection ``-ex``): the body deadline (``gap``, the client_header timeout) is armed;
    ``connect``: the backend connection opens and gets the request head, and the
    response-head deadline (``head``) starts. Returns the stream id and the backend peer."""
    sid = client.conn.get_next_available_stream_id()
    headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"a")]
    client.conn.send_headers(sid, [*headers, (b":path", UPLOAD)])
    pb >> data(1, client.conn.data_to_send())
    if ex == 1:
        pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", ex), at=pb.now + 5.0)
    pb << OpenConnection(conn=-ex, origin=ORIGIN)
    pb << SetTimer(timer=("body", ex), at=pb.now + gap)
    backend = H1BackendPeer()
    if connect:
        pb >> opened(-ex)
        pb << CancelTimer(timer=("connect", ex))
        pb << Sends(-ex, backend, upload_head)
        pb << SetTimer(timer=("head", ex), at=pb.now + head)
    return sid, backend


def sse_opened(
    pb: Playbook, client: H2ClientPeer, *, ex: int, read: float = 300.0
) -> tuple[int, H1BackendPeer]:
    """A GET of /v1/stream on client connection 1 (exchange ``ex``; the first comes with the
    client's preface) opens backend connection ``-ex``, which answers with an SSE head relayed
    on the stream; the read deadline (``read``) starts. Returns the stream id and the backend
    peer."""
    sid, request = client.request(b"GET", b"/v1/stream")
    if ex == 1:
        pb >> data(1, client.preface() + request)
        pb << SetTimer(timer=("send", 1), at=pb.now + 60.0)
        pb << Sends(1, client, settings)
        pb << CancelTimer(timer=("header", 1))
    else:
        pb >> data(1, request)
    pb << SetTimer(timer=("connect", ex), at=pb.now + 5.0)
    pb << OpenConnection(conn=-ex, origin=ORIGIN)
    if ex == 1:
        pb << Sends(1, client, acked)
    backend = H1BackendPeer()
    pb >> opened(-ex)
    pb << CancelTimer(timer=("connect", ex))
    pb << Sends(-ex, backend, h1_request(b"GET", b"/v1/stream"))
    pb << SetTimer(timer=("head", ex), at=pb.now + 60.0)
    pb >> data(-ex, backend.sse_head())
    pb << CancelTimer(timer=("head", ex))
    pb << Sends(1, client, h2_response(sid, 200, b"", ended=False))
    pb << SetTimer(timer=("read", ex), at=pb.now + read)
    return sid, backend


# -- graceful shutdown ---------------------------------------------------------------------------


def test_shutdown_goaway_lets_the_running_stream_finish_and_refuses_new_ones() -> None:
    pb = book()
    client = H2ClientPeer()
    frames = Frames()
    sid, backend = sse_stream(pb, client)
    pb >> data(-1, backend.chunk(b"data: one\n\n"))
    pb << Sends(1, frames, frames_carry(sid, b"data: one\n\n"))
    pb >> ShutdownRequested(now=pb.now, deadline=pb.now + 30)
    pb << Sends(1, frames, one_goaway(2**31 - 1))
    pb << SetTimer(timer=("goaway", 1), at=1.0)
    pb << SetTimer(timer=("shutdown", 0), at=30.0)
    # The client answers the PING that came with it: the final GOAWAY names the real last.
    ack = hyperframe.frame.PingFrame(0, flags=["ACK"])
    ack.opaque_data = SHUTDOWN_PING
    pb >> data(1, ack.serialize())
    pb << Sends(1, frames, one_goaway(sid))
    # A stream opened after that is refused, reaching no backend.
    late, request = client.request(b"GET", b"/v1/late")
    pb >> data(1, request)
    pb << Sends(1, frames, lambda got: resets(list(got)) == {late: REFUSED})
    # The running stream still sends (h2 no longer raises ProtocolError) and ends cleanly.
    pb >> data(-1, backend.chunk(b"data: two\n\n") + backend.end())
    pb << (last := Sends(1, frames, frames_carry(sid, b"data: two\n\n")))
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("read", 1))
    pb << CloseConnection(conn=1)
    pb.done()
    assert "END_STREAM" in last.events[-1].flags and last.events[-1].stream_id == sid


# -- request-body idle deadline (slowloris) ------------------------------------------------------


def test_idle_upload_is_reset_after_the_deadline_and_others_go_on() -> None:
    pb = book(client_header=5.0)
    client = H2ClientPeer()
    other, backend = sse_stream(pb, client)  # exchange 1, backend connection -1
    idle, _ = upload(pb, client, ex=2)
    pb.now = 4.9
    pb >> wakeup("body", 1)  # exchange 1 has no body deadline: nothing
    pb >> wakeup("body", 2)  # not due: re-armed
    pb << SetTimer(timer=("body", 2), at=5.0)
    pb.now = 5.0
    pb >> wakeup("body", 1)
    pb >> wakeup("body", 2)
    pb << Sends(1, client, h2_resets((idle, CANCEL)))
    pb << CloseConnection(conn=-2)
    pb << CancelTimer(timer=("head", 2))
    # The streaming response on the same connection is untouched (connection 1 stays open).
    pb >> data(-1, backend.chunk(b"data: tok\n\n"))
    pb << Sends(1, client, lambda events: h2_body(events, other) == b"data: tok\n\n")
    pb.done()


def test_slow_but_steady_upload_is_not_reset() -> None:
    pb = book(client_header=5.0)
    client = H2ClientPeer()
    preface(pb, client)
    sid, backend = upload(pb, client, ex=1)
    for step in range(1, 8):
        pb.now = step * 4.0
        client.conn.send_data(sid, b"x" * 10)
        pb >> data(1, client.conn.data_to_send())
        pb << Sends(-1, backend, body_bytes(b"x" * 10))
        pb.now += 1.0
        pb >> wakeup("body", 1)  # the body moved within the deadline: re-armed from it
        pb << SetTimer(timer=("body", 1), at=step * 4.0 + 5.0)
    client.conn.end_stream(sid)
    pb >> data(1, client.conn.data_to_send())
    pb << Sends(-1, backend, body_end)
    pb.now = 100.0
    pb >> wakeup("body", 1)  # body complete: the deadline no longer applies
    pb.done()  # no RST_STREAM, backend connection -1 open


def test_upload_whose_window_we_withhold_is_not_reset() -> None:
    # stream_buffer 16 KiB: read_size 8 KiB, high water 8 KiB, a stream window of 8 KiB.
    pb = book(client_header=5.0, stream_buffer=16 * 1024)
    client = H2ClientPeer()
    preface(pb, client)  # our SETTINGS (the smaller window) reach the client
    pb >> data(1, client.conn.data_to_send())  # its ACK
    sid, _ = upload(pb, client, ex=1, connect=False)  # the backend connection hangs
    window = client.conn.local_flow_control_window(sid)
    client.conn.send_data(sid, b"x" * window)
    pb >> data(1, client.conn.data_to_send())  # held: no backend to send it to
    (stats,) = pb.core.statistics().streams
    assert stats.request_buffered >= pb.core.limits.high_water  # window withheld
    for now in (5.0, 10.0, 20.0):
        pb.now = now
        pb >> wakeup("body", 1)  # we withhold the window: the deadline waits with it
        pb << SetTimer(timer=("body", 1), at=now + 5.0)
    pb.done()  # no RST_STREAM, backend connection -1 not closed


def test_upload_answered_by_the_backend_is_not_reset() -> None:
    pb = book(client_header=5.0)
    client = H2ClientPeer()
    preface(pb, client)
    sid, _ = upload(pb, client, ex=1)
    pb >> data(-1, b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
    pb << CancelTimer(timer=("head", 1))
    pb << Sends(1, client, h2_response(sid, 200, b"", ended=False))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb.now = 50.0
    pb >> wakeup("body", 1)  # answered: the deadline no longer applies
    pb.done()  # no RST_STREAM, backend connection -1 open


# -- per-connection output bound ---------------------------------------------------------------


def streams_on_wide_windows(
    bound: int, streams: int
) -> tuple[Book, H2ClientPeer, list[tuple[int, H1BackendPeer]]]:
    """A core with ``connection_buffer=bound`` and ``streams`` SSE streams of one HTTP/2
    client whose windows are wide open: every byte goes to the socket at once, none waits in a
    stream queue. Stream i is exchange i + 1 on backend connection -(i + 1). Returns
    (playbook, client, (stream id, backend peer) of each)."""
    pb = book(connection_buffer=bound)
    client = H2ClientPeer()
    client.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
    client.conn.increment_flow_control_window(2**31 - 1 - 65535)
    out = [sse_opened(pb, client, ex=ex) for ex in range(1, streams + 1)]
    pb.done()
    return pb, client, out


def test_connection_buffer_pauses_every_backend_and_resumes_below_half() -> None:
    bound = 64 * 1024
    pb, client, streams = streams_on_wide_windows(bound, 8)
    ups = [-ex for ex in range(1, 9)]
    core = pb.core
    down = core.clients[1]
    # Each backend read here carries one 16,008-byte event: one DATA frame to the client.
    event = b"data: " + b"z" * 16000 + b"\n\n"
    assert len(event) <= min(16384, core.read_size)
    out_per_read = len(event) + 9  # the body bytes plus one DATA frame header
    peak = 0

    def read(i: int) -> None:
        nonlocal peak
        sid, backend = streams[i]
        pb >> data(ups[i], backend.chunk(event))
        pb << Sends(1, client, lambda events: h2_body(events, sid) == event)
        peak = max(peak, down.pending)

    # Five reads fill the connection past the bound: every backend is paused at once.
    for i in range(5):
        read(i)
    for up in ups:
        pb << PauseReading(conn=up)
    # A real driver delivers at most one read after PauseReading: each backend's is relayed,
    # and nothing more is read (a paused backend is not read again).
    for i in [5, 6, 7, 0, 1, 2, 3, 4]:
        read(i)
    pb.done()
    # The bound documented in ``core/client/output.py`` (control frames aside: none here).
    assert peak <= bound + (len(ups) + 1) * out_per_read
    assert all(s.upstream_paused for s in core.statistics().streams)
    # Writing down to above half resumes nothing; below half resumes every backend, the
    # three that delivered one read before the five that delivered two.
    pb >> sent(1, down.pending - bound // 2 - 1)
    pb >> sent(1, down.pending)
    pb << InAnyOrder(*[ResumeReading(conn=up) for up in ups[5:]])
    pb << InAnyOrder(*[ResumeReading(conn=up) for up in ups[:5]])
    pb.done()


def test_congested_connection_resumes_least_served_backends_first() -> None:
    """The driver reads resumed backends in the order they were resumed, and the first ones
    can fill the connection again: a fixed order would starve the last streams for good."""
    pb, client, streams = streams_on_wide_windows(64 * 1024, 6)
    ups = [-ex for ex in range(1, 7)]
    down = pb.core.clients[1]
    event = b"data: " + b"z" * 4000 + b"\n\n"

    def read(i: int) -> None:
        sid, backend = streams[i]
        pb >> data(ups[i], backend.chunk(event))
        pb << Sends(1, client, lambda events: h2_body(events, sid) == event)

    # The first backends delivered the most before the connection filled up: least served
    # first is the reverse of the order the core holds them in.
    for i, reads in [(5, 1), (4, 2), (3, 3), (2, 4), (1, 5)]:
        for _ in range(reads):
            read(i)
    read(0)
    read(0)  # the 17th read fills the connection: every backend is paused
    for up in ups:
        pb << PauseReading(conn=up)
    for _ in range(4):
        read(0)  # reads the driver had under way still arrive, and are relayed
    pb.done()
    assert all(s.upstream_paused for s in pb.core.statistics().streams)
    pb >> sent(1, down.pending)
    for up in reversed(ups):
        pb << ResumeReading(conn=up)
    pb.done()

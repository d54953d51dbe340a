"""HTTP/2 resource holding: graceful shutdown GOAWAY, the request-body idle deadline (slowloris
with HEADERS and no DATA) and the per-connection bound on unsent output. Bytes from a real h2
client; raw frames parsed with hyperframe where h2 as a client refuses frames after a GOAWAY."""

from __future__ import annotations

from typing import Any

import attrs
import h2.errors
import h2.settings
import hyperframe.frame
from playbook import H2ClientPeer, default_config, h2_sse_stream
from test_h2guard import Book, closed_conns, parse

from muxproxy.config import Limits, Timeouts
from muxproxy.core.commands import PauseReading, ResumeReading
from muxproxy.core.events import ShutdownRequested
from muxproxy.core.http2.h2 import SHUTDOWN_PING

NO_ERROR = h2.errors.ErrorCodes.NO_ERROR
CANCEL = h2.errors.ErrorCodes.CANCEL


def book(*, client_header: float = 5.0, **limits: int) -> Book:
    config = default_config(
        timeouts=Timeouts(client_header=client_header),
        limits=attrs.evolve(Limits(), **limits),
    )
    pb = Book(config)
    pb.accept(1)
    return pb


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


# -- graceful shutdown ---------------------------------------------------------------------------


def test_shutdown_goaway_lets_the_running_stream_finish_and_refuses_new_ones() -> None:
    pb = book()
    client = H2ClientPeer()
    sid, up = h2_sse_stream(pb, client, data=client.preface())
    pb.receive(up, sse_chunk(b"data: one\n\n"))
    assert data_of(parse(pb.fresh()), sid) == b"data: one\n\n"
    pb.feed(ShutdownRequested(now=pb.now, deadline=pb.now + 30))
    (first,) = [f for f in parse(pb.fresh()) if isinstance(f, hyperframe.frame.GoAwayFrame)]
    assert first.error_code == NO_ERROR and first.last_stream_id == 2**31 - 1
    # The client answers the PING that came with it: the final GOAWAY names the real last.
    ack = hyperframe.frame.PingFrame(0, flags=["ACK"])
    ack.opaque_data = SHUTDOWN_PING
    pb.receive(1, ack.serialize())
    (end,) = [f for f in parse(pb.fresh()) if isinstance(f, hyperframe.frame.GoAwayFrame)]
    assert end.error_code == NO_ERROR and end.last_stream_id == sid
    # A stream opened after that is refused, reaching no backend.
    late, data = client.request(b"GET", b"/v1/late")
    pb.receive(1, data)
    assert resets(parse(pb.fresh())) == {late: h2.errors.ErrorCodes.REFUSED_STREAM}
    assert len(pb.opens()) == 1 and 1 not in closed_conns(pb)
    # The running stream still sends (h2 no longer raises ProtocolError) and ends cleanly.
    pb.receive(up, sse_chunk(b"data: two\n\n") + b"0\r\n\r\n")
    frames = parse(pb.fresh())
    assert data_of(frames, sid) == b"data: two\n\n"
    assert "END_STREAM" in frames[-1].flags and frames[-1].stream_id == sid
    assert 1 in closed_conns(pb)


# -- request-body idle deadline (slowloris) ------------------------------------------------------


def open_upload(pb: Book, client: H2ClientPeer, *, connect: bool = True) -> tuple[int, int]:
    """POST HEADERS without END_STREAM; return (stream, backend conn)."""
    before = len(pb.opens())
    sid = client.conn.get_next_available_stream_id()
    headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"a")]
    client.conn.send_headers(sid, [*headers, (b":path", b"/v1/chat/completions")])
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


def test_idle_upload_is_reset_after_the_deadline_and_others_go_on() -> None:
    pb = book(client_header=5.0)
    client = H2ClientPeer()
    other, other_up = h2_sse_stream(pb, client, data=client.preface())
    idle, idle_up = open_upload(pb, client)
    pb.fresh()
    tick(pb, 4.9)
    assert resets(parse(pb.fresh())) == {}
    tick(pb, 5.0)
    assert resets(parse(pb.fresh())) == {idle: CANCEL}
    assert idle_up in closed_conns(pb)
    assert 1 not in closed_conns(pb) and other_up not in closed_conns(pb)
    # The streaming response on the same connection is untouched.
    pb.receive(other_up, sse_chunk(b"data: tok\n\n"))
    assert data_of(parse(pb.fresh()), other) == b"data: tok\n\n"


def test_slow_but_steady_upload_is_not_reset() -> None:
    pb = book(client_header=5.0)
    client = H2ClientPeer()
    pb.receive(1, client.preface())
    sid, up = open_upload(pb, client)
    for step in range(1, 8):
        pb.now = step * 4.0
        client.conn.send_data(sid, b"x" * 10)
        pb.receive(1, client.conn.data_to_send())
        tick(pb, pb.now + 1.0)
    assert resets(parse(pb.fresh())) == {}
    assert up not in closed_conns(pb)
    client.conn.end_stream(sid)
    pb.receive(1, client.conn.data_to_send())
    tick(pb, 100.0)  # body complete: the deadline no longer applies
    assert resets(parse(pb.fresh())) == {}
    assert up not in closed_conns(pb)


def test_upload_whose_window_we_withhold_is_not_reset() -> None:
    # stream_buffer 16 KiB: read_size 8 KiB, high water 8 KiB, a stream window of 8 KiB.
    pb = book(client_header=5.0, stream_buffer=16 * 1024)
    client = H2ClientPeer()
    pb.receive(1, client.preface())
    client.events(pb.fresh())  # our SETTINGS (the smaller window) reach the client
    pb.receive(1, client.conn.data_to_send())
    sid, up = open_upload(pb, client, connect=False)  # the backend connection hangs
    window = client.conn.local_flow_control_window(sid)
    client.conn.send_data(sid, b"x" * window)
    pb.receive(1, client.conn.data_to_send())
    (stats,) = pb.core.statistics().streams
    assert stats.request_buffered >= pb.core.limits.high_water  # window withheld
    for now in (5.0, 10.0, 20.0):
        tick(pb, now)
    assert resets(parse(pb.fresh())) == {}
    assert up not in closed_conns(pb)


def test_upload_answered_by_the_backend_is_not_reset() -> None:
    pb = book(client_header=5.0)
    client = H2ClientPeer()
    pb.receive(1, client.preface())
    _, up = open_upload(pb, client)
    pb.receive(up, b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
    tick(pb, 50.0)
    assert resets(parse(pb.fresh())) == {}
    assert up not in closed_conns(pb)


# -- per-connection output bound ---------------------------------------------------------------


def streams_on_wide_windows(bound: int, streams: int) -> tuple[Any, list[int]]:
    """A core with ``connection_buffer=bound`` and ``streams`` SSE streams of one HTTP/2
    client whose windows are wide open: every byte goes to the socket at once, none waits in a
    stream queue. Returns (playbook, backend connection ids)."""
    pb = book(connection_buffer=bound)
    client = H2ClientPeer()
    client.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
    client.conn.increment_flow_control_window(2**31 - 1 - 65535)
    preface = client.preface()
    ups = [h2_sse_stream(pb, client, data=preface if i == 0 else b"")[1] for i in range(streams)]
    client.events(pb.fresh())
    return pb, ups


def test_connection_buffer_pauses_every_backend_and_resumes_below_half() -> None:
    bound = 64 * 1024
    pb, ups = streams_on_wide_windows(bound, 8)
    core = pb.core
    down = core.clients[1]
    paused: set[int] = set()
    in_flight_used: set[int] = set()
    peak = 0
    # Each backend read here carries one 16,008-byte event: one DATA frame to the client.
    event = b"data: " + b"z" * 16000 + b"\n\n"
    assert len(event) <= min(16384, core.read_size)
    chunk = sse_chunk(event)
    out_per_read = len(event) + 9  # the body bytes plus one DATA frame header
    for _ in range(20):
        for up in ups:
            # A real driver delivers at most one read after PauseReading.
            if up in paused:
                if up in in_flight_used:
                    continue
                in_flight_used.add(up)
            commands = pb.receive(up, chunk)
            peak = max(peak, down.pending)
            paused |= {c.conn for c in commands if isinstance(c, PauseReading)}
    # The bound documented in ``core/client/output.py`` (control frames aside: none here).
    assert peak <= bound + (len(ups) + 1) * out_per_read
    assert paused == set(ups)
    stats = core.statistics().streams
    assert all(s.upstream_paused for s in stats)
    # Writing down to above half resumes nothing; below half resumes every backend.
    commands = pb.sent(1, down.pending - bound // 2 - 1)
    assert not [c for c in commands if isinstance(c, ResumeReading)]
    commands = pb.sent(1, down.pending)
    assert {c.conn for c in commands if isinstance(c, ResumeReading)} == set(ups)


def test_congested_connection_resumes_least_served_backends_first() -> None:
    """The driver reads resumed backends in the order they were resumed, and the first ones
    can fill the connection again: a fixed order would starve the last streams for good."""
    pb, ups = streams_on_wide_windows(64 * 1024, 6)
    down = pb.core.clients[1]
    chunk = sse_chunk(b"data: " + b"z" * 4000 + b"\n\n")
    # The first backends delivered the most before the connection filled up: least served
    # first is the reverse of the order the core holds them in.
    for reads, up in zip([1, 2, 3, 4, 5, 6], reversed(ups), strict=True):
        for _ in range(reads):
            pb.receive(up, chunk)
    while not all(s.upstream_paused for s in pb.core.statistics().streams):
        pb.receive(ups[0], chunk)
    commands = pb.sent(1, down.pending)
    resumed = [c.conn for c in commands if isinstance(c, ResumeReading)]
    assert resumed == list(reversed(ups))

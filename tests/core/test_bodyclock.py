"""The whole-body deadline (``timeouts.client_body``, ``core/http/bodyclock.py``): a request
body trickled just under the gap bound (``timeouts.client_header``) is cut once its deadline
passes, with a 408 over HTTP/1.1 (and the close) and HTTP/2 (and RST_STREAM(NO_ERROR) for the
rest; the connection's other streams go on), and counted; time in which the proxy stopped the
client is not counted. Bytes from real h11/h2 peers; time moves only through ``pb.now``.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import h2.errors
import h2.events
import h11
from checks import h1_body, h1_response
from playbook import (
    H1BackendPeer,
    H1ClientPeer,
    H2ClientPeer,
    Sends,
    data,
    default_config,
    h2_sse_stream,
    opened,
    wakeup,
)
from test_h2_slowloris import data_of, open_upload, sse_chunk, tick
from test_h2guard import Book, closed_conns, parse
from test_routing_exchange import Opens

from muxproxy.config import Limits, Timeouts
from muxproxy.core.commands import CancelTimer, CloseConnection, SetTimer

GAP = 5.0
WHOLE = 12.0


def book(**limits: int) -> Book:
    config = default_config(
        timeouts=Timeouts(client_header=GAP, client_body=WHOLE),
        limits=attrs.evolve(Limits(), **limits),
    )
    pb = Book(config)
    pb.accept(1)
    return pb


def trickle(pb: Book, send: Callable[[], object], until: float) -> None:
    """One body byte every ``GAP - 1`` seconds (never a gap of ``GAP``) up to ``until``,
    every due ``body`` timer delivered on the way."""
    while pb.now + GAP - 1 < until:
        tick(pb, pb.now + GAP - 1)
        send()


def test_h2_body_trickled_under_the_gap_gets_408_at_its_deadline_and_others_go_on() -> None:
    pb = book()
    client = H2ClientPeer()
    other, other_up = h2_sse_stream(pb, client, data=client.preface())
    sid, up = open_upload(pb, client)
    client.events(pb.fresh())

    def send() -> None:
        client.conn.send_data(sid, b"x")
        pb.receive(1, client.conn.data_to_send())

    trickle(pb, send, WHOLE)
    assert pb.now < WHOLE
    events = client.events(pb.fresh())
    assert not [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    tick(pb, WHOLE)
    events = client.events(pb.fresh())
    (head,) = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert head.stream_id == sid and dict(head.headers)[b":status"] == b"408"
    assert [e.stream_id for e in events if isinstance(e, h2.events.StreamEnded)] == [sid]
    resets = [(e.stream_id, e.error_code) for e in events if isinstance(e, h2.events.StreamReset)]
    assert resets == [(sid, h2.errors.ErrorCodes.NO_ERROR)]
    assert up in closed_conns(pb)  # the backend slot is free
    assert 1 not in closed_conns(pb) and other_up not in closed_conns(pb)
    assert pb.core.counters["request_body_deadline"] == 1
    pb.receive(other_up, sse_chunk(b"data: tok\n\n"))
    assert data_of(parse(pb.fresh()), other) == b"data: tok\n\n"


def test_h1_body_trickled_under_the_gap_gets_408_and_close() -> None:
    pb = book()
    client = H1ClientPeer()
    backend = H1BackendPeer()
    head = h11.Request(
        method="POST",
        target="/v1/chat/completions",
        headers=[("Host", "a"), ("Content-Length", "1000")],
    )
    pb >> data(1, client.conn.send(head) or b"")
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << (up := Opens())
    pb << SetTimer(timer=("body", 1), at=GAP)
    pb >> opened(up.conn)
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(up.conn, backend, lambda events: isinstance(events[0], h11.Request))
    pb << SetTimer(timer=("head", 1), at=60.0)
    last = 0.0
    while pb.now + GAP - 1 < WHOLE:  # a byte every GAP - 1 seconds: never a gap of GAP
        pb.now += GAP - 1
        pb >> wakeup("body", 1)  # not due yet: re-armed GAP after the last byte
        pb << SetTimer(timer=("body", 1), at=last + GAP)
        pb >> data(1, client.conn.send(h11.Data(data=b"x")) or b"")
        pb << Sends(up.conn, backend, lambda events: h1_body(events) == b"x")
        last = pb.now
    assert pb.now < WHOLE
    pb.now = WHOLE
    pb >> wakeup("body", 1)
    pb << SetTimer(timer=("send", 1), at=WHOLE + 60.0)
    pb << Sends(1, client, h1_response(408))
    pb << CloseConnection(conn=up.conn)
    pb << CancelTimer(timer=("head", 1))
    pb << CloseConnection(conn=1)
    pb.done()
    assert pb.core.counters["request_body_deadline"] == 1


def test_time_the_proxy_stopped_the_client_does_not_count() -> None:
    """The backend connection hangs, so the body fills the stream's buffer and we withhold the
    client's window: that time is ours. Once we let it send, it has what was left."""
    pb = book(stream_buffer=16 * 1024)
    client = H2ClientPeer()
    pb.receive(1, client.preface())
    client.events(pb.fresh())
    pb.receive(1, client.conn.data_to_send())
    sid, up = open_upload(pb, client, connect=False)
    pb.now = 2.0
    client.conn.send_data(sid, b"x" * client.conn.local_flow_control_window(sid))
    pb.receive(1, client.conn.data_to_send())
    (stats,) = pb.core.statistics().streams
    assert stats.request_buffered >= pb.core.limits.high_water  # window withheld
    for now in (10.0, 30.0, 100.0):
        tick(pb, now)
    assert pb.core.counters["request_body_deadline"] == 0
    assert up not in closed_conns(pb)
    pb.opened(up)  # the backend takes the body: the client may send again at 100
    pb.sent(up, len(pb.take(up)))
    client.events(pb.fresh())  # its window back

    def send() -> None:
        client.conn.send_data(sid, b"x")
        pb.receive(1, client.conn.data_to_send())

    trickle(pb, send, 100.0 + WHOLE - 2.0)
    tick(pb, 100.0 + WHOLE - 2.0 - 0.1)
    assert pb.core.counters["request_body_deadline"] == 0
    tick(pb, 100.0 + WHOLE - 2.0 + 0.1)  # 2 s before the stop, WHOLE - 2 s after it
    assert pb.core.counters["request_body_deadline"] == 1

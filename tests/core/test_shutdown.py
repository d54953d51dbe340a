"""Graceful stop (core/shutdown.py), bytes only: real h11/h2 peers on both sides.

The HTTP/2 client peer reads through ``h2goaway.GoawayTolerantReceiver``, so it behaves as
RFC 9113 §6.8 asks (and as nghttp2 and browsers do): a GOAWAY stops it opening streams, and
the frames after it are still processed. Plain python-h2 refuses every frame after a GOAWAY.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import h2.errors
import h2.events
import h11
import pytest
from checks import (
    Check,
    both,
    h1_body,
    h1_request,
    h1_response,
    h2_body,
    h2_ended,
    h2_resets,
    h2_response,
)
from playbook import (
    H1BackendPeer,
    H1ClientPeer,
    H2Client,
    H2ClientPeer,
    Playbook,
    Sends,
    Where,
    accepted,
    closed,
    data,
    opened,
    wakeup,
)
from test_h2client import connect_backend, h2_config, requests, respond
from test_tunnel import _open_h1, _switch

from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    Command,
    Log,
    OpenConnection,
    Origin,
    SendData,
    SetTimer,
)
from muxproxy.core.events import ShutdownRequested
from muxproxy.core.http2.h2 import SHUTDOWN_PING
from muxproxy.core.http2.h2goaway import GoawayTolerantReceiver
from muxproxy.core.shutdown import FIRST_REQUEST_WAIT, GOAWAY_ACK_WAIT

NO_ERROR = h2.errors.ErrorCodes.NO_ERROR
CANCEL = h2.errors.ErrorCodes.CANCEL
REFUSED = h2.errors.ErrorCodes.REFUSED_STREAM
ORIGIN = Origin(host="127.0.0.1", port=9001)
SSE = [b"data: one\n\n", b"data: two\n\n", b"data: three\n\n"]


class Book(Playbook):
    seen = 0

    def fresh(self, conn: int = 1) -> bytes:
        """Bytes sent to ``conn`` since the last call."""
        new, self.seen = self.log[self.seen :], len(self.log)
        return self.take(conn, new)

    def stop(self, deadline: float) -> list[Command]:
        return self.feed(ShutdownRequested(now=self.now, deadline=deadline))

    def closed_conns(self) -> list[int]:
        return [c.conn for c in self.log if isinstance(c, CloseConnection)]

    def logs(self, event: str) -> list[Log]:
        return [c for c in self.log if isinstance(c, Log) and c.event == event]


class TolerantClient(H2ClientPeer):
    """An HTTP/2 client that reads past a GOAWAY (RFC 9113 §6.8)."""

    def __init__(self) -> None:
        super().__init__()
        self.receiver = GoawayTolerantReceiver()
        self.data: dict[int, bytes] = {}
        self.ended: set[int] = set()
        self.resets: dict[int, int] = {}
        self.goaways: list[h2.events.ConnectionTerminated] = []
        self.pings: list[bytes] = []
        self.heads: dict[int, list[tuple[bytes, bytes]]] = {}

    def events(self, data: bytes) -> list[h2.events.Event]:
        events = self.receiver.receive_data(self.conn, data)
        for event in events:
            if isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                self.data[event.stream_id] = self.data.get(event.stream_id, b"") + event.data
            elif isinstance(event, h2.events.ResponseReceived):
                self.heads[event.stream_id] = list(event.headers)
            elif isinstance(event, h2.events.StreamEnded):
                self.ended.add(event.stream_id)
            elif isinstance(event, h2.events.StreamReset):
                self.resets[event.stream_id] = event.error_code
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.goaways.append(event)
            elif isinstance(event, h2.events.PingReceived):
                self.pings.append(event.ping_data)
        return events


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def h2_book() -> tuple[Book, TolerantClient]:
    """Client connection 1 speaks HTTP/2 (prior knowledge): the proxy's SETTINGS answer its
    preface."""
    pb = Book()
    pb.accept(1)
    client = TolerantClient()
    pb >> data(1, client.preface())
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client)
    return pb, client


def stop(pb: Book, deadline: float) -> None:
    pb >> ShutdownRequested(now=pb.now, deadline=deadline)


def first_goaway(client: TolerantClient) -> Check:
    """RFC 9113 §6.8, first step: GOAWAY(NO_ERROR) naming 2^31-1, and a PING."""

    def check(events: Sequence[Any]) -> None:
        assert [(g.error_code, g.last_stream_id) for g in client.goaways] == [(NO_ERROR, 2**31 - 1)]
        assert client.pings == [SHUTDOWN_PING]

    return check


def final_goaway(client: TolerantClient, last: int) -> Check:
    def check(events: Sequence[Any]) -> None:
        assert [g.last_stream_id for g in client.goaways] == [2**31 - 1, last]

    return check


def h2_sse(
    pb: Book, client: TolerantClient, path: bytes = b"/v1/stream", *, ex: int = 1, up: int = -1
) -> int:
    """A GET of ``path`` on client connection 1, exchange ``ex``, answered with an SSE head
    by a new HTTP/1.1 backend connection ``up``; returns its stream id."""
    sid, request = client.request(b"GET", path)
    pb >> data(1, request)
    if ex == 1:
        pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", ex), at=5.0)
    pb << OpenConnection(conn=up, origin=ORIGIN)
    sse_head(pb, client, sid, ex=ex, up=up)
    return sid


def sse_head(pb: Book, client: TolerantClient, sid: int, *, ex: int = 1, up: int = -1) -> None:
    """Backend connection ``up`` opens, takes exchange ``ex``'s request and answers with an
    SSE head, relayed on stream ``sid``."""
    backend = H1BackendPeer()
    pb >> opened(up)
    pb << CancelTimer(timer=("connect", ex))
    pb << Sends(up, backend, h1_request(b"GET"))
    pb << SetTimer(timer=("head", ex), at=60.0)
    pb >> data(up, backend.sse_head())
    pb << CancelTimer(timer=("head", ex))
    pb << Sends(1, client, h2_response(sid, 200))
    pb << SetTimer(timer=("read", ex), at=300.0)


def h1_post(
    pb: Book, client: H1ClientPeer, conn: int = 1, *, ex: int = 1, up: int = -1
) -> H1BackendPeer:
    """Client connection ``conn`` POSTs, exchange ``ex``, to a new backend connection
    ``up``, which takes the request; returns the backend peer."""
    pb >> data(conn, client.request("POST", "/v1/chat/completions", body=b"{}"))
    pb << CancelTimer(timer=("header", conn))
    pb << SetTimer(timer=("connect", ex), at=5.0)
    pb << OpenConnection(conn=up, origin=ORIGIN)
    pb << SetTimer(timer=("body", ex), at=30.0)
    return forwarded(pb, ex=ex, up=up)


def forwarded(pb: Book, *, ex: int = 1, up: int = -1) -> H1BackendPeer:
    backend = H1BackendPeer()
    pb >> opened(up)
    pb << CancelTimer(timer=("connect", ex))
    pb << Sends(up, backend, h1_request(b"POST", b"/v1/chat/completions", b"{}"))
    pb << SetTimer(timer=("head", ex), at=60.0)
    return backend


def sse_started(
    pb: Book,
    client: H1ClientPeer,
    backend: H1BackendPeer,
    first: bytes = b"",
    *,
    conn: int = 1,
    ex: int = 1,
    up: int = -1,
    close: bool = False,
) -> None:
    """Backend ``up`` answers with an SSE head (and the chunk ``first``), relayed to client
    connection ``conn``; ``close``: the head says ``Connection: close``."""
    pb >> data(up, backend.sse_head() + (backend.chunk(first) if first else b""))
    pb << CancelTimer(timer=("head", ex))
    pb << SetTimer(timer=("send", conn), at=60.0)
    pb << Sends(conn, client, both(h1_response(200), closing(close)))
    pb << SetTimer(timer=("read", ex), at=300.0)
    if first:
        pb << Sends(conn, client, lambda events: h1_body(events) == first)


def closing(close: bool) -> Check:
    """The response head says ``Connection: close`` (or does not)."""

    def check(events: Sequence[Any]) -> None:
        assert ((b"connection", b"close") in events[0].headers) is close, events[0]

    return check


def ended(pb: Book, client: H1ClientPeer, body: bytes, *, ex: int = 1) -> None:
    """The last chunk (``body``) and the end went to client 1; the backend connection is
    closed, not pooled; then the client connection."""
    pb << Sends(1, client, both(lambda e: h1_body(e) == body, _ends))
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("read", ex))
    pb << CancelTimer(timer=("body", ex))
    pb << CloseConnection(conn=1)


def _ends(events: Sequence[Any]) -> None:
    assert isinstance(events[-1], h11.EndOfMessage), events


def served_ok(
    pb: Book,
    client: H1ClientPeer,
    backend: H1BackendPeer,
    *,
    conn: int = 1,
    ex: int = 1,
    up: int = -1,
) -> None:
    """Backend ``up`` answers ``200 ok`` whole, relayed to client ``conn``; both are kept alive."""
    ok = backend.conn.send(h11.Response(status_code=200, headers=[("Content-Length", "2")]))
    pb >> data(up, (ok or b"") + backend.chunk(b"ok") + backend.end())
    pb << CancelTimer(timer=("head", ex))
    pb << SetTimer(timer=("send", conn), at=60.0)
    pb << Sends(conn, client, h1_response(200))
    pb << SetTimer(timer=("read", ex), at=300.0)
    pb << Sends(conn, client, both(lambda e: h1_body(e) == b"ok", _ends))
    pb << SetTimer(timer=("pool", up), at=60.0)
    pb << CancelTimer(timer=("read", ex))
    pb << CancelTimer(timer=("body", ex))
    pb << SetTimer(timer=("idle", conn), at=75.0)


# -- HTTP/2 clients: the two GOAWAYs ------------------------------------------------------------


def test_h2_two_goaways_serve_streams_opened_before_the_ping_ack_and_refuse_later_ones() -> None:
    pb, client = h2_book()
    first = h2_sse(pb, client)
    stop(pb, pb.now + 30)
    pb << Sends(1, client, first_goaway(client))
    pb << SetTimer(timer=("goaway", 1), at=pb.now + GOAWAY_ACK_WAIT)
    pb << SetTimer(timer=("shutdown", 0), at=30.0)
    (started,) = pb.logs("shutdown_started")
    assert started.fields == {"deadline": 30.0, "streams": 1, "connections": 1}
    # A stream the client sent before it saw the GOAWAY is still taken and served; the
    # PING's ACK (h2 queued it on receipt) goes with it and brings the final GOAWAY with
    # the real last id.
    racing, request = client.request(b"GET", b"/v1/racing")
    assert racing > first
    pb >> data(1, client.conn.data_to_send() + request)
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << OpenConnection(conn=-2, origin=ORIGIN)
    pb << Sends(1, client, final_goaway(client, racing))
    sse_head(pb, client, racing, ex=2, up=-2)
    # A stream after the final GOAWAY is refused and reaches no backend.
    late, request = client.request(b"GET", b"/v1/late")
    pb >> data(1, request)
    pb << Sends(1, client, h2_resets((late, REFUSED)))
    # Both running streams are served to their end; the connection closes after the last.
    for up, sid in ((-1, first), (-2, racing)):
        pb >> data(up, chunk(SSE[0]) + chunk(SSE[1]))
        pb << Sends(1, client, lambda e, sid=sid: h2_body(e, sid) == SSE[0] + SSE[1])
    pb >> data(-1, b"0\r\n\r\n")
    pb << Sends(1, client, h2_ended(first))
    # Neither backend connection goes back to the pool: each closes with its stream.
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("read", 1))
    pb >> data(-2, chunk(SSE[2]) + b"0\r\n\r\n")
    pb << Sends(1, client, both(h2_ended(racing), lambda e: h2_body(e, racing) == SSE[2]))
    pb << CloseConnection(conn=-2)
    pb << CancelTimer(timer=("read", 2))
    pb << CloseConnection(conn=1)
    assert client.data == {first: SSE[0] + SSE[1], racing: SSE[0] + SSE[1] + SSE[2]}
    assert client.ended == {first, racing} and client.resets == {late: REFUSED}
    assert pb.core.statistics().idle_upstream_connections == 0
    assert not pb.core.drained  # the client's close is not reported yet
    pb >> closed(1)
    pb << CancelTimer(timer=("send", 1))
    pb << CancelTimer(timer=("goaway", 1))
    pb << CancelTimer(timer=("shutdown", 0))
    pb.done()
    assert pb.core.drained
    assert len(pb.logs("drained")) == 1 and pb.logs("shutdown_cut") == []


def test_h2_final_goaway_goes_out_after_the_ack_wait_and_an_idle_connection_closes() -> None:
    pb, client = h2_book()
    sid = h2_sse(pb, client)
    pb >> data(-1, b"0\r\n\r\n")
    pb << Sends(1, client, h2_ended(sid))
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    stop(pb, pb.now + 30)
    pb << Sends(1, client, first_goaway(client))
    pb << SetTimer(timer=("goaway", 1), at=pb.now + GOAWAY_ACK_WAIT)
    pb << CloseConnection(conn=-1)  # the pooled backend connection
    pb << CancelTimer(timer=("pool", -1))
    pb << SetTimer(timer=("shutdown", 0), at=30.0)
    # The client never answers the PING: the bound sends the final GOAWAY; no stream runs,
    # so the connection closes after it.
    pb.now += GOAWAY_ACK_WAIT
    pb >> wakeup("goaway", 1)
    pb << Sends(1, client, final_goaway(client, sid))
    pb << CloseConnection(conn=1)
    pb.done()


def test_h2_idle_connection_closes_once_the_ping_ack_brought_the_final_goaway() -> None:
    pb, client = h2_book()
    stop(pb, pb.now + 30)
    pb << Sends(1, client, first_goaway(client))
    pb << SetTimer(timer=("goaway", 1), at=pb.now + GOAWAY_ACK_WAIT)
    pb << SetTimer(timer=("shutdown", 0), at=30.0)
    pb >> data(1, client.conn.data_to_send())  # the ACK
    pb << Sends(1, client, final_goaway(client, 0))
    pb << CloseConnection(conn=1)
    pb.done()


# -- HTTP/1.1 clients ---------------------------------------------------------------------------


def test_h1_response_whose_head_is_not_out_gets_connection_close_and_then_the_close() -> None:
    pb = Book()
    pb.accept(1)
    client = H1ClientPeer()
    backend = h1_post(pb, client)
    stop(pb, pb.now + 30)
    pb << SetTimer(timer=("shutdown", 0), at=30.0)  # nothing closes yet
    sse_started(pb, client, backend, SSE[0], close=True)
    pb >> data(-1, backend.chunk(SSE[1]) + backend.end())
    # Closed after the response; the backend connection is closed, not pooled.
    ended(pb, client, SSE[1])
    pb.done()
    assert pb.core.statistics().idle_upstream_connections == 0


def test_h1_response_already_streaming_completes_then_the_connection_closes() -> None:
    pb = Book()
    pb.accept(1)
    client = H1ClientPeer()
    backend = h1_post(pb, client)
    # Its head went out before the stop: no ``Connection: close`` in it.
    sse_started(pb, client, backend, SSE[0])
    stop(pb, pb.now + 30)
    pb << SetTimer(timer=("shutdown", 0), at=30.0)  # nothing closes yet
    pb >> data(-1, backend.chunk(SSE[1]))
    pb << Sends(1, client, lambda events: h1_body(events) == SSE[1])
    pb >> data(-1, backend.chunk(SSE[2]) + backend.end())
    ended(pb, client, SSE[2])
    pb.done()


def test_h1_idle_keepalive_connections_close_at_once_silent_new_ones_after_a_wait() -> None:
    pb = Book()
    pb.accept(1)
    pb.accept(2)  # connected, not a byte sent
    pb.accept(3, tls=True, alpn="http/1.1")  # HTTP/1.1 by ALPN, no request yet
    client = H1ClientPeer()
    backend = h1_post(pb, client)
    served_ok(pb, client, backend)  # kept alive: the client and its pooled backend
    stop(pb, pb.now + 30)
    pb << CloseConnection(conn=1)
    # The new connections' clients have had their chance to send the request they
    # connected for; silent, they close.
    pb << SetTimer(timer=("header", 2), at=pb.now + FIRST_REQUEST_WAIT)
    pb << SetTimer(timer=("header", 3), at=pb.now + FIRST_REQUEST_WAIT)
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("pool", -1))
    pb << SetTimer(timer=("shutdown", 0), at=30.0)
    assert pb.logs("shutdown_started")[0].fields["streams"] == 0
    pb >> closed(1)
    pb << CancelTimer(timer=("idle", 1))
    pb << CancelTimer(timer=("send", 1))
    pb >> closed(-1)
    assert not pb.core.drained  # the new connections hold the stop, for that long only
    pb.now += FIRST_REQUEST_WAIT
    pb >> wakeup("header", 2)
    pb << CloseConnection(conn=2)
    pb >> wakeup("header", 3)
    pb << CloseConnection(conn=3)
    pb >> closed(2)
    pb >> closed(3)
    pb << CancelTimer(timer=("shutdown", 0))
    pb.done()
    assert pb.core.drained


def test_h1_idle_keepalive_connection_closes_without_lingering_a_busy_one_lingers() -> None:
    # An idle connection's client has nothing unanswered that an RST could destroy, and
    # one that keeps its pooled connection open (httpx, a browser) never sends the EOF a
    # lingering close waits for: the stop waited the whole linger for it.
    pb = Book()
    pb.accept(1)
    pb.accept(2)
    busy, idle = H1ClientPeer(), H1ClientPeer()
    backend2 = h1_post(pb, busy, conn=2)
    sse_started(pb, busy, backend2, SSE[0], conn=2)
    backend = h1_post(pb, idle, ex=2, up=-2)
    served_ok(pb, idle, backend, ex=2, up=-2)
    stop(pb, pb.now + 30)
    pb << Where(CloseConnection, lambda c: c.conn == 1 and c.linger is False)
    pb << CloseConnection(conn=-2)
    pb << CancelTimer(timer=("pool", -2))
    pb << SetTimer(timer=("shutdown", 0), at=30.0)
    pb >> data(-1, backend2.end())
    pb << Sends(2, busy, _ends)
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    # Its exchange ended with Connection: close.
    pb << Where(CloseConnection, lambda c: c.conn == 2 and c.linger is True)
    pb.done()


def test_h1_request_arriving_just_after_the_stop_on_a_new_connection_is_served() -> None:
    # Accepted an instant before the stop; the request was on the wire, read after it.
    pb = Book()
    pb.accept(1)
    stop(pb, pb.now + 30)
    pb << SetTimer(timer=("header", 1), at=pb.now + FIRST_REQUEST_WAIT)  # not closed
    pb << SetTimer(timer=("shutdown", 0), at=30.0)
    client = H1ClientPeer()
    backend = h1_post(pb, client)
    pb >> data(-1, backend.sse_head() + backend.chunk(SSE[0]) + backend.end())
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, both(h1_response(200), closing(True)))
    pb << SetTimer(timer=("read", 1), at=300.0)
    ended(pb, client, SSE[0])
    pb.done()


def test_h2_preface_arriving_just_after_the_stop_gets_the_two_goaways_and_is_served() -> None:
    pb = Book()
    pb.accept(1)  # plain: h2 with prior knowledge, not known until the preface
    stop(pb, pb.now + 30)
    pb << SetTimer(timer=("header", 1), at=pb.now + FIRST_REQUEST_WAIT)
    pb << SetTimer(timer=("shutdown", 0), at=30.0)
    client = TolerantClient()
    pb >> data(1, client.conn.data_to_send())
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client)
    pb << SetTimer(timer=("goaway", 1), at=pb.now + GOAWAY_ACK_WAIT)
    pb << Sends(1, client, first_goaway(client))
    # A stream sent before the PING's ACK is served.
    sid = client.conn.get_next_available_stream_id()
    client.conn.send_headers(
        sid,
        [
            (":method", "GET"),
            (":path", "/v1/models"),
            (":scheme", "http"),
            (":authority", "proxy.test"),
        ],
        end_stream=True,
    )
    pb >> data(1, client.conn.data_to_send())
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    # The ACK went with the stream: the final GOAWAY names it.
    pb << Sends(1, client, final_goaway(client, sid))
    backend = H1BackendPeer()
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(-1, backend, h1_request(b"GET", b"/v1/models"))
    pb << SetTimer(timer=("head", 1), at=60.0)
    ok = backend.conn.send(h11.Response(status_code=200, headers=[("Content-Length", "2")]))
    pb >> data(-1, (ok or b"") + backend.chunk(b"ok") + backend.end())
    pb << CancelTimer(timer=("head", 1))
    pb << Sends(1, client, h2_response(sid, 200))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << Sends(1, client, both(h2_ended(sid), lambda e: h2_body(e, sid) == b"ok"))
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("read", 1))
    pb << CloseConnection(conn=1)  # its end closed the connection
    pb.done()


def test_h1_request_head_begun_before_the_stop_is_served_with_connection_close() -> None:
    pb = Book()
    pb.accept(1)
    client = H1ClientPeer()
    request = client.request("POST", "/v1/chat/completions", body=b"{}")
    pb >> data(1, request[:20])
    stop(pb, pb.now + 30)
    pb << SetTimer(timer=("shutdown", 0), at=30.0)  # nothing closes
    pb >> data(1, request[20:])
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb << SetTimer(timer=("body", 1), at=30.0)
    backend = forwarded(pb)
    pb >> data(-1, backend.sse_head() + backend.chunk(SSE[0]) + backend.end())
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, both(h1_response(200), closing(True)))
    pb << SetTimer(timer=("read", 1), at=300.0)
    ended(pb, client, SSE[0])
    pb.done()


def test_connections_accepted_after_the_stop_are_closed_at_once() -> None:
    pb = Book()
    stop(pb, pb.now + 30)
    pb << SetTimer(timer=("shutdown", 0), at=30.0)
    pb << CancelTimer(timer=("shutdown", 0))
    assert pb.core.drained  # nothing was running
    pb >> accepted(1)
    pb << SetTimer(timer=("header", 1), at=30.0)
    pb << CloseConnection(conn=1)
    # HTTP/2 chosen by ALPN: a GOAWAY naming no stream, then the close.
    client = TolerantClient()
    pb >> accepted(2, tls=True, alpn="h2")
    pb << SetTimer(timer=("send", 2), at=60.0)
    pb << Sends(2, client)
    pb << SetTimer(timer=("header", 2), at=30.0)
    pb << Sends(2, client)
    pb << CloseConnection(conn=2)
    pb.done()  # no OpenConnection
    assert [(g.error_code, g.last_stream_id) for g in client.goaways] == [(NO_ERROR, 0)]


# -- backend connections ------------------------------------------------------------------------


def test_h2_backend_connection_with_a_stream_closes_when_that_stream_ends() -> None:
    pb = Book(h2_config())
    one = H2Client(pb, 1, TolerantClient())
    first = one.request()
    backend = connect_backend(pb, -1)
    (req,) = requests(backend.read())
    respond(backend, req.stream_id)
    backend.conn.send_data(req.stream_id, b"data: tok\n\n", end_stream=True)
    backend.flush()
    # The connection, idle now, takes a stream of another client.
    two = H2Client(pb, 2, TolerantClient())
    two.request()
    assert [o.conn for o in pb.opens()] == [-1]  # the first connection takes it
    (busy_req,) = requests(backend.read())
    respond(backend, busy_req.stream_id)
    pb.stop(pb.now + 30)
    # The connection carries a stream: it stays, and closes when that stream ends.
    assert -1 not in pb.closed_conns()
    backend.conn.send_data(busy_req.stream_id, b"data: last\n\n", end_stream=True)
    backend.flush()
    assert -1 in pb.closed_conns()
    goaways = [e for e in backend.read() if isinstance(e, h2.events.ConnectionTerminated)]
    assert [g.error_code for g in goaways] == [NO_ERROR]
    assert first in {e.stream_id for e in one.read() if isinstance(e, h2.events.StreamEnded)}


def test_h2_backend_connection_without_streams_closes_when_the_stop_begins() -> None:
    pb = Book(h2_config())
    one = H2Client(pb, 1, TolerantClient())
    one.request()
    backend = connect_backend(pb, -1)
    (req,) = requests(backend.read())
    respond(backend, req.stream_id, end=True)
    assert -1 not in pb.closed_conns()  # idle, kept for the next request
    pb.stop(pb.now + 30)
    assert -1 in pb.closed_conns()


# -- the deadline -------------------------------------------------------------------------------


def test_deadline_resets_h2_streams_with_cancel_then_goaway_and_closes_their_backends() -> None:
    pb, client = h2_book()
    sid = h2_sse(pb, client)
    pb >> data(-1, chunk(SSE[0]))
    pb << Sends(1, client)
    stop(pb, pb.now + 5)
    pb << Sends(1, client, first_goaway(client))
    pb << SetTimer(timer=("goaway", 1), at=pb.now + GOAWAY_ACK_WAIT)
    pb << SetTimer(timer=("shutdown", 0), at=5.0)
    pb.now = 5.0
    pb >> wakeup("shutdown", 0)
    pb << Sends(1, client, lambda e: [type(x) for x in e][:1] == [h2.events.StreamReset])
    # The backend is closed so the GPU stops; then the client connection.
    pb << CloseConnection(conn=1)
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("read", 1))
    assert client.resets == {sid: CANCEL} and sid not in client.ended
    assert client.data[sid] == SSE[0]
    (cut,) = pb.logs("shutdown_cut")
    assert cut.fields["streams"] == 1
    assert pb.logs("drained") == []
    assert not pb.core.drained
    pb >> closed(1)
    pb << CancelTimer(timer=("send", 1))
    pb << CancelTimer(timer=("goaway", 1))
    pb.done()
    assert pb.core.drained


def test_deadline_closes_an_h1_stream_without_its_final_chunk() -> None:
    pb = Book()
    pb.accept(1)
    client = H1ClientPeer()
    backend = h1_post(pb, client)
    sse_started(pb, client, backend, SSE[0])
    stop(pb, pb.now + 5)
    pb << SetTimer(timer=("shutdown", 0), at=5.0)
    pb.now = 5.0
    pb >> wakeup("shutdown", 0)
    pb << CloseConnection(conn=1)  # no last chunk first
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    pb.done()
    assert not pb.take(1).endswith(b"0\r\n\r\n")
    with pytest.raises(h11.RemoteProtocolError):
        client.events(b"")  # the EOF: the chunked body is incomplete (RFC 9112 §8)
    assert pb.logs("shutdown_cut")[0].fields["streams"] == 1


def test_a_second_request_moves_the_deadline_earlier_never_later() -> None:
    pb = Book()
    pb.accept(1)
    client = H1ClientPeer()
    backend = h1_post(pb, client)
    sse_started(pb, client, backend)
    stop(pb, 30.0)
    pb << SetTimer(timer=("shutdown", 0), at=30.0)
    stop(pb, 10.0)
    pb << SetTimer(timer=("shutdown", 0), at=10.0)
    stop(pb, 20.0)  # later than the current deadline: ignored
    assert len(pb.logs("shutdown_started")) == 1
    pb.now = 2.0
    stop(pb, 1.0)  # at or before now: cut at once
    pb << CancelTimer(timer=("shutdown", 0))
    pb << CloseConnection(conn=1)
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    pb.done()
    assert len(pb.logs("shutdown_cut")) == 1


def test_deadline_already_past_cuts_at_once() -> None:
    pb, client = h2_book()
    sid = h2_sse(pb, client)
    stop(pb, pb.now)
    pb << Sends(1, client, first_goaway(client))
    pb << SetTimer(timer=("goaway", 1), at=pb.now + GOAWAY_ACK_WAIT)
    pb << Sends(1, client, lambda events: client.resets == {sid: CANCEL})
    pb << CloseConnection(conn=1)
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("read", 1))
    pb.done()


def test_drained_only_once_every_connection_is_gone() -> None:
    pb = Book()
    assert not pb.core.drained  # not stopping
    pb.accept(1)
    client = H1ClientPeer()
    backend = h1_post(pb, client)
    sse_started(pb, client, backend)
    stop(pb, pb.now + 30)
    pb << SetTimer(timer=("shutdown", 0), at=30.0)
    assert not pb.core.drained
    pb >> data(-1, backend.chunk(SSE[0]) + backend.end())
    ended(pb, client, SSE[0])
    assert not pb.core.drained  # closing, not closed
    pb >> closed(-1)
    assert not pb.core.drained
    pb >> closed(1)
    pb << CancelTimer(timer=("send", 1))
    pb << CancelTimer(timer=("shutdown", 0))
    assert pb.core.drained
    (drained,) = pb.logs("drained")
    pb >> wakeup("shutdown", 0)  # cancelled: nothing is cut after the drain
    pb.done()
    assert pb.logs("shutdown_cut") == [] and len(pb.logs("drained")) == 1
    assert drained.fields["seconds"] == 0.0


# -- tunnels ------------------------------------------------------------------------------------


def test_websocket_tunnel_runs_on_until_the_deadline_cuts_it() -> None:
    pb = Book()
    up, backend, _ = _open_h1(pb)
    pb.receive(up, _switch(backend))
    stop(pb, pb.now + 10)
    pb << SetTimer(timer=("shutdown", 0), at=10.0)  # nothing closes
    pb >> data(1, b"\x81\x02hi")
    pb << SendData(conn=up, data=b"\x81\x02hi")
    pb >> data(up, b"\x81\x02yo")
    pb << SendData(conn=1, data=b"\x81\x02yo")
    assert not pb.core.drained
    pb.now = 10.0
    pb >> wakeup("shutdown", 0)
    pb << CloseConnection(conn=1)
    pb << CancelTimer(timer=("tunnel", 1))
    pb << CloseConnection(conn=up)
    assert [c.fields["reason"] for c in pb.logs("tunnel_closed")] == [
        "client closed: client connection closed"
    ]
    assert pb.logs("shutdown_cut")[0].fields["streams"] == 1
    pb >> closed(up)
    assert not pb.core.drained
    pb >> closed(1)
    pb << CancelTimer(timer=("send", 1))
    pb.done()
    assert pb.core.drained

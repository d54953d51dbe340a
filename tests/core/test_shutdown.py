"""Graceful stop (core/shutdown.py), bytes only: real h11/h2 peers on both sides.

The HTTP/2 client peer reads through ``h2goaway.GoawayTolerantReceiver``, so it behaves as
RFC 9113 §6.8 asks (and as nghttp2 and browsers do): a GOAWAY stops it opening streams, and
the frames after it are still processed. Plain python-h2 refuses every frame after a GOAWAY.
"""

from __future__ import annotations

import h2.errors
import h2.events
import h11
import pytest
from playbook import H1BackendPeer, H1ClientPeer, H2Client, H2ClientPeer, Playbook, h2_sse_stream
from test_h2client import connect_backend, h2_config, requests, respond
from test_tunnel import _open_h1, _switch

from muxproxy.core.commands import CloseConnection, Command, Log, SetTimer
from muxproxy.core.events import ShutdownRequested
from muxproxy.core.http2.h2 import SHUTDOWN_PING
from muxproxy.core.http2.h2goaway import GoawayTolerantReceiver
from muxproxy.core.shutdown import FIRST_REQUEST_WAIT, GOAWAY_ACK_WAIT

NO_ERROR = h2.errors.ErrorCodes.NO_ERROR
CANCEL = h2.errors.ErrorCodes.CANCEL
REFUSED = h2.errors.ErrorCodes.REFUSED_STREAM
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
    pb = Book()
    pb.accept(1)
    client = TolerantClient()
    pb.receive(1, client.preface())
    return pb, client


# -- HTTP/2 clients: the two GOAWAYs ------------------------------------------------------------


def test_h2_two_goaways_serve_streams_opened_before_the_ping_ack_and_refuse_later_ones() -> None:
    pb, client = h2_book()
    first, first_up = h2_sse_stream(pb, client)
    client.events(pb.fresh())
    pb.stop(pb.now + 30)
    (started,) = pb.logs("shutdown_started")
    assert started.fields == {"deadline": 30.0, "streams": 1, "connections": 1}
    client.events(pb.fresh())
    # RFC 9113 §6.8, first step: GOAWAY(NO_ERROR) naming 2^31-1, and a PING.
    assert [(g.error_code, g.last_stream_id) for g in client.goaways] == [(NO_ERROR, 2**31 - 1)]
    assert client.pings == [SHUTDOWN_PING]
    # A stream the client sent before it saw the GOAWAY is still taken and served.
    racing, racing_up = h2_sse_stream(pb, client, b"/v1/racing")
    assert racing > first and len(pb.opens()) == 2
    # The PING's ACK (h2 queued it on receipt) brings the final GOAWAY with the real last id.
    pb.receive(1, client.conn.data_to_send())
    client.events(pb.fresh())
    assert [g.last_stream_id for g in client.goaways] == [2**31 - 1, racing]
    # A stream after the final GOAWAY is refused and reaches no backend.
    late, data = client.request(b"GET", b"/v1/late")
    pb.receive(1, data)
    client.events(pb.fresh())
    assert client.resets == {late: REFUSED}
    assert len(pb.opens()) == 2
    # Both running streams are served to their end; the connection closes after the last.
    for up in (first_up, racing_up):
        pb.receive(up, chunk(SSE[0]) + chunk(SSE[1]))
    pb.receive(first_up, b"0\r\n\r\n")
    client.events(pb.fresh())
    assert first in client.ended and 1 not in pb.closed_conns()
    pb.receive(racing_up, chunk(SSE[2]) + b"0\r\n\r\n")
    client.events(pb.fresh())
    assert client.data == {first: SSE[0] + SSE[1], racing: SSE[0] + SSE[1] + SSE[2]}
    assert client.ended == {first, racing} and client.resets == {late: REFUSED}
    assert 1 in pb.closed_conns()
    # Neither backend connection goes back to the pool: both close with their stream.
    assert {first_up, racing_up} <= set(pb.closed_conns())
    assert pb.core.statistics().idle_upstream_connections == 0
    assert not pb.core.drained  # the client's close is not reported yet
    pb.closed(1)
    assert pb.core.drained
    assert len(pb.logs("drained")) == 1 and pb.logs("shutdown_cut") == []


def test_h2_final_goaway_goes_out_after_the_ack_wait_and_an_idle_connection_closes() -> None:
    pb, client = h2_book()
    sid, up = h2_sse_stream(pb, client)
    pb.receive(up, b"0\r\n\r\n")
    client.events(pb.fresh())
    assert sid in client.ended
    pb.stop(pb.now + 30)
    timers = [c for c in pb.log if isinstance(c, SetTimer) and c.timer == ("goaway", 1)]
    assert [t.at for t in timers] == [pb.now + GOAWAY_ACK_WAIT]
    client.events(pb.fresh())
    assert len(client.goaways) == 1 and 1 not in pb.closed_conns()
    # The client never answers the PING: the bound sends the final GOAWAY; no stream runs,
    # so the connection closes after it.
    pb.now += GOAWAY_ACK_WAIT
    pb.wakeup("goaway", 1)
    client.events(pb.fresh())
    assert [g.last_stream_id for g in client.goaways] == [2**31 - 1, sid]
    assert pb.closed_conns()[-1] == 1


def test_h2_idle_connection_closes_once_the_ping_ack_brought_the_final_goaway() -> None:
    pb, client = h2_book()
    pb.stop(pb.now + 30)
    client.events(pb.fresh())
    assert 1 not in pb.closed_conns()
    pb.receive(1, client.conn.data_to_send())  # the ACK
    client.events(pb.fresh())
    assert [g.last_stream_id for g in client.goaways] == [2**31 - 1, 0]
    assert 1 in pb.closed_conns()


# -- HTTP/1.1 clients ---------------------------------------------------------------------------


def h1_request(pb: Book, client: H1ClientPeer, conn: int = 1) -> tuple[int, H1BackendPeer]:
    before = len(pb.opens())
    pb.receive(conn, client.request("POST", "/v1/chat/completions", body=b"{}"))
    up = pb.opens()[before].conn
    pb.opened(up)
    backend = H1BackendPeer()
    backend.events(pb.take(up))
    return up, backend


def test_h1_response_whose_head_is_not_out_gets_connection_close_and_then_the_close() -> None:
    pb = Book()
    pb.accept(1)
    client = H1ClientPeer()
    up, backend = h1_request(pb, client)
    pb.stop(pb.now + 30)
    assert pb.closed_conns() == []
    pb.receive(up, backend.sse_head() + backend.chunk(SSE[0]))
    pb.receive(up, backend.chunk(SSE[1]) + backend.end())
    events = client.events(pb.fresh())
    (head,) = [e for e in events if isinstance(e, h11.Response)]
    assert (b"connection", b"close") in head.headers
    assert b"".join(e.data for e in events if isinstance(e, h11.Data)) == SSE[0] + SSE[1]
    assert isinstance(events[-1], h11.EndOfMessage)
    # Closed after the response; the backend connection is closed, not pooled.
    assert set(pb.closed_conns()) == {1, up}
    assert pb.core.statistics().idle_upstream_connections == 0


def test_h1_response_already_streaming_completes_then_the_connection_closes() -> None:
    pb = Book()
    pb.accept(1)
    client = H1ClientPeer()
    up, backend = h1_request(pb, client)
    pb.receive(up, backend.sse_head() + backend.chunk(SSE[0]))
    pb.stop(pb.now + 30)
    assert pb.closed_conns() == []
    pb.receive(up, backend.chunk(SSE[1]))
    assert pb.closed_conns() == []
    pb.receive(up, backend.chunk(SSE[2]) + backend.end())
    events = client.events(pb.fresh())
    assert b"".join(e.data for e in events if isinstance(e, h11.Data)) == b"".join(SSE)
    assert isinstance(events[-1], h11.EndOfMessage)
    (head,) = [e for e in events if isinstance(e, h11.Response)]
    assert (b"connection", b"close") not in head.headers  # it went out before the stop
    assert set(pb.closed_conns()) == {1, up}


def test_h1_idle_keepalive_connections_close_at_once_silent_new_ones_after_a_wait() -> None:
    pb = Book()
    pb.accept(1)
    pb.accept(2)  # connected, not a byte sent
    pb.accept(3, tls=True, alpn="http/1.1")  # HTTP/1.1 by ALPN, no request yet
    client = H1ClientPeer()
    up, backend = h1_request(pb, client)
    ok = backend.conn.send(h11.Response(status_code=200, headers=[("Content-Length", "2")]))
    pb.receive(up, (ok or b"") + backend.chunk(b"ok") + backend.end())
    assert pb.closed_conns() == []  # kept alive: the client and its pooled backend
    pb.stop(pb.now + 30)
    assert set(pb.closed_conns()) == {1, up}
    assert pb.logs("shutdown_started")[0].fields["streams"] == 0
    # The new connections' clients have had their chance to send the request they
    # connected for; silent, they close.
    for conn in (2, 3):
        timers = [c for c in pb.log if isinstance(c, SetTimer) and c.timer == ("header", conn)]
        assert timers[-1].at == pb.now + FIRST_REQUEST_WAIT
    for conn in (1, up):
        pb.closed(conn)
    assert not pb.core.drained  # the new connections hold the stop, for that long only
    pb.now += FIRST_REQUEST_WAIT
    pb.wakeup("header", 2)
    pb.wakeup("header", 3)
    assert set(pb.closed_conns()) == {1, 2, 3, up}
    pb.closed(2)
    pb.closed(3)
    assert pb.core.drained


def test_h1_idle_keepalive_connection_closes_without_lingering_a_busy_one_lingers() -> None:
    # An idle connection's client has nothing unanswered that an RST could destroy, and
    # one that keeps its pooled connection open (httpx, a browser) never sends the EOF a
    # lingering close waits for: the stop waited the whole linger for it.
    pb = Book()
    pb.accept(1)
    pb.accept(2)
    busy, idle = H1ClientPeer(), H1ClientPeer()
    up2, backend2 = h1_request(pb, busy, conn=2)
    pb.receive(up2, backend2.sse_head() + backend2.chunk(SSE[0]))
    up, backend = h1_request(pb, idle)
    ok = backend.conn.send(h11.Response(status_code=200, headers=[("Content-Length", "2")]))
    pb.receive(up, (ok or b"") + backend.chunk(b"ok") + backend.end())
    pb.stop(pb.now + 30)
    pb.receive(up2, backend2.end())
    closes = {c.conn: c.linger for c in pb.log if isinstance(c, CloseConnection)}
    assert closes[1] is False
    assert closes[2] is True  # its exchange ended with Connection: close


def test_h1_request_arriving_just_after_the_stop_on_a_new_connection_is_served() -> None:
    # Accepted an instant before the stop; the request was on the wire, read after it.
    pb = Book()
    pb.accept(1)
    pb.stop(pb.now + 30)
    assert pb.closed_conns() == []
    client = H1ClientPeer()
    up, backend = h1_request(pb, client)
    pb.receive(up, backend.sse_head() + backend.chunk(SSE[0]) + backend.end())
    events = client.events(pb.fresh())
    (head,) = [e for e in events if isinstance(e, h11.Response)]
    assert head.status_code == 200
    assert (b"connection", b"close") in head.headers
    assert isinstance(events[-1], h11.EndOfMessage)
    assert set(pb.closed_conns()) == {1, up}


def test_h2_preface_arriving_just_after_the_stop_gets_the_two_goaways_and_is_served() -> None:
    pb = Book()
    pb.accept(1)  # plain: h2 with prior knowledge, not known until the preface
    pb.stop(pb.now + 30)
    client = TolerantClient()
    pb.receive(1, client.conn.data_to_send())
    client.events(pb.fresh())
    assert [g.last_stream_id for g in client.goaways] == [2**31 - 1]
    assert client.pings == [SHUTDOWN_PING]
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
    pb.receive(1, client.conn.data_to_send())
    (open_cmd,) = pb.opens()
    pb.opened(open_cmd.conn)
    backend = H1BackendPeer()
    backend.events(pb.take(open_cmd.conn))
    ok = backend.conn.send(h11.Response(status_code=200, headers=[("Content-Length", "2")]))
    pb.receive(open_cmd.conn, (ok or b"") + backend.chunk(b"ok") + backend.end())
    client.events(pb.fresh())
    assert sid in client.ended and client.data[sid] == b"ok"
    # The ACK went with the stream: the final GOAWAY names it; its end closed the connection.
    assert [g.last_stream_id for g in client.goaways] == [2**31 - 1, sid]
    assert 1 in pb.closed_conns()


def test_h1_request_head_begun_before_the_stop_is_served_with_connection_close() -> None:
    pb = Book()
    pb.accept(1)
    client = H1ClientPeer()
    request = client.request("POST", "/v1/chat/completions", body=b"{}")
    pb.receive(1, request[:20])
    pb.stop(pb.now + 30)
    assert pb.closed_conns() == []
    pb.receive(1, request[20:])
    (open_cmd,) = pb.opens()
    pb.opened(open_cmd.conn)
    backend = H1BackendPeer()
    backend.events(pb.take(open_cmd.conn))
    pb.receive(open_cmd.conn, backend.sse_head() + backend.chunk(SSE[0]) + backend.end())
    events = client.events(pb.fresh())
    (head,) = [e for e in events if isinstance(e, h11.Response)]
    assert (b"connection", b"close") in head.headers
    assert isinstance(events[-1], h11.EndOfMessage)
    assert 1 in pb.closed_conns()


def test_connections_accepted_after_the_stop_are_closed_at_once() -> None:
    pb = Book()
    pb.stop(pb.now + 30)
    assert pb.core.drained  # nothing was running
    pb.accept(1)
    assert pb.closed_conns() == [1]
    # HTTP/2 chosen by ALPN: a GOAWAY naming no stream, then the close.
    pb.accept(2, tls=True, alpn="h2")
    client = TolerantClient()
    client.events(pb.take(2))
    assert [(g.error_code, g.last_stream_id) for g in client.goaways] == [(NO_ERROR, 0)]
    assert pb.closed_conns() == [1, 2]
    assert pb.opens() == []


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
    sid, up = h2_sse_stream(pb, client)
    pb.receive(up, chunk(SSE[0]))
    pb.stop(pb.now + 5)
    (timer,) = [c for c in pb.log if isinstance(c, SetTimer) and c.timer == ("shutdown", 0)]
    assert timer.at == 5.0
    pb.receive(1, client.conn.data_to_send())  # the PING's ACK: the final GOAWAY
    client.events(pb.fresh())
    pb.now = 5.0
    pb.wakeup("shutdown", 0)
    events = client.events(pb.fresh())
    assert client.resets == {sid: CANCEL} and sid not in client.ended
    assert client.data[sid] == SSE[0]
    kinds = [type(e) for e in events]
    assert h2.events.StreamReset in kinds
    # The backend is closed so the GPU stops; then the client connection.
    assert up in pb.closed_conns() and 1 in pb.closed_conns()
    (cut,) = pb.logs("shutdown_cut")
    assert cut.fields["streams"] == 1
    assert pb.logs("drained") == []
    assert not pb.core.drained
    pb.closed(1)
    assert pb.core.drained


def test_deadline_closes_an_h1_stream_without_its_final_chunk() -> None:
    pb = Book()
    pb.accept(1)
    client = H1ClientPeer()
    up, backend = h1_request(pb, client)
    pb.receive(up, backend.sse_head() + backend.chunk(SSE[0]))
    pb.stop(pb.now + 5)
    pb.now = 5.0
    pb.wakeup("shutdown", 0)
    assert set(pb.closed_conns()) == {1, up}
    sent = pb.fresh()
    assert not sent.endswith(b"0\r\n\r\n")
    events = client.events(sent)
    assert b"".join(e.data for e in events if isinstance(e, h11.Data)) == SSE[0]
    with pytest.raises(h11.RemoteProtocolError):
        client.events(b"")  # the EOF: the chunked body is incomplete (RFC 9112 §8)
    assert pb.logs("shutdown_cut")[0].fields["streams"] == 1


def test_a_second_request_moves_the_deadline_earlier_never_later() -> None:
    pb = Book()
    pb.accept(1)
    client = H1ClientPeer()
    up, backend = h1_request(pb, client)
    pb.receive(up, backend.sse_head())

    def shutdown_timers() -> list[float]:
        return [c.at for c in pb.log if isinstance(c, SetTimer) and c.timer == ("shutdown", 0)]

    pb.stop(30.0)
    pb.stop(10.0)
    pb.stop(20.0)  # later than the current deadline: ignored
    assert shutdown_timers() == [30.0, 10.0]
    assert len(pb.logs("shutdown_started")) == 1
    pb.now = 2.0
    pb.stop(1.0)  # at or before now: cut at once
    assert set(pb.closed_conns()) == {1, up}
    assert len(pb.logs("shutdown_cut")) == 1


def test_deadline_already_past_cuts_at_once() -> None:
    pb, client = h2_book()
    sid, up = h2_sse_stream(pb, client)
    pb.stop(pb.now)
    client.events(pb.fresh())
    assert client.resets == {sid: CANCEL}
    assert up in pb.closed_conns() and 1 in pb.closed_conns()


def test_drained_only_once_every_connection_is_gone() -> None:
    pb = Book()
    assert not pb.core.drained  # not stopping
    pb.accept(1)
    client = H1ClientPeer()
    up, backend = h1_request(pb, client)
    pb.receive(up, backend.sse_head())
    pb.stop(pb.now + 30)
    assert not pb.core.drained
    pb.receive(up, backend.chunk(SSE[0]) + backend.end())
    assert 1 in pb.closed_conns() and not pb.core.drained  # closing, not closed
    pb.closed(up)
    assert not pb.core.drained
    pb.closed(1)
    assert pb.core.drained
    (drained,) = pb.logs("drained")
    pb.wakeup("shutdown", 0)  # cancelled: nothing is cut after the drain
    assert pb.logs("shutdown_cut") == [] and len(pb.logs("drained")) == 1
    assert drained.fields["seconds"] == 0.0


# -- tunnels ------------------------------------------------------------------------------------


def test_websocket_tunnel_runs_on_until_the_deadline_cuts_it() -> None:
    pb = Book()
    up, backend, _ = _open_h1(pb)
    pb.receive(up, _switch(backend))
    pb.stop(pb.now + 10)
    assert pb.closed_conns() == []
    assert pb.take(up, pb.receive(1, b"\x81\x02hi")) == b"\x81\x02hi"
    assert pb.take(1, pb.receive(up, b"\x81\x02yo")) == b"\x81\x02yo"
    assert not pb.core.drained
    pb.now = 10.0
    pb.wakeup("shutdown", 0)
    assert set(pb.closed_conns()) == {1, up}
    assert [c.fields["reason"] for c in pb.logs("tunnel_closed")] == [
        "client closed: client connection closed"
    ]
    assert pb.logs("shutdown_cut")[0].fields["streams"] == 1
    pb.closed(up)
    assert not pb.core.drained
    pb.closed(1)
    assert pb.core.drained

"""The HTTP/2 upstream adapter (core/http2/h2client.py, core/upstream/h2pool.py) as whole
conversations.

Real h2 peers play the client and the backend: every frame the proxy sends is decoded by an
``h2.H2Connection``, every frame it receives is built by one. Each test asserts every command
in order, timers included: streams start only after the backend's SETTINGS (RFC 9113 §3.4),
a GOAWAY lets the streams it names finish (§6.8), an idle connection is PINGed (§6.7), and a
malformed response head is a stream error (§8.1.1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import h2.errors
import h2.events
import h11
import pytest
from checks import Check, both, h1_body, h1_response, h2_body, h2_ended, h2_resets, h2_response
from hyperframe.frame import GoAwayFrame
from playbook import (
    BACKEND,
    H1ClientPeer,
    H2BackendPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    data,
    default_config,
    opened,
    sent,
    wakeup,
)

from muxproxy.config import Config, Limits, Server, Upstream
from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    Log,
    OpenConnection,
    Origin,
    SetTimer,
)

CHAT = b"/v1/chat/completions"
ORIGIN = Origin(host="127.0.0.1", port=9001, alpn="h2")
SSE = [(b":status", b"200"), (b"content-type", b"text/event-stream")]
TOK = b"data: tok\n\n"
NO_ERROR = h2.errors.ErrorCodes.NO_ERROR
CANCEL = h2.errors.ErrorCodes.CANCEL
PROTOCOL_ERROR = h2.errors.ErrorCodes.PROTOCOL_ERROR


def h2_config(**limits: Any) -> Config:
    group = Upstream(
        name="default", servers=(Server(address=BACKEND, protocol="h2", max_connections=2),)
    )
    config = default_config(upstreams={"default": group})
    return attrs.evolve(config, limits=Limits(**limits)) if limits else config


# -- set-up helpers shared with other modules' tests (they feed events without asserting) ---


def connect_backend(pb: Playbook, conn: int, *, max_streams: int = 100) -> H2BackendPeer:
    assert OpenConnection in {type(c) for c in pb.log}
    pb.opened(conn)
    backend = H2BackendPeer(pb, conn, max_streams=max_streams, ack=False)
    backend.read()  # our preface and SETTINGS
    backend.flush()  # its SETTINGS: streams may start now
    return backend


def requests(events: list[h2.events.Event]) -> list[h2.events.RequestReceived]:
    return [e for e in events if isinstance(e, h2.events.RequestReceived)]


def respond(backend: H2BackendPeer, sid: int, *, end: bool = False) -> None:
    backend.conn.send_headers(sid, SSE, end_stream=end)
    backend.flush()


# -- the conversation's steps -----------------------------------------------------------------


def h2_client(pb: Playbook, conn: int = 1) -> H2ClientPeer:
    """Client connection ``conn`` speaks HTTP/2: the proxy answers its preface with SETTINGS."""
    client = H2ClientPeer()
    pb.accept(conn)
    pb >> data(conn, client.preface())
    pb << SetTimer(timer=("send", conn), at=pb.now + 60.0)
    pb << Sends(conn, client)
    return client


def posted(
    pb: Playbook,
    client: H2ClientPeer,
    *,
    conn: int = 1,
    ex: int,
    first: bool = False,
    opens: int | None = None,
    origin: Origin = ORIGIN,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> int:
    """Client ``conn`` POSTs ``{}`` (exchange ``ex``; ``first``: its first request, which ends
    the header timer); ``opens``: the backend connection it opens, else it waits for one.
    Returns the client's stream id."""
    sid, request = client.request(b"POST", CHAT, headers=headers, body=b"{}")
    pb >> data(conn, request)
    if first:
        pb << CancelTimer(timer=("header", conn))
    pb << SetTimer(timer=("connect", ex), at=pb.now + 5.0)
    if opens is not None:
        pb << OpenConnection(conn=opens, origin=origin)
        pb << SetTimer(timer=("pool", opens), at=pb.now + 5.0)  # its SETTINGS are due (§3.4)
    pb << SetTimer(timer=("body", ex), at=pb.now + 30.0)
    return sid


def settings(events: Sequence[Any]) -> None:
    """A ``Sends`` check: the proxy's preface (its SETTINGS) and no stream yet."""
    assert any(isinstance(e, h2.events.RemoteSettingsChanged) for e in events), events
    assert not any(isinstance(e, h2.events.RequestReceived) for e in events), events


def started(
    sid: int,
    path: bytes = CHAT,
    *,
    fields: dict[bytes, bytes] | None = None,
    absent: tuple[bytes, ...] = (),
    body: bytes | None = b"{}",
) -> Check:
    """A ``Sends`` check for the backend: a request for ``path`` on stream ``sid`` whose header
    block holds ``fields`` and none of ``absent``; ``body``: then its body and its end."""

    def check(events: Sequence[Any]) -> None:
        (request,) = [e for e in events if isinstance(e, h2.events.RequestReceived)]
        assert request.stream_id == sid, request
        held = dict(request.headers)
        assert held[b":path"] == path, held
        for name, value in (fields or {}).items():
            assert held.get(name) == value, (name, held)
        assert not [name for name in absent if name in held], held
        if body is not None:
            assert h2_body(events, sid) == body, events
            assert any(isinstance(e, h2.events.StreamEnded) for e in events), events

    return check


def connected(
    pb: Playbook,
    up: int,
    starts: Sequence[tuple[int, Check]],
    *,
    max_streams: int = 100,
) -> H2BackendPeer:
    """Backend connection ``up`` opens and takes our preface; its SETTINGS arrive and each
    waiting exchange of ``starts`` starts its stream (checked by its check), in order."""
    pb >> opened(up)
    backend = H2BackendPeer(pb, up, max_streams=max_streams, ack=False)
    pb << Sends(up, backend, settings)
    pb >> data(up, backend.output())
    pb << CancelTimer(timer=("pool", up))
    for ex, check in starts:
        pb << CancelTimer(timer=("connect", ex))
        pb << Sends(up, backend, check)
        pb << SetTimer(timer=("head", ex), at=pb.now + 60.0)
    return backend


def head_relayed(
    pb: Playbook,
    backend: H2BackendPeer,
    bsid: int,
    client: H2ClientPeer,
    sid: int,
    *,
    conn: int = 1,
    ex: int,
) -> None:
    """The backend answers stream ``bsid`` with an SSE head, relayed on the client's ``sid``."""
    backend.conn.send_headers(bsid, SSE)
    pb >> data(backend.conn_id, backend.output())
    pb << CancelTimer(timer=("head", ex))
    pb << Sends(conn, client, h2_response(sid, 200))
    pb << SetTimer(timer=("read", ex), at=pb.now + 300.0)


def over(pb: Playbook, *, ex: int, pool: int | None = None, idle: int | None = None) -> None:
    """Exchange ``ex`` is over: ``pool``: its backend connection is idle now (the PING timer,
    §6.7); ``idle``: so is client connection ``idle``."""
    if pool is not None:
        pb << SetTimer(timer=("pool", pool), at=pb.now + 20.0)
    pb << CancelTimer(timer=("read", ex))
    pb << CancelTimer(timer=("body", ex))
    if idle is not None:
        pb << SetTimer(timer=("idle", idle), at=pb.now + 75.0)


def ends_with(sid: int, body: bytes) -> Check:
    """Stream ``sid`` carries ``body`` and ends."""
    return both(lambda events: h2_body(events, sid) == body, h2_ended(sid))


def goaways(events: Sequence[Any]) -> list[int]:
    return [e.error_code for e in events if isinstance(e, h2.events.ConnectionTerminated)]


def goes_away(events: Sequence[Any]) -> None:
    """A ``Sends`` check for the backend: our GOAWAY(NO_ERROR), and no new stream."""
    assert goaways(events) == [NO_ERROR], events
    assert not any(isinstance(e, h2.events.RequestReceived) for e in events), events


def logged(pb: Playbook) -> list[str]:
    """The events of the log records so far, access records left out."""
    return [c.event for c in pb.log if isinstance(c, Log) and c.event != "access"]


def test_two_client_connections_share_one_backend_connection() -> None:
    pb = Playbook(h2_config())
    one, two = h2_client(pb, 1), h2_client(pb, 2)
    a = posted(pb, one, conn=1, ex=1, first=True, opens=-1)
    b = posted(pb, two, conn=2, ex=2, first=True)  # the second stream waits for the first conn
    proxied = {
        b":method": b"POST",
        b":authority": b"proxy.example",
        b":scheme": b"http",
    }
    first = started(1, fields=proxied, absent=(b"host", b"transfer-encoding"))
    backend = connected(pb, -1, [(1, first), (2, started(3))])
    for bsid, client, sid, conn, ex in ((1, one, a, 1, 1), (3, two, b, 2, 2)):
        head_relayed(pb, backend, bsid, client, sid, conn=conn, ex=ex)
        backend.conn.send_data(bsid, TOK, end_stream=True)
        pb >> data(-1, backend.output())
        pb << Sends(conn, client, ends_with(sid, TOK))
        over(pb, ex=ex, pool=-1 if ex == 2 else None, idle=conn)
    pb.done()  # one backend connection, never closed
    assert pb.core.statistics().upstream_connections == 1


def test_max_concurrent_streams_opens_a_second_connection() -> None:
    pb = Playbook(h2_config())
    client = h2_client(pb)
    a = posted(pb, client, ex=1, first=True, opens=-1)
    first = connected(pb, -1, [(1, started(1))], max_streams=1)
    posted(pb, client, ex=2, opens=-2)
    connected(pb, -2, [(2, started(1))], max_streams=1)
    # max_connections = 2: a third request waits for a free stream, no third connection.
    posted(pb, client, ex=3)
    pb.done()
    # The first stream ends: the waiting request takes its place on the first connection.
    first.conn.send_headers(1, SSE, end_stream=True)
    pb >> data(-1, first.output())
    pb << CancelTimer(timer=("head", 1))
    pb << Sends(1, client, h2_response(a, 200, ended=True))
    pb << SetTimer(timer=("read", 1), at=300.0)
    over(pb, ex=1, pool=-1)
    pb << CancelTimer(timer=("pool", -1))
    pb << CancelTimer(timer=("connect", 3))
    pb << Sends(-1, first, started(3))
    pb << SetTimer(timer=("head", 3), at=60.0)
    pb.done()


def test_goaway_lets_in_flight_streams_finish_and_new_ones_go_elsewhere() -> None:
    pb = Playbook(h2_config())
    client = h2_client(pb)
    a = posted(pb, client, ex=1, first=True, opens=-1)
    backend = connected(pb, -1, [(1, started(1))])
    head_relayed(pb, backend, 1, client, a, ex=1)
    # (h2 sends nothing after its own GOAWAY, so the frame is built by hyperframe.)
    pb >> data(-1, goaway_frame(1, NO_ERROR))
    pb.done()
    # A new request opens a new connection rather than using the draining one.
    posted(pb, client, ex=2, opens=-2)
    pb.done()
    # The in-flight stream still finishes on the old connection, which then closes.
    backend.conn.send_data(1, b"data: last\n\n", end_stream=True)
    pb >> data(-1, backend.output())
    pb << Sends(1, client, ends_with(a, b"data: last\n\n"))
    pb << Sends(-1, backend, goes_away)
    pb << CloseConnection(conn=-1)
    over(pb, ex=1)
    pb.done()


def window_updates(sid: int, delta: int) -> Check:
    """Exactly one WINDOW_UPDATE, for stream ``sid``, of ``delta``."""

    def check(events: Sequence[Any]) -> None:
        updates = [e for e in events if isinstance(e, h2.events.WindowUpdated)]
        assert [(e.stream_id, e.delta) for e in updates] == [(sid, delta)], events

    return check


def test_backend_data_acknowledged_only_as_the_client_takes_it() -> None:
    # stream_buffer 32 KiB: reads of 16 KiB, high water 16 KiB, a 16 KiB stream window.
    pb = Playbook(h2_config(stream_buffer=32 * 1024))
    client = h2_client(pb)
    sid = posted(pb, client, ex=1, first=True, opens=-1)
    backend = connected(pb, -1, [(1, started(1))])
    head_relayed(pb, backend, 1, client, sid, ex=1)
    assert backend.conn.local_flow_control_window(1) == 16 * 1024

    def frame() -> None:
        backend.conn.send_data(1, b"x" * 8_000)
        pb >> data(-1, backend.output())
        pb << Sends(1, client, lambda events: h2_body(events, sid) == b"x" * 8_000)

    # Below high water: each DATA frame is acknowledged as it is handed to the client side.
    frame()
    frame()
    pb << Sends(-1, backend, window_updates(1, 16_000))
    # The client takes nothing: past high water the acknowledgements are withheld.
    frame()
    frame()
    pb.done()
    assert backend.conn.local_flow_control_window(1) == 16 * 1024 - 16_000
    (entry,) = pb.core.statistics().streams
    assert entry.upstream_paused
    # The client socket takes everything: the withheld window goes back to the backend.
    pb >> sent(1, len(pb.take(1)))
    pb << Sends(-1, backend, window_updates(1, 16_000))
    pb.done()
    (entry,) = pb.core.statistics().streams
    assert not entry.upstream_paused


def test_client_reset_cancels_the_backend_stream_only() -> None:
    pb = Playbook(h2_config())
    client = h2_client(pb)
    a = posted(pb, client, ex=1, first=True, opens=-1)
    b = posted(pb, client, ex=2)
    backend = connected(pb, -1, [(1, started(1)), (2, started(3))])
    head_relayed(pb, backend, 1, client, a, ex=1)
    client.conn.reset_stream(a, CANCEL)
    pb >> data(1, client.conn.data_to_send())
    pb << Sends(-1, backend, h2_resets((1, CANCEL)))
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    pb.done()  # the shared connection is not closed
    # The other stream goes on.
    backend.conn.send_headers(3, SSE, end_stream=True)
    pb >> data(-1, backend.output())
    pb << CancelTimer(timer=("head", 2))
    pb << Sends(1, client, h2_response(b, 200, ended=True))
    pb << SetTimer(timer=("read", 2), at=300.0)
    over(pb, ex=2, pool=-1, idle=1)
    pb.done()


def test_backend_reset_mid_stream_resets_the_client_stream() -> None:
    pb = Playbook(h2_config())
    client = h2_client(pb)
    a = posted(pb, client, ex=1, first=True, opens=-1)
    backend = connected(pb, -1, [(1, started(1))])
    head_relayed(pb, backend, 1, client, a, ex=1)
    backend.conn.reset_stream(1, h2.errors.ErrorCodes.INTERNAL_ERROR)
    pb >> data(-1, backend.output())
    pb << SetTimer(timer=("pool", -1), at=20.0)
    pb << Sends(1, client, h2_resets((a, h2.errors.ErrorCodes.INTERNAL_ERROR)))
    over(pb, ex=1, idle=1)
    pb.done()


def test_trailers_reach_h2_and_h1_clients() -> None:
    pb = Playbook(h2_config())
    client = h2_client(pb)
    grpc = [(b"content-type", b"application/grpc"), (b"te", b"trailers")]
    a = posted(pb, client, ex=1, first=True, opens=-1, headers=grpc)
    backend = connected(pb, -1, [(1, started(1, fields={b"te": b"trailers"}))])
    backend.conn.send_headers(1, [(b":status", b"200"), (b"content-type", b"application/grpc")])
    backend.conn.send_data(1, b"\x00\x00\x00\x00\x01y")
    backend.conn.send_headers(
        1, [(b"grpc-status", b"5"), (b"grpc-message", b"gone")], end_stream=True
    )

    def trailers(events: Sequence[Any]) -> None:
        (got,) = [e for e in events if isinstance(e, h2.events.TrailersReceived)]
        assert got.stream_id == a
        assert dict(got.headers) == {b"grpc-status": b"5", b"grpc-message": b"gone"}
        assert h2_body(events, a) == b"\x00\x00\x00\x00\x01y"

    pb >> data(-1, backend.output())
    pb << CancelTimer(timer=("head", 1))
    pb << Sends(1, client, h2_response(a, 200))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << Sends(1, client, trailers)
    over(pb, ex=1, pool=-1, idle=1)
    pb.done()

    # An HTTP/1.1 client gets them as chunked trailers.
    h1 = H1ClientPeer()
    pb.accept(2)
    pb >> data(2, h1.request("POST", "/x", [("te", "trailers")], body=b"{}"))
    pb << CancelTimer(timer=("header", 2))
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << CancelTimer(timer=("pool", -1))
    pb << CancelTimer(timer=("connect", 2))
    pb << Sends(-1, backend, started(3, b"/x", fields={b"te": b"trailers"}, body=None))
    pb << SetTimer(timer=("head", 2), at=60.0)
    pb << SetTimer(timer=("body", 2), at=30.0)
    pb << Sends(-1, backend, lambda events: h2_body(events, 3) == b"{}")
    backend.conn.send_headers(3, [(b":status", b"200")])
    backend.conn.send_data(3, b"body")
    backend.conn.send_headers(3, [(b"x-done", b"yes")], end_stream=True)
    pb >> data(-1, backend.output())
    pb << CancelTimer(timer=("head", 2))
    pb << SetTimer(timer=("send", 2), at=60.0)
    pb << Sends(2, h1, h1_response(200))

    def chunked_trailers(events: Sequence[Any]) -> None:
        assert h1_body(events) == b"body"
        assert isinstance(events[-1], h11.EndOfMessage)
        assert events[-1].headers == [(b"x-done", b"yes")]

    pb << SetTimer(timer=("read", 2), at=300.0)
    pb << Sends(2, h1, chunked_trailers)
    over(pb, ex=2, pool=-1, idle=2)
    pb.done()


def finished_one_stream(pb: Playbook, *, ping_at: float = 20.0) -> H2BackendPeer:
    """One POST on client connection 1 served whole by backend connection -1, which is idle
    then: its PING timer is set for ``ping_at``."""
    client = h2_client(pb)
    sid = posted(pb, client, ex=1, first=True, opens=-1)
    backend = connected(pb, -1, [(1, started(1))])
    head_relayed(pb, backend, 1, client, sid, ex=1)
    backend.conn.send_data(1, TOK, end_stream=True)
    pb >> data(-1, backend.output())
    pb << Sends(1, client, ends_with(sid, TOK))
    pb << SetTimer(timer=("pool", -1), at=ping_at)
    over(pb, ex=1, idle=1)
    pb.done()
    return backend


def pinged(events: Sequence[Any]) -> None:
    assert len([e for e in events if isinstance(e, h2.events.PingReceived)]) == 1, events


def test_idle_backend_connection_is_pinged_then_closed_after_the_idle_timeout() -> None:
    config = h2_config()
    group = attrs.evolve(config.upstreams["default"], pool_idle_timeout=30.0)
    pb = Playbook(attrs.evolve(config, upstreams={"default": group}))
    # RFC 9113 §6.7: an idle connection is PINGed, a third of the idle timeout apart.
    backend = finished_one_stream(pb, ping_at=10.0)
    for at in (10.0, 20.0):
        pb.now = at
        pb >> wakeup("pool", -1)
        pb << Sends(-1, backend, pinged)
        pb << SetTimer(timer=("pool", -1), at=at + 10.0)
        pb >> data(-1, backend.output())  # h2 answers the PING with an ACK
        pb.done()
    pb.now = 30.0
    pb >> wakeup("pool", -1)
    pb << Sends(-1, backend, goes_away)
    pb << CloseConnection(conn=-1)  # closed at the idle timeout, not before
    pb.done()


def test_backend_that_does_not_answer_a_ping_is_closed() -> None:
    pb = Playbook(h2_config())
    backend = finished_one_stream(pb)
    pb.now = 20.0
    pb >> wakeup("pool", -1)
    pb << Sends(-1, backend, pinged)
    pb << SetTimer(timer=("pool", -1), at=40.0)
    # No ACK comes back (the backend is wedged): the next tick closes the connection.
    pb.now = 40.0
    pb >> wakeup("pool", -1)
    pb << Sends(-1, backend, goes_away)
    pb << CloseConnection(conn=-1)
    pb.done()
    assert logged(pb) == ["upstream_ping_timeout"]


# -- GOAWAY at any moment, a backend that never sends SETTINGS, empty DATA frames --------------

OTHER = "127.0.0.1:9002"
OTHER_ORIGIN = Origin(host="127.0.0.1", port=9002, alpn="h2")


def two_server_config() -> Config:
    servers = tuple(Server(address=a, protocol="h2") for a in (BACKEND, OTHER))
    return default_config(upstreams={"default": Upstream(name="default", servers=servers)})


def goaway_frame(last_stream_id: int, code: h2.errors.ErrorCodes) -> bytes:
    # (h2 sends nothing after its own GOAWAY, so the frame is built by hyperframe.)
    frame = GoAwayFrame(0)
    frame.last_stream_id = last_stream_id
    frame.error_code = code
    return frame.serialize()


def settings_then_goaway(pb: Playbook, conn: int, code: h2.errors.ErrorCodes) -> None:
    """A backend shutting down: its SETTINGS and a GOAWAY(last_stream_id 0) in one write.
    No stream may start on a connection that went away: the proxy closes it."""
    pb >> opened(conn)
    backend = H2BackendPeer(pb, conn, max_streams=100, ack=False)
    pb << Sends(conn, backend, settings)
    pb >> data(conn, backend.output() + goaway_frame(0, code))
    pb << Sends(conn, backend, goes_away)
    pb << CloseConnection(conn=conn)
    pb << CancelTimer(timer=("pool", conn))


def served_whole(
    pb: Playbook, backend: H2BackendPeer, client: H2ClientPeer, sid: int, *, ex: int, up: int
) -> None:
    """The backend answers its stream 1 with a head that ends it; the exchange is over."""
    backend.conn.send_headers(1, SSE, end_stream=True)
    pb >> data(up, backend.output())
    pb << CancelTimer(timer=("head", ex))
    pb << Sends(1, client, h2_response(sid, 200, ended=True))
    pb << SetTimer(timer=("read", ex), at=pb.now + 300.0)
    over(pb, ex=ex, pool=up, idle=1)
    pb.done()


def retried(pb: Playbook, *, ex: int, up: int, origin: Origin) -> None:
    """Exchange ``ex`` tries again: a new connection ``up`` to ``origin``."""
    pb << CancelTimer(timer=("connect", ex))
    pb << SetTimer(timer=("connect", ex), at=pb.now + 5.0)
    pb << OpenConnection(conn=up, origin=origin)
    pb << SetTimer(timer=("pool", up), at=pb.now + 5.0)


def retries(pb: Playbook) -> list[str]:
    return [c.fields["condition"] for c in pb.log if isinstance(c, Log) and c.event == "retry"]


@pytest.mark.parametrize("code", [NO_ERROR, h2.errors.ErrorCodes.INTERNAL_ERROR])
def test_goaway_with_the_first_settings_starts_no_stream_and_fails_over(
    code: h2.errors.ErrorCodes,
) -> None:
    pb = Playbook(two_server_config())
    client = h2_client(pb)
    sid = posted(pb, client, ex=1, first=True, opens=-1)
    settings_then_goaway(pb, -1, code)
    # The request was never sent: it goes to the other server (next_upstream "error").
    retried(pb, ex=1, up=-2, origin=OTHER_ORIGIN)
    pb.done()
    assert logged(pb) == ["upstream_goaway", "health", "retry"]
    backend = connected(pb, -2, [(1, started(1))])
    served_whole(pb, backend, client, sid, ex=1, up=-2)


def test_goaway_before_the_first_request_leaves_the_next_request_a_new_connection() -> None:
    pb = Playbook(h2_config())
    client = h2_client(pb)
    first = posted(pb, client, ex=1, first=True, opens=-1)
    settings_then_goaway(pb, -1, NO_ERROR)
    # One server, nothing to fail over to: the request that waited for it gets a 502 ...
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(1, client, h2_response(first, 502, ended=True))
    pb << CancelTimer(timer=("body", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()
    # ... and the proxy goes on: the next request opens a new connection and is served.
    second, request = client.request(b"POST", CHAT, body=b"{}")
    pb >> data(1, client.conn.data_to_send() + request)
    pb << CancelTimer(timer=("idle", 1))
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << OpenConnection(conn=-2, origin=ORIGIN)
    pb << SetTimer(timer=("pool", -2), at=5.0)
    pb << SetTimer(timer=("body", 2), at=30.0)
    backend = connected(pb, -2, [(2, started(1))])
    served_whole(pb, backend, client, second, ex=2, up=-2)


def test_stream_refused_by_goaway_is_retried_on_a_new_connection() -> None:
    pb = Playbook(h2_config())
    client = h2_client(pb)
    sid = posted(pb, client, ex=1, first=True, opens=-1)  # a POST: not idempotent, but
    old = connected(pb, -1, [(1, started(1))])  # never processed (RFC 9113 §8.7)
    pb >> data(-1, goaway_frame(0, NO_ERROR))
    pb << CancelTimer(timer=("head", 1))
    pb << Sends(-1, old, goes_away)
    pb << CloseConnection(conn=-1)
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-2, origin=ORIGIN)
    pb << SetTimer(timer=("pool", -2), at=5.0)
    pb.done()
    assert retries(pb) == ["stale_connection"]
    backend = connected(pb, -2, [(1, started(1))])
    head_relayed(pb, backend, 1, client, sid, ex=1)
    backend.conn.send_data(1, TOK, end_stream=True)
    pb >> data(-2, backend.output())
    pb << Sends(1, client, ends_with(sid, TOK))
    over(pb, ex=1, pool=-2, idle=1)
    pb.done()


def test_frames_after_goaway_in_the_same_read_still_reach_the_stream() -> None:
    pb = Playbook(h2_config())
    client = h2_client(pb)
    sid = posted(pb, client, ex=1, first=True, opens=-1)
    backend = connected(pb, -1, [(1, started(1))])
    backend.conn.send_headers(1, [(b":status", b"200")])
    backend.conn.send_data(1, b"one ")
    before = backend.output()
    backend.conn.send_data(1, b"two", end_stream=True)
    after = backend.output()
    pb >> data(-1, before + goaway_frame(1, NO_ERROR) + after)
    pb << CancelTimer(timer=("head", 1))
    pb << Sends(1, client, h2_response(sid, 200))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << Sends(1, client, both(ends_with(sid, b"one two"), h2_resets()))
    # Drained: the connection closes once its last stream is done.
    pb << Sends(-1, backend, goes_away)
    pb << CloseConnection(conn=-1)
    over(pb, ex=1, idle=1)
    pb.done()


def test_backend_silent_after_connect_is_closed_and_a_later_request_gets_a_new_one() -> None:
    pb = Playbook(h2_config())
    client = h2_client(pb)
    first = posted(pb, client, ex=1, first=True, opens=-1)
    pb >> opened(-1)  # up at TCP; the backend never sends its SETTINGS (RFC 9113 §3.4)
    backend = H2BackendPeer(pb, -1)
    pb << Sends(-1, backend, settings)
    pb.now = pb.core.config.timeouts.connect
    pb >> wakeup("pool", -1)
    pb << Sends(-1, backend, goes_away)
    pb << CloseConnection(conn=-1)
    # The request that waited for it fails as a timeout, with one server to try: 504.
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(1, client, h2_response(first, 504, ended=True))
    pb << CancelTimer(timer=("body", 1))
    pb << SetTimer(timer=("idle", 1), at=pb.now + 75.0)
    pb.done()
    assert logged(pb) == ["upstream_start_timeout"]
    # 100 s later a request is not stuck behind it: a new connection serves it.
    pb.now += 100
    second, request = client.request(b"POST", CHAT, body=b"{}")
    pb >> data(1, client.conn.data_to_send() + request)
    pb << CancelTimer(timer=("idle", 1))
    pb << SetTimer(timer=("connect", 2), at=pb.now + 5.0)
    pb << OpenConnection(conn=-2, origin=ORIGIN)
    pb << SetTimer(timer=("pool", -2), at=pb.now + 5.0)
    pb << SetTimer(timer=("body", 2), at=pb.now + 30.0)
    fresh = connected(pb, -2, [(2, started(1))])
    served_whole(pb, fresh, client, second, ex=2, up=-2)


def test_request_waiting_for_a_silent_backend_is_retried_on_the_next_server() -> None:
    pb = Playbook(two_server_config())
    client = h2_client(pb)
    sid = posted(pb, client, ex=1, first=True, opens=-1)
    pb >> opened(-1)
    silent = H2BackendPeer(pb, -1)
    pb << Sends(-1, silent, settings)
    pb.now = 5.0
    pb >> wakeup("pool", -1)
    pb << Sends(-1, silent, goes_away)
    pb << CloseConnection(conn=-1)
    retried(pb, ex=1, up=-2, origin=OTHER_ORIGIN)
    pb.done()
    assert retries(pb) == ["timeout"]
    backend = connected(pb, -2, [(1, started(1))])
    served_whole(pb, backend, client, sid, ex=1, up=-2)


def test_empty_data_frame_ending_the_stream_is_not_sent_on_as_an_empty_frame() -> None:
    pb = Playbook(h2_config())
    client = h2_client(pb)
    sid = posted(pb, client, ex=1, first=True, opens=-1)
    backend = connected(pb, -1, [(1, started(1))])
    head_relayed(pb, backend, 1, client, sid, ex=1)
    backend.conn.send_data(1, TOK)
    pb >> data(-1, backend.output())
    pb << Sends(1, client, lambda events: h2_body(events, sid) == TOK)
    backend.conn.send_data(1, b"", pad_length=9)  # empty but flow-controlled
    pb >> data(-1, backend.output())
    pb.done()  # nothing to send on
    backend.conn.end_stream(1)  # an empty DATA frame with END_STREAM

    def just_the_end(events: Sequence[Any]) -> None:
        frames = [e for e in events if isinstance(e, h2.events.DataReceived)]
        assert [(e.data, e.stream_ended is not None) for e in frames] == [(b"", True)]

    pb >> data(-1, backend.output())
    pb << Sends(1, client, both(just_the_end, h2_ended(sid)))
    over(pb, ex=1, pool=-1, idle=1)
    pb.done()


def test_backend_connection_uses_stream_ids_up_to_the_last_and_no_further() -> None:
    # RFC 9113 §5.1.1: client stream ids are odd and at most 2**31-1. The connection carries
    # the two last ones (2**31-3, then 2**31-1) and is retired only when the last is taken:
    # the request after it opens a new connection, none is tried on an id past the last, and
    # the old connection drains its streams, then says GOAWAY and closes.
    pb = Playbook(h2_config())
    client = h2_client(pb)
    a = posted(pb, client, ex=1, first=True, opens=-1)
    backend = connected(pb, -1, [(1, started(1))])
    upstream: Any = pb.core.upstreams[-1]
    upstream.client.conn.highest_outbound_stream_id = 2**31 - 5  # as if 2**30 - 2 streams ran
    served_whole(pb, backend, client, a, ex=1, up=-1)
    last_but_one, last = 2**31 - 3, 2**31 - 1
    b, request = client.request(b"POST", CHAT, body=b"{}")
    pb >> data(1, client.conn.data_to_send() + request)
    pb << CancelTimer(timer=("idle", 1))
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << CancelTimer(timer=("pool", -1))
    pb << CancelTimer(timer=("connect", 2))
    pb << Sends(-1, backend, started(last_but_one, body=None))
    pb << SetTimer(timer=("head", 2), at=60.0)
    pb << SetTimer(timer=("body", 2), at=30.0)
    pb << Sends(-1, backend, lambda events: h2_body(events, last_but_one) == b"{}")
    pb.done()
    assert logged(pb) == []  # one id is left: the connection stays in the pool
    c, request = client.request(b"POST", CHAT, body=b"{}")
    pb >> data(1, request)
    pb << SetTimer(timer=("connect", 3), at=5.0)
    pb << CancelTimer(timer=("connect", 3))
    pb << Sends(-1, backend, started(last, body=None))
    pb << SetTimer(timer=("head", 3), at=60.0)
    pb << SetTimer(timer=("body", 3), at=30.0)
    pb << Sends(-1, backend, lambda events: h2_body(events, last) == b"{}")
    pb.done()
    assert logged(pb) == ["upstream_stream_ids_used"]
    # Every id is used: the next request opens a new connection and starts at 1 there.
    d = posted(pb, client, ex=4, opens=-2)
    fresh = connected(pb, -2, [(4, started(1))])
    fresh.conn.send_headers(1, SSE, end_stream=True)
    pb >> data(-2, fresh.output())
    pb << CancelTimer(timer=("head", 4))
    pb << Sends(1, client, h2_response(d, 200, ended=True))
    pb << SetTimer(timer=("read", 4), at=300.0)
    over(pb, ex=4, pool=-2)
    pb.done()
    # Both last streams finish on the old connection, which then closes.
    backend.conn.send_headers(last_but_one, SSE, end_stream=True)
    pb >> data(-1, backend.output())
    pb << CancelTimer(timer=("head", 2))
    pb << Sends(1, client, h2_response(b, 200, ended=True))
    pb << SetTimer(timer=("read", 2), at=300.0)
    over(pb, ex=2)
    pb.done()
    backend.conn.send_headers(last, SSE, end_stream=True)
    pb >> data(-1, backend.output())
    pb << CancelTimer(timer=("head", 3))
    pb << Sends(1, client, h2_response(c, 200, ended=True))
    pb << SetTimer(timer=("read", 3), at=300.0)
    pb << Sends(-1, backend, goes_away)
    pb << CloseConnection(conn=-1)
    over(pb, ex=3, idle=1)
    pb.done()


@pytest.mark.parametrize(
    "fields",
    [
        [(b":status", b"200"), (b"x-a", b"a\r\ninjected: 1")],  # a header injection
        [(b":status", b"200"), (b"x-a", b"a\x0cb")],
        [(b":status", b"200"), (b"x-a", b" a")],
        [(b":status", b"200"), (b"X-Upper", b"a")],
        [(b":status", b"200"), (b"bad name", b"a")],
        [(b":status", b"2xx")],
        [(b":status", b"+200")],
    ],
    ids=["crlf", "form-feed", "leading-space", "upper-case", "space-in-name", "2xx", "+200"],
)
def test_malformed_backend_response_head_is_a_502_never_relayed(fields) -> None:
    # RFC 9113 §8.1.1, §8.2.1: h2 hands us the block unvalidated; a malformed response is a
    # stream error (RST_STREAM) and the client gets a 502, never the fields (h11 would refuse
    # to write them, and CR LF in a value would inject a header).
    pb = Playbook(h2_config())
    h1 = H1ClientPeer()
    pb.accept(1)
    pb >> data(1, h1.request("POST", "/x", body=b"{}"))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb << SetTimer(timer=("pool", -1), at=5.0)
    pb << SetTimer(timer=("body", 1), at=30.0)
    backend = connected(pb, -1, [(1, started(1, b"/x"))])
    backend.conn.config.validate_outbound_headers = False
    backend.conn.config.normalize_outbound_headers = False
    backend.conn.send_headers(1, fields)
    pb >> data(-1, backend.output())
    pb << CancelTimer(timer=("head", 1))
    pb << Sends(-1, backend, h2_resets((1, PROTOCOL_ERROR)))
    pb << SetTimer(timer=("pool", -1), at=20.0)
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << (reply := Sends(1, h1, h1_response(502)))
    pb << CancelTimer(timer=("body", 1))
    pb << CloseConnection(conn=1)
    pb.done()
    assert b"injected" not in reply.data

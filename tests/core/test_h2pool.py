"""``core/upstream/h2pool.py`` as whole conversations: client requests as streams of one shared
HTTP/2 backend connection.

The rules under test (RFC 9113): streams start only after the backend's first SETTINGS
(§3.4), several exchanges share one connection with their own stream ids (§5.1.1), each
response goes to its own client whatever the order the backend answers in, a client that
goes away cancels only its stream with RST_STREAM(CANCEL) (§8.7), and at the backend's
SETTINGS_MAX_CONCURRENT_STREAMS a request waits for a free stream (§5.1.2) on the same
connection when ``max_connections`` allows no other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import h2.errors
import h2.events
import h11
import pytest
from playbook import (
    BACKEND,
    H1ClientPeer,
    H2BackendPeer,
    Playbook,
    Sends,
    Where,
    closed,
    data,
    default_config,
    opened,
)

from muxproxy.config import Config, Server, Upstream
from muxproxy.core.commands import (
    CancelTimer,
    OpenConnection,
    Origin,
    SendData,
    SetTimer,
)

ORIGIN = Origin(host="127.0.0.1", port=9001, alpn="h2")
SSE = [(b":status", b"200"), (b"content-type", b"text/event-stream")]


def h2_config(max_connections: int = 4) -> Config:
    server = Server(address=BACKEND, protocol="h2", max_connections=max_connections)
    return default_config(upstreams={"default": Upstream(name="default", servers=(server,))})


def request_on(sid: int, path: bytes) -> Any:
    """A ``Sends`` check: the HEADERS of a request for ``path`` on stream ``sid``."""

    def check(events: Sequence[Any]) -> None:
        requests = [e for e in events if isinstance(e, h2.events.RequestReceived)]
        assert [(r.stream_id, dict(r.headers)[b":path"]) for r in requests] == [(sid, path)]

    return check


def ends(sid: int) -> Any:
    """A ``Sends`` check: the request's END_STREAM (an empty DATA frame)."""
    return lambda events: (
        [e.stream_id for e in events if isinstance(e, h2.events.StreamEnded)] == [sid]
    )


def connect(pb: Playbook, clients: dict[int, H1ClientPeer], **settings: Any) -> H2BackendPeer:
    """Requests of every client in; one connection -1 opened; the backend's preface back."""
    for conn, client in clients.items():
        pb.accept(conn)
        pb >> data(conn, client.request("GET", b"/%d" % conn))
        pb << CancelTimer(timer=("header", conn))
        pb << SetTimer(timer=("connect", conn), at=5.0)
        if conn == 1:  # the first one opens the connection; the others wait for it
            pb << OpenConnection(conn=-1, origin=ORIGIN)
            pb << SetTimer(timer=("pool", -1), at=5.0)  # its SETTINGS are due (§3.4)
    pb >> opened(-1)
    backend = H2BackendPeer(pb, -1, **settings)
    pb << Sends(
        -1,
        backend,
        lambda events: any(isinstance(e, h2.events.RemoteSettingsChanged) for e in events),
    )
    pb.done()
    return backend


def both_started(pb: Playbook, backend: H2BackendPeer) -> None:
    # No stream before the backend's SETTINGS (§3.4): both start in the call that brings it.
    pb >> data(-1, backend.output())
    pb << CancelTimer(timer=("pool", -1))
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(-1, backend, request_on(1, b"/1"))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb << CancelTimer(timer=("connect", 2))
    pb << Sends(-1, backend, request_on(3, b"/2"))
    pb << SetTimer(timer=("head", 2), at=60.0)
    pb.done()


def test_two_clients_share_one_backend_connection_as_two_streams() -> None:
    pb = Playbook(h2_config())
    clients = {1: H1ClientPeer(), 2: H1ClientPeer()}
    backend = connect(pb, clients)
    both_started(pb, backend)

    # The backend answers stream 3 first: it reaches client 2, not client 1.
    backend.conn.send_headers(3, SSE)
    backend.conn.send_data(3, b"data: two\n\n")
    pb >> data(-1, backend.output())
    pb << CancelTimer(timer=("head", 2))
    pb << SetTimer(timer=("send", 2), at=60.0)
    pb << Sends(2, clients[2], lambda events: events[0].status_code == 200)
    pb << SetTimer(timer=("read", 2), at=300.0)
    pb << SendData(conn=2, data=b"b\r\ndata: two\n\n\r\n")
    backend.conn.send_headers(1, SSE)
    backend.conn.send_data(1, b"data: one\n\n", end_stream=True)
    pb >> data(-1, backend.output())
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, clients[1], lambda events: events[0].status_code == 200)
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << SendData(conn=1, data=b"b\r\ndata: one\n\n\r\n")
    pb << SendData(conn=1, data=b"0\r\n\r\n")
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()  # stream 3 still open: no idle PING timer yet
    backend.conn.send_data(3, b"", end_stream=True)
    pb >> data(-1, backend.output())
    pb << SendData(conn=2, data=b"0\r\n\r\n")
    pb << SetTimer(timer=("pool", -1), at=20.0)  # idle now: PING it (§6.7)
    pb << CancelTimer(timer=("read", 2))
    pb << SetTimer(timer=("idle", 2), at=75.0)
    pb.done()
    assert [c.conn for c in pb.opens()] == [-1]


def test_a_client_gone_cancels_its_stream_only() -> None:
    pb = Playbook(h2_config())
    clients = {1: H1ClientPeer(), 2: H1ClientPeer()}
    backend = connect(pb, clients)
    both_started(pb, backend)
    for sid in (1, 3):
        backend.conn.send_headers(sid, SSE)
    pb >> data(-1, backend.output())
    pb.rest()
    pb >> closed(1)

    def cancels_stream_1(events: Sequence[Any]) -> None:
        (reset,) = events
        assert isinstance(reset, h2.events.StreamReset)
        assert (reset.stream_id, reset.error_code) == (1, h2.errors.ErrorCodes.CANCEL)

    pb << Sends(-1, backend, cancels_stream_1)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("send", 1))
    pb.done()  # the shared connection is not closed
    backend.conn.send_data(3, b"data: still\n\n", end_stream=True)
    pb >> data(-1, backend.output())
    pb << SendData(conn=2, data=b"d\r\ndata: still\n\n\r\n")
    pb << SendData(conn=2, data=b"0\r\n\r\n")
    pb << SetTimer(timer=("pool", -1), at=20.0)
    pb << CancelTimer(timer=("read", 2))
    pb << SetTimer(timer=("idle", 2), at=75.0)
    pb.done()


def test_at_max_concurrent_streams_a_request_waits_for_a_free_stream() -> None:
    pb = Playbook(h2_config(max_connections=1))
    clients = {1: H1ClientPeer(), 2: H1ClientPeer()}
    backend = connect(pb, clients, max_streams=1)
    pb >> data(-1, backend.output())
    pb << CancelTimer(timer=("pool", -1))
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(-1, backend, request_on(1, b"/1"))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb.done()  # client 2 waits: one stream allowed, one connection allowed
    backend.conn.send_headers(1, [(b":status", b"204")], end_stream=True)
    pb >> data(-1, backend.output())
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Where(SendData, lambda c: c.conn == 1 and c.data.startswith(b"HTTP/1.1 204"))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << SetTimer(timer=("pool", -1), at=20.0)  # idle for a moment,
    pb << CancelTimer(timer=("read", 1))  # the first exchange is over,
    # then (Effects.defer) the waiting request takes the freed stream,
    pb << CancelTimer(timer=("pool", -1))
    pb << CancelTimer(timer=("connect", 2))
    pb << Sends(-1, backend, request_on(3, b"/2"))  # on the same connection
    pb << SetTimer(timer=("head", 2), at=60.0)
    pb << SetTimer(timer=("idle", 1), at=75.0)  # and the first client goes idle
    pb.done()
    assert [c.conn for c in pb.opens()] == [-1]
    (response,) = [e for e in clients[1].events(pb.take(1)) if isinstance(e, h11.Response)]
    assert response.status_code == 204


def data_frame(sid: int, payload: bytes) -> bytes:
    """A raw DATA frame (RFC 9113 §6.1), no flags: what h2 refuses to send on a closed stream."""
    return len(payload).to_bytes(3, "big") + b"\x00\x00" + sid.to_bytes(4, "big") + payload


@pytest.mark.parametrize("same_read", [True, False])
def test_data_after_end_stream_reaches_no_client(same_read: bool) -> None:
    # RFC 9113 §5.1: a closed stream takes no more DATA. h2 drops it and answers
    # RST_STREAM(STREAM_CLOSED) (a stream error: its flow-controlled length is given back to
    # the connection's window); the bytes reach no client, and the other stream goes on.
    pb = Playbook(h2_config())
    clients = {1: H1ClientPeer(), 2: H1ClientPeer()}
    backend = connect(pb, clients)
    both_started(pb, backend)
    backend.conn.send_headers(1, SSE)
    backend.conn.send_data(1, b"data: one\n\n", end_stream=True)
    backend.conn.send_headers(3, SSE)
    ended = backend.output()
    poison = data_frame(1, b"POISON")
    before = len(pb.log)
    if same_read:
        pb.receive(-1, ended + poison)
    else:
        pb.receive(-1, ended)
        before = len(pb.log)
        pb.receive(-1, poison)
    reset = pb.take(-1, pb.log[before:])
    stream_closed = h2.errors.ErrorCodes.STREAM_CLOSED
    assert (
        b"\x00\x00\x04\x03\x00" + (1).to_bytes(4, "big") + stream_closed.to_bytes(4, "big") in reset
    )
    backend.conn.send_data(3, b"data: two\n\n", end_stream=True)
    pb.receive(-1, backend.output())
    bodies = {
        conn: b"".join(e.data for e in client.events(pb.take(conn)) if isinstance(e, h11.Data))
        for conn, client in clients.items()
    }
    assert bodies == {1: b"data: one\n\n", 2: b"data: two\n\n"}
    assert [c.conn for c in pb.opens()] == [-1]  # the connection carries on

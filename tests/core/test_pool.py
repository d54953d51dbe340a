"""``core/upstream/pool.py`` as whole conversations: HTTP/1.1 backend connections kept alive.

The pool's rules under test (RFC 9112 §9.3): a connection whose request and response both
completed goes back to the pool and carries the next request without a new connect; one the
backend marked ``Connection: close`` is closed; an idle one is closed after
``pool_idle_timeout`` or dropped when the backend closes it; at most ``pool_max_idle`` are
kept; a connect no exchange waits for any more is closed at once (RFC 9113 §10.5).
"""

from __future__ import annotations

import attrs
import h11
from playbook import (
    H1BackendPeer,
    H1ClientPeer,
    Playbook,
    Sends,
    closed,
    data,
    default_config,
    is_request,
    opened,
    sent,
    wakeup,
)

from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    OpenConnection,
    Origin,
    SetTimer,
)

ORIGIN = Origin(host="127.0.0.1", port=9001)


def served(
    pb: Playbook,
    conn: int,
    client: H1ClientPeer,
    up: int,
    backend: H1BackendPeer,
    body: bytes,
    *,
    close: bool = False,
    exchange: int | None = None,
    send_timer: bool = True,
) -> None:
    """The backend's whole response to the request in flight (exchange ``exchange``, by
    default numbered like the client connection), relayed to the client."""
    ex = conn if exchange is None else exchange
    pb >> data(up, backend.reply(body, close=close))
    pb << CancelTimer(timer=("head", ex))
    if send_timer:  # else still armed: it is checked lazily when it fires
        pb << SetTimer(timer=("send", conn), at=pb.now + 60.0)
    head = Sends(conn, client)
    pb << head
    pb << SetTimer(timer=("read", ex), at=pb.now + 300.0)
    rest = Sends(conn, client)
    pb << rest
    (response,) = head.events
    assert response.status_code == 200
    assert [e.data for e in rest.events if isinstance(e, h11.Data)] == [body]
    assert isinstance(rest.events[-1], h11.EndOfMessage)


def first_request(pb: Playbook, client: H1ClientPeer, backend: H1BackendPeer) -> None:
    """Client 1's request over a new backend connection -1, served whole and pooled."""
    pb.accept(1)
    pb >> data(1, client.request("GET", "/one"))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(-1, backend, is_request(b"/one"))
    pb << SetTimer(timer=("head", 1), at=60.0)
    served(pb, 1, client, -1, backend, b"first")
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb >> sent(1, len(pb.take(1)))  # the client read it all; the send timer is lazy
    pb.done()
    client.conn.start_next_cycle()
    backend.conn.start_next_cycle()


def test_the_next_request_reuses_the_pooled_connection_without_a_connect() -> None:
    pb = Playbook()
    client, backend = H1ClientPeer(), H1BackendPeer()
    first_request(pb, client, backend)
    pb.now = 10.0
    pb >> data(1, client.request("GET", "/two"))
    pb << CancelTimer(timer=("idle", 1))
    pb << SetTimer(timer=("connect", 2), at=15.0)
    pb << CancelTimer(timer=("pool", -1))  # out of the pool: no OpenConnection
    pb << CancelTimer(timer=("connect", 2))
    pb << Sends(-1, backend, is_request(b"/two"))
    pb << SetTimer(timer=("head", 2), at=70.0)
    served(pb, 1, client, -1, backend, b"second", exchange=2, send_timer=False)
    pb << SetTimer(timer=("pool", -1), at=70.0)
    pb << CancelTimer(timer=("read", 2))
    pb << SetTimer(timer=("idle", 1), at=85.0)
    pb.done()


def test_a_response_with_connection_close_is_not_pooled() -> None:
    pb = Playbook()
    client, backend = H1ClientPeer(), H1BackendPeer()
    pb.accept(1)
    pb >> data(1, client.request("GET", "/one"))
    pb.rest()
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(-1, backend, is_request(b"/one"))
    pb << SetTimer(timer=("head", 1), at=60.0)
    served(pb, 1, client, -1, backend, b"bye", close=True)
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()
    client.conn.start_next_cycle()
    pb >> data(1, client.request("GET", "/two"))
    pb << CancelTimer(timer=("idle", 1))
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << OpenConnection(conn=-2, origin=ORIGIN)
    pb.done()


def test_an_idle_connection_is_closed_after_pool_idle_timeout() -> None:
    pb = Playbook()
    client, backend = H1ClientPeer(), H1BackendPeer()
    first_request(pb, client, backend)
    pb.now = 60.0
    pb >> wakeup("pool", -1)
    pb << CloseConnection(conn=-1)
    pb.done()
    pb >> closed(-1)
    pb.done()
    pb >> data(1, client.request("GET", "/two"))
    pb << CancelTimer(timer=("idle", 1))
    pb << SetTimer(timer=("connect", 2), at=65.0)
    pb << OpenConnection(conn=-2, origin=ORIGIN)
    pb.done()


def test_a_connection_the_backend_closed_while_idle_is_dropped_from_the_pool() -> None:
    pb = Playbook()
    client, backend = H1ClientPeer(), H1BackendPeer()
    first_request(pb, client, backend)
    pb >> closed(-1)
    pb << CancelTimer(timer=("pool", -1))
    pb.done()
    pb >> data(1, client.request("GET", "/two"))
    pb << CancelTimer(timer=("idle", 1))
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << OpenConnection(conn=-2, origin=ORIGIN)
    pb.done()


def test_no_more_than_pool_max_idle_connections_are_kept() -> None:
    group = attrs.evolve(default_config().upstreams["default"], pool_max_idle=1)
    pb = Playbook(default_config(upstreams={"default": group}))
    clients = {1: H1ClientPeer(), 2: H1ClientPeer()}
    backends = {-1: H1BackendPeer(), -2: H1BackendPeer()}
    for conn, up in ((1, -1), (2, -2)):
        pb.accept(conn)
        pb >> data(conn, clients[conn].request("GET", b"/%d" % conn))
        pb.rest()
        pb >> opened(up)
        pb << CancelTimer(timer=("connect", conn))
        pb << Sends(up, backends[up], is_request(b"/%d" % conn))
        pb << SetTimer(timer=("head", conn), at=60.0)
    served(pb, 1, clients[1], -1, backends[-1], b"a")
    pb << SetTimer(timer=("pool", -1), at=60.0)  # the first to finish is kept
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    served(pb, 2, clients[2], -2, backends[-2], b"b")
    pb << CloseConnection(conn=-2)  # the pool is full
    pb << CancelTimer(timer=("read", 2))
    pb << SetTimer(timer=("idle", 2), at=75.0)
    pb.done()


def test_a_connect_nobody_waits_for_is_closed_at_once() -> None:
    pb = Playbook()
    client = H1ClientPeer()
    pb.accept(1)
    pb >> data(1, client.request("GET", "/one"))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb >> closed(1)
    # Not kept for a later request: a client resetting requests must not leave connects.
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("connect", 1))
    pb.done()
    pb >> opened(-1)  # the connect raced the close: nothing to do
    pb.done()

"""A request on a stale pooled keep-alive connection is retried on a fresh one (pool.py).

RFC 9112 §9.3.1: a backend may close an idle connection at any time, and its FIN can arrive
after we took the connection from the pool and wrote the next request on it. Such a failure
(reused connection, no response byte yet) is retried once on a new connection to the *same*
server, whatever ``next_upstream`` says, without counting against the server's health or
``tries`` — when the request may be sent twice: idempotent, with an Idempotency-Key, or not
written at all.

Each test is a whole conversation: every command asserted in order, timers included; real h11
peers build the bytes and decode what the proxy sends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import h11
import pytest
from checks import Check, h1_body, h1_request, h1_response
from playbook import (
    CHAT,
    H1BackendPeer,
    H1ClientPeer,
    Playbook,
    Sends,
    closed,
    data,
    default_config,
    open_failed,
    opened,
    sent,
    wakeup,
)
from test_h2guard import ORIGIN

from muxproxy.config import NextUpstream
from muxproxy.core.commands import CancelTimer, CloseConnection, Log, OpenConnection, SetTimer

MODELS = b"/v1/models"


def no_next_upstream() -> Playbook:
    config = default_config()
    group = config.upstreams["default"]
    group = attrs.evolve(group, next_upstream=NextUpstream(on=frozenset()))
    return Playbook(attrs.evolve(config, upstreams={"default": group}))


def access(pb: Playbook) -> list[Log]:
    return [c for c in pb.log if isinstance(c, Log) and c.event == "access"]


def retries(pb: Playbook) -> list[Log]:
    return [c for c in pb.log if isinstance(c, Log) and c.event == "retry"]


def body_is(body: bytes) -> Check:
    """A run of HTTP/1.1 response body: exactly ``body``, then its end."""

    def check(events: Sequence[Any]) -> None:
        assert h1_body(events) == body, events
        assert not any(isinstance(e, h11.Response) for e in events), events
        assert isinstance(events[-1], h11.EndOfMessage), events

    return check


# -- the conversation's steps -----------------------------------------------------------------


def first_request(pb: Playbook, conn: int = 1, ex: int = 1) -> H1ClientPeer:
    """Client connection ``conn`` (accepted here) sends a GET (exchange ``ex``), which opens
    backend connection ``-ex``."""
    client = H1ClientPeer()
    pb.accept(conn)
    pb >> data(conn, client.request())
    pb << CancelTimer(timer=("header", conn))
    pb << SetTimer(timer=("connect", ex), at=pb.now + 5.0)
    pb << OpenConnection(conn=-ex, origin=ORIGIN)
    return client


def forwarded(pb: Playbook, up: int, ex: int, check: Check, *, head: float = 60.0) -> Sends:
    """Backend connection ``up`` opens and gets exchange ``ex``'s request (``check``); the
    response-head deadline (``head``) starts."""
    pb >> opened(up)
    pb << CancelTimer(timer=("connect", ex))
    pb << (request := Sends(up, H1BackendPeer(), check))
    pb << SetTimer(timer=("head", ex), at=pb.now + head)
    return request


def answered(
    pb: Playbook, client: H1ClientPeer, body: bytes, *, conn: int, ex: int, up: int, first: bool
) -> None:
    """Backend connection ``up`` answers exchange ``ex`` with a 200 of ``body``, relayed to
    client connection ``conn`` (``first``: its first response, which arms the send timer);
    both go idle."""
    pb >> data(up, H1BackendPeer().reply(body))
    pb << CancelTimer(timer=("head", ex))
    if first:
        pb << SetTimer(timer=("send", conn), at=pb.now + 60.0)
    pb << Sends(conn, client, h1_response(200, b"", end=False))
    pb << SetTimer(timer=("read", ex), at=pb.now + 300.0)
    pb << Sends(conn, client, body_is(body))
    pb << SetTimer(timer=("pool", up), at=pb.now + 60.0)
    pb << CancelTimer(timer=("read", ex))
    pb << SetTimer(timer=("idle", conn), at=pb.now + 75.0)


def pooled(pb: Playbook) -> tuple[H1ClientPeer, int, H1BackendPeer]:
    """One complete request/response, leaving the backend connection idle in the pool."""
    client = first_request(pb)
    backend = H1BackendPeer()
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << (request := Sends(-1, backend, h1_request(b"GET", MODELS)))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb >> sent(-1, len(request.data))
    pb >> data(-1, backend.reply(b"ok"))
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(200, b"", end=False))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << Sends(1, client, body_is(b"ok"))
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()
    client.conn.start_next_cycle()
    assert pb.core.statistics().idle_upstream_connections == 1
    return client, -1, backend


def reused(pb: Playbook, client: H1ClientPeer) -> Sends:
    """Client connection 1's second GET (exchange 2) goes out on the pooled connection -1."""
    pb >> data(1, client.request())
    pb << CancelTimer(timer=("idle", 1))
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << CancelTimer(timer=("pool", -1))
    pb << CancelTimer(timer=("connect", 2))
    pb << (request := Sends(-1, H1BackendPeer(), h1_request(b"GET", MODELS)))
    pb << SetTimer(timer=("head", 2), at=60.0)
    return request


def posted_on_pool(pb: Playbook, headers: list[tuple[str, str]]) -> tuple[H1ClientPeer, int]:
    """Client connection 2 (accepted here) POSTs ``{}`` (exchange 2) on the pooled connection
    -1: head, then body. Returns the client and the bytes written to the backend."""
    client = H1ClientPeer()
    pb.accept(2)
    pb >> data(2, client.request("POST", CHAT.decode(), headers=headers, body=b"{}"))
    pb << CancelTimer(timer=("header", 2))
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << CancelTimer(timer=("pool", -1))
    pb << CancelTimer(timer=("connect", 2))
    backend = H1BackendPeer()
    pb << (head := Sends(-1, backend, lambda events: events[0].target == CHAT))
    pb << SetTimer(timer=("head", 2), at=60.0)
    pb << SetTimer(timer=("body", 2), at=30.0)
    pb << (body := Sends(-1, backend, body_is(b"{}")))
    return client, len(head.data) + len(body.data)


def refused(pb: Playbook, client: H1ClientPeer, status: int, *, conn: int = 1) -> None:
    """Client connection ``conn``, whose send timer is armed, gets ``status`` and is closed."""
    pb << Sends(conn, client, h1_response(status))
    pb << CloseConnection(conn=conn)


@pytest.mark.parametrize("error", [None, "Connection reset by peer"])
@pytest.mark.parametrize("written", [False, True])
def test_stale_pooled_connection_is_retried_on_a_fresh_one(
    error: str | None, written: bool
) -> None:
    pb = no_next_upstream()  # the stale retry does not depend on next_upstream
    client, up, _ = pooled(pb)
    request = reused(pb, client)  # the request went out on the pooled connection
    if written:
        pb >> sent(up, len(request.data))
    pb >> closed(up, error)  # the backend's FIN (or RST) was already on its way
    # The client sees nothing; a fresh connection to the same server is opened.
    pb << CancelTimer(timer=("head", 2))
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << OpenConnection(conn=-2, origin=ORIGIN)
    (retry,) = retries(pb)
    assert retry.fields["condition"] == "stale_connection"
    forwarded(pb, -2, 2, h1_request(b"GET", MODELS))
    answered(pb, client, b"fresh", conn=1, ex=2, up=-2, first=False)
    pb.done()
    last = access(pb)[-1]
    assert last.fields["status"] == 200 and last.fields["tries"] == 1
    router = pb.core.router(pb.core.config.upstreams["default"])
    assert router.candidates(None, None, pb.now)  # the server's health is untouched


def test_stale_retry_happens_only_once() -> None:
    pb = no_next_upstream()
    client, up, _ = pooled(pb)
    reused(pb, client)
    pb >> closed(up)
    pb << CancelTimer(timer=("head", 2))
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << OpenConnection(conn=-2, origin=ORIGIN)
    forwarded(pb, -2, 2, h1_request(b"GET", MODELS))
    pb >> closed(-2)  # a new connection failing is the server's fault: 502
    pb << CancelTimer(timer=("head", 2))
    refused(pb, client, 502)
    pb.done()
    assert len(retries(pb)) == 1
    assert len(access(pb)) == 2


def test_written_post_without_idempotency_key_is_not_replayed() -> None:
    pb = no_next_upstream()
    _, up, _ = pooled(pb)
    client, written = posted_on_pool(pb, [])
    pb >> sent(up, written)
    pb >> closed(up)
    pb << CancelTimer(timer=("head", 2))
    pb << SetTimer(timer=("send", 2), at=60.0)
    pb << Sends(2, client, h1_response(502))
    pb << CancelTimer(timer=("body", 2))
    pb << CloseConnection(conn=2)
    pb.done()  # no second OpenConnection
    assert not retries(pb)


@pytest.mark.parametrize("written", [False, True])
def test_post_is_replayed_when_unwritten_or_with_an_idempotency_key(written: bool) -> None:
    pb = no_next_upstream()
    _, up, _ = pooled(pb)
    client, nbytes = posted_on_pool(pb, [("Idempotency-Key", "abc")] if written else [])
    if written:
        pb >> sent(up, nbytes)
    pb >> closed(up)
    pb << CancelTimer(timer=("head", 2))
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << OpenConnection(conn=-2, origin=ORIGIN)
    forwarded(pb, -2, 2, h1_request(b"POST", CHAT, b"{}"))  # body replayed
    pb >> data(-2, H1BackendPeer().reply(b""))
    pb << CancelTimer(timer=("head", 2))
    pb << SetTimer(timer=("send", 2), at=60.0)
    pb << Sends(2, client, h1_response(200, b"", end=True))
    pb << SetTimer(timer=("read", 2), at=300.0)
    pb << SetTimer(timer=("pool", -2), at=60.0)
    pb << CancelTimer(timer=("read", 2))
    pb << CancelTimer(timer=("body", 2))
    pb << SetTimer(timer=("idle", 2), at=75.0)
    pb.done()


def test_failure_after_a_response_byte_is_not_stale() -> None:
    pb = no_next_upstream()
    client, up, _ = pooled(pb)
    reused(pb, client)
    pb >> data(up, b"HTTP/1.1 200 O")  # part of a head: the backend did answer
    pb >> closed(up)
    pb << CancelTimer(timer=("head", 2))
    refused(pb, client, 502)
    pb.done()  # no second OpenConnection
    assert not retries(pb)


def test_first_request_on_a_new_connection_is_not_stale() -> None:
    pb = no_next_upstream()
    client = first_request(pb)
    forwarded(pb, -1, 1, h1_request(b"GET", MODELS))
    pb >> closed(-1)
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    refused(pb, client, 502)
    pb.done()  # no second OpenConnection
    assert not retries(pb)


# -- connects whose exchange went away (Pool.forget, Pool.opened) --------------------------------


def pending_connect(pb: Playbook) -> tuple[H1ClientPeer, int]:
    """A client request whose backend connection is still being opened."""
    return first_request(pb), -1


def test_connect_its_client_left_is_closed_at_once_and_never_pooled() -> None:
    """A connect no one waits for any more is closed, not kept for a later request: resets
    as fast as requests (rapid reset) must leave no backend connections behind."""
    pb = Playbook()
    _, up = pending_connect(pb)
    pb >> closed(1)  # the client went away while we connected
    pb << CloseConnection(conn=up)
    pb << CancelTimer(timer=("connect", 1))
    pb >> opened(up)  # the driver had the outcome queued already: nothing
    assert pb.core.statistics().idle_upstream_connections == 0
    client = first_request(pb, 2, 2)  # a fresh connection, -2
    forwarded(pb, -2, 2, h1_request(b"GET", MODELS))
    pb >> opened(-2)  # reported twice: the second report changes nothing
    answered(pb, client, b"fresh", conn=2, ex=2, up=-2, first=True)
    pb.done()


def test_connect_timeout_closes_the_connect() -> None:
    pb = no_next_upstream()
    client, up = pending_connect(pb)
    pb.now = pb.core.config.timeouts.connect
    pb >> wakeup("connect", 1)
    pb << CloseConnection(conn=up)
    pb << SetTimer(timer=("send", 1), at=pb.now + 60.0)
    refused(pb, client, 504)
    pb.done()


def test_close_reported_for_a_pending_connect_fails_its_exchange() -> None:
    """An embedder may report ConnectionClosed for a connect (before, or instead of,
    OpenFailed): the exchange waiting for it fails over at once, and the OpenFailed that
    may follow, or the client going away, finds nothing left to clean up."""
    pb = no_next_upstream()
    client, up = pending_connect(pb)
    pb >> closed(up, "Connection refused")
    pb << CancelTimer(timer=("connect", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    refused(pb, client, 502)
    pb >> open_failed(up, "refused")  # nothing
    pb >> closed(1)
    pb << CancelTimer(timer=("send", 1))
    pb.done()
    assert pb.core.statistics().upstream_connections == 0


def test_client_leaving_after_a_close_of_its_pending_connect() -> None:
    config = default_config()
    pb = Playbook(config)
    client, up = pending_connect(pb)
    pb >> closed(up)  # no OpenFailed follows
    pb << CancelTimer(timer=("connect", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    refused(pb, client, 502)
    pb >> closed(1)
    pb << CancelTimer(timer=("send", 1))
    pb >> open_failed(up, "refused")  # nothing
    pb.done()
    assert pb.core.statistics().upstream_connections == 0
    assert not pb.core.exchanges

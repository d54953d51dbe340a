"""A request on a stale pooled keep-alive connection is retried on a fresh one (pool.py).

RFC 9112 §9.3.1: a backend may close an idle connection at any time, and its FIN can arrive
after we took the connection from the pool and wrote the next request on it. Such a failure
(reused connection, no response byte yet) is retried once on a new connection to the *same*
server, whatever ``next_upstream`` says, without counting against the server's health or
``tries`` — when the request may be sent twice: idempotent, with an Idempotency-Key, or not
written at all.
"""

from __future__ import annotations

import attrs
import h11
import pytest
from playbook import BACKEND, H1BackendPeer, H1ClientPeer, Playbook, default_config

from muxproxy.config import NextUpstream
from muxproxy.core.commands import CloseConnection, Log
from muxproxy.core.events import OpenFailed


def no_next_upstream() -> Playbook:
    config = default_config()
    group = config.upstreams["default"]
    group = attrs.evolve(group, next_upstream=NextUpstream(on=frozenset()))
    return Playbook(attrs.evolve(config, upstreams={"default": group}))


def pooled(pb: Playbook) -> tuple[H1ClientPeer, int, H1BackendPeer]:
    """One complete request/response, leaving the backend connection idle in the pool."""
    client = H1ClientPeer()
    pb.accept(1)
    pb.receive(1, client.request())
    (open_cmd,) = pb.opens()
    up = open_cmd.conn
    pb.opened(up)
    backend = H1BackendPeer()
    backend.events(pb.take(up))
    pb.sent(up, len(pb.take(up)))
    head = backend.conn.send(h11.Response(status_code=200, headers=[("Content-Length", "2")]))
    pb.receive(up, (head or b"") + backend.chunk(b"ok") + backend.end())
    assert [type(e) for e in client.events(pb.take(1))][-1] is h11.EndOfMessage
    client.conn.start_next_cycle()
    assert pb.core.statistics().idle_upstream_connections == 1
    return client, up, backend


def answer(pb: Playbook, up: int) -> None:
    backend = H1BackendPeer()
    (request, *_) = backend.events(pb.take(up))
    assert isinstance(request, h11.Request)
    head = backend.conn.send(h11.Response(status_code=200, headers=[("Content-Length", "5")]))
    pb.receive(up, (head or b"") + backend.chunk(b"fresh") + backend.end())


def access(pb: Playbook) -> list[Log]:
    return [c for c in pb.log if isinstance(c, Log) and c.event == "access"]


def retries(pb: Playbook) -> list[Log]:
    return [c for c in pb.log if isinstance(c, Log) and c.event == "retry"]


@pytest.mark.parametrize("error", [None, "Connection reset by peer"])
@pytest.mark.parametrize("written", [False, True])
def test_stale_pooled_connection_is_retried_on_a_fresh_one(
    error: str | None, written: bool
) -> None:
    pb = no_next_upstream()  # the stale retry does not depend on next_upstream
    client, up, _ = pooled(pb)
    before = len(pb.log)
    pb.receive(1, client.request())
    assert pb.take(up, pb.log[before:])  # the request went out on the pooled connection
    if written:
        pb.sent(up, len(pb.take(up, pb.log[before:])))
    pb.closed(up, error)  # the backend's FIN (or RST) was already on its way
    assert not pb.take(1, pb.log[before:])  # the client saw nothing
    (_, fresh) = pb.opens()
    assert str(fresh.origin) == BACKEND and fresh.conn != up
    (retry,) = retries(pb)
    assert retry.fields["condition"] == "stale_connection"
    pb.opened(fresh.conn)
    answer(pb, fresh.conn)
    events = client.events(pb.take(1, pb.log[before:]))
    assert events[0].status_code == 200
    assert b"".join(e.data for e in events if type(e) is h11.Data) == b"fresh"
    last = access(pb)[-1]
    assert last.fields["status"] == 200 and last.fields["tries"] == 1
    router = pb.core.router(pb.core.config.upstreams["default"])
    assert router.candidates(None, None, pb.now)  # the server's health is untouched


def test_stale_retry_happens_only_once() -> None:
    pb = no_next_upstream()
    client, up, _ = pooled(pb)
    before = len(pb.log)
    pb.receive(1, client.request())
    pb.closed(up)
    (_, fresh) = pb.opens()
    pb.opened(fresh.conn)
    pb.closed(fresh.conn)  # a new connection failing is the server's fault: 502
    (response, *_) = client.events(pb.take(1, pb.log[before:]))
    assert response.status_code == 502
    assert len(retries(pb)) == 1
    assert len(access(pb)) == 2


def test_written_post_without_idempotency_key_is_not_replayed() -> None:
    pb = no_next_upstream()
    _, up, _ = pooled(pb)
    client = H1ClientPeer()
    pb.accept(2)
    request = client.request("POST", "/v1/chat/completions", body=b"{}")
    before = len(pb.log)
    pb.receive(2, request)
    pb.sent(up, len(pb.take(up, pb.log[before:])))
    pb.closed(up)
    (response, *_) = client.events(pb.take(2, pb.log[before:]))
    assert response.status_code == 502
    assert not retries(pb) and len(pb.opens()) == 1


@pytest.mark.parametrize("written", [False, True])
def test_post_is_replayed_when_unwritten_or_with_an_idempotency_key(written: bool) -> None:
    pb = no_next_upstream()
    _, up, _ = pooled(pb)
    client = H1ClientPeer()
    pb.accept(2)
    headers = [("Idempotency-Key", "abc")] if written else []
    request = client.request("POST", "/v1/chat/completions", headers=headers, body=b"{}")
    before = len(pb.log)
    pb.receive(2, request)
    if written:
        pb.sent(up, len(pb.take(up, pb.log[before:])))
    pb.closed(up)
    (_, fresh) = pb.opens()
    pb.opened(fresh.conn)
    backend = H1BackendPeer()
    events = backend.events(pb.take(fresh.conn))
    assert b"".join(e.data for e in events if type(e) is h11.Data) == b"{}"  # body replayed
    head = backend.conn.send(h11.Response(status_code=200, headers=[("Content-Length", "0")]))
    pb.receive(fresh.conn, (head or b"") + backend.end())
    (response, *_) = client.events(pb.take(2, pb.log[before:]))
    assert response.status_code == 200


def test_failure_after_a_response_byte_is_not_stale() -> None:
    pb = no_next_upstream()
    client, up, _ = pooled(pb)
    before = len(pb.log)
    pb.receive(1, client.request())
    pb.receive(up, b"HTTP/1.1 200 O")  # part of a head: the backend did answer
    pb.closed(up)
    (response, *_) = client.events(pb.take(1, pb.log[before:]))
    assert response.status_code == 502
    assert not retries(pb) and len(pb.opens()) == 1


def test_first_request_on_a_new_connection_is_not_stale() -> None:
    pb = no_next_upstream()
    client = H1ClientPeer()
    pb.accept(1)
    pb.receive(1, client.request())
    (open_cmd,) = pb.opens()
    pb.opened(open_cmd.conn)
    pb.closed(open_cmd.conn)
    (response, *_) = client.events(pb.take(1))
    assert response.status_code == 502
    assert not retries(pb)


# -- connects whose exchange went away (Pool.forget, Pool.opened) --------------------------------


def pending_connect(pb: Playbook) -> tuple[H1ClientPeer, int]:
    """A client request whose backend connection is still being opened."""
    client = H1ClientPeer()
    pb.accept(1)
    pb.receive(1, client.request())
    (open_cmd,) = pb.opens()
    return client, open_cmd.conn


def closes(pb: Playbook, conn: int, since: int = 0) -> list[CloseConnection]:
    return [c for c in pb.log[since:] if isinstance(c, CloseConnection) and c.conn == conn]


def test_connect_its_client_left_is_closed_at_once_and_never_pooled() -> None:
    """A connect no one waits for any more is closed, not kept for a later request: resets
    as fast as requests (rapid reset) must leave no backend connections behind."""
    pb = Playbook()
    _, up = pending_connect(pb)
    mark = len(pb.log)
    pb.closed(1)  # the client went away while we connected
    assert closes(pb, up, mark)
    pb.opened(up)  # the driver had the outcome queued already
    assert pb.core.statistics().idle_upstream_connections == 0
    client = H1ClientPeer()
    pb.accept(2)
    pb.receive(2, client.request())
    (_, fresh) = pb.opens()
    assert fresh.conn != up
    pb.opened(fresh.conn)
    pb.opened(fresh.conn)  # reported twice: the second report changes nothing
    answer(pb, fresh.conn)
    (response, *_) = client.events(pb.take(2))
    assert response.status_code == 200


def test_connect_timeout_closes_the_connect() -> None:
    pb = no_next_upstream()
    client, up = pending_connect(pb)
    pb.now = pb.core.config.timeouts.connect
    pb.wakeup("connect", 1)
    assert closes(pb, up)
    (response, *_) = client.events(pb.take(1))
    assert response.status_code == 504


def test_close_reported_for_a_pending_connect_fails_its_exchange() -> None:
    """An embedder may report ConnectionClosed for a connect (before, or instead of,
    OpenFailed): the exchange waiting for it fails over at once, and the OpenFailed that
    may follow, or the client going away, finds nothing left to clean up."""
    pb = no_next_upstream()
    client, up = pending_connect(pb)
    pb.closed(up, "Connection refused")
    (response, *_) = client.events(pb.take(1))
    assert response.status_code == 502
    pb.feed(OpenFailed(now=pb.now, conn=up, reason="refused"))
    pb.closed(1)
    assert pb.core.statistics().upstream_connections == 0


def test_client_leaving_after_a_close_of_its_pending_connect() -> None:
    config = default_config()
    pb = Playbook(config)
    _, up = pending_connect(pb)
    pb.closed(up)  # no OpenFailed follows
    pb.closed(1)
    pb.feed(OpenFailed(now=pb.now, conn=up, reason="refused"))
    assert pb.core.statistics().upstream_connections == 0
    assert not pb.core.exchanges

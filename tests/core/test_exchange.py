"""``core/exchange/exchange.py`` as whole conversations: every command the core emits, in order.

The exchange's rules under test: per-chunk flush, bounded buffers with backpressure on the
backend (``high_water`` / ``low_water``), retries only before the first response byte with
the body replayed (RFC 9110 §9.2.2), cancellation reaching the backend, and a truncated
stream made visible to the client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import h11
from playbook import (
    ANY,
    Capture,
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
    subset,
)

from muxproxy.config import Config, Limits, quick_config
from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    Log,
    OpenConnection,
    Origin,
    PauseReading,
    ResumeReading,
    SendData,
    SetTimer,
)

FIRST = Origin(host="127.0.0.1", port=9001)
SECOND = Origin(host="127.0.0.1", port=9002)
EVENTS = [b"data: {'token': %d} padding..\n\n" % i for i in range(4)]


def two_servers() -> Config:
    return quick_config("127.0.0.1:8080", ["127.0.0.1:9001", "127.0.0.1:9002"])


def request_to(rid: Capture[bytes], body: bytes | None = None) -> Any:
    """A ``Sends`` check: one whole request, its body, and the generated x-request-id."""

    def check(events: Sequence[Any]) -> None:
        request, *rest = events
        assert isinstance(request, h11.Request)
        headers = dict(request.headers)
        assert rid.offer(headers[b"x-request-id"]), "the request id changed between tries"
        got = b"".join(e.data for e in rest if isinstance(e, h11.Data))
        assert got == (body or b"")
        assert isinstance(rest[-1], h11.EndOfMessage)

    return check


def start_stream(pb: Playbook, client: H1ClientPeer, backend: H1BackendPeer) -> int:
    """Accept, request, connect: the conversation up to the backend's SSE head."""
    up = Capture[int]("up")
    rid = Capture[bytes]("request id")
    pb >> data(1, client.request("GET", "/v1/stream"))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=up.slot, origin=FIRST)
    pb >> opened(up.value)
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(up.value, backend, request_to(rid))
    pb << SetTimer(timer=("head", 1), at=60.0)

    def relayed_head(events: Sequence[Any]) -> None:
        (response,) = events
        assert response.status_code == 200
        headers = dict(response.headers)
        assert headers[b"x-request-id"] == rid.value
        assert headers[b"x-accel-buffering"] == b"no"

    pb >> data(up.value, backend.sse_head())
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, relayed_head)
    pb << SetTimer(timer=("read", 1), at=300.0)
    return up.value


def test_stream_is_relayed_chunk_by_chunk_and_the_backend_paused_at_high_water() -> None:
    # Reads of 300 bytes; high_water 300, low_water 150 bytes of unsent client output.
    pb = Playbook(default_config(limits=attrs.evolve(Limits(), stream_buffer=600)))
    assert (pb.core.limits.high_water, pb.core.limits.low_water) == (300, 150)
    client, backend = H1ClientPeer(), H1BackendPeer()
    pb.accept(1)
    up = start_stream(pb, client, backend)
    head = len(pb.take(1))
    chunk = len(backend.chunk(EVENTS[0]))  # h11 frames each event the same size
    assert (head + 2 * chunk, head + 3 * chunk) == (269, 305)  # the third crosses 300
    for event in EVENTS[:3]:
        pb >> data(up, backend.chunk(event))
        # Per-chunk flush: the event leaves, whole, in the call that brought it.
        pb << SendData(conn=1, data=b"%x\r\n%s\r\n" % (len(event), event))
    pb << PauseReading(conn=up)
    pb >> sent(1, 305 - 151)  # 151 left: above low water, still paused
    pb >> sent(1, 1)
    pb << ResumeReading(conn=up)
    pb >> data(up, backend.chunk(EVENTS[3]))
    pb << SendData(conn=1, data=ANY)
    pb >> data(up, backend.end())
    pb << SendData(conn=1, data=b"0\r\n\r\n")
    pb << SetTimer(timer=("pool", up), at=60.0)  # the backend connection is kept
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()
    whole = H1ClientPeer()  # the whole response again, through a fresh client
    whole.request("GET", "/v1/stream")
    decoded = whole.events(pb.take(1))
    assert b"".join(e.data for e in decoded if isinstance(e, h11.Data)) == b"".join(EVENTS)
    assert isinstance(decoded[-1], h11.EndOfMessage)


def test_a_backend_that_closes_before_the_head_is_retried_with_the_body_replayed() -> None:
    pb = Playbook(two_servers(), ignore=())
    client, first, second = H1ClientPeer(), H1BackendPeer(), H1BackendPeer()
    body = b'{"model": "m", "stream": true}'
    rid = Capture[bytes]("request id")
    pb.accept(1)
    pb >> data(1, client.request("POST", "/v1/chat/completions", body=body))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=FIRST)
    pb << SetTimer(timer=("body", 1), at=30.0)
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(-1, first, request_to(rid, body))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb >> closed(-1)
    pb << Log(event="health", fields=subset({"server": "127.0.0.1:9001", "up": False}))
    pb << CancelTimer(timer=("head", 1))
    pb << Log(event="retry", fields=subset({"condition": "error", "upstream": "127.0.0.1:9001"}))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-2, origin=SECOND)
    pb >> opened(-2)
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(-2, second, request_to(rid, body))  # same id, same body
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb >> data(-2, second.sse_head() + second.chunk(EVENTS[0]) + second.end())
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    reply = Sends(1, client)
    pb << reply
    pb << SetTimer(timer=("read", 1), at=300.0)
    body_sent = Sends(1, client)
    pb << body_sent
    pb << SetTimer(timer=("pool", -2), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    pb << Log(
        event="access",
        fields=subset({"status": 200, "tries": 2, "server": "127.0.0.1:9002", "outcome": "ok"}),
    )
    # The connection goes idle once the exchange is over (Effects.defer).
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()
    (response,) = reply.events
    assert response.status_code == 200
    relayed = body_sent.events
    assert b"".join(e.data for e in relayed if isinstance(e, h11.Data)) == EVENTS[0]
    assert isinstance(relayed[-1], h11.EndOfMessage)


def test_refused_on_every_server_is_a_502_after_tries() -> None:
    pb = Playbook(two_servers())
    client = H1ClientPeer()
    pb.accept(1)
    pb >> data(1, client.request())
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=FIRST)
    pb >> open_failed(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-2, origin=SECOND)
    pb >> open_failed(-2)
    pb << CancelTimer(timer=("connect", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    reply = Sends(1, client)
    pb << reply
    pb << CloseConnection(conn=1)
    pb.done()
    response = reply.events[0]
    assert response.status_code == 502
    assert (b"connection", b"close") in response.headers


def test_a_client_gone_mid_stream_closes_the_backend_at_once() -> None:
    pb = Playbook(ignore=())
    client, backend = H1ClientPeer(), H1BackendPeer()
    pb.accept(1)
    up = start_stream(pb, client, backend)
    pb >> data(up, backend.chunk(EVENTS[0]))
    pb << SendData(conn=1, data=ANY)
    pb >> closed(1, "reset by peer")
    # The GPU stops generating: its connection is closed, never pooled.
    pb << CloseConnection(conn=up)
    pb << CancelTimer(timer=("read", 1))
    outcome = "client aborted: reset by peer"
    pb << Log(event="access", fields=subset({"outcome": outcome, "events": 1, "status": 200}))
    pb << CancelTimer(timer=("send", 1))
    pb << Log(event="client_closed", fields={"conn": 1, "error": "reset by peer"})
    pb.done()


def test_a_backend_gone_mid_stream_truncates_the_client_and_is_not_retried() -> None:
    pb = Playbook(two_servers())
    client, backend = H1ClientPeer(), H1BackendPeer()
    pb.accept(1)
    up = start_stream(pb, client, backend)
    pb >> data(up, backend.chunk(EVENTS[0]))
    pb << SendData(conn=1, data=ANY)
    pb >> closed(up, "reset by peer")
    # No final chunk: the client sees a truncated body, not a clean end (RFC 9112 §7.1),
    # once the exchange is over (Effects.defer).
    pb << CancelTimer(timer=("read", 1))
    pb << CloseConnection(conn=1)
    pb.done()
    assert b"0\r\n\r\n" not in pb.take(1)

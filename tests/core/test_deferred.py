"""Deferred endings (``effects.py``): an ending asked for while an event is handled is applied
after it, so no part of the core runs inside another's handling of its own input."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playbook import H1BackendPeer, H1ClientPeer, Playbook, data, opened

from muxproxy.core.commands import Command, Log, OpenConnection, SendData
from muxproxy.core.events import ConnectionAccepted, DataReceived
from muxproxy.core.exchange.exchange import Exchange
from muxproxy.core.faultplan import FaultPoint, plant_faults
from muxproxy.core.proxy import ProxyCore
from muxproxy.core.upstream.pool import UpstreamConn


@pytest.fixture
def backend_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """``[True]`` while a backend connection handles its bytes; every exchange that starts
    records whether it started inside that handling."""
    inside = [False]
    starts: list[bool] = []
    on_data = UpstreamConn.on_data
    start = Exchange.start

    def reading(self: UpstreamConn, payload: bytes) -> None:
        inside[0] = True
        try:
            on_data(self, payload)
        finally:
            inside[0] = False

    def starting(self: Exchange) -> None:
        starts.append(inside[0])
        start(self)

    monkeypatch.setattr(UpstreamConn, "on_data", reading)
    monkeypatch.setattr(Exchange, "start", starting)
    yield starts


def _access_index(commands: list[Command], n: int) -> int:
    logs = [i for i, c in enumerate(commands) if isinstance(c, Log) and c.event == "access"]
    return logs[n]


def test_a_pipelined_request_starts_after_the_exchange_before_it_ended(
    backend_reads: list[bool],
) -> None:
    pb = Playbook(ignore=())
    backend = H1BackendPeer()
    pb.accept(1)
    # Two requests in one read (RFC 9112 §9.3.2: pipelining); h11's client cannot send that.
    pipelined = b"GET /v1/a HTTP/1.1\r\nHost: p\r\n\r\nGET /v1/b HTTP/1.1\r\nHost: p\r\n\r\n"
    pb >> data(1, pipelined)
    (open_first,) = [c for c in pb.rest() if isinstance(c, OpenConnection)]
    pb >> opened(open_first.conn)
    first = [c for c in pb.rest() if isinstance(c, SendData) and c.conn == open_first.conn]
    assert b"/v1/a" in first[0].data
    mark = len(pb.log)
    pb >> data(open_first.conn, backend.reply(b"one"))
    commands = pb.log[mark:]
    pb.rest()
    # The first exchange is over (its access record) before the second one does anything:
    # the second request goes out on the same, released, backend connection afterwards.
    ended = _access_index(commands, 0)
    second = [
        i
        for i, c in enumerate(commands)
        if isinstance(c, SendData) and c.conn == open_first.conn and b"/v1/b" in c.data
    ]
    assert second and second[0] > ended
    assert not [c for c in commands if isinstance(c, OpenConnection)]
    # Neither exchange started while a backend connection was in the middle of its input.
    assert backend_reads == [False, False]


def test_a_fault_in_deferred_work_ends_its_own_connection_only() -> None:
    class Planted(Exception):
        pass

    pb = Playbook()
    core = ProxyCore(pb.core.config, raise_errors=False)
    # A bug in the work deferred for connection 1 (the end of its exchange), not in 2's.
    plant_faults(core).plant(FaultPoint.DEFERRED, lambda conn: conn == 1, Planted("planted bug"))
    clients = {1: H1ClientPeer(), 2: H1ClientPeer()}
    out: list[Command] = []
    for conn, peer in clients.items():
        out += core.handle(
            ConnectionAccepted(
                now=0.0, conn=conn, listener="l", peer=("10.0.0.7", 1), tls=False, alpn=None
            )
        )
        # A path that cannot be normalised safely: a 400 of the proxy's own, and the
        # exchange ends at once (paths.py).
        request = peer.request(target="/v1/%2F../x")
        out += core.handle(DataReceived(now=0.0, conn=conn, data=request))
    faults = [c for c in out if isinstance(c, Log) and c.event == "internal_error"]
    assert [f.fields["conn"] for f in faults] == [1]
    assert faults[0].fields["event"] == "deferred"
    assert 1 not in core.clients
    assert 2 in core.clients  # the neighbour goes on, idle and open

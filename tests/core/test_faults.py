"""Fault isolation (``core/faults.py``): a bug met while handling one connection ends that one.

No peer can trigger a bug on purpose, so each test plants one on the core's fault plan
(``faultplan.py``): the core raises it where the part the event concerns handles it, as a bug
there would, in the pure-Python and the compiled build alike. The switch that re-raises (on
for the whole suite) is turned off for these cores.
"""

from __future__ import annotations

from typing import Any

import attrs
import h2.errors
import h2.events
import h11
import pytest
from playbook import (
    H1BackendPeer,
    H1ClientPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    data,
    subset,
    wakeup,
)

from muxproxy.config import HealthCheck
from muxproxy.core.commands import CancelTimer, CloseConnection, Log, OpenConnection, SetTimer
from muxproxy.core.events import ConfigChanged, DataReceived
from muxproxy.core.faultplan import FaultPoint, plant_faults
from muxproxy.core.proxy import ProxyCore
from muxproxy.core.raising import raise_errors_from_environment
from muxproxy.core.timers import BackendTimer, ExchangeTimer, ProbeTimer
from muxproxy.core.tunnel.websocket import accept_for

CHAT = b"/v1/chat/completions"
EVENTS = [f'data: {{"token": {i}}}\n\n'.encode() for i in range(3)]


class Injected(RuntimeError):
    """The bug a test plants."""


def _isolating() -> Playbook:
    pb = Playbook()
    pb.core.raise_errors = False
    return pb


def _h2_stream(pb: Playbook, conn: int) -> tuple[H2ClientPeer, int, int, H1BackendPeer]:
    """An HTTP/2 client on ``conn`` whose SSE response is streaming: (client, sid, backend
    connection, backend peer)."""
    known = {o.conn for o in pb.opens()}
    pb.accept(conn)
    client = H2ClientPeer()
    sid, data = client.request(b"GET", CHAT)
    pb.receive(conn, client.preface() + data)
    (up,) = [o.conn for o in pb.opens() if o.conn not in known]
    pb.opened(up)
    backend = H1BackendPeer()
    backend.events(pb.take(up))
    client.events(pb.take(conn, pb.receive(up, backend.sse_head() + backend.chunk(EVENTS[0]))))
    return client, sid, up, backend


def _h1_request(pb: Playbook) -> tuple[H1ClientPeer, OpenConnection, H1BackendPeer]:
    """An HTTP/1.1 client on connection 1 whose request reached its backend."""
    pb.accept(1)
    client = H1ClientPeer()
    pb.receive(1, client.request("GET", CHAT.decode()))
    (opened,) = pb.opens()
    pb.opened(opened.conn)
    backend = H1BackendPeer()
    backend.events(pb.take(opened.conn))
    return client, opened, backend


def _internal_errors(pb: Playbook) -> list[Log]:
    return [c for c in pb.log if isinstance(c, Log) and c.event == "internal_error"]


def _bug() -> Injected:
    return Injected("planted bug")


def _data_on(conn: int) -> Any:
    """Matches the bytes of connection ``conn``."""
    return lambda event: type(event) is DataReceived and event.conn == conn


def _plant_on_data(
    core: ProxyCore, conn: int, point: FaultPoint = FaultPoint.BEFORE, times: int | None = None
) -> None:
    plant_faults(core).plant(point, _data_on(conn), _bug(), times=times)


def test_client_fault_ends_that_connection_and_the_other_stream_completes() -> None:
    pb = _isolating()
    client1, sid1, up1, _ = _h2_stream(pb, 1)
    client2, sid2, up2, backend2 = _h2_stream(pb, 2)
    # The bug strikes once the client's bytes are handled: their answer (a PING ACK) is queued.
    _plant_on_data(pb.core, 1, FaultPoint.AFTER, times=1)
    client1.conn.ping(b"12345678")
    commands = pb.receive(1, client1.conn.data_to_send())

    # The failed connection: what the failed call queued for it is dropped; a GOAWAY
    # (INTERNAL_ERROR) and the close take its place; its backend connection is closed.
    events = client1.events(pb.take(1, commands))
    assert not any(isinstance(e, h2.events.PingAckReceived) for e in events)
    (gone,) = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
    assert gone.error_code == h2.errors.ErrorCodes.INTERNAL_ERROR
    assert gone.last_stream_id == sid1
    assert CloseConnection(conn=1) in commands
    assert CloseConnection(conn=up1) in commands
    assert 1 not in pb.core.clients
    assert all(ex.client.conn != 1 for ex in pb.core.exchanges.values())
    assert not [t for t in pb.core.fx.timers if t[1] == 1 and t[0] in ("header", "idle", "send")]
    (logged,) = _internal_errors(pb)
    assert logged.fields["conn"] == 1
    assert logged.fields["event"] == "DataReceived"
    assert logged.fields["streams"] == [sid1]
    assert "Injected: planted bug" in logged.fields["traceback"]
    assert "faultplan.py" in logged.fields["traceback"]  # where the bug struck
    assert pb.core.counters["internal_errors"] == 1

    # Later events for the failed connections are ignored.
    pb.receive(1, b"anything")
    pb.closed(1)
    pb.closed(up1)

    # The neighbour streams on to its clean end.
    out = pb.receive(up2, backend2.chunk(EVENTS[1]) + backend2.end())
    events = client2.events(pb.take(2, out))
    data = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
    assert data == EVENTS[1]
    assert any(isinstance(e, h2.events.StreamEnded) and e.stream_id == sid2 for e in events)
    assert pb.core.counters["internal_errors"] == 1


def test_backend_fault_truncates_its_stream_and_keeps_the_rest_of_the_call() -> None:
    pb = _isolating()
    client1, sid1, up1, backend1 = _h2_stream(pb, 1)
    client2, _, up2, backend2 = _h2_stream(pb, 2)
    # The bug strikes once the backend's chunk is handled: a command for the client (its
    # DATA) is queued by the backend's call.
    _plant_on_data(pb.core, up1, FaultPoint.AFTER)
    commands = pb.receive(up1, backend1.chunk(EVENTS[1]))
    plant_faults(pb.core).clear()

    # The backend's event failed: that backend connection is closed, and its exchange fails as
    # an upstream failure after the head: the chunk already sent, then RST(INTERNAL_ERROR).
    assert CloseConnection(conn=up1) in commands
    events = client1.events(pb.take(1, commands))
    data = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
    assert data == EVENTS[1]
    resets = [(e.stream_id, e.error_code) for e in events if isinstance(e, h2.events.StreamReset)]
    assert resets == [(sid1, h2.errors.ErrorCodes.INTERNAL_ERROR)]
    assert CloseConnection(conn=1) not in commands
    (logged,) = _internal_errors(pb)
    assert logged.fields["conn"] == up1
    assert up1 not in pb.core.upstreams

    # The client connection itself is fine: a new request on it is served.
    _, data3 = client1.request(b"GET", CHAT)
    pb.receive(1, data3)
    up3 = pb.opens()[-1].conn
    assert up3 not in (up1, up2)
    # The other stream was untouched.
    events = client2.events(pb.take(2, pb.receive(up2, backend2.chunk(EVENTS[1]))))
    assert b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived)) == EVENTS[1]


def test_backend_fault_before_the_head_is_a_502() -> None:
    pb = _isolating()
    client, opened, backend = _h1_request(pb)
    _plant_on_data(pb.core, opened.conn)
    pb.ignore = ()
    pb >> data(opened.conn, backend.sse_head())
    pb << CloseConnection(conn=opened.conn)  # the failed backend connection first
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    reply = Sends(1, client)
    pb << reply
    outcome = "internal error on the backend connection"
    pb << Log(event="access", fields=subset({"status": 502, "outcome": outcome}))
    pb << Log(event="internal_error", fields=subset({"conn": opened.conn, "event": "DataReceived"}))
    pb << CloseConnection(conn=1)  # once the exchange is over (Effects.defer)
    pb.done()
    (response, *_) = reply.events
    assert isinstance(response, h11.Response) and response.status_code == 502


def test_h1_client_fault_closes_without_the_final_chunk() -> None:
    pb = _isolating()
    client, opened, backend = _h1_request(pb)
    pb.receive(opened.conn, backend.sse_head() + backend.chunk(EVENTS[0]))
    # A bug on a timer of the exchange: it belongs to the client connection.
    exchange = next(iter(pb.core.exchanges.values()))
    read = (ExchangeTimer.READ, exchange.ident)
    plant_faults(pb.core).plant(FaultPoint.TIMER, lambda timer: timer == read, _bug())
    pb.now = 1000.0
    pb >> wakeup("read", exchange.ident)
    pb << CloseConnection(conn=opened.conn)
    pb << CancelTimer(timer=("send", 1))
    pb << CloseConnection(conn=1)
    pb.done()  # no final chunk before the close
    events = client.events(pb.take(1))
    assert not any(isinstance(e, h11.EndOfMessage) for e in events)
    with pytest.raises(h11.RemoteProtocolError):
        client.events(b"")  # EOF inside a chunked body: visibly truncated
    (logged,) = _internal_errors(pb)
    assert (logged.fields["conn"], logged.fields["event"]) == (1, "Wakeup")
    assert not pb.core.exchanges


def test_fault_in_the_cleanup_of_a_neighbour_isolates_the_neighbour_too() -> None:
    pb = _isolating()
    _, _, up1, backend1 = _h2_stream(pb, 1)
    client2, sid2, up2, backend2 = _h2_stream(pb, 2)
    _plant_on_data(pb.core, up1)
    # Failing the backend's exchange calls into its client, which is broken as well.
    plant_faults(pb.core).plant(FaultPoint.NEIGHBOUR, lambda conn: conn == 1, _bug())
    commands = pb.receive(up1, backend1.chunk(EVENTS[1]))
    assert [log.fields["conn"] for log in _internal_errors(pb)] == [up1, 1]
    assert CloseConnection(conn=1) in commands
    assert 1 not in pb.core.clients
    events = client2.events(pb.take(2, pb.receive(up2, backend2.end())))
    assert any(isinstance(e, h2.events.StreamEnded) and e.stream_id == sid2 for e in events)


def test_switch_re_raises_and_the_suite_runs_with_it() -> None:
    pb = Playbook()
    assert pb.core.raise_errors  # tests/conftest.py sets MUXPROXY_RAISE_ERRORS=1
    pb.accept(1)
    _plant_on_data(pb.core, 1)
    with pytest.raises(Injected):
        pb.receive(1, b"GET / HTTP/1.1\r\n")
    assert raise_errors_from_environment({"MUXPROXY_RAISE_ERRORS": "1"})
    assert not raise_errors_from_environment({"MUXPROXY_RAISE_ERRORS": "0"})
    assert not raise_errors_from_environment({})


def test_fault_outside_any_connection_still_raises() -> None:
    core = ProxyCore(Playbook().core.config, raise_errors=False)
    changed = lambda event: type(event) is ConfigChanged  # noqa: E731
    plant_faults(core).plant(FaultPoint.BEFORE, changed, _bug())
    with pytest.raises(Injected):
        core.handle(ConfigChanged(now=0.0, config=core.config))


def _tunnel(pb: Playbook) -> int:
    """An HTTP/1.1 WebSocket tunnel on client connection 1; returns its backend connection."""
    key = b"dGhlIHNhbXBsZSBub25jZQ=="
    handshake = [
        ("Host", "p"),
        ("Upgrade", "websocket"),
        ("Connection", "Upgrade"),
        ("Sec-WebSocket-Key", key.decode()),
        ("Sec-WebSocket-Version", "13"),
    ]
    pb.accept(1)
    pb.receive(
        1,
        h11.Connection(h11.CLIENT).send(h11.Request(method="GET", target="/ws", headers=handshake))
        or b"",
    )
    (opened,) = pb.opens()
    pb.opened(opened.conn)
    backend = H1BackendPeer()
    backend.events(pb.take(opened.conn))
    switch = h11.InformationalResponse(
        status_code=101,
        headers=[
            ("Upgrade", "websocket"),
            ("Connection", "Upgrade"),
            ("Sec-WebSocket-Accept", accept_for(key).decode()),
        ],
    )
    pb.receive(opened.conn, backend.conn.send(switch) or b"")
    assert pb.core.tunnels
    return opened.conn


@pytest.mark.parametrize("side", ["client", "backend"])
def test_fault_in_a_tunnel_closes_both_of_its_connections(side: str) -> None:
    pb = _isolating()
    up = _tunnel(pb)
    assert up in pb.core.tunnels
    if side == "client":
        _plant_on_data(pb.core, 1, times=1)
        commands = pb.receive(1, b"\x81\x05hello")
    else:
        _plant_on_data(pb.core, up, times=1)
        commands = pb.receive(up, b"\x81\x05world")
    assert CloseConnection(conn=1) in commands and CloseConnection(conn=up) in commands
    assert not pb.core.tunnels and not pb.core.exchanges
    assert not [t for t in pb.core.fx.timers if t[0] == "tunnel"]
    (logged,) = _internal_errors(pb)
    assert logged.fields["conn"] == (1 if side == "client" else up)
    # Later bytes on either connection find nothing to call into.
    pb.receive(1, b"late")
    pb.receive(up, b"late")
    pb.closed(1)
    pb.closed(up)
    assert pb.core.counters["internal_errors"] == 1


def test_fault_on_a_pooled_connections_timer_ends_that_connection() -> None:
    pb = _isolating()
    pb.accept(1)
    client = H1ClientPeer()
    pb.receive(1, client.request("GET", "/v1/models"))
    (opened,) = pb.opens()
    pb.opened(opened.conn)
    backend = H1BackendPeer()
    backend.events(pb.take(opened.conn))
    done = backend.conn.send(h11.Response(status_code=200, headers=[("Content-Length", "0")]))
    pb.receive(opened.conn, (done or b"") + backend.end())
    assert pb.core.pool.idle  # kept alive for the next request
    pool_timer = (BackendTimer.POOL, opened.conn)
    plant_faults(pb.core).plant(FaultPoint.TIMER, lambda timer: timer == pool_timer, _bug())
    commands = pb.wakeup("pool", opened.conn)
    assert CloseConnection(conn=opened.conn) in commands
    assert opened.conn not in pb.core.upstreams
    assert not any(pb.core.pool.idle.values())
    (logged,) = _internal_errors(pb)
    assert (logged.fields["conn"], logged.fields["event"]) == (opened.conn, "Wakeup")
    # The client connection is untouched: its next request opens a new backend connection.
    pb.receive(1, H1ClientPeer().request("GET", "/v1/models"))
    assert len(pb.opens()) == 2


def test_fault_in_a_probe_without_a_connection_reschedules_it() -> None:
    config = Playbook().core.config
    group = config.upstreams["default"]
    group = attrs.evolve(group, health_check=HealthCheck(interval=7.0))
    pb = Playbook(attrs.evolve(config, upstreams={"default": group}))
    pb.core.raise_errors = False
    pb.feed(ConfigChanged(now=0.0, config=pb.core.config))
    (probe,) = pb.core.probes.values()
    probe_timer = (ProbeTimer.PROBE, probe.ident)
    plan = plant_faults(pb.core)
    plan.plant(FaultPoint.TIMER, lambda timer: timer == probe_timer, _bug())
    commands = pb.wakeup("probe", probe.ident)
    (logged,) = _internal_errors(pb)
    assert logged.fields["probe"] == probe.ident and logged.fields["conn"] is None
    assert SetTimer(timer=("probe", probe.ident), at=7.0) in commands
    plan.clear()
    pb.now = 7.0
    pb.wakeup("probe", probe.ident)
    assert pb.opens()  # the next check runs as usual

"""Fault isolation (``core/faults.py``): a bug met while handling one connection ends that one.

No peer can trigger a bug on purpose, so each test plants one on the core's fault plan
(``faultplan.py``): the core raises it where the part the event concerns handles it, as a bug
there would, in the pure-Python and the compiled build alike. The switch that re-raises (on
for the whole suite) is turned off for these cores.

From the planted bug on, each test is a conversation: every command in order, timers and the
``internal_error`` record included; real h11 / h2 peers decode what the proxy sends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import h2.errors
import h2.events
import h11
import pytest
from checks import Check, both, h2_body, h2_ended, h2_resets
from playbook import (
    H1BackendPeer,
    H1ClientPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    Where,
    closed,
    data,
    subset,
    wakeup,
)
from test_h2guard import ORIGIN

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
INTERNAL_ERROR = h2.errors.ErrorCodes.INTERNAL_ERROR


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


def _internal_error(conn: int | None, event: str, *, where: str = "faultplan.py") -> Where:
    """The ``internal_error`` record of a planted bug on ``conn`` while handling ``event``:
    its traceback names the bug and where it struck."""

    def check(log: Log) -> None:
        assert log.event == "internal_error", log
        assert (log.fields["conn"], log.fields["event"]) == (conn, event), log.fields
        assert "Injected: planted bug" in log.fields["traceback"], log.fields
        assert where in log.fields["traceback"], log.fields

    return Where(Log, check)


def _access(**fields: Any) -> Log:
    return Log(event="access", fields=subset(fields))


def _goaway_internal(last_stream_id: int) -> Check:
    """GOAWAY(INTERNAL_ERROR) naming ``last_stream_id``, and no answer to anything else (no
    PING ACK: what the failed call queued for the connection was dropped)."""

    def check(events: Sequence[Any]) -> None:
        assert not any(isinstance(e, h2.events.PingAckReceived) for e in events), events
        (gone,) = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
        assert gone.error_code == INTERNAL_ERROR, gone
        assert gone.last_stream_id == last_stream_id, gone

    return check


def _carries(sid: int, body: bytes) -> Check:
    """DATA of exactly ``body`` on stream ``sid``, no reset, no GOAWAY."""
    return both(lambda events: _equal(h2_body(events, sid), body), h2_resets())


def _equal(got: bytes, expected: bytes) -> None:
    assert got == expected, (got, expected)


def test_client_fault_ends_that_connection_and_the_other_stream_completes() -> None:
    pb = _isolating()
    client1, sid1, up1, _ = _h2_stream(pb, 1)
    client2, sid2, up2, backend2 = _h2_stream(pb, 2)
    # The bug strikes once the client's bytes are handled: their answer (a PING ACK) is queued.
    _plant_on_data(pb.core, 1, FaultPoint.AFTER, times=1)
    client1.conn.ping(b"12345678")
    pb.ignore = ()
    pb >> data(1, client1.conn.data_to_send())
    # The failed connection: what the failed call queued for it is dropped; a GOAWAY
    # (INTERNAL_ERROR) and the close take its place; its backend connection is closed.
    pb << CancelTimer(timer=("read", 1))
    pb << CloseConnection(conn=up1)
    pb << CancelTimer(timer=("send", 1))
    pb << Sends(1, client1, _goaway_internal(sid1))
    pb << CloseConnection(conn=1)
    pb << _internal_error(1, "DataReceived")
    (logged,) = _internal_errors(pb)
    assert logged.fields["streams"] == [sid1]
    assert 1 not in pb.core.clients
    assert all(ex.client.conn != 1 for ex in pb.core.exchanges.values())
    assert not [t for t in pb.core.fx.timers if t[1] == 1 and t[0] in ("header", "idle", "send")]
    assert pb.core.counters["internal_errors"] == 1

    # Later events for the failed connections are ignored.
    pb >> data(1, b"anything")
    pb >> closed(1)
    pb >> closed(up1)

    # The neighbour streams on to its clean end.
    pb >> data(up2, backend2.chunk(EVENTS[1]) + backend2.end())
    pb << Sends(2, client2, both(_carries(sid2, EVENTS[1]), h2_ended(sid2)))
    pb << SetTimer(timer=("pool", up2), at=60.0)
    pb << CancelTimer(timer=("read", 2))
    pb << _access(status=200, outcome="ok")
    pb << SetTimer(timer=("idle", 2), at=75.0)
    pb.done()
    assert pb.core.counters["internal_errors"] == 1


def test_backend_fault_truncates_its_stream_and_keeps_the_rest_of_the_call() -> None:
    pb = _isolating()
    client1, sid1, up1, backend1 = _h2_stream(pb, 1)
    client2, sid2, up2, backend2 = _h2_stream(pb, 2)
    # The bug strikes once the backend's chunk is handled: a command for the client (its
    # DATA) is queued by the backend's call.
    _plant_on_data(pb.core, up1, FaultPoint.AFTER)
    pb.ignore = ()
    pb >> data(up1, backend1.chunk(EVENTS[1]))
    # The backend's event failed: that backend connection is closed, and its exchange fails as
    # an upstream failure after the head: the chunk already sent, then RST(INTERNAL_ERROR).
    pb << Sends(1, client1, _carries(sid1, EVENTS[1]))
    pb << CloseConnection(conn=up1)
    pb << Sends(1, client1, h2_resets((sid1, INTERNAL_ERROR)))
    pb << CancelTimer(timer=("read", 1))
    failed = "upstream failed mid-stream: internal error on the backend connection"
    pb << _access(status=200, outcome=failed)
    pb << _internal_error(up1, "DataReceived")
    pb << SetTimer(timer=("idle", 1), at=75.0)  # not closed: the client connection stays
    plant_faults(pb.core).clear()
    assert up1 not in pb.core.upstreams

    # The client connection itself is fine: a new request on it is served.
    _, data3 = client1.request(b"GET", CHAT)
    pb >> data(1, data3)
    pb << CancelTimer(timer=("idle", 1))
    pb << SetTimer(timer=("connect", 3), at=5.0)
    pb << OpenConnection(conn=-3, origin=ORIGIN)  # a new backend connection
    assert -3 not in (up1, up2)
    # The other stream was untouched.
    pb >> data(up2, backend2.chunk(EVENTS[1]))
    pb << Sends(2, client2, _carries(sid2, EVENTS[1]))
    pb.done()


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
    client1, sid1, up1, backend1 = _h2_stream(pb, 1)
    client2, sid2, up2, backend2 = _h2_stream(pb, 2)
    _plant_on_data(pb.core, up1)
    # Failing the backend's exchange calls into its client, which is broken as well.
    plant_faults(pb.core).plant(FaultPoint.NEIGHBOUR, lambda conn: conn == 1, _bug())
    pb.ignore = ()
    pb >> data(up1, backend1.chunk(EVENTS[1]))
    pb << CloseConnection(conn=up1)
    pb << _internal_error(up1, "DataReceived")
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("send", 1))
    pb << Sends(1, client1, _goaway_internal(sid1))
    pb << CloseConnection(conn=1)
    pb << _internal_error(1, "upstream_failed")
    assert 1 not in pb.core.clients
    pb >> data(up2, backend2.end())
    pb << Sends(2, client2, h2_ended(sid2))
    pb << SetTimer(timer=("pool", up2), at=60.0)
    pb << CancelTimer(timer=("read", 2))
    pb << _access(status=200, outcome="ok")
    pb << SetTimer(timer=("idle", 2), at=75.0)
    pb.done()


def test_switch_re_raises_and_the_suite_runs_with_it() -> None:
    pb = Playbook()
    assert pb.core.raise_errors  # tests/conftest.py sets MUXPROXY_RAISE_ERRORS=1
    pb.accept(1)
    _plant_on_data(pb.core, 1)
    with pytest.raises(Injected):
        pb >> data(1, b"GET / HTTP/1.1\r\n")
    pb.done()
    assert raise_errors_from_environment({"MUXPROXY_RAISE_ERRORS": "1"})
    assert not raise_errors_from_environment({"MUXPROXY_RAISE_ERRORS": "0"})
    assert not raise_errors_from_environment({})


def test_fault_outside_any_connection_still_raises() -> None:
    pb = Playbook()
    pb.core = ProxyCore(pb.core.config, raise_errors=False)
    changed = lambda event: type(event) is ConfigChanged  # noqa: E731
    plant_faults(pb.core).plant(FaultPoint.BEFORE, changed, _bug())
    with pytest.raises(Injected):
        pb >> ConfigChanged(now=0.0, config=pb.core.config)
    pb.done()


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
    pb.ignore = ()
    if side == "client":
        _plant_on_data(pb.core, 1, times=1)
        pb >> data(1, b"\x81\x05hello")
        pb << CancelTimer(timer=("tunnel", 1))
        pb << CloseConnection(conn=up)
        pb << CancelTimer(timer=("send", 1))
        pb << CloseConnection(conn=1)
        pb << _internal_error(1, "DataReceived")
    else:
        _plant_on_data(pb.core, up, times=1)
        pb >> data(up, b"\x81\x05world")
        pb << CancelTimer(timer=("tunnel", 1))
        pb << CloseConnection(conn=up)
        failed = "upstream failed mid-stream: internal error on the backend connection"
        pb << _access(status=101, outcome=failed)
        pb << _internal_error(up, "DataReceived")
        pb << CloseConnection(conn=1)
    assert not pb.core.tunnels and not pb.core.exchanges
    assert not [t for t in pb.core.fx.timers if t[0] == "tunnel"]
    # Later bytes on either connection find nothing to call into.
    pb >> data(1, b"late")
    pb >> data(up, b"late")
    pb >> closed(1)
    if side == "backend":
        pb << CancelTimer(timer=("send", 1))  # the client's response was written in full
    pb >> closed(up)
    pb.done()
    assert len(_internal_errors(pb)) == 1
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
    pb.ignore = ()
    pb >> wakeup("pool", opened.conn)
    pb << CloseConnection(conn=opened.conn)
    pb << _internal_error(opened.conn, "Wakeup")
    assert opened.conn not in pb.core.upstreams
    assert not any(pb.core.pool.idle.values())
    # The client connection is untouched: its next request opens a new backend connection.
    pb >> data(1, H1ClientPeer().request("GET", "/v1/models"))
    pb << CancelTimer(timer=("idle", 1))
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << OpenConnection(conn=-2, origin=ORIGIN)
    pb.done()


def test_fault_in_a_probe_without_a_connection_reschedules_it() -> None:
    config = Playbook().core.config
    group = config.upstreams["default"]
    group = attrs.evolve(group, health_check=HealthCheck(interval=7.0))
    pb = Playbook(attrs.evolve(config, upstreams={"default": group}), ignore=())
    pb.core.raise_errors = False
    pb >> ConfigChanged(now=0.0, config=pb.core.config)
    pb << SetTimer(timer=("probe", 1), at=0.0)
    pb << Log(event="config_changed", fields={})
    (probe,) = pb.core.probes.values()
    probe_timer = (ProbeTimer.PROBE, probe.ident)
    plan = plant_faults(pb.core)
    plan.plant(FaultPoint.TIMER, lambda timer: timer == probe_timer, _bug())
    pb >> wakeup("probe", probe.ident)
    pb << SetTimer(timer=("probe", probe.ident), at=7.0)
    pb << Log(event="internal_error", fields=subset({"probe": probe.ident, "conn": None}))
    plan.clear()
    pb.now = 7.0
    pb >> wakeup("probe", probe.ident)  # the next check runs as usual
    pb << SetTimer(timer=("probe_timeout", probe.ident), at=9.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb.done()

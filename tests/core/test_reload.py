"""A new configuration (``ConfigChanged``) while the proxy runs: what routing state it keeps.

``ProxyCore._config_changed`` carries each group's router over (``GroupRouter.reconfigure``):
each server whose address stays keeps its health, balancer state and streams in flight, and
the operator's runtime state (``RuntimeChanged``) is applied again; the health probes of the
old configuration are retired, timers and all. As conversations: every command the core
returns is asserted in order, timers included.
"""

from __future__ import annotations

import attrs
from playbook import H1BackendPeer, Sends, Where, data, opened, wakeup
from test_routing_exchange import CHECK, PROBE, A, B, C, Opens, Routing, fails_over, fleet

from muxproxy.config import Config, Server
from muxproxy.config.runtime import RuntimeState
from muxproxy.core.commands import CancelTimer, CloseConnection, OpenConnection, SetTimer
from muxproxy.core.events import ConfigChanged, RuntimeChanged


def edited(config: Config, **changes: object) -> Config:
    """``config`` with its group ``default`` changed by ``changes``."""
    group = attrs.evolve(config.upstreams["default"], **changes)
    return attrs.evolve(config, upstreams={"default": group})


def reload(rig: Routing, config: Config) -> None:
    """Feed the new ``config``; the caller asserts what it caused."""
    rig.config = config
    rig.pb >> ConfigChanged(now=rig.pb.now, config=config)


def probes_due(rig: Routing, *idents: int) -> None:
    """The probes ``idents`` are due at once."""
    for ident in idents:
        rig.pb << SetTimer(timer=("probe", ident), at=0.0)
    rig.pb.done()


def set_runtime(rig: Routing, state: RuntimeState) -> None:
    """The operator's runtime state: nothing to send, no timer."""
    rig.pb >> RuntimeChanged(now=rig.pb.now, state=state)
    rig.pb.done()


def routed_to(rig: Routing, server: str, count: int = 4) -> None:
    """The next ``count`` requests all go to ``server``."""
    for _ in range(count):
        rig.ask(to=server)
    rig.pb.done()


def running_probe(rig: Routing) -> int:
    """Start server A's probe (ident 1) and let its request reach the backend; its conn."""
    pb = rig.pb
    pb >> wakeup("probe", 1)
    pb << SetTimer(timer=("probe_timeout", 1), at=pb.now + CHECK.timeout)
    pb << (probe := Opens(to=A))
    pb >> opened(probe.conn)
    rig.backends[probe.conn] = H1BackendPeer()
    pb << Sends(probe.conn, rig.backends[probe.conn], PROBE)
    pb.done()
    return probe.conn


def probe_fails(rig: Routing) -> None:
    """Server A's first probe is answered 500: A is down, its next probe is due later."""
    pb = rig.pb
    mark = len(pb.log)
    up = running_probe(rig)
    pb >> data(up, rig.response_bytes(up, 500, b""))
    pb << CloseConnection(conn=up)
    pb << CancelTimer(timer=("probe_timeout", 1))
    pb << SetTimer(timer=("probe", 1), at=pb.now + CHECK.interval)
    pb.done()
    (down,) = [c for c in pb.log[mark:] if getattr(c, "event", None) == "health"]
    assert down.fields["server"] == A and down.fields["up"] is False


def test_reload_during_a_probe_keeps_the_new_configurations_router() -> None:
    """The probe's answer arriving after the reload must not install a router for the old
    group: the runtime weight set after the reload stays."""
    rig = Routing(fleet(A, B, health_check=CHECK))
    reload(rig, rig.config)  # the driver's first event starts the probes
    probes_due(rig, 1, 2)
    up = running_probe(rig)
    pb = rig.pb
    reload(rig, edited(rig.config, pool_idle_timeout=30.0))
    pb << CancelTimer(timer=("probe_timeout", 1))
    pb << CloseConnection(conn=up)  # the old check was dropped
    pb << CancelTimer(timer=("probe", 2))
    probes_due(rig, 3, 4)
    router = rig.router
    set_runtime(rig, RuntimeState.empty().changed("default", A, weight=0))  # drain A
    pb >> data(up, rig.response_bytes(up, 200, b""))  # the old check's answer, after the reload
    pb.done()
    assert rig.router is router and router.weights[0] == 0
    routed_to(rig, B)


def test_group_edit_with_the_same_servers_keeps_health_and_runtime_weights() -> None:
    rig = Routing(fleet(A, B, C, health_check=CHECK))
    pb = rig.pb
    reload(rig, rig.config)  # the driver's first event starts the probes
    probes_due(rig, 1, 2, 3)
    probe_fails(rig)
    set_runtime(rig, RuntimeState.empty().changed("default", C, drain=True))
    servers = (Server(address=A), Server(address=B, weight=3), Server(address=C, weight=2))
    reload(rig, edited(rig.config, servers=servers, pool_idle_timeout=30.0))
    for ident in (1, 2, 3):
        pb << CancelTimer(timer=("probe", ident))
    probes_due(rig, 4, 5, 6)  # and no OpenConnection
    assert rig.router.weights == [1, 3, 0]  # B's configured weight applies; C stays drained
    routed_to(rig, B)  # A is still down after the reload
    set_runtime(rig, RuntimeState.empty())  # the operator undoes the drain
    assert rig.router.weights == [1, 3, 2]  # C's new configured weight


def test_group_edit_keeps_passive_health() -> None:
    rig = Routing(fleet(A, B))
    conn, client, first = rig.ask(to=A)
    second = fails_over(rig, first.conn, conn, avoid={A})  # A failed: out for fail_timeout
    rig.pb.done()
    rig.serve(conn, client, second)
    servers = (Server(address=A, max_fails=1), Server(address=B, weight=2))
    reload(rig, edited(rig.config, servers=servers))
    rig.pb.done()
    routed_to(rig, B)


def test_group_with_other_servers_keeps_the_state_of_those_that_stay() -> None:
    rig = Routing(fleet(A, B, health_check=CHECK))
    pb = rig.pb
    reload(rig, rig.config)
    probes_due(rig, 1, 2)
    probe_fails(rig)  # A down
    reload(rig, edited(rig.config, servers=(Server(address=C), Server(address=A))))
    pb << CancelTimer(timer=("probe", 1))
    pb << CancelTimer(timer=("probe", 2))
    probes_due(rig, 3, 4)
    routed_to(rig, C)  # A stays down though it moved; C is new and up


def test_reload_retires_every_probe_timer() -> None:
    rig = Routing(fleet(A, B, health_check=CHECK))
    pb = rig.pb
    reload(rig, rig.config)
    probes_due(rig, 1, 2)
    up = running_probe(rig)
    pb >> ConfigChanged(now=pb.now, config=rig.config)
    pb << CancelTimer(timer=("probe_timeout", 1))
    pb << CloseConnection(conn=up)  # the check in flight is dropped
    pb << CancelTimer(timer=("probe", 2))
    pb << SetTimer(timer=("probe", 3), at=0.0)
    pb << SetTimer(timer=("probe", 4), at=0.0)
    pb.done()
    # The retired probe's timers fire for nothing; the new probes (3 and 4) run.
    pb.now = 2.0
    pb >> wakeup("probe_timeout", 1)
    pb.done()
    pb >> wakeup("probe", 3)
    pb << SetTimer(timer=("probe_timeout", 3), at=4.0)
    pb << Where(OpenConnection, lambda c: str(c.origin) == A)
    pb.done()

"""A new configuration (``ConfigChanged``) while the proxy runs: what routing state it keeps.

``ProxyCore._config_changed`` carries each group's router over (``GroupRouter.reconfigure``):
each server whose address stays keeps its health, balancer state and streams in flight, and
the operator's runtime state (``RuntimeChanged``) is applied again; the health probes of the
old configuration are retired, timers and all.
"""

from __future__ import annotations

import attrs
import h11
from playbook import Where, wakeup
from test_routing_exchange import CHECK, A, B, C, Rig, fleet, origin, probe_a, start_probes

from muxproxy.config import Config, Server
from muxproxy.config.runtime import RuntimeState
from muxproxy.core.commands import CancelTimer, CloseConnection, OpenConnection, SetTimer
from muxproxy.core.events import ConfigChanged, RuntimeChanged


def edited(config: Config, **changes: object) -> Config:
    """``config`` with its group ``default`` changed by ``changes``."""
    group = attrs.evolve(config.upstreams["default"], **changes)
    return attrs.evolve(config, upstreams={"default": group})


def reload(rig: Rig, config: Config) -> list[object]:
    rig.config = config
    return list(rig.pb.feed(ConfigChanged(now=rig.pb.now, config=config)))


def set_runtime(rig: Rig, state: RuntimeState) -> None:
    rig.pb.feed(RuntimeChanged(now=rig.pb.now, state=state))


def routed_to(rig: Rig, count: int = 4) -> set[str]:
    mark = len(rig.pb.log)
    for _ in range(count):
        rig.request()
    return {origin(o) for o in rig.opens(mark)}


def running_probe(rig: Rig) -> int:
    """Start server A's probe (ident 1) and let its request reach the backend; its conn."""
    commands = rig.pb.wakeup("probe", 1)
    (open_cmd,) = [c for c in commands if isinstance(c, OpenConnection)]
    rig.open(open_cmd.conn)
    request, _ = rig.received(open_cmd.conn)
    assert isinstance(request, h11.Request) and request.target == b"/health"
    return open_cmd.conn


def test_reload_during_a_probe_keeps_the_new_configurations_router() -> None:
    """The probe's answer arriving after the reload must not install a router for the old
    group: the runtime weight set after the reload stays."""
    rig = Rig(fleet(A, B, health_check=CHECK))
    start_probes(rig)
    up = running_probe(rig)
    commands = reload(rig, edited(rig.config, pool_idle_timeout=30.0))
    router = rig.router
    set_runtime(rig, RuntimeState.empty().changed("default", A, weight=0))  # drain A
    rig.answer(up, 200, b"")  # the old check's answer, after the reload
    assert rig.router is router and router.weights[0] == 0
    assert routed_to(rig) == {B}
    assert CancelTimer(timer=("probe_timeout", 1)) in commands
    assert CloseConnection(conn=up) in commands  # the old check was dropped


def test_group_edit_with_the_same_servers_keeps_health_and_runtime_weights() -> None:
    rig = Rig(fleet(A, B, C, health_check=CHECK))
    reload(rig, rig.config)  # the driver's first event starts the probes
    (down,) = probe_a(rig, 500)
    assert down.fields["up"] is False
    set_runtime(rig, RuntimeState.empty().changed("default", C, drain=True))
    servers = (Server(address=A), Server(address=B, weight=3), Server(address=C, weight=2))
    commands = reload(rig, edited(rig.config, servers=servers, pool_idle_timeout=30.0))
    assert not [c for c in commands if isinstance(c, OpenConnection)]
    assert rig.router.weights == [1, 3, 0]  # B's configured weight applies; C stays drained
    assert routed_to(rig) == {B}  # A is still down after the reload
    set_runtime(rig, RuntimeState.empty())  # the operator undoes the drain
    assert rig.router.weights == [1, 3, 2]  # C's new configured weight


def test_group_edit_keeps_passive_health() -> None:
    rig = Rig(fleet(A, B))
    rig.request()
    rig.refuse(rig.last_open().conn)  # A failed: out for fail_timeout
    rig.serve()
    servers = (Server(address=A, max_fails=1), Server(address=B, weight=2))
    reload(rig, edited(rig.config, servers=servers))
    assert routed_to(rig) == {B}


def test_group_with_other_servers_keeps_the_state_of_those_that_stay() -> None:
    rig = Rig(fleet(A, B, health_check=CHECK))
    start_probes(rig)
    probe_a(rig, 500)  # A down
    reload(rig, edited(rig.config, servers=(Server(address=C), Server(address=A))))
    assert routed_to(rig) == {C}  # A stays down though it moved; C is new and up


def test_reload_retires_every_probe_timer() -> None:
    rig = Rig(fleet(A, B, health_check=CHECK))
    start_probes(rig)
    up = running_probe(rig)
    pb = rig.pb
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
    pb << Where(OpenConnection, lambda c: origin(c) == A)
    pb.done()

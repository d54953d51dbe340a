"""The operator's runtime server state (``RuntimeChanged``) in the core, as conversations:
weights, drain and down apply to the next decision, never to a stream in flight; remembered
session keys and sticky pins stay on a draining server; ``status()``; a reload keeps each
kept server's state by address, and streams of removed servers finish cleanly.

Every request comes from a real h11 client peer and every backend is a real h11 server peer
(``Routing`` of ``test_routing_exchange``); each conversation asserts every command, timers
included. Where hashing picks the server, the expected one comes from the routing module's
own ``rendezvous_order``.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from checks import h1_response
from playbook import H1ClientPeer, Sends, data
from test_routing_exchange import (
    COOKIE,
    A,
    B,
    C,
    Routing,
    body_is,
    fails_over,
    fleet,
    sticky_cookie,
)

from muxproxy.config import Balance, Server, SessionSource, Sticky, StickyCookie
from muxproxy.config.runtime import RuntimeState
from muxproxy.core.commands import CancelTimer, SetTimer
from muxproxy.core.events import ConfigChanged, RuntimeChanged
from muxproxy.routing.balancer import rendezvous_order

KEYED = Sticky(sources=(SessionSource(kind="header", name="x-chat-id"),))
KEYED_AND_PINNED = Sticky(
    sources=(SessionSource(kind="header", name="x-chat-id"),), cookie=StickyCookie(name="mp_srv")
)


def set_runtime(rig: Routing, **changes: dict[str, Any]) -> RuntimeState:
    """Feed a ``RuntimeChanged`` whose state has ``changes`` (address -> fields)."""
    state = RuntimeState.empty()
    for address, fields in changes.items():
        state = state.changed("default", address, **fields)
    runtime(rig, state)
    return state


def runtime(rig: Routing, state: RuntimeState) -> None:
    """The operator's state comes in: it cuts nothing, no command comes out."""
    rig.pb >> RuntimeChanged(now=rig.pb.now, state=state)
    rig.pb.done()


def reload(rig: Routing, servers: tuple[str, ...]) -> None:
    """A new configuration with ``servers``: no command comes out (no health checks)."""
    group = attrs.evolve(rig.group, servers=tuple(Server(address=s) for s in servers))
    rig.config = attrs.evolve(rig.config, upstreams={"default": group})
    rig.pb >> ConfigChanged(now=rig.pb.now, config=rig.config)
    rig.pb.done()


def sse_stream(
    rig: Routing, headers: list[tuple[str, str]] | None = None, *, to: str | None = None
) -> tuple[int, H1ClientPeer, int]:
    """A request (to ``to``) whose backend answers with an SSE head and one event that reach
    the client: (client conn, client peer, backend conn). The response stays open."""
    pb = rig.pb
    conn, client, opens = rig.ask(headers=headers, to=to)
    up = opens.conn
    rig.accept(up, conn)
    pb >> data(up, rig.sse_head_bytes(up, "x"))
    pb << CancelTimer(timer=("head", conn))
    pb << SetTimer(timer=("send", conn), at=pb.now + rig.send_s)
    pb << Sends(conn, client, h1_response(200))
    pb << SetTimer(timer=("read", conn), at=pb.now + rig.read_s)
    event(rig, up, conn, client, b"data: one\n\n")
    return conn, client, up


def event(rig: Routing, up: int, conn: int, client: H1ClientPeer, payload: bytes) -> None:
    """The backend on ``up`` sends an event: the client gets exactly it."""
    rig.pb >> data(up, rig.chunk(up, payload))
    rig.pb << Sends(conn, client, body_is(payload, end=False))
    rig.pb.done()


def served_by(
    rig: Routing,
    headers: list[tuple[str, str]] | None = None,
    *,
    to: str | None = None,
    avoid: set[str] | None = None,
) -> str:
    """One whole request (to ``to``, not to one of ``avoid``) answered 200; its server."""
    conn, client, opens = rig.ask(headers=headers, to=to, avoid=avoid or ())
    rig.serve(conn, client, opens)
    return opens.server


def chat(key: str) -> list[tuple[str, str]]:
    return [("X-Chat-ID", key)]


def keys_owned_by(rig: Routing, address: str, count: int, among: range | None = None) -> list[str]:
    """``count`` session keys whose rendezvous owner (every server usable) is ``address``."""
    router = rig.router
    index = [s.address for s in rig.group.servers].index(address)
    servers = range(len(rig.group.servers))
    out = []
    for n in among or range(10_000):
        key = f"conv-{n}"
        if rendezvous_order(key.encode(), router.ids, router.weights, servers)[0] == index:
            out.append(key)
            if len(out) == count:
                return out
    raise AssertionError("no such keys")


# -- weights, drain, down on the next decision -------------------------------------------------


@pytest.mark.parametrize("fields", [{"weight": 0}, {"drain": True}, {"down": True}])
def test_runtime_change_mid_stream_leaves_the_stream_and_moves_the_next_request(
    fields: dict[str, Any],
) -> None:
    rig = Routing(fleet(A, B))
    conn, client, backend = sse_stream(rig, to=A)
    assert rig.router.active == [1, 0]
    state = set_runtime(rig, **{A: fields})  # cuts nothing: no command
    assert rig.pb.core.runtime == state
    for _ in range(3):
        served_by(rig, to=B)  # unkeyed requests leave A at once
    event(rig, backend, conn, client, b"data: two\n\n")
    rig.stream_ends(backend, conn, client)
    access = rig.logs("access")[-1]  # the stream's, which ended last
    assert access.fields["server"] == A and access.fields["status"] == 200
    assert rig.router.active == [0, 0]


def test_weights_apply_at_once_and_a_reset_restores_the_configured_ones() -> None:
    rig = Routing(fleet(A, B))
    set_runtime(rig, **{B: {"weight": 3}})
    assert [served_by(rig) for _ in range(8)].count(B) == 6  # 3:1 in every cycle of 4
    runtime(rig, RuntimeState.empty())
    assert [served_by(rig) for _ in range(4)].count(B) == 2


def test_overrides_of_servers_or_groups_not_configured_are_ignored() -> None:
    rig = Routing(fleet(A, B))
    state = RuntimeState.empty().changed("default", C, down=True).changed("other", A, down=True)
    runtime(rig, state)
    assert {served_by(rig) for _ in range(4)} == {A, B}


def test_drain_keeps_remembered_keys_and_sends_new_keys_elsewhere() -> None:
    rig = Routing(fleet(A, B, C, sticky=KEYED))
    known, fresh = keys_owned_by(rig, A, 2)
    served_by(rig, chat(known), to=A)
    set_runtime(rig, **{A: {"drain": True}})
    for _ in range(3):
        served_by(rig, chat(known), to=A)  # a conversation under way stays
    elsewhere = served_by(rig, chat(fresh), avoid={A})  # a new one goes elsewhere
    served_by(rig, chat(fresh), to=elsewhere)  # and stays there, though it would hash to A


def test_down_moves_even_remembered_keys_and_pins_and_they_stay_moved() -> None:
    rig = Routing(fleet(A, B, C, sticky=KEYED_AND_PINNED))
    (known,) = keys_owned_by(rig, A, 1)
    conn, client, first = rig.ask(headers=chat(known), to=A)
    pin = sticky_cookie(rig.serve(conn, client, first))
    assert pin is not None
    set_runtime(rig, **{A: {"down": True}})
    pinned = [("Cookie", f"mp_srv={pin.decode()}")]
    served_by(rig, pinned, avoid={A})
    moved_key = served_by(rig, chat(known), avoid={A})
    runtime(rig, RuntimeState.empty())  # A is back: the key stays where it was moved to
    served_by(rig, chat(known), to=moved_key)
    served_by(rig, pinned, to=A)  # the pin still names A


def test_cookie_pin_follows_to_a_draining_server() -> None:
    rig = Routing(fleet(sticky=COOKIE))
    conn, client, opens = rig.ask()
    pin = sticky_cookie(rig.serve(conn, client, opens))
    assert pin is not None
    first = opens.server
    set_runtime(rig, **{first: {"weight": 0}})
    for _ in range(3):
        served_by(rig, [("Cookie", f"mp_srv={pin.decode()}")], to=first)
    for _ in range(3):
        served_by(rig, avoid={first})


def test_remembered_key_expires_after_session_idle() -> None:
    rig = Routing(fleet(A, B, C, sticky=attrs.evolve(KEYED, session_idle=60.0)))
    (key,) = keys_owned_by(rig, A, 1)
    served_by(rig, chat(key), to=A)
    set_runtime(rig, **{A: {"drain": True}})
    rig.pb.now += 60.0
    served_by(rig, chat(key), to=A)  # 60 s idle: still remembered
    rig.pb.now += 60.5
    # Forgotten: a new session, which A does not take while it drains.
    served_by(rig, chat(key), avoid={A})


def test_runtime_state_is_applied_to_a_new_configuration() -> None:
    rig = Routing(fleet(A, B))
    set_runtime(rig, **{A: {"down": True}})
    reload(rig, (C, A, B))
    assert {served_by(rig, avoid={A}) for _ in range(6)} == {B, C}


# -- status ------------------------------------------------------------------------------------


def test_status_reports_weights_states_health_streams_and_failures() -> None:
    rig = Routing(fleet(Server(address=A, weight=2), B, C, sticky=COOKIE))
    conn, client, first = rig.ask(to=A)
    # A fails once (max_fails 1): out for fail_timeout; the request goes on to B.
    second = fails_over(rig, first.conn, conn, avoid={A})
    rig.serve(conn, client, second)
    _conn, _client, _backend = sse_stream(rig, to=B)
    set_runtime(rig, **{B: {"weight": 5}, C: {"drain": True}})
    status = rig.pb.core.status()
    assert status["clients"] == 2 and status["streams"] == 1
    assert status["upstream_connections"] == 1
    group = status["groups"]["default"]
    assert group["balance"] == "round_robin"
    by_address = {s["address"]: s for s in group["servers"]}
    assert [s["address"] for s in group["servers"]] == [A, B, C]
    assert by_address[A] | {"id": None} == {
        "address": A,
        "id": None,
        "weight": 2,
        "effective_weight": 2,
        "configured_weight": 2,
        "state": "down",
        "health": "unhealthy",
        "active": 0,
        "failures": 1,
        "max_streams": None,
        "work": 0,
        "reported": None,
    }
    assert group["queue"] == {"waiting": 0, "max": 1000}
    assert by_address[A]["id"] == rig.router.ids[0].decode()
    b = by_address[B]
    assert (b["weight"], b["configured_weight"], b["state"], b["active"]) == (5, 1, "up", 1)
    assert (by_address[C]["state"], by_address[C]["health"]) == ("draining", "healthy")
    set_runtime(rig, **{B: {"down": True}})
    assert rig.pb.core.status()["groups"]["default"]["servers"][1]["state"] == "down"
    rig.pb.now += 11.0  # past A's fail_timeout
    a = rig.pb.core.status(rig.pb.now)["groups"]["default"]["servers"][0]
    assert (a["state"], a["health"], a["failures"]) == ("up", "healthy", 1)  # on probation
    rig.pb.done()


# -- reloads keep state by address -------------------------------------------------------------


def test_reload_keeps_streams_in_flight_of_servers_that_stay_and_moved() -> None:
    rig = Routing(fleet(A, B, balance=Balance.LEAST_STREAMS))
    conn, client, backend = sse_stream(rig, to=A)
    reload(rig, (C, A))  # A moves to position 1 and keeps its stream
    assert rig.router.active == [0, 1]
    for _ in range(3):
        served_by(rig, to=C)  # least streams: A is busy
    event(rig, backend, conn, client, b"data: two\n\n")
    rig.stream_ends(backend, conn, client)
    assert rig.router.active == [0, 0]


def test_stream_of_a_removed_server_finishes_and_leaves_the_new_router_alone() -> None:
    rig = Routing(fleet(A, B))
    conn, client, backend = sse_stream(rig, to=A)
    reload(rig, (B, C))
    assert rig.router.active == [0, 0]
    assert served_by(rig) in (B, C)
    event(rig, backend, conn, client, b"data: two\n\n")
    rig.stream_ends(backend, conn, client)
    assert rig.router.active == [0, 0]
    status = rig.pb.core.status()["groups"]["default"]["servers"]
    assert [s["active"] for s in status] == [0, 0]


def test_reload_keeps_remembered_keys_when_a_server_is_added() -> None:
    rig = Routing(fleet(A, B, sticky=KEYED))
    keys = [f"conv-{n}" for n in range(40)]
    before = {key: served_by(rig, chat(key)) for key in keys}
    reload(rig, (A, B, C))
    # C would own about a third of the keys by hashing; remembered keys stay where they are.
    for key in keys:
        served_by(rig, chat(key), to=before[key])
    for key in keys_owned_by(rig, C, 3, among=range(100, 10_000)):
        served_by(rig, chat(key), to=C)

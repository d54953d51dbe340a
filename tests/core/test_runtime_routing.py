"""The operator's runtime server state (``RuntimeChanged``) in the core, driven with bytes only:
weights, drain and down apply to the next decision, never to a stream in flight; remembered
session keys and sticky pins stay on a draining server; ``status()``; a reload keeps each
kept server's state by address, and streams of removed servers finish cleanly.
"""

from __future__ import annotations

from typing import Any

import attrs
import h11
import pytest
from test_routing_exchange import COOKIE, A, B, C, Rig, fleet, origin, sticky_cookie

from muxproxy.config import Balance, Server, SessionSource, Sticky, StickyCookie
from muxproxy.config.runtime import RuntimeState
from muxproxy.core.events import ConfigChanged, RuntimeChanged
from muxproxy.routing.balancer import rendezvous_order

KEYED = Sticky(sources=(SessionSource(kind="header", name="x-chat-id"),))
KEYED_AND_PINNED = Sticky(
    sources=(SessionSource(kind="header", name="x-chat-id"),), cookie=StickyCookie(name="mp_srv")
)


def set_runtime(rig: Rig, **changes: dict[str, Any]) -> RuntimeState:
    """Feed a ``RuntimeChanged`` whose state has ``changes`` (address -> fields)."""
    state = RuntimeState.empty()
    for address, fields in changes.items():
        state = state.changed("default", address, **fields)
    rig.pb.feed(RuntimeChanged(now=rig.pb.now, state=state))
    return state


def runtime(rig: Rig, state: RuntimeState) -> None:
    rig.pb.feed(RuntimeChanged(now=rig.pb.now, state=state))


def drained(address: str, **fields: Any) -> RuntimeState:
    return RuntimeState.empty().changed("default", address, **fields)


def reload(rig: Rig, servers: tuple[str, ...]) -> None:
    group = attrs.evolve(rig.group, servers=tuple(Server(address=s) for s in servers))
    rig.config = attrs.evolve(rig.config, upstreams={"default": group})
    rig.pb.feed(ConfigChanged(now=rig.pb.now, config=rig.config))


def sse_stream(rig: Rig, headers: list[tuple[str, str]] | None = None) -> tuple[int, Any, int]:
    """A request whose backend answers with an SSE head and one event: (client conn, client
    peer, backend conn). The response stays open."""
    conn, client = rig.request(headers=headers)
    backend = rig.last_open().conn
    rig.sse_start(backend, "x")
    rig.chunk(backend, b"data: one\n\n")
    return conn, client, backend


def client_data(rig: Rig, conn: int, client: Any) -> bytes:
    return b"".join(bytes(e.data) for e in client.events(rig.take(conn)) if isinstance(e, h11.Data))


def served_by(rig: Rig, headers: list[tuple[str, str]] | None = None) -> str:
    """One whole request answered 200; the server it went to."""
    conn, client = rig.request(headers=headers)
    (served,) = rig.serve()
    head, _, _ = rig.response(conn, client)
    assert head.status_code == 200
    return served


def chat(key: str) -> list[tuple[str, str]]:
    return [("X-Chat-ID", key)]


def keys_owned_by(rig: Rig, address: str, count: int, among: range | None = None) -> list[str]:
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
    rig = Rig(fleet(A, B))
    conn, client, backend = sse_stream(rig)
    assert origin(rig.last_open()) == A
    assert client_data(rig, conn, client) == b"data: one\n\n"
    assert rig.router.active == [1, 0]
    mark = len(rig.pb.log)
    state = set_runtime(rig, **{A: fields})
    assert rig.pb.core.runtime == state
    assert [c for c in rig.pb.log[mark:] if c.__class__.__name__ != "Log"] == []  # cuts nothing
    for _ in range(3):
        assert served_by(rig) == B  # unkeyed requests leave A at once
    rig.chunk(backend, b"data: two\n\n")
    rig.end(backend)
    assert client_data(rig, conn, client) == b"data: two\n\n"
    access = rig.logs("access")[-1]  # the stream's, which ended last
    assert access.fields["server"] == A and access.fields["status"] == 200
    assert rig.router.active == [0, 0]


def test_weights_apply_at_once_and_a_reset_restores_the_configured_ones() -> None:
    rig = Rig(fleet(A, B))
    set_runtime(rig, **{B: {"weight": 3}})
    assert [served_by(rig) for _ in range(8)].count(B) == 6  # 3:1 in every cycle of 4
    runtime(rig, RuntimeState.empty())
    assert [served_by(rig) for _ in range(4)].count(B) == 2


def test_overrides_of_servers_or_groups_not_configured_are_ignored() -> None:
    rig = Rig(fleet(A, B))
    state = RuntimeState.empty().changed("default", C, down=True).changed("other", A, down=True)
    runtime(rig, state)
    assert {served_by(rig) for _ in range(4)} == {A, B}


def test_drain_keeps_remembered_keys_and_sends_new_keys_elsewhere() -> None:
    rig = Rig(fleet(A, B, C, sticky=KEYED))
    known, fresh = keys_owned_by(rig, A, 2)
    assert served_by(rig, chat(known)) == A
    set_runtime(rig, **{A: {"drain": True}})
    for _ in range(3):
        assert served_by(rig, chat(known)) == A  # a conversation under way stays
    assert served_by(rig, chat(fresh)) != A  # a new one goes elsewhere
    assert served_by(rig, chat(fresh)) != A  # and stays there, though it would hash to A


def test_down_moves_even_remembered_keys_and_pins_and_they_stay_moved() -> None:
    rig = Rig(fleet(A, B, C, sticky=KEYED_AND_PINNED))
    (known,) = keys_owned_by(rig, A, 1)
    conn, client = rig.request(headers=chat(known))
    (first,) = rig.serve()
    head, _, _ = rig.response(conn, client)
    pin = sticky_cookie(head)
    assert first == A and pin is not None
    set_runtime(rig, **{A: {"down": True}})
    pinned = [("Cookie", f"mp_srv={pin.decode()}")]
    moved_pin = served_by(rig, pinned)
    moved_key = served_by(rig, chat(known))
    assert A not in (moved_pin, moved_key)
    runtime(rig, RuntimeState.empty())  # A is back: the key stays where it was moved to
    assert served_by(rig, chat(known)) == moved_key
    assert served_by(rig, pinned) == A  # the pin still names A


def test_cookie_pin_follows_to_a_draining_server() -> None:
    rig = Rig(fleet(sticky=COOKIE))
    conn, client = rig.request()
    (first,) = rig.serve()
    head, _, _ = rig.response(conn, client)
    pin = sticky_cookie(head)
    assert pin is not None
    set_runtime(rig, **{first: {"weight": 0}})
    assert {served_by(rig, [("Cookie", f"mp_srv={pin.decode()}")]) for _ in range(3)} == {first}
    assert first not in {served_by(rig) for _ in range(3)}


def test_remembered_key_expires_after_session_idle() -> None:
    rig = Rig(fleet(A, B, C, sticky=attrs.evolve(KEYED, session_idle=60.0)))
    (key,) = keys_owned_by(rig, A, 1)
    assert served_by(rig, chat(key)) == A
    set_runtime(rig, **{A: {"drain": True}})
    rig.pb.now += 60.0
    assert served_by(rig, chat(key)) == A  # 60 s idle: still remembered
    rig.pb.now += 60.5
    moved = served_by(rig, chat(key))
    assert moved != A  # forgotten: a new session, which A does not take while it drains


def test_runtime_state_is_applied_to_a_new_configuration() -> None:
    rig = Rig(fleet(A, B))
    set_runtime(rig, **{A: {"down": True}})
    reload(rig, (C, A, B))
    assert {served_by(rig) for _ in range(6)} == {B, C}


# -- status ------------------------------------------------------------------------------------


def test_status_reports_weights_states_health_streams_and_failures() -> None:
    rig = Rig(fleet(Server(address=A, weight=2), B, C, sticky=COOKIE))
    rig.request()
    rig.refuse(rig.last_open().conn)  # A fails once (max_fails 1): out for fail_timeout
    rig.serve()
    _conn, _client, _backend = sse_stream(rig)
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


# -- reloads keep state by address -------------------------------------------------------------


def test_reload_keeps_streams_in_flight_of_servers_that_stay_and_moved() -> None:
    rig = Rig(fleet(A, B, balance=Balance.LEAST_STREAMS))
    conn, client, backend = sse_stream(rig)
    assert origin(rig.last_open()) == A
    reload(rig, (C, A))  # A moves to position 1 and keeps its stream
    assert rig.router.active == [0, 1]
    assert {served_by(rig) for _ in range(3)} == {C}  # least streams: A is busy
    rig.chunk(backend, b"data: two\n\n")
    rig.end(backend)
    assert client_data(rig, conn, client) == b"data: one\n\ndata: two\n\n"
    assert rig.router.active == [0, 0]


def test_stream_of_a_removed_server_finishes_and_leaves_the_new_router_alone() -> None:
    rig = Rig(fleet(A, B))
    conn, client, backend = sse_stream(rig)
    assert origin(rig.last_open()) == A
    reload(rig, (B, C))
    assert rig.router.active == [0, 0]
    assert served_by(rig) in (B, C)
    rig.chunk(backend, b"data: two\n\n")
    rig.end(backend)
    assert client_data(rig, conn, client) == b"data: one\n\ndata: two\n\n"
    assert rig.router.active == [0, 0]
    status = rig.pb.core.status()["groups"]["default"]["servers"]
    assert [s["active"] for s in status] == [0, 0]


def test_reload_keeps_remembered_keys_when_a_server_is_added() -> None:
    rig = Rig(fleet(A, B, sticky=KEYED))
    keys = [f"conv-{n}" for n in range(40)]
    before = {key: served_by(rig, chat(key)) for key in keys}
    reload(rig, (A, B, C))
    # C would own about a third of the keys by hashing; remembered keys stay where they are.
    assert {key: served_by(rig, chat(key)) for key in keys} == before
    fresh = keys_owned_by(rig, C, 3, among=range(100, 10_000))
    assert {served_by(rig, chat(key)) for key in fresh} == {C}

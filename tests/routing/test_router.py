"""``GroupRouter`` (``muxproxy.routing.router``): runtime overrides, affinity, reconfiguration.

Pure: time is passed in, no sockets. The exchange-level behaviour is in
``tests/core/test_runtime_routing.py``.
"""

from __future__ import annotations

from collections import Counter

import attrs

from muxproxy.config import (
    AffinityMode,
    Balance,
    HealthCheck,
    PrefixAffinity,
    Server,
    SessionSource,
    Sticky,
    Upstream,
)
from muxproxy.config.runtime import RuntimeState
from muxproxy.routing.balancer import rendezvous_order
from muxproxy.routing.load import DEFAULT_GAP
from muxproxy.routing.router import GroupRouter

A, B, C, D = (f"10.0.0.{n}:8000" for n in range(1, 5))
STICKY = Sticky(sources=(SessionSource(kind="header", name="x-chat-id"),))


def group(*servers: str | Server, **fields: object) -> Upstream:
    members = tuple(Server(address=s) if isinstance(s, str) else s for s in servers)
    fields.setdefault("sticky", STICKY)
    return Upstream(name="g", servers=members, **fields)  # type: ignore[arg-type]


def state(**by_address: dict[str, object]) -> RuntimeState:
    out = RuntimeState.empty()
    for address, fields in by_address.items():
        out = out.changed("g", address, **fields)
    return out


def first(router: GroupRouter, key: bytes | None = None, pinned: bytes | None = None) -> str:
    order = router.candidates(key, pinned, 0.0)
    return router.group.servers[order[0]].address


def send(router: GroupRouter, key: bytes | None, now: float = 0.0) -> str:
    """Route one request and count it sent (and ended); its server."""
    index = router.candidates(key, None, now)[0]
    router.stream_started(index, key, now)
    router.stream_ended(index)
    return router.group.servers[index].address


def owned_by(router: GroupRouter, address: str, count: int) -> list[bytes]:
    index = router.by_address[address]
    every = range(len(router.group.servers))
    keys = (b"conv-%d" % n for n in range(10_000))
    out = [k for k in keys if rendezvous_order(k, router.ids, router.weights, every)[0] == index]
    return out[:count]


def test_weights_apply_to_the_next_decision() -> None:
    router = GroupRouter(group(A, B))
    router.apply_runtime(state(**{A: {"weight": 3}}))
    assert Counter(send(router, None) for _ in range(8)) == {A: 6, B: 2}
    router.apply_runtime(state(**{A: {"weight": 0}}))
    assert {send(router, None) for _ in range(4)} == {B}


def test_keyed_shares_follow_runtime_weights() -> None:
    router = GroupRouter(group(A, B), state(**{B: {"weight": 4}}))
    owners = Counter(first(router, b"new-%d" % n) for n in range(2000))
    assert 1500 < owners[B] < 1700  # 4/5 of the keys


def test_drain_keeps_remembered_keys_and_pins_but_takes_no_new_ones() -> None:
    router = GroupRouter(group(A, B, C))
    known, fresh = owned_by(router, A, 2)
    assert send(router, known) == A
    router.apply_runtime(state(**{A: {"drain": True}}))
    assert send(router, known) == A
    assert first(router, fresh) != A
    assert first(router, None, pinned=router.ids[0]) == A
    assert A not in {send(router, None) for _ in range(6)}
    # Fallbacks of a remembered key are the hashing's order over the servers taking new work.
    order = router.candidates(known, None, 0.0)
    assert order[0] == 0 and 0 not in order[1:] and len(order) == 3


def test_down_excludes_everything() -> None:
    router = GroupRouter(group(A, B))
    (known,) = owned_by(router, A, 1)
    assert send(router, known) == A
    router.apply_runtime(state(**{A: {"down": True}}))
    assert router.candidates(known, router.ids[0], 0.0) == [1]
    assert router.candidates(None, None, 0.0) == [1]
    router.apply_runtime(state(**{A: {"down": True}, B: {"down": True}}))
    assert router.candidates(known, router.ids[1], 0.0) == []


def test_remembered_server_that_failed_is_left_for_the_hashing() -> None:
    router = GroupRouter(group(A, B, C))
    (key,) = owned_by(router, A, 1)
    router.apply_runtime(state(**{A: {"weight": 0}}))
    router.stream_started(1, key, 0.0)  # the key went to B earlier
    assert router.candidates(key, None, 0.5)[0] == 1
    router.failed(1, 1.0)  # B is out
    assert router.candidates(key, None, 1.0) == [2]  # A drains, B is out: C is left


def test_remembered_key_expires_after_session_idle() -> None:
    router = GroupRouter(group(A, B, C, sticky=attrs.evolve(STICKY, session_idle=30.0)))
    (key,) = owned_by(router, A, 1)
    assert send(router, key, 0.0) == A
    router.apply_runtime(state(**{A: {"drain": True}}))
    assert router.candidates(key, None, 30.0)[0] == 0
    assert router.candidates(key, None, 30.1)[0] != 0


def test_reconfigure_keeps_per_server_state_by_address() -> None:
    check = HealthCheck(fails=1, passes=1)
    old = GroupRouter(group(A, B, C, health_check=check, balance=Balance.LEAST_STREAMS))
    (key,) = owned_by(old, C, 1)
    old.stream_started(2, key, 0.0)  # C: a stream in flight, and the key remembered there
    old.stream_started(2, None, 0.0)
    old.failed(0, 1.0)  # A out (passive)
    old.probe_result(1, False)  # B down (active)
    new = old.reconfigure(group(D, C, B, health_check=check, balance=Balance.LEAST_STREAMS))
    assert new is not old
    assert new.active == [0, 2, 0]
    assert not new.probes.up(2) and new.probes.up(0)  # type: ignore[union-attr]
    assert new.candidates(None, None, 1.0) == [0, 1]  # D idle, then C; B down
    assert new.candidates(key, None, 1.0)[0] == 1
    # The old router's streams end on the new router's C; A (removed) stays behind.
    old.stream_ended(2)
    old.stream_started(0, None, 2.0)
    old.stream_ended(0)
    assert new.active == [0, 1, 0] and old.active == [0, 0, 1]
    old.succeeded(1)  # reported for B, which is index 2 now
    newer = new.reconfigure(group(C, D))
    old.stream_ended(2)
    assert newer.active == [0, 0] and new.active == [0, 0, 0]


def test_reconfigure_keeps_passive_health_and_balancer_position_by_address() -> None:
    old = GroupRouter(group(A, B))
    old.failed(1, 5.0)  # B out until 15
    new = old.reconfigure(group(C, B, A))
    assert [new.group.servers[i].address for i in new.candidates(None, None, 6.0)] in (
        [C, A],
        [A, C],
    )
    assert {send(new, None, 16.0) for _ in range(6)} == {A, B, C}


def test_reconfigure_in_place_and_runtime_weights() -> None:
    router = GroupRouter(group(A, B), state(**{A: {"weight": 5}}))
    assert router.weights == [5, 1]
    same = router.reconfigure(group(A, Server(address=B, weight=2)))
    assert same is router
    assert router.weights == [1, 2]  # overrides are the caller's to re-apply
    router.apply_runtime(state(**{A: {"weight": 5}}))
    assert router.weights == [5, 2]


def test_status_of_a_group() -> None:
    router = GroupRouter(group(A, Server(address=B, weight=2)))
    router.apply_runtime(state(**{A: {"drain": True}, B: {"weight": 0}}))
    router.stream_started(0, None, 0.0)
    got = router.status(0.0)
    assert got["balance"] == "round_robin"
    servers = got["servers"]
    assert isinstance(servers, list)
    assert [(s["weight"], s["configured_weight"], s["state"], s["active"]) for s in servers] == [
        (1, 1, "draining", 1),
        (0, 2, "draining", 0),
    ]


def test_prefix_placement_applies_the_groups_balance_gap() -> None:
    def placements(balance_gap: int | None) -> Counter[str]:
        fleet = group(
            A,
            B,
            C,
            D,
            affinity=AffinityMode.PREFIX,
            prefix=PrefixAffinity(balance_gap=balance_gap),
        )
        router = GroupRouter(fleet)
        out: Counter[str] = Counter()
        for _ in range(20):  # one hot prompt, its streams all still running
            index = router.candidates(None, None, 0.0, prefix=b"hot prompt")[0]
            router.stream_started(index, None, 0.0)
            out[fleet.servers[index].address] += 1
        return out

    # The mean bound alone (a gap too large to bind) lets the prompt's owner run
    # ceil(1.25 x 20 / 4) = 7 of 20 streams; a gap of 1 keeps every server within one stream
    # of the others: 5 each. Unset, the gap is ``DEFAULT_GAP`` (no server's slots known).
    assert max(placements(1000).values()) >= 7
    assert sorted(placements(1).values()) == [5, 5, 5, 5]
    unset = placements(None).values()
    assert (
        max(unset) - min(unset)
        <= DEFAULT_GAP
        < max(placements(1000).values()) - min(placements(1000).values())
    )

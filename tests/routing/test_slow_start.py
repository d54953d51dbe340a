"""Slow start (``slow_start``, ``routing/router.py``): a server that joins ramps its weight
from near 0 to its own; remembered sessions are not moved by the ramp."""

from __future__ import annotations

from collections import Counter

from muxproxy.config import Balance, Server, SessionSource, Sticky, Upstream
from muxproxy.routing.router import RAMP_SCALE, GroupRouter

A, B, C, D = (f"10.0.0.{n}:8000" for n in range(1, 5))
STICKY = Sticky(sources=(SessionSource(kind="header", name="x-chat-id"),))


def group(*addresses: str, slow_start: float = 30.0, **fields: object) -> Upstream:
    servers = tuple(Server(address=a) for a in addresses)
    return Upstream(name="g", servers=servers, sticky=STICKY, slow_start=slow_start, **fields)  # type: ignore[arg-type]


def shares(router: GroupRouter, now: float, keyed: bool, count: int = 3000) -> Counter[str]:
    seen: Counter[str] = Counter()
    for n in range(count):
        key = b"new-%d-%f" % (n, now) if keyed else None
        index = router.candidates(key, None, now)[0]
        seen[router.group.servers[index].address] += 1
    return seen


def test_a_joining_server_ramps_from_near_zero_to_its_weight_for_unkeyed_requests() -> None:
    router = GroupRouter(group(A, B, C)).reconfigure(group(A, B, C, D), now=100.0)
    assert shares(router, 100.0, keyed=False)[D] <= 3  # a thousandth of a share at the start
    # Half way: a weight of 0.5 beside three of 1, so 0.5 / 3.5 of the requests.
    assert shares(router, 115.0, keyed=False, count=3500)[D] == 500
    assert shares(router, 130.0, keyed=False, count=4000)[D] == 1000  # its whole share


def test_a_joining_server_ramps_for_new_sessions_by_rendezvous_hashing() -> None:
    router = GroupRouter(group(A, B, C)).reconfigure(group(A, B, C, D), now=0.0)
    start = shares(router, 0.5, keyed=True)[D]
    middle = shares(router, 15.0, keyed=True)[D]
    end = shares(router, 30.0, keyed=True)[D]
    assert start < 30 < middle < end
    assert 600 < end < 900  # a quarter of 3000, once ramped


def test_remembered_sessions_stay_where_they_are_while_a_server_ramps() -> None:
    router = GroupRouter(group(A, B, C))
    keys = [b"conv-%d" % n for n in range(300)]
    before = {}
    for key in keys:
        index = router.candidates(key, None, 0.0)[0]
        router.stream_started(index, key, 0.0)
        router.stream_ended(index)
        before[key] = router.group.servers[index].address
    router = router.reconfigure(group(A, B, C, D), now=1.0)
    for now in (1.0, 20.0, 40.0):
        for key in keys:
            index = router.candidates(key, None, now)[0]
            assert router.group.servers[index].address == before[key]


def test_servers_of_the_first_configuration_and_kept_ones_do_not_ramp() -> None:
    router = GroupRouter(group(A, B))
    assert router.routing_weights(0.0) == [RAMP_SCALE, RAMP_SCALE]
    router = router.reconfigure(group(A, B, C), now=10.0)
    assert router.routing_weights(10.0) == [RAMP_SCALE, RAMP_SCALE, 1]
    router = router.reconfigure(group(B, C), now=20.0)  # C keeps the time it joined
    assert router.routing_weights(25.0) == [RAMP_SCALE, RAMP_SCALE // 2]
    assert router.effective_weight(1, 25.0) == 0.5


def test_status_shows_the_set_weight_and_the_ramped_one() -> None:
    router = GroupRouter(group(A)).reconfigure(group(A, B), now=0.0)
    servers = router.status(6.0)["servers"]
    assert isinstance(servers, list)
    by_address = {entry["address"]: entry for entry in servers}
    assert by_address[B]["weight"] == 1 and by_address[B]["effective_weight"] == 0.2
    assert by_address[A]["effective_weight"] == 1.0


def test_without_slow_start_a_joining_server_takes_its_share_at_once() -> None:
    router = GroupRouter(group(A, B, slow_start=0)).reconfigure(
        group(A, B, C, slow_start=0), now=5.0
    )
    assert router.routing_weights(5.0) == [1, 1, 1]
    assert shares(router, 5.0, keyed=False, count=300)[C] == 100


def test_least_streams_weighs_a_ramping_server_by_its_ramped_weight() -> None:
    old = GroupRouter(group(A, B, balance=Balance.LEAST_STREAMS))
    router = old.reconfigure(group(A, B, balance=Balance.LEAST_STREAMS), now=0.0)
    assert router is old  # same servers: nothing joined
    router = router.reconfigure(group(A, B, C, balance=Balance.LEAST_STREAMS), now=0.0)
    picks: Counter[str] = Counter()
    for _ in range(100):
        index = router.candidates(None, None, 3.0)[0]
        router.stream_started(index, None, 3.0)  # streams stay open: least streams counts
        picks[router.group.servers[index].address] += 1
    assert 0 < picks[C] <= 10  # a tenth of a share at 3 s of 30

"""A key stays on its server while that server has a free slot, and spills only when it is
full or over the gap (``routing/load.py``: ``bounded_order`` with ``free``, ``default_gap``,
``ServerLoads.free``; ``routing/router.py`` with ``max_streams`` and load reports)."""

from __future__ import annotations

from muxproxy.config import AffinityMode, LoadReporting, PrefixAffinity, Server, Upstream
from muxproxy.config.serverid import server_id
from muxproxy.routing.balancer import rendezvous_order
from muxproxy.routing.load import (
    DEFAULT_GAP,
    UNSEEN_SPARE,
    ServerLoads,
    bounded_order,
    default_gap,
)
from muxproxy.routing.loadreport import LoadReport
from muxproxy.routing.router import GroupRouter

IDS = [server_id("gpu", f"10.0.0.{i}:8000") for i in range(4)]
ADDRESSES = [f"10.0.0.{i}:8000" for i in range(1, 5)]
KEY = b"a conversation"


def report(running: int, waiting: int = 0) -> LoadReport:
    return LoadReport(running=running, waiting=waiting, kv_cache=0.5, engine="vllm")


def test_a_home_with_a_free_slot_keeps_its_key_past_both_bounds() -> None:
    home = rendezvous_order(KEY, IDS, [1] * 4, range(4))[0]
    streams = [0] * 4
    streams[home] = 6  # 6 of 8 slots: over the mean bound (ceil(1.25 x 7 / 4) = 3) and a gap of 2
    assert bounded_order(KEY, IDS, [1] * 4, streams, range(4), 1.25, 2)[0] != home
    slots = 8
    chosen = bounded_order(
        KEY, IDS, [1] * 4, streams, range(4), 1.25, 2, lambda i: streams[i] < slots
    )
    assert chosen[0] == home


def test_a_full_home_spills_to_the_first_server_within_the_bounds_with_a_free_slot() -> None:
    order = rendezvous_order(KEY, IDS, [1] * 4, range(4))
    streams = [0] * 4
    streams[order[0]] = 8  # full
    streams[order[1]] = 8  # full too, though within a gap of 8
    chosen = bounded_order(KEY, IDS, [1] * 4, streams, range(4), 100.0, 8, lambda i: streams[i] < 8)
    assert chosen[0] == order[2]
    assert sorted(chosen) == [0, 1, 2, 3]


def test_when_every_server_is_full_the_bounds_decide() -> None:
    order = rendezvous_order(KEY, IDS, [1] * 4, range(4))
    streams = [8] * 4
    streams[order[0]] = 10  # two over the others: over a gap of 2 (11 - 8 > 2)
    chosen = bounded_order(KEY, IDS, [1] * 4, streams, range(4), 100.0, 2, lambda i: False)
    assert chosen[0] == order[1]
    streams[order[0]] = 9  # within the gap: stays home (all full, it leads by little)
    chosen = bounded_order(KEY, IDS, [1] * 4, streams, range(4), 100.0, 2, lambda i: False)
    assert chosen[0] == order[0]


def test_unknown_slots_keep_the_bounds_as_before() -> None:
    streams = [5, 0, 0, 0]
    for key in (b"a", b"b", b"c", b"d", b"e"):
        plain = bounded_order(key, IDS, [1] * 4, streams, range(4), 1.25, 2)
        unknown = bounded_order(key, IDS, [1] * 4, streams, range(4), 1.25, 2, lambda i: None)
        assert plain == unknown


def test_the_default_gap_is_a_quarter_of_the_smallest_known_slots() -> None:
    assert default_gap([8, 8, 8, 8]) == 2
    assert default_gap([None, 256, 64]) == 16
    assert default_gap([9]) == 3
    assert default_gap([1, None]) == 1
    assert default_gap([None, None]) == DEFAULT_GAP
    assert default_gap([]) == DEFAULT_GAP


def test_slots_are_seen_when_the_engine_queues_and_a_queue_means_full() -> None:
    loads = ServerLoads(2, 100, 1.0)
    assert loads.free(0, 3, None, 0.0) is None  # unknown
    loads.report(0, report(6), 0.0, streams=3)
    assert loads.free(0, 3, None, 0.0) is True  # no queue: room, by its report
    assert loads.free(0, 3 + UNSEEN_SPARE, None, 0.0) is None  # sent that many since: unknown
    loads.report(0, report(8, waiting=2), 1.0)
    assert loads.seen_slots[0] == 8
    assert loads.free(0, 3, None, 1.0) is False  # it queues now
    loads.report(0, report(5), 2.0)
    assert loads.free(0, 3, None, 2.0) is True
    assert loads.free(0, 8, None, 2.0) is False  # our own streams fill it
    loads.report(0, report(7, waiting=1), 3.0)
    assert loads.seen_slots[0] == 8  # the largest batch seen
    assert loads.free(1, 3, 4, 0.0) is True  # max_streams decides without reports
    assert loads.free(1, 4, 4, 0.0) is False
    assert loads.free(0, 3, None, 100.0) is True  # a stale report says nothing; slots stay


def router_with(max_streams: int | None, *, reports: bool = False) -> GroupRouter:
    servers = tuple(Server(address=a, max_streams=max_streams) for a in ADDRESSES)
    fleet = Upstream(
        name="gpu",
        servers=servers,
        affinity=AffinityMode.PREFIX,
        prefix=PrefixAffinity(),
        load_report=LoadReporting() if reports else None,
    )
    return GroupRouter(fleet)


def test_a_hot_key_fills_its_home_slots_before_spilling_with_the_defaults() -> None:
    router = router_with(8)
    placed = []
    for _ in range(12):
        index = router.candidates(None, None, 0.0, prefix=KEY)[0]
        router.stream_started(index, None, 0.0)
        placed.append(index)
    home = placed[0]
    assert placed[:8] == [home] * 8  # never spilled while it had a free slot
    assert home not in placed[8:]  # full: the rest spill


def test_a_home_with_free_slots_by_its_report_keeps_its_key() -> None:
    router = router_with(None, reports=True)
    home = router.candidates(None, None, 0.0, prefix=KEY)[0]
    for index in range(4):  # every engine showed a full batch of 8 once
        router.load_reported(index, report(8, waiting=1), 0.0)
    for index in range(4):
        router.load_reported(index, report(2 if index != home else 6), 1.0)
    assert router.gap() == 2  # a quarter of the 8 slots seen
    for _ in range(6):
        router.stream_started(home, None, 1.0)  # 6 streams: over the gap of 2
    assert router.candidates(None, None, 1.0, prefix=KEY)[0] == home
    router.load_reported(home, report(8, waiting=1), 1.5)  # its engine queues: full
    assert router.candidates(None, None, 1.5, prefix=KEY)[0] != home


def test_before_its_slots_are_seen_a_report_without_a_queue_keeps_the_key_home() -> None:
    router = router_with(None, reports=True)
    home = router.candidates(None, None, 0.0, prefix=KEY)[0]
    for index in range(4):
        router.load_reported(index, report(2 if index != home else 5), 0.0)
    assert router.loads.seen_slots == [None] * 4  # no engine has queued yet
    placed = []
    for _ in range(UNSEEN_SPARE + 2):
        index = router.candidates(None, None, 0.5, prefix=KEY)[0]
        router.stream_started(index, None, 0.5)
        placed.append(index)
    # Room by its report for UNSEEN_SPARE more, past the default gap of 4 and the bound;
    # then the bounds decide until the next report.
    assert placed[:UNSEEN_SPARE] == [home] * UNSEEN_SPARE
    assert home not in placed[UNSEEN_SPARE:]
    router.load_reported(home, report(5 + UNSEEN_SPARE), 1.0)  # no queue yet: room again
    assert router.candidates(None, None, 1.0, prefix=KEY)[0] == home
    router.load_reported(home, report(0, waiting=3), 2.0)  # a queue: full
    assert router.candidates(None, None, 2.0, prefix=KEY)[0] != home

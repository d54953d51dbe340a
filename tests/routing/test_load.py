"""Load-aware choices (``routing/load.py``): tickets, reports, power of two choices and
consistent hashing with bounded loads."""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from muxproxy.config.serverid import server_id
from muxproxy.routing.balancer import rendezvous_order
from muxproxy.routing.load import (
    REPORT_LIFETIMES,
    Sampler,
    ServerLoads,
    Ticket,
    bounded_order,
    power_of_two,
)
from muxproxy.routing.loadreport import LoadReport

IDS = [server_id("gpu", f"10.0.0.{i}:8000") for i in range(4)]


class Meter:
    def __init__(self) -> None:
        self.events = 0


def report(running: int | None = None, waiting: int | None = None, kv: float | None = None):
    return LoadReport(running=running, waiting=waiting, kv_cache=kv, engine="vllm")


# -- tickets and work ---------------------------------------------------------------------------


def test_a_ticket_counts_down_with_the_events_relayed_and_stops_at_zero() -> None:
    ticket = Ticket(10)
    assert ticket.remaining == 10
    meter = Meter()
    ticket.progress = meter
    meter.events = 4
    assert ticket.remaining == 6
    meter.events = 25
    assert ticket.remaining == 0


def test_own_work_is_the_sum_of_what_each_stream_has_left() -> None:
    loads = ServerLoads(2, default_tokens=100, interval=None)
    long, short = Ticket(4000), Ticket(10)
    loads.add(0, long)
    loads.add(1, short)
    meter = Meter()
    long.progress = meter
    meter.events = 1000
    assert (loads.own_work(0), loads.own_work(1)) == (3000, 10)
    loads.remove(0, long)
    loads.remove(0, long)  # a second removal is harmless
    assert loads.own_work(0) == 0


def test_a_fresh_report_adds_the_engines_queue_and_the_work_of_others() -> None:
    loads = ServerLoads(1, default_tokens=100, interval=1.0)
    loads.add(0, Ticket(50))
    loads.report(0, report(running=5, waiting=2), now=10.0)
    # 2 waiting + (5 running - 1 of ours) foreign, each at the default.
    assert loads.work(0, own_streams=1, now=10.5) == 50 + (2 + 4) * 100
    # Running fewer than ours (the report is older than our last admission): no foreign work.
    loads.report(0, report(running=0, waiting=0), now=11.0)
    assert loads.work(0, own_streams=1, now=11.0) == 50


def test_a_report_older_than_three_intervals_is_ignored() -> None:
    loads = ServerLoads(1, default_tokens=100, interval=2.0)
    loads.report(0, report(running=0, waiting=7, kv=0.99), now=0.0)
    limit = REPORT_LIFETIMES * 2.0
    assert loads.fresh(0, now=limit) is not None
    assert loads.work(0, 0, now=limit) == 700 and loads.kv_full(0, 0.95, now=limit)
    assert loads.fresh(0, now=limit + 0.001) is None
    assert loads.work(0, 0, now=limit + 0.001) == 0
    assert not loads.kv_full(0, 0.95, now=limit + 0.001)
    assert loads.waiting(0, now=limit + 0.001) is None


def test_a_report_without_a_kv_gauge_never_counts_as_full() -> None:
    loads = ServerLoads(1, default_tokens=1, interval=1.0)
    loads.report(0, report(running=1, waiting=1), now=0.0)
    assert not loads.kv_full(0, 0.5, now=0.0)


def test_carry_moves_tickets_and_reports_to_the_new_positions() -> None:
    old = ServerLoads(2, default_tokens=1, interval=1.0)
    ticket = Ticket(7)
    old.add(1, ticket)
    old.report(1, report(waiting=3), now=0.0)
    new = ServerLoads(3, default_tokens=1, interval=1.0)
    new.carry(old, [(1, 2)])
    assert new.own_work(2) == 7 and new.waiting(2, now=0.0) == 3
    assert new.own_work(0) == 0 and new.waiting(0, now=0.0) is None


# -- the sampler and power of two choices -------------------------------------------------------


def test_the_sampler_is_deterministic_and_spreads_evenly() -> None:
    first = [Sampler(42).below(4) for _ in range(1)]
    a, b = Sampler(42), Sampler(42)
    assert [a.next() for _ in range(5)] == [b.next() for _ in range(5)]
    assert first[0] == Sampler(42).below(4)
    sampler = Sampler(7)
    counts = Counter(sampler.below(4) for _ in range(40_000))
    assert set(counts) == {0, 1, 2, 3}
    assert all(abs(n - 10_000) < 500 for n in counts.values()), counts


def test_power_of_two_picks_the_less_loaded_of_the_two_drawn() -> None:
    weights = [1, 1]
    work = [500, 20]
    sampler = Sampler(1)
    picks = {power_of_two(weights, work.__getitem__, [0, 1], sampler) for _ in range(50)}
    assert picks == {1}  # with two servers both are always drawn


def test_power_of_two_normalises_by_weight() -> None:
    # Server 0 has twice the work but three times the weight: it is the less loaded.
    weights = [3, 1]
    work = [200, 100]
    assert power_of_two(weights, work.__getitem__, [0, 1], Sampler(3)) == 0


def test_power_of_two_never_draws_a_zero_weight_or_ineligible_server() -> None:
    weights = [0, 1, 1, 1]
    sampler = Sampler(5)
    picks = Counter(power_of_two(weights, lambda i: 0, [0, 1, 2], sampler) for _ in range(600))
    assert set(picks) == {1, 2}
    assert power_of_two(weights, lambda i: 0, [0], sampler) is None
    assert power_of_two(weights, lambda i: 0, [], sampler) is None
    assert power_of_two(weights, lambda i: 0, [3], sampler) == 3


def test_power_of_two_asks_for_the_work_of_the_two_drawn_only() -> None:
    asked: list[int] = []

    def work(index: int) -> int:
        asked.append(index)
        return index

    power_of_two([1] * 8, work, range(8), Sampler(9))
    assert len(asked) == 2 and len(set(asked)) == 2


def test_power_of_two_balances_long_and_short_generations() -> None:
    """Streams of mixed lengths placed one after another end up with about equal work."""
    weights = [1, 1, 1, 1]
    work = [0, 0, 0, 0]
    sampler = Sampler(11)
    length = Sampler(12)
    for _ in range(4000):
        tokens = 10 if length.below(2) else 4000
        index = power_of_two(weights, work.__getitem__, range(4), sampler)
        assert index is not None
        work[index] += tokens
    mean = sum(work) / 4
    assert max(work) <= 1.05 * mean, work


@given(st.lists(st.integers(1, 9), min_size=2, max_size=6), st.integers(0, 2**32))
def test_weighted_draws_follow_the_weights(weights: list[int], seed: int) -> None:
    """With equal work, each server wins about as often as its weight says (two draws by
    weight, the first wins ties: the first draw is the pick, so shares follow weights)."""
    sampler = Sampler(seed)
    n = 3000
    picks = Counter(
        power_of_two(weights, lambda i: 0, range(len(weights)), sampler) for _ in range(n)
    )
    total = sum(weights)
    for index, weight in enumerate(weights):
        expected = n * weight / total
        assert abs(picks[index] - expected) < 5 * math.sqrt(expected) + 10


# -- consistent hashing with bounded loads -------------------------------------------------------


def test_a_key_goes_to_its_rendezvous_owner_while_under_the_bound() -> None:
    key = b"system prompt A"
    owner = rendezvous_order(key, IDS, [1] * 4, range(4))
    assert bounded_order(key, IDS, [1] * 4, [0] * 4, range(4), 1.25) == owner


def test_a_hot_key_spills_to_its_next_server_once_its_owner_is_over_the_bound() -> None:
    key = b"the hot system prompt"
    order = rendezvous_order(key, IDS, [1] * 4, range(4))
    streams = [0, 0, 0, 0]
    placed = []
    for _ in range(40):
        first = bounded_order(key, IDS, [1] * 4, streams, range(4), 1.25)[0]
        streams[first] += 1
        placed.append(first)
    mean = sum(streams) / 4
    assert placed[0] == order[0]
    assert max(streams) <= math.ceil(1.25 * mean)
    assert streams[order[0]] == max(streams)  # the owner is used as far as the bound allows


@settings(max_examples=200)
@given(
    st.lists(st.integers(0, 30), min_size=1, max_size=6),
    st.lists(st.integers(1, 5), min_size=6, max_size=6),
    st.floats(1.0, 3.0),
    st.binary(min_size=1, max_size=16),
)
def test_the_chosen_server_stays_within_the_bound(
    streams: list[int], weights: list[int], factor: float, key: bytes
) -> None:
    n = len(streams)
    ids = [server_id("g", f"h:{i}") for i in range(n)]
    weights = weights[:n]
    order = bounded_order(key, ids, weights, streams, range(n), factor)
    assert sorted(order) == list(range(n))  # a permutation: every fallback is there
    total = sum(streams) + 1
    chosen = order[0]
    if n > 1:
        bound = math.ceil(factor * total * weights[chosen] / sum(weights))
        assert streams[chosen] + 1 <= bound
        # Every server ranked before it by the hash was over its bound.
        for index in rendezvous_order(key, ids, weights, range(n)):
            if index == chosen:
                break
            assert streams[index] + 1 > math.ceil(factor * total * weights[index] / sum(weights))


# -- the balance gap: a bound on the lead over the least loaded server --------------------------


def test_near_capacity_the_mean_bound_lets_a_hot_key_queue_where_the_gap_does_not() -> None:
    key = b"the hot system prompt"
    order = rendezvous_order(key, IDS, [1] * 4, range(4))
    # Three servers at 9 streams (past an engine's 8 slots), one at 4: the mean bound
    # (ceil(1.25 x 32 / 4) = 10) still takes a tenth on the owner, the gap sends it to the 4.
    streams = [9, 9, 9, 9]
    streams[order[3]] = 4
    assert bounded_order(key, IDS, [1] * 4, streams, range(4), 1.25)[0] == order[0]
    chosen = bounded_order(key, IDS, [1] * 4, streams, range(4), 1.25, gap=2)
    assert chosen[0] == order[3]
    assert sorted(chosen) == [0, 1, 2, 3]  # the others stay as fallbacks
    assert chosen[1:] == order[:3]


def test_within_the_gap_a_key_stays_with_its_owner() -> None:
    key = b"system prompt A"
    order = rendezvous_order(key, IDS, [1] * 4, range(4))
    streams = [3, 3, 3, 3]
    streams[order[0]] = 4  # 4 + 1 - 3 = 2: within a gap of 2
    assert bounded_order(key, IDS, [1] * 4, streams, range(4), 1.25, gap=2)[0] == order[0]
    streams[order[0]] = 5  # 5 + 1 - 3 = 3: over it; the next server takes the key
    assert bounded_order(key, IDS, [1] * 4, streams, range(4), 1.25, gap=2)[0] == order[1]


def test_one_hot_key_placed_again_and_again_keeps_servers_within_the_gap() -> None:
    key = b"the hot system prompt"
    order = rendezvous_order(key, IDS, [1] * 4, range(4))
    streams = [0, 0, 0, 0]
    for _ in range(40):
        first = bounded_order(key, IDS, [1] * 4, streams, range(4), 1.25, gap=2)[0]
        streams[first] += 1
        assert max(streams) - min(streams) <= 2
    assert streams[order[0]] == max(streams)  # the owner is used as far as the gap allows


def test_the_gap_is_per_unit_of_weight() -> None:
    key = b"system prompt B"
    weights = [2, 1, 1, 1]
    order = rendezvous_order(key, IDS, weights, range(4))
    streams = [2, 1, 1, 1]  # per weight: 1 everywhere
    streams[order[0]] *= 3  # the owner at 3x its share: 3 (weight 1) or 6 (weight 2)
    low = order[1]
    chosen = bounded_order(key, IDS, weights, streams, range(4), 100.0, gap=2)[0]
    # (streams + 1) / weight <= streams_low / weight_low + gap / weight fails for the owner
    lead = (streams[order[0]] + 1) * weights[low] - streams[low] * weights[order[0]]
    assert lead > 2 * weights[low]
    assert chosen != order[0]


@settings(max_examples=200)
@given(
    st.lists(st.integers(0, 30), min_size=1, max_size=6),
    st.lists(st.integers(1, 5), min_size=6, max_size=6),
    st.floats(1.0, 3.0),
    st.integers(1, 8),
    st.binary(min_size=1, max_size=16),
)
def test_the_chosen_server_stays_within_both_bounds(
    streams: list[int], weights: list[int], factor: float, gap: int, key: bytes
) -> None:
    n = len(streams)
    ids = [server_id("g", f"h:{i}") for i in range(n)]
    weights = weights[:n]
    order = bounded_order(key, ids, weights, streams, range(n), factor, gap)
    assert sorted(order) == list(range(n))
    if n < 2:
        return
    total = sum(streams) + 1
    low = min(streams[i] / weights[i] for i in range(n))

    def within(index: int) -> bool:
        mean_bound = math.ceil(factor * total * weights[index] / sum(weights))
        lead = (streams[index] + 1) / weights[index] - low
        return streams[index] + 1 <= mean_bound and lead <= gap / weights[index] + 1e-9

    assert within(order[0])
    for index in rendezvous_order(key, ids, weights, range(n)):
        if index == order[0]:
            break
        assert not within(index)  # every server the hash ranks first was over a bound

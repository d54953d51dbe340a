"""Smooth weighted round-robin, least streams, weighted rendezvous hashing, server ids."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from muxproxy.config.serverid import server_id
from muxproxy.routing.balancer import (
    SmoothWeightedRoundRobin,
    least_streams,
    rendezvous_order,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def picks(rr: SmoothWeightedRoundRobin, weights: list[int], count: int) -> list[int | None]:
    return [rr.pick(weights, range(len(weights))) for _ in range(count)]


# -- smooth weighted round-robin ---------------------------------------------------------------


def test_nginx_sequence_for_weights_5_1_1() -> None:
    rr = SmoothWeightedRoundRobin(3)
    cycle = [0, 0, 1, 0, 2, 0, 0]  # a a b a c a a, as documented for nginx
    assert picks(rr, [5, 1, 1], 21) == cycle * 3


def test_equal_weights_alternate() -> None:
    rr = SmoothWeightedRoundRobin(3)
    assert picks(rr, [1, 1, 1], 6) == [0, 1, 2, 0, 1, 2]


def test_shares_follow_weights_over_a_cycle() -> None:
    rr = SmoothWeightedRoundRobin(4)
    weights = [3, 1, 0, 2]
    assert Counter(picks(rr, weights, 60)) == {0: 30, 1: 10, 3: 20}


def test_weight_change_applies_on_the_next_pick() -> None:
    rr = SmoothWeightedRoundRobin(2)
    weights = [1, 1]
    assert picks(rr, weights, 2) == [0, 1]
    weights[1] = 0  # drain server 1
    assert picks(rr, weights, 4) == [0, 0, 0, 0]
    weights[0] = 0
    weights[1] = 3
    assert picks(rr, weights, 3) == [1, 1, 1]


def test_zero_and_negative_weights_are_never_picked() -> None:
    rr = SmoothWeightedRoundRobin(3)
    assert set(picks(rr, [0, 2, -1], 50)) == {1}
    assert rr.pick([0, 0, 0], range(3)) is None


def test_ineligible_servers_are_skipped() -> None:
    rr = SmoothWeightedRoundRobin(3)
    weights = [5, 1, 1]
    assert [rr.pick(weights, [1, 2]) for _ in range(4)] == [1, 2, 1, 2]
    assert rr.pick(weights, []) is None
    assert rr.pick(weights, iter([2])) == 2


def test_resizes_when_the_number_of_weights_changes() -> None:
    rr = SmoothWeightedRoundRobin(2)
    assert picks(rr, [1, 1], 1) == [0]
    assert picks(rr, [5, 1, 1], 7) == [0, 0, 1, 0, 2, 0, 0]
    assert rr.size == 3


# -- least streams -----------------------------------------------------------------------------


def test_least_streams_relative_to_weight() -> None:
    rr = SmoothWeightedRoundRobin(2)
    weights = [2, 1]
    assert least_streams(weights, [3, 1], range(2), rr) == 1  # 1.5 per weight vs 1
    assert least_streams(weights, [1, 1], range(2), rr) == 0  # 0.5 vs 1
    assert least_streams(weights, [5, 0], range(2), rr) == 1


def test_least_streams_ties_are_broken_by_smooth_round_robin() -> None:
    rr = SmoothWeightedRoundRobin(2)
    weights = [2, 1]
    # (2, 1) active is 1 per unit of weight on both: the weighted round-robin decides.
    got = [least_streams(weights, [2, 1], range(2), rr) for _ in range(6)]
    assert got == [0, 1, 0, 0, 1, 0]  # nginx order for weights 2, 1: a b a, repeated


def test_least_streams_idle_fleet_is_round_robin() -> None:
    rr = SmoothWeightedRoundRobin(3)
    got = [least_streams([1, 1, 1], [0, 0, 0], range(3), rr) for _ in range(3)]
    assert got == [0, 1, 2]


def test_least_streams_skips_ineligible_and_draining() -> None:
    rr = SmoothWeightedRoundRobin(3)
    assert least_streams([1, 0, 1], [5, 0, 9], [0, 1, 2], rr) == 0
    assert least_streams([1, 0, 1], [5, 0, 9], [2], rr) == 2
    assert least_streams([1, 0, 1], [0, 0, 0], [1], rr) is None
    assert least_streams([1, 1, 1], [0, 0, 0], [], rr) is None


# -- rendezvous hashing ------------------------------------------------------------------------

IDS = [server_id("gpus", f"10.0.0.{i}:8000") for i in range(1, 6)]
RENDEZVOUS_SCRIPT = """
import json, sys
from muxproxy.config.serverid import server_id
from muxproxy.routing.balancer import rendezvous_order
ids = [server_id("gpus", f"10.0.0.{i}:8000") for i in range(1, 6)]
print(json.dumps([rendezvous_order(b"key-%d" % k, ids, [1, 2, 3, 1, 1], range(5))
                  for k in range(200)]))
"""


def owner(key: bytes, ids: list[bytes], weights: list[int], eligible: list[int]) -> int:
    return rendezvous_order(key, ids, weights, eligible)[0]


def test_rendezvous_is_deterministic() -> None:
    weights = [1, 2, 3, 1, 1]
    for k in range(200):
        key = b"key-%d" % k
        first = rendezvous_order(key, IDS, weights, range(5))
        assert sorted(first) == [0, 1, 2, 3, 4]
        assert rendezvous_order(key, list(IDS), list(weights), [4, 3, 2, 1, 0]) == first


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_rendezvous_agrees_across_processes(hash_seed: str) -> None:
    here = [rendezvous_order(b"key-%d" % k, IDS, [1, 2, 3, 1, 1], range(5)) for k in range(200)]
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "-c", RENDEZVOUS_SCRIPT],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(done.stdout) == here


def test_rendezvous_leaves_out_ineligible_and_draining() -> None:
    order = rendezvous_order(b"k", IDS, [1, 0, 1, -2, 1], [0, 1, 2, 3])
    assert sorted(order) == [0, 2]
    assert rendezvous_order(b"k", IDS, [0, 0, 0, 0, 0], range(5)) == []


def test_rendezvous_adding_a_server_moves_only_keys_to_it() -> None:
    weights = [1, 1, 2, 1, 1]
    keys = [b"session-%d" % k for k in range(20_000)]
    before = [owner(key, IDS, weights, [0, 1, 2, 3]) for key in keys]
    after = [owner(key, IDS, weights, [0, 1, 2, 3, 4]) for key in keys]
    moved = [new for old, new in zip(before, after, strict=True) if old != new]
    assert moved, "the new server should get some keys"
    assert set(moved) == {4}
    # Its share is about its weight's share: 1/6.
    assert abs(len(moved) / len(keys) - 1 / 6) < 0.02


def test_rendezvous_removing_a_server_moves_only_its_keys() -> None:
    weights = [1, 1, 2, 1, 1]
    keys = [b"session-%d" % k for k in range(20_000)]
    before = [owner(key, IDS, weights, range(5)) for key in keys]
    after = [owner(key, IDS, weights, [0, 1, 3, 4]) for key in keys]  # server 2 is gone
    for old, new in zip(before, after, strict=True):
        assert old == new or old == 2
    assert 2 in before


def test_rendezvous_draining_by_weight_zero_moves_only_its_keys() -> None:
    keys = [b"s%d" % k for k in range(5_000)]
    before = [owner(key, IDS, [1, 1, 1, 1, 1], range(5)) for key in keys]
    after = [owner(key, IDS, [1, 1, 1, 0, 1], range(5)) for key in keys]
    assert all(old == new or old == 3 for old, new in zip(before, after, strict=True))


def test_rendezvous_shares_follow_weights() -> None:
    weights = [1, 2, 3, 4]
    ids = IDS[:4]
    count = 100_000
    owners = Counter(owner(b"%d" % k, ids, weights, [0, 1, 2, 3]) for k in range(count))
    for index, weight in enumerate(weights):
        share = owners[index] / count
        assert abs(share - weight / 10) < 0.02, (index, share)


def test_rendezvous_fallback_order_follows_the_remaining_servers() -> None:
    """Without the first choice, a key goes to its second choice: the order is a ranking."""
    for k in range(500):
        key = b"k%d" % k
        order = rendezvous_order(key, IDS, [1, 1, 1, 1, 1], range(5))
        rest = [i for i in range(5) if i != order[0]]
        assert rendezvous_order(key, IDS, [1, 1, 1, 1, 1], rest) == order[1:]


# -- server ids --------------------------------------------------------------------------------


def test_server_id_is_stable_opaque_hex() -> None:
    sid = server_id("gpus", "10.0.0.1:8000")
    assert sid == server_id("gpus", "10.0.0.1:8000")
    assert len(sid) == 16
    assert all(c in b"0123456789abcdef" for c in sid)
    assert b"10.0.0.1" not in sid and b"8000" not in sid


def test_server_id_depends_on_group_address_and_secret() -> None:
    base = server_id("gpus", "10.0.0.1:8000")
    assert server_id("cpus", "10.0.0.1:8000") != base
    assert server_id("gpus", "10.0.0.2:8000") != base
    assert server_id("gpus", "10.0.0.1:8000", "s3cret") != base
    assert server_id("gpus", "10.0.0.1:8000", "other") != server_id(
        "gpus", "10.0.0.1:8000", "s3cret"
    )
    # The separator keeps ("ab", "c") and ("a", "bc") apart.
    assert server_id("ab", "c:1") != server_id("a", "bc:1")


def test_server_id_accepts_long_secrets() -> None:
    long_a = "a" * 200
    long_b = "a" * 199 + "b"
    sid = server_id("gpus", "10.0.0.1:8000", long_a)
    assert len(sid) == 16
    assert sid != server_id("gpus", "10.0.0.1:8000", long_b)
    assert sid == server_id("gpus", "10.0.0.1:8000", long_a)

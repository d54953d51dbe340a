"""Tests of the LLM routing benchmark's traces and statistics (``bench/llm_trace.py``): what
makes its comparisons fair (one fixed trace per seed, the same at every load) and its
intervals honest. Pure: no processes, no sockets, no clock.
"""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from llm_trace import (
    Arrival,
    Workload,
    fastest_reply,
    goodput,
    hit_ceiling,
    multi_turn_chat,
    percentile,
    ratio_interval,
    single_questions,
    ttft_quantile,
)

from muxproxy.testing.fakellm import reply_text
from muxproxy.testing.fakellm.engine import block_hashes, prompt_text


def chat(seed: int, count: int = 300) -> list[Arrival]:
    workload = multi_turn_chat(
        seed,
        count,
        users=12,
        prompts=3,
        prompt_bytes=400,
        zipf=0.8,
        turns=(2, 4),
        user_bytes=(20, 60),
        tokens=(4, 12),
    )
    return list(workload.arrivals)


def test_a_seed_draws_the_same_trace_and_another_seed_another() -> None:
    assert chat(0) == chat(0)
    assert [a.at for a in chat(0)] != [a.at for a in chat(1)]
    single = single_questions(3, 50, 2000, (20, 60), (4, 12))
    assert single == single_questions(3, 50, 2000, (20, 60), (4, 12))
    assert {a.messages[0] for a in single.arrivals} == {single.arrivals[0].messages[0]}


def test_arrivals_are_poisson_at_unit_rate() -> None:
    times = [a.at for a in chat(5, 4000)]
    assert times == sorted(times)
    assert times[-1] / len(times) == pytest.approx(1.0, rel=0.05)


def test_a_turn_carries_the_reply_the_fake_engine_gives_to_the_turn_before() -> None:
    arrivals = chat(2)
    by_user: dict[int, list[Arrival]] = {}
    for arrival in arrivals:
        by_user.setdefault(arrival.user, []).append(arrival)
    followed = 0
    for turns in by_user.values():
        for before, after in itertools.pairwise(turns):
            if after.conversation != before.conversation:
                assert after.turn == 1 and len(after.messages) == 2
                continue
            followed += 1
            reply = ("assistant", reply_text(before.max_tokens))
            assert after.messages[: len(before.messages) + 1] == (*before.messages, reply)
            assert after.turn == before.turn + 1
    assert followed > 100


def test_each_run_salts_every_block_of_its_prompts() -> None:
    workload = single_questions(0, 3, 2000, (20, 60), (4, 12))
    arrival = workload.arrivals[0]
    one = prompt_text({"messages": workload.body_messages(arrival, "[run 1] ")})
    two = prompt_text({"messages": workload.body_messages(arrival, "[run 2] ")})
    assert not set(block_hashes(one, 16)) & set(block_hashes(two, 16))


def test_percentiles_and_goodput() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 0.5), percentile(values, 0.99)) == (50.0, 99.0)
    seeds = [[0.2, 0.5, 3.0], [0.9, 1.5]]
    assert goodput(1.0, 10.0)(seeds) == 3 / 20
    assert ttft_quantile(0.5)(seeds) == 0.9


def test_the_bootstrap_interval_holds_the_ratio_and_tells_equal_from_different() -> None:
    rng = random.Random(1)
    fast = [[rng.uniform(0.1, 0.3) for _ in range(200)] for _ in range(2)]
    slow = [[rng.uniform(0.4, 0.6) for _ in range(200)] for _ in range(2)]
    point, low, high = ratio_interval(ttft_quantile(0.5), fast, slow, 300, random.Random(2))
    assert low <= point <= high < 1
    same, low, high = ratio_interval(ttft_quantile(0.5), fast, fast, 300, random.Random(3))
    assert same == 1.0 and low < 1 < high


def long_chat() -> Workload:
    """Conversations of two to six turns, twelve users on three system prompts."""
    return multi_turn_chat(
        1,
        600,
        users=12,
        prompts=3,
        prompt_bytes=400,
        zipf=0.8,
        turns=(2, 6),
        user_bytes=(20, 60),
        tokens=(16, 32),
    )


def test_the_hit_ceiling_is_what_one_unbounded_cache_finds_in_the_window() -> None:
    # Single questions behind one system prompt: every prompt after the first hits the
    # system prompt's full blocks, and nothing of its own question.
    single = single_questions(0, 200, 2048, (40, 80), (8, 16))
    ceiling = hit_ceiling(single, 1.0, 50.0, 100.0, 16)
    counted = [a for a in single.arrivals if 50.0 <= a.at < 150.0]
    system_tokens = 2048 // 64 * 16  # "system: " + 2,048 bytes: 32 full blocks of 64 bytes
    prompts = [len(prompt_text({"messages": single.body_messages(a, "")})) // 4 for a in counted]
    assert ceiling == pytest.approx(system_tokens * len(counted) / sum(prompts), rel=0.02)
    # A conversation's later turns hit their whole history: the chat's ceiling is higher
    # than the system prompts' share alone, and it grows with the warm-up (more history).
    workload = long_chat()
    cold = hit_ceiling(workload, 1.0, 0.0, 100.0, 16)
    warm = hit_ceiling(workload, 1.0, 100.0, 100.0, 16)
    assert 0.5 < cold < warm < 1.0


def test_a_reply_counts_in_the_ceiling_only_once_an_engine_could_have_ended_it() -> None:
    workload = long_chat()
    every_reply_first = hit_ceiling(workload, 1.0, 100.0, 100.0, 16)
    # A reply ready at once is what caching each before the next request assumed.
    assert hit_ceiling(workload, 1.0, 100.0, 100.0, 16, lambda _: 0.0) == every_reply_first
    # Turns come every few seconds per user: replies taking longer are not there for some
    # next turns, and replies that never end leave only what the prompts themselves cached.
    slow = hit_ceiling(workload, 1.0, 100.0, 100.0, 16, lambda _: 20.0)
    never = hit_ceiling(workload, 1.0, 100.0, 100.0, 16, lambda _: 1e9)
    assert never < slow < every_reply_first
    # The engine's fastest answer: the first token after ttft_base, then one per step.
    fastest = fastest_reply(0.005, 0.02)
    assert fastest(workload.arrivals[0]) == pytest.approx(
        0.005 + (workload.arrivals[0].max_tokens - 1) * 0.02
    )
    assert never < hit_ceiling(workload, 1.0, 100.0, 100.0, 16, fastest) <= every_reply_first

"""The workloads of ``llm_routing.py`` as fixed arrival traces, and the statistics it reports.

What it obeys, and why:

* **One trace per seed, the same for every policy.** A trace is drawn once from its seed at
  unit rate (exponential gaps of mean 1 s) and scaled to the rate asked for, so that every
  policy, and every load of one seed, sees the same requests in the same order: only their
  spacing changes with the load. Nothing in a request depends on how an earlier one was
  served: a conversation's history carries the reply the fake engine gives (its answer
  depends on the token count alone, ``muxproxy/testing/fakellm/answer.py``), so the bodies
  are fixed in advance, and a turn is sent at its arrival time even if the turn before it
  has not ended (rare: a user's turns are tens of seconds apart; counted as ``overlapping``).
* **Two workloads.** ``single``: every request is one question behind the same long system
  prompt (a shared prefix longer than any prefix key's default, which is all a placement can
  use). ``chat``: ``users`` users, each with a system prompt of ``prompts`` (Zipf
  popularity), in conversations of ``turns`` turns that send the whole history every turn;
  what the users' conversations hold together is several times one engine's cache.
* **Statistics.** Percentiles of TTFT; goodput (requests whose first token came within the
  SLO, per second of the window); and for each ratio against round robin a bootstrap interval:
  the requests of each seed resampled with replacement (stratified by seed, policy and round
  robin resampled independently), the ratio recomputed, its 2.5th and 97.5th percentiles.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from chat_client import system_prompts, words

from muxproxy.testing.fakellm.answer import reply_text
from muxproxy.testing.fakellm.engine import (
    Admission,
    EnginePrompt,
    PrefixCache,
    Prompt,
    output_blocks,
)


@dataclass(frozen=True)
class Arrival:
    """One request of a trace, at unit rate."""

    at: float
    """Seconds after the start at 1 request/s (divide by the rate)."""
    user: int
    conversation: int
    turn: int
    max_tokens: int
    messages: tuple[tuple[str, str], ...]
    """(role, content) in order; the first is the system prompt."""


@dataclass(frozen=True)
class Workload:
    name: str
    arrivals: tuple[Arrival, ...]
    """Sorted by ``at``."""

    def body_messages(self, arrival: Arrival, salt: str) -> list[dict[str, str]]:
        """The request's messages, its system prompt led by ``salt`` (each run's own, so no
        block cached by an earlier run can hit)."""
        (role, system), *rest = arrival.messages
        return [
            {"role": role, "content": salt + system},
            *({"role": r, "content": c} for r, c in rest),
        ]


def gaps(rng: random.Random, count: int) -> list[float]:
    """``count`` arrival times at unit rate (a Poisson process)."""
    at, out = 0.0, []
    for _ in range(count):
        at += rng.expovariate(1.0)
        out.append(at)
    return out


def single_questions(
    seed: int, count: int, system_bytes: int, user_bytes: tuple[int, int], tokens: tuple[int, int]
) -> Workload:
    """``count`` one-question requests behind one system prompt of ``system_bytes``."""
    rng = random.Random(seed * 1_000_003 + 11)
    (system,) = system_prompts(1, system_bytes, seed)
    arrivals = tuple(
        Arrival(
            at=at,
            user=k,
            conversation=k,
            turn=1,
            max_tokens=rng.randint(*tokens),
            messages=(("system", system), ("user", words(rng, rng.randint(*user_bytes)))),
        )
        for k, at in enumerate(gaps(rng, count))
    )
    return Workload("single", arrivals)


def multi_turn_chat(
    seed: int,
    count: int,
    *,
    users: int,
    prompts: int,
    prompt_bytes: int,
    zipf: float,
    turns: tuple[int, int],
    user_bytes: tuple[int, int],
    tokens: tuple[int, int],
) -> Workload:
    """``count`` turns of ``users`` users' conversations (see the header)."""
    rng = random.Random(seed * 1_000_003 + 17)
    systems = system_prompts(prompts, prompt_bytes, seed)
    popularity = [(k + 1) ** -zipf for k in range(prompts)]
    picks = rng.choices(range(prompts), weights=popularity, k=users)
    history: list[list[tuple[str, str]]] = [[] for _ in range(users)]
    left = [0] * users
    conversation = [0] * users
    conversations = 0
    arrivals = []
    for at in gaps(rng, count):
        u = rng.randrange(users)
        if left[u] <= 0:
            left[u] = rng.randint(*turns)
            history[u] = [("system", systems[picks[u]])]
            conversation[u] = conversations
            conversations += 1
        max_tokens = rng.randint(*tokens)
        sent = [*history[u], ("user", words(rng, rng.randint(*user_bytes)))]
        arrivals.append(
            Arrival(
                at=at,
                user=u,
                conversation=conversation[u],
                turn=(len(sent) + 1) // 2,
                max_tokens=max_tokens,
                messages=tuple(sent),
            )
        )
        history[u] = [*sent, ("assistant", reply_text(max_tokens))]
        left[u] -= 1
    return Workload("chat", tuple(arrivals))


def hit_ceiling(
    workload: Workload,
    rate: float,
    warmup: float,
    window: float,
    block_tokens: int,
    reply_time: Callable[[Arrival], float] | None = None,
) -> float:
    """The workload's hit rate with one unbounded cache that every request goes through in
    order: the share of the window's prompt tokens that any placement could find cached (the
    fake engine's rules, ``engine.py``).

    A reply is cached once it could have been generated: ``reply_time(arrival)`` after its
    request (the engine's fastest answer, :func:`fastest_reply`); a turn sent before its
    previous reply could exist finds only what was cached before it. None: every reply is
    cached before the next request (no engine can do that: an upper bound above this one).
    """
    cache = PrefixCache(capacity=1 << 40, block_tokens=block_tokens)
    queried = hits = 0
    replies: list[tuple[float, int, Admission, list[bytes]]] = []
    for count, arrival in enumerate(workload.arrivals):
        at = arrival.at / rate
        if at >= warmup + window:
            break
        while replies and replies[0][0] <= at:
            _, _, held, blocks = heapq.heappop(replies)
            cache.release(held, blocks)
        request = {"messages": workload.body_messages(arrival, "")}
        prompt = EnginePrompt.of(request)
        admission = cache.admit(Prompt.from_text(prompt.text, block_tokens))
        reply = output_blocks(prompt, reply_text(arrival.max_tokens), block_tokens)
        if reply_time is None:
            cache.release(admission, reply)
        else:
            heapq.heappush(replies, (at + reply_time(arrival), count, admission, list(reply)))
        if at >= warmup:
            queried += admission.prompt_tokens
            hits += admission.hit_tokens
    return hits / queried if queried else math.nan


def fastest_reply(ttft_base: float, step: float) -> Callable[[Arrival], float]:
    """The soonest an engine of the step model can end a reply after its request: the first
    token after ``ttft_base`` with every prompt token cached and no queue, then one token a
    step (``step``, the fake's ``delay``)."""
    return lambda arrival: ttft_base + max(arrival.max_tokens - 1, 0) * step


# --- statistics ---------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` (0..1) percentile, nearest rank; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


Stat = Callable[[Sequence[Sequence[float]]], float]
"""A statistic of the TTFTs of a run, given seed by seed."""


def ttft_quantile(q: float) -> Stat:
    return lambda seeds: percentile([t for seed in seeds for t in seed], q)


def goodput(slo: float, window_s: float) -> Stat:
    """Requests with a TTFT within ``slo`` per second of window, all seeds together."""
    return lambda seeds: sum(t <= slo for seed in seeds for t in seed) / (window_s * len(seeds))


def ratio_interval(
    stat: Stat,
    policy: Sequence[Sequence[float]],
    base: Sequence[Sequence[float]],
    rounds: int,
    rng: random.Random,
) -> tuple[float, float, float]:
    """(stat(policy) / stat(base), and the 2.5th and 97.5th percentiles of that ratio over
    ``rounds`` bootstrap resamples, each seed's requests resampled on its own)."""

    def resample(seeds: Sequence[Sequence[float]]) -> list[list[float]]:
        return [rng.choices(seed, k=len(seed)) if seed else [] for seed in seeds]

    def ratio(a: float, b: float) -> float:
        return a / b if b else math.nan

    point = ratio(stat(policy), stat(base))
    ratios = sorted(ratio(stat(resample(policy)), stat(resample(base))) for _ in range(rounds))
    ratios = [r for r in ratios if not math.isnan(r)]
    return point, percentile(ratios, 0.025), percentile(ratios, 0.975)

"""Tests of the fake LLM backend's engine model: the pure prefix cache (engine.py), the FIFO
slots (scheduler.py), and the engine served over real sockets on 127.0.0.1 (app.py, metrics.py).

Every IO test runs under fail_after; waits are on the fake's own counters (``wait_until``).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import httpx
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from test_fakellm import ready_line

from muxproxy.process.cli import main as muxproxy_main
from muxproxy.testing.fakellm import FakeLLM, add_arguments, reply_text
from muxproxy.testing.fakellm.engine import (
    TOKEN_BYTES,
    Admission,
    EngineConfig,
    PrefixCache,
    Prompt,
    block_hashes,
    prompt_text,
    token_count,
)
from muxproxy.testing.fakellm.scheduler import Engine, FifoSlots

if TYPE_CHECKING:
    from conftest import StartBackend

CHAT = "/v1/chat/completions"

# ---- tokens and blocks -----------------------------------------------------------------


def test_a_token_is_four_bytes_of_utf8_rounded_up() -> None:
    assert TOKEN_BYTES == 4
    assert [token_count(t) for t in ("", "a", "abcd", "abcde", "é", "éé", "ééé")] == [
        0,
        1,
        1,
        2,
        1,
        1,
        2,
    ]


def test_prompt_text_is_roles_and_contents_in_order() -> None:
    request = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"}]},
            "not a message",
            {"content": 7},
        ],
        "prompt": "ignored: messages win",
    }
    assert prompt_text(request) == "system: be brief\nuser: hi\n: \n"
    assert prompt_text({"prompt": "once upon"}) == "once upon"
    assert prompt_text({"prompt": 3}) == prompt_text({}) == ""


def test_blocks_are_full_blocks_only() -> None:
    block = 2 * TOKEN_BYTES  # two tokens a block
    assert len(block_hashes("x" * (3 * block - 1), 2)) == 2
    assert len(block_hashes("x" * (3 * block), 2)) == 3
    assert block_hashes("x" * (block - 1), 2) == []


def test_a_block_hash_names_its_whole_prefix() -> None:
    a, b, c = "A" * 8, "B" * 8, "C" * 8
    ab, cb, abc = block_hashes(a + b, 2), block_hashes(c + b, 2), block_hashes(a + b + c, 2)
    assert abc[:2] == ab  # a shared prefix shares its blocks
    assert block_hashes(a + b, 2) == ab  # deterministic
    assert ab[1] != cb[1]  # the same text after a different prefix is another block
    assert len(set(block_hashes(a + a + a, 2))) == 3  # repeats within a prompt are distinct


# ---- the prefix cache ------------------------------------------------------------------


def prompt(text: str, block_tokens: int = 1) -> Prompt:
    return Prompt.from_text(text, block_tokens)


def tokens(*names: str) -> str:
    """One 4-byte token per name (``"ab"`` -> ``"abab"``), for one-token blocks."""
    return "".join((name * 4)[:4] for name in names)


def test_shared_prefix_hits_and_counts_tokens() -> None:
    cache = PrefixCache(capacity=100, block_tokens=4)
    system = "You are a careful assistant. " * 4  # 116 bytes: 29 tokens, 7 full blocks
    first = cache.admit(prompt(system + "Question one?", 4))
    cache.release(first)
    second = cache.admit(prompt(system + "Another question?", 4))
    assert first.hit_tokens == 0
    assert second.hit_tokens == 28  # the 7 blocks wholly inside the shared system prompt
    assert second.uncached_tokens == second.prompt_tokens - 28
    assert cache.queried_tokens == first.prompt_tokens + second.prompt_tokens
    assert cache.hit_tokens == 28


def test_same_block_text_after_a_different_prefix_does_not_hit() -> None:
    cache = PrefixCache(capacity=100, block_tokens=1)
    cache.release(cache.admit(prompt(tokens("a", "b", "c", "d"))))
    other = cache.admit(prompt(tokens("x", "b", "c", "d")))
    assert other.hit_tokens == 0
    assert cache.cached_blocks == 8  # "b", "c", "d" after "x" are blocks of their own


def test_hits_stop_at_the_first_miss() -> None:
    cache = PrefixCache(capacity=100, block_tokens=1)
    cache.release(cache.admit(prompt(tokens("a", "b", "c", "d", "e"))))
    assert cache.admit(prompt(tokens("a", "b", "z", "d", "e"))).hit_tokens == 2


def test_the_last_prompt_token_is_never_a_hit() -> None:
    cache = PrefixCache(capacity=100, block_tokens=2)
    text = tokens("a", "b", "c", "d")  # exactly two blocks
    cache.release(cache.admit(prompt(text, 2)))
    again = cache.admit(prompt(text, 2))
    assert (again.prompt_tokens, again.hit_tokens) == (4, 2)  # the last block is computed
    assert cache.admit(prompt(text + "e", 2)).hit_tokens == 4


def test_lru_evicts_the_least_recently_released_blocks() -> None:
    cache = PrefixCache(capacity=4, block_tokens=1)
    a, b = prompt(tokens("a", "a2")), prompt(tokens("b", "b2"))
    cache.release(cache.admit(a))
    cache.release(cache.admit(b))
    cache.release(cache.admit(a))  # a is used again: b is now the least recent
    cache.release(cache.admit(prompt(tokens("c", "c2"))))
    assert all(cache.is_cached(block) for block in a.blocks)
    assert not any(cache.is_cached(block) for block in b.blocks)
    assert cache.cached_blocks == 4


def test_a_released_prompt_is_evicted_tail_first() -> None:
    cache = PrefixCache(capacity=3, block_tokens=1)
    a = prompt(tokens("a", "b", "c"))
    cache.release(cache.admit(a))
    cache.release(cache.admit(prompt(tokens("z"))))
    assert [cache.is_cached(block) for block in a.blocks] == [True, True, False]


def test_pinned_blocks_are_never_evicted_and_are_the_usage() -> None:
    cache = PrefixCache(capacity=4, block_tokens=1)
    running = cache.admit(prompt(tokens("a", "b", "c")))
    assert (cache.pinned_blocks, cache.usage) == (3, 0.75)
    late = prompt(tokens("x", "y"))
    squeezed = cache.admit(late)  # room for one block only: "y" is computed, not kept
    assert squeezed.pinned == late.blocks[:1]
    assert all(cache.is_cached(block) for block in running.pinned)
    assert len(running.pinned) == 3
    assert cache.usage == 1.0
    cache.release(squeezed)
    cache.release(running)
    # Cached but unpinned blocks count as free, as in vLLM's block pool.
    assert (cache.cached_blocks, cache.pinned_blocks, cache.usage) == (4, 0, 0.0)


def test_a_block_shared_by_two_running_prompts_stays_pinned_until_both_end() -> None:
    cache = PrefixCache(capacity=2, block_tokens=1)
    one = cache.admit(prompt(tokens("a", "b")))
    two = cache.admit(prompt(tokens("a", "b", "c")))
    assert two.hit_tokens == 2 and cache.pinned_blocks == 2
    cache.release(one)
    assert cache.pinned_blocks == 2
    cache.release(two)
    assert cache.pinned_blocks == 0


def test_no_capacity_caches_nothing_but_still_counts() -> None:
    cache = PrefixCache(capacity=0, block_tokens=1)
    for _ in range(2):
        admission = cache.admit(prompt(tokens("a", "b", "c")))
        cache.release(admission)
    assert (admission.hit_tokens, cache.cached_blocks, cache.usage) == (0, 0, 0.0)
    assert (cache.queried_tokens, cache.hit_tokens) == (6, 0)


@given(
    capacity=st.integers(0, 6),
    steps=st.lists(
        st.one_of(st.lists(st.sampled_from("abc"), max_size=6), st.integers(0, 5)), max_size=30
    ),
)
def test_cache_invariants_under_any_admissions_and_releases(
    capacity: int, steps: list[list[str] | int]
) -> None:
    cache = PrefixCache(capacity=capacity, block_tokens=1)
    running: list[Admission] = []
    for step in steps:
        if isinstance(step, int):
            if running:
                cache.release(running.pop(step % len(running)))
        else:
            p = prompt(tokens(*step))
            admission = cache.admit(p)
            running.append(admission)
            assert 0 <= admission.hit_tokens <= max(p.tokens - 1, 0)
            assert set(admission.pinned) <= set(p.blocks)
        assert cache.pinned_blocks <= cache.cached_blocks <= capacity
        assert 0.0 <= cache.usage <= 1.0
    for admission in running:
        cache.release(admission)
    assert cache.pinned_blocks == 0


# ---- the engine's options --------------------------------------------------------------


def test_engine_is_on_when_any_option_but_block_tokens_is_given() -> None:
    assert not EngineConfig().enabled
    assert not EngineConfig(block_tokens=32).enabled
    given: list[dict[str, Any]] = [
        {"max_running": 1},
        {"kv_blocks": 0},
        {"ttft_base": 0.0},
        {"prefill_per_token": 0.0},
    ]
    for options in given:
        assert EngineConfig(**options).enabled, options


def test_prefill_is_the_base_plus_the_uncached_tokens() -> None:
    config = EngineConfig(ttft_base=0.5, prefill_per_token=0.002)
    assert config.prefill_seconds(500) == pytest.approx(1.5)
    assert config.prefill_seconds(0) == 0.5
    assert EngineConfig(max_running=1).prefill_seconds(500) == 0.0


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("max_running", 0),
        ("kv_blocks", -1),
        ("block_tokens", 0),
        ("ttft_base", -0.1),
        ("prefill_per_token", float("inf")),
    ],
)
def test_bad_engine_options_are_refused_by_name(option: str, value: float) -> None:
    options: dict[str, Any] = {option: value}
    with pytest.raises(ValueError, match=option):
        EngineConfig(**options)


# ---- the FIFO slots --------------------------------------------------------------------


def no_op() -> None:
    pass


async def test_slots_let_waiters_in_first_come_first_served() -> None:
    slots = FifoSlots(limit=1)
    order: list[int] = []
    await slots.acquire(no_op)

    async def waiter(i: int) -> None:
        await slots.acquire(no_op)
        order.append(i)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(waiter, i)
                await trio.testing.wait_all_tasks_blocked()  # i is in line before i + 1
            assert (slots.running, slots.waiting, order) == (1, 3, [])
            for expected in ([0], [0, 1], [0, 1, 2]):
                slots.release(no_op)
                await trio.testing.wait_all_tasks_blocked()
                assert order == expected
                assert (slots.running, slots.waiting) == (1, 3 - len(expected))
    slots.release(no_op)
    assert slots.running == 0


async def test_a_cancelled_waiter_leaves_the_line_at_once_and_takes_no_slot() -> None:
    slots = FifoSlots(limit=1)
    changes: list[tuple[int, int]] = []

    def record() -> None:
        changes.append((slots.running, slots.waiting))

    await slots.acquire(record)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(slots.acquire, record)
            await trio.testing.wait_all_tasks_blocked()
            assert slots.waiting == 1
            nursery.cancel_scope.cancel()
    assert (slots.running, slots.waiting) == (1, 0)
    slots.release(record)
    assert (slots.running, slots.waiting) == (0, 0)
    assert changes == [(1, 0), (1, 1), (1, 0), (0, 0)]


async def test_no_limit_never_waits() -> None:
    slots = FifoSlots(limit=None)
    with trio.fail_after(5):
        for _ in range(100):
            await slots.acquire(no_op)
    assert (slots.running, slots.waiting) == (100, 0)


# ---- the engine: slots, cache and metrics together -------------------------------------


def metric_samples(text: str) -> dict[str, tuple[str, dict[str, str], float]]:
    """Sample name -> (family type, labels, value) of a text exposition."""
    return {
        sample.name: (family.type, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_engine_prefills_only_what_is_not_cached_and_frees_on_exit() -> None:
    changes: list[int] = []
    config = EngineConfig(kv_blocks=64, block_tokens=4, prefill_per_token=0.01)
    engine = Engine(config, "m", lambda: changes.append(engine.running))
    text = "x" * 400  # 100 tokens, 25 blocks
    assert engine.cache is not None
    with trio.fail_after(5):
        async with engine.generation(text) as cold:
            assert (engine.running, engine.cache.pinned_blocks) == (1, 25)
        async with engine.generation(text) as warm:
            pass
    assert cold == pytest.approx(1.0)
    assert warm == pytest.approx(0.04)  # 24 blocks hit; the last block is computed again
    assert (engine.running, engine.cache.pinned_blocks, engine.cache.cached_blocks) == (0, 0, 25)
    assert 1 in changes and changes[-1] == 0


async def test_engine_without_kv_blocks_prefills_every_token_and_counts_no_lookups() -> None:
    engine = Engine(EngineConfig(prefill_per_token=0.5), "m", no_op)
    with trio.fail_after(5):
        async with engine.generation("abcdefgh") as prefill:
            pass
    assert prefill == 1.0
    assert engine.cache is None
    samples = metric_samples(engine.render_metrics().decode())
    assert samples["vllm:prefix_cache_queries_total"][2] == 0


async def test_engine_metrics_have_vllm_names_types_and_model_label() -> None:
    config = EngineConfig(max_running=1, kv_blocks=10, block_tokens=1)
    engine = Engine(config, "fake-llm", no_op)
    expected_help = {
        "vllm:num_requests_running": "Number of requests in model execution batches.",
        "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    }
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await engine.slots.acquire(no_op)  # someone else runs: the next one waits

            async def generate() -> None:
                async with engine.generation("aaaabbbbcccc"):
                    await trio.sleep_forever()

            nursery.start_soon(generate)
            await trio.testing.wait_all_tasks_blocked()
            text = engine.render_metrics().decode()
            engine.slots.release(no_op)
            await trio.testing.wait_all_tasks_blocked()
            later = engine.render_metrics().decode()
            nursery.cancel_scope.cancel()
    families: dict[str, Any] = {f.name: f for f in text_string_to_metric_families(text)}
    for name, help_text in expected_help.items():
        assert families[name].documentation == help_text
    samples = metric_samples(text)
    label = {"model_name": "fake-llm"}
    assert samples["vllm:num_requests_running"] == ("gauge", label, 1.0)
    assert samples["vllm:num_requests_waiting"] == ("gauge", label, 1.0)
    assert samples["vllm:kv_cache_usage_perc"] == ("gauge", label, 0.0)
    assert samples["vllm:prefix_cache_queries_total"] == ("counter", label, 0.0)
    after = metric_samples(later)
    assert after["vllm:num_requests_waiting"][2] == 0.0
    assert after["vllm:kv_cache_usage_perc"][2] == pytest.approx(0.3)  # 3 of 10 blocks pinned
    assert after["vllm:prefix_cache_queries_total"][2] == 3.0
    assert after["vllm:prefix_cache_hits_total"][2] == 0.0


# ---- served: the engine behind real sockets --------------------------------------------


def chat(system: str = "You are terse.", user: str = "hi", stream: bool = True) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return json.dumps({"model": "m", "messages": messages, "stream": stream}).encode()


@attrs.define
class Stream:
    """What one streamed completion saw, filled in as it goes."""

    head: trio.Event = attrs.field(factory=trio.Event)
    first_token: trio.Event = attrs.field(factory=trio.Event)
    done: trio.Event = attrs.field(factory=trio.Event)
    sent_at: float = 0.0
    first_token_at: float = 0.0
    at_first_token: dict[str, int] = attrs.field(factory=dict)
    """The fake's counters when the first token arrived."""
    raw: bytes = b""


async def run_stream(
    client: httpx.AsyncClient,
    fake: FakeLLM,
    seen: Stream,
    headers: Sequence[tuple[str, str]] = (),
    body: bytes | None = None,
) -> None:
    seen.sent_at = trio.current_time()
    content = chat() if body is None else body
    async with client.stream("POST", CHAT, content=content, headers=list(headers)) as response:
        assert response.status_code == 200
        seen.head.set()
        async for data in response.aiter_bytes():
            if b'"content":"tok' in seen.raw + data and not seen.first_token.is_set():
                seen.first_token_at = trio.current_time()
                seen.at_first_token = {
                    "running": fake.running,
                    "waiting": fake.waiting,
                    "streams_completed": fake.streams_completed,
                }
                seen.first_token.set()
            seen.raw += data
    seen.done.set()


def token_text(raw: bytes) -> str:
    text = ""
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: {"):
            choices = json.loads(block[len("data: ") :])["choices"]
            text += "".join(c["delta"].get("content", "") for c in choices)
    return text


async def scrape(client: httpx.AsyncClient) -> dict[str, tuple[str, dict[str, str], float]]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return metric_samples(response.text)


SLOW = [("x-fake-delay", "30")]
"""Per-request knobs of a generation that holds its slot until its client leaves."""


async def test_a_third_stream_waits_for_one_of_two_slots_and_starts_when_one_ends(
    start_backend: StartBackend,
) -> None:
    fake, port = await start_backend(max_running=2, tokens=2, delay=0.01)
    first, second, third = Stream(), Stream(), Stream()
    with trio.fail_after(10):
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
            trio.open_nursery() as nursery,
        ):
            # A second between its two tokens: time to look at the line while it runs.
            nursery.start_soon(run_stream, client, fake, first, [("x-fake-delay", "1")])
            await fake.wait_until(lambda: fake.running == 1)
            nursery.start_soon(run_stream, client, fake, second, SLOW)
            await fake.wait_until(lambda: fake.running == 2)
            nursery.start_soon(run_stream, client, fake, third)
            await fake.wait_until(lambda: fake.waiting == 1)
            waiting = await scrape(client)
            await third.head.wait()  # the head goes out before the engine lets it in
            assert not third.first_token.is_set()
            await third.done.wait()
            after = await scrape(client)
            assert fake.running == 1  # the slow one
            nursery.cancel_scope.cancel()
    assert waiting["vllm:num_requests_running"][2] == 2.0
    assert waiting["vllm:num_requests_waiting"][2] == 1.0
    assert after["vllm:num_requests_waiting"][2] == 0.0
    # The third generation began only once the first one had ended.
    assert third.at_first_token == {"running": 2, "waiting": 0, "streams_completed": 1}
    assert first.done.is_set() and token_text(first.raw) == token_text(third.raw) == reply_text(2)


async def test_a_client_that_leaves_while_waiting_leaves_the_line_at_once(
    start_backend: StartBackend,
) -> None:
    fake, port = await start_backend(max_running=1, kv_blocks=64, tokens=2, delay=0.01)
    running, waiter, after = Stream(), Stream(), Stream()
    with trio.fail_after(10):
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
            trio.open_nursery() as nursery,
        ):
            holder = trio.CancelScope()

            async def hold() -> None:
                with holder:
                    await run_stream(client, fake, running, SLOW)

            nursery.start_soon(hold)
            await fake.wait_until(lambda: fake.running == 1)
            leaver = trio.CancelScope()

            async def leave_while_waiting() -> None:
                with leaver:
                    await run_stream(client, fake, waiter)

            nursery.start_soon(leave_while_waiting)
            await fake.wait_until(lambda: fake.waiting == 1)
            leaver.cancel()  # httpx closes the connection
            await fake.wait_until(lambda: fake.waiting == 0)
            assert (fake.running, fake.disconnects) == (1, 1)
            nursery.start_soon(run_stream, client, fake, after)
            await fake.wait_until(lambda: fake.waiting == 1)
            holder.cancel()
            await after.done.wait()
    assert not waiter.first_token.is_set()
    # The one that left was never let in: it took no slot and looked nothing up.
    assert after.at_first_token["running"] == 1
    assert fake.prefix_cache_queries == 2 * token_count(prompt_text(json.loads(chat())))
    assert token_text(after.raw) == reply_text(2)


async def test_a_warm_prefix_makes_the_first_token_measurably_sooner(
    start_backend: StartBackend,
) -> None:
    # 2 ms a token: the 500-token system prompt costs a full second of prefill, cold.
    per_token, system = 0.002, "Answer as a patient teacher would. " * 57  # 1995 bytes
    fake, port = await start_backend(kv_blocks=1000, prefill_per_token=per_token, tokens=1)
    cold, warm = Stream(), Stream()
    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            await run_stream(client, fake, cold, body=chat(system, "What is a noun?"))
            cold_queries, cold_hits = fake.prefix_cache_queries, fake.prefix_cache_hits
            await run_stream(client, fake, warm, body=chat(system, "And a verb?"))
            metrics = await scrape(client)
    cold_ttft = cold.first_token_at - cold.sent_at
    warm_ttft = warm.first_token_at - warm.sent_at
    assert cold_hits == 0 and cold_queries >= 500
    warm_hits = fake.prefix_cache_hits
    assert warm_hits >= 496  # all but the block the system prompt ends in
    assert cold_ttft >= cold_queries * per_token  # every token prefilled
    assert warm_ttft < cold_ttft - 0.5  # 496 tokens skipped: ~1 s less, 0.5 s of margin
    assert metrics["vllm:prefix_cache_hits_total"][2] == warm_hits
    assert metrics["vllm:prefix_cache_queries_total"][2] == fake.prefix_cache_queries
    assert metrics["vllm:kv_cache_usage_perc"][2] == 0.0  # nothing runs: nothing pinned


async def test_metrics_answer_with_zeros_when_the_engine_is_off(
    start_backend: StartBackend,
) -> None:
    fake, port = await start_backend(backend_id="g", tokens=1, delay=0)
    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            await client.post(CHAT, content=chat(stream=False))
            response = await client.get("/metrics")
            head = await client.head("/metrics")
    assert response.headers["x-backend-id"] == "g"
    assert head.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
    }
    for name, kind in expected.items():
        assert families[name].type == kind
        assert f"# HELP {name}" in response.text and f"# TYPE {name}" in response.text
        [sample] = families[name].samples
        assert (sample.labels, sample.value) == ({"model_name": "fake-llm"}, 0.0)
    assert (fake.running, fake.waiting, fake.prefix_cache_queries) == (0, 0, 0)


async def test_engine_off_keeps_the_first_token_at_the_first_delay(
    start_backend: StartBackend,
) -> None:
    # A long prompt costs nothing without the engine model, and nothing is counted.
    fake, port = await start_backend(tokens=1, first_delay=0.0)
    seen = Stream()
    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            await run_stream(client, fake, seen, body=chat("word " * 5000))
    assert seen.first_token_at - seen.sent_at < 0.5
    assert seen.at_first_token["running"] == 0


# ---- the command line ------------------------------------------------------------------


def test_engine_options_parse_and_default_to_off() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    options = ("max_running", "kv_blocks", "block_tokens", "ttft_base", "prefill_per_token")
    assert [getattr(args, name) for name in options] == [None, None, 16, None, None]
    argv = "--max-running 4 --kv-blocks 0 --block-tokens 8 --ttft-base 0.1 --prefill-per-token 0"
    args = parser.parse_args(argv.split(" "))
    assert [getattr(args, name) for name in options] == [4, 0, 8, 0.1, 0.0]
    for bad in ("--max-running 0", "--block-tokens 0", "--kv-blocks -1", "--ttft-base -1"):
        with pytest.raises(SystemExit):
            parser.parse_args(bad.split(" "))


def test_fakellm_help_lists_the_engine_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert muxproxy_main(["fakellm", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--max-running", "--kv-blocks", "--block-tokens", "--ttft-base"):
        assert option in out
    assert "--prefill-per-token" in out


async def test_cli_engine_options_reach_the_engine() -> None:
    options = ["--max-running", "1", "--kv-blocks", "64", "--block-tokens", "4", "--tokens", "1"]
    async with trio.open_nursery() as nursery:
        process, line = await ready_line(nursery, *options, "--delay", "0")
        try:
            match = re.search(rb"listening on 127\.0\.0\.1:(\d+)", line)
            assert match, line
            with trio.fail_after(10):
                url = f"http://127.0.0.1:{int(match[1])}"
                async with httpx.AsyncClient(base_url=url) as client:
                    for _ in range(2):
                        await client.post(CHAT, content=chat("x" * 64, stream=False))
                    samples = await scrape(client)
        finally:
            process.terminate()
    # "system: " + 64 bytes + "\n" + "user: hi\n" is 82 bytes: 21 tokens, 5 full blocks of 4
    # (the last token is computed again, but it is in the partial block: all 5 hit).
    assert samples["vllm:prefix_cache_queries_total"][2] == 42.0
    assert samples["vllm:prefix_cache_hits_total"][2] == 20.0

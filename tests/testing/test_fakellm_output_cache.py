"""Tests of the fake engine caching the blocks of the tokens it generated, as vLLM does: the
pure cache (engine.py), the engine on its own timetable and in the step model (scheduler.py,
under MockClock), and a conversation's next turn over real sockets (app.py).

Every IO test runs under fail_after; waits are on the fake's own counters.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import httpx
import trio
import trio.testing

from muxproxy.testing.fakellm import reply_text
from muxproxy.testing.fakellm.engine import (
    CHAT_REPLY_LEAD,
    TOKEN_BYTES,
    EngineConfig,
    EnginePrompt,
    PrefixCache,
    Prompt,
    block_hashes,
    output_blocks,
    prompt_text,
)
from muxproxy.testing.fakellm.scheduler import Engine

if TYPE_CHECKING:
    from conftest import StartBackend

BLOCK = 4
"""Tokens per block in these tests (16 bytes of text)."""


def no_op() -> None:
    pass


def turn(history: list[dict[str, str]], question: str) -> dict[str, Any]:
    return {"model": "m", "messages": [*history, {"role": "user", "content": question}]}


FIRST = turn([{"role": "system", "content": "You answer in numbered tokens. " * 8}], "Count?")


def next_turn(request: dict[str, Any], tokens: int, question: str) -> dict[str, Any]:
    """The turn after ``request``, whose reply was ``tokens`` tokens: its history, the reply."""
    reply = {"role": "assistant", "content": reply_text(tokens)}
    return turn([*request["messages"], reply], question)


def full_blocks(text: str) -> int:
    return len(text.encode()) // (BLOCK * TOKEN_BYTES)


# ---- the pure model --------------------------------------------------------------------


def test_a_chat_reply_completes_the_blocks_its_next_turn_sends() -> None:
    prompt = EnginePrompt.of(FIRST)
    assert prompt.reply_lead == CHAT_REPLY_LEAD
    output = output_blocks(prompt, reply_text(20), BLOCK)
    following = block_hashes(prompt_text(next_turn(FIRST, 20, "And then?")), BLOCK)
    prompt_blocks = full_blocks(prompt.text)
    sequence = prompt.text + CHAT_REPLY_LEAD + reply_text(20)
    assert len(output) == full_blocks(sequence) - prompt_blocks > 0
    # The prompt's blocks, then the reply's: all of them the next turn's leading blocks.
    assert following[: prompt_blocks + len(output)] == [
        *block_hashes(prompt.text, BLOCK),
        *output,
    ]


def test_a_completion_reply_follows_its_prompt_directly_and_nothing_is_not_cached() -> None:
    prompt = EnginePrompt.of({"prompt": "Once upon a time"})
    assert prompt.reply_lead == ""
    assert (
        output_blocks(prompt, "tok0 tok1 ", BLOCK)
        == block_hashes("Once upon a time" + "tok0 tok1 ", BLOCK)[1:]
    )
    assert output_blocks(prompt, "", BLOCK) == []
    assert output_blocks(EnginePrompt.uncached_output("Once upon a time"), "tok0 ", BLOCK) == []


def test_generated_blocks_are_cached_at_release_and_evicted_before_the_prompt() -> None:
    cache = PrefixCache(capacity=5, block_tokens=1)
    prompt = Prompt.from_text("aaaabbbbcccc", 1)
    output = block_hashes("aaaabbbbccccddddeeee", 1)[3:]
    admission = cache.admit(prompt)
    cache.release(admission, output)
    assert all(cache.is_cached(block) for block in (*prompt.blocks, *output))
    assert cache.pinned_blocks == 0
    cache.release(cache.admit(Prompt.from_text("zzzz", 1)))  # room for one: the tail goes
    assert [cache.is_cached(block) for block in output] == [True, False]
    assert all(cache.is_cached(block) for block in prompt.blocks)


def test_with_every_block_pinned_the_output_is_not_kept_and_nothing_breaks() -> None:
    cache = PrefixCache(capacity=3, block_tokens=1)
    running = cache.admit(Prompt.from_text("xxxxyyyy", 1))
    done = cache.admit(Prompt.from_text("aaaa", 1))  # one block: the cache is full
    cache.release(done, block_hashes("aaaabbbbcccc", 1)[1:])
    assert cache.cached_blocks == 3  # "a" only; neither "b" nor "c" found room
    assert not cache.is_cached(block_hashes("aaaabbbb", 1)[1])
    cache.release(running)
    assert cache.pinned_blocks == 0


# ---- the engine: what it generated, however it ends ------------------------------------


async def hits_of_next_turn(engine: Engine, tokens: int) -> int:
    assert engine.cache is not None
    before = engine.cache.hit_tokens
    async with engine.generation(prompt_text(next_turn(FIRST, tokens, "More?"))):
        pass
    return engine.cache.hit_tokens - before


async def test_the_engine_caches_the_tokens_let_out_on_its_timetable(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = EngineConfig(kv_blocks=1000, block_tokens=BLOCK, prefill_per_token=0.001)
    whole, cut = Engine(config, "m", no_op), Engine(config, "m", no_op)
    with trio.fail_after(60):
        async with whole.timetabled(EnginePrompt.of(FIRST), 0.0, 0.01) as clock:
            for i in range(30):
                await clock.wait_generated(i + 1)
        async with cut.timetabled(EnginePrompt.of(FIRST), 0.0, 0.01) as clock:
            await clock.wait_generated(3)  # the client left after three tokens
        reply_hits = await hits_of_next_turn(whole, 30)
        cut_hits = await hits_of_next_turn(cut, 30)
    prompt_tokens = full_blocks(prompt_text(FIRST)) * BLOCK
    sequence = prompt_text(FIRST) + CHAT_REPLY_LEAD + reply_text(30)
    assert reply_hits == full_blocks(sequence) * BLOCK > prompt_tokens
    # Only what was generated before the end is cached: three tokens' worth at most.
    three = prompt_text(FIRST) + CHAT_REPLY_LEAD + reply_text(3)
    assert prompt_tokens <= cut_hits <= full_blocks(three) * BLOCK < reply_hits


async def test_the_step_model_caches_the_tokens_its_batch_generated(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = EngineConfig(
        kv_blocks=1000, block_tokens=BLOCK, prefill_per_token=0.001, prefill_chunk=64
    )
    engine = Engine(config, "m", no_op)
    with trio.fail_after(60):
        async with engine.batched_generation(EnginePrompt.of(FIRST), tokens=30) as generation:
            await generation.wait_generated(30)
        hits = await hits_of_next_turn(engine, 30)
    sequence = prompt_text(FIRST) + CHAT_REPLY_LEAD + reply_text(30)
    assert hits == full_blocks(sequence) * BLOCK


async def test_a_plain_text_prompt_keeps_no_output(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = Engine(EngineConfig(kv_blocks=1000, block_tokens=BLOCK), "m", no_op)
    with trio.fail_after(60):
        async with engine.generation(prompt_text(FIRST)):
            pass
        hits = await hits_of_next_turn(engine, 30)
    assert hits == full_blocks(prompt_text(FIRST)) * BLOCK


# ---- served: a conversation's next turn ------------------------------------------------


async def test_the_next_turn_of_a_conversation_hits_the_reply_it_sends_back(
    start_backend: StartBackend,
) -> None:
    fake, port = await start_backend(kv_blocks=1000, block_tokens=BLOCK, tokens=40, delay=0)
    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            first = await client.post("/v1/chat/completions", content=json.dumps(FIRST))
            reply = first.json()["choices"][0]["message"]["content"]
            assert reply == reply_text(40)
            await fake.wait_until(lambda: fake.running == 0)
            before = fake.prefix_cache_hits
            second = next_turn(FIRST, 40, "Go on.")
            answered = await client.post("/v1/chat/completions", content=json.dumps(second))
            assert answered.status_code == 200
    sequence = prompt_text(FIRST) + CHAT_REPLY_LEAD + reply
    assert fake.prefix_cache_hits - before == full_blocks(sequence) * BLOCK


async def test_a_generation_of_no_tokens_caches_no_output(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = EngineConfig(
        kv_blocks=1000, block_tokens=BLOCK, prefill_per_token=0.001, prefill_chunk=64
    )
    engine = Engine(config, "m", no_op)
    with trio.fail_after(60):
        async with engine.batched_generation(EnginePrompt.of(FIRST), tokens=0) as generation:
            await generation.wait_generated(0)
        assert engine.cache is not None
    assert engine.cache.cached_blocks == full_blocks(prompt_text(FIRST))

"""The fake engine's KV-cache events: what its cache does, said as vLLM says it, and an index
fed over ZeroMQ from two fakes telling which one holds a prompt."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import httpx
import trio
from hypothesis import given
from hypothesis import strategies as st

from muxproxy.routing.kvfeed import EngineFeed
from muxproxy.routing.kvindex import BlockRemoved, BlockStored, EngineBlocks, KVEvent, best_cached
from muxproxy.routing.kvtokens import (
    TokenCache,
    conversation_keys,
    parse_tokenize_answer,
    tokenize_body,
)
from muxproxy.testing.fakellm.engine import Admission, Prompt, prompt_text
from muxproxy.testing.fakellm.kvevents import (
    KvFakeLLM,
    PublishingCache,
    publish_kv_events,
    token_ids,
)
from muxproxy.testing.fakellm.server import serve_fakellm
from muxproxy.trio.kvevents import follow

BLOCK = 4  # tokens per block: 16 bytes of text


def test_token_ids_are_little_endian_four_byte_chunks() -> None:
    assert token_ids("abcdefg") == [
        int.from_bytes(b"abcd", "little"),
        int.from_bytes(b"efg", "little"),
    ]


def test_events_mirror_the_cache_through_admissions_and_evictions() -> None:
    events: list[KVEvent] = []
    cache = PublishingCache(6, BLOCK, on_events=events.extend)
    index = EngineBlocks(max_blocks=100)
    texts = ["s" * 32 + "q1" * 16, "s" * 32 + "q2" * 16, "t" * 48, "s" * 32 + "q1" * 16 + "x" * 16]
    for text in texts:
        cache.learn(text)
        admission = cache.admit(Prompt.from_text(text, BLOCK))
        cache.release(admission)
        for event in events:
            index.apply(event)
        events.clear()
        # The index holds what the cache holds, block for block.
        assert len(index) == cache.cached_blocks
        for other in texts:
            held = 0
            for block in Prompt.from_text(other, BLOCK).blocks:
                if not cache.is_cached(block):
                    break
                held += 1
            assert index.cached_tokens(token_ids(other)) == held * BLOCK


TEXTS = ["s" * 32 + "q1" * 16, "s" * 32 + "q2" * 16, "t" * 48, "s" * 48 + "x" * 16, "u" * 16]


@given(
    capacity=st.integers(0, 8),
    steps=st.lists(st.tuples(st.integers(0, len(TEXTS) - 1), st.booleans()), max_size=30),
)
def test_the_index_follows_the_cache_whatever_admissions_and_releases(
    capacity: int, steps: list[tuple[int, bool]]
) -> None:
    events: list[KVEvent] = []
    cache = PublishingCache(capacity, BLOCK, on_events=events.extend)
    index = EngineBlocks(max_blocks=100)
    running: list[Admission] = []
    for which, release_one in steps:
        if release_one and running:
            cache.release(running.pop(0))
        cache.learn(TEXTS[which])
        running.append(cache.admit(Prompt.from_text(TEXTS[which], BLOCK)))
        for event in events:
            index.apply(event)
        events.clear()
        assert len(index) == cache.cached_blocks
        for text in TEXTS:
            held = 0
            for block in Prompt.from_text(text, BLOCK).blocks:
                if not cache.is_cached(block):
                    break
                held += 1
            assert index.cached_tokens(token_ids(text)) == held * BLOCK


def test_a_second_turn_stores_only_its_new_blocks_chained_to_the_first() -> None:
    events: list[KVEvent] = []
    cache = PublishingCache(100, BLOCK, on_events=events.extend)
    first, second = "s" * 32, "s" * 32 + "u" * 16
    for text in (first, second):
        cache.learn(text)
        cache.admit(Prompt.from_text(text, BLOCK))
    blocks = Prompt.from_text(second, BLOCK).blocks
    assert events[1] == BlockStored(
        block_hashes=(blocks[2],),
        parent_block_hash=blocks[1],
        token_ids=tuple(token_ids("u" * 16)),
        block_size=BLOCK,
    )
    assert not any(isinstance(event, BlockRemoved) for event in events)


def chat(user: str) -> dict[str, Any]:
    system = "You are a careful assistant who answers in one line. " * 4
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


async def test_an_index_fed_by_two_fakes_events_places_a_next_turn_on_its_holder(
    nursery: trio.Nursery,
) -> None:
    feeds: list[EngineFeed] = []
    changed = trio.Condition()

    def notify() -> None:
        nursery.start_soon(_notify_all, changed)

    ports = []
    for _ in range(2):
        fake = KvFakeLLM(kv_blocks=64, block_tokens=BLOCK, tokens=2, delay=0.001)
        events_port, publisher = await nursery.start(publish_kv_events, fake)
        ports.append(await nursery.start(serve_fakellm, fake))
        feed = EngineFeed(EngineBlocks(max_blocks=1000), stale_after=5.0)
        feeds.append(feed)
        await nursery.start(
            partial(follow, f"fake{len(feeds)}", "127.0.0.1", events_port, feed, on_change=notify)
        )
        await publisher.subscribed.wait()
    first = chat("What is a KV cache?")
    reply = {"role": "assistant", "content": "Keys and values kept."}
    second = {**first, "messages": [*first["messages"], reply, {"role": "user", "content": "Why?"}]}
    first_tokens = token_ids(prompt_text(first))
    cache = TokenCache(max_entries=100, max_tokens=100_000)
    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports[1]}") as client:
            response = await client.post("/v1/chat/completions", content=json.dumps(first))
            assert response.status_code == 200
            # Placed, the first turn's messages are tokenized for the next turn.
            keys = conversation_keys(first)
            answer = await client.post("/tokenize", content=tokenize_body(first))
            cache.put(keys[-1], parse_tokenize_answer(answer.content))
        async with changed:
            while feeds[1].blocks.cached_tokens(first_tokens) == 0:
                await changed.wait()
    # The next turn is scored with its known prefix: the first turn's tokens.
    known = cache.longest(conversation_keys(second))
    assert known is not None and known[0] == 2
    held = [feed.blocks.cached_tokens(known[1]) for feed in feeds]
    assert held[0] == 0
    assert held[1] == len(first_tokens) // BLOCK * BLOCK  # every full block of the first turn
    assert best_cached([0, 1], enumerate(held)) == [1, 0]
    # Another conversation behind the same system prompt shares its blocks only.
    other = token_ids(prompt_text(chat("Another question entirely")))
    assert 0 < feeds[1].blocks.cached_tokens(other) < held[1]
    assert feeds[1].usable(trio.current_time(), busy=False)


async def _notify_all(condition: trio.Condition) -> None:
    async with condition:
        condition.notify_all()


async def test_tokenize_answers_the_engine_models_tokens(nursery: trio.Nursery) -> None:
    fake = KvFakeLLM()
    port = await nursery.start(serve_fakellm, fake)
    request = chat("hello")
    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            answer = (await client.post("/tokenize", json=request)).json()
            bad = await client.post("/tokenize", content=b"[1]")
            prompt = (await client.post("/tokenize", json={"prompt": "abcdefgh"})).json()
            models = await client.get("/v1/models")  # everything else as the fake serves it
    assert answer["tokens"] == token_ids(prompt_text(request))
    assert answer["count"] == len(answer["tokens"])
    assert bad.status_code == 400
    assert prompt["tokens"] == token_ids("abcdefgh")
    assert models.status_code == 200

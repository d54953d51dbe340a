"""The cases of ``fuzz_kv_events.py``: an engine's KV-cache event stream and tokenize answers,
with their invariants (no atheris here: the tests replay the seed corpus through ``check``).

An input's first byte picks the case (its value modulo 3):

0. **stream**: the rest is what a publisher sends after the connection opens: a subscriber
   (``zmtp._Connection``) does its handshake and reads messages until the bytes end, each
   message applied to one engine's feed. Only ``ZmtpError`` may end it (the driver's
   ``trio/kvevents.py`` catches it, with ``OSError``, and reconnects).
1. **batch**: the rest is one message's batch, applied to a feed as ``[topic, sequence,
   batch]``. ``EngineFeed.message`` never raises: an unreadable batch is counted and told.
2. **tokenize**: the rest is an engine's ``/tokenize`` answer: a tuple of ints >= 0 within
   ``MAX_ANSWER_TOKENS``, or ``TokenizeError``.

After a feed's messages: the index holds at most ``max_blocks`` blocks, and scoring the
tokens of any stored block (``cached_tokens``, ``place_by_cache``) answers within the
request's own length and keeps every server in the order.
"""

from __future__ import annotations

import trio
import trio.testing

from muxproxy.routing.kvfeed import EngineFeed, place_by_cache
from muxproxy.routing.kvindex import BlockStored, EngineBlocks
from muxproxy.routing.kvtokens import MAX_ANSWER_TOKENS, TokenizeError, parse_tokenize_answer
from muxproxy.routing.kvwire import WireError, decode_batch
from muxproxy.trio.zmtp import ZmtpError, _Connection

MAX_BLOCKS = 64
"""A small cap, so that the fuzzer reaches the index's forgetting."""
MAX_MESSAGES = 64


def new_feed() -> EngineFeed:
    feed = EngineFeed(EngineBlocks(max_blocks=MAX_BLOCKS), stale_after=2.0)
    feed.up(0.0)
    return feed


def check(data: bytes) -> None:
    if not data:
        return
    case, rest = data[0] % 3, data[1:]
    if case == 0:
        feed = new_feed()
        trio.run(_stream, rest, feed)
        _check_feed(feed, [])
    elif case == 1:
        feed = new_feed()
        note = feed.message([b"kv-events", (0).to_bytes(8, "big"), rest], 1.0)
        assert note is None or isinstance(note, str)
        stored: list[tuple[int, ...]] = []
        try:
            batch = decode_batch(rest)
        except WireError:
            assert feed.bad == 1
        else:
            stored = [e.token_ids for e in batch.events if isinstance(e, BlockStored)]
        _check_feed(feed, stored)
    else:
        try:
            tokens = parse_tokenize_answer(rest)
        except TokenizeError:
            return
        assert isinstance(tokens, tuple) and len(tokens) <= MAX_ANSWER_TOKENS
        assert all(type(t) is int and t >= 0 for t in tokens)


async def _stream(data: bytes, feed: EngineFeed) -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    await theirs.send_all(data)
    await theirs.send_eof()
    connection = _Connection(ours)
    try:
        await connection.handshake(b"SUB", frozenset({b"PUB", b"XPUB"}))
        for _ in range(MAX_MESSAGES):
            parts = await connection.read_message()
            note = feed.message(parts, 1.0)
            assert note is None or isinstance(note, str)
    except ZmtpError:
        pass


def _check_feed(feed: EngineFeed, stored: list[tuple[int, ...]]) -> None:
    blocks = feed.blocks
    assert len(blocks) <= MAX_BLOCKS, len(blocks)
    for tokens in stored[:8]:
        cached = blocks.cached_tokens(tokens)
        assert 0 <= cached <= len(tokens)
        order = place_by_cache([0, 1], {0: feed}, tokens, 1.0, lambda i: True)
        assert sorted(order) == [0, 1]

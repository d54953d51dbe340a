"""Following an engine's KV-event publisher: retries with backoff, one log line per failure."""

from __future__ import annotations

import logging
from functools import partial

import pytest
import trio

from muxproxy.routing.kvfeed import EngineFeed
from muxproxy.routing.kvindex import BlockStored, EngineBlocks
from muxproxy.routing.kvwire import encode_batch
from muxproxy.trio.kvevents import follow
from muxproxy.trio.zmtp import ZmtpPublisher


async def test_a_publisher_that_fails_at_first_is_followed_once_it_works(
    caplog: pytest.LogCaptureFixture,
) -> None:
    publisher = ZmtpPublisher()
    refused = 0

    async def flaky(stream: trio.SocketStream) -> None:
        nonlocal refused
        if refused < 4:  # the engine is starting: it closes at once
            refused += 1
            await stream.aclose()
            return
        await publisher.serve(stream)

    feed = EngineFeed(EngineBlocks(max_blocks=10), stale_after=5.0)
    applied = trio.Event()
    caplog.set_level(logging.INFO, logger="muxproxy")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_tcp, flaky, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            await nursery.start(
                partial(
                    follow,
                    "gpu0",
                    "127.0.0.1",
                    port,
                    feed,
                    on_change=applied.set,
                    retry_min=0.001,  # 1, 2, 4, 8 ms: the backoff, quickly
                )
            )
            await publisher.subscribed.wait()
            stored = BlockStored(
                block_hashes=(1,), parent_block_hash=None, token_ids=(1, 2), block_size=2
            )
            publisher.publish([b"kv-events", bytes(8), encode_batch(0.0, [stored])])
            await applied.wait()  # the subscriber's side is up once it applies a message
            assert feed.connected
            assert feed.blocks.cached_tokens((1, 2)) == 2
            nursery.cancel_scope.cancel()
    assert refused == 4
    failures = [r for r in caplog.records if "no events from" in r.getMessage()]
    assert len(failures) == 1  # the same failure four times: said once
    assert any("subscribed again" in r.getMessage() for r in caplog.records)
    assert not feed.connected  # cancelled: the subscription is down

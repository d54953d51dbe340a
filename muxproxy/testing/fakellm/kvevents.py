"""The fake engine's KV-cache events, published as vLLM publishes them, so that routing by
the engines' own events is tested without vLLM.

What it obeys: vLLM's ``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}'``: a ZeroMQ PUB socket
(``muxproxy/trio/zmtp.py``) sending, for each change of the prefix cache, the message
``[topic, sequence (8 bytes, big-endian, from 0), KVEventBatch]``
(``muxproxy/routing/kvwire.py``). The events name what changed in the engine model's cache
(``engine.py``): ``BlockRemoved`` for the blocks an admission evicted, then ``BlockStored``
for the blocks it cached, each run with its parent (the prompt's block before it; None for a
prompt's first block). A block's hash is the engine model's own (bytes, as vLLM's are since
0.11); its tokens are its 4-byte chunks of prompt text read as little-endian integers, the
engine model's tokens (``engine.TOKEN_BYTES``), so :func:`token_ids` of a prompt's text cut
in blocks gives the same tokens the events carry.

How it hooks in, leaving the engine model as it is: :class:`PublishingEngine` is the
scheduler's ``Engine`` that, before each admission, tells its :class:`PublishingCache` the
tokens of the prompt's blocks (the cache knows blocks only by their hashes); the cache diffs
its blocks around each ``admit`` and hands the events to a callback. Blocks it cannot name
the tokens of (none, today) are left out of the events, and a block stored after one left
out names that one as its parent, as vLLM's would: a subscriber counts it as an orphan.

:class:`KvFakeLLM` also answers vLLM's ``POST /tokenize`` (``{"model", "messages"}`` or
``{"model", "prompt"}``; the answer ``{"count", "max_model_len", "tokens"}``) with the
engine model's tokens of the prompt text: the tokens its events carry, so a router can score
a request as it would against vLLM.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial

import attrs
import trio

from muxproxy.routing.kvindex import BlockRemoved, BlockStored, KVEvent
from muxproxy.routing.kvwire import encode_batch
from muxproxy.testing.fakellm.app import FakeLLM, Receive, Scope, Send
from muxproxy.testing.fakellm.engine import (
    TOKEN_BYTES,
    Admission,
    EnginePrompt,
    PrefixCache,
    Prompt,
    block_hashes,
    prompt_text,
)
from muxproxy.testing.fakellm.scheduler import Engine, Held
from muxproxy.trio.zmtp import ZmtpPublisher

__all__ = [
    "DEFAULT_TOPIC",
    "MAX_MODEL_LEN",
    "KvEventStream",
    "KvFakeLLM",
    "PublishingCache",
    "PublishingEngine",
    "publish_kv_events",
    "token_ids",
]

DEFAULT_TOPIC = "kv-events"
"""vLLM's topic in its documented ``--kv-events-config`` example."""

MAX_MODEL_LEN = 32768
"""The context length the fake's ``/tokenize`` answers report."""


def token_ids(text: str) -> list[int]:
    """The engine model's tokens of ``text``: its UTF-8 bytes in 4-byte chunks, each read as a
    little-endian integer (a short last chunk too)."""
    data = text.encode()
    return [
        int.from_bytes(data[start : start + TOKEN_BYTES], "little")
        for start in range(0, len(data), TOKEN_BYTES)
    ]


@attrs.define
class PublishingCache(PrefixCache):
    """The engine model's prefix cache, telling ``on_events`` what each admission changed."""

    on_events: Callable[[Sequence[KVEvent]], None] = attrs.field(
        default=lambda events: None, kw_only=True, repr=False
    )
    _tokens: dict[bytes, tuple[int, ...]] = attrs.field(factory=dict, init=False, repr=False)
    """Block hash -> its tokens, for the blocks cached and those of prompts about to be
    admitted."""

    def learn(self, text: str) -> None:
        """Remember the tokens of ``text``'s full blocks (called before its admission)."""
        tokens = token_ids(text)
        for at, block in enumerate(block_hashes(text, self.block_tokens)):
            self._tokens[block] = tuple(
                tokens[at * self.block_tokens : (at + 1) * self.block_tokens]
            )

    def admit(self, prompt: Prompt) -> Admission:
        before = set(self._refs)
        admission = super().admit(prompt)
        removed = tuple(block for block in before if block not in self._refs)
        events: list[KVEvent] = []
        if removed:
            events.append(BlockRemoved(block_hashes=removed))
        events.extend(self._stored(prompt.blocks, before))
        for block in removed:
            self._tokens.pop(block, None)
        if len(self._tokens) > 2 * max(self.capacity, 1):  # learnt, never stored: forget
            self._tokens = {
                block: self._tokens[block] for block in self._refs if block in self._tokens
            }
        if events:
            self.on_events(events)
        return admission

    def _stored(self, blocks: Sequence[bytes], before: set[bytes]) -> list[BlockStored]:
        """The newly cached blocks of a prompt, one event per run of consecutive ones."""
        events: list[BlockStored] = []
        run: list[bytes] = []
        parent: bytes | None = None
        for at, block in enumerate((*blocks, None)):
            new = block is not None and block not in before and block in self._refs
            if new and block in self._tokens:
                if not run:
                    parent = blocks[at - 1] if at else None
                run.append(block)
                continue
            if run:
                events.append(
                    BlockStored(
                        block_hashes=tuple(run),
                        parent_block_hash=parent,
                        token_ids=tuple(token for hash_ in run for token in self._tokens[hash_]),
                        block_size=self.block_tokens,
                    )
                )
                run = []
        return events


@attrs.define
class PublishingEngine(Engine):
    """The scheduler's engine, with a :class:`PublishingCache` (when it has a cache)."""

    on_events: Callable[[Sequence[KVEvent]], None] = attrs.field(
        default=lambda events: None, kw_only=True, repr=False
    )

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.cache is not None:
            self.cache = PublishingCache(
                self.cache.capacity, self.cache.block_tokens, on_events=self.on_events
            )

    @asynccontextmanager
    async def _admitted(self, prompt: EnginePrompt) -> AsyncIterator[Held]:
        if isinstance(self.cache, PublishingCache):
            self.cache.learn(prompt.text)
        async with super()._admitted(prompt) as held:
            yield held


class KvEventStream:
    """Numbered vLLM batches on a ZeroMQ PUB socket."""

    def __init__(self, publisher: ZmtpPublisher, topic: str) -> None:
        self.publisher = publisher
        self.topic = topic.encode()
        self._sequence = itertools.count()

    def send(self, events: Sequence[KVEvent]) -> None:
        sequence = next(self._sequence)
        payload = encode_batch(time.time(), events)
        self.publisher.publish([self.topic, sequence.to_bytes(8, "big"), payload])


async def publish_kv_events(
    fake: FakeLLM,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    topic: str = DEFAULT_TOPIC,
    task_status: trio.TaskStatus[tuple[int, ZmtpPublisher]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Give ``fake`` a publishing engine and serve its events on ``host:port`` until cancelled.

    Start it before the fake serves requests (``nursery.start`` reports ``(port, publisher)``);
    the fake needs its engine model's cache (``kv_blocks``)."""
    if fake.kv_blocks is None:
        raise ValueError("KV-cache events need the engine model's cache (kv_blocks)")
    publisher = ZmtpPublisher()
    stream = KvEventStream(publisher, topic)
    old = fake.engine
    fake.engine = PublishingEngine(
        old.config, old.model_name, old.on_change, old.lora, on_events=stream.send
    )
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(trio.serve_listeners, publisher.serve, listeners))
        task_status.started((bound, publisher))


@attrs.define
class KvFakeLLM(FakeLLM):
    """A fake backend that also serves ``POST /tokenize`` as vLLM does (see the header)."""

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/tokenize" or scope["method"] != "POST":
            await super().app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        try:
            request = json.loads(b"".join(chunks))
        except ValueError:
            request = None
        answer: dict[str, object]
        if not isinstance(request, dict) or not (
            isinstance(request.get("messages"), list) or isinstance(request.get("prompt"), str)
        ):
            status, answer = 400, {"error": {"message": "messages or prompt wanted"}}
        else:
            tokens = token_ids(prompt_text(request))
            status = 200
            answer = {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens}
        body = json.dumps(answer).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", b"%d" % len(body)),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

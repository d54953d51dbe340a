"""The fake LLM backend's engine, live: the FIFO of generations and the prefix cache they use.

The Trio side of the engine model (the model itself is ``engine.py``, pure). :class:`Engine`
lets at most ``max_running`` generations run at once (:class:`FifoSlots`); the others wait in
arrival order, as vLLM's scheduler takes waiting requests first come first served (its default
``fcfs`` policy). When a generation is let in, its prompt is looked up in the prefix cache and
its blocks pinned (vLLM looks the cache up when it schedules a request, not when it arrives);
when it ends, the full blocks of the tokens it generated are cached (``engine.py``) and all
its blocks unpinned. A waiter that is cancelled (its client went away) leaves the
queue at once and is never let in. In the step model (``prefill_chunk``) a generation let in
runs in the engine's one batch (``batch.py``) until it ends, holding its slot all the while.

Every change of what is running, waiting or cached calls ``on_change`` (the fake backend
wakes its ``wait_until`` waiters with it) and is mirrored in the Prometheus metrics
(``metrics.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import trio

from muxproxy.testing.fakellm.answer import reply_text
from muxproxy.testing.fakellm.batch import Batch, BatchedGeneration
from muxproxy.testing.fakellm.engine import (
    Admission,
    EngineConfig,
    EnginePrompt,
    PrefixCache,
    Prompt,
    output_blocks,
    token_count,
)
from muxproxy.testing.fakellm.lora import LoraSlots
from muxproxy.testing.fakellm.metrics import EngineMetrics
from muxproxy.testing.fakellm.pacing import Timetable, TokenClock


@attrs.define
class Held:
    """One generation let in: its uncached prompt tokens, and the tokens it has generated
    (set by whoever paces it, read when it ends)."""

    uncached: int
    generated: int = 0


@attrs.define
class _CountingClock:
    """A generation's own timetable that counts the tokens it has let out."""

    timetable: Timetable
    held: Held

    async def wait_generated(self, count: int) -> None:
        await self.timetable.wait_generated(count)
        self.held.generated = max(self.held.generated, count)


@attrs.define
class FifoSlots:
    """A semaphore that lets waiters in strictly first come first served.

    :meth:`acquire` takes a slot, waiting in line when all ``limit`` are taken (``None``: no
    limit); :meth:`release` hands the slot straight to the first waiter. A waiter cancelled
    while parked is removed from the line by Trio (``ParkingLot``) and takes no slot.
    """

    limit: int | None = attrs.field(validator=attrs.validators.optional(attrs.validators.ge(1)))
    running: int = attrs.field(default=0, init=False)
    """Slots taken."""
    waiting: int = attrs.field(default=0, init=False)
    """Tasks waiting in line."""
    _line: trio.lowlevel.ParkingLot = attrs.field(
        factory=trio.lowlevel.ParkingLot, init=False, repr=False
    )

    async def acquire(self, on_change: Callable[[], None]) -> None:
        """Take a slot, waiting in line for one if need be; ``on_change`` on every change."""
        if self.limit is None or (self.running < self.limit and not self._line):
            await trio.lowlevel.checkpoint_if_cancelled()
            self.running += 1
            on_change()
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        self.waiting += 1
        on_change()
        try:
            await self._line.park()  # release() handed its slot over: running is unchanged
        finally:
            self.waiting -= 1
            on_change()

    def release(self, on_change: Callable[[], None]) -> None:
        """Give a slot back: to the first waiter if there is one."""
        if self._line:
            self._line.unpark()
        else:
            self.running -= 1
        on_change()


@attrs.define
class Engine:
    """A fake backend's engine: its options, its slots, its prefix cache and their metrics."""

    config: EngineConfig
    model_name: str
    on_change: Callable[[], None] = attrs.field(repr=False)
    lora: LoraSlots | None = None
    """The LoRA adapters it holds, reported with its metrics; None: no LoRA."""
    slots: FifoSlots = attrs.field(init=False)
    cache: PrefixCache | None = attrs.field(init=False)
    """None when no ``kv_blocks`` are given: nothing is cached, nothing is counted."""
    batch: Batch | None = attrs.field(init=False)
    """The step model's batch and loop; None without ``prefill_chunk``."""
    metrics: EngineMetrics = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        config = self.config
        self.slots = FifoSlots(config.max_running)
        kv_blocks = config.kv_blocks
        self.cache = None if kv_blocks is None else PrefixCache(kv_blocks, config.block_tokens)
        self.batch = None
        if config.prefill_chunk is not None:
            self.batch = Batch(
                chunk=config.prefill_chunk,
                decode_seconds=config.decode_seconds,
                prefill_per_token=config.prefill_per_token or 0.0,
                on_change=self.on_change,
            )
        self.metrics = EngineMetrics(self.model_name, lora=self.lora is not None)

    @property
    def running(self) -> int:
        """Generations running."""
        return self.slots.running

    @property
    def waiting(self) -> int:
        """Generations waiting for a slot."""
        return self.slots.waiting

    @asynccontextmanager
    async def generation(self, text: str) -> AsyncIterator[float]:
        """Run one generation of a prompt ``text``: wait for a slot, then hold it.

        Yields the seconds from admission to the first token (``EngineConfig.prefill_seconds``
        of the prompt tokens not found cached). The slot and the prompt's cache blocks are
        given back on exit, however it comes; nothing it generates is cached.
        """
        async with self._admitted(EnginePrompt.uncached_output(text)) as held:
            yield self.config.prefill_seconds(held.uncached)

    @asynccontextmanager
    async def timetabled(
        self, prompt: EnginePrompt, first_delay: float, delay: float
    ) -> AsyncIterator[TokenClock]:
        """Run one generation of ``prompt`` on its own timetable: wait for a slot, then hold
        it; the first token ``prefill_seconds + first_delay`` after admission, then one every
        ``delay``. On exit, however it comes, the tokens let out so far are cached (see
        ``engine.py``) and the slot and blocks given back."""
        async with self._admitted(prompt) as held:
            start = trio.current_time() + self.config.prefill_seconds(held.uncached)
            yield _CountingClock(Timetable(start, first_delay, delay), held)

    @asynccontextmanager
    async def batched_generation(
        self, prompt: str | EnginePrompt, *, tokens: int, first_delay: float = 0.0
    ) -> AsyncIterator[BatchedGeneration]:
        """Run one generation of ``tokens`` tokens of a ``prompt`` in the step model (a plain
        text: its output is not cached).

        Waits for a slot as :meth:`generation` does, then ``ttft_base + first_delay``
        seconds, then joins the batch with its uncached prompt tokens to prefill and yields
        its place there (``wait_generated`` paces its tokens). It leaves the batch, caches the
        tokens the batch generated for it, and gives the slot and cache blocks back, on exit,
        however it comes. Only with ``prefill_chunk`` (raises ``RuntimeError`` without it).
        """
        if self.batch is None:
            raise RuntimeError("batched_generation needs the step model (prefill_chunk)")
        if isinstance(prompt, str):
            prompt = EnginePrompt.uncached_output(prompt)
        async with self._admitted(prompt) as held:
            await trio.sleep((self.config.ttft_base or 0.0) + first_delay)
            async with self.batch.joined(held.uncached, tokens) as generation:
                try:
                    yield generation
                finally:
                    # A generation of no tokens still has its one step: it emits nothing.
                    held.generated = min(generation.generated, tokens)

    @asynccontextmanager
    async def _admitted(self, prompt: EnginePrompt) -> AsyncIterator[Held]:
        """Hold a slot and the prompt's cache blocks; yields its uncached prompt tokens, and
        on exit caches the blocks of the tokens it generated by then."""
        await self.slots.acquire(self.on_change)
        admission: Admission | None = None
        held = Held(uncached=token_count(prompt.text))
        try:
            if self.cache is not None:
                block_tokens = self.config.block_tokens
                admission = self.cache.admit(Prompt.from_text(prompt.text, block_tokens))
                self.metrics.count_lookup(admission.prompt_tokens, admission.hit_tokens)
                held.uncached = admission.uncached_tokens
                self.on_change()
            yield held
        finally:
            if admission is not None and self.cache is not None:
                reply = reply_text(held.generated)
                output = output_blocks(prompt, reply, self.config.block_tokens)
                self.cache.release(admission, output)
            self.slots.release(self.on_change)

    def render_metrics(self) -> bytes:
        """The Prometheus text exposition of the engine's state now."""
        usage = 0.0 if self.cache is None else self.cache.usage
        return self.metrics.render(
            running=self.running, waiting=self.waiting, kv_usage=usage, lora=self.lora
        )

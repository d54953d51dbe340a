"""The fake LLM backend's engine loop: steps of continuous batching, the Trio side of ``steps.py``.

One :class:`Batch` per engine. A generation joins it (:meth:`Batch.joined`) once it holds a
slot, with the prompt tokens it must prefill (its uncached ones) and the tokens it will
generate; it leaves when the context ends, however it ends (its last token written, die-after,
its client gone: a cancellation), at once, even in the middle of a step.

Theory of operation: the first generation to join an idle batch starts the loop, a Trio
system task (``trio.lowlevel.spawn_system_task``: the ASGI app owns no nursery that outlives
a request), which runs steps back to back while any member has work (prefill left, or tokens
to generate) and returns when none has. Each step is planned by :func:`~.steps.plan_step` on
the members with work at its start, in the order they joined, and lasts
:func:`~.steps.step_seconds` of its prefill; a member that joins during a step waits for the
next (vLLM schedules between steps), and one that leaves during a step takes no part in its
outcome. When a step ends, every member it emits for has one more token generated and every
waiter (:meth:`BatchedGeneration.wait_generated`) is woken: the tokens of all running streams
come out together, once a step. The engine does not wait for a slow reader: tokens not yet
written pile up in the count (vLLM's output queue).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import trio

from muxproxy.testing.fakellm.steps import plan_step, step_seconds


@attrs.define(eq=False)
class BatchedGeneration:
    """One generation in the batch (what :meth:`Batch.joined` yields)."""

    prefill_left: int
    """Prompt tokens still to prefill."""
    tokens: int
    """Tokens it will generate; with 0 it still waits for its prefill (one token's step)."""
    generated: int = attrs.field(default=0, init=False)
    """Tokens out so far (steps ended that emitted for it)."""
    gone: bool = attrs.field(default=False, init=False)
    """It has left the batch."""
    _batch: Batch = attrs.field(alias="batch", kw_only=True, repr=False)

    @property
    def has_work(self) -> bool:
        """Whether a step is still owed to it: prefill left, or tokens not yet generated."""
        return not self.gone and (self.prefill_left > 0 or self.generated < max(self.tokens, 1))

    async def wait_generated(self, count: int) -> None:
        """Return once ``count`` tokens are out (at least 1, at most ``tokens``: 0 waits for
        the prefill). Always a checkpoint."""
        want = max(1, min(count, self.tokens))
        if self.generated >= want:
            await trio.lowlevel.checkpoint()
            return
        while self.generated < want:
            await self._batch.wait_step()


@attrs.define
class Batch:
    """The running generations of one engine and the loop of steps that serves them."""

    chunk: int = attrs.field(validator=attrs.validators.ge(1))
    """Prefill tokens per step, all generations together."""
    decode_seconds: float
    """Seconds of a step's decode (every step's cost without prefill)."""
    prefill_per_token: float
    """Seconds more per prefill token in a step."""
    on_change: Callable[[], None] = attrs.field(repr=False)
    """Called when a step ends and when a generation leaves."""

    steps: int = attrs.field(default=0, init=False)
    """Steps run so far."""
    _members: list[BatchedGeneration] = attrs.field(factory=list, init=False, repr=False)
    _looping: bool = attrs.field(default=False, init=False, repr=False)
    _stepped: trio.Event = attrs.field(factory=trio.Event, init=False, repr=False)

    @property
    def size(self) -> int:
        """Generations in the batch (with work or not)."""
        return len(self._members)

    @asynccontextmanager
    async def joined(self, prefill_tokens: int, tokens: int) -> AsyncIterator[BatchedGeneration]:
        """Be in the batch for the context: ``prefill_tokens`` to prefill, then ``tokens``."""
        generation = BatchedGeneration(max(prefill_tokens, 0), max(tokens, 0), batch=self)
        self._members.append(generation)
        if not self._looping:
            self._looping = True
            trio.lowlevel.spawn_system_task(self._loop, name="fakellm engine loop")
        try:
            yield generation
        finally:
            generation.gone = True
            self._members.remove(generation)
            self.on_change()

    async def wait_step(self) -> None:
        """Return when the step under way (or the next one) ends."""
        await self._stepped.wait()

    async def _loop(self) -> None:
        try:
            while working := [g for g in self._members if g.has_work]:
                plan = plan_step([g.prefill_left for g in working], self.chunk)
                await trio.sleep(
                    step_seconds(
                        plan.prefill_tokens,
                        decode=self.decode_seconds,
                        per_token=self.prefill_per_token,
                    )
                )
                for generation, prefill, emits in zip(
                    working, plan.prefill, plan.emits, strict=True
                ):
                    if generation.gone:
                        continue
                    generation.prefill_left -= prefill
                    generation.generated += emits
                self.steps += 1
                self._stepped.set()
                self._stepped = trio.Event()
                self.on_change()
        finally:
            self._looping = False

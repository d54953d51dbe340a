"""One worker process of ``serve --workers N`` as its supervisor sees it.

:class:`Worker` is the supervisor's record of one process (:mod:`muxproxy.workers`): its
slot, its control channel (:mod:`muxproxy.trio.channel`), the state it is in and its
answers. A request to a worker carries an ``id`` that its answer repeats; an answer that
comes after its request gave up waiting is dropped by the supervisor. Below: the small Trio
helpers the supervisor waits with, and what an exited worker leaves of its measurements.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import trio

from ..core.series import GAUGE
from .channel import Channel, Message

REPLY_TIMEOUT = 5.0
"""Seconds a worker has to answer a request on its control channel."""


class WorkerState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    STOPPING = "stopping"
    """Told to stop (a shutdown, or replaced by a rolling restart): draining."""
    EXITED = "exited"


@attrs.define(eq=False)
class Worker:
    """One worker process, as the supervisor sees it."""

    slot: int
    process: trio.Process
    channel: Channel
    generation: int
    """The supervisor's configuration generation this worker runs."""
    state: WorkerState = WorkerState.STARTING
    bound: list[tuple[str, int]] = attrs.field(factory=list)
    listening: trio.Event = attrs.field(factory=trio.Event)
    exited: trio.Event = attrs.field(factory=trio.Event)
    returncode: int | None = None
    final: dict[str, Any] | None = None
    """The measurements it sent as it exited."""
    replies: dict[int, Pending] = attrs.field(factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def live(self) -> bool:
        return self.state is not WorkerState.EXITED

    async def request(self, message: Message, ident: int, fds: Sequence[int] = ()) -> Message:
        """Send ``message`` (given ``ident``, carrying ``fds``); the answer with the same id.

        Raises ``trio.BrokenResourceError`` when the worker exits first, ``trio.TooSlowError``
        after :data:`REPLY_TIMEOUT`.
        """
        pending = self.replies[ident] = Pending()
        try:
            with trio.fail_after(REPLY_TIMEOUT):
                await self.channel.send({**message, "id": ident}, fds)
                await pending.done.wait()
        finally:
            del self.replies[ident]
        if pending.reply is None:
            raise trio.BrokenResourceError(f"worker {self.pid} exited")
        return pending.reply


@attrs.define
class Pending:
    done: trio.Event = attrs.field(factory=trio.Event)
    reply: Message | None = None


async def gather(*tasks: Callable[[], Awaitable[None]]) -> None:
    async with trio.open_nursery() as nursery:
        for task in tasks:
            nursery.start_soon(task)


async def first_of(*waits: Callable[[], Awaitable[None]]) -> None:
    """Return as soon as one of ``waits`` returns."""
    async with trio.open_nursery() as nursery:

        async def run(wait: Callable[[], Awaitable[None]]) -> None:
            await wait()
            nursery.cancel_scope.cancel()

        for wait in waits:
            nursery.start_soon(run, wait)


def without_gauges(snapshot: dict[str, Any]) -> dict[str, Any]:
    """``snapshot`` with its counters and histograms only: what an exited worker leaves."""
    metrics = snapshot.get("metrics", {})
    kept = {name: m for name, m in metrics.items() if m.get("type") != GAUGE}
    return {**snapshot, "metrics": kept}

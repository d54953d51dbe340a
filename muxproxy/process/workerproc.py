"""One worker process of ``serve --workers N`` as its supervisor sees it.

:class:`Worker` is the supervisor's record of one process (:mod:`muxproxy.process.workers`): its
slot, its control channel (:mod:`muxproxy.trio.channel`), the state it is in and its
answers. A request to a worker carries an ``id`` that its answer repeats; an answer that
comes after its request gave up waiting is dropped by the supervisor. Below: the
supervisor's phases, its budget of replacements, the small Trio helpers it waits with, and
what exited workers leave of their measurements (:class:`Retired`).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from functools import partial
from typing import Any

import attrs
import trio

from muxproxy.core.observe.series import GAUGE, merge
from muxproxy.trio.channel import Channel, Message

REPLY_TIMEOUT = 5.0
"""Seconds a worker has to answer a request on its control channel."""
RESTART_WINDOW = 10.0
"""Seconds over which replacements are counted: N workers may be replaced N times in it."""


class Phase(enum.Enum):
    """The supervisor's."""

    STARTING = "starting"
    """Not every worker has reported that it listens; a death fails the start."""
    SERVING = "serving"
    """Every worker has listened once; a death is replaced."""
    STOPPING = "stopping"
    """The workers were told to stop; the supervisor exits once they have."""


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


async def ask_each(
    workers: list[Worker], message: Message, ids: Iterator[int]
) -> list[tuple[Worker, Message | None]]:
    """``message`` to each of ``workers`` at once (each request given the next of ``ids``);
    each worker's answer, None for one that gave none (exited, or too slow)."""
    answers: dict[int, Message | None] = {}

    async def ask(worker: Worker) -> None:
        try:
            answers[id(worker)] = await worker.request(message, next(ids))
        except (trio.BrokenResourceError, trio.TooSlowError):
            answers[id(worker)] = None

    await gather(*(partial(ask, worker) for worker in workers))
    return [(worker, answers[id(worker)]) for worker in workers]


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


@attrs.define
class RestartBudget:
    """Replacements of dead workers: ``count`` within :data:`RESTART_WINDOW` seconds, no
    more, so a crash loop stops the supervisor instead of spinning."""

    count: int
    started: deque[float] = attrs.field(factory=deque)
    """When each recent replacement started (within the window)."""

    def spend(self, now: float) -> bool:
        """Whether one more replacement may start at ``now`` (it is then counted)."""
        while self.started and now - self.started[0] > RESTART_WINDOW:
            self.started.popleft()
        if len(self.started) >= self.count:
            return False
        self.started.append(now)
        return True

    def describe(self) -> str:
        return f"{len(self.started)} workers replaced within {RESTART_WINDOW:g}s"


@attrs.define
class Retired:
    """The counters and histograms of every exited worker, merged into one snapshot as each
    exits, so the fleet's never go backwards (their gauges went with them)."""

    merged: dict[str, Any] | None = None

    def add(self, final: dict[str, Any]) -> str | None:
        """Count a worker's last snapshot; why it cannot be counted (another version's
        metrics, after a rolling restart), or None."""
        kept = without_gauges(final)
        try:
            self.merged = kept if self.merged is None else merge([self.merged, kept])
        except ValueError as exc:
            return str(exc)
        return None

    def snapshots(self) -> list[dict[str, Any]]:
        """A new list holding the merged snapshot (empty before any worker exited)."""
        return [] if self.merged is None else [self.merged]

    @staticmethod
    def answered(answers: list[tuple[Worker, Message | None]]) -> list[dict[str, Any]]:
        """The snapshots of ``metrics?`` answers. A worker that exited meanwhile answers with
        its final snapshot (not yet added here); one that answered and then exited is counted
        by its answer."""
        snapshots = []
        for worker, answer in answers:
            if answer is not None:
                snapshots.append(answer["snapshot"])
            elif worker.final is not None:
                snapshots.append(without_gauges(worker.final))
        return snapshots

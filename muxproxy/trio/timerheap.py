"""The core's timers on one Trio task: a deadline heap, each due timer fired once.

What it obeys, and why:

- **One task for every timer.** The core sets and cancels timers by the thousand (a read
  deadline per stream, re-armed per chunk); a task or a cancel scope per timer would cost more
  than the work. ``SetTimer`` pushes ``(at, seq, timer)``; ``CancelTimer`` forgets the timer
  and leaves its entry. The task sleeps until the earliest entry, and a ``SetTimer`` sooner
  than that moves its deadline, so the wake-up is never late.
- **The table is the truth, the heap a hint.** ``timers`` holds each timer's one current
  deadline; an entry whose deadline is not it (cancelled, or set again) is stale and skipped.
  A timer fires only at its current deadline, once. Stale entries are bounded: past twice the
  live timers (plus a constant) the heap is rebuilt from the table, so a timer set again
  many times (a read deadline) cannot grow it without bound.
- **Fired in deadline order, at the time the task woke.** Every due timer of one wake-up is
  handed to ``fire`` with the same ``now``; ``fire`` is the driver's, which feeds the core a
  ``Wakeup``. A timer set while firing (at or before ``now``) fires in the same wake-up.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import trio

from muxproxy.core.commands import CancelTimer, SetTimer
from muxproxy.core.events import TimerId

__all__ = ["TimerHeap"]

_SLACK = 256
"""Stale entries the heap may hold beyond twice the live timers before it is rebuilt."""


class TimerHeap:
    """The set timers and their deadline heap; :meth:`run` fires them as they fall due."""

    def __init__(self) -> None:
        self.timers: dict[TimerId, float] = {}
        """Each set timer's current deadline."""
        self._heap: list[tuple[float, int, TimerId]] = []
        self._seq = 0
        self._scope: trio.CancelScope | None = None
        """The sleep of :meth:`run` until the earliest deadline, while it sleeps."""

    def set(self, command: SetTimer) -> None:
        self.timers[command.timer] = command.at
        self._seq += 1
        heapq.heappush(self._heap, (command.at, self._seq, command.timer))
        scope = self._scope
        if scope is not None and command.at < scope.deadline:
            scope.deadline = command.at
        if len(self._heap) > 2 * len(self.timers) + _SLACK:
            self._heap = [(at, i, t) for i, (t, at) in enumerate(self.timers.items())]
            heapq.heapify(self._heap)

    def cancel(self, command: CancelTimer) -> None:
        self.timers.pop(command.timer, None)

    async def run(self, fire: Callable[[float, TimerId], None]) -> None:
        """Forever: sleep until the earliest deadline, then ``fire(now, timer)`` for each
        timer due by then, in deadline order."""
        timers = self.timers
        while True:
            while self._heap and timers.get(self._heap[0][2]) != self._heap[0][0]:
                heapq.heappop(self._heap)  # cancelled or re-set: a stale entry
            deadline = self._heap[0][0] if self._heap else float("inf")
            with trio.CancelScope(deadline=deadline) as scope:
                self._scope = scope
                await trio.sleep_forever()
            self._scope = None
            now = trio.current_time()
            while self._heap and self._heap[0][0] <= now:
                at, _, timer = heapq.heappop(self._heap)
                if timers.get(timer) == at:
                    del timers[timer]
                    fire(now, timer)

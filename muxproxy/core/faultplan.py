"""Planted faults: where a test makes the core meet a bug, without replacing any of its methods.

Fault isolation (``faults.py``) is about bugs, and no peer can cause a bug on purpose, so its
tests plant one. Replacing a method of a core object would do that in the pure-Python build
only: a class compiled by mypyc (``compiled.py``) refuses new attributes. A ``FaultPlan`` is
the seam instead: ``plant_faults(core)`` hangs one on the core (``ProxyCore.planted``), a test
plants exceptions on it, and the core consults it at the few points below, raising what is
planted there for the subject at hand. The exception then travels as a real bug would: out of
the part's handling into ``ProxyCore.handle``, which contains it (or re-raises it, with
``raise_errors``).

The points (``FaultPoint``), each where the core already knows whom a bug there would concern:

- ``BEFORE``: an event reached ``handle``, before the part it concerns handles it (a bug at
  the top of ``Downstream.on_data``, say). The subject is the event.
- ``AFTER``: the part handled the event, its commands are queued, ``handle`` has not returned
  (a bug at the end of the handling: what it queued for the failed connection is dropped).
- ``TIMER``: a timer fired and its owner (exchange, client, backend connection, probe) is
  known, before the owner handles it. The subject is the timer, ``(kind, ident)``.
- ``DEFERRED``: deferred work (``Effects.defer``) for a connection is about to run. The
  subject is the connection id.
- ``NEIGHBOUR``: the isolation of one connection is about to call into a neighbour's code (a
  client whose exchange fails, a backend whose stream is cancelled: ``Isolation.guard``).
  The subject is the neighbour's connection id.

Rules: no plan, no cost but one ``is None`` test per point (``ProxyCore.planted`` is None in
production; nothing in muxproxy sets it); the per-token path has no point of its own. A planted
fault fires each time its subject comes, until the test removes it (``clear``); a test that
needs "only once" says so with ``times``. This module imports nothing of the core, so any
part may consult a plan.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Protocol

import attrs


class FaultPoint(enum.Enum):
    """Where the core consults its ``FaultPlan`` (see the module docstring)."""

    BEFORE = "before"
    AFTER = "after"
    TIMER = "timer"
    DEFERRED = "deferred"
    NEIGHBOUR = "neighbour"


@attrs.define(kw_only=True)
class Planted:
    """One planted fault: ``error`` is raised at ``point`` for each subject ``matches``
    accepts, ``times`` times (None: every time)."""

    point: FaultPoint
    matches: Callable[[Any], bool]
    error: Exception
    times: int | None = None
    raised: int = 0
    """How often it fired."""


class FaultPlan:
    """The faults planted on one core; consulted by ``reach``."""

    def __init__(self) -> None:
        self.planted: list[Planted] = []

    def plant(
        self,
        point: FaultPoint,
        matches: Callable[[Any], bool],
        error: Exception,
        *,
        times: int | None = None,
    ) -> Planted:
        """Raise ``error`` at ``point`` whenever ``matches(subject)``; ``times`` bounds how
        often (None: until ``clear``)."""
        if times is not None and times < 1:
            raise ValueError(f"times must be at least 1 or None, not {times}")
        planted = Planted(point=point, matches=matches, error=error, times=times)
        self.planted.append(planted)
        return planted

    def clear(self) -> None:
        """Remove every planted fault: the core runs as if none had been planted."""
        self.planted.clear()

    def reach(self, point: FaultPoint, subject: object) -> None:
        """Called by the core at ``point`` for ``subject``: raises the first fault planted
        there that matches it."""
        for planted in self.planted:
            if planted.point is not point or not planted.matches(subject):
                continue
            if planted.times is not None and planted.raised >= planted.times:
                continue
            planted.raised += 1
            raise planted.error


class Plantable(Protocol):
    """A core that consults a plan (``ProxyCore``)."""

    planted: FaultPlan | None


def plant_faults(core: Plantable) -> FaultPlan:
    """The plan ``core`` consults, made and hung on it on first use."""
    plan = core.planted
    if plan is None:
        plan = core.planted = FaultPlan()
    return plan

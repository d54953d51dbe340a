"""Validation of a group's ``queue`` table: its size, its deadlines (``timeout``, and
``max_wait`` per priority class), ``retry_after`` and ``affinity_wait``.

Internal to :mod:`muxproxy.config`; :mod:`.upstreams` calls it. Each function checks one value
at one key path, reports through the :class:`Checker` and returns the record, or None when
something was wrong.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from muxproxy.config.checker import Checker, Key, describe, join
from muxproxy.config.queue import PRIORITIES, AdmissionQueue
from muxproxy.config.ranges import RANGES, outside, pattern

__all__ = ["admission_queue", "max_wait", "seconds_or_zero"]


def seconds_or_zero(check: Checker, value: Any, path: str) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value == 0:
            return 0.0
        if value > 0 and math.isfinite(value):
            return float(value)
    check.add(
        path, f"expected 0 (off) or a positive, finite number of seconds, got {describe(value)}"
    )
    return None


def admission_queue(check: Checker, value: Any, path: str) -> AdmissionQueue | None:
    values = check.table(value, path, _QUEUE_KEYS)
    return None if values is None else AdmissionQueue(**values)


def max_wait(check: Checker, value: Any, path: str) -> tuple[tuple[int, float], ...] | None:
    """``queue.max_wait``: a table of priority classes (``"0"``..``"9"``) to deadlines, each
    in ``queue.timeout``'s range (a deadline, as it is)."""
    if not isinstance(value, Mapping):
        check.add(
            path,
            f'expected a table of priority classes, e.g. {{ 0 = 60, 9 = "2s" }}, got'
            f" {describe(value)}",
        )
        return None
    limits = RANGES[pattern(path).rpartition(".")[0] + ".timeout"]
    found: list[tuple[int, float]] = []
    valid = True
    for key, seconds in value.items():
        where = join(path, key)
        if key not in _CLASSES:
            check.add(where, f"expected a priority class 0..{PRIORITIES - 1} as the key")
            valid = False
            continue
        converted = _seconds(seconds)
        problem = (
            f'expected seconds (a number) or a duration such as "30s", "500ms" or "2m",'
            f" got {describe(seconds)}"
            if converted is None
            else outside(limits, converted)
        )
        if problem is not None:
            check.add(where, problem)
            valid = False
        elif converted is not None:
            found.append((int(key), converted))
    return tuple(sorted(found)) if valid else None


_CLASSES = frozenset(str(level) for level in range(PRIORITIES))
"""The keys of ``max_wait``: the priority classes as ``priority`` reads them, one digit."""
_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h)\s*\Z")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def _seconds(value: Any) -> float | None:
    """Seconds from a number or a duration with its unit (``"30s"``), unchecked for range."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        # An integer too large for a float is an infinity: refused by the range.
        return float(value) if abs(value) < 2**1000 else math.inf
    if isinstance(value, str) and (match := _DURATION.match(value)):
        return float(match[1]) * _UNITS[match[2]]
    return None


_QUEUE_KEYS = {
    "max": Key(Checker.count),
    "timeout": Key(Checker.seconds),
    "max_wait": Key(max_wait),
    "retry_after": Key(Checker.positive_int),
    "affinity_wait": Key(seconds_or_zero),
}

"""Server health: passive (failures of real requests) and active (probe results).

Obeys the routing rules: pure code, standard library and attrs only (no trio, asyncio,
socket, ssl, select, time, random), no I/O; time is passed in as ``now`` (seconds on any
monotonic clock). Why: the core decides with the same state every replica could rebuild,
and tests drive time explicitly instead of sleeping or mocking a clock.

Indices refer to positions in a group's ``servers`` tuple. A reload that changes the servers
carries each kept server's state over by address: ``carry(old, moves)`` with ``moves`` the
``(old index, new index)`` pairs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from muxproxy.config import HealthCheck, Server

__all__ = ["ActiveHealth", "PassiveHealth", "usable_servers"]


class PassiveHealth:
    """nginx ``max_fails``/``fail_timeout``.

    ``max_fails`` failures within ``fail_timeout`` seconds (counted from the first of them)
    take a server out for ``fail_timeout`` seconds; after that it is tried again. One success
    resets the count; until then the server is on probation and its next failure takes it
    out again at once, as in nginx. ``max_fails = 0`` never takes a server out. Failures
    reported while a server is out (requests that were already in flight) change nothing.
    """

    __slots__ = ("_down_until", "_fails", "_window_start")

    def __init__(self, size: int) -> None:
        self._fails = [0] * size
        self._window_start = [0.0] * size
        self._down_until = [-math.inf] * size

    def failure(self, index: int, now: float, server: Server) -> bool:
        """Count a failure of ``server`` (at ``index``); True if it took the server out."""
        max_fails = server.max_fails
        if max_fails <= 0 or now < self._down_until[index]:
            return False
        fails = self._fails[index]
        if fails >= max_fails:
            pass  # on probation: the first failure after coming back takes it out again
        elif fails == 0 or now - self._window_start[index] > server.fail_timeout:
            fails = 1
            self._window_start[index] = now
        else:
            fails += 1
        self._fails[index] = fails
        if fails < max_fails:
            return False
        self._down_until[index] = now + server.fail_timeout
        return True

    def success(self, index: int) -> None:
        """A request to the server succeeded: forget its failures.

        A server that is out stays out until its ``fail_timeout`` has passed, but comes back
        with a clean count instead of on probation.
        """
        self._fails[index] = 0

    def usable(self, index: int, now: float) -> bool:
        return now >= self._down_until[index]

    def failures(self, index: int, now: float, server: Server) -> int:
        """Failures counted now: those of the current ``fail_timeout`` window, while the
        server is out, or on probation; 0 once the window has passed without one."""
        fails = self._fails[index]
        if fails == 0 or fails >= server.max_fails or now < self._down_until[index]:
            return fails
        return fails if now - self._window_start[index] <= server.fail_timeout else 0

    def carry(self, old: PassiveHealth, moves: Sequence[tuple[int, int]]) -> None:
        """Take over ``old``'s state of the servers that ``moves`` maps to this one's."""
        for before, after in moves:
            self._fails[after] = old._fails[before]
            self._window_start[after] = old._window_start[before]
            self._down_until[after] = old._down_until[before]

    def out_until(self, index: int) -> float | None:
        """When a server that was taken out may be tried again; None if never taken out."""
        until = self._down_until[index]
        return None if until == -math.inf else until


class ActiveHealth:
    """Probe results with thresholds.

    ``check.fails`` consecutive failures take an up server down; ``check.passes`` consecutive
    passes bring a down server up (thresholds below 1 count as 1). Servers start up.
    """

    __slots__ = ("_fails", "_passes", "_streak", "_up")

    def __init__(self, size: int, check: HealthCheck) -> None:
        self._fails = max(1, check.fails)
        self._passes = max(1, check.passes)
        self._up = [True] * size
        self._streak = [0] * size
        """Consecutive results that argue for a change of state."""

    def set_thresholds(self, check: HealthCheck) -> None:
        """Use ``check``'s thresholds from now on; the servers' states and streaks stay."""
        self._fails = max(1, check.fails)
        self._passes = max(1, check.passes)

    def result(self, index: int, ok: bool) -> bool:
        """Record one probe result; True if the server's state changed."""
        up = self._up[index]
        if ok == up:  # agrees with the current state: any streak towards a change is broken
            self._streak[index] = 0
            return False
        streak = self._streak[index] + 1
        if streak < (self._fails if up else self._passes):
            self._streak[index] = streak
            return False
        self._streak[index] = 0
        self._up[index] = not up
        return True

    def up(self, index: int) -> bool:
        return self._up[index]

    def carry(self, old: ActiveHealth, moves: Sequence[tuple[int, int]]) -> None:
        """Take over ``old``'s states and streaks of the servers ``moves`` maps here."""
        for before, after in moves:
            self._up[after] = old._up[before]
            self._streak[after] = old._streak[before]


def usable_servers(
    servers: Sequence[Server],
    weights: Sequence[int],
    passive: PassiveHealth,
    active: ActiveHealth | None,
    now: float,
    *,
    for_new_sessions: bool,
    down: Sequence[bool] | None = None,
) -> list[int]:
    """Indices of the servers usable now, in index order.

    A server is usable when the operator has not set it down (``down[i]``, if given),
    passive health has not taken it out and active health (if any) has it up. With
    ``for_new_sessions`` servers with weight <= 0 (draining) are left out as well, before
    the next rule. Primaries come first: if any primary is usable the result is
    the usable primaries, otherwise the usable backups (possibly none).
    """
    primaries: list[int] = []
    backups: list[int] = []
    for index, server in enumerate(servers):
        if for_new_sessions and weights[index] <= 0:
            continue
        if down is not None and down[index]:
            continue
        if not passive.usable(index, now):
            continue
        if active is not None and not active.up(index):
            continue
        (backups if server.backup else primaries).append(index)
    return primaries or backups

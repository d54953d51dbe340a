"""The ``Date`` field (RFC 9110 §6.6.1) for a core that reads no clock.

RFC 9110 §6.6.1: a recipient with a clock that forwards a response without ``Date`` MUST add
one, and an origin with a clock sends one; the proxy is the origin of its own responses (404,
502, 504...). The core's time is the driver's monotonic ``event.now``, which says nothing about
the calendar, so the driver also hands it the wall-clock time, ``wall`` (``time.time()`` at the
same instant as ``now``), on ``ConfigChanged`` and on every ``ConnectionAccepted``: the offset
between the two is kept, and refreshed with each new connection, so a stepped system clock is
followed from the next connection on. A core never given a wall time (most core tests) has no
clock and adds no ``Date``, which keeps its output deterministic.

Formatting a date per response would be per-request work for a value that changes once a
second: the IMF-fixdate is cached for the current second, so a response costs one addition,
one ``int`` and one comparison.
"""

from __future__ import annotations

from email.utils import formatdate

__all__ = ["HttpDate"]


class HttpDate:
    """The current ``Date`` value, from monotonic time plus the offset the driver gave."""

    def __init__(self) -> None:
        self.offset: float | None = None
        """Wall-clock seconds minus monotonic seconds; None: the core has no clock."""
        self._second = -1
        self._value = b""

    def set_wall(self, now: float, wall: float) -> None:
        """``wall`` (POSIX seconds) is the wall-clock time at monotonic ``now``."""
        self.offset = wall - now

    def at(self, now: float) -> bytes | None:
        """The IMF-fixdate (RFC 9110 §5.6.7) at monotonic ``now``, or None without a clock."""
        offset = self.offset
        if offset is None:
            return None
        second = int(now + offset)
        if second != self._second:
            self._second = second
            # RFC 9110 §5.6.7 IMF-fixdate: "Sun, 06 Nov 1994 08:49:37 GMT".
            self._value = formatdate(second, usegmt=True).encode("ascii")
        return self._value

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
one ``int`` and one comparison. The formatting is done here from ``datetime`` rather than by
``email.utils.formatdate``: importing ``email.utils`` would load the ``email`` package,
``calendar`` and ``locale`` (half a MiB) into every serving process for this one line.
"""

from __future__ import annotations

from datetime import UTC, datetime

__all__ = ["HttpDate", "imf_fixdate"]

_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
"""``datetime.weekday()`` order. RFC 9110 §5.6.7: day-name, case-sensitive."""
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
"""RFC 9110 §5.6.7: month, case-sensitive (never the locale's names)."""


def imf_fixdate(second: int) -> bytes:
    """RFC 9110 §5.6.7 IMF-fixdate of POSIX time ``second``: ``Sun, 06 Nov 1994 08:49:37 GMT``."""
    t = datetime.fromtimestamp(second, UTC)
    return (
        f"{_DAYS[t.weekday()]}, {t.day:02d} {_MONTHS[t.month - 1]} {t.year:04d}"
        f" {t.hour:02d}:{t.minute:02d}:{t.second:02d} GMT"
    ).encode("ascii")


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
            self._value = imf_fixdate(second)
        return self._value

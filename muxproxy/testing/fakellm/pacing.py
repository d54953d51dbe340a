"""What paces one generation's tokens: :class:`TokenClock`, and :class:`Timetable`, the clock
of a generation on its own timetable (the engine model off, or not batching).

Trio's clock only (``trio.sleep_until``), so tests on a mock clock pace the fake the same way.
"""

from __future__ import annotations

from typing import Protocol

import attrs
import trio


class TokenClock(Protocol):
    """What paces one generation's tokens."""

    async def wait_generated(self, count: int) -> None:
        """Return once ``count`` tokens are out (0: once the first could be)."""
        ...


@attrs.frozen
class Timetable:
    """Tokens on a generation's own timetable: token ``i`` at ``start + first_delay + i *
    delay``."""

    start: float
    first_delay: float
    delay: float

    async def wait_generated(self, count: int) -> None:
        await trio.sleep_until(self.start + self.first_delay + max(count - 1, 0) * self.delay)

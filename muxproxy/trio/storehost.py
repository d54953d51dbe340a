"""What a store's client sees of the driver that runs it (:mod:`.resumestore`,
:mod:`.fleetbudgets`): its core, its nursery, how it feeds an event and logs a line.

A :class:`typing.Protocol`, so that the driver (which starts the stores on their first
command) and the stores do not import each other: the driver is what satisfies it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import trio

    from muxproxy.core.commands import Log
    from muxproxy.core.events import Event
    from muxproxy.core.proxy import ProxyCore

__all__ = ["StoreHost"]


class StoreHost(Protocol):
    core: ProxyCore
    nursery: trio.Nursery
    raise_errors: bool

    def feed(self, event: Event) -> None:
        """Hand ``event`` to the core, from any task of the driver's nursery."""
        ...

    def log(self, command: Log) -> None:
        """Write ``command`` to the error log (as the core's own ``Log`` commands go)."""
        ...

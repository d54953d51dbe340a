"""The core's tables: everything that runs, as the owner's helpers see it.

``ProxyCore`` keeps a table per kind of part (client connections, backend connections,
exchanges, tunnels, probes) and routes each event through them. Two helpers of the owner act on
all of them at once, and so are the only modules besides ``proxy.py`` that know the concrete
parts: fault isolation (``faults.py``: drop what a bug left half-updated) and the graceful stop
(``shutdown.py``: stop every connection). They see the core through ``CoreTables``, which
``ProxyCore`` has by its shape; neither imports ``proxy.py``.
"""

from __future__ import annotations

from typing import Protocol

from muxproxy.core.client.downstream import Downstream
from muxproxy.core.effects import Effects
from muxproxy.core.exchange.exchange import Exchange
from muxproxy.core.faultplan import FaultPlan
from muxproxy.core.ports import BackendConnection
from muxproxy.core.tunnel.tunnel import Tunnel
from muxproxy.core.upstream.pool import Pool
from muxproxy.core.upstream.probes import Probe


class CoreTables(Protocol):
    """What the owner's helpers read and change of the core."""

    fx: Effects
    raise_errors: bool
    """Let an internal error escape instead of containing it (tests, fuzzing)."""
    planted: FaultPlan | None
    """Faults a test planted (``faultplan.py``); None but in tests."""
    counters: dict[str, int]
    clients: dict[int, Downstream]
    upstreams: dict[int, BackendConnection]
    exchanges: dict[int, Exchange]
    tunnels: dict[int, Tunnel]
    probes: dict[int, Probe]
    pool: Pool

    @property
    def drained(self) -> bool:
        """Stopping, and nothing is left."""

"""The records of a fleet's configuration: ``[fleet]`` (the shared store) and ``[resolver]``
(the DNS servers discovery asks).

A leaf module (no import from the rest of :mod:`muxproxy.config`), so :mod:`.records` can name
these types in :class:`~muxproxy.config.records.Config`; the checks are in :mod:`.loading`.
What is shared through the store, and what each replica keeps for itself, is ``docs/fleet.md``.
"""

from __future__ import annotations

import enum

import attrs

__all__ = ["FleetSettings", "ResolverSettings", "StoreErrorPolicy"]


class StoreErrorPolicy(enum.Enum):
    """What fleet-wide budgets do while the store cannot be reached (``on_store_error``)."""

    LOCAL = "local"
    """Each replica enforces its share of every budget: the budget divided by the number of
    replicas it last saw in the store."""
    OPEN = "open"
    """Admit as if there were no budget (availability first)."""
    CLOSED = "closed"
    """Refuse what a budget governs with 503 (the budget first)."""


@attrs.frozen(kw_only=True)
class FleetSettings:
    """``[fleet]``: the store every replica shares runtime state, sessions and budgets through."""

    store: str
    """The Redis URL (``redis://``, ``rediss://``, ``redis+sentinel://``), as ``resume.store``."""
    on_store_error: StoreErrorPolicy = StoreErrorPolicy.LOCAL
    """Budgets while the store is down (:class:`StoreErrorPolicy`)."""
    sync_interval: float = 5.0
    """Seconds between full reconciliations with the store, beside its published changes."""


@attrs.frozen(kw_only=True)
class ResolverSettings:
    """``[resolver]``: how discovery (``discover`` in a group) asks DNS."""

    nameservers: tuple[str, ...] = ()
    """``host:port`` (or a bare address, port 53) of each DNS server; empty: the system's
    (``/etc/resolv.conf``)."""
    timeout: float = 2.0
    """Seconds one lookup may take, every attempt included."""
    attempts: int = 2
    """Tries per nameserver within ``timeout`` before the lookup fails."""

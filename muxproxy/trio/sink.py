"""What the reactor (``reactor.py``) needs of its driver (``driver.py``): a :class:`Sink`.

The reactor serves plain TCP sockets and the driver owns everything else the core's events
and commands touch (the core, the connection table, the reports fed after a batch). The
reactor knows the driver by this protocol alone, so it imports nothing from ``driver.py`` and
reaches none of its attributes: it feeds events, brackets each round of ready sockets, and
reports what the kernel took and which connections closed. ``Driver`` implements it.

On the hot path (one read, its token relayed) the reactor makes one :meth:`Sink.feed` and one
:meth:`Sink.sent_now` call per token, as it made them to the driver before, and one
:meth:`Sink.begin_round` per round of ready sockets.
"""

from __future__ import annotations

from typing import Protocol

from muxproxy.core.events import Event


class Sink(Protocol):
    """What the reactor needs of its driver (``driver.Driver``): where the events go.

    Every call is made from the reactor's round, between :meth:`begin_round` and
    :meth:`settle`, but for the reports of ``Reactor.close`` and ``Reactor.abandon``, which
    the driver calls while it executes a command.
    """

    @property
    def raise_errors(self) -> bool:
        """A bug in per-connection code raises instead of closing the one connection."""

    def begin_round(self) -> None:
        """A round of ready sockets starts: :meth:`feed` leaves settling to :meth:`settle`."""

    def end_round(self) -> None:
        """The round ended without :meth:`settle` (an exception escaped it)."""

    def settle(self, now: float) -> None:
        """End the round: write what it queued (``Reactor.write_queued``) and feed what that
        caused, until nothing is left; ``now`` is the round's time."""

    def feed(self, event: Event) -> None:
        """Hand one event to the core and carry out its commands."""

    def sent_now(self, ident: int, nbytes: int) -> None:
        """The kernel took ``nbytes`` of ``ident``'s output (fed as ``DataSent`` by settle)."""

    def closed_now(self, ident: int, error: str | None) -> None:
        """``ident`` is closed (fed as ``ConnectionClosed`` by settle)."""

    def open_failed_now(self, ident: int, reason: str) -> None:
        """The connect of ``ident`` failed (fed as ``OpenFailed`` by settle)."""

    def forget(self, ident: int) -> None:
        """``ident`` takes no more commands: it is closed, or lingering after the core heard
        it closed (see ``reactor.py``)."""

    def connection_failed(self, ident: int, exc: BaseException, *, where: str) -> None:
        """A bug in the driver's code for ``ident``: log and count it, close the connection."""

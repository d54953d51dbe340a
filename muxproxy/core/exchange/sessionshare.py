"""The core's side of the shared memory of sessions: what it remembered goes out in batches,
what others remembered comes in (``fleet/sessions.py`` says what is shared and why).

Off unless the driver asks for it (``enable``: the worker of a supervisor, or a process with
``[fleet] store``): then each routing memory (``Affinity``) calls ``remembered`` on every
``sent``, which queues the entry in an ``Outbox`` and, for the first entry of a batch, arms
the ``CoreTimer.SESSIONS`` timer ``SHARE_DELAY`` seconds ahead. When it fires (or the outbox
is full) the batch goes out as one ``SessionsRemembered`` command. So a request costs a dict
insert and, once per batch, a timer; the token path is not touched at all.

``SessionsLearned`` applies entries from elsewhere to the routing memories of the groups of
the configuration in force, newest wins (``Affinity.learn``); entries of a group this
configuration lacks, or older than its ``sticky.session_idle``, are not taken.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any

from muxproxy.core.commands import SessionsRemembered
from muxproxy.core.effects import Effects
from muxproxy.core.events import SessionsLearned
from muxproxy.core.timers import CoreTimer
from muxproxy.fleet.sessions import SHARE_DELAY, Outbox

if TYPE_CHECKING:
    from muxproxy.config import Upstream
    from muxproxy.routing.router import GroupRouter

SESSIONS_TIMER = (CoreTimer.SESSIONS, 0)


class SessionSharing:
    """Batches of remembered sessions out, learned ones in, and their counts."""

    def __init__(
        self,
        fx: Effects,
        router_of: Callable[[Upstream], GroupRouter],
        routers: Callable[[], Iterable[GroupRouter]],
    ) -> None:
        """``router_of``: the router of a group (``ProxyCore.router``); ``routers``: those
        of the configuration in force."""
        self.fx = fx
        self._router_of = router_of
        self._routers = routers
        self.enabled = False
        """Whether what is remembered is shared (``enable``)."""
        self.outbox = Outbox()
        self._armed = False
        self.shared = 0
        """Entries handed out in ``SessionsRemembered`` commands."""
        self.learned = 0
        """Entries from elsewhere taken by a routing memory."""
        self.ignored = 0
        """Entries from elsewhere not taken: older than held, expired, or of no group here."""
        self.store_errors = 0
        """Failures of the fleet store's session memory, counted by the driver when this
        process talks to the store itself (``muxproxy.trio.fleetsessions``)."""
        self.store_status: Callable[[], dict[str, Any]] | None = None
        """The store's state for ``status`` (the driver's; None: not talking to one)."""

    def enable(self) -> None:
        """Share from now on (each router made later is attached as it is made)."""
        self.enabled = True
        for router in self._routers():
            self.attach(router)

    def attach(self, router: GroupRouter) -> None:
        """Make ``router``'s memory report what it remembers (when sharing is on)."""
        if self.enabled:
            router.affinity.share = partial(self.remembered, router.group.name)

    def remembered(self, group: str, key: int, address: str, at: float) -> None:
        """``Affinity.share``: the key of hash ``key`` was sent to ``address`` at ``at``."""
        if self.outbox.add(group, key, address, at):
            self.flush()
        elif not self._armed:
            self._armed = True
            self.fx.set_timer(SESSIONS_TIMER, at + SHARE_DELAY)

    def due(self) -> None:
        """The batch's timer fired."""
        self._armed = False
        self.flush()

    def flush(self) -> None:
        """Hand out what is queued, now."""
        if self._armed:
            self._armed = False
            self.fx.cancel_timer(SESSIONS_TIMER)
        entries = self.outbox.take()
        if entries:
            self.shared += len(entries)
            self.fx.emit(SessionsRemembered(entries=entries))

    def learn(self, event: SessionsLearned) -> None:
        """Apply entries remembered elsewhere (see the module header)."""
        upstreams = self.fx.config.upstreams
        now = event.now
        for entry in event.entries:
            group = upstreams.get(entry.group)
            if group is not None:
                memory = self._router_of(group).affinity
                if memory.learn(entry.key, entry.address, entry.at, now):
                    self.learned += 1
                    continue
            self.ignored += 1

    def status(self) -> dict[str, Any]:
        """``ProxyCore.status()``'s ``sessions``: keys remembered, sent out, learned."""
        return {
            "shared": self.enabled,
            "remembered": sum(len(router.affinity) for router in self._routers()),
            "sent_out": self.shared,
            "learned": self.learned,
            "ignored": self.ignored,
            **({} if self.store_status is None else {"store": self.store_status()}),
        }

"""The I/O of following an engine's KV-cache events: one Trio task per engine, subscribed to
its ZeroMQ publisher, feeding a :class:`Feed` (an :class:`~muxproxy.routing.kvfeed.EngineFeed`,
or in the proxy the core, through ``trio/kvfollow.py``).

The decisions (what a message does to the index, when the index is trusted) are
``routing/kvfeed.py``'s; this module only connects, reads and waits. A connection that
fails or drops is retried after a delay that doubles from :data:`RETRY_MIN` to
:data:`RETRY_MAX`, reset by a connection that worked; the engine's index stays untrusted
meanwhile and the router falls back to its approximate key. Each failure is logged when it
differs from the previous one (a dead engine logs once, not every retry); a refused message
is logged at most once per :data:`LOG_INTERVAL`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import trio

from muxproxy.trio.zmtp import ZmtpError, subscribe

__all__ = ["LOG_INTERVAL", "RETRY_MAX", "RETRY_MIN", "Feed", "follow"]

log = logging.getLogger("muxproxy")

RETRY_MIN = 0.5
"""Seconds before the first retry of a failed subscription."""
RETRY_MAX = 30.0
"""The longest wait between retries."""
LOG_INTERVAL = 60.0
"""Seconds between two logged refused messages of one engine."""


class Feed(Protocol):
    """What a subscription feeds: ``routing.kvfeed.EngineFeed`` itself, or the driver's
    hand-over to the core (``trio/kvfollow.py``)."""

    @property
    def topic(self) -> bytes: ...

    def up(self, now: float) -> None: ...

    def message(self, parts: list[bytes], now: float) -> str | None: ...

    def down(self) -> None: ...

    def failed(self, reason: str) -> None: ...


async def follow(
    name: str,
    host: str,
    port: int,
    feed: Feed,
    *,
    on_change: Callable[[], None] = lambda: None,
    retry_min: float = RETRY_MIN,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep ``feed`` subscribed to ``host:port`` until cancelled; ``name`` names the engine in
    logs. ``on_change`` is called after each message applied. ``task_status.started()`` is
    reported after the first subscription (or the first failure). ``retry_min``: the first
    retry's delay."""
    delay = retry_min
    last_failure: str | None = None
    logged_at = -LOG_INTERVAL
    started = False
    while True:
        try:
            subscription = await subscribe(host, port, feed.topic)
        except (OSError, ZmtpError) as error:
            failure = f"{type(error).__name__}: {error}"
        else:
            feed.up(trio.current_time())
            if last_failure is not None:
                log.info("kv events: %s: subscribed again to %s:%d", name, host, port)
            last_failure = None
            delay = retry_min
            if not started:
                task_status.started()
                started = True
            try:
                while True:
                    parts = await subscription.receive()
                    now = trio.current_time()
                    note = feed.message(parts, now)
                    if note is not None and now - logged_at >= LOG_INTERVAL:
                        logged_at = now
                        log.warning("kv events: %s: %s", name, note)
                    on_change()
            except (OSError, ZmtpError, trio.BrokenResourceError) as error:
                failure = f"{type(error).__name__}: {error}"
            finally:
                feed.down()
                with trio.CancelScope(shield=True):
                    await subscription.aclose()
        feed.failed(failure)
        if failure != last_failure:
            log.warning(
                "kv events: %s: no events from %s:%d (%s); placing by the prefix key until"
                " they come back",
                name,
                host,
                port,
                failure,
            )
            last_failure = failure
        if not started:
            task_status.started()
            started = True
        await trio.sleep(delay)
        delay = min(delay * 2, RETRY_MAX)

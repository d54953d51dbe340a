"""A Redis client from a store URL, for every part that uses the store: resume
(:mod:`.resumestore`), the fleet's runtime state (:mod:`.fleetstate`), session memory
(:mod:`.fleetsessions`) and budgets (:mod:`.fleetbudgets`).

One reading of a URL for all of them (``config/storeurl.py`` checks it at load): ``redis://``
and ``rediss://`` as they are, ``redis+sentinel://`` through ``coredis.Sentinel``, which finds
the primary again when Sentinel fails it over. A URL may hold a password: what goes to a log
or to ``/status`` is :func:`redacted`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, NoReturn

import trio

from muxproxy.config.storeurl import is_sentinel, parse_sentinel, redacted

if TYPE_CHECKING:
    import coredis

__all__ = ["client_of", "keep_serving", "redacted", "store_errors"]


@asynccontextmanager
async def client_of(url: str) -> AsyncIterator[coredis.Redis[bytes]]:
    """A client of ``url``: ``redis://`` or ``rediss://`` as it is, ``redis+sentinel://``
    through ``coredis.Sentinel`` (the primary it names, found again when it fails over).

    ``coredis`` is imported here, not with the module: a proxy without a store never loads it
    (:func:`redacted` is used without one)."""
    import coredis
    from coredis.connection import TCPLocation

    if not is_sentinel(url):
        async with coredis.Redis.from_url(url, verify_version=False) as client:
            yield client
        return
    parts = parse_sentinel(url)
    sentinel = coredis.Sentinel([TCPLocation(host, port) for host, port in parts.sentinels])
    async with sentinel:
        primary = sentinel.primary_for(parts.service, db=parts.db, password=parts.password)
        async with primary:
            yield primary


def store_errors() -> tuple[type[BaseException], ...]:
    """What a store that fails raises: coredis's errors, a socket's, a timeout, and anyio's
    closed and broken resources (coredis runs on anyio: a connection closed under a command or
    a subscription surfaces as those, also while it is closed on a cancellation)."""
    import anyio
    from coredis.exceptions import RedisError

    return (
        RedisError,
        OSError,
        trio.TooSlowError,
        anyio.ClosedResourceError,
        anyio.BrokenResourceError,
    )


async def keep_serving(
    serve: Callable[[], Awaitable[None]],
    failed: Callable[[BaseException], None],
    *,
    errors: tuple[type[BaseException], ...],
    delay: float,
    reset: Callable[[], None] = lambda: None,
) -> NoReturn:
    """Run ``serve`` (one client's life) again and again. When it fails with ``errors`` (alone,
    or an exception group of nothing else), ``failed`` is told, ``reset`` called, and the next
    try waits ``delay`` seconds; a store that is down costs one try per ``delay``. Anything
    else (a cancellation, a bug of ours) propagates: a failing store never ends the proxy, and
    nothing but a failing store is swallowed."""
    while True:
        try:
            await serve()
        except errors as exc:
            failed(exc)
        except BaseExceptionGroup as group:
            failures, rest = group.split(errors)
            if rest is not None:
                # A cancellation, or a bug of ours, without the store's errors beside it (a
                # connection closed under a command as it was cancelled is no news).
                raise rest from None
            failed(failures or group)
        reset()
        await trio.sleep(delay)

"""A Redis client from a store URL, for every part that uses the store: resume
(:mod:`.resumestore`), the fleet's runtime state (:mod:`.fleetstate`), session memory
(:mod:`.fleetsessions`) and budgets (:mod:`.fleetbudgets`).

One reading of a URL for all of them (``config/storeurl.py`` checks it at load): ``redis://``
and ``rediss://`` as they are, ``redis+sentinel://`` through ``coredis.Sentinel``, which finds
the primary again when Sentinel fails it over. A URL may hold a password: what goes to a log
or to ``/status`` is :func:`redacted`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from ..config.storeurl import is_sentinel, parse_sentinel

if TYPE_CHECKING:
    import coredis

__all__ = ["client_of", "redacted"]


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


def redacted(url: str) -> str:
    """``url`` without a password (it goes to the logs)."""
    scheme, sep, rest = url.partition("://")
    at = rest.rfind("@")
    return f"{scheme}{sep}{rest[at + 1 :]}" if at >= 0 else url

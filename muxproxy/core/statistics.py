"""A snapshot of the core's connections and of every stream's buffered bytes
(``ProxyCore.statistics()``), for embedders, the admin status and the tests.

What it obeys, and why: it reads and never changes (no command, no timer, no move of any
part), so a driver may take one between any two events; and it is a copy, frozen, so what it
says stays what was true when it was taken. The per-stream figures are the two sides of the
flow-control rule (``flow.py``): what the backend sent that the client has not taken yet, and
what the client sent that the backend has not.
"""

from __future__ import annotations

from collections.abc import Iterable, Sized
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from muxproxy.core.exchange.exchange import Exchange
    from muxproxy.core.upstream.pool import Pool

__all__ = ["ProxyStatistics", "StreamStatistics", "take_statistics"]


@attrs.frozen(kw_only=True)
class StreamStatistics:
    conn: int
    stream: int
    phase: str
    response_buffered: int
    """Response bytes accepted from the backend and not yet written to the client."""
    request_buffered: int
    """Request bytes accepted from the client and not yet written to the backend."""
    upstream_paused: bool


@attrs.frozen(kw_only=True)
class ProxyStatistics:
    client_connections: int
    upstream_connections: int
    idle_upstream_connections: int
    streams: list[StreamStatistics]


def take_statistics(
    clients: Sized, upstreams: Sized, exchanges: Iterable[Exchange], pool: Pool
) -> ProxyStatistics:
    """The snapshot of the core whose client and backend connections, exchanges and pool
    these are."""
    streams = [
        StreamStatistics(
            conn=ex.client.conn,
            stream=ex.stream,
            phase=ex.phase.value,
            response_buffered=ex.client.buffered(ex.stream),
            request_buffered=ex.request_buffered(),
            upstream_paused=ex.upstream.paused if ex.upstream else False,
        )
        for ex in exchanges
    ]
    idle = sum(len(v) for v in pool.idle.values()) + pool.h2.idle_count
    return ProxyStatistics(
        client_connections=len(clients),
        upstream_connections=len(upstreams),
        idle_upstream_connections=idle,
        streams=streams,
    )

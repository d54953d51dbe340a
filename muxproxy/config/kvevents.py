"""The record of a group's ``kv_events`` table: where each engine publishes its KV-cache
events, and how far the proxy trusts them (``docs/balancing.md``).

Internal to :mod:`muxproxy.config`; checked by :mod:`.kveventkeys`. A record module of its
own, importing nothing of the checking machinery, so :mod:`.records` can name it without an
import cycle (the checking functions sit above the records, as :mod:`.discovery` does).
"""

from __future__ import annotations

import attrs

__all__ = ["KvEvents", "endpoint_host_port"]


@attrs.frozen(kw_only=True)
class KvEvents:
    """``kv_events``: place a prompt on the engine whose KV cache holds the most of it, as
    the engines' own events tell (vLLM's ``--kv-events-config``); ``affinity = "prefix"``
    only."""

    port: int = 5557
    """The port each server's engine publishes its events on (vLLM's ``"endpoint":
    "tcp://*:5557"``); the host is the server's own, so discovered servers work too. A
    server's own ``kv_events`` endpoint overrides it."""
    topic: str = "kv-events"
    """The topic the engine publishes under (vLLM's ``"topic"``)."""
    stale_after: float = 2.0
    """Seconds without an event after which an engine that runs the proxy's streams is no
    longer trusted: its requests are placed by the prefix key until events come again. An
    idle engine publishes nothing and stays trusted."""
    max_blocks: int = 200_000
    """Blocks remembered per engine at most (past it the block stored longest ago is
    forgotten): some 40 MB per engine, above the cache of one GPU of 16-token blocks."""


def endpoint_host_port(endpoint: str) -> tuple[str, int]:
    """``"tcp://host:port"`` (checked by :mod:`.kveventkeys`) as ``(host, port)``; an IPv6
    host loses its brackets."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)

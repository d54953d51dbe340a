"""Which modules the optional compiled build compiles (``setup.py``, ``scripts/compile``), and
which of them this process runs compiled.

The list is the per-token path and the per-request path's busiest parts: the core's event
dispatch, the backend's HTTP/1.1 decoding, the exchange, the client adapters, the output
accounting, and the reactor. mypyc compiles each to a C extension from the same source; a
module left out (the configuration, the data records, the admin API) stays Python and is
called as before. Modules that define ``attrs`` classes with ``attrs.field`` defaults are
left out: mypyc takes those classes for its own dataclasses and gets the defaults wrong.

This file is read by ``setup.py`` with ``runpy``, so it imports nothing of the package.
"""

from __future__ import annotations

import importlib

MODULES = [
    "muxproxy.core.proxy",
    "muxproxy.core.upstream.pool",
    "muxproxy.core.http1.h1client",
    "muxproxy.core.http1.chunked",
    "muxproxy.core.exchange.exchange",
    # Where an exchange goes (every request) and what outlives its client or backend (per
    # token on a resumable route): the exchange's parts, called from it.
    "muxproxy.core.exchange.placement",
    "muxproxy.core.exchange.surviving",
    # The exchange's subclasses: an interpreted class cannot subclass a compiled one.
    "muxproxy.core.exchange.replay",
    "muxproxy.core.tunnel.websocket",
    "muxproxy.core.observe.ssemeter",
    "muxproxy.core.client.downstream",
    "muxproxy.core.http1.h1",
    "muxproxy.core.client.output",
    "muxproxy.core.effects",
    "muxproxy.core.http2.h2send",
    "muxproxy.core.http2.h2",
    "muxproxy.core.streams.sse",
    "muxproxy.core.timers",
    "muxproxy.trio.reactor",
    "muxproxy.trio.socketconn",
    # The request path's other busiest parts: the access line, the fields in and out, the
    # access record, the attempt's bookkeeping, the state tables' step, the choice of a server.
    # Not the driver (its fault-isolation tests replace its methods on an instance, which a
    # compiled class refuses) nor the timer heap (its tests use keys of no timer kind, which
    # compiled code checks against ``TimerKey``).
    "muxproxy.trio.logs",
    "muxproxy.core.http.headers",
    "muxproxy.core.http.intake",
    "muxproxy.core.observe.access",
    "muxproxy.core.exchange.failover",
    "muxproxy.core.states",
    "muxproxy.routing.router",
]


def compiled_modules() -> list[str]:
    """The modules of ``MODULES`` that were imported from a compiled extension."""
    out = []
    for name in MODULES:
        module = importlib.import_module(name)
        if not str(getattr(module, "__file__", "")).endswith(".py"):
            out.append(name)
    return out


def build() -> str:
    """``"compiled"`` (every module of ``MODULES``), ``"partly compiled"`` or
    ``"pure Python"``."""
    done = len(compiled_modules())
    if done == len(MODULES):
        return "compiled"
    return "partly compiled" if done else "pure Python"

"""ASGI helpers shared by muxproxy's own hypercorn apps (the admin API, the fake LLM server)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def serve_lifespan(receive: Receive, send: Send) -> None:
    """Answer the ASGI lifespan protocol: acknowledge startup and shutdown, then return.
    The apps have nothing to set up or tear down here."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return

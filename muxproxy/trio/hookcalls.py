"""The driver's side of the extensions' async hooks: ``ExtensionCall`` awaited in a task of
its own, answered to the core as ``ExtensionAnswered``.

What it obeys: the answer always comes (the core's exchange waits in AWAITING_HOOK for it),
within the extension's ``timeout``: a hook that runs longer is cancelled and answered as an
error, as is one that raises. Catching ``Exception`` here is deliberate: the hook is foreign
code, and its failure is its extension's (the core applies the extension's ``on_error``);
trio's ``Cancelled`` (a ``BaseException``) still ends the task when the server stops.
"""

from __future__ import annotations

from typing import Protocol

import trio

from muxproxy.core.commands import ExtensionCall
from muxproxy.core.events import Event, ExtensionAnswered

__all__ = ["call_hook"]


class Feeds(Protocol):
    """The driver, as far as a hook's task needs it."""

    def feed(self, event: Event) -> None: ...


async def call_hook(driver: Feeds, command: ExtensionCall) -> None:
    """Await ``command``'s hook under its timeout and feed the core its answer."""
    decision: object = None
    error = ""
    try:
        with trio.fail_after(command.timeout):
            decision = await command.extension.on_request_head_async(command.view)
    except trio.TooSlowError:
        error = f"no answer within {command.timeout:g} s"
    except Exception as exc:  # the extension's failure (module header)
        error = f"{type(exc).__name__}: {exc}"
    driver.feed(
        ExtensionAnswered(
            now=trio.current_time(),
            request=command.request,
            position=command.position,
            decision=decision,
            error=error,
        )
    )

"""One proxy process with its admin listener: a ``ProxyServer``, the state file applied before
the first accept, and the admin API (``admin.py``) over a ``LocalControl`` (``control.py``).

Here, not in ``control.py``, so that the admin app and the controls it serves do not import
each other: ``admin`` knows ``control``'s protocol, ``control`` knows no HTTP, and this module
puts the two together for one process (the supervisor of ``--workers`` does the same with its
own ``Control``).
"""

from __future__ import annotations

import os
from functools import partial

import trio

from muxproxy.config import Config
from muxproxy.config.runtime import RuntimeState
from muxproxy.trio.admin import serve_admin
from muxproxy.trio.control import LocalControl, apply_saved_state
from muxproxy.trio.server import ProxyServer

__all__ = ["serve_control", "serve_local"]


async def serve_control(
    server: ProxyServer,
    *,
    config_path: str | os.PathLike[str] | None = None,
    state: RuntimeState | None = None,
    task_status: trio.TaskStatus[tuple[str, int] | None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the admin API of ``server`` (a :class:`LocalControl`) until cancelled, when its
    configuration has an ``[admin]`` section, and follow the fleet store's runtime state when
    it has a ``[fleet]`` one (:class:`~muxproxy.trio.fleetstate.FleetSync`: started before
    the admin API, so no change is ever made here alone); with neither, return at once.

    ``state``: what :func:`apply_saved_state` applied. ``task_status.started`` gets the
    admin address bound, or None. Raises ``OSError`` when the address cannot be bound.
    """
    config = server.config
    control = LocalControl(server, config_path=config_path, state=state)
    async with trio.open_nursery() as nursery:
        if config.fleet is not None:
            from muxproxy.trio.fleetstate import (
                FleetSync,  # coredis only where a store is configured
            )

            control.fleet = FleetSync(
                config.fleet,
                control.state,
                apply=control.apply_runtime,
                state_file=lambda: control.state_file,
            )
            await nursery.start(control.fleet.run)
        settings = config.admin
        if settings is None:
            task_status.started(None)
            return
        await serve_admin(settings.address, control, control.token, task_status=task_status)


async def serve_local(
    config: Config,
    *,
    config_path: str | os.PathLike[str] | None = None,
    task_status: trio.TaskStatus[
        tuple[list[tuple[str, int]], tuple[str, int] | None]
    ] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run one proxy process for ``config`` with its admin listener (when ``config.admin``
    is set; and its fleet store's sync, when ``config.fleet`` is) until cancelled or the server
    stops; the state file is applied first.

    ``task_status.started((proxy addresses, admin address or None))``. Raises ``OSError``
    when a listener cannot be bound or the state file cannot be used.
    """
    server = ProxyServer(config)
    state = apply_saved_state(server)
    async with trio.open_nursery() as nursery:

        async def run_proxy(task_status: trio.TaskStatus[list[tuple[str, int]]]) -> None:
            await server.run(task_status=task_status)
            # The proxy has stopped and drained: its admin listener goes with it.
            nursery.cancel_scope.cancel()

        bound: list[tuple[str, int]] = await nursery.start(run_proxy)
        admin = await nursery.start(
            partial(serve_control, server, config_path=config_path, state=state)
        )
        task_status.started((bound, admin))

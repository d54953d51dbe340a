"""What the admin API controls: the :class:`Control` protocol, and :class:`LocalControl`.

The admin listener (:mod:`muxproxy.trio.admin`) speaks HTTP and knows nothing of the proxy;
it calls a ``Control``. One process serving alone is controlled by :class:`LocalControl`,
over its :class:`~muxproxy.trio.server.ProxyServer`; a supervisor of worker processes
implements the same protocol by asking its workers, so the admin API is the same either way.

Runtime changes (weight, drain, down) obey four rules. They are applied to the core as a
whole :class:`~muxproxy.config.runtime.RuntimeState`, never as a delta, so every process
that receives the state agrees on it; a change of several servers of a group (a gray
release's step) is validated whole and applied as one state, so no request sees half of it.
They are saved to the state file *before* they are applied: a change the API answered with
200 survives a crash that follows. They are serialised by one lock, so two concurrent
requests cannot save one state and apply another. And with a fleet store (``[fleet] store``,
:class:`~muxproxy.trio.fleetstate.FleetSync`) a change is written to the store first, and
answered once the store has it; while the store cannot be reached it is refused (503) rather
than made on this replica alone.

Readiness (:class:`Readiness`, ``GET /ready``) is read from the lifecycle's own state, the
server's :class:`~muxproxy.trio.server.Phase` here and the supervisor's phase and workers
there, without asking any process: a probe's answer never waits behind a busy worker, and the
moment a graceful stop begins is the moment it turns.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, assert_never

import attrs
import trio

from muxproxy.config import Config, ConfigError, load_config
from muxproxy.config.runtime import RuntimeState, load_state, resolve_server, save_state
from muxproxy.fleet.state import StoreUnavailable
from muxproxy.trio.discovery import with_discovery
from muxproxy.trio.metrics import render
from muxproxy.trio.server import Phase

if TYPE_CHECKING:
    from muxproxy.trio.fleetstate import FleetSync
    from muxproxy.trio.server import ProxyServer

__all__ = [
    "AdminError",
    "Control",
    "LocalControl",
    "Readiness",
    "ReloadResult",
    "answer_of_one",
    "apply_saved_state",
    "change_model_weights",
    "change_runtime",
    "changed_models",
    "changed_servers",
    "commit_runtime",
    "group_answer",
    "load_runtime_state",
    "models_answer",
    "saved_state",
    "server_status",
]

log = logging.getLogger("muxproxy.admin")


class AdminError(Exception):
    """A request the control plane refuses: ``status`` is the HTTP status to answer with
    (400 bad request, 404 unknown group or server, 409 not possible now, 503 the fleet store
    cannot take a change now), ``message`` says what is wrong and how to fix it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@attrs.frozen(kw_only=True)
class ReloadResult:
    """The outcome of a reload: ``ok`` with the ``generation`` now running, or the
    ``errors`` that kept the file from being applied (the old configuration still runs)."""

    ok: bool
    errors: list[str] = attrs.field(factory=list)
    generation: int


class Readiness(enum.Enum):
    """Whether the proxy takes new traffic, and if not, why (``GET /ready``'s ``reason``).

    The state of the backends is deliberately not part of it: see ``muxproxy.trio.admin``.
    """

    READY = "ready"
    STARTING = "starting"
    """Nothing accepts yet: the listeners are not bound, or (``--workers N``) no worker
    listens, every one of them being replaced; connections wait in the kernel's backlog."""
    STOPPING = "stopping"
    """A graceful stop has begun: new connections are refused, running streams finish
    within ``timeouts.shutdown_grace``. It lasts until the process exits."""


class Control(Protocol):
    """The operations of the admin API, for one process or for a fleet of workers."""

    def readiness(self) -> Readiness:
        """Whether new traffic is taken now; never waits and never raises."""
        ...

    async def status(self) -> dict[str, Any]:
        """JSON-able status: ``groups`` (``ProxyCore.status()``'s), ``listeners``,
        ``generation``, ``workers`` (``[{"pid", "generation"}]``) and, with a fleet store,
        ``fleet`` (``FleetSync.status()``)."""
        ...

    async def change_server(
        self, group: str, server: str, change: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Set ``change`` (validated ``weight``, ``drain``, ``down``) on one server, given by
        its configured address or opaque id; returns the server's new status entry.
        Raises :class:`AdminError` (404 for an unknown group or server)."""
        ...

    async def change_group(
        self, group: str, changes: Mapping[str, Mapping[str, Any]]
    ) -> dict[str, Any]:
        """Set each server's change (server -> validated fields) in ``group`` as one new state:
        all of them or, on any error, none. Returns ``{"group", "version", "servers": [status
        entries]}`` (``version``: the fleet store's, None without one). Raises
        :class:`AdminError` (404 unknown group or server, 400 a bad or repeated entry, 503
        the fleet store cannot be reached)."""
        ...

    async def change_models(self, alias: str, weights: Mapping[str, int | None]) -> dict[str, Any]:
        """Set the runtime weights of ``alias``'s targets (model -> weight; null: the
        configured one) as one new state. Returns ``{"alias", "version", "targets":
        [status entries]}``. Raises :class:`AdminError` (404 unknown alias or target, 400
        every weight 0, 503 the fleet store cannot be reached)."""
        ...

    async def reload(self, restart: bool = False) -> ReloadResult:
        """Re-read the configuration file and apply it (``restart``: and restart the workers
        onto the installed code). Raises :class:`AdminError` when it cannot be attempted."""
        ...

    async def metrics(self) -> bytes:
        """The Prometheus text exposition of every process's measurements."""
        ...


def load_runtime_state(config: Config) -> RuntimeState:
    """The runtime state saved in ``config.admin.state_file``; empty when there is none.

    Raises ``ValueError`` for a state file that is not valid and ``OSError`` for one that
    cannot be read: starting with every weight silently reset would be worse than not
    starting.
    """
    if config.admin is None or config.admin.state_file is None:
        return RuntimeState.empty()
    return load_state(config.admin.state_file)


class LocalControl:
    """:class:`Control` over the :class:`ProxyServer` of this process.

    ``config_path`` is the file ``reload`` reads again (None: started from flags, so there
    is nothing to reload). ``state`` is the runtime state the server started with.
    """

    def __init__(
        self,
        server: ProxyServer,
        *,
        config_path: str | os.PathLike[str] | None = None,
        state: RuntimeState | None = None,
    ) -> None:
        self.server = server
        self.config_path = config_path
        self.state = RuntimeState.empty() if state is None else state
        self.fleet: FleetSync | None = None
        """The fleet store's sync, when ``[fleet]`` is configured (set before serving)."""
        self._lock = trio.Lock()

    def token(self) -> str | None:
        """The admin token of the configuration running now (a reload may change it; the
        admin address stays the one the process started with)."""
        admin = self.server.config.admin
        return None if admin is None else admin.token

    @property
    def state_file(self) -> str | None:
        admin = self.server.config.admin
        return None if admin is None else admin.state_file

    def readiness(self) -> Readiness:
        match self.server.phase:
            case Phase.SERVING:
                return Readiness.READY
            case Phase.NEW:
                return Readiness.STARTING
            case Phase.DRAINING | Phase.CUTTING | Phase.STOPPED:
                return Readiness.STOPPING
            case unknown:
                assert_never(unknown)

    async def status(self) -> dict[str, Any]:
        server = self.server
        status = dict(server.core.status())
        status["generation"] = server.generation
        status["listeners"] = _listeners(server)
        status["workers"] = [{"pid": os.getpid(), "generation": server.generation}]
        if self.fleet is not None:
            status["fleet"] = self.fleet.status()
        if server.discovery is not None:
            with_discovery(status, server.discovery.status(trio.current_time()))
        return status

    async def change_server(
        self, group: str, server: str, change: Mapping[str, Any]
    ) -> dict[str, Any]:
        answer = await self.change_group(group, {server: change})
        return answer_of_one(answer)

    async def change_group(
        self, group: str, changes: Mapping[str, Mapping[str, Any]]
    ) -> dict[str, Any]:
        async with self._lock:
            addresses, version = await change_runtime(
                self.server.config,
                self.state,
                self.state_file,
                group,
                changes,
                apply=self.apply_runtime,
                fleet=self.fleet,
            )
        return group_answer(await self.status(), group, addresses, version)

    async def change_models(self, alias: str, weights: Mapping[str, int | None]) -> dict[str, Any]:
        async with self._lock:
            version = await change_model_weights(
                self.server.config,
                self.state,
                self.state_file,
                alias,
                weights,
                apply=self.apply_runtime,
                fleet=self.fleet,
            )
        return models_answer(await self.status(), alias, version)

    async def apply_runtime(self, state: RuntimeState) -> None:
        """Make ``state`` the server's runtime state (whole) from its next request on."""
        self.server.apply_runtime(state)
        self.state = state

    async def reload(self, restart: bool = False) -> ReloadResult:
        if restart:
            raise AdminError(
                400,
                "a rolling restart needs worker processes (muxproxy serve --workers N); a"
                " single process is restarted by restarting it",
            )
        if self.config_path is None:
            raise AdminError(
                400,
                "nothing to reload: muxproxy serve was started from flags, not --config FILE",
            )
        async with self._lock:
            server = self.server
            try:
                config = await trio.to_thread.run_sync(load_config, self.config_path)
            except ConfigError as exc:
                return ReloadResult(ok=False, errors=exc.problems, generation=server.generation)
            # Checked after the file was read (in a thread): a stop may have begun meanwhile.
            if server.phase is not Phase.SERVING:
                raise AdminError(409, f"cannot reload: the server is {server.phase.value}")
            try:
                added = server.reload(config)
            except OSError as exc:
                return ReloadResult(ok=False, errors=[str(exc)], generation=server.generation)
            for listener, (host, port) in added:
                shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
                log.info("listening on %s (%s, reloaded)", shown, listener.address)
            return ReloadResult(ok=True, generation=server.generation)

    async def metrics(self) -> bytes:
        snapshots = [self.server.core.measurements.snapshot()]
        if self.fleet is not None:
            snapshots.append(self.fleet.snapshot())
        if self.server.discovery is not None:
            snapshots.append(self.server.discovery.snapshot(trio.current_time()))
        return render(snapshots)


def saved_state(config: Config) -> RuntimeState:
    """:func:`load_runtime_state`, raising ``OSError`` naming ``admin.state_file`` for a file
    that cannot be read or is not valid (what a process that is starting says and stops)."""
    try:
        return load_runtime_state(config)
    except ValueError as exc:
        raise OSError(f"admin.state_file: {exc}") from None
    except OSError as exc:
        raise OSError(f"admin.state_file: cannot read it: {exc}") from None


def apply_saved_state(server: ProxyServer) -> RuntimeState:
    """Load ``server.config.admin.state_file`` (if any) and apply it to ``server``: call it
    before ``server.run``, so the first connection accepted already sees the saved weights.

    Returns the state applied. Raises ``OSError`` naming ``admin.state_file`` when the file
    cannot be read or is not valid: starting with every weight silently reset would be worse
    than not starting.
    """
    state = saved_state(server.config)
    if not state.is_empty:
        server.apply_runtime(state)
    return state


def changed_servers(
    config: Config, state: RuntimeState, group: str, changes: Mapping[str, Mapping[str, Any]]
) -> tuple[RuntimeState, list[str]]:
    """``state`` with each server's change (server as given -> fields) made in ``group``, and
    the servers' configured addresses, in order. All or nothing: raises :class:`AdminError`
    (404 an unknown group or server, 400 no change, a bad field or a server named twice,
    by address and by id say) for the first entry at fault, and nothing is changed."""
    if not changes:
        raise AdminError(400, "no server to change; name at least one")
    addresses: list[str] = []
    for server, change in changes.items():
        try:
            address = resolve_server(config, group, server)
        except KeyError as exc:
            raise AdminError(404, str(exc.args[0])) from None
        if address in addresses:
            raise AdminError(400, f"{server}: names the server {address} a second time")
        try:
            state = state.changed(group, address, **change)
        except ValueError as exc:
            where = f"{server}: " if len(changes) > 1 else ""
            raise AdminError(400, f"{where}{exc}") from None
        addresses.append(address)
    return state, addresses


async def change_runtime(
    config: Config,
    state: RuntimeState,
    state_file: str | None,
    group: str,
    changes: Mapping[str, Mapping[str, Any]],
    *,
    apply: Callable[[RuntimeState], Awaitable[None]],
    fleet: FleetSync | None = None,
) -> tuple[list[str], int | None]:
    """``Control.change_group``'s rules (see the module header), for one process or many.

    Makes ``changes`` in ``state`` (:func:`changed_servers`). Without ``fleet``: saves the new
    state to ``state_file`` (when there is one), then hands it to ``apply``. With one: the
    change is checked here first, then made on the fleet store's newest state and written
    there (``FleetSync.commit``, which saves and applies it once the store has it). Returns
    the servers' configured addresses and the store's new version (None without a store).
    The caller holds its lock around the call. Raises :class:`AdminError`: 404 / 400 as
    :func:`changed_servers`, 500 when the state file cannot be written (then nothing is
    applied), 503 when the fleet store cannot take the change (nothing changed anywhere).
    """
    changed, addresses = changed_servers(config, state, group, changes)
    version = await commit_runtime(
        changed,
        state_file,
        lambda newest: changed_servers(config, newest, group, changes)[0],
        apply=apply,
        fleet=fleet,
    )
    return addresses, version


async def commit_runtime(
    changed: RuntimeState,
    state_file: str | None,
    change: Callable[[RuntimeState], RuntimeState],
    *,
    apply: Callable[[RuntimeState], Awaitable[None]],
    fleet: FleetSync | None,
) -> int | None:
    """Make a change checked already (``changed``: this process's state with it). Without
    ``fleet``: saves ``changed`` to ``state_file`` (when there is one), then applies it; with
    one: ``change`` is made on the store's newest state and written there (``FleetSync.
    commit``, which saves and applies it). Returns the store's new version (None without).
    Raises :class:`AdminError` 500 (the state file cannot be written: nothing applied) or 503
    (the store cannot take the change: nothing changed anywhere)."""
    if fleet is not None:
        try:
            return await fleet.commit(change)
        except StoreUnavailable as exc:
            raise AdminError(503, str(exc)) from None
    if state_file is not None:
        try:
            await trio.to_thread.run_sync(save_state, state_file, changed)
        except OSError as exc:
            # Not applied either: a change that would be lost at the next start is refused
            # rather than half made.
            raise AdminError(
                500, f"cannot write the state file {state_file!r}: {exc}; nothing changed"
            ) from None
    await apply(changed)
    return None


def changed_models(
    config: Config, state: RuntimeState, alias: str, weights: Mapping[str, int | None]
) -> RuntimeState:
    """``state`` with the runtime weights of ``alias``'s targets set (model -> weight; None:
    the configured one). All or nothing: raises :class:`AdminError` (404 an unknown alias or
    target, 400 no weight or every weight in force 0)."""
    entry = config.models.get(alias)
    if entry is None:
        known = ", ".join(sorted(config.models)) or "none"
        raise AdminError(404, f"unknown model alias {alias!r}; configured aliases: {known}")
    if not weights:
        raise AdminError(400, "no weight to change; name at least one target")
    targets = {target.model: target.weight for target in entry.targets}
    for model in weights:
        if model not in targets:
            raise AdminError(
                404,
                f"weights.{model}: the alias {alias!r} has no target {model!r}; its targets:"
                f" {', '.join(targets)}",
            )
    try:
        changed = state.models_changed(alias, weights)
    except ValueError as exc:
        raise AdminError(400, str(exc)) from None
    in_force = [
        weight if (weight := changed.model_weight(alias, model)) is not None else configured
        for model, configured in targets.items()
    ]
    if all(weight == 0 for weight in in_force):
        raise AdminError(
            400, f"every weight of the alias {alias!r} would be 0; give one target a weight"
        )
    return changed


async def change_model_weights(
    config: Config,
    state: RuntimeState,
    state_file: str | None,
    alias: str,
    weights: Mapping[str, int | None],
    *,
    apply: Callable[[RuntimeState], Awaitable[None]],
    fleet: FleetSync | None = None,
) -> int | None:
    """``Control.change_models``'s rules, for one process or many (as ``change_runtime``):
    returns the fleet store's new version (None without a store)."""
    changed = changed_models(config, state, alias, weights)
    return await commit_runtime(
        changed,
        state_file,
        lambda newest: changed_models(config, newest, alias, weights),
        apply=apply,
        fleet=fleet,
    )


def models_answer(status: Mapping[str, Any], alias: str, version: int | None) -> dict[str, Any]:
    """The answer to a change of an alias's weights: its targets as ``/status`` shows them
    and the fleet store's ``version`` (None without a store)."""
    entry = status.get("models", {}).get(alias, {})
    return {"ok": True, "alias": alias, "version": version, "targets": entry.get("targets", [])}


def group_answer(
    status: Mapping[str, Any], group: str, addresses: list[str], version: int | None
) -> dict[str, Any]:
    """The answer to a change of ``group``: its changed servers' status entries and the
    fleet store's ``version`` (None without a store)."""
    servers = [server_status(status, group, address) for address in addresses]
    return {"ok": True, "group": group, "version": version, "servers": servers}


def answer_of_one(answer: Mapping[str, Any]) -> dict[str, Any]:
    """The answer to a change of one server: its status entry, with the fleet store's
    ``version`` when there is a store."""
    entry = dict(answer["servers"][0])
    if answer["version"] is not None:
        entry["version"] = answer["version"]
    return entry


def server_status(status: Mapping[str, Any], group: str, address: str) -> dict[str, Any]:
    """The entry of the server at ``address`` in ``group`` of a ``status()`` document (404
    when it has none: no worker answered for it, say)."""
    for entry in status["groups"].get(group, {}).get("servers", []):
        if entry["address"] == address:
            return dict(entry)
    raise AdminError(404, f"upstream group {group!r} has no server {address!r}")


def _listeners(server: ProxyServer) -> dict[str, Any]:
    return {
        "configured": [
            {"address": listener.address, "tls": listener.tls}
            for listener in server.config.listeners
        ],
        "bound": [f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in server.addresses],
    }

"""The admin interface's :class:`~muxproxy.trio.control.Control` for ``serve --workers N``.

The admin listener speaks to one ``Control`` whether one process serves or a supervisor runs
workers (:mod:`muxproxy.process.workers`); this one answers by asking every worker over its control
channel and merging the answers:

* ``status()``: each worker's ``ProxyCore.status()``, merged per server: the counts
  (``active`` streams, ``failures``, outstanding ``work``, the group's ``queue`` length,
  ``refused`` and ``reservations``, and the top-level ``clients``, ``upstream_connections``,
  ``streams``) are summed, but ``sessions.remembered`` and a group's ``remembered_sessions``
  are the most any worker holds (each holds the host's memory); ``health`` and ``state``
  are the worst any worker reports (each worker learns a backend's health for itself, and
  one that sees it down routes around it);
  ``workers`` lists every live process with its pid, slot, the configuration generation it
  runs and whether it serves or drains.
* ``change_server()`` and ``change_group()``: the same rules as one process (``LocalControl``):
  resolved with ``resolve_server``, a group's changes validated whole, saved to the state
  file before they are applied (with a fleet store: written to the store first), one change
  at a time; then the whole ``RuntimeState`` goes to every worker as "runtime" and each has
  applied it (or :data:`RUNTIME_TIMEOUT` passed) before the answer. A worker that starts
  later gets it in its payload. The supervisor is the fleet's replica: its ``FleetSync``
  (``Supervisor.fleet``) follows the store and sends each state to the workers the same way.
* ``reload(restart)``: SIGHUP's and SIGUSR2's work, as they do it.
* ``readiness()``: the supervisor's own (:func:`readiness_of` its phase and workers):
  stopping from the stop signal on, ready while serving as long as one worker listens (so a
  rolling restart, which starts a slot's new worker before it stops the old one, never turns
  it not-ready).
* ``metrics()``: ``muxproxy.trio.metrics.render`` over the live workers' snapshots and the
  counters and histograms of the workers that exited (merged into one as each exits: its
  gauges, such as streams in flight, went with it), so no counter goes backwards across a
  rolling restart (a worker that answers and then exits is counted once: by its answer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, assert_never

import trio

from muxproxy.process.common import host_port
from muxproxy.process.workerproc import Phase, WorkerState
from muxproxy.trio.control import (
    AdminError,
    Readiness,
    ReloadResult,
    answer_of_one,
    change_model_weights,
    change_runtime,
    group_answer,
    models_answer,
)

if TYPE_CHECKING:
    from muxproxy.config import Config
    from muxproxy.config.fleet import FleetSettings
    from muxproxy.config.runtime import RuntimeState
    from muxproxy.process.workerproc import Worker
    from muxproxy.trio.channel import Message
    from muxproxy.trio.fleetsessions import SessionRelay
    from muxproxy.trio.fleetstate import FleetSync

RUNTIME_TIMEOUT = 1.0
"""Seconds within which every worker applies a runtime change."""

_WORST_STATE = ("down", "draining", "up")
_WORST_HEALTH = ("unhealthy", "healthy")
_SUMMED = ("active", "failures", "work")
_HELD_BY_EACH = frozenset({"remembered"})
"""Counts of what every worker holds whole: ``sessions.remembered`` (each worker has the
host's memory, the supervisor relays it), which a sum would count once per worker."""


class Supervised(Protocol):
    """What :class:`SupervisorControl` asks of the supervisor
    (``muxproxy.process.workers.Supervisor``): the supervisor imports this module, and this one
    knows it by these names alone."""

    @property
    def config(self) -> Config:
        """The configuration running now."""

    @property
    def config_path(self) -> str | None:
        """The file a reload reads (None: started from flags)."""

    @property
    def generation(self) -> int:
        """1 at start, +1 per configuration applied by a reload."""

    @property
    def runtime(self) -> RuntimeState:
        """The operator's server overrides, as every worker has them."""

    @property
    def state_file(self) -> str | None:
        """Where runtime overrides are saved (``admin.state_file``)."""

    @property
    def fleet(self) -> FleetSync | None:
        """The fleet store's sync (``[fleet]``), None without a store."""

    def bound_addresses(self) -> list[tuple[str, int]]:
        """Every listening socket's (host, port), in the configuration's order."""

    def discovery_status(self) -> dict[str, Any]:
        """Per discovering group, its lookups (``trio.discovery.Discovery.status``)."""

    def readiness(self) -> Readiness:
        """Whether new traffic is taken now, from the supervisor's phase and workers."""

    async def ask_all(
        self, message: Message, workers: list[Worker] | None = None
    ) -> list[tuple[Worker, Message | None]]:
        """``message`` to each live worker; each worker's answer, None for one that gave none."""

    async def apply_runtime(self, state: RuntimeState, *, timeout: float) -> None:
        """Make ``state`` the runtime state of every worker, and of the ones to come."""

    async def reload(self) -> ReloadResult:
        """SIGHUP's work: read the configuration file again and apply it to every worker."""

    async def restart(self) -> ReloadResult:
        """SIGUSR2's work: a rolling restart onto the installed code."""

    async def snapshots(self) -> list[dict[str, Any]]:
        """Measurements of every worker: the live ones' now, the exited ones' last."""

    @property
    def sessions(self) -> SessionRelay:
        """The host's memory of sessions and its bridge to the fleet store."""


async def follow_fleet(supervisor: Any, settings: FleetSettings) -> None:
    """Follow the fleet store's runtime state (``[fleet]``) for ``supervisor`` (a
    ``muxproxy.process.workers.Supervisor``, started): each state the store gives is sent to every
    worker (``apply_runtime``) and saved to the state file. Call it before the admin API
    serves, so that no change is ever made here alone."""
    from muxproxy.trio.fleetstate import FleetSync

    supervisor.fleet = FleetSync(
        settings,
        supervisor.runtime,
        apply=partial(supervisor.apply_runtime, timeout=RUNTIME_TIMEOUT),
        state_file=lambda: supervisor.state_file,
    )
    await supervisor.nursery.start(supervisor.fleet.run)


class SupervisorControl:
    """:class:`~muxproxy.trio.control.Control` over the workers of ``supervisor``."""

    def __init__(self, supervisor: Supervised) -> None:
        self.supervisor = supervisor
        self._lock = trio.Lock()
        """One runtime change at a time: saved and applied in the same order."""

    def token(self) -> str | None:
        """The admin token of the configuration running now (a reload may change it)."""
        admin = self.supervisor.config.admin
        return None if admin is None else admin.token

    def readiness(self) -> Readiness:
        return self.supervisor.readiness()

    async def status(self) -> dict[str, Any]:
        supervisor = self.supervisor
        answers = await supervisor.ask_all({"type": "status?"})
        merged = merge_statuses([answer["status"] for _, answer in answers if answer])
        merged["generation"] = supervisor.generation
        merged["listeners"] = {
            "configured": [
                {"address": listener.address, "tls": listener.tls}
                for listener in supervisor.config.listeners
            ],
            "bound": [host_port(*address) for address in supervisor.bound_addresses()],
        }
        merged.setdefault("sessions", {}).update(supervisor.sessions.status())
        merged["workers"] = [
            {
                "pid": worker.pid,
                "slot": worker.slot,
                "generation": worker.generation,
                "state": worker.state.value,
                "answered": answer is not None,
            }
            for worker, answer in answers
        ]
        if supervisor.fleet is not None:
            merged["fleet"] = supervisor.fleet.status()
        for name, entry in supervisor.discovery_status().items():
            group = merged.get("groups", {}).get(name)
            if isinstance(group, dict):
                group["discovery"] = entry
        return merged

    async def change_server(
        self, group: str, server: str, change: Mapping[str, Any]
    ) -> dict[str, Any]:
        return answer_of_one(await self.change_group(group, {server: change}))

    async def change_group(
        self, group: str, changes: Mapping[str, Mapping[str, Any]]
    ) -> dict[str, Any]:
        supervisor = self.supervisor
        async with self._lock:
            addresses, version = await change_runtime(
                supervisor.config,
                supervisor.runtime,
                supervisor.state_file,
                group,
                changes,
                apply=partial(supervisor.apply_runtime, timeout=RUNTIME_TIMEOUT),
                fleet=supervisor.fleet,
            )
        return group_answer(await self.status(), group, addresses, version)

    async def change_models(self, alias: str, weights: Mapping[str, int | None]) -> dict[str, Any]:
        supervisor = self.supervisor
        async with self._lock:
            version = await change_model_weights(
                supervisor.config,
                supervisor.runtime,
                supervisor.state_file,
                alias,
                weights,
                apply=partial(supervisor.apply_runtime, timeout=RUNTIME_TIMEOUT),
                fleet=supervisor.fleet,
            )
        return models_answer(await self.status(), alias, version)

    async def reload(self, restart: bool = False) -> ReloadResult:
        supervisor = self.supervisor
        if restart:
            return await supervisor.restart()
        if supervisor.config_path is None:
            raise AdminError(
                400,
                "nothing to reload: muxproxy serve was started from flags, not --config FILE",
            )
        return await supervisor.reload()

    async def metrics(self) -> bytes:
        from muxproxy.trio.metrics import render

        snapshots = await self.supervisor.snapshots()
        snapshots.append(self.supervisor.sessions.snapshot_metrics())  # the host's store bridge
        if self.supervisor.fleet is not None:
            snapshots.append(self.supervisor.fleet.snapshot())
        return render(snapshots)


def readiness_of(phase: Phase, workers: Iterable[Worker]) -> Readiness:
    """The supervisor's readiness in ``phase`` with these ``workers``: ready while serving
    with at least one worker listening; stopping from the first stop signal (or ``stop()``)
    until the supervisor exits."""
    match phase:
        case Phase.SERVING:
            # A rolling restart stops a slot's old worker only once its new one listens,
            # so one serves throughout; none does only while every slot is being
            # replaced (their connections wait in the sockets' backlogs meanwhile).
            if any(worker.state is WorkerState.SERVING for worker in workers):
                return Readiness.READY
            return Readiness.STARTING
        case Phase.STARTING:
            return Readiness.STARTING
        case Phase.STOPPING:
            return Readiness.STOPPING
        case unknown:
            assert_never(unknown)


def merge_statuses(statuses: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One ``ProxyCore.status()`` document for several workers' (see the module header)."""
    if not statuses:
        return {"groups": {}}
    merged: dict[str, Any] = {}
    for key, value in statuses[0].items():
        if key == "groups":
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            merged[key] = sum(status.get(key, 0) for status in statuses)
        elif isinstance(value, dict) and key != "groups":
            merged[key] = _sum_counts([status.get(key, {}) for status in statuses])
        else:
            merged[key] = value
    groups: dict[str, Any] = {}
    for name, group in statuses[0].get("groups", {}).items():
        servers = []
        for entry in group.get("servers", []):
            same = [
                other
                for status in statuses
                for other in status.get("groups", {}).get(name, {}).get("servers", [])
                if other.get("address") == entry.get("address")
            ]
            combined = dict(entry)
            for key in _SUMMED:
                if key in entry:
                    combined[key] = sum(other.get(key, 0) for other in same)
            combined["state"] = _worst(_WORST_STATE, [o.get("state") for o in same])
            combined["health"] = _worst(_WORST_HEALTH, [o.get("health") for o in same])
            servers.append(combined)
        merged_group = {**group, "servers": servers}
        each = [status.get("groups", {}).get(name, {}) for status in statuses]
        queue = group.get("queue")
        if isinstance(queue, dict):
            waiting = sum(other.get("queue", {}).get("waiting", 0) for other in each)
            merged_group["queue"] = {**queue, "waiting": waiting}
        if "reservations" in group:
            merged_group["reservations"] = sum(other.get("reservations", 0) for other in each)
        if "remembered_sessions" in group:  # the host's memory, held by each: not a sum
            merged_group["remembered_sessions"] = max(
                other.get("remembered_sessions", 0) for other in each
            )
        if "refused" in group:
            refused: dict[str, int] = {}
            for other in each:
                for reason, count in other.get("refused", {}).items():
                    refused[reason] = refused.get(reason, 0) + count
            merged_group["refused"] = refused
        groups[name] = merged_group
    merged["groups"] = groups
    return merged


def _sum_counts(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A table of counts (``sessions``) over several workers: the numbers summed (the most
    for :data:`_HELD_BY_EACH`), anything else as the first worker has it."""
    out = dict(parts[0])
    for key, value in parts[0].items():
        if isinstance(value, int) and not isinstance(value, bool):
            each = [part.get(key, 0) for part in parts]
            out[key] = max(each) if key in _HELD_BY_EACH else sum(each)
    return out


def _worst(order: tuple[str, ...], values: Sequence[object]) -> object:
    for candidate in order:
        if candidate in values:
            return candidate
    return values[0] if values else None

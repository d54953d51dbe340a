"""A worker process of ``muxproxy serve --workers N``, steered by its supervisor.

The supervisor (:mod:`muxproxy.process.workers`) starts it as ``python -c`` (:data:`WORKER_CODE`)
with a pickled :class:`~muxproxy.process.handover.WorkerPayload` on stdin: the configuration, the
listening sockets of its slot (already bound and listening; the worker never binds) and its
end of the control channel (:mod:`muxproxy.trio.channel`). It serves them with one
:class:`~muxproxy.trio.server.ProxyServer` and talks to the supervisor in JSON lines:

=============== ================================== ===========================================
from            message                            meaning
=============== ================================== ===========================================
worker          ``listening`` bound, generation    serving; sent once, after the sockets
                                                   are adopted
supervisor      ``stop``                           drain: ``request_shutdown()`` (graceful)
supervisor      ``cut``                            cut every stream now
supervisor      ``reload`` id, config, listeners   apply a validated Config (base64 pickle);
                                                   new listeners' sockets come as descriptors,
                                                   ``listeners`` naming how many per address;
                                                   answered ``reloaded`` id, ok, generation,
                                                   error
supervisor      ``reopen_logs``                    open the access log file again (SIGUSR1 to
                                                   the supervisor, after log rotation)
supervisor      ``runtime`` id, state              ``RuntimeState`` JSON; answered ``applied``
supervisor      ``discovered`` id, sets            the discovering groups' servers (a JSON
                                                   object: group -> [address, weight,
                                                   backup, name] lists); answered ``applied``
supervisor      ``status?`` / ``metrics?`` id      answered ``status`` / ``metrics`` with
                                                   ``ProxyCore.status()`` / a measurements
                                                   snapshot
both            ``sessions`` entries               sessions remembered (``fleetsessions.py``):
                                                   a worker's own batch to the supervisor,
                                                   the others' (and the store's) from it
worker          ``exited`` snapshot                drained and about to exit: the final
                                                   measurements, kept by the supervisor
=============== ================================== ===========================================

SIGTERM and SIGINT to a worker, and the end of the channel, stop it gracefully as ``stop``
does; a second one cuts. A worker runs in a process group of its own, so a terminal's Ctrl-C
reaches the supervisor alone.

The end of the channel is how a worker learns that its supervisor died, even by SIGKILL: the
supervisor's end of the socketpair is open in the supervisor alone (not inheritable, and no
other child is passed it), so the kernel closes it when that process goes, and the worker
reads end of file. Not ``PR_SET_PDEATHSIG``: its "parent" is the *thread* that forked, and
Trio spawns from a worker thread that exits after 10 s idle, which stopped every worker every
10 s while the supervisor lived.
"""

from __future__ import annotations

import base64
import logging
import os
import pickle
import socket
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import attrs
import trio

from muxproxy.config import Config
from muxproxy.config.runtime import RuntimeState
from muxproxy.core.commands import SessionsRemembered
from muxproxy.fleet.discovery import Target
from muxproxy.fleet.sessions import entries_from_wire, entries_to_wire
from muxproxy.process.common import (
    EXIT_FAILURE,
    EXIT_OK,
    freeze_startup_heap,
    reopen_access_log,
)
from muxproxy.process.handover import WorkerPayload
from muxproxy.process.signals import WORKER_SIGNALS, Action, action_of
from muxproxy.trio.channel import Channel, ChannelError, Message
from muxproxy.trio.excgroups import leaves
from muxproxy.trio.fleetsessions import learn, shifted, wall_offset
from muxproxy.trio.server import ProxyServer

log = logging.getLogger("muxproxy")

SESSION_BATCHES = 64
"""Batches of remembered sessions waiting for the control channel (``SHARE_DELAY`` apart)."""

WORKER_CODE = "from muxproxy.process.worker import worker_main; raise SystemExit(worker_main())"
"""A worker's ``python -c`` program (arguments are ignored: a supervisor of an older version
passes its pid)."""


def worker_main() -> int:
    """A worker process: the payload is on stdin.

    Returns the exit status: 0 once stopped and drained, 1 when it cannot serve (or the
    supervisor died before it sent the payload).
    """
    data = sys.stdin.buffer.read()
    if not data:
        return EXIT_FAILURE  # The supervisor is gone already: nobody to serve for.
    payload = WorkerPayload.loads(data)
    try:
        # Every field, recursively: a supervisor of an older version (a rolling restart onto
        # newly installed code) may have pickled records that lack a field this one has.
        attrs.asdict(payload.config)
    except AttributeError as missing:
        print(
            f"muxproxy: worker {os.getpid()}: the supervisor's configuration does not fit this"
            f" version of muxproxy ({missing}); restart muxproxy itself to upgrade",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    sockets = {
        address: [socket.socket(fileno=fd) for fd in fds]
        for address, fds in payload.listeners.items()
    }
    control = socket.socket(fileno=payload.control)
    try:
        trio.run(WorkerProcess(payload, sockets, control).run)
    except* OSError as group:
        for exc in leaves(group):
            print(f"muxproxy: worker {os.getpid()}: cannot serve: {exc}", file=sys.stderr)
    else:
        return EXIT_OK
    return EXIT_FAILURE


class WorkerProcess:
    """One worker's server and its side of the control channel."""

    def __init__(
        self,
        payload: WorkerPayload,
        sockets: dict[str, list[socket.socket]],
        control: socket.socket,
    ) -> None:
        self.payload = payload
        # The supervisor looks up the groups with ``discover`` and sends the sets, and shares
        # the memory of sessions.
        self.server = ProxyServer(
            payload.config,
            reuse_port=True,
            listen_sockets=sockets,
            store_sessions=False,
            discover=False,
        )
        self.channel = Channel(control)
        # The memory of sessions is the host's: batches go to the supervisor, which relays.
        self.server.core.sessions.enable()
        self.server.on_sessions = self._sessions_out
        self._sessions_send, self._sessions_receive = trio.open_memory_channel[Message](
            SESSION_BATCHES
        )
        self.sessions_dropped = 0
        """Batches not sent: the supervisor had ``SESSION_BATCHES`` unread already."""
        self.stops = 0
        """``request_shutdown()`` calls so far: 1 drains, 2 cuts."""

    async def run(self) -> None:
        """Serve until stopped and drained."""
        with trio.open_signal_receiver(*WORKER_SIGNALS) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._signals, signals)
                if self.payload.runtime is not None:
                    # Before the first connection: no request is routed without it.
                    self.server.apply_runtime(RuntimeState.from_json(self.payload.runtime))
                known = getattr(self.payload, "sessions", None)
                if known:  # the host's memory, before the first connection too
                    learn(self.server, entries_from_wire(known)[0])
                nursery.start_soon(self._send_sessions)
                bound = await nursery.start(self._serve, nursery.cancel_scope)
                freeze_startup_heap()
                await self._send(
                    {
                        "type": "listening",
                        "bound": bound,
                        "generation": self.server.generation,
                        "pid": os.getpid(),
                    }
                )
                nursery.start_soon(self._commands)

    async def _serve(
        self, done: trio.CancelScope, *, task_status: trio.TaskStatus[list[tuple[str, int]]]
    ) -> None:
        await self.server.run(task_status=task_status)
        # Stopped and drained: the last word is the measurements, which the supervisor keeps
        # so that its counters never go backwards once this process is gone.
        await self._send({"type": "exited", "snapshot": self._snapshot()})
        done.cancel()

    async def _signals(self, signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            action = action_of(signum, stopping=self.stops > 0)
            self._stop(cut=action is Action.CUT)

    async def _commands(self) -> None:
        while (received := await self.channel.receive()) is not None:
            message, fds = received
            kind = message["type"]
            if fds and kind != "reload":
                for fd in fds:
                    os.close(fd)
                raise ChannelError(f"a {kind!r} message carries descriptors")
            if kind == "stop":
                self._stop(cut=False)
            elif kind == "cut":
                self._stop(cut=True)
            elif kind == "reload":
                await self._send(self._reload(message, fds))
            elif kind == "reopen_logs":
                reopen_access_log(self.server, log)
            elif kind == "discovered":
                self.server.apply_discovered(decode_sets(message["sets"]))
                await self._send({"type": "applied", "id": message["id"]})
            elif kind == "runtime":
                self.server.apply_runtime(RuntimeState.from_json(message["state"]))
                await self._send({"type": "applied", "id": message["id"]})
            elif kind == "sessions":
                learn(self.server, entries_from_wire(message.get("entries"))[0])
            elif kind == "status?":
                await self._send({"type": "status", "id": message["id"], **self._status()})
            elif kind == "metrics?":
                snapshot = self._snapshot()
                await self._send({"type": "metrics", "id": message["id"], "snapshot": snapshot})
            else:
                raise ChannelError(f"unknown control message {kind!r}")
        # The supervisor is gone: nobody will ever tell us to stop. Drain and exit.
        self._stop(cut=False)

    def _sessions_out(self, command: SessionsRemembered) -> None:
        """``Driver.on_sessions``: a batch for the supervisor, never waiting."""
        entries = entries_to_wire(shifted(command.entries, wall_offset()))
        try:
            self._sessions_send.send_nowait({"type": "sessions", "entries": entries})
        except trio.WouldBlock:
            self.sessions_dropped += 1

    async def _send_sessions(self) -> None:
        async for message in self._sessions_receive:
            await self._send(message)

    def _stop(self, *, cut: bool) -> None:
        wanted = 2 if cut else 1
        while self.stops < wanted:
            self.stops += 1
            self.server.request_shutdown()

    def _reload(self, message: Message, fds: list[int]) -> Message:
        reply: Message = {"type": "reloaded", "id": message["id"]}
        sockets: dict[str, list[socket.socket]] = {}
        start = 0
        for address, count in message["listeners"].items():
            sockets[address] = [socket.socket(fileno=fd) for fd in fds[start : start + count]]
            start += count
        try:
            config = pickle.loads(base64.b64decode(message["config"]))
            assert isinstance(config, Config)
            self.server.reload(config, listen_sockets=sockets)
        except (OSError, RuntimeError) as exc:  # cannot bind / load TLS; or stopping
            for adopted in sockets.values():
                for sock in adopted:
                    sock.close()
            return {**reply, "ok": False, "error": str(exc), "generation": self.server.generation}
        return {**reply, "ok": True, "generation": self.server.generation}

    def _status(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "slot": self.payload.slot,
            "generation": self.server.generation,
            "status": self.server.core.status(),
        }

    def _snapshot(self) -> dict[str, Any]:
        return self.server.core.measurements.snapshot()

    async def _send(self, message: Message) -> None:
        try:
            await self.channel.send(message)
        except trio.BrokenResourceError:
            pass  # The supervisor is gone; the end of file says so to _commands too.


def encode_sets(sets: Mapping[str, Sequence[Target]]) -> dict[str, list[list[Any]]]:
    """Discovered sets as the ``discovered`` message carries them (JSON)."""
    return {
        group: [[t.address, t.weight, t.backup, t.name] for t in targets]
        for group, targets in sets.items()
    }


def decode_sets(data: Mapping[str, list[list[Any]]]) -> dict[str, tuple[Target, ...]]:
    return {
        group: tuple(
            Target(address=address, weight=weight, backup=backup, name=name)
            for address, weight, backup, name in targets
        )
        for group, targets in data.items()
    }


def encode_config(config: Config) -> str:
    """``config`` as the ``reload`` message carries it: a base64 pickle."""
    return base64.b64encode(pickle.dumps(config)).decode("ascii")

"""``muxproxy serve --workers N``: a supervisor and N worker processes on handed-over sockets.

Each worker is a whole proxy: its own Trio loop, ``ProxyCore``, connection pools and health
state. Sticky routing agrees across them (rendezvous hashing over one configuration, and the
host's memory of recent sessions, relayed by the supervisor: ``trio/fleetsessions.py``).

Theory of operation. The supervisor (the process the user started) never serves a request. It
owns the listening sockets, the workers' lives and the signals, and it never drops a stream
or a connection waiting to be accepted:

* Sockets. It binds every listening socket itself (:mod:`muxproxy.process.handover`): per
  listener, one ``SO_REUSEPORT`` socket per worker slot, so the kernel spreads connections
  over the slots as it did when each worker bound its own, and each connection wakes one
  process. A worker adopts its slot's sockets (``ProxyServer(listen_sockets=...)``) and never
  binds. Because the supervisor keeps every socket open, a worker that stops or dies takes no
  accept queue with it: what waits there is accepted by the worker that takes the slot over.
* Workers. Each is ``python -c`` (:data:`~muxproxy.process.worker.WORKER_CODE`, so it imports the
  code installed at the time it starts) in a process group of its own (a terminal's Ctrl-C
  reaches the supervisor alone), reading a pickled ``WorkerPayload`` on stdin that names its
  descriptors (``pass_fds``). A Unix socketpair per worker is its control channel
  (:mod:`muxproxy.trio.channel`; the messages are listed in :mod:`muxproxy.process.worker`):
  "listening", "stop", "cut", "reload", "runtime", "status?", "metrics?", "sessions", and the
  worker's final measurements as it exits; end of file means the worker has gone.
* Start. Once every worker reports that it listens, the supervisor prints ``muxproxy
  listening on ...`` (as one process would). A worker that exits before that fails the
  start: exit 1, after the worker's own message saying why.
* SIGTERM, SIGINT, SIGQUIT: every worker is told "stop" (``request_shutdown()``: it stops
  accepting and lets its streams finish); the supervisor waits until each has drained and
  exited, up to ``timeouts.shutdown_grace`` plus :data:`KILL_MARGIN` seconds, kills what is
  left, and exits 0. A second SIGTERM or SIGINT tells every worker "cut".
* SIGHUP: the configuration file is read again with ``load_config`` (the checker of ``muxproxy
  check``). An invalid file is refused, every problem logged, and the old configuration
  keeps running. Otherwise sockets are bound for new listeners and sent with "reload" to
  every worker (:mod:`muxproxy.process.workerreload`); a removed listener's sockets are closed
  once every worker has applied the new configuration (and so closed its own copies).
* SIGUSR2: a rolling restart onto the installed code. Slot by slot, a new worker starts on the
  slot's sockets, and once it reports that it listens the old one is told "stop" and drains
  in the background; both accept from the same queue meanwhile, so no connection is refused.
  A new worker that fails to listen aborts the restart: the old one keeps its slot, and why is
  logged.
* SIGUSR1: every worker opens the access log file again (after log rotation renamed it).
* A worker that dies is logged and replaced on its slot, at most N times within
  :data:`~muxproxy.process.workerproc.RESTART_WINDOW` seconds: past that the workers stop and
  the supervisor exits 1, rather than spin on a crash loop.
* Admin API (``[admin]``): the supervisor runs it (:mod:`muxproxy.trio.admin`) over
  :class:`~muxproxy.process.supervision.SupervisorControl`: status, runtime server overrides,
  reloads and metrics, merged over the workers; ``muxproxy admin on ...`` follows the listening
  lines. The admin address is the one the supervisor started with; a reload rotates the token.
  It stays open until the supervisor exits, so ``GET /ready`` answers "stopping" (503) for
  the whole drain (:meth:`Supervisor.readiness`).

* Logs: the supervisor's lines are the error log's (``<timestamp> <LEVEL> muxproxy: ...``,
  ``[log] level``), as a worker's and one process's are; only a start that fails before
  anything serves prints its reason plainly, as one process does.

A worker that reads end of file on its control channel (the supervisor died, even by
SIGKILL: the kernel closes the supervisor's end, which no other process holds) stops as
"stop" does; so no worker outlives the supervisor by more than its drain. Workers are
started from a Trio thread, which is why no ``PR_SET_PDEATHSIG`` is used: the kernel ties
that to the thread, not the process (:mod:`muxproxy.process.worker`). ``SO_REUSEPORT``'s
spreading is Linux-only; so is ``--workers N``.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import trio

from muxproxy.config import Config
from muxproxy.config.runtime import RuntimeState
from muxproxy.fleet.discovery import Target, with_discovered
from muxproxy.process.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    describe_exit,
    host_port,
    listening_lines,
)
from muxproxy.process.handover import (
    SlotSockets,
    WorkerPayload,
    bind_listeners,
    close_listeners,
    slot_fds,
)
from muxproxy.process.signals import HANDLED_SIGNALS, obey
from muxproxy.process.supervision import SupervisorControl, follow_fleet, readiness_of
from muxproxy.process.worker import WORKER_CODE, encode_sets
from muxproxy.process.workerproc import (
    REPLY_TIMEOUT,
    Phase,
    RestartBudget,
    Retired,
    Worker,
    WorkerState,
    ask_each,
    first_of,
)
from muxproxy.process.workerreload import reload_each, reread
from muxproxy.trio.channel import Channel, ChannelError, Message
from muxproxy.trio.control import Readiness, ReloadResult, saved_state
from muxproxy.trio.discovery import Discovery
from muxproxy.trio.excgroups import leaves
from muxproxy.trio.fleetsessions import SessionRelay
from muxproxy.trio.logs import configure_error_log

if TYPE_CHECKING:
    from muxproxy.trio.fleetstate import FleetSync

log = logging.getLogger("muxproxy")

STARTUP_TIMEOUT = 30.0
"""Seconds a worker has to start listening; a start that hangs fails instead."""
KILL_MARGIN = 5.0
"""Seconds past ``timeouts.shutdown_grace`` before a worker that has not exited is killed."""


def supervise(
    config: Config, count: int, config_path: str | None = None, log_level: str | None = None
) -> int:
    """Serve ``config`` with ``count`` worker processes until a signal; returns the exit status.

    ``config_path``: the file ``config`` was loaded from, read again on SIGHUP (None when
    it came from flags: a SIGHUP is then refused); ``log_level`` (``--log-level``) overrides
    ``[log] level`` of every file read. 0 after SIGTERM, SIGINT or SIGQUIT; 1 when
    the workers cannot start or keep dying; 2 off Linux.
    """
    if sys.platform != "linux":
        print("muxproxy serve: --workers above 1 needs Linux (SO_REUSEPORT)", file=sys.stderr)
        return EXIT_USAGE
    try:
        return trio.run(partial(_supervise, config, count, config_path, log_level))
    except* OSError as group:
        for exc in leaves(group):
            print(f"muxproxy: cannot serve: {exc}", file=sys.stderr)
    return EXIT_FAILURE


async def _supervise(
    config: Config, count: int, config_path: str | None, log_level: str | None
) -> int:
    configure_error_log(config.log.level)
    with trio.open_signal_receiver(*HANDLED_SIGNALS) as signals:
        supervisor = Supervisor(config, count, config_path, bind_listeners(config.listeners, count))
        supervisor.log_level = log_level
        try:
            async with trio.open_nursery() as nursery:
                supervisor.nursery = nursery
                supervisor.sessions.start(nursery)
                # Bounded by the resolver's timeout: the workers start with the servers.
                await supervisor.discovery.first_round()
                await supervisor.start()
                nursery.start_soon(supervisor.discovery.run)
                if supervisor.phase is Phase.SERVING and config.fleet is not None:
                    await follow_fleet(supervisor, config.fleet)  # before the admin API
                if supervisor.phase is Phase.SERVING and config.admin is not None:
                    await supervisor.serve_admin(config.admin.address)
                nursery.start_soon(obey, signals, supervisor)
                await supervisor.done.wait()
                nursery.cancel_scope.cancel()
        finally:
            close_listeners(supervisor.sockets)
    return supervisor.exit_status


class Supervisor:
    """The workers of one ``serve --workers N``, and what the signals do to them."""

    def __init__(
        self,
        config: Config,
        count: int,
        config_path: str | None,
        sockets: dict[str, SlotSockets],
    ) -> None:
        self.config = config
        self.count = count
        self.config_path = config_path
        self.log_level: str | None = None
        """``--log-level``: it overrides ``[log] level`` of every file read again."""
        self.sockets = sockets
        """Listener address -> per slot, its listening sockets (kept open while serving)."""
        self.nursery: trio.Nursery
        """Where the workers' watchers run (set before :meth:`start`)."""
        self.generation = 1
        """1 at start, +1 per configuration applied by a reload."""
        self.phase = Phase.STARTING
        self.slots: list[Worker | None] = [None] * count
        """The worker that owns each slot (a rolling restart's old one drains beside it)."""
        self.workers: list[Worker] = []
        """Every worker process not yet exited, draining ones included."""
        self.retired = Retired()
        """What the exited workers measured, so the fleet's counters never go backwards."""
        # Starting with every weight silently reset would be worse than not starting.
        self.runtime: RuntimeState = saved_state(config)
        """The operator's server overrides, as every worker has them."""
        self.fleet: FleetSync | None = None
        """The fleet store's sync (``[fleet]``): the supervisor is the fleet's replica."""
        self.discovered: dict[str, tuple[Target, ...]] = {}
        """Each discovering group's last good set, as every worker has it."""
        self.discovery = Discovery(lambda: self.config, self.apply_discovered)
        """The lookups of the groups with ``discover``: here, once for every worker."""
        self.restarts = RestartBudget(count)
        self.sessions = SessionRelay(lambda: self.config, lambda: self.workers)
        self.lock = trio.Lock()
        """Held by a reload, a rolling restart and a replacement: one change at a time."""
        self.exit_status = EXIT_OK
        self.done = trio.Event()
        self._ids = itertools.count(1)
        self._kill_at = math.inf

    @property
    def state_file(self) -> str | None:
        admin = self.config.admin
        return None if admin is None else admin.state_file

    # ---- starting -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every worker and wait until all listen; on failure, set ``done`` (exit 1)."""
        started = [await self._spawn(slot) for slot in range(self.count)]
        for worker in started:
            self.slots[worker.slot] = worker
        failure: str | None = None
        with trio.move_on_after(STARTUP_TIMEOUT):
            for worker in started:
                await first_of(worker.listening.wait, worker.exited.wait)
                if not worker.listening.is_set():
                    failure = (
                        f"worker {worker.pid} {describe_exit(worker.returncode)} while starting"
                    )
                    break
            else:
                self.phase = Phase.SERVING
                for line in listening_lines(self.config, started[0].bound):
                    print(line, flush=True)
                return
        self._log(
            failure or f"workers did not all listen within {STARTUP_TIMEOUT:g}s", logging.ERROR
        )
        self.exit_status = EXIT_FAILURE
        await self.stop(cut=True)

    async def _spawn(self, slot: int) -> Worker:
        """Start a worker on ``slot``'s sockets (not yet owning the slot)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        listeners = slot_fds(self.sockets, slot)
        runtime = self.runtime
        payload = WorkerPayload(
            config=self.config,
            slot=slot,
            control=theirs.fileno(),
            listeners=listeners,
            runtime=None if runtime.is_empty else runtime.to_json(),
            sessions=self.sessions.snapshot(),
        )
        try:
            process = await trio.lowlevel.open_process(
                [sys.executable, "-c", WORKER_CODE],
                stdin=subprocess.PIPE,
                pass_fds=(theirs.fileno(), *(fd for fds in listeners.values() for fd in fds)),
                process_group=0,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # The worker's now: end of file on ours means it has exited.
        assert process.stdin is not None
        try:
            async with process.stdin:
                await process.stdin.send_all(payload.dumps())
        except trio.BrokenResourceError:
            pass  # It died at once; its channel will say so.
        worker = Worker(
            slot=slot, process=process, channel=Channel(ours), generation=self.generation
        )
        self.workers.append(worker)
        self.nursery.start_soon(self._watch, worker)
        if self.runtime is not runtime:  # changed while it started: it missed the broadcast
            await self._tell(worker, self._runtime_message())
        return worker

    async def serve_admin(self, address: str) -> None:
        """Run the admin API (``[admin]``) on ``address`` over :class:`SupervisorControl`;
        an address that cannot be bound stops the workers (exit 1), as a listener would."""
        from muxproxy.trio.admin import serve_admin

        control = SupervisorControl(self)
        try:
            host, port = await self.nursery.start(serve_admin, address, control, control.token)
        except OSError as exc:
            self._log(f"cannot serve: the admin API on {address}: {exc}", logging.ERROR)
            self.exit_status = EXIT_FAILURE
            await self.stop(cut=True)
            return
        print(f"muxproxy admin on http://{host_port(host, port)}", flush=True)

    # ---- each worker's channel ------------------------------------------------------------

    async def _watch(self, worker: Worker) -> None:
        """Read ``worker``'s messages until it exits; then replace it if it died."""
        try:
            while (received := await worker.channel.receive()) is not None:
                message, fds = received
                for fd in fds:
                    os.close(fd)
                self._received(worker, message)
        except ChannelError as exc:
            self._log(f"worker {worker.pid}: {exc}; killing it", logging.ERROR)
            worker.process.kill()
        finally:
            worker.channel.close()
            for pending in worker.replies.values():
                pending.done.set()
        with trio.move_on_after(KILL_MARGIN) as waited:
            worker.returncode = await worker.process.wait()
        if waited.cancelled_caught:  # It closed its channel but lives on: a bug.
            worker.process.kill()
            worker.returncode = await worker.process.wait()
        was = worker.state
        worker.state = WorkerState.EXITED
        self.workers.remove(worker)
        if worker.final is not None and (why := self.retired.add(worker.final)) is not None:
            self._log(f"worker {worker.pid}: its last measurements are not counted: {why}")
        worker.exited.set()
        if self.phase is Phase.STOPPING:
            if not self.workers:
                self.done.set()
        elif was is not WorkerState.STOPPING and self.slots[worker.slot] is worker:
            await self._replace(worker)

    def _received(self, worker: Worker, message: Message) -> None:
        kind = message["type"]
        if kind == "listening":
            worker.bound = [(host, port) for host, port in message["bound"]]
            if worker.state is WorkerState.STARTING:
                worker.state = WorkerState.SERVING
            worker.listening.set()
        elif kind == "exited":
            worker.final = message["snapshot"]
        elif kind == "sessions":
            self.sessions.from_worker(worker, message)
        elif "id" in message:
            # An answer; one that comes after its request timed out is dropped.
            if (pending := worker.replies.get(message["id"])) is not None:
                pending.reply = message
                pending.done.set()
        else:
            raise ChannelError(f"unexpected {kind!r} message")

    async def _replace(self, dead: Worker) -> None:
        what = f"worker {dead.pid} {describe_exit(dead.returncode)}"
        if self.phase is Phase.STARTING:
            return  # start() reports it
        if not self.restarts.spend(trio.current_time()):
            self._log(f"{what}; {self.restarts.describe()}, giving up", logging.ERROR)
            self.exit_status = EXIT_FAILURE
            await self.stop(cut=False)
            return
        self._log(f"{what}; starting another", logging.WARNING)
        async with self.lock:
            if self.phase is Phase.SERVING and self.slots[dead.slot] is dead:
                try:
                    self.slots[dead.slot] = await self._spawn(dead.slot)
                except OSError as exc:  # EMFILE, ENOMEM, EAGAIN from fork
                    self._log(f"cannot start a worker: {exc}; stopping", logging.ERROR)
                    self.exit_status = EXIT_FAILURE
                    await self.stop(cut=False)

    # ---- signals --------------------------------------------------------------------------

    # The signals' actions (``process/signals.py``).

    def stopping(self) -> bool:
        return self.phase is Phase.STOPPING

    async def on_stop(self, signum: signal.Signals, *, cut: bool) -> None:
        await self.stop(cut=cut)

    async def on_keep_stopping(self, signum: signal.Signals) -> None:
        self._log(f"{signum.name}: already stopping gracefully (SIGTERM or SIGINT cuts now)")

    async def on_reload(self) -> None:
        self.nursery.start_soon(self.reload)

    async def on_restart(self) -> None:
        self.nursery.start_soon(self.restart)

    async def on_reopen_logs(self) -> None:
        for worker in list(self.workers):
            await self._tell(worker, {"type": "reopen_logs"})

    async def on_refused(self, signum: signal.Signals) -> None:
        self._log(f"{signum.name} ignored: stopping", logging.WARNING)

    async def stop(self, *, cut: bool) -> None:
        """Tell every worker to stop (drain, or ``cut``); kill those left at the deadline."""
        if self.phase is not Phase.STOPPING:
            self.phase = Phase.STOPPING
            grace: float = self.config.timeouts.shutdown_grace
            self._kill_at = trio.current_time() + grace + KILL_MARGIN
            if not cut:
                self._log(
                    f"stopping: {len(self.workers)} workers drain their streams"
                    f" (up to {grace:g}s; a second SIGTERM or SIGINT cuts them)"
                )
            self.nursery.start_soon(self._kill_stragglers)
            if not self.workers:
                self.done.set()
        elif cut:
            self._log(f"cutting the streams of {len(self.workers)} workers")
        for worker in list(self.workers):
            worker.state = WorkerState.STOPPING
            await self._tell(worker, {"type": "cut" if cut else "stop"})

    async def _kill_stragglers(self) -> None:
        await trio.sleep_until(self._kill_at)
        for worker in list(self.workers):
            self._log(f"worker {worker.pid} had not drained; killed", logging.WARNING)
            worker.process.kill()

    async def _tell(self, worker: Worker, message: Message) -> None:
        try:
            await worker.channel.send(message)
        except trio.BrokenResourceError:
            pass  # It is exiting; _watch sees to it.

    # ---- reload and rolling restart -------------------------------------------------------

    async def reload(self) -> ReloadResult:
        """Apply the configuration file again (SIGHUP); an invalid one changes nothing."""
        async with self.lock:
            if self.config_path is None:
                self._log("SIGHUP: nothing to reload (configured by --listen, not --config)")
                why = "nothing to reload: configured by --listen, not --config"
                return ReloadResult(ok=False, errors=[why], generation=self.generation)
            config = reread(self.config_path, self.log_level)
            if isinstance(config, list):
                return self._refused(config)
            # The file has no servers for the groups it discovers: the last good sets stay.
            config = with_discovered(config, self.discovered)
            current = {listener.address for listener in config.listeners}
            added = [item for item in config.listeners if item.address not in self.sockets]
            try:
                new = bind_listeners(added, self.count)
            except OSError as exc:
                return self._refused([f"{self.config_path}: {exc}"])
            generation = self.generation + 1
            targets = [w for w in self.workers if w.state is not WorkerState.STOPPING]
            errors = await reload_each(targets, config, new, generation, self._ids)
            if errors and not any(w.generation == generation for w in targets):
                close_listeners(new)
                return self._refused(errors)
            removed = {a: s for a, s in self.sockets.items() if a not in current}
            self.sockets = {
                **{a: s for a, s in self.sockets.items() if a in current},
                **new,
            }
            # Every worker has closed its copies of a removed listener's sockets.
            close_listeners(removed)
            self.config, self.generation = config, generation
            configure_error_log(config.log.level)
            for line in listening_lines(
                attrs.evolve(config, listeners=tuple(added)),
                [s.getsockname()[:2] for item in added for s in new[item.address][0]],
            ):
                print(line, flush=True)
            for error in errors:
                self._log(f"reload: {error}", logging.WARNING)
            pids = ", ".join(str(w.pid) for w in targets if w.generation == generation)
            self._log(f"reloaded {self.config_path} (generation {generation}; workers {pids})")
            self.discovery.wake()  # a group's discover table may have changed
            return ReloadResult(ok=not errors, errors=errors, generation=generation)

    def _refused(self, errors: list[str]) -> ReloadResult:
        for error in errors:
            self._log(f"reload refused: {error}", logging.ERROR)
        path, generation = self.config_path, self.generation
        self._log(f"{path} not applied; still running generation {generation}", logging.ERROR)
        return ReloadResult(ok=False, errors=errors, generation=self.generation)

    async def restart(self) -> ReloadResult:
        """Replace every worker, slot by slot, with one running the installed code (SIGUSR2)."""
        async with self.lock:
            started: list[int] = []
            for slot in range(self.count):
                if self.phase is not Phase.SERVING:
                    return ReloadResult(ok=False, errors=["stopping"], generation=self.generation)
                old = self.slots[slot]
                try:
                    new = await self._spawn(slot)
                except OSError as exc:
                    error = f"rolling restart aborted: cannot start a worker: {exc}"
                    self._log(f"{error}; the old workers keep serving", logging.ERROR)
                    return ReloadResult(ok=False, errors=[error], generation=self.generation)
                with trio.move_on_after(STARTUP_TIMEOUT):
                    await first_of(new.listening.wait, new.exited.wait)
                if not new.listening.is_set():
                    why = (
                        f"did not listen within {STARTUP_TIMEOUT:g}s"
                        if new.live
                        else describe_exit(new.returncode)
                    )
                    new.state = WorkerState.STOPPING
                    new.process.kill()
                    keeps = f"worker {old.pid} keeps" if old is not None else "nobody holds"
                    error = f"rolling restart aborted: the new worker {new.pid} {why}"
                    self._log(f"{error}; {keeps} slot {slot}", logging.ERROR)
                    return ReloadResult(ok=False, errors=[error], generation=self.generation)
                self.slots[slot] = new
                started.append(new.pid)
                if old is not None and old.live:
                    old.state = WorkerState.STOPPING
                    await self._tell(old, {"type": "stop"})
            self._log(f"rolling restart done: workers {', '.join(map(str, started))}")
            return ReloadResult(ok=True, errors=[], generation=self.generation)

    # ---- requests to every worker ---------------------------------------------------------

    async def ask_all(
        self, message: Message, workers: list[Worker] | None = None
    ) -> list[tuple[Worker, Message | None]]:
        """``message`` to each live worker; each worker's answer, None for one that gave none."""
        return await ask_each(
            list(self.workers) if workers is None else workers, message, self._ids
        )

    async def apply_runtime(self, state: RuntimeState, *, timeout: float) -> None:
        """Make ``state`` the runtime state of every worker, and of the ones to come."""
        self.runtime = state
        with trio.move_on_after(timeout):
            await self.ask_all(self._runtime_message())

    async def apply_discovered(self, sets: Mapping[str, Sequence[Target]]) -> None:
        """Make ``sets`` (group -> last good set) the discovering groups' servers in every
        worker (the ``discovered`` message), and in the workers to come (``config``)."""
        async with self.lock:
            self.discovered.update((name, tuple(targets)) for name, targets in sets.items())
            config = with_discovered(self.config, self.discovered)
            if config is self.config:
                return
            self.config = config
            message = {
                "type": "discovered",
                "sets": encode_sets(self.discovered),
                "id": next(self._ids),
            }
            with trio.move_on_after(REPLY_TIMEOUT):
                await self.ask_all(message)

    def discovery_status(self) -> dict[str, Any]:
        return self.discovery.status(trio.current_time())

    def _runtime_message(self) -> Message:
        return {"type": "runtime", "state": self.runtime.to_json(), "id": next(self._ids)}

    async def snapshots(self) -> list[dict[str, Any]]:
        """Measurements of every worker: the live ones' now, the exited ones' last."""
        retired = self.retired.snapshots()  # before a worker exits while we ask
        answered = Retired.answered(await self.ask_all({"type": "metrics?"}))
        return [*retired, *answered, self.discovery.snapshot(trio.current_time())]

    def readiness(self) -> Readiness:
        """Whether new traffic is taken now (:func:`~muxproxy.process.supervision.readiness_of`)."""
        return readiness_of(self.phase, self.workers)

    def bound_addresses(self) -> list[tuple[str, int]]:
        """Every listening socket's (host, port), one per address, in the configuration's order."""
        return [
            (sock.getsockname()[0], sock.getsockname()[1])
            for listener in self.config.listeners
            for sock in self.sockets[listener.address][0]
        ]

    def _log(self, text: str, level: int = logging.INFO) -> None:
        """A line of the error log, as a worker's (``configure_error_log``)."""
        log.log(level, "muxproxy: %s", text)

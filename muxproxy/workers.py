"""``muxproxy serve --workers N``: N worker processes sharing the listeners with SO_REUSEPORT.

Each worker is a whole, independent proxy: its own Trio loop, ``ProxyCore``, connection pools
and health state. Nothing is shared or synchronised between workers, which is why this is
simple: the Linux kernel spreads new connections over the workers' listening sockets (by a hash
of the 4-tuple, ``SO_REUSEPORT``), and sticky routing still agrees across workers because it is
rendezvous hashing over the same configuration. Passive and active health are per worker: each
learns for itself that a backend is down.

Theory of operation. The supervisor (the process the user started) never serves a request:

* It reserves ports first. A listener configured with port 0 gets one socket bound with
  ``SO_REUSEADDR`` + ``SO_REUSEPORT`` and kept bound, not listening, until the supervisor exits:
  every worker, replacements included, binds that same concrete port, and no other program can
  take it while a worker restarts. A bound socket that does not listen is never handed a
  connection.
* It starts each worker as ``python -c`` (:data:`_WORKER_CODE`) with the configuration pickled on
  its stdin, in a process group of its own (a terminal's Ctrl-C reaches the supervisor alone,
  which forwards it: one signal per worker). A worker reports its bound addresses as one JSON
  line on a status pipe once it listens; end of file on that pipe means it has exited.
* Once every worker listens it prints ``muxproxy listening on ...`` (as one process would).
* SIGINT and SIGTERM are forwarded to the workers, which get :data:`SHUTDOWN_GRACE` seconds to
  exit before SIGKILL; the supervisor then exits 0, as Ctrl-C of one process does.
* A worker that dies is reported on stderr and replaced, at most N times within
  :data:`RESTART_WINDOW` seconds: past that the workers stop and the supervisor exits 1, rather
  than spin on a crash loop. A worker that dies before every worker listens (a port in use, a
  bad certificate) fails the start: exit 1, after the worker's own message saying why.

A worker asks the kernel for SIGTERM when the supervisor dies (``PR_SET_PDEATHSIG``), so no
worker outlives it, even one killed with SIGKILL. Both are Linux-only; so is ``--workers N``.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import json
import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from functools import partial
from typing import assert_never

import attrs
import trio

from muxproxy.cli import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    freeze_startup_heap,
    leaves,
    listening_lines,
)
from muxproxy.config import Config, Listener
from muxproxy.trio.server import serve

SHUTDOWN_GRACE = 5.0
"""Seconds a worker has to exit after a forwarded signal before it is killed."""
STARTUP_TIMEOUT = 30.0
"""Seconds every worker has to start listening; a start that hangs fails instead."""
RESTART_WINDOW = 10.0
"""Seconds over which replacements are counted: N workers may be replaced N times in it."""

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_WORKER_CODE = "from muxproxy.workers import worker_main; raise SystemExit(worker_main())"
"""A worker's ``python -c`` program; its arguments are the supervisor's pid and the status fd."""
_PR_SET_PDEATHSIG = 1
"""From ``<linux/prctl.h>``."""

Address = tuple[str, int]


class _Phase(enum.Enum):
    STARTING = "starting"
    """Not every worker has reported that it listens; a death fails the start."""
    SERVING = "serving"
    """Every worker has listened once; a death is replaced."""


@attrs.define
class _Worker:
    process: subprocess.Popen[bytes]
    status: int
    """Read end of the worker's status pipe: its bound addresses, then end of file at exit."""
    received: bytes = b""
    bound: list[Address] | None = None
    """What the worker reported once it listened; None before."""


@attrs.frozen(kw_only=True)
class _Listening:
    worker: _Worker


@attrs.frozen(kw_only=True)
class _Died:
    worker: _Worker
    returncode: int


@attrs.frozen(kw_only=True)
class _Signalled:
    signum: int


_Event = _Listening | _Died | _Signalled


def supervise(config: Config, count: int) -> int:
    """Serve ``config`` with ``count`` worker processes until a signal; returns the exit status.

    0 after SIGINT or SIGTERM; 1 when the workers cannot start or keep dying; 2 off Linux.
    """
    if sys.platform != "linux":
        print("muxproxy serve: --workers above 1 needs Linux (SO_REUSEPORT)", file=sys.stderr)
        return EXIT_USAGE
    try:
        with contextlib.ExitStack() as stack:
            concrete = stack.enter_context(_reserved_ports(config))
            wakeup = stack.enter_context(_signal_wakeup())
            supervisor = _Supervisor(concrete, count, wakeup)
            stack.callback(supervisor.selector.close)
            stack.callback(supervisor.stop_all, signal.SIGTERM)
            return supervisor.run()
    except OSError as exc:
        print(f"muxproxy: cannot serve: {exc}", file=sys.stderr)
        return EXIT_FAILURE


class _Supervisor:
    def __init__(self, config: Config, count: int, wakeup: socket.socket) -> None:
        self.config = config
        self.count = count
        self.payload = pickle.dumps(config)
        self.wakeup = wakeup
        self.selector = selectors.DefaultSelector()
        self.selector.register(wakeup, selectors.EVENT_READ, None)
        self.workers: list[_Worker] = []
        self.phase = _Phase.STARTING
        self.restarts: deque[float] = deque()
        """When each recent replacement started (within :data:`RESTART_WINDOW`)."""

    def run(self) -> int:
        """Start the workers and look after them until a signal; returns the exit status."""
        self.workers = [self._spawn() for _ in range(self.count)]
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            timeout = None
            if self.phase is _Phase.STARTING:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    print(
                        f"muxproxy: workers did not all listen within {STARTUP_TIMEOUT:g}s",
                        file=sys.stderr,
                    )
                    return EXIT_FAILURE
            for event in self._wait(timeout):
                status = self._handle(event)
                if status is not None:
                    return status

    def _handle(self, event: _Event) -> int | None:
        """Act on ``event``; returns the exit status once the supervisor is done."""
        match event:
            case _Signalled(signum=signum):
                self.stop_all(signal.Signals(signum))
                return EXIT_OK
            case _Listening():
                bound = event.worker.bound
                assert bound is not None
                if self.phase is _Phase.STARTING and all(w.bound for w in self.workers):
                    # Every worker bound the same addresses: print them once, as one process.
                    self.phase = _Phase.SERVING
                    for line in listening_lines(self.config, bound):
                        print(line, flush=True)
                return None
            case _Died(worker=worker, returncode=returncode):
                what = f"muxproxy: worker {worker.process.pid} {_describe_exit(returncode)}"
                if self.phase is _Phase.STARTING:
                    print(f"{what} while starting", file=sys.stderr)
                    return EXIT_FAILURE
                if not self._may_restart():
                    print(
                        f"{what}; {len(self.restarts)} workers replaced within"
                        f" {RESTART_WINDOW:g}s, giving up",
                        file=sys.stderr,
                    )
                    return EXIT_FAILURE
                print(f"{what}; starting another", file=sys.stderr)
                self.workers.append(self._spawn())
                return None
            case _:
                assert_never(event)

    def _may_restart(self) -> bool:
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > RESTART_WINDOW:
            self.restarts.popleft()
        if len(self.restarts) >= self.count:
            return False
        self.restarts.append(now)
        return True

    def _spawn(self) -> _Worker:
        status, status_out = os.pipe()
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", _WORKER_CODE, str(os.getpid()), str(status_out)],
                stdin=subprocess.PIPE,
                pass_fds=(status_out,),
                process_group=0,
            )
        except BaseException:
            os.close(status)
            raise
        finally:
            # Only the worker holds the write end now: end of file means it has exited.
            os.close(status_out)
        assert process.stdin is not None
        try:
            with process.stdin:
                process.stdin.write(self.payload)
        except BrokenPipeError:
            pass  # It died at once; its status pipe will say so.
        worker = _Worker(process=process, status=status)
        self.selector.register(status, selectors.EVENT_READ, worker)
        return worker

    def _wait(self, timeout: float | None) -> list[_Event]:
        events: list[_Event] = []
        for key, _ in self.selector.select(timeout):
            worker = key.data
            if worker is None:
                with contextlib.suppress(BlockingIOError):
                    events.extend(_Signalled(signum=n) for n in self.wakeup.recv(64))
                continue
            assert isinstance(worker, _Worker)
            data = os.read(worker.status, 4096)
            if not data:
                events.append(_Died(worker=worker, returncode=self._reap(worker)))
                continue
            worker.received += data
            if worker.bound is None and b"\n" in worker.received:
                line, _, worker.received = worker.received.partition(b"\n")
                worker.bound = [(host, port) for host, port in json.loads(line)]
                events.append(_Listening(worker=worker))
        return events

    def _reap(self, worker: _Worker) -> int:
        """Forget ``worker``, whose status pipe has ended; returns its exit status."""
        self._forget(worker)
        try:
            return worker.process.wait(timeout=SHUTDOWN_GRACE)
        except subprocess.TimeoutExpired:  # It closed the pipe but lives on: a bug.
            worker.process.kill()
            return worker.process.wait()

    def _forget(self, worker: _Worker) -> None:
        self.workers.remove(worker)
        self.selector.unregister(worker.status)
        os.close(worker.status)

    def stop_all(self, signum: signal.Signals) -> None:
        """Send ``signum`` to every worker; kill those still running after the grace period."""
        for worker in self.workers:
            worker.process.send_signal(signum)
        deadline = time.monotonic() + SHUTDOWN_GRACE
        for worker in list(self.workers):
            try:
                worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"muxproxy: worker {worker.process.pid} killed", file=sys.stderr)
                worker.process.kill()
                worker.process.wait()
            self._forget(worker)


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:  # a real-time signal has no name of its own
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


@contextlib.contextmanager
def _reserved_ports(config: Config) -> Iterator[Config]:
    """``config`` with each port 0 replaced by a port reserved until the context exits."""
    with contextlib.ExitStack() as stack:
        listeners: list[Listener] = []
        for listener in config.listeners:
            if listener.port == 0:
                sock = stack.enter_context(_reserve_port(listener.host))
                host_part = listener.address.rsplit(":", 1)[0]
                port = sock.getsockname()[1]
                listener = attrs.evolve(listener, address=f"{host_part}:{port}")
            listeners.append(listener)
        yield attrs.evolve(config, listeners=tuple(listeners))


def _reserve_port(host: str) -> socket.socket:
    """A socket bound to a free port of ``host``'s first address, in a SO_REUSEPORT group."""
    family, type_, proto, _, sockaddr = socket.getaddrinfo(
        host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, type_, proto)
    try:
        # The same options as the workers' listeners (muxproxy.trio.listeners), which the
        # kernel requires of every socket sharing the port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(sockaddr)
    except BaseException:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def _signal_wakeup() -> Iterator[socket.socket]:
    """A socket that turns readable when SIGINT or SIGTERM arrives; reads give the numbers.

    The handlers do nothing: Python's C-level handler writes the signal number to the wakeup
    fd, so the supervisor's ``select`` sees a signal like any other event, with no exception
    raised at an arbitrary point (halfway through starting a worker).
    """
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    previous = {signum: signal.signal(signum, _note_signal) for signum in FORWARDED_SIGNALS}
    try:
        yield reader
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(previous_fd)
        reader.close()
        writer.close()


def _note_signal(signum: int, frame: object) -> None:
    """Nothing to do: the wakeup fd carries the signal to the supervisor's loop."""


# ---- the worker ---------------------------------------------------------------------------


def worker_main() -> int:
    """A worker process: ``sys.argv[1:]`` are the supervisor's pid and the status fd.

    Reads the pickled configuration from stdin, serves it with SO_REUSEPORT, and writes its
    bound addresses to the status fd once listening. Returns the exit status: 0 after SIGINT,
    1 when it cannot listen.
    """
    supervisor, status = int(sys.argv[1]), int(sys.argv[2])
    _exit_with(supervisor)

    async def serve_and_report(config: Config) -> None:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(partial(serve, config, reuse_port=True))
            freeze_startup_heap()
            os.write(status, json.dumps(bound).encode() + b"\n")

    exit_status = EXIT_OK
    try:
        config = pickle.load(sys.stdin.buffer)
        assert isinstance(config, Config)
        trio.run(serve_and_report, config)
    except* KeyboardInterrupt:
        pass
    except* OSError as group:
        for exc in leaves(group):
            print(f"muxproxy: worker {os.getpid()}: cannot serve: {exc}", file=sys.stderr)
        exit_status = EXIT_FAILURE
    return exit_status


def _exit_with(supervisor: int) -> None:
    """Have the kernel send this process SIGTERM when the supervisor exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != supervisor:  # It exited before the prctl: no signal will come.
        raise SystemExit(EXIT_FAILURE)

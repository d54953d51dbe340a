"""A recording ``Sink`` for the reactor's tests, and the loopback peers they talk to.

:class:`Recorder` stands where ``Driver`` stands: the reactor (``muxproxy/trio/reactor.py``)
feeds it events and reports what the kernel took and which connections closed. It records all
of it, in one numbered sequence, and carries out a test's commands for each event it is fed
(``react``), as ``Driver.feed`` carries out the core's. Like the driver it asks for
``Reactor.write_queued`` at the end of a round only when a ``send`` said its bytes wait for it,
so a ``send`` that wrongly says they do not leaves them unwritten, and the test waiting for
them fails.

It also checks what the ``Sink`` protocol promises of the reactor's calls: events are fed
only inside a round, never from inside the handling of another event, and rounds do not nest.
A broken promise is kept in ``violations`` (it would be lost if raised into the reactor,
which may contain it), and the ``recorder`` fixtures fail the test on it.

Every connection is a real TCP pair on 127.0.0.1 (:meth:`Recorder.pair`): the reactor owns
its end, the test holds the peer, non-blocking, and reads and writes it with the helpers
below, which wait on the socket with Trio, never for a while.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import TypeVar

import attrs
import trio

from muxproxy.config import quick_config
from muxproxy.core.events import DataReceived, Event
from muxproxy.core.proxy import ProxyCore
from muxproxy.trio.reactor import Reactor, SocketConn, tune

SMALL_BUFFER = 4096
"""Socket buffers of a pair made with ``small=True``: a payload of a MiB cannot go at once."""

ROUND_LIMIT = 10_000
"""Rounds a test's reactor may serve: past them it spins (a socket it neither serves nor
leaves), and the recorder stops it, as a test under ``MockClock`` would otherwise hang (a
busy reactor never lets the clock jump to the test's deadline)."""

E = TypeVar("E", bound=Event)


def pattern(size: int) -> bytes:
    """``size`` bytes whose order shows: a reordered or lost chunk does not compare equal."""
    block = bytes(range(256))
    return (block * (size // 256 + 1))[:size]


@attrs.frozen
class Fed:
    seq: int
    round: int
    event: Event


@attrs.frozen
class Sent:
    seq: int
    round: int | None
    """The round the bytes were written in, its ``settle`` included (None: outside one)."""
    conn: int
    nbytes: int
    at: float


@attrs.frozen
class Closed:
    seq: int
    conn: int
    error: str | None
    at: float


@attrs.frozen
class Released:
    """The socket was closed (``on_closed``): for a lingering one, after ``Closed``."""

    seq: int
    conn: int
    at: float


class Recorder:
    """A ``Sink`` (``muxproxy/trio/sink.py``) that records what the reactor tells it."""

    def __init__(self, core: ProxyCore, listener: socket.socket) -> None:
        self.reactor = Reactor(self, core)
        self.core = core
        self.raise_errors = True
        self.react: Callable[[Event], None] = lambda event: None
        """The test's commands for each event fed (the core's, in the driver)."""
        self.conns: dict[int, SocketConn] = {}
        self.rounds = 0
        """Rounds begun."""
        self.settled = 0
        self.ended_without_settle = 0
        self.fed: list[Fed] = []
        self.sent: list[Sent] = []
        self.closed: list[Closed] = []
        self.released: list[Released] = []
        self.open_failed: list[tuple[int, str]] = []
        self.forgotten: list[int] = []
        self.failed: list[tuple[int, str]] = []
        self.waits: list[bool] = []
        """What each :meth:`send` returned."""
        self.violations: list[str] = []
        self._listener = listener
        self._peers: list[socket.socket] = []
        self._seq = 0
        self._in_round = False
        self._settling = False
        self._feeding: Event | None = None
        self._gave_output = False
        self._changed = trio.Event()

    # -- the test's side -------------------------------------------------------------------

    def pair(
        self, ident: int, *, linger: bool = False, small: bool = False
    ) -> tuple[SocketConn, socket.socket]:
        """A new TCP connection served by the reactor as ``ident``, and its peer."""
        peer = socket.socket()
        if small:
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
        peer.connect(self._listener.getsockname())
        ours, _ = self._listener.accept()
        if small:
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
        tune(ours)
        peer.setblocking(False)
        self._peers.append(peer)
        return self.add(ident, ours, linger=linger), peer

    def add(self, ident: int, sock: socket.socket, *, linger: bool = False) -> SocketConn:
        conn = self.reactor.add(ident, sock, partial(self._released, ident), linger=linger)
        self.conns[ident] = conn
        return conn

    def send(self, conn: SocketConn, data: bytes) -> bool:
        """``SendData`` as the driver carries it out: ``Reactor.send``, and remember whether
        ``write_queued`` is wanted."""
        waits = self.reactor.send(conn, data)
        self.waits.append(waits)
        if waits:
            self._gave_output = True
        return waits

    def write_if_asked(self) -> None:
        """What ``Driver.settle`` does after commands carried out outside a round (a timer's,
        a task's): ``write_queued``, if a ``send`` asked for it."""
        if self._gave_output:
            self._gave_output = False
            self.reactor.write_queued()

    async def until(self, done: Callable[[], bool]) -> None:
        """Until ``done()`` is true, checked after each thing recorded (bound it by the
        test's ``fail_after``)."""
        while not done():
            await self._changed.wait()

    def events(self, conn: int, kind: type[E]) -> list[E]:
        """The events of type ``kind`` (``Event``: all) fed for ``conn``, in order."""
        return [
            f.event
            for f in self.fed
            if isinstance(f.event, kind) and getattr(f.event, "conn", None) == conn
        ]

    def data(self, conn: int) -> bytes:
        """Everything fed as ``DataReceived`` for ``conn``."""
        return b"".join(e.data for e in self.events(conn, DataReceived))

    def closed_of(self, conn: int) -> list[Closed]:
        return [c for c in self.closed if c.conn == conn]

    def sent_of(self, conn: int) -> list[Sent]:
        return [s for s in self.sent if s.conn == conn]

    # -- the Sink ----------------------------------------------------------------------------

    def begin_round(self) -> None:
        if self._in_round:
            self._violation("a round began inside another")
        self._in_round = True
        self.rounds += 1
        if self.rounds > ROUND_LIMIT:
            raise AssertionError(f"the reactor spins: {self.rounds} rounds")

    def end_round(self) -> None:
        self._in_round = False
        self.ended_without_settle += 1
        self._notify()

    def settle(self, now: float) -> None:
        if not self._in_round:
            self._violation("settle outside a round")
        self._in_round = False
        self.settled += 1
        self._settling = True
        try:
            self.write_if_asked()
        finally:
            self._settling = False
        self._notify()

    def feed(self, event: Event) -> None:
        if not self._in_round:
            self._violation(f"{event!r} fed outside a round")
        if self._feeding is not None:
            self._violation(f"{event!r} fed while {self._feeding!r} was handled")
        self.fed.append(Fed(seq=self._next(), round=self.rounds, event=event))
        self._feeding = event
        try:
            self.react(event)
        finally:
            self._feeding = None
            self._notify()

    def sent_now(self, ident: int, nbytes: int) -> None:
        round_ = self.rounds if self._in_round or self._settling else None
        now = trio.current_time()
        self.sent.append(Sent(seq=self._next(), round=round_, conn=ident, nbytes=nbytes, at=now))
        self._notify()

    def closed_now(self, ident: int, error: str | None) -> None:
        now = trio.current_time()
        self.closed.append(Closed(seq=self._next(), conn=ident, error=error, at=now))
        self._notify()

    def open_failed_now(self, ident: int, reason: str) -> None:
        self.open_failed.append((ident, reason))
        self._notify()

    def forget(self, ident: int) -> None:
        self.forgotten.append(ident)
        self.conns.pop(ident, None)

    def connection_failed(self, ident: int, exc: BaseException, *, where: str) -> None:
        """As ``Driver.connection_failed``: the connection is abandoned."""
        self.failed.append((ident, where))
        conn = self.conns.get(ident)
        if conn is not None:
            self.reactor.abandon(conn, "internal error")

    # -- bookkeeping -----------------------------------------------------------------------

    def _released(self, ident: int) -> None:
        self.released.append(Released(seq=self._next(), conn=ident, at=trio.current_time()))
        self._notify()

    def _violation(self, what: str) -> None:
        self.violations.append(what)

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def close_peers(self) -> None:
        for peer in self._peers:
            peer.close()


def make_core() -> ProxyCore:
    """A real core: the reactor asks it for ``read_size`` (the tests feed it nothing)."""
    return ProxyCore(quick_config("127.0.0.1:0", ["127.0.0.1:9"]), raise_errors=True)


@asynccontextmanager
async def recording() -> AsyncIterator[Recorder]:
    """A :class:`Recorder` whose reactor runs until the block ends; then its peers close.
    Fails on a broken promise of the ``Sink`` protocol (see the module)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        recorder = Recorder(make_core(), listener)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(recorder.reactor.run)
                yield recorder
                nursery.cancel_scope.cancel()
        finally:
            recorder.close_peers()
    assert not recorder.violations, recorder.violations


# -- the peer's side: non-blocking stdlib sockets, waited on with Trio -----------------------


def peek(peer: socket.socket) -> bytes:
    """What has arrived at ``peer`` and not been read, left unread."""
    try:
        return peer.recv(1 << 20, socket.MSG_PEEK)
    except BlockingIOError:
        return b""


async def receive(peer: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes (fails at an early end of file)."""
    data = bytearray()
    while len(data) < size:
        await trio.lowlevel.wait_readable(peer)
        chunk = peer.recv(size - len(data))
        assert chunk, f"end of file after {len(data)} of {size} bytes"
        data += chunk
    return bytes(data)


async def receive_to_eof(peer: socket.socket) -> bytes:
    """Everything until the end of file (raises ``ConnectionResetError`` at an RST)."""
    data = bytearray()
    while True:
        await trio.lowlevel.wait_readable(peer)
        try:
            chunk = peer.recv(1 << 20)
        except BlockingIOError:
            continue
        if not chunk:
            return bytes(data)
        data += chunk


async def send_all(peer: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        await trio.lowlevel.wait_writable(peer)
        try:
            sent = peer.send(view)
        except BlockingIOError:
            continue
        view = view[sent:]


def drain(peer: socket.socket) -> int:
    """Read and drop what has arrived, without waiting; how many bytes that was."""
    total = 0
    while True:
        try:
            chunk = peer.recv(1 << 20)
        except BlockingIOError:
            return total
        if not chunk:
            return total
        total += len(chunk)

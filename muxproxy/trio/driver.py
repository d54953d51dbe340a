"""The Trio driver: sockets, timers and the execution of the core's commands.

It holds no proxy logic. Plain TCP sockets are served by the reactor (``reactor.py``): one task
that handles every ready socket per wake-up. TLS connections have a reader task (bytes ->
``DataReceived``) and a writer task (pending bytes -> one ``send_all`` -> ``DataSent``); TLS to
a backend is ``backendtls.py``'s. One task runs every timer from a deadline heap
(``timerheap.py``). Any of them may call ``ProxyCore.handle`` directly: Trio runs one task at
a time and ``handle`` never awaits, so there is no lock and no hop through a channel per chunk.

Events a command causes (bytes written, a connection closed) are fed after the batch that
caused them (``settle``): ``handle`` is never re-entered. Async hooks: ``hookcalls.py``.

Fault isolation, as in the core (``core/faults.py``): an exception in the driver's own code for
one connection (executing a command for it, reading or writing its socket, its tasks) closes
that connection, is logged (``internal_error``) and counted in ``ProxyCore.counters``, and the
core hears ``ConnectionClosed``; every other connection goes on. An exception out of
``ProxyCore.handle`` itself (the core contains its own, so one that escapes is a broken
invariant) and a bug in the loops that serve every connection still crash, as does everything
with ``ProxyCore.raise_errors``.
"""

from __future__ import annotations

import contextlib
import socket
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from muxproxy.core.commands import (
    BudgetReserve,
    BudgetSettle,
    CancelTimer,
    CloseConnection,
    Command,
    ExtensionCall,
    Log,
    OpenConnection,
    PauseReading,
    ResumeAppend,
    ResumeFetch,
    ResumeFetchCancel,
    ResumeFetchMore,
    ResumeProbe,
    ResumeReading,
    SendData,
    SessionsRemembered,
    SetTimer,
    ShutdownWrite,
)
from muxproxy.core.events import (
    ConnectionClosed,
    ConnectionOpened,
    DataReceived,
    DataSent,
    Event,
    InputEnded,
    OpenFailed,
    TimerId,
    Wakeup,
)
from muxproxy.core.proxy import ProxyCore
from muxproxy.core.raising import raised_by_handle
from muxproxy.trio import kvfollow, reactor
from muxproxy.trio.backendtls import BackendTLS, BackendTLSError
from muxproxy.trio.hookcalls import call_hook
from muxproxy.trio.logs import drop_access
from muxproxy.trio.reactor import Reactor
from muxproxy.trio.socketconn import SocketConn
from muxproxy.trio.sockets import detach_socket, is_ip_address, set_nodelay
from muxproxy.trio.timerheap import TimerHeap

if TYPE_CHECKING:
    from muxproxy.trio.fleetbudgets import FleetBudgets
    from muxproxy.trio.resumestore import ResumeStores


def _nothing() -> None:
    """``settle``'s writer of queued reactor output where there is no reactor."""


class StreamConn:
    """A connection served by a reader and a writer task (TLS, or no epoll on this platform)."""

    __slots__ = (
        "closed",
        "closing",
        "error",
        "ident",
        "paused",
        "pending",
        "resume",
        "scope",
        "send_started",
        "shutdown_wanted",
        "stream",
        "writer_lot",
    )

    def __init__(self, ident: int, stream: trio.abc.Stream) -> None:
        self.ident = ident
        self.stream = stream
        self.pending = bytearray()
        self.writer_lot = trio.lowlevel.ParkingLot()
        self.paused = False
        self.resume = trio.Event()
        self.closing = False
        self.closed = False
        self.scope = trio.CancelScope()
        self.send_started: float | None = None
        """When the ``send_all`` in flight began; None while the writer is not sending."""
        self.shutdown_wanted = False
        """``ShutdownWrite`` on a stream that can half-close: ``send_eof`` once flushed."""
        self.error: str | None = None
        """Why the writer failed: the connection broke, it did not close cleanly."""


class Driver:
    def __init__(self, core: ProxyCore, nursery: trio.Nursery) -> None:
        self.core = core
        self.nursery = nursery
        self.conns: dict[int, StreamConn | SocketConn] = {}
        self.connecting: dict[int, trio.CancelScope] = {}
        self._next_client = 0
        self.timers = TimerHeap()
        self._execute: dict[type[Command], Callable[[Any], None]] = {
            SendData: self._send_data,
            SetTimer: self.timers.set,
            CancelTimer: self.timers.cancel,
            PauseReading: self._pause,
            ResumeReading: self._resume,
            CloseConnection: self._close,
            ShutdownWrite: self._shutdown_write,
            OpenConnection: self._open,
            Log: self.log,
            ResumeAppend: self._resume_append,
            ResumeFetch: self._resume_fetch,
            ResumeFetchMore: self._resume_fetch_more,
            ResumeFetchCancel: self._resume_fetch_cancel,
            ResumeProbe: self._resume_probe,
            BudgetReserve: lambda command: self._budgets().reserve(command),
            BudgetSettle: lambda command: self._budgets().settle(command),
            SessionsRemembered: self._sessions_remembered,
            ExtensionCall: lambda command: self.nursery.start_soon(call_hook, self, command),
            **kvfollow.executors(self),  # the engines' KV-cache events and tokens
        }
        self._fleet_budgets: FleetBudgets | None = None
        """Fleet-wide budgets (``fleetbudgets.py``), made at the start with ``[fleet]``."""
        self._resume_stores: ResumeStores | None = None
        """The shared resume stores (``resumestore.py``), made on the first command for one:
        a proxy without ``resume.store`` never imports ``coredis``."""
        self.backend_tls = BackendTLS()
        self.reactor = Reactor(self, core) if reactor.available() else None
        self._write_queued: Callable[[], None] = (
            self.reactor.write_queued if self.reactor is not None else _nothing
        )
        """Bound once: ``settle`` calls it."""
        self._gave_output = False
        """``Reactor.send`` left output since ``settle`` last called ``write_queued``."""
        self._in_round = False
        """While the reactor handles a round of ready sockets: ``feed`` leaves ``settle`` to it."""
        self._sent_now: dict[int, int] = {}
        """Bytes the kernel took, per connection, not yet reported."""
        self._later: deque[Event] = deque()
        """Connections closed or failed to open, not yet reported."""
        self.on_settled: Callable[[float], None] | None = None
        """Called with the batch's time after each batch is settled (while the server stops)."""
        self.on_sessions: Callable[[SessionsRemembered], None] | None = None
        """Where the core's batches of remembered sessions go (``fleetsessions.py``): the
        supervisor's channel or the fleet store; None: nowhere (they are not shared)."""
        self.on_log: Callable[[Log], None] | None = None
        """Tests hook here to see the core's ``Log`` commands."""
        self.sink: Callable[[Log, float], None] = drop_access
        """Where ``Log`` commands go, with the wall time (``ProxyServer``'s ``logs.LogSink``)."""
        self.raise_errors = core.raise_errors
        """Let a bug in per-connection code crash the driver instead of closing the one
        connection (``ProxyCore.raise_errors``)."""

    def start(self) -> None:
        """Start the driver's own tasks: the timers and, on Linux, the reactor."""
        self.nursery.start_soon(self.run_timers)
        fleet = self.core.config.fleet
        if fleet is not None:
            self._budgets().start(fleet.store)  # in the replica count before any request
        if self.reactor is not None:
            self.nursery.start_soon(self.reactor.run)

    def feed(self, event: Event) -> None:
        """Hand one event to the core and carry out its commands."""
        execute = self._execute
        for command in self.core.handle(event):
            try:
                execute[type(command)](command)
            except Exception as exc:
                self.command_failed(command, exc)
        if not self._in_round:
            self.settle(event.now)

    # -- the reactor's :class:`~muxproxy.trio.reactor.Sink` ----------------------------------

    def begin_round(self) -> None:
        self._in_round = True

    def end_round(self) -> None:
        self._in_round = False

    def settle(self, now: float) -> None:
        """Write what the commands queued and feed what that caused, until nothing is left.

        ``handle`` is never re-entered from inside the execution of its own commands: bytes
        the kernel took and connections closed are reported here, after the batch, bytes
        first (a connection's DataSent precedes its ConnectionClosed). The reactor writes
        each connection's queued output in one ``send`` here, however many commands queued it.
        ``now``: the time of the batch, which the DataSent events carry. Ends the reactor's
        round, if one is under way.
        """
        self._in_round = False
        execute = self._execute
        handle = self.core.handle
        write_queued = self._write_queued
        sent_now = self._sent_now
        later_events = self._later
        while True:
            if self._gave_output:
                self._gave_output = False
                write_queued()
            later: Event
            if sent_now:
                ident, nbytes = sent_now.popitem()
                later = DataSent(now=now, conn=ident, nbytes=nbytes)
            elif later_events:
                later = later_events.popleft()
            else:
                if self.on_settled is not None:
                    self.on_settled(now)
                return
            for command in handle(later):
                try:
                    execute[type(command)](command)
                except Exception as exc:
                    self.command_failed(command, exc)

    # -- fault isolation -------------------------------------------------------------------

    def command_failed(self, command: Command, exc: Exception) -> None:
        """Executing ``command`` raised: a bug of ours. Close its connection (a command for
        no connection, a timer's, is a bug in shared state: it re-raises)."""
        conn = getattr(command, "conn", None)
        if self.raise_errors or conn is None:
            raise exc
        self.connection_failed(conn, exc, where=type(command).__name__)

    def connection_failed(self, ident: int, exc: BaseException, *, where: str) -> None:
        """A bug in the driver's code for connection ``ident`` (not in the core): log and
        count it, close the connection and tell the core as for any broken connection."""
        self.core.counters["internal_errors"] += 1
        self.log(
            Log(
                event="internal_error",
                fields={
                    "conn": ident,
                    "where": f"driver: {where}",
                    "error": repr(exc),
                    "traceback": "".join(traceback.format_exception(exc)),
                },
            )
        )
        scope = self.connecting.pop(ident, None)
        if scope is not None:
            scope.cancel()  # ``_connect`` reports the ConnectionClosed
            return
        conn = self.conns.get(ident)
        if type(conn) is SocketConn:
            assert self.reactor is not None
            self.reactor.abandon(conn, "internal error")
        elif type(conn) is StreamConn:
            conn.closing = True
            conn.scope.cancel()  # ``run_connection`` reports the ConnectionClosed

    def sent_now(self, ident: int, nbytes: int) -> None:
        """The kernel took ``nbytes`` of ``ident``'s output (reported by ``settle``)."""
        self._sent_now[ident] = self._sent_now.get(ident, 0) + nbytes

    def open_failed_now(self, ident: int, reason: str) -> None:
        """The connect of ``ident`` failed (reported by ``settle``)."""
        self._later.append(OpenFailed(now=trio.current_time(), conn=ident, reason=reason))

    def closed_now(self, ident: int, error: str | None) -> None:
        """``ident`` is closed (reported by ``settle``)."""
        self._later.append(ConnectionClosed(now=trio.current_time(), conn=ident, error=error))

    def forget(self, ident: int) -> None:
        """``ident`` takes no more commands (the reactor closed it, or it lingers)."""
        self.conns.pop(ident, None)

    def new_client_id(self) -> int:
        self._next_client += 1
        return self._next_client

    # -- connections -----------------------------------------------------------------------

    def add_socket(
        self,
        ident: int,
        sock: socket.socket,
        on_closed: Callable[[], None] | None = None,
        *,
        linger: bool = False,
    ) -> SocketConn:
        """Serve a connected plain TCP socket from the reactor (which must exist) as ``ident``.

        No task waits for it: ``on_closed`` is called once the socket is closed. ``linger``:
        a client connection, closed in stages (see ``reactor.py``).
        """
        assert self.reactor is not None
        conn = self.reactor.add(ident, sock, on_closed, linger=linger)
        self.conns[ident] = conn
        return conn

    def register(self, ident: int, stream: trio.abc.Stream) -> StreamConn:
        """Make ``ident`` known, so commands for it queue up before its tasks start."""
        conn = StreamConn(ident, stream)
        self.conns[ident] = conn
        return conn

    async def run_connection(self, conn: StreamConn) -> None:
        """Read and write ``conn`` until either side closes it; report it closed once."""
        ident = conn.ident
        stream = conn.stream
        error: str | None = None
        try:
            with conn.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._writer, conn)
                    error = await self._reader(conn)
                    if not conn.closing:
                        nursery.cancel_scope.cancel()
        except Exception as exc:
            if self.raise_errors or raised_by_handle(exc):
                raise
            error = "internal error"
            self.connection_failed(ident, exc, where="connection task")
        finally:
            if conn.error is not None:
                # The writer failed and cancelled the reader: a broken connection, never a
                # clean close (a read-until-close body must end truncated, RFC 9112 §8).
                error = conn.error
            conn.closed = True
            self.conns.pop(ident, None)
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(1),
                contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError),
            ):
                await stream.aclose()
            self.feed(ConnectionClosed(now=trio.current_time(), conn=ident, error=error))

    async def _reader(self, conn: StreamConn) -> str | None:
        receive = conn.stream.receive_some
        feed = self.feed
        ident = conn.ident
        core = self.core
        while True:
            if conn.paused:
                await conn.resume.wait()
                continue
            try:
                data = await receive(core.read_size)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                return f"receive failed: {exc!r}"
            if not data:
                # The peer ended its side; writing goes on until the core closes (or the
                # writer fails).
                feed(InputEnded(now=trio.current_time(), conn=ident))
                await trio.sleep_forever()
            feed(DataReceived(now=trio.current_time(), conn=ident, data=bytes(data)))
            if conn.closing:
                await trio.sleep_forever()  # the writer flushes, then ends the connection

    async def _writer(self, conn: StreamConn) -> None:
        send_all = conn.stream.send_all
        feed = self.feed
        ident = conn.ident
        pending = conn.pending
        while True:
            if not pending:
                if conn.closing:
                    conn.scope.cancel()
                    return
                if conn.shutdown_wanted:
                    conn.shutdown_wanted = False
                    stream = conn.stream
                    assert isinstance(stream, trio.abc.HalfCloseableStream)
                    try:
                        await stream.send_eof()
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                        conn.error = f"send failed: {exc!r}"
                        conn.closing = True
                        conn.scope.cancel()
                        return
                    continue
                await conn.writer_lot.park()
                continue
            data = bytes(pending)
            pending.clear()
            conn.send_started = trio.current_time()
            try:
                await send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                conn.error = f"send failed: {exc!r}"
                conn.closing = True
                conn.scope.cancel()
                return
            conn.send_started = None
            feed(DataSent(now=trio.current_time(), conn=ident, nbytes=len(data)))

    def _send_data(self, command: SendData) -> None:
        conn = self.conns.get(command.conn)
        if conn is None:
            return
        if type(conn) is SocketConn:
            assert self.reactor is not None
            if self.reactor.send(conn, command.data):
                self._gave_output = True
        elif type(conn) is StreamConn and not conn.closed:
            conn.pending += command.data
            conn.writer_lot.unpark()

    def _pause(self, command: PauseReading) -> None:
        conn = self.conns.get(command.conn)
        if type(conn) is SocketConn:
            assert self.reactor is not None
            self.reactor.pause(conn)
        elif type(conn) is StreamConn and not conn.paused:
            conn.paused = True
            conn.resume = trio.Event()

    def _resume(self, command: ResumeReading) -> None:
        conn = self.conns.get(command.conn)
        if type(conn) is SocketConn:
            assert self.reactor is not None
            self.reactor.resume(conn)
        elif type(conn) is StreamConn and conn.paused:
            conn.paused = False
            conn.resume.set()

    def _close(self, command: CloseConnection) -> None:
        scope = self.connecting.pop(command.conn, None)
        if scope is not None:
            scope.cancel()
            return
        conn = self.conns.get(command.conn)
        if type(conn) is SocketConn:
            assert self.reactor is not None
            self.reactor.close(conn, command.flush_timeout, command.linger)
        elif type(conn) is StreamConn and not conn.closing:
            conn.closing = True
            # The flush before the close is bounded by the command: a peer that takes none
            # of the pending bytes for ``flush_timeout`` (counted from the start of the send
            # in flight, if any) is cut off. Without this bound a close issued *because* of
            # a send timeout (the client stopped reading) would wait in ``send_all`` forever.
            if command.flush_timeout is not None:
                started = conn.send_started
                if started is None:
                    started = trio.current_time()
                conn.scope.deadline = started + command.flush_timeout
            conn.writer_lot.unpark()

    def _shutdown_write(self, command: ShutdownWrite) -> None:
        conn = self.conns.get(command.conn)
        if type(conn) is SocketConn:
            assert self.reactor is not None
            self.reactor.shutdown_write(conn)
        elif (
            type(conn) is StreamConn
            and not conn.closing
            # TLS (``SSLStream``) cannot half-close: nothing is sent (see ``ShutdownWrite``;
            # a tunnel never asks it of a TLS side, ``core/tunnel/tunnel.py``).
            and isinstance(conn.stream, trio.abc.HalfCloseableStream)
        ):
            conn.shutdown_wanted = True
            conn.writer_lot.unpark()

    def _open(self, command: OpenConnection) -> None:
        origin = command.origin
        if self.reactor is not None and not origin.tls and is_ip_address(origin.host):
            # No name to resolve and no handshake: the reactor connects without a task.
            try:
                self.conns[command.conn] = self.reactor.connect(
                    command.conn, origin.host, origin.port
                )
            except OSError as exc:
                reason = str(exc) or repr(exc)
                self._later.append(
                    OpenFailed(now=trio.current_time(), conn=command.conn, reason=reason)
                )
            return
        self.nursery.start_soon(self._connect, command)

    async def _connect(self, command: OpenConnection) -> None:
        ident = command.conn
        origin = command.origin
        scope = trio.CancelScope()
        self.connecting[ident] = scope
        stream: trio.abc.Stream | None = None
        with scope:
            try:
                stream = await trio.open_tcp_stream(origin.host, origin.port)
                set_nodelay(stream)
                if origin.tls:
                    stream = await self.backend_tls.handshake(stream, origin)
            except (OSError, trio.BrokenResourceError, BackendTLSError) as exc:
                self.connecting.pop(ident, None)
                if stream is not None:
                    await trio.aclose_forcefully(stream)
                reason = str(exc) or repr(exc)
                self.feed(OpenFailed(now=trio.current_time(), conn=ident, reason=reason))
                return
            except Exception as exc:
                if self.raise_errors or raised_by_handle(exc):
                    raise
                self.connecting.pop(ident, None)
                if stream is not None:
                    await trio.aclose_forcefully(stream)
                self.connection_failed(ident, exc, where="connect")
                self.feed(OpenFailed(now=trio.current_time(), conn=ident, reason="internal error"))
                return
        if scope.cancelled_caught or stream is None:
            # The core gave up on this connection (connect timeout, client gone), maybe in
            # the middle of the TLS handshake: the TCP connection under it is closed too.
            if stream is not None:
                await trio.aclose_forcefully(stream)
            self.feed(ConnectionClosed(now=trio.current_time(), conn=ident, error="cancelled"))
            return
        self.connecting.pop(ident, None)
        if isinstance(stream, trio.SocketStream) and self.reactor is not None:
            self.add_socket(ident, detach_socket(stream))
            self.feed(ConnectionOpened(now=trio.current_time(), conn=ident))
            return
        conn = self.register(ident, stream)
        self.feed(ConnectionOpened(now=trio.current_time(), conn=ident))
        await self.run_connection(conn)

    # -- timers ----------------------------------------------------------------------------

    async def run_timers(self) -> None:
        await self.timers.run(self._fire)

    def _fire(self, now: float, timer: TimerId) -> None:
        self.feed(Wakeup(now=now, timer=timer))

    # -- the shared resume store (``resumestore.py``) --------------------------------------

    def _stores(self) -> ResumeStores:
        stores = self._resume_stores
        if stores is None:
            from muxproxy.trio.resumestore import ResumeStores

            stores = self._resume_stores = ResumeStores(self)
        return stores

    def _budgets(self) -> FleetBudgets:
        budgets = self._fleet_budgets
        if budgets is None:
            from muxproxy.trio.fleetbudgets import FleetBudgets

            budgets = self._fleet_budgets = FleetBudgets(self)
        return budgets

    def _resume_append(self, command: ResumeAppend) -> None:
        self._stores().append(command)

    def _resume_fetch(self, command: ResumeFetch) -> None:
        self._stores().fetch(command)

    def _resume_fetch_more(self, command: ResumeFetchMore) -> None:
        self._stores().more(command)

    def _resume_fetch_cancel(self, command: ResumeFetchCancel) -> None:
        self._stores().cancel(command)

    def _resume_probe(self, command: ResumeProbe) -> None:
        self._stores().probe(command)

    # -- the shared memory of sessions (``fleetsessions.py``) -------------------------------

    def _sessions_remembered(self, command: SessionsRemembered) -> None:
        if self.on_sessions is not None:
            self.on_sessions(command)

    def log(self, command: Log) -> None:
        """Hand ``command`` to the log sink (``on_log``); the stores log through it too."""
        if self.on_log is not None:
            self.on_log(command)
        self.sink(command, time.time())

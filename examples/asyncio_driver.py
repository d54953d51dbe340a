"""muxproxy's sans-IO core on asyncio streams: a second, complete driver, plain TCP only.

    python examples/asyncio_driver.py --listen 127.0.0.1:8080 --upstream 127.0.0.1:9001
    python examples/asyncio_driver.py --config muxproxy.toml

It obeys the driver contract of ``docs/embedding.md`` and nothing more: it holds no proxy
logic, it only moves bytes, timers and closes between asyncio and ``ProxyCore.handle``. It
prints ``muxproxy listening on http://HOST:PORT`` per bound socket once serving (as
``muxproxy serve`` does); the core's log records go to stderr as JSON lines. SIGINT or
SIGTERM stops gracefully (``timeouts.shutdown_grace``), a second one cuts what is left.

How the contract maps onto asyncio:

- one reader task per connection reads at most ``core.read_size`` bytes at a time and feeds
  ``DataReceived``; it does not read while the core has paused the connection. The
  ``StreamReader`` under it buffers at most about ``2 * read_size`` before asyncio stops
  reading the socket, so a paused peer is held back by TCP flow control;
- one writer task per connection sends what ``SendData`` queued, in one ``write``, and
  feeds ``DataSent`` once ``drain()`` returns. The transport's write buffer limit is 0, so
  ``drain()`` returns only when the kernel took every byte;
- ``CloseConnection`` stops reading, lets the writer flush, and cuts the connection when the
  flush makes no progress for the command's ``flush_timeout``; ``ConnectionClosed`` is fed
  exactly once per connection, however it ended;
- timers are ``loop.call_at`` handles on the loop's monotonic clock, which every event's
  ``now`` comes from; ``SetTimer`` replaces a timer, ``CancelTimer`` cancels it;
- ``feed`` is the only way into the core, and it queues: an event caused while the core's
  commands are being carried out is fed after them, never from inside ``handle``.

What the Trio driver (``muxproxy.trio``) does on top, left out here to stay short: TLS
listeners and backends, ``limits.max_client_connections``, lingering closes of client
connections (RFC 9112 §9.6), reloads, metrics and the admin API, worker processes.
It imports no trio (nor anything of ``muxproxy.trio``): the core needs none.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from muxproxy.config import Config, ConfigError, load_config, parse_quick_config
from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    Command,
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
    SetTimer,
    ShutdownWrite,
)
from muxproxy.core.events import (
    ConfigChanged,
    ConnectionAccepted,
    ConnectionClosed,
    ConnectionOpened,
    DataReceived,
    DataSent,
    Event,
    InputEnded,
    OpenFailed,
    ResumeFetched,
    ResumeProbed,
    ShutdownRequested,
    TimerId,
    Wakeup,
)
from muxproxy.core.proxy import ProxyCore
from muxproxy.core.raising import raised_by_handle

IO_ERRORS = (OSError, EOFError, asyncio.IncompleteReadError)
FLUSH_TIME = 2.0
"""Seconds the last connections get to flush once the core is drained, as in the Trio driver."""


class Conn:
    """One connection, client or backend: its streams, pending output and state."""

    def __init__(self, ident: int) -> None:
        self.ident = ident
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        """None while a backend connection is still connecting."""
        self.pending = bytearray()
        self.wake = asyncio.Event()
        """Set when the writer has something to do (output, a close, a shutdown)."""
        self.readable = asyncio.Event()
        """Clear while the core has paused reading (``PauseReading``)."""
        self.readable.set()
        self.closing = False
        self.flush_timeout: float | None = None
        self.flush_deadline: asyncio.TimerHandle | None = None
        self.shutdown_wanted = False
        self.closed = False
        self.done = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []


class AsyncioDriver:
    def __init__(self, core: ProxyCore) -> None:
        self.core = core
        self.loop = asyncio.get_running_loop()
        self.conns: dict[int, Conn] = {}
        self.connecting: dict[int, asyncio.Task[None]] = {}
        self.timers: dict[TimerId, asyncio.TimerHandle] = {}
        self.servers: list[asyncio.Server] = []
        self.stopping = 0
        self.stopped = asyncio.Event()
        self.crash: BaseException | None = None
        self._queue: collections.deque[Event] = collections.deque()
        self._feeding = False
        self._next_client = 0
        self._execute: dict[type[Command], Callable[[Any], None]] = {
            SendData: self._send_data,
            CloseConnection: self._close,
            ShutdownWrite: self._shutdown_write,
            PauseReading: self._pause,
            ResumeReading: self._resume,
            OpenConnection: self._open,
            SetTimer: self._set_timer,
            CancelTimer: self._cancel_timer,
            Log: self._log,
            # ``resume.store`` (a shared Redis) is the Trio driver's: here appends are dropped
            # and a resume of a token held elsewhere is refused (``resume_unavailable``).
            ResumeAppend: self._ignore,
            ResumeFetch: self._no_store,
            ResumeFetchMore: self._ignore,
            ResumeFetchCancel: self._ignore,
            ResumeProbe: self._no_reader,
        }

    def now(self) -> float:
        return self.loop.time()

    # -- the one way into the core ------------------------------------------------------------

    def feed(self, event: Event) -> None:
        """Hand ``event`` to the core and carry out its commands. An event caused while
        commands are carried out (a close at once, a failed connect) waits in the queue."""
        self._queue.append(event)
        if self._feeding:
            return
        self._feeding = True
        try:
            while self._queue:
                for command in self.core.handle(self._queue.popleft()):
                    self._execute[type(command)](command)
        finally:
            self._feeding = False
        if self.stopping and self.core.drained:
            self.stopped.set()

    # -- listeners and connections ------------------------------------------------------------

    async def listen(self, config: Config) -> list[tuple[str, int]]:
        """Bind every listener of ``config``; returns the bound addresses."""
        bound = []
        for listener in config.listeners:
            address = listener.address

            async def accepted(
                reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str = address
            ) -> None:
                await self._serve_client(reader, writer, address)

            server = await asyncio.start_server(
                accepted, listener.host, listener.port, limit=self.core.read_size
            )
            self.servers.append(server)
            bound += [sock.getsockname()[:2] for sock in server.sockets]
        return bound

    async def _serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, listener: str
    ) -> None:
        # While stopping, the core itself refuses a connection that still got in.
        self._next_client += 1
        conn = self.conns[self._next_client] = Conn(self._next_client)
        peer = writer.get_extra_info("peername")
        self._attach(conn, reader, writer)
        self.feed(
            ConnectionAccepted(
                now=self.now(),
                conn=conn.ident,
                listener=listener,
                peer=(peer[0], peer[1]) if peer else None,
                wall=time.time(),
            )
        )
        # asyncio's server task for this client lives as long as the connection.
        await conn.done.wait()

    def _attach(
        self, conn: Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Start serving ``conn``'s streams: one reader task and one writer task."""
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)  # tokens, not Nagle
        # drain() returns only once the kernel took every byte: DataSent means just that.
        writer.transport.set_write_buffer_limits(high=0)
        conn.reader, conn.writer = reader, writer
        for work in (self._reader, self._writer):
            conn.tasks.append(asyncio.create_task(self._guard(conn, work)))
        if conn.pending or conn.closing:
            conn.wake.set()

    async def _guard(self, conn: Conn, work: Callable[[Conn], Any]) -> None:
        """Run one of ``conn``'s tasks. A socket error ends the connection; any other
        exception is a bug: with ``raise_errors`` (or out of the core) it stops the driver,
        else it ends this connection only and is logged."""
        try:
            await work(conn)
        except asyncio.CancelledError:
            raise
        except IO_ERRORS as exc:
            self._finish(conn, f"{work.__name__.strip('_')} failed: {exc!r}")
        except Exception as exc:
            self._bug(exc)
            self.core.counters["internal_errors"] += 1
            print(f"internal error on connection {conn.ident}:", file=sys.stderr)
            traceback.print_exception(exc)
            self._finish(conn, "internal error")

    def _bug(self, exc: Exception) -> None:
        """Stop the driver on ``exc`` with ``raise_errors``, or when it came out of the core
        (which contains its own faults, so one that escapes is a broken invariant)."""
        if self.core.raise_errors or raised_by_handle(exc):
            self._crash(exc)
            raise exc

    def _crash(self, exc: BaseException) -> None:
        """Stop serving; ``serve`` re-raises ``exc``."""
        if self.crash is None:
            self.crash = exc
        self.stopped.set()

    def guarded(self, function: Callable[..., None], *args: Any) -> None:
        """Run a loop callback (a timer, a signal): what escapes it is a bug in shared
        state, which stops the driver instead of being logged by asyncio and ignored."""
        try:
            function(*args)
        except Exception as exc:
            self._crash(exc)

    async def _reader(self, conn: Conn) -> None:
        assert conn.reader is not None
        read = conn.reader.read
        while True:
            await conn.readable.wait()  # never read a paused connection
            if conn.closing:
                return
            data = await read(self.core.read_size)
            # Paused while the read was waiting: the bytes wait for ResumeReading too.
            await conn.readable.wait()
            if conn.closing:
                return
            if not data:
                # A clean EOF: tell the core once and read no more; writing goes on.
                self.feed(InputEnded(now=self.now(), conn=conn.ident))
                return
            self.feed(DataReceived(now=self.now(), conn=conn.ident, data=data))

    async def _writer(self, conn: Conn) -> None:
        writer = conn.writer
        assert writer is not None
        while True:
            await conn.wake.wait()
            conn.wake.clear()
            while conn.pending:
                data = bytes(conn.pending)
                conn.pending.clear()
                writer.write(data)
                await writer.drain()
                if conn.closing:
                    self._arm_flush_deadline(conn)  # progress: the bound starts again
                self.feed(DataSent(now=self.now(), conn=conn.ident, nbytes=len(data)))
            if conn.closing:
                self._finish(conn, None)
                return
            if conn.shutdown_wanted:
                conn.shutdown_wanted = False
                if writer.can_write_eof():
                    writer.write_eof()

    def _finish(self, conn: Conn, error: str | None, *, abort: bool = False) -> None:
        """Close ``conn`` and tell the core, exactly once."""
        if conn.closed:
            return
        conn.closed = True
        self.conns.pop(conn.ident, None)
        if conn.flush_deadline is not None:
            conn.flush_deadline.cancel()
        current = asyncio.current_task()
        for task in conn.tasks:
            if task is not current:
                task.cancel()
        if conn.writer is not None:
            if abort or error is not None:
                conn.writer.transport.abort()
            else:
                conn.writer.close()
        conn.done.set()
        self.feed(ConnectionClosed(now=self.now(), conn=conn.ident, error=error))

    def _arm_flush_deadline(self, conn: Conn) -> None:
        if conn.flush_deadline is not None:
            conn.flush_deadline.cancel()
        if conn.flush_timeout is not None:
            conn.flush_deadline = self.loop.call_later(
                conn.flush_timeout, self.guarded, self._flush_expired, conn
            )

    def _flush_expired(self, conn: Conn) -> None:
        """The peer took nothing for ``flush_timeout``: cut it, dropping what is pending."""
        self._finish(conn, None, abort=True)

    # -- the core's commands (each returns at once; outcomes come back as events) -------------

    def _send_data(self, command: SendData) -> None:
        conn = self.conns.get(command.conn)
        if conn is not None and not conn.closing:
            conn.pending += command.data
            conn.wake.set()

    def _close(self, command: CloseConnection) -> None:
        task = self.connecting.pop(command.conn, None)
        if task is not None:
            # The core gave up on a connect (connect timeout, client gone).
            task.cancel()
            self.conns.pop(command.conn, None)
            self.feed(ConnectionClosed(now=self.now(), conn=command.conn, error="cancelled"))
            return
        conn = self.conns.get(command.conn)
        if conn is None or conn.closing:
            return
        conn.closing = True
        conn.readable.set()  # the reader wakes up and ends
        conn.flush_timeout = command.flush_timeout
        self._arm_flush_deadline(conn)
        conn.wake.set()

    def _shutdown_write(self, command: ShutdownWrite) -> None:
        conn = self.conns.get(command.conn)
        if conn is not None and not conn.closing:
            conn.shutdown_wanted = True
            conn.wake.set()

    def _pause(self, command: PauseReading) -> None:
        conn = self.conns.get(command.conn)
        if conn is not None and not conn.closing:
            conn.readable.clear()

    def _resume(self, command: ResumeReading) -> None:
        conn = self.conns.get(command.conn)
        if conn is not None:
            conn.readable.set()

    def _open(self, command: OpenConnection) -> None:
        # Known at once, so SendData queued before the connect completes is kept.
        self.conns[command.conn] = Conn(command.conn)
        self.connecting[command.conn] = asyncio.create_task(self._connect(command))

    async def _connect(self, command: OpenConnection) -> None:
        ident, origin = command.conn, command.origin
        try:
            if origin.tls:
                raise OSError(f"{origin}: this driver connects over plain TCP only")
            reader, writer = await asyncio.open_connection(
                origin.host, origin.port, limit=self.core.read_size
            )
        except OSError as exc:
            self.connecting.pop(ident, None)
            self.conns.pop(ident, None)
            self.feed(OpenFailed(now=self.now(), conn=ident, reason=str(exc) or repr(exc)))
            return
        self.connecting.pop(ident, None)
        conn = self.conns[ident]
        try:
            self._attach(conn, reader, writer)
            self.feed(ConnectionOpened(now=self.now(), conn=ident))
        except Exception as exc:
            self._bug(exc)
            self._finish(conn, "internal error")

    def _set_timer(self, command: SetTimer) -> None:
        old = self.timers.pop(command.timer, None)
        if old is not None:
            old.cancel()
        self.timers[command.timer] = self.loop.call_at(
            command.at, self.guarded, self._fire, command.timer
        )

    def _cancel_timer(self, command: CancelTimer) -> None:
        handle = self.timers.pop(command.timer, None)
        if handle is not None:
            handle.cancel()

    def _fire(self, timer: TimerId) -> None:
        self.timers.pop(timer, None)
        self.feed(Wakeup(now=self.now(), timer=timer))

    def _ignore(self, command: Command) -> None:
        pass

    def _no_store(self, command: ResumeFetch) -> None:
        self._queue.append(
            ResumeFetched(now=self.now(), request=command.request, state="unavailable")
        )

    def _no_reader(self, command: ResumeProbe) -> None:
        self._queue.append(ResumeProbed(now=self.now(), stream=command.stream, reading=False))

    def _log(self, command: Log) -> None:
        record = {"event": command.event, "wall": round(time.time(), 3), **command.fields}
        print(json.dumps(record, default=str), file=sys.stderr, flush=True)

    # -- stopping ---------------------------------------------------------------------------

    def request_shutdown(self) -> None:
        """First call: stop accepting, let streams finish within ``shutdown_grace``; a
        later call cuts what is left now."""
        self.stopping += 1
        now = self.now()
        if self.stopping == 1:
            for server in self.servers:
                server.close()
            grace = self.core.config.timeouts.shutdown_grace
            self.feed(ShutdownRequested(now=now, deadline=now + grace))
        else:
            self.feed(ShutdownRequested(now=now, deadline=now))

    async def aclose(self) -> None:
        """Give the last connections ``FLUSH_TIME`` to flush their output, then cut every
        one left and cancel timers and tasks."""
        waits = [asyncio.create_task(conn.done.wait()) for conn in self.conns.values()]
        if waits and self.crash is None:
            await asyncio.wait(waits, timeout=FLUSH_TIME)
        for wait in waits:
            wait.cancel()
        for handle in self.timers.values():
            handle.cancel()
        self.timers.clear()
        for task in list(self.connecting.values()):
            task.cancel()
        for conn in list(self.conns.values()):
            if conn.writer is not None:
                conn.writer.transport.abort()
            for task in conn.tasks:
                task.cancel()
        for server in self.servers:
            server.close()
            await server.wait_closed()


async def serve(config: Config) -> int:
    core = ProxyCore(config)  # raise_errors from MUXPROXY_RAISE_ERRORS
    driver = AsyncioDriver(core)
    # The core's first event, with the wall clock for ``Date`` fields; it starts health checks.
    driver.feed(ConfigChanged(now=driver.now(), config=config, wall=time.time()))
    for host, port in await driver.listen(config):
        shown = f"[{host}]" if ":" in host else host
        print(f"muxproxy listening on http://{shown}:{port}", flush=True)
    for signum in (signal.SIGINT, signal.SIGTERM):
        driver.loop.add_signal_handler(signum, driver.guarded, driver.request_shutdown)
    try:
        await driver.stopped.wait()
    finally:
        await driver.aclose()
    if driver.crash is not None:
        raise driver.crash
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--listen", help="host:port to serve on (port 0: any free port)")
    parser.add_argument("--upstream", action="append", default=[], help="backend host:port")
    parser.add_argument("--config", help="a muxproxy TOML configuration instead of the flags")
    args = parser.parse_args(argv)
    try:
        if args.config is not None:
            config = load_config(args.config)
        else:
            config = parse_quick_config(args.listen or "127.0.0.1:8080", args.upstream)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    tls = [listener.address for listener in config.listeners if listener.tls]
    if tls:
        print(f"listeners {', '.join(tls)}: this driver serves plain TCP only", file=sys.stderr)
        return 2
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())

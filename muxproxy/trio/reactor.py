"""Plain TCP connections served from one Trio task: every ready socket in one wake-up.

A task per socket direction (the obvious Trio design, still used for TLS in ``driver.py``) pays,
for every token relayed, a task switch, a one-shot epoll re-registration and a trip through
Trio's scheduler, per socket. Here the proxy's plain TCP sockets sit in an epoll set of their
own, registered once (level-triggered, ``EPOLLIN`` while reading is wanted, ``EPOLLOUT`` only
while output is pending). Trio waits on that epoll's descriptor like on any other: when it
is readable, one task runs ``epoll_wait(0)`` and handles every ready socket in one go, feeding
the core synchronously. Timers, connects, TLS and accepts stay ordinary Trio tasks, and the
core is untouched: it sees the same events and commands as with the task-per-socket driver.

Semantics kept from the task-based driver (the core relies on them):

- output is written without waiting for readiness: what the core queues for a connection
  while it handles one ready socket goes out in one ``send`` before the next ready socket is
  read (one read of a backend: one ``send`` to its client, however many tokens the read
  held), so a token does not wait for the rest of the round. A connection that another
  socket fed last (the streams of an HTTP/2 client, each from its own backend) is written at
  the end of the round instead, once for all of them, or sooner in a long round, once its
  first token has waited ``SHARED_WRITE_WAIT``; so is what timers and ``settle`` cause.
  What the kernel does not take waits for ``EPOLLOUT``, and the order of bytes is kept;
- ``DataSent`` and ``ConnectionClosed`` are never fed from inside the execution of the core's
  own commands: the driver queues them and feeds them after the batch (``Sink.settle``);
- ``CloseConnection`` stops reading and flushes what is pending, bounded by the command's
  ``flush_timeout`` counted from the last progress of the flush; ``ConnectionClosed`` comes
  exactly once;
- a paused connection is not read: with no output pending it leaves the epoll set, so even a
  peer that hangs up cannot wake us until reading resumes;
- an EOF read is fed as ``InputEnded`` and that connection is read no more (it stays paused
  for good); it is still written, and closed on ``CloseConnection`` as any other.
  ``ShutdownWrite`` shuts the write side down (``SHUT_WR``) once what is pending is written.

A client connection the core closes is closed in stages (RFC 9112 §9.6): once its output is
flushed the write side is shut down (FIN), and what the peer still sends is read and dropped
for up to ``LINGER`` seconds and ``LINGER_BYTES`` bytes before the socket is closed. Closing
a socket with unread input makes the kernel send RST, and a client that receives RST may
discard the response it has not read yet (the 408 for a slow request head, say); an idle one
(``CloseConnection.linger``) closes at once. The core hears ``ConnectionClosed`` at the FIN.

An exception in the handling of one ready socket that is the driver's own (not one out of
``ProxyCore.handle``) abandons that socket (``Driver.connection_failed``); the round goes on
with the next one. A bug in the round itself (polling, deadlines, ``settle``) still crashes.

The reactor and the driver (``driver.py``) are one component in two files, joined by two
narrow interfaces and nothing else: the reactor reaches the driver through a ``sink.Sink``
(feed an event, hold ``settle`` for a round, report bytes sent and connections closed) and the
driver reaches the reactor through its public methods (the core's commands, and
``write_queued`` from ``settle``); neither touches the other's attributes. The reactor imports
nothing from ``driver.py``. The state of one connection is a ``socketconn.SocketConn``, which
only the reactor reads and writes.

Linux only (epoll), like the deployments this proxy is for; elsewhere the driver falls back to
tasks per socket.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import select
import socket
from collections.abc import Callable
from time import perf_counter

import trio

from muxproxy.core.events import ConnectionOpened, DataReceived, InputEnded, OpenFailed
from muxproxy.core.proxy import ProxyCore
from muxproxy.core.raising import raised_by_handle
from muxproxy.trio.sink import Sink
from muxproxy.trio.socketconn import SocketConn

EPOLLIN = getattr(select, "EPOLLIN", 1)
EPOLLOUT = getattr(select, "EPOLLOUT", 4)
EPOLLERR = getattr(select, "EPOLLERR", 8)
EPOLLHUP = getattr(select, "EPOLLHUP", 16)
READ_READY = EPOLLIN | EPOLLERR | EPOLLHUP
WRITE_READY = EPOLLOUT | EPOLLERR | EPOLLHUP
LINGER = 2.0
"""Seconds a closed connection's input is still read and dropped (see the module docstring)."""
LINGER_BYTES = 256 * 1024
"""Input dropped at most while lingering: a peer that keeps sending is cut off sooner."""

MAX_ROUNDS = 4
"""Rounds served per wake-up at most, while each finds sockets ready."""

SHARED_WRITE_WAIT = 0.0002
"""Seconds the output of a connection several sockets feed (an HTTP/2 client's streams) may
wait in a round for more of it before it is written: one ``send`` for the tokens of many
streams, and no token held longer than this plus one socket's work."""

NOTSENT_LOWAT = 16 * 1024
"""Unsent bytes the kernel may hold per socket (as ``trio.SocketStream`` sets it)."""


def available() -> bool:
    """Whether this platform has epoll (Linux)."""
    return hasattr(select, "epoll")


def tune(sock: socket.socket) -> None:
    """TCP_NODELAY (a token must not wait for Nagle) and TCP_NOTSENT_LOWAT: the kernel keeps
    at most 16 KiB unsent per socket, so a peer that stops reading shows up in our own bounded
    buffers (and pauses its source) instead of in megabytes of kernel memory, and a token is
    not queued behind them."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
    lowat = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    if lowat is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, lowat, NOTSENT_LOWAT)


class Reactor:
    """The epoll set of the driver's plain TCP connections and the task that serves it."""

    def __init__(self, sink: Sink, core: ProxyCore) -> None:
        self.sink = sink
        self.core = core
        """Asked for ``read_size`` at each read; the sink, not the reactor, feeds it events."""
        self._epoll = select.epoll()
        self._by_fd: dict[int, SocketConn] = {}
        self._ending: set[SocketConn] = set()
        """Connections flushing before their close, or lingering: each has a deadline."""
        self._wait_scope: trio.CancelScope | None = None
        self._round = 0
        self._serving = 0
        """The connection whose ready events the round is handling (0: none)."""
        self.now = 0.0
        """The time of the current round's wake-up (Trio's clock)."""
        self._outbox: list[SocketConn] = []
        """Connections whose new output is written once the ready socket that fed them is
        handled (``_write_outbox(end_of_round=False)``), or at the end of the batch."""
        self._end_of_round: list[SocketConn] = []
        """Connections that another socket than last time fed: several feed them (the streams
        of an HTTP/2 client), so their output waits for the end of the batch, one send for
        all (:meth:`write_queued`, from ``Sink.settle``), or for ``SHARED_WRITE_WAIT`` in a
        long round."""
        self._shared_since = 0.0
        """When the first of ``_end_of_round`` was queued (``time.perf_counter``)."""

    def add(
        self,
        ident: int,
        sock: socket.socket,
        on_closed: Callable[[], None] | None = None,
        *,
        linger: bool = False,
    ) -> SocketConn:
        """Serve ``sock`` (connected, TCP_NODELAY set) as connection ``ident``.

        ``linger``: close it in stages when the core closes it (client connections).
        """
        sock.setblocking(False)
        return self._register(SocketConn(ident, sock, on_closed, LINGER_BYTES if linger else 0))

    def _register(self, conn: SocketConn) -> SocketConn:
        conn.born = self._round
        self._by_fd[conn.fd] = conn
        self._watch(conn)
        return conn

    def connect(self, ident: int, host: str, port: int) -> SocketConn:
        """Start connecting to ``host`` (an IP address) as connection ``ident``.

        The outcome is fed from the reactor's round: ``ConnectionOpened`` or ``OpenFailed``.
        Raises ``OSError`` if the connect fails at once.
        """
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            tune(sock)
            error = sock.connect_ex((host, port))
            if error not in (0, errno.EINPROGRESS):
                raise OSError(error, f"connect to {host}:{port} failed: {os.strerror(error)}")
        except OSError:
            sock.close()
            raise
        conn = SocketConn(ident, sock, None, 0)
        conn.connecting = True
        return self._register(conn)

    async def run(self) -> None:
        """Serve the sockets until cancelled; then close every one of them."""
        epoll = self._epoll
        fileno = epoll.fileno()
        wait_readable = trio.lowlevel.wait_readable
        by_fd = self._by_fd
        sink = self.sink
        try:
            while True:
                # One cancel scope for as many rounds as its deadline (the earliest flush or
                # linger deadline, see ``_set_deadline``) lets run: entering a scope costs
                # about as much as the wait itself, so it is not done per round.
                with trio.CancelScope(deadline=self._next_deadline()) as scope:
                    self._wait_scope = scope
                    while True:
                        await wait_readable(fileno)
                        # Sockets that became ready during a round are served at once, without
                        # a trip through Trio's scheduler, a few rounds at most before the
                        # other tasks (timers, accepts, TLS) get their turn.
                        rounds = 1
                        while self._serve_round(epoll, by_fd, sink) and rounds < MAX_ROUNDS:
                            rounds += 1
                        deadline = self._next_deadline()
                        if deadline != scope.deadline:
                            scope.deadline = deadline
                # The deadline passed: the round expires what is due.
                self._wait_scope = None
                self._serve_round(epoll, by_fd, sink)
        finally:
            for conn in list(by_fd.values()):
                self._release(conn)
            epoll.close()

    def _serve_round(self, epoll: select.epoll, by_fd: dict[int, SocketConn], sink: Sink) -> int:
        """One round: every ready socket, each followed by the output it caused (except for
        connections several sockets feed, written at the end); returns the number of ready
        sockets.

        Its events carry the time of the wake-up: the round takes well under a millisecond,
        and one clock read per round is cheaper than one per socket.
        """
        self._round += 1
        this_round = self._round
        self.now = now = trio.current_time()
        sink.begin_round()
        try:
            if self._ending:
                self._expire_flushes(now)
            ready = epoll.poll(0)
            for fd, events in ready:
                conn = by_fd.get(fd)
                if conn is None or conn.born == this_round:
                    # Closed during this round, or a new socket that reuses the number of
                    # one closed during this round: the event is not its own.
                    continue
                self._serving = conn.ident
                try:
                    if conn.connecting:
                        self._connected(conn)
                    else:
                        if events & WRITE_READY and conn.pending and not conn.queued:
                            self._flush(conn)
                        if events & READ_READY and not (conn.closed or conn.paused or conn.closing):
                            self._read(conn)
                        elif conn.lingering:
                            self._drop_input(conn)
                    if self._outbox:
                        # What this socket's events caused leaves before the next socket is
                        # read: a token does not wait for the other streams' work of the round.
                        self._write_outbox(end_of_round=False)
                    if (
                        self._end_of_round
                        and perf_counter() - self._shared_since >= SHARED_WRITE_WAIT
                    ):
                        # A long round: the shared connections' tokens have waited enough.
                        self._write_outbox()
                except Exception as exc:
                    self._failed(conn, exc)
        except BaseException:
            sink.end_round()
            raise
        finally:
            self._serving = 0
        if self._outbox:
            # Left by a socket whose handling failed before its output was written.
            self._write_outbox(end_of_round=False)
        sink.settle(now)
        return len(ready)

    def _failed(self, conn: SocketConn, exc: Exception) -> None:
        """Handling ``conn``'s readiness raised: a bug of ours, in the driver's code for it
        (re-raised if it came out of the core, or with ``raise_errors``)."""
        sink = self.sink
        if sink.raise_errors or raised_by_handle(exc):
            raise exc
        sink.connection_failed(conn.ident, exc, where="reactor")

    def abandon(self, conn: SocketConn, reason: str) -> None:
        """Close ``conn`` now, whatever is pending (it failed); the core hears of it."""
        if conn.closed or conn.lingering:
            return
        connecting = conn.connecting
        self._release(conn)
        if connecting:
            self.sink.open_failed_now(conn.ident, reason)
        else:
            self.sink.closed_now(conn.ident, reason)

    def _next_deadline(self) -> float:
        """The earliest flush or linger deadline (``math.inf``: none)."""
        if not self._ending:
            return math.inf
        return min(c.flush_deadline for c in self._ending)

    # -- the core's commands (called from inside ``Driver.feed``) --------------------------

    def send(self, conn: SocketConn, data: bytes) -> bool:
        """Queue ``data`` for ``conn``; returns whether it waits for :meth:`write_queued`.

        Not when the ready socket being handled fed it (the round writes that once the socket
        is done), nor when earlier bytes wait for ``EPOLLOUT`` (these follow them): so on the
        paced path of one token per round the driver's ``settle`` has nothing to call.
        """
        if conn.closed or conn.lingering:
            return False
        serving = self._serving
        waits = False
        if not conn.pending:
            # Nothing waits for EPOLLOUT: the bytes go out when the socket being handled is
            # done, with whatever else it queues for this connection. Fed by another
            # connection than last time, several feed it (the streams of an HTTP/2 client),
            # and their output shares one send at the end of the round.
            conn.queued = True
            if conn.fed_by == serving:
                self._outbox.append(conn)
                waits = serving == 0  # not fed from a ready socket: from a timer, a task
            else:
                if not self._end_of_round:
                    self._shared_since = perf_counter()
                self._end_of_round.append(conn)
                waits = True
        conn.fed_by = serving
        conn.pending += data
        return waits

    def write_queued(self) -> None:
        """Write what the batch queued, one ``send`` per connection (``Sink.settle`` calls it
        after a :meth:`send` that said so)."""
        if self._outbox or self._end_of_round:
            self._write_outbox()

    def _write_outbox(self, *, end_of_round: bool = True) -> None:
        """Write what the batch queued, one ``send`` per connection.

        ``end_of_round=False`` (after each ready socket) leaves the connections several
        sockets feed for the end of the round.
        """
        outbox = self._outbox
        self._outbox = []
        if end_of_round and self._end_of_round:
            outbox += self._end_of_round
            self._end_of_round = []
        for conn in outbox:
            conn.queued = False
            if not (conn.closed or conn.connecting):
                self._flush(conn)

    def pause(self, conn: SocketConn) -> None:
        if not conn.paused:
            conn.paused = True
            self._watch(conn)

    def resume(self, conn: SocketConn) -> None:
        if conn.paused and not conn.input_ended:
            conn.paused = False
            self._watch(conn)

    def shutdown_write(self, conn: SocketConn) -> None:
        """End our sending side (FIN) once what is pending is written; reading goes on."""
        if conn.closed or conn.closing or conn.lingering or conn.connecting:
            return
        if conn.pending:
            conn.shutdown_wanted = True
        else:
            self._shutdown_write(conn)

    def close(
        self, conn: SocketConn, flush_timeout: float | None = None, linger: bool = True
    ) -> None:
        """Stop reading; close once what is pending is written, or once the flush made no
        progress for ``flush_timeout`` seconds (None: no bound); ``linger``: in stages."""
        if conn.closing or conn.closed:
            return
        conn.linger_budget = conn.linger_budget if linger else 0
        if conn.connecting:
            # The core gave up on the connect (connect timeout, client gone).
            self._release(conn)
            self.sink.closed_now(conn.ident, "cancelled")
            return
        conn.closing = True
        if not conn.pending:
            self._finish(conn, None)
            return
        # A peer that takes none of the pending bytes for ``flush_timeout`` is cut off:
        # without this bound a close issued *because* the client stopped reading would
        # wait for it forever.
        conn.flush_timeout = math.inf if flush_timeout is None else flush_timeout
        started = conn.blocked_since if conn.blocked_since is not None else trio.current_time()
        self._set_deadline(conn, started + conn.flush_timeout)
        self._watch(conn)

    # -- readiness ---------------------------------------------------------------------------

    def _read(self, conn: SocketConn) -> None:
        try:
            data = conn.sock.recv(self.core.read_size)
        except BlockingIOError:
            return
        except OSError as exc:
            self._finish(conn, f"receive failed: {exc!r}")
            return
        if not data:
            self._input_ended(conn)
            return
        self.sink.feed(DataReceived(now=self.now, conn=conn.ident, data=data))

    def _input_ended(self, conn: SocketConn) -> None:
        """The peer ended its sending side: read no more, tell the core (which closes the
        connection, or relays the end if it is a tunnel's)."""
        conn.input_ended = True
        self.pause(conn)
        self.sink.feed(InputEnded(now=self.now, conn=conn.ident))

    def _flush(self, conn: SocketConn) -> None:
        """Write as much of ``pending`` as the kernel takes; wait for EPOLLOUT for the rest."""
        pending = conn.pending
        try:
            sent = conn.sock.send(pending)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._finish(conn, f"send failed: {exc!r}")
            return
        if sent:
            del pending[:sent]
            self.sink.sent_now(conn.ident, sent)
        if not pending:
            conn.blocked_since = None
            if conn.closing:
                self._finish(conn, None)
                return
            if conn.shutdown_wanted:
                self._shutdown_write(conn)
                if conn.closed:
                    return
        elif sent or conn.blocked_since is None:
            now = trio.current_time()
            conn.blocked_since = now
            if conn.closing:
                self._set_deadline(conn, now + conn.flush_timeout)
        self._watch(conn)

    def _connected(self, conn: SocketConn) -> None:
        """The connect of ``conn`` finished (EPOLLOUT, or an error): tell the core how."""
        error = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        now = trio.current_time()
        if error:
            self._release(conn)
            reason = f"connect failed: {os.strerror(error)}"
            self.sink.feed(OpenFailed(now=now, conn=conn.ident, reason=reason))
            return
        conn.connecting = False
        self._watch(conn)
        if conn.pending and not conn.queued:
            conn.queued = True
            self._outbox.append(conn)
        self.sink.feed(ConnectionOpened(now=now, conn=conn.ident))

    def _drop_input(self, conn: SocketConn) -> None:
        try:
            data = conn.sock.recv(conn.linger_budget)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        conn.linger_budget -= len(data)
        if not data or conn.linger_budget <= 0:
            self._release(conn)

    def _expire_flushes(self, now: float) -> None:
        for conn in [c for c in self._ending if c.flush_deadline <= now]:
            if conn.lingering:
                self._release(conn)
            else:
                self._finish(conn, None)

    # -- bookkeeping ---------------------------------------------------------------------------

    def _watch(self, conn: SocketConn) -> None:
        """Register the epoll events ``conn`` needs now (level-triggered)."""
        if conn.connecting:
            wanted = EPOLLOUT  # the connect's outcome
        else:
            wanted = EPOLLIN if conn.lingering or not (conn.paused or conn.closing) else 0
            if conn.pending:
                wanted |= EPOLLOUT
        if wanted == conn.mask:
            return
        if not wanted:
            self._epoll.unregister(conn.fd)
        elif not conn.mask:
            self._epoll.register(conn.fd, wanted)
        else:
            self._epoll.modify(conn.fd, wanted)
        conn.mask = wanted

    def _finish(self, conn: SocketConn, error: str | None) -> None:
        """Close ``conn`` and tell the core (after the batch, if inside one)."""
        if conn.closed or conn.lingering:
            return
        if (
            error is None
            and conn.closing
            and not conn.pending
            and conn.linger_budget
            and not conn.input_ended
        ):
            self._linger(conn)
        else:
            self._release(conn)
        self.sink.closed_now(conn.ident, error)

    def _shutdown_write(self, conn: SocketConn) -> None:
        conn.shutdown_wanted = False
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError as exc:
            self._finish(conn, f"shutdown failed: {exc!r}")

    def _linger(self, conn: SocketConn) -> None:
        """Shut the write side down and drop input until EOF or ``LINGER`` seconds."""
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._release(conn)
            return
        conn.lingering = True
        self.sink.forget(conn.ident)
        self._set_deadline(conn, trio.current_time() + LINGER)
        self._watch(conn)

    def _set_deadline(self, conn: SocketConn, at: float) -> None:
        """End ``conn``'s flush or linger at ``at``, waking the reactor's wait if earlier."""
        conn.flush_deadline = at
        self._ending.add(conn)
        scope = self._wait_scope
        if scope is not None and at < scope.deadline:
            scope.deadline = at

    def _release(self, conn: SocketConn) -> None:
        conn.closed = True
        self._ending.discard(conn)
        self._by_fd.pop(conn.fd, None)
        self.sink.forget(conn.ident)
        if conn.mask:
            self._epoll.unregister(conn.fd)
            conn.mask = 0
        conn.sock.close()
        if conn.on_closed is not None:
            conn.on_closed()

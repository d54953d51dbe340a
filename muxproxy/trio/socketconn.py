"""One plain TCP connection served by the reactor (``reactor.py``): the socket and the state
of its output, its pause and its close, with no task of its own.

A record, not a component: the reactor alone reads and writes these fields (the driver keeps a
``SocketConn`` in its connection table to tell the reactor which connection a command is for,
and reads nothing in it). Kept apart from the reactor so that the reactor's module is its
round and its moves, and this one the state those moves change. Every field is documented
where it is set; ``__slots__`` because the reactor touches them for every token relayed.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable

__all__ = ["SocketConn"]


class SocketConn:
    """One plain TCP connection in the reactor: no task of its own."""

    __slots__ = (
        "blocked_since",
        "born",
        "closed",
        "closing",
        "connecting",
        "fd",
        "fed_by",
        "flush_deadline",
        "flush_timeout",
        "ident",
        "input_ended",
        "linger_budget",
        "lingering",
        "mask",
        "on_closed",
        "paused",
        "pending",
        "queued",
        "shutdown_wanted",
        "sock",
    )

    def __init__(
        self,
        ident: int,
        sock: socket.socket,
        on_closed: Callable[[], None] | None,
        linger_budget: int,
    ) -> None:
        self.ident = ident
        self.sock = sock
        self.fd = sock.fileno()
        self.born = -1
        """The reactor's round this connection was added in (see ``Reactor.run``)."""
        self.pending = bytearray()
        self.queued = False
        """In one of the reactor's outboxes: ``pending`` is written by ``_write_outbox``."""
        self.fed_by = 0
        """The connection whose handling last queued output here (0: none, or not a socket's)."""
        self.paused = False
        self.closing = False
        self.closed = False
        self.connecting = False
        """A non-blocking connect in progress: EPOLLOUT tells its outcome."""
        self.lingering = False
        """Write side shut down, input read and dropped until EOF or ``flush_deadline``."""
        self.input_ended = False
        """The peer's EOF was read (``InputEnded``): never read again."""
        self.shutdown_wanted = False
        """``ShutdownWrite`` came with output pending: shut down once it is written."""
        self.linger_budget = linger_budget
        """Bytes still to drop while lingering (0: close at once, no lingering)."""
        self.mask = 0
        """The epoll events registered now (0: not in the set)."""
        self.blocked_since: float | None = None
        """When the kernel last took bytes while some are still pending (None: none pending)."""
        self.flush_deadline = math.inf
        self.flush_timeout = math.inf
        """While closing: how long the flush may go without progress (``CloseConnection``)."""
        self.on_closed = on_closed
        """Called once when the socket is closed (the server frees a connection slot)."""

    def __repr__(self) -> str:
        return f"<SocketConn {self.ident} fd={self.fd} pending={len(self.pending)}>"

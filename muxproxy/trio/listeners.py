"""Listening sockets, optionally shared between processes with ``SO_REUSEPORT``, and the bound
on the client connections served at once.

:func:`open_listeners` and :func:`bind_listeners` are ``trio.open_tcp_listeners`` with one
addition, ``reuse_port``, and plain ``socket.socket`` results (the accept loops call
``accept`` on them directly). With ``reuse_port`` every socket sets ``SO_REUSEPORT`` before
``bind``, so several worker processes (see :mod:`muxproxy.workers`) can listen on the same
address and the Linux kernel spreads new connections across them by a hash of the 4-tuple.
Every socket in such a group must set the option, and all must belong to the same user; a
socket that is bound but not listening (the supervisor's port reservation) is in the group but
is never handed a connection.

Like Trio: ``SO_REUSEADDR`` (a restart need not wait out TIME_WAIT), one listener per address
``getaddrinfo`` gives for the host, ``IPV6_V6ONLY`` on IPv6 sockets so a wildcard host can bind
both families on one port, and families the system lacks are skipped while one address binds.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence
from typing import Any

import trio

BACKLOG = max(4096, socket.SOMAXCONN)
"""Listen backlog: a burst of connects queues in the kernel, which costs us nothing, rather
than being refused (the kernel silently caps it at ``net.core.somaxconn``)."""

_AddrInfo = tuple[Any, Any, int, str, Any]


async def open_listeners(host: str, port: int, *, reuse_port: bool) -> list[socket.socket]:
    """Listen on ``port`` at each address of ``host``; ``reuse_port`` sets ``SO_REUSEPORT``.

    The name is resolved in a worker thread (the event loop goes on). Returns non-blocking
    listening sockets. Raises ``OSError`` when an address cannot be bound (every socket opened
    so far is closed), or ``EAFNOSUPPORT`` when the system supports none of the host's address
    families.
    """
    addresses = await trio.socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    return _listen(host, addresses, reuse_port=reuse_port)


def bind_listeners(host: str, port: int, *, reuse_port: bool) -> list[socket.socket]:
    """:func:`open_listeners` without awaiting: for a reload, which must bind every new
    listener or none before anything else changes. The name is resolved with the blocking
    ``getaddrinfo``: listener hosts are addresses or local names (``localhost``), answered
    from ``/etc/hosts`` at once. Raises as :func:`open_listeners`."""
    addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return _listen(host, addresses, reuse_port=reuse_port)


def _listen(host: str, addresses: Sequence[_AddrInfo], *, reuse_port: bool) -> list[socket.socket]:
    listeners: list[socket.socket] = []
    unsupported = 0
    try:
        for family, type_, proto, _, sockaddr in addresses:
            try:
                sock = socket.socket(family, type_, proto)
            except OSError as exc:
                # An IPv4-only (or IPv6-only) system may still resolve both families.
                if exc.errno != errno.EAFNOSUPPORT:
                    raise
                unsupported += 1
                continue
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if reuse_port:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(sockaddr)
                sock.listen(BACKLOG)
                sock.setblocking(False)
            except BaseException:
                sock.close()
                raise
            listeners.append(sock)
    except BaseException:
        for listener in listeners:
            listener.close()
        raise
    if not listeners:
        raise OSError(
            errno.EAFNOSUPPORT,
            f"none of the address families of {host!r} is supported ({unsupported} tried)",
        )
    return listeners


class ConnectionSlots:
    """One slot per client connection being served (``limits.max_client_connections``).

    A ``trio.Semaphore`` that can be resized (a reload changes the limit; connections above a
    lowered limit run on, and no new one is accepted until enough of them ended) and that
    says when every slot is free (``wait_idle``: the last client connection closed, which a
    graceful stop waits for, bounded).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._free = trio.lowlevel.ParkingLot()
        self._idle = trio.lowlevel.ParkingLot()

    def acquire_nowait(self) -> None:
        """Take a slot; raises ``trio.WouldBlock`` when all are taken."""
        if self.used >= self.limit:
            raise trio.WouldBlock
        self.used += 1

    async def acquire(self) -> None:
        """Take a slot, waiting until one is free (cancellable without taking one)."""
        while self.used >= self.limit:
            await self._free.park()
        self.used += 1

    def release(self) -> None:
        self.used -= 1
        if self.used < self.limit:
            self._free.unpark()
        if not self.used:
            self._idle.unpark_all()

    def resize(self, limit: int) -> None:
        self.limit = limit
        self._free.unpark_all()  # each waiter checks again

    async def wait_idle(self) -> None:
        """Return once no slot is taken."""
        while self.used:
            await self._idle.park()

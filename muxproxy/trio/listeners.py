"""Listening sockets, optionally shared between processes with ``SO_REUSEPORT``; the listeners
a server accepts on (:class:`Listening`, bound here or adopted from another process); and the
bound on the client connections served at once (:class:`ConnectionSlots`).

:func:`open_listeners` and :func:`bind_listeners` are ``trio.open_tcp_listeners`` with one
addition, ``reuse_port``, and plain ``socket.socket`` results (the accept loops call
``accept`` on them directly). With ``reuse_port`` every socket sets ``SO_REUSEPORT`` before
``bind``, so several worker processes (see :mod:`muxproxy.process.workers`) can listen on the same
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
import ssl
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import trio

from muxproxy.config import Listener

BACKLOG = max(4096, socket.SOMAXCONN)
"""Listen backlog: a burst of connects queues in the kernel, which costs us nothing, rather
than being refused (the kernel silently caps it at ``net.core.somaxconn``)."""

_AddrInfo = tuple[Any, Any, int, str, Any]

Address = tuple[str, int]
ListenSockets = Mapping[str, Sequence[socket.socket]]
"""A listener's configured address -> already-listening sockets to adopt instead of binding."""


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


@attrs.define(eq=False)
class Listening:
    """One configured listener and the sockets it accepts on."""

    listener: Listener
    context: ssl.SSLContext | None
    """Given to connections accepted from now on (a reload may replace it)."""
    sockets: list[socket.socket]
    owned: bool
    """Bound by this process (closed when it stops), not adopted from ``listen_sockets``."""
    stopped: bool = False
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)

    def addresses(self) -> list[Address]:
        return [address_of(sock) for sock in self.sockets]


def listener_keys(listeners: Sequence[Listener | Listening]) -> list[tuple[str, int]]:
    """Each listener's identity across a reload: its configured address, and how many
    listeners before it have the same one (several may listen on ``127.0.0.1:0``)."""
    seen: dict[str, int] = {}
    keys = []
    for item in listeners:
        address = item.listener.address if isinstance(item, Listening) else item.address
        keys.append((address, seen.get(address, 0)))
        seen[address] = seen.get(address, 0) + 1
    return keys


def adopt(
    listener: Listener, context: ssl.SSLContext | None, sockets: Sequence[socket.socket]
) -> Listening:
    """``listener`` on already-listening ``sockets`` handed over by another process (a
    supervisor's): made non-blocking, never closed by this one at a stop."""
    for sock in sockets:
        sock.setblocking(False)
    return Listening(listener=listener, context=context, sockets=list(sockets), owned=False)


def address_of(sock: socket.socket) -> Address:
    host, port = sock.getsockname()[:2]
    return (host, port)

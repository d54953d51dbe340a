"""Listening sockets, optionally shared between processes with ``SO_REUSEPORT``.

:func:`open_listeners` is ``trio.open_tcp_listeners`` with one addition: ``reuse_port``. With it,
every socket sets ``SO_REUSEPORT`` before ``bind``, so several worker processes (see
:mod:`muxproxy.workers`) can listen on the same address and the Linux kernel spreads new
connections across them by a hash of the 4-tuple. Every socket in such a group must set the
option, and all must belong to the same user; a socket that is bound but not listening (the
supervisor's port reservation) is in the group but is never handed a connection.

Like Trio: ``SO_REUSEADDR`` (a restart need not wait out TIME_WAIT), one listener per address
``getaddrinfo`` gives for the host, ``IPV6_V6ONLY`` on IPv6 sockets so a wildcard host can bind
both families on one port, and families the system lacks are skipped while one address binds.
"""

from __future__ import annotations

import errno
import socket

import trio

BACKLOG = max(4096, socket.SOMAXCONN)
"""Listen backlog: a burst of connects queues in the kernel, which costs us nothing, rather
than being refused (the kernel silently caps it at ``net.core.somaxconn``)."""


async def open_listeners(host: str, port: int, *, reuse_port: bool) -> list[trio.SocketListener]:
    """Listen on ``port`` at each address of ``host``; ``reuse_port`` sets ``SO_REUSEPORT``.

    Raises ``OSError`` when an address cannot be bound (every socket opened so far is closed),
    or ``EAFNOSUPPORT`` when the system supports none of the host's address families.
    """
    addresses = await trio.socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    listeners: list[trio.SocketListener] = []
    unsupported = 0
    try:
        for family, type_, proto, _, sockaddr in addresses:
            try:
                sock = trio.socket.socket(family, type_, proto)
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
                await sock.bind(sockaddr)
                sock.listen(BACKLOG)
            except BaseException:
                sock.close()
                raise
            listeners.append(trio.SocketListener(sock))
    except BaseException:
        for listener in listeners:
            listener.socket.close()
        raise
    if not listeners:
        raise OSError(
            errno.EAFNOSUPPORT,
            f"none of the address families of {host!r} is supported ({unsupported} tried)",
        )
    return listeners

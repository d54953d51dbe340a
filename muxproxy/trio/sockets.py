"""Socket-level facts the driver and the server act on, below any protocol.

- **TCP_NODELAY before the first byte** on a connection a Trio stream carries (TLS, or a
  backend connected by a task; the reactor's own sockets get it from ``reactor.tune``): a
  token is a few bytes, and Nagle's algorithm would hold it back until the previous one is
  acknowledged (tens of milliseconds per token on a delayed-ACK peer).
- **An address needs no lookup.** A backend host that is an IP address (IPv4 or IPv6) is
  connected by the reactor without a task; a name is resolved by ``trio.open_tcp_stream``
  in a task of its own, so a slow resolver never blocks the reactor.
- **A socket changes owner whole.** A backend connected by a task on a plain TCP stream is
  handed to the reactor as the socket itself, detached from the stream (which then owns
  nothing and closes nothing), so exactly one owner closes it.
"""

from __future__ import annotations

import ipaddress
import socket

import trio

__all__ = ["detach_socket", "is_ip_address", "set_nodelay"]


def set_nodelay(stream: trio.abc.Stream) -> None:
    """TCP_NODELAY on the socket under ``stream``: a token must not wait for Nagle."""
    while isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    if isinstance(stream, trio.SocketStream):
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)


def is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def detach_socket(stream: trio.SocketStream) -> socket.socket:
    """The plain socket under ``stream``, which no longer owns it."""
    sock = stream.socket
    family, kind, proto = sock.family, sock.type, sock.proto
    return socket.socket(family, kind, proto, fileno=sock.detach())

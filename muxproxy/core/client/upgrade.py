"""The HTTP/1.1 side of a client connection switching protocols: the 101 and the raw bytes after.

What it obeys: RFC 9110 §7.8 and §15.2.2. After the 101 the connection carries the new protocol,
opaque bytes for the proxy, and h11 (SWITCHED_PROTOCOL) has no say in them any more; they still
go through the connection's ``Output`` (pending bytes, the send timeout, the connection bound).

Why a part of its own: HTTP/2 has no Upgrade (RFC 9113 §8.6; a WebSocket there is an extended
CONNECT on one stream, RFC 8441), so only an HTTP/1.1 connection hands one out
(``Downstream.http1_upgrade``) and a caller learns the side once, from the type, instead of
calling a method that cannot work on the other side.
"""

from __future__ import annotations

from muxproxy.core.client.output import Output
from muxproxy.core.http1.h1 import H1Server
from muxproxy.core.messages import Headers


class H1Switch:
    """``ports.Http1Upgrade`` over one HTTP/1.1 client connection."""

    __slots__ = ("h1", "output")

    def __init__(self, h1: H1Server, output: Output) -> None:
        self.h1 = h1
        self.output = output

    def switch_protocols(self, headers: Headers) -> bytes:
        """The 101 to a WebSocket upgrade (``H1Server.switch_protocols``); returns the bytes
        the client sent after its request (the tunnel's first)."""
        out, early = self.h1.switch_protocols(headers)
        self.output.write(out)
        return early

    def send_raw(self, data: bytes) -> None:
        self.output.write(data)

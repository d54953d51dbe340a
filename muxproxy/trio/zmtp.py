"""Just enough ZeroMQ, on Trio, to read an engine's KV-cache events: a SUB socket that
connects over TCP, and a PUB socket (for the fake engine) that binds.

What it obeys: ZMTP 3.0 (rfc.zeromq.org 23/ZMTP), with the NULL security mechanism (37/ZMTP's
is the same on the wire for what is used here). vLLM's publisher is a libzmq PUB socket; its
subscribers are SUB sockets; a SUB peer says which topics it wants with a message whose
first byte is 1 followed by the topic prefix (ZMTP 3.0's subscription message, which libzmq
PUB sockets accept from peers that greet as 3.0). Written here rather than taken from pyzmq
so that the proxy needs no native library and the socket is an ordinary Trio stream; the
exchange was checked against libzmq 4.3 (pyzmq's PUB and SUB) both ways.

The exchange: each side sends its 64-byte greeting (signature ``FF 00*8 7F``, version 3.0,
mechanism ``NULL``, as-server 0, filler), then a ``READY`` command with its
``Socket-Type`` property; then frames. A frame is a flags byte (bit 0: more frames follow,
bit 1: an 8-byte length, bit 2: a command), its length (one byte or eight, big-endian) and
its body. A message is the frames up to one without the more bit.

Bounds: a frame over :data:`MAX_FRAME` bytes, or a message of more than :data:`MAX_PARTS`
frames, ends the connection with :class:`ZmtpError` (a peer's fault): a vLLM batch is a few
kilobytes per step.
"""

from __future__ import annotations

import logging
import struct

import trio

__all__ = [
    "MAX_FRAME",
    "MAX_PARTS",
    "ZmtpError",
    "ZmtpPublisher",
    "ZmtpSubscription",
    "frame",
    "greeting",
    "subscribe",
]

log = logging.getLogger("muxproxy")

MAX_FRAME = 16 * 1024 * 1024
"""The largest frame read: a batch of thousands of stored blocks fits many times over."""
MAX_PARTS = 8
"""The most frames in one message (vLLM sends three: topic, sequence, payload)."""
SUBSCRIBER_QUEUE = 1024
"""Messages a PUB socket holds for one slow subscriber before it drops new ones (libzmq's
high-water mark does the same)."""

_SIGNATURE = b"\xff" + b"\x00" * 8 + b"\x7f"
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04


class ZmtpError(Exception):
    """The peer broke ZMTP, or asked for what this subset does not do."""


def greeting() -> bytes:
    """Our 64-byte greeting: ZMTP 3.0, the NULL mechanism, not as server."""
    return _SIGNATURE + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def frame(body: bytes, *, more: bool = False, command: bool = False) -> bytes:
    """One frame carrying ``body``."""
    flags = (_MORE if more else 0) | (_COMMAND if command else 0)
    if len(body) > 255:
        return bytes([flags | _LONG]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def _ready(socket_type: bytes) -> bytes:
    name = b"Socket-Type"
    properties = bytes([len(name)]) + name + struct.pack(">I", len(socket_type)) + socket_type
    return frame(b"\x05READY" + properties, command=True)


class _Connection:
    """A stream with ZMTP's framing on it."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.last_more = False
        """Whether the last frame read said more frames follow."""
        self._buffer = bytearray()

    async def _exactly(self, size: int) -> bytes:
        while len(self._buffer) < size:
            chunk = await self.stream.receive_some(65536)
            if not chunk:
                raise ZmtpError("the peer closed the connection")
            self._buffer += chunk
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    async def handshake(self, socket_type: bytes, accept: frozenset[bytes]) -> None:
        await self.stream.send_all(greeting())
        peer = await self._exactly(64)
        if peer[0] != 0xFF or peer[9] != 0x7F:
            raise ZmtpError("the peer is not speaking ZMTP (bad signature)")
        if peer[10] < 3:
            raise ZmtpError(f"the peer speaks ZMTP {peer[10]}.{peer[11]}, not 3")
        mechanism = peer[12:32].rstrip(b"\x00")
        if mechanism != b"NULL":
            raise ZmtpError(f"the peer wants the {mechanism.decode(errors='replace')} mechanism")
        await self.stream.send_all(_ready(socket_type))
        command, body = await self.read_frame()
        if not command or not body.startswith(b"\x05READY"):
            raise ZmtpError("the peer's first command is not READY")
        peer_type = _property(body[6:], b"socket-type")
        if peer_type not in accept:
            raise ZmtpError(f"the peer is a {peer_type!r} socket, not {sorted(accept)}")

    async def read_frame(self) -> tuple[bool, bytes]:
        """(is a command, body) of the next frame; a more bit is kept in ``last_more``."""
        flags, short = await self._exactly(2)
        if flags & _LONG:
            size = struct.unpack(">Q", bytes([short]) + await self._exactly(7))[0]
        else:
            size = short
        if size > MAX_FRAME:
            raise ZmtpError(f"a frame of {size} bytes, over {MAX_FRAME}")
        self.last_more = bool(flags & _MORE)
        return bool(flags & _COMMAND), await self._exactly(size)

    async def read_message(self) -> list[bytes]:
        """The next message's frames, commands in between skipped (PING, ..)."""
        parts: list[bytes] = []
        while True:
            command, body = await self.read_frame()
            if command:
                continue
            parts.append(body)
            if not self.last_more:
                return parts
            if len(parts) >= MAX_PARTS:
                raise ZmtpError(f"a message of more than {MAX_PARTS} frames")


def _property(data: bytes, wanted: bytes) -> bytes | None:
    at = 0
    while at < len(data):
        size = data[at]
        name = data[at + 1 : at + 1 + size]
        at += 1 + size
        (length,) = struct.unpack(">I", data[at : at + 4].rjust(4, b"\x00"))
        value = data[at + 4 : at + 4 + length]
        at += 4 + length
        if name.lower() == wanted:
            return value
    return None


class ZmtpSubscription:
    """A SUB socket's one connection to a PUB socket."""

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection

    async def receive(self) -> list[bytes]:
        """The next message's frames; raises :class:`ZmtpError` or a transport error."""
        return await self._connection.read_message()

    async def aclose(self) -> None:
        await self._connection.stream.aclose()


async def subscribe(host: str, port: int, topic: bytes) -> ZmtpSubscription:
    """Connect a SUB socket to ``host:port`` and subscribe to messages whose first frame starts
    with ``topic``; raises OSError (the connection) or :class:`ZmtpError` (the handshake)."""
    stream = await trio.open_tcp_stream(host, port)
    try:
        connection = _Connection(stream)
        await connection.handshake(b"SUB", frozenset({b"PUB", b"XPUB"}))
        await stream.send_all(frame(b"\x01" + topic))
    except trio.BrokenResourceError as error:
        await trio.aclose_forcefully(stream)
        raise ZmtpError(f"the connection broke during the handshake: {error}") from None
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return ZmtpSubscription(connection)


class ZmtpPublisher:
    """A PUB socket: every connected subscriber gets the messages whose first frame starts
    with one of its topics; a subscriber too slow to keep up loses messages, never stalls
    the others."""

    def __init__(self) -> None:
        self._subscribers: dict[int, tuple[list[bytes], trio.MemorySendChannel[bytes]]] = {}
        self._next = 0
        self.subscribed = trio.Event()
        """Set once a subscriber has subscribed to something (tests wait on it)."""

    def publish(self, parts: list[bytes]) -> None:
        """Queue one message to every subscriber whose topics match its first frame."""
        data = b"".join(frame(part, more=at < len(parts) - 1) for at, part in enumerate(parts))
        for topics, channel in list(self._subscribers.values()):
            if any(parts[0].startswith(topic) for topic in topics):
                try:
                    channel.send_nowait(data)
                except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # slow or gone: PUB drops, as libzmq's high-water mark does

    async def serve(self, stream: trio.SocketStream) -> None:
        """One subscriber's connection (a ``trio.serve_tcp`` handler)."""
        key = self._next
        self._next += 1
        send, receive = trio.open_memory_channel[bytes](SUBSCRIBER_QUEUE)
        topics: list[bytes] = []
        connection = _Connection(stream)
        try:
            await connection.handshake(b"PUB", frozenset({b"SUB", b"XSUB"}))
            self._subscribers[key] = (topics, send)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._forward, stream, receive, nursery.cancel_scope)
                await self._read_subscriptions(connection, topics)
                nursery.cancel_scope.cancel()
        except (ZmtpError, trio.BrokenResourceError, trio.ClosedResourceError) as error:
            log.debug("zmtp: a subscriber failed its handshake: %s", error)
        finally:
            self._subscribers.pop(key, None)
            await trio.aclose_forcefully(stream)

    async def _read_subscriptions(self, connection: _Connection, topics: list[bytes]) -> None:
        """Track the subscriber's topics until it leaves or breaks ZMTP."""
        try:
            while True:
                command, body = await connection.read_frame()
                if command and body.startswith(b"\x09SUBSCRIBE"):  # ZMTP 3.1
                    topics.append(body[10:])
                elif command and body.startswith(b"\x06CANCEL"):
                    if body[7:] in topics:
                        topics.remove(body[7:])
                elif not command and body[:1] == b"\x01":
                    topics.append(body[1:])
                elif not command and body[:1] == b"\x00" and body[1:] in topics:
                    topics.remove(body[1:])
                if topics:
                    self.subscribed.set()
        except (ZmtpError, trio.BrokenResourceError, trio.ClosedResourceError) as error:
            log.debug("zmtp: a subscriber left: %s", error)

    @staticmethod
    async def _forward(
        stream: trio.SocketStream,
        receive: trio.MemoryReceiveChannel[bytes],
        scope: trio.CancelScope,
    ) -> None:
        try:
            async for data in receive:
                await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
            log.debug("zmtp: a subscriber's connection broke: %s", error)
            scope.cancel()

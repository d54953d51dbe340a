"""Peers the test steps by hand, for end-to-end tests: an h2c client read by read, and a
raw HTTP/1.1 backend that records everything it receives.

``H2Client`` has no background task (unlike ``peers.H2Peer``): each ``pump`` reads once and
folds what came into per-stream ``peers.H2Stream`` records, so a test under ``MockClock``
decides when the client reads. With ``lenient`` it sends what h2 would refuse to (upper-case
names, connection-specific fields), for the tests of the proxy's own checks. Once a GOAWAY
arrived it writes nothing more: the proxy is closing, and a write could only meet a reset
socket.

``RecordingBackend`` answers each request head with ``answer`` (or never, with None) and keeps
the bytes, so a test can check what the proxy forwarded, byte for byte.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import attrs
import h2.config
import h2.connection
import h2.events
import trio
from peers import H2Frame, H2Stream

__all__ = ["OK", "H2Client", "RecordingBackend", "h2_request_headers"]

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


def h2_request_headers(
    path: bytes = b"/v1/models",
    method: bytes = b"GET",
    extra: list[tuple[bytes, bytes]] | tuple[()] = (),
) -> list[tuple[bytes, bytes]]:
    return [
        (b":method", method),
        (b":scheme", b"http"),
        (b":authority", b"proxy.test"),
        (b":path", path),
        *extra,
    ]


class H2Client:
    """A minimal h2c (prior knowledge) client: requests out, per-stream results and GOAWAY in."""

    def __init__(self, stream: trio.SocketStream, *, lenient: bool = False) -> None:
        self.stream = stream
        config = h2.config.H2Configuration(
            client_side=True,
            header_encoding=None,
            validate_outbound_headers=not lenient,
            normalize_outbound_headers=not lenient,
            validate_inbound_headers=not lenient,
        )
        self.conn = h2.connection.H2Connection(config=config)
        self.streams: dict[int, H2Stream] = {}
        self.settings_received = False
        self.goaway: h2.events.ConnectionTerminated | None = None
        self.goaway_at: float | None = None
        """``trio.current_time()`` of the read that brought the GOAWAY."""
        self.eof = False

    @classmethod
    async def connect(cls, port: int, *, lenient: bool = False) -> H2Client:
        client = cls(await trio.open_tcp_stream("127.0.0.1", port), lenient=lenient)
        client.conn.initiate_connection()
        await client.flush()
        return client

    async def flush(self) -> None:
        data = self.conn.data_to_send()
        if data and not self.eof and self.goaway is None:
            try:
                await self.stream.send_all(data)
            except trio.BrokenResourceError:
                self.eof = True

    async def request(self, headers: list[tuple[bytes, bytes]], body: bytes = b"") -> int:
        sid = self.conn.get_next_available_stream_id()
        self.streams[sid] = H2Stream(sid=sid)
        self.conn.send_headers(sid, headers, end_stream=not body)
        if body:
            self.conn.send_data(sid, body, end_stream=True)
        await self.flush()
        return sid

    async def send(self, path: bytes, body: bytes = b"") -> int:
        """GET ``path``, or POST ``body`` (with its content-length) to it."""
        if not body:
            return await self.request(h2_request_headers(path))
        length = [(b"content-length", str(len(body)).encode())]
        return await self.request(h2_request_headers(path, b"POST", length), body)

    async def pump(self) -> None:
        """Read once and process what came."""
        try:
            data = await self.stream.receive_some(65536)
        except trio.BrokenResourceError:
            # ECONNRESET: our last write (a SETTINGS ACK, a WINDOW_UPDATE) reached a socket
            # the proxy had already closed. What it sent before has been read.
            data = b""
        if not data:
            self.eof = True
            return
        at = trio.current_time()
        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.RemoteSettingsChanged):
                self.settings_received = True
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.goaway, self.goaway_at = event, at
            sid = getattr(event, "stream_id", None)
            state = self.streams.get(sid) if sid else None
            if isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if state is None:
                continue
            if isinstance(event, h2.events.ResponseReceived):
                state.headers = list(event.headers)
            elif isinstance(event, h2.events.DataReceived):
                state.frames.append(H2Frame(at, bytes(event.data), event.flow_controlled_length))
            elif isinstance(event, h2.events.TrailersReceived):
                state.trailers = list(event.headers)
            elif isinstance(event, h2.events.StreamEnded):
                state.ended = True
            elif isinstance(event, h2.events.StreamReset):
                state.reset = event.error_code
        await self.flush()

    async def wait(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            assert not self.eof, "connection closed"
            await self.pump()

    async def finish(self, sid: int) -> H2Stream:
        state = self.streams[sid]
        await self.wait(lambda: state.done)
        return state

    async def until_eof(self) -> None:
        while not self.eof:
            await self.pump()

    async def aclose(self) -> None:
        await self.stream.aclose()


@attrs.define
class RecordingBackend:
    """Answers every request head (no body expected) with ``answer``, or never (None);
    records all it got."""

    answer: bytes | None = OK
    connections: int = 0
    received: bytearray = attrs.field(factory=bytearray)
    arrived: trio.Event = attrs.field(factory=trio.Event)

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        buffer = bytearray()
        async with stream:
            try:
                while data := await stream.receive_some(65536):
                    self.received += data
                    self.arrived.set()
                    self.arrived = trio.Event()
                    if self.answer is None:
                        continue
                    buffer += data
                    while b"\r\n\r\n" in buffer:
                        del buffer[: buffer.index(b"\r\n\r\n") + 4]
                        await stream.send_all(self.answer)
            except trio.BrokenResourceError:
                pass

    @property
    def heads(self) -> int:
        return bytes(self.received).count(b"\r\n\r\n")

    @property
    def targets(self) -> list[bytes]:
        return re.findall(rb"(?:^|\r\n\r\n)[A-Z]+ (\S+) HTTP/1\.1\r\n", bytes(self.received))

    async def wait_for(self, target: bytes) -> None:
        while target not in self.targets:
            await self.arrived.wait()

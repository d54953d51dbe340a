"""The suite's HTTP/2 client over a Trio socket, stepped by hand, and its per-stream records.

``H2Client`` speaks h2c with prior knowledge and has no background task (unlike
``peers.H2Peer``, which runs a reader for tests that wait on several streams at once): each
``pump`` reads once and folds what came into per-stream ``H2Stream`` records, so a test under
``MockClock`` decides when the client reads. With ``lenient`` it sends what h2 would refuse to
(upper-case names, connection-specific fields) and accepts any response field, for the tests
of the proxy's own checks. Once a GOAWAY arrived it writes nothing more: the peer is closing,
and a write could only meet a reset socket. Received DATA is acknowledged at once (the
stream's window stays open; ``peers.H2Peer`` can hold a stream's instead).

``H2Stream`` and ``H2Frame`` are the records ``peers.H2Peer`` fills as well.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import trio

__all__ = ["H2Client", "H2Frame", "H2Stream", "h2_request_headers"]


@attrs.define
class H2Frame:
    """One DATA frame's payload and the arrival time of the read that brought it."""

    at: float
    data: bytes
    flow_len: int


@attrs.define
class H2Stream:
    sid: int
    headers: list[tuple[bytes, bytes]] | None = None
    frames: list[H2Frame] = attrs.field(factory=list)
    ended: bool = False
    """END_STREAM arrived (``h2.events.StreamEnded``)."""
    reset: h2.errors.ErrorCodes | int | None = None
    """Error code of an RST_STREAM from the server."""
    trailers: list[tuple[bytes, bytes]] | None = None
    held: bool = False
    """Received data is not acknowledged while held (its stream window closes)."""
    unacked: int = 0

    @property
    def done(self) -> bool:
        return self.ended or self.reset is not None

    @property
    def status(self) -> int | None:
        for name, value in self.headers or ():
            if name == b":status":
                return int(value)
        return None

    @property
    def body(self) -> bytes:
        return b"".join(f.data for f in self.frames)

    @property
    def data_frames(self) -> list[H2Frame]:
        """The frames that carried data (not an empty DATA frame holding only END_STREAM)."""
        return [f for f in self.frames if f.data]

    def field(self, name: bytes) -> bytes | None:
        """The first response field ``name`` (lower case), as received."""
        for key, value in self.headers or ():
            if key == name:
                return value
        return None

    def header(self, name: str) -> str | None:
        wanted = name.lower().encode()
        for key, value in self.headers or ():
            if key == wanted:
                return value.decode("latin-1")
        return None


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
        """Open a stream with the header block ``headers`` and ``body`` (in frames of the
        peer's largest size; it must fit the initial 64 KiB window); its stream id."""
        sid = self.conn.get_next_available_stream_id()
        self.streams[sid] = H2Stream(sid=sid)
        self.conn.send_headers(sid, headers, end_stream=not body)
        view = memoryview(body)
        while view:
            size = min(len(view), self.conn.max_outbound_frame_size)
            self.conn.send_data(sid, bytes(view[:size]), end_stream=size == len(view))
            view = view[size:]
        await self.flush()
        return sid

    async def send(self, path: bytes, body: bytes = b"") -> int:
        """GET ``path``, or POST ``body`` (with its content-length) to it."""
        if not body:
            return await self.request(h2_request_headers(path))
        length = [(b"content-length", str(len(body)).encode())]
        return await self.request(h2_request_headers(path, b"POST", length), body)

    async def exchange(
        self,
        path: str | bytes,
        *,
        method: str | bytes = b"POST",
        headers: Sequence[tuple[str | bytes, str | bytes]] = (),
        body: bytes = b"",
    ) -> H2Stream:
        """One request, waited for until its stream ends or is reset."""
        extra = [(_bytes(name), _bytes(value)) for name, value in headers]
        block = h2_request_headers(_bytes(path), _bytes(method), extra)
        return await self.finish(await self.request(block, body))

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


def _bytes(value: str | bytes) -> bytes:
    return value.encode("latin-1") if isinstance(value, str) else value

"""Raw HTTP/1.1 (h11) and HTTP/2 (h2) client peers over Trio sockets, for end-to-end tests.

They give a test the control a real client library hides: when each byte is written, when
window is given back, what arrived in which read (with ``trio.current_time()`` stamps).

``H1Peer``: one h11 client connection, driven by the caller (no background task)::

    peer = await H1Peer.connect(port)
    await peer.send_request("POST", "/v1/chat/completions", [("content-type", "...")], body)
    response = await peer.read_response()      # H1Response: head, timed Data events, ...

``H2Peer``: one h2 client connection with a background reader task that folds events into
per-stream ``H2Stream`` records and acknowledges received data (unless the stream is held)::

    async with open_h2(port) as peer:
        sid = await peer.request("POST", "/v1/chat/completions", body=body)
        stream = await peer.wait_done(sid)      # ended or reset

Both only wait on conditions (``wait_until``), never on elapsed time.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import h11
import trio
from h2client import H2Frame, H2Stream

__all__ = [
    "H1Data",
    "H1Peer",
    "H1Response",
    "H2Frame",
    "H2Peer",
    "H2Stream",
    "closed_port",
    "h1_read_response",
    "h1_request_bytes",
    "hanging_port",
    "never_answer",
    "open_h2",
    "open_tcp",
    "read_until_eof",
    "serve_raw",
    "socket_of",
    "sse_events",
]

HeaderPairs = Sequence[tuple[str | bytes, str | bytes]]


def _b(value: str | bytes) -> bytes:
    return value.encode("latin-1") if isinstance(value, str) else value


def _headers(pairs: HeaderPairs) -> list[tuple[bytes, bytes]]:
    return [(_b(name), _b(value)) for name, value in pairs]


async def open_tcp(
    port: int, *, host: str = "127.0.0.1", rcvbuf: int | None = None
) -> trio.SocketStream:
    """A TCP connection to ``host:port``; ``rcvbuf`` sets SO_RCVBUF *before* connecting.

    A small ``rcvbuf`` (set before the handshake, so the advertised window honours it and
    Linux turns receive autotuning off) makes a client that stops reading push back on its
    peer after a few KiB instead of after megabytes of kernel buffering.
    """
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


def socket_of(stream: trio.abc.Stream) -> trio.socket.SocketType:
    """The socket under a ``trio.SocketStream`` or a (possibly nested) ``trio.SSLStream``."""
    while isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    assert isinstance(stream, trio.SocketStream), f"not a socket stream: {stream!r}"
    return stream.socket


async def read_until_eof(stream: trio.abc.Stream) -> bytes:
    """Everything ``stream`` delivers until the peer closes it."""
    received = b""
    while chunk := await stream.receive_some(65536):
        received += chunk
    return received


# ---- bare servers --------------------------------------------------------------------------


async def closed_port() -> int:
    """A port on 127.0.0.1 with nothing listening (bound once, then closed)."""
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    sock.close()
    return port


@contextlib.contextmanager
def hanging_port() -> Iterator[int]:
    """A port on 127.0.0.1 where a connect hangs: a listener with a full accept queue.

    ``listen(0)`` holds one connection that is never accepted; once fillers took it, Linux
    drops every further SYN, so a connect waits (and retries) until its caller gives up.
    """
    listener = socket.socket()
    fillers: list[socket.socket] = []
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port: int = listener.getsockname()[1]
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
        yield port
    finally:
        for sock in [*fillers, listener]:
            sock.close()


async def serve_raw(
    nursery: trio.Nursery, handler: Callable[[trio.SocketStream], Awaitable[None]]
) -> int:
    """A bare TCP server on 127.0.0.1 running ``handler`` per connection; returns its port."""
    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return int(listeners[0].socket.getsockname()[1])


async def never_answer(stream: trio.SocketStream) -> None:
    """A backend that reads whatever comes and never answers."""
    async with stream:
        while await stream.receive_some(65536):
            pass


# ---- SSE -----------------------------------------------------------------------------------


def sse_events(body: bytes) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded (``[DONE]`` kept as the string)."""
    out: list[Any] = []
    for block in body.decode().split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# ---- HTTP/1.1 ----------------------------------------------------------------------------


def h1_request_bytes(
    target: bytes = b"/v1/models",
    method: bytes = b"GET",
    body: bytes = b"",
    headers: Sequence[tuple[bytes, bytes]] = ((b"host", b"proxy.test"),),
) -> tuple[h11.Connection, bytes]:
    """A fresh h11 client connection and one whole request serialized by it (content-length
    added when there is a body), for a test that writes the bytes itself."""
    conn = h11.Connection(h11.CLIENT)
    all_headers = list(headers)
    if body:
        all_headers.append((b"content-length", str(len(body)).encode()))
    data = conn.send(h11.Request(method=method, target=target, headers=all_headers))
    data += conn.send(h11.Data(data=body)) if body else b""
    data += conn.send(h11.EndOfMessage())
    return conn, data


async def h1_read_response(
    stream: trio.abc.Stream, conn: h11.Connection
) -> tuple[h11.Response, bytes]:
    """Read one response on ``conn`` to its ``EndOfMessage``: its head and whole body.

    Anything else (an informational response, EOF) fails the test; so does h11's
    ``RemoteProtocolError`` (a body cut short), which propagates.
    """
    response: h11.Response | None = None
    body = b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif type(event) is h11.Response:
            response = event
        elif type(event) is h11.Data:
            body += bytes(event.data)
        elif type(event) is h11.EndOfMessage:
            assert response is not None
            return response, body
        else:
            raise AssertionError(f"unexpected {event!r}")


@attrs.define
class H1Data:
    """One ``h11.Data`` event and when the read that completed it returned."""

    at: float
    data: bytes
    chunk_start: bool
    chunk_end: bool


@attrs.define
class H1Response:
    response: h11.Response | None = None
    data: list[H1Data] = attrs.field(factory=list)
    complete: bool = False
    """``EndOfMessage`` arrived."""
    error: str | None = None
    """h11's ``RemoteProtocolError`` (e.g. the peer closed inside a chunked body)."""
    closed: bool = False
    """The peer closed the connection (before, at or after the end of the message)."""

    @property
    def status(self) -> int | None:
        return None if self.response is None else self.response.status_code

    @property
    def body(self) -> bytes:
        return b"".join(d.data for d in self.data)

    def header(self, name: str) -> str | None:
        if self.response is None:
            return None
        wanted = name.lower().encode()
        for key, value in self.response.headers:
            if key == wanted:
                return value.decode("latin-1")
        return None

    def chunks(self) -> list[tuple[float, bytes]]:
        """The chunked-coding chunks (``(arrival, payload)``), rebuilt from the Data events.

        h11 may split one chunk over several ``Data`` events when it arrives in pieces; the
        arrival time is then that of the chunk's last piece.
        """
        out: list[tuple[float, bytes]] = []
        current = bytearray()
        for piece in self.data:
            current += piece.data
            if piece.chunk_end:
                out.append((piece.at, bytes(current)))
                current.clear()
        if current:
            out.append((self.data[-1].at, bytes(current)))
        return out


class H1Peer:
    """An h11 client on one connection. Not safe for concurrent use by two tasks."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)
        self.reads = 0
        """Number of ``receive_some`` calls that returned data (or EOF)."""
        self.last_read_at = 0.0

    @classmethod
    async def connect(cls, port: int, *, rcvbuf: int | None = None) -> H1Peer:
        return cls(await open_tcp(port, rcvbuf=rcvbuf))

    async def send(self, *events: Any) -> None:
        """Serialize h11 events and write them in one ``send_all``."""
        out = bytearray()
        for event in events:
            out += self.conn.send(event) or b""
        if out:
            await self.stream.send_all(bytes(out))

    async def send_request(
        self,
        method: str,
        target: str,
        headers: HeaderPairs = (),
        body: bytes | None = None,
        *,
        chunked: bool = False,
        piece: int = 64 * 1024,
        host: str = "proxy",
    ) -> None:
        """Send a whole request: head, body, ``EndOfMessage``.

        ``body`` goes with content-length, or with ``chunked`` as ``piece``-sized chunks;
        every piece is its own write, so a peer that stops reading blocks the sender here.
        """
        all_headers = [(b"host", _b(host)), *_headers(headers)]
        if chunked:
            all_headers.append((b"transfer-encoding", b"chunked"))
        elif body is not None:
            all_headers.append((b"content-length", str(len(body)).encode()))
        await self.send(h11.Request(method=method, target=target, headers=all_headers))
        view = memoryview(body or b"")
        while view:
            await self.send(h11.Data(data=bytes(view[:piece])))
            view = view[piece:]
        await self.send(h11.EndOfMessage())

    async def _read(self) -> None:
        try:
            data = await self.stream.receive_some(65536)
        except (trio.BrokenResourceError, OSError):
            data = b""  # a reset connection reads as EOF for h11's purposes
        self.reads += 1
        self.last_read_at = trio.current_time()
        self.conn.receive_data(data)

    async def next_event(self) -> tuple[float, Any]:
        """The next h11 event and the arrival time of the read that completed it.

        Raises ``h11.RemoteProtocolError`` as h11 does (for instance EOF inside a body).
        """
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                await self._read()
                continue
            return self.last_read_at, event

    async def read_response(self, on_data: Callable[[H1Data], None] | None = None) -> H1Response:
        """Read one response to its end, to EOF, or to a protocol error (never raises those).

        ``on_data`` is called with each ``Data`` event as it is read.
        """
        result = H1Response()
        while True:
            try:
                at, event = await self.next_event()
            except h11.RemoteProtocolError as exc:
                result.error = str(exc)
                result.closed = True
                return result
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                result.response = event
            elif isinstance(event, h11.Data):
                piece = H1Data(at, bytes(event.data), event.chunk_start, event.chunk_end)
                result.data.append(piece)
                if on_data is not None:
                    on_data(piece)
            elif isinstance(event, h11.EndOfMessage):
                result.complete = True
                return result
            elif isinstance(event, h11.ConnectionClosed):
                result.closed = True
                return result
            else:  # h11.PAUSED: a response already completed on this cycle
                return result

    async def aclose(self) -> None:
        await self.stream.aclose()


# ---- HTTP/2 ------------------------------------------------------------------------------


class H2Peer:
    """An h2 client connection; use :func:`open_h2`, which runs its reader task."""

    def __init__(self, stream: trio.SocketStream, conn: h2.connection.H2Connection) -> None:
        self.stream = stream
        self.conn = conn
        self.streams: dict[int, H2Stream] = {}
        self.settings_received = False
        self.terminated: h2.events.ConnectionTerminated | None = None
        self.closed = False
        """The server closed the TCP connection (or it broke)."""
        self.reads = 0
        self.pings_acked = 0
        """PING ACKs received: the server has handled every frame sent before the PING."""
        self._send_lock = trio.StrictFIFOLock()
        self._changed = trio.Event()

    # -- waiting ---------------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds; re-checked after every read and every send.

        Raises ``ConnectionError`` if the connection closes with the predicate still false.
        """
        while not predicate():
            if self.closed:
                raise ConnectionError("h2 connection closed while waiting")
            await self._changed.wait()

    async def wait_done(self, sid: int) -> H2Stream:
        state = self.streams[sid]
        await self.wait_until(lambda: state.done)
        return state

    # -- sending ---------------------------------------------------------------------------

    async def flush(self) -> None:
        """Write whatever h2 has queued (serialized: frames never interleave or reorder)."""
        async with self._send_lock:
            data = self.conn.data_to_send()
            if data:
                await self.stream.send_all(data)
        if data:
            self._notify()  # what was sent changes windows and stream states too

    async def request(
        self,
        method: str,
        path: str,
        headers: HeaderPairs = (),
        body: bytes | None = None,
        *,
        end_stream: bool = True,
        hold: bool = False,
        authority: str = "proxy",
        flush: bool = True,
    ) -> int:
        """Open a stream. With ``body`` it is sent (flow control respected) and, if
        ``end_stream``, the stream half-closed; without one ``end_stream`` goes on the HEADERS.
        ``hold``: do not acknowledge this stream's received data (see :meth:`release`).
        ``flush=False``: only queue the frames (a body that fits the windows, else it is
        flushed anyway); a later :meth:`flush` sends many requests in one write."""
        sid = self.conn.get_next_available_stream_id()
        self.streams[sid] = H2Stream(sid=sid, held=hold)
        block = [
            (b":method", _b(method)),
            (b":scheme", b"http"),
            (b":authority", _b(authority)),
            (b":path", _b(path)),
            *_headers(headers),
        ]
        conn = self.conn
        conn.send_headers(sid, block, end_stream=end_stream and body is None)
        if (
            body is not None
            and not flush
            and len(body) <= min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
        ):
            conn.send_data(sid, body, end_stream=end_stream)
            return sid
        await self.flush()
        if body is not None:
            await self.send_body(sid, body, end_stream=end_stream)
        return sid

    async def request_as_is(self, block: list[tuple[bytes, bytes]]) -> int:
        """Open a stream whose whole header block is ``block``, sent without h2's checks and
        normalisation of outbound headers: a malformed request, to see the server refuse it."""
        sid = self.conn.get_next_available_stream_id()
        self.streams[sid] = H2Stream(sid=sid)
        config = self.conn.config
        checks = (config.validate_outbound_headers, config.normalize_outbound_headers)
        config.validate_outbound_headers = config.normalize_outbound_headers = False
        try:
            self.conn.send_headers(sid, block, end_stream=True)
        finally:
            config.validate_outbound_headers, config.normalize_outbound_headers = checks
        await self.flush()
        return sid

    async def send_body(
        self,
        sid: int,
        data: bytes,
        *,
        end_stream: bool = True,
        after_each: Callable[[], None] | None = None,
    ) -> None:
        """Send ``data`` on ``sid`` as fast as the server's windows allow.

        ``after_each`` runs after every write (handy for sampling proxy state).
        """
        view = memoryview(data)
        conn = self.conn
        while view:
            await self.wait_until(
                lambda: min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size) > 0
            )
            room = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
            size = min(room, len(view))
            conn.send_data(sid, bytes(view[:size]), end_stream=end_stream and size == len(view))
            view = view[size:]
            await self.flush()
            if after_each is not None:
                after_each()
        if not data and end_stream:
            conn.end_stream(sid)
            await self.flush()

    async def sync(self) -> None:
        """PING, and wait for its ACK (RFC 9113 §6.7): the server has read and handled every
        frame sent before it."""
        acked = self.pings_acked
        self.conn.ping(acked.to_bytes(8, "big"))
        await self.flush()
        await self.wait_until(lambda: self.pings_acked > acked)

    async def reset(
        self, sid: int, code: h2.errors.ErrorCodes = h2.errors.ErrorCodes.CANCEL
    ) -> None:
        """RST_STREAM ``sid``; returns once the frame was handed to the kernel."""
        self.conn.reset_stream(sid, code)
        await self.flush()

    def hold(self, sid: int) -> None:
        """Stop acknowledging ``sid``'s data: its window closes once the server filled it."""
        self.streams[sid].held = True

    async def release(self, sid: int) -> None:
        """Acknowledge what ``sid`` received while held, and keep acknowledging from now on."""
        state = self.streams[sid]
        state.held = False
        if state.unacked:
            # On a closed stream h2 gives back only the connection-level window.
            self.conn.acknowledge_received_data(state.unacked, sid)
        state.unacked = 0
        await self.flush()

    # -- receiving -------------------------------------------------------------------------

    async def _reader(self) -> None:
        try:
            while True:
                try:
                    data = await self.stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    data = b""
                if not data:
                    return
                self.reads += 1
                self._handle(trio.current_time(), self.conn.receive_data(data))
                await self.flush()
                self._notify()
        finally:
            self.closed = True
            self._notify()

    def _handle(self, at: float, events: Iterable[h2.events.Event]) -> None:
        conn = self.conn
        for event in events:
            if isinstance(event, h2.events.RemoteSettingsChanged):
                self.settings_received = True
                continue
            if isinstance(event, h2.events.ConnectionTerminated):
                self.terminated = event
                continue
            if isinstance(event, h2.events.PingAckReceived):
                self.pings_acked += 1
                continue
            sid = getattr(event, "stream_id", None)
            state = self.streams.get(sid) if sid else None
            if state is None:
                if isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                continue
            if isinstance(event, h2.events.ResponseReceived):
                state.headers = list(event.headers)
            elif isinstance(event, h2.events.DataReceived):
                state.frames.append(H2Frame(at, bytes(event.data), event.flow_controlled_length))
                if state.held:
                    state.unacked += event.flow_controlled_length
                else:
                    # Also after END_STREAM: h2 then only gives back connection window.
                    conn.acknowledge_received_data(event.flow_controlled_length, sid)
            elif isinstance(event, h2.events.TrailersReceived):
                state.trailers = list(event.headers)
            elif isinstance(event, h2.events.StreamEnded):
                state.ended = True
            elif isinstance(event, h2.events.StreamReset):
                state.reset = event.error_code

    async def aclose(self) -> None:
        await self.stream.aclose()


@asynccontextmanager
async def open_h2(
    port: int,
    *,
    settings: dict[int, int] | None = None,
    connection_window: int | None = None,
    rcvbuf: int | None = None,
    wait_settings: bool = True,
) -> AsyncIterator[H2Peer]:
    """Connect with h2c prior knowledge and run the peer's reader until the block ends.

    ``settings``: SETTINGS to announce (``h2.settings.SettingCodes`` -> value).
    ``connection_window``: raise the connection-level receive window to this size at once, so
    that a held stream (which keeps its stream window unacknowledged) never starves the others
    of connection window. ``wait_settings``: return only after the server's SETTINGS arrived
    (so ``MAX_CONCURRENT_STREAMS`` is known before opening streams).
    """
    stream = await open_tcp(port, rcvbuf=rcvbuf)
    config = h2.config.H2Configuration(client_side=True, header_encoding=None)
    conn = h2.connection.H2Connection(config=config)
    conn.initiate_connection()
    if settings:
        conn.update_settings(settings)
    if connection_window is not None and connection_window > 65535:
        conn.increment_flow_control_window(connection_window - 65535)
    peer = H2Peer(stream, conn)
    async with trio.open_nursery() as nursery:
        await peer.flush()
        nursery.start_soon(peer._reader)
        try:
            if wait_settings:
                await peer.wait_until(lambda: peer.settings_received)
            yield peer
        finally:
            nursery.cancel_scope.cancel()
            with trio.CancelScope(shield=True):
                await stream.aclose()

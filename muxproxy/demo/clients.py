"""The demo's clients: streamed chat completions over HTTP/1.1 and HTTP/2, and the admin API.

Small h11 and h2 peers over Trio sockets (the runtime dependencies only), each reporting
what it receives to a :class:`Listener` as it arrives: the response head, every SSE event's
data, the end. Nothing here knows the demo's script or its view.

- :class:`H1Client`: one keep-alive HTTP/1.1 connection, one request at a time (a browser tab
  of one conversation); a connection the proxy closed is opened again for the next request.
- :class:`H2Client`: one HTTP/2 connection (h2c, prior knowledge) shared by many tasks, each
  request a stream. One reader task hands each stream's events to that stream's channel; the
  stream's owner gives the window back (``acknowledge_received_data``) only once it has
  handled the data, so HTTP/2 flow control bounds what a channel can hold (RFC 9113 §5.2)
  and a slow stream never stops the reader.
- :func:`admin_request`: one request to the admin listener, with the bearer token.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, Protocol

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h11
import trio

READ_SIZE = 65536


class Listener(Protocol):
    """What a client reports about one response, as it arrives."""

    def on_head(self, status: int, headers: dict[str, str]) -> None: ...
    def on_data(self, data: str) -> None: ...


class RequestFailed(Exception):
    """A request got no complete response: the connection broke, or a stream was reset."""


class SSEParser:
    """Incremental server-sent events parser (WHATWG HTML §9.2.6), ``data`` fields only."""

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, data: bytes) -> list[str]:
        self.buffer += data.replace(b"\r\n", b"\n")
        *events, self.buffer = self.buffer.split(b"\n\n")
        out = []
        for event in events:
            lines = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines).decode())
        return out


def _text_headers(headers: Sequence[tuple[bytes, bytes]]) -> dict[str, str]:
    return {bytes(k).decode("latin-1").lower(): bytes(v).decode("latin-1") for k, v in headers}


class H1Client:
    """One keep-alive HTTP/1.1 connection to ``port``, one request at a time."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._stream: trio.SocketStream | None = None
        self._conn = h11.Connection(h11.CLIENT)
        self.connects = 0
        """TCP connections opened (one, unless the proxy closed one)."""

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()
            self._stream = None

    async def post(
        self, path: str, headers: list[tuple[str, str]], body: bytes, listener: Listener
    ) -> None:
        """POST ``body``; report the response to ``listener``. Raises :class:`RequestFailed`."""
        try:
            await self._post(path, headers, body, listener)
        except (OSError, trio.BrokenResourceError, h11.ProtocolError) as exc:
            await self.aclose()
            raise RequestFailed(f"HTTP/1.1: {exc!r}") from exc

    async def _post(
        self, path: str, headers: list[tuple[str, str]], body: bytes, listener: Listener
    ) -> None:
        conn = self._conn
        if self._stream is None or conn.our_state is not h11.IDLE:
            await self.aclose()
            self._stream = await trio.open_tcp_stream("127.0.0.1", self.port)
            self.connects += 1
            conn = self._conn = h11.Connection(h11.CLIENT)
        stream = self._stream
        head = [("Host", f"127.0.0.1:{self.port}"), ("Content-Length", str(len(body))), *headers]
        out = conn.send(h11.Request(method="POST", target=path, headers=head)) or b""
        out += conn.send(h11.Data(data=body)) or b""
        out += conn.send(h11.EndOfMessage()) or b""
        await stream.send_all(out)
        parser = SSEParser()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(READ_SIZE))
            elif isinstance(event, h11.Response):
                listener.on_head(event.status_code, _text_headers(event.headers))
            elif isinstance(event, h11.Data):
                for data in parser.feed(bytes(event.data)):
                    listener.on_data(data)
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise RequestFailed("HTTP/1.1: the connection closed before the response ended")
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        else:
            await self.aclose()


_StreamEvent = h2.events.DataReceived | h2.events.ResponseReceived | h2.events.StreamEnded


class H2Client:
    """One HTTP/2 connection (h2c with prior knowledge) to ``port``, shared by many tasks.

    Run :meth:`serve` in a nursery (it reads until the connection ends), then call
    :meth:`post` from any number of tasks at once.
    """

    def __init__(self, stream: trio.SocketStream, port: int) -> None:
        self._stream = stream
        self._authority = f"127.0.0.1:{port}".encode()
        self._conn = h2.connection.H2Connection(
            config=h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self._send_lock = trio.Lock()
        self._streams: dict[int, trio.MemorySendChannel[_StreamEvent | None]] = {}
        self.closed = False
        self.streams_opened = 0
        self.peak_streams = 0

    @classmethod
    async def connect(cls, port: int) -> H2Client:
        client = cls(await trio.open_tcp_stream("127.0.0.1", port), port)
        client._conn.initiate_connection()
        await client._flush()
        return client

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    async def aclose(self) -> None:
        """Say GOAWAY (when the connection still stands) and close it."""
        self.closed = True
        try:
            self._conn.close_connection()
            await self._flush()
        except (
            h2.exceptions.ProtocolError,
            OSError,
            trio.BrokenResourceError,
            trio.ClosedResourceError,
        ):
            pass  # already closed by the peer
        await self._stream.aclose()

    async def _flush(self) -> None:
        async with self._send_lock:
            data = self._conn.data_to_send()
            if data:
                await self._stream.send_all(data)

    async def serve(self) -> None:
        """Read the connection until it ends, handing each stream's events to its channel."""
        try:
            while True:
                data = await self._stream.receive_some(READ_SIZE)
                if not data:
                    break
                for event in self._conn.receive_data(data):
                    self._dispatch(event)
                await self._flush()
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.closed = True
            for channel in self._streams.values():
                channel.send_nowait(None)  # the connection ended: every open stream failed
            self._streams.clear()

    def _dispatch(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.ResponseReceived | h2.events.DataReceived):
            channel = self._streams.get(event.stream_id)
            if channel is not None:
                channel.send_nowait(event)
        elif isinstance(event, h2.events.StreamEnded):
            channel = self._streams.pop(event.stream_id, None)
            if channel is not None:
                channel.send_nowait(event)
        elif isinstance(event, h2.events.StreamReset):
            channel = self._streams.pop(event.stream_id, None)
            if channel is not None:
                channel.send_nowait(None)

    async def post(
        self, path: str, headers: list[tuple[str, str]], body: bytes, listener: Listener
    ) -> None:
        """POST ``body`` on a new stream; report the response to ``listener``. Raises
        :class:`RequestFailed`."""
        if self.closed:
            raise RequestFailed("HTTP/2: the connection is closed")
        # Unbounded in count, bounded in bytes: the window is given back only below, once
        # the data is handled, so the server can never have more in flight than one window.
        send, receive = trio.open_memory_channel[_StreamEvent | None](math.inf)
        conn = self._conn
        sid = conn.get_next_available_stream_id()
        self._streams[sid] = send
        self.streams_opened += 1
        self.peak_streams = max(self.peak_streams, len(self._streams))
        fields = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":authority", self._authority),
            (b":path", path.encode()),
            (b"content-length", str(len(body)).encode()),
            *((k.lower().encode(), v.encode()) for k, v in headers),
        ]
        try:
            conn.send_headers(sid, fields)
            conn.send_data(sid, body, end_stream=True)
            await self._flush()
            await self._read_stream(sid, receive, listener)
        except (
            OSError,
            trio.BrokenResourceError,
            trio.ClosedResourceError,
            h2.exceptions.ProtocolError,
        ) as exc:
            raise RequestFailed(f"HTTP/2: {exc!r}") from exc
        finally:
            self._streams.pop(sid, None)

    async def _read_stream(
        self,
        sid: int,
        receive: trio.MemoryReceiveChannel[_StreamEvent | None],
        listener: Listener,
    ) -> None:
        parser = SSEParser()
        async for event in receive:
            if event is None:
                raise RequestFailed(f"HTTP/2: stream {sid} was reset or its connection ended")
            if isinstance(event, h2.events.ResponseReceived):
                fields = _text_headers(event.headers)
                listener.on_head(int(fields.pop(":status", "0")), fields)
            elif isinstance(event, h2.events.DataReceived):
                for data in parser.feed(event.data):
                    listener.on_data(data)
                self._conn.acknowledge_received_data(event.flow_controlled_length, sid)
                await self._flush()
            else:
                return


async def admin_request(
    port: int, method: str, path: str, token: str | None = None, body: Any = None
) -> tuple[int, Any]:
    """One request to the admin API on ``port``; the status and the JSON answer (None if the
    answer is not JSON). Raises ``OSError`` when the listener cannot be reached."""
    payload = b"" if body is None else json.dumps(body).encode()
    headers = [("Host", f"127.0.0.1:{port}"), ("Content-Length", str(len(payload)))]
    headers.append(("Connection", "close"))
    if token is not None:
        headers.append(("Authorization", f"Bearer {token}"))
    conn = h11.Connection(h11.CLIENT)
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        out = conn.send(h11.Request(method=method, target=path, headers=headers)) or b""
        out += conn.send(h11.Data(data=payload)) or b""
        out += conn.send(h11.EndOfMessage()) or b""
        await stream.send_all(out)
        status, chunks = 0, []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(READ_SIZE))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
    try:
        return status, json.loads(b"".join(chunks))
    except ValueError:
        return status, None

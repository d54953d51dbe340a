"""WebSockets through the proxy, with real peers: trio-websocket on both ends over HTTP/1.1,
and a raw h2 client framing with wsproto for RFC 8441 (trio-websocket has no HTTP/2 client).

The backend is trio-websocket's server: an echo handler that also closes with 4001 when asked
to, rejects the handshake with 403 on ``/reject``, and records how each connection ended.
"""

from __future__ import annotations

import base64
from typing import Any

import attrs
import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
import trio
from peers import serve_raw
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    WebSocketConnection,
    WebSocketRequest,
    open_websocket,
    serve_websocket,
)
from wsproto import WSConnection
from wsproto.connection import Connection as WsConnection
from wsproto.connection import ConnectionType
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    Pong,
    Request,
    TextMessage,
)

from muxproxy.config import Timeouts
from muxproxy.core.tunnel.websocket import accept_for

TIMEOUT = 5


@attrs.define
class WsBackend:
    """Echoes messages; closes with 4001 when sent "close-me"; refuses ``/reject`` with 403;
    records how each connection ended."""

    port: int = 0
    closes: list[tuple[int, str | None]] = attrs.field(factory=list)
    """(code, reason) of every connection the backend saw end."""
    closed: trio.Event = attrs.field(factory=trio.Event)

    async def handler(self, request: WebSocketRequest) -> None:
        if request.path == "/reject":
            await request.reject(403, body=b"go away\n")
            return
        ws = await request.accept()
        try:
            while True:
                message = await ws.get_message()
                if message == "close-me":
                    await ws.aclose(4001, "server bye")
                    self._ended(4001, "server bye")
                    return
                await ws.send_message(message)
        except ConnectionClosed as exc:
            self._ended(exc.reason.code, exc.reason.reason)

    def _ended(self, code: int, reason: str | None) -> None:
        self.closes.append((code, reason))
        self.closed.set()

    @classmethod
    async def start(cls, nursery: trio.Nursery) -> WsBackend:
        """A backend serving on an ephemeral port of 127.0.0.1 until ``nursery`` ends."""
        backend = cls()
        server = await nursery.start(serve_websocket, backend.handler, "127.0.0.1", 0, None)
        backend.port = server.port
        return backend


@pytest.fixture
async def ws_backend(nursery: trio.Nursery) -> WsBackend:
    return await WsBackend.start(nursery)


@pytest.fixture
async def proxy(ws_backend: WsBackend, start_proxy: Any) -> Any:
    """The proxy in front of ``ws_backend``, with default timeouts."""
    return await start_proxy([ws_backend.port])


async def _echo(ws: WebSocketConnection, message: str) -> None:
    """One message through the tunnel and its echo back."""
    await ws.send_message(message)
    assert await ws.get_message() == message


def _client(port: int, path: str = "/ws") -> Any:
    return open_websocket(
        "127.0.0.1", port, path, use_ssl=False, connect_timeout=TIMEOUT, disconnect_timeout=2
    )


# -- HTTP/1.1 Upgrade ------------------------------------------------------------------------


async def test_text_and_binary_messages_echo_through_the_tunnel(
    ws_backend: WsBackend, proxy: Any
) -> None:
    with trio.fail_after(TIMEOUT):
        async with _client(proxy.port) as ws:
            await _echo(ws, "hello")
            big = bytes(range(256)) * 1024  # 256 KiB: several reads and writes each way
            await ws.send_message(big)
            assert await ws.get_message() == big
        await ws_backend.closed.wait()
    assert ws_backend.closes == [(1000, None)]


async def test_ping_is_answered_by_the_backend_through_the_tunnel(
    ws_backend: WsBackend, proxy: Any
) -> None:
    with trio.fail_after(TIMEOUT):
        async with _client(proxy.port) as ws:
            await ws.ping(b"are you there")  # returns once the matching pong arrived


async def test_client_close_code_and_reason_reach_the_backend(
    ws_backend: WsBackend, proxy: Any
) -> None:
    with trio.fail_after(TIMEOUT):
        async with _client(proxy.port) as ws:
            await _echo(ws, "x")
            await ws.aclose(4000, "client bye")
        await ws_backend.closed.wait()
    assert ws_backend.closes == [(4000, "client bye")]


async def test_backend_close_code_and_reason_reach_the_client(
    ws_backend: WsBackend, proxy: Any
) -> None:
    with trio.fail_after(TIMEOUT):
        async with _client(proxy.port) as ws:
            await ws.send_message("close-me")
            with pytest.raises(ConnectionClosed) as info:
                await ws.get_message()
    assert info.value.reason.code == 4001
    assert info.value.reason.reason == "server bye"


async def test_client_disconnect_without_close_frame_closes_the_backend(
    ws_backend: WsBackend, proxy: Any
) -> None:
    with trio.fail_after(TIMEOUT):
        async with _client(proxy.port) as ws:
            await _echo(ws, "x")
            stream = ws._stream  # the TCP stream under the client
            await stream.aclose()
        await ws_backend.closed.wait()
    assert ws_backend.closes == [(1006, None)]  # abnormal closure: no close frame


async def test_backend_refusing_the_upgrade_answers_the_client_normally(
    ws_backend: WsBackend, proxy: Any
) -> None:
    with trio.fail_after(TIMEOUT), pytest.raises(ConnectionRejected) as info:
        async with _client(proxy.port, "/reject"):
            pass  # pragma: no cover
    assert info.value.status_code == 403
    assert info.value.body == b"go away\n"


async def test_idle_tunnel_is_closed_on_both_sides(ws_backend: WsBackend, start_proxy: Any) -> None:
    proxy = await start_proxy([ws_backend.port], timeouts=Timeouts(tunnel_idle=0.3))
    with trio.fail_after(TIMEOUT):
        async with _client(proxy.port) as ws:
            await _echo(ws, "x")
            with pytest.raises(ConnectionClosed) as info:
                await ws.get_message()
        await ws_backend.closed.wait()
    assert info.value.reason.code == 1006
    assert ws_backend.closes == [(1006, None)]


# -- half-close: one side ends, the other direction goes on (RFC 9293 §3.6) ------------------


class RawWebSocket:
    """A wsproto WebSocket over a plain socket, so a test decides when its side ends."""

    def __init__(self, stream: trio.SocketStream, kind: ConnectionType) -> None:
        self.stream = stream
        self.ws = WSConnection(kind)
        self.events: list[Any] = []
        self.eof = False

    async def send(self, event: Any) -> None:
        await self.stream.send_all(self.ws.send(event))

    async def next_event(self) -> Any:
        while not self.events:
            data = await self.stream.receive_some(65536)
            if not data:
                self.eof = True
                raise EOFError("the peer ended its side")
            self.ws.receive_data(data)
            self.events.extend(self.ws.events())
        return self.events.pop(0)

    async def read_until_eof(self) -> None:
        while not self.eof:
            try:
                self.events.append(await self.next_event())
            except EOFError:
                return


async def _raw_client(port: int) -> RawWebSocket:
    client = RawWebSocket(await trio.open_tcp_stream("127.0.0.1", port), ConnectionType.CLIENT)
    await client.send(Request(host="proxy.example", target="/ws"))
    assert isinstance(await client.next_event(), AcceptConnection)
    return client


async def test_h1_client_that_shuts_down_after_its_close_gets_the_backend_close_reply(
    ws_backend: WsBackend, proxy: Any
) -> None:
    with trio.fail_after(TIMEOUT):
        client = await _raw_client(proxy.port)
        await client.send(TextMessage(data="x"))
        assert isinstance(await client.next_event(), TextMessage)
        await client.send(CloseConnection(code=4000, reason="h1 bye"))
        await client.stream.send_eof()  # shutdown(SHUT_WR)
        reply = await client.next_event()
        assert isinstance(reply, CloseConnection)
        assert (reply.code, reply.reason) == (4000, "h1 bye")
        await client.read_until_eof()
        await ws_backend.closed.wait()
        await client.stream.aclose()
    assert ws_backend.closes == [(4000, "h1 bye")]


async def test_backend_that_shuts_down_after_its_close_gets_the_client_close_reply(
    nursery: trio.Nursery, start_proxy: Any
) -> None:
    replies: list[tuple[int, str | None]] = []
    done = trio.Event()

    async def backend(stream: trio.SocketStream) -> None:
        peer = RawWebSocket(stream, ConnectionType.SERVER)
        assert isinstance(await peer.next_event(), Request)
        await peer.send(AcceptConnection())
        await peer.send(CloseConnection(code=4002, reason="backend bye"))
        await stream.send_eof()  # shutdown(SHUT_WR): our side is over, we still read
        reply = await peer.next_event()
        assert isinstance(reply, CloseConnection)
        replies.append((reply.code, reply.reason))
        await peer.read_until_eof()
        done.set()
        await stream.aclose()

    port = await serve_raw(nursery, backend)
    proxy = await start_proxy([port])
    with trio.fail_after(TIMEOUT):
        client = await _raw_client(proxy.port)
        closing = await client.next_event()
        assert isinstance(closing, CloseConnection) and closing.code == 4002
        with pytest.raises(EOFError):
            await client.next_event()  # the backend's FIN, relayed
        # Our reply still travels: only the other direction had ended.
        await client.send(closing.response())
        await client.stream.send_eof()
        await done.wait()
        await client.stream.aclose()
    assert replies == [(4002, "backend bye")]


# -- RFC 8441: extended CONNECT over HTTP/2 ------------------------------------------------


class H2WebSocket:
    """A raw h2 client with one extended-CONNECT stream; wsproto frames the messages."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self.h2 = h2.connection.H2Connection(config=config)
        self.ws = WsConnection(ConnectionType.CLIENT)
        self.sid = 0
        self.server_settings: dict[int, int] = {}
        self.response: list[tuple[bytes, bytes]] | None = None
        self.ended = False
        self.reset: h2.events.StreamReset | None = None
        self.events: list[Any] = []
        """wsproto events received and not yet taken by ``next_event``."""

    async def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            await self.stream.send_all(data)

    async def read(self) -> None:
        """One read: h2 events are folded in, wsproto events queued in ``events``."""
        data = await self.stream.receive_some(65536)
        if not data:
            raise EOFError("proxy closed the connection")
        for event in self.h2.receive_data(data):
            if isinstance(event, h2.events.RemoteSettingsChanged):
                for code, change in event.changed_settings.items():
                    self.server_settings[code] = change.new_value
            elif isinstance(event, h2.events.ResponseReceived):
                self.response = list(event.headers)
            elif isinstance(event, h2.events.DataReceived):
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                if event.data:  # END_STREAM may come on an empty DATA frame
                    self.ws.receive_data(event.data)
                    self.events.extend(self.ws.events())
            elif isinstance(event, h2.events.StreamEnded):
                self.ended = True
            elif isinstance(event, h2.events.StreamReset):
                self.reset = event
        await self.flush()

    async def connect(self, path: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        self.h2.initiate_connection()
        await self.flush()
        code = h2.settings.SettingCodes.ENABLE_CONNECT_PROTOCOL
        while code not in self.server_settings:
            await self.read()
        assert self.server_settings[code] == 1
        self.sid = self.h2.get_next_available_stream_id()
        headers = [
            (b":method", b"CONNECT"),
            (b":protocol", b"websocket"),
            (b":scheme", b"http"),
            (b":path", path),
            (b":authority", b"proxy.example"),
            (b"sec-websocket-version", b"13"),
            *(extra or []),
        ]
        self.h2.send_headers(self.sid, headers)
        await self.flush()
        while self.response is None and self.reset is None:
            await self.read()

    @property
    def status(self) -> bytes | None:
        return dict(self.response or []).get(b":status")

    async def send(self, event: Any) -> None:
        """Frame ``event`` with wsproto and send it in DATA frames, within the windows."""
        data = self.ws.send(event)
        while data:
            room = min(self.h2.local_flow_control_window(self.sid), self.h2.max_outbound_frame_size)
            if room <= 0:
                await self.read()  # the proxy's WINDOW_UPDATE
                continue
            self.h2.send_data(self.sid, data[:room])
            data = data[room:]
            await self.flush()

    async def next_event(self) -> Any:
        while not self.events:
            await self.read()
        return self.events.pop(0)


async def _open_h2(port: int) -> H2WebSocket:
    return H2WebSocket(await trio.open_tcp_stream("127.0.0.1", port))


async def _connect_h2(port: int, path: bytes) -> H2WebSocket:
    """A fresh connection with its extended CONNECT to ``path`` answered (or reset)."""
    client = await _open_h2(port)
    await client.connect(path)
    return client


async def test_extended_connect_bridges_to_the_websocket_backend(
    ws_backend: WsBackend, proxy: Any
) -> None:
    with trio.fail_after(TIMEOUT):
        client = await _connect_h2(proxy.port, b"/chat")
        assert client.status == b"200"
        await client.send(TextMessage(data="hello over h2"))
        echoed = await client.next_event()
        assert isinstance(echoed, TextMessage) and echoed.data == "hello over h2"
        await client.send(BytesMessage(data=b"\x00\x01" * 40000))
        data = b""
        while len(data) < 80000:  # a large message may come in several pieces
            event = await client.next_event()
            assert isinstance(event, BytesMessage)
            data += event.data
        assert data == b"\x00\x01" * 40000
        await client.send(Ping(payload=b"p"))
        pong = await client.next_event()
        assert isinstance(pong, Pong) and pong.payload == b"p"
        # Close handshake: the backend echoes the close, then closes TCP: END_STREAM for us.
        await client.send(CloseConnection(code=4000, reason="h2 bye"))
        closing = await client.next_event()
        assert isinstance(closing, CloseConnection) and closing.code == 4000
        while not client.ended:
            await client.read()
        await ws_backend.closed.wait()
        await client.stream.aclose()
    assert ws_backend.closes == [(4000, "h2 bye")]


async def test_h2_client_close_with_end_stream_gets_the_backend_close_reply(
    ws_backend: WsBackend, proxy: Any
) -> None:
    with trio.fail_after(TIMEOUT):
        client = await _connect_h2(proxy.port, b"/chat")
        assert client.status == b"200"
        # RFC 8441 §5: the Close frame, and END_STREAM as the FIN of our side.
        client.h2.send_data(
            client.sid, client.ws.send(CloseConnection(code=4003, reason="ended")), end_stream=True
        )
        await client.flush()
        reply = await client.next_event()
        assert isinstance(reply, CloseConnection)
        assert (reply.code, reply.reason) == (4003, "ended")
        while not client.ended:
            await client.read()
        assert client.reset is None
        await ws_backend.closed.wait()
        await client.stream.aclose()
    assert ws_backend.closes == [(4003, "ended")]


async def test_h2_client_gets_the_backend_close_and_end_and_its_reply_still_goes_up(
    nursery: trio.Nursery, start_proxy: Any
) -> None:
    replies: list[tuple[int, str | None]] = []
    done = trio.Event()

    async def backend(stream: trio.SocketStream) -> None:
        peer = RawWebSocket(stream, ConnectionType.SERVER)
        assert isinstance(await peer.next_event(), Request)
        await peer.send(AcceptConnection())
        await peer.send(CloseConnection(code=4002, reason="backend bye"))
        await stream.send_eof()  # shutdown(SHUT_WR): relayed as END_STREAM
        reply = await peer.next_event()
        assert isinstance(reply, CloseConnection)
        replies.append((reply.code, reply.reason))
        await peer.read_until_eof()
        done.set()
        await stream.aclose()

    port = await serve_raw(nursery, backend)
    proxy = await start_proxy([port])
    with trio.fail_after(TIMEOUT):
        client = await _connect_h2(proxy.port, b"/chat")
        closing = await client.next_event()
        assert isinstance(closing, CloseConnection) and closing.code == 4002
        while not client.ended:
            await client.read()
        # RFC 8441 §5: END_STREAM ended one direction only; the reply travels, then ours.
        client.h2.send_data(client.sid, client.ws.send(closing.response()), end_stream=True)
        await client.flush()
        await done.wait()
        await client.stream.aclose()
    assert replies == [(4002, "backend bye")]


async def test_extended_connect_response_carries_sec_websocket_accept(
    ws_backend: WsBackend, proxy: Any
) -> None:
    with trio.fail_after(TIMEOUT):
        # Without a key of its own the client gets the backend's (checked by the proxy).
        client = await _connect_h2(proxy.port, b"/chat")
        accept = dict(client.response or [])[b"sec-websocket-accept"]
        assert len(base64.b64decode(accept)) == 20  # RFC 6455 §4.2.2: a SHA-1, base64
        await client.stream.aclose()
        # With a key of its own (some clients send one), the accept for that key.
        key = base64.b64encode(b"sixteen byte key")
        client = await _open_h2(proxy.port)
        await client.connect(b"/chat", [(b"sec-websocket-key", key)])
        assert client.status == b"200"
        assert dict(client.response or [])[b"sec-websocket-accept"] == accept_for(key)
        await client.send(TextMessage(data="still a tunnel"))
        echoed = await client.next_event()
        assert isinstance(echoed, TextMessage) and echoed.data == "still a tunnel"
        await client.stream.aclose()


async def test_extended_connect_gets_the_backend_refusal(ws_backend: WsBackend, proxy: Any) -> None:
    with trio.fail_after(TIMEOUT):
        client = await _connect_h2(proxy.port, b"/reject")
        assert client.status == b"403"
        await client.stream.aclose()


async def test_plain_connect_is_not_implemented(ws_backend: WsBackend, proxy: Any) -> None:
    with trio.fail_after(TIMEOUT):
        client = await _open_h2(proxy.port)
        client.h2.initiate_connection()
        await client.flush()
        sid = client.h2.get_next_available_stream_id()
        client.sid = sid
        client.h2.send_headers(sid, [(b":method", b"CONNECT"), (b":authority", b"db:5432")])
        await client.flush()
        while client.response is None:
            await client.read()
        assert client.status == b"501"
        await client.stream.aclose()


async def test_client_reset_of_the_stream_closes_the_backend(
    ws_backend: WsBackend, proxy: Any
) -> None:
    with trio.fail_after(TIMEOUT):
        client = await _connect_h2(proxy.port, b"/chat")
        await client.send(TextMessage(data="x"))
        assert isinstance(await client.next_event(), TextMessage)
        client.h2.reset_stream(client.sid)
        await client.flush()
        await ws_backend.closed.wait()
        await client.stream.aclose()
    assert ws_backend.closes == [(1006, None)]


async def test_h1_connect_is_not_implemented(proxy: Any, ws_backend: WsBackend) -> None:
    with trio.fail_after(TIMEOUT):
        stream = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        await stream.send_all(b"CONNECT db:5432 HTTP/1.1\r\nHost: db:5432\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(4096)
            assert chunk
            data += chunk
        assert data.startswith(b"HTTP/1.1 501 ")
        await stream.aclose()

"""WebSockets to HTTP/2 backends (``protocol = "h2"``), with real peers: Hypercorn serving an
ASGI WebSocket app over h2c (it advertises SETTINGS_ENABLE_CONNECT_PROTOCOL), trio-websocket
and a raw h2 client with wsproto in front, and a bare h2 server that does not advertise it.

RFC 8441: the proxy opens the backend stream with an extended CONNECT (``:protocol
websocket``), never a plain GET; an HTTP/1.1 client gets its 101 (with the Sec-WebSocket-Accept
for its key) and the frames travel between its connection and the backend stream.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import attrs
import h2.config
import h2.connection
import h2.events
import pytest
import trio
from hypercorn.trio import serve as hypercorn_serve
from peers import serve_raw
from test_h2_upstream import h2_config
from test_websocket import TIMEOUT, _client, _connect_h2, _echo
from trio_websocket import ConnectionClosed, ConnectionRejected
from wsproto.events import CloseConnection, TextMessage

from muxproxy.testing.fakellm import hypercorn_config


@attrs.define
class EchoApp:
    """An ASGI WebSocket echo that closes with 4001 on "close-me"; plain requests get 426."""

    versions: list[str] = attrs.field(factory=list)
    """The HTTP version of every WebSocket the app accepted."""
    closed: trio.Event = attrs.field(factory=trio.Event)
    """Set at the app's ``websocket.disconnect`` (Hypercorn passes no client close code)."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "websocket":
            await send({"type": "http.response.start", "status": 426, "headers": []})
            await send({"type": "http.response.body", "body": b"not a websocket\n"})
            return
        self.versions.append(scope["http_version"])
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                self.closed.set()
                return
            if message.get("text") == "close-me":
                await send({"type": "websocket.close", "code": 4001, "reason": "server bye"})
                continue
            await send(
                {
                    "type": "websocket.send",
                    "text": message.get("text"),
                    "bytes": message.get("bytes"),
                }
            )


@pytest.fixture
async def app_port(nursery: trio.Nursery) -> tuple[EchoApp, int]:
    app = EchoApp()
    binds: list[str] = await nursery.start(partial(hypercorn_serve, app, hypercorn_config()))
    return app, int(binds[0].rsplit(":", 1)[1])


async def test_h1_websocket_to_an_h2_backend_is_an_extended_connect(
    app_port: tuple[EchoApp, int], start_proxy: Any
) -> None:
    app, port = app_port
    proxy = await start_proxy(config=h2_config(port))
    with trio.fail_after(TIMEOUT):
        async with _client(proxy.port) as ws:  # trio-websocket checks the 101's accept
            await _echo(ws, "hello over an h2 backend")
            await _echo(ws, "x" * 100_000)
            await ws.aclose(4000, "client bye")  # returns once the backend's reply came
        await app.closed.wait()
    assert ws.closed is not None and ws.closed.code == 4000  # the reply names our code
    assert app.versions == ["2"]  # RFC 8441 on the backend side, not a GET


async def test_h1_websocket_gets_the_close_of_an_h2_backend(
    app_port: tuple[EchoApp, int], start_proxy: Any
) -> None:
    _, port = app_port
    proxy = await start_proxy(config=h2_config(port))
    with trio.fail_after(TIMEOUT):
        async with _client(proxy.port) as ws:
            await ws.send_message("close-me")
            with pytest.raises(ConnectionClosed) as info:
                await ws.get_message()
    assert info.value.reason.code == 4001


async def test_h2_websocket_to_an_h2_backend(
    app_port: tuple[EchoApp, int], start_proxy: Any
) -> None:
    app, port = app_port
    proxy = await start_proxy(config=h2_config(port))
    with trio.fail_after(TIMEOUT):
        client = await _connect_h2(proxy.port, b"/chat")
        assert client.status == b"200"
        await client.send(TextMessage(data="hello h2 to h2"))
        echoed = await client.next_event()
        assert isinstance(echoed, TextMessage) and echoed.data == "hello h2 to h2"
        await client.send(CloseConnection(code=4002, reason="bye"))
        reply = await client.next_event()
        assert isinstance(reply, CloseConnection) and reply.code == 4002
        await app.closed.wait()
        await client.stream.aclose()
    assert app.versions == ["2"]


async def test_h2_backend_without_extended_connect_is_refused_with_a_502(
    nursery: trio.Nursery, start_proxy: Any
) -> None:
    requests: list[dict[bytes, bytes]] = []

    async def backend(stream: trio.SocketStream) -> None:
        """An h2 server whose SETTINGS do not allow extended CONNECT; it answers 200."""
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        conn = h2.connection.H2Connection(config=config)
        conn.initiate_connection()
        await stream.send_all(conn.data_to_send())
        while data := await stream.receive_some(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    requests.append(dict(event.headers))
                    conn.send_headers(event.stream_id, [(b":status", b"200")], end_stream=True)
            await stream.send_all(conn.data_to_send())

    port = await serve_raw(nursery, backend)
    proxy = await start_proxy(config=h2_config(port))
    with trio.fail_after(TIMEOUT), pytest.raises(ConnectionRejected) as info:
        async with _client(proxy.port):
            pass  # pragma: no cover
    assert info.value.status_code == 502
    assert b"SETTINGS_ENABLE_CONNECT_PROTOCOL" in (info.value.body or b"")
    assert requests == []  # nothing reached the backend, no GET in particular

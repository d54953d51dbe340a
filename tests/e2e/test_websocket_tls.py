"""WebSockets through the proxy's TLS listener (``wss://``, HTTP/1.1 Upgrade), with real
peers: trio-websocket on both ends, the backend on plain TCP.

TLS cannot carry a half-close (trio's ``SSLStream`` sends close_notify only as part of a
whole close), so the backend's end of the tunnel cannot reach a TLS client as a FIN: the
proxy closes the client connection once the backend's side ended and what was pending for
the client (the backend's Close frame) is written. Before, a client that waits for the
server to close the TCP connection (RFC 6455 §7.1.1) waited for its own close timeout
(``disconnect_timeout`` here; 10 s by default in the ``websockets`` library).
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trustme
from trio_websocket import (
    ConnectionClosed,
    WebSocketRequest,
    open_websocket,
    serve_websocket,
)
from wsproto import WSConnection
from wsproto.connection import ConnectionType
from wsproto.events import AcceptConnection, CloseConnection, Request

DISCONNECT = 10
"""The peers' own close timeout: each close must end long before it."""
FAST = 2
"""What a close over TLS may take, well under ``DISCONNECT`` (it takes milliseconds)."""


@attrs.define
class EchoBackend:
    """Echoes messages; closes with 4001 when asked to; records each connection's end."""

    closes: list[tuple[int, str | None]] = attrs.field(factory=list)
    closed: trio.Event = attrs.field(factory=trio.Event)

    async def handler(self, request: WebSocketRequest) -> None:
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


@attrs.frozen
class TlsSetup:
    cert: str
    key: str
    context: ssl.SSLContext
    """The client's: trusts the proxy's certificate."""


@pytest.fixture
def tls(tmp_path: Path) -> TlsSetup:
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    issued.private_key_pem.write_to_path(str(key))
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return TlsSetup(cert=str(cert), key=str(key), context=context)


async def _start(nursery: trio.Nursery, start_proxy: Any, tls: TlsSetup) -> tuple[EchoBackend, int]:
    backend = EchoBackend()
    server = await nursery.start(serve_websocket, backend.handler, "127.0.0.1", 0, None)
    proxy = await start_proxy([server.port], tls_cert=tls.cert, tls_key=tls.key)
    return backend, proxy.port


def _wss_client(port: int, tls: TlsSetup) -> Any:
    return open_websocket(
        "127.0.0.1",
        port,
        "/ws",
        use_ssl=tls.context,
        connect_timeout=FAST,
        disconnect_timeout=DISCONNECT,
    )


async def test_wss_client_close_completes_at_once_for_a_client_that_awaits_the_server_close(
    nursery: trio.Nursery, start_proxy: Any, tls: TlsSetup
) -> None:
    """RFC 6455 §7.1.1: after the Close frames the client waits for the server to close the
    TCP connection (as the ``websockets`` library does); that close must come through TLS."""
    backend, port = await _start(nursery, start_proxy, tls)
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    stream = trio.SSLStream(tcp, tls.context, server_hostname="127.0.0.1")
    ws = WSConnection(ConnectionType.CLIENT)
    events: list[Any] = []

    async def next_event() -> Any:
        while not events:
            data = await stream.receive_some(65536)
            if not data:
                return None  # the server closed
            ws.receive_data(bytes(data))
            events.extend(ws.events())
        return events.pop(0)

    async with stream:
        with trio.fail_after(FAST):  # the handshakes take milliseconds too
            await stream.send_all(ws.send(Request(host="127.0.0.1", target="/ws")))
            assert isinstance(await next_event(), AcceptConnection)
            await stream.send_all(ws.send(CloseConnection(code=4000, reason="client bye")))
            reply = await next_event()
            assert isinstance(reply, CloseConnection) and reply.code == 4000
            assert await next_event() is None
            await backend.closed.wait()
    assert backend.closes == [(4000, "client bye")]


async def test_wss_client_close_completes_at_once(
    nursery: trio.Nursery, start_proxy: Any, tls: TlsSetup
) -> None:
    backend, port = await _start(nursery, start_proxy, tls)
    with trio.fail_after(FAST):  # the handshakes take milliseconds too
        async with _wss_client(port, tls) as ws:
            await ws.send_message("hello")
            assert await ws.get_message() == "hello"
            await ws.aclose(4000, "client bye")
        await backend.closed.wait()
    assert backend.closes == [(4000, "client bye")]


async def test_wss_backend_close_completes_at_once(
    nursery: trio.Nursery, start_proxy: Any, tls: TlsSetup
) -> None:
    backend, port = await _start(nursery, start_proxy, tls)
    with trio.fail_after(FAST):  # the handshakes take milliseconds too
        async with _wss_client(port, tls) as ws:
            await ws.send_message("close-me")
            with pytest.raises(ConnectionClosed) as info:
                await ws.get_message()
        # Leaving the block waited for the server's close of the connection.
        await backend.closed.wait()
    assert (info.value.reason.code, info.value.reason.reason) == (4001, "server bye")
    assert backend.closes == [(4001, "server bye")]

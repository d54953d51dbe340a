"""WebSockets through the proxy's TLS listener (``wss://``, HTTP/1.1 Upgrade), with real
clients in front (the ``websockets`` library's asyncio client, trio-websocket) and
trio-websocket's server behind, on plain TCP.

TLS cannot carry a half-close (trio's ``SSLStream`` sends close_notify only as part of a
whole close), so the backend's end of the tunnel cannot reach a TLS client as a FIN: the
proxy closes the client connection once the backend's side ended and what was pending for
the client (the backend's Close frame) is written. Before, a client that waits for the
server to close the TCP connection (RFC 6455 §7.1.1, as ``websockets`` does) waited for its
own close timeout (10 s by default in ``websockets``), whichever side began the close.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trustme
import websockets
from test_websocket import WsBackend
from trio_websocket import ConnectionClosed, open_websocket
from websockets.asyncio.client import connect

DISCONNECT = 10
"""The clients' own close timeout (``websockets``' default): each close must end long before."""
FAST = 1
"""What a close over TLS may take, well under ``DISCONNECT`` (it takes milliseconds)."""


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


@attrs.frozen
class Wss:
    backend: WsBackend
    port: int
    """The proxy's TLS listener, in front of ``backend``."""
    tls: TlsSetup


@pytest.fixture
async def wss(nursery: trio.Nursery, start_proxy: Any, tls: TlsSetup) -> Wss:
    backend = await WsBackend.start(nursery)
    proxy = await start_proxy([backend.port], tls_cert=tls.cert, tls_key=tls.key)
    return Wss(backend, proxy.port, tls)


# -- the websockets library (asyncio, in a thread of its own) --------------------------------


@attrs.frozen(kw_only=True)
class Closed:
    """What the ``websockets`` client saw of a close, timed on its own clock (seconds)."""

    code: int | None
    reason: str
    raised_after: float
    """From the close's start (``close()`` called, or "close-me" sent) until ``recv()``
    raised ConnectionClosed (or ``close()`` returned)."""
    ended_after: float
    """From the close's start until ``wait_closed()`` returned: the TCP connection is gone."""


def _connect(wss: Wss) -> connect:
    return connect(
        f"wss://127.0.0.1:{wss.port}/ws",
        ssl=wss.tls.context,
        open_timeout=FAST,
        close_timeout=DISCONNECT,
    )


async def _websockets_client_closes(wss: Wss) -> Closed:
    async with _connect(wss) as ws:
        await ws.send("hello")
        assert await ws.recv() == "hello"
        start = time.perf_counter()
        # Sends Close, reads the echoed Close, then waits for the server's TCP close.
        await ws.close(4000, "client bye")
        raised = time.perf_counter() - start
        await ws.wait_closed()
        return Closed(
            code=ws.close_code,
            reason=ws.close_reason or "",
            raised_after=raised,
            ended_after=time.perf_counter() - start,
        )


async def _websockets_backend_closes(wss: Wss) -> Closed:
    async with _connect(wss) as ws:
        await ws.send("hello")
        assert await ws.recv() == "hello"
        start = time.perf_counter()
        await ws.send("close-me")
        # recv() raises only once the TCP connection is closed (the library's reader
        # ends then), after it answered the backend's Close frame.
        try:
            message = await ws.recv()
        except websockets.ConnectionClosed as exc:
            raised = time.perf_counter() - start
            frame = exc.rcvd
        else:
            raise AssertionError(f"a message instead of the close: {message!r}")
        await ws.wait_closed()
        assert frame is not None, "the backend's Close frame did not arrive"
        return Closed(
            code=frame.code,
            reason=frame.reason,
            raised_after=raised,
            ended_after=time.perf_counter() - start,
        )


async def _in_asyncio(client: Callable[[Wss], Awaitable[Closed]], wss: Wss) -> Closed:
    """Run ``client`` on an asyncio loop in a worker thread, bounded there and here."""

    async def bounded() -> Closed:
        try:
            async with asyncio.timeout(DISCONNECT + FAST):
                return await client(wss)
        except TimeoutError:
            raise AssertionError(f"no close within {DISCONNECT + FAST} s") from None

    with trio.fail_after(DISCONNECT + 2 * FAST):
        return await trio.to_thread.run_sync(asyncio.run, bounded(), abandon_on_cancel=True)


async def test_websockets_client_close_over_wss_completes_at_once(wss: Wss) -> None:
    """RFC 6455 §7.1.1: after the Close frames the client waits for the server to close the
    TCP connection; that close must come through TLS, not after the client's timeout."""
    closed = await _in_asyncio(_websockets_client_closes, wss)
    assert (closed.code, closed.reason) == (4000, "client bye")  # the backend's echo
    assert closed.ended_after < FAST, f"close() took {closed.ended_after:.3f} s"
    with trio.fail_after(FAST):
        await wss.backend.closed.wait()
    assert wss.backend.closes == [(4000, "client bye")]


async def test_websockets_backend_close_over_wss_completes_at_once(wss: Wss) -> None:
    closed = await _in_asyncio(_websockets_backend_closes, wss)
    assert (closed.code, closed.reason) == (4001, "server bye")
    assert closed.raised_after < FAST, f"recv() raised after {closed.raised_after:.3f} s"
    assert closed.ended_after < FAST, f"wait_closed() returned after {closed.ended_after:.3f} s"
    assert wss.backend.closes == [(4001, "server bye")]


# -- trio-websocket --------------------------------------------------------------------------


def _wss_client(port: int, tls: TlsSetup) -> Any:
    return open_websocket(
        "127.0.0.1",
        port,
        "/ws",
        use_ssl=tls.context,
        connect_timeout=FAST,
        disconnect_timeout=DISCONNECT,
    )


async def test_wss_client_close_completes_at_once(wss: Wss) -> None:
    with trio.fail_after(FAST):  # the handshakes take milliseconds too
        async with _wss_client(wss.port, wss.tls) as ws:
            await ws.send_message("hello")
            assert await ws.get_message() == "hello"
            await ws.aclose(4000, "client bye")
        await wss.backend.closed.wait()
    assert wss.backend.closes == [(4000, "client bye")]


async def test_wss_backend_close_completes_at_once(wss: Wss) -> None:
    with trio.fail_after(FAST):  # the handshakes take milliseconds too
        async with _wss_client(wss.port, wss.tls) as ws:
            await ws.send_message("close-me")
            with pytest.raises(ConnectionClosed) as info:
                await ws.get_message()
        # Leaving the block waited for the server's close of the connection.
        await wss.backend.closed.wait()
    assert (info.value.reason.code, info.value.reason.reason) == (4001, "server bye")
    assert wss.backend.closes == [(4001, "server bye")]

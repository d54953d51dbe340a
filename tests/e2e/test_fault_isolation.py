"""Fault isolation through the real server: a bug in one connection's path ends that one only.

A bug cannot be triggered by a real peer on purpose, so one is planted (on the core's fault
plan, ``faultplan.py``, for one connection's bytes; or in the driver, for one socket's read);
the rest is real: sockets, an h2 client, the fake LLM backend. These proxies run with
``raise_errors=False``, as in production.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h2.errors
import h11
import pytest
import trio
import trustme
from peers import H1Peer, open_h2

from muxproxy.config import quick_config
from muxproxy.core.commands import Log
from muxproxy.core.events import ConnectionAccepted, DataReceived, Event
from muxproxy.core.faultplan import FaultPoint, plant_faults
from muxproxy.trio.driver import StreamConn
from muxproxy.trio.server import ProxyServer

if TYPE_CHECKING:
    from conftest import RunningProxy, StartBackend, StartProxy

CHAT = "/v1/chat/completions"
JSON = ("content-type", "application/json")
BODY = json.dumps({"model": "m", "messages": [], "stream": True}).encode()
TOKENS = 12


class Injected(RuntimeError):
    """The planted bug."""


def _bytes_of(conn: int) -> Callable[[object], bool]:
    """Matches the bytes read from connection ``conn``."""
    return lambda event: type(event) is DataReceived and event.conn == conn


def _knobs(tokens: int) -> list[tuple[str, str]]:
    return [("x-fake-tokens", str(tokens)), JSON]


def _events(proxy: RunningProxy) -> list[Log]:
    logs: list[Log] = []
    driver = proxy.server.driver
    assert driver is not None
    driver.on_log = logs.append
    return logs


async def _served(port: int) -> int | None:
    """A fresh HTTP/1.1 request: the status it got (the server is still up)."""
    peer = await H1Peer.connect(port)
    await peer.send_request("POST", CHAT, _knobs(2), BODY)
    response = await peer.read_response()
    await peer.aclose()
    return response.status


async def test_client_fault_does_not_stop_another_connections_stream(
    start_backend: StartBackend, start_proxy: StartProxy
) -> None:
    _fake, port = await start_backend(delay=0.02)
    proxy = await start_proxy([port], raise_errors=False)
    logs = _events(proxy)
    core = proxy.server.core
    with trio.fail_after(10):
        async with open_h2(proxy.port) as doomed, open_h2(proxy.port) as other:
            first = await doomed.request("POST", CHAT, _knobs(500), BODY)
            sid = await other.request("POST", CHAT, _knobs(TOKENS), BODY)
            await doomed.wait_until(lambda: len(doomed.streams[first].frames) >= 1)
            await other.wait_until(lambda: len(other.streams[sid].frames) >= 1)
            # The first connection accepted has the lowest id.
            victim = min(core.clients)
            assert core.clients[victim].h2 is not None
            plant_faults(core).plant(FaultPoint.BEFORE, _bytes_of(victim), Injected("planted bug"))
            doomed.conn.ping(b"01234567")
            await doomed.flush()
            await doomed.wait_until(lambda: doomed.closed)
            state = await other.wait_done(sid)
        assert doomed.terminated is not None
        assert doomed.terminated.error_code == h2.errors.ErrorCodes.INTERNAL_ERROR
        assert not doomed.streams[first].ended
        assert state.ended and state.reset is None
        assert state.body.endswith(b"data: [DONE]\n\n")
        assert await _served(proxy.port) == 200
    assert core.counters["internal_errors"] == 1
    (logged,) = [log for log in logs if log.event == "internal_error"]
    assert "Injected: planted bug" in logged.fields["traceback"]


async def test_driver_fault_closes_only_its_socket(
    start_backend: StartBackend, start_proxy: StartProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, port = await start_backend(delay=0.02)
    proxy = await start_proxy([port], raise_errors=False)
    logs = _events(proxy)
    driver = proxy.server.driver
    assert driver is not None and driver.reactor is not None
    with trio.fail_after(10):
        async with open_h2(proxy.port) as doomed, open_h2(proxy.port) as other:
            first = await doomed.request("POST", CHAT, _knobs(500), BODY)
            sid = await other.request("POST", CHAT, _knobs(TOKENS), BODY)
            await doomed.wait_until(lambda: len(doomed.streams[first].frames) >= 1)
            victim = min(proxy.server.core.clients)
            feed = driver.feed

            def feed_or_fail(event: Event) -> None:
                # The driver's own code, as the reactor reads the victim's socket.
                if _bytes_of(victim)(event):
                    raise Injected("planted driver bug")
                feed(event)

            monkeypatch.setattr(driver, "feed", feed_or_fail)
            doomed.conn.ping(b"01234567")
            await doomed.flush()
            await doomed.wait_until(lambda: doomed.closed)
            # The core heard ConnectionClosed: the doomed stream's backend request is cancelled.
            await fake.wait_disconnect(1)
            state = await other.wait_done(sid)
        assert not doomed.streams[first].ended
        assert state.ended and state.body.endswith(b"data: [DONE]\n\n")
        assert await _served(proxy.port) == 200
    assert victim not in proxy.server.core.clients
    assert proxy.server.core.counters["internal_errors"] == 1
    (logged,) = [log for log in logs if log.event == "internal_error"]
    assert logged.fields["conn"] == victim
    assert logged.fields["where"] == "driver: reactor"
    assert "planted driver bug" in logged.fields["traceback"]


async def _crash(server: ProxyServer, plant: Any) -> None:
    """Run ``server``; once a client is accepted plant a bug, then the client's request comes
    (through the reactor's round)."""
    accepted = trio.Event()

    async with trio.open_nursery() as nursery:
        addresses = await nursery.start(server.run)
        driver = server.driver
        assert driver is not None
        feed = driver.feed

        def feed_and_watch(event: Event) -> None:
            feed(event)
            if isinstance(event, ConnectionAccepted):
                accepted.set()

        driver.feed = feed_and_watch  # type: ignore[method-assign]  # watch the accept
        peer = await H1Peer.connect(addresses[0][1])
        await accepted.wait()
        plant()
        await peer.send(h11.Request(method="GET", target="/", headers=[("host", "a")]))
        await trio.sleep_forever()


async def test_bug_in_the_reactor_round_itself_still_crashes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = ProxyServer(quick_config("127.0.0.1:0", ["127.0.0.1:9"]), raise_errors=False)

    def plant() -> None:
        def broken(now: float) -> None:
            raise Injected("planted bug in the round")

        assert server.driver is not None
        monkeypatch.setattr(server.driver, "settle", broken)

    with trio.fail_after(10), pytest.raises(BaseExceptionGroup) as info:
        await _crash(server, plant)
    assert info.group_contains(Injected, depth=None)


async def test_bug_while_isolating_still_crashes(monkeypatch: pytest.MonkeyPatch) -> None:
    server = ProxyServer(quick_config("127.0.0.1:0", ["127.0.0.1:9"]), raise_errors=False)
    core = server.core

    def plant() -> None:
        def broken_cleanup(*args: Any) -> None:
            raise Injected("planted bug in the cleanup")

        clients = lambda event: type(event) is DataReceived and event.conn > 0  # noqa: E731
        plant_faults(core).plant(FaultPoint.BEFORE, clients, Injected("planted bug"))
        monkeypatch.setattr(core.isolation, "_isolate", broken_cleanup)

    with trio.fail_after(10), pytest.raises(BaseExceptionGroup) as info:
        await _crash(server, plant)
    assert info.group_contains(Injected, match="in the cleanup", depth=None)


async def test_fault_in_a_tls_connections_task_closes_only_that_connection(
    start_backend: StartBackend,
    start_proxy: StartProxy,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    issued.private_key_pem.write_to_path(str(key))
    context = ssl.create_default_context()
    ca.configure_trust(context)
    _fake, port = await start_backend(delay=0.0)
    proxy = await start_proxy([port], tls_cert=str(cert), tls_key=str(key), raise_errors=False)
    logs = _events(proxy)
    driver = proxy.server.driver
    assert driver is not None
    reader = driver._reader

    async def reader_or_fail(conn: StreamConn) -> str | None:
        if conn.ident == 1:
            raise Injected("planted bug in a connection task")
        return await reader(conn)

    monkeypatch.setattr(driver, "_reader", reader_or_fail)
    with trio.fail_after(10):
        doomed = await trio.open_ssl_over_tcp_stream("127.0.0.1", proxy.port, ssl_context=context)
        await doomed.do_handshake()
        assert await doomed.receive_some(100) == b""  # closed, nothing sent
        other = await trio.open_ssl_over_tcp_stream("127.0.0.1", proxy.port, ssl_context=context)
        client = h11.Connection(h11.CLIENT)
        request = h11.Request(method="GET", target="/v1/models", headers=[("host", "a")])
        await other.send_all(
            (client.send(request) or b"") + (client.send(h11.EndOfMessage()) or b"")
        )
        event: Any = h11.NEED_DATA
        while event is h11.NEED_DATA:
            client.receive_data(await other.receive_some(65536))
            event = client.next_event()
        assert isinstance(event, h11.Response) and event.status_code == 200
    (logged,) = [log for log in logs if log.event == "internal_error"]
    assert (logged.fields["conn"], logged.fields["where"]) == (1, "driver: connection task")
    assert 1 not in proxy.server.core.clients

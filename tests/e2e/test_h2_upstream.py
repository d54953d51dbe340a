"""End-to-end HTTP/2 upstreams: Hypercorn's fake LLM speaking h2c, servers with protocol "h2".

1. Streams of several client connections share one backend h2 connection.
2. A client that stops reading stalls only its own backend stream: another client's tokens
   sharing the same backend connection keep arriving, and the stalled stream's bytes held in
   the proxy stay under ``stream_buffer``.
3. A client that goes away cancels its backend stream (RST_STREAM) and the shared connection
   stays up for the others.
4. A backend that answers a new connection with its SETTINGS and a GOAWAY in one write (a
   server shutting down) neither takes a stream nor stops the proxy: the request goes to
   another server, or the next request to a new connection.
5. The empty DATA frame that ends a backend's stream is not sent on as an empty frame of its own.
6. A backend that accepts the connection but never sends its SETTINGS is given up at the
   connect timeout, and the next request gets a connection of its own.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import attrs
import h2.config
import h2.connection
import h2.events
import pytest
import trio
import trio.testing
from peers import H1Peer, open_h2, serve_raw
from test_streaming import (
    CHAT,
    JSON,
    SMALL_BUFFER,
    assert_complete_stream,
    chat_body,
    knobs,
    settle,
    stream_stats,
    wait_stats,
)

from muxproxy.config import Config, Limits, Timeouts, Upstream, quick_config

if TYPE_CHECKING:
    from conftest import StartBackend, StartProxy


def h2_config(port: int, **limits: int) -> Config:
    config = quick_config("127.0.0.1:0", [f"127.0.0.1:{port}"])
    group = config.upstreams["default"]
    servers = tuple(attrs.evolve(s, protocol="h2") for s in group.servers)
    return attrs.evolve(
        config,
        upstreams={"default": attrs.evolve(group, servers=servers)},
        limits=Limits(**limits),
    )


def backend_conns(proxy: object) -> int:
    driver = proxy.server.driver  # type: ignore[attr-defined]
    return sum(1 for c in driver.conns.values() if c.ident < 0)


async def test_clients_share_one_backend_connection(
    start_backend: StartBackend, start_proxy: StartProxy
) -> None:
    fake, port = await start_backend(tokens=6, delay=0.01, first_delay=0.1)
    proxy = await start_proxy(config=h2_config(port))
    with trio.fail_after(10):
        async with open_h2(proxy.port) as one, open_h2(proxy.port) as two:
            a = await one.request("POST", CHAT, [JSON], chat_body())
            b = await two.request("POST", CHAT, [JSON], chat_body())
            await fake.wait_streams_started(2)
            stats = proxy.server.core.statistics()
            assert stats.client_connections == 2
            assert stats.upstream_connections == 1
            assert backend_conns(proxy) == 1
            for peer, sid in ((one, a), (two, b)):
                state = await peer.wait_done(sid)
                assert state.ended and state.reset is None and state.status == 200
                assert_complete_stream(state.body, 6)
        # An HTTP/1.1 client reuses the same (now idle) backend connection.
        peer = await H1Peer.connect(proxy.port)
        await peer.send_request("POST", CHAT, [JSON], chat_body())
        response = await peer.read_response()
        assert response.status == 200
        assert_complete_stream(response.body, 6)
    assert backend_conns(proxy) == 1
    assert fake.streams_completed == 3


async def test_stalled_client_stalls_only_its_backend_stream(
    start_backend: StartBackend, start_proxy: StartProxy
) -> None:
    fake, port = await start_backend(delay=0.0)
    proxy = await start_proxy(config=h2_config(port, stream_buffer=SMALL_BUFFER))
    with trio.fail_after(15):
        async with (
            open_h2(proxy.port, connection_window=16 * 1024 * 1024) as slow,
            open_h2(proxy.port) as fast_peer,
        ):
            stalled = await slow.request(
                "POST", CHAT, [JSON, *knobs(tokens=1500)], chat_body(), hold=True
            )
            await slow.wait_until(lambda: slow.conn.remote_flow_control_window(stalled) == 0)
            await wait_stats(proxy, stalled, lambda s: s.upstream_paused)
            received = len(slow.streams[stalled].body)

            fast = await fast_peer.request(
                "POST", CHAT, [JSON, *knobs(tokens=20, delay=0.005)], chat_body()
            )
            state = await fast_peer.wait_done(fast)
            assert state.ended and state.reset is None
            assert_complete_stream(state.body, 20)
            assert backend_conns(proxy) == 1, "the two streams should share one connection"

            await settle()
            entry = stream_stats(proxy, stalled)
            assert entry is not None and entry.upstream_paused
            assert entry.response_buffered <= SMALL_BUFFER
            assert len(slow.streams[stalled].body) == received
            assert not slow.streams[stalled].done

            await slow.release(stalled)
            big = await slow.wait_done(stalled)
    assert big.ended and big.reset is None
    assert_complete_stream(big.body, 1500)
    assert fake.streams_completed == 2


async def test_client_gone_cancels_only_its_backend_stream(
    start_backend: StartBackend, start_proxy: StartProxy
) -> None:
    fake, port = await start_backend(tokens=40, delay=0.01)
    proxy = await start_proxy(config=h2_config(port))
    with trio.fail_after(10):
        async with open_h2(proxy.port) as keep:
            sid = await keep.request("POST", CHAT, [JSON], chat_body())
            async with open_h2(proxy.port) as gone:
                await gone.request("POST", CHAT, [JSON], chat_body())
                await fake.wait_streams_started(2)
            await fake.wait_disconnect(1)
            state = await keep.wait_done(sid)
            assert state.ended and state.reset is None
            assert_complete_stream(state.body, 40)
    assert backend_conns(proxy) == 1
    assert fake.streams_completed == 1


class ShuttingDownBackend:
    """A real h2 server over a socket whose first ``refusals`` connections get its SETTINGS and
    a GOAWAY(NO_ERROR, last_stream_id 0) in one write; later ones are served ("served")."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.connections = 0
        self.streams = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        conn = h2.connection.H2Connection(config=config)
        conn.initiate_connection()
        refuse = self.connections <= self.refusals
        if refuse:
            conn.close_connection()
        async with stream:
            await stream.send_all(conn.data_to_send())
            with contextlib.suppress(trio.BrokenResourceError):
                while data := await stream.receive_some(65536):
                    if refuse:
                        continue
                    for event in conn.receive_data(data):
                        if isinstance(event, h2.events.StreamEnded):
                            self.streams += 1
                            sid = event.stream_id
                            conn.send_headers(sid, [(b":status", b"200")])
                            conn.send_data(sid, b"served", end_stream=True)
                    await stream.send_all(conn.data_to_send())


def h2_servers(ports: list[int]) -> Config:
    config = quick_config("127.0.0.1:0", [f"127.0.0.1:{p}" for p in ports])
    group = config.upstreams["default"]
    servers = tuple(attrs.evolve(s, protocol="h2") for s in group.servers)
    return attrs.evolve(config, upstreams={"default": Upstream(name="default", servers=servers)})


async def test_backend_goaway_with_its_settings_fails_over_to_another_server(
    nursery: trio.Nursery, start_backend: StartBackend, start_proxy: StartProxy
) -> None:
    gone = ShuttingDownBackend(refusals=1_000)
    gone_port = await serve_raw(nursery, gone.handle)
    fake, port = await start_backend(tokens=3)
    proxy = await start_proxy(config=h2_servers([gone_port, port]))
    with trio.fail_after(10):
        # Round robin sends one of the two requests to the server shutting down first.
        for _ in range(2):
            peer = await H1Peer.connect(proxy.port)
            await peer.send_request("POST", CHAT, [JSON], chat_body())
            response = await peer.read_response()
            assert response.status == 200
            assert_complete_stream(response.body, 3)
    assert gone.connections >= 1 and gone.streams == 0
    assert fake.streams_completed == 2


async def test_backend_goaway_before_the_first_request_then_a_new_connection_serves(
    nursery: trio.Nursery, start_proxy: StartProxy
) -> None:
    backend = ShuttingDownBackend(refusals=1)
    port = await serve_raw(nursery, backend.handle)
    proxy = await start_proxy(config=h2_servers([port]))
    with trio.fail_after(10):
        peer = await H1Peer.connect(proxy.port)
        # One server: the request that waited for the refused connection gets a 502 ...
        await peer.send_request("POST", CHAT, [JSON], chat_body())
        response = await peer.read_response()
        assert response.status == 502
        # ... and the proxy keeps serving: the next request opens a new connection.
        peer = await H1Peer.connect(proxy.port)
        await peer.send_request("POST", CHAT, [JSON], chat_body())
        response = await peer.read_response()
        assert response.status == 200 and response.body == b"served"
    assert backend.connections == 2 and backend.streams == 1


async def test_no_empty_data_frame_before_end_stream(
    start_backend: StartBackend, start_proxy: StartProxy
) -> None:
    _, port = await start_backend(tokens=4)
    proxy = await start_proxy(config=h2_config(port))
    with trio.fail_after(10):
        async with open_h2(proxy.port) as peer:
            sid = await peer.request("POST", CHAT, [JSON], chat_body())
            state = await peer.wait_done(sid)
    assert state.ended and state.reset is None
    assert_complete_stream(state.body, 4)
    # Only the last DATA frame (the one with END_STREAM) may be empty.
    assert [f for f in state.frames[:-1] if not f.data] == []


@pytest.fixture
def clock() -> trio.testing.MockClock:
    # Virtual time for the tests that ask for it (pytest-trio runs them under this clock);
    # 10 ms of real quiet before a jump, so loopback bytes in flight never fire a timeout.
    return trio.testing.MockClock(autojump_threshold=0.01)


class SilentBackend:
    """Accepts connections, reads what comes, never answers (no SETTINGS); ``closed[i]`` is set
    once the proxy closed the i-th connection."""

    def __init__(self) -> None:
        self.closed: list[trio.Event] = []

    async def handle(self, stream: trio.SocketStream) -> None:
        gone = trio.Event()
        self.closed.append(gone)
        async with stream:
            with contextlib.suppress(trio.BrokenResourceError):
                while await stream.receive_some(65536):
                    pass
        gone.set()


async def test_backend_that_never_sends_settings_does_not_hold_later_requests(
    nursery: trio.Nursery, start_proxy: StartProxy, clock: trio.testing.MockClock
) -> None:
    silent = SilentBackend()
    port = await serve_raw(nursery, silent.handle)
    config = attrs.evolve(h2_servers([port]), timeouts=Timeouts(connect=5.0))
    proxy = await start_proxy(config=config)
    with trio.fail_after(60):
        for n in (1, 2):
            peer = await H1Peer.connect(proxy.port)
            start = trio.current_time()
            await peer.send_request("POST", CHAT, [JSON], chat_body())
            response = await peer.read_response()
            assert response.status == 504
            assert trio.current_time() - start == pytest.approx(5.0, abs=0.5)
            # Each request had a connection of its own, which the proxy gave up and closed.
            assert len(silent.closed) == n
            await silent.closed[-1].wait()

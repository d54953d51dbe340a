"""End to end: backends that misbehave at the TCP and HTTP level, each with the client's
outcome asserted and a healthy stream on the same proxy shown to be unaffected.

One raw Trio backend picks its fault by request path. Time is virtual (``MockClock``, as in
test_timeouts.py), so a backend that drips one byte a second costs nothing. The server never
counts as failed (``max_fails = 0``) so that a fault cannot turn the healthy stream into a 503;
the stale-pool test keeps the default to show that that retry spares the server's health.
Refused connects and a plain response-head timeout are in test_errors.py / test_timeouts.py.
"""

from __future__ import annotations

import socket
import struct

import attrs
import h2.errors
import pytest
import trio
import trio.testing
from peers import H1Peer, open_h2, serve_raw

from muxproxy.config import Server, Timeouts, quick_config

GOOD_EVENTS = [b"data: %d\n\n" % i for i in range(5)]
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
TIMEOUTS = Timeouts(response_head=5.0, read=3.0)


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0.01)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def reset(stream: trio.SocketStream) -> None:
    """Close with RST instead of FIN (SO_LINGER with a zero timeout)."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    stream.socket.close()


async def read_head(stream: trio.SocketStream, buffer: bytearray) -> bytes | None:
    """The path of the next request head (GET, no body), or None at EOF."""
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buffer += data
    end = buffer.index(b"\r\n\r\n") + 4
    head = bytes(buffer[:end])
    del buffer[:end]
    return head.split(b" ", 2)[1]


class FaultyBackend:
    def __init__(self) -> None:
        self.connections = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        try:
            await self._serve(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the proxy gave up on this connection: that is the point of most faults

    async def _serve(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        number = self.connections
        buffer = bytearray()
        served = 0
        while (path := await read_head(stream, buffer)) is not None:
            served += 1
            if path == b"/good":
                await stream.send_all(SSE_HEAD)
                for event in GOOD_EVENTS:
                    await trio.sleep(1.0)
                    await stream.send_all(chunk(event))
                await stream.send_all(b"0\r\n\r\n")
            elif path == b"/hang-head":
                await trio.sleep_forever()
            elif path == b"/hang-mid":
                await stream.send_all(SSE_HEAD + chunk(b"data: first\n\n"))
                await trio.sleep_forever()
            elif path == b"/rst-head":
                return reset(stream)
            elif path == b"/rst-mid":
                await stream.send_all(SSE_HEAD + chunk(b"data: first\n\n"))
                await trio.sleep(0.5)
                return reset(stream)
            elif path == b"/garbage":
                await stream.send_all(
                    b"SSH-2.0-OpenSSH_9.6\r\n\x00\xff\xfe not http at all\r\n\r\n"
                )
                await trio.sleep_forever()
            elif path == b"/big-head":
                filler = b"x-filler: " + b"a" * 1000 + b"\r\n"
                await stream.send_all(b"HTTP/1.1 200 OK\r\n" + filler * 100)
                await trio.sleep_forever()
            elif path == b"/drip-head":
                for byte in b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-slow: yes\r\n\r\nok":
                    await stream.send_all(bytes([byte]))
                    await trio.sleep(1.0)
            elif path == b"/drip-body":
                await stream.send_all(SSE_HEAD)
                for byte in b"data: slow\n\n":
                    await trio.sleep(1.0)
                    await stream.send_all(chunk(bytes([byte])))
                await stream.send_all(b"0\r\n\r\n")
            elif path == b"/once":
                # Keep-alive for one response; the next request on this connection finds
                # it closed (as if the backend's idle close raced with our reuse).
                if served > 1:
                    return await stream.aclose()
                body = b"conn %d" % number
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
                await stream.send_all(body)
        await stream.aclose()


async def start(start_proxy, nursery, *, max_fails: int = 0):
    backend = FaultyBackend()
    port = await serve_raw(nursery, backend.handle)
    config = quick_config("127.0.0.1:0", [f"127.0.0.1:{port}"])
    group = config.upstreams["default"]
    server = Server(address=f"127.0.0.1:{port}", max_fails=max_fails)
    group = attrs.evolve(group, servers=(server,))
    config = attrs.evolve(config, upstreams={"default": group}, timeouts=TIMEOUTS)
    return backend, await start_proxy(config=config)


def assert_good(stream) -> None:
    assert stream.status == 200 and stream.ended and stream.reset is None
    assert stream.body == b"".join(GOOD_EVENTS)


# Fault -> what the client sees before a head (status) or after one (truncation).
BEFORE_HEAD = [
    ("/hang-head", 504),  # response_head timeout
    ("/rst-head", 502),
    ("/garbage", 502),
    ("/big-head", 502),  # H1Client's max_incomplete_event_size
    ("/drip-head", 504),  # a slow head is bounded by the response-head timeout
]
MID_STREAM = ["/hang-mid", "/rst-mid"]  # read timeout / RST after the head


@pytest.mark.parametrize(("path", "status"), BEFORE_HEAD)
async def test_fault_before_the_head_answers_an_error_and_spares_other_streams(
    start_proxy, nursery, clock, path, status
):
    _, proxy = await start(start_proxy, nursery)
    with trio.fail_after(100):
        async with open_h2(proxy.port) as peer:
            good = await peer.request("GET", "/good")
            bad = await peer.request("GET", path)
            bad_stream = await peer.wait_done(bad)
            assert bad_stream.status == status and bad_stream.ended
            assert bad_stream.header("content-type").startswith("text/plain")
            assert_good(await peer.wait_done(good))
        h1 = await H1Peer.connect(proxy.port)
        await h1.send_request("GET", path)
        response = await h1.read_response()
        assert response.status == status
        await h1.aclose()


@pytest.mark.parametrize("path", MID_STREAM)
async def test_fault_mid_stream_truncates_visibly_and_spares_other_streams(
    start_proxy, nursery, clock, path
):
    _, proxy = await start(start_proxy, nursery)
    with trio.fail_after(100):
        async with open_h2(proxy.port) as peer:
            good = await peer.request("GET", "/good")
            bad = await peer.request("GET", path)
            bad_stream = await peer.wait_done(bad)
            assert bad_stream.status == 200 and not bad_stream.ended
            assert bad_stream.reset == h2.errors.ErrorCodes.INTERNAL_ERROR
            assert bad_stream.body == b"data: first\n\n"
            assert_good(await peer.wait_done(good))
        h1 = await H1Peer.connect(proxy.port)
        await h1.send_request("GET", path)
        response = await h1.read_response()
        assert response.status == 200 and not response.complete and response.closed
        await h1.aclose()


async def test_body_dripping_a_byte_a_second_is_a_stream_not_a_timeout(start_proxy, nursery, clock):
    _, proxy = await start(start_proxy, nursery)
    with trio.fail_after(100):
        async with open_h2(proxy.port) as peer:
            good = await peer.request("GET", "/good")
            slow = await peer.request("GET", "/drip-body")
            slow_stream = await peer.wait_done(slow)
            assert slow_stream.ended and slow_stream.reset is None
            assert slow_stream.body == b"data: slow\n\n"
            assert_good(await peer.wait_done(good))


async def test_stale_pooled_connection_is_retried_on_the_same_server(start_proxy, nursery, clock):
    backend, proxy = await start(start_proxy, nursery, max_fails=1)
    with trio.fail_after(100):
        h1 = await H1Peer.connect(proxy.port)
        bodies = []
        for _ in range(3):
            await h1.send_request("GET", "/once")
            response = await h1.read_response()
            assert response.status == 200 and response.complete
            bodies.append(response.body)
            h1.conn.start_next_cycle()
        await h1.aclose()
    # Each reuse found the pooled connection closed and went, unseen, to a fresh one; the
    # server was never counted as failed (max_fails = 1 would have made the next one a 503).
    assert bodies == [b"conn 1", b"conn 2", b"conn 3"]
    assert backend.connections == 3

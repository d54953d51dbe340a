"""End to end: backends that misbehave at the TCP and HTTP level, each with the client's
outcome asserted and a healthy stream on the same proxy shown to be unaffected.

One raw Trio backend picks its fault by request path. Time is virtual (``MockClock``, as in
test_timeouts.py), so a backend that drips one byte a second costs nothing. The server never
counts as failed (``max_fails = 0``) so that a fault cannot turn the healthy stream into a 503;
the stale-pool test keeps the default to show that that retry spares the server's health.
Refused connects and a plain response-head timeout are in test_errors.py / test_timeouts.py.
TLS backends (trustme certificates): one that closes right after its last chunk, with and
without close_notify; a handshake that never completes; a write that fails.
"""

from __future__ import annotations

import socket
import ssl
import struct
from functools import partial
from pathlib import Path

import attrs
import h2.errors
import h11
import pytest
import trio
import trio.testing
import trustme
from peers import H1Peer, open_h2, serve_raw

from muxproxy.config import Config, Server, Timeouts, quick_config
from muxproxy.core.events import ConnectionClosed
from muxproxy.core.proxy import ProxyCore
from muxproxy.trio.driver import Driver

GOOD_EVENTS = [b"data: %d\n\n" % i for i in range(5)]
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
TIMEOUTS = Timeouts(response_head=5.0, read=3.0)
BAD_TRAILERS = (
    b"0\r\nTransfer-Encoding: ehunked\r\nContent-Length: 5\r\nConnection: close\r\n"
    b"x-done: yes\r\n\r\n"
)


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0.01)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def reset(stream: trio.SocketStream) -> None:
    """Close with RST instead of FIN (SO_LINGER with a zero timeout)."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    stream.socket.close()


async def read_head(stream: trio.abc.Stream, buffer: bytearray) -> bytes | None:
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
            elif path == b"/bad-trailers":
                # A trailer section h11 refuses to send (RFC 9110 §6.5.1 forbids framing
                # fields in trailers), next to fields that may go on.
                await stream.send_all(SSE_HEAD + chunk(b"data: first\n\n") + BAD_TRAILERS)
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


# -- TLS backends ----------------------------------------------------------------------------


@attrs.frozen
class BackendTls:
    ca: trustme.CA
    ca_file: str
    cert: trustme.LeafCert

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.cert.configure_cert(context)
        return context

    def config(self, port: int, **changes: object) -> Config:
        """A proxy config with one HTTP/1.1 server at ``port`` spoken to over TLS."""
        config = quick_config("127.0.0.1:0", [f"127.0.0.1:{port}"])
        group = config.upstreams["default"]
        server = Server(
            address=f"127.0.0.1:{port}",
            max_fails=0,
            tls=True,
            tls_ca=self.ca_file,
            tls_server_name="backend.test",
        )
        group = attrs.evolve(group, servers=(server,))
        return attrs.evolve(config, upstreams={"default": group}, **changes)


@pytest.fixture
def backend_tls(tmp_path: Path) -> BackendTls:
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    return BackendTls(ca=ca, ca_file=str(ca_file), cert=ca.issue_cert("backend.test"))


LAST_CHUNK_EVENTS = [b"data: %d\n\n" % i for i in range(3)] + [b"data: [DONE]\n\n"]


@pytest.mark.parametrize("close_notify", [True, False], ids=["close_notify", "no-close_notify"])
async def test_tls_backend_closing_right_after_its_last_chunk_never_truncates(
    start_proxy, nursery, backend_tls, close_notify
):
    """The whole response, the terminating chunk and the close in one go, 50 times: the
    last bytes and the close reach the proxy together, and the client must get every byte
    and a clean end each time (a TLS stack that drops data read with the close, or a close
    seen before the data it follows, would truncate the stream)."""
    body = b"".join(chunk(event) for event in LAST_CHUNK_EVENTS) + b"0\r\n\r\n"

    async def close_after_last_chunk(stream: trio.SSLStream[trio.SocketStream]) -> None:
        buffer = bytearray()
        try:
            if await read_head(stream, buffer) is None:
                return
            await stream.send_all(SSE_HEAD + body)
        except trio.BrokenResourceError:
            return
        if close_notify:
            await stream.aclose()
        else:
            await stream.transport_stream.aclose()  # TCP FIN, no TLS close_notify

    listeners = await nursery.start(
        partial(
            trio.serve_ssl_over_tcp,
            close_after_last_chunk,
            0,
            backend_tls.server_context(),
            host="127.0.0.1",
        )
    )
    port = listeners[0].transport_listener.socket.getsockname()[1]
    proxy = await start_proxy(config=backend_tls.config(port))
    with trio.fail_after(60):
        h1 = await H1Peer.connect(proxy.port)
        for _ in range(50):
            await h1.send_request("GET", "/v1/stream")
            response = await h1.read_response()
            assert response.status == 200 and response.complete
            assert response.body == b"".join(LAST_CHUNK_EVENTS)
            h1.conn.start_next_cycle()
        await h1.aclose()


@pytest.mark.parametrize("close_notify", [True, False], ids=["close_notify", "no-close_notify"])
async def test_tls_body_framed_by_the_close_is_complete_only_after_close_notify(
    start_proxy, nursery, backend_tls, close_notify
):
    """RFC 9112 §9.8: a response with neither Content-Length nor chunked framing is complete
    only if a valid closure alert was received; a bare TCP close may be a truncation."""

    async def until_close(stream: trio.SSLStream[trio.SocketStream]) -> None:
        buffer = bytearray()
        if await read_head(stream, buffer) is None:
            return
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\npart one, ")
        await stream.send_all(b"part two")
        if close_notify:
            await stream.aclose()
        else:
            await stream.transport_stream.aclose()

    listeners = await nursery.start(
        partial(
            trio.serve_ssl_over_tcp, until_close, 0, backend_tls.server_context(), host="127.0.0.1"
        )
    )
    port = listeners[0].transport_listener.socket.getsockname()[1]
    proxy = await start_proxy(config=backend_tls.config(port))
    with trio.fail_after(10):
        h1 = await H1Peer.connect(proxy.port)
        await h1.send_request("GET", "/v1/download")
        response = await h1.read_response()
        await h1.aclose()
    assert response.status == 200
    if close_notify:
        assert response.complete and response.body == b"part one, part two"
    else:
        assert not response.complete and response.closed


async def test_connect_cancelled_during_the_tls_handshake_closes_its_socket(
    start_proxy, nursery, backend_tls, clock
):
    """The backend takes the ClientHello and never answers: the connect timeout gives up on
    the handshake, and the TCP connection under it must be closed, not leaked."""
    closed = trio.Event()

    async def silent(stream: trio.SocketStream) -> None:
        async with stream:
            while await stream.receive_some(65536):
                pass
        closed.set()

    port = await serve_raw(nursery, silent)
    proxy = await start_proxy(config=backend_tls.config(port, timeouts=Timeouts(connect=2.0)))
    with trio.fail_after(30):
        h1 = await H1Peer.connect(proxy.port)
        await h1.send_request("GET", "/v1/models")
        response = await h1.read_response()
        assert response.status == 504
        await closed.wait()
        await h1.aclose()


async def test_tls_write_failure_is_reported_as_a_broken_connection(nursery, backend_tls):
    """A TLS connection whose peer went away: our write fails while our read still waits.
    The close is an error, so that a read-until-close response ends truncated, not clean."""
    ours, theirs = trio.testing.memory_stream_pair()
    client_context = ssl.create_default_context()
    backend_tls.ca.configure_trust(client_context)
    client = trio.SSLStream(ours, client_context, server_hostname="backend.test")
    server = trio.SSLStream(theirs, backend_tls.server_context(), server_side=True)
    with trio.fail_after(10):
        async with trio.open_nursery() as handshakes:
            handshakes.start_soon(client.do_handshake)
            handshakes.start_soon(server.do_handshake)
        await theirs.receive_stream.aclose()
        driver = Driver(ProxyCore(quick_config("127.0.0.1:0", ["127.0.0.1:9"])), nursery)
        events: list[object] = []
        # The events are recorded, not handled: no core conversation is needed here.
        driver.feed = events.append  # type: ignore[method-assign]
        conn = driver.register(-1, client)
        conn.pending += b"GET / HTTP/1.1\r\nhost: a\r\n\r\n"
        await driver.run_connection(conn)
    (closed,) = [e for e in events if isinstance(e, ConnectionClosed)]
    assert closed.error is not None and "send failed" in closed.error


async def test_trailers_a_backend_must_not_send_are_dropped_on_every_path(start_proxy, nursery):
    # The live form of a crash: one plain curl to a backend that sends
    # "Transfer-Encoding: ehunked" as a trailer. Every client gets the body and the trailer
    # fields that may go on; the proxy serves the next client as well.
    _, proxy = await start(start_proxy, nursery)
    with trio.fail_after(20):
        result = await trio.run_process(
            [
                "curl",
                "--silent",
                "--show-error",
                "--raw",
                "--max-time",
                "10",
                f"http://127.0.0.1:{proxy.port}/bad-trailers",
            ],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        raw = result.stdout.lower()
        assert b"data: first" in raw and raw.endswith(b"0\r\nx-done: yes\r\n\r\n")
        assert b"ehunked" not in raw

        async with open_h2(proxy.port) as peer:
            sid = await peer.request("GET", "/bad-trailers", headers=[("te", "trailers")])
            stream = await peer.wait_done(sid)
            assert stream.status == 200 and stream.ended and stream.reset is None
            assert stream.body == b"data: first\n\n"
            assert stream.trailers == [(b"x-done", b"yes")]

        h1 = await H1Peer.connect(proxy.port)
        await h1.send_request("GET", "/bad-trailers")
        events = []
        while not events or not isinstance(events[-1], h11.EndOfMessage):
            events.append((await h1.next_event())[1])
        assert list(events[-1].headers) == [(b"x-done", b"yes")]
        await h1.aclose()

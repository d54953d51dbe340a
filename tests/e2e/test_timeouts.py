"""End to end: every configured timeout, on real sockets, in virtual time.

Each test runs under a ``MockClock`` that jumps to the next deadline once every task has been
blocked for 10 ms of real time (``autojump_threshold=0.01``, not 0: with 0 the clock could jump
while loopback bytes are still on their way between two sockets, firing a timeout early). So
the timeouts here are realistic (seconds) and the tests still take milliseconds, and the
durations can be asserted: virtual time moves only by jumps to deadlines.

What is checked (``Timeouts`` in ``muxproxy.config``):

- connect: a backend connect that never completes -> 504 after ``connect``;
- response_head: a backend that never answers -> 504 after ``response_head``;
- read: a backend that goes quiet mid-stream -> the truncation is visible (HTTP/2
  RST_STREAM(INTERNAL_ERROR), HTTP/1.1 close without the last chunk), and a backend that is
  slow but steady is not cut;
- send: a client that stops reading -> the proxy closes its connection (at once, without
  waiting for the unwritable bytes); a slow reader that keeps reading is served in full; an
  HTTP/2 stream whose window stays closed -> RST_STREAM(CANCEL) on that stream alone;
- client_header: an incomplete (or trickled) request head -> 408 and close, also the second
  head on a kept-alive connection; a request body that stops coming -> 408 (HTTP/1.1), not a
  504; a silent connection -> close (GOAWAY first for HTTP/2); a TLS handshake that never
  starts -> close;
- client_body: a request body trickled just under the ``client_header`` gap -> 408 at the
  whole-body deadline (HTTP/1.1 with the close; HTTP/2 on that stream alone), counted;
- keepalive_idle: an idle kept-alive HTTP/1.1 connection is closed; an idle HTTP/2 connection
  gets GOAWAY then is closed; a long response is not an idle connection.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import h11
import pytest
import trio
import trio.testing
import trustme
from h2client import H2Client
from peers import (
    closed_port,
    h1_read_response,
    h1_request_bytes,
    hanging_port,
    never_answer,
    open_h2,
    open_tcp,
    read_until_eof,
    serve_raw,
)

from muxproxy.config import Timeouts, quick_config
from muxproxy.core.commands import Log
from muxproxy.core.events import ConnectionClosed
from muxproxy.testing.fakellm import reply_text

CHAT = b"/v1/chat/completions"


def chat_body(tokens: int | None = None) -> bytes:
    request: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    }
    if tokens is not None:
        request["max_tokens"] = tokens
    return json.dumps(request).encode()


@pytest.fixture
def clock() -> trio.testing.MockClock:
    # pytest-trio runs the test under any Clock among its fixtures' values.
    return trio.testing.MockClock(autojump_threshold=0.01)


# -- helpers --------------------------------------------------------------------------------


def close_to(elapsed: float, timeout: float) -> bool:
    """Virtual time moves by jumps to deadlines: the timeout, plus at most a little."""
    return timeout <= elapsed < timeout + 0.5


async def until_closed(port: int, sent: bytes = b"") -> tuple[bytes, float]:
    """Connect, send ``sent`` (if any), read until the proxy closes: what came back, and the
    virtual time from just after the connect to the close."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        start = trio.current_time()
        if sent:
            await stream.send_all(sent)
        received = await read_until_eof(stream)
        return received, trio.current_time() - start


class Watch:
    """The proxy's ``Log`` commands and client ``ConnectionClosed`` events, with the virtual
    time of each (the latter by wrapping ``Driver.feed`` and ``Driver.closed_now``, where the
    reactor reports the sockets it closed: the core logs no ``client_closed`` for a
    connection it closed itself)."""

    def __init__(self, proxy: Any) -> None:
        self.logs: list[tuple[float, str]] = []
        self._changed = trio.Event()
        driver = proxy.server.driver
        assert driver is not None
        driver.on_log = self._on_log
        feed = driver.feed

        def watching_feed(event: Any) -> None:
            if isinstance(event, ConnectionClosed) and event.conn > 0:
                self._record("connection_closed")
            feed(event)

        driver.feed = watching_feed
        closed_now = driver.closed_now

        def watching_closed_now(ident: int, error: str | None) -> None:
            if ident > 0:
                self._record("connection_closed")
            closed_now(ident, error)

        driver.closed_now = watching_closed_now

    def _on_log(self, log: Log) -> None:
        self._record(log.event)

    def _record(self, event: str) -> None:
        self.logs.append((trio.current_time(), event))
        self._changed.set()
        self._changed = trio.Event()

    def times(self, event: str) -> list[float]:
        return [at for at, name in self.logs if name == event]

    async def wait_for(self, event: str) -> float:
        while not self.times(event):
            await self._changed.wait()
        return self.times(event)[0]


# -- connect ---------------------------------------------------------------------------------


async def assert_h1_504_after(port: int, seconds: float) -> None:
    """One HTTP/1.1 request to the proxy on ``port`` gets 504 after ``seconds``."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        conn, request = h1_request_bytes()
        start = trio.current_time()
        await stream.send_all(request)
        response, _ = await h1_read_response(stream, conn)
        assert response.status_code == 504
        assert close_to(trio.current_time() - start, seconds)


async def test_connect_timeout(start_proxy, clock):
    with hanging_port() as port:
        proxy = await start_proxy([port], timeouts=Timeouts(connect=7.0))
        with trio.fail_after(100):
            await assert_h1_504_after(proxy.port, 7.0)

            client = await H2Client.connect(proxy.port)
            async with client.stream:
                start = trio.current_time()
                sid = await client.send(b"/v1/models")
                await client.finish(sid)
                assert client.streams[sid].status == 504 and client.streams[sid].ended
                assert close_to(trio.current_time() - start, 7.0)
        assert proxy.server.core.statistics().upstream_connections == 0


async def test_connect_timeout_through_name_resolution(start_proxy, monkeypatch, clock):
    """An upstream given by name connects in a Trio task (resolution may block): that connect
    is abandoned at the timeout too."""
    real_open = trio.open_tcp_stream
    abandoned = trio.Event()

    async def hanging_open(host: str, p: int, **kwargs: Any) -> trio.SocketStream:
        if host != "localhost":
            return await real_open(host, p, **kwargs)
        try:
            await trio.sleep_forever()
        finally:
            abandoned.set()
        raise AssertionError("unreachable")

    monkeypatch.setattr(trio, "open_tcp_stream", hanging_open)
    config = quick_config("127.0.0.1:0", ["localhost:9"])
    proxy = await start_proxy(config=attrs.evolve(config, timeouts=Timeouts(connect=7.0)))
    with trio.fail_after(100):
        await assert_h1_504_after(proxy.port, 7.0)
        await abandoned.wait()
    assert proxy.server.core.statistics().upstream_connections == 0


# -- response head ---------------------------------------------------------------------------


async def test_response_head_timeout(start_proxy, nursery, clock):
    port = await serve_raw(nursery, never_answer)
    proxy = await start_proxy([port], timeouts=Timeouts(response_head=20.0))
    with trio.fail_after(100):
        stream = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        async with stream:
            conn, request = h1_request_bytes(CHAT, b"POST", chat_body())
            start = trio.current_time()
            await stream.send_all(request)
            response, body = await h1_read_response(stream, conn)
            assert response.status_code == 504
            assert body
            assert close_to(trio.current_time() - start, 20.0)

        client = await H2Client.connect(proxy.port)
        async with client.stream:
            start = trio.current_time()
            sid = await client.send(CHAT, chat_body())
            await client.finish(sid)
            assert client.streams[sid].status == 504 and client.streams[sid].ended
            assert close_to(trio.current_time() - start, 20.0)


# -- read ------------------------------------------------------------------------------------


async def test_read_timeout_truncates_h2_stream(start_backend, start_proxy, clock):
    # The backend sends the head and the first token, then would wait 1000 s for the next.
    fake, backend = await start_backend(tokens=3, delay=1000.0)
    proxy = await start_proxy([backend], timeouts=Timeouts(read=15.0))
    with trio.fail_after(100):
        client = await H2Client.connect(proxy.port)
        async with client.stream:
            sid = await client.send(CHAT, chat_body())
            await client.wait(lambda: b"tok0" in client.streams[sid].body)
            first_token_at = trio.current_time()
            await client.finish(sid)
            assert close_to(trio.current_time() - first_token_at, 15.0)
            await fake.wait_disconnect()  # the backend was told to stop generating
    assert client.streams[sid].status == 200
    assert client.streams[sid].reset == h2.errors.ErrorCodes.INTERNAL_ERROR
    assert not client.streams[sid].ended
    assert b"[DONE]" not in client.streams[sid].body


async def test_read_timeout_truncates_h1_response(start_backend, start_proxy, clock):
    fake, backend = await start_backend(tokens=3, delay=1000.0)
    proxy = await start_proxy([backend], timeouts=Timeouts(read=15.0))
    with trio.fail_after(100):
        stream = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        async with stream:
            conn, request = h1_request_bytes(CHAT, b"POST", chat_body())
            await stream.send_all(request)
            body = b""
            while b"tok0" not in body:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif type(event) is h11.Response:
                    assert event.status_code == 200
                elif type(event) is h11.Data:
                    body += bytes(event.data)
            first_token_at = trio.current_time()
            rest = await read_until_eof(stream)
            assert close_to(trio.current_time() - first_token_at, 15.0)
            await fake.wait_disconnect()
    # The connection closed inside the chunked body: no terminating chunk, no [DONE].
    conn.receive_data(rest)
    conn.receive_data(b"")
    with pytest.raises(h11.RemoteProtocolError):
        while True:
            event = conn.next_event()
            assert type(event) is h11.Data
    assert b"0\r\n\r\n" not in rest
    assert b"[DONE]" not in body + rest


async def test_slow_but_steady_stream_is_not_cut(start_backend, start_proxy, clock):
    # Tokens every 8 s, read timeout 10 s: 4 tokens take 24 s in all, never a 10 s gap.
    _, backend = await start_backend(tokens=4, delay=8.0)
    proxy = await start_proxy([backend], timeouts=Timeouts(read=10.0))
    with trio.fail_after(200):
        client = await H2Client.connect(proxy.port)
        async with client.stream:
            start = trio.current_time()
            sid = await client.send(CHAT, chat_body())
            await client.finish(sid)
            assert trio.current_time() - start >= 24.0
    assert client.streams[sid].ended and client.streams[sid].reset is None
    assert client.streams[sid].body.endswith(b"data: [DONE]\n\n")
    assert reply_text(4).split()[-1].encode() in client.streams[sid].body


# -- send ------------------------------------------------------------------------------------


async def flood(stream: trio.SocketStream) -> None:
    """A backend answering with an endless body, as fast as the proxy takes it."""
    async with stream:
        await stream.receive_some(65536)
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n"
        await stream.send_all(head % (1 << 40))
        chunk = b"data: " + b"x" * 65000 + b"\n\n"
        try:
            while True:
                await stream.send_all(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


async def start_unread_request(port: int, protocol: str) -> trio.SocketStream:
    """A client with a tiny receive buffer that sends one request and then reads nothing."""
    stream = await open_tcp(port, rcvbuf=4096)  # fill up quickly
    if protocol == "h1":
        _, request = h1_request_bytes(b"/stream")
    else:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        # Flow control must not be what stops the proxy: open every window wide.
        conn.local_settings.initial_window_size = 2**31 - 1
        conn.initiate_connection()
        conn.increment_flow_control_window(2**31 - 1 - 65535)
        conn.send_headers(
            1,
            [(":method", "GET"), (":scheme", "http"), (":authority", "a"), (":path", "/s")],
            end_stream=True,
        )
        request = conn.data_to_send()
    await stream.send_all(request)
    return stream


@pytest.mark.parametrize("protocol", ["h1", "h2"])
async def test_send_timeout_closes_a_client_that_stopped_reading(
    start_proxy, nursery, clock, protocol
):
    port = await serve_raw(nursery, flood)
    proxy = await start_proxy([port], timeouts=Timeouts(send=5.0))
    watch = Watch(proxy)
    with trio.fail_after(100):
        stream = await start_unread_request(proxy.port, protocol)
        async with stream:
            # The client reads nothing; the proxy must give up on it, and close at once:
            # the bytes it holds cannot be written, so there is nothing to wait for.
            timed_out = await watch.wait_for("send_timeout")
            closed = await watch.wait_for("connection_closed")
            assert 0 <= closed - timed_out < 0.5
            # What the kernel holds is all the client gets (with the driver waiting for its
            # flush the flood would go on as soon as the client read, for ever).
            received = 0
            while chunk := await stream.receive_some(65536):
                received += len(chunk)
                assert received < 64 << 20, "the proxy did not close the connection"
    assert proxy.server.core.statistics().upstream_connections == 0


async def test_zero_window_stream_is_reset_after_send_and_others_go_on(
    start_backend, start_proxy, clock
):
    """A client that never opens one stream's window (SETTINGS_INITIAL_WINDOW_SIZE 0) while it
    reads another: the stuck one is reset with CANCEL after ``send``, and its backend is
    told to stop, long before the read timeout; the other stream is served in full."""
    fake, backend = await start_backend(tokens=2000, delay=0.1)
    proxy = await start_proxy([backend], timeouts=Timeouts(send=20.0, read=300.0))
    with trio.fail_after(200):
        client = await H2Client.connect(proxy.port)
        async with client.stream:
            client.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
            await client.flush()
            start = trio.current_time()
            stuck = await client.send(CHAT, chat_body(2000))
            good = await client.send(CHAT, chat_body(3))
            client.conn.increment_flow_control_window(1 << 20, stream_id=good)
            await client.flush()
            await client.wait(
                lambda: client.streams[stuck].reset is not None and client.streams[good].ended
            )
            assert 20.0 <= trio.current_time() - start < 22.0
            await fake.wait_disconnect()
    assert client.streams[stuck].reset == h2.errors.ErrorCodes.CANCEL
    assert client.streams[stuck].body == b""
    assert (
        client.streams[good].body.endswith(b"data: [DONE]\n\n")
        and client.streams[good].reset is None
    )
    assert client.goaway is None


# -- client header ---------------------------------------------------------------------------


async def test_second_request_head_on_a_kept_alive_connection_gets_408(
    start_backend, start_proxy, clock
):
    _, backend = await start_backend()
    timeouts = Timeouts(client_header=10.0, keepalive_idle=75.0)
    proxy = await start_proxy([backend], timeouts=timeouts)
    with trio.fail_after(100):
        stream = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        async with stream:
            conn, request = h1_request_bytes()
            await stream.send_all(request)
            response, _ = await h1_read_response(stream, conn)
            assert response.status_code == 200
            await stream.send_all(b"GET /v1/models HTTP/1.1\r\nHost: a\r\n")
            started = trio.current_time()
            received = await read_until_eof(stream)
            assert close_to(trio.current_time() - started, 10.0)
    assert received.startswith(b"HTTP/1.1 408 ")


async def test_stalled_h1_request_body_gets_408_not_504(start_proxy, nursery, clock):
    """The backend waits for the whole body, as it may; the client sent 10 of 100 bytes."""
    port = await serve_raw(nursery, never_answer)
    timeouts = Timeouts(client_header=10.0, response_head=5.0)
    proxy = await start_proxy([port], timeouts=timeouts)
    with trio.fail_after(100):
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\ncontent-length: 100\r\n\r\n"
        received, took = await until_closed(proxy.port, head + b"x" * 10)
        assert close_to(took, 10.0)
    assert received.startswith(b"HTTP/1.1 408 ")


BODY_TIMEOUTS = Timeouts(client_header=10.0, client_body=30.0)
"""A body byte every 9 s never breaks the gap; the whole body is due 30 s after the head."""


async def test_h2_body_trickled_under_the_gap_gets_408_at_its_deadline(
    start_backend, start_proxy, clock
):
    fake, backend = await start_backend()
    proxy = await start_proxy([backend], timeouts=BODY_TIMEOUTS)
    json_type = ("content-type", "application/json")
    with trio.fail_after(100):
        async with open_h2(proxy.port) as peer:
            started = trio.current_time()
            sid = await peer.request("POST", CHAT.decode(), [json_type], end_stream=False)
            state = peer.streams[sid]
            while not state.done:
                peer.conn.send_data(sid, b" ")
                await peer.flush()
                with trio.move_on_after(9.0):
                    await peer.wait_until(lambda: state.done)
            assert close_to(trio.current_time() - started, 30.0)
            assert state.status == 408
            # The connection goes on: the next request on it is answered.
            other = await peer.request("POST", CHAT.decode(), [json_type], chat_body(3))
            assert (await peer.wait_done(other)).status == 200
    assert proxy.server.core.counters["request_body_deadline"] == 1
    assert fake.streams_completed == 1


async def test_h1_body_trickled_under_the_gap_gets_408_and_close(start_proxy, nursery, clock):
    port = await serve_raw(nursery, never_answer)
    proxy = await start_proxy([port], timeouts=BODY_TIMEOUTS)
    with trio.fail_after(100):
        stream = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        async with stream:
            started = trio.current_time()
            head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\ncontent-length: 100\r\n\r\n"
            await stream.send_all(head)
            received = b""
            with contextlib.suppress(trio.BrokenResourceError):
                while True:
                    await stream.send_all(b"x")
                    with trio.move_on_after(9.0):
                        received = await read_until_eof(stream)
                        break
            assert close_to(trio.current_time() - started, 30.0)
    assert received.startswith(b"HTTP/1.1 408 ")
    assert proxy.server.core.counters["request_body_deadline"] == 1


async def test_incomplete_request_head_gets_408(start_proxy, clock):
    proxy = await start_proxy([await closed_port()], timeouts=Timeouts(client_header=10.0))
    with trio.fail_after(100):
        received, took = await until_closed(
            proxy.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n"
        )
        assert close_to(took, 10.0)
    assert received.startswith(b"HTTP/1.1 408 ")


async def test_trickled_request_head_still_times_out(start_proxy, clock):
    """The header timeout runs from the connection's start: bytes do not extend it."""
    proxy = await start_proxy([await closed_port()], timeouts=Timeouts(client_header=10.0))
    head = b"GET /v1/models HTTP/1.1\r\nHost: a\r\nX-Slow: " + b"a" * 100
    with trio.fail_after(100):
        stream = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        async with stream:
            start = trio.current_time()

            async def trickle() -> None:
                for byte in head:
                    await stream.send_all(bytes([byte]))
                    await trio.sleep(1.0)  # pacing of the slow client, not synchronisation

            async with trio.open_nursery() as nursery:
                nursery.start_soon(trickle)
                received = await read_until_eof(stream)
                nursery.cancel_scope.cancel()
            assert close_to(trio.current_time() - start, 10.0)
    assert received.startswith(b"HTTP/1.1 408 ")


@pytest.mark.parametrize("preface", [b"", b"PRI * HTTP/2.0\r\n"], ids=["nothing", "half-preface"])
async def test_silent_connection_is_closed(start_proxy, clock, preface):
    proxy = await start_proxy([await closed_port()], timeouts=Timeouts(client_header=10.0))
    with trio.fail_after(100):
        received, took = await until_closed(proxy.port, preface)
        assert close_to(took, 10.0)
    assert received == b""


async def test_h2_connection_without_requests_gets_goaway(start_proxy, clock):
    proxy = await start_proxy([await closed_port()], timeouts=Timeouts(client_header=10.0))
    with trio.fail_after(100):
        client = await H2Client.connect(proxy.port)
        async with client.stream:
            start = trio.current_time()
            await client.until_eof()
    assert client.goaway is not None and client.goaway_at is not None
    assert client.goaway.error_code == h2.errors.ErrorCodes.NO_ERROR
    assert close_to(client.goaway_at - start, 10.0)


async def test_tls_handshake_counts_against_client_header(start_proxy, clock, tmp_path):
    """A client that connects to the TLS listener and never starts the handshake."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(key_path))
    proxy = await start_proxy(
        [await closed_port()],
        timeouts=Timeouts(client_header=10.0),
        tls_cert=str(cert_path),
        tls_key=str(key_path),
    )
    with trio.fail_after(100):
        received, took = await until_closed(proxy.port)
        assert received == b""
        assert close_to(took, 10.0)


# -- keep-alive idle -------------------------------------------------------------------------


async def test_idle_h1_connection_is_closed(start_backend, start_proxy, clock):
    _, backend = await start_backend()
    proxy = await start_proxy([backend], timeouts=Timeouts(keepalive_idle=20.0))
    with trio.fail_after(100):
        stream = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        async with stream:
            for _ in range(2):  # kept alive between the two
                conn, request = h1_request_bytes()
                await stream.send_all(request)
                response, _ = await h1_read_response(stream, conn)
                assert response.status_code == 200
                conn.start_next_cycle()
            idle_since = trio.current_time()
            assert await read_until_eof(stream) == b""
            assert close_to(trio.current_time() - idle_since, 20.0)


async def test_idle_h2_connection_gets_goaway_then_close(start_backend, start_proxy, clock):
    _, backend = await start_backend()
    proxy = await start_proxy([backend], timeouts=Timeouts(keepalive_idle=20.0))
    with trio.fail_after(100):
        client = await H2Client.connect(proxy.port)
        async with client.stream:
            sid = await client.send(b"/v1/models")
            await client.finish(sid)
            assert client.streams[sid].status == 200
            idle_since = trio.current_time()
            await client.until_eof()
    assert client.goaway is not None and client.goaway_at is not None
    assert client.goaway.error_code == h2.errors.ErrorCodes.NO_ERROR
    assert client.goaway.last_stream_id == sid
    assert close_to(client.goaway_at - idle_since, 20.0)


async def test_long_response_is_not_idle(start_backend, start_proxy, clock):
    """keepalive_idle counts only between requests, not during a long generation."""
    _, backend = await start_backend(tokens=5, delay=4.0)
    timeouts = Timeouts(keepalive_idle=5.0, client_header=5.0)
    proxy = await start_proxy([backend], timeouts=timeouts)
    with trio.fail_after(200):
        client = await H2Client.connect(proxy.port)
        async with client.stream:
            sid = await client.send(CHAT, chat_body())
            await client.finish(sid)
        stream = await trio.open_tcp_stream("127.0.0.1", proxy.port)
        async with stream:
            conn, request = h1_request_bytes(CHAT, b"POST", chat_body())
            await stream.send_all(request)
            response, body = await h1_read_response(stream, conn)
    assert client.streams[sid].ended and client.streams[sid].body.endswith(b"data: [DONE]\n\n")
    assert client.goaway is None
    assert response.status_code == 200 and body.endswith(b"data: [DONE]\n\n")


async def test_slow_reader_making_progress_is_not_cut(start_proxy, nursery, clock):
    """send is about *no* progress: a client that keeps reading, slowly, is served in full.

    The client takes at most 64 KiB a second of a 3 MiB body, so the whole takes longer than
    the send timeout (30 s) while no single write waits that long: the send timer fires with
    output pending and must re-arm from the last progress instead of closing. (Much slower
    readers are not "progress" the proxy can see: the kernel reports a socket writable again
    only once a third of its send buffer drained, hundreds of KiB on loopback.)
    """
    size = 3 * 1024 * 1024

    async def big_body(stream: trio.SocketStream) -> None:
        async with stream:
            await stream.receive_some(65536)
            head = b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(head + b"content-length: %d\r\n\r\n" % size + b"x" * size)
                await stream.receive_some(65536)

    port = await serve_raw(nursery, big_body)
    proxy = await start_proxy([port], timeouts=Timeouts(send=30.0))
    watch = Watch(proxy)
    with trio.fail_after(1000):
        stream = await open_tcp(proxy.port, rcvbuf=128 * 1024)
        async with stream:
            conn, request = h1_request_bytes(b"/download")
            start = trio.current_time()
            await stream.send_all(request)
            body = b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    await trio.sleep(1.0)  # the slow reader's pace
                    conn.receive_data(await stream.receive_some(65536))
                elif type(event) is h11.Data:
                    body += bytes(event.data)
                elif type(event) is h11.EndOfMessage:
                    break
            took = trio.current_time() - start
    assert len(body) == size
    assert took > 30.0
    assert not watch.times("send_timeout")

"""End-to-end streaming: real sockets, real Hypercorn fake backends, raw h11/h2 client peers.

What is asserted, each through the wire and through ``ProxyCore.statistics()``:

1. Per-chunk flush: one SSE event per HTTP/1.1 chunk / HTTP/2 DATA frame, each arriving when
   the backend sent it (not coalesced, not held); TCP_NODELAY on every socket of the proxy.
2. Many concurrent SSE streams on one HTTP/2 connection, each complete and in order.
3. Backpressure: a client that stops reading (h2: withholds one stream's WINDOW_UPDATEs;
   HTTP/1.1: stops reading its socket) stalls only its own stream, the proxy holds at most
   ``Limits.stream_buffer`` bytes for it (exactly once settled; in passing within framing
   overhead, see ``FRAMING_SLACK``) and pauses the backend connection.
4. Cancellation: an h2 RST_STREAM or a closed HTTP/1.1 connection reaches the backend within
   100 ms; the other streams of the connection go on.
5. Truncation: a backend dying mid-stream is an RST_STREAM(INTERNAL_ERROR) / a connection
   closed without the last chunk, never a clean end.
6. Request bodies stream: uploads larger than every buffer arrive intact, the proxy's request
   buffer stays bounded, and a backend that does not read stops the client's upload. One
   test pins that an HTTP/2 upload cannot overfill a ``stream_buffer`` smaller than
   2 x 64 KiB by a stream window: the proxy advertises a window that fits its slack.

No test synchronises on elapsed time: they wait on events and counters. Where a condition can
only be polled (proxy statistics) a short ``trio.sleep`` inside ``fail_after`` is the poll.
"""

from __future__ import annotations

import hashlib
import json
import random
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import h11
import pytest
import trio
import trio.testing
from peers import H1Peer, open_h2, open_tcp, socket_of

from muxproxy.config import Limits
from muxproxy.core.events import DataReceived
from muxproxy.core.statistics import StreamStatistics
from muxproxy.testing.fakellm import FakeLLM, serve_fakellm
from muxproxy.trio.reactor import SocketConn

if TYPE_CHECKING:
    from conftest import RunningProxy, StartBackend, StartProxy

CHAT = "/v1/chat/completions"
JSON = ("content-type", "application/json")
SMALL_BUFFER = 64 * 1024


def chat_body(**extra: Any) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    return json.dumps({**body, **extra}).encode()


def knobs(**values: object) -> list[tuple[str, str]]:
    """``knobs(tokens=5, die_after=2)`` -> ``[("x-fake-tokens", "5"), ...]``."""
    return [(f"x-fake-{name.replace('_', '-')}", str(value)) for name, value in values.items()]


# ---- SSE ---------------------------------------------------------------------------------


def sse_data(raw: bytes) -> list[str]:
    """The ``data:`` payloads of a stream of complete SSE events."""
    text = raw.decode()
    assert text == "" or text.endswith("\n\n"), f"incomplete SSE event at the end: {text[-80:]!r}"
    out = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        out.append(block[len("data: ") :])
    return out


def is_one_event(payload: bytes) -> bool:
    """Exactly one complete SSE event."""
    return (
        payload.startswith(b"data: ") and payload.endswith(b"\n\n") and payload.count(b"\n\n") == 1
    )


def token_contents(raw: bytes) -> list[str]:
    """The ``delta.content`` of every token chunk (not the finish chunk, not [DONE])."""
    out = []
    for data in sse_data(raw):
        if data == "[DONE]":
            continue
        choice = json.loads(data)["choices"][0]
        if choice["finish_reason"] is None:
            out.append(choice["delta"]["content"])
    return out


def tokens(n: int) -> list[str]:
    return [f"tok{i} " for i in range(n)]


def assert_complete_stream(raw: bytes, n: int) -> None:
    """Every token ``tok0..tok<n-1>`` in order, then the finish chunk, then ``[DONE]``."""
    data = sse_data(raw)
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["choices"][0]["finish_reason"] == "stop"
    assert token_contents(raw) == tokens(n)
    assert len(data) == n + 2


# ---- proxy state -------------------------------------------------------------------------


def stream_stats(proxy: RunningProxy, stream: int) -> StreamStatistics | None:
    """Statistics of client stream ``stream`` (tests here have one client connection)."""
    for entry in proxy.server.core.statistics().streams:
        if entry.stream == stream:
            return entry
    return None


async def wait_stats(
    proxy: RunningProxy, stream: int, predicate: Callable[[StreamStatistics], bool]
) -> StreamStatistics:
    """Poll the proxy's statistics until ``stream`` satisfies ``predicate`` (callers bound
    this with ``fail_after``)."""
    while True:
        entry = stream_stats(proxy, stream)
        if entry is not None and predicate(entry):
            return entry
        await trio.sleep(0.005)


# The proxy measures a stream's buffer in wire bytes (the request head it wrote upstream,
# chunk-size lines, 9-byte DATA frame headers, and for an HTTP/2 client the connection's whole
# unsent output) against a high-water mark derived from payload-sized reads, so the figure in
# ``statistics()`` can pass ``stream_buffer`` by framing overhead while a source is being
# stopped (seen: ~100 bytes on uploads, up to ~2 KiB on an h2 response with 64 KiB buffers;
# reported to the lead). Checks after *every* event allow this much; checks at quiescent points
# (everything written that could be) hold the exact limit.
FRAMING_SLACK = 4096


@attrs.define
class BufferWatch:
    """Every stream's buffered bytes, checked after *every* event the driver feeds the core."""

    limit: int
    events: int = 0
    peak_response: int = 0
    peak_request: int = 0
    paused_seen: bool = False
    violations: list[str] = attrs.field(factory=list)

    def check(self) -> None:
        assert self.events > 0
        assert not self.violations, self.violations[:5]


def watch_buffers(proxy: RunningProxy, limit: int) -> BufferWatch:
    """Wrap the driver's ``feed`` so each event is followed by a bound check (``limit`` plus
    ``FRAMING_SLACK``); peaks are recorded exactly.

    Must be installed before the connections to watch exist: the driver's reader and writer
    tasks look ``feed`` up once when they start.
    """
    driver = proxy.server.driver
    assert driver is not None
    core = proxy.server.core
    inner = driver.feed
    watch = BufferWatch(limit)
    bound = limit + FRAMING_SLACK

    def feed(event: Any) -> None:
        inner(event)
        watch.events += 1
        for entry in core.statistics().streams:
            watch.peak_response = max(watch.peak_response, entry.response_buffered)
            watch.peak_request = max(watch.peak_request, entry.request_buffered)
            watch.paused_seen = watch.paused_seen or entry.upstream_paused
            if entry.response_buffered > bound or entry.request_buffered > bound:
                watch.violations.append(f"after {type(event).__name__}: {entry}")

    driver.feed = feed  # type: ignore[method-assign]
    return watch


async def settle() -> None:
    """Wait until every task is blocked: on loopback nothing moves any more (the kernel
    delivers synchronously), so proxy statistics read now are a stable state, not a sample."""
    await trio.testing.wait_all_tasks_blocked()


def assert_nodelay_everywhere(proxy: RunningProxy, *, clients: int, upstreams: int) -> None:
    driver = proxy.server.driver
    assert driver is not None
    conns = list(driver.conns.values())
    assert sum(c.ident > 0 for c in conns) == clients, conns
    assert sum(c.ident < 0 for c in conns) == upstreams, conns
    for conn in conns:
        # Plain TCP connections live in the driver's reactor as bare sockets.
        sock = conn.sock if isinstance(conn, SocketConn) else socket_of(conn.stream)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY), f"conn {conn.ident}"


# ---- 1. per-chunk flush ------------------------------------------------------------------

FLUSH_TOKENS = 5
FLUSH_DELAY = 0.05


TIMED = ("x-timed", "1")


@attrs.define
class TimedBackend:
    """A FakeLLM that time-stamps its ASGI body ``send`` calls (when each SSE event left it)
    for the requests carrying the ``TIMED`` header."""

    fake: FakeLLM
    sent: list[float] = attrs.field(factory=list)

    async def app(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or (b"x-timed", b"1") not in scope["headers"]:
            await self.fake.app(scope, receive, send)
            return

        async def timed_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                self.sent.append(trio.current_time())
            await send(message)

        await self.fake.app(scope, receive, timed_send)


async def start_timed_backend(nursery: trio.Nursery, **options: Any) -> tuple[TimedBackend, int]:
    backend = TimedBackend(FakeLLM(**options))
    port = await nursery.start(serve_fakellm, backend)  # it only needs ``.app``
    return backend, port


def assert_flushed_one_by_one(sent: list[float], arrived: list[float], n: int) -> None:
    """Each of the ``n`` token events reached the client before the backend sent the next
    one: nothing was coalesced with a later event or held back. (The backend sends on an
    absolute schedule, so comparing with its send times, not inter-arrival gaps, keeps this
    exact under scheduling jitter.)"""
    assert len(sent) >= n and len(arrived) >= n
    for i in range(n - 1):
        assert arrived[i] < sent[i + 1], (
            f"token {i} arrived {arrived[i] - sent[i]:.3f}s after it was sent, after token "
            f"{i + 1} was sent ({sent[i + 1] - sent[i]:.3f}s later): sent {sent}, "
            f"arrived {arrived}"
        )


async def test_per_chunk_flush_http11(nursery: trio.Nursery, start_proxy: StartProxy) -> None:
    backend, port = await start_timed_backend(nursery, tokens=FLUSH_TOKENS, delay=FLUSH_DELAY)
    proxy = await start_proxy([port])
    with trio.fail_after(5):
        peer = await H1Peer.connect(proxy.port)
        await peer.send_request("POST", CHAT, [JSON, TIMED], chat_body())
        checked = []

        def on_data(piece: Any) -> None:
            if not checked:  # mid-stream: the client and the backend socket both exist
                assert_nodelay_everywhere(proxy, clients=1, upstreams=1)
                checked.append(True)

        response = await peer.read_response(on_data)
        await peer.aclose()
    assert checked
    assert response.status == 200 and response.complete
    assert response.header("transfer-encoding") == "chunked"
    chunks = response.chunks()
    # tokens, the finish chunk, [DONE]: one SSE event per chunk, nothing merged.
    assert len(chunks) == FLUSH_TOKENS + 2
    assert all(is_one_event(payload) for _, payload in chunks), chunks
    assert_complete_stream(response.body, FLUSH_TOKENS)
    assert_flushed_one_by_one(backend.sent, [at for at, _ in chunks], FLUSH_TOKENS)


async def test_per_chunk_flush_http2(nursery: trio.Nursery, start_proxy: StartProxy) -> None:
    backend, port = await start_timed_backend(nursery, tokens=FLUSH_TOKENS, delay=FLUSH_DELAY)
    proxy = await start_proxy([port])
    with trio.fail_after(5):
        async with open_h2(proxy.port) as peer:
            sid = await peer.request("POST", CHAT, [JSON, TIMED], chat_body())
            state = peer.streams[sid]
            await peer.wait_until(lambda: len(state.frames) >= 1)
            assert_nodelay_everywhere(proxy, clients=1, upstreams=1)
            await peer.wait_done(sid)
    assert state.ended and state.reset is None and state.status == 200
    frames = state.data_frames  # not the empty DATA frame that may carry END_STREAM
    # One SSE event per DATA frame, nothing merged.
    assert len(frames) == FLUSH_TOKENS + 2
    assert all(is_one_event(f.data) for f in frames), [f.data for f in frames]
    assert_complete_stream(state.body, FLUSH_TOKENS)
    assert_flushed_one_by_one(backend.sent, [f.at for f in frames], FLUSH_TOKENS)


# Which sockets wait for which: backends played by the test on plain sockets, so that several
# of them become readable in one round of the proxy's reactor.

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
EVENT = b"data: tok\n\n"
EVENT_CHUNK = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)
H2_GET = [(":method", "GET"), (":scheme", "http"), (":authority", "x"), (":path", "/sse")]


async def read_until(sock: socket.socket, marker: bytes) -> bytes:
    buf = b""
    while marker not in buf:
        await trio.lowlevel.wait_readable(sock)
        buf += sock.recv(65536)
    return buf


def peek(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return b""


@attrs.define
class RawBackends:
    """A listener the proxy connects to, the backends accepted from it, and a spy on the
    proxy's core that notes, at each read of a backend, the bytes waiting at each client."""

    listener: socket.socket
    clients: list[socket.socket] = attrs.field(factory=list)
    backends: list[socket.socket] = attrs.field(factory=list)
    waiting: list[list[int]] = attrs.field(factory=list)
    rounds: list[int] = attrs.field(factory=list)

    @classmethod
    def listen(cls) -> RawBackends:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        return cls(listener)

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    def connect_client(self, proxy: RunningProxy) -> socket.socket:
        client = socket.create_connection(("127.0.0.1", proxy.port))
        client.setblocking(False)
        self.clients.append(client)
        return client

    async def accept(self) -> None:
        """Take the proxy's next backend connection, read its request, answer an SSE head."""
        await trio.lowlevel.wait_readable(self.listener)
        backend, _ = self.listener.accept()
        backend.setblocking(False)
        self.backends.append(backend)
        await read_until(backend, b"\r\n\r\n")
        backend.send(SSE_HEAD)

    def send_one_event_each(self) -> None:
        # No checkpoint between the sends: the proxy finds every backend ready at once.
        for backend in self.backends:
            backend.send(EVENT_CHUNK)

    def spy_on(self, proxy: RunningProxy) -> Callable[[], None]:
        """Start noting (``waiting``, and the reactor's round of each read in ``rounds``);
        returns the undo."""
        driver = proxy.server.driver
        assert driver is not None
        feed = driver.feed
        reactor = driver.reactor
        assert reactor is not None

        def spy(event: Any) -> None:
            if type(event) is DataReceived and event.conn < 0:
                self.waiting.append([len(peek(c)) for c in self.clients])
                self.rounds.append(reactor._round)
            feed(event)

        driver.feed = spy  # type: ignore[method-assign]  # the reactor feeds the core through it
        return lambda: setattr(driver, "feed", feed)

    def close(self) -> None:
        for sock in [*self.clients, *self.backends, self.listener]:
            sock.close()


async def test_a_token_is_written_before_the_next_socket_is_read(
    start_proxy: StartProxy,
) -> None:
    """Two HTTP/1.1 clients, their backends readable together (one round of the reactor): the
    token of the one read first is already at its client when the proxy reads the other. A
    token does not wait for the other streams' work of the round."""
    raw = RawBackends.listen()
    proxy = await start_proxy([raw.port])
    try:
        with trio.fail_after(5):
            for _ in range(2):
                client = raw.connect_client(proxy)
                client.send(b"GET /sse HTTP/1.1\r\nhost: x\r\n\r\n")
                await raw.accept()
                await read_until(client, b"\r\n\r\n")
            undo = raw.spy_on(proxy)
            raw.send_one_event_each()
            for client in raw.clients:
                assert await read_until(client, b"tok") == EVENT_CHUNK
            undo()
    finally:
        raw.close()
    assert len(raw.waiting) == 2, raw.waiting
    assert raw.waiting[0] == [0, 0]
    assert sorted(raw.waiting[1]) == [0, len(EVENT_CHUNK)], raw.waiting


async def test_the_tokens_of_an_http2_clients_streams_in_one_round_share_a_send(
    start_proxy: StartProxy,
) -> None:
    """Three streams of one HTTP/2 client, their backends readable together: the connection is
    fed by several sockets, so what the round queues for it goes out at the end of the round,
    in one send. (The first read of the round may be written at once, if the same backend fed
    the connection last; the reads after it are not.)"""
    raw = RawBackends.listen()
    proxy = await start_proxy([raw.port])
    h2conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    h2conn.initiate_connection()

    async def receive_data_frames(n: int) -> list[bytes]:
        frames: list[bytes] = []
        while len(frames) < n:
            await trio.lowlevel.wait_readable(client)
            for event in h2conn.receive_data(client.recv(65536)):
                if isinstance(event, h2.events.DataReceived):
                    frames.append(event.data)
            client.send(h2conn.data_to_send())
        return frames

    try:
        with trio.fail_after(5):
            client = raw.connect_client(proxy)
            for stream in (1, 3, 5):
                h2conn.send_headers(stream, H2_GET, end_stream=True)
            client.send(h2conn.data_to_send())
            for _ in range(3):
                await raw.accept()
            raw.send_one_event_each()  # a first round: each backend has fed the connection
            assert await receive_data_frames(3) == [EVENT] * 3
            undo = raw.spy_on(proxy)
            # The three reads must fall in one round; a loaded kernel may deliver one late.
            for _ in range(5):
                await trio.testing.wait_all_tasks_blocked()
                raw.waiting.clear()
                raw.rounds.clear()
                raw.send_one_event_each()
                assert await receive_data_frames(3) == [EVENT] * 3
                if len(set(raw.rounds)) == 1:
                    break
            undo()
    finally:
        raw.close()
    assert len(raw.waiting) == 3 and len(set(raw.rounds)) == 1, (raw.waiting, raw.rounds)
    assert raw.waiting[2] == raw.waiting[1], raw.waiting


# ---- 2. many streams on one HTTP/2 connection --------------------------------------------


async def test_many_concurrent_streams_on_one_h2_connection(
    start_backend: StartBackend, start_proxy: StartProxy
) -> None:
    n, n_tokens = 120, 8
    # A first delay keeps every stream open until all of them have been opened.
    fake, port = await start_backend(tokens=n_tokens, delay=0.01, first_delay=0.3)
    proxy = await start_proxy([port], limits=Limits(max_concurrent_streams=128))
    core = proxy.server.core
    driver = proxy.server.driver
    assert driver is not None
    peak = [0]
    inner = driver.feed

    def feed(event: Any) -> None:
        inner(event)
        peak[0] = max(peak[0], len(core.exchanges))

    driver.feed = feed  # type: ignore[method-assign]
    with trio.fail_after(15):
        async with open_h2(proxy.port) as peer:
            assert peer.conn.remote_settings.max_concurrent_streams == 128
            sids = [
                await peer.request("POST", CHAT, [JSON], chat_body(), flush=False) for _ in range(n)
            ]
            await peer.flush()  # all the requests in one write
            await peer.wait_until(lambda: all(peer.streams[s].done for s in sids))
            stats = core.statistics()
    assert peak[0] == n, "the streams did not all run at once"
    assert stats.client_connections == 1
    for sid in sids:
        state = peer.streams[sid]
        assert state.ended and state.reset is None and state.status == 200, sid
        assert_complete_stream(state.body, n_tokens)
    assert fake.streams_completed == n


# ---- 3. backpressure ---------------------------------------------------------------------

BIG_TOKENS = 1500  # ~190 bytes an event: ~280 KiB, far beyond window + stream buffer


async def test_backpressure_h2_one_stalled_stream(
    nursery: trio.Nursery, start_proxy: StartProxy
) -> None:
    backend, port = await start_timed_backend(nursery, delay=0.0)
    fake = backend.fake
    proxy = await start_proxy([port], limits=Limits(stream_buffer=SMALL_BUFFER))
    watch = watch_buffers(proxy, SMALL_BUFFER)
    n_fast, fast_delay = 8, 0.03
    with trio.fail_after(15):
        # A big connection window: the stalled stream keeps its own 64 KiB stream window
        # unacknowledged and must not take the connection's window from the others.
        async with open_h2(proxy.port, connection_window=16 * 1024 * 1024) as peer:
            stalled = await peer.request(
                "POST", CHAT, [JSON, *knobs(tokens=BIG_TOKENS)], chat_body(), hold=True
            )
            # Its window closes, then the proxy's buffer for it fills and it pauses the backend.
            await peer.wait_until(lambda: peer.conn.remote_flow_control_window(stalled) == 0)
            await wait_stats(proxy, stalled, lambda s: s.upstream_paused)
            received_while_stalled = len(peer.streams[stalled].body)
            assert received_while_stalled <= 65535

            # Another stream on the same connection flows, token by token, on time.
            fast = await peer.request(
                "POST", CHAT, [JSON, TIMED, *knobs(tokens=n_fast, delay=fast_delay)], chat_body()
            )
            state = await peer.wait_done(fast)
            assert state.ended
            assert_complete_stream(state.body, n_fast)
            token_frames = state.data_frames[:n_fast]
            assert all(is_one_event(f.data) for f in token_frames)
            assert_flushed_one_by_one(backend.sent, [f.at for f in token_frames], n_fast)

            # Meanwhile the stalled stream stayed stalled and bounded.
            await settle()
            entry = stream_stats(proxy, stalled)
            assert entry is not None and entry.upstream_paused
            assert entry.response_buffered <= SMALL_BUFFER
            assert len(peer.streams[stalled].body) == received_while_stalled
            assert not peer.streams[stalled].done

            # Resume reading: the stalled stream completes intact.
            await peer.release(stalled)
            big = await peer.wait_done(stalled)
    assert big.ended and big.reset is None
    assert_complete_stream(big.body, BIG_TOKENS)
    assert fake.streams_completed == 2
    assert watch.paused_seen
    watch.check()


async def test_backpressure_http11_client_stops_reading(
    start_backend: StartBackend, start_proxy: StartProxy
) -> None:
    _fake, port = await start_backend(delay=0.0)
    proxy = await start_proxy([port], limits=Limits(stream_buffer=SMALL_BUFFER))
    watch = watch_buffers(proxy, SMALL_BUFFER)
    with trio.fail_after(15):
        # A small receive buffer: the kernel stops taking bytes after a few KiB, so the
        # proxy's own buffer is what fills up.
        peer = await H1Peer.connect(proxy.port, rcvbuf=8192)
        await peer.send_request("POST", CHAT, [JSON, *knobs(tokens=BIG_TOKENS)], chat_body())
        # Not reading at all: the proxy must pause the backend and hold a bounded amount.
        await wait_stats(proxy, 1, lambda s: s.upstream_paused)
        await settle()
        entry = stream_stats(proxy, 1)
        assert entry is not None and entry.upstream_paused
        assert entry.response_buffered <= SMALL_BUFFER
        assert peer.reads == 0
        response = await peer.read_response()
        await peer.aclose()
    assert response.status == 200 and response.complete
    assert_complete_stream(response.body, BIG_TOKENS)
    watch.check()


# ---- 4. cancellation ---------------------------------------------------------------------


async def test_h2_reset_reaches_backend_and_other_streams_continue(
    start_backend: StartBackend, start_proxy: StartProxy
) -> None:
    fake, port = await start_backend(delay=0.02)
    proxy = await start_proxy([port])
    with trio.fail_after(10):
        async with open_h2(proxy.port) as peer:
            doomed = await peer.request("POST", CHAT, [JSON, *knobs(tokens=500)], chat_body())
            other = await peer.request(
                "POST", CHAT, [JSON, *knobs(tokens=10, delay=0.03)], chat_body()
            )
            await peer.wait_until(
                lambda: (
                    len(peer.streams[doomed].frames) >= 2 and len(peer.streams[other].frames) >= 1
                )
            )
            with trio.fail_after(0.1):  # from sending RST_STREAM to the backend noticing
                await peer.reset(doomed, h2.errors.ErrorCodes.CANCEL)
                await fake.wait_disconnect(1)
            state = await peer.wait_done(other)
            assert stream_stats(proxy, doomed) is None
    assert state.ended
    assert_complete_stream(state.body, 10)
    assert fake.disconnects == 1
    assert fake.streams_completed == 1


async def test_http11_close_reaches_backend(
    start_backend: StartBackend, start_proxy: StartProxy
) -> None:
    fake, port = await start_backend(delay=0.02)
    proxy = await start_proxy([port])
    with trio.fail_after(10):
        peer = await H1Peer.connect(proxy.port)
        await peer.send_request("POST", CHAT, [JSON, *knobs(tokens=500)], chat_body())
        seen = 0
        while seen < 2:
            _, event = await peer.next_event()
            seen += isinstance(event, h11.Data)
        with trio.fail_after(0.1):  # from closing the socket to the backend noticing
            await peer.aclose()
            await fake.wait_disconnect(1)
        # The proxy forgets the exchange and the backend connection.
        while proxy.server.core.statistics().streams:
            await trio.sleep(0.005)
    assert fake.disconnects == 1
    assert fake.streams_completed == 0


# ---- 5. truncation -----------------------------------------------------------------------


async def test_truncation_h2_is_a_reset(
    start_backend: StartBackend, start_proxy: StartProxy
) -> None:
    fake, port = await start_backend(tokens=10, delay=0.005)
    proxy = await start_proxy([port])
    with trio.fail_after(5):
        async with open_h2(proxy.port) as peer:
            dying = await peer.request("POST", CHAT, [JSON, *knobs(die_after=3)], chat_body())
            healthy = await peer.request("POST", CHAT, [JSON], chat_body())
            state = await peer.wait_done(dying)
            other = await peer.wait_done(healthy)
    assert state.status == 200
    assert state.reset == h2.errors.ErrorCodes.INTERNAL_ERROR
    assert not state.ended
    assert token_contents(state.body) == tokens(3)
    assert b"[DONE]" not in state.body
    assert other.ended
    assert_complete_stream(other.body, 10)
    assert fake.aborts == 1


async def test_truncation_http11_closes_without_last_chunk(
    start_backend: StartBackend, start_proxy: StartProxy
) -> None:
    fake, port = await start_backend(tokens=10, delay=0.005)
    proxy = await start_proxy([port])
    with trio.fail_after(5):
        peer = await H1Peer.connect(proxy.port)
        await peer.send_request("POST", CHAT, [JSON, *knobs(die_after=3)], chat_body())
        response = await peer.read_response()
        await peer.aclose()
    assert response.status == 200
    assert not response.complete  # never an EndOfMessage
    assert response.error is not None  # h11: peer closed inside the chunked body
    assert token_contents(response.body) == tokens(3)
    assert b"[DONE]" not in response.body
    assert fake.aborts == 1


# ---- 6. request bodies -------------------------------------------------------------------

UPLOAD = random.Random(1234).randbytes(4 * 1024 * 1024)
UPLOAD_DIGEST = {"received_bytes": len(UPLOAD), "sha256": hashlib.sha256(UPLOAD).hexdigest()}


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
async def test_upload_http11_streams_to_backend(
    start_backend: StartBackend, start_proxy: StartProxy, framing: str
) -> None:
    _fake, port = await start_backend()
    proxy = await start_proxy([port], limits=Limits(stream_buffer=SMALL_BUFFER))
    watch = watch_buffers(proxy, SMALL_BUFFER)
    with trio.fail_after(10):
        peer = await H1Peer.connect(proxy.port)
        await peer.send_request(
            "POST", "/upload", [("x-fake-sink", "1")], UPLOAD, chunked=framing == "chunked"
        )
        response = await peer.read_response()
        await peer.aclose()
    assert response.status == 200 and response.complete
    assert json.loads(response.body) == UPLOAD_DIGEST
    watch.check()
    assert watch.peak_request > 0


async def test_upload_h2_streams_to_backend(
    start_backend: StartBackend, start_proxy: StartProxy
) -> None:
    _fake, port = await start_backend()
    proxy = await start_proxy([port], limits=Limits(stream_buffer=SMALL_BUFFER))
    watch = watch_buffers(proxy, SMALL_BUFFER)
    with trio.fail_after(10):
        async with open_h2(proxy.port) as peer:
            sid = await peer.request("POST", "/upload", [("x-fake-sink", "1")], UPLOAD)
            state = await peer.wait_done(sid)
    assert state.ended and state.status == 200
    assert json.loads(state.body) == UPLOAD_DIGEST
    watch.check()
    assert watch.peak_request > 0


# A backend that reads only what the test allows: the one way to see upload backpressure,
# since Hypercorn reads request bodies greedily.


@attrs.define
class GatedSink:
    port: int
    budget: float = 0
    """Bytes its connections may still read (``inf``: no limit)."""
    _changed: trio.Event = attrs.field(factory=trio.Event)

    def allow(self, nbytes: float) -> None:
        self.budget += nbytes
        self._changed.set()
        self._changed = trio.Event()

    def open(self) -> None:
        self.allow(float("inf"))

    async def receive(self, stream: trio.SocketStream) -> bytes:
        while self.budget <= 0:
            await self._changed.wait()
        data = await stream.receive_some(int(min(self.budget, 65536)))
        self.budget -= len(data)
        return data


async def serve_gated_sink(*, task_status: trio.TaskStatus[GatedSink]) -> None:
    """An HTTP/1.1 backend that reads no more bytes than ``sink.allow`` grants, then answers
    each request with ``{"received_bytes", "sha256"}`` and closes. Its sockets have a small
    receive buffer (inherited from the listener), so unread bytes back up quickly."""
    listener = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    await listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    sink = GatedSink(port=listener.getsockname()[1])

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            conn = h11.Connection(h11.SERVER)
            digest = hashlib.sha256()
            size = 0
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await sink.receive(stream))
                elif isinstance(event, h11.Data):
                    digest.update(event.data)
                    size += len(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    break
            body = json.dumps({"received_bytes": size, "sha256": digest.hexdigest()}).encode()
            head = h11.Response(
                status_code=200,
                headers=[
                    ("content-type", "application/json"),
                    ("content-length", str(len(body))),
                    ("connection", "close"),
                ],
            )
            out = conn.send(head) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
            await stream.send_all(out)

    async with trio.open_nursery() as nursery:
        task_status.started(sink)
        with listener:
            while True:
                sock, _ = await listener.accept()
                nursery.start_soon(handle, trio.SocketStream(sock))


async def test_upload_backpressure_h2_slow_backend(
    nursery: trio.Nursery, start_proxy: StartProxy
) -> None:
    sink: GatedSink = await nursery.start(serve_gated_sink)
    proxy = await start_proxy([sink.port], limits=Limits(stream_buffer=SMALL_BUFFER))
    watch = watch_buffers(proxy, SMALL_BUFFER)
    with trio.fail_after(10):
        async with open_h2(proxy.port) as peer, trio.open_nursery() as uploading:
            sid = await peer.request("POST", "/upload", end_stream=False)
            done = trio.Event()

            async def upload() -> None:
                await peer.send_body(sid, UPLOAD)
                done.set()

            uploading.start_soon(upload)
            # The backend reads nothing: the proxy fills to its high-water mark and withholds
            # WINDOW_UPDATEs, so the client's window closes and its upload stops. (The figure
            # can drop back below high water once the kernel takes a write that was in flight;
            # the source stays stopped until low water, so poll for the window, not the peak.)
            await peer.wait_until(lambda: peer.conn.local_flow_control_window(sid) == 0)
            await settle()
            assert not done.is_set()
            assert peer.conn.local_flow_control_window(sid) == 0
            entry = stream_stats(proxy, sid)
            assert entry is not None and entry.request_buffered <= SMALL_BUFFER + FRAMING_SLACK
            # Let the backend read: everything arrives, intact.
            sink.open()
            state = await peer.wait_done(sid)
            await done.wait()
    assert state.ended and state.status == 200
    assert json.loads(state.body) == UPLOAD_DIGEST
    watch.check()


async def test_upload_backpressure_http11_slow_backend(
    nursery: trio.Nursery, start_proxy: StartProxy
) -> None:
    sink: GatedSink = await nursery.start(serve_gated_sink)
    proxy = await start_proxy([sink.port], limits=Limits(stream_buffer=SMALL_BUFFER))
    watch = watch_buffers(proxy, SMALL_BUFFER)
    high_water = proxy.server.core.limits.high_water
    driver = proxy.server.driver
    assert driver is not None
    with trio.fail_after(10):
        stream = await open_tcp(proxy.port)
        # A small send buffer (no autotuning): unread bytes back up into the client at once.
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        peer = H1Peer(stream)
        async with trio.open_nursery() as uploading:
            done = trio.Event()

            async def upload() -> None:
                await peer.send_request("POST", "/upload", [], UPLOAD, chunked=True)
                done.set()

            uploading.start_soon(upload)
            # The proxy stops reading the client once the stream's buffer reaches high water
            # (it may fall back a little as the kernel takes part of a write to the backend:
            # the source stays stopped until low water).
            await wait_stats(proxy, 1, lambda s: s.request_buffered > 0)
            while not any(c.paused for c in driver.conns.values() if c.ident > 0):
                await trio.sleep(0.005)
            await settle()
            # The proxy stopped reading the client; the client's upload is stuck.
            client_conns = [c for c in driver.conns.values() if c.ident > 0]
            assert len(client_conns) == 1 and client_conns[0].paused
            entry = stream_stats(proxy, 1)
            assert entry is not None and entry.request_buffered > high_water // 2
            assert not done.is_set()
            entry = stream_stats(proxy, 1)
            assert entry is not None and entry.request_buffered <= SMALL_BUFFER + FRAMING_SLACK
            sink.open()
            response = await peer.read_response()
            await done.wait()
        await peer.aclose()
    assert response.status == 200 and response.complete
    assert json.loads(response.body) == UPLOAD_DIGEST
    watch.check()


async def test_upload_h2_window_never_overfills_stream_buffer(
    nursery: trio.Nursery, start_proxy: StartProxy
) -> None:
    """Deterministic: with the backend reading nothing, put the proxy just under its
    high-water mark (it is not paused, so it acknowledges everything it received), then send
    all the window it granted. The proxy must then hold at most ``stream_buffer`` bytes."""
    buffer = 32 * 1024
    sink: GatedSink = await nursery.start(serve_gated_sink)
    proxy = await start_proxy([sink.port], limits=Limits(stream_buffer=buffer))
    high_water = proxy.server.core.limits.high_water

    async def buffered(sid: int) -> int:
        await settle()
        entry = stream_stats(proxy, sid)
        assert entry is not None
        return entry.request_buffered

    with trio.fail_after(10):
        async with open_h2(proxy.port) as peer:
            sid = await peer.request("POST", "/upload", end_stream=False)
            sent = 0
            # 1. Fill the path to the backend until the proxy itself holds bytes.
            while (held := await buffered(sid)) == 0:
                await peer.send_body(sid, UPLOAD[sent : sent + 4096], end_stream=False)
                sent += 4096
            # 2. Top it up to just under the high-water mark (64 bytes for chunk framing).
            top_up = high_water - 64 - held
            if top_up > 0:
                await peer.send_body(sid, UPLOAD[sent : sent + top_up], end_stream=False)
                sent += top_up
            held = await buffered(sid)
            assert held < high_water
            # 3. Send every byte of window the proxy granted.
            window = peer.conn.local_flow_control_window(sid)
            await peer.send_body(sid, UPLOAD[sent : sent + window], end_stream=False)
            sent += window
            after = await buffered(sid)
            assert after <= buffer, (
                f"proxy holds {after} bytes of a {buffer}-byte stream buffer: it held {held} "
                f"(high water {high_water}) and had granted a {window}-byte window"
            )
            # The rest of the upload, with a backend that reads.
            sink.open()
            await peer.send_body(sid, UPLOAD[sent:])
            state = await peer.wait_done(sid)
    assert state.ended and state.status == 200
    assert json.loads(state.body) == UPLOAD_DIGEST

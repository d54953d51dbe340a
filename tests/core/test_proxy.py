"""The whole proxy driven with bytes only: real h11/h2 peers on both sides, no sockets."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Sequence
from typing import Any

import attrs
import h2.errors
import h2.events
import h2.settings
import h11
import pytest
from checks import (
    Check,
    both,
    h1_body,
    h1_request,
    h1_response,
    h2_body,
    h2_ended,
    h2_resets,
    h2_response,
    on_stream,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from playbook import (
    BACKEND,
    H1BackendPeer,
    H1ClientPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    Where,
    accepted,
    closed,
    data,
    default_config,
    open_failed,
    opened,
    sent,
    subset,
    wakeup,
)

from muxproxy.config import Limits, Timeouts, parse_config
from muxproxy.config.ranges import RANGES
from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    Log,
    OpenConnection,
    Origin,
    PauseReading,
    ResumeReading,
    SendData,
    SetTimer,
)
from muxproxy.core.events import ConfigChanged, InputEnded

ROOT = pathlib.Path(__file__).resolve().parents[2] / "muxproxy"
FORBIDDEN = {"trio", "asyncio", "socket", "ssl", "select", "selectors", "time"}
ORIGIN = Origin(host="127.0.0.1", port=9001)
SSE_EVENTS = [f'data: {{"token": {i}}}\n\n'.encode() for i in range(5)]


@pytest.mark.parametrize("package", ["core", "routing"])
def test_core_is_sans_io(package: str) -> None:
    files = sorted((ROOT / package).glob("*.py"))
    assert files
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"


def _start_h1(pb: Playbook, request: bytes) -> tuple[int, H1BackendPeer]:
    """Client request in; returns the backend connection id and the backend peer."""
    pb.accept(1)
    pb.receive(1, request)
    (open_cmd,) = pb.opens()
    assert str(open_cmd.origin) == BACKEND
    backend = H1BackendPeer()
    pb.opened(open_cmd.conn)
    return open_cmd.conn, backend


def _h1_asks(pb: Playbook, request: bytes, *, body: bool = False, connect: float = 5.0) -> None:
    """Client connection 1 (accepted here) sends ``request``: the proxy connects to the
    backend (connection -1); ``body``: the request has a body, whose timer is armed."""
    pb.accept(1)
    pb >> data(1, request)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=connect)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    if body:
        pb << SetTimer(timer=("body", 1), at=30.0)


def _h2_asks(
    pb: Playbook,
    client: H2ClientPeer,
    method: bytes = b"GET",
    path: bytes = b"/v1/models",
    **request: Any,
) -> int:
    """Client connection 1 (accepted here) opens HTTP/2 and sends one request: the proxy
    answers the preface with its SETTINGS and their ack, then connects to the backend
    (connection -1). Returns the stream id."""
    pb.accept(1)
    pb >> data(1, client.preface())
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, _settings)
    sid, payload = client.request(method, path, **request)
    pb >> data(1, payload)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    if request.get("body") is not None:
        pb << SetTimer(timer=("body", 1), at=30.0)
    return sid


def _settings(events: Sequence[Any]) -> None:
    """The proxy's SETTINGS, and nothing for any stream."""
    assert any(isinstance(e, h2.events.RemoteSettingsChanged) for e in events), events
    assert not [e for e in events if getattr(e, "stream_id", 0)], events


def _forwarded(
    pb: Playbook, backend: H1BackendPeer, check: Check | None = None, *, head: float = 60.0
) -> Sends:
    """Backend connection -1 opens: the request goes out on it (``check`` on what the
    backend decoded) and the response-head timer is armed."""
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << (request := Sends(-1, backend, check or h1_request()))
    pb << SetTimer(timer=("head", 1), at=head)
    return request


def _served_ok(pb: Playbook, conn: int, client: H1ClientPeer, backend: H1BackendPeer) -> None:
    """Backend connection -1 answers ``200 ok`` (Content-Length: 2), relayed to client
    connection ``conn`` (exchange ``conn``); the backend connection goes back to the pool."""
    response = backend.conn.send(h11.Response(status_code=200, headers=[("Content-Length", "2")]))
    pb >> data(-1, (response or b"") + backend.chunk(b"ok") + backend.end())
    pb << CancelTimer(timer=("head", conn))
    pb << SetTimer(timer=("send", conn), at=60.0)
    pb << Sends(conn, client, h1_response(200))
    pb << SetTimer(timer=("read", conn), at=300.0)
    pb << Sends(conn, client, both(lambda e: h1_body(e) == b"ok", _ends))
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", conn))
    pb << SetTimer(timer=("idle", conn), at=75.0)


def _ends(events: Sequence[Any]) -> None:
    assert isinstance(events[-1], h11.EndOfMessage), events


def _not_ended(events: Sequence[Any]) -> None:
    assert not any(isinstance(e, h2.events.StreamEnded) for e in events), events


def _served_204(pb: Playbook, client: H1ClientPeer, backend: H1BackendPeer) -> None:
    """Client connection 1's request, answered ``204`` by backend connection -1, which goes
    back to the pool for ``pool_idle_timeout``."""
    _h1_asks(pb, client.request())
    _forwarded(pb, backend)
    response = backend.conn.send(h11.Response(status_code=204, headers=[]))
    pb >> data(-1, (response or b"") + backend.end())
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(204, end=True))
    pb << SetTimer(timer=("read", 1), at=300.0)
    idle = pb.core.config.upstreams["default"].pool_idle_timeout
    pb << SetTimer(timer=("pool", -1), at=idle)
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)


@pytest.mark.parametrize("split", [0, 1])
def test_h1_client_sse_stream_is_relayed_chunk_by_chunk(split: int) -> None:
    pb = Playbook(split=split, ignore=())
    client = H1ClientPeer()
    body = b'{"stream": true}'
    _h1_asks(
        pb, client.request("POST", "/v1/chat/completions", [("Cookie", "a=1")], body), body=True
    )
    backend = H1BackendPeer()

    def forwarded(events: Sequence[Any]) -> None:
        h1_request(b"POST", b"/v1/chat/completions", body)(events)
        headers = dict(events[0].headers)
        assert headers[b"host"] == b"proxy.example"
        assert headers[b"x-forwarded-for"] == b"10.0.0.7"
        assert headers[b"via"] == b"1.1 muxproxy"

    _forwarded(pb, backend, forwarded)
    pb >> data(-1, backend.sse_head())
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(200, headers={b"x-accel-buffering": b"no"}))
    pb << SetTimer(timer=("read", 1), at=300.0)
    for event in SSE_EVENTS:

        def relayed(decoded: Sequence[Any], event: bytes = event) -> None:
            assert h1_body(decoded) == event
            if not split:
                assert len(decoded) == 1

        # Per-chunk flush: what arrives leaves in the very call that brought it.
        pb >> data(-1, backend.chunk(event))
        pb << Sends(1, client, relayed)
    pb >> data(-1, backend.end())
    pb << Sends(1, client, lambda events: isinstance(events[-1], h11.EndOfMessage))
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    pb << Log(event="access", fields=subset({"status": 200, "outcome": "ok"}))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()


@pytest.mark.parametrize("split", [0, 1, 7])
def test_h2_client_streams_are_relayed_per_data_frame(split: int) -> None:
    pb = Playbook(split=split)
    client = H2ClientPeer()
    cookies = [(b"cookie", b"a=1"), (b"cookie", b"b=2")]
    sid = _h2_asks(pb, client, b"POST", b"/v1/chat/completions", headers=cookies, body=b"{}")
    backend = H1BackendPeer()

    def forwarded(events: Sequence[Any]) -> None:
        headers = dict(events[0].headers)
        # RFC 9113 §8.2.3: cookies arrive joined for HTTP/1.1.
        assert headers[b"cookie"] == b"a=1; b=2"
        assert headers[b"host"] == b"proxy.example"
        assert headers[b"via"] == b"2 muxproxy"

    _forwarded(pb, backend, both(h1_request(b"POST"), forwarded))
    pb >> data(-1, backend.sse_head())
    pb << CancelTimer(timer=("head", 1))
    pb << Sends(1, client, h2_response(sid, 200))
    pb << SetTimer(timer=("read", 1), at=300.0)
    for chunk in SSE_EVENTS:

        def relayed(events: Sequence[Any], chunk: bytes = chunk) -> None:
            frames = [e.data for e in events if isinstance(e, h2.events.DataReceived)]
            assert b"".join(frames) == chunk
            if not split:
                assert len(frames) == 1

        pb >> data(-1, backend.chunk(chunk))
        pb << Sends(1, client, relayed)
    pb >> data(-1, backend.end())
    pb << Sends(1, client, h2_ended(sid))
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()


def test_plain_listener_tells_h1_from_h2_by_the_preface_byte_by_byte() -> None:
    pb = Playbook(split=1)
    pb.accept(1)
    client = H2ClientPeer()
    _, request = client.request()
    pb >> data(1, client.preface() + request)
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, _settings)  # SETTINGS and their ack: it speaks HTTP/2
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)  # the request was parsed as HTTP/2
    pb.done()


def test_tls_alpn_h2_needs_no_sniffing() -> None:
    pb = Playbook()
    client = H2ClientPeer()
    # The server preface (SETTINGS) goes out at once, before any client byte.
    pb >> accepted(1, tls=True, alpn="h2")
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, _settings)
    pb << SetTimer(timer=("header", 1), at=30.0)
    _, request = client.request()
    pb >> data(1, client.preface() + request)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb << Sends(1, client)  # the ack of the client's SETTINGS
    pb.done()


def test_backend_pool_reuses_the_kept_alive_connection() -> None:
    pb = Playbook()
    client = H1ClientPeer()
    backend = H1BackendPeer()
    _h1_asks(pb, client.request())
    _forwarded(pb, backend)
    _served_ok(pb, 1, client, backend)
    client.conn.start_next_cycle()
    backend.conn.start_next_cycle()
    pb >> data(1, client.request())
    pb << CancelTimer(timer=("idle", 1))
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << CancelTimer(timer=("pool", -1))  # no new connection: the pooled one carries it
    pb << CancelTimer(timer=("connect", 2))
    pb << Sends(-1, backend, h1_request(b"GET"))
    pb << SetTimer(timer=("head", 2), at=60.0)
    pb.done()
    assert pb.core.statistics().upstream_connections == 1


def test_slow_h1_client_pauses_the_backend_and_resumes_it() -> None:
    limits = Limits(stream_buffer=64 * 1024)
    pb = Playbook(default_config(limits=limits))
    client = H1ClientPeer()
    up, backend = _start_h1(pb, client.request())
    backend.events(pb.take(up))
    pb.receive(up, backend.sse_head())
    chunk = b"data: " + b"x" * 4000 + b"\n\n"
    framed = backend.chunk(chunk)
    paused_at = None
    for i in range(40):
        pb >> data(up, framed)
        pb << SendData(conn=1, data=framed)  # h11 frames it as the backend did
        if pb.queue == [PauseReading(conn=up)]:
            pb << PauseReading(conn=up)
            paused_at = i
            break
    assert paused_at is not None
    (stats,) = pb.core.statistics().streams
    assert stats.upstream_paused
    assert stats.response_buffered <= limits.stream_buffer
    # The client's socket drains: reading resumes once below low water.
    pb >> sent(1, stats.response_buffered)
    pb << ResumeReading(conn=up)
    pb.done()


def test_stalled_h2_stream_does_not_stall_its_neighbour() -> None:
    limits = Limits(stream_buffer=64 * 1024)
    pb = Playbook(default_config(limits=limits))
    pb.accept(1)
    client = H2ClientPeer()
    stalled, data1 = client.request(path=b"/a")
    other, data2 = client.request(path=b"/b")
    pb >> data(1, client.preface() + data1 + data2)
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, _settings)
    pb << CancelTimer(timer=("header", 1))
    for ex, up in ((1, -1), (2, -2)):
        pb << SetTimer(timer=("connect", ex), at=5.0)
        pb << OpenConnection(conn=up, origin=ORIGIN)
    pb << Sends(1, client)  # the ack of the client's SETTINGS
    backends = {-1: H1BackendPeer(), -2: H1BackendPeer()}
    for ex, up, sid, path in ((1, -1, stalled, b"/a"), (2, -2, other, b"/b")):
        pb >> opened(up)
        pb << CancelTimer(timer=("connect", ex))
        pb << Sends(up, backends[up], h1_request(b"GET", path))
        pb << SetTimer(timer=("head", ex), at=60.0)
        pb >> data(up, backends[up].sse_head())
        pb << CancelTimer(timer=("head", ex))
        pb << Sends(1, client, h2_response(sid, 200))
        pb << SetTimer(timer=("read", ex), at=300.0)
    pb >> data(1, client.conn.data_to_send())  # the client acks the proxy's SETTINGS
    # The client reads everything but never gives window back for the stalled stream.
    received: dict[int, int] = {stalled: 0, other: 0}

    def delivered(events: Sequence[Any]) -> None:
        for event in events:
            if isinstance(event, h2.events.DataReceived):
                received[event.stream_id] += len(event.data)
                if event.stream_id == other:
                    client.conn.acknowledge_received_data(
                        event.flow_controlled_length, event.stream_id
                    )
                else:
                    # Like any real h2 client, give the connection-level window back for
                    # data it buffered, but keep the stream's window closed.
                    client.conn.increment_flow_control_window(event.flow_controlled_length)

    class Reader:
        def events(self, payload: bytes) -> list[h2.events.Event]:
            return client.conn.receive_data(payload)

    def relay(up: int, *, pause: bool = False) -> None:
        pb >> data(up, backends[up].chunk(chunk))
        if pause:
            pb << SetTimer(timer=("window", 1), at=60.0)
            pb << PauseReading(conn=up)
        pb << (out := Sends(1, Reader(), delivered))
        window = client.conn.data_to_send()
        if window:
            pb >> data(1, window)
        pb >> sent(1, len(out.data))

    chunk = b"data: " + b"y" * 8000 + b"\n\n"
    # The stalled stream's 64 KiB window takes this many whole chunks; the next one fills
    # it, and the backend behind it is paused.
    for _ in range(65535 // len(chunk)):
        relay(-1)
    relay(-1, pause=True)
    before = received[other]
    for _ in range(20):
        relay(-2)  # never paused
    pb.done()
    assert received[other] - before == 20 * (len(chunk))
    by_stream = {s.stream: s for s in pb.core.statistics().streams}
    assert by_stream[stalled].upstream_paused
    assert by_stream[stalled].response_buffered <= limits.stream_buffer
    assert not by_stream[other].upstream_paused


def test_client_reset_closes_the_backend_connection_at_once() -> None:
    pb = Playbook()
    pb.accept(1)
    client = H2ClientPeer()
    sid, request = client.request()
    pb.receive(1, client.preface() + request)
    (open_cmd,) = pb.opens()
    pb.opened(open_cmd.conn)
    backend = H1BackendPeer()
    backend.events(pb.take(open_cmd.conn))
    pb.receive(open_cmd.conn, backend.sse_head() + backend.chunk(SSE_EVENTS[0]))
    client.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
    pb >> data(1, client.conn.data_to_send())
    pb << CloseConnection(conn=open_cmd.conn)  # the GPU stops at once
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)  # the connection goes on, streamless
    pb.done()


def test_h1_client_disconnect_closes_the_backend_connection() -> None:
    pb = Playbook()
    client = H1ClientPeer()
    up, backend = _start_h1(pb, client.request())
    backend.events(pb.take(up))
    pb.receive(up, backend.sse_head())
    pb >> closed(1)
    pb << CloseConnection(conn=up)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("send", 1))
    pb.done()


def test_backend_death_mid_stream_resets_the_h2_stream() -> None:
    pb = Playbook()
    client = H2ClientPeer()
    sid = _h2_asks(pb, client)
    backend = H1BackendPeer()
    _forwarded(pb, backend)
    pb >> data(-1, backend.sse_head() + backend.chunk(SSE_EVENTS[0]))
    pb << CancelTimer(timer=("head", 1))
    pb << Sends(1, client, h2_response(sid, 200))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << Sends(1, client, lambda events: h2_body(events, sid) == SSE_EVENTS[0])
    pb >> closed(-1)
    pb << Sends(1, client, both(h2_resets((sid, h2.errors.ErrorCodes.INTERNAL_ERROR)), _not_ended))
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()


def test_backend_death_mid_stream_closes_h1_without_last_chunk() -> None:
    pb = Playbook()
    client = H1ClientPeer()
    up, backend = _start_h1(pb, client.request())
    backend.events(pb.take(up))
    pb.receive(up, backend.sse_head() + backend.chunk(SSE_EVENTS[0]))
    pb >> closed(up)
    pb << CancelTimer(timer=("read", 1))
    pb << CloseConnection(conn=1)  # no final chunk first; once the exchange is over
    pb.done()
    events = client.events(pb.take(1))
    assert not any(isinstance(e, h11.EndOfMessage) for e in events)
    with pytest.raises(h11.RemoteProtocolError):
        client.events(b"")  # EOF inside a chunked body


@pytest.mark.parametrize(
    ("timer", "status"), [("connect", 504), ("head", 504)], ids=["connect", "response-head"]
)
def test_timeouts_before_the_head_answer_504(timer: str, status: int) -> None:
    pb = Playbook(default_config(timeouts=Timeouts(connect=2, response_head=3)))
    client = H1ClientPeer()
    _h1_asks(pb, client.request(), connect=2.0)
    if timer == "head":
        _forwarded(pb, H1BackendPeer(), head=3.0)
    pb.now = 2.0 if timer == "connect" else 3.0
    pb >> wakeup(timer, 1)
    pb << CloseConnection(conn=-1)
    pb << SetTimer(timer=("send", 1), at=pb.now + 60.0)
    pb << Sends(1, client, h1_response(status))
    pb << CloseConnection(conn=1)
    pb.done()


def test_read_timeout_is_lazy_and_moves_with_every_chunk() -> None:
    pb = Playbook(default_config(timeouts=Timeouts(read=10)))
    client = H1ClientPeer()
    up, backend = _start_h1(pb, client.request())
    backend.events(pb.take(up))
    pb >> data(up, backend.sse_head())
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, lambda events: events[0].status_code == 200)
    pb << SetTimer(timer=("read", 1), at=10.0)
    pb.now = 6.0
    pb >> data(up, backend.chunk(SSE_EVENTS[0]))
    pb << SendData(conn=1, data=b"14\r\n" + SSE_EVENTS[0] + b"\r\n")
    pb.done()  # relaying costs no timer
    pb.now = 10.0
    pb >> wakeup("read", 1)
    pb << SetTimer(timer=("read", 1), at=16.0)  # 10 s after the chunk, not after the head
    pb.done()
    pb.now = 16.0
    pb >> wakeup("read", 1)
    pb << CloseConnection(conn=up)
    pb << CloseConnection(conn=1)  # truncated, never a clean end
    pb.done()


def test_refused_backend_answers_502() -> None:
    pb = Playbook()
    client = H2ClientPeer()
    sid = _h2_asks(pb, client)
    pb >> open_failed(-1, "refused")
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(1, client, h2_response(sid, 502))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()


def test_malformed_h1_request_gets_400_and_close() -> None:
    pb = Playbook()
    pb.accept(1)
    pb >> data(1, b"GET / HTTP/1.1\r\nHost: a\r\nBad Header\r\n\r\n")
    pb << SetTimer(timer=("send", 1), at=60.0)
    answer = Sends(1, H1ClientPeer())
    pb << answer
    pb << CloseConnection(conn=1)
    pb.done()  # no backend connection
    (response, *_) = answer.events
    assert response.status_code == 400
    assert (b"connection", b"close") in response.headers


def test_malformed_h2_request_resets_only_its_stream() -> None:
    pb = Playbook()
    pb.accept(1)
    client = H2ClientPeer()
    base = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")]
    _, bad = client.request_as_is([*base, (b"connection", b"keep-alive")])
    _, good = client.request_as_is(base)
    pb >> data(1, client.preface() + bad + good)
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, both(_settings, h2_resets()))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)  # stream 3 goes on to the backend
    pb << Sends(1, client, h2_resets((1, h2.errors.ErrorCodes.PROTOCOL_ERROR)))
    pb.done()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_chunking_gives_the_same_relayed_stream(data: st.DataObject) -> None:
    def cuts(blob: bytes) -> list[bytes]:
        points = sorted(
            data.draw(st.sets(st.integers(1, max(1, len(blob) - 1)), max_size=12)) | {len(blob)}
        )
        out, last = [], 0
        for p in points:
            out.append(blob[last:p])
            last = p
        return [p for p in out if p]

    pb = Playbook()
    pb.accept(1)
    client = H2ClientPeer()
    sid, request = client.request(b"POST", b"/v1/chat/completions", body=b'{"x": 1}')
    for piece in cuts(client.preface() + request):
        pb.receive(1, piece)
    (open_cmd,) = pb.opens()
    pb.opened(open_cmd.conn)
    backend = H1BackendPeer()
    got = backend.events(pb.take(open_cmd.conn))
    assert b"".join(e.data for e in got if isinstance(e, h11.Data)) == b'{"x": 1}'
    wire = backend.sse_head() + b"".join(backend.chunk(e) for e in SSE_EVENTS) + backend.end()
    for piece in cuts(wire):
        pb.receive(open_cmd.conn, piece)
    events = client.events(pb.take(1))
    body = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
    assert body == b"".join(SSE_EVENTS)
    assert any(isinstance(e, h2.events.StreamEnded) and e.stream_id == sid for e in events)
    # Every exchange ends exactly once.
    assert len([c for c in pb.log if isinstance(c, Log) and c.event == "access"]) == 1


def test_open_connection_carries_the_origin() -> None:
    def origin(command: OpenConnection) -> None:
        assert command.conn == -1
        assert attrs.asdict(command.origin) == {
            "host": "127.0.0.1",
            "port": 9001,
            "tls": False,
            "alpn": "http/1.1",
            "ca": None,
            "server_name": None,
        }

    pb = Playbook()
    pb.accept(1)
    pb >> data(1, H1ClientPeer().request())
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << Where(OpenConnection, origin)
    pb.done()


def test_expect_100_continue_is_answered_by_the_proxy() -> None:
    pb = Playbook()
    pb.accept(1)
    client = H1ClientPeer()
    head = client.conn.send(
        h11.Request(
            method="POST",
            target="/v1/chat/completions",
            headers=[("Host", "a"), ("Content-Length", "2"), ("Expect", "100-continue")],
        )
    )

    def interim(events: Sequence[Any]) -> None:
        (response,) = events
        assert isinstance(response, h11.InformationalResponse)
        assert response.status_code == 100

    pb >> data(1, head or b"")
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, interim)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb << SetTimer(timer=("body", 1), at=30.0)
    pb.done()


def test_idle_pooled_connection_is_closed_after_the_pool_idle_timeout() -> None:
    pb = Playbook()
    _served_204(pb, H1ClientPeer(), H1BackendPeer())
    assert pb.core.statistics().idle_upstream_connections == 1
    pb.now = pb.core.config.upstreams["default"].pool_idle_timeout
    pb >> wakeup("pool", -1)
    pb << CloseConnection(conn=-1)
    pb.done()
    assert pb.core.statistics().idle_upstream_connections == 0


def test_backend_closing_an_idle_pooled_connection_just_drops_it() -> None:
    pb = Playbook()
    client = H1ClientPeer()
    _served_204(pb, client, H1BackendPeer())
    pb >> closed(-1)
    pb << CancelTimer(timer=("pool", -1))
    client.conn.start_next_cycle()
    pb >> data(1, client.request())
    pb << CancelTimer(timer=("idle", 1))
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << OpenConnection(conn=-2, origin=ORIGIN)  # the next request opens a fresh connection
    pb.done()


@pytest.mark.parametrize("malformed", [False, True])
def test_request_reset_in_the_same_read_is_answered_by_nothing(malformed: bool) -> None:
    """h2 processes the RST_STREAM before the proxy answers the request it cancels: a
    response made at once (here 404: no route) must not reach a closed stream."""
    pb = Playbook(default_config(routes=(attrs.evolve(default_config().routes[0], prefix="/v1/"),)))
    pb.accept(1)
    client = H2ClientPeer()
    preface = client.preface()
    headers = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"a")]
    headers.append((b":path", b"/elsewhere"))
    if malformed:
        headers.append((b"connection", b"close"))
    sid, request = client.request_as_is(headers)
    client.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
    pb >> data(1, preface + request + client.conn.data_to_send())
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, _settings)
    if not malformed:
        pb << CancelTimer(timer=("header", 1))
        pb << Sends(1, client, lambda events: not on_stream(events, sid))  # the ack alone
        pb << SetTimer(timer=("idle", 1), at=75.0)
    # The connection is still usable: a next request is answered.
    sid, request = client.request_as_is([*headers[:3], (b":path", b"/elsewhere")])
    pb >> data(1, request)
    if malformed:
        pb << CancelTimer(timer=("header", 1))
    else:
        pb << CancelTimer(timer=("idle", 1))
    pb << Sends(1, client, h2_response(sid, 404))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()


def test_largest_settings_the_loader_accepts_serve_http2_and_http1() -> None:
    """Every limit sent as an HTTP/2 SETTINGS value, at the largest value the configuration
    loader accepts, still makes a valid first frame: an HTTP/2 client and, after it, an
    HTTP/1.1 client are both served (a value past 32 bits used to fail in SETTINGS)."""
    streams = int(RANGES["limits.max_concurrent_streams"].high)
    head = int(RANGES["limits.max_request_head"].high)
    document = {
        "listeners": [{"address": "127.0.0.1:8080"}],
        "upstreams": {"default": {"servers": [BACKEND]}},
        "limits": {
            "max_concurrent_streams": streams,
            "max_request_head": head,
            "h2_connection_window": int(RANGES["limits.h2_connection_window"].high),
        },
    }
    pb = Playbook(parse_config(document))

    def advertised(events: Sequence[Any]) -> None:
        settings = [e for e in events if isinstance(e, h2.events.RemoteSettingsChanged)]
        values = {code: change.new_value for code, change in settings[0].changed_settings.items()}
        assert values[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] == streams
        assert values[h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE] == head

    client = H2ClientPeer()
    pb.accept(1)
    sid, request = client.request()
    pb >> data(1, client.preface() + request)
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, advertised)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb << Sends(1, client)  # the ack of the client's SETTINGS
    backend = H1BackendPeer()
    _forwarded(pb, backend)
    pb >> data(-1, backend.sse_head() + backend.chunk(b"data: 1\n\n") + backend.end())
    pb << CancelTimer(timer=("head", 1))
    pb << Sends(1, client, h2_response(sid, 200))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << Sends(1, client, both(h2_ended(sid), lambda e: h2_body(e, sid) == b"data: 1\n\n"))
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    backend.conn.start_next_cycle()
    h1_client = H1ClientPeer()
    pb >> accepted(2)
    pb << SetTimer(timer=("header", 2), at=30.0)
    pb >> data(2, h1_client.request())
    pb << CancelTimer(timer=("header", 2))
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << CancelTimer(timer=("pool", -1))  # the kept-alive backend connection carries it
    pb << CancelTimer(timer=("connect", 2))
    pb << Sends(-1, backend, h1_request(b"GET"))
    pb << SetTimer(timer=("head", 2), at=60.0)
    _served_ok(pb, 2, h1_client, backend)
    pb.done()


def test_every_close_carries_the_send_timeout_as_its_flush_bound() -> None:
    # The driver bounds the flush before a close by the command, not by its own copy of
    # the configuration: clients and backends alike get ``timeouts.send``.
    pb = Playbook(default_config(timeouts=Timeouts(send=7.5)))
    client = H1ClientPeer()
    _h1_asks(pb, client.request("POST", "/v1/chat/completions", [], b"{}"), body=True)
    _forwarded(pb, H1BackendPeer())
    pb >> InputEnded(now=pb.now, conn=1)  # the client goes away mid-exchange
    pb << Where(CloseConnection, lambda c: c.conn == 1 and c.flush_timeout == 7.5)
    pb << Where(CloseConnection, lambda c: c.conn == -1 and c.flush_timeout == 7.5)
    pb << CancelTimer(timer=("head", 1))
    pb << CancelTimer(timer=("body", 1))
    pb.done()
    # The bound is no part of a close's identity (``CloseConnection.flush_timeout``).
    assert CloseConnection(conn=1) in pb.log


def test_config_changed_moves_the_flush_bound_of_later_closes() -> None:
    pb = Playbook()
    pb >> ConfigChanged(now=pb.now, config=default_config(timeouts=Timeouts(send=0.25)))
    pb.accept(1)
    pb >> data(1, b"NOT HTTP\r\n\r\n")  # answered 400, then closed
    pb << SetTimer(timer=("send", 1), at=0.25)
    pb << Sends(1, H1ClientPeer(), h1_response(400))
    pb << Where(CloseConnection, lambda c: c.conn == 1 and c.flush_timeout == 0.25)
    pb.done()

"""The whole proxy driven with bytes only: real h11/h2 peers on both sides, no sockets."""

from __future__ import annotations

import ast
import pathlib

import attrs
import h2.errors
import h2.events
import h2.settings
import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from playbook import (
    BACKEND,
    H1BackendPeer,
    H1ClientPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    closed,
    data,
    default_config,
    sent,
    wakeup,
)

from muxproxy.config import Limits, Timeouts, parse_config
from muxproxy.config.ranges import RANGES
from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    Log,
    OpenConnection,
    PauseReading,
    ResumeReading,
    SendData,
    SetTimer,
)
from muxproxy.core.events import ConfigChanged, InputEnded

ROOT = pathlib.Path(__file__).resolve().parents[2] / "muxproxy"
FORBIDDEN = {"trio", "asyncio", "socket", "ssl", "select", "selectors", "time"}
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


@pytest.mark.parametrize("split", [0, 1])
def test_h1_client_sse_stream_is_relayed_chunk_by_chunk(split: int) -> None:
    pb = Playbook(split=split)
    client = H1ClientPeer()
    body = b'{"stream": true}'
    up, backend = _start_h1(
        pb, client.request("POST", "/v1/chat/completions", [("Cookie", "a=1")], body)
    )
    received = backend.events(pb.take(up))
    request = received[0]
    assert isinstance(request, h11.Request)
    assert request.target == b"/v1/chat/completions"
    headers = dict(request.headers)
    assert headers[b"host"] == b"proxy.example"
    assert headers[b"x-forwarded-for"] == b"10.0.0.7"
    assert headers[b"via"] == b"1.1 muxproxy"
    assert b"".join(e.data for e in received if isinstance(e, h11.Data)) == body
    assert isinstance(received[-1], h11.EndOfMessage)

    head = pb.receive(up, backend.sse_head())
    response = client.events(pb.take(1, head))
    assert isinstance(response[0], h11.Response)
    assert dict(response[0].headers)[b"x-accel-buffering"] == b"no"
    for event in SSE_EVENTS:
        commands = pb.receive(up, backend.chunk(event))
        # Per-chunk flush: what arrives leaves in the very call that brought it.
        decoded = client.events(pb.take(1, commands))
        assert b"".join(d.data for d in decoded) == event
        if not split:
            assert len(decoded) == 1
    final = client.events(pb.take(1, pb.receive(up, backend.end())))
    assert isinstance(final[-1], h11.EndOfMessage)
    (access,) = [c for c in pb.log if isinstance(c, Log) and c.event == "access"]
    assert access.fields["status"] == 200
    assert access.fields["outcome"] == "ok"


@pytest.mark.parametrize("split", [0, 1, 7])
def test_h2_client_streams_are_relayed_per_data_frame(split: int) -> None:
    pb = Playbook(split=split)
    pb.accept(1)
    client = H2ClientPeer()
    sid, data = client.request(
        b"POST",
        b"/v1/chat/completions",
        headers=[(b"cookie", b"a=1"), (b"cookie", b"b=2")],
        body=b"{}",
    )
    pb.receive(1, client.preface() + data)
    (open_cmd,) = pb.opens()
    up = open_cmd.conn
    pb.opened(up)
    backend = H1BackendPeer()
    request = backend.events(pb.take(up))[0]
    headers = dict(request.headers)
    # RFC 9113 §8.2.3: cookies arrive joined for HTTP/1.1.
    assert headers[b"cookie"] == b"a=1; b=2"
    assert headers[b"host"] == b"proxy.example"
    assert headers[b"via"] == b"2 muxproxy"

    events = client.events(pb.take(1, pb.receive(up, backend.sse_head())))
    (response,) = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert dict(response.headers)[b":status"] == b"200"
    for chunk in SSE_EVENTS:
        events = client.events(pb.take(1, pb.receive(up, backend.chunk(chunk))))
        frames = [e.data for e in events if isinstance(e, h2.events.DataReceived)]
        assert b"".join(frames) == chunk
        if not split:
            assert len(frames) == 1
    events = client.events(pb.take(1, pb.receive(up, backend.end())))
    assert any(isinstance(e, h2.events.StreamEnded) and e.stream_id == sid for e in events)


def test_plain_listener_tells_h1_from_h2_by_the_preface_byte_by_byte() -> None:
    pb = Playbook(split=1)
    pb.accept(1)
    client = H2ClientPeer()
    _, data = client.request()
    pb.receive(1, client.preface() + data)
    assert len(pb.opens()) == 1  # the request was parsed as HTTP/2
    out = client.events(pb.take(1))
    assert any(isinstance(e, h2.events.RemoteSettingsChanged) for e in out)


def test_tls_alpn_h2_needs_no_sniffing() -> None:
    pb = Playbook()
    pb.accept(1, tls=True, alpn="h2")
    # The server preface (SETTINGS) goes out at once, before any client byte.
    assert pb.take(1)
    client = H2ClientPeer()
    _, data = client.request()
    pb.receive(1, client.preface() + data)
    assert len(pb.opens()) == 1


def test_backend_pool_reuses_the_kept_alive_connection() -> None:
    pb = Playbook()
    client = H1ClientPeer()
    up, backend = _start_h1(pb, client.request())
    backend.events(pb.take(up))
    response = backend.conn.send(h11.Response(status_code=200, headers=[("Content-Length", "2")]))
    pb.receive(up, (response or b"") + backend.chunk(b"ok") + backend.end())
    assert [type(e) for e in client.events(pb.take(1))][-1] is h11.EndOfMessage
    client.conn.start_next_cycle()
    backend.conn.start_next_cycle()
    before = len(pb.log)
    pb.receive(1, client.request())
    assert len(pb.opens()) == 1  # no new connection
    request = backend.events(pb.take(up, pb.log[before:]))[0]
    assert isinstance(request, h11.Request)
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
    pb.receive(1, client.preface() + data1 + data2)
    up_stalled, up_other = (c.conn for c in pb.opens())
    backends = {}
    for up in (up_stalled, up_other):
        pb.opened(up)
        backends[up] = H1BackendPeer()
        backends[up].events(pb.take(up))
        pb.receive(up, backends[up].sse_head())
    client.conn.receive_data(pb.take(1))  # settings and both response heads
    pb.receive(1, client.conn.data_to_send())
    # The client reads everything but never gives window back for the stalled stream.
    received: dict[int, int] = {stalled: 0, other: 0}

    def deliver(commands: list) -> None:
        for event in client.conn.receive_data(pb.take(1, commands)):
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
        pb.receive(1, client.conn.data_to_send())

    chunk = b"data: " + b"y" * 8000 + b"\n\n"
    paused = False
    for _ in range(40):
        commands = pb.receive(up_stalled, backends[up_stalled].chunk(chunk))
        paused = paused or PauseReading(conn=up_stalled) in commands
        deliver(commands)
        for c in commands:
            if isinstance(c, SendData) and c.conn == 1:
                pb.sent(1, len(c.data))
        if paused:
            break
    assert paused
    before = received[other]
    for _ in range(20):
        commands = pb.receive(up_other, backends[up_other].chunk(chunk))
        assert PauseReading(conn=up_other) not in commands
        deliver(commands)
        for c in commands:
            if isinstance(c, SendData) and c.conn == 1:
                pb.sent(1, len(c.data))
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
    pb.accept(1)
    client = H2ClientPeer()
    sid, data = client.request()
    pb.receive(1, client.preface() + data)
    (open_cmd,) = pb.opens()
    up = open_cmd.conn
    pb.opened(up)
    backend = H1BackendPeer()
    backend.events(pb.take(up))
    pb.receive(up, backend.sse_head() + backend.chunk(SSE_EVENTS[0]))
    events = client.events(pb.take(1, pb.closed(up)))
    resets = [e for e in events if isinstance(e, h2.events.StreamReset)]
    assert [(r.stream_id, r.error_code) for r in resets] == [
        (sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
    ]
    assert not any(isinstance(e, h2.events.StreamEnded) for e in events)


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
    pb.accept(1)
    pb.receive(1, client.request())
    (open_cmd,) = pb.opens()
    if timer == "head":
        pb.opened(open_cmd.conn)
    armed = [c for c in pb.log if isinstance(c, SetTimer) and c.timer[0] == timer]
    assert armed and armed[-1].at == (2 if timer == "connect" else 3)
    pb.now = armed[-1].at
    commands = pb.wakeup(timer, armed[-1].timer[1])
    response = client.events(pb.take(1, commands))[0]
    assert response.status_code == status


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
    from muxproxy.core.events import OpenFailed

    pb = Playbook()
    client = H2ClientPeer()
    pb.accept(1)
    _, data = client.request()
    pb.receive(1, client.preface() + data)
    (open_cmd,) = pb.opens()
    commands = pb.feed(OpenFailed(now=0, conn=open_cmd.conn, reason="refused"))
    events = client.events(pb.take(1, commands))
    (response,) = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert dict(response.headers)[b":status"] == b"502"


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
    import h2.config
    import h2.connection

    pb = Playbook()
    pb.accept(1)
    config = h2.config.H2Configuration(
        client_side=True, validate_outbound_headers=False, normalize_outbound_headers=False
    )
    conn = h2.connection.H2Connection(config=config)
    conn.initiate_connection()
    base = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")]
    conn.send_headers(1, [*base, (b"connection", b"keep-alive")], end_stream=True)
    conn.send_headers(3, base, end_stream=True)
    pb.receive(1, conn.data_to_send())
    events = conn.receive_data(pb.take(1))
    resets = [e for e in events if isinstance(e, h2.events.StreamReset)]
    assert [(r.stream_id, r.error_code) for r in resets] == [
        (1, h2.errors.ErrorCodes.PROTOCOL_ERROR)
    ]
    assert len(pb.opens()) == 1  # stream 3 goes on to the backend


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
    pb = Playbook()
    pb.accept(1)
    pb.receive(1, H1ClientPeer().request())
    assert pb.opens() == [OpenConnection(conn=-1, origin=pb.opens()[0].origin)]
    assert attrs.asdict(pb.opens()[0].origin) == {
        "host": "127.0.0.1",
        "port": 9001,
        "tls": False,
        "alpn": "http/1.1",
        "ca": None,
        "server_name": None,
    }


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
    commands = pb.receive(1, head or b"")
    (interim,) = client.events(pb.take(1, commands))
    assert isinstance(interim, h11.InformationalResponse)
    assert interim.status_code == 100


def test_idle_pooled_connection_is_closed_after_the_pool_idle_timeout() -> None:
    pb = Playbook()
    client = H1ClientPeer()
    up, backend = _start_h1(pb, client.request())
    backend.events(pb.take(up))
    response = backend.conn.send(h11.Response(status_code=204, headers=[]))
    pb.receive(up, (response or b"") + backend.end())
    (armed,) = [c for c in pb.log if isinstance(c, SetTimer) and c.timer == ("pool", up)]
    assert armed.at == pb.core.config.upstreams["default"].pool_idle_timeout
    assert pb.core.statistics().idle_upstream_connections == 1
    pb.now = armed.at
    assert CloseConnection(conn=up) in pb.wakeup("pool", up)
    assert pb.core.statistics().idle_upstream_connections == 0


def test_backend_closing_an_idle_pooled_connection_just_drops_it() -> None:
    pb = Playbook()
    client = H1ClientPeer()
    up, backend = _start_h1(pb, client.request())
    backend.events(pb.take(up))
    response = backend.conn.send(h11.Response(status_code=204, headers=[]))
    pb.receive(up, (response or b"") + backend.end())
    assert pb.closed(up) == [CancelTimer(timer=("pool", up))]
    client.events(pb.take(1))
    client.conn.start_next_cycle()
    pb.receive(1, client.request())
    assert len(pb.opens()) == 2  # the next request opens a fresh connection


@pytest.mark.parametrize("malformed", [False, True])
def test_request_reset_in_the_same_read_is_answered_by_nothing(malformed: bool) -> None:
    """h2 processes the RST_STREAM before the proxy answers the request it cancels: a
    response made at once (here 404: no route) must not reach a closed stream."""
    import h2.config
    import h2.connection

    pb = Playbook(default_config(routes=(attrs.evolve(default_config().routes[0], prefix="/v1/"),)))
    pb.accept(1)
    config = h2.config.H2Configuration(
        client_side=True, validate_outbound_headers=False, normalize_outbound_headers=False
    )
    conn = h2.connection.H2Connection(config=config)
    conn.initiate_connection()
    headers = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"a")]
    headers.append((b":path", b"/elsewhere"))
    if malformed:
        headers.append((b"connection", b"close"))
    conn.send_headers(1, headers, end_stream=True)
    conn.reset_stream(1, h2.errors.ErrorCodes.CANCEL)
    pb.receive(1, conn.data_to_send())
    conn.receive_data(pb.take(1))
    # The connection is still usable: a next request is answered.
    conn.send_headers(3, [*headers[:3], (b":path", b"/elsewhere")], end_stream=True)
    events = conn.receive_data(pb.take(1, pb.receive(1, conn.data_to_send())))
    (response,) = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert dict(response.headers)[b":status"] == b"404"


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
    pb.accept(1)
    client = H2ClientPeer()
    _, data = client.request()
    pb.receive(1, client.preface() + data)
    settings = [
        e for e in client.events(pb.take(1)) if isinstance(e, h2.events.RemoteSettingsChanged)
    ]
    advertised = {code: change.new_value for code, change in settings[0].changed_settings.items()}
    assert advertised[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] == streams
    assert advertised[h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE] == head
    (open_cmd,) = pb.opens()
    pb.opened(open_cmd.conn)
    backend = H1BackendPeer()
    backend.events(pb.take(open_cmd.conn))
    reply = backend.sse_head() + backend.chunk(b"data: 1\n\n") + backend.end()
    events = client.events(pb.take(1, pb.receive(open_cmd.conn, reply)))
    assert [type(e) for e in events if not isinstance(e, h2.events.WindowUpdated)][-1:] == [
        h2.events.StreamEnded
    ]
    backend.conn.start_next_cycle()
    h1_client = H1ClientPeer()
    pb.accept(2)
    mark = len(pb.log)
    pb.receive(2, h1_client.request())
    assert len(pb.opens()) == 1  # the kept-alive backend connection carries it
    backend.events(pb.take(open_cmd.conn, pb.log[mark:]))
    head = backend.conn.send(h11.Response(status_code=200, headers=[("Content-Length", "2")]))
    pb.receive(open_cmd.conn, (head or b"") + backend.chunk(b"ok") + backend.end())
    events = h1_client.events(pb.take(2))
    assert events[0].status_code == 200 and type(events[-1]) is h11.EndOfMessage


def test_every_close_carries_the_send_timeout_as_its_flush_bound() -> None:
    # The driver bounds the flush before a close by the command, not by its own copy of
    # the configuration: clients and backends alike get ``timeouts.send``.
    pb = Playbook(default_config(timeouts=Timeouts(send=7.5)))
    client = H1ClientPeer()
    up, _ = _start_h1(pb, client.request("POST", "/v1/chat/completions", [], b"{}"))
    pb.feed(InputEnded(now=pb.now, conn=1))  # the client goes away mid-exchange
    closes = [c for c in pb.log if isinstance(c, CloseConnection)]
    assert {c.conn for c in closes} == {1, up}
    assert [c.flush_timeout for c in closes] == [7.5, 7.5]
    # The bound is no part of a close's identity (``CloseConnection.flush_timeout``).
    assert CloseConnection(conn=1) in closes


def test_config_changed_moves_the_flush_bound_of_later_closes() -> None:
    pb = Playbook()
    pb.feed(ConfigChanged(now=pb.now, config=default_config(timeouts=Timeouts(send=0.25))))
    pb.accept(1)
    commands = pb.receive(1, b"NOT HTTP\r\n\r\n")  # answered 400, then closed
    (close,) = [c for c in commands if isinstance(c, CloseConnection)]
    assert close.conn == 1 and close.flush_timeout == 0.25

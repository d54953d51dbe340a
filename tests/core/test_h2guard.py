"""HTTP/2 attack defences (core/http2/h2guard.py, wired in core/http2/h2.py) as whole
conversations: bytes from a real h2 client, raw frames from hyperframe where h2 refuses to produce
them; every test asserts every command in order, timers included, so it checks both the answer to
the abuse and what happened to the other streams and backend connections."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import h2.errors
import h2.events
import h2.settings
import h11
import hpack
import hyperframe.frame
import pytest
from checks import Check, both, h1_request, h2_body, h2_ended, h2_goaway, h2_resets, h2_response
from playbook import H1BackendPeer, H2ClientPeer, Playbook, Sends, data, default_config, opened

from muxproxy.config import Limits
from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    Log,
    OpenConnection,
    Origin,
    PauseReading,
    SetTimer,
)
from muxproxy.core.http2.h2guard import STREAM_ID_DRAIN, H2Guard

CALM = h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
CANCEL = h2.errors.ErrorCodes.CANCEL
REFUSED = h2.errors.ErrorCodes.REFUSED_STREAM
ORIGIN = Origin(host="127.0.0.1", port=9001)
TOK = b"data: tok\n\n"


# -- set-up helpers shared with other modules' tests (they feed events without asserting) ---


class Book(Playbook):
    seen = 0

    def fresh(self) -> bytes:
        """Bytes sent to the client since the last call (each byte is decoded once)."""
        new, self.seen = self.log[self.seen :], len(self.log)
        return self.take(1, new)


def closed_conns(pb: Playbook) -> set[int]:
    return {c.conn for c in pb.log if isinstance(c, CloseConnection)}


# -- this module's conversations ----------------------------------------------------------------


def playbook(**limits: int) -> Playbook:
    pb = Playbook(default_config(limits=attrs.evolve(Limits(), **limits)))
    pb.accept(1)  # set-up: its header timer is not asserted
    return pb


def abuse_logged(pb: Playbook) -> bool:
    return any(isinstance(c, Log) and c.event == "client_h2_abuse" for c in pb.log)


# -- checks on what the client decoded --------------------------------------------------------


def settings(events: Sequence[Any]) -> None:
    """The proxy's SETTINGS, and nothing for any stream."""
    assert any(isinstance(e, h2.events.RemoteSettingsChanged) for e in events), events
    assert not [e for e in events if getattr(e, "stream_id", 0)], events


def acked(events: Sequence[Any]) -> None:
    """The proxy acknowledged the client's SETTINGS."""
    assert any(isinstance(e, h2.events.SettingsAcknowledged) for e in events), events


def calm(reason: bytes) -> Check:
    """GOAWAY(ENHANCE_YOUR_CALM) whose debug data names ``reason``."""

    def check(events: Sequence[Any]) -> None:
        (end,) = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
        assert end.error_code == CALM and reason in (end.additional_data or b""), end

    return check


def carries(sid: int, body: bytes) -> Check:
    return lambda events: h2_body(events, sid) == body


# -- the conversation's steps -----------------------------------------------------------------


def sse_stream(
    pb: Playbook, client: H2ClientPeer, path: bytes = b"/v1/stream"
) -> tuple[int, H1BackendPeer]:
    """The client's preface and a GET of ``path`` in one read (exchange 1); backend
    connection -1 answers with an SSE head, relayed on the stream."""
    sid, request = client.request(b"GET", path)
    pb >> data(1, client.preface() + request)
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, settings)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb << Sends(1, client, acked)
    backend = H1BackendPeer()
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(-1, backend, h1_request(b"GET", path))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb >> data(-1, backend.sse_head())
    pb << CancelTimer(timer=("head", 1))
    pb << Sends(1, client, h2_response(sid, 200, b"", ended=False))
    pb << SetTimer(timer=("read", 1), at=300.0)
    return sid, backend


def preface(pb: Playbook, client: H2ClientPeer) -> None:
    """The client's preface alone: the proxy answers with its SETTINGS."""
    pb >> data(1, client.preface())
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, settings)


# -- rapid reset (CVE-2023-44487) ------------------------------------------------------------


def test_rapid_reset_cancels_each_backend_then_gets_goaway_enhance_your_calm() -> None:
    pb = playbook(h2_reset_budget=5)
    client = H2ClientPeer()
    sse_stream(pb, client)
    for i in range(6):
        sid, request = client.request(b"GET", f"/v1/models/{i}".encode())
        client.conn.reset_stream(sid, CANCEL)
        pb >> data(1, request + client.conn.data_to_send())
        ex = i + 2
        pb << SetTimer(timer=("connect", ex), at=5.0)
        pb << OpenConnection(conn=-ex, origin=ORIGIN)
        # Every reset request's backend connection is closed at once.
        pb << CloseConnection(conn=-ex)
        pb << CancelTimer(timer=("connect", ex))
    # The connection closes, and the stream still running on it is cancelled upstream too.
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("read", 1))
    pb << Sends(1, client, h2_goaway(CALM))
    pb << CloseConnection(conn=1)
    pb.done()
    assert abuse_logged(pb)
    assert pb.core.statistics().streams == []


def test_cancels_paid_back_by_completed_responses_never_trip_the_budget() -> None:
    pb = playbook(h2_reset_budget=2)
    client = H2ClientPeer()
    preface(pb, client)
    ex, up, pooled = 0, 0, 0
    for i in range(10):
        # One cancelled request, then one completed: a client that cancels half the time.
        target = f"/cancel/{i}".encode()
        sid, request = client.request(b"GET", target)
        client.conn.reset_stream(sid, CANCEL)
        pb >> data(1, request + client.conn.data_to_send())
        ex += 1
        pb << CancelTimer(timer=("idle" if i else "header", 1))
        pb << SetTimer(timer=("connect", ex), at=5.0)
        if not pooled:
            up -= 1
            pb << OpenConnection(conn=up, origin=ORIGIN)
            pb << CloseConnection(conn=up)
            pb << CancelTimer(timer=("connect", ex))
        else:
            # It takes the pooled backend connection, closed when the request is cancelled.
            pb << CancelTimer(timer=("pool", pooled))
            pb << CancelTimer(timer=("connect", ex))
            pb << Sends(pooled, H1BackendPeer(), h1_request(b"GET", target))
            pb << SetTimer(timer=("head", ex), at=60.0)
            pb << CloseConnection(conn=pooled)
            pb << CancelTimer(timer=("head", ex))
        pb << SetTimer(timer=("idle", 1), at=75.0)
        sid, request = client.request(b"GET", b"/v1/stream")
        pb >> data(1, request)
        ex, up = ex + 1, up - 1
        pb << CancelTimer(timer=("idle", 1))
        pb << SetTimer(timer=("connect", ex), at=5.0)
        pb << OpenConnection(conn=up, origin=ORIGIN)
        backend = H1BackendPeer()
        pb >> opened(up)
        pb << CancelTimer(timer=("connect", ex))
        pb << Sends(up, backend, h1_request(b"GET", b"/v1/stream"))
        pb << SetTimer(timer=("head", ex), at=60.0)
        pb >> data(up, backend.sse_head())
        pb << CancelTimer(timer=("head", ex))
        pb << Sends(1, client, h2_response(sid, 200, b"", ended=False))
        pb << SetTimer(timer=("read", ex), at=300.0)
        pb >> data(up, backend.end())  # the last chunk of the chunked SSE response
        pb << Sends(1, client, h2_ended(sid))
        pb << SetTimer(timer=("pool", up), at=60.0)
        pb << CancelTimer(timer=("read", ex))
        pb << SetTimer(timer=("idle", 1), at=75.0)
        pooled = up
    pb.done()  # no GOAWAY, connection 1 open


# -- control-frame floods ----------------------------------------------------------------------


FLOODS: dict[str, Callable[[H2ClientPeer, int], None]] = {
    "PING": lambda c, i: c.conn.ping(i.to_bytes(8, "big")),
    "SETTINGS": lambda c, i: c.conn.update_settings({h2.settings.SettingCodes.ENABLE_PUSH: 0}),
    "WINDOW_UPDATE": lambda c, i: c.conn.increment_flow_control_window(1),
    "PRIORITY": lambda c, i: c.conn.prioritize(1, weight=1 + i % 200),
    "empty DATA": lambda c, i: None,  # set per test: needs a stream with the request open
}


@pytest.mark.parametrize("kind", list(FLOODS))
def test_control_frame_flood_gets_goaway_and_cancels_running_streams(kind: str) -> None:
    pb = playbook(h2_control_frame_budget=50)
    client = H2ClientPeer()
    # The response head was delivered; the client's own SETTINGS ACK etc. are within budget.
    sid, _ = sse_stream(pb, client)
    assert sid == 1
    flood = FLOODS[kind]
    if kind == "empty DATA":
        # Empty DATA needs a stream whose request is still open.
        sid = client.conn.get_next_available_stream_id()
        open_request = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/up")]
        client.conn.send_headers(sid, [*open_request, (b":authority", b"a")])

        def flood(c: H2ClientPeer, i: int) -> None:
            c.conn.send_data(sid, b"")

    for i in range(60):
        flood(client, i)
    pb >> data(1, client.conn.data_to_send())
    if kind == "empty DATA":
        pb << SetTimer(timer=("connect", 2), at=5.0)
        pb << OpenConnection(conn=-2, origin=ORIGIN)
        pb << SetTimer(timer=("body", 2), at=30.0)
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("read", 1))
    if kind == "empty DATA":
        pb << CloseConnection(conn=-2)
        pb << CancelTimer(timer=("connect", 2))
        pb << CancelTimer(timer=("body", 2))
    pb << Sends(1, client, calm(kind.encode()))
    pb << CloseConnection(conn=1)
    pb.done()


def test_pings_are_paid_back_by_a_streaming_response() -> None:
    pb = playbook(h2_control_frame_budget=20)
    client = H2ClientPeer()
    sid, backend = sse_stream(pb, client)
    for i in range(200):
        # One token event and one keep-alive PING per token: never a flood.
        pb >> data(-1, backend.chunk(TOK))
        pb << Sends(1, client, carries(sid, TOK))
        client.conn.ping(i.to_bytes(8, "big"))
        pb >> data(1, client.conn.data_to_send())
        pb << Sends(1, client, pong(i.to_bytes(8, "big")))
    pb.done()  # no GOAWAY, connection 1 open


def pong(ping: bytes) -> Check:
    """The PING acknowledged with its data, and no GOAWAY."""

    def check(events: Sequence[Any]) -> None:
        assert [e.ping_data for e in events if isinstance(e, h2.events.PingAckReceived)] == [
            ping
        ], events
        assert not any(isinstance(e, h2.events.ConnectionTerminated) for e in events), events

    return check


def test_guard_budgets_refill_with_work_up_to_their_size() -> None:
    guard = H2Guard(reset_budget=2, control_budget=3)
    for _ in range(5):
        guard.response_completed()
    assert guard.resets_left == 2 and guard.control_left == 3
    guard.premature_reset()
    guard.premature_reset()
    assert guard.exhausted is None
    guard.premature_reset()
    assert guard.exhausted is not None and "reset" in guard.exhausted


# -- header blocks -----------------------------------------------------------------------------


def test_continuation_flood_is_a_connection_error_before_any_backend() -> None:
    pb = playbook()
    client = H2ClientPeer()
    preface(pb, client)
    block = hpack.Encoder().encode(
        [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")]
    )
    headers = hyperframe.frame.HeadersFrame(1, data=block[:4], flags=["END_STREAM"])
    frames = [headers.serialize()]
    for _ in range(100):
        # h2 buffers at most 64 CONTINUATION frames (at most 64 x 16 KiB) then gives up.
        frames.append(hyperframe.frame.ContinuationFrame(1, data=b"\x00" * 100).serialize())
    pb >> data(1, b"".join(frames))
    pb << Sends(1, client, h2_goaway(h2.errors.ErrorCodes.PROTOCOL_ERROR))
    pb << CloseConnection(conn=1)
    pb.done()  # no OpenConnection


def test_hpack_bomb_over_the_header_list_limit_gets_enhance_your_calm() -> None:
    pb = playbook()
    client = H2ClientPeer()
    preface(pb, client)
    # 80 references to one 4 KiB dynamic-table entry: ~4 KiB on the wire, 320 KiB decoded,
    # past HARD_LIMIT_FACTOR times max_request_head (4 x 64 KiB), where decoding stops.
    _, request = client.request(headers=[(b"x-bomb", b"a" * 4000)] * 80)
    assert len(request) < 8000
    pb >> data(1, request)
    pb << Sends(1, client, h2_goaway(CALM))
    pb << CloseConnection(conn=1)
    pb.done()  # no OpenConnection
    assert abuse_logged(pb)


# -- refused streams ---------------------------------------------------------------------------


def ignore_stream_limit(client: H2ClientPeer) -> None:
    """Make the peer open streams past our MAX_CONCURRENT_STREAMS, as a client does before it
    saw our SETTINGS (or as an attacker does)."""
    client.conn.remote_settings.max_concurrent_streams = 2**31 - 1
    client.conn.remote_settings.acknowledge()


def open_streams(pb: Playbook, client: H2ClientPeer, n: int) -> None:
    """The preface and ``n`` streams in one read: exchanges 1..n open backend connections
    -1..-n, which never answer."""
    request = client.preface()
    for i in range(n):
        request += client.request(b"GET", f"/v1/stream/{i}".encode())[1]
    pb >> data(1, request)
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, settings)
    pb << CancelTimer(timer=("header", 1))
    for ex in range(1, n + 1):
        pb << SetTimer(timer=("connect", ex), at=5.0)
        pb << OpenConnection(conn=-ex, origin=ORIGIN)
    pb << Sends(1, client, acked)


def cancelled(pb: Playbook, n: int) -> None:
    """The connection goes: backend connections -1..-n, still connecting, are closed."""
    for ex in range(1, n + 1):
        pb << CloseConnection(conn=-ex)
        pb << CancelTimer(timer=("connect", ex))


def test_streams_refused_past_the_limit_spend_the_budget_then_goaway() -> None:
    pb = playbook(max_concurrent_streams=2, h2_control_frame_budget=300)
    client = H2ClientPeer()
    open_streams(pb, client, 2)
    ignore_stream_limit(client)
    refused = []
    for i in range(40):
        # One stream too many per read: each is refused alone (RFC 9113 §5.1.2) ...
        sid, request = client.request(b"GET", f"/v1/extra/{i}".encode())
        pb >> data(1, request)
        if pb.queue[:1] == [CloseConnection(conn=-1)]:
            break  # the budget is spent
        pb << Sends(1, client, h2_resets((sid, REFUSED)))
        refused.append(sid)
    else:
        raise AssertionError("no GOAWAY after 40 refused streams")
    # ... and costs ten of the control-frame budget: GOAWAY(ENHANCE_YOUR_CALM) once spent.
    cancelled(pb, 2)
    pb << Sends(1, client, calm(b"refused stream"))
    pb << CloseConnection(conn=1)
    pb.done()  # no OpenConnection past the first two
    assert 25 <= len(refused) <= 30


def test_a_read_full_of_streams_past_the_limit_gets_goaway_inside_the_read() -> None:
    pb = playbook(max_concurrent_streams=10)
    client = H2ClientPeer()
    open_streams(pb, client, 10)
    ignore_stream_limit(client)
    flood = b""
    for _ in range(5000):
        flood += client.request(b"GET", b"/v1/flood")[1]
    pb >> data(1, flood)
    cancelled(pb, 10)
    pb << (answer := Sends(1, client, h2_goaway(CALM)))
    pb << CloseConnection(conn=1)
    pb.done()  # no OpenConnection past the first ten
    # h2 stopped at the 20th header block of the read: it opened 20 streams, not 5,000.
    (end,) = [e for e in answer.events if isinstance(e, h2.events.ConnectionTerminated)]
    assert end.last_stream_id is not None and end.last_stream_id <= 2 * (10 + 20)


def test_streams_refused_before_the_client_saw_our_settings_are_paid_back() -> None:
    pb = playbook(max_concurrent_streams=4, h2_control_frame_budget=100)
    client = H2ClientPeer()
    for round_ in range(5):
        # Eight streams at once, four refused, four answered: the client retries the rest.
        open_streams_and_answer(pb, client, round_)
    pb.done()  # no GOAWAY, connection 1 open


def open_streams_and_answer(pb: Playbook, client: H2ClientPeer, round_: int) -> None:
    """Round ``round_``: eight streams in one read; the proxy opens backend connections for
    four (exchanges 4 * round_ + 1 ...) and refuses the other four; each backend answers
    ``200 ok`` with "Connection: close", so the next round opens new backend connections."""
    request = client.preface() if not round_ else b""
    sids, paths = [], [f"/v1/models/{i}".encode() for i in range(8)]
    for path in paths:
        sid, one = client.request(b"GET", path)
        request += one
        sids.append(sid)
    exchanges = range(4 * round_ + 1, 4 * round_ + 5)
    pb >> data(1, request)
    if not round_:
        pb << SetTimer(timer=("send", 1), at=60.0)
        pb << Sends(1, client, settings)
    pb << CancelTimer(timer=("idle" if round_ else "header", 1))
    for ex in exchanges:
        pb << SetTimer(timer=("connect", ex), at=5.0)
        pb << OpenConnection(conn=-ex, origin=ORIGIN)
    pb << Sends(1, client, h2_resets(*[(sid, REFUSED) for sid in sids[4:]]))
    ignore_stream_limit(client)
    for sid, path, ex in zip(sids, paths, exchanges, strict=False):
        backend = H1BackendPeer()
        pb >> opened(-ex)
        pb << CancelTimer(timer=("connect", ex))
        pb << Sends(-ex, backend, h1_request(b"GET", path))
        pb << SetTimer(timer=("head", ex), at=60.0)
        head = h11.Response(
            status_code=200, headers=[("Content-Length", "2"), ("Connection", "close")]
        )
        pb >> data(-ex, backend.conn.send(head) + backend.chunk(b"ok") + backend.end())
        pb << CancelTimer(timer=("head", ex))
        pb << Sends(1, client, h2_response(sid, 200, b""))
        pb << SetTimer(timer=("read", ex), at=300.0)
        pb << Sends(1, client, both(carries(sid, b"ok"), h2_ended(sid)))
        pb << CloseConnection(conn=-ex)
        pb << CancelTimer(timer=("read", ex))
    pb << SetTimer(timer=("idle", 1), at=75.0)


# -- stream-id exhaustion --------------------------------------------------------------------


def parse(data: bytes) -> list[hyperframe.frame.Frame]:
    """Raw frames: h2 as a client refuses a RST_STREAM after a GOAWAY, though RFC 9113 §6.8
    lets it arrive."""
    out = []
    while data:
        frame, length = hyperframe.frame.Frame.parse_frame_header(memoryview(data[:9]))
        frame.parse_body(memoryview(data[9 : 9 + length]))
        out.append(frame)
        data = data[9 + length :]
    return out


class Frames:
    """A decoder for ``Sends`` that gives the raw frames."""

    def events(self, data: bytes) -> list[hyperframe.frame.Frame]:
        return parse(data)


def test_stream_ids_near_the_end_get_a_graceful_goaway_and_the_stream_finishes() -> None:
    pb = playbook()
    client = H2ClientPeer()
    client.conn.highest_outbound_stream_id = STREAM_ID_DRAIN - 2
    last, first = client.request(b"GET", b"/v1/stream")
    late, second = client.request(b"GET", b"/v1/late")
    frames = Frames()

    def drained(got: Sequence[Any]) -> None:
        (end,) = [f for f in got if isinstance(f, hyperframe.frame.GoAwayFrame)]
        assert end.error_code == h2.errors.ErrorCodes.NO_ERROR and end.last_stream_id == last
        (refused,) = [f for f in got if isinstance(f, hyperframe.frame.RstStreamFrame)]
        assert refused.stream_id == late
        assert refused.error_code == REFUSED

    pb >> data(1, client.preface() + first + second)
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, frames, lambda got: isinstance(got[0], hyperframe.frame.SettingsFrame))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)  # the late stream reaches no backend
    pb << Sends(1, frames, drained)
    backend = H1BackendPeer()
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(-1, backend, h1_request(b"GET", b"/v1/stream"))
    pb << SetTimer(timer=("head", 1), at=60.0)
    # The stream below the GOAWAY's last id is served in full, then the connection closes.
    pb >> data(-1, backend.sse_head() + backend.chunk(b"data: hi\n\n") + backend.end())
    pb << CancelTimer(timer=("head", 1))
    pb << Sends(1, frames, lambda got: [type(f) for f in got] == [hyperframe.frame.HeadersFrame])
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << (body := Sends(1, frames))
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << CloseConnection(conn=1)
    pb.done()
    got = body.events
    assert b"".join(f.data for f in got if isinstance(f, hyperframe.frame.DataFrame)) == (
        b"data: hi\n\n"
    )
    assert "END_STREAM" in got[-1].flags and got[-1].stream_id == last


# -- zero-window slow reader -------------------------------------------------------------------


def test_zero_window_reader_keeps_its_stream_at_bounded_memory() -> None:
    limits = Limits(stream_buffer=64 * 1024)
    pb = Playbook(default_config(limits=limits))
    pb.accept(1)
    client = H2ClientPeer()
    client.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    _, backend = sse_stream(pb, client)
    chunk = b"data: " + b"y" * 4000 + b"\n\n"
    pb >> data(-1, backend.chunk(chunk))
    # The client's window is shut: the stream waits for it (the window timer) and the
    # backend connection stops being read.
    pb << SetTimer(timer=("window", 1), at=60.0)
    pb << PauseReading(conn=-1)
    pb.done()
    (stats,) = pb.core.statistics().streams
    assert stats.upstream_paused and stats.response_buffered <= limits.stream_buffer
    # Nothing is unwritten on the socket (the bytes wait in the stream's queue), so the send
    # timeout does not cut it: the stream stays, costing at most ``stream_buffer``.

"""HTTP/2 attack defences (core/http2/h2guard.py, wired in core/http2/h2.py): bytes from a real h2
client, raw frames from hyperframe where h2 refuses to produce them; every test checks both the
answer to the abuse and what happened to the other streams and backend connections."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import h2.errors
import h2.events
import h2.settings
import h11
import hpack
import hyperframe.frame
import pytest
from playbook import H1BackendPeer, H2ClientPeer, Playbook, default_config, h2_sse_stream

from muxproxy.config import Limits
from muxproxy.core.commands import CloseConnection, Log, PauseReading
from muxproxy.core.http2.h2guard import STREAM_ID_DRAIN, H2Guard

CALM = h2.errors.ErrorCodes.ENHANCE_YOUR_CALM


class Book(Playbook):
    seen = 0

    def fresh(self) -> bytes:
        """Bytes sent to the client since the last call (each byte is decoded once)."""
        new, self.seen = self.log[self.seen :], len(self.log)
        return self.take(1, new)


def playbook(**limits: int) -> Book:
    pb = Book(default_config(limits=attrs.evolve(Limits(), **limits)))
    pb.accept(1)
    return pb


def goaway(client: H2ClientPeer, pb: Book) -> h2.events.ConnectionTerminated | None:
    events = client.events(pb.fresh())
    ends = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
    return ends[0] if ends else None


def closed_conns(pb: Book) -> set[int]:
    return {c.conn for c in pb.log if isinstance(c, CloseConnection)}


# -- rapid reset (CVE-2023-44487) ------------------------------------------------------------


def test_rapid_reset_cancels_each_backend_then_gets_goaway_enhance_your_calm() -> None:
    pb = playbook(h2_reset_budget=5)
    client = H2ClientPeer()
    _, victim_up = h2_sse_stream(pb, client, data=client.preface())
    for i in range(6):
        sid, data = client.request(b"GET", f"/v1/models/{i}".encode())
        client.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
        pb.receive(1, data + client.conn.data_to_send())
    ups = [o.conn for o in pb.opens() if o.conn != victim_up]
    assert len(ups) == 6
    # Every reset request's backend connection was closed at once.
    assert set(ups) <= closed_conns(pb)
    end = goaway(client, pb)
    assert end is not None and end.error_code == CALM
    # The connection closes, and the stream still running on it is cancelled upstream too.
    assert {1, victim_up} <= closed_conns(pb)
    assert any(isinstance(c, Log) and c.event == "client_h2_abuse" for c in pb.log)
    assert pb.core.statistics().streams == []


def test_cancels_paid_back_by_completed_responses_never_trip_the_budget() -> None:
    pb = playbook(h2_reset_budget=2)
    client = H2ClientPeer()
    pb.receive(1, client.preface())
    for i in range(10):
        # One cancelled request, then one completed: a client that cancels half the time.
        sid, data = client.request(b"GET", f"/cancel/{i}".encode())
        client.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
        pb.receive(1, data + client.conn.data_to_send())
        sid, up = h2_sse_stream(pb, client)
        pb.receive(up, b"0\r\n\r\n")  # the last chunk of the chunked SSE response
    assert goaway(client, pb) is None
    assert 1 not in closed_conns(pb)


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
    sid, up = h2_sse_stream(pb, client, data=client.preface())
    assert sid == 1
    # Deliver the response head; the client's own SETTINGS ACK etc. are within budget.
    client.events(pb.fresh())
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
    pb.receive(1, client.conn.data_to_send())
    end = goaway(client, pb)
    assert end is not None and end.error_code == CALM
    assert kind.encode() in (end.additional_data or b"")
    assert {1, up} <= closed_conns(pb)


def test_pings_are_paid_back_by_a_streaming_response() -> None:
    pb = playbook(h2_control_frame_budget=20)
    client = H2ClientPeer()
    _, up = h2_sse_stream(pb, client, data=client.preface())
    for i in range(200):
        # One token event and one keep-alive PING per token: never a flood.
        pb.receive(up, b"%x\r\ndata: tok\n\n\r\n" % len(b"data: tok\n\n"))
        client.events(pb.fresh())
        client.conn.ping(i.to_bytes(8, "big"))
        pb.receive(1, client.conn.data_to_send())
    assert goaway(client, pb) is None
    assert 1 not in closed_conns(pb)


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
    pb.receive(1, client.preface())
    block = hpack.Encoder().encode(
        [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")]
    )
    headers = hyperframe.frame.HeadersFrame(1, data=block[:4], flags=["END_STREAM"])
    frames = [headers.serialize()]
    for _ in range(100):
        # h2 buffers at most 64 CONTINUATION frames (at most 64 x 16 KiB) then gives up.
        frames.append(hyperframe.frame.ContinuationFrame(1, data=b"\x00" * 100).serialize())
    pb.receive(1, b"".join(frames))
    end = goaway(client, pb)
    assert end is not None and end.error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR
    assert pb.opens() == []
    assert 1 in closed_conns(pb)


def test_hpack_bomb_over_the_header_list_limit_gets_enhance_your_calm() -> None:
    pb = playbook()
    client = H2ClientPeer()
    pb.receive(1, client.preface())
    # 80 references to one 4 KiB dynamic-table entry: ~4 KiB on the wire, 320 KiB decoded,
    # past HARD_LIMIT_FACTOR times max_request_head (4 x 64 KiB), where decoding stops.
    _, data = client.request(headers=[(b"x-bomb", b"a" * 4000)] * 80)
    assert len(data) < 8000
    pb.receive(1, data)
    end = goaway(client, pb)
    assert end is not None and end.error_code == CALM
    assert pb.opens() == []
    assert any(isinstance(c, Log) and c.event == "client_h2_abuse" for c in pb.log)


# -- refused streams ---------------------------------------------------------------------------


def ignore_stream_limit(client: H2ClientPeer) -> None:
    """Make the peer open streams past our MAX_CONCURRENT_STREAMS, as a client does before it
    saw our SETTINGS (or as an attacker does)."""
    client.conn.remote_settings.max_concurrent_streams = 2**31 - 1
    client.conn.remote_settings.acknowledge()


def open_streams(pb: Book, client: H2ClientPeer, n: int) -> None:
    """Open ``n`` streams whose backends never answer (connections opened, nothing sent)."""
    data = client.preface()
    for i in range(n):
        data += client.request(b"GET", f"/v1/stream/{i}".encode())[1]
    pb.receive(1, data)


def test_streams_refused_past_the_limit_spend_the_budget_then_goaway() -> None:
    pb = playbook(max_concurrent_streams=2, h2_control_frame_budget=300)
    client = H2ClientPeer()
    open_streams(pb, client, 2)
    client.events(pb.fresh())
    ignore_stream_limit(client)
    refused = []
    for i in range(40):
        # One stream too many per read: each is refused alone (RFC 9113 §5.1.2) ...
        sid, data = client.request(b"GET", f"/v1/extra/{i}".encode())
        pb.receive(1, data)
        events = client.events(pb.fresh())
        if any(isinstance(e, h2.events.ConnectionTerminated) for e in events):
            end = next(e for e in events if isinstance(e, h2.events.ConnectionTerminated))
            break
        resets = [e for e in events if isinstance(e, h2.events.StreamReset)]
        assert [(e.stream_id, e.error_code) for e in resets] == [
            (sid, h2.errors.ErrorCodes.REFUSED_STREAM)
        ]
        refused.append(sid)
    else:
        raise AssertionError("no GOAWAY after 40 refused streams")
    # ... and costs ten of the control-frame budget: GOAWAY(ENHANCE_YOUR_CALM) once spent.
    assert 25 <= len(refused) <= 30
    assert end.error_code == CALM and b"refused stream" in (end.additional_data or b"")
    assert len(pb.opens()) == 2
    assert 1 in closed_conns(pb)


def test_a_read_full_of_streams_past_the_limit_gets_goaway_inside_the_read() -> None:
    pb = playbook(max_concurrent_streams=10)
    client = H2ClientPeer()
    open_streams(pb, client, 10)
    client.events(pb.fresh())
    ignore_stream_limit(client)
    data = b""
    for _ in range(5000):
        data += client.request(b"GET", b"/v1/flood")[1]
    pb.receive(1, data)
    end = goaway(client, pb)
    assert end is not None and end.error_code == CALM
    # h2 stopped at the 20th header block of the read: it opened 20 streams, not 5,000.
    assert end.last_stream_id is not None and end.last_stream_id <= 2 * (10 + 20)
    assert len(pb.opens()) == 10
    assert 1 in closed_conns(pb)


def test_streams_refused_before_the_client_saw_our_settings_are_paid_back() -> None:
    pb = playbook(max_concurrent_streams=4, h2_control_frame_budget=100)
    client = H2ClientPeer()
    for _ in range(5):
        # Eight streams at once, four refused, four answered: the client retries the rest.
        open_streams_and_answer(pb, client, 8)
    assert goaway(client, pb) is None
    assert 1 not in closed_conns(pb)


def open_streams_and_answer(pb: Book, client: H2ClientPeer, n: int) -> None:
    before = len(pb.opens())
    data = client.preface() if not before else b""
    for i in range(n):
        data += client.request(b"GET", f"/v1/models/{i}".encode())[1]
    pb.receive(1, data)
    client.events(pb.fresh())
    ignore_stream_limit(client)
    for opened in pb.opens()[before:]:
        pb.opened(opened.conn)
        backend = H1BackendPeer()
        backend.events(pb.take(opened.conn))
        # "Connection: close": the next round opens new backend connections.
        head = h11.Response(
            status_code=200, headers=[("Content-Length", "2"), ("Connection", "close")]
        )
        pb.receive(opened.conn, backend.conn.send(head) + backend.chunk(b"ok") + backend.end())
    client.events(pb.fresh())


# -- stream-id exhaustion --------------------------------------------------------------------


def test_stream_ids_near_the_end_get_a_graceful_goaway_and_the_stream_finishes() -> None:
    pb = playbook()
    client = H2ClientPeer()
    client.conn.highest_outbound_stream_id = STREAM_ID_DRAIN - 2
    last, first = client.request(b"GET", b"/v1/stream")
    late, second = client.request(b"GET", b"/v1/late")
    pb.receive(1, client.preface() + first + second)
    (open_cmd,) = pb.opens()  # the late stream reached no backend
    up = open_cmd.conn
    pb.opened(up)
    backend = H1BackendPeer()
    backend.events(pb.take(up))
    frames = parse(pb.fresh())
    (end,) = [f for f in frames if isinstance(f, hyperframe.frame.GoAwayFrame)]
    assert end.error_code == h2.errors.ErrorCodes.NO_ERROR and end.last_stream_id == last
    (refused,) = [f for f in frames if isinstance(f, hyperframe.frame.RstStreamFrame)]
    assert refused.stream_id == late
    assert refused.error_code == h2.errors.ErrorCodes.REFUSED_STREAM
    # The stream below the GOAWAY's last id is served in full, then the connection closes.
    pb.receive(up, backend.sse_head() + backend.chunk(b"data: hi\n\n") + backend.end())
    frames = parse(pb.fresh())
    assert isinstance(frames[0], hyperframe.frame.HeadersFrame)
    assert b"".join(f.data for f in frames if isinstance(f, hyperframe.frame.DataFrame)) == (
        b"data: hi\n\n"
    )
    assert "END_STREAM" in frames[-1].flags and frames[-1].stream_id == last
    assert 1 in closed_conns(pb)


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


# -- zero-window slow reader -------------------------------------------------------------------


def test_zero_window_reader_keeps_its_stream_at_bounded_memory() -> None:
    limits = Limits(stream_buffer=64 * 1024)
    pb = Book(default_config(limits=limits))
    pb.accept(1)
    client = H2ClientPeer()
    client.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    _, up = h2_sse_stream(pb, client, data=client.preface())
    chunk = b"data: " + b"y" * 4000 + b"\n\n"
    wire = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
    paused = False
    for _ in range(100):
        commands = pb.receive(up, wire)
        client.events(pb.fresh())
        paused = paused or PauseReading(conn=up) in commands
        if paused:
            break
    assert paused
    (stats,) = pb.core.statistics().streams
    assert stats.upstream_paused and stats.response_buffered <= limits.stream_buffer
    # Nothing is unwritten on the socket (the bytes wait in the stream's queue), so the send
    # timeout does not cut it: the stream stays, costing at most ``stream_buffer``.
    assert 1 not in closed_conns(pb) and up not in closed_conns(pb)

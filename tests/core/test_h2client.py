"""The HTTP/2 upstream adapter (core/http2/h2client.py, core/upstream/h2pool.py), driven with bytes
only.

Real h2 peers play the client and the backend: every frame the proxy sends is decoded by an
``h2.H2Connection``, every frame it receives is built by one.
"""

from __future__ import annotations

from typing import Any

import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import pytest
from hyperframe.frame import GoAwayFrame
from playbook import (
    BACKEND,
    H1ClientPeer,
    H2BackendPeer,
    H2Client,
    Playbook,
    default_config,
)

from muxproxy.config import Config, Limits, Server, Upstream
from muxproxy.core.commands import CloseConnection, Log, OpenConnection, SendData, SetTimer

CHAT = b"/v1/chat/completions"


def h2_config(**limits: Any) -> Config:
    group = Upstream(
        name="default", servers=(Server(address=BACKEND, protocol="h2", max_connections=2),)
    )
    config = default_config(upstreams={"default": group})
    return attrs.evolve(config, limits=Limits(**limits)) if limits else config


def connect_backend(pb: Playbook, conn: int, *, max_streams: int = 100) -> H2BackendPeer:
    assert OpenConnection in {type(c) for c in pb.log}
    pb.opened(conn)
    backend = H2BackendPeer(pb, conn, max_streams=max_streams, ack=False)
    backend.read()  # our preface and SETTINGS
    backend.flush()  # its SETTINGS: streams may start now
    return backend


def requests(events: list[h2.events.Event]) -> list[h2.events.RequestReceived]:
    return [e for e in events if isinstance(e, h2.events.RequestReceived)]


def respond(backend: H2BackendPeer, sid: int, *, end: bool = False) -> None:
    backend.conn.send_headers(
        sid, [(b":status", b"200"), (b"content-type", b"text/event-stream")], end_stream=end
    )
    backend.flush()


def test_two_client_connections_share_one_backend_connection() -> None:
    pb = Playbook(h2_config())
    one, two = H2Client(pb, 1), H2Client(pb, 2)
    a = one.request()
    b = two.request()
    assert [o.conn for o in pb.opens()] == [-1], "the second stream waits for the first conn"
    backend = connect_backend(pb, -1)
    got = requests(backend.read())
    assert len(got) == 2
    fields = dict(got[0].headers)
    assert fields[b":method"] == b"POST" and fields[b":path"] == CHAT
    assert fields[b":authority"] == b"proxy.example" and fields[b":scheme"] == b"http"
    assert b"host" not in fields and b"transfer-encoding" not in fields
    for req, client, sid in ((got[0], one, a), (got[1], two, b)):
        respond(backend, req.stream_id)
        backend.conn.send_data(req.stream_id, b"data: tok\n\n", end_stream=True)
        backend.flush()
        events = client.read()
        assert any(isinstance(e, h2.events.StreamEnded) and e.stream_id == sid for e in events)
        body = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
        assert body == b"data: tok\n\n"
    assert len(pb.opens()) == 1
    assert not any(isinstance(c, CloseConnection) and c.conn == -1 for c in pb.log)
    assert pb.core.statistics().upstream_connections == 1


def test_max_concurrent_streams_opens_a_second_connection() -> None:
    pb = Playbook(h2_config())
    client = H2Client(pb, 1)
    client.request()
    first = connect_backend(pb, -1, max_streams=1)
    assert len(requests(first.read())) == 1
    client.request()
    assert [o.conn for o in pb.opens()] == [-1, -2]
    second = connect_backend(pb, -2, max_streams=1)
    assert len(requests(second.read())) == 1
    # max_connections = 2: a third request waits for a free stream, no third connection.
    client.request()
    assert len(pb.opens()) == 2
    # The first stream ends: the waiting request takes its place on the first connection.
    respond(first, 1, end=True)
    assert len(requests(first.read())) == 1


def test_goaway_lets_in_flight_streams_finish_and_new_ones_go_elsewhere() -> None:
    pb = Playbook(h2_config())
    client = H2Client(pb, 1)
    a = client.request()
    backend = connect_backend(pb, -1)
    (req,) = requests(backend.read())
    respond(backend, req.stream_id)
    # (h2 sends nothing after its own GOAWAY, so the frame is built by hyperframe.)
    goaway = GoAwayFrame(0)
    goaway.last_stream_id = req.stream_id
    pb.receive(-1, goaway.serialize())
    # A new request opens a new connection rather than using the draining one.
    client.request()
    assert [o.conn for o in pb.opens()] == [-1, -2]
    # The in-flight stream still finishes on the old connection, which then closes.
    backend.conn.send_data(req.stream_id, b"data: last\n\n", end_stream=True)
    backend.flush()
    events = client.read()
    assert any(isinstance(e, h2.events.StreamEnded) and e.stream_id == a for e in events)
    assert any(isinstance(c, CloseConnection) and c.conn == -1 for c in pb.log)


def test_backend_data_acknowledged_only_as_the_client_takes_it() -> None:
    # stream_buffer 32 KiB: reads of 16 KiB, high water 16 KiB, a 16 KiB stream window.
    pb = Playbook(h2_config(stream_buffer=32 * 1024))
    client = H2Client(pb, 1)
    client.request()
    backend = connect_backend(pb, -1)
    (req,) = requests(backend.read())
    sid = req.stream_id
    respond(backend, sid)
    assert backend.conn.local_flow_control_window(sid) == 16 * 1024

    def window_updates() -> int:
        events = backend.read()
        return sum(
            e.delta for e in events if isinstance(e, h2.events.WindowUpdated) and e.stream_id == sid
        )

    def send_window() -> None:
        for _ in range(2):
            backend.conn.send_data(sid, b"x" * 8_000)
            backend.flush()

    # Below high water: each DATA frame is acknowledged as it is handed to the client side.
    send_window()
    assert window_updates() == 16_000
    # The client takes nothing: past high water the acknowledgements are withheld.
    send_window()
    assert window_updates() == 0
    assert backend.conn.local_flow_control_window(sid) == 16 * 1024 - 16_000
    (entry,) = pb.core.statistics().streams
    assert entry.upstream_paused
    # The client socket takes everything: the withheld window goes back to the backend.
    pending = sum(len(c.data) for c in pb.log if isinstance(c, SendData) and c.conn == 1)
    pb.sent(1, pending)
    assert window_updates() == 16_000
    (entry,) = pb.core.statistics().streams
    assert not entry.upstream_paused


def test_client_reset_cancels_the_backend_stream_only() -> None:
    pb = Playbook(h2_config())
    client = H2Client(pb, 1)
    a = client.request()
    b = client.request()
    backend = connect_backend(pb, -1)
    first, second = requests(backend.read())
    respond(backend, first.stream_id)
    client.peer.conn.reset_stream(a, h2.errors.ErrorCodes.CANCEL)
    client.send()
    events = backend.read()
    resets = [e for e in events if isinstance(e, h2.events.StreamReset)]
    assert [(r.stream_id, r.error_code) for r in resets] == [
        (first.stream_id, h2.errors.ErrorCodes.CANCEL)
    ]
    assert not any(isinstance(c, CloseConnection) for c in pb.log)
    # The other stream goes on.
    respond(backend, second.stream_id, end=True)
    events = client.read()
    assert any(isinstance(e, h2.events.StreamEnded) and e.stream_id == b for e in events)


def test_backend_reset_mid_stream_resets_the_client_stream() -> None:
    pb = Playbook(h2_config())
    client = H2Client(pb, 1)
    a = client.request()
    backend = connect_backend(pb, -1)
    (req,) = requests(backend.read())
    respond(backend, req.stream_id)
    backend.conn.reset_stream(req.stream_id, h2.errors.ErrorCodes.INTERNAL_ERROR)
    backend.flush()
    events = client.read()
    resets = [e for e in events if isinstance(e, h2.events.StreamReset)]
    assert [(r.stream_id, r.error_code) for r in resets] == [
        (a, h2.errors.ErrorCodes.INTERNAL_ERROR)
    ]


def test_trailers_reach_h2_and_h1_clients() -> None:
    pb = Playbook(h2_config())
    client = H2Client(pb, 1)
    a = client.request(headers=[(b"content-type", b"application/grpc"), (b"te", b"trailers")])
    backend = connect_backend(pb, -1)
    (req,) = requests(backend.read())
    assert dict(req.headers)[b"te"] == b"trailers"
    backend.conn.send_headers(
        req.stream_id, [(b":status", b"200"), (b"content-type", b"application/grpc")]
    )
    backend.conn.send_data(req.stream_id, b"\x00\x00\x00\x00\x01y")
    backend.conn.send_headers(
        req.stream_id, [(b"grpc-status", b"5"), (b"grpc-message", b"gone")], end_stream=True
    )
    backend.flush()
    events = client.read()
    (trailers,) = [e for e in events if isinstance(e, h2.events.TrailersReceived)]
    assert trailers.stream_id == a
    assert dict(trailers.headers) == {b"grpc-status": b"5", b"grpc-message": b"gone"}

    # An HTTP/1.1 client gets them as chunked trailers.
    h1 = H1ClientPeer()
    pb.accept(2)
    pb.receive(2, h1.request("POST", "/x", [("te", "trailers")], body=b"{}"))
    (req,) = requests(backend.read())
    backend.conn.send_headers(req.stream_id, [(b":status", b"200")])
    backend.conn.send_data(req.stream_id, b"body")
    backend.conn.send_headers(req.stream_id, [(b"x-done", b"yes")], end_stream=True)
    backend.flush()
    out = h1.events(pb.take(2))
    assert out[-1].headers == [(b"x-done", b"yes")]


def _finish_one_stream(pb: Playbook) -> H2BackendPeer:
    client = H2Client(pb, 1)
    sid = client.request()
    backend = connect_backend(pb, -1)
    (req,) = requests(backend.read())
    respond(backend, req.stream_id)
    backend.conn.send_data(req.stream_id, b"data: tok\n\n", end_stream=True)
    backend.flush()
    assert any(isinstance(e, h2.events.StreamEnded) and e.stream_id == sid for e in client.read())
    return backend


def _pool_timer(pb: Playbook) -> SetTimer:
    return [c for c in pb.log if isinstance(c, SetTimer) and c.timer == ("pool", -1)][-1]


def test_idle_backend_connection_is_pinged_then_closed_after_the_idle_timeout() -> None:
    config = h2_config()
    group = attrs.evolve(config.upstreams["default"], pool_idle_timeout=30.0)
    pb = Playbook(attrs.evolve(config, upstreams={"default": group}))
    backend = _finish_one_stream(pb)
    # RFC 9113 §6.7: an idle connection is PINGed, a third of the idle timeout apart.
    timer = _pool_timer(pb)
    assert timer.at == pytest.approx(pb.now + 10.0)
    pb.now = timer.at
    pb.wakeup("pool", -1)
    pings = [e for e in backend.read() if isinstance(e, h2.events.PingReceived)]
    assert len(pings) == 1
    backend.flush()  # h2 answers the PING with an ACK
    assert CloseConnection(conn=-1) not in pb.log
    while CloseConnection(conn=-1) not in pb.log:
        timer = _pool_timer(pb)
        pb.now = timer.at
        pb.wakeup("pool", -1)
        backend.read()
        backend.flush()
        assert pb.now <= 30.0
    assert pb.now == pytest.approx(30.0)  # closed at the idle timeout, not before


def test_backend_that_does_not_answer_a_ping_is_closed() -> None:
    pb = Playbook(h2_config())
    backend = _finish_one_stream(pb)
    timer = _pool_timer(pb)
    pb.now = timer.at
    pb.wakeup("pool", -1)
    assert any(isinstance(e, h2.events.PingReceived) for e in backend.read())
    # No ACK comes back (the backend is wedged): the next tick closes the connection.
    timer = _pool_timer(pb)
    pb.now = timer.at
    assert CloseConnection(conn=-1) in pb.wakeup("pool", -1)
    assert any(isinstance(c, Log) and c.event == "upstream_ping_timeout" for c in pb.log)


# -- GOAWAY at any moment, a backend that never sends SETTINGS, empty DATA frames --------------

OTHER = "127.0.0.1:9002"


def two_server_config() -> Config:
    servers = tuple(Server(address=a, protocol="h2") for a in (BACKEND, OTHER))
    return default_config(upstreams={"default": Upstream(name="default", servers=servers)})


def goaway_frame(last_stream_id: int, code: h2.errors.ErrorCodes) -> bytes:
    # (h2 sends nothing after its own GOAWAY, so the frame is built by hyperframe.)
    frame = GoAwayFrame(0)
    frame.last_stream_id = last_stream_id
    frame.error_code = code
    return frame.serialize()


def settings_then_goaway(pb: Playbook, conn: int, code: h2.errors.ErrorCodes) -> H2BackendPeer:
    """A backend shutting down: its SETTINGS and a GOAWAY(last_stream_id 0) in one write."""
    pb.opened(conn)
    backend = H2BackendPeer(pb, conn, max_streams=100, ack=False)
    backend.read()
    pb.receive(conn, backend.conn.data_to_send() + goaway_frame(0, code))
    return backend


def status_of(events: list[h2.events.Event], sid: int) -> int:
    (head,) = [
        e for e in events if isinstance(e, h2.events.ResponseReceived) and e.stream_id == sid
    ]
    return int(dict(head.headers)[b":status"])


def ended(events: list[h2.events.Event], sid: int) -> bool:
    return any(isinstance(e, h2.events.StreamEnded) and e.stream_id == sid for e in events)


def assert_served_by_the_other_server(
    pb: Playbook, client: H2Client, sid: int, first: OpenConnection
) -> None:
    """The last connection opened goes to another server than ``first`` and serves ``sid``."""
    second = pb.opens()[-1]
    assert second.origin != first.origin
    backend = connect_backend(pb, second.conn)
    (req,) = requests(backend.read())
    respond(backend, req.stream_id, end=True)
    events = client.read()
    assert status_of(events, sid) == 200 and ended(events, sid)


@pytest.mark.parametrize(
    "code", [h2.errors.ErrorCodes.NO_ERROR, h2.errors.ErrorCodes.INTERNAL_ERROR]
)
def test_goaway_with_the_first_settings_starts_no_stream_and_fails_over(
    code: h2.errors.ErrorCodes,
) -> None:
    pb = Playbook(two_server_config())
    client = H2Client(pb, 1)
    sid = client.request()
    (first,) = pb.opens()
    gone = settings_then_goaway(pb, first.conn, code)
    assert requests(gone.read()) == [], "no stream may start on a connection that went away"
    assert CloseConnection(conn=first.conn) in pb.log
    assert any(isinstance(c, Log) and c.event == "upstream_goaway" for c in pb.log)
    # The request was never sent: it goes to the other server (next_upstream "error").
    assert_served_by_the_other_server(pb, client, sid, first)


def test_goaway_before_the_first_request_leaves_the_next_request_a_new_connection() -> None:
    pb = Playbook(h2_config())
    client = H2Client(pb, 1)
    first = client.request()
    settings_then_goaway(pb, -1, h2.errors.ErrorCodes.NO_ERROR)
    # One server, nothing to fail over to: the request that waited for it gets a 502 ...
    events = client.read()
    assert status_of(events, first) == 502 and ended(events, first)
    # ... and the proxy goes on: the next request opens a new connection and is served.
    second = client.request()
    assert [o.conn for o in pb.opens()] == [-1, -2]
    backend = connect_backend(pb, -2)
    (req,) = requests(backend.read())
    respond(backend, req.stream_id, end=True)
    events = client.read()
    assert status_of(events, second) == 200 and ended(events, second)


def test_stream_refused_by_goaway_is_retried_on_a_new_connection() -> None:
    pb = Playbook(h2_config())
    client = H2Client(pb, 1)
    sid = client.request()  # a POST: not idempotent, but never processed (RFC 9113 §8.7)
    old = connect_backend(pb, -1)
    (refused,) = requests(old.read())
    pb.receive(-1, goaway_frame(refused.stream_id - 1, h2.errors.ErrorCodes.NO_ERROR))
    assert [o.conn for o in pb.opens()] == [-1, -2]
    assert CloseConnection(conn=-1) in pb.log
    retries = [c for c in pb.log if isinstance(c, Log) and c.event == "retry"]
    assert [r.fields["condition"] for r in retries] == ["stale_connection"]
    backend = connect_backend(pb, -2)
    (req,) = requests(backend.read())
    respond(backend, req.stream_id)
    backend.conn.send_data(req.stream_id, b"data: tok\n\n", end_stream=True)
    backend.flush()
    events = client.read()
    assert status_of(events, sid) == 200 and ended(events, sid)
    body = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
    assert body == b"data: tok\n\n"


def test_frames_after_goaway_in_the_same_read_still_reach_the_stream() -> None:
    pb = Playbook(h2_config())
    client = H2Client(pb, 1)
    sid = client.request()
    backend = connect_backend(pb, -1)
    (req,) = requests(backend.read())
    backend.conn.send_headers(req.stream_id, [(b":status", b"200")])
    backend.conn.send_data(req.stream_id, b"one ")
    before = backend.conn.data_to_send()
    backend.conn.send_data(req.stream_id, b"two", end_stream=True)
    after = backend.conn.data_to_send()
    pb.receive(-1, before + goaway_frame(req.stream_id, h2.errors.ErrorCodes.NO_ERROR) + after)
    events = client.read()
    assert status_of(events, sid) == 200 and ended(events, sid)
    assert not any(isinstance(e, h2.events.StreamReset) for e in events)
    body = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
    assert body == b"one two"
    # Drained: the connection closes once its last stream is done.
    assert CloseConnection(conn=-1) in pb.log


def fire_due_timer(pb: Playbook, timer: tuple[str, int]) -> list[Any]:
    """Move the clock to ``timer``'s deadline and fire it."""
    (armed,) = [c for c in pb.log if isinstance(c, SetTimer) and c.timer == timer][-1:]
    pb.now = armed.at
    return pb.wakeup(*timer)


def test_backend_silent_after_connect_is_closed_and_a_later_request_gets_a_new_one() -> None:
    pb = Playbook(h2_config())
    client = H2Client(pb, 1)
    first = client.request()
    pb.opened(-1)  # up at TCP; the backend never sends its SETTINGS (RFC 9113 §3.4)
    assert CloseConnection(conn=-1) in fire_due_timer(pb, ("pool", -1))
    assert pb.now == pb.core.config.timeouts.connect
    assert any(isinstance(c, Log) and c.event == "upstream_start_timeout" for c in pb.log)
    # The request that waited for it fails as a timeout, with one server to try: 504.
    events = client.read()
    assert status_of(events, first) == 504 and ended(events, first)
    # 100 s later a request is not stuck behind it: a new connection serves it.
    pb.now += 100
    second = client.request()
    assert [o.conn for o in pb.opens()] == [-1, -2]
    backend = connect_backend(pb, -2)
    (req,) = requests(backend.read())
    respond(backend, req.stream_id, end=True)
    events = client.read()
    assert status_of(events, second) == 200 and ended(events, second)


def test_request_waiting_for_a_silent_backend_is_retried_on_the_next_server() -> None:
    pb = Playbook(two_server_config())
    client = H2Client(pb, 1)
    sid = client.request()
    (first,) = pb.opens()
    pb.opened(first.conn)
    fire_due_timer(pb, ("pool", first.conn))
    assert CloseConnection(conn=first.conn) in pb.log
    retries = [c for c in pb.log if isinstance(c, Log) and c.event == "retry"]
    assert [r.fields["condition"] for r in retries] == ["timeout"]
    assert_served_by_the_other_server(pb, client, sid, first)


def test_empty_data_frame_ending_the_stream_is_not_sent_on_as_an_empty_frame() -> None:
    pb = Playbook(h2_config())
    client = H2Client(pb, 1)
    sid = client.request()
    backend = connect_backend(pb, -1)
    (req,) = requests(backend.read())
    respond(backend, req.stream_id)
    backend.conn.send_data(req.stream_id, b"data: tok\n\n")
    backend.flush()
    backend.conn.send_data(req.stream_id, b"", pad_length=9)  # empty but flow-controlled
    backend.flush()
    backend.conn.end_stream(req.stream_id)  # an empty DATA frame with END_STREAM
    backend.flush()
    events = client.read()
    data = [e for e in events if isinstance(e, h2.events.DataReceived) and e.stream_id == sid]
    assert [e.data for e in data if not e.stream_ended] == [b"data: tok\n\n"]
    assert ended(events, sid)


def test_connection_that_used_every_stream_id_drains_and_the_next_request_opens_another() -> None:
    pb = Playbook(h2_config())
    client = H2Client(pb, 1)
    a = client.request()
    backend = connect_backend(pb, -1)
    (req,) = requests(backend.read())
    # As if 2**30 streams had gone by: the next one gets the last id (RFC 9113 §5.1.1).
    upstream: Any = pb.core.upstreams[-1]
    upstream.client.conn.highest_outbound_stream_id = 2**31 - 3
    respond(backend, req.stream_id, end=True)
    b = client.request()
    (last,) = requests(backend.read())
    assert last.stream_id == 2**31 - 1
    assert any(isinstance(c, Log) and c.event == "upstream_stream_ids_used" for c in pb.log)
    # No id is left on it: the next request opens a new connection.
    c = client.request()
    assert [o.conn for o in pb.opens()] == [-1, -2]
    fresh = connect_backend(pb, -2)
    (other,) = requests(fresh.read())
    respond(fresh, other.stream_id, end=True)
    # The last stream still finishes on the old connection, which then closes.
    respond(backend, last.stream_id, end=True)
    events = client.read()
    for sid in (a, b, c):
        assert status_of(events, sid) == 200 and ended(events, sid)
    assert CloseConnection(conn=-1) in pb.log


@pytest.mark.parametrize(
    "fields",
    [
        [(b":status", b"200"), (b"x-a", b"a\r\ninjected: 1")],  # a header injection
        [(b":status", b"200"), (b"x-a", b"a\x0cb")],
        [(b":status", b"200"), (b"x-a", b" a")],
        [(b":status", b"200"), (b"X-Upper", b"a")],
        [(b":status", b"200"), (b"bad name", b"a")],
        [(b":status", b"2xx")],
        [(b":status", b"+200")],
    ],
    ids=["crlf", "form-feed", "leading-space", "upper-case", "space-in-name", "2xx", "+200"],
)
def test_malformed_backend_response_head_is_a_502_never_relayed(fields) -> None:
    # RFC 9113 §8.1.1, §8.2.1: h2 hands us the block unvalidated; a malformed response is a
    # stream error (RST_STREAM) and the client gets a 502, never the fields (h11 would refuse
    # to write them, and CR LF in a value would inject a header).
    pb = Playbook(h2_config())
    h1 = H1ClientPeer()
    pb.accept(1)
    pb.receive(1, h1.request("POST", "/x", body=b"{}"))
    backend = connect_backend(pb, -1)
    (req,) = requests(backend.read())
    backend.conn.config.validate_outbound_headers = False
    backend.conn.config.normalize_outbound_headers = False
    backend.conn.send_headers(req.stream_id, fields)
    backend.flush()
    (response, *_) = h1.events(pb.take(1))
    assert response.status_code == 502
    assert b"injected" not in pb.take(1)
    resets = [e for e in backend.read() if isinstance(e, h2.events.StreamReset)]
    assert [e.error_code for e in resets] == [h2.errors.ErrorCodes.PROTOCOL_ERROR]

"""Timeouts that blame the client: a zero-window HTTP/2 reader (``send``), a slow request body
(``client_header``: 408 or RST_STREAM, never a 504), the next request head on a kept-alive
connection (``client_header`` once its first byte came). Bytes from real h11/h2 peers; time
moves only when a test says so, and a timer fires only when its ``Wakeup`` is fed."""

from __future__ import annotations

import h2.errors
import h2.events
import h2.settings
import h11
from playbook import H1ClientPeer, H2ClientPeer, default_config, h2_sse_stream
from test_h2_slowloris import data_of, open_upload, resets, sse_chunk
from test_h2guard import Book, closed_conns, parse
from test_routing_exchange import BODY_KEY, Rig, fleet

from muxproxy.config import Limits, Timeouts
from muxproxy.core.commands import CloseConnection, Log, PauseReading, SetTimer
from muxproxy.core.exchange.exchange import Phase

CANCEL = h2.errors.ErrorCodes.CANCEL


def exchange_of(pb: Book, stream: int) -> int:
    (ident,) = [i for i, ex in pb.core.exchanges.items() if ex.stream == stream]
    return ident


def timers(commands: list, kind: str) -> list[SetTimer]:
    return [c for c in commands if isinstance(c, SetTimer) and c.timer[0] == kind]


def logs(pb: Book, event: str) -> list[Log]:
    return [c for c in pb.log if isinstance(c, Log) and c.event == event]


# -- zero-window reader ----------------------------------------------------------------------


def zero_window_book(**timeouts: float) -> tuple[Book, H2ClientPeer]:
    """A client whose streams start with a closed window (SETTINGS_INITIAL_WINDOW_SIZE 0);
    a small stream buffer, so that the backend is paused after a few chunks."""
    config = default_config(timeouts=Timeouts(**timeouts), limits=Limits(stream_buffer=64 * 1024))
    pb = Book(config)
    pb.accept(1)
    client = H2ClientPeer()
    client.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    return pb, client


def open_window(pb: Book, client: H2ClientPeer, sid: int, size: int) -> None:
    client.conn.increment_flow_control_window(size, stream_id=sid)
    pb.receive(1, client.conn.data_to_send())


CHUNK = sse_chunk(b"data: " + b"y" * 4000 + b"\n\n")


def test_zero_window_reader_is_reset_after_the_send_timeout_and_others_go_on() -> None:
    pb, client = zero_window_book(send=60.0, read=30.0)
    stuck, stuck_up = h2_sse_stream(pb, client, data=client.preface())
    good, good_up = h2_sse_stream(pb, client)
    open_window(pb, client, good, 1 << 20)
    client.events(pb.fresh())
    # The stuck stream's first chunk meets the closed window: its backend is paused at once.
    commands = pb.receive(stuck_up, CHUNK)
    assert [t.at for t in timers(commands, "window")] == [60.0]
    assert PauseReading(conn=stuck_up) in commands
    for _ in range(10):  # what the backend had in flight waits for the window too
        assert not timers(pb.receive(stuck_up, CHUNK), "window")  # lazy: nothing per chunk
    # The backend is silent because we paused it: its read timeout does not blame it.
    pb.now = 30.0
    pb.wakeup("read", exchange_of(pb, stuck))
    pb.receive(good_up, sse_chunk(b"data: tok\n\n"))
    pb.now = 59.9
    pb.wakeup("window", 1)
    frames = parse(pb.fresh())
    assert resets(frames) == {}
    assert data_of(frames, good) == b"data: tok\n\n"
    pb.now = 60.0
    pb.wakeup("window", 1)
    # RST_STREAM(CANCEL) on the stuck stream, its backend request aborted; nothing else.
    assert resets(parse(pb.fresh())) == {stuck: CANCEL}
    assert stuck_up in closed_conns(pb)
    assert 1 not in closed_conns(pb) and good_up not in closed_conns(pb)
    assert [log.fields["stream"] for log in logs(pb, "stream_send_timeout")] == [stuck]
    pb.receive(good_up, sse_chunk(b"data: more\n\n"))
    assert data_of(parse(pb.fresh()), good) == b"data: more\n\n"


def test_stream_whose_window_moves_is_not_cut() -> None:
    pb, client = zero_window_book(send=60.0)
    sid, up = h2_sse_stream(pb, client, data=client.preface())
    pb.receive(up, CHUNK)
    client.events(pb.fresh())
    for step in range(1, 6):
        # 100 bytes of window every 50 s: slow, but the window moves within each 60 s.
        pb.now = step * 50.0
        open_window(pb, client, sid, 100)
        pb.wakeup("window", 1)
        assert resets(parse(pb.fresh())) == {}
    assert up not in closed_conns(pb)
    pb.now = 250.0 + 60.0
    pb.wakeup("window", 1)
    assert resets(parse(pb.fresh())) == {sid: CANCEL}


def test_response_complete_upstream_but_unread_is_reset_too() -> None:
    """The backend finished, the client never opened the window: the queued rest (and the
    END_STREAM behind it) is given up with a reset, so the truncation stays visible."""
    pb, client = zero_window_book(send=60.0)
    sid, up = h2_sse_stream(pb, client, data=client.preface())
    pb.receive(up, CHUNK + b"0\r\n\r\n")
    assert not pb.core.exchanges  # the exchange is done, its bytes wait in the stream queue
    pb.now = 60.0
    pb.wakeup("window", 1)
    events = client.events(pb.fresh())
    got = [(e.stream_id, e.error_code) for e in events if isinstance(e, h2.events.StreamReset)]
    assert got == [(sid, CANCEL)]
    assert not any(isinstance(e, h2.events.StreamEnded) for e in events)


# -- slow request body -----------------------------------------------------------------------


def h1_upload(rig: Rig, sent: bytes, length: int = 100) -> tuple[int, H1ClientPeer]:
    """An HTTP/1.1 POST announcing ``length`` body bytes and sending ``sent`` of them."""
    conn, client = rig.connect()
    head = h11.Request(
        method="POST",
        target="/v1/chat/completions",
        headers=[("Host", "a"), ("Content-Length", str(length))],
    )
    wire = (client.conn.send(head) or b"") + (client.conn.send(h11.Data(data=sent)) or b"")
    rig.pb.receive(conn, wire)
    return conn, client


def status_of(rig: Rig, conn: int, client: H1ClientPeer) -> int:
    (response, *_) = client.events(rig.take(conn))
    assert isinstance(response, h11.Response)
    return response.status_code


def test_h1_slow_request_body_gets_408_not_504() -> None:
    rig = Rig(fleet("127.0.0.1:9001", timeouts=Timeouts(response_head=10.0, client_header=30.0)))
    conn, client = h1_upload(rig, b"x" * 10)
    up = rig.last_open().conn
    rig.open(up)
    rig.received(up)
    # The backend waits for the rest of the body: its response-head timer blames nobody.
    rig.pb.now = 10.0
    rig.pb.wakeup("head", 1)
    assert rig.take(conn) == b""
    rig.pb.now = 30.0
    rig.pb.wakeup("body", 1)
    assert status_of(rig, conn, client) == 408
    closed = {c.conn for c in rig.pb.log if isinstance(c, CloseConnection)}
    assert {conn, up} <= closed
    assert rig.logs("request_body_timeout")


def test_response_head_timeout_counts_from_the_end_of_the_request() -> None:
    rig = Rig(fleet("127.0.0.1:9001", timeouts=Timeouts(response_head=10.0, client_header=30.0)))
    conn, client = h1_upload(rig, b"x" * 10)
    up = rig.last_open().conn
    rig.open(up)
    rig.pb.now = 8.0
    rig.pb.receive(conn, client.conn.send(h11.Data(data=b"y" * 90)) or b"")
    rig.pb.receive(conn, client.conn.send(h11.EndOfMessage()) or b"")
    rig.pb.now = 10.0
    rig.pb.wakeup("head", 1)
    assert rig.take(conn) == b""
    assert rig.timer("head").at == 18.0
    rig.pb.now = 18.0
    rig.pb.wakeup("head", 1)
    assert status_of(rig, conn, client) == 504  # now the backend is late


def test_h1_body_buffered_for_a_session_key_times_out() -> None:
    """Sticky ``body:`` source: the exchange holds the body before any backend is chosen."""
    rig = Rig(fleet(sticky=BODY_KEY, timeouts=Timeouts(client_header=30.0)))
    conn, client = h1_upload(rig, b'{"metadat')
    (exchange,) = rig.pb.core.exchanges.values()
    assert exchange.phase is Phase.BUFFERING
    rig.pb.now = 29.0
    rig.pb.wakeup("body", exchange.ident)
    assert rig.take(conn) == b""
    rig.pb.now = 30.0
    rig.pb.wakeup("body", exchange.ident)
    assert status_of(rig, conn, client) == 408
    assert not rig.opens() and not rig.pb.core.exchanges


def test_h2_slow_request_body_gets_reset_not_504() -> None:
    config = default_config(timeouts=Timeouts(response_head=10.0, client_header=30.0))
    pb = Book(config)
    pb.accept(1)
    client = H2ClientPeer()
    pb.receive(1, client.preface())
    sid, up = open_upload(pb, client)
    client.conn.send_data(sid, b"x" * 10)
    pb.receive(1, client.conn.data_to_send())
    pb.fresh()
    ident = exchange_of(pb, sid)
    pb.now = 10.0
    pb.wakeup("head", ident)
    events = client.events(pb.fresh())
    assert not any(isinstance(e, h2.events.ResponseReceived) for e in events)
    pb.now = 30.0
    pb.wakeup("body", ident)
    assert resets(parse(pb.fresh())) == {sid: CANCEL}
    assert up in closed_conns(pb) and 1 not in closed_conns(pb)


# -- the next request head on a kept-alive connection ----------------------------------------


def test_second_request_head_is_bounded_by_client_header_and_gets_408() -> None:
    rig = Rig(
        fleet(
            "127.0.0.1:9001",
            timeouts=Timeouts(client_header=30.0, keepalive_idle=75.0),
            pool_max_idle=4,
        )
    )
    conn, client = rig.request(target="/v1/models")
    rig.serve()
    response, body, _ = rig.response(conn, client)
    assert response.status_code == 200 and body == b"ok"
    client.conn.start_next_cycle()
    assert rig.timer("idle").at == 75.0
    rig.pb.now = 50.0
    commands = rig.pb.receive(conn, b"GET /v1/models HTTP/1.1\r\nHo")
    assert [t.at for t in timers(commands, "header")] == [80.0]
    rig.pb.now = 75.0
    rig.pb.wakeup("idle", conn)  # cancelled: the client is sending a request now
    assert rig.take(conn) == b""
    assert conn not in {c.conn for c in rig.pb.log if isinstance(c, CloseConnection)}
    rig.pb.now = 80.0
    rig.pb.wakeup("header", conn)
    assert rig.take(conn).startswith(b"HTTP/1.1 408 ")
    assert conn in {c.conn for c in rig.pb.log if isinstance(c, CloseConnection)}


def test_idle_kept_alive_connection_still_closes_without_408() -> None:
    rig = Rig(fleet("127.0.0.1:9001", timeouts=Timeouts(keepalive_idle=75.0), pool_max_idle=4))
    conn, client = rig.request(target="/v1/models")
    rig.serve()
    rig.response(conn, client)
    rig.fire("idle")
    assert rig.take(conn) == b""
    assert conn in {c.conn for c in rig.pb.log if isinstance(c, CloseConnection)}

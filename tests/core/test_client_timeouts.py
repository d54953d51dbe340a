"""Timeouts that blame the client: a zero-window HTTP/2 reader (``send``), a slow request body
(``client_header``: 408 or RST_STREAM, never a 504), the next request head on a kept-alive
connection (``client_header`` once its first byte came). Bytes from real h11/h2 peers; time
moves only when a test says so, and a timer fires only when its ``Wakeup`` is fed. Each test
is a whole conversation: every command asserted in order, timers included."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import h2.errors
import h2.events
import h2.settings
import h11
from checks import Check, h1_response, h2_body, h2_resets
from playbook import H1ClientPeer, H2ClientPeer, Playbook, Sends, data, default_config, wakeup
from test_h2_slowloris import body_bytes, data_of, resets, sse_chunk, sse_opened, upload
from test_h2guard import ORIGIN, Book, Frames, preface
from test_routing_exchange import BODY_KEY, fleet
from test_stale_pool import answered, first_request, forwarded

from muxproxy.config import Limits, Timeouts
from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    Log,
    OpenConnection,
    PauseReading,
    ResumeReading,
    SetTimer,
)
from muxproxy.core.exchange.exchange import Phase

CANCEL = h2.errors.ErrorCodes.CANCEL
CHAT = "/v1/chat/completions"
SLOW_BODY = Timeouts(response_head=10.0, client_header=30.0)


def logs(pb: Playbook, event: str) -> list[Log]:
    return [c for c in pb.log if isinstance(c, Log) and c.event == event]


def carries(sid: int, body: bytes) -> Check:
    """Stream ``sid`` gets ``body``, and no stream is reset."""

    def check(events: Sequence[Any]) -> None:
        assert h2_body(events, sid) == body, events
        assert not any(isinstance(e, h2.events.StreamReset) for e in events), events

    return check


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


def open_window(client: H2ClientPeer, sid: int, size: int) -> bytes:
    """The client's WINDOW_UPDATE of ``size`` for stream ``sid`` (and what else it has)."""
    client.conn.increment_flow_control_window(size, stream_id=sid)
    return client.conn.data_to_send()


EVENT = b"data: " + b"y" * 4000 + b"\n\n"
CHUNK = sse_chunk(EVENT)


def test_zero_window_reader_is_reset_after_the_send_timeout_and_others_go_on() -> None:
    pb, client = zero_window_book(send=60.0, read=30.0)
    stuck, _ = sse_opened(pb, client, ex=1, read=30.0)
    good, _ = sse_opened(pb, client, ex=2, read=30.0)
    pb >> data(1, open_window(client, good, 1 << 20))
    # The stuck stream's first chunk meets the closed window: its backend is paused at once.
    pb >> data(-1, CHUNK)
    pb << SetTimer(timer=("window", 1), at=60.0)
    pb << PauseReading(conn=-1)
    for _ in range(10):  # what the backend had in flight waits for the window too
        pb >> data(-1, CHUNK)  # lazy: no timer per chunk
    # The backend is silent because we paused it: its read timeout does not blame it.
    pb.now = 30.0
    pb >> wakeup("read", 1)
    pb << SetTimer(timer=("read", 1), at=60.0)
    pb >> data(-2, sse_chunk(b"data: tok\n\n"))
    pb << Sends(1, client, carries(good, b"data: tok\n\n"))
    pb.now = 59.9
    pb >> wakeup("window", 1)  # not due: re-armed
    pb << SetTimer(timer=("window", 1), at=60.0)
    pb.now = 60.0
    pb >> wakeup("window", 1)
    # RST_STREAM(CANCEL) on the stuck stream, its backend request aborted; nothing else.
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("read", 1))
    pb << Sends(1, client, h2_resets((stuck, CANCEL)))
    assert [log.fields["stream"] for log in logs(pb, "stream_send_timeout")] == [stuck]
    pb >> data(-2, sse_chunk(b"data: more\n\n"))
    pb << Sends(1, client, carries(good, b"data: more\n\n"))
    pb.done()  # connection 1 and backend connection -2 stay open


def test_stream_whose_window_moves_is_not_cut() -> None:
    pb, client = zero_window_book(send=60.0)
    sid, _ = sse_opened(pb, client, ex=1)
    pb >> data(-1, CHUNK)
    pb << SetTimer(timer=("window", 1), at=60.0)
    pb << PauseReading(conn=-1)
    frames = Frames()  # raw: the client gives back no window of its own
    sent = b""
    for step in range(1, 6):
        # 100 bytes of window every 50 s: slow, but the window moves within each 60 s.
        pb.now = step * 50.0
        pb >> data(1, open_window(client, sid, 100))
        pb << (window := Sends(1, frames, lambda got: len(data_of(list(got), sid)) == 100))
        sent += data_of(list(window.events), sid)
        pb >> wakeup("window", 1)
        pb << SetTimer(timer=("window", 1), at=pb.now + 60.0)
    assert sent == EVENT[:500]
    pb.now = 250.0 + 60.0
    pb >> wakeup("window", 1)
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("read", 1))
    pb << Sends(1, frames, lambda got: resets(list(got)) == {sid: CANCEL})
    pb << SetTimer(timer=("idle", 1), at=pb.now + 75.0)
    pb.done()


def test_response_complete_upstream_but_unread_is_reset_too() -> None:
    """The backend finished, the client never opened the window: the queued rest (and the
    END_STREAM behind it) is given up with a reset, so the truncation stays visible."""
    pb, client = zero_window_book(send=60.0)
    sid, _ = sse_opened(pb, client, ex=1)
    pb >> data(-1, CHUNK + b"0\r\n\r\n")
    pb << SetTimer(timer=("window", 1), at=60.0)
    pb << PauseReading(conn=-1)
    pb << ResumeReading(conn=-1)  # the response is whole: the connection goes to the pool
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    assert not pb.core.exchanges  # the exchange is done, its bytes wait in the stream queue
    pb.now = 60.0
    pb >> wakeup("window", 1)

    def reset_not_ended(events: Sequence[Any]) -> None:
        h2_resets((sid, CANCEL))(events)
        assert not any(isinstance(e, h2.events.StreamEnded) for e in events), events

    pb << Sends(1, client, reset_not_ended)
    pb.done()


# -- slow request body -----------------------------------------------------------------------


def h1_upload(pb: Playbook, sent: bytes, length: int = 100) -> H1ClientPeer:
    """Client connection 1 (accepted here) POSTs, announcing ``length`` body bytes and
    sending ``sent`` of them; the caller asserts what that causes."""
    client = H1ClientPeer()
    pb.accept(1)
    head = h11.Request(
        method="POST", target=CHAT, headers=[("Host", "a"), ("Content-Length", str(length))]
    )
    pb >> data(1, (client.conn.send(head) or b"") + (client.conn.send(h11.Data(data=sent)) or b""))
    return client


def upload_opens(pb: Playbook, sent: bytes) -> tuple[H1ClientPeer, Sends]:
    """``h1_upload`` of 100 bytes, ``sent`` sent: backend connection -1 opens and gets the
    head and what came of the body; the response-head deadline (10 s) starts."""
    client = h1_upload(pb, sent)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb << SetTimer(timer=("body", 1), at=30.0)

    def head_and_part(events: Sequence[Any]) -> None:
        assert isinstance(events[0], h11.Request) and events[0].target == CHAT.encode()
        assert [type(e) for e in events[1:]] == [h11.Data] and events[1].data == sent, events

    request = forwarded(pb, -1, 1, head_and_part, head=10.0)
    assert request.events[-1].data == sent
    return client, request


def test_h1_slow_request_body_gets_408_not_504() -> None:
    pb = Playbook(
        fleet("127.0.0.1:9001", timeouts=Timeouts(response_head=10.0, client_header=30.0))
    )
    client, _ = upload_opens(pb, b"x" * 10)
    # The backend waits for the rest of the body: its response-head timer blames nobody.
    pb.now = 10.0
    pb >> wakeup("head", 1)
    pb << SetTimer(timer=("head", 1), at=20.0)
    pb.now = 30.0
    pb >> wakeup("body", 1)
    pb << SetTimer(timer=("send", 1), at=90.0)
    pb << Sends(1, client, h1_response(408))
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("head", 1))
    pb << CloseConnection(conn=1)
    pb.done()
    assert logs(pb, "request_body_timeout")


def test_response_head_timeout_counts_from_the_end_of_the_request() -> None:
    pb = Playbook(
        fleet("127.0.0.1:9001", timeouts=Timeouts(response_head=10.0, client_header=30.0))
    )
    client, request = upload_opens(pb, b"x" * 10)
    backend = request.peer
    pb.now = 8.0
    # The rest of the body: its Content-Length ends the request (h11 sends no bytes for it).
    rest = (client.conn.send(h11.Data(data=b"y" * 90)) or b"") + (
        client.conn.send(h11.EndOfMessage()) or b""
    )
    pb >> data(1, rest)

    def rest_and_end(events: Sequence[Any]) -> None:
        assert [type(e) for e in events] == [h11.Data, h11.EndOfMessage], events
        assert events[0].data == b"y" * 90, events

    pb << Sends(-1, backend, rest_and_end)
    pb.now = 10.0
    pb >> wakeup("head", 1)  # nothing for the client: the deadline moved to 8 + 10
    pb << SetTimer(timer=("head", 1), at=18.0)
    pb.now = 18.0
    pb >> wakeup("head", 1)  # now the backend is late
    pb << CloseConnection(conn=-1)
    pb << SetTimer(timer=("send", 1), at=78.0)
    pb << Sends(1, client, h1_response(504))
    pb << CancelTimer(timer=("body", 1))
    pb << CloseConnection(conn=1)
    pb.done()


def test_h1_body_buffered_for_a_session_key_times_out() -> None:
    """Sticky ``body:`` source: the exchange holds the body before any backend is chosen."""
    pb = Playbook(fleet(sticky=BODY_KEY, timeouts=Timeouts(client_header=30.0)))
    client = h1_upload(pb, b'{"metadat')
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("body", 1), at=30.0)
    (exchange,) = pb.core.exchanges.values()
    assert exchange.phase is Phase.BUFFERING and exchange.ident == 1
    pb.now = 29.0
    pb >> wakeup("body", 1)  # not due: re-armed
    pb << SetTimer(timer=("body", 1), at=30.0)
    pb.now = 30.0
    pb >> wakeup("body", 1)
    pb << SetTimer(timer=("send", 1), at=90.0)
    pb << Sends(1, client, h1_response(408))
    pb << CloseConnection(conn=1)
    pb.done()  # no OpenConnection
    assert not pb.core.exchanges


def test_h2_slow_request_body_gets_reset_not_504() -> None:
    config = default_config(timeouts=Timeouts(response_head=10.0, client_header=30.0))
    pb = Book(config)
    pb.accept(1)
    client = H2ClientPeer()
    preface(pb, client)
    sid, backend = upload(pb, client, ex=1, gap=30.0, head=10.0)
    client.conn.send_data(sid, b"x" * 10)
    pb >> data(1, client.conn.data_to_send())
    pb << Sends(-1, backend, body_bytes(b"x" * 10))
    pb.now = 10.0
    pb >> wakeup("head", 1)  # no response head for the client: the body is not all here
    pb << SetTimer(timer=("head", 1), at=20.0)
    pb.now = 30.0
    pb >> wakeup("body", 1)
    pb << Sends(1, client, h2_resets((sid, CANCEL)))
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("idle", 1), at=105.0)
    pb.done()  # connection 1 stays open


# -- the next request head on a kept-alive connection ----------------------------------------


def served(pb: Playbook) -> H1ClientPeer:
    """Client connection 1's GET of /v1/models is answered 200 ``ok``; both connections are
    idle now (the client's keep-alive timer runs)."""
    client = first_request(pb)
    forwarded(pb, -1, 1, lambda events: events[0].target == b"/v1/models")
    answered(pb, client, b"ok", conn=1, ex=1, up=-1, first=True)
    client.conn.start_next_cycle()
    return client


def test_second_request_head_is_bounded_by_client_header_and_gets_408() -> None:
    pb = Playbook(
        fleet(
            "127.0.0.1:9001",
            timeouts=Timeouts(client_header=30.0, keepalive_idle=75.0),
            pool_max_idle=4,
        )
    )
    client = served(pb)
    pb.now = 50.0
    pb >> data(1, b"GET /v1/models HTTP/1.1\r\nHo")
    pb << CancelTimer(timer=("idle", 1))
    pb << SetTimer(timer=("header", 1), at=80.0)
    pb.now = 75.0
    pb >> wakeup("idle", 1)  # cancelled: the client is sending a request now
    pb.now = 80.0
    pb >> wakeup("header", 1)
    pb << Sends(1, client, h1_response(408))
    pb << CloseConnection(conn=1)
    pb.done()


def test_idle_kept_alive_connection_still_closes_without_408() -> None:
    pb = Playbook(fleet("127.0.0.1:9001", timeouts=Timeouts(keepalive_idle=75.0), pool_max_idle=4))
    served(pb)
    pb.now = 75.0
    pb >> wakeup("idle", 1)
    pb << CloseConnection(conn=1)  # and nothing sent
    pb.done()

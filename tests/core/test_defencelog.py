"""What the defences do is counted and logged, at most one line per kind per interval
(``core/observe/defencelog.py``): the attacks are real bytes from real h11/h2 peers."""

from __future__ import annotations

import h2.errors
import h2.events
import h11
from playbook import H1ClientPeer, H2ClientPeer, Playbook, default_config

from muxproxy.config import Limits
from muxproxy.core.commands import Log
from muxproxy.core.observe.defencelog import KINDS, LOG_INTERVAL
from muxproxy.core.proxy import COUNTERS

SMUGGLED = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
)
PEER = "10.0.0.7"


def _lines(pb: Playbook, event: str) -> list[Log]:
    return [c for c in pb.log if isinstance(c, Log) and c.event == event]


def _smuggle(pb: Playbook, conn: int) -> None:
    pb.accept(conn)
    pb.receive(conn, SMUGGLED)


def test_counters_name_every_defence_and_start_at_zero() -> None:
    pb = Playbook()
    assert set(KINDS) <= set(COUNTERS)
    assert pb.core.counters == dict.fromkeys(COUNTERS, 0)


def test_smuggling_refusals_log_one_line_per_interval_with_the_count_left_out() -> None:
    pb = Playbook()
    for conn, at in enumerate([0.0, 1.0, 2.0, LOG_INTERVAL - 0.5], start=1):
        pb.now = at
        _smuggle(pb, conn)
    (first,) = _lines(pb, "smuggling_refused")
    assert first.fields["client"] == PEER
    assert first.fields["conn"] == 1
    assert first.fields["error"] == "both content-length and transfer-encoding"
    assert first.fields["suppressed"] == 0
    assert pb.core.counters["smuggling_refused"] == 4
    # Each was still refused before any backend: 400 and close.
    assert not pb.opens()

    pb.now = LOG_INTERVAL
    _smuggle(pb, 10)
    lines = _lines(pb, "smuggling_refused")
    assert [(line.fields["conn"], line.fields["suppressed"]) for line in lines] == [(1, 0), (10, 3)]
    assert pb.core.counters["smuggling_refused"] == 5


def test_raw_head_smuggling_shapes_count_but_other_bad_requests_do_not() -> None:
    pb = Playbook()
    pb.accept(1)
    pb.receive(1, b"GET /v1/models HTTP/1.1\r\nHost: a\r\nContent-Length: 0, 0\r\n\r\n")
    pb.accept(2)
    pb.receive(2, b"GET /v1/models HTTP/1.1\r\nHost a\r\n\r\n")  # not a field line at all
    assert pb.core.counters["smuggling_refused"] == 1
    (line,) = _lines(pb, "smuggling_refused")
    assert line.fields["error"] == "list of values in content-length"
    assert [c.fields["conn"] for c in _lines(pb, "client_protocol_error")] == [2]


def test_goaway_enhance_your_calm_is_counted_and_logged_with_the_client() -> None:
    pb = Playbook(default_config(limits=Limits(h2_control_frame_budget=10)))
    pb.accept(1)
    client = H2ClientPeer()
    for i in range(20):
        client.conn.ping(i.to_bytes(8, "big"))
    events = client.events(pb.take(1, pb.receive(1, client.preface() + client.conn.data_to_send())))
    (gone,) = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
    assert gone.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    (line,) = _lines(pb, "client_h2_abuse")
    assert line.fields["client"] == PEER
    assert line.fields["reason"].startswith("PING flood")
    assert pb.core.counters["client_h2_abuse"] == 1


def test_slowloris_header_timeout_is_counted_and_logged() -> None:
    pb = Playbook()
    timeout = pb.core.config.timeouts.client_header
    for conn in (1, 2):
        pb.accept(conn)
        pb.receive(conn, b"GET /v1/models HTTP/1.1\r\nHost: a\r\nX-Slow: ")
    pb.now = timeout
    for conn in (1, 2):
        client = H1ClientPeer()
        client.conn.send(h11.Request(method="GET", target="/", headers=[("host", "a")]))
        (response, *_) = client.events(pb.take(conn, pb.wakeup("header", conn)))
        assert isinstance(response, h11.Response) and response.status_code == 408
    (line,) = _lines(pb, "request_header_timeout")
    assert (line.fields["client"], line.fields["conn"]) == (PEER, 1)
    assert pb.core.counters["request_header_timeout"] == 2


def test_h2_request_body_timeout_is_counted_and_logged() -> None:
    pb = Playbook()
    pb.accept(1)
    client = H2ClientPeer()
    sid = client.conn.get_next_available_stream_id()
    headers = [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":authority", b"proxy.example"),
        (b":path", b"/v1/chat/completions"),
    ]
    client.conn.send_headers(sid, headers, end_stream=False)
    pb.receive(1, client.preface() + client.conn.data_to_send())
    (exchange,) = pb.core.exchanges.values()
    pb.now = pb.core.config.timeouts.client_header
    events = client.events(pb.take(1, pb.wakeup("body", exchange.ident)))
    resets = [(e.stream_id, e.error_code) for e in events if isinstance(e, h2.events.StreamReset)]
    assert resets == [(sid, h2.errors.ErrorCodes.CANCEL)]
    (line,) = _lines(pb, "request_body_timeout")
    assert (line.fields["client"], line.fields["stream"], line.fields["suppressed"]) == (
        PEER,
        sid,
        0,
    )
    assert pb.core.counters["request_body_timeout"] == 1


def test_each_kind_has_its_own_interval() -> None:
    pb = Playbook()
    _smuggle(pb, 1)
    pb.accept(2)
    pb.receive(2, b"GET / HTTP/1.1\r\nHost: a\r\n")
    pb.wakeup("header", 2)
    assert len(_lines(pb, "smuggling_refused")) == 1
    assert len(_lines(pb, "request_header_timeout")) == 1

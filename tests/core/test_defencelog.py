"""What the defences do is counted and logged, at most one line per kind per interval
(``core/observe/defencelog.py``): the attacks are real bytes from real h11/h2 peers. Each test
is a conversation that asserts the log lines in place, with every other command, in order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import h2.errors
import h2.events
import h11
from checks import h1_response, h2_resets
from playbook import (
    H1ClientPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    Where,
    data,
    default_config,
    subset,
    wakeup,
)
from test_h2guard import ORIGIN

from muxproxy.config import Config, Limits
from muxproxy.core.commands import CancelTimer, CloseConnection, Log, OpenConnection, SetTimer
from muxproxy.core.observe.defencelog import KINDS, LOG_INTERVAL
from muxproxy.core.proxy import COUNTERS

SMUGGLED = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
)
PEER = "10.0.0.7"


def _lines(pb: Playbook, event: str) -> list[Log]:
    return [c for c in pb.log if isinstance(c, Log) and c.event == event]


def _playbook(config: Config | None = None) -> Playbook:
    """A playbook whose conversations assert the log lines too: they are the subject."""
    return Playbook(config, ignore=())


def _refused(pb: Playbook, conn: int, status: int, client: H1ClientPeer | None = None) -> None:
    """Client connection ``conn`` gets ``status`` and is closed."""
    pb << SetTimer(timer=("send", conn), at=pb.now + 60.0)
    pb << Sends(conn, client or _reader(), h1_response(status))
    pb << CloseConnection(conn=conn)


def _reader() -> H1ClientPeer:
    """A client peer that reads an answer to a request it did not send itself (the test
    sent raw bytes)."""
    client = H1ClientPeer()
    client.conn.send(h11.Request(method="GET", target="/", headers=[("host", "a")]))
    return client


def _smuggle(pb: Playbook, conn: int, line: dict[str, object] | None = None) -> None:
    """Client connection ``conn`` (accepted here) sends both Content-Length and
    Transfer-Encoding: refused with a 400 before any backend; ``line``: the log line it gets
    (None: none, the interval's line was written)."""
    pb.accept(conn)
    pb >> data(conn, SMUGGLED)
    if line is not None:
        pb << Log(event="smuggling_refused", fields=line)
    _refused(pb, conn, 400)


def test_counters_name_every_defence_and_start_at_zero() -> None:
    pb = Playbook()
    assert set(KINDS) <= set(COUNTERS)
    assert pb.core.counters == dict.fromkeys(COUNTERS, 0)


def test_smuggling_refusals_log_one_line_per_interval_with_the_count_left_out() -> None:
    pb = _playbook()
    error = "both content-length and transfer-encoding"
    for conn, at in enumerate([0.0, 1.0, 2.0, LOG_INTERVAL - 0.5], start=1):
        pb.now = at
        first = {"client": PEER, "conn": 1, "error": error, "suppressed": 0}
        # Each is still refused before any backend: 400 and close.
        _smuggle(pb, conn, first if conn == 1 else None)
    pb.done()
    assert pb.core.counters["smuggling_refused"] == 4
    assert not pb.opens()

    pb.now = LOG_INTERVAL
    _smuggle(pb, 10, {"client": PEER, "conn": 10, "error": error, "suppressed": 3})
    pb.done()
    assert pb.core.counters["smuggling_refused"] == 5


def test_raw_head_smuggling_shapes_count_but_other_bad_requests_do_not() -> None:
    pb = _playbook()
    pb.accept(1)
    pb >> data(1, b"GET /v1/models HTTP/1.1\r\nHost: a\r\nContent-Length: 0, 0\r\n\r\n")
    line = {"error": "list of values in content-length"}
    pb << Log(event="smuggling_refused", fields=subset(line))
    _refused(pb, 1, 400)
    pb.accept(2)
    pb >> data(2, b"GET /v1/models HTTP/1.1\r\nHost a\r\n\r\n")  # not a field line at all
    pb << Log(event="client_protocol_error", fields=subset({"conn": 2}))
    _refused(pb, 2, 400)
    pb.done()
    assert pb.core.counters["smuggling_refused"] == 1


def settings(events: Sequence[Any]) -> None:
    assert any(isinstance(e, h2.events.RemoteSettingsChanged) for e in events), events


def acked(events: Sequence[Any]) -> None:
    assert any(isinstance(e, h2.events.SettingsAcknowledged) for e in events), events


def calm(events: Sequence[Any]) -> None:
    """GOAWAY(ENHANCE_YOUR_CALM)."""
    (gone,) = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
    assert gone.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, gone


def test_goaway_enhance_your_calm_is_counted_and_logged_with_the_client() -> None:
    pb = _playbook(default_config(limits=Limits(h2_control_frame_budget=10)))
    pb.accept(1)
    client = H2ClientPeer()
    for i in range(20):
        client.conn.ping(i.to_bytes(8, "big"))
    pb >> data(1, client.preface() + client.conn.data_to_send())
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, settings)
    pb << Where(Log, lambda log: log.event == "client_h2_abuse")
    pb << Sends(1, client, calm)
    pb << CloseConnection(conn=1)
    pb.done()
    (line,) = _lines(pb, "client_h2_abuse")
    assert line.fields["client"] == PEER
    assert line.fields["reason"].startswith("PING flood")
    assert pb.core.counters["client_h2_abuse"] == 1


def test_slowloris_header_timeout_is_counted_and_logged() -> None:
    pb = _playbook()
    timeout = pb.core.config.timeouts.client_header
    for conn in (1, 2):
        pb.accept(conn)
        pb >> data(conn, b"GET /v1/models HTTP/1.1\r\nHost: a\r\nX-Slow: ")
    pb.now = timeout
    for conn in (1, 2):
        pb >> wakeup("header", conn)
        if conn == 1:  # the second is within the interval: counted, not logged
            line = {"client": PEER, "conn": 1, "suppressed": 0}
            pb << Log(event="request_header_timeout", fields=line)
        _refused(pb, conn, 408)
    pb.done()
    assert pb.core.counters["request_header_timeout"] == 2


def test_h2_request_body_timeout_is_counted_and_logged() -> None:
    pb = _playbook()
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
    pb >> data(1, client.preface() + client.conn.data_to_send())
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, settings)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb << SetTimer(timer=("body", 1), at=30.0)
    pb << Sends(1, client, acked)
    (exchange,) = pb.core.exchanges.values()
    pb.now = pb.core.config.timeouts.client_header
    pb >> wakeup("body", exchange.ident)
    line = {"client": PEER, "stream": sid, "suppressed": 0}
    pb << Log(event="request_body_timeout", fields=subset(line))
    pb << Sends(1, client, h2_resets((sid, h2.errors.ErrorCodes.CANCEL)))
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << Log(event="access", fields=subset({"status": 0}))
    pb << SetTimer(timer=("idle", 1), at=pb.now + 75.0)
    pb.done()
    assert pb.core.counters["request_body_timeout"] == 1


def test_each_kind_has_its_own_interval() -> None:
    pb = _playbook()
    line = {"client": PEER, "conn": 1}
    _smuggle(pb, 1, subset(line))
    pb.accept(2)
    pb >> data(2, b"GET / HTTP/1.1\r\nHost: a\r\n")
    pb >> wakeup("header", 2)
    # Another kind: logged although a smuggling line was just written.
    pb << Log(event="request_header_timeout", fields=subset({"conn": 2}))
    _refused(pb, 2, 408)
    pb.done()

"""A response to HEAD is its head alone (RFC 9110 §9.3.2), whoever makes it: the proxy's own
resume answers (``replay.py``) and refusals included. Driven with bytes from real h11 / h2
peers; found by fuzzing (``fuzz/corpus/client_h1/crash-head-resume``). The stream to resume is
set up by hand (``resume_setup.Stream``); from the client's going away on, each test is a
conversation: every command asserted in order, timers included."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import h2.events
import h11
from checks import Check, h1_request
from playbook import (
    H1BackendPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    closed,
    data,
    opened,
)
from resume_setup import SSE, Stream, resume_config
from test_h2guard import ORIGIN, settings

from muxproxy.core.commands import CancelTimer, OpenConnection, SetTimer

UNKNOWN = b"A" * 22 + b".3"
"""An event id of the proxy's form that names no stream: a refusal, as an SSE event."""


def head_request(event_id: bytes) -> tuple[h11.Connection, bytes]:
    client = h11.Connection(h11.CLIENT)
    headers = [("Host", "proxy.example"), *SSE, ("Last-Event-ID", event_id.decode())]
    out = client.send(h11.Request(method="HEAD", target="/v1/chat", headers=headers)) or b""
    return client, out + (client.send(h11.EndOfMessage()) or b"")


GET_MODELS = b"GET /v1/models HTTP/1.1\r\nHost: proxy.example\r\n\r\n"
MODELS = b'{"data": []}'


def response_events(client: h11.Connection, data: bytes) -> list[object]:
    """The events of the one response to ``client``'s request in ``data``; the rest stays."""
    client.receive_data(data)
    events: list[object] = []
    while not events or type(events[-1]) is not h11.EndOfMessage:
        event = client.next_event()
        assert event is not h11.NEED_DATA, events
        events.append(event)
    return events


class HeadClient:
    """A decoder for ``Sends``: the h11 client of one HEAD request."""

    def __init__(self, conn: h11.Connection) -> None:
        self.conn = conn

    def events(self, data: bytes) -> list[object]:
        return response_events(self.conn, data)


class Raw:
    """A decoder for ``Sends`` that gives the bytes as they are (the answer to a request sent
    as raw bytes, which no h11 client made)."""

    def events(self, data: bytes) -> list[bytes]:
        return [data]


def head_alone(client: h11.Connection) -> Check:
    """A 200 head and its end, no body, nothing after it (``client`` decodes the rest)."""

    def check(events: Sequence[Any]) -> None:
        response, *rest = events
        assert isinstance(response, h11.Response) and response.status_code == 200, events
        assert [type(e) for e in rest] == [h11.EndOfMessage], events  # no body
        assert not client.trailing_data[0]

    return check


def h2_head_alone(sid: int, status: int = 200) -> Check:
    """Stream ``sid``'s response of ``status``: one HEADERS frame with END_STREAM, no DATA."""

    def check(events: Sequence[Any]) -> None:
        (response,) = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
        assert response.stream_id == sid
        assert dict(response.headers)[b":status"] == str(status).encode()
        assert response.stream_ended is not None  # HEADERS with END_STREAM
        assert not [e for e in events if isinstance(e, h2.events.DataReceived)]

    return check


# -- the conversation's steps -----------------------------------------------------------------


def head_answered(pb: Playbook, conn: int, event_id: bytes) -> Sends:
    """Client connection ``conn`` (accepted here) sends a HEAD resuming ``event_id`` and a GET
    of /v1/models in one read: the proxy answers the HEAD itself, at once, and the GET
    (exchange ``conn + 1``) opens backend connection ``-conn``."""
    pb.accept(conn)
    client, head = head_request(event_id)
    pb >> data(conn, head + GET_MODELS)
    pb << CancelTimer(timer=("header", conn))
    pb << SetTimer(timer=("send", conn), at=60.0)
    pb << (answer := Sends(conn, HeadClient(client), head_alone(client)))
    pb << SetTimer(timer=("header", conn), at=30.0)  # the pipelined GET's head is here
    pb << CancelTimer(timer=("header", conn))
    pb << SetTimer(timer=("connect", conn + 1), at=5.0)
    pb << OpenConnection(conn=-conn, origin=ORIGIN)
    return answer


def pipelined_get_reaches_the_backend(pb: Playbook, conn: int) -> None:
    """The GET after the HEAD on client connection ``conn`` (exchange ``conn + 1``, backend
    connection ``-conn``) is forwarded and answered."""
    ex, up = conn + 1, -conn
    backend = H1BackendPeer()
    pb >> opened(up)
    pb << CancelTimer(timer=("connect", ex))
    pb << Sends(up, backend, h1_request(b"GET", b"/v1/models"))
    pb << SetTimer(timer=("head", ex), at=60.0)
    pb >> data(up, backend.reply(MODELS))
    pb << CancelTimer(timer=("head", ex))
    pb << Sends(conn, Raw(), lambda got: got[0].startswith(b"HTTP/1.1 200 "))
    pb << SetTimer(timer=("read", ex), at=300.0)
    pb << Sends(conn, Raw(), lambda got: got == [MODELS])
    pb << SetTimer(timer=("pool", up), at=60.0)
    pb << CancelTimer(timer=("read", ex))
    pb << SetTimer(timer=("idle", conn), at=75.0)


def client_gone(pb: Playbook, first: Stream) -> None:
    """The stream's client goes away: the stream lingers for a resume."""
    pb >> closed(first.conn)
    pb << SetTimer(timer=("linger", 1), at=pb.now + 30.0)
    pb << CancelTimer(timer=("send", first.conn))


def h2_head(pb: Playbook, conn: int, event_id: bytes) -> tuple[H2ClientPeer, int]:
    """A new HTTP/2 client on ``conn`` (accepted here): its preface, then a HEAD of /v1/chat
    resuming ``event_id``, which the caller sees answered. Returns the client and stream."""
    client = H2ClientPeer()
    pb.accept(conn)
    pb >> data(conn, client.preface())
    pb << SetTimer(timer=("send", conn), at=pb.now + 60.0)
    pb << Sends(conn, client, settings)
    headers = [(b"accept", b"text/event-stream"), (b"last-event-id", event_id)]
    sid, request = client.request(b"HEAD", b"/v1/chat", headers=headers)
    pb >> data(conn, request)
    return client, sid


def test_a_refused_resume_by_head_over_http1_is_a_head_and_the_pipelined_request_goes_on() -> None:
    pb = Playbook(resume_config())
    answer = head_answered(pb, 1, UNKNOWN)
    assert b"resume_unknown" not in answer.data
    assert pb.core.resumes.refused["unknown"] == 1
    pipelined_get_reaches_the_backend(pb, 1)
    pb.done()


def test_a_resume_by_head_of_a_live_stream_over_http1_is_its_head_alone_at_once() -> None:
    pb = Playbook(resume_config())
    first = Stream(pb)  # set-up: exchange 1 on backend connection -1
    first.send(b"data: a\n\n")
    client_gone(pb, first)
    pb >> data(first.up, first.backend.chunk(b"data: b\n\n"))  # kept for a resume
    answer = head_answered(pb, 2, first.last_id()[:-1] + b"1")
    assert b"data: " not in answer.data
    pipelined_get_reaches_the_backend(pb, 2)
    # The stream still lingers for a real resume; the HEAD took nothing of it.
    pb >> data(first.up, first.backend.chunk(b"data: c\n\n"))
    pb.done()


def test_a_refused_resume_by_head_over_http2_sends_no_data_frame() -> None:
    pb = Playbook(resume_config())
    client, sid = h2_head(pb, 1, UNKNOWN)
    pb << CancelTimer(timer=("header", 1))
    pb << Sends(1, client, h2_head_alone(sid))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()


def test_a_resume_by_head_of_a_live_stream_over_http2_is_one_headers_frame() -> None:
    pb = Playbook(resume_config())
    first = Stream(pb)  # set-up: exchange 1 on backend connection -1
    first.send(b"data: a\n\n")
    client_gone(pb, first)
    client, sid = h2_head(pb, 2, first.last_id())
    pb << CancelTimer(timer=("header", 2))
    pb << Sends(2, client, h2_head_alone(sid))
    pb << SetTimer(timer=("idle", 2), at=75.0)
    pb >> data(first.up, first.backend.chunk(b"data: b\n\n"))  # nothing for the HEAD
    pb.done()


def test_a_proxy_error_to_head_over_http2_is_one_headers_frame() -> None:
    """More fields than ``limits.max_header_fields``: the proxy's own 431, head only."""
    pb = Playbook(resume_config())
    client = H2ClientPeer()
    pb.accept(1)
    pb >> data(1, client.preface())
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, settings)
    many = [(b"x-field-%d" % i, b"v") for i in range(200)]
    sid, request = client.request(b"HEAD", b"/v1/models", headers=many)
    pb >> data(1, request)
    pb << Sends(1, client, h2_head_alone(sid, 431))
    pb.done()

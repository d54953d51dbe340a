"""A response to HEAD is its head alone (RFC 9110 §9.3.2), whoever makes it: the proxy's own
resume answers (``replay.py``) and refusals included. Driven with bytes from real h11 / h2
peers; found by fuzzing (``fuzz/corpus/client_h1/crash-head-resume``)."""

from __future__ import annotations

import h2.events
import h11
from playbook import H1BackendPeer, H2ClientPeer, Playbook
from resume_setup import SSE, Stream, h2_resume, resume_config

UNKNOWN = b"A" * 22 + b".3"
"""An event id of the proxy's form that names no stream: a refusal, as an SSE event."""


def head_request(event_id: bytes) -> tuple[h11.Connection, bytes]:
    client = h11.Connection(h11.CLIENT)
    headers = [("Host", "proxy.example"), *SSE, ("Last-Event-ID", event_id.decode())]
    out = client.send(h11.Request(method="HEAD", target="/v1/chat", headers=headers)) or b""
    return client, out + (client.send(h11.EndOfMessage()) or b"")


GET_MODELS = b"GET /v1/models HTTP/1.1\r\nHost: proxy.example\r\n\r\n"


def response_events(client: h11.Connection, data: bytes) -> list[object]:
    """The events of the one response to ``client``'s request in ``data``; the rest stays."""
    client.receive_data(data)
    events: list[object] = []
    while not events or type(events[-1]) is not h11.EndOfMessage:
        event = client.next_event()
        assert event is not h11.NEED_DATA, events
        events.append(event)
    return events


def assert_pipelined_get_reaches_the_backend(pb: Playbook, conn: int) -> None:
    (*_, opened) = pb.opens()
    pb.opened(opened.conn)
    backend = H1BackendPeer()
    (request, *_) = backend.events(pb.take(opened.conn))
    assert isinstance(request, h11.Request) and request.target == b"/v1/models"
    answer = pb.receive(opened.conn, backend.reply(b'{"data": []}'))
    assert pb.take(conn, answer).endswith(b'{"data": []}')


def test_a_refused_resume_by_head_over_http1_is_a_head_and_the_pipelined_request_goes_on() -> None:
    pb = Playbook(resume_config())
    pb.accept(1)
    client, head = head_request(UNKNOWN)
    out = pb.take(1, pb.receive(1, head + GET_MODELS))
    response, *rest = response_events(client, out)
    assert isinstance(response, h11.Response) and response.status_code == 200
    assert [type(e) for e in rest] == [h11.EndOfMessage]  # no body
    assert b"resume_unknown" not in out and not client.trailing_data[0]
    assert pb.core.resumes.refused["unknown"] == 1
    assert_pipelined_get_reaches_the_backend(pb, 1)


def test_a_resume_by_head_of_a_live_stream_over_http1_is_its_head_alone_at_once() -> None:
    pb = Playbook(resume_config())
    first = Stream(pb)
    first.send(b"data: a\n\n")
    pb.closed(1)
    first.send(b"data: b\n\n")
    pb.accept(2)
    client, head = head_request(first.last_id()[:-1] + b"1")
    out = pb.take(2, pb.receive(2, head + GET_MODELS))
    response, *rest = response_events(client, out)
    assert isinstance(response, h11.Response) and response.status_code == 200
    assert [type(e) for e in rest] == [h11.EndOfMessage]
    assert b"data: " not in out
    assert_pipelined_get_reaches_the_backend(pb, 2)
    # The stream still lingers for a real resume; the HEAD took nothing of it.
    live = pb.receive(first.up, first.backend.chunk(b"data: c\n\n"))
    assert pb.take(2, live) == b""


def h2_head(pb: Playbook, conn: int, event_id: bytes) -> list[h2.events.Event]:
    _, events = h2_resume(pb, conn, event_id, method=b"HEAD", path=b"/v1/chat")
    return events


def test_a_refused_resume_by_head_over_http2_sends_no_data_frame() -> None:
    pb = Playbook(resume_config())
    events = h2_head(pb, 1, UNKNOWN)
    (response,) = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert dict(response.headers)[b":status"] == b"200"
    assert response.stream_ended is not None  # HEADERS with END_STREAM
    assert not [e for e in events if isinstance(e, h2.events.DataReceived)]


def test_a_resume_by_head_of_a_live_stream_over_http2_is_one_headers_frame() -> None:
    pb = Playbook(resume_config())
    first = Stream(pb)
    first.send(b"data: a\n\n")
    pb.closed(1)
    events = h2_head(pb, 2, first.last_id())
    (response,) = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert response.stream_ended is not None
    assert not [e for e in events if isinstance(e, h2.events.DataReceived)]
    assert pb.take(2, pb.receive(first.up, first.backend.chunk(b"data: b\n\n"))) == b""


def test_a_proxy_error_to_head_over_http2_is_one_headers_frame() -> None:
    """More fields than ``limits.max_header_fields``: the proxy's own 431, head only."""
    pb = Playbook(resume_config())
    client = H2ClientPeer()
    pb.accept(1)
    pb.receive(1, client.preface())
    many = [(b"x-field-%d" % i, b"v") for i in range(200)]
    _sid, request = client.request(b"HEAD", b"/v1/models", headers=many)
    events = client.events(pb.take(1, pb.receive(1, request)))
    (response,) = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert dict(response.headers)[b":status"] == b"431"
    assert response.stream_ended is not None
    assert not [e for e in events if isinstance(e, h2.events.DataReceived)]

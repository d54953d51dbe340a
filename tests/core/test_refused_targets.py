"""Requests the proxy refuses before any backend is asked for, whose target or framing a
backend could read otherwise than the proxy routed it: a fragment in the target (RFC 9112
§3.2, RFC 3986 §3.5), a dot-segment behind a path parameter (``paths.py``), an HTTP/2
``:authority`` that a ``host`` field contradicts or a ``:scheme`` other than http(s) (RFC 9113
§8.3.1), and a chunked body whose lines end in a bare LF (RFC 9112 §7.1), which hung the
exchange until a timer. Bytes in, bytes out, through real h11 / h2 peers."""

from __future__ import annotations

import h2.errors
import h2.events
import h11
import pytest
from playbook import H1ClientPeer, H2ClientPeer, Playbook, h2_request_as_is, stream_resets

from muxproxy.core.commands import CloseConnection

H1_TARGETS = {
    "fragment": b"GET /v1/models#frag HTTP/1.1\r\nHost: a\r\n\r\n",
    "fragment-after-query": b"GET /v1/models?a=1#frag HTTP/1.1\r\nHost: a\r\n\r\n",
    "fragment-absolute-form": b"GET http://a/v1/models#frag HTTP/1.1\r\nHost: a\r\n\r\n",
    "dot-dot-param": b"GET /v1/..;/flag HTTP/1.1\r\nHost: a\r\n\r\n",
    "dot-param": b"GET /v1/.;x=1/flag HTTP/1.1\r\nHost: a\r\n\r\n",
    "encoded-dot-dot-param": b"GET /v1/%2e%2e;jsessionid=1/flag HTTP/1.1\r\nHost: a\r\n\r\n",
    "dot-dot-encoded-param": b"GET /v1/..%3b/flag HTTP/1.1\r\nHost: a\r\n\r\n",
}


def closes(pb: Playbook, conn: int) -> bool:
    return any(isinstance(c, CloseConnection) and c.conn == conn for c in pb.log)


def status_of(data: bytes) -> int:
    client = H1ClientPeer()
    client.request()
    (response, *_) = client.events(data)
    assert isinstance(response, h11.Response)
    return int(response.status_code)


@pytest.mark.parametrize("kind", sorted(H1_TARGETS))
def test_a_target_a_backend_could_read_otherwise_gets_400_over_http1(kind: str) -> None:
    pb = Playbook()
    pb.accept(1)
    pb.receive(1, H1_TARGETS[kind])
    assert pb.opens() == []
    assert status_of(pb.take(1)) == 400


CHUNKED_HEAD = b"POST /v1/chat HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    "body",
    [b"5\nhello\n0\n\n", b"5\r\nhello\n", b"5\r\nhello\r\n0\r\nx-a: b\n"],
    ids=["size-line", "after-data", "trailer"],
)
def test_a_chunked_body_with_bare_lf_lines_is_refused_at_once(body: bytes) -> None:
    """Sent with its head: 400 and the close, with no backend asked for and no timer waited
    on (before, the decoder waited for a CRLF that never came: the exchange hung)."""
    pb = Playbook()
    pb.accept(1)
    pb.receive(1, CHUNKED_HEAD + body)
    assert pb.opens() == []
    assert status_of(pb.take(1)) == 400
    assert closes(pb, 1)


def test_a_bare_lf_after_the_head_went_out_cuts_the_exchange_at_once() -> None:
    pb = Playbook()
    pb.accept(1)
    pb.receive(1, CHUNKED_HEAD)
    assert len(pb.opens()) == 1  # the head is on its way
    pb.receive(1, b"5\nhello\n")
    assert closes(pb, 1)  # no CRLF waited for: the exchange is aborted, the connection closed


BASE = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")]
H2_HEADS = {
    "fragment": [*BASE[:3], (b":path", b"/v1/models#frag")],
    "authority-and-host-differ": [*BASE, (b"host", b"b")],
    "authority-and-a-second-host-differ": [*BASE, (b"host", b"a"), (b"host", b"b")],
    "scheme-javascript": [BASE[0], (b":scheme", b"javascript"), *BASE[2:]],
    "scheme-file": [BASE[0], (b":scheme", b"file"), *BASE[2:]],
}


@pytest.mark.parametrize("kind", sorted(H2_HEADS))
def test_a_malformed_h2_request_is_reset_and_the_next_stream_goes_on(kind: str) -> None:
    pb, client, sid, events = h2_request_as_is(H2_HEADS[kind])
    assert pb.opens() == []
    assert stream_resets(events) == [(sid, h2.errors.ErrorCodes.PROTOCOL_ERROR)]
    assert not any(isinstance(e, h2.events.ConnectionTerminated) for e in events)
    _, data = client.request()
    pb.receive(1, data)
    assert len(pb.opens()) == 1


@pytest.mark.parametrize("path", [b"/v1/..;/flag", b"/v1/%2e%2e;x/flag"])
def test_a_dot_segment_behind_a_parameter_gets_400_on_its_h2_stream(path: bytes) -> None:
    pb = Playbook()
    pb.accept(1, tls=True, alpn="h2")
    client = H2ClientPeer()
    pb.receive(1, client.preface())
    sid, data = client.request(b"GET", path)
    events = client.events(pb.take(1, pb.receive(1, data)))
    assert pb.opens() == []
    (response,) = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert response.stream_id == sid and dict(response.headers)[b":status"] == b"400"
    _, data = client.request()
    pb.receive(1, data)
    assert len(pb.opens()) == 1

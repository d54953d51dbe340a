"""Requests the proxy refuses before any backend is asked for, whose target or framing a
backend could read otherwise than the proxy routed it: a fragment in the target (RFC 9112
§3.2, RFC 3986 §3.5), a dot-segment behind a path parameter (``paths.py``), an HTTP/2
``:authority`` that a ``host`` field contradicts or a ``:scheme`` other than http(s) (RFC 9113
§8.3.1), and a chunked body whose lines end in a bare LF (RFC 9112 §7.1), which hung the
exchange until a timer. Bytes in, bytes out, through real h11 / h2 peers."""

from __future__ import annotations

import h2.errors
import pytest
from checks import h1_response, h2_resets, h2_response
from playbook import ANY, H1ClientPeer, H2ClientPeer, Playbook, Sends, data

from muxproxy.core.commands import CancelTimer, CloseConnection, OpenConnection, SetTimer

H1_TARGETS = {
    "fragment": b"GET /v1/models#frag HTTP/1.1\r\nHost: a\r\n\r\n",
    "fragment-after-query": b"GET /v1/models?a=1#frag HTTP/1.1\r\nHost: a\r\n\r\n",
    "fragment-absolute-form": b"GET http://a/v1/models#frag HTTP/1.1\r\nHost: a\r\n\r\n",
    "dot-dot-param": b"GET /v1/..;/flag HTTP/1.1\r\nHost: a\r\n\r\n",
    "dot-param": b"GET /v1/.;x=1/flag HTTP/1.1\r\nHost: a\r\n\r\n",
    "encoded-dot-dot-param": b"GET /v1/%2e%2e;jsessionid=1/flag HTTP/1.1\r\nHost: a\r\n\r\n",
    "dot-dot-encoded-param": b"GET /v1/..%3b/flag HTTP/1.1\r\nHost: a\r\n\r\n",
}


def h2_open() -> tuple[Playbook, H2ClientPeer]:
    """Client connection 1 (TLS, ALPN h2) past the prefaces, before the conversation."""
    pb = Playbook()
    pb.accept(1, tls=True, alpn="h2")
    client = H2ClientPeer()
    pb.receive(1, client.preface())
    client.events(pb.take(1))
    return pb, client


def refused_with_400(pb: Playbook, request: bytes, *, head_read: bool = False) -> None:
    """``request`` on client connection 1 gets 400 and the close, no backend asked for;
    ``head_read``: the head parsed whole (its wait ends) before its target was refused."""
    client = H1ClientPeer()
    client.request()  # the client peer only decodes: it expects a response
    pb.accept(1)
    pb >> data(1, request)
    if head_read:
        pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(400))
    pb << CloseConnection(conn=1)
    pb.done()


@pytest.mark.parametrize("kind", sorted(H1_TARGETS))
def test_a_target_a_backend_could_read_otherwise_gets_400_over_http1(kind: str) -> None:
    # A fragment is h11's to refuse; a dot-segment behind a parameter is the path's.
    refused_with_400(Playbook(), H1_TARGETS[kind], head_read="param" in kind)


CHUNKED_HEAD = b"POST /v1/chat HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    "body",
    [b"5\nhello\n0\n\n", b"5\r\nhello\n", b"5\r\nhello\r\n0\r\nx-a: b\n"],
    ids=["size-line", "after-data", "trailer"],
)
def test_a_chunked_body_with_bare_lf_lines_is_refused_at_once(body: bytes) -> None:
    """Sent with its head: 400 and the close, with no backend asked for and no timer waited
    on (before, the decoder waited for a CRLF that never came: the exchange hung)."""
    refused_with_400(Playbook(), CHUNKED_HEAD + body)


def test_a_bare_lf_after_the_head_went_out_cuts_the_exchange_at_once() -> None:
    pb = Playbook()
    client = H1ClientPeer()
    client.request()
    pb.accept(1)
    pb >> data(1, CHUNKED_HEAD)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ANY)  # the head is on its way
    pb << SetTimer(timer=("body", 1), at=30.0)
    # No CRLF waited for: the exchange is aborted, the connection closed.
    pb >> data(1, b"5\nhello\n")
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << CancelTimer(timer=("body", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(400))
    pb << CloseConnection(conn=1)
    pb.done()


BASE = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")]
H2_HEADS = {
    "fragment": [*BASE[:3], (b":path", b"/v1/models#frag")],
    "authority-and-host-differ": [*BASE, (b"host", b"b")],
    "authority-and-a-second-host-differ": [*BASE, (b"host", b"a"), (b"host", b"b")],
    "scheme-javascript": [BASE[0], (b":scheme", b"javascript"), *BASE[2:]],
    "scheme-file": [BASE[0], (b":scheme", b"file"), *BASE[2:]],
}


def next_stream_is_served(pb: Playbook, client: H2ClientPeer) -> None:
    _, request = client.request()
    pb >> data(1, request)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", ANY), at=5.0)
    pb << OpenConnection(conn=-1, origin=ANY)
    pb.done()


@pytest.mark.parametrize("kind", sorted(H2_HEADS))
def test_a_malformed_h2_request_is_reset_and_the_next_stream_goes_on(kind: str) -> None:
    pb, client = h2_open()
    sid, request = client.request_as_is(H2_HEADS[kind])
    pb >> data(1, request)
    pb << Sends(1, client, h2_resets((sid, h2.errors.ErrorCodes.PROTOCOL_ERROR)))
    next_stream_is_served(pb, client)  # no backend was asked for the first


@pytest.mark.parametrize("path", [b"/v1/..;/flag", b"/v1/%2e%2e;x/flag"])
def test_a_dot_segment_behind_a_parameter_gets_400_on_its_h2_stream(path: bytes) -> None:
    pb, client = h2_open()
    sid, request = client.request(b"GET", path)
    pb >> data(1, request)
    pb << CancelTimer(timer=("header", 1))
    pb << Sends(1, client, h2_response(sid, 400))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    _, request = client.request()
    pb >> data(1, request)
    pb << CancelTimer(timer=("idle", 1))
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << OpenConnection(conn=-1, origin=ANY)
    pb.done()

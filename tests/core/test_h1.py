"""The HTTP/1.1 adapters' errors by blame (core/http1/h1.py): a client's bad bytes become a 4xx
whose body is fixed text, never a repr of what it sent; our own misuse of h11 raises."""

from __future__ import annotations

import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st
from playbook import H1ClientPeer, Playbook

from muxproxy.core.http1.h1 import H1Server, PeerError

MARK = b"ZQXJ"
# Requests h11 refuses with a text that quotes the offending bytes, and what we answer.
QUOTING = {
    b"GET /" + MARK + b" HTTP/1.1 x\r\nHost: a\r\n\r\n": "illegal request line",
    b"GET / HTTP/1.1\r\nHost: a\r\n" + MARK + b"\r\n\r\n": "illegal header line",
    b"GET / HTTP/1.1\r\nHost: a\r\nX-A: " + MARK + b"\x0cb\r\n\r\n": "illegal header line",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"2\r\nab" + MARK + b"\r\n": "chunk data not followed by CRLF",
    b"GET / HTTP/1.1\r\nHost: a" + MARK + b'!"\r\n\r\n': "invalid authority",
}


def response_to(request: bytes) -> tuple[int, bytes]:
    pb = Playbook()
    pb.accept(1)
    pb.receive(1, request)
    client = H1ClientPeer()
    client.request()
    events = client.events(pb.take(1))
    body = b"".join(e.data for e in events if isinstance(e, h11.Data))
    return int(events[0].status_code), body


@pytest.mark.parametrize("request_bytes", sorted(QUOTING))
def test_400_body_is_a_fixed_reason_not_the_clients_bytes(request_bytes: bytes) -> None:
    status, body = response_to(request_bytes)
    assert status == 400
    assert body == QUOTING[request_bytes].encode() + b"\n"
    assert MARK not in body


@given(st.binary(max_size=200))
def test_no_error_body_quotes_a_repr_whatever_the_client_sends(junk: bytes) -> None:
    server = H1Server(scheme=b"http")
    try:
        server.receive(b"GET / HTTP/1.1\r\nHost: a\r\nX-A: " + junk + b"\r\n\r\n")
        server.receive(junk)
    except PeerError as exc:
        out = server.send_error(exc.status, exc.reason)
        assert out.startswith(b"HTTP/1.1 4") or out.startswith(b"HTTP/1.1 5")
        body = out.split(b"\r\n\r\n", 1)[1]
        assert b"b'" not in body and b'b"' not in body and b"bytearray(" not in body


def test_our_misuse_of_h11_raises_and_is_not_swallowed() -> None:
    # A local error is a bug (h11's LocalProtocolError): it must not vanish into b"".
    server = H1Server(scheme=b"http")
    server.receive(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
    with pytest.raises(h11.LocalProtocolError):
        server.send_error(99, "no such status")

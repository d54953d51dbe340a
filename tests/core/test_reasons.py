"""``core/http1/reasons.py``: every HTTP/1.1 status line the proxy writes carries a reason phrase.

RFC 9112 §4 makes the phrase optional, but clients such as h2load count ``HTTP/1.1 200 `` as a
failure. A relayed response gets the standard phrase of its code whatever the backend wrote
(nothing, or its own words); a code without one keeps the backend's phrase; the proxy's own
answers (an error, 100 Continue) carry theirs. Checked on the bytes the client receives.
"""

from __future__ import annotations

import pytest
from playbook import H1ClientPeer, Playbook

from muxproxy.core.http1.reasons import reason_phrase


def status_line(pb: Playbook, conn: int = 1) -> bytes:
    """The first line the client received."""
    return pb.take(conn).split(b"\r\n", 1)[0]


def relayed(backend_line: bytes) -> bytes:
    """The client's status line for a backend response that starts with ``backend_line``."""
    pb = Playbook()
    client = H1ClientPeer()
    pb.accept(1)
    pb.receive(1, client.request("GET", "/one"))
    (open_cmd,) = pb.opens()
    pb.opened(open_cmd.conn)
    pb.sent(open_cmd.conn, len(pb.take(open_cmd.conn)))
    pb.receive(open_cmd.conn, backend_line + b"\r\nContent-Length: 2\r\n\r\nok")
    return status_line(pb)


@pytest.mark.parametrize(
    ("backend", "client"),
    [
        (b"HTTP/1.1 200 ", b"HTTP/1.1 200 OK"),  # an empty phrase gets the standard one
        (b"HTTP/1.1 200", b"HTTP/1.1 200 OK"),  # so does none at all (h11 reads it so)
        (b"HTTP/1.1 404 Nope", b"HTTP/1.1 404 Not Found"),  # a known code: the standard
        (b"HTTP/1.0 503 x", b"HTTP/1.1 503 Service Unavailable"),
        (b"HTTP/1.1 299 Custom Thing", b"HTTP/1.1 299 Custom Thing"),  # no standard: kept
        (b"HTTP/1.1 299 ", b"HTTP/1.1 299 "),  # no standard, none given: none
    ],
)
def test_a_relayed_status_line_carries_the_standard_reason_phrase(
    backend: bytes, client: bytes
) -> None:
    assert relayed(backend) == client


def test_the_proxys_own_error_carries_its_reason_phrase() -> None:
    pb = Playbook()
    client = H1ClientPeer()
    pb.accept(1)
    pb.receive(1, client.request("GET", "/one"))
    (open_cmd,) = pb.opens()
    pb.closed(open_cmd.conn, "connection refused")  # the connect failed: 502
    assert status_line(pb) == b"HTTP/1.1 502 Bad Gateway"


def test_100_continue_carries_its_reason_phrase() -> None:
    pb = Playbook()
    client = H1ClientPeer()
    pb.accept(1)
    head = client.request("POST", "/one", headers=[("Expect", "100-continue")], body=b"{}")
    pb.receive(1, head[: head.index(b"\r\n\r\n") + 4])
    assert status_line(pb) == b"HTTP/1.1 100 Continue"


def test_reason_phrase_table() -> None:
    assert reason_phrase(200) == b"OK"
    assert reason_phrase(429, b"Slow Down") == b"Too Many Requests"
    assert reason_phrase(599) == b""
    assert reason_phrase(599, b"Network Timeout") == b"Network Timeout"

"""``core/http1/reasons.py``: every HTTP/1.1 status line the proxy writes carries a reason phrase.

RFC 9112 §4 makes the phrase optional, but clients such as h2load count ``HTTP/1.1 200 `` as a
failure. A relayed response gets the standard phrase of its code whatever the backend wrote
(nothing, or its own words); a code without one keeps the backend's phrase; the proxy's own
answers (an error, 100 Continue) carry theirs. Checked on the bytes the client receives.
"""

from __future__ import annotations

import pytest
from playbook import (
    ANY,
    H1BackendPeer,
    H1ClientPeer,
    Playbook,
    Sends,
    Where,
    closed,
    data,
    opened,
    sent,
)

from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    OpenConnection,
    SendData,
    SetTimer,
)
from muxproxy.core.http1.reasons import reason_phrase


def status_line(line: bytes) -> Where:
    """The next command: bytes to client connection 1 that start with the status ``line``."""
    return Where(SendData, lambda c: c.conn == 1 and c.data.split(b"\r\n", 1)[0] == line)


def relayed(backend_line: bytes, client_line: bytes) -> None:
    """The client gets ``client_line`` for a backend response that starts with ``backend_line``."""
    pb = Playbook()
    client = H1ClientPeer()
    pb.accept(1)
    pb >> data(1, client.request("GET", "/one"))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ANY)
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << (request := Sends(-1, H1BackendPeer()))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb >> sent(-1, len(request.data))
    pb >> data(-1, backend_line + b"\r\nContent-Length: 2\r\n\r\nok")
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << status_line(client_line)
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << SendData(conn=1, data=b"ok")
    if backend_line.startswith(b"HTTP/1.1"):
        pb << SetTimer(timer=("pool", -1), at=60.0)  # kept alive
    else:
        pb << CloseConnection(conn=-1)  # an HTTP/1.0 backend closes after its answer
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()


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
    relayed(backend, client)


def test_the_proxys_own_error_carries_its_reason_phrase() -> None:
    pb = Playbook()
    client = H1ClientPeer()
    pb.accept(1)
    pb >> data(1, client.request("GET", "/one"))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ANY)
    pb >> closed(-1, "connection refused")  # the connect failed: 502
    pb << CancelTimer(timer=("connect", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << status_line(b"HTTP/1.1 502 Bad Gateway")
    pb << CloseConnection(conn=1)
    pb.done()


def test_100_continue_carries_its_reason_phrase() -> None:
    pb = Playbook()
    client = H1ClientPeer()
    pb.accept(1)
    head = client.request("POST", "/one", headers=[("Expect", "100-continue")], body=b"{}")
    pb >> data(1, head[: head.index(b"\r\n\r\n") + 4])
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << SendData(conn=1, data=b"HTTP/1.1 100 Continue\r\n\r\n")
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ANY)
    pb << SetTimer(timer=("body", 1), at=30.0)
    pb.done()


def test_reason_phrase_table() -> None:
    assert reason_phrase(200) == b"OK"
    assert reason_phrase(429, b"Slow Down") == b"Too Many Requests"
    assert reason_phrase(599) == b""
    assert reason_phrase(599, b"Network Timeout") == b"Network Timeout"

"""Bytes an HTTP/1.1 backend sends after a complete response never reach the next request.

RFC 9112 §9.3: a server sends nothing between responses that was not asked for. A pooled
connection holding such bytes would hand them to the next request on it, another client's, as
its answer (response splitting). So bytes after the end of a response, in the read that ended
it or in a later one while the connection is idle in the pool, close the connection; they are
counted (``defences_total{kind="upstream_trailing_bytes"}``) and logged. Every framing whose
end h11 knows is covered: Content-Length, chunked, and no body at all (HEAD, 204, 304, a 1xx
before the final response). The backend's bytes are written raw: a real h11 server refuses to
send them. Each test is a conversation: every command in order, timers included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import h11
import pytest
from checks import Check, h1_body, h1_request
from playbook import H1BackendPeer, H1ClientPeer, Playbook, Sends, closed, data, opened, sent
from test_h2guard import ORIGIN

from muxproxy.core.commands import CancelTimer, CloseConnection, Log, OpenConnection, SetTimer

POISON = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nPOISON"
"""What a backend (or whatever stands between) appends: a whole response of its own."""

RESPONSES = {
    "content-length": ("GET", b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"),
    "chunked": (
        "GET",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    ),
    "head": ("HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n"),
    "204": ("GET", b"HTTP/1.1 204 No Content\r\n\r\n"),
    "304": ("GET", b'HTTP/1.1 304 Not Modified\r\nETag: "x"\r\n\r\n'),
    "1xx": (
        "GET",
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    ),
}


STATUS = {"204": 204, "304": 304}
BODILESS = {"head", "204", "304"}


def head_of(status: int, *, end: bool) -> Check:
    """The client's run of a response head: its final status (after any 1xx), nothing of the
    body; ``end``: and the response's end (a response without a body)."""

    def check(events: Sequence[Any]) -> None:
        finals = [e for e in events if isinstance(e, h11.Response)]
        assert [e.status_code for e in finals] == [status], events
        assert not h1_body(events), events
        assert isinstance(events[-1], h11.EndOfMessage) is end, events

    return check


def body_is(body: bytes) -> Check:
    """The client's run of a response body: exactly ``body``, then its end."""

    def check(events: Sequence[Any]) -> None:
        assert h1_body(events) == body, events
        assert isinstance(events[-1], h11.EndOfMessage), events

    return check


def relayed(pb: Playbook, client: H1ClientPeer, framing: str, *, conn: int, ex: int) -> None:
    """Exchange ``ex``'s response of ``framing`` relayed to client ``conn`` (its first: the
    send timer is armed), up to the read timer being cancelled; nothing after its end is."""
    pb << CancelTimer(timer=("head", ex))
    pb << SetTimer(timer=("send", conn), at=60.0)
    bodiless = framing in BODILESS
    pb << (head := Sends(conn, client, head_of(STATUS.get(framing, 200), end=bodiless)))
    pb << SetTimer(timer=("read", ex), at=300.0)
    sends = [head]
    if not bodiless:
        pb << (body := Sends(conn, client, body_is(b"ok")))
        sends.append(body)
    assert not any(b"POISON" in s.data for s in sends)


def first_exchange(
    pb: Playbook, framing: str, reads: list[bytes], *, trailing: bool
) -> tuple[H1ClientPeer, int]:
    """Client 1's request over a new backend connection -1, answered by ``reads`` (the
    response of ``framing``; ``trailing``: with bytes after it, which close the connection:
    at once when in the read that ended the response, else once they come)."""
    method, _ = RESPONSES[framing]
    client = H1ClientPeer()
    pb.accept(1)
    pb >> data(1, client.request(method, "/one"))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << (request := Sends(-1, H1BackendPeer(), h1_request(method.encode(), b"/one")))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb >> sent(-1, len(request.data))
    pb >> data(-1, reads[0])
    relayed(pb, client, framing, conn=1, ex=1)
    same_read = trailing and len(reads) == 1 and not pb.split
    if same_read:
        pb << CloseConnection(conn=-1)  # never pooled
    else:
        pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    if trailing and not same_read:
        if len(reads) > 1:
            pb >> data(-1, reads[1])
        pb << CloseConnection(conn=-1)
        pb << CancelTimer(timer=("pool", -1))
    pb.done()
    return client, -1


def second_client(pb: Playbook, *, pooled: bool) -> tuple[H1ClientPeer, int]:
    """Another client's request, on the pooled connection -1 (``pooled``) or a new one, -2:
    which backend connection carries it."""
    client = H1ClientPeer()
    pb.accept(2)
    pb >> data(2, client.request("GET", "/two"))
    pb << CancelTimer(timer=("header", 2))
    pb << SetTimer(timer=("connect", 2), at=5.0)
    if pooled:
        carrier = -1
        pb << CancelTimer(timer=("pool", -1))
    else:
        carrier = -2
        pb << OpenConnection(conn=-2, origin=ORIGIN)
        pb >> opened(-2)
    pb << CancelTimer(timer=("connect", 2))
    pb << Sends(carrier, H1BackendPeer(), h1_request(b"GET", b"/two"))
    pb << SetTimer(timer=("head", 2), at=60.0)
    return client, carrier


def answer_fresh(pb: Playbook, client: H1ClientPeer, conn: int, up: int) -> bytes:
    """Backend connection ``up`` answers client ``conn``'s request with ``fresh``: relayed, the
    backend connection pooled. Returns the body the client read."""
    pb >> data(up, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfresh")
    pb << CancelTimer(timer=("head", 2))
    pb << SetTimer(timer=("send", conn), at=60.0)
    pb << Sends(conn, client, head_of(200, end=False))
    pb << SetTimer(timer=("read", 2), at=300.0)
    pb << (body := Sends(conn, client, body_is(b"fresh")))
    pb << SetTimer(timer=("pool", up), at=60.0)
    pb << CancelTimer(timer=("read", 2))
    pb << SetTimer(timer=("idle", conn), at=75.0)
    pb.done()
    return h1_body(body.events)


def trailing_logs(pb: Playbook) -> list[Log]:
    return [c for c in pb.log if isinstance(c, Log) and c.event == "upstream_trailing_bytes"]


@pytest.mark.parametrize("timing", ["same_read", "later_read", "byte_by_byte"])
@pytest.mark.parametrize("framing", list(RESPONSES))
def test_bytes_after_a_response_close_the_backend_connection(framing: str, timing: str) -> None:
    _, response = RESPONSES[framing]
    pb = Playbook(split=1 if timing == "byte_by_byte" else 0)
    reads = [response, POISON] if timing == "later_read" else [response + POISON]
    _, up = first_exchange(pb, framing, reads, trailing=True)
    assert pb.core.statistics().idle_upstream_connections == 0

    # A new connection: the poisoned one was never given out again.
    client, carrier = second_client(pb, pooled=False)
    assert carrier != up
    assert answer_fresh(pb, client, 2, carrier) == b"fresh"

    assert pb.core.counters["upstream_trailing_bytes"] == 1
    (line,) = trailing_logs(pb)
    assert line.fields["server"] == "127.0.0.1:9001"
    assert "client" not in line.fields
    defences = pb.core.measurements.snapshot()["metrics"]["muxproxy_defences_total"]
    assert [["upstream_trailing_bytes"], 1] in defences["samples"]


@pytest.mark.parametrize("framing", list(RESPONSES))
def test_a_clean_response_keeps_the_connection_for_the_next_request(framing: str) -> None:
    _, response = RESPONSES[framing]
    pb = Playbook()
    _, up = first_exchange(pb, framing, [response], trailing=False)
    assert pb.core.statistics().idle_upstream_connections == 1
    client, carrier = second_client(pb, pooled=True)
    assert carrier == up
    assert answer_fresh(pb, client, 2, up) == b"fresh"
    assert pb.core.counters["upstream_trailing_bytes"] == 0
    assert not trailing_logs(pb)


def test_a_response_framed_by_the_close_is_not_pooled_nor_counted() -> None:
    # RFC 9112 §6.3: no Content-Length, no chunked: the body ends at EOF, every byte is body.
    pb = Playbook()
    client = H1ClientPeer()
    pb.accept(1)
    pb >> data(1, client.request("GET", "/one"))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << (request := Sends(-1, H1BackendPeer(), h1_request(b"GET", b"/one")))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb >> sent(-1, len(request.data))
    pb >> data(-1, b"HTTP/1.1 200 OK\r\n\r\nall of it" + POISON)
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, head_of(200, end=False))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << Sends(1, client, lambda events: h1_body(events) == b"all of it" + POISON)
    pb >> closed(-1)
    pb << Sends(1, client, body_is(b""))  # the body, as the backend framed it, ends
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()
    assert pb.core.statistics().idle_upstream_connections == 0
    client2, carrier = second_client(pb, pooled=False)
    assert carrier != -1
    assert answer_fresh(pb, client2, 2, carrier) == b"fresh"
    assert pb.core.counters["upstream_trailing_bytes"] == 0

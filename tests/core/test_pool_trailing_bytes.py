"""Bytes an HTTP/1.1 backend sends after a complete response never reach the next request.

RFC 9112 §9.3: a server sends nothing between responses that was not asked for. A pooled
connection holding such bytes would hand them to the next request on it, another client's, as
its answer (response splitting). So bytes after the end of a response, in the read that ended
it or in a later one while the connection is idle in the pool, close the connection; they are
counted (``defences_total{kind="upstream_trailing_bytes"}``) and logged. Every framing whose
end h11 knows is covered: Content-Length, chunked, and no body at all (HEAD, 204, 304, a 1xx
before the final response). The backend's bytes are written raw: a real h11 server refuses to
send them.
"""

from __future__ import annotations

import h11
import pytest
from playbook import H1ClientPeer, Playbook

from muxproxy.core.commands import CloseConnection, Log, SendData

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


def first_exchange(pb: Playbook, method: str, reads: list[bytes]) -> tuple[H1ClientPeer, int]:
    """Client 1's request over a new backend connection, answered by ``reads``."""
    client = H1ClientPeer()
    pb.accept(1)
    pb.receive(1, client.request(method, "/one"))
    (open_cmd,) = pb.opens()
    up = open_cmd.conn
    pb.opened(up)
    pb.sent(up, len(pb.take(up)))
    for read in reads:
        pb.receive(up, read)
    events = client.events(pb.take(1))
    assert type(events[-1]) is h11.EndOfMessage
    assert b"POISON" not in pb.take(1)
    return client, up


def second_client(pb: Playbook) -> tuple[H1ClientPeer, int]:
    """Another client's request: which backend connection carries it."""
    client = H1ClientPeer()
    pb.accept(2)
    before = len(pb.log)
    pb.receive(2, client.request("GET", "/two"))
    carriers = {c.conn for c in pb.log[before:] if isinstance(c, SendData) and c.conn < 0}
    opens = [c.conn for c in pb.opens()]
    if not carriers:  # a new connection is being opened for it
        pb.opened(opens[-1])
        carriers = {opens[-1]}
    (carrier,) = carriers
    return client, carrier


def answer_fresh(pb: Playbook, client: H1ClientPeer, conn: int, up: int) -> bytes:
    before = len(pb.log)
    pb.receive(up, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfresh")
    events = client.events(pb.take(conn, pb.log[before:]))
    return b"".join(e.data for e in events if type(e) is h11.Data)


def trailing_logs(pb: Playbook) -> list[Log]:
    return [c for c in pb.log if isinstance(c, Log) and c.event == "upstream_trailing_bytes"]


@pytest.mark.parametrize("timing", ["same_read", "later_read", "byte_by_byte"])
@pytest.mark.parametrize("framing", list(RESPONSES))
def test_bytes_after_a_response_close_the_backend_connection(framing: str, timing: str) -> None:
    method, response = RESPONSES[framing]
    pb = Playbook(split=1 if timing == "byte_by_byte" else 0)
    reads = [response, POISON] if timing == "later_read" else [response + POISON]
    _, up = first_exchange(pb, method, reads)
    assert CloseConnection(conn=up, flush_timeout=60.0) in pb.log
    assert pb.core.statistics().idle_upstream_connections == 0

    client, carrier = second_client(pb)
    assert carrier != up  # a new connection: the poisoned one was never given out again
    assert answer_fresh(pb, client, 2, carrier) == b"fresh"

    assert pb.core.counters["upstream_trailing_bytes"] == 1
    (line,) = trailing_logs(pb)
    assert line.fields["server"] == "127.0.0.1:9001"
    assert "client" not in line.fields
    defences = pb.core.measurements.snapshot()["metrics"]["muxproxy_defences_total"]
    assert [["upstream_trailing_bytes"], 1] in defences["samples"]


@pytest.mark.parametrize("framing", list(RESPONSES))
def test_a_clean_response_keeps_the_connection_for_the_next_request(framing: str) -> None:
    method, response = RESPONSES[framing]
    pb = Playbook()
    _, up = first_exchange(pb, method, [response])
    assert pb.core.statistics().idle_upstream_connections == 1
    client, carrier = second_client(pb)
    assert carrier == up
    assert answer_fresh(pb, client, 2, up) == b"fresh"
    assert pb.core.counters["upstream_trailing_bytes"] == 0
    assert not trailing_logs(pb)


def test_a_response_framed_by_the_close_is_not_pooled_nor_counted() -> None:
    # RFC 9112 §6.3: no Content-Length, no chunked: the body ends at EOF, every byte is body.
    pb = Playbook()
    client = H1ClientPeer()
    pb.accept(1)
    pb.receive(1, client.request("GET", "/one"))
    (open_cmd,) = pb.opens()
    up = open_cmd.conn
    pb.opened(up)
    pb.sent(up, len(pb.take(up)))
    pb.receive(up, b"HTTP/1.1 200 OK\r\n\r\nall of it" + POISON)
    pb.closed(up)
    body = b"".join(e.data for e in client.events(pb.take(1)) if type(e) is h11.Data)
    assert body == b"all of it" + POISON  # the body, as the backend framed it
    assert pb.core.statistics().idle_upstream_connections == 0
    client2, carrier = second_client(pb)
    assert carrier != up
    assert answer_fresh(pb, client2, 2, carrier) == b"fresh"
    assert pb.core.counters["upstream_trailing_bytes"] == 0

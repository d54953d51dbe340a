"""``core/http1/h1client.py``: an HTTP/2 server behind a server configured as HTTP/1.1; what a
chunked response leaves in h11.

Such a server (a gRPC server left at the default ``protocol = "h1"``) answers an HTTP/1.1
request with its SETTINGS frame (RFC 9113 §3.4), which h11 calls an illegal status line. The
failure then names the likely cause and the fix in the access log's outcome, whether h11
rejects the bytes at once or the server closes first; other garbage gets no such hint.
"""

from __future__ import annotations

import h2.config
import h2.connection
import h11
import pytest
from playbook import H1ClientPeer, Playbook

from muxproxy.core.commands import Log
from muxproxy.core.http1.h1client import H2_HINT, H1Client, speaks_h2
from muxproxy.core.messages import Body, End, ResponseHead


def h2_server_opening() -> bytes:
    """What an HTTP/2 server sends first: its SETTINGS (and, here, a WINDOW_UPDATE)."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    conn.initiate_connection()
    conn.increment_flow_control_window(1 << 20)
    return conn.data_to_send()


def outcome(reads: list[bytes], *, close: bool) -> str:
    """The access log's outcome of one request whose backend sent ``reads`` (then closed)."""
    pb = Playbook()
    client = H1ClientPeer()
    pb.accept(1)
    pb.receive(1, client.request("POST", "/test.Echo/Unary", body=b"\x00\x00\x00\x00\x00"))
    (open_cmd,) = pb.opens()
    pb.opened(open_cmd.conn)
    pb.sent(open_cmd.conn, len(pb.take(open_cmd.conn)))
    for read in reads:
        pb.receive(open_cmd.conn, read)
    if close:
        pb.closed(open_cmd.conn)
    assert pb.take(1).startswith(b"HTTP/1.1 502 ")
    (access,) = [c for c in pb.log if isinstance(c, Log) and c.event == "access"]
    return str(access.fields["outcome"])


@pytest.mark.parametrize("close", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_an_http2_answer_names_the_protocol_setting(close: bool, split: bool) -> None:
    opening = h2_server_opening()
    # h11 gives up on the first byte; a read that ended inside the frame header is enough.
    reads = [opening[:4], opening[4:]] if split else [opening]
    assert H2_HINT in outcome(reads, close=close)
    assert 'protocol = "h2"' in H2_HINT


def test_other_garbage_gets_no_hint() -> None:
    assert H2_HINT not in outcome([b"SSH-2.0-OpenSSH_9.6\r\n\r\n"], close=True)


def test_speaks_h2() -> None:
    assert speaks_h2(h2_server_opening())
    assert speaks_h2(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # an empty SETTINGS
    assert speaks_h2(b"\x00\x00\x06\x04\x00\x00")  # what came of it fits
    assert not speaks_h2(b"\x00\x00\x06")  # too short to tell
    assert not speaks_h2(b"\x00\x00\x00\x04\x01\x00\x00")  # an ACK
    assert not speaks_h2(b"\x00\x00\x05\x04\x00\x00\x00\x00\x00")  # not a multiple of 6
    assert not speaks_h2(b"\x00\x00\x06\x04\x00\x00\x00\x00\x01")  # not stream 0
    assert not speaks_h2(b"HTTP/1.1 200 OK\r\n")


def _chunked_response(client: H1Client, body_chunks: list[bytes]) -> list[object]:
    """One request (complete), then a chunked response whose head and ``body_chunks`` come in
    one read, as a backend that wrote them before the proxy read does."""
    client.send_head(1, b"GET", b"/sse", [(b"host", b"backend")])
    client.send_end([])
    backend = h11.Connection(h11.SERVER)
    backend.receive_data(b"GET /sse HTTP/1.1\r\nhost: backend\r\n\r\n")
    assert isinstance(backend.next_event(), h11.Request)
    head = h11.Response(status_code=200, headers=[("transfer-encoding", "chunked")])
    read = backend.send(head) or b""
    for chunk in body_chunks:
        read += backend.send(h11.Data(data=chunk)) or b""
    return [*client.receive(read), backend]


def test_a_chunked_response_read_is_not_also_kept_by_h11() -> None:
    """h11 parsed the head only; the rest of the read went to the chunked decoder. Kept in
    h11's receive buffer too, it stayed there, a second copy, for as long as the body
    streamed: 200 stalled streams held ~2.5 MiB for nothing (docs/performance.md)."""
    client = H1Client()
    chunks = [b"data: %d\n\n" % i * 40 for i in range(30)]
    *messages, backend = _chunked_response(client, chunks)
    assert isinstance(messages[0], ResponseHead)
    assert [m.data for m in messages[1:] if isinstance(m, Body)] == [b"".join(chunks)]
    assert client.conn.trailing_data == (b"", False)  # h11 holds none of the body
    assert client.response_started and not client.reusable  # the body is still coming
    assert isinstance(backend, h11.Connection)
    (end,) = client.receive(backend.send(h11.EndOfMessage()) or b"")
    assert isinstance(end, End)
    assert client.reusable  # kept alive, as before
    client.next_cycle()
    chunks = [b"second response"]
    *messages, backend = _chunked_response(client, chunks)
    assert [m.data for m in messages if isinstance(m, Body)] == chunks


def test_a_chunked_response_before_the_request_ended_keeps_h11() -> None:
    """A backend may answer before the request body is all sent (RFC 9112 §9.5: an early
    response); h11 still frames the rest of the request, so it stays until the cycle ends."""
    client = H1Client()
    client.send_head(1, b"POST", b"/upload", [(b"host", b"b"), (b"content-length", b"4")])
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nearly\r\n"
    messages = client.receive(head)
    assert [m.data for m in messages if isinstance(m, Body)] == [b"early"]
    assert client.send_body(b"rest") == b"rest"
    client.send_end([])
    client.receive(b"0\r\n\r\n")
    assert client.reusable

"""``core/h1client.py``: an HTTP/2 server behind a server configured as HTTP/1.1.

Such a server (a gRPC server left at the default ``protocol = "h1"``) answers an HTTP/1.1
request with its SETTINGS frame (RFC 9113 §3.4), which h11 calls an illegal status line. The
failure then names the likely cause and the fix in the access log's outcome, whether h11
rejects the bytes at once or the server closes first; other garbage gets no such hint.
"""

from __future__ import annotations

import h2.config
import h2.connection
import pytest
from playbook import H1ClientPeer, Playbook

from muxproxy.core.commands import Log
from muxproxy.core.h1client import H2_HINT, speaks_h2


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

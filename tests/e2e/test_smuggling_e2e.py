"""End to end: request smuggling shapes over real sockets never reach the backend.

The core-level cases are in tests/core/test_smuggling.py; here a handful of the most important
ones go through the real Trio driver and sockets to a recording backend: the client gets 400
(HTTP/1.1) or RST_STREAM(PROTOCOL_ERROR) (HTTP/2 -> HTTP/1.1 downgrade) and the backend gets no
connection and no byte. A good request sent afterwards (a new HTTP/1.1 connection, or a new
stream on the same HTTP/2 connection) is then the only thing the backend ever sees, which
orders the check: by the time it arrived, a forwarded bad request would have too.
"""

from __future__ import annotations

import h2.errors
import h11
import pytest
import trio
from peers import (
    h1_read_response,
    h1_request_bytes,
    open_h2,
    open_tcp,
    read_until_eof,
)
from stepped import RecordingBackend


async def h1_control(backend: RecordingBackend, port: int) -> None:
    """A good request on a fresh connection; returns once the backend has it."""
    stream = await open_tcp(port)
    conn, data = h1_request_bytes(b"/control")
    await stream.send_all(data)
    response, body = await h1_read_response(stream, conn)
    assert (response.status_code, body) == (200, b"ok")
    await backend.wait_for(b"/control")
    await stream.aclose()


# Each is sent in one write (a bad chunk size thus arrives in the same packet as the head).
SMUGGLING_H1 = {
    "cl-and-te": b"POST /smuggled HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "duplicate-cl": b"POST /smuggled HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n"
    b"Content-Length: 5\r\n\r\nhello",
    "cl-list": b"POST /smuggled HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 5\r\n\r\nhello",
    "bad-chunk-size": b"POST /smuggled HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"zz\r\nhello\r\n0\r\n\r\n",
    "obs-fold": b"GET /smuggled HTTP/1.1\r\nHost: a\r\nX-A: b\r\n c\r\n\r\n",
    "bare-lf": b"GET /smuggled HTTP/1.1\nHost: a\n\n",
    "ctl-in-value": b"GET /smuggled HTTP/1.1\r\nHost: a\r\nX-A: b\x01c\r\n\r\n",
    "chunk-size-2**64+5": b"POST /smuggled HTTP/1.1\r\nHost: a\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n10000000000000005\r\nhello\r\n0\r\n\r\n",
    "empty-host": b"GET /smuggled HTTP/1.1\r\nHost: \r\n\r\n",
    "version-2.0": b"GET /smuggled HTTP/2.0\r\nHost: a\r\n\r\n",
}
# RFC 9110 §15.6.6: a request line of another major version is a 505, not a 400.
STATUS_H1 = {"version-2.0": b"505"}


@pytest.mark.parametrize("kind", sorted(SMUGGLING_H1))
async def test_ambiguous_h1_request_is_400_and_the_backend_gets_nothing(recorded, kind):
    backend, proxy = recorded
    with trio.fail_after(10):
        stream = await open_tcp(proxy.port)
        await stream.send_all(SMUGGLING_H1[kind])
        answer = await read_until_eof(stream)  # the proxy closes after the 400
        await stream.aclose()
        assert answer.startswith(b"HTTP/1.1 %s " % STATUS_H1.get(kind, b"400")), answer
        assert b"b'" not in answer  # a fixed reason, not a repr of the client's bytes
        assert (backend.connections, bytes(backend.received)) == (0, b"")
        await h1_control(backend, proxy.port)
    assert backend.connections == 1
    assert backend.targets == [b"/control"]


async def test_smuggled_request_pipelined_behind_a_good_one_never_reaches_the_backend(recorded):
    backend, proxy = recorded
    good = b"GET /first HTTP/1.1\r\nHost: a\r\n\r\n"
    with trio.fail_after(10):
        stream = await open_tcp(proxy.port)
        await stream.send_all(good + SMUGGLING_H1["duplicate-cl"])
        answer = await read_until_eof(stream)
        await stream.aclose()
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method="GET", target="/first", headers=[("host", "a")]))
        conn.send(h11.EndOfMessage())
        conn.receive_data(answer)
        first = conn.next_event()
        assert isinstance(first, h11.Response) and first.status_code == 200, answer
        assert b"\r\n\r\nokHTTP/1.1 400 " in answer, answer
        await h1_control(backend, proxy.port)
    assert backend.targets == [b"/first", b"/control"]
    assert b"/smuggled" not in backend.received
    assert b"hello" not in backend.received


BASE = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")]

SMUGGLING_H2 = {
    "cr-in-value": [*BASE, (b"x-a", b"b\rc")],
    "lf-in-value": [*BASE, (b"x-a", b"b\r\nx-injected: 1")],
    "nul-in-value": [*BASE, (b"x-a", b"b\x00c")],
    "colon-in-name": [*BASE, (b"x:b", b"c")],
    "crlf-in-path": [*BASE[:3], (b":path", b"/ HTTP/1.1\r\nHost: evil\r\n\r\nGET /")],
    "transfer-encoding": [*BASE, (b"transfer-encoding", b"chunked")],
    "connection": [*BASE, (b"connection", b"keep-alive")],
    "te-gzip": [*BASE, (b"te", b"gzip")],
}


@pytest.mark.parametrize("kind", sorted(SMUGGLING_H2))
async def test_h2_request_that_would_smuggle_in_http1_is_reset_and_never_forwarded(recorded, kind):
    backend, proxy = recorded
    with trio.fail_after(10):
        async with open_h2(proxy.port) as peer:
            bad = await peer.wait_done(await peer.request_as_is(SMUGGLING_H2[kind]))
            assert bad.headers is None
            assert bad.reset == h2.errors.ErrorCodes.PROTOCOL_ERROR
            assert (backend.connections, bytes(backend.received)) == (0, b"")
            # The connection survives: a good stream on it is served.
            good = await peer.request("GET", "/control")
            stream = await peer.wait_done(good)
            assert (stream.status, stream.body) == (200, b"ok")
            assert peer.terminated is None
    assert backend.connections == 1
    assert backend.targets == [b"/control"]


async def test_h2_request_without_authority_or_host_is_400_and_never_forwarded(recorded):
    backend, proxy = recorded
    with trio.fail_after(10):
        async with open_h2(proxy.port) as peer:
            head = [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/smuggled")]
            bad = await peer.wait_done(await peer.request_as_is(head))
            assert bad.status == 400 and bad.ended
            good = await peer.request("GET", "/control")
            stream = await peer.wait_done(good)
            assert (stream.status, stream.body) == (200, b"ok")
    assert backend.targets == [b"/control"]

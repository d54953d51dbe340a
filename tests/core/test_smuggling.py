"""Request smuggling through the core: every ambiguous request is refused before a backend
connection is even asked for (RFC 9112 §6.1, §6.3, §2.2, §5.2; RFC 9113 §8.2)."""

from __future__ import annotations

import h2.errors
import h2.events
import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st
from playbook import H1BackendPeer, H1ClientPeer, Playbook, h2_request_as_is, stream_resets

from muxproxy.core.commands import CloseConnection
from muxproxy.core.http1.h1 import PeerError, check_raw_head

# Each is a complete request the client sends in one piece; h11 would accept (and normalise)
# every one of the first six.
SMUGGLING_H1 = {
    "cl-and-te": b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "te-and-cl": b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n"
    b"Content-Length: 5\r\n\r\n0\r\n\r\n",
    "duplicate-cl": b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n"
    b"Content-Length: 5\r\n\r\nhello",
    "cl-list": b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 5\r\n\r\nhello",
    "obs-fold": b"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\r\n c\r\n\r\n",
    "bare-lf": b"GET / HTTP/1.1\nHost: a\n\n",
    "bare-lf-one-line": b"GET / HTTP/1.1\r\nHost: a\nX-A: b\r\n\r\n",
    "http10-te": b"POST / HTTP/1.0\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    # h11 refuses these itself; they are here so a change of h11 cannot let them through.
    "conflicting-cl": b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n"
    b"Content-Length: 6\r\n\r\nhello",
    "cl-plus": b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +5\r\n\r\nhello",
    "te-gzip": b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    "te-twice": b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "space-before-colon": b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding : chunked\r\n\r\n",
    "chunk-size-not-hex": b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"zz\r\nhello\r\n0\r\n\r\n",
    "chunk-size-negative": b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"-5\r\nhello\r\n0\r\n\r\n",
    "chunk-size-0x": b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"0x5\r\nhello\r\n0\r\n\r\n",
    "chunk-without-crlf": b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\nhelloXX0\r\n\r\n",
    "nul-in-value": b"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\x00c\r\n\r\n",
    "bare-cr": b"GET / HTTP/1.1\r\nHost: a\rX-A: b\r\n\r\n",
    # RFC 9110 §5.5: control characters in a value, which h11 lets through.
    "soh-in-value": b"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\x01c\r\n\r\n",
    "esc-in-value": b"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\x1b[2Jc\r\n\r\n",
    "del-in-value": b"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\x7f\r\n\r\n",
    "ctl-in-host": b"GET / HTTP/1.1\r\nHost: a\x1f\r\n\r\n",
    # A chunk size that wraps a 64-bit integer (2**64 + 5), and one of 2**40: h11 takes both.
    "chunk-size-2**64+5": b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"10000000000000005\r\nhello\r\n0\r\n\r\n",
    "chunk-size-2**40": b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"10000000000\r\nhello\r\n0\r\n\r\n",
    "ctl-in-chunk-ext": b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5;a=\x01\r\nhello\r\n0\r\n\r\n",
    "ctl-in-trailer": b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n0\r\nx-a: \x01\r\n\r\n",
    # RFC 9112 §2.3: HTTP/2 has no request line; any major version but 1 is a 505.
    "version-2.0": b"GET / HTTP/2.0\r\nHost: a\r\n\r\n",
    "version-0.9": b"GET / HTTP/0.9\r\nHost: a\r\n\r\n",
    # RFC 9110 §4.2.1: an http URI with an empty host is invalid.
    "empty-host": b"GET / HTTP/1.1\r\nHost: \r\n\r\n",
    "host-only-port": b"GET / HTTP/1.1\r\nHost: :80\r\n\r\n",
}


def _status_of(data: bytes) -> int:
    client = H1ClientPeer()
    client.request()
    events = client.events(data)
    return int(events[0].status_code)


# RFC 9112 §6.1: an unknown transfer coding is a 501 (h11's answer).
STATUS = {"te-gzip": 501, "te-twice": 501, "version-2.0": 505, "version-0.9": 505}
# Errors in the body framing: h11 finds them only when the body arrives. Sent in one piece
# with the head they are refused before the head is forwarded; byte by byte the head has
# gone out by then, and the backend request is cut off unfinished (its connection closed).
BODY_FRAMING = {
    "chunk-size-not-hex",
    "chunk-size-negative",
    "chunk-size-0x",
    "chunk-without-crlf",
    "chunk-size-2**64+5",
    "chunk-size-2**40",
    "ctl-in-chunk-ext",
    "ctl-in-trailer",
}


@pytest.mark.parametrize("split", [0, 1])
@pytest.mark.parametrize("kind", sorted(SMUGGLING_H1))
def test_ambiguous_h1_request_is_refused_and_never_forwarded(kind, split):
    pb = Playbook(split=split)
    pb.accept(1)
    pb.receive(1, SMUGGLING_H1[kind])
    assert any(isinstance(c, CloseConnection) and c.conn == 1 for c in pb.log)
    if split and kind in BODY_FRAMING:
        return  # the exchange is aborted; no error response once a request is under way
    assert pb.opens() == []
    assert _status_of(pb.take(1)) == STATUS.get(kind, 400)


def test_smuggled_request_pipelined_after_a_good_one_is_refused():
    """The raw-head check also covers a head that waited in h11's trailing data."""
    pb = Playbook()
    pb.accept(1)
    good = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
    pb.receive(1, good + SMUGGLING_H1["duplicate-cl"])
    (open_,) = pb.opens()
    pb.opened(open_.conn)
    backend = H1BackendPeer()
    (request, _end) = backend.events(pb.take(open_.conn))
    assert request.target == b"/"
    answer = backend.conn.send(h11.Response(status_code=204, headers=[])) or b""
    answer += backend.end()
    pb.receive(open_.conn, answer)
    client = H1ClientPeer()
    client.request()
    events = client.events(pb.take(1))
    assert events[0].status_code == 204
    assert b"HTTP/1.1 400 " in pb.take(1)
    assert len(pb.opens()) == 1
    assert backend.events(pb.take(open_.conn)) == []


@pytest.mark.parametrize(
    "head",
    [
        b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nX-Note: a, b\r\nTransfer-Encoding: chunked\r\n",
    ],
)
def test_clean_heads_pass_the_raw_check(head):
    check_raw_head(head)


@pytest.mark.parametrize(
    ("head", "reason"),
    [
        (b"GET / HTTP/1.1\nHost: a\n", "bare LF"),
        (b"GET / HTTP/1.1\r\nX: a\r\n\tb\r\n", "obs-fold"),
        (b"GET / HTTP/1.1\r\ncontent-length: 1\r\nCONTENT-LENGTH: 1\r\n", "more than one"),
        (b"GET / HTTP/1.1\r\nContent-Length: 1,1\r\n", "list"),
    ],
)
def test_raw_check_names_the_problem(head, reason):
    with pytest.raises(PeerError, match=reason) as info:
        check_raw_head(head)
    assert info.value.status == 400


def content_length_problem(head: bytes) -> str | None:
    """The Content-Length rules of ``check_raw_head``, field line by field line."""
    lengths = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            lengths += 1
            if lengths > 1:
                return "more than one"
            if b"," in value:
                return "list"
    return None


field_lines = st.lists(
    st.tuples(
        st.sampled_from([b"Content-Length", b"content-length", b"CONTENT-LENGTH", b"X-Length"]),
        st.sampled_from([b"5", b" 5", b"1,1", b"1, 1", b"", b"a,b"]),
    ),
    max_size=4,
)


@given(field_lines)
def test_raw_check_finds_content_length_like_a_walk_over_the_lines(fields):
    head = b"POST / HTTP/1.1\r\nHost: a\r\n" + b"".join(n + b":" + v + b"\r\n" for n, v in fields)
    expected = content_length_problem(head)
    if expected is None:
        check_raw_head(head)
    else:
        with pytest.raises(PeerError, match=expected):
            check_raw_head(head)


# -- HTTP/2 -> HTTP/1.1 downgrade ------------------------------------------------------------

BASE = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")]

# Fields that would split or extend the HTTP/1.1 head we write for the backend, and the
# connection-specific fields RFC 9113 §8.2.2 forbids.
SMUGGLING_H2 = {
    "cr-in-value": [*BASE, (b"x-a", b"b\rc")],
    "lf-in-value": [*BASE, (b"x-a", b"b\r\nx-injected: 1")],
    "nul-in-value": [*BASE, (b"x-a", b"b\x00c")],
    "cr-in-name": [*BASE, (b"x-a\r", b"b")],
    "lf-in-name": [*BASE, (b"x\nb", b"c")],
    "nul-in-name": [*BASE, (b"x\x00b", b"c")],
    "colon-in-name": [*BASE, (b"x:b", b"c")],
    "space-in-name": [*BASE, (b"x b", b"c")],
    "crlf-in-path": [*BASE[:3], (b":path", b"/ HTTP/1.1\r\nHost: evil\r\n\r\nGET /")],
    "space-in-path": [*BASE[:3], (b":path", b"/a b")],
    "crlf-in-method": [(b":method", b"GET / HTTP/1.1\r\n"), *BASE[1:]],
    "crlf-in-authority": [*BASE[:2], (b":authority", b"a\r\nx: y"), BASE[3]],
    "transfer-encoding": [*BASE, (b"transfer-encoding", b"chunked")],
    "keep-alive": [*BASE, (b"keep-alive", b"timeout=5")],
    "proxy-connection": [*BASE, (b"proxy-connection", b"keep-alive")],
    "upgrade": [*BASE, (b"upgrade", b"websocket")],
    "te-trailers-and-gzip": [*BASE, (b"te", b"trailers, gzip")],
    "leading-space-in-value": [*BASE, (b"x-a", b" b")],
}


@pytest.mark.parametrize("kind", sorted(SMUGGLING_H2))
def test_h2_request_that_would_smuggle_in_http1_is_reset_and_never_forwarded(kind):
    pb, _, sid, events = h2_request_as_is(SMUGGLING_H2[kind])
    assert pb.opens() == []
    assert stream_resets(events) == [(sid, h2.errors.ErrorCodes.PROTOCOL_ERROR)]
    assert not any(isinstance(e, h2.events.ConnectionTerminated) for e in events)


def test_h2_request_without_authority_or_host_gets_400_on_its_stream():
    # RFC 9113 §8.3.1: an http(s) request carries :authority or Host; without either it is
    # answered 400 (§8.1.1 allows a response before the stream closes), never forwarded,
    # and the connection's other streams go on.
    head = [(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/v1/models")]
    pb, client, sid, events = h2_request_as_is(head)  # h2 refuses to send such a request
    assert pb.opens() == []
    (response,) = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert response.stream_id == sid and dict(response.headers)[b":status"] == b"400"
    body = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
    assert body == b"no :authority or host field\n"
    assert any(isinstance(e, h2.events.StreamEnded) and e.stream_id == sid for e in events)
    assert not any(isinstance(e, h2.events.ConnectionTerminated) for e in events)
    _, data = client.request()
    pb.receive(1, data)
    assert len(pb.opens()) == 1

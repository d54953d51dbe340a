"""Request smuggling through the core: every ambiguous request is refused before a backend
connection is even asked for (RFC 9112 §6.1, §6.3, §2.2, §5.2; RFC 9113 §8.2).

The requests through the core are conversations: every command in order, timers included, so
a refusal that also asked for a backend connection fails. The raw-head check alone is tested
with data, and against a walk over the field lines with Hypothesis."""

from __future__ import annotations

import h2.errors
import h11
import pytest
from checks import both, h1_request, h1_response, h2_resets, h2_response
from hypothesis import given
from hypothesis import strategies as st
from playbook import (
    H1BackendPeer,
    H1ClientPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    accepted,
    data,
    opened,
)
from test_h2guard import ORIGIN, acked, settings

from muxproxy.core.commands import CancelTimer, CloseConnection, OpenConnection, SetTimer
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


def _reader() -> H1ClientPeer:
    """A client peer that reads the answer to a request the test sent as raw bytes."""
    client = H1ClientPeer()
    client.request()
    return client


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
    pb >> data(1, SMUGGLING_H1[kind])
    if split and kind in BODY_FRAMING:
        # The head went on before the body's framing failed: the backend connection asked
        # for is closed at once, before it carried a byte.
        pb << CancelTimer(timer=("header", 1))
        pb << SetTimer(timer=("connect", 1), at=5.0)
        pb << OpenConnection(conn=-1, origin=ORIGIN)
        pb << SetTimer(timer=("body", 1), at=30.0)
        pb << CloseConnection(conn=-1)
        pb << CancelTimer(timer=("connect", 1))
        pb << CancelTimer(timer=("body", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, _reader(), h1_response(STATUS.get(kind, 400)))
    pb << CloseConnection(conn=1)
    pb.done()


def test_smuggled_request_pipelined_after_a_good_one_is_refused():
    """The raw-head check also covers a head that waited in h11's trailing data."""
    pb = Playbook()
    client = H1ClientPeer()
    pb.accept(1)
    good = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
    client.request("GET", "/")  # the good request, as the client peer reads its answer
    pb >> data(1, good + SMUGGLING_H1["duplicate-cl"])
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    backend = H1BackendPeer()
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    only_good = lambda events: len(events) == 2  # noqa: E731  # the request and its end
    pb << Sends(-1, backend, both(h1_request(b"GET", b"/"), only_good))
    pb << SetTimer(timer=("head", 1), at=60.0)
    answer = backend.conn.send(h11.Response(status_code=204, headers=[])) or b""
    pb >> data(-1, answer + backend.end())
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(204))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << Sends(1, _reader(), h1_response(400))  # the smuggled one: refused, not forwarded
    pb << CloseConnection(conn=1)
    pb.done()


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


def h2_client(pb: Playbook) -> H2ClientPeer:
    """Client connection 1 (TLS, ALPN h2) and its preface: the proxy's SETTINGS first, then
    its ACK of the client's."""
    client = H2ClientPeer()
    pb >> accepted(1, tls=True, alpn="h2")
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, settings)
    pb << SetTimer(timer=("header", 1), at=30.0)
    pb >> data(1, client.preface())
    pb << Sends(1, client, acked)
    return client


@pytest.mark.parametrize("kind", sorted(SMUGGLING_H2))
def test_h2_request_that_would_smuggle_in_http1_is_reset_and_never_forwarded(kind):
    pb = Playbook()
    client = h2_client(pb)
    sid, request = client.request_as_is(SMUGGLING_H2[kind])
    pb >> data(1, request)
    pb << Sends(1, client, h2_resets((sid, h2.errors.ErrorCodes.PROTOCOL_ERROR)))  # no GOAWAY
    pb.done()  # never forwarded


def test_h2_request_without_authority_or_host_gets_400_on_its_stream():
    # RFC 9113 §8.3.1: an http(s) request carries :authority or Host; without either it is
    # answered 400 (§8.1.1 allows a response before the stream closes), never forwarded,
    # and the connection's other streams go on.
    head = [(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/v1/models")]
    pb = Playbook()
    client = h2_client(pb)
    sid, request = client.request_as_is(head)  # h2 refuses to send such a request
    pb >> data(1, request)
    body = b"no :authority or host field\n"
    pb << Sends(1, client, both(h2_response(sid, 400, body, ended=True), h2_resets()))
    pb.done()  # never forwarded
    _, request = client.request()
    pb >> data(1, request)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb.done()

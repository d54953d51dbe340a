"""The chunked response-body decoder, against h11 as the oracle, and ``H1Client`` around it."""

from __future__ import annotations

import itertools

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muxproxy.core.http1.chunked import MAX_SIZE_DIGITS, ChunkedDecoder, ChunkedError
from muxproxy.core.http1.h1 import H1Server
from muxproxy.core.http1.h1client import H1Client
from muxproxy.core.messages import Abort, Body, End, RequestHead, ResponseHead

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"

payloads = st.lists(st.binary(min_size=1, max_size=300), max_size=12)
extensions = st.sampled_from([b"", b";a=1", b";name ", b';x="q u o t e d"', b";k\t"])
trailer_sets = st.lists(
    st.tuples(
        st.sampled_from([b"grpc-status", b"X-Checksum", b"server-timing"]),
        st.sampled_from([b"0", b"abc def", b"", b"1;dur=2"]),
    ),
    max_size=3,
)


def encode(
    chunks: list[bytes], ext: bytes = b"", trailers: list[tuple[bytes, bytes]] | None = None
) -> bytes:
    out = b"".join(b"%x%s\r\n%s\r\n" % (len(c), ext, c) for c in chunks)
    fields = b"".join(b"%s: %s\r\n" % (n, v) for n, v in trailers or [])
    return out + b"0%s\r\n%s\r\n" % (ext, fields)


def decode_in_pieces(data: bytes, cuts: list[int]) -> tuple[bytes, ChunkedDecoder, bytes]:
    decoder = ChunkedDecoder()
    payload = b""
    extra = b""
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    for start, end in itertools.pairwise(points):
        if decoder.done:
            extra += data[start:end]
            continue
        piece, after = decoder.feed(data[start:end])
        payload += piece
        extra += after
    return payload, decoder, extra


def h11_decode(data: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]] | None:
    """What h11 makes of ``data`` as the body after ``HEAD``; None if it refuses it."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "a")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(HEAD + data)
    body = b""
    try:
        while True:
            event = conn.next_event()
            if type(event) is h11.Data:
                body += event.data
            elif type(event) is h11.EndOfMessage:
                return body, list(event.headers)
            elif event is h11.NEED_DATA:
                return None
    except h11.RemoteProtocolError:
        return None


@settings(max_examples=300, deadline=None)
@given(payloads, extensions, trailer_sets, st.lists(st.integers(min_value=0), max_size=8))
def test_any_split_decodes_what_h11_decodes(chunks, ext, trailers, cuts):
    data = encode(chunks, ext, trailers)
    payload, decoder, extra = decode_in_pieces(data, cuts)
    assert decoder.done and extra == b""
    assert payload == b"".join(chunks)
    assert (payload, decoder.trailers) == h11_decode(data)


@settings(max_examples=500, deadline=None)
@given(payloads, st.integers(min_value=0), st.binary(min_size=1, max_size=3))
def test_whatever_we_accept_h11_accepts_the_same(chunks, where, junk):
    """Corrupt a valid body anywhere: we are never more lenient than h11."""
    valid = encode(chunks)
    at = where % len(valid)
    data = valid[:at] + junk + valid[at + len(junk) :]
    decoder = ChunkedDecoder()
    try:
        payload, _ = decoder.feed(data)
    except ChunkedError:
        return
    if decoder.done:
        assert (payload, decoder.trailers) == h11_decode(data)


def test_one_read_of_many_chunks_is_one_piece():
    tokens = [b'data: {"t":%d}\n\n' % i for i in range(100)]
    decoder = ChunkedDecoder()
    payload, extra = decoder.feed(encode(tokens) + b"HTTP/1.1 200 OK\r\n")
    assert payload == b"".join(tokens) and decoder.done
    assert extra == b"HTTP/1.1 200 OK\r\n"


@pytest.mark.parametrize(
    "body, reason",
    [
        (b"x\r\nabc\r\n", "bad chunk size line"),
        (b"3\r\nabcX\r\n", "not followed by CRLF"),
        (b"11111111111111111\r\n", "bad chunk size line"),  # 17 hex digits
        (b"-1\r\n", "bad chunk size line"),
        (b"3\nabc\r\n0\r\n\r\n", "bare LF"),
        (b"0\r\nbad trailer\r\n\r\n", "bad trailer field"),
        (b"0\r\nx: a\x00b\r\n\r\n", "bad trailer field"),
        (b"5" * 70000, "longer than"),
    ],
)
def test_malformed_bodies_are_refused(body, reason):
    with pytest.raises(ChunkedError, match=reason):
        ChunkedDecoder().feed(body)
    assert h11_decode(body) is None


@pytest.mark.parametrize(
    "size",
    [
        b"10000000000000005",  # 2**64 + 5: 5 to a parser that wraps at 64 bits
        b"ffffffffffffffff",  # 2**64 - 1
        b"8000000000000000",  # 2**63
        b"10000000000",  # 2**40: one digit past MAX_SIZE_DIGITS
        b"0000000ffffffffff",  # 17 digits with the zeros
    ],
)
def test_absurd_chunk_sizes_h11_would_take_are_refused(size):
    assert len(size.lstrip(b"0")) > MAX_SIZE_DIGITS or len(size) > 16
    with pytest.raises(ChunkedError, match="bad chunk size line"):
        ChunkedDecoder().feed(size + b"\r\nhello\r\n0\r\n\r\n")


@pytest.mark.parametrize("size", [b"ffffffffff", b"000000ffffffffff", b"0000000000000005"])
def test_chunk_sizes_within_the_bound_are_taken(size):
    decoder = ChunkedDecoder()
    payload, _ = decoder.feed(size + b"\r\nhello")
    assert payload == b"hello" and not decoder.done


def test_backend_absurd_chunk_size_truncates_the_response_visibly():
    client = client_after_request()
    messages = client.receive(HEAD + b"5\r\nhello\r\n")
    assert [type(m).__name__ for m in messages] == ["ResponseHead", "Body"]
    (abort,) = client.receive(b"ffffffffffffffff\r\nworld\r\n")
    assert isinstance(abort, Abort) and "bad chunk size line" in abort.reason


# -- H1Client ----------------------------------------------------------------------------


def client_after_request(method: bytes = b"GET") -> H1Client:
    client = H1Client()
    client.send_head(1, method, b"/s", [(b"host", b"a")])
    client.send_end([])
    return client


def test_h1client_hands_a_read_of_many_tokens_over_as_one_body():
    client = client_after_request()
    tokens = [b"data: %d\n\n" % i for i in range(50)]
    messages = client.receive(HEAD + encode(tokens, trailers=[(b"X-Done", b"1")]))
    assert [type(m) for m in messages] == [ResponseHead, Body, End]
    assert messages[1].data == b"".join(tokens)  # type: ignore[union-attr]
    assert messages[2].trailers == [(b"x-done", b"1")]  # type: ignore[union-attr]
    assert client.reusable
    client.next_cycle()
    client.send_head(3, b"GET", b"/again", [(b"host", b"a")])
    client.send_end([])
    again = client.receive(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    assert [type(m) for m in again] == [ResponseHead, Body, End]


def test_h1client_byte_by_byte():
    client = client_after_request()
    data = HEAD + encode([b"data: a\n\n", b"data: b\n\n"])
    messages = [m for i in range(len(data)) for m in client.receive(data[i : i + 1])]
    assert b"".join(m.data for m in messages if type(m) is Body) == b"data: a\n\ndata: b\n\n"
    assert type(messages[-1]) is End and client.reusable


def test_eof_inside_the_body_is_a_visible_truncation():
    client = client_after_request()
    assert [type(m) for m in client.receive(HEAD + b"5\r\nab")] == [ResponseHead, Body]
    (abort,) = client.receive(b"")
    assert type(abort) is Abort and "closed" in abort.reason
    assert not client.reusable


def test_bytes_after_the_response_make_the_connection_unusable():
    client = client_after_request()
    messages = client.receive(HEAD + encode([b"x"]) + b"junk")
    assert type(messages[-1]) is End
    assert not client.reusable


def test_malformed_chunk_aborts_the_response():
    client = client_after_request()
    messages = client.receive(HEAD + b"zz\r\n")
    assert type(messages[-1]) is Abort and "bad response" in messages[-1].reason


@pytest.mark.parametrize("status", [204, 304])
def test_no_body_statuses_are_left_to_h11(status):
    client = client_after_request()
    head = b"HTTP/1.1 %d X\r\ntransfer-encoding: chunked\r\n\r\n" % status
    assert [type(m) for m in client.receive(head)] == [ResponseHead, End]
    assert client.reusable


def test_head_response_has_no_body():
    client = client_after_request(b"HEAD")
    assert [type(m) for m in client.receive(HEAD)] == [ResponseHead, End]
    assert client.reusable


# -- H1Server: the chunks it frames itself ---------------------------------------------------


def server_after_request(request: bytes) -> H1Server:
    server = H1Server(scheme=b"http")
    assert next(type(m) for m in server.receive(request)) is RequestHead
    return server


def client_reads(request: bytes, response: bytes) -> list[object]:
    """What a real h11 client makes of ``response`` to ``request``."""
    peer = h11.Connection(h11.CLIENT)
    method, target, _version = request.split(b"\r\n")[0].split(b" ")
    peer.send(h11.Request(method=method, target=target, headers=[("host", "a")]))
    peer.send(h11.EndOfMessage())
    peer.receive_data(response)
    events: list[object] = []
    while (event := peer.next_event()) is not h11.NEED_DATA:
        events.append(event)
        if type(event) is h11.EndOfMessage:
            break
    return events


@pytest.mark.parametrize(
    "request_line, headers, chunked",
    [
        (b"GET /s HTTP/1.1", [], True),
        (b"GET /s HTTP/1.1", [(b"content-length", b"9")], False),
        (b"GET /s HTTP/1.0", [], False),  # h11 frames by closing the connection
    ],
)
def test_h1server_frames_what_h11_would(request_line, headers, chunked):
    request = request_line + b"\r\nHost: a\r\n\r\n"
    server = server_after_request(request)
    out = server.send_head(ResponseHead(stream=1, status=200, headers=headers))
    assert server.chunking is chunked
    out += server.send_body(b"data: a\n\n") + server.send_body(b"")
    out += server.send_end([(b"x-done", b"1")] if chunked else [])
    events = client_reads(request, out)
    assert b"".join(e.data for e in events if type(e) is h11.Data) == b"data: a\n\n"
    if chunked:
        assert b"9\r\ndata: a\n\n\r\n" in out
        assert type(events[-1]) is h11.EndOfMessage and events[-1].headers == [(b"x-done", b"1")]
        assert server.reusable


@pytest.mark.parametrize("status", [204, 304])
def test_h1server_no_body_statuses_are_not_chunked(status):
    server = server_after_request(b"GET /s HTTP/1.1\r\nHost: a\r\n\r\n")
    server.send_head(ResponseHead(stream=1, status=status, headers=[]))
    assert not server.chunking


def test_h1server_head_response_is_not_chunked():
    server = server_after_request(b"HEAD /s HTTP/1.1\r\nHost: a\r\n\r\n")
    server.send_head(ResponseHead(stream=1, status=200, headers=[]))
    assert not server.chunking


@pytest.mark.parametrize(
    "body",
    [
        b"3\n",  # the size line
        b"3\r\nabc\n",  # after the chunk data
        b"3\r\nabc\r\n0\n",  # the last chunk
        b"0\r\nx: y\n",  # a trailer
        b"0\r\n\n",  # the end of the trailer section
        b"3;ext\n",
    ],
    ids=["size", "data-end", "last-chunk", "trailer", "trailer-end", "extension"],
)
def test_a_bare_lf_is_refused_as_it_arrives_not_waited_past(body):
    """RFC 9112 §7.1: chunk lines end in CRLF. A client that ends them in a bare LF never
    sends the CRLF a lenient wait would need: refused at the LF, fed byte by byte."""
    decoder = ChunkedDecoder()
    lf = len(body) - 1  # the bare LF ends each of them
    for i in range(lf):
        decoder.feed(body[i : i + 1])
    with pytest.raises(ChunkedError, match="CRLF"):
        decoder.feed(body[lf : lf + 1])

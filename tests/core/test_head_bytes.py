"""``h1.head_bytes`` against h11: the same fields refused, the same head on the wire.

h11 is the oracle. For any fields, ``head_bytes`` must refuse exactly what h11's own ``send``
refuses, and what it writes must parse (with h11, on the receiving side) to the same start
line, the same fields in the same order per name, and the same body framing and keep-alive
state as what h11 writes.
"""

from __future__ import annotations

from collections.abc import Callable

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muxproxy.core.http.headers import trailer_fields
from muxproxy.core.http1.h1 import H11_FIELDS, H1Server, head_bytes
from muxproxy.core.http1.h1client import H1Client
from muxproxy.core.messages import Headers, ResponseHead

Fields = list[tuple[bytes, bytes]]

# Names: ordinary, the ones h11 acts on (any case), and some that are not tokens.
names = st.sampled_from(
    [
        *(b"x-a", b"X-B", b"content-type", b"date", b"x-request-id"),
        *sorted(H11_FIELDS),
        *(b"Content-Length", b"Transfer-Encoding", b"Connection"),
        *(b"", b"bad name", b"x:y", b"x\r\ny", b"x\x00"),
    ]
)
values = st.one_of(
    st.sampled_from([b"", b"1", b"0", b"7", b"chunked", b"close", b"keep-alive", b"a b", b"a\tb"]),
    st.sampled_from([b"100-continue", b"websocket", b"h.example", b"1, 1", b"1, 2", b"gzip"]),
    # Whatever bytes, including CR, LF, NUL, leading and trailing whitespace, obs-text.
    st.binary(max_size=6),
)
fields_lists = st.lists(st.tuples(names, values), max_size=6)


def parsed(role: type[h11.CLIENT] | type[h11.SERVER], data: bytes, prime: bytes = b"") -> object:
    """What a real h11 peer of ``role`` makes of head ``data`` (after ``prime``)."""
    peer = h11.Connection(role)
    if prime:
        peer.send(h11.Request(method=b"GET", target=b"/", headers=[(b"host", b"h")]))
        peer.send(h11.EndOfMessage())
    peer.receive_data(data)
    event = peer.next_event()
    return event


def same_head(ours: h11.Request | h11.Response, theirs: h11.Request | h11.Response) -> None:
    assert type(ours) is type(theirs)
    if isinstance(ours, h11.Request):
        assert isinstance(theirs, h11.Request)
        assert (ours.method, ours.target) == (theirs.method, theirs.target)
    else:
        assert isinstance(theirs, h11.Response)
        assert ours.status_code == theirs.status_code
    # Fields of different names may come in another order (RFC 9110 §5.3); one name's may not.
    for name in {n for n, _ in theirs.headers}:
        assert [v for n, v in ours.headers if n == name] == [
            v for n, v in theirs.headers if n == name
        ]
    assert sorted(ours.headers) == sorted(theirs.headers)


def compare(
    fresh: Callable[[], h11.Connection],
    make: Callable[[Headers], h11.Request | h11.Response],
    fields: Fields,
    role: type[h11.CLIENT] | type[h11.SERVER],
    prime: bytes = b"",
) -> None:
    oracle, ours = fresh(), fresh()
    try:
        expected = oracle.send(make(fields)) or b""
    except h11.LocalProtocolError:
        with pytest.raises(h11.LocalProtocolError):
            head_bytes(ours, make, fields)
        return
    got = head_bytes(ours, make, fields)
    same_head(parsed(role, got, prime), parsed(role, expected, prime))  # type: ignore[arg-type]
    # h11's state machine is where a full send would have left it.
    assert (ours.our_state, ours.their_state) == (oracle.our_state, oracle.their_state)
    if ours.our_state is h11.SEND_BODY:
        # The body is framed the same way (Content-Length, chunked, or until close).
        for event in (h11.Data(data=b"xyz"), h11.EndOfMessage()):
            assert outcome(ours, event) == outcome(oracle, event)


def outcome(conn: h11.Connection, event: h11.Data | h11.EndOfMessage) -> bytes | str:
    try:
        return conn.send(event) or b""
    except h11.LocalProtocolError as exc:
        return str(exc)


def server_after(request: bytes) -> h11.Connection:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(request)
    assert isinstance(conn.next_event(), h11.Request)
    return conn


@settings(max_examples=400, deadline=None)
@given(fields_lists, st.sampled_from([200, 204, 304, 404, 503]), st.booleans())
def test_response_heads_are_h11s(fields: Fields, status: int, http10: bool) -> None:
    request = b"GET / HTTP/1.0\r\n\r\n" if http10 else b"GET / HTTP/1.1\r\nhost: h\r\n\r\n"
    compare(
        lambda: server_after(request),
        lambda f: h11.Response(status_code=status, headers=f),
        fields,
        h11.CLIENT,
        prime=b"GET",
    )


@settings(max_examples=400, deadline=None)
@given(fields_lists, st.sampled_from([b"GET", b"POST", b"HEAD"]), st.booleans())
def test_request_heads_are_h11s(fields: Fields, method: bytes, with_host: bool) -> None:
    if with_host:
        fields = [(b"host", b"backend:8000"), *fields]
    compare(
        lambda: h11.Connection(h11.CLIENT),
        lambda f: h11.Request(method=method, target=b"/v1/x?y=1", headers=f),
        fields,
        h11.SERVER,
    )


@pytest.mark.parametrize(
    "field",
    [
        (b"x-a", b"1\r\nx-injected: 2"),  # the bytes would look like two valid fields
        (b"x-a", b"1\x00x-b"),  # a NUL, the byte the values are joined by
        (b"x-a:x-b", b"1"),  # a colon, the byte the names are joined by
    ],
)
def test_one_bad_field_cannot_pass_for_two_good_ones(field: tuple[bytes, bytes]) -> None:
    conn = h11.Connection(h11.CLIENT)
    with pytest.raises(h11.LocalProtocolError):
        head_bytes(
            conn,
            lambda f: h11.Request(method=b"GET", target=b"/", headers=f),
            [(b"host", b"h"), field],
        )


def test_adapters_write_every_field_once() -> None:
    client = H1Client()
    head = client.send_head(
        1, b"POST", b"/v1/chat", [(b"host", b"b"), (b"x-a", b"1"), (b"content-length", b"2")]
    )
    assert head.startswith(b"POST /v1/chat HTTP/1.1\r\nhost: b\r\n")
    assert head.count(b"x-a: 1\r\n") == 1 and head.count(b"content-length: 2\r\n") == 1
    assert head.endswith(b"\r\n\r\n")

    server = H1Server(scheme=b"http")
    server.receive(b"GET / HTTP/1.1\r\nhost: h\r\n\r\n")
    out = server.send_head(
        ResponseHead(stream=1, status=200, headers=[(b"content-type", b"text/event-stream")])
    )
    assert out.count(b"content-type: text/event-stream\r\n") == 1
    assert b"transfer-encoding: chunked\r\n" in out.lower() and server.chunking


def test_trailers_h11_would_refuse_are_dropped_not_raised() -> None:
    # Trailers from an HTTP/2 client reach us unchecked: a value h11 refuses (a form feed is
    # whitespace to it) and framing fields (RFC 9110 §6.5.1) are dropped by
    # ``trailer_fields`` (which the exchange applies), the rest kept.
    client = H1Client()
    client.send_head(1, b"POST", b"/", [(b"host", b"b"), (b"transfer-encoding", b"chunked")])
    client.send_body(b"x")
    trailers = [
        (b"grpc-status", b"0"),
        (b"x-bad", b"a\x0cb"),
        (b"transfer-encoding", b"gzip"),
        (b"bad name", b"1"),
    ]
    out = client.send_end(trailer_fields(trailers))
    server = h11.Connection(h11.SERVER)
    server.receive_data(
        b"POST / HTTP/1.1\r\nhost: b\r\ntransfer-encoding: chunked\r\n\r\n1\r\nx\r\n" + out
    )
    events = [server.next_event() for _ in range(3)]
    end = events[-1]
    assert isinstance(end, h11.EndOfMessage)
    assert list(end.headers) == [(b"grpc-status", b"0")]


@settings(max_examples=400, deadline=None)
@given(fields_lists)
def test_the_client_knows_its_request_body_is_chunked(fields: Fields) -> None:
    # ``chunking`` (the body's trailers go out) exactly when a Transfer-Encoding field, of any
    # case, was sent: what h11 frames chunked (RFC 9112 §6.1).
    client = H1Client()
    try:
        client.send_head(1, b"POST", b"/v1/x", [(b"host", b"b"), *fields])
    except h11.LocalProtocolError:
        return
    assert client.chunking == any(name.lower() == b"transfer-encoding" for name, _ in fields)

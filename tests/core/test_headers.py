"""Tests for muxproxy.core.http.headers: HTTP/2 and HTTP/1.1 intake, upstream and response
fields."""

from __future__ import annotations

import attrs
import h2.config
import h2.connection
import h2.events
import h11
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from muxproxy.core.http.headers import (
    header_value,
    is_event_stream,
    response_headers,
    upstream_h1_headers,
)
from muxproxy.core.http.intake import MalformedRequest, request_from_h1, request_from_h2
from muxproxy.core.messages import Headers, RequestHead

HOP_BY_HOP = {b"connection", b"proxy-connection", b"keep-alive", b"te", b"transfer-encoding"}
HOP_BY_HOP |= {b"upgrade"}

GET: Headers = [
    (b":method", b"GET"),
    (b":scheme", b"https"),
    (b":authority", b"api.example"),
    (b":path", b"/v1/models"),
]
CONNECT: Headers = [(b":method", b"CONNECT"), (b":authority", b"backend:443")]
WEBSOCKET: Headers = [
    (b":method", b"CONNECT"),
    (b":protocol", b"websocket"),
    (b":scheme", b"https"),
    (b":authority", b"api.example"),
    (b":path", b"/ws"),
]


def h2_roundtrip(headers: Headers, *, client_checks: bool = True) -> list[tuple[bytes, bytes]]:
    """Encode `headers` with a real h2 client and decode them with the server config we use."""
    client = h2.connection.H2Connection(
        config=h2.config.H2Configuration(
            client_side=True,
            validate_outbound_headers=client_checks,
            normalize_outbound_headers=client_checks,
            split_outbound_cookies=True,
        )
    )
    client.initiate_connection()
    client.send_headers(1, headers, end_stream=True)
    server = h2.connection.H2Connection(
        config=h2.config.H2Configuration(
            client_side=False, validate_inbound_headers=False, normalize_inbound_headers=False
        )
    )
    server.initiate_connection()
    events = server.receive_data(client.data_to_send())
    received = [e for e in events if isinstance(e, h2.events.RequestReceived)]
    assert len(received) == 1
    assert received[0].headers is not None
    return list(received[0].headers)


def h1_head(raw: bytes, *, scheme: bytes = b"http") -> RequestHead:
    """Parse `raw` with a real h11 server and build the RequestHead from the event."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(raw)
    event = conn.next_event()
    assert isinstance(event, h11.Request)
    return request_from_h1(
        1,
        event.method,
        event.target,
        event.headers,
        scheme=scheme,
        http_version=event.http_version,
    )


def names(headers: Headers) -> list[bytes]:
    return [name for name, _ in headers]


def values(headers: Headers, name: bytes) -> list[bytes]:
    return [v for n, v in headers if n == name]


def h1_request(headers: Headers, **kw: bytes) -> RequestHead:
    fields: dict[str, bytes] = {"method": b"GET", "target": b"/", "http_version": b"1.1"}
    fields.update(kw)
    return RequestHead(
        stream=1,
        method=fields["method"],
        target=fields["target"],
        authority=b"api.example",
        scheme=b"http",
        headers=headers,
        http_version=fields["http_version"],
    )


def send_h11_request(headers: Headers, body: bytes = b"") -> bytes:
    conn = h11.Connection(h11.CLIENT)
    out = conn.send(h11.Request(method=b"POST" if body else b"GET", target=b"/", headers=headers))
    assert out is not None
    data = out
    if body:
        data += conn.send(h11.Data(data=body)) or b""
    data += conn.send(h11.EndOfMessage()) or b""
    return data


# --- request_from_h2: malformed ------------------------------------------------------------

MALFORMED_H2: dict[str, Headers] = {
    "uppercase name": [*GET, (b"Content-Type", b"application/json")],
    "uppercase pseudo": [(b":Method", b"GET"), *GET[1:]],
    "empty name": [*GET, (b"", b"x")],
    "space in name": [*GET, (b"x y", b"1")],
    "NUL in name": [*GET, (b"x\x00y", b"1")],
    "tab in name": [*GET, (b"x\ty", b"1")],
    "DEL in name": [*GET, (b"x\x7f", b"1")],
    "high byte in name": [*GET, (b"x\xe9", b"1")],
    "colon inside name": [*GET, (b"x:y", b"1")],
    "non-token char in name": [*GET, (b"x(y)", b"1")],
    "NUL in value": [*GET, (b"x", b"a\x00b")],
    "CR in value": [*GET, (b"x", b"a\rb")],
    "LF in value": [*GET, (b"x", b"a\nb")],
    "CRLF injection": [*GET, (b"x", b"a\r\nhost: evil")],
    "leading SP in value": [*GET, (b"x", b" a")],
    "trailing SP in value": [*GET, (b"x", b"a ")],
    "leading HTAB in value": [*GET, (b"x", b"\ta")],
    "trailing HTAB in value": [*GET, (b"x", b"a\t")],
    "only SP value": [*GET, (b"x", b" ")],
    "vertical tab in value": [*GET, (b"x", b"a\x0bb")],
    "CR in pseudo value": [(b":method", b"GET"), *GET[1:3], (b":path", b"/a\rb")],
    "pseudo after regular": [*GET[:2], (b"x", b"1"), *GET[2:]],
    "pseudo after regular at end": [*GET, (b"x", b"1"), (b":protocol", b"websocket")],
    "unknown pseudo": [*GET, (b":foo", b"bar")],
    "response pseudo": [*GET, (b":status", b"200")],
    "duplicated :method": [*GET, (b":method", b"GET")],
    "duplicated :scheme": [*GET, (b":scheme", b"https")],
    "duplicated :authority": [*GET, (b":authority", b"api.example")],
    "duplicated :path": [*GET, (b":path", b"/")],
    "duplicated :protocol": [*WEBSOCKET, (b":protocol", b"websocket")],
    "missing :method": GET[1:],
    "missing :scheme": [GET[0], *GET[2:]],
    "missing :path": GET[:3],
    "empty :path": [*GET[:3], (b":path", b"")],
    "relative :path": [*GET[:3], (b":path", b"v1/models")],
    "asterisk :path on GET": [*GET[:3], (b":path", b"*")],
    "space in :path": [*GET[:3], (b":path", b"/a b")],
    "invalid :method": [(b":method", b"GE T"), *GET[1:]],
    "empty :method": [(b":method", b""), *GET[1:]],
    "invalid :scheme": [GET[0], (b":scheme", b"1http"), *GET[2:]],
    "empty :authority": [*GET[:2], (b":authority", b""), GET[3]],
    "userinfo in :authority": [*GET[:2], (b":authority", b"user:pw@api.example"), GET[3]],
    "space in :authority": [*GET[:2], (b":authority", b"api example"), GET[3]],
    "two hosts without :authority": [*GET[:2], GET[3], (b"host", b"a"), (b"host", b"b")],
    "invalid host without :authority": [*GET[:2], GET[3], (b"host", b"a/b")],
    "CONNECT without :authority": [(b":method", b"CONNECT")],
    "CONNECT with host only": [(b":method", b"CONNECT"), (b"host", b"backend:443")],
    "CONNECT with :scheme": [*CONNECT, (b":scheme", b"https")],
    "CONNECT with :path": [*CONNECT, (b":path", b"/")],
    ":protocol without CONNECT": [*GET, (b":protocol", b"websocket")],
    "extended CONNECT without :path": WEBSOCKET[:4],
    "extended CONNECT without :scheme": [*WEBSOCKET[:2], *WEBSOCKET[3:]],
    "connection": [*GET, (b"connection", b"keep-alive")],
    "proxy-connection": [*GET, (b"proxy-connection", b"keep-alive")],
    "keep-alive": [*GET, (b"keep-alive", b"timeout=5")],
    "transfer-encoding": [*GET, (b"transfer-encoding", b"chunked")],
    "upgrade": [*GET, (b"upgrade", b"websocket")],
    "te gzip": [*GET, (b"te", b"gzip")],
    "te trailers and more": [*GET, (b"te", b"trailers, deflate")],
    "te empty": [*GET, (b"te", b"")],
    "content-length not digits": [*GET, (b"content-length", b"12a")],
    "content-length negative": [*GET, (b"content-length", b"-1")],
    "content-length list": [*GET, (b"content-length", b"5, 5")],
    "content-length conflict": [*GET, (b"content-length", b"5"), (b"content-length", b"6")],
}


@pytest.mark.parametrize("headers", MALFORMED_H2.values(), ids=MALFORMED_H2.keys())
def test_request_from_h2_malformed(headers: Headers) -> None:
    with pytest.raises(MalformedRequest) as info:
        request_from_h2(1, headers, scheme_default=b"https")
    assert info.value.status == 400
    assert info.value.reason


# A few of them for real, through h2's encoder and the decoder configuration we run.
@pytest.mark.parametrize(
    "case",
    [
        "uppercase name",
        "pseudo after regular",
        "response pseudo",
        "connection",
        "te gzip",
        "trailing SP in value",
        "missing :path",
    ],
)
def test_request_from_h2_malformed_through_h2(case: str) -> None:
    headers = h2_roundtrip(MALFORMED_H2[case], client_checks=False)
    with pytest.raises(MalformedRequest):
        request_from_h2(1, headers, scheme_default=b"https")


def test_malformed_request_attributes() -> None:
    err = MalformedRequest("head too large", 431)
    assert (err.reason, err.status, str(err)) == ("head too large", 431, "head too large")
    assert MalformedRequest("bad").status == 400


# --- request_from_h2: valid ----------------------------------------------------------------


def test_request_from_h2_get() -> None:
    fields = [(b"accept", b"*/*"), (b"x-b", b"2"), (b"x-a", b"1"), (b"x-b", b"3")]
    head = request_from_h2(3, [*GET, *fields], scheme_default=b"http")
    assert head == RequestHead(
        stream=3,
        method=b"GET",
        target=b"/v1/models",
        authority=b"api.example",
        scheme=b"https",
        headers=fields,
        http_version=b"2",
    )


def test_request_from_h2_values_allowed() -> None:
    fields = [
        (b"x-empty", b""),
        (b"x-inner", b"a \t b"),
        (b"x-obs", b"caf\xe9"),
        (b"te", b"trailers"),
        (b"content-length", b"12"),
        (b"content-length", b"12"),
        (b"!#$%&'*+-.^_`|~09az", b"v"),
    ]
    head = request_from_h2(1, [*GET, *fields], scheme_default=b"https")
    assert head.headers == fields


def test_request_from_h2_host_fallback() -> None:
    headers = [*GET[:2], GET[3], (b"host", b"api.example:8443")]
    head = request_from_h2(1, headers, scheme_default=b"https")
    assert head.authority == b"api.example:8443"
    assert head.headers == [(b"host", b"api.example:8443")]


def test_request_from_h2_host_next_to_authority_names_the_same_origin() -> None:
    """RFC 9113 §8.3.1: a Host field next to :authority must name the same (case aside);
    one that differs makes the request malformed."""
    head = request_from_h2(1, [*GET, (b"host", b"API.example")], scheme_default=b"https")
    assert head.authority == b"api.example"
    assert head.headers == [(b"host", b"API.example")]  # untouched
    out = upstream_h1_headers(head, client_ip="10.0.0.1", proto=b"http", via=b"muxproxy")
    assert values(out, b"host") == [b"api.example"]
    for hosts in ([b"other.example"], [b"api.example", b"other.example"]):
        with pytest.raises(MalformedRequest, match="differ"):
            request_from_h2(1, [*GET, *((b"host", h) for h in hosts)], scheme_default=b"https")


def test_request_from_h2_no_authority_at_all() -> None:
    head = request_from_h2(1, [*GET[:2], GET[3]], scheme_default=b"https")
    assert head.authority == b""


def test_request_from_h2_ipv6_authority() -> None:
    headers = [*GET[:2], (b":authority", b"[2001:db8::1]:8443"), GET[3]]
    assert request_from_h2(1, headers, scheme_default=b"https").authority == b"[2001:db8::1]:8443"


def test_request_from_h2_options_asterisk() -> None:
    headers = [(b":method", b"OPTIONS"), *GET[1:3], (b":path", b"*")]
    assert request_from_h2(1, headers, scheme_default=b"https").target == b"*"


def test_request_from_h2_plain_connect_is_valid() -> None:
    head = request_from_h2(5, [*CONNECT, (b"x", b"1")], scheme_default=b"https")
    assert head == RequestHead(
        stream=5,
        method=b"CONNECT",
        target=b"",
        authority=b"backend:443",
        scheme=b"https",
        headers=[(b"x", b"1")],
        http_version=b"2",
    )


@pytest.mark.parametrize("end_stream", [False, True])
def test_request_from_h2_says_whether_its_headers_ended_the_stream(end_stream: bool) -> None:
    get = [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"), (b":authority", b"a")]
    assert request_from_h2(1, get, scheme_default=b"http", end_stream=end_stream).end_stream is (
        end_stream
    )
    connect = request_from_h2(5, CONNECT, scheme_default=b"https", end_stream=end_stream)
    assert connect.end_stream is end_stream
    assert request_from_h2(1, get, scheme_default=b"http").end_stream is False


def test_request_from_h2_extended_connect() -> None:
    head = request_from_h2(7, WEBSOCKET, scheme_default=b"http")
    assert (head.method, head.target, head.authority, head.scheme) == (
        b"CONNECT",
        b"/ws",
        b"api.example",
        b"https",
    )


def test_request_from_h2_through_real_h2() -> None:
    sent = [
        *GET,
        (b"user-agent", b"openai-python/1.30"),
        (b"cookie", b"session=abc; theme=dark; lang=en"),
        (b"content-type", b"application/json"),
    ]
    received = h2_roundtrip(sent)
    # h2 split the cookie into crumbs (RFC 9113 §8.2.3).
    assert values(received, b"cookie") == [b"session=abc", b"theme=dark", b"lang=en"]
    head = request_from_h2(1, received, scheme_default=b"http")
    assert (head.method, head.target, head.authority, head.scheme, head.http_version) == (
        b"GET",
        b"/v1/models",
        b"api.example",
        b"https",
        b"2",
    )
    assert names(head.headers) == [b"user-agent", b"cookie", b"cookie", b"cookie", b"content-type"]
    # The connection is TLS: X-Forwarded-Proto says so (it does not come from :scheme).
    out = upstream_h1_headers(head, client_ip="192.0.2.7", proto=b"https", via=b"muxproxy")
    assert out == [
        (b"host", b"api.example"),
        (b"user-agent", b"openai-python/1.30"),
        (b"cookie", b"session=abc; theme=dark; lang=en"),
        (b"content-type", b"application/json"),
        (b"x-forwarded-for", b"192.0.2.7"),
        (b"x-forwarded-proto", b"https"),
        (b"via", b"2 muxproxy"),
    ]
    send_h11_request(out)


# --- request_from_h1 -----------------------------------------------------------------------


def test_request_from_h1_origin_form() -> None:
    head = h1_head(b"POST /v1/chat?x=1 HTTP/1.1\r\nHost: api.example\r\nX-A: 1\r\n\r\n")
    assert head == RequestHead(
        stream=1,
        method=b"POST",
        target=b"/v1/chat?x=1",
        authority=b"api.example",
        scheme=b"http",
        headers=[(b"host", b"api.example"), (b"x-a", b"1")],
        http_version=b"1.1",
        end_stream=True,  # no Content-Length, no Transfer-Encoding: no body
    )


@pytest.mark.parametrize(
    ("fields", "end_stream"),
    [
        (b"", True),
        (b"Content-Length: 0\r\n", True),
        (b"Content-Length: 5\r\n", False),
        (b"Transfer-Encoding: chunked\r\n", False),
    ],
)
def test_request_from_h1_end_stream(fields: bytes, end_stream: bool) -> None:
    # RFC 9112 §6.3: a request without Transfer-Encoding or Content-Length has no body.
    head = h1_head(b"POST /v1 HTTP/1.1\r\nHost: api.example\r\n" + fields + b"\r\n")
    assert head.end_stream is end_stream


@pytest.mark.parametrize(
    ("method", "target", "authority", "path"),
    [
        (b"GET", b"http://api.example:8080/v1/x?y=1", b"api.example:8080", b"/v1/x?y=1"),
        (b"GET", b"HTTPS://api.example/", b"api.example", b"/"),
        (b"GET", b"http://api.example", b"api.example", b"/"),
        (b"GET", b"http://api.example?q=1", b"api.example", b"/?q=1"),
        (b"OPTIONS", b"http://api.example", b"api.example", b"*"),
        (b"GET", b"http://[::1]:8080/a", b"[::1]:8080", b"/a"),
    ],
)
def test_request_from_h1_absolute_form(
    method: bytes, target: bytes, authority: bytes, path: bytes
) -> None:
    # RFC 9112 §3.2.2: the target's authority wins over Host.
    raw = method + b" " + target + b" HTTP/1.1\r\nHost: other.example\r\n\r\n"
    head = h1_head(raw)
    assert (head.target, head.authority) == (path, authority)
    assert head.headers == [(b"host", b"other.example")]
    out = upstream_h1_headers(head, client_ip="10.0.0.1", proto=b"http", via=b"mp")
    assert out[0] == (b"host", authority)


def test_request_from_h1_connect_and_asterisk() -> None:
    head = h1_head(b"CONNECT backend:443 HTTP/1.1\r\nHost: backend:443\r\n\r\n")
    assert (head.method, head.target, head.authority) == (b"CONNECT", b"", b"backend:443")
    head = h1_head(b"OPTIONS * HTTP/1.1\r\nHost: api.example\r\n\r\n")
    assert (head.target, head.authority) == (b"*", b"api.example")


def test_request_from_h1_http10_without_host() -> None:
    head = h1_head(b"GET / HTTP/1.0\r\n\r\n")
    assert (head.authority, head.http_version) == (b"", b"1.0")
    out = upstream_h1_headers(head, client_ip="10.0.0.1", proto=b"http", via=b"mp")
    assert out[0] == (b"host", b"")
    assert values(out, b"via") == [b"1.0 mp"]
    send_h11_request(out)


@pytest.mark.parametrize(
    ("method", "target", "headers"),
    [
        (b"GET", b"/", []),
        (b"GET", b"/", [(b"host", b"a"), (b"host", b"b")]),
        (b"GET", b"/", [(b"host", b"a b")]),
        (b"GET", b"/", [(b"host", b"user@a")]),
        (b"GET", b"http://user@a/", [(b"host", b"a")]),
        (b"GET", b"http:///x", [(b"host", b"a")]),
        (b"GET", b"ftp://a/x", [(b"host", b"a")]),
        (b"GET", b"http://a/x#frag", [(b"host", b"a")]),
        (b"GET", b"a/b", [(b"host", b"a")]),
        (b"GET", b"*", [(b"host", b"a")]),
        (b"CONNECT", b"a b:443", [(b"host", b"a")]),
    ],
)
def test_request_from_h1_malformed(method: bytes, target: bytes, headers: Headers) -> None:
    with pytest.raises(MalformedRequest) as info:
        request_from_h1(1, method, target, headers, scheme=b"http", http_version=b"1.1")
    assert info.value.status == 400


# --- upstream_h1_headers -------------------------------------------------------------------


def test_upstream_drops_hop_by_hop_and_connection_listed() -> None:
    head = h1_request(
        [
            (b"host", b"client-said.example"),
            (b"connection", b"keep-alive, X-Secret , upgrade"),
            (b"keep-alive", b"timeout=5"),
            (b"proxy-connection", b"keep-alive"),
            (b"upgrade", b"websocket"),
            (b"x-secret", b"1"),
            (b"accept", b"*/*"),
            (b"connection", b"Foo"),
            (b"foo", b"bar"),
            (b"x-forwarded-proto", b"http"),
            (b"content-length", b"4"),
        ]
    )
    out = upstream_h1_headers(head, client_ip="10.0.0.1", proto=b"http", via=b"mp")
    assert out == [
        (b"host", b"api.example"),
        (b"accept", b"*/*"),
        (b"content-length", b"4"),
        (b"x-forwarded-for", b"10.0.0.1"),
        (b"x-forwarded-proto", b"http"),
        (b"via", b"1.1 mp"),
    ]
    send_h11_request(out, b"body")


def test_upstream_connection_cannot_remove_content_length_or_host() -> None:
    head = h1_request([(b"connection", b"content-length, host, te"), (b"content-length", b"2")])
    out = upstream_h1_headers(head, client_ip="10.0.0.1", proto=b"http", via=b"mp")
    assert values(out, b"content-length") == [b"2"]
    assert out[0] == (b"host", b"api.example")


@pytest.mark.parametrize(
    ("te", "kept"),
    [
        (b"trailers", True),
        (b"Trailers", True),
        (b"trailers, deflate;q=0.5", True),
        (b"gzip", False),
        (b"deflate, gzip;q=0.3", False),
    ],
)
def test_upstream_te(te: bytes, kept: bool) -> None:
    head = h1_request([(b"te", te), (b"connection", b"TE")])
    out = upstream_h1_headers(head, client_ip="10.0.0.1", proto=b"http", via=b"mp")
    assert values(out, b"te") == ([b"trailers"] if kept else [])
    assert b"connection" not in names(out)


def test_upstream_te_trailers_from_h2() -> None:
    head = request_from_h2(1, [*GET, (b"te", b"trailers")], scheme_default=b"https")
    out = upstream_h1_headers(head, client_ip="10.0.0.1", proto=b"http", via=b"mp")
    assert values(out, b"te") == [b"trailers"]


def test_upstream_cookie_join_keeps_order_and_position() -> None:
    head = h1_request(
        [
            (b"accept", b"*/*"),
            (b"cookie", b"a=1"),
            (b"x-mid", b"m"),
            (b"cookie", b"b=2"),
            (b"cookie", b"c=3; d=4"),
        ],
        http_version=b"2",
    )
    out = upstream_h1_headers(head, client_ip="10.0.0.1", proto=b"http", via=b"mp")
    assert out[:4] == [
        (b"host", b"api.example"),
        (b"accept", b"*/*"),
        (b"cookie", b"a=1; b=2; c=3; d=4"),
        (b"x-mid", b"m"),
    ]
    assert names(out).count(b"cookie") == 1


def test_upstream_single_cookie_untouched() -> None:
    head = h1_request([(b"cookie", b"a=1; b=2")])
    out = upstream_h1_headers(head, client_ip="10.0.0.1", proto=b"http", via=b"mp")
    assert values(out, b"cookie") == [b"a=1; b=2"]


def test_upstream_x_forwarded_for() -> None:
    out = upstream_h1_headers(h1_request([]), client_ip="10.0.0.1", proto=b"http", via=b"mp")
    assert values(out, b"x-forwarded-for") == [b"10.0.0.1"]
    head = h1_request(
        [(b"x-forwarded-for", b"203.0.113.1"), (b"x-forwarded-for", b"198.51.100.2, 10.1.1.1")]
    )
    # From a peer the listener does not trust (the default), the client's list is dropped.
    out = upstream_h1_headers(head, client_ip="2001:db8::7", proto=b"http", via=b"mp")
    assert values(out, b"x-forwarded-for") == [b"2001:db8::7"]
    # From a trusted proxy, it is appended to.
    out = upstream_h1_headers(head, client_ip="2001:db8::7", proto=b"http", via=b"mp", trusted=True)
    assert values(out, b"x-forwarded-for") == [b"203.0.113.1, 198.51.100.2, 10.1.1.1, 2001:db8::7"]


def test_upstream_x_forwarded_proto_replaced() -> None:
    head = request_from_h2(1, [*GET, (b"x-forwarded-proto", b"http")], scheme_default=b"https")
    out = upstream_h1_headers(head, client_ip="10.0.0.1", proto=b"https", via=b"mp")
    assert values(out, b"x-forwarded-proto") == [b"https"]


@pytest.mark.parametrize("claimed", [b"https", b"HTTPS"])
def test_upstream_x_forwarded_proto_is_the_transport_not_the_h2_scheme(claimed: bytes) -> None:
    # A cleartext HTTP/2 client claiming ":scheme: https" must not make the backend think the
    # request came over TLS.
    pseudo = [GET[0], (b":scheme", claimed), *GET[2:]]
    head = request_from_h2(1, pseudo, scheme_default=b"http")
    out = upstream_h1_headers(head, client_ip="10.0.0.1", proto=b"http", via=b"mp")
    assert values(out, b"x-forwarded-proto") == [b"http"]


@pytest.mark.parametrize("claimed", [b"wss", b"javascript", b"file", b"ftp"])
def test_an_h2_scheme_other_than_http_or_https_is_malformed(claimed: bytes) -> None:
    """RFC 9113 §8.3.1: the proxy serves http and https URIs only."""
    with pytest.raises(MalformedRequest, match="unsupported :scheme"):
        request_from_h2(1, [GET[0], (b":scheme", claimed), *GET[2:]], scheme_default=b"http")


@pytest.mark.parametrize("nominated", [False, True])
def test_http2_settings_is_never_forwarded(nominated: bool) -> None:
    # RFC 9113 §3.2.1: HTTP2-Settings is hop-by-hop, with or without Connection naming it.
    fields = [(b"http2-settings", b"AAMAAABkAAQAAP__"), (b"accept", b"*/*")]
    if nominated:
        fields.append((b"connection", b"HTTP2-Settings"))
    out = upstream_h1_headers(h1_request(fields), client_ip="10.0.0.1", proto=b"http", via=b"mp")
    assert values(out, b"http2-settings") == []
    assert values(out, b"accept") == [b"*/*"]
    h2_head = request_from_h2(1, [*GET, fields[0]], scheme_default=b"http")
    out = upstream_h1_headers(h2_head, client_ip="10.0.0.1", proto=b"http", via=b"mp")
    assert values(out, b"http2-settings") == []
    back = response_headers(
        200, [(b"HTTP2-Settings", b"AAMAAABk")], via=b"mp", upstream_version=b"1.1", to_h2=True
    )
    assert values(back, b"http2-settings") == []


@pytest.mark.parametrize(("version", "expected"), [(b"1.1", b"1.1 mp"), (b"2", b"2 mp")])
def test_upstream_via(version: bytes, expected: bytes) -> None:
    out = upstream_h1_headers(
        h1_request([], http_version=version), client_ip="1.2.3.4", proto=b"http", via=b"mp"
    )
    assert values(out, b"via") == [expected]
    head = h1_request([(b"via", b"1.0 fred"), (b"via", b"1.1 p.example (Apache/1.1)")])
    head = RequestHead(
        stream=1,
        method=b"GET",
        target=b"/",
        authority=b"a",
        scheme=b"https",
        headers=head.headers,
        http_version=version,
    )
    out = upstream_h1_headers(head, client_ip="1.2.3.4", proto=b"http", via=b"mp")
    assert values(out, b"via") == [b"1.0 fred, 1.1 p.example (Apache/1.1), " + expected]


def test_upstream_via_of_real_clients() -> None:
    h1 = h1_head(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
    assert values(
        upstream_h1_headers(h1, client_ip="1.2.3.4", proto=b"http", via=b"mp"), b"via"
    ) == [b"1.1 mp"]
    h2_ = request_from_h2(1, h2_roundtrip(GET), scheme_default=b"https")
    assert values(
        upstream_h1_headers(h2_, client_ip="1.2.3.4", proto=b"http", via=b"mp"), b"via"
    ) == [b"2 mp"]


def test_upstream_chunked_client_body_is_rechunked_without_content_length() -> None:
    # RFC 9112 §6.3: Transfer-Encoding overrides Content-Length; the intermediary drops it.
    # (Intake refuses such a request, RFC 9112 §6.1; this is the defence behind that.)
    head = h1_head(b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n")
    head = attrs.evolve(head, headers=[*head.headers, (b"content-length", b"3")])
    out = upstream_h1_headers(head, client_ip="1.2.3.4", proto=b"http", via=b"mp")
    assert values(out, b"transfer-encoding") == [b"chunked"]
    assert values(out, b"content-length") == []
    wire = send_h11_request(out, b"hello")
    assert b"5\r\nhello\r\n0\r\n\r\n" in wire


def test_upstream_h2_body_framing() -> None:
    head = request_from_h2(1, [(b":method", b"POST"), *GET[1:]], scheme_default=b"https")
    out = upstream_h1_headers(head, client_ip="1.2.3.4", proto=b"http", via=b"mp")
    assert b"transfer-encoding" not in names(out)  # no body: h11 sends none
    out = upstream_h1_headers(head, client_ip="1.2.3.4", proto=b"http", via=b"mp", has_body=True)
    assert values(out, b"transfer-encoding") == [b"chunked"]
    send_h11_request(out, b"{}")
    with_length = RequestHead(
        stream=1,
        method=b"POST",
        target=b"/",
        authority=b"a",
        scheme=b"https",
        headers=[(b"content-length", b"2")],
        http_version=b"2",
    )
    out = upstream_h1_headers(
        with_length, client_ip="1.2.3.4", proto=b"http", via=b"mp", has_body=True
    )
    assert values(out, b"content-length") == [b"2"]
    assert b"transfer-encoding" not in names(out)
    send_h11_request(out, b"{}")


# --- response_headers ----------------------------------------------------------------------


def test_response_drops_hop_by_hop() -> None:
    backend = [
        (b"connection", b"keep-alive, X-Backend-Only"),
        (b"keep-alive", b"timeout=5"),
        (b"x-backend-only", b"1"),
        (b"transfer-encoding", b"chunked"),
        (b"upgrade", b"h2c"),
        (b"proxy-connection", b"close"),
        (b"te", b"trailers"),
        (b"content-type", b"application/json"),
        (b"server", b"uvicorn"),
    ]
    for to_h2 in (False, True):
        out = response_headers(200, backend, via=b"mp", upstream_version=b"1.1", to_h2=to_h2)
        assert out == [
            (b"content-type", b"application/json"),
            (b"server", b"uvicorn"),
            (b"via", b"1.1 mp"),
        ]


def test_response_content_length() -> None:
    backend = [(b"content-length", b"12"), (b"content-type", b"text/plain")]
    out = response_headers(200, backend, via=b"mp", upstream_version=b"1.1", to_h2=True)
    assert values(out, b"content-length") == [b"12"]
    out = response_headers(304, backend, via=b"mp", upstream_version=b"1.1", to_h2=True)
    assert values(out, b"content-length") == [b"12"]
    # RFC 9110 §8.6: none in 204 / 1xx.
    out = response_headers(204, backend, via=b"mp", upstream_version=b"1.1", to_h2=True)
    assert values(out, b"content-length") == []
    # RFC 9112 §6.3: Transfer-Encoding overrides it, so it goes.
    backend = [*backend, (b"transfer-encoding", b"chunked")]
    out = response_headers(200, backend, via=b"mp", upstream_version=b"1.1", to_h2=False)
    assert values(out, b"content-length") == []
    # and a Connection header cannot take it away.
    backend = [(b"connection", b"content-length"), (b"content-length", b"3")]
    out = response_headers(200, backend, via=b"mp", upstream_version=b"1.1", to_h2=False)
    assert values(out, b"content-length") == [b"3"]


def test_response_via() -> None:
    out = response_headers(200, [], via=b"mp", upstream_version=b"1.1", to_h2=True)
    assert out == [(b"via", b"1.1 mp")]
    backend = [(b"via", b"1.1 a"), (b"x", b"1"), (b"via", b"2 b")]
    out = response_headers(200, backend, via=b"mp", upstream_version=b"2", to_h2=False)
    assert out == [(b"x", b"1"), (b"via", b"1.1 a, 2 b, 2 mp")]


def test_response_lowercases_names() -> None:
    backend = [(b"Content-Type", b"text/plain"), (b"X-Request-Id", b"r1"), (b"Connection", b"x")]
    out = response_headers(200, backend, via=b"mp", upstream_version=b"1.1", to_h2=True)
    assert out == [(b"content-type", b"text/plain"), (b"x-request-id", b"r1"), (b"via", b"1.1 mp")]


@pytest.mark.parametrize(
    "content_type",
    [b"text/event-stream", b"text/event-stream; charset=utf-8", b"Text/Event-Stream ;charset=x"],
)
def test_response_sse_adds_headers(content_type: bytes) -> None:
    backend = [(b"content-type", content_type), (b"transfer-encoding", b"chunked")]
    out = response_headers(200, backend, via=b"mp", upstream_version=b"1.1", to_h2=True)
    assert out == [
        (b"content-type", content_type),
        (b"via", b"1.1 mp"),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
    ]


def test_response_sse_keeps_cache_control_and_replaces_accel() -> None:
    backend = [
        (b"x-accel-buffering", b"yes"),
        (b"cache-control", b"no-store"),
        (b"content-type", b"text/event-stream"),
    ]
    out = response_headers(200, backend, via=b"mp", upstream_version=b"1.1", to_h2=False)
    assert values(out, b"cache-control") == [b"no-store"]
    assert values(out, b"x-accel-buffering") == [b"no"]


def test_response_not_sse_left_alone() -> None:
    backend = [(b"content-type", b"application/json"), (b"x-accel-buffering", b"yes")]
    out = response_headers(200, backend, via=b"mp", upstream_version=b"1.1", to_h2=False)
    assert out == [*backend, (b"via", b"1.1 mp")]
    backend = [(b"content-type", b"text/event-streamx")]
    out = response_headers(200, backend, via=b"mp", upstream_version=b"1.1", to_h2=False)
    assert b"cache-control" not in names(out)


def test_response_from_real_h11_to_h2_and_h11() -> None:
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method=b"GET", target=b"/", headers=[(b"host", b"a")]))
    client.send(h11.EndOfMessage())
    client.receive_data(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: keep-alive\r\n"
        b"Transfer-Encoding: chunked\r\nX-Request-Id: r1\r\n\r\n"
    )
    event = client.next_event()
    assert isinstance(event, h11.Response)
    out = response_headers(
        event.status_code,
        event.headers,
        via=b"mp",
        upstream_version=event.http_version,
        to_h2=True,
    )
    # h2's own outbound validation accepts it.
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    server.initiate_connection()
    h2_client = h2.connection.H2Connection()
    h2_client.initiate_connection()
    h2_client.send_headers(1, GET, end_stream=True)
    server.receive_data(h2_client.data_to_send())
    server.send_headers(1, [(b":status", b"200"), *out])
    # and so does h11 for an HTTP/1.1 client.
    out = response_headers(200, event.headers, via=b"mp", upstream_version=b"1.1", to_h2=False)
    h1_server = h11.Connection(h11.SERVER)
    h1_server.receive_data(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
    h1_server.next_event()
    wire = h1_server.send(h11.Response(status_code=200, headers=out))
    assert wire is not None
    assert b"x-accel-buffering: no\r\n" in wire


# --- is_event_stream / header_value --------------------------------------------------------


def test_is_event_stream() -> None:
    assert is_event_stream([(b"content-type", b"text/event-stream")])
    assert is_event_stream([(b"x", b"1"), (b"content-type", b"TEXT/EVENT-STREAM;charset=utf-8")])
    assert not is_event_stream([(b"content-type", b"application/json")])
    assert not is_event_stream([])


def test_header_value() -> None:
    headers = [(b"a", b"1"), (b"b", b"2"), (b"a", b"3")]
    assert header_value(headers, b"a") == b"1"
    assert header_value(iter(headers), b"b") == b"2"
    assert header_value(headers, b"c") is None


# --- properties ----------------------------------------------------------------------------

token_names = st.from_regex(rb"\A[!#$%&'*+\-.^_`|~0-9a-z]{1,12}\Z")
field_values = st.from_regex(
    rb"\A(?:[\x21-\x7e\x80-\xff](?:[\t\x20-\x7e\x80-\xff]{0,10}[\x21-\x7e\x80-\xff])?)?\Z"
)
special_names = st.sampled_from(
    [
        b"host",
        b"cookie",
        b"via",
        b"x-forwarded-for",
        b"x-forwarded-proto",
        b"content-type",
        b"accept",
        b"x-secret",
        b"authorization",
    ]
)
connection_values = st.lists(
    st.sampled_from([b"close", b"keep-alive", b"Upgrade", b"X-Secret", b"te", b"accept", b"via"]),
    min_size=1,
    max_size=4,
).map(b", ".join)
h1_fields = st.one_of(
    st.tuples(token_names, field_values),
    st.tuples(special_names, field_values),
    st.tuples(st.just(b"connection"), connection_values),
    st.tuples(st.sampled_from([b"keep-alive", b"proxy-connection", b"upgrade"]), field_values),
    st.tuples(st.just(b"te"), st.sampled_from([b"trailers", b"gzip", b"trailers, deflate"])),
    st.tuples(st.just(b"transfer-encoding"), st.just(b"chunked")),
    st.tuples(st.just(b"content-length"), st.just(b"7")),
)


# Fields the proxy itself writes (or must keep to frame the body), whatever Connection says.
OURS = {b"host", b"content-length", b"x-forwarded-for", b"x-forwarded-proto", b"via"}


def check_upstream(out: Headers, nominated: set[bytes]) -> None:
    assert out[0][0] == b"host"
    assert names(out).count(b"host") == 1
    assert names(out).count(b"cookie") <= 1
    for name, value in out:
        if name == b"te":
            assert value == b"trailers"
        elif name == b"transfer-encoding":
            assert value == b"chunked"  # our own framing
        else:
            assert name not in HOP_BY_HOP
            assert name not in nominated or name in OURS
    # The brief's acceptance check: h11 takes the head as is.
    conn = h11.Connection(h11.CLIENT)
    assert conn.send(h11.Request(method=b"GET", target=b"/", headers=out))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(h1_fields, max_size=12), st.booleans())
def test_property_upstream_from_h1(fields: Headers, has_body: bool) -> None:
    # "Valid" is what a real h11 server accepts from a client.
    raw = b"".join(name + b": " + value + b"\r\n" for name, value in fields)
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST /x HTTP/1.1\r\nhost: api.example\r\n" + raw + b"\r\n")
    try:
        request = conn.next_event()
    except h11.RemoteProtocolError:
        event("refused by h11")
        return
    assert isinstance(request, h11.Request)
    try:
        head = request_from_h1(
            1, request.method, request.target, request.headers, scheme=b"http", http_version=b"1.1"
        )
    except MalformedRequest as exc:
        # Only an invalid or second Host value, or Content-Length next to Transfer-Encoding
        # (RFC 9112 §6.1, request smuggling), may be refused here.
        names = {name for name, _ in request.headers}
        assert any(name == b"host" for name, _ in fields) or (
            {b"content-length", b"transfer-encoding"} <= names
        ), exc
        event("refused: host or content-length with transfer-encoding")
        return
    nominated: set[bytes] = set()
    for name, value in head.headers:
        if name == b"connection":
            nominated |= {t.strip().lower() for t in value.split(b",")}
    out = upstream_h1_headers(
        head, client_ip="192.0.2.1", proto=b"http", via=b"mp", has_body=has_body
    )
    check_upstream(out, nominated)


h2_fields = st.one_of(
    st.tuples(token_names, field_values).filter(
        lambda f: f[0] not in HOP_BY_HOP and f[0] != b"content-length"
    ),
    st.tuples(special_names, field_values),
    st.tuples(st.just(b"te"), st.just(b"trailers")),
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(h2_fields, max_size=12),
    st.sampled_from([GET, WEBSOCKET, [(b":method", b"POST"), *GET[1:]]]),
    st.one_of(st.none(), st.just(b"42")),
    st.booleans(),
)
def test_property_upstream_from_h2(
    fields: Headers, pseudo: Headers, length: bytes | None, has_body: bool
) -> None:
    if length is not None:
        fields = [*fields, (b"content-length", length)]
    # RFC 9113 §8.3.1: a Host field next to :authority names it (one that does not is refused:
    # test_request_from_h2_host_next_to_authority_names_the_same_origin).
    authority = dict(pseudo)[b":authority"]
    fields = [(name, authority if name == b"host" else value) for name, value in fields]
    head = request_from_h2(1, [*pseudo, *fields], scheme_default=b"https")
    assert head.headers == fields
    out = upstream_h1_headers(
        head, client_ip="2001:db8::1", proto=b"http", via=b"mp", has_body=has_body
    )
    check_upstream(out, set())


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([b"a", b"b", b"upgrade", b"A"]), st.binary(max_size=3))),
    st.sampled_from([b"a", b"b", b"upgrade", b"c"]),
)
def test_header_value_is_the_first_match_of_any_iterable(fields: Headers, name: bytes) -> None:
    first = next((value for field, value in fields if field == name), None)
    assert header_value(fields, name) == first
    assert header_value(iter(fields), name) == first
    assert header_value(tuple(fields), name) == first

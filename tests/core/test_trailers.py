"""Trailer fields through the core (RFC 9110 §6.5.1): what a trailer section must not carry,
or what the other side's protocol cannot carry, is dropped on every path, and nothing a
client or a backend puts in trailers raises out of ``ProxyCore.handle``. Each path is a whole
conversation, every command asserted in order, timers included; real h11/h2 peers build the
bytes and decode what the proxy sends."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import h2.events
import h11
import pytest
from checks import Check, both, h1_body, h1_request, h1_response, h2_body, h2_ended, h2_response
from playbook import (
    CHAT,
    H1BackendPeer,
    H1ClientPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    data,
    opened,
)
from test_h2client import ORIGIN as H2_ORIGIN
from test_h2client import connected, h2_client, h2_config, over, posted, started
from test_h2guard import ORIGIN, acked, settings

from muxproxy.core.commands import CancelTimer, CloseConnection, OpenConnection, SetTimer
from muxproxy.core.http.headers import trailer_fields

# What a backend (or a client) may put in a trailer section that must not go on: framing,
# routing, hop-by-hop and connection-specific fields, and values no protocol can carry.
BAD_TRAILERS = [
    (b"Transfer-Encoding", b"ehunked"),
    (b"Content-Length", b"5"),
    (b"Host", b"evil.example"),
    (b"Connection", b"close"),
    (b"Keep-Alive", b"timeout=5"),
    (b"TE", b"gzip"),
    (b"Upgrade", b"h2c"),
    (b"Trailer", b"x-done"),
    (b"HTTP2-Settings", b"AAMAAABkAAQAAP__"),
    (b"Content-Type", b"text/html"),
    (b"Set-Cookie", b"a=1"),
]
GOOD_TRAILERS = [(b"grpc-status", b"0"), (b"x-done", b"yes")]
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def chunked_response(trailers: list[tuple[bytes, bytes]]) -> bytes:
    fields = b"".join(b"%s: %s\r\n" % field for field in trailers)
    return SSE_HEAD + b"b\r\ndata: tok\n\n\r\n0\r\n" + fields + b"\r\n"


# -- checks on what a peer decoded ----------------------------------------------------------


def h1_trailed(body: bytes, trailers: list[tuple[bytes, bytes]]) -> Check:
    """An HTTP/1.1 body run (no head): ``body``, then its end carrying exactly ``trailers``."""

    def check(events: Sequence[Any]) -> None:
        assert not any(isinstance(e, (h11.Request, h11.Response)) for e in events), events
        assert h1_body(events) == body, events
        end = events[-1]
        assert isinstance(end, h11.EndOfMessage), events
        assert list(end.headers) == trailers, end

    return check


def h2_trailed(sid: int, body: bytes) -> Check:
    """Stream ``sid`` carries ``body``, then trailers of exactly ``GOOD_TRAILERS``, and ends."""

    def check(events: Sequence[Any]) -> None:
        assert h2_body(events, sid) == body, events
        (trailers,) = [e for e in events if isinstance(e, h2.events.TrailersReceived)]
        assert trailers.stream_id == sid, trailers
        assert list(trailers.headers) == GOOD_TRAILERS, trailers

    return both(check, h2_ended(sid))


class Raw:
    """A decoder for ``Sends`` that gives the bytes as they are (an HTTP/1.0 exchange, which
    h11 as a client cannot speak)."""

    def events(self, data: bytes) -> list[bytes]:
        return [data]


# -- the conversation's steps -----------------------------------------------------------------


def h1_opens(pb: Playbook, request: bytes, *, body: bool = False) -> None:
    """Client connection 1's first request (exchange 1) opens backend connection -1;
    ``body``: it has a body, whose deadline is armed."""
    pb >> data(1, request)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    if body:
        pb << SetTimer(timer=("body", 1), at=30.0)


def h1_forwarded(pb: Playbook, check: Check) -> H1BackendPeer:
    """Backend connection -1 opens and gets exchange 1's request (``check``)."""
    backend = H1BackendPeer()
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(-1, backend, check)
    pb << SetTimer(timer=("head", 1), at=60.0)
    return backend


def test_trailer_fields_keeps_only_what_a_trailer_section_may_carry() -> None:
    fields = [
        *BAD_TRAILERS,
        (b":status", b"200"),
        (b"x-ctl", b"a\x01b"),
        (b"x-ff", b"a\x0cb"),
        (b"x-space", b" a"),
        (b"bad name", b"1"),
        (b"", b"1"),
        (b"Grpc-Status", b"0"),
        (b"x-done", b"yes"),
    ]
    assert trailer_fields(fields) == GOOD_TRAILERS


@pytest.mark.parametrize("te", [None, "trailers"])
@pytest.mark.parametrize("split", [0, 1])
def test_h1_backend_trailers_reach_an_h1_client_filtered(te: str | None, split: int) -> None:
    pb = Playbook(split=split)
    client = H1ClientPeer()
    pb.accept(1)
    h1_opens(pb, client.request("GET", "/v1/models", [("TE", te)] if te else []))
    h1_forwarded(pb, h1_request(b"GET", b"/v1/models"))
    pb >> data(-1, chunked_response([*BAD_TRAILERS, *GOOD_TRAILERS]))
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(200, b"", end=False))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << Sends(1, client, h1_trailed(b"data: tok\n\n", GOOD_TRAILERS))
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()


def test_h1_backend_trailers_reach_an_h2_client_filtered() -> None:
    pb = Playbook()
    client = H2ClientPeer()
    pb.accept(1)
    sid, request = client.request(b"GET", b"/v1/models", headers=[(b"te", b"trailers")])
    pb >> data(1, client.preface() + request)
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, settings)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb << Sends(1, client, acked)
    h1_forwarded(pb, h1_request(b"GET", b"/v1/models"))
    pb >> data(-1, chunked_response([*BAD_TRAILERS, *GOOD_TRAILERS]))
    pb << CancelTimer(timer=("head", 1))
    pb << Sends(1, client, h2_response(sid, 200, b"", ended=False))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << Sends(1, client, h2_trailed(sid, b"data: tok\n\n"))
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()


def test_trailers_are_dropped_for_an_http10_client() -> None:
    # RFC 9112 §7.1.2: an HTTP/1.0 client gets a read-until-close body: no trailer section.
    pb = Playbook()
    pb.accept(1)
    h1_opens(pb, b"GET /v1/models HTTP/1.0\r\nHost: proxy.example\r\n\r\n")
    h1_forwarded(pb, h1_request(b"GET", b"/v1/models"))
    pb >> data(-1, chunked_response(GOOD_TRAILERS))
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << (head := Sends(1, Raw()))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << Sends(1, Raw(), lambda got: got == [b"data: tok\n\n"])  # no chunk framing
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << CloseConnection(conn=1)  # the end of the body
    pb.done()
    assert head.data.startswith(b"HTTP/1.1 200 ") and head.data.endswith(b"\r\n\r\n")
    assert b"grpc-status" not in head.data.lower()


def test_h2_backend_trailers_reach_h2_and_h1_clients_filtered() -> None:
    pb = Playbook(h2_config())
    client = h2_client(pb, 1)
    sid = posted(pb, client, ex=1, first=True, opens=-1, headers=[(b"te", b"trailers")])
    backend = connected(pb, -1, [(1, started(1))])
    # h2 refuses to send connection-specific fields itself: the backend's encoder is told
    # not to check, as a broken server's would not.
    bad = [(n.lower(), v) for n, v in BAD_TRAILERS]

    def answer(bsid: int) -> bytes:
        backend.conn.send_headers(bsid, [(b":status", b"200")])
        backend.conn.send_data(bsid, b"body")
        backend.conn.config.validate_outbound_headers = False
        backend.conn.send_headers(bsid, [*bad, *GOOD_TRAILERS], end_stream=True)
        return backend.output()

    pb >> data(-1, answer(1))
    pb << CancelTimer(timer=("head", 1))
    pb << Sends(1, client, h2_response(sid, 200, b"", ended=False))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << Sends(1, client, h2_trailed(sid, b"body"))
    over(pb, ex=1, pool=-1, idle=1)

    h1 = H1ClientPeer()
    pb.accept(2)
    pb >> data(2, h1.request("POST", "/x", [("te", "trailers")], body=b"{}"))
    pb << CancelTimer(timer=("header", 2))
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << CancelTimer(timer=("pool", -1))  # the idle backend connection takes it
    pb << CancelTimer(timer=("connect", 2))
    pb << Sends(-1, backend, started(3, b"/x", body=None))
    pb << SetTimer(timer=("head", 2), at=60.0)
    pb << SetTimer(timer=("body", 2), at=30.0)
    pb << Sends(-1, backend, both(lambda got: h2_body(got, 3) == b"{}", h2_ended(3)))
    pb >> data(-1, answer(3))
    pb << CancelTimer(timer=("head", 2))
    pb << SetTimer(timer=("send", 2), at=60.0)
    pb << Sends(2, h1, h1_response(200, b"", end=False))
    pb << SetTimer(timer=("read", 2), at=300.0)
    pb << Sends(2, h1, h1_trailed(b"body", GOOD_TRAILERS))
    over(pb, ex=2, pool=-1, idle=2)
    pb.done()


def test_h2_backend_trailers_after_a_content_length_are_dropped_for_an_h1_client() -> None:
    # h11 sends no trailers after a Content-Length body (RFC 9112 §7.1.2: only chunked has them).
    pb = Playbook(h2_config())
    h1 = H1ClientPeer()
    pb.accept(1)
    pb >> data(1, h1.request("POST", "/x", body=b"{}"))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=H2_ORIGIN)
    pb << SetTimer(timer=("pool", -1), at=5.0)
    pb << SetTimer(timer=("body", 1), at=30.0)
    backend = connected(pb, -1, [(1, started(1, b"/x"))])
    backend.conn.send_headers(1, [(b":status", b"200"), (b"content-length", b"4")])
    backend.conn.send_data(1, b"body")
    backend.conn.send_headers(1, GOOD_TRAILERS, end_stream=True)
    pb >> data(-1, backend.output())
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, h1, h1_response(200, b"", end=False))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << Sends(1, h1, h1_trailed(b"body", []))
    over(pb, ex=1, pool=-1, idle=1)
    pb.done()


def test_h1_client_request_trailers_reach_the_backend_filtered() -> None:
    pb = Playbook()
    pb.accept(1)
    # h11 itself refuses a bad Transfer-Encoding or Content-Length in a client's trailers.
    fields = b"".join(b"%s: %s\r\n" % f for f in [*BAD_TRAILERS[2:], *GOOD_TRAILERS])
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy.example\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n" + fields + b"\r\n"
    )
    h1_opens(pb, request, body=True)
    request_trailed = both(h1_request(b"POST", CHAT), h1_trailed_request(b"{}", GOOD_TRAILERS))
    h1_forwarded(pb, request_trailed)
    pb.done()


def h1_trailed_request(body: bytes, trailers: list[tuple[bytes, bytes]]) -> Check:
    """A whole HTTP/1.1 request (a backend's view): ``body``, then its end carrying exactly
    ``trailers``."""
    return lambda events: h1_trailed(body, trailers)(events[1:])


@pytest.mark.parametrize("content_length", [False, True])
def test_h2_client_request_trailers_reach_an_h1_backend_filtered(content_length: bool) -> None:
    pb = Playbook()
    client = H2ClientPeer()
    pb.accept(1)
    sid = client.conn.get_next_available_stream_id()
    head = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"proxy.example")]
    head.append((b":path", CHAT))
    if content_length:
        head.append((b"content-length", b"2"))
    client.conn.send_headers(sid, head)
    client.conn.send_data(sid, b"{}")
    client.conn.config.validate_outbound_headers = False
    bad = [(n.lower(), v) for n, v in BAD_TRAILERS]
    client.conn.send_headers(sid, [*bad, (b"x-ctl", b"a\x01b"), *GOOD_TRAILERS], end_stream=True)
    pb >> data(1, client.preface() + client.conn.data_to_send())
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, settings)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb << SetTimer(timer=("body", 1), at=30.0)
    pb << Sends(1, client, acked)
    # A body framed by its Content-Length has no trailer section on HTTP/1.1.
    trailers = [] if content_length else GOOD_TRAILERS
    h1_forwarded(pb, both(h1_request(b"POST", CHAT), h1_trailed_request(b"{}", trailers)))
    pb.done()


def test_h2_client_request_trailers_reach_an_h2_backend_filtered() -> None:
    pb = Playbook(h2_config())
    client = h2_client(pb, 1)
    sid = client.conn.get_next_available_stream_id()
    head = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"proxy.example")]
    client.conn.send_headers(sid, [*head, (b":path", CHAT)])
    client.conn.send_data(sid, b"{}")
    client.conn.config.validate_outbound_headers = False
    bad = [(n.lower(), v) for n, v in BAD_TRAILERS]
    client.conn.send_headers(sid, [*bad, *GOOD_TRAILERS], end_stream=True)
    pb >> data(1, client.conn.data_to_send())
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=H2_ORIGIN)
    pb << SetTimer(timer=("pool", -1), at=5.0)
    pb << SetTimer(timer=("body", 1), at=30.0)
    connected(pb, -1, [(1, both(started(1), h2_trailed(1, b"{}")))])
    pb.done()

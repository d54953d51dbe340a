"""Trailer fields through the core (RFC 9110 §6.5.1): what a trailer section must not carry,
or what the other side's protocol cannot carry, is dropped on every path, and nothing a
client or a backend puts in trailers raises out of ``ProxyCore.handle``."""

from __future__ import annotations

import h2.events
import h11
import pytest
from playbook import BACKEND, H1BackendPeer, H1ClientPeer, H2Client, H2ClientPeer, Playbook
from test_h2client import connect_backend, h2_config, requests

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


def _h1_backend(pb: Playbook) -> int:
    (open_cmd,) = pb.opens()
    assert str(open_cmd.origin) == BACKEND
    pb.opened(open_cmd.conn)
    return open_cmd.conn


@pytest.mark.parametrize("te", [None, "trailers"])
@pytest.mark.parametrize("split", [0, 1])
def test_h1_backend_trailers_reach_an_h1_client_filtered(te: str | None, split: int) -> None:
    pb = Playbook(split=split)
    client = H1ClientPeer()
    pb.accept(1)
    pb.receive(1, client.request("GET", "/v1/models", [("TE", te)] if te else []))
    up = _h1_backend(pb)
    pb.receive(up, chunked_response([*BAD_TRAILERS, *GOOD_TRAILERS]))
    events = client.events(pb.take(1))
    assert b"".join(e.data for e in events if isinstance(e, h11.Data)) == b"data: tok\n\n"
    end = events[-1]
    assert isinstance(end, h11.EndOfMessage)
    assert list(end.headers) == GOOD_TRAILERS


def test_h1_backend_trailers_reach_an_h2_client_filtered() -> None:
    pb = Playbook()
    client = H2ClientPeer()
    pb.accept(1)
    sid, data = client.request(b"GET", b"/v1/models", headers=[(b"te", b"trailers")])
    pb.receive(1, client.preface() + data)
    up = _h1_backend(pb)
    pb.receive(up, chunked_response([*BAD_TRAILERS, *GOOD_TRAILERS]))
    events = client.events(pb.take(1))
    (trailers,) = [e for e in events if isinstance(e, h2.events.TrailersReceived)]
    assert trailers.stream_id == sid
    assert list(trailers.headers) == GOOD_TRAILERS
    assert any(isinstance(e, h2.events.StreamEnded) for e in events)


def test_trailers_are_dropped_for_an_http10_client() -> None:
    # RFC 9112 §7.1.2: an HTTP/1.0 client gets a read-until-close body: no trailer section.
    pb = Playbook()
    pb.accept(1)
    pb.receive(1, b"GET /v1/models HTTP/1.0\r\nHost: proxy.example\r\n\r\n")
    up = _h1_backend(pb)
    pb.receive(up, chunked_response(GOOD_TRAILERS))
    out = pb.take(1)
    assert out.endswith(b"\r\n\r\ndata: tok\n\n")
    assert b"grpc-status" not in out


def test_h2_backend_trailers_reach_h2_and_h1_clients_filtered() -> None:
    pb = Playbook(h2_config())
    client = H2Client(pb, 1)
    sid = client.request(headers=[(b"te", b"trailers")])
    backend = connect_backend(pb, -1)
    (req,) = requests(backend.read())
    backend.conn.send_headers(req.stream_id, [(b":status", b"200")])
    backend.conn.send_data(req.stream_id, b"body")
    # h2 refuses to send connection-specific fields itself: the backend's encoder is told
    # not to check, as a broken server's would not.
    backend.conn.config.validate_outbound_headers = False
    bad = [(n.lower(), v) for n, v in BAD_TRAILERS]
    backend.conn.send_headers(req.stream_id, [*bad, *GOOD_TRAILERS], end_stream=True)
    backend.flush()
    (trailers,) = [e for e in client.read() if isinstance(e, h2.events.TrailersReceived)]
    assert trailers.stream_id == sid
    assert list(trailers.headers) == GOOD_TRAILERS

    h1 = H1ClientPeer()
    pb.accept(2)
    pb.receive(2, h1.request("POST", "/x", [("te", "trailers")], body=b"{}"))
    (req,) = requests(backend.read())
    backend.conn.send_headers(req.stream_id, [(b":status", b"200")])
    backend.conn.send_data(req.stream_id, b"body")
    backend.conn.send_headers(req.stream_id, [*bad, *GOOD_TRAILERS], end_stream=True)
    backend.flush()
    end = h1.events(pb.take(2))[-1]
    assert isinstance(end, h11.EndOfMessage)
    assert list(end.headers) == GOOD_TRAILERS


def test_h2_backend_trailers_after_a_content_length_are_dropped_for_an_h1_client() -> None:
    # h11 sends no trailers after a Content-Length body (RFC 9112 §7.1.2: only chunked has them).
    pb = Playbook(h2_config())
    h1 = H1ClientPeer()
    pb.accept(1)
    pb.receive(1, h1.request("POST", "/x", body=b"{}"))
    backend = connect_backend(pb, -1)
    (req,) = requests(backend.read())
    backend.conn.send_headers(req.stream_id, [(b":status", b"200"), (b"content-length", b"4")])
    backend.conn.send_data(req.stream_id, b"body")
    backend.conn.send_headers(req.stream_id, GOOD_TRAILERS, end_stream=True)
    backend.flush()
    events = h1.events(pb.take(1))
    assert b"".join(e.data for e in events if isinstance(e, h11.Data)) == b"body"
    assert isinstance(events[-1], h11.EndOfMessage) and list(events[-1].headers) == []


def test_h1_client_request_trailers_reach_the_backend_filtered() -> None:
    pb = Playbook()
    pb.accept(1)
    # h11 itself refuses a bad Transfer-Encoding or Content-Length in a client's trailers.
    fields = b"".join(b"%s: %s\r\n" % f for f in [*BAD_TRAILERS[2:], *GOOD_TRAILERS])
    pb.receive(
        1,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy.example\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n" + fields + b"\r\n",
    )
    up = _h1_backend(pb)
    backend = H1BackendPeer()
    received = backend.events(pb.take(up))
    end = received[-1]
    assert isinstance(end, h11.EndOfMessage)
    assert list(end.headers) == GOOD_TRAILERS


@pytest.mark.parametrize("content_length", [False, True])
def test_h2_client_request_trailers_reach_an_h1_backend_filtered(content_length: bool) -> None:
    pb = Playbook()
    client = H2ClientPeer()
    pb.accept(1)
    sid = client.conn.get_next_available_stream_id()
    head = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"proxy.example")]
    head.append((b":path", b"/v1/chat/completions"))
    if content_length:
        head.append((b"content-length", b"2"))
    client.conn.send_headers(sid, head)
    client.conn.send_data(sid, b"{}")
    client.conn.config.validate_outbound_headers = False
    bad = [(n.lower(), v) for n, v in BAD_TRAILERS]
    client.conn.send_headers(sid, [*bad, (b"x-ctl", b"a\x01b"), *GOOD_TRAILERS], end_stream=True)
    pb.receive(1, client.preface() + client.conn.data_to_send())
    up = _h1_backend(pb)
    backend = H1BackendPeer()
    received = backend.events(pb.take(up))
    assert b"".join(e.data for e in received if isinstance(e, h11.Data)) == b"{}"
    end = received[-1]
    assert isinstance(end, h11.EndOfMessage)
    # A body framed by its Content-Length has no trailer section on HTTP/1.1.
    assert list(end.headers) == ([] if content_length else GOOD_TRAILERS)


def test_h2_client_request_trailers_reach_an_h2_backend_filtered() -> None:
    pb = Playbook(h2_config())
    client = H2Client(pb, 1)
    sid = client.peer.conn.get_next_available_stream_id()
    head = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"proxy.example")]
    client.peer.conn.send_headers(sid, [*head, (b":path", b"/v1/chat/completions")])
    client.peer.conn.send_data(sid, b"{}")
    client.peer.conn.config.validate_outbound_headers = False
    bad = [(n.lower(), v) for n, v in BAD_TRAILERS]
    client.peer.conn.send_headers(sid, [*bad, *GOOD_TRAILERS], end_stream=True)
    client.send()
    backend = connect_backend(pb, -1)
    events = backend.read()
    (trailers,) = [e for e in events if isinstance(e, h2.events.TrailersReceived)]
    assert list(trailers.headers) == GOOD_TRAILERS

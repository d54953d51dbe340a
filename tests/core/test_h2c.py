"""h2c upgrade (RFC 7540 §3.2): an HTTP/1.1 request switches the connection to HTTP/2."""

from __future__ import annotations

import base64

import h2.config
import h2.connection
import h2.events
import h11
import pytest
from playbook import H1BackendPeer, H1ClientPeer, Playbook

from muxproxy.core.http1.h2c import h2c_offer
from muxproxy.core.messages import RequestHead

SSE = [b'data: {"token": 0}\n\n', b"data: [DONE]\n\n"]


def h2_upgrade_client() -> tuple[h2.connection.H2Connection, str]:
    """An h2 client set up for an upgrade, and its HTTP2-Settings value (as curl sends it:
    base64url without padding)."""
    config = h2.config.H2Configuration(client_side=True, header_encoding=None)
    conn = h2.connection.H2Connection(config=config)
    settings = conn.initiate_upgrade_connection()
    assert settings is not None
    return conn, settings.decode().rstrip("=")


def upgrade_headers(settings: str) -> list[tuple[str, str]]:
    return [
        ("Connection", "Upgrade, HTTP2-Settings"),
        ("Upgrade", "h2c"),
        ("HTTP2-Settings", settings),
    ]


def backend_for(pb: Playbook) -> tuple[int, H1BackendPeer, h11.Request]:
    (open_cmd,) = pb.opens()
    up = open_cmd.conn
    pb.opened(up)
    backend = H1BackendPeer()
    request = backend.events(pb.take(up))[0]
    assert isinstance(request, h11.Request)
    return up, backend, request


@pytest.mark.parametrize("split", [0, 1])
def test_h2c_upgrade_answers_101_and_serves_stream_1_over_http2(split: int) -> None:
    pb = Playbook(split=split)
    h2_client, settings = h2_upgrade_client()
    h1_client = H1ClientPeer()
    pb.accept(1)
    request = h1_client.request("GET", "/v1/models", upgrade_headers(settings))
    # curl writes its preface only after the 101; a client may also pipeline it at once.
    pb.receive(1, request)

    events = h1_client.events(pb.take(1))
    assert isinstance(events[0], h11.InformationalResponse)
    assert events[0].status_code == 101
    assert dict(events[0].headers) == {b"connection": b"Upgrade", b"upgrade": b"h2c"}
    assert h1_client.conn.our_state is h11.SWITCHED_PROTOCOL
    seen = len(pb.take(1))
    # What followed the 101 is HTTP/2: our SETTINGS first (RFC 9113 §3.4).
    after_101 = h1_client.conn.trailing_data[0]
    h2_events = h2_client.receive_data(after_101)
    assert isinstance(h2_events[0], h2.events.RemoteSettingsChanged)
    pb.receive(1, h2_client.data_to_send())  # the client's preface and SETTINGS ACK

    up, backend, backend_request = backend_for(pb)
    assert backend_request.target == b"/v1/models"
    headers = dict(backend_request.headers)
    assert b"upgrade" not in headers and b"http2-settings" not in headers
    assert headers[b"via"] == b"1.1 muxproxy"

    pb.receive(up, backend.sse_head())
    for chunk in SSE:
        pb.receive(up, backend.chunk(chunk))
    pb.receive(up, backend.end())
    events = h2_client.receive_data(pb.take(1)[seen:])
    (response,) = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert response.stream_id == 1
    assert dict(response.headers)[b":status"] == b"200"
    body = b"".join(
        e.data for e in events if isinstance(e, h2.events.DataReceived) and e.stream_id == 1
    )
    assert body == b"".join(SSE)
    assert any(isinstance(e, h2.events.StreamEnded) and e.stream_id == 1 for e in events)

    # The connection is HTTP/2 now: the next request is an ordinary stream 3.
    h2_client.send_headers(
        3,
        [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"x"), (b":path", b"/")],
        end_stream=True,
    )
    pb.receive(1, h2_client.data_to_send())
    assert len(pb.opens()) == 1  # the kept-alive backend connection serves it
    assert backend.conn.our_state is h11.DONE


def test_h2c_preface_in_the_same_read_as_the_request() -> None:
    pb = Playbook()
    h2_client, settings = h2_upgrade_client()
    h1_client = H1ClientPeer()
    pb.accept(1)
    request = h1_client.request("HEAD", "/v1/models", upgrade_headers(settings))
    pb.receive(1, request + h2_client.data_to_send())
    up, backend, _ = backend_for(pb)
    assert isinstance(h1_client.events(pb.take(1))[0], h11.InformationalResponse)
    h2_client.receive_data(h1_client.conn.trailing_data[0])
    head = backend.conn.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
    events = h2_client.receive_data(pb.take(1, pb.receive(up, (head or b"") + backend.end())))
    assert [type(e) for e in events if e.stream_id == 1][-1] is h2.events.StreamEnded


@pytest.mark.parametrize(
    "case", ["with-body", "bad-settings", "settings-not-a-connection-option", "tls"]
)
def test_h2c_offers_we_decline_are_served_over_http1(case: str) -> None:
    pb = Playbook()
    _, settings = h2_upgrade_client()
    headers = upgrade_headers(settings)
    body = None
    if case == "with-body":
        body = b'{"stream": true}'
    elif case == "bad-settings":
        headers[2] = ("HTTP2-Settings", "AAMAAABk!")
    elif case == "settings-not-a-connection-option":
        headers[0] = ("Connection", "Upgrade")
    h1_client = H1ClientPeer()
    if case == "tls":
        pb.accept(1, tls=True, alpn="http/1.1")
    else:
        pb.accept(1)
    pb.receive(1, h1_client.request("POST" if body else "GET", "/v1/x", headers, body))
    assert not pb.take(1)  # no 101
    up, backend, request = backend_for(pb)
    assert b"http2-settings" not in dict(request.headers)
    assert b"upgrade" not in dict(request.headers)
    commands = pb.receive(up, backend.sse_head() + backend.chunk(SSE[0]) + backend.end())
    events = h1_client.events(pb.take(1, commands))
    assert isinstance(events[0], h11.Response) and events[0].status_code == 200
    assert b"".join(e.data for e in events if isinstance(e, h11.Data)) == SSE[0]
    assert isinstance(events[-1], h11.EndOfMessage)
    # The refused switch leaves an ordinary kept-alive HTTP/1.1 connection.
    assert h1_client.conn.our_state is h11.DONE and h1_client.conn.their_state is h11.DONE


def test_invalid_settings_values_fall_back_to_http1() -> None:
    # SETTINGS_ENABLE_PUSH = 2 is out of range (RFC 9113 §6.5.2): h2 refuses it.
    payload = (2).to_bytes(2, "big") + (2).to_bytes(4, "big")
    settings = base64.urlsafe_b64encode(payload).decode().rstrip("=")
    pb = Playbook()
    h1_client = H1ClientPeer()
    pb.accept(1)
    pb.receive(1, h1_client.request("GET", "/v1/models", upgrade_headers(settings)))
    assert not pb.take(1)
    up, backend, _ = backend_for(pb)
    events = h1_client.events(pb.take(1, pb.receive(up, backend.sse_head() + backend.end())))
    assert isinstance(events[0], h11.Response)


def head_with(headers: list[tuple[bytes, bytes]], *, end_stream: bool = True) -> RequestHead:
    return RequestHead(
        stream=1,
        method=b"GET",
        target=b"/",
        authority=b"x",
        scheme=b"http",
        headers=headers,
        end_stream=end_stream,
    )


def test_h2c_offer_needs_exactly_one_settings_field() -> None:
    fields = [
        (b"connection", b"upgrade, http2-settings"),
        (b"upgrade", b"websocket, h2c"),
        (b"http2-settings", b""),
    ]
    head, upgrade = h2c_offer(head_with(fields), plain=True)
    assert upgrade is not None and upgrade.settings == b""  # an empty SETTINGS is valid
    assert b"http2-settings" not in dict(head.headers)
    _, upgrade = h2c_offer(head_with([*fields, (b"http2-settings", b"")]), plain=True)
    assert upgrade is None
    plain_head = head_with([(b"upgrade", b"websocket"), (b"http2-settings", b"")])
    assert h2c_offer(plain_head, plain=True) == (plain_head, None)  # not ours to touch

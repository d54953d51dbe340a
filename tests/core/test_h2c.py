"""h2c upgrade (RFC 7540 §3.2): an HTTP/1.1 request switches the connection to HTTP/2.

Through the core, each test is a conversation (every command in order, timers included): the
client's h11 peer reads the 101, its h2 peer what follows it."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import h2.config
import h2.connection
import h2.events
import h11
import pytest
from checks import (
    Check,
    both,
    h1_body,
    h1_request,
    h1_response,
    h2_body,
    h2_ended,
    h2_resets,
    h2_response,
)
from playbook import H1BackendPeer, H1ClientPeer, Playbook, Sends, data, opened
from test_h2guard import ORIGIN

from muxproxy.core.commands import CancelTimer, OpenConnection, SetTimer
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


class Upgraded:
    """The HTTP/2 side of an upgraded client connection, decoding for ``Sends``."""

    def __init__(self, conn: h2.connection.H2Connection) -> None:
        self.conn = conn

    def events(self, data: bytes) -> list[h2.events.Event]:
        return self.conn.receive_data(data)


def switched(h1_client: H1ClientPeer, h2_client: h2.connection.H2Connection) -> Check:
    """A 101 to h2c, the HTTP/1.1 side done with; what follows it is HTTP/2, our SETTINGS
    first (RFC 9113 §3.4), decoded by ``h2_client``."""

    def check(events: Sequence[Any]) -> None:
        (switch,) = events
        assert isinstance(switch, h11.InformationalResponse), events
        assert switch.status_code == 101
        assert dict(switch.headers) == {b"connection": b"Upgrade", b"upgrade": b"h2c"}
        assert h1_client.conn.our_state is h11.SWITCHED_PROTOCOL
        after_101 = h1_client.conn.trailing_data[0]
        h2_events = h2_client.receive_data(after_101)
        assert isinstance(h2_events[0], h2.events.RemoteSettingsChanged), h2_events

    return check


def acked(events: Sequence[Any]) -> None:
    assert [type(e) for e in events] == [h2.events.SettingsAcknowledged], events


def plain(method: bytes, target: bytes) -> Check:
    """The request as the backend got it: HTTP/1.1, without the upgrade's fields."""

    def check(events: Sequence[Any]) -> None:
        headers = dict(events[0].headers)
        assert b"upgrade" not in headers and b"http2-settings" not in headers, headers
        assert headers[b"via"] == b"1.1 muxproxy", headers

    return both(h1_request(method, target), check)


def carries(body: bytes) -> Check:
    return lambda events: h2_body(events, 1) == body


def upgraded(
    pb: Playbook, h1_client: H1ClientPeer, h2_client: h2.connection.H2Connection, read: bytes
) -> None:
    """Client connection 1 sends ``read``, an upgrade request for stream 1 (and maybe the
    preface after it): answered with a 101 at once, and forwarded."""
    pb >> data(1, read)
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, h1_client, switched(h1_client, h2_client))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)


def forwarded(pb: Playbook, ex: int, check: Check) -> H1BackendPeer:
    """Backend connection -1 opens and gets exchange ``ex``'s request (``check``)."""
    backend = H1BackendPeer()
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", ex))
    pb << Sends(-1, backend, check)
    pb << SetTimer(timer=("head", ex), at=60.0)
    return backend


@pytest.mark.parametrize("split", [0, 1])
def test_h2c_upgrade_answers_101_and_serves_stream_1_over_http2(split: int) -> None:
    pb = Playbook(split=split)
    h2_client, settings = h2_upgrade_client()
    h1_client = H1ClientPeer()
    h2_side = Upgraded(h2_client)
    pb.accept(1)
    request = h1_client.request("GET", "/v1/models", upgrade_headers(settings))
    # curl writes its preface only after the 101; a client may also pipeline it at once.
    upgraded(pb, h1_client, h2_client, request)
    pb >> data(1, h2_client.data_to_send())  # the client's preface and SETTINGS ACK
    pb << Sends(1, h2_side, acked)

    backend = forwarded(pb, 1, plain(b"GET", b"/v1/models"))
    pb >> data(-1, backend.sse_head())
    pb << CancelTimer(timer=("head", 1))
    pb << Sends(1, h2_side, h2_response(1, 200, b"", ended=False))
    pb << SetTimer(timer=("read", 1), at=300.0)
    for chunk in SSE:
        pb >> data(-1, backend.chunk(chunk))
        pb << Sends(1, h2_side, both(carries(chunk), h2_resets()))
    pb >> data(-1, backend.end())
    pb << Sends(1, h2_side, both(carries(b""), h2_ended(1)))
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    assert backend.conn.our_state is h11.DONE

    # The connection is HTTP/2 now: the next request is an ordinary stream 3.
    h2_client.send_headers(
        3,
        [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"x"), (b":path", b"/")],
        end_stream=True,
    )
    backend.conn.start_next_cycle()
    pb >> data(1, h2_client.data_to_send())
    pb << CancelTimer(timer=("idle", 1))
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << CancelTimer(timer=("pool", -1))  # the kept-alive backend connection serves it
    pb << CancelTimer(timer=("connect", 2))
    pb << Sends(-1, backend, h1_request(b"GET", b"/"))
    pb << SetTimer(timer=("head", 2), at=60.0)
    pb.done()


def test_h2c_preface_in_the_same_read_as_the_request() -> None:
    pb = Playbook()
    h2_client, settings = h2_upgrade_client()
    h1_client = H1ClientPeer()
    h2_side = Upgraded(h2_client)
    pb.accept(1)
    request = h1_client.request("HEAD", "/v1/models", upgrade_headers(settings))
    upgraded(pb, h1_client, h2_client, request + h2_client.data_to_send())
    pb << Sends(1, h2_side, acked)
    backend = forwarded(pb, 1, plain(b"HEAD", b"/v1/models"))
    head = backend.conn.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
    pb >> data(-1, (head or b"") + backend.end())
    pb << CancelTimer(timer=("head", 1))

    def ends(events: Sequence[Any]) -> None:
        on_1 = [type(e) for e in events if getattr(e, "stream_id", None) == 1]
        assert on_1[-1] is h2.events.StreamEnded, events

    pb << Sends(1, h2_side, both(h2_response(1, 200, b""), ends))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()


def served_over_http1(
    pb: Playbook, client: H1ClientPeer, request: bytes, *, body: bool, chunk: bytes
) -> None:
    """Client connection 1's ``request`` (``body``: it has one) is forwarded as plain
    HTTP/1.1, no 101 first; the backend's SSE answer (``chunk``, then its end) is relayed."""
    pb >> data(1, request)
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    if body:
        pb << SetTimer(timer=("body", 1), at=30.0)
    backend = H1BackendPeer()
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(-1, backend, plain(b"POST" if body else b"GET", target_of(request)))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb >> data(-1, backend.sse_head() + (backend.chunk(chunk) if chunk else b"") + backend.end())
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(200, b"", end=False))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << Sends(1, client, both(lambda events: h1_body(events) == chunk, ended))
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    if body:
        pb << CancelTimer(timer=("body", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()


def target_of(request: bytes) -> bytes:
    """The target of a raw HTTP/1.1 request."""
    return request.split(b" ", 2)[1]


def ended(events: Sequence[Any]) -> None:
    assert isinstance(events[-1], h11.EndOfMessage), events


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
    request = h1_client.request("POST" if body else "GET", "/v1/x", headers, body)
    served_over_http1(pb, h1_client, request, body=body is not None, chunk=SSE[0])
    # The refused switch leaves an ordinary kept-alive HTTP/1.1 connection.
    assert h1_client.conn.our_state is h11.DONE and h1_client.conn.their_state is h11.DONE


def test_invalid_settings_values_fall_back_to_http1() -> None:
    # SETTINGS_ENABLE_PUSH = 2 is out of range (RFC 9113 §6.5.2): h2 refuses it.
    payload = (2).to_bytes(2, "big") + (2).to_bytes(4, "big")
    settings = base64.urlsafe_b64encode(payload).decode().rstrip("=")
    pb = Playbook()
    h1_client = H1ClientPeer()
    pb.accept(1)
    request = h1_client.request("GET", "/v1/models", upgrade_headers(settings))
    served_over_http1(pb, h1_client, request, body=False, chunk=b"")


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

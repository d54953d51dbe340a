"""WebSocket tunnels in the core, bytes only: the handshake, the switch, the relay, the ends.

Real peers build and decode everything HTTP: h11 for the client and the backend handshake,
h2 for the RFC 8441 client. After the switch the bytes are opaque, so the tests use plain
byte strings where WebSocket frames would travel. Each test is a conversation: every command
asserted in order, timers included (``Log`` where the log line is the behaviour); a bug is
planted on the core's ``FaultPlan``, never by replacing a method.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import h11
from checks import both, h1_body, h1_request, h1_response, h2_ended, h2_resets, h2_response
from playbook import (
    BACKEND,
    H1BackendPeer,
    H2BackendPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    closed,
    data,
    default_config,
    opened,
    sent,
    subset,
    wakeup,
)

from muxproxy.config import (
    Config,
    Limits,
    Server,
    Timeouts,
    Upstream,
    parse_config,
    quick_config,
)
from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    Log,
    OpenConnection,
    Origin,
    PauseReading,
    ResumeReading,
    SendData,
    SetTimer,
    ShutdownWrite,
)
from muxproxy.core.events import DataReceived, InputEnded
from muxproxy.core.faultplan import FaultPoint, plant_faults
from muxproxy.core.tunnel.websocket import accept_for

KEY = b"dGhlIHNhbXBsZSBub25jZQ=="
ORIGIN = Origin(host="127.0.0.1", port=9001)
TUNNEL = ("tunnel", 1)
HANDSHAKE = [
    ("Upgrade", "websocket"),
    ("Connection", "Upgrade"),
    ("Sec-WebSocket-Key", KEY.decode()),
    ("Sec-WebSocket-Version", "13"),
]


def _upgrade_request(target: str = "/ws", extra: bytes = b"") -> bytes:
    client = h11.Connection(h11.CLIENT)
    data = client.send(
        h11.Request(method="GET", target=target, headers=[("Host", "p"), *HANDSHAKE])
    )
    assert data is not None
    return data + extra


def _switch(backend: H1BackendPeer, key: bytes = KEY, status: int = 101) -> bytes:
    headers = [("Upgrade", "websocket"), ("Connection", "Upgrade")]
    headers.append(("Sec-WebSocket-Accept", accept_for(key).decode()))
    return backend.conn.send(h11.InformationalResponse(status_code=status, headers=headers)) or b""


def _open_h1(pb: Playbook, extra: bytes = b"") -> tuple[int, H1BackendPeer, h11.Request]:
    pb.accept(1)
    pb.receive(1, _upgrade_request(extra=extra))
    (open_cmd,) = pb.opens()
    up = open_cmd.conn
    pb.opened(up)
    backend = H1BackendPeer()
    (request, *_) = backend.events(pb.take(up))
    assert isinstance(request, h11.Request)
    return up, backend, request


def _upgrades(pb: Playbook, extra: bytes = b"") -> tuple[H1BackendPeer, Sends]:
    """Client connection 1 (accepted here) asks to upgrade to a WebSocket (``extra``: bytes
    right after its request): the proxy connects to backend connection -1 and forwards the
    handshake. Returns the backend peer and what it decoded."""
    pb.accept(1)
    pb >> data(1, _upgrade_request(extra=extra))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    backend = H1BackendPeer()
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << (request := Sends(-1, backend, lambda e: isinstance(e[0], h11.Request)))
    pb << SetTimer(timer=("head", 1), at=60.0)
    return backend, request


class _HandshakeClient:
    """The client's side of the handshake: decodes the proxy's answer to ``GET /ws``."""

    def __init__(self) -> None:
        self.conn = h11.Connection(h11.CLIENT)
        self.conn.send(h11.Request(method="GET", target="/ws", headers=[("Host", "p"), *HANDSHAKE]))
        self.conn.send(h11.EndOfMessage())

    def events(self, payload: bytes) -> list[Any]:
        self.conn.receive_data(payload)
        out = []
        while (event := self.conn.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
            out.append(event)
        return out


def _tunnel_timer(pb: Playbook) -> tuple[str, int]:
    (timer,) = {c.timer for c in pb.log if isinstance(c, SetTimer) and c.timer[0] == "tunnel"}
    return timer


def test_upgrade_goes_to_the_backend_with_only_the_websocket_upgrade_fields() -> None:
    pb = Playbook()
    _, forwarded = _upgrades(pb)
    pb.done()
    headers = forwarded.events[0].headers
    assert (b"upgrade", b"websocket") in headers
    assert (b"connection", b"upgrade") in headers
    assert (b"sec-websocket-key", KEY) in headers
    assert (b"sec-websocket-version", b"13") in headers
    assert sum(1 for name, _ in headers if name in (b"upgrade", b"connection")) == 2


def test_101_switches_both_connections_to_raw_bytes() -> None:
    pb = Playbook()
    backend, _ = _upgrades(pb, extra=b"early-frame")
    client = _HandshakeClient()

    def switched(events: Sequence[Any]) -> None:
        (response,) = events
        assert isinstance(response, h11.InformationalResponse) and response.status_code == 101
        fields = dict(response.headers)
        assert fields[b"upgrade"] == b"websocket"
        assert fields[b"sec-websocket-accept"] == accept_for(KEY)
        assert client.conn.our_state is h11.SWITCHED_PROTOCOL

    # The backend's first frame arrives in the same read as its 101.
    pb >> data(-1, _switch(backend) + b"server-frame")
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, switched)
    pb << SetTimer(timer=TUNNEL, at=3600.0)
    # What the client sent right after its request is the tunnel's first bytes upstream.
    pb << SendData(conn=-1, data=b"early-frame")
    pb << SendData(conn=1, data=b"server-frame")
    pb >> data(1, b"\x81\x05hello")
    pb << SendData(conn=-1, data=b"\x81\x05hello")
    pb >> data(-1, b"\x81\x05world")
    pb << SendData(conn=1, data=b"\x81\x05world")
    pb.done()


def test_backend_close_closes_the_client_after_flushing() -> None:
    pb = Playbook(ignore=())
    up, backend, _ = _open_h1(pb)
    pb.receive(up, _switch(backend))
    pb >> data(up, b"last-frame")
    pb << SendData(conn=1, data=b"last-frame")
    pb >> closed(up)
    # The last frame was handed over before; the close (which the driver flushes) follows.
    pb << CancelTimer(timer=TUNNEL)
    pb << Log(event="tunnel_closed", fields=subset({"reason": "backend closed"}))
    pb << Log(event="access", fields=subset({"status": 101}))
    pb << CloseConnection(conn=1)  # once the tunnel is over (Effects.defer)
    pb.done()
    # The client's own close report afterwards changes nothing.
    pb >> closed(1)
    pb << CancelTimer(timer=("send", 1))
    pb.done()


def test_client_close_closes_the_backend() -> None:
    pb = Playbook(ignore=())
    up, backend, _ = _open_h1(pb)
    pb.receive(up, _switch(backend))
    pb >> closed(1)
    pb << CancelTimer(timer=TUNNEL)
    pb << CloseConnection(conn=up)
    reason = "client closed: client closed the connection"
    pb << Log(event="tunnel_closed", fields=subset({"reason": reason}))
    pb << Log(event="access", fields=subset({"status": 101}))
    pb << CancelTimer(timer=("send", 1))
    pb << Log(event="client_closed", fields={"conn": 1, "error": None})
    pb.done()
    assert not pb.core.tunnels and not pb.core.exchanges


def test_client_eof_is_relayed_and_the_backend_reply_still_reaches_the_client() -> None:
    pb = Playbook(ignore=())
    up, backend, _ = _open_h1(pb)
    pb.receive(up, _switch(backend))
    # The client sends its Close frame and shuts its side down (SHUT_WR).
    pb >> data(1, b"client-close")
    pb << SendData(conn=up, data=b"client-close")
    pb >> InputEnded(now=pb.now, conn=1)
    # RFC 9293 §3.6: the FIN goes on to the backend after the frame; nothing is closed.
    pb << ShutdownWrite(conn=up)
    pb.done()
    # The backend's Close reply still reaches the client.
    pb >> data(up, b"backend-close")
    pb << SendData(conn=1, data=b"backend-close")
    # Then the backend ends too: both directions are over, both connections close.
    pb >> InputEnded(now=pb.now, conn=up)
    pb << CancelTimer(timer=TUNNEL)
    pb << CloseConnection(conn=up)
    pb << Log(event="tunnel_closed", fields=subset({"reason": "both sides ended"}))
    pb << Log(event="access", fields=subset({"status": 101}))
    pb << CloseConnection(conn=1)  # once the tunnel is over (Effects.defer)
    pb.done()
    assert not pb.core.tunnels and not pb.core.exchanges


def test_backend_eof_is_relayed_and_the_client_reply_still_reaches_the_backend() -> None:
    pb = Playbook(ignore=())
    up, backend, _ = _open_h1(pb)
    pb.receive(up, _switch(backend))
    pb >> data(up, b"backend-close")
    pb << SendData(conn=1, data=b"backend-close")
    pb >> InputEnded(now=pb.now, conn=up)
    pb << ShutdownWrite(conn=1)
    pb.done()
    pb >> data(1, b"client-close")
    pb << SendData(conn=up, data=b"client-close")
    pb >> InputEnded(now=pb.now, conn=1)
    pb << CancelTimer(timer=TUNNEL)
    pb << CloseConnection(conn=up)
    pb << Log(event="tunnel_closed", fields=subset({"reason": "both sides ended"}))
    pb << Log(event="access", fields=subset({"status": 101}))
    pb << CloseConnection(conn=1)  # once the tunnel is over (Effects.defer)
    pb.done()


def test_eof_on_a_connection_that_is_no_tunnel_closes_it() -> None:
    pb = Playbook()
    pb.accept(1)
    pb.receive(1, _upgrade_request())
    (open_cmd,) = pb.opens()
    up = open_cmd.conn
    pb.opened(up)
    # Before the 101 the client's EOF ends the connection as a close does: the handshake
    # is abandoned and the backend connection closed.
    pb >> InputEnded(now=pb.now, conn=1)
    pb << CloseConnection(conn=1)
    pb << CloseConnection(conn=up)
    pb << CancelTimer(timer=("head", 1))
    pb.done()
    assert not pb.core.clients and not pb.core.exchanges
    # The driver's ConnectionClosed that follows changes nothing.
    pb >> closed(1)
    pb.done()


def test_tunnel_backpressure_pauses_the_reading_side_both_ways() -> None:
    pb = Playbook(default_config(limits=Limits(stream_buffer=64 * 1024)))
    high = pb.core.limits.high_water
    up, backend, _ = _open_h1(pb)
    pb.receive(up, _switch(backend))
    pb.sent(1, len(pb.take(1)))  # the 101 went out
    # Backend to client: the client socket takes nothing, the backend is stopped.
    pb >> data(up, b"x" * (high - 1))
    pb << SendData(conn=1, data=b"x" * (high - 1))
    pb >> data(up, b"x")  # at high water exactly
    pb << SendData(conn=1, data=b"x")
    pb << PauseReading(conn=up)
    pb >> sent(1, high)
    pb << ResumeReading(conn=up)
    # Client to backend: the backend socket takes nothing, the client is stopped.
    pb.sent(up, len(pb.take(up)))  # the handshake went out
    pb >> data(1, b"y" * high)
    pb << SendData(conn=up, data=b"y" * high)
    pb << PauseReading(conn=1)
    pb >> sent(up, high)
    pb << ResumeReading(conn=1)
    pb.done()


def test_idle_tunnel_is_closed_on_both_sides_by_a_lazy_timer() -> None:
    pb = Playbook(default_config(timeouts=Timeouts(tunnel_idle=10.0)), ignore=())
    up, backend, _ = _open_h1(pb)
    pb.receive(up, _switch(backend))
    assert _tunnel_timer(pb) == TUNNEL
    pb.now = 6.0
    pb >> data(1, b"ping")
    pb << SendData(conn=up, data=b"ping")  # activity: the deadline moves, no timer command
    pb.now = 10.0
    pb >> wakeup(*TUNNEL)
    pb << SetTimer(timer=TUNNEL, at=16.0)
    pb.now = 16.0
    pb >> wakeup(*TUNNEL)
    pb << CloseConnection(conn=up)
    pb << Log(event="tunnel_closed", fields=subset({"reason": "idle timeout"}))
    pb << Log(event="access", fields=subset({"status": 101}))
    pb << CloseConnection(conn=1)  # once the tunnel is over (Effects.defer)
    pb.done()


def test_refused_upgrade_is_an_ordinary_response() -> None:
    pb = Playbook()
    backend, _ = _upgrades(pb)
    client = _HandshakeClient()
    response = (
        backend.conn.send(h11.Response(status_code=403, headers=[("Content-Length", "2")])) or b""
    )
    pb >> data(-1, response + backend.chunk(b"no") + backend.end())
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(403))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << Sends(1, client, lambda e: isinstance(e[-1], h11.EndOfMessage))
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()
    assert not pb.core.tunnels


# -- RFC 8441 ---------------------------------------------------------------------------------


def send_extended_connect(
    pb: Playbook,
    peer: H2ClientPeer,
    extra: list[tuple[bytes, bytes]] | None = None,
    *,
    wall: float | None = None,
) -> tuple[int, int]:
    """Accept an HTTP/2 client that sends an RFC 8441 extended CONNECT for /chat (after
    checking that our SETTINGS allow it), and open the backend connection it asks for:
    (the client's stream, the backend connection)."""
    pb.accept(1, wall=wall)
    pb.receive(1, peer.preface())
    events = peer.events(pb.take(1))
    (settings,) = [e for e in events if isinstance(e, h2.events.RemoteSettingsChanged)]
    code = h2.settings.SettingCodes.ENABLE_CONNECT_PROTOCOL
    assert settings.changed_settings[code].new_value == 1
    sid = peer.conn.get_next_available_stream_id()
    peer.conn.send_headers(
        sid,
        [
            (b":method", b"CONNECT"),
            (b":protocol", b"websocket"),
            (b":scheme", b"http"),
            (b":path", b"/chat"),
            (b":authority", b"proxy.example"),
            (b"sec-websocket-version", b"13"),
            *(extra or []),
        ],
    )
    pb.receive(1, peer.conn.data_to_send())
    (open_cmd,) = pb.opens()
    up = open_cmd.conn
    pb.opened(up)
    return sid, up


H2_ORIGIN = Origin(host="127.0.0.1", port=9001, alpn="h2")


def _allows_connect(events: Sequence[Any]) -> None:
    """The proxy's SETTINGS allow RFC 8441's extended CONNECT."""
    (settings,) = [e for e in events if isinstance(e, h2.events.RemoteSettingsChanged)]
    code = h2.settings.SettingCodes.ENABLE_CONNECT_PROTOCOL
    assert settings.changed_settings[code].new_value == 1


def _h2_connects(
    pb: Playbook,
    peer: H2ClientPeer,
    extra: list[tuple[bytes, bytes]] | None = None,
    *,
    origin: Origin = ORIGIN,
) -> int:
    """Client connection 1 (accepted here) is an HTTP/2 client whose SETTINGS from the proxy
    allow an RFC 8441 extended CONNECT, and which sends one for /chat: the proxy opens
    backend connection -1 to ``origin``. Returns the client's stream."""
    pb.accept(1)
    pb >> data(1, peer.preface())
    pb << SetTimer(timer=("send", 1), at=pb.now + 60.0)
    pb << Sends(1, peer, _allows_connect)
    sid = peer.conn.get_next_available_stream_id()
    peer.conn.send_headers(
        sid,
        [
            (b":method", b"CONNECT"),
            (b":protocol", b"websocket"),
            (b":scheme", b"http"),
            (b":path", b"/chat"),
            (b":authority", b"proxy.example"),
            (b"sec-websocket-version", b"13"),
            *(extra or []),
        ],
    )
    pb >> data(1, peer.conn.data_to_send())
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=pb.now + 5.0)
    pb << OpenConnection(conn=-1, origin=origin)
    return sid


def _bridged(events: Sequence[Any]) -> None:
    """The HTTP/1.1 upgrade an extended CONNECT for /chat becomes: a whole GET, no body."""
    (request, end) = events
    assert isinstance(request, h11.Request) and isinstance(end, h11.EndOfMessage)
    assert request.method == b"GET" and request.target == b"/chat"
    fields = dict(request.headers)
    assert fields[b"upgrade"] == b"websocket" and fields[b"sec-websocket-version"] == b"13"


def _handshake(pb: Playbook, backend: H1BackendPeer) -> h11.Request:
    """The HTTP/1.1 backend accepts connection -1 and reads the bridged upgrade request."""
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << (request := Sends(-1, backend, _bridged))
    pb << SetTimer(timer=("head", 1), at=pb.now + 60.0)
    head = request.events[0]
    assert isinstance(head, h11.Request)
    return head


def _extended_connect(pb: Playbook, peer: H2ClientPeer) -> tuple[int, int, H1BackendPeer, bytes]:
    """An extended CONNECT bridged to an HTTP/1.1 backend on -1: (the client's stream, the
    backend connection, the backend peer, the key the proxy chose for the backend)."""
    sid = _h2_connects(pb, peer)
    backend = H1BackendPeer()
    request = _handshake(pb, backend)
    return sid, -1, backend, dict(request.headers)[b"sec-websocket-key"]


def _on_stream(sid: int, body: bytes, *, then_end: bool = False) -> Any:
    """A ``Sends`` check: stream ``sid`` gets one DATA frame ``body`` (``then_end``: with
    END_STREAM), and nothing else happens."""

    def check(events: Sequence[Any]) -> None:
        kinds = [h2.events.DataReceived, *([h2.events.StreamEnded] if then_end else [])]
        assert [type(e) for e in events] == kinds, events
        assert events[0].stream_id == sid and events[0].data == body, events

    return check


def test_extended_connect_is_bridged_to_an_http1_upgrade() -> None:
    pb = Playbook()
    peer = H2ClientPeer()
    sid, up, backend, key = _extended_connect(pb, peer)
    pb >> data(up, _switch(backend, key) + b"server-frame")
    pb << CancelTimer(timer=("head", 1))
    pb << (answer := Sends(1, peer, h2_response(sid, 200, ended=False)))
    pb << SetTimer(timer=TUNNEL, at=3600.0)
    pb << Sends(1, peer, _on_stream(sid, b"server-frame"))
    (response,) = [e for e in answer.events if isinstance(e, h2.events.ResponseReceived)]
    fields = dict(response.headers)
    assert b"upgrade" not in fields
    # RFC 8441 needs none, but clients insist: the backend's accept, checked against our key.
    assert fields[b"sec-websocket-accept"] == accept_for(key)

    peer.conn.send_data(sid, b"client-frame")
    pb >> data(1, peer.conn.data_to_send())
    pb << SendData(conn=up, data=b"client-frame")

    # The backend closes: END_STREAM for the client, after the data.
    pb >> data(up, b"bye")
    pb << Sends(1, peer, _on_stream(sid, b"bye"))
    pb >> closed(up)
    pb << CancelTimer(timer=TUNNEL)
    pb << Sends(1, peer, h2_response_ends(sid))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()


def h2_response_ends(sid: int) -> Any:
    """Stream ``sid`` ends (an empty DATA with END_STREAM); the rest of the client's upload
    is not wanted (RFC 9113 §8.1: RST_STREAM(NO_ERROR))."""

    def check(events: Sequence[Any]) -> None:
        kinds = [type(e) for e in events]
        assert kinds == [h2.events.DataReceived, h2.events.StreamEnded, h2.events.StreamReset]
        assert all(e.stream_id == sid for e in events), events
        assert events[-1].error_code == h2.errors.ErrorCodes.NO_ERROR, events

    return check


def test_extended_connect_end_stream_half_closes_the_backend() -> None:
    pb = Playbook(ignore=())
    peer = H2ClientPeer()
    sid, up, backend, key = _extended_connect(pb, peer)
    peer.events(pb.take(1, pb.receive(up, _switch(backend, key))))
    # RFC 8441 §5: END_STREAM is the FIN. The Close frame in the same DATA goes first.
    peer.conn.send_data(sid, b"client-close", end_stream=True)
    pb >> data(1, peer.conn.data_to_send())
    pb << SendData(conn=up, data=b"client-close")
    pb << ShutdownWrite(conn=up)
    pb.done()  # nothing closed
    # The backend's Close reply reaches the client, then its FIN is our END_STREAM.
    pb >> data(up, b"backend-close")
    reply = Sends(1, peer)
    pb << reply
    assert [e.data for e in reply.events if isinstance(e, h2.events.DataReceived)] == [
        b"backend-close"
    ]
    pb >> InputEnded(now=pb.now, conn=up)
    pb << CancelTimer(timer=TUNNEL)
    ended = Sends(1, peer)
    pb << ended
    pb << CloseConnection(conn=up)
    pb << Log(event="tunnel_closed", fields=subset({"reason": "both sides ended"}))
    pb << Log(event="access", fields=subset({"status": 200}))
    pb << SetTimer(timer=("idle", 1), at=75.0)  # the h2 connection goes on
    pb.done()
    # An empty DATA frame with END_STREAM, no RST_STREAM.
    assert [type(e) for e in ended.events] == [h2.events.DataReceived, h2.events.StreamEnded]
    assert not pb.core.tunnels


def test_extended_connect_with_a_wrong_accept_is_a_502() -> None:
    pb = Playbook()
    peer = H2ClientPeer()
    _, up, backend, _ = _extended_connect(pb, peer)
    pb.ignore = ()
    pb >> data(up, _switch(backend, b"not-the-key"))
    reason = "wrong Sec-WebSocket-Accept from backend"
    pb << Log(event="websocket_handshake_failed", fields={"reason": reason})
    pb << CancelTimer(timer=("head", 1))
    pb << CloseConnection(conn=up)
    answer = Sends(1, peer)
    pb << answer
    pb << Log(event="access", fields=subset({"status": 502, "outcome": reason}))
    # Once the exchange is over (Effects.defer): RFC 9113 §8.1, the rest of the request is
    # not wanted (RST_STREAM(NO_ERROR)), and the connection goes idle.
    cancel = Sends(1, peer)
    pb << cancel
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()
    (response,) = [e for e in answer.events if isinstance(e, h2.events.ResponseReceived)]
    assert dict(response.headers)[b":status"] == b"502"
    # RFC 9113 §8.1: the response is complete; RST_STREAM(NO_ERROR) stops the upload.
    assert not [e for e in answer.events if isinstance(e, h2.events.StreamReset)]
    (reset,) = [e for e in cancel.events if isinstance(e, h2.events.StreamReset)]
    assert reset.error_code == h2.errors.ErrorCodes.NO_ERROR


def test_plain_connect_is_answered_501() -> None:
    pb = Playbook()
    peer = H2ClientPeer()
    pb.accept(1)
    pb >> data(1, peer.preface())
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, peer, lambda events: not [e for e in events if getattr(e, "stream_id", 0)])
    sid = peer.conn.get_next_available_stream_id()
    peer.conn.send_headers(sid, [(b":method", b"CONNECT"), (b":authority", b"db:5432")])
    pb >> data(1, peer.conn.data_to_send())
    pb << CancelTimer(timer=("header", 1))
    pb << Sends(1, peer, h2_response(sid, 501))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()  # no OpenConnection


def test_tunnel_idle_is_read_from_the_configuration() -> None:
    data = {
        "listeners": [{"address": "127.0.0.1:8080"}],
        "timeouts": {"tunnel_idle": 120},
        "upstreams": {"gpus": {"servers": ["127.0.0.1:9001"]}},
        "routes": [{"prefix": "/", "upstream": "gpus"}],
    }
    assert parse_config(data).timeouts.tunnel_idle == 120.0
    assert attrs.evolve(Timeouts()).tunnel_idle == 3600.0


def test_internal_error_on_the_client_side_of_a_tunnel_closes_its_backend() -> None:
    pb = Playbook()
    pb.core.raise_errors = False
    up, backend, _ = _open_h1(pb)
    pb.receive(up, _switch(backend))
    assert pb.core.tunnels
    # The one planted fault: a bug met handling the tunnel's client side.
    client_data = lambda event: isinstance(event, DataReceived) and event.conn == 1  # noqa: E731
    plant_faults(pb.core).plant(FaultPoint.BEFORE, client_data, RuntimeError("planted bug"))
    pb >> data(1, b"frame")
    pb << CancelTimer(timer=TUNNEL)
    pb << CloseConnection(conn=up)
    pb << CancelTimer(timer=("send", 1))
    pb << CloseConnection(conn=1)
    pb.done()
    assert not pb.core.tunnels


def test_extended_connect_with_a_client_key_gets_the_accept_for_that_key() -> None:
    pb = Playbook()
    peer = H2ClientPeer()
    sid = _h2_connects(pb, peer, [(b"sec-websocket-key", KEY)])
    backend = H1BackendPeer()
    ours = dict(_handshake(pb, backend).headers)[b"sec-websocket-key"]
    assert ours != KEY
    pb >> data(-1, _switch(backend, ours))
    pb << CancelTimer(timer=("head", 1))
    pb << (answer := Sends(1, peer, h2_response(sid, 200, ended=False)))
    pb << SetTimer(timer=TUNNEL, at=3600.0)
    pb.done()
    (response,) = [e for e in answer.events if isinstance(e, h2.events.ResponseReceived)]
    assert dict(response.headers)[b"sec-websocket-accept"] == accept_for(KEY)


# -- HTTP/2 backends (RFC 8441 extended CONNECT upstream) -----------------------------------------


def _h2_backend_config() -> Config:
    group = Upstream(name="default", servers=(Server(address=BACKEND, protocol="h2"),))
    return default_config(upstreams={"default": group})


def _h2_backend_ready(pb: Playbook, backend: H2BackendPeer, ex: int = 1) -> None:
    """The h2 backend accepts connection -1 (opened for exchange ``ex``, in the pool's
    start-up deadline), reads the proxy's preface and answers with its SETTINGS: the
    connection is ready, both deadlines end."""
    pb >> opened(-1)
    pb << Sends(-1, backend)  # the preface and the proxy's SETTINGS
    pb >> data(-1, backend.output())
    pb << CancelTimer(timer=("pool", -1))
    pb << CancelTimer(timer=("connect", ex))


def _upgrade_to_h2_backend(
    pb: Playbook, *, window: int = 65535
) -> tuple[H2BackendPeer, h2.events.RequestReceived]:
    """Client connection 1 (accepted here) asks to upgrade to a WebSocket; the group's
    backend speaks h2 and allows extended CONNECT: once its connection is ready the request
    goes out on it. Returns the backend peer and the request it decoded."""
    pb.accept(1)
    pb >> data(1, _upgrade_request())
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=pb.now + 5.0)
    pb << OpenConnection(conn=-1, origin=H2_ORIGIN)
    pb << SetTimer(timer=("pool", -1), at=pb.now + 5.0)
    backend = H2BackendPeer(pb, -1, connect=True, window=window)
    _h2_backend_ready(pb, backend)
    pb << (sent_up := Sends(-1, backend))
    pb << SetTimer(timer=("head", 1), at=pb.now + 60.0)
    (request,) = [e for e in sent_up.events if isinstance(e, h2.events.RequestReceived)]
    # The request's stream stays open both ways: it carries the tunnel.
    assert not any(isinstance(e, h2.events.StreamEnded) for e in sent_up.events)
    return backend, request


def _switched(client: _HandshakeClient) -> Any:
    """A ``Sends`` check for the client of ``GET /ws``: the one 101 with our accept."""

    def check(events: Sequence[Any]) -> None:
        (switched,) = events
        assert isinstance(switched, h11.InformationalResponse) and switched.status_code == 101
        headers = dict(switched.headers)
        assert headers[b"sec-websocket-accept"] == accept_for(KEY)  # RFC 6455 §4.2.2, ours
        assert headers[b"upgrade"] == b"websocket"
        assert client.conn.our_state is h11.SWITCHED_PROTOCOL

    return check


def _backend_gets(sid: int, body: bytes, *, ended: bool = False) -> Any:
    """A ``Sends`` check for an h2 backend: DATA ``body`` on stream ``sid`` (``ended``: and
    END_STREAM)."""

    def check(events: Sequence[Any]) -> None:
        got = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
        assert got == body, events
        assert all(getattr(e, "stream_id", sid) == sid for e in events), events
        assert any(isinstance(e, h2.events.StreamEnded) for e in events) is ended, events

    return check


def test_h1_upgrade_to_an_h2_backend_is_an_extended_connect_answered_with_a_101() -> None:
    pb = Playbook(_h2_backend_config(), ignore=())
    backend, request = _upgrade_to_h2_backend(pb)
    fields = dict(request.headers)
    # RFC 8441 §4/§5: CONNECT with :protocol, never a plain GET; no key, no Upgrade.
    assert fields[b":method"] == b"CONNECT" and fields[b":protocol"] == b"websocket"
    assert fields[b":path"] == b"/ws" and fields[b":scheme"] == b"http"
    assert fields[b"sec-websocket-version"] == b"13"
    assert b"sec-websocket-key" not in fields and b"upgrade" not in fields
    sid = request.stream_id
    backend.conn.send_headers(sid, [(b":status", b"200")])
    backend.conn.send_data(sid, b"server-frame")
    client = _HandshakeClient()
    pb >> data(-1, backend.output())
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, _switched(client))
    pb << SetTimer(timer=TUNNEL, at=3600.0)
    pb << Log(event="tunnel_opened", fields=subset({"conn": 1}))
    pb << SendData(conn=1, data=b"server-frame")

    # Frames both ways, as DATA on the backend stream.
    pb >> data(1, b"client-frame")
    pb << Sends(-1, backend, _backend_gets(sid, b"client-frame"))
    backend.conn.send_data(sid, b"more")
    pb >> data(-1, backend.output())
    pb << SendData(conn=1, data=b"more")

    # The client's FIN is END_STREAM upstream, nothing closes; the backend's END_STREAM
    # then ends it all.
    pb >> InputEnded(now=pb.now, conn=1)
    pb << Sends(-1, backend, _backend_gets(sid, b"", ended=True))
    pb.done()
    backend.conn.send_data(sid, b"backend-close", end_stream=True)
    pb >> data(-1, backend.output())
    pb << SendData(conn=1, data=b"backend-close")
    pb << CancelTimer(timer=TUNNEL)
    pb << SetTimer(timer=("pool", -1), at=20.0)  # the shared connection stays, idle
    pb << Log(event="tunnel_closed", fields=subset({"reason": "both sides ended"}))
    pb << Log(event="access", fields=subset({"status": 101}))
    pb << CloseConnection(conn=1)
    pb.done()
    assert not pb.core.exchanges


def test_websocket_to_an_h2_backend_without_extended_connect_is_a_502() -> None:
    pb = Playbook(_h2_backend_config())
    pb.accept(1)
    pb >> data(1, _upgrade_request())
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=H2_ORIGIN)
    pb << SetTimer(timer=("pool", -1), at=5.0)
    backend = H2BackendPeer(pb, -1, connect=False)
    _h2_backend_ready(pb, backend)
    # No request goes to it: the SETTINGS ack alone, and the connection goes to the pool.
    pb << Sends(-1, backend, lambda got: [type(e) for e in got] == [h2.events.SettingsAcknowledged])
    pb << SetTimer(timer=("pool", -1), at=20.0)
    client = _HandshakeClient()
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << (answer := Sends(1, client, h1_response(502, end=True)))
    pb << CloseConnection(conn=1)
    pb.done()
    assert b"SETTINGS_ENABLE_CONNECT_PROTOCOL" in h1_body(answer.events)


def test_h2_backend_refusal_of_the_extended_connect_is_an_ordinary_response() -> None:
    pb = Playbook(_h2_backend_config())
    backend, request = _upgrade_to_h2_backend(pb)
    sid = request.stream_id
    backend.conn.send_headers(sid, [(b":status", b"403"), (b"content-length", b"2")])
    backend.conn.send_data(sid, b"no", end_stream=True)
    client = _HandshakeClient()
    pb >> data(-1, backend.output())
    # Our side of the refused stream ends too: nothing holds the backend's stream open.
    pb << Sends(-1, backend, _backend_gets(sid, b"", ended=True))
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(403, b""))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << Sends(1, client, lambda got: h1_body(got) == b"no" and got[-1] == h11.EndOfMessage())
    pb << SetTimer(timer=("pool", -1), at=20.0)
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()
    assert not pb.core.tunnels and not pb.core.exchanges


def test_extended_connect_from_an_h2_client_to_an_h2_backend() -> None:
    pb = Playbook(_h2_backend_config())
    peer = H2ClientPeer()
    sid = _h2_connects(pb, peer, origin=H2_ORIGIN)
    pb << SetTimer(timer=("pool", -1), at=5.0)
    backend = H2BackendPeer(pb, -1, connect=True)
    _h2_backend_ready(pb, backend)
    pb << (sent_up := Sends(-1, backend))
    pb << SetTimer(timer=("head", 1), at=60.0)
    (request,) = [e for e in sent_up.events if isinstance(e, h2.events.RequestReceived)]
    fields = dict(request.headers)
    assert fields[b":method"] == b"CONNECT" and fields[b":protocol"] == b"websocket"
    assert b"sec-websocket-key" not in fields
    bsid = request.stream_id
    backend.conn.send_headers(bsid, [(b":status", b"200")])
    pb >> data(-1, backend.output())
    pb << CancelTimer(timer=("head", 1))
    pb << Sends(1, peer, h2_response(sid, 200, ended=False))
    pb << SetTimer(timer=TUNNEL, at=3600.0)
    peer.conn.send_data(sid, b"client-frame")
    pb >> data(1, peer.conn.data_to_send())
    pb << Sends(-1, backend, _backend_gets(bsid, b"client-frame"))
    backend.conn.send_data(bsid, b"server-frame")
    pb >> data(-1, backend.output())
    pb << Sends(1, peer, _on_stream(sid, b"server-frame"))
    pb.done()


def test_extended_connect_backend_eof_ends_the_stream_and_the_client_reply_still_goes_up() -> None:
    pb = Playbook(ignore=())
    peer = H2ClientPeer()
    sid, up, backend, key = _extended_connect(pb, peer)
    pb >> data(up, _switch(backend, key))
    pb << CancelTimer(timer=("head", 1))
    pb << Sends(1, peer, h2_response(sid, 200, ended=False))
    pb << SetTimer(timer=TUNNEL, at=3600.0)
    pb << Log(event="tunnel_opened", fields=subset({"conn": 1}))
    # The backend's Close frame, then its FIN: END_STREAM for the client, nothing closed.
    pb >> data(up, b"backend-close")
    pb << Sends(1, peer, _on_stream(sid, b"backend-close"))
    pb >> InputEnded(now=pb.now, conn=up)
    pb << Sends(1, peer, both(_on_stream(sid, b"", then_end=True), h2_ended(sid)))
    # The client's Close reply still reaches the backend; its END_STREAM ends it all: the
    # backend closes after the data, and no RST_STREAM reaches the client.
    peer.conn.send_data(sid, b"client-close", end_stream=True)
    pb >> data(1, peer.conn.data_to_send())
    pb << SendData(conn=up, data=b"client-close")
    pb << CancelTimer(timer=TUNNEL)
    pb << CloseConnection(conn=up)
    pb << Log(event="tunnel_closed", fields=subset({"reason": "both sides ended"}))
    pb << Log(event="access", fields=subset({"status": 200}))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()
    assert not pb.core.tunnels and not pb.core.exchanges


def test_h2_backend_stream_is_reset_when_our_end_stream_still_waits_for_window() -> None:
    pb = Playbook(_h2_backend_config(), ignore=())
    backend, request = _upgrade_to_h2_backend(pb, window=4)
    sid = request.stream_id
    backend.conn.send_headers(sid, [(b":status", b"200")])
    client = _HandshakeClient()
    pb >> data(-1, backend.output())
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, _switched(client))
    pb << SetTimer(timer=TUNNEL, at=3600.0)
    pb << Log(event="tunnel_opened", fields=subset({"conn": 1}))
    # Ten bytes, four fit the window: our END_STREAM queues behind the other six.
    pb >> data(1, b"0123456789")
    pb << Sends(-1, backend, _backend_gets(sid, b"0123"))
    pb >> InputEnded(now=pb.now, conn=1)
    pb.done()  # nothing goes out: the window is shut
    backend.conn.send_data(sid, b"bye", end_stream=True)  # no window given back
    pb >> data(-1, backend.output())
    pb << SendData(conn=1, data=b"bye")
    pb << CancelTimer(timer=TUNNEL)
    # RFC 9113 §5.1: a stream we could not end cleanly is reset, never left half-open.
    pb << Sends(-1, backend, h2_resets((sid, h2.errors.ErrorCodes.CANCEL)))
    pb << SetTimer(timer=("pool", -1), at=20.0)
    pb << Log(event="tunnel_closed", fields=subset({"reason": "both sides ended"}))
    pb << Log(event="access", fields=subset({"status": 101}))
    pb << CloseConnection(conn=1)
    pb.done()


def test_tunnel_opened_while_the_connection_bound_stalls_its_backend_resumes_it() -> None:
    """A WebSocket backend that the client connection's bound (``Output._stall_all``)
    paused before its handshake's answer arrived: the tunnel takes the stop over, so the
    backend is read again once the connection drains, like every other stalled backend."""
    bound = 64 * 1024
    config = attrs.evolve(
        quick_config("127.0.0.1:8080", [BACKEND]),
        limits=attrs.evolve(Limits(), connection_buffer=bound),
    )
    pb = Playbook(config)
    peer = H2ClientPeer()
    # Wide windows: every byte goes to the socket at once, none waits in a stream queue.
    peer.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
    peer.conn.increment_flow_control_window(2**31 - 1 - 65535)
    ws = _h2_connects(pb, peer)
    ws_backend = H1BackendPeer()
    key = dict(_handshake(pb, ws_backend).headers)[b"sec-websocket-key"]
    # A streaming exchange on the same connection, on backend connection -2.
    streaming, request = peer.request(b"GET", b"/v1/stream")
    pb >> data(1, request)
    pb << SetTimer(timer=("connect", 2), at=5.0)
    pb << OpenConnection(conn=-2, origin=ORIGIN)
    sse = H1BackendPeer()
    pb >> opened(-2)
    pb << CancelTimer(timer=("connect", 2))
    pb << Sends(-2, sse, h1_request(b"GET", b"/v1/stream"))
    pb << SetTimer(timer=("head", 2), at=60.0)
    pb >> data(-2, sse.sse_head())
    pb << CancelTimer(timer=("head", 2))
    pb << Sends(1, peer, h2_response(streaming, 200, ended=False))
    pb << SetTimer(timer=("read", 2), at=300.0)
    event = b"data: " + b"z" * 16000 + b"\n\n"
    chunk = b"%x\r\n%s\r\n" % (len(event), event)
    down = pb.core.clients[1]
    while down.pending <= bound:
        # Each chunk goes out at once; nothing else happens until one takes the
        # connection past its bound (the next ``>>`` asserts that).
        pb >> data(-2, chunk)
        pb << Sends(1, peer, _on_stream(streaming, event))
    # Every backend of the connection stops, the one still in its handshake too.
    pb << PauseReading(conn=-1)
    pb << PauseReading(conn=-2)
    # The read the paused backend had in flight: its 101 opens the tunnel.
    pb >> data(-1, _switch(ws_backend, key) + b"server-frame")
    pb << CancelTimer(timer=("head", 1))
    pb << Sends(1, peer, h2_response(ws, 200, ended=False))
    pb << SetTimer(timer=TUNNEL, at=3600.0)
    pb << Sends(1, peer, _on_stream(ws, b"server-frame"))
    assert -1 in pb.core.tunnels
    pb >> sent(1, down.pending)
    pb << ResumeReading(conn=-1)
    pb << ResumeReading(conn=-2)
    pb.done()

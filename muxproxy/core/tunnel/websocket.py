"""WebSocket handshakes: the exchange that becomes a byte tunnel (``tunnel.py``) on success.

What it obeys:

- RFC 6455 §4 (opening handshake) and RFC 9110 §7.8 (Upgrade): an HTTP/1.1 ``GET`` with
  ``Upgrade: websocket`` and ``Connection: upgrade`` goes to the backend with those fields
  kept (``headers.is_websocket_upgrade``); the backend answers the handshake, and its 101
  (RFC 9110 §15.2.2) goes to the client, after which both connections are a tunnel.
- RFC 8441 (WebSockets over HTTP/2): we advertise SETTINGS_ENABLE_CONNECT_PROTOCOL (``h2.py``);
  an extended CONNECT (``:protocol websocket``) is bridged to an HTTP/1.1 handshake with the
  backend: ``GET :path``, Host from ``:authority``, a Sec-WebSocket-Key of our own (RFC 6455
  §4.1: 16 random bytes, base64), whose Sec-WebSocket-Accept the backend must return
  (§4.2.2: base64(SHA-1(key + GUID))). On that 101 the stream gets ``:status 200`` (RFC 8441
  §5) and its DATA frames carry the WebSocket frames unchanged. The 200 carries a
  Sec-WebSocket-Accept although RFC 8441 needs none (clients such as niquests insist): the
  one for the client's own key if it sent one, else the backend's, which we checked.
- An HTTP/2 backend (``protocol = "h2"``) gets an extended CONNECT itself (RFC 8441 §4:
  ``:method CONNECT``, ``:protocol websocket``, no Sec-WebSocket-Key), from an HTTP/1.1 client
  too, and only where its SETTINGS say SETTINGS_ENABLE_CONNECT_PROTOCOL = 1 (§3); otherwise
  a 502 says why, and nothing is sent (never a plain GET). Its 2xx opens the tunnel: an
  HTTP/1.1 client gets a 101 with the Sec-WebSocket-Accept for its key, computed here; the
  stream stays open for the frames (``tunnel.StreamBackend``). A refusal is an ordinary
  response, and our side of the stream ends with it.
- A backend that does not switch: its response goes to the client as a normal response
  (retries and failover as for any request). On the HTTP/2 bridge a 2xx other than 101, or a
  wrong Sec-WebSocket-Accept, is a 502: a 2xx would tell the client the tunnel is open.
- Plain CONNECT (RFC 9113 §8.5, RFC 9112 §3.2.3) and extended CONNECT for any other protocol
  are answered 501 (RFC 9110 §15.6.2): we are a reverse proxy, not a TCP forwarder. A response
  rather than RST_STREAM, so HTTP/1.1 and HTTP/2 clients both get the reason.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import os

import attrs

from muxproxy.core.commands import Log
from muxproxy.core.effects import Effects
from muxproxy.core.exchange.exchange import Exchange
from muxproxy.core.exchange.exchange_states import ExchangeInput
from muxproxy.core.exchange.exchangeports import ExchangeHost
from muxproxy.core.exchange.heads import VIA, backend_fields
from muxproxy.core.http.headers import header_value, is_websocket_upgrade, response_headers
from muxproxy.core.messages import Headers, RequestHead, ResponseHead
from muxproxy.core.ports import ClientSide, Http1Upgrade, RequestPhase, UpstreamStream
from muxproxy.core.timers import ExchangeTimer
from muxproxy.core.tunnel.tunnel import Backend, RawBackend, StreamBackend, Tunnel
from muxproxy.core.upstream.h2pool import H2Stream
from muxproxy.core.upstream.pool import UpstreamConn

# RFC 6455 §1.3: the GUID appended to the key before hashing.
WEBSOCKET_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class Handshake(enum.Enum):
    H1_UPGRADE = "h1_upgrade"
    """HTTP/1.1 Upgrade: forwarded as it is."""
    H2_EXTENDED_CONNECT = "h2_extended_connect"
    """RFC 8441: bridged to an HTTP/1.1 Upgrade with our own key."""
    UNSUPPORTED = "unsupported"
    """Plain CONNECT or another ``:protocol``: 501."""


def wants_tunnel(head: RequestHead) -> bool:
    """Whether ``head`` is handled by a :class:`WebSocketExchange` (CONNECT or a handshake)."""
    return head.method == b"CONNECT" or is_websocket_upgrade(head)


def new_key() -> bytes:
    """A Sec-WebSocket-Key: 16 random bytes, base64 (RFC 6455 §4.1, client requirement 7)."""
    return base64.b64encode(os.urandom(16))


def accept_for(key: bytes) -> bytes:
    """The Sec-WebSocket-Accept that answers ``key`` (RFC 6455 §4.2.2, step 5.4)."""
    return base64.b64encode(hashlib.sha1(key + WEBSOCKET_GUID).digest())


def bridged_head(head: RequestHead, key: bytes) -> RequestHead:
    """The HTTP/1.1 handshake for an RFC 8441 extended CONNECT (RFC 8441 §5, RFC 6455 §4.1)."""
    headers: Headers = [field for field in head.headers if field[0] != b"sec-websocket-key"]
    headers += [
        (b"connection", b"upgrade"),
        (b"upgrade", b"websocket"),
        (b"sec-websocket-key", key),
    ]
    return attrs.evolve(head, method=b"GET", headers=headers, end_stream=True, protocol=None)


class WebSocketExchange(Exchange):
    """An exchange for CONNECT or a WebSocket handshake; a :class:`Tunnel` once switched.

    Until the backend's 101 it is an ordinary exchange (routing, retries, timeouts, error
    responses); then the tunnel owns both sides and this exchange only forwards the client
    side's messages to it and logs the end.
    """

    def __init__(
        self,
        fx: Effects,
        host: ExchangeHost,
        client: ClientSide,
        head: RequestHead,
        ident: int,
        *,
        tunnels: dict[int, Tunnel],
    ) -> None:
        """``tunnels``: the core's table of tunnelled connections (``Tunnel``)."""
        super().__init__(fx, host, client, head, ident)
        self.side = client
        """The client connection as the tunnel's client side will see it (``TunnelClient``)."""
        self.upgrade: Http1Upgrade | None = None
        """An HTTP/1.1 client's protocol switch, for an Upgrade handshake."""
        self.tunnels = tunnels
        self.tunnel: Tunnel | None = None
        self.key: bytes | None = None
        self.early: list[bytes] = []
        """HTTP/2 DATA that came before the tunnel opened, held (unacknowledged) until then."""
        self.early_size = 0
        self.client_key = header_value(head.headers, b"sec-websocket-key")
        """The client's own Sec-WebSocket-Key (RFC 6455 §4.1; an RFC 8441 client may send one
        too), answered with its Sec-WebSocket-Accept where the backend's does not fit."""
        if head.method != b"CONNECT":
            # RFC 9113 §8.2.2: an HTTP/2 request carries no Connection or Upgrade (``intake``
            # refuses them), so an Upgrade handshake comes over HTTP/1.1.
            upgrade = client.http1_upgrade()
            assert upgrade is not None, "an Upgrade handshake over HTTP/2"
            self.upgrade = upgrade
            self.handshake = Handshake.H1_UPGRADE
        elif head.protocol == b"websocket" and client.is_h2 and head.target:
            self.handshake = Handshake.H2_EXTENDED_CONNECT
            self.key = new_key()
            self.head = bridged_head(head, self.key)
        else:
            self.handshake = Handshake.UNSUPPORTED

    def start(self) -> None:
        if self.handshake is Handshake.UNSUPPORTED:
            self.fail(501, "CONNECT is not supported (only extended CONNECT for websocket)")
            return
        super().start()

    def _send_request(self, upstream: UpstreamStream) -> None:
        if isinstance(upstream, H2Stream):
            self._extended_connect(upstream)
            return
        super()._send_request(upstream)
        if self.upstream is upstream and self.handshake is Handshake.H2_EXTENDED_CONNECT:
            # The bridged GET has no body; the stream's DATA are the tunnel's, after the 101.
            upstream.send_end([])

    def _extended_connect(self, stream: H2Stream) -> None:
        """An HTTP/2 backend: RFC 8441 extended CONNECT, never a plain GET, and only where the
        backend's SETTINGS allow it (§3: SETTINGS_ENABLE_CONNECT_PROTOCOL = 1)."""
        fx = self.fx
        group = self.group
        assert group is not None
        if not stream.upstream.client.extended_connect:
            stream.exchange = None
            stream.close()  # no HEADERS went out: this only frees the slot
            reason = (
                "the HTTP/2 backend does not accept WebSockets "
                "(no SETTINGS_ENABLE_CONNECT_PROTOCOL, RFC 8441 §3)"
            )
            self.fx.emit(Log(event="websocket_handshake_failed", fields={"reason": reason}))
            self.fail(502, f"bad gateway: {reason}", reason)
            return
        self.upstream = stream
        head = self.head
        key = self.session_key
        headers = backend_fields(head, self.client, group, session_key=key, has_body=False)
        # RFC 8441 §5: no Sec-WebSocket-Key over HTTP/2 (nor Upgrade / Connection, which
        # the HTTP/2 field block drops anyway); the stream stays open for the frames.
        headers = [field for field in headers if field[0].lower() != b"sec-websocket-key"]
        stream.send_head(self.stream, b"CONNECT", head.target, headers, protocol=b"websocket")
        self.move(ExchangeInput.REQUEST_SENT)
        timeout = group.timeouts.response_head or fx.config.timeouts.response_head
        fx.set_timer((ExchangeTimer.HEAD, self.ident), fx.now + timeout)

    # -- client side -----------------------------------------------------------------------

    def request_body(self, data: bytes, flow_len: int) -> None:
        if self.tunnel is not None:
            self.tunnel.from_client(data, flow_len)
        elif self.handshake is not Handshake.H2_EXTENDED_CONNECT:
            super().request_body(data, flow_len)
        elif not self.move(ExchangeInput.REQUEST_BODY):
            self.upload.give_back(flow_len)  # not taken
        else:
            # RFC 8441 §5: DATA before the 200 belongs to the tunnel that is not open yet;
            # held, and bounded like any request body (acknowledged only below low water).
            self.early.append(data)
            self.early_size += len(data)
            self.upload.flow.hold(flow_len)
            self._check_request_flow()

    def request_end(self, trailers: Headers) -> None:
        if self.handshake is not Handshake.H2_EXTENDED_CONNECT:
            super().request_end(trailers)
            return
        if self.request is RequestPhase.COMPLETE:
            return
        # END_STREAM: the client's FIN (RFC 8441 §5); before the 200 it ends the tunnel as
        # soon as it opens.
        self.upload.phase = RequestPhase.COMPLETE
        if self.tunnel is not None:
            self.tunnel.client_end()

    def request_buffered(self) -> int:
        if self.tunnel is not None:
            return self.tunnel.backend.pending
        return self.early_size + super().request_buffered()

    def client_aborted(self, reason: str) -> None:
        if self.tunnel is not None:
            self.tunnel.client_gone(reason)
        else:
            super().client_aborted(reason)

    def client_drained(self) -> None:
        if self.tunnel is not None:
            self.tunnel.client_drained()
        else:
            super().client_drained()

    # An HTTP/2 backend stream's events reach the tunnel through the exchange.

    def upstream_drained(self) -> None:
        if self.tunnel is not None:
            self.tunnel.backend_drained()
        else:
            super().upstream_drained()

    def response_body(self, data: bytes) -> None:
        if self.tunnel is not None:
            self.tunnel.from_backend(data)
        else:
            super().response_body(data)

    def response_end(self, trailers: Headers) -> None:
        if self.tunnel is not None:
            self.tunnel.backend_end()  # END_STREAM: the backend's FIN (RFC 8441 §5)
        else:
            super().response_end(trailers)

    def upstream_failed(self, reason: str, *, timeout: bool = False, stale: bool = False) -> None:
        if self.tunnel is not None:
            self.tunnel.backend_closed(reason)
        else:
            super().upstream_failed(reason, timeout=timeout, stale=stale)

    def watch_request_body(self) -> None:
        """No request-body idle deadline: a tunnel's client may rightly stay silent (its
        ``tunnel_idle`` timer bounds that)."""

    def timer_fired(self, kind: ExchangeTimer) -> None:
        if kind is ExchangeTimer.TUNNEL and self.tunnel is not None:
            self.tunnel.timer_fired()
        else:
            super().timer_fired(kind)

    # -- backend side ----------------------------------------------------------------------

    def _relay_head(self, head: ResponseHead) -> None:
        upstream = self.upstream
        if isinstance(upstream, H2Stream):
            if 200 <= head.status < 300:
                # RFC 8441 §5: a 2xx to the extended CONNECT opens the tunnel.
                self.upstream = None  # the tunnel's now; its events still come here
                self._open_tunnel(StreamBackend(upstream), head)
            else:
                # A refusal is an ordinary response; our side of the stream is done.
                upstream.send_end([])
                super()._relay_head(head)
            return
        bridged = self.handshake is Handshake.H2_EXTENDED_CONNECT
        if head.status != 101:
            if bridged and 200 <= head.status < 300:
                self._bad_handshake(f"backend answered {head.status} to a WebSocket handshake")
                return
            super()._relay_head(head)
            return
        if not isinstance(upstream, UpstreamConn):  # pragma: no cover - h11 only gives 101s
            self._bad_handshake("101 from a backend that cannot switch")
            return
        if bridged:
            assert self.key is not None
            accept = header_value(head.headers, b"sec-websocket-accept")
            if accept is None or accept.strip() != accept_for(self.key):
                self._bad_handshake("wrong Sec-WebSocket-Accept from backend")
                return
        # The backend connection leaves the pool for good: its bytes are the tunnel's now.
        self.upstream = None
        pending = upstream.pending
        leftover = upstream.become_tunnel()
        backend = RawBackend(self.fx, upstream.conn, pending, half_close=not upstream.origin.tls)
        self._open_tunnel(backend, head, leftover)

    def _bad_handshake(self, reason: str) -> None:
        self.fx.emit(Log(event="websocket_handshake_failed", fields={"reason": reason}))
        self.deadlines.end_attempt()
        self.release_upstream(close=True)
        self.fail(502, "bad WebSocket handshake from upstream", reason)

    def _open_tunnel(self, backend: Backend, head: ResponseHead, leftover: bytes = b"") -> None:
        """The backend switched (its 101, or a 2xx to an extended CONNECT): switch the client
        too and relay. ``leftover``: backend bytes read past its 101."""
        fx = self.fx
        client = self.client
        self.deadlines.end_attempt()
        if self.failover is not None:
            self.failover.succeeded()
        h2_backend = isinstance(backend, StreamBackend)
        headers = response_headers(
            101,
            head.headers,
            via=VIA,
            upstream_version=b"2" if h2_backend else b"1.1",
            to_h2=client.is_h2,
        )
        if h2_backend or self.handshake is Handshake.H2_EXTENDED_CONNECT:
            # The backend never saw the client's key: answer it ourselves (RFC 6455 §4.2.2).
            # RFC 8441 §5 needs no accept on HTTP/2, yet clients (niquests) insist on one.
            headers = self._accept_for_client(headers)
        self.move(ExchangeInput.COMMIT)
        self.first_byte_at = fx.now
        early: list[bytes]
        if self.handshake is Handshake.H2_EXTENDED_CONNECT:
            # RFC 8441 §5: a 2xx opens the tunnel; RFC 9110 §6.6.1: a 2xx carries a Date
            # (the headers above are those of a 101, which need none).
            self.status = 200
            date = fx.http_date()
            if date is not None and header_value(headers, b"date") is None:
                headers.append((b"date", date))
            client.send_head(ResponseHead(stream=self.stream, status=200, headers=headers))
            early, self.early, self.early_size = self.early, [], 0
        else:
            upgrade = self.upgrade
            assert upgrade is not None  # H1_UPGRADE
            # RFC 9110 §7.8: the 101 names the protocol switched to, with Connection: upgrade.
            headers += [(b"connection", b"upgrade"), (b"upgrade", b"websocket")]
            self.status = 101
            # Bytes the client sent after its request (h11 read them, PAUSED): tunnel bytes.
            early = [upgrade.switch_protocols(headers)]
        tunnel = self.tunnel = Tunnel(
            fx,
            self.tunnels,
            self,
            self.side,
            raw=self.upgrade,
            backend=backend,
            timer=(ExchangeTimer.TUNNEL, self.ident),
            ended=self._tunnel_ended,
        )
        # The credit of the DATA held so far is the tunnel's to give back.
        tunnel.client_flow.hold(self.upload.flow.take())
        if self.response_flow.stopped:
            # The client connection's bound paused the backend before its answer came
            # (``Output._stall_all``): the tunnel takes the stop over, so its own flow
            # reads the backend again once the connection drains (``Tunnel.client_drained``).
            tunnel.backend_flow.stop()
        upstream = self.failover.origin if self.failover is not None else None
        fields = {"conn": client.conn, "stream": self.stream, "upstream": str(upstream)}
        fx.emit(Log(event="tunnel_opened", fields=fields))
        for chunk in early:
            if chunk:
                tunnel.from_client(chunk, 0)
        if leftover:
            tunnel.from_backend(leftover)
        if self.request is RequestPhase.COMPLETE and client.is_h2:
            tunnel.client_end()

    def _accept_for_client(self, headers: Headers) -> Headers:
        """The Sec-WebSocket-Accept for the client's own key, if it sent one; otherwise
        the backend's (on the HTTP/1.1 bridge: the value checked against our key)."""
        key = self.client_key
        if key is None:
            return headers
        fields = [field for field in headers if field[0].lower() != b"sec-websocket-accept"]
        fields.append((b"sec-websocket-accept", accept_for(key.strip())))
        return fields

    def _tunnel_ended(self, outcome: str) -> None:
        tunnel = self.tunnel
        assert tunnel is not None
        self.bytes_out = tunnel.bytes_down
        self._finish(f"tunnel closed: {outcome}")

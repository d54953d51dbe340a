"""One client connection: protocol detection, the adapter, and the exchanges it carries.

Obeys RFC 9113 §3.3 and §3.4 for choosing the protocol: over TLS the ALPN result decides; on a
plain listener a connection that starts with the HTTP/2 connection preface speaks h2c (prior
knowledge), anything else HTTP/1.1. A connection that starts like the preface
(``PRI * HTTP/2.0``, which no HTTP/1.1 request can be) but is not it is HTTP/2 with an invalid
preface: GOAWAY(PROTOCOL_ERROR) (§3.4), not an HTTP/1.1 400. The decision is made here, in the
core, from the first bytes, so it is tested without sockets.

It is the sink of its exchanges' responses and the source of their requests. It counts the
bytes handed to the driver and not yet written (``pending``): together with an HTTP/2
stream's send queue that is what the exchange measures for backpressure (its ``Flow``s,
``flow.py``). Above ``limits.connection_buffer`` it stops every backend feeding it, and none
resumes while its output is above half of that (``congested``). It owns the
connection-level timers: send (no write progress), keep-alive idle, client header, and the
HTTP/2 stream-window timer:

- A request head is due within ``client_header`` from the connection's start, and on an idle
  kept-alive HTTP/1.1 connection from its first byte on (``Waiting.HEAD``): the client is
  sending a request, so ``keepalive_idle`` no longer bounds it. Late: 408 (RFC 9110 §15.5.9).
- A request body that stops coming for ``client_header`` is the client's fault: 408 and close
  on HTTP/1.1, RST_STREAM(CANCEL) on HTTP/2 (``refuse_slow_body``).
- An HTTP/2 stream whose response waits for a window (RFC 9113 §6.9) the client does not open
  for ``timeouts.send`` is reset with CANCEL, its backend request aborted, the other streams
  untouched (``window`` timer, lazy: armed when a stream starts to wait, moved only when it
  fires).

A graceful stop (``shutdown.py`` decides it) sets ``going_away``: on HTTP/1.1 the response
whose head has not gone out yet says ``Connection: close`` and the connection closes when the
exchange ends (RFC 9112 §9.6); HTTP/2's two GOAWAYs are ``shutdown.py``'s (RFC 9113 §6.8).
"""

from __future__ import annotations

import enum
from typing import assert_never

import attrs
import h2.errors
import h2.exceptions

from ..config import Api
from .commands import Log, PauseReading, ResumeReading
from .effects import Effects
from .errors import error_response
from .h1 import H1Server, PeerError
from .h2 import PREFACE, H2Server
from .intake import MalformedRequest, check_request_limits
from .messages import Abort, Body, End, Headers, Message, Refused, RequestHead, ResponseHead
from .paths import normalise_target
from .ports import ClientHost, ClientStream, Phase, RequestPhase
from .timers import ClientTimer


class Waiting(enum.Enum):
    """What bounds the connection while it carries no request."""

    HEAD = "head"
    """A request head is due: the ``header`` timer (``client_header``) runs."""
    IDLE = "idle"
    """Between requests, nothing of the next one received: the ``idle`` timer runs."""
    BUSY = "busy"
    """Requests in progress: their exchanges' timers bound the connection."""


# RFC 9113 §3.4: the preface's first line; no HTTP/1.1 request line reads so (RFC 9112 §2.3).
_PREFACE_LINE = PREFACE[:14]


class Protocol(enum.Enum):
    SNIFFING = "sniffing"
    """Plain listener, first bytes not seen yet: HTTP/1.1 or the HTTP/2 preface?"""
    HTTP1 = "http/1.1"
    HTTP2 = "h2"
    CLOSED = "closed"


class Downstream:
    def __init__(
        self,
        fx: Effects,
        host: ClientHost,
        conn: int,
        *,
        peer_ip: str,
        tls: bool,
        alpn: str | None,
    ) -> None:
        self.fx = fx
        self.host = host
        self.conn = conn
        self.peer_ip = peer_ip
        self.scheme = b"https" if tls else b"http"
        self.exchanges: dict[int, ClientStream] = {}
        self.stalled: set[ClientStream] = set()
        """Exchanges whose backend reading is paused because this side is behind: those whose
        ``response_flow`` (or tunnel's ``backend_flow``) is stopped (``flow.py``)."""
        self.pending = 0
        self.last_progress = fx.now
        self.send_timer_armed = False
        self.reading_paused = False
        self.abuse_logged = False
        self.h1: H1Server | None = None
        self.h2: H2Server | None = None
        self.sniffed = b""
        self.protocol = Protocol.SNIFFING
        self.going_away = False
        """A graceful stop began: no request after those running (``shutdown.py``)."""
        if tls:
            self._choose(Protocol.HTTP2 if alpn == "h2" else Protocol.HTTP1)
        timeouts = fx.config.timeouts
        fx.set_timer((ClientTimer.HEADER, conn), fx.now + timeouts.client_header)
        self.waiting = Waiting.HEAD
        self.window_waits: dict[int, float] = {}
        """HTTP/2 streams whose response waits for a window, and since when it has not moved
        (``_window_timeout``)."""

    @property
    def is_h2(self) -> bool:
        return self.protocol is Protocol.HTTP2

    @property
    def fresh(self) -> bool:
        """Not a byte of a request has arrived yet: a connection accepted an instant ago
        (plain, not yet sniffed; or HTTP/1.1 by ALPN, before its first request)."""
        if self.protocol is Protocol.SNIFFING:
            return not self.sniffed
        return self.h1 is not None and self.h1.stream == 0 and self.h1.idle

    def _choose(self, protocol: Protocol) -> None:
        self.protocol = protocol
        limits = self.fx.config.limits
        if protocol is Protocol.HTTP2:
            self.h2 = self._new_h2()
            self._flush_h2()
            if self.going_away:
                # The preface came after the stop began (a fresh connection was left its
                # first request): the two GOAWAYs now, as for every HTTP/2 client.
                self.host.stop_client(self)
        else:
            self.h1 = H1Server(scheme=self.scheme, max_head=limits.max_request_head)

    def _new_h2(self, upgrade_settings: bytes | None = None) -> H2Server:
        # A stream's receive window is what a client may send beyond what we hold; the
        # request side stays within stream_buffer only if it fits in one read's slack.
        return H2Server(
            scheme=self.scheme,
            max_concurrent_streams=self.fx.config.limits.max_concurrent_streams,
            initial_window=min(65535, self.fx.read_size),
            max_header_list_size=self.fx.config.limits.max_request_head,
            connection_window=self.fx.config.limits.h2_connection_window,
            upgrade_settings=upgrade_settings,
            reset_budget=self.fx.config.limits.h2_reset_budget,
            control_budget=self.fx.config.limits.h2_control_frame_budget,
        )

    def _maybe_switch_to_h2c(self) -> None:
        """RFC 7540 §3.2: the HTTP/1.1 adapter accepted an h2c offer (h2c.py). Answer 101 and
        go on as HTTP/2 with that request as stream 1; the rest of what the client sent is
        the start of its HTTP/2 preface."""
        h1 = self.h1
        if h1 is None or h1.h2c is None or self.protocol is not Protocol.HTTP1:
            return
        if self.going_away:
            # Stopping: the request is served over HTTP/1.1, with ``Connection: close``.
            self._dispatch(h1.decline_h2c())
            return
        head = h1.h2c.head
        try:
            h2s = self._new_h2(upgrade_settings=h1.h2c.settings)
        except h2.exceptions.ProtocolError:
            # Settings h2 refuses (RFC 9113 §6.5.2 value ranges): HTTP/1.1 it is, then.
            self._dispatch(h1.decline_h2c())
            return
        switched, rest = h1.switch_to_h2c()
        self._send(switched)
        self.h1 = None
        self.h2 = h2s
        self.protocol = Protocol.HTTP2
        self._flush_h2()
        self._dispatch([attrs.evolve(head, stream=1), End(stream=1)])
        if rest:
            self.on_data(rest)

    # -- bytes in --------------------------------------------------------------------------

    def on_data(self, data: bytes) -> None:
        if self.protocol is Protocol.HTTP2:
            assert self.h2 is not None
            self._dispatch(self.h2.receive(data))
            self._after_h2_receive()
        elif self.protocol is Protocol.HTTP1:
            self._receive_h1(data)
        elif self.protocol is Protocol.SNIFFING:
            self._sniff(data)

    def _sniff(self, data: bytes) -> None:
        # RFC 9113 §3.4: the client preface starts with a fixed 24-byte string that cannot be
        # the start of an HTTP/1.1 request line of any real method.
        buf = self.sniffed + data
        if len(buf) < len(PREFACE) and PREFACE.startswith(buf):
            self.sniffed = buf
            return
        self.sniffed = b""
        # h2 checks the rest of the preface and answers an invalid one with a GOAWAY.
        self._choose(Protocol.HTTP2 if buf.startswith(_PREFACE_LINE) else Protocol.HTTP1)
        self.on_data(buf)

    def _receive_h1(self, data: bytes) -> None:
        assert self.h1 is not None
        try:
            messages = self.h1.receive(data)
        except PeerError as exc:
            self._h1_protocol_error(exc)
            return
        if self.h1.interim:
            self._send(self.h1.interim)
            self.h1.interim = b""
        self._dispatch(messages)
        if self.waiting is Waiting.IDLE and self.h1 is not None and not self.h1.idle:
            self._await_head()
        self._maybe_switch_to_h2c()

    def _h1_protocol_error(self, exc: PeerError, api: Api | None = None) -> None:
        assert self.h1 is not None
        if exc.smuggling:
            self.host.defences.record(
                "smuggling_refused", self.peer_ip, conn=self.conn, error=exc.reason
            )
        else:
            self.fx.emit(
                Log(event="client_protocol_error", fields={"conn": self.conn, "error": exc.reason})
            )
        exchange = self.exchanges.get(self.h1.stream)
        if exchange is not None:
            exchange.client_aborted(f"malformed request body: {exc.reason}")
        self._h1_error(exc.status, exc.reason, api)
        self.close()

    def _h1_error(
        self, status: int, text: str, api: Api | None = None, request_id: bytes | None = None
    ) -> int:
        """The proxy's own response on HTTP/1.1; returns the body bytes it carried."""
        assert self.h1 is not None
        headers, body = error_response(status, text, api=api, date=self.fx.http_date())
        if request_id is not None:
            headers.append((b"x-request-id", request_id))
        out = self.h1.send_whole(status, headers, body)
        self._send(out)
        return len(body) if out and not self.h1.head_only else 0

    def _after_h2_receive(self) -> None:
        h2c = self.h2
        assert h2c is not None
        self._flush_blocked()
        if h2c.guard.exhausted is not None and not self.abuse_logged:
            self.abuse_logged = True
            self.host.defences.record(
                "client_h2_abuse", self.peer_ip, conn=self.conn, reason=h2c.guard.exhausted
            )
        self._flush_h2()
        if h2c.closed and not self.exchanges:
            self.close()

    def _flush_blocked(self) -> None:
        """Send HTTP/2 data a WINDOW_UPDATE / SETTINGS made room for, unless the connection is
        congested (then it waits for ``on_sent``)."""
        h2c = self.h2
        if h2c is None or not h2c.window_changed or (h2c.blocked and self.congested):
            return
        waits = self.window_waits
        for stream in h2c.flush_blocked():
            if stream in waits:
                waits[stream] = self.fx.now  # the window moved: its wait starts again
            exchange = self.exchanges.get(stream)
            if exchange is not None and exchange in self.stalled:
                exchange.client_drained()
        h2c.window_changed = False

    def _dispatch(self, messages: list[Message]) -> None:
        exchanges = self.exchanges
        for message in messages:
            if type(message) is Body:
                exchange = exchanges.get(message.stream)
                if exchange is not None:
                    limit = self.fx.config.limits.max_request_body
                    if exchange.request_size + len(message.data) > limit:
                        self._body_too_large(exchange, message.flow_len)
                        continue
                    exchange.request_body(message.data, message.flow_len)
                elif self.h2 is not None:
                    self.h2.acknowledge(message.stream, message.flow_len)
            elif type(message) is RequestHead:
                self._start_exchange(message)
            elif type(message) is End:
                exchange = exchanges.get(message.stream)
                if exchange is not None:
                    exchange.request_end(message.trailers)
            elif type(message) is Abort:
                exchange = exchanges.get(message.stream)
                if exchange is not None:
                    exchange.client_aborted(message.reason)
            elif type(message) is Refused:
                # The head was not decoded, so no route: a plain-text 431.
                self._refuse_stream(message.stream, message.status, message.reason, None)
                if not message.end_stream:
                    assert self.h2 is not None
                    # RFC 9113 §8.1: the response is complete; the body is not wanted.
                    self.h2.cancel_request(message.stream)
                    self._flush_h2()

    def _start_exchange(self, head: RequestHead) -> None:
        fx = self.fx
        limits = fx.config.limits
        try:
            check_request_limits(
                head, max_fields=limits.max_header_fields, max_body=limits.max_request_body
            )
        except MalformedRequest as exc:
            self._refuse(head, exc)
            return
        if not self.exchanges:
            fx.cancel_timer((ClientTimer.HEADER, self.conn))
            fx.cancel_timer((ClientTimer.IDLE, self.conn))
            self.waiting = Waiting.BUSY
        exchange = self.host.new_exchange(self, head)
        self.exchanges[head.stream] = exchange
        exchange.start()
        if exchange.request is RequestPhase.BODY and exchange.phase is not Phase.DONE:
            exchange.watch_request_body()

    def refuse_slow_body(self, stream: int, *, api: Api | None, request_id: bytes) -> int | None:
        """Slow request body: none of it for ``timeouts.client_header`` seconds while no
        response began. The client's fault, not the backend's: 408 and close on HTTP/1.1
        (RFC 9110 §15.5.9; the close after the current event, which flushes the 408 first,
        RFC 9112 §9.6), RST_STREAM(CANCEL) on HTTP/2. Returns the 408's body bytes (None on
        HTTP/2, which sends no response); the exchange aborts its backend request."""
        self.host.defences.record(
            "request_body_timeout", self.peer_ip, conn=self.conn, stream=stream
        )
        if self.h1 is not None:
            sent = self._h1_error(408, "request body timeout", api, request_id)
            self.request_close()
            return sent
        assert self.h2 is not None
        self.h2.abort(stream, h2.errors.ErrorCodes.CANCEL)
        self._flush_h2()
        return None

    def _refuse(self, head: RequestHead, exc: MalformedRequest) -> None:
        """A request past a limit (431, 413): answered here, never forwarded."""
        api = self._api_of(head)
        if self.h1 is not None:
            self._h1_protocol_error(PeerError(exc.reason, exc.status), api)
            return
        assert self.h2 is not None
        self._refuse_stream(head.stream, exc.status, exc.reason, api)
        if not head.end_stream:
            # RFC 9113 §8.1: the response is complete; the body it would send is not wanted.
            self.h2.cancel_request(head.stream)
            self._flush_h2()

    def _api_of(self, head: RequestHead) -> Api | None:
        """The ``api`` of the route ``head`` would take, for a refusal before its exchange."""
        try:
            target = normalise_target(head.target)
        except MalformedRequest:
            return None
        route = self.fx.config.route_for(target)
        return None if route is None else route.api

    def _refuse_stream(self, stream: int, status: int, reason: str, api: Api | None) -> None:
        self.fx.emit(Log(event="request_refused", fields={"conn": self.conn, "error": reason}))
        self.send_error(stream, status, reason, api=api)

    def _body_too_large(self, exchange: ClientStream, flow_len: int) -> None:
        """The request body grew past ``limits.max_request_body``: 413 while no response
        began, otherwise the stream is reset (HTTP/2) or the connection closed (HTTP/1.1)."""
        reason = f"request body above {self.fx.config.limits.max_request_body} bytes"
        self.fx.emit(Log(event="request_refused", fields={"conn": self.conn, "error": reason}))
        api = exchange.route.api if exchange.route is not None else None
        if self.h1 is not None:
            # The 413 first (h11 sends nothing once a response began): the abort below
            # closes the connection, which flushes it (RFC 9112 §9.6).
            self._h1_error(413, reason, api)
            exchange.client_aborted(reason)
            self.close()
            return
        assert self.h2 is not None
        self.h2.acknowledge(exchange.stream, flow_len)
        answered = exchange.phase in (Phase.STREAMING, Phase.DONE)
        stream = exchange.stream
        exchange.client_aborted(reason)
        if answered:
            self.h2.abort(stream, h2.errors.ErrorCodes.CANCEL)
            self._flush_h2()
        else:
            self.send_error(stream, 413, reason, api=api)
            self.h2.cancel_request(stream)
            self._flush_h2()

    # -- the sink side, for exchanges ------------------------------------------------------

    def _send(self, data: bytes) -> None:
        if not data or self.protocol is Protocol.CLOSED:
            return
        fx = self.fx
        if not self.pending:
            self.last_progress = fx.now
            if not self.send_timer_armed:
                self.send_timer_armed = True
                fx.set_timer((ClientTimer.SEND, self.conn), fx.now + fx.config.timeouts.send)
        self.pending += len(data)
        fx.send(self.conn, data)
        if self.pending > fx.config.limits.connection_buffer:
            self._stall_all()

    def _stall_all(self) -> None:
        """``limits.connection_buffer`` is exceeded: pause every backend feeding this
        connection (tunnels, which hold no ``upstream``, keep their own per-stream bound).

        Bound: once ``pending`` exceeds ``connection_buffer`` every backend is paused, and a
        paused backend delivers at most the one read it had in flight; the write that crossed
        the bound is one read's output too. So ``pending <= connection_buffer + (streams + 1)
        * out(read_size)`` where ``out(n)`` is n body bytes plus their HTTP/2 frame headers,
        plus control frames (bounded by the h2 guard's budgets). WINDOW_UPDATEs do not release
        queued stream data meanwhile (``_after_h2_receive`` defers ``flush_blocked``)."""
        for exchange in self.exchanges.values():
            # Each resumes by its own flow (``Exchange.client_drained``), not while congested.
            if exchange.client_stalled():
                self.stalled.add(exchange)

    @property
    def congested(self) -> bool:
        """Output above half of ``limits.connection_buffer`` while some backend is stalled:
        stalled backends stay paused and queued HTTP/2 data stays queued."""
        return bool(self.stalled) and self.pending > self.fx.config.limits.connection_buffer // 2

    def _flush_h2(self) -> None:
        assert self.h2 is not None
        self._send(self.h2.data_to_send())

    def flush(self) -> None:
        """Hand what the HTTP/2 connection queued (frames of its own: GOAWAY, PING, resets)
        to the driver."""
        if self.h2 is not None:
            self._flush_h2()

    def send_head(self, head: ResponseHead, *, end_stream: bool = False) -> None:
        """Send the response head; ``end_stream``: the response is complete without a body
        (a gRPC Trailers-Only response: one HEADERS frame with END_STREAM on HTTP/2)."""
        if self.h2 is not None:
            self.h2.send_head(head, end_stream=end_stream)
            self._flush_h2()
        elif self.h1 is not None:
            if self.going_away:
                # RFC 9112 §9.6: a server that is stopping says so on the response it still
                # sends, and closes after it.
                head = attrs.evolve(head, headers=[*head.headers, (b"connection", b"close")])
            self._send(self.h1.send_head(head))
            if end_stream:
                self._send(self.h1.send_end([]))

    def send_body(self, stream: int, data: bytes) -> None:
        if self.h2 is not None:
            if self.h2.send_body(stream, data):
                self._window_wait(stream)
            self._flush_h2()
        elif self.h1 is not None:
            self._send(self.h1.send_body(data))

    def send_end(self, stream: int, trailers: Headers) -> None:
        if self.h2 is not None:
            self.h2.send_end(stream, trailers)
            self._flush_h2()
        elif self.h1 is not None:
            self._send(self.h1.send_end(trailers))

    def keep_receiving(self, stream: int) -> None:
        """HTTP/2: the request side of ``stream`` still reaches its exchange after the
        response ends (``H2Server.keep_receiving``)."""
        if self.h2 is not None:
            self.h2.keep_receiving(stream)

    def send_error(
        self,
        stream: int,
        status: int,
        text: str,
        *,
        api: Api | None = None,
        head_only: bool = False,
        request_id: bytes | None = None,
    ) -> int:
        """The proxy's own short response (``errors.error_response``; ``api``: the route's);
        ``head_only``: the request was a HEAD (RFC 9110 §9.3.2: no body); ``request_id``:
        the exchange's X-Request-ID, sent with it. Returns the body bytes sent, for the
        access log."""
        if self.h2 is not None:
            headers, body = error_response(status, text, api=api, date=self.fx.http_date())
            if request_id is not None:
                headers.append((b"x-request-id", request_id))
            self.h2.send_head(ResponseHead(stream=stream, status=status, headers=headers))
            if not head_only:
                self.h2.send_body(stream, body)
            self.h2.send_end(stream, [])
            self._flush_h2()
            return 0 if head_only else len(body)
        if self.h1 is not None:
            return self._h1_error(status, text, api, request_id)
        return 0

    def abort(self, stream: int) -> None:
        """End a response without a clean end: the client must see the truncation."""
        if self.h2 is not None:
            # RFC 9113 §8.1: an incomplete response is reset, INTERNAL_ERROR as the cause.
            self.h2.abort(stream, h2.errors.ErrorCodes.INTERNAL_ERROR)
            self._flush_h2()
        else:
            # HTTP/1.1 has no reset: closing without the final chunk is the signal
            # (RFC 9112 §8: an incomplete message). Once the caller is done.
            self.request_close()

    def request_close(self) -> None:
        """``close`` once the current event is handled (``Effects.defer``): what an exchange
        or a tunnel asks for, so that the close does not call back into it (the exchanges it
        aborts) while it is still handling its own input."""
        self.fx.defer(self.conn, self.close)

    def _window_wait(self, stream: int) -> None:
        """``stream``'s response started to wait for a window. One timer per connection,
        armed while some stream waits; a chunk queued behind a closed window costs nothing."""
        fx = self.fx
        if not self.window_waits:
            fx.set_timer((ClientTimer.WINDOW, self.conn), fx.now + fx.config.timeouts.send)
        self.window_waits[stream] = fx.now

    def _window_timeout(self) -> None:
        """The ``window`` timer: reset each stream whose window stayed closed for
        ``timeouts.send`` (the zero-window reader). Its bytes can never be written, so the
        stream is given up like a connection that takes no bytes: RST_STREAM(CANCEL) — the
        client has broken no rule (a closed window is legal, so not FLOW_CONTROL_ERROR) and
        we did not fail (not INTERNAL_ERROR); the stream is no longer wanted (RFC 9113 §7).
        Its backend request is aborted; the other streams go on."""
        h2c = self.h2
        fx = self.fx
        now = fx.now
        limit = fx.config.timeouts.send
        waits = self.window_waits
        due: float | None = None
        for stream, since in list(waits.items()):
            if h2c is None or not h2c.queued(stream):
                del waits[stream]  # sent, ended or reset meanwhile
                continue
            if not h2c.window_closed(stream):
                # The window is open and the bytes wait for the socket (``congested``): the
                # connection's send timer judges that.
                since = waits[stream] = now
            elif now >= since + limit:
                del waits[stream]
                self._cut_window_wait(stream)
                continue
            at = since + limit
            due = at if due is None or at < due else due
        if due is not None and self.protocol is not Protocol.CLOSED:
            fx.set_timer((ClientTimer.WINDOW, self.conn), due)
        if self.h2 is not None:
            self._flush_h2()

    def _cut_window_wait(self, stream: int) -> None:
        assert self.h2 is not None
        self.host.defences.record(
            "stream_send_timeout", self.peer_ip, conn=self.conn, stream=stream
        )
        self.h2.abort(stream, h2.errors.ErrorCodes.CANCEL)
        exchange = self.exchanges.get(stream)
        if exchange is not None:
            exchange.client_aborted("the client opened no window within the send timeout")

    def buffered(self, stream: int) -> int:
        """Bytes of this stream's response held here: its HTTP/2 queue plus unsent output."""
        if self.h2 is not None:
            return self.pending + self.h2.queued(stream)
        return self.pending

    def acknowledge(self, stream: int, nbytes: int) -> None:
        if self.h2 is not None and nbytes:
            self.h2.acknowledge(stream, nbytes)
            self._flush_h2()

    def send_raw(self, data: bytes) -> None:
        """Bytes as they are, through this connection's accounting (pending bytes, send
        timeout): an HTTP/1.1 tunnel's, once h11 has switched protocols."""
        self._send(data)

    def switch_protocols(self, headers: Headers) -> bytes:
        """HTTP/1.1: the 101 to a WebSocket upgrade (``H1Server.switch_protocols``); returns
        the bytes the client sent after its request (the tunnel's first)."""
        assert self.h1 is not None
        out, early = self.h1.switch_protocols(headers)
        self._send(out)
        return early

    def hold(self, stream: ClientStream) -> None:
        self.stalled.add(stream)

    def release(self, stream: ClientStream) -> None:
        self.stalled.discard(stream)

    def holds(self, stream: ClientStream) -> bool:
        return stream in self.stalled

    def pause_source(self) -> None:
        # HTTP/2 sources are stopped by the withheld acknowledgements alone.
        if self.h1 is not None and not self.reading_paused:
            self.reading_paused = True
            self.fx.emit(PauseReading(conn=self.conn))

    def resume_source(self) -> None:
        if self.h1 is not None and self.reading_paused:
            self.reading_paused = False
            self.fx.emit(ResumeReading(conn=self.conn))

    def exchange_finished(self, exchange: ClientStream) -> None:
        """``exchange`` is over. It is forgotten now; what follows for the connection (the
        next request, idle, or the close) once the current event is handled, so that nothing
        of that reaches back into the exchange or its backend while they finish."""
        self.exchanges.pop(exchange.stream, None)
        self.stalled.discard(exchange)
        if self.protocol is not Protocol.CLOSED:
            self.fx.defer(self.conn, lambda: self._after_exchange(exchange))

    def _after_exchange(self, exchange: ClientStream) -> None:
        if self.protocol is Protocol.CLOSED:
            return
        if self.h1 is not None:
            if not self.h1.reusable or self.going_away:
                # "Connection: close", or the response ended before the request (an early
                # error, a half-read upload): RFC 9112 §9.6, close rather than resynchronise.
                # Stopping: no next request is read (a pipelined one is retried elsewhere by
                # its client, RFC 9112 §9.3.2).
                self.close()
                return
            try:
                messages = self.h1.next_cycle()
            except PeerError as exc:
                self._h1_protocol_error(exc)
                return
            self._become_idle_if_unused()
            self._dispatch(messages)
            self._maybe_switch_to_h2c()
        elif self.h2 is not None:
            if exchange.request is RequestPhase.BODY and self.h2.finished(exchange.stream):
                # RFC 9113 §8.1: the response is complete, so the rest of the request body
                # is not needed; NO_ERROR tells the client to stop sending it.
                self.h2.cancel_request(exchange.stream)
                self._flush_h2()
            if self.h2.closed and not self.exchanges:
                self.close()
                return
            self._become_idle_if_unused()

    def _become_idle_if_unused(self) -> None:
        if not self.exchanges:
            if self.h1 is not None and not self.h1.idle:
                self._await_head()  # a pipelined head has begun
                return
            fx = self.fx
            self.waiting = Waiting.IDLE
            fx.set_timer((ClientTimer.IDLE, self.conn), fx.now + fx.config.timeouts.keepalive_idle)

    def _await_head(self) -> None:
        """The first bytes of a request head came on an idle connection: from now on it is
        bounded by ``client_header`` (and answered 408 when late), not ``keepalive_idle``."""
        fx = self.fx
        self.waiting = Waiting.HEAD
        fx.cancel_timer((ClientTimer.IDLE, self.conn))
        fx.set_timer((ClientTimer.HEADER, self.conn), fx.now + fx.config.timeouts.client_header)

    # -- driver events ---------------------------------------------------------------------

    def on_sent(self, nbytes: int) -> None:
        self.pending -= nbytes
        self.last_progress = self.fx.now
        if self.h2 is not None and self.h2.window_changed and self.protocol is Protocol.HTTP2:
            self._flush_blocked()
            self._flush_h2()
        if self.stalled and self.pending <= self.fx.limits.low_water:
            # Least served first: the backends resumed first are read first (the driver reads
            # ready sockets in the order they became ready), and they may fill the connection
            # again before the others get a read. In a fixed order the same streams of a busy
            # connection would win every time and the last ones would starve.
            for exchange in sorted(self.stalled, key=_bytes_out):
                exchange.client_drained()

    def on_closed(self, error: str | None) -> None:
        was_open = self.protocol is not Protocol.CLOSED
        self.protocol = Protocol.CLOSED
        for exchange in list(self.exchanges.values()):
            exchange.client_aborted(error or "client closed the connection")
        self.exchanges.clear()
        fx = self.fx
        for kind in ClientTimer:
            fx.cancel_timer((kind, self.conn))
        self.host.client_closed(self.conn)
        if was_open:
            fx.emit(Log(event="client_closed", fields={"conn": self.conn, "error": error}))

    def close(self) -> None:
        """Close after what is pending is written; exchanges still running are aborted."""
        if self.protocol is Protocol.CLOSED:
            return
        if self.h2 is not None:
            # What h2 still holds goes out before the close: a connection error queues its
            # GOAWAY in ``H2Server.receive``, and the aborts of the running exchanges can
            # reach this close (via ``exchange_finished``) before ``_after_h2_receive``
            # flushes; once CLOSED, ``_send`` drops everything (RFC 9113 §5.4.1: the GOAWAY
            # must be sent).
            self._flush_h2()
        self.protocol = Protocol.CLOSED
        self.fx.close(self.conn)
        for exchange in list(self.exchanges.values()):
            exchange.client_aborted("client connection closed")

    def timer_fired(self, kind: ClientTimer) -> None:
        match kind:
            case ClientTimer.SEND:
                self._send_timeout()
            case ClientTimer.WINDOW:
                self._window_timeout()
            case ClientTimer.IDLE | ClientTimer.HEADER:
                self._idle_timeout(kind)
            case ClientTimer.GOAWAY:
                pass  # the graceful stop's: ``ProxyCore`` hands it to ``Shutdown.goaway_due``
            case _:
                assert_never(kind)

    def _send_timeout(self) -> None:
        """Lazy: armed when output starts waiting, moved only when it fires."""
        fx = self.fx
        self.send_timer_armed = False
        if not self.pending:
            return
        due = self.last_progress + fx.config.timeouts.send
        if fx.now < due:
            self.send_timer_armed = True
            fx.set_timer((ClientTimer.SEND, self.conn), due)
            return
        fx.emit(Log(event="send_timeout", fields={"conn": self.conn}))
        self.close()

    def _idle_timeout(self, kind: ClientTimer) -> None:
        """``keepalive_idle`` between requests, or ``client_header`` for a request head."""
        if self.exchanges:
            return
        if self.h2 is not None:
            self.h2.goaway()
            self._flush_h2()
        elif self.h1 is not None and kind is ClientTimer.HEADER and not self.h1.idle:
            # RFC 9110 §15.5.9: the client did not complete its request in time.
            self.host.defences.record("request_header_timeout", self.peer_ip, conn=self.conn)
            self._h1_error(408, "request header timeout")
        self.close()


def _bytes_out(exchange: ClientStream) -> int:
    return exchange.bytes_out

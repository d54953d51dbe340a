"""One client connection: its adapter, the exchanges it carries, its output and its timers.

Its life is the table of ``downstream_states.py``: the protocol (chosen by ``detect.py``, RFC
9113 §3.3 and §3.4: ALPN, or HTTP/2 prior knowledge by the preface; or the h2c upgrade, RFC
7540 §3.2), what bounds it between requests, its close. Every state change goes through
``move``; the inputs of every token (bytes in, bytes written) read ``ClientState.protocol``.

It is the sink of its exchanges' responses (its ``output.py``: pending bytes, the connection
bound, the ``send`` timer) and the source of their requests. Its other timers:

- A request head is due within ``client_header`` from the connection's start, and on an idle
  kept-alive HTTP/1.1 connection from its first byte on (HEAD): the client is sending a
  request, so ``keepalive_idle`` no longer bounds it. Late: 408 (RFC 9110 §15.5.9).
- ``keepalive_idle`` between requests (IDLE): the close, on HTTP/2 after a GOAWAY.
- ``window``: an HTTP/2 stream whose response waits for a window (``windowwait.py``).

What it answers itself (413, 431, 408, 400, refused smuggling) is ``refusals.py``'s. A graceful
stop (``shutdown.py`` decides it) sets ``going_away``: on HTTP/1.1 the response whose head has
not gone out yet says ``Connection: close`` and the connection closes when the exchange ends
(RFC 9112 §9.6); HTTP/2's two GOAWAYs are ``shutdown.py``'s (RFC 9113 §6.8).
"""

from __future__ import annotations

from typing import assert_never

import attrs
import h2.errors

from muxproxy.config import Api
from muxproxy.core.client import detect, refusals
from muxproxy.core.client.downstream_states import (
    TIMER_INPUTS,
    TRANSITIONS,
    ClientInput,
    ClientState,
    Protocol,
)
from muxproxy.core.client.output import Output
from muxproxy.core.client.upgrade import H1Switch
from muxproxy.core.client.windowwait import WindowWaits
from muxproxy.core.commands import Log, PauseReading, ResumeReading
from muxproxy.core.effects import Effects
from muxproxy.core.http.bodyclock import SlowBody
from muxproxy.core.http.credentials import check_credentials
from muxproxy.core.http.errors import ErrorShape
from muxproxy.core.http.intake import MalformedRequest, check_request_limits
from muxproxy.core.http1.h1 import H1Server, PeerError
from muxproxy.core.http2.h2 import H2Server
from muxproxy.core.messages import (
    Abort,
    AnswerRewrite,
    Body,
    End,
    Fields,
    Headers,
    Message,
    Refused,
    RequestHead,
    ResponseHead,
)
from muxproxy.core.ports import ClientHost, ClientStream, Phase, RequestPhase
from muxproxy.core.states import step
from muxproxy.core.timers import ClientTimer

__all__ = ["ClientInput", "ClientState", "Downstream", "Protocol"]

_HTTP1 = Protocol.HTTP1
_HTTP2 = Protocol.HTTP2
_CLOSED = Protocol.CLOSED


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
        trusted: bool = False,
    ) -> None:
        """``trusted``: the peer is a proxy whose forwarded fields are believed
        (``forwarded.py``)."""
        self.fx = fx
        self.host = host
        self.conn = conn
        self.peer_ip = peer_ip
        self.trusted = trusted
        self.scheme = b"https" if tls else b"http"
        self.state = ClientState.SNIFFING
        """Changed by ``move`` alone, as ``TRANSITIONS`` says (and by fault isolation)."""
        self.exchanges: dict[int, ClientStream] = {}
        self.head_only: set[int] = set()
        """Streams whose request is a HEAD: their response is its head alone (RFC 9110
        §9.3.2), whatever the sender (a resume, a continuation) has for a body."""
        self.output = Output(fx, conn, self)
        self.reading_paused = False
        self.abuse_logged = False
        self.h1: H1Server | None = None
        self.h2: H2Server | None = None
        self.sniffed = b""
        self.going_away = False
        """A graceful stop began: no request after those running (``shutdown.py``)."""
        self.window = WindowWaits(fx, conn, self.output.windowed)
        if tls:
            self._choose(detect.by_alpn(alpn))
        fx.set_timer((ClientTimer.HEADER, conn), fx.now + fx.config.timeouts.client_header)

    def move(self, input: ClientInput) -> bool:
        """Take ``input`` as ``TRANSITIONS`` says: False where it is ignored; raises
        ``IllegalTransition`` where it cannot happen."""
        before = self.state
        target = step(TRANSITIONS, "Downstream", before, input)
        if target is not None:
            self.state = target
        if self.fx.moves is not None:
            self.fx.moves.record(self, before, input, self.state)
        return target is not None

    @property
    def pending(self) -> int:
        return self.output.pending

    @property
    def protocol(self) -> Protocol:
        return self.state.protocol

    @property
    def is_h2(self) -> bool:
        return self.state.protocol is _HTTP2

    @property
    def fresh(self) -> bool:
        """Not a byte of a request has arrived yet: a connection accepted an instant ago
        (plain, not yet sniffed; or HTTP/1.1 by ALPN, before its first request)."""
        if self.state is ClientState.SNIFFING:
            return not self.sniffed
        return self.h1 is not None and self.h1.stream == 0 and self.h1.idle

    def _choose(self, protocol: Protocol) -> None:
        if protocol is _HTTP2:
            self.move(ClientInput.H2)
            self.h2 = detect.h2_server(self.fx, self.scheme)
            self.flush()
            if self.going_away:
                # The preface came after the stop began (a fresh connection was left its
                # first request): the two GOAWAYs now, as for every HTTP/2 client.
                self.host.stop_client(self)
        else:
            self.move(ClientInput.H1)
            self.h1 = detect.h1_server(self.fx, self.scheme)

    def _maybe_switch_to_h2c(self) -> None:
        """The HTTP/1.1 adapter holds an h2c offer it accepted (``h2c.py``): switch, or serve
        the request over HTTP/1.1 after all (stopping, or settings h2 refuses)."""
        h1 = self.h1
        if h1 is None or h1.h2c is None:
            return
        # Stopping: the request is served over HTTP/1.1, with ``Connection: close``.
        h2s = None if self.going_away else detect.h2c_server(self.fx, self.scheme, h1.h2c)
        if h2s is None:
            self._dispatch(h1.decline_h2c())
        else:
            self._switch_to_h2c(h1, h2s)

    def _switch_to_h2c(self, h1: H1Server, h2s: H2Server) -> None:
        """RFC 7540 §3.2: the 101, then HTTP/2 (``detect.switch_to_h2c``)."""
        self.move(ClientInput.H2C)
        switched, messages, rest = detect.switch_to_h2c(h1)
        self.output.write(switched)
        self.h1 = None
        self.h2 = h2s
        self.flush()
        self._dispatch(messages)
        if rest:
            self.on_data(rest)

    # -- bytes in --------------------------------------------------------------------------

    def on_data(self, data: bytes) -> None:
        protocol = self.state.protocol
        if protocol is _HTTP2:
            assert self.h2 is not None
            self._dispatch(self.h2.receive(data))
            self._after_h2_receive()
        elif protocol is _HTTP1:
            self._receive_h1(data)
        elif self.move(ClientInput.DATA):  # sniffing (dropped once closing)
            buf = self.sniffed + data
            chosen = detect.sniff(buf)
            self.sniffed = buf if chosen is None else b""
            if chosen is not None:
                self._choose(chosen)
                self.on_data(buf)

    def _receive_h1(self, data: bytes) -> None:
        h1 = self.h1
        assert h1 is not None
        try:
            messages = h1.receive(data)
        except PeerError as exc:
            refusals.peer_error(self, exc)
            return
        if h1.interim:
            self.output.write(h1.interim)
            h1.interim = b""
        self._dispatch(messages)
        if self.state is ClientState.H1_IDLE and not h1.idle:
            self._await_head()
        self._maybe_switch_to_h2c()

    def _after_h2_receive(self) -> None:
        h2s = self.h2
        assert h2s is not None
        self._flush_blocked()
        if h2s.guard.exhausted is not None and not self.abuse_logged:
            self.abuse_logged = True
            self.host.defences.record(
                "client_h2_abuse", self.peer_ip, conn=self.conn, reason=h2s.guard.exhausted
            )
        self.flush()
        if h2s.closed and not self.exchanges:
            self.close()

    def _flush_blocked(self) -> None:
        """Send HTTP/2 data a WINDOW_UPDATE / SETTINGS made room for, unless the connection is
        congested (then it waits for ``on_sent``)."""
        h2s = self.h2
        if h2s is None or not h2s.window_changed or (h2s.blocked and self.congested):
            return
        for stream in h2s.flush_blocked():
            self.window.moved(stream)
            exchange = self.exchanges.get(stream)
            if (
                exchange is not None
                and exchange in self.output.stalled
                and self.window.reopened(stream, blocked=stream in h2s.blocked)
            ):
                exchange.client_drained()
        h2s.window_changed = False

    def _dispatch(self, messages: list[Message]) -> None:
        exchanges = self.exchanges
        for message in messages:
            if type(message) is Body:
                exchange = exchanges.get(message.stream)
                if exchange is not None:
                    limit = self.fx.config.limits.max_request_body
                    if exchange.request_size + len(message.data) > limit:
                        refusals.body_too_large(self, exchange, message.flow_len)
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
                refusals.refuse_undecoded(self, message)

    def _start_exchange(self, head: RequestHead) -> None:
        fx = self.fx
        limits = fx.config.limits
        try:
            check_request_limits(
                head, max_fields=limits.max_header_fields, max_body=limits.max_request_body
            )
            check_credentials(head)
        except MalformedRequest as exc:
            refusals.refuse_head(self, head, exc)
            return
        if self.move(ClientInput.STARTED):
            fx.cancel_timer((ClientTimer.HEADER, self.conn))
            fx.cancel_timer((ClientTimer.IDLE, self.conn))
        exchange = self.host.new_exchange(self, head)
        self.exchanges[head.stream] = exchange
        if head.method == b"HEAD":
            self.head_only.add(head.stream)
        exchange.start()
        if exchange.request is RequestPhase.BODY and exchange.phase is not Phase.DONE:
            exchange.watch_request_body()

    # -- the sink side, for exchanges ------------------------------------------------------

    @property
    def congested(self) -> bool:
        return self.output.congested

    def flush(self) -> None:
        """Hand what the HTTP/2 connection queued to the driver."""
        if self.h2 is not None:
            self.output.write(self.h2.data_to_send())

    def send_head(self, head: ResponseHead, *, end_stream: bool = False) -> None:
        """Send the response head; ``end_stream``: the response is complete without a body
        (a gRPC Trailers-Only response: one HEADERS frame with END_STREAM on HTTP/2, as is
        every response to HEAD: no DATA frame follows, RFC 9113 §8.1)."""
        if self.h2 is not None:
            end_stream = end_stream or head.stream in self.head_only
            self.h2.send_head(head, end_stream=end_stream)
            self.flush()
        elif self.h1 is not None:
            if self.going_away:
                # RFC 9112 §9.6: a server that is stopping says so on the response it still
                # sends, and closes after it.
                head = attrs.evolve(head, headers=[*head.headers, (b"connection", b"close")])
            self.output.write(self.h1.send_head(head))
            if end_stream:
                self.output.write(self.h1.send_end([]))

    def send_body(self, stream: int, data: bytes) -> None:
        if self.head_only and stream in self.head_only:
            return  # RFC 9110 §9.3.2: no content in a response to HEAD (h11 would raise)
        h2s = self.h2
        if h2s is not None:
            if h2s.send_body(stream, data):
                exchange = self.exchanges.get(stream)
                if self.window.wait(stream, exchange) and exchange is not None:
                    self.output.stalled.add(exchange)
            self.output.write(h2s.data_to_send())
        elif self.h1 is not None:
            self.output.write(self.h1.send_body(data))

    def send_end(self, stream: int, trailers: Headers) -> None:
        if self.h2 is not None:
            self.h2.send_end(stream, trailers)
            self.flush()
        elif self.h1 is not None:
            self.output.write(self.h1.send_end(trailers))

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
        api: ErrorShape | None = None,
        head_only: bool = False,
        request_id: bytes | None = None,
        extra: Fields = (),
        rewrite: AnswerRewrite | None = None,
    ) -> int:
        """The proxy's own short response (``refusals.send_error``)."""
        return refusals.send_error(
            self,
            stream,
            status,
            text,
            api=api,
            head_only=head_only,
            request_id=request_id,
            extra=extra,
            rewrite=rewrite,
        )

    def refuse_slow_body(
        self, stream: int, slow: SlowBody, *, api: Api | None, request_id: bytes
    ) -> int | None:
        """408 (and close on HTTP/1.1), or RST_STREAM(CANCEL) (``refusals.slow_body``)."""
        return refusals.slow_body(self, stream, slow, api=api, request_id=request_id)

    def abort(self, stream: int) -> None:
        """End a response without a clean end: the client must see the truncation."""
        if self.h2 is not None:
            # RFC 9113 §8.1: an incomplete response is reset, INTERNAL_ERROR as the cause.
            self.h2.abort(stream, h2.errors.ErrorCodes.INTERNAL_ERROR)
            self.flush()
        else:
            # HTTP/1.1 has no reset: closing without the final chunk is the signal
            # (RFC 9112 §8: an incomplete message). Once the caller is done.
            self.request_close()

    def request_close(self) -> None:
        """``close`` once the current event is handled (``Effects.defer``): what an exchange
        or a tunnel asks for, so that the close does not call back into it (the exchanges it
        aborts) while it is still handling its own input."""
        self.fx.defer(self.conn, self.close)

    def buffered(self, stream: int) -> int:
        """Bytes of this stream's response held here: its HTTP/2 queue plus unsent output."""
        if self.h2 is not None:
            return self.output.pending + self.h2.queued(stream)
        return self.output.pending

    def acknowledge(self, stream: int, nbytes: int) -> None:
        """HTTP/2 alone has credit to give back: an HTTP/1.1 body's ``flow_len`` is 0, so
        its flows hold none and no caller gives back nothing (``RequestSource``)."""
        h2s = self.h2
        assert h2s is not None and nbytes, "credit comes from HTTP/2 DATA alone"
        h2s.acknowledge(stream, nbytes)
        self.flush()

    def send_raw(self, data: bytes) -> None:
        """Bytes as they are, through this connection's accounting (pending bytes, send
        timeout): an HTTP/1.1 answer of ``refusals.py``'s."""
        self.output.write(data)

    def http1_upgrade(self) -> H1Switch | None:
        """The HTTP/1.1 side's protocol switch (``ports.Http1Upgrade``); None on HTTP/2, which
        has no Upgrade (RFC 9113 §8.6)."""
        return H1Switch(self.h1, self.output) if self.h1 is not None else None

    def hold(self, stream: ClientStream) -> None:
        self.output.stalled.add(stream)

    def release(self, stream: ClientStream) -> None:
        self.output.stalled.discard(stream)

    def holds(self, stream: ClientStream) -> bool:
        return stream in self.output.stalled

    def pause_source(self) -> None:
        # HTTP/2 sources are stopped by the withheld acknowledgements alone.
        if self.h1 is not None and not self.reading_paused:
            self.reading_paused = True
            self.fx.emit(PauseReading(conn=self.conn))

    def resume_source(self) -> None:
        if self.h1 is not None and self.reading_paused:
            self.reading_paused = False
            self.fx.emit(ResumeReading(conn=self.conn))

    # -- the keep-alive cycle --------------------------------------------------------------

    def exchange_finished(self, exchange: ClientStream) -> None:
        """``exchange`` is over. It is forgotten now, in any state; what follows for the
        connection (the next request, idle, or the close) once the current event is handled,
        so that nothing of that reaches back into the exchange or its backend while they
        finish."""
        follow = self.move(ClientInput.FINISHED)
        self.exchanges.pop(exchange.stream, None)
        self.head_only.discard(exchange.stream)
        self.output.stalled.discard(exchange)
        if follow:
            self.fx.defer(self.conn, lambda: self._after_exchange(exchange))

    def _after_exchange(self, exchange: ClientStream) -> None:
        if not self.move(ClientInput.FOLLOW_UP):
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
                refusals.peer_error(self, exc)
                return
            self._become_idle_if_unused()
            self._dispatch(messages)
            self._maybe_switch_to_h2c()
        elif self.h2 is not None:
            if exchange.request is RequestPhase.BODY and self.h2.finished(exchange.stream):
                # RFC 9113 §8.1: the response is complete, so the rest of the request body
                # is not needed; NO_ERROR tells the client to stop sending it.
                self.h2.cancel_request(exchange.stream)
                self.flush()
            if self.h2.closed and not self.exchanges:
                self.close()
                return
            self._become_idle_if_unused()

    def _become_idle_if_unused(self) -> None:
        if self.exchanges:
            return
        if self.h1 is not None and not self.h1.idle:
            self._await_head()  # a pipelined head has begun
        else:
            self._go_idle()

    def _go_idle(self) -> None:
        if self.move(ClientInput.UNUSED):
            fx = self.fx
            fx.set_timer((ClientTimer.IDLE, self.conn), fx.now + fx.config.timeouts.keepalive_idle)

    def _await_head(self) -> None:
        """The first bytes of a request head came on an idle connection: from now on it is
        bounded by ``client_header`` (and answered 408 when late), not ``keepalive_idle``."""
        self.move(ClientInput.HEAD_BEGAN)
        fx = self.fx
        fx.cancel_timer((ClientTimer.IDLE, self.conn))
        fx.set_timer((ClientTimer.HEADER, self.conn), fx.now + fx.config.timeouts.client_header)

    # -- driver events ---------------------------------------------------------------------

    def on_sent(self, nbytes: int) -> None:
        protocol = self.state.protocol
        if protocol is not _HTTP1 and protocol is not _HTTP2:
            self.move(ClientInput.SENT)  # late once closing; never sent while sniffing
            return
        output = self.output
        output.pending -= nbytes  # ``Output``'s accounting, without a call per write
        output.last_progress = self.fx.now
        if self.h2 is not None and self.h2.window_changed:
            self._flush_blocked()
            self.flush()
        if output.stalled:
            output.resume()

    def on_closed(self, error: str | None) -> None:
        was = self.state
        self.move(ClientInput.PEER_CLOSED)
        for exchange in list(self.exchanges.values()):
            exchange.client_aborted(error or "client closed the connection")
        self.exchanges.clear()
        fx = self.fx
        for kind in ClientTimer:
            fx.cancel_timer((kind, self.conn))
        self.host.client_closed(self.conn)
        if was.protocol is not _CLOSED:
            fx.emit(Log(event="client_closed", fields={"conn": self.conn, "error": error}))

    def close(self, *, linger: bool = True) -> None:
        """Close after what is pending is written; exchanges still running are aborted.
        ``linger=False``: an idle connection (``CloseConnection.linger``)."""
        # What h2 still holds goes out before the close: a connection error queues its
        # GOAWAY in ``H2Server.receive``, and the aborts of the running exchanges can reach
        # this close (via ``exchange_finished``) before ``_after_h2_receive`` flushes; once
        # closing, ``_send`` drops everything (RFC 9113 §5.4.1: the GOAWAY must be sent).
        self.flush()
        if not self.move(ClientInput.CLOSE):
            return
        self.fx.close(self.conn, linger=linger)
        for exchange in list(self.exchanges.values()):
            exchange.client_aborted("client connection closed")

    def timer_fired(self, kind: ClientTimer) -> None:
        if kind is ClientTimer.GOAWAY:
            return  # the graceful stop's: ``ProxyCore`` hands it to ``Shutdown.goaway_due``
        if not self.move(TIMER_INPUTS[kind]):
            return
        match kind:
            case ClientTimer.SEND:
                if self.output.timed_out():
                    self.fx.emit(Log(event="send_timeout", fields={"conn": self.conn}))
                    self.close()
            case ClientTimer.WINDOW:
                self.window.expire(self)
            case ClientTimer.IDLE | ClientTimer.HEADER:
                self._idle_timeout(kind)
            case _:
                assert_never(kind)

    def _idle_timeout(self, kind: ClientTimer) -> None:
        """``keepalive_idle`` between requests, or ``client_header`` for a request head (no
        exchange runs in either state)."""
        if self.h2 is not None:
            self.h2.goaway()
            self.flush()
        elif self.h1 is not None and kind is ClientTimer.HEADER and not self.h1.idle:
            refusals.head_timeout(self)
        self.close()

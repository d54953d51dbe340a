"""HTTP/2 server adapter: one ``h2.H2Connection`` facing a client, translated to core messages.

Obeys RFC 9113 through h2, and adds what h2 leaves to its user:

- Flow control both ways (RFC 9113 §5.2). Outbound, each stream has a send queue and
  ``send_data`` is only ever called with what the peer's window allows
  (``min(local_flow_control_window, max_outbound_frame_size)``); the rest waits for a
  WINDOW_UPDATE or a SETTINGS change. Trailers and END_STREAM wait behind the queued data.
  Inbound, nothing is acknowledged on arrival: the exchange calls ``acknowledge`` once the
  bytes have moved on, so a stalled backend closes this stream's window and no other's.
- Malformed requests (RFC 9113 §8.1.1) are stream errors: RST_STREAM(PROTOCOL_ERROR) for that
  stream, the others go on. h2's own inbound header validation is off so that a bad header
  block does not become a connection error; ``intake.request_from_h2`` validates instead.
  Trailers with pseudo-header fields (§8.1) and a body whose length disagrees with its
  Content-Length (§8.1.1) are malformed too; h2 never sees Content-Length (``h2decode``), the
  adapter counts the body against it.
- A header list over ``limits.max_request_head`` gets 431 on its stream (``Refused``); the
  HPACK decoder is ours (``h2decode.HeaderDecoder``), so this limit is the one it enforces.
- Frame-level violations are connection errors (RFC 9113 §5.4.1): one GOAWAY with h2's error
  code, and ``state`` CLOSED. h2 itself refuses more than 64 CONTINUATION frames per header
  block (PROTOCOL_ERROR); an HPACK block that cannot be decoded is COMPRESSION_ERROR (§4.3);
  an HPACK bomb ENHANCE_YOUR_CALM.
- Abuse that is legal frame by frame (rapid reset, control-frame floods, streams refused past
  MAX_CONCURRENT_STREAMS) is counted by ``h2guard.H2Guard`` and answered with
  GOAWAY(ENHANCE_YOUR_CALM) (RFC 9113 §10.5); a client near the end of the stream-id space gets
  a graceful GOAWAY(NO_ERROR) (``drain``).
- A GOAWAY either way (ours from ``drain``, or the client's, whatever its code) only ends the
  opening of streams (RFC 9113 §6.8): ``state`` DRAINING, and the open streams are served to
  their end. A graceful stop takes two steps (§6.8, ``announce_shutdown``): GOAWAY(NO_ERROR)
  with last-stream-id 2^31-1 and a PING (``GOING_AWAY``: streams are still taken, since
  the client may have sent some before it saw the GOAWAY), then, once the PING's ACK shows
  that every stream the client sent before it has arrived, the GOAWAY with the real last
  stream id (``drain``; DRAINING). h2 moves its state machine to CLOSED on any GOAWAY and then
  refuses every frame and every send: after our own GOAWAY the adapter sets it back
  (``H2Connection.state_machine`` is public by name), and reads go through ``h2goaway``, whose
  machine stays open on a client's GOAWAY, so the frames after it in the same read are
  processed too.

States (``H2State``) and what moves them (``H2Input``) are one table, ``TRANSITIONS``
(``states.py``). Every input but the graceful stop's announce comes from the client or is
idempotent, so the table ignores rather than refuses them in the states they come late to; the
one illegal pair is an announce while one is under way (a stop begins once, ``shutdown.py``).
The response side (send queues, RST_STREAM) is ``h2send.ResponseSender``, which ``H2Server``
extends; the connection's SETTINGS and windows are set up in ``h2settings``.
"""

from __future__ import annotations

import contextlib
import enum

import h2.connection
import h2.errors
import h2.events
import h2.exceptions

from muxproxy.core.http.headers import header_value
from muxproxy.core.http.intake import MalformedRequest, request_from_h2
from muxproxy.core.http2.h2decode import OVERSIZED, HeaderBlockFlood
from muxproxy.core.http2.h2goaway import GoawayTolerantReceiver
from muxproxy.core.http2.h2guard import CONTROL_FRAME_BUDGET, RESET_BUDGET, STREAM_ID_DRAIN, H2Guard
from muxproxy.core.http2.h2send import ResponseSender, SendQueue
from muxproxy.core.http2.h2settings import CONNECTION_WINDOW as CONNECTION_WINDOW
from muxproxy.core.http2.h2settings import server_connection
from muxproxy.core.messages import Abort, Body, End, Headers, Message, Refused
from muxproxy.core.movelog import Recorded
from muxproxy.core.states import IGNORED, ILLEGAL, Transitions, step

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


# h2 events that stand for a frame that asks for work and carries no request, and the name
# a GOAWAY's debug data gives their flood (RFC 9113 §10.5).
_CONTROL_EVENTS: dict[type[h2.events.Event], str] = {
    h2.events.RemoteSettingsChanged: "SETTINGS",
    h2.events.SettingsAcknowledged: "SETTINGS ACK",
    h2.events.PingReceived: "PING",
    h2.events.PingAckReceived: "PING ACK",
    h2.events.PriorityUpdated: "PRIORITY",
    h2.events.WindowUpdated: "WINDOW_UPDATE",
    h2.events.UnknownFrameReceived: "unknown frame",
}

_HUGE_LENGTH = 10**18

SHUTDOWN_PING = b"muxstop\x00"
"""The opaque data of the PING that follows the first GOAWAY of a graceful stop; its ACK
means the client has seen that GOAWAY (RFC 9113 §6.7: the ACK echoes the data)."""

MAX_STREAM_ID = 2**31 - 1
"""RFC 9113 §5.1.1: the largest stream id; the first GOAWAY of a graceful stop names it."""

_OPEN_STATE = h2.connection.ConnectionState.SERVER_OPEN
_CLOSED_STATE = h2.connection.ConnectionState.CLOSED


class H2State(enum.Enum):
    __hash__ = object.__hash__  # as ``Phase``'s: a table lookup runs no Python code
    OPEN = "open"
    GOING_AWAY = "going_away"
    """The first GOAWAY of a graceful stop (last-stream-id 2^31-1) and a PING were sent: new
    streams are still served until the PING's ACK, then ``drain`` sends the final GOAWAY
    (RFC 9113 §6.8)."""
    DRAINING = "draining"
    """A GOAWAY(NO_ERROR) was sent (``drain``) or a GOAWAY received: the streams up to
    ``last_stream`` finish, later ones are refused (RFC 9113 §6.8)."""
    CLOSED = "closed"
    """A connection error or ENHANCE_YOUR_CALM: every stream aborted, nothing more is sent."""


class H2Input(enum.Enum):
    __hash__ = object.__hash__  # as ``Phase``'s: a table lookup runs no Python code
    ANNOUNCE = "announce"
    """``announce_shutdown``: the first GOAWAY of a graceful stop and its PING."""
    SHUTDOWN_ACK = "shutdown_ack"
    """The client's ACK of that PING (``SHUTDOWN_PING``)."""
    DRAIN = "drain"
    """``drain`` / ``goaway``: our final GOAWAY(NO_ERROR)."""
    GOAWAY_RECEIVED = "goaway_received"
    """The client's GOAWAY, whatever its error code."""
    ABUSE = "abuse"
    """A budget of ``H2Guard`` ran out: GOAWAY(ENHANCE_YOUR_CALM)."""
    CONNECTION_ERROR = "connection_error"
    """h2 (or our HPACK decoder) found a frame-level violation: GOAWAY with its code."""


_S = H2State
_I = H2Input
TRANSITIONS: Transitions[H2State, H2Input] = {
    (_S.OPEN, _I.ANNOUNCE): _S.GOING_AWAY,
    (_S.OPEN, _I.SHUTDOWN_ACK): IGNORED,  # an ACK of a PING we never sent: the client's affair
    (_S.OPEN, _I.DRAIN): _S.DRAINING,
    (_S.OPEN, _I.GOAWAY_RECEIVED): _S.DRAINING,
    (_S.OPEN, _I.ABUSE): _S.CLOSED,
    (_S.OPEN, _I.CONNECTION_ERROR): _S.CLOSED,
    (_S.GOING_AWAY, _I.ANNOUNCE): ILLEGAL,  # a graceful stop begins once (shutdown.py)
    (_S.GOING_AWAY, _I.SHUTDOWN_ACK): _S.DRAINING,
    (_S.GOING_AWAY, _I.DRAIN): _S.DRAINING,  # no ACK in time (``goaway_due``), or the cut
    (_S.GOING_AWAY, _I.GOAWAY_RECEIVED): _S.DRAINING,
    (_S.GOING_AWAY, _I.ABUSE): _S.CLOSED,
    (_S.GOING_AWAY, _I.CONNECTION_ERROR): _S.CLOSED,
    # DRAINING: the final GOAWAY went either way; a later one changes nothing (RFC 9113 §6.8:
    # a last-stream-id never grows), nor does an ACK that comes after the timer drained.
    (_S.DRAINING, _I.ANNOUNCE): IGNORED,
    (_S.DRAINING, _I.SHUTDOWN_ACK): IGNORED,
    (_S.DRAINING, _I.DRAIN): IGNORED,
    (_S.DRAINING, _I.GOAWAY_RECEIVED): IGNORED,
    (_S.DRAINING, _I.ABUSE): _S.CLOSED,
    (_S.DRAINING, _I.CONNECTION_ERROR): _S.CLOSED,
    # CLOSED: nothing more is sent. h2 keeps a frame it could not parse and raises on every
    # read after it, so a CONNECTION_ERROR comes again for each read the client still sends.
    (_S.CLOSED, _I.ANNOUNCE): IGNORED,
    (_S.CLOSED, _I.SHUTDOWN_ACK): IGNORED,
    (_S.CLOSED, _I.DRAIN): IGNORED,
    (_S.CLOSED, _I.GOAWAY_RECEIVED): IGNORED,
    (_S.CLOSED, _I.ABUSE): IGNORED,
    (_S.CLOSED, _I.CONNECTION_ERROR): IGNORED,
}
del _S, _I


class H2Server(ResponseSender):
    """HTTP/2 for one client connection (its response side: ``ResponseSender``)."""

    def __init__(
        self,
        *,
        scheme: bytes,
        max_concurrent_streams: int = 100,
        initial_window: int = 65535,
        max_header_list_size: int = 64 * 1024,
        connection_window: int = CONNECTION_WINDOW,
        upgrade_settings: bytes | None = None,
        reset_budget: int = RESET_BUDGET,
        control_budget: int = CONTROL_FRAME_BUDGET,
        watch: Recorded | None = None,
    ) -> None:
        """``upgrade_settings``: the client's HTTP2-Settings value when this connection was
        upgraded from HTTP/1.1 (h2c.py); raises h2's ``ProtocolError`` if they are invalid.
        ``watch``: what may carry a log of its moves for a test (its core's ``Effects``,
        ``movelog.py``)."""
        conn, self.decoder = server_connection(
            max_concurrent_streams=max_concurrent_streams,
            initial_window=initial_window,
            max_header_list_size=max_header_list_size,
            connection_window=connection_window,
            upgrade_settings=upgrade_settings,
        )
        super().__init__(conn, H2Guard(reset_budget=reset_budget, control_budget=control_budget))
        self.receiver = GoawayTolerantReceiver()
        self.scheme = scheme
        self.max_streams = max_concurrent_streams
        if upgrade_settings is not None:
            self.queues[1] = SendQueue()  # the response to the upgraded request
        self.window_changed = False
        """A WINDOW_UPDATE or SETTINGS arrived since the owner last flushed ``blocked``."""
        self.trailers: dict[int, Headers] = {}
        self.body_left: dict[int, int] = {}
        """Request body bytes still due by Content-Length, for streams that declared one."""
        self.state = H2State.OPEN
        """Changed by ``move`` alone, as ``TRANSITIONS`` says."""
        self.watch = watch
        self.last_stream: int | None = None
        """DRAINING: the last stream id served; later ones are refused. None otherwise."""

    @property
    def closed(self) -> bool:
        """A final GOAWAY was sent or received: no new streams."""
        state = self.state
        return state is H2State.DRAINING or state is H2State.CLOSED

    def move(self, input: H2Input) -> bool:
        """Take ``input`` as ``TRANSITIONS`` says: False where it is ignored."""
        before = self.state
        target = step(TRANSITIONS, "H2Server", before, input)
        if target is not None:
            self.state = target
        watch = self.watch
        if watch is not None and watch.moves is not None:
            watch.moves.record(self, before, input, self.state)
        return target is not None

    def data_to_send(self) -> bytes:
        return self.conn.data_to_send()

    def receive(self, data: bytes) -> list[Message]:
        """Feed bytes; return messages. On a connection error, GOAWAY is queued and every open
        stream gets an ``Abort``."""
        try:
            events = self.receiver.receive_data(self.conn, data)
        except h2.exceptions.ProtocolError as exc:
            return self._connection_error(exc)
        out: list[Message] = []
        guard = self.guard
        for event in events:
            if guard.exhausted is not None:
                return out + self._calm(guard.exhausted)
            if type(event) in _CONTROL_EVENTS:
                guard.control_frame(_CONTROL_EVENTS[type(event)])
                if (
                    type(event) is h2.events.PingAckReceived
                    and event.ping_data == SHUTDOWN_PING
                    and self.move(H2Input.SHUTDOWN_ACK)
                ):
                    # RFC 9113 §6.8: the client saw the first GOAWAY; the streams it opened
                    # before that are all here (the frames before this ACK), so the final
                    # GOAWAY can name the real last stream.
                    self._final_goaway(None)
            if isinstance(event, h2.events.DataReceived):
                sid = event.stream_id
                if not event.flow_controlled_length and event.stream_ended is None:
                    # RFC 9113 §10.5: an empty DATA frame costs a frame's work and moves
                    # nothing (the "empty frames" flood, CVE-2019-9518).
                    guard.control_frame("empty DATA")
                left = self.body_left.get(sid) if self.body_left else None
                if left is not None:
                    left -= len(event.data)
                    self.body_left[sid] = left
                    if left < 0:
                        out.extend(self._malformed(sid, "request body past its content-length"))
                if sid in self.queues or sid in self.trailers or sid in self.receiving:
                    out.append(
                        Body(stream=sid, data=event.data, flow_len=event.flow_controlled_length)
                    )
                else:
                    # Data for a stream we already refused: give the window back at once,
                    # nobody will consume it (RFC 9113 §6.9: flow control is hop by hop).
                    self.conn.acknowledge_received_data(event.flow_controlled_length, sid)
            elif isinstance(event, h2.events.RequestReceived):
                out.extend(self._request(event))
            elif isinstance(event, h2.events.StreamEnded):
                sid = event.stream_id
                if self.body_left and self.body_left.pop(sid, 0):
                    out.extend(self._malformed(sid, "request body short of its content-length"))
                elif sid in self.queues:
                    out.append(End(stream=sid, trailers=self.trailers.pop(sid, [])))
                elif sid in self.receiving:
                    self.receiving.discard(sid)
                    out.append(End(stream=sid, trailers=self.trailers.pop(sid, [])))
            elif isinstance(event, h2.events.TrailersReceived):
                out.extend(self._trailers(event))
            elif isinstance(event, h2.events.StreamReset):
                sid = event.stream_id
                self.body_left.pop(sid, None)
                self.blocked.discard(sid)
                if self.queues.pop(sid, None) is not None:
                    # The response was not complete: a backend request started for nothing.
                    guard.premature_reset()
                    out.append(
                        Abort(stream=sid, reason=f"client reset the stream ({event.error_code!r})")
                    )
                elif sid in self.receiving:
                    self.receiving.discard(sid)
                    out.append(
                        Abort(stream=sid, reason=f"client reset the stream ({event.error_code!r})")
                    )
            elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
                # RFC 9113 §6.9.2: a SETTINGS change of the initial window applies to every
                # stream, so any of them may have room now.
                self.window_changed = True
            elif isinstance(event, h2.events.ConnectionTerminated):
                self._goaway_received()
        if guard.exhausted is not None:
            return out + self._calm(guard.exhausted)
        return out

    def _request(self, event: h2.events.RequestReceived) -> list[Message]:
        sid = event.stream_id
        decoder = self.decoder
        decoder.processed()
        if self.closed and (self.last_stream is None or sid > self.last_stream):
            # RFC 9113 §6.8: after a GOAWAY, streams above its last stream id are not
            # processed; REFUSED_STREAM tells the client it may retry them elsewhere.
            return self._refuse(sid)
        if len(self.queues) + len(self.receiving) >= self.max_streams:
            return self._refuse(sid)
        fields = decoder.restore(list(event.headers))
        if fields and fields[0][0] == OVERSIZED:
            # RFC 9113 §10.5.1, RFC 6585 §5: 431, on this stream alone.
            self.queues[sid] = SendQueue()
            limit = decoder.limit
            reason = f"request header list of {fields[0][1].decode()} bytes, over {limit}"
            return [
                Refused(stream=sid, status=431, reason=reason, end_stream=bool(event.stream_ended))
            ]
        try:
            # RFC 9113 §8.1: HEADERS with END_STREAM is a request without a body; the head
            # says so as it is built (its ``End`` comes from h2's ``StreamEnded`` next).
            ended = event.stream_ended is not None
            head = request_from_h2(sid, fields, scheme_default=self.scheme, end_stream=ended)
            length = header_value(head.headers, b"content-length")
            declared = None
            if length is not None:
                # Digits only (intake). Past 18 of them no body can match it, and int() of a
                # few thousand digits raises: count it as the largest we track.
                declared = int(length) if len(length) <= 18 else _HUGE_LENGTH
            if declared and ended:
                raise MalformedRequest("content-length of a request without a body")
        except MalformedRequest:
            # RFC 9113 §8.1.1: a malformed request is a stream error of type PROTOCOL_ERROR.
            self._reset(sid, h2.errors.ErrorCodes.PROTOCOL_ERROR)
            return []
        self.queues[sid] = SendQueue()
        if declared is not None and event.stream_ended is None:
            self.body_left[sid] = declared
        if sid >= STREAM_ID_DRAIN:
            self.drain(sid)
        return [head]

    def _refuse(self, sid: int) -> list[Message]:
        """RFC 9113 §5.1.2, §6.8: REFUSED_STREAM, charged to the client's budget."""
        self.guard.refused_stream()
        self._reset(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
        return []

    def _trailers(self, event: h2.events.TrailersReceived) -> list[Message]:
        sid = event.stream_id
        self.decoder.processed()
        fields = self.decoder.restore(list(event.headers))
        if sid not in self.queues and sid not in self.receiving:
            return []
        if fields and fields[0][0] == OVERSIZED:
            return self._malformed(sid, "request trailers over the header list limit")
        for name, _ in fields:
            if name[:1] == b":":
                # RFC 9113 §8.1: trailers hold no pseudo-header fields; malformed (§8.1.1).
                return self._malformed(sid, "pseudo-header field in the request trailers")
        self.trailers[sid] = fields
        return []

    def _malformed(self, sid: int, reason: str) -> list[Message]:
        """RFC 9113 §8.1.1: a request found malformed after it began (its body or trailers)
        is a stream error of type PROTOCOL_ERROR; the exchange is aborted."""
        self.body_left.pop(sid, None)
        self.trailers.pop(sid, None)
        self.blocked.discard(sid)
        running = self.queues.pop(sid, None) is not None or sid in self.receiving
        self._reset(sid, h2.errors.ErrorCodes.PROTOCOL_ERROR)
        if not running:
            return []
        return [Abort(stream=sid, reason=f"malformed request: {reason}")]

    def _calm(self, reason: str) -> list[Message]:
        """RFC 9113 §10.5: GOAWAY(ENHANCE_YOUR_CALM); every open stream is aborted, so their
        backend requests are cancelled."""
        if not self.move(H2Input.ABUSE):
            return []  # already closed by a connection error or an earlier flood
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.conn.close_connection(
                error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM,
                additional_data=reason[:64].encode(),
            )
        return self._abort_all(f"HTTP/2 abuse: {reason}")

    def _abort_all(self, reason: str) -> list[Message]:
        """CLOSED: every stream's exchange is aborted."""
        self.last_stream = None
        out: list[Message] = [
            Abort(stream=sid, reason=reason) for sid in [*self.queues, *self.receiving]
        ]
        self.queues.clear()
        self.receiving.clear()
        self.blocked.clear()
        self.body_left.clear()
        return out

    def drain(self, last_stream: int | None = None) -> None:
        """Graceful GOAWAY(NO_ERROR): the streams open now finish, new ones are refused.

        h2 moves its state machine to CLOSED on any GOAWAY it sends and then refuses to send
        or receive for the running streams, which RFC 9113 §6.8 lets finish; the state goes
        back to SERVER_OPEN (as ``H2Client`` does for a received GOAWAY) and ``_request``
        refuses the later streams itself. ``last_stream``: the last stream served (default:
        the highest the client opened). Nothing to do once the client sent its own GOAWAY:
        the connection is draining already. After ``announce_shutdown`` this is the second,
        final GOAWAY."""
        if self.move(H2Input.DRAIN):
            self._final_goaway(last_stream)

    def _final_goaway(self, last_stream: int | None) -> None:
        """DRAINING, by our GOAWAY(NO_ERROR) naming ``last_stream`` (or the highest yet)."""
        conn = self.conn
        if last_stream is None:
            last_stream = conn.highest_inbound_stream_id
        self.last_stream = last_stream
        conn.close_connection(error_code=h2.errors.ErrorCodes.NO_ERROR, last_stream_id=last_stream)
        conn.state_machine.state = _OPEN_STATE

    def announce_shutdown(self) -> None:
        """The first step of a graceful stop (RFC 9113 §6.8): GOAWAY(NO_ERROR) with
        last-stream-id 2^31-1, so the client opens no more streams, then a PING whose ACK
        tells when the streams it sent before it saw the GOAWAY have all arrived (the ACK
        follows them on the wire). Streams keep being taken meanwhile (``GOING_AWAY``); the
        owner bounds the wait for the ACK and then calls ``drain`` itself."""
        if not self.move(H2Input.ANNOUNCE):
            return
        conn = self.conn
        conn.close_connection(
            error_code=h2.errors.ErrorCodes.NO_ERROR, last_stream_id=MAX_STREAM_ID
        )
        conn.state_machine.state = _OPEN_STATE  # as in ``drain``: the streams go on
        conn.ping(SHUTDOWN_PING)

    def _goaway_received(self) -> None:
        """RFC 9113 §6.8: the client opens no more streams (whatever its error code says, a
        client that is going away still reads); the responses to its open streams finish."""
        if self.move(H2Input.GOAWAY_RECEIVED):
            self.last_stream = self.conn.highest_inbound_stream_id

    def _connection_error(self, exc: h2.exceptions.ProtocolError) -> list[Message]:
        """RFC 9113 §5.4.1: one GOAWAY, with the error's code. h2 queued it already unless it
        raised before its frame loop (an invalid preface: its state is not CLOSED then). No
        debug data: h2's error text is about its own code, not for the client."""
        if not self.move(H2Input.CONNECTION_ERROR):
            return []  # closed already: h2 raises again for the frame it could not parse
        if self.conn.state_machine.state is not _CLOSED_STATE:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.conn.close_connection(error_code=exc.error_code)
        if isinstance(exc, (HeaderBlockFlood, h2.exceptions.DenialOfServiceError)):
            self.guard.abuse(str(exc))
        return self._abort_all(f"connection error: {exc}")

    def acknowledge(self, stream: int, nbytes: int) -> None:
        """Give ``nbytes`` of receive window back to the client (RFC 9113 §6.9)."""
        # While DRAINING the running streams may still be uploading.
        if nbytes and self.state is not H2State.CLOSED:
            try:
                self.conn.acknowledge_received_data(nbytes, stream)
            except h2.exceptions.ProtocolError:
                pass  # the stream closed meanwhile; h2 refuses, nothing to give back

    def goaway(self) -> None:
        """Graceful GOAWAY(NO_ERROR) for shutdown and the idle / header timers: the streams
        open now may finish (``drain``), later ones get REFUSED_STREAM."""
        self.drain()

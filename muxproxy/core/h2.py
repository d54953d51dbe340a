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
"""

from __future__ import annotations

import contextlib
import enum

import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from .h2decode import OVERSIZED, HeaderBlockFlood, HeaderDecoder
from .h2goaway import GoawayTolerantReceiver
from .h2guard import CONTROL_FRAME_BUDGET, RESET_BUDGET, STREAM_ID_DRAIN, H2Guard
from .h2send import BlockedStreams, Flushed, SendQueue, flush_queue, send_or_queue
from .headers import header_value
from .intake import MalformedRequest, request_from_h2
from .messages import Abort, Body, End, Headers, Message, Refused, ResponseHead

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# The connection-level receive window we open at start (RFC 9113 §6.9.2: only the stream level
# has a SETTINGS parameter). Large enough that one stalled stream, holding its own 64 KiB
# window unacknowledged, never starves the others; bounded so a client cannot make us buffer
# more than streams x stream window.
CONNECTION_WINDOW = 16 * 1024 * 1024


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


# The stream limit python-h2 itself enforces (see ``H2Server.__init__``): far above what one
# read of at most 64 KiB can open (a HEADERS frame is at least 9 bytes plus its block).
H2_ENFORCED_STREAMS = 2**31 - 1

BLOCKS_PER_READ_FACTOR = 2
"""Header blocks one read may carry, in multiples of MAX_CONCURRENT_STREAMS: the streams there
is room for, as many again refused (a client that had not seen our SETTINGS yet) and the
trailers of open streams. Past it, GOAWAY(ENHANCE_YOUR_CALM) inside the read
(``h2decode.HeaderBlockFlood``)."""

_HUGE_LENGTH = 10**18

SHUTDOWN_PING = b"muxstop\x00"
"""The opaque data of the PING that follows the first GOAWAY of a graceful stop; its ACK
means the client has seen that GOAWAY (RFC 9113 §6.7: the ACK echoes the data)."""

MAX_STREAM_ID = 2**31 - 1
"""RFC 9113 §5.1.1: the largest stream id; the first GOAWAY of a graceful stop names it."""

_OPEN_STATE = h2.connection.ConnectionState.SERVER_OPEN
_CLOSED_STATE = h2.connection.ConnectionState.CLOSED


class H2State(enum.Enum):
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


class H2Server:
    """HTTP/2 for one client connection."""

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
    ) -> None:
        """``upgrade_settings``: the client's HTTP2-Settings value when this connection was
        upgraded from HTTP/1.1 (h2c.py); raises h2's ``ProtocolError`` if they are invalid."""
        config = h2.config.H2Configuration(
            client_side=False,
            header_encoding=None,
            validate_inbound_headers=False,
            normalize_inbound_headers=False,
        )
        self.conn = h2.connection.H2Connection(config=config)
        self.receiver = GoawayTolerantReceiver()
        # h2 keeps hpack's 64 KiB default list size unless a SETTINGS change is acknowledged,
        # and an initial value is not a change: the decoder is ours, with our limit
        # (``h2decode``; ``decoder`` is h2's public attribute, read at every header block).
        self.decoder = HeaderDecoder(
            limit=max_header_list_size, blocks=BLOCKS_PER_READ_FACTOR * max_concurrent_streams
        )
        self.conn.decoder = self.decoder
        self.scheme = scheme
        self.max_streams = max_concurrent_streams
        settings = {
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: max_concurrent_streams,
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: max_header_list_size,
            # RFC 8441 §3: we accept extended CONNECT (WebSockets over HTTP/2, tunnel.py).
            h2.settings.SettingCodes.ENABLE_CONNECT_PROTOCOL: 1,
        }
        self.conn.local_settings = h2.settings.Settings(client=False, initial_values=settings)
        if upgrade_settings is None:
            self.conn.initiate_connection()
        else:
            # RFC 7540 §3.2: the settings count as the client's first SETTINGS (no ACK), and
            # the upgraded request is stream 1, half-closed (remote).
            self.conn.initiate_upgrade_connection(upgrade_settings)
        # RFC 9113 §5.1.2: a stream past the advertised MAX_CONCURRENT_STREAMS is a stream
        # error (REFUSED_STREAM), the others go on. python-h2 enforces its local value as a
        # connection error, so once the SETTINGS above are on their way the value h2 enforces
        # is raised past anything one read can open, and ``_request`` refuses the extra
        # streams itself.
        settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = H2_ENFORCED_STREAMS
        self.conn.local_settings = h2.settings.Settings(client=False, initial_values=settings)
        if initial_window != 65535:
            # Sent as a change rather than an initial value: h2 applies it only once the
            # client acknowledged it, so a client that sends a default 65,535-byte window
            # before it saw our SETTINGS is within its rights (RFC 9113 §6.5.3, §6.9.2).
            self.conn.update_settings(
                {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: initial_window}
            )
        if connection_window > 65535:
            self.conn.increment_flow_control_window(connection_window - 65535)
        self.queues: dict[int, SendQueue] = {}
        if upgrade_settings is not None:
            self.queues[1] = SendQueue()  # the response to the upgraded request
        self.blocked = BlockedStreams()
        """Streams with data waiting for window."""
        self.window_changed = False
        """A WINDOW_UPDATE or SETTINGS arrived since the owner last flushed ``blocked``."""
        self.trailers: dict[int, Headers] = {}
        self.receiving: set[int] = set()
        """Streams whose response ended while their request side still goes to the owner
        (``keep_receiving``: a tunnel that relays a half-close, RFC 8441 §5)."""
        self.body_left: dict[int, int] = {}
        """Request body bytes still due by Content-Length, for streams that declared one."""
        self.state = H2State.OPEN
        self.guard = H2Guard(reset_budget=reset_budget, control_budget=control_budget)
        self.last_stream: int | None = None
        """DRAINING: the last stream id served; later ones are refused."""

    @property
    def closed(self) -> bool:
        """A final GOAWAY was sent or received: no new streams."""
        state = self.state
        return state is H2State.DRAINING or state is H2State.CLOSED

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
                    and self.state is H2State.GOING_AWAY
                ):
                    # RFC 9113 §6.8: the client saw the first GOAWAY; the streams it opened
                    # before that are all here (the frames before this ACK), so the final
                    # GOAWAY can name the real last stream.
                    self.drain()
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
            head = request_from_h2(sid, fields, scheme_default=self.scheme)
            length = header_value(head.headers, b"content-length")
            declared = None
            if length is not None:
                # Digits only (intake). Past 18 of them no body can match it, and int() of a
                # few thousand digits raises: count it as the largest we track.
                declared = int(length) if len(length) <= 18 else _HUGE_LENGTH
            if declared and event.stream_ended is not None:
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
        if event.stream_ended is not None:
            return [attrs.evolve(head, end_stream=True), End(stream=sid)]
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
        if self.state is H2State.CLOSED:
            return []  # already closed by a connection error or an earlier flood
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.conn.close_connection(
                error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM,
                additional_data=reason[:64].encode(),
            )
        return self._abort_all(f"HTTP/2 abuse: {reason}")

    def _abort_all(self, reason: str) -> list[Message]:
        self.state = H2State.CLOSED
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
        if self.state is not H2State.OPEN and self.state is not H2State.GOING_AWAY:
            return
        conn = self.conn
        if last_stream is None:
            last_stream = conn.highest_inbound_stream_id
        self.last_stream = last_stream
        conn.close_connection(error_code=h2.errors.ErrorCodes.NO_ERROR, last_stream_id=last_stream)
        conn.state_machine.state = _OPEN_STATE
        self.state = H2State.DRAINING

    def announce_shutdown(self) -> None:
        """The first step of a graceful stop (RFC 9113 §6.8): GOAWAY(NO_ERROR) with
        last-stream-id 2^31-1, so the client opens no more streams, then a PING whose ACK
        tells when the streams it sent before it saw the GOAWAY have all arrived (the ACK
        follows them on the wire). Streams keep being taken meanwhile (``GOING_AWAY``); the
        owner bounds the wait for the ACK and then calls ``drain`` itself."""
        if self.state is not H2State.OPEN:
            return
        conn = self.conn
        conn.close_connection(
            error_code=h2.errors.ErrorCodes.NO_ERROR, last_stream_id=MAX_STREAM_ID
        )
        conn.state_machine.state = _OPEN_STATE  # as in ``drain``: the streams go on
        conn.ping(SHUTDOWN_PING)
        self.state = H2State.GOING_AWAY

    def _goaway_received(self) -> None:
        """RFC 9113 §6.8: the client opens no more streams (whatever its error code says, a
        client that is going away still reads); the responses to its open streams finish."""
        if self.state is H2State.OPEN or self.state is H2State.GOING_AWAY:
            self.state = H2State.DRAINING
            self.last_stream = self.conn.highest_inbound_stream_id

    def _connection_error(self, exc: h2.exceptions.ProtocolError) -> list[Message]:
        """RFC 9113 §5.4.1: one GOAWAY, with the error's code. h2 queued it already unless it
        raised before its frame loop (an invalid preface: its state is not CLOSED then). No
        debug data: h2's error text is about its own code, not for the client."""
        if self.conn.state_machine.state is not _CLOSED_STATE:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.conn.close_connection(error_code=exc.error_code)
        if isinstance(exc, (HeaderBlockFlood, h2.exceptions.DenialOfServiceError)):
            self.guard.abuse(str(exc))
        return self._abort_all(f"connection error: {exc}")

    # -- sending ---------------------------------------------------------------------------

    def send_head(self, head: ResponseHead, *, end_stream: bool = False) -> None:
        """Send the response HEADERS; ``end_stream`` makes it a complete (Trailers-Only)
        response."""
        if head.stream not in self.queues:
            return
        headers = [(b":status", str(head.status).encode()), *head.headers]
        try:
            self.conn.send_headers(head.stream, headers, end_stream=end_stream)
        except h2.exceptions.StreamClosedError:
            self._closed_by_client(head.stream)
            return
        if end_stream:
            self.blocked.discard(head.stream)
            self.queues.pop(head.stream, None)
            self.guard.response_completed()

    def send_body(self, stream: int, data: bytes) -> bool:
        """Send or queue ``data``; True when with it the stream starts to wait for a window
        (its owner bounds such a wait: ``timeouts.send``)."""
        queue = self.queues.get(stream)
        if queue is None:
            return False
        self.guard.response_chunk()
        try:
            return self._settle(stream, send_or_queue(self.conn, stream, queue, data))
        except h2.exceptions.StreamClosedError:
            self._closed_by_client(stream)
            return False

    def send_end(self, stream: int, trailers: Headers) -> None:
        queue = self.queues.get(stream)
        if queue is None:
            return
        queue.end = True
        queue.end_trailers = trailers
        self._flush(stream, queue)

    def _closed_by_client(self, stream: int) -> None:
        """h2 already closed ``stream``: its RST_STREAM came in the same read as the request,
        so h2 processed it before the response was made. Its ``Abort`` is on its way."""
        self.blocked.discard(stream)
        self.queues.pop(stream, None)

    def abort(self, stream: int, code: h2.errors.ErrorCodes) -> None:
        self.blocked.discard(stream)
        if self.queues.pop(stream, None) is None and stream not in self.receiving:
            return
        self._reset(stream, code)

    def keep_receiving(self, stream: int) -> None:
        """Deliver ``stream``'s DATA and END_STREAM after its response ended (END_STREAM
        sent): a tunnel whose backend side ended first still relays the client's side."""
        if stream in self.queues:
            self.receiving.add(stream)

    def cancel_request(self, stream: int) -> None:
        """The response is complete; tell the client to stop sending the request body."""
        self._reset(stream, h2.errors.ErrorCodes.NO_ERROR)

    def _reset(self, stream: int, code: h2.errors.ErrorCodes) -> None:
        self.receiving.discard(stream)
        try:
            self.conn.reset_stream(stream, code)
        except h2.exceptions.ProtocolError:
            pass  # already closed on the wire (e.g. the client reset it first)

    def acknowledge(self, stream: int, nbytes: int) -> None:
        """Give ``nbytes`` of receive window back to the client (RFC 9113 §6.9)."""
        # While DRAINING the running streams may still be uploading.
        if nbytes and self.state is not H2State.CLOSED:
            try:
                self.conn.acknowledge_received_data(nbytes, stream)
            except h2.exceptions.ProtocolError:
                pass  # the stream closed meanwhile; h2 refuses, nothing to give back

    def queued(self, stream: int) -> int:
        queue = self.queues.get(stream)
        return 0 if queue is None else queue.size

    def window_closed(self, stream: int) -> bool:
        """The client's window for ``stream`` (or the connection's) is closed: no queued byte
        of it can be sent until a WINDOW_UPDATE (RFC 9113 §6.9)."""
        try:
            return self.conn.local_flow_control_window(stream) <= 0
        except h2.exceptions.StreamClosedError:
            return False

    def flush_blocked(self) -> list[int]:
        """Send what windows now allow; return the streams whose queues shrank."""
        drained = []
        for stream in self.blocked.in_order():
            queue = self.queues.get(stream)
            if queue is None:
                continue
            before = queue.size
            self._flush(stream, queue)
            if queue.size < before:
                drained.append(stream)
                self.blocked.served(stream)
        return drained

    def finished(self, stream: int) -> bool:
        """The response for ``stream`` went out completely (END_STREAM sent)."""
        return stream not in self.queues

    def goaway(self) -> None:
        """Graceful GOAWAY(NO_ERROR) for shutdown and the idle / header timers: the streams
        open now may finish (``drain``), later ones get REFUSED_STREAM."""
        self.drain()

    def _flush(self, stream: int, queue: SendQueue) -> None:
        try:
            self._settle(stream, flush_queue(self.conn, stream, queue))
        except h2.exceptions.StreamClosedError:
            self._closed_by_client(stream)

    def _settle(self, stream: int, state: Flushed) -> bool:
        """Record the stream's send state; True when it starts to wait for a window."""
        if state is Flushed.BLOCKED:
            if stream in self.blocked:
                return False
            self.blocked.add(stream)
            return True
        self.blocked.discard(stream)
        if state is Flushed.ENDED:
            del self.queues[stream]
            self.guard.response_completed()
        return False

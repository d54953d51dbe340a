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
  block does not become a connection error; ``headers.request_from_h2`` validates instead.
- Frame-level violations are connection errors (RFC 9113 §5.4.1): GOAWAY with h2's error code,
  after which ``closed`` is true.
"""

from __future__ import annotations

import contextlib

import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from .h2send import Flushed, SendQueue, flush_queue, send_or_queue
from .headers import MalformedRequest, request_from_h2
from .messages import Abort, Body, End, Headers, Message, ResponseHead

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# The connection-level receive window we open at start (RFC 9113 §6.9.2: only the stream level
# has a SETTINGS parameter). Large enough that one stalled stream, holding its own 64 KiB
# window unacknowledged, never starves the others; bounded so a client cannot make us buffer
# more than streams x stream window.
CONNECTION_WINDOW = 16 * 1024 * 1024


class H2Server:
    """HTTP/2 for one client connection."""

    def __init__(
        self,
        *,
        scheme: bytes,
        max_concurrent_streams: int = 100,
        initial_window: int = 65535,
        max_header_list_size: int = 64 * 1024,
        upgrade_settings: bytes | None = None,
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
        self.scheme = scheme
        self.conn.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: max_concurrent_streams,
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: max_header_list_size,
                # RFC 8441 §3: we accept extended CONNECT (WebSockets over HTTP/2, tunnel.py).
                h2.settings.SettingCodes.ENABLE_CONNECT_PROTOCOL: 1,
            },
        )
        if upgrade_settings is None:
            self.conn.initiate_connection()
        else:
            # RFC 7540 §3.2: the settings count as the client's first SETTINGS (no ACK), and
            # the upgraded request is stream 1, half-closed (remote).
            self.conn.initiate_upgrade_connection(upgrade_settings)
        if initial_window != 65535:
            # Sent as a change rather than an initial value: h2 applies it only once the
            # client acknowledged it, so a client that sends a default 65,535-byte window
            # before it saw our SETTINGS is within its rights (RFC 9113 §6.5.3, §6.9.2).
            self.conn.update_settings(
                {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: initial_window}
            )
        self.conn.increment_flow_control_window(CONNECTION_WINDOW - 65535)
        self.queues: dict[int, SendQueue] = {}
        if upgrade_settings is not None:
            self.queues[1] = SendQueue()  # the response to the upgraded request
        self.blocked: set[int] = set()
        """Streams with data waiting for window."""
        self.window_changed = False
        """A WINDOW_UPDATE or SETTINGS arrived since the owner last flushed ``blocked``."""
        self.trailers: dict[int, Headers] = {}
        self.closed = False
        """A GOAWAY was sent or received; no new streams."""

    def data_to_send(self) -> bytes:
        return self.conn.data_to_send()

    def receive(self, data: bytes) -> list[Message]:
        """Feed bytes; return messages. On a connection error, GOAWAY is queued and every open
        stream gets an ``Abort``."""
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            return self._connection_error(exc)
        out: list[Message] = []
        for event in events:
            if isinstance(event, h2.events.DataReceived):
                sid = event.stream_id
                if sid in self.queues or sid in self.trailers:
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
                if sid in self.queues:
                    out.append(End(stream=sid, trailers=self.trailers.pop(sid, [])))
            elif isinstance(event, h2.events.TrailersReceived):
                self.trailers[event.stream_id] = list(event.headers)
            elif isinstance(event, h2.events.StreamReset):
                sid = event.stream_id
                self.blocked.discard(sid)
                if self.queues.pop(sid, None) is not None:
                    out.append(
                        Abort(stream=sid, reason=f"client reset the stream ({event.error_code!r})")
                    )
            elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
                # RFC 9113 §6.9.2: a SETTINGS change of the initial window applies to every
                # stream, so any of them may have room now.
                self.window_changed = True
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.closed = True
        return out

    def _request(self, event: h2.events.RequestReceived) -> list[Message]:
        sid = event.stream_id
        try:
            head = request_from_h2(sid, list(event.headers), scheme_default=self.scheme)
        except MalformedRequest:
            # RFC 9113 §8.1.1: a malformed request is a stream error of type PROTOCOL_ERROR.
            self.conn.reset_stream(sid, h2.errors.ErrorCodes.PROTOCOL_ERROR)
            return []
        self.queues[sid] = SendQueue()
        if event.stream_ended is not None:
            return [attrs.evolve(head, end_stream=True), End(stream=sid)]
        return [head]

    def _connection_error(self, exc: h2.exceptions.ProtocolError) -> list[Message]:
        code = getattr(exc, "error_code", h2.errors.ErrorCodes.PROTOCOL_ERROR)
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.conn.close_connection(error_code=code, additional_data=str(exc)[:64].encode())
        self.closed = True
        out: list[Message] = [
            Abort(stream=sid, reason=f"connection error: {exc}") for sid in self.queues
        ]
        self.queues.clear()
        self.blocked.clear()
        return out

    # -- sending ---------------------------------------------------------------------------

    def send_head(self, head: ResponseHead, *, end_stream: bool = False) -> None:
        """Send the response HEADERS; ``end_stream`` makes it a complete (Trailers-Only)
        response."""
        headers = [(b":status", str(head.status).encode()), *head.headers]
        self.conn.send_headers(head.stream, headers, end_stream=end_stream)
        if end_stream:
            self.blocked.discard(head.stream)
            self.queues.pop(head.stream, None)

    def send_body(self, stream: int, data: bytes) -> None:
        queue = self.queues.get(stream)
        if queue is None:
            return
        self._settle(stream, send_or_queue(self.conn, stream, queue, data))

    def send_end(self, stream: int, trailers: Headers) -> None:
        queue = self.queues.get(stream)
        if queue is None:
            return
        queue.end = True
        queue.end_trailers = trailers
        self._flush(stream, queue)

    def abort(self, stream: int, code: h2.errors.ErrorCodes) -> None:
        self.blocked.discard(stream)
        if self.queues.pop(stream, None) is None:
            return
        self._reset(stream, code)

    def cancel_request(self, stream: int) -> None:
        """The response is complete; tell the client to stop sending the request body."""
        self._reset(stream, h2.errors.ErrorCodes.NO_ERROR)

    def _reset(self, stream: int, code: h2.errors.ErrorCodes) -> None:
        try:
            self.conn.reset_stream(stream, code)
        except h2.exceptions.ProtocolError:
            pass  # already closed on the wire (e.g. the client reset it first)

    def acknowledge(self, stream: int, nbytes: int) -> None:
        """Give ``nbytes`` of receive window back to the client (RFC 9113 §6.9)."""
        if nbytes and not self.closed:
            try:
                self.conn.acknowledge_received_data(nbytes, stream)
            except h2.exceptions.ProtocolError:
                pass  # the stream closed meanwhile; h2 refuses, nothing to give back

    def queued(self, stream: int) -> int:
        queue = self.queues.get(stream)
        return 0 if queue is None else queue.size

    def flush_blocked(self) -> list[int]:
        """Send what windows now allow; return the streams whose queues shrank."""
        drained = []
        for stream in list(self.blocked):
            queue = self.queues[stream]
            before = queue.size
            self._flush(stream, queue)
            if queue.size < before:
                drained.append(stream)
        return drained

    def finished(self, stream: int) -> bool:
        """The response for ``stream`` went out completely (END_STREAM sent)."""
        return stream not in self.queues

    def goaway(self) -> None:
        if not self.closed:
            self.conn.close_connection()
            self.closed = True

    def _flush(self, stream: int, queue: SendQueue) -> None:
        self._settle(stream, flush_queue(self.conn, stream, queue))

    def _settle(self, stream: int, state: Flushed) -> None:
        if state is Flushed.BLOCKED:
            self.blocked.add(stream)
            return
        self.blocked.discard(stream)
        if state is Flushed.ENDED:
            del self.queues[stream]

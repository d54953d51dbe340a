"""HTTP/2 client adapter: one ``h2.H2Connection`` facing a backend, translated to core messages.

Obeys RFC 9113 through h2 and adds what h2 leaves to its user, mirroring ``h2.H2Server``:

- Flow control both ways (RFC 9113 §5.2, §6.9). Outbound (request bodies), each stream has a
  send queue (``h2send``) clamped to the backend's window. Inbound (responses), nothing is
  acknowledged here: the owner calls ``acknowledge`` once the client side took the bytes, so a
  client that stops reading closes its own backend stream's window and no other's. The
  connection-level window is opened wide at the start for the same reason as on the server side.
- Responses (RFC 9113 §8.1): 1xx heads are dropped (hop by hop for us); a HEADERS that ends the
  stream (gRPC's Trailers-Only) is a head marked ``end_stream``, whole, so that an HTTP/2
  client gets it as it was sent (``grpc.py``); its ``End`` repeats the gRPC status fields as
  trailers for an HTTP/1.1 client, which gets them in its chunked trailers. h2 hands us the head
  unvalidated (inbound validation is off, as on the server side): a :status that is not three
  digits, or a field that is not valid by RFC 9113 §8.2.1, makes the response malformed
  (§8.1.1): RST_STREAM(PROTOCOL_ERROR) and an ``Abort`` (a 502), never relayed.
- GOAWAY (RFC 9113 §6.8): ``goaway_last_stream`` records the last stream the backend will
  process; streams above it were refused and are aborted (``refused`` says so: safe to retry,
  RFC 9113 §8.7, nothing was processed). Streams up to it may finish, so a received GOAWAY
  leaves h2's connection state open (``h2goaway``): the frames after it, in the same
  read or later, are still processed. A GOAWAY with an error code aborts every stream.
- An empty DATA frame (typically the one that carries END_STREAM) is no ``Body``: the client
  side would send it on as an empty DATA frame of its own (RFC 9113 §6.1 allows it, but it is
  a frame for nothing); its padding, if any, is acknowledged at once.
- Frame-level violations by the backend are connection errors (RFC 9113 §5.4.1): GOAWAY sent,
  every open stream aborted, ``closed`` set.
"""

from __future__ import annotations

import contextlib

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from muxproxy.core.http.grpc import STATUS_FIELDS
from muxproxy.core.http.intake import valid_h2_fields
from muxproxy.core.http2.h2 import CONNECTION_WINDOW
from muxproxy.core.http2.h2encode import HeaderEncoder
from muxproxy.core.http2.h2goaway import GoawayTolerantReceiver
from muxproxy.core.http2.h2send import (
    BlockedStreams,
    Flushed,
    SendQueue,
    flush_queue,
    send_or_queue,
)
from muxproxy.core.http2.h2slimsettings import SlimSettings
from muxproxy.core.messages import Abort, Body, End, Headers, Message, ResponseHead

# RFC 9113 §5.1.1: stream ids are 31 bits and never reused; a client that used them all opens a
# new connection.
MAX_STREAM_ID = 2**31 - 1


class H2Client:
    """HTTP/2 for one backend connection: requests out, responses in."""

    def __init__(self, *, initial_window: int = 65535, max_header_list_size: int = 64 * 1024):
        config = h2.config.H2Configuration(
            client_side=True,
            header_encoding=None,
            validate_inbound_headers=False,
            normalize_inbound_headers=False,
        )
        self.conn = h2.connection.H2Connection(config=config)
        # Our HPACK encoder, as on the server side (``h2encode``; h2's public ``encoder``).
        self.conn.encoder = HeaderEncoder()
        # Settings in a few hundred bytes rather than h2's 10 KiB (h2slimsettings).
        self.conn.remote_settings = SlimSettings(client=False)
        self.conn.local_settings = SlimSettings(
            client=True,
            initial_values={
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: max_header_list_size,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: initial_window,
            },
        )
        self.conn.initiate_connection()
        self.conn.increment_flow_control_window(CONNECTION_WINDOW - 65535)
        self.receiver = GoawayTolerantReceiver()
        self.queues: dict[int, SendQueue] = {}
        self.blocked = BlockedStreams()
        self.trailers: dict[int, Headers] = {}
        self.settings_received = False
        """The backend's first SETTINGS arrived: MAX_CONCURRENT_STREAMS is known."""
        self.window_changed = False
        self.goaway_last_stream: int | None = None
        self.ping_acked = False
        self.closed = False

    def data_to_send(self) -> bytes:
        return self.conn.data_to_send()

    @property
    def max_concurrent_streams(self) -> int:
        return int(self.conn.remote_settings.max_concurrent_streams)

    @property
    def extended_connect(self) -> bool:
        """The backend accepts RFC 8441 extended CONNECT (SETTINGS_ENABLE_CONNECT_PROTOCOL,
        RFC 8441 §3); known once its first SETTINGS arrived."""
        return bool(self.conn.remote_settings.enable_connect_protocol == 1)

    @property
    def open_streams(self) -> int:
        return int(self.conn.open_outbound_streams)

    @property
    def stream_ids_left(self) -> bool:
        """Another stream can be opened (RFC 9113 §5.1.1: ids are never reused)."""
        return int(self.conn.highest_outbound_stream_id) + 2 <= MAX_STREAM_ID

    # -- receiving -------------------------------------------------------------------------

    def receive(self, data: bytes) -> list[Message]:
        try:
            events = self.receiver.receive_data(self.conn, data)
        except h2.exceptions.ProtocolError as exc:
            return self.connection_error(f"bad HTTP/2 from backend: {exc}", exc)
        out: list[Message] = []
        for event in events:
            if isinstance(event, h2.events.DataReceived):
                sid = event.stream_id
                if event.data and sid in self.queues:
                    out.append(
                        Body(stream=sid, data=event.data, flow_len=event.flow_controlled_length)
                    )
                else:
                    # Data for a stream we reset, or none (an empty frame, maybe padded):
                    # nobody consumes it, give the window back.
                    self.acknowledge(sid, event.flow_controlled_length)
            elif isinstance(event, h2.events.ResponseReceived):
                out.extend(self._response(event))
            elif isinstance(event, h2.events.TrailersReceived):
                self.trailers[event.stream_id] = _fields(event.headers)
            elif isinstance(event, h2.events.StreamEnded):
                sid = event.stream_id
                if sid in self.queues:
                    out.append(End(stream=sid, trailers=self.trailers.pop(sid, [])))
            elif isinstance(event, h2.events.StreamReset):
                sid = event.stream_id
                if sid in self.queues:
                    self.forget(sid)
                    out.append(
                        Abort(stream=sid, reason=f"backend reset the stream ({event.error_code!r})")
                    )
            elif isinstance(event, h2.events.RemoteSettingsChanged):
                self.settings_received = True
                self.window_changed = True
            elif isinstance(event, h2.events.WindowUpdated):
                self.window_changed = True
            elif isinstance(event, h2.events.PingAckReceived):
                self.ping_acked = True
            elif isinstance(event, h2.events.ConnectionTerminated):
                last = event.last_stream_id if event.last_stream_id is not None else 0
                self.goaway_last_stream = last
                # RFC 9113 §6.8: streams above last_stream_id were not processed.
                for sid in [s for s in self.queues if s > last]:
                    self.forget(sid)
                    out.append(Abort(stream=sid, reason="backend sent GOAWAY (stream refused)"))
                if event.error_code != h2.errors.ErrorCodes.NO_ERROR:
                    out.extend(self._abort_all(f"backend GOAWAY {event.error_code!r}"))
        return out

    def _response(self, event: h2.events.ResponseReceived) -> list[Message]:
        sid = event.stream_id
        if sid not in self.queues:
            return []
        status = 0
        headers: Headers = []
        for name, value in event.headers:
            if name == b":status":
                status = int(value) if len(value) == 3 and value.isdigit() else 0
            elif not name.startswith(b":"):
                headers.append((name, value))
        if not 200 <= status <= 999 or not valid_h2_fields(headers):
            # RFC 9113 §8.1.1, §8.3.2: a malformed response is a stream error, never relayed.
            self.forget(sid)
            self._reset(sid, h2.errors.ErrorCodes.PROTOCOL_ERROR)
            return [Abort(stream=sid, reason="malformed response head from backend")]
        if event.stream_ended is None:
            return [ResponseHead(stream=sid, status=status, headers=headers)]
        # StreamEnded follows in the same event list and yields the End, with the status
        # fields again as trailers (``ResponseHead.end_stream``).
        self.trailers[sid] = [f for f in headers if f[0] in STATUS_FIELDS]
        return [ResponseHead(stream=sid, status=status, headers=headers, end_stream=True)]

    def refused(self, sid: int) -> bool:
        """``sid`` is above a GOAWAY's last_stream_id: the backend never processed it."""
        last = self.goaway_last_stream
        return last is not None and sid > last

    def connection_error(self, reason: str, exc: Exception | None = None) -> list[Message]:
        code = getattr(exc, "error_code", h2.errors.ErrorCodes.PROTOCOL_ERROR)
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.conn.close_connection(error_code=code)
        self.closed = True
        return self._abort_all(reason)

    def _abort_all(self, reason: str) -> list[Message]:
        out: list[Message] = [Abort(stream=sid, reason=reason) for sid in self.queues]
        self.queues.clear()
        self.blocked.clear()
        return out

    # -- sending ---------------------------------------------------------------------------

    def start_request(self, headers: Headers) -> int:
        """Open a stream with ``headers`` (pseudo-fields first); return its id."""
        sid: int = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, headers)
        self.queues[sid] = SendQueue()
        return sid

    def send_body(self, sid: int, data: bytes) -> None:
        queue = self.queues.get(sid)
        if queue is not None and not queue.end:
            self._settle(sid, send_or_queue(self.conn, sid, queue, data))

    def send_end(self, sid: int, trailers: Headers) -> None:
        queue = self.queues.get(sid)
        if queue is not None and not queue.end:
            queue.end = True
            queue.end_trailers = trailers
            self._settle(sid, flush_queue(self.conn, sid, queue))

    def flush_blocked(self) -> list[int]:
        """Send what windows now allow; return the streams whose queues shrank."""
        self.window_changed = False
        drained = []
        for sid in self.blocked.in_order():
            queue = self.queues[sid]
            before = queue.size
            self._settle(sid, flush_queue(self.conn, sid, queue))
            if queue.size < before:
                drained.append(sid)
                self.blocked.served(sid)
        return drained

    def _settle(self, sid: int, state: Flushed) -> None:
        if state is Flushed.BLOCKED:
            self.blocked.add(sid)
        else:
            self.blocked.discard(sid)

    def queued(self, sid: int) -> int:
        queue = self.queues.get(sid)
        return 0 if queue is None else queue.size

    def acknowledge(self, sid: int, nbytes: int) -> None:
        """Give ``nbytes`` of receive window back to the backend (RFC 9113 §6.9)."""
        if nbytes and not self.closed:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.conn.acknowledge_received_data(nbytes, sid)

    def cancel(self, sid: int) -> None:
        """RST_STREAM(CANCEL): the client is gone (RFC 9113 §8.7)."""
        if self.forget(sid):
            self._reset(sid, h2.errors.ErrorCodes.CANCEL)

    def forget(self, sid: int) -> bool:
        """Drop the stream's queue; whether it was known."""
        self.blocked.discard(sid)
        self.trailers.pop(sid, None)
        return self.queues.pop(sid, None) is not None

    def _reset(self, sid: int, code: h2.errors.ErrorCodes) -> None:
        with contextlib.suppress(h2.exceptions.ProtocolError, KeyError):
            self.conn.reset_stream(sid, code)

    def ping(self) -> None:
        self.ping_acked = False
        self.conn.ping(b"muxproxy")

    def goaway(self) -> None:
        if not self.closed:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.conn.close_connection()
            self.closed = True


def _fields(headers: list[tuple[bytes, bytes]]) -> Headers:
    return [(name, value) for name, value in headers if not name.startswith(b":")]

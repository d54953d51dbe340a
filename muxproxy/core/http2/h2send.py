"""Per-stream send queues into an HTTP/2 peer, shared by the server and client adapters, and
the server adapter's send side.

Obeys RFC 9113 §5.2 and §6.9: DATA never exceeds the stream's and the connection's send window,
nor the peer's SETTINGS_MAX_FRAME_SIZE (§4.2). h2 refuses rather than buffers, so what does not
fit waits here, per stream, until a WINDOW_UPDATE or a SETTINGS change (§6.9.2) opens room.
Trailers and END_STREAM wait behind the queued data (§8.1: trailers end the message).

One queue per stream keeps a slow reader's bytes out of every other stream's way; the owner
flushes the blocked ones when h2 reports ``WindowUpdated`` / ``RemoteSettingsChanged``.

``ResponseSender`` is the half of ``h2.H2Server`` that sends the responses (and resets
streams). ``H2Server`` is built on it (a base class, not a member), so the per-token
``send_body`` stays one method call. A stream has a response under way while it has a queue
here; ``H2Server``'s receiving half reads the same tables to know which streams are live.
"""

from __future__ import annotations

import enum

import h2.connection
import h2.errors
import h2.exceptions

from muxproxy.core.http2.h2guard import H2Guard
from muxproxy.core.http2.h2outbound import outbound_fields
from muxproxy.core.messages import Headers, ResponseHead


class Flushed(enum.Enum):
    BLOCKED = "blocked"
    """Data is left and the window is closed: wait for a WINDOW_UPDATE."""
    OPEN = "open"
    """Everything queued went out; the stream stays open for more."""
    ENDED = "ended"
    """Everything went out, END_STREAM included: forget the queue."""


class BlockedStreams:
    """Streams with data waiting for window, in the order they get the next window.

    RFC 9113 §5.3 leaves the order to the sender. Round robin: a stream that was served and is
    still blocked goes to the back, so the streams that share a connection window all make
    progress, and one fast stream cannot take every WINDOW_UPDATE (a set would serve the
    lowest stream ids first, every time).
    """

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: dict[int, None] = {}

    def add(self, stream: int) -> None:
        """Blocked now (a stream already waiting keeps its place)."""
        self._order.setdefault(stream)

    def __contains__(self, stream: int) -> bool:
        return stream in self._order

    def discard(self, stream: int) -> None:
        self._order.pop(stream, None)

    def clear(self) -> None:
        self._order.clear()

    def served(self, stream: int) -> None:
        """``stream`` got some window: if it still waits, it waits behind the others."""
        if self._order.pop(stream, 0) is None:
            self._order[stream] = None

    def in_order(self) -> list[int]:
        return list(self._order)


class SendQueue:
    __slots__ = ("chunks", "end", "end_trailers", "size")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0
        self.end = False
        self.end_trailers: Headers = []


def send_or_queue(
    conn: h2.connection.H2Connection, stream: int, queue: SendQueue, data: bytes
) -> Flushed:
    """Send ``data`` on ``stream`` as far as the window allows; queue the rest."""
    if queue.size == 0:
        if not data:
            return Flushed.OPEN  # an empty DATA frame would move nothing
        # Fast path: nothing waits, so the chunk goes out if it fits the window and the frame
        # size. h2 checks both before it changes any state and raises if either is too
        # small: asking it first would compute the window twice per token.
        try:
            conn.send_data(stream, data)
            return Flushed.OPEN
        except (h2.exceptions.FlowControlError, h2.exceptions.FrameTooLargeError):
            pass
    queue.chunks.append(data)
    queue.size += len(data)
    return flush_queue(conn, stream, queue)


def flush_queue(conn: h2.connection.H2Connection, stream: int, queue: SendQueue) -> Flushed:
    """Send what the window allows, then trailers or END_STREAM once the data is out."""
    chunks = queue.chunks
    while chunks:
        room = min(conn.local_flow_control_window(stream), conn.max_outbound_frame_size)
        if room <= 0:
            return Flushed.BLOCKED
        chunk = chunks[0]
        if len(chunk) <= room:
            chunks.pop(0)
        else:
            chunks[0] = chunk[room:]
            chunk = chunk[:room]
        conn.send_data(stream, chunk)
        queue.size -= len(chunk)
    if not queue.end:
        return Flushed.OPEN
    if queue.end_trailers:
        conn.send_headers(stream, queue.end_trailers, end_stream=True)
    else:
        conn.end_stream(stream)
    return Flushed.ENDED


class ResponseSender:
    """The responses of one HTTP/2 server connection: HEADERS, DATA within the client's
    windows (RFC 9113 §6.9), trailers or END_STREAM, and RST_STREAM."""

    def __init__(self, conn: h2.connection.H2Connection, guard: H2Guard) -> None:
        self.conn = conn
        self.guard = guard
        self.queues: dict[int, SendQueue] = {}
        """Streams whose response is not complete (END_STREAM not sent), and what of it waits."""
        self.blocked = BlockedStreams()
        """Streams with data waiting for window."""
        self.receiving: set[int] = set()
        """Streams whose response ended while their request side still goes to the owner
        (``keep_receiving``: a tunnel that relays a half-close, RFC 8441 §5)."""

    def send_head(self, head: ResponseHead, *, end_stream: bool = False) -> None:
        """Send the response HEADERS; ``end_stream`` makes it a complete (Trailers-Only)
        response."""
        if head.stream not in self.queues:
            return
        headers = [(b":status", str(head.status).encode()), *outbound_fields(head.headers)]
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
            state = send_or_queue(self.conn, stream, queue, data)
            if state is Flushed.OPEN and not queue.size:
                return False  # nothing queued, so the stream was not among the blocked ones
            return self._settle(stream, state)
        except h2.exceptions.StreamClosedError:
            self._closed_by_client(stream)
            return False

    def send_end(self, stream: int, trailers: Headers) -> None:
        queue = self.queues.get(stream)
        if queue is None:
            return
        queue.end = True
        queue.end_trailers = outbound_fields(trailers) if trailers else trailers
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

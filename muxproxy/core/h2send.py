"""Per-stream send queues into an HTTP/2 peer, shared by the server and client adapters.

Obeys RFC 9113 §5.2 and §6.9: DATA never exceeds the stream's and the connection's send window,
nor the peer's SETTINGS_MAX_FRAME_SIZE (§4.2). h2 refuses rather than buffers, so what does not
fit waits here, per stream, until a WINDOW_UPDATE or a SETTINGS change (§6.9.2) opens room.
Trailers and END_STREAM wait behind the queued data (§8.1: trailers end the message).

One queue per stream keeps a slow reader's bytes out of every other stream's way; the owner
flushes the blocked ones when h2 reports ``WindowUpdated`` / ``RemoteSettingsChanged``.
"""

from __future__ import annotations

import enum

import h2.connection

from .messages import Headers


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
        # Fast path: the whole chunk fits the window and the frame size.
        room = min(conn.local_flow_control_window(stream), conn.max_outbound_frame_size)
        if len(data) <= room:
            conn.send_data(stream, data)
            return Flushed.OPEN
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

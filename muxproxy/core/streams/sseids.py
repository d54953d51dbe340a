"""Event ids for a resumable SSE stream: each complete event gets ``id: <token>.<seq>``.

Obeys the event stream interpretation of WHATWG HTML §9.2.6:

- An event ends at an empty line. Lines end with LF, CRLF or CR; a stream's line end is taken
  from its first line, as ``ssemeter.py`` does (no server mixes them).
- An ``id`` field sets the event source's last event id, the last one in an event winning;
  the browser sends it back as ``Last-Event-ID`` when it reconnects (§9.2.4). So an ``id:``
  line put just before the empty line names the event whatever it carried, and changes
  nothing else a client parser sees (the data, event type and retry fields are untouched).
- A block of comment lines only (``: keep-alive``) is not an event: it passes unnumbered.

What it decides, by the first event that is not a comment:

- **Stamping**: that event has no ``id`` field, so the proxy numbers the stream. Events are
  sent as they complete (a client dispatches nothing before the empty line anyway), each with
  its id, and handed to the caller as ``(seq, bytes)`` to keep for a resume. A partial event
  larger than ``limit`` cannot be kept: the stream falls back to passing bytes through, and
  ``overflowed`` says that resume is lost for it.
- **Pass-through**: the backend numbers its events itself; its resume is its own, and every
  byte passes untouched from then on (``stamping`` is False).

Pure and incremental: one ``feed`` per backend chunk, no clock, no I/O.
"""

from __future__ import annotations

import enum

_LF = 0x0A


class Mode(enum.Enum):
    UNDECIDED = "undecided"
    STAMPING = "stamping"
    PASSTHROUGH = "passthrough"


Stamped = list[tuple[int, bytes]]
"""The events completed by one chunk: their sequence numbers and their bytes as sent."""


class EventStamper:
    """Numbers one SSE stream's events, chunk by chunk (see the module)."""

    __slots__ = ("id_prefix", "limit", "line_end", "mode", "overflowed", "pending", "seq")

    def __init__(self, token: bytes, *, limit: int) -> None:
        self.id_prefix = b"id: " + token + b"."
        self.limit = limit
        """Most bytes of one incomplete event held before giving up."""
        self.mode = Mode.UNDECIDED
        self.line_end: bytes | None = None
        self.pending = b""
        """The incomplete event at the end of what was fed."""
        self.seq = 0
        """The last sequence number given."""
        self.overflowed = False

    @property
    def stamping(self) -> bool:
        return self.mode is not Mode.PASSTHROUGH

    def feed(self, data: bytes) -> tuple[bytes, Stamped]:
        """The bytes for the client now, and the events ``data`` completed."""
        if self.mode is Mode.PASSTHROUGH:
            return data, []
        buffer = self.pending + data if self.pending else data
        line_end = self.line_end
        if line_end is None:
            line_end = self.line_end = _line_end(buffer)
            if line_end is None:
                return self._hold(buffer, 0, [], b"")
        separator = line_end + line_end
        out: list[bytes] = []
        events: Stamped = []
        start = 0
        while (end := buffer.find(separator, start)) >= 0:
            stop = end + len(separator)
            event = buffer[start:stop]
            start = stop
            lines = event[: -len(separator)].split(line_end)
            if all(line[:1] == b":" for line in lines):
                out.append(event)  # a comment block: not an event
                continue
            if self.mode is Mode.UNDECIDED:
                if any(line == b"id" or line.startswith(b"id:") for line in lines):
                    # The backend's own ids: everything from here on passes untouched.
                    self.mode = Mode.PASSTHROUGH
                    self.pending = b""
                    return b"".join(out) + buffer[start - len(event) :], events
                self.mode = Mode.STAMPING
            self.seq = seq = self.seq + 1
            stamped = b"%s%s%d%s" % (event[: -len(line_end)], self.id_prefix, seq, separator)
            out.append(stamped)
            events.append((seq, stamped))
        return self._hold(buffer, start, events, b"".join(out))

    def _hold(
        self, buffer: bytes, start: int, events: Stamped, out: bytes
    ) -> tuple[bytes, Stamped]:
        """Keep ``buffer[start:]`` (an incomplete event) unless it is too large."""
        rest = buffer[start:] if start else buffer
        if len(rest) > self.limit:
            self.mode = Mode.PASSTHROUGH
            self.overflowed = True
            self.pending = b""
            return out + rest, events
        self.pending = rest
        return out, events

    def flush(self) -> bytes:
        """The stream ended: whatever incomplete event is held goes as it is."""
        rest, self.pending = self.pending, b""
        return rest


def _line_end(data: bytes) -> bytes | None:
    """The line end of the first line in ``data``; None: not known yet."""
    lf, cr = data.find(b"\n"), data.find(b"\r")
    if cr < 0 or 0 <= lf < cr:
        return b"\n" if lf >= 0 else None
    if cr + 1 == len(data):
        return None  # CR or CRLF: the next byte tells
    return b"\r\n" if data[cr + 1] == _LF else b"\r"

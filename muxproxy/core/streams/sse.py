"""Where an SSE stream may take a keep-alive comment: an incremental event-boundary tracker.

Obeys the event stream interpretation of WHATWG HTML §9.2.6: a line ends with CRLF, LF or CR
(a CR at the end of one chunk and an LF at the start of the next are one CRLF), and an empty
line dispatches the event collected since the last one.

The one question asked is "is the stream, after the bytes seen so far, between two events?".
The answer is yes only right after an empty line (or before the first byte): there the data
and event-type buffers are empty, so the comment line plus empty line of a heartbeat
(``: keep-alive``) change nothing a client parser sees. Anywhere else it is no — also after a
comment line or an ``id:``/``retry:`` line, where an inserted empty line would be harmless or
would reset a pending ``event:`` type; being conservative costs at most one delayed heartbeat.

Theory of operation: the answer depends only on the run of CR/LF bytes that ends the stream
so far. ``feed`` therefore scans each chunk backwards over its trailing CR/LF bytes — usually
two (``\\n\\n``) — and never looks at the rest; only a chunk made entirely of line ends needs
the state left by the previous one. The state is the position (mid-line, at the start of a
line after a non-empty one, at a boundary) and whether the last byte was a CR, whose LF, if it
comes first in the next chunk, ends no further line.

Known limit: a heartbeat sent before a stream's first byte precedes a leading UTF-8 BOM, which
a client strips only at the very start; backends do not send one in practice.
"""

from __future__ import annotations

import enum

HEARTBEAT = b": keep-alive\n\n"
"""An SSE comment line and the empty line after it (WHATWG HTML §9.2.6: a line starting with
a colon is ignored)."""

_CR = 0x0D
_LF = 0x0A


class Position(enum.Enum):
    MID_LINE = "mid_line"
    """Inside a line that has at least one byte."""
    LINE_START = "line_start"
    """A non-empty line just ended: an event (or a comment block) is being collected."""
    BOUNDARY = "boundary"
    """An empty line just ended, or nothing was received: between events."""


class EventBoundary:
    """Tracks one SSE byte stream, chunk by chunk; ``at_boundary`` says if a comment may go in."""

    __slots__ = ("after_cr", "position")

    def __init__(self) -> None:
        self.position = Position.BOUNDARY
        self.after_cr = False
        """The last byte was a CR: an LF first in the next chunk completes that CRLF."""

    @property
    def at_boundary(self) -> bool:
        return self.position is Position.BOUNDARY

    def feed(self, data: bytes) -> None:
        end = len(data)
        start = end
        while start and (data[start - 1] == _LF or data[start - 1] == _CR):
            start -= 1
        if start:
            # Some other byte precedes the trailing line ends: they start mid-line.
            position = Position.MID_LINE
            after_cr = False
        elif end:
            position = self.position
            after_cr = self.after_cr
        else:
            return
        for index in range(start, end):
            byte = data[index]
            if byte == _LF and after_cr:
                after_cr = False  # the second half of a CRLF ends no line
                continue
            after_cr = byte == _CR
            position = Position.LINE_START if position is Position.MID_LINE else Position.BOUNDARY
        self.position = position
        self.after_cr = after_cr

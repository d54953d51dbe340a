"""The client connection preface, checked whole: the 24 octets, then a SETTINGS frame.

RFC 9113 §3.4: the client preface is the string ``PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n``
followed by a SETTINGS frame, and an invalid preface is a connection error of type
PROTOCOL_ERROR. python-h2 checks the string (``FrameBuffer``) but takes any frame after it,
so a client that opens with a PING, a HEADERS or garbage that parses as a frame was served.
``SettingsFirstBuffer`` is h2's frame buffer with the second half of the check: once the
first frame's type octet has arrived it must be SETTINGS (0x4), else ``add_data`` raises
h2's ``ProtocolError`` exactly as for a bad string, and ``H2Server`` answers with
GOAWAY(PROTOCOL_ERROR) and closes: on the TLS port, on the shared plain port (prior
knowledge, ``detect.py``) and after an h2c upgrade (RFC 7540 §3.5: the preface follows the
101 there too).

The check costs one comparison per read until the type octet is in, then one attribute test
per read; the per-frame path (``__next__``) is h2's own, untouched. It reads only what it is
fed (the first ``_TYPE_AT + 1`` bytes), none of h2's private state.
"""

from __future__ import annotations

import h2.exceptions
import h2.frame_buffer

_SETTINGS = 0x4
"""RFC 9113 §6.5: the SETTINGS frame type."""
_TYPE_AT = 24 + 3
"""Offset of the first frame's type octet: after the 24-octet preface string and the
frame's 24-bit length (§4.1)."""


class SettingsFirstBuffer(h2.frame_buffer.FrameBuffer):
    """A server's ``FrameBuffer`` that also refuses a first frame other than SETTINGS."""

    def __init__(self) -> None:
        super().__init__(server=True)
        self._start: bytes | None = b""
        """The connection's first bytes, until the first frame's type octet is among them;
        None once it was checked."""

    # h2 types ``data`` with a protocol of its private ``_typing``; ``receive_data`` feeds bytes.
    def add_data(self, data: bytes) -> None:  # type: ignore[override]
        """h2's ``add_data``; raises ``ProtocolError`` for an invalid preface (§3.4)."""
        super().add_data(data)  # checks the 24 octets first
        start = self._start
        if start is None:
            return
        start += bytes(data[: _TYPE_AT + 1 - len(start)])
        if len(start) <= _TYPE_AT:
            self._start = start
            return
        self._start = None
        if start[_TYPE_AT] != _SETTINGS:
            raise h2.exceptions.ProtocolError("client preface not followed by SETTINGS")

"""The commit point of a held SSE response (``retry_until_first_event``): its first content event.

What it obeys:

- RFC 9110 §9.2.2: a proxy may retry a request only while nothing of the response reached
  the client. With ``retry_until_first_event`` the proxy holds an SSE response (its head and
  its first bytes) so that a backend that fails before its first token is retried, as the
  route's documentation promises. The first byte is not the first token: a backend may send a
  comment (``: ping``), a role-only chunk (OpenAI's ``{"delta":{"role":"assistant"}}``), an
  ``event:`` line, or half an event, and then die. All of that is held too.
- What counts as a content event is ``ssemeter.is_token_event``'s rule (WHATWG HTML §9.2.6
  for where an event ends, the meter's byte patterns for whether it carries a token): the
  same rule that times the first token, so the commit point and time to first token agree.
- Per API (``core/apis/streaming.py``): content is the API's rule (the Responses and Messages
  readers), and an event the API reports an error with before any content (Anthropic's
  ``overloaded_error``, an OpenAI ``error`` event, Responses' ``response.failed``) is noted in
  ``error``: the exchange fails over as for a failed connection (``next_upstream``'s
  ``"error"``), or, with no try left, goes on holding and relays it as the backend sent it.
- Bounded: at most ``limit`` bytes are held (the exchange passes ``high_water``, so a held
  response takes no more than a streamed one). A backend that sends more before its first
  token is committed to with what it sent: the proxy cannot hold it longer without reading
  it unboundedly, and pausing it would only make it late.
- Nothing of a failed attempt reaches the client: the held bytes belong to one attempt and
  are dropped with it (the exchange makes a new ``CommitPoint`` per held head).

Theory of operation: ``take`` appends a chunk and scans only the complete events not scanned
yet; it returns the held bytes (all of them, in order) once a content event is complete or
the bound is reached, and None while it still holds.
"""

from __future__ import annotations

from muxproxy.core.apis.streaming import ApiStream
from muxproxy.core.observe.ssemeter import is_token_event, stream_terminator


def _no_error(event: bytes) -> str | None:
    return None


class CommitPoint:
    """The bytes of one held SSE response until its first content event."""

    __slots__ = ("error", "error_of", "held", "is_content", "limit", "scanned", "sep")

    def __init__(self, limit: int, api: ApiStream | None = None) -> None:
        """``api``: the API the stream speaks, if known (else the meter's byte patterns)."""
        self.limit = limit
        self.is_content = (api and api.is_content) or is_token_event
        self.error_of = _no_error if api is None else api.error_of
        self.error: str | None = None
        """The type of the first error event before any content, once one came."""
        self.held = b""
        self.scanned = 0
        """How far ``held`` was split into events: the start of the first incomplete one."""
        self.sep = b""
        """The stream's event terminator (two line ends); empty until its first line end."""

    def take(self, data: bytes) -> bytes | None:
        """A chunk of the response body: all the held bytes once the response may be
        committed to (a content event is complete, or ``limit`` is reached), else None."""
        held = self.held = self.held + data
        if self._has_content() or len(held) > self.limit:
            self.held = b""
            return held
        return None

    def _has_content(self) -> bool:
        held = self.held
        if not self.sep:
            sep = stream_terminator(held)
            if sep is None:
                return False
            self.sep = sep
        sep = self.sep
        while True:
            end = held.find(sep, self.scanned)
            if end < 0:
                return False
            event, self.scanned = held[self.scanned : end], end + len(sep)
            if self.is_content(event):
                return True
            if self.error is None:
                self.error = self.error_of(event)

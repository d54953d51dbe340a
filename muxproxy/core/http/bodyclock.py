"""How long a request body may take: its idle gap and its whole-body deadline.

What it obeys:

- RFC 9110 §15.5.9: a request the client does not finish sending in time is answered 408.
  Two bounds, as Apache's ``mod_reqtimeout`` has (``body=20,MinRate=500``) and nginx's
  ``client_body_timeout`` half of (a gap only):

  - the gap (``timeouts.client_header``): no body byte for that long;
  - the whole body (``timeouts.client_body``): the body not complete that long after the
    request head came. A gap bound alone never cuts a body trickled one byte per interval
    just under it (slowloris on the body, which holds a backend slot as long as it lasts).
    A deadline rather than a minimum rate: what an attacker holds is bounded by one number
    an operator can read, and LLM request bodies (prompts, a few MiB with images at most)
    arrive in well under a second from any real client.

- Time in which the proxy stopped the client (``flow.py``: the backend or the buffer is
  behind, the client's HTTP/2 window is withheld or its socket not read) is ours, not the
  client's: neither bound counts it. The gap counts afresh once the client may send again;
  the deadline is moved by the time the client was stopped (``stopped`` / ``going``, called
  only when the flow changes, so a body chunk costs nothing here).

``BodyClock`` holds the times of one request body; ``Upload`` owns it and the lazy ``body``
timer, which it arms at the earlier of the two bounds.
"""

from __future__ import annotations

import enum


class SlowBody(enum.Enum):
    """Which bound a refused request body broke; its value is the defence counted
    (``defencelog.KINDS``)."""

    IDLE = "request_body_timeout"
    """No body byte for ``timeouts.client_header``."""
    TOO_SLOW = "request_body_deadline"
    """The body not complete within ``timeouts.client_body`` of the request head."""

    @property
    def reason(self) -> str:
        """What the access log says of the exchange."""
        if self is SlowBody.IDLE:
            return "no request body within the client_header timeout"
        return "request body not complete within the client_body timeout"


class BodyClock:
    """The whole-body deadline of one request body, less the time we stopped its client."""

    __slots__ = ("started", "stopped_at", "stopped_for")

    def __init__(self, started: float) -> None:
        self.started = started
        """When the request head came."""
        self.stopped_for = 0.0
        """Seconds the client was stopped by us, in periods that ended."""
        self.stopped_at: float | None = None
        """When the client was last stopped, while it still is."""

    def stopped(self, now: float) -> None:
        """We stopped the client (its window withheld, its socket not read)."""
        if self.stopped_at is None:
            self.stopped_at = now

    def going(self, now: float) -> None:
        """We let the client send again."""
        if self.stopped_at is not None:
            self.stopped_for += now - self.stopped_at
            self.stopped_at = None

    def due(self, now: float, timeout: float) -> float:
        """When the body must be complete: ``timeout`` after the head plus the time the
        client was stopped (up to ``now`` while it still is)."""
        stopped = self.stopped_for
        if self.stopped_at is not None:
            stopped += now - self.stopped_at
        return self.started + timeout + stopped

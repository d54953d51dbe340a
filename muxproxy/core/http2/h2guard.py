"""Abuse accounting for one HTTP/2 client connection: pure counters, no IO, no clock.

python-h2 enforces the frame rules of RFC 9113 but counts nothing: a client may reset every
stream it opens (CVE-2023-44487, "rapid reset") or send SETTINGS, PING, empty DATA, PRIORITY
and WINDOW_UPDATE frames without end, each legal on its own, each costing us work and output
(RFC 9113 §10.5: "an endpoint MAY treat activity that is suspicious as a connection error of
type ENHANCE_YOUR_CALM"). This module keeps two budgets per connection:

- **resets**: a client's RST_STREAM of a stream whose response was not complete costs one; a
  completed response gives one back (up to the budget). A client that cancels now and then
  never runs dry; one that opens and resets streams in a loop does after ``reset_budget``.
- **control frames**: every SETTINGS, PING, PING ACK, SETTINGS ACK, PRIORITY, WINDOW_UPDATE,
  unknown frame and DATA frame without payload or END_STREAM costs one; a stream refused with
  REFUSED_STREAM (past MAX_CONCURRENT_STREAMS, or after a GOAWAY: RFC 9113 §5.1.2, §6.8)
  costs ``REFUSED_STREAM_COST``, since h2 decodes, sets up and tears down a stream for it;
  useful work gives some back: a
  response chunk sent (a reading client answers DATA with WINDOW_UPDATEs) and a completed
  response. A client that opens a few streams too many before it saw our SETTINGS is paid
  back as its responses complete; one that keeps opening streams it was refused is not.

A token bucket refilled by work, rather than a rate per second, keeps the core free of
clocks and scales with what the client actually uses the connection for. The owner
(``H2Server``) asks ``exhausted`` after each event and answers GOAWAY(ENHANCE_YOUR_CALM).

It also names the stream id at which a connection is drained with a graceful GOAWAY
(RFC 9113 §5.1.1: stream ids cannot be reused, so a long-lived connection runs out).
"""

from __future__ import annotations

import attrs

RESET_BUDGET = 100
"""Premature resets a connection may make before GOAWAY(ENHANCE_YOUR_CALM). Browsers and SDKs
cancel a request now and then (a closed tab, a user pressing stop); 100 in a row without a
single completed response is an attack. Each reset costs a backend request already started,
so the bound is on wasted GPU work, not just frames. Default of ``limits.h2_reset_budget``."""

CONTROL_FRAME_BUDGET = 1000
"""Control frames a connection may send beyond what its useful work paid for. A client
pinging every 10 s for a 2-minute reasoning pause sends 12; 1000 with nothing in return is a
flood. Default of ``limits.h2_control_frame_budget``."""

REFUSED_STREAM_COST = 10
"""Control frames' worth of one refused stream: h2 counts its open streams, decodes the block,
builds and resets a stream (about 110 µs with 100 streams open, a PING about a tenth). The
default budget lets a connection have 100 streams refused; a completed response pays one."""

CONTROL_REFILL_PER_CHUNK = 2
"""A response chunk sent pays for the stream and the connection WINDOW_UPDATE a client
sends back for it (RFC 9113 §6.9): reading a long stream never exhausts the budget."""

CONTROL_REFILL_PER_RESPONSE = 10
"""A completed response pays for a handful of PRIORITY / SETTINGS / PING frames around it."""

STREAM_ID_DRAIN = 2**31 - 1 - 2**20
"""A request on a stream id at or above this gets a graceful GOAWAY(NO_ERROR) after it: the
client has about half a million ids left (RFC 9113 §5.1.1: the space is 2**31-1 and ids never
repeat), so it opens a new connection in time instead of hitting the end mid-burst. At 1,000
requests a second a connection reaches it after 12 days."""


@attrs.define
class H2Guard:
    """The budgets of one connection. ``exhausted`` names the first one that ran out."""

    reset_budget: int = RESET_BUDGET
    control_budget: int = CONTROL_FRAME_BUDGET
    resets_left: int = attrs.field(init=False)
    control_left: int = attrs.field(init=False)
    exhausted: str | None = attrs.field(init=False, default=None)
    """Why the connection must get GOAWAY(ENHANCE_YOUR_CALM); None while within budget."""

    def __attrs_post_init__(self) -> None:
        self.resets_left = self.reset_budget
        self.control_left = self.control_budget

    def premature_reset(self) -> None:
        """The client reset a stream before its response was complete."""
        self.resets_left -= 1
        if self.resets_left < 0 and self.exhausted is None:
            self.exhausted = f"more than {self.reset_budget} streams reset before their response"

    def control_frame(self, kind: str) -> None:
        """The client sent a frame that asks for work and carries no request."""
        self.control_left -= 1
        if self.control_left < 0 and self.exhausted is None:
            self.exhausted = f"{kind} flood: over {self.control_budget} control frames"

    def refused_stream(self) -> None:
        """A stream was refused (REFUSED_STREAM) before any work was done for it."""
        self.control_left -= REFUSED_STREAM_COST - 1
        self.control_frame("refused stream")

    def abuse(self, reason: str) -> None:
        """Abuse found outside these budgets (an HPACK bomb, a HEADERS flood within a read)."""
        if self.exhausted is None:
            self.exhausted = reason

    def response_chunk(self) -> None:
        left = self.control_left + CONTROL_REFILL_PER_CHUNK  # per token: no call to min()
        self.control_left = left if left < self.control_budget else self.control_budget

    def response_completed(self) -> None:
        self.resets_left = min(self.reset_budget, self.resets_left + 1)
        self.control_left = min(
            self.control_budget, self.control_left + CONTROL_REFILL_PER_RESPONSE
        )

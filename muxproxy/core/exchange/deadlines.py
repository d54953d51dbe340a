"""An exchange's deadlines: when each of its timers is due, and whom a due one blames.

What it obeys:

- Timeouts blame the party that is late. The backend's (response head, first token, read)
  never count time in which it waits for us: while the client is still sending the request
  body (the backend may want all of it before it answers; a client that stopped sending is
  the ``body`` timer's to judge, RFC 9110 §15.5.9: a 408, not a 504), then the clock runs
  from the end of the request; nor while we paused the backend because the client is behind
  (the client side has its own bound, ``Downstream``'s send and window timers). A backend
  timer that fires while we do not read the backend is armed again for a whole timeout, and
  each one counts afresh from the moment we read it again (``resumed_at``): a backend the
  proxy paused is never failed, nor counted against its server's passive health, for the
  time we did not read it (the response head and first token included: a connection that
  is behind pauses every backend it feeds, also those whose head is still due). The client's
  ``body`` timer (``timeouts.client_header``) never counts time in which we withheld its
  window.
- A group's ``[upstreams.NAME.timeouts]`` win over the global ``[timeouts]``, both read when
  a timer is armed or fires (a reload counts from then on).
- Lazy timers (``read``, ``body``, ``heartbeat``, and ``head`` / ``first_token`` while the
  request is still coming): armed once, moved only when they fire. What they watch is a
  timestamp written as bytes move (``upstream_at``, ``request_at``), so relaying a chunk
  costs no timer command.
- The SSE heartbeat (``route.sse_heartbeat``): a comment (``sse.HEARTBEAT``) after that many
  seconds without backend bytes or an earlier heartbeat, so idle timeouts along the way (load
  balancers, proxies) keep a thinking model's stream. Only between events (a comment inside
  one would end it early, ``sse.EventBoundary``), only when the client took everything
  (unsent bytes keep nothing alive), and never on a sized body (RFC 9112 §6.3).

``Deadlines`` holds the timestamps and arms the timers of one exchange; it decides, the
exchange acts (``exchange.py``). ``Heartbeat`` sends its comments itself.
"""

from __future__ import annotations

import attrs

from muxproxy.config import Config, Upstream
from muxproxy.core.effects import Effects
from muxproxy.core.http.headers import header_value
from muxproxy.core.messages import Headers
from muxproxy.core.ports import ResponseSink
from muxproxy.core.streams.sse import HEARTBEAT, EventBoundary
from muxproxy.core.timers import ExchangeTimer

# The timers of one attempt at a backend, cancelled when it ends.
ATTEMPT_TIMERS = (
    ExchangeTimer.CONNECT,
    ExchangeTimer.HEAD,
    ExchangeTimer.FIRST_TOKEN,
    ExchangeTimer.READ,
    ExchangeTimer.HEARTBEAT,
)
# The backend's timers, and what the failure they cause says.
BACKEND_TIMEOUTS = {
    ExchangeTimer.CONNECT: "connect timeout",
    ExchangeTimer.HEAD: "response head timeout",
    ExchangeTimer.FIRST_TOKEN: "no first token within the first-token timeout",
    ExchangeTimer.READ: "no data from upstream within the read timeout",
}


def connect_timeout(group: Upstream, config: Config) -> float:
    return group.timeouts.connect or config.timeouts.connect


def head_timeout(group: Upstream, config: Config) -> float:
    return group.timeouts.response_head or config.timeouts.response_head


def idle_timeout(group: Upstream | None, config: Config) -> float:
    """The longest gap between two response body chunks."""
    return (group.timeouts.idle if group is not None else None) or config.timeouts.read


@attrs.define
class Deadlines:
    """The timers of one exchange (``ident``) and the times they are judged by."""

    fx: Effects
    ident: int
    upstream_at: float
    """When the backend last sent something (or we last held it, see ``read_due``)."""
    request_at: float
    """When the client last moved the request body on."""
    request_done_at: float
    """When the request was complete (its start while the body is still coming)."""
    resumed_at: float = 0.0
    """When we last resumed reading the backend after pausing it (0: never paused)."""

    def arm(self, kind: ExchangeTimer, at: float) -> None:
        self.fx.set_timer((kind, self.ident), at)

    def cancel(self, *kinds: ExchangeTimer) -> None:
        for kind in kinds:
            self.fx.cancel_timer((kind, self.ident))

    def end_attempt(self) -> None:
        """An attempt at a backend ends (retried, answered by us, or the exchange ends)."""
        self.cancel(*ATTEMPT_TIMERS)

    def request_sent(self, group: Upstream) -> None:
        """The request head went to a server of ``group``: its response head is due, and its
        first body byte where the group has a first-token timeout."""
        now = self.fx.now
        self.arm(ExchangeTimer.HEAD, now + head_timeout(group, self.fx.config))
        if group.timeouts.first_token:
            self.arm(ExchangeTimer.FIRST_TOKEN, now + group.timeouts.first_token)

    def watch_reading(self, group: Upstream | None) -> None:
        """The response's idle bound, from the backend's last bytes (``read_due``)."""
        self.arm(ExchangeTimer.READ, self.upstream_at + idle_timeout(group, self.fx.config))

    def due(self, kind: ExchangeTimer, at: float) -> bool:
        """A lazy timer fired: whether ``at`` has passed; if not, it is armed for ``at``."""
        if self.fx.now < at:
            self.arm(kind, at)
            return False
        return True

    def backend_expired(
        self, kind: ExchangeTimer, group: Upstream, *, sending: bool, held: bool
    ) -> bool:
        """One of ``BACKEND_TIMEOUTS`` fired: whether it blames the backend (else it is armed
        again). ``sending``, ``held``: as for ``backend_late`` and ``read_due``."""
        config = self.fx.config
        if kind is ExchangeTimer.READ:
            return self.read_due(idle_timeout(group, config), held=held)
        if kind is ExchangeTimer.HEAD:
            timeout = head_timeout(group, config)
            return self.backend_late(kind, timeout, sending=sending, held=held)
        if kind is ExchangeTimer.FIRST_TOKEN:
            first_token = group.timeouts.first_token
            return not first_token or self.backend_late(
                kind, first_token, sending=sending, held=held
            )
        assert kind is ExchangeTimer.CONNECT, kind
        return True

    def read_due(self, idle: float, *, held: bool) -> bool:
        """The ``read`` timer: the backend sent nothing for ``idle`` seconds. ``held``: we
        paused it because the client is behind, so its silence is ours."""
        if held:
            self.upstream_at = self.fx.now
        return self.due(ExchangeTimer.READ, max(self.upstream_at, self.resumed_at) + idle)

    def backend_late(
        self, kind: ExchangeTimer, timeout: float, *, sending: bool, held: bool
    ) -> bool:
        """The ``head`` or ``first_token`` timer: whether it blames the backend. ``sending``:
        the client still sends request body bytes the backend takes (not stopped by us);
        ``held``: we do not read the backend (``read_due``)."""
        if sending or held:
            self.arm(kind, self.fx.now + timeout)
            return False
        return self.due(kind, max(self.request_done_at, self.resumed_at) + timeout)


class Heartbeat:
    """The SSE heartbeat of one response, armed as its head goes out."""

    def __init__(self, deadlines: Deadlines, interval: float) -> None:
        self.deadlines = deadlines
        self.interval = interval
        self.boundary = EventBoundary()
        """Where the response's bytes stand (fed per chunk by the exchange)."""
        self.sent_at = deadlines.fx.now
        """When the last heartbeat, or the head, went to the client."""
        deadlines.arm(ExchangeTimer.HEARTBEAT, self.sent_at + interval)

    @classmethod
    def for_response(
        cls, deadlines: Deadlines, interval: float | None, headers: Headers
    ) -> Heartbeat | None:
        """The heartbeat of an SSE response with ``headers``, if ``interval`` asks for one."""
        # A sized body cannot take extra bytes (RFC 9112 §6.3); SSE backends stream without
        # Content-Length anyway.
        if not interval or header_value(headers, b"content-length") is not None:
            return None
        return cls(deadlines, interval)

    def fired(self, client: ResponseSink, stream: int) -> None:
        """The ``heartbeat`` timer: a comment to ``stream`` if one is due and fits; armed
        again either way."""
        deadlines, interval = self.deadlines, self.interval
        if not deadlines.due(
            ExchangeTimer.HEARTBEAT, max(deadlines.upstream_at, self.sent_at) + interval
        ):
            return
        now = deadlines.fx.now
        if self.boundary.at_boundary and not client.buffered(stream):
            client.send_body(stream, HEARTBEAT)
            self.sent_at = now
        deadlines.arm(ExchangeTimer.HEARTBEAT, now + interval)

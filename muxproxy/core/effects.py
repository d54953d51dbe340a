"""Effects: what a part of the core may do to the outside world, and the clock it reads.

Every part of the core (a client connection, an exchange, a backend connection, a tunnel, a
probe) holds the one ``Effects`` of its ``ProxyCore`` and nothing more of it. Through it a part

- reads the time of the event being handled (``now``: the driver's monotonic clock, in
  seconds; the core never reads a clock itself), the configuration in force (``config``) and
  the buffer bounds derived from it (``limits``, ``read_size``: ``flow.py``);
- queues commands for the driver (``emit``, ``send``, ``close``), which ``ProxyCore.handle``
  returns, in order, once the event is handled;
- arms and cancels timers (``set_timer``, ``cancel_timer``): a timer cancelled before it
  fires is forgotten here, so a ``Wakeup`` the driver had already queued for it is dropped
  (``fired`` says so), and a cancel of a timer not armed emits nothing;
- asks for work to be done once the current event is handled (``defer``). A part that ends
  something while it handles an input asks, and the owner (``ProxyCore.handle``) applies the
  requests after that input, in order (and what they ask for in turn), so no part re-enters
  another that is still in the middle of its own handling — the way h11 only returns events
  and mitmproxy's parent layer routes what its children yield. The endings deferred so:

  - an exchange's end, for its client connection (``Downstream.exchange_finished``: the next
    pipelined request, the idle timer, or the close);
  - a close that an exchange or a tunnel asks of its client connection
    (``Downstream.request_close``: an HTTP/1.1 response cut mid-stream, a tunnel's end);
  - a backend stream released on a shared HTTP/2 connection, for the requests waiting for a
    free stream (``H2Upstream.stream_finished``).

  A fault in deferred work ends the connection it concerns (``faults.py``), not the others.

It also holds what the parts learn of the servers' models (``models``: the catalog that
``upstream/modelpoll.py`` fills and the proxy's own ``GET /v1/models`` reads, in
``exchange/placement.py``), kept across configurations for the servers a new one still names.

``Effects`` knows no part of the core: it imports only commands, events, dates, flow, the
move log a test may hang on it (``movelog.py``) and the pure model catalog.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from muxproxy.config import Config
from muxproxy.core.commands import CancelTimer, CloseConnection, Command, SendData, SetTimer
from muxproxy.core.events import TimerId
from muxproxy.core.flow import BufferLimits
from muxproxy.core.http.dates import HttpDate
from muxproxy.core.movelog import MoveLog
from muxproxy.routing.modelcatalog import ModelCatalog

# The most bytes a driver reads from a socket in one go; the core's buffer bound relies on it.
READ_SIZE = 64 * 1024


class Effects:
    """The clock, the configuration, the command queue and the timers of one core."""

    def __init__(self, config: Config, *, read_size: int = READ_SIZE) -> None:
        self.now = 0.0
        """The time of the event being handled (``Event.now``)."""
        self._max_read_size = read_size
        self.models = ModelCatalog()
        """What the servers of groups with ``learn_models`` said they serve."""
        self.config = config
        self.read_size = read_size
        """How many bytes the driver may read from a socket at once."""
        self.limits = BufferLimits.for_stream_buffer(
            config.limits.stream_buffer, read_size, config.limits.connection_buffer
        )
        self.apply(config)
        self.date = HttpDate()
        """The ``Date`` of responses, from the wall time the driver gives (``dates.py``)."""
        self.shutting_down = False
        """A graceful stop began (``shutdown.py``): no new requests are taken, no backend
        connection is kept for another."""
        self.out: list[Command] = []
        """Commands queued while the current event is handled."""
        self.timers: dict[TimerId, TimerId] = {}
        """Timers armed and not yet fired or cancelled (each id maps to itself: a driver's
        ``Wakeup`` may carry an equal plain ``(str, int)``, and ``fired`` hands back the typed
        id)."""
        self.deferred: deque[tuple[int, Callable[[], None]]] = deque()
        """Work asked for while handling the current event (``defer``), with the connection
        it concerns."""
        self.moves: MoveLog | None = None
        """Where the parts record their state moves, for a test (``movelog.py``); None, and
        so one ``is None`` test per move, but in tests."""

    def apply(self, config: Config) -> None:
        """A new configuration: its limits hold from the next event on; what was learnt of
        servers it no longer names is forgotten."""
        self.config = config
        self.models.retain(config)
        stream_buffer = config.limits.stream_buffer
        self.read_size = min(self._max_read_size, stream_buffer // 2)
        self.limits = BufferLimits.for_stream_buffer(
            stream_buffer, self.read_size, config.limits.connection_buffer
        )

    def emit(self, command: Command) -> None:
        self.out.append(command)

    def send(self, conn: int, data: bytes) -> None:
        self.out.append(SendData(conn=conn, data=data))

    def close(self, conn: int, *, linger: bool = True) -> None:
        """Close ``conn`` once its pending output is flushed, the flush bounded by
        ``timeouts.send`` (``CloseConnection.flush_timeout``; ``linger``: its field)."""
        timeout = self.config.timeouts.send
        self.out.append(CloseConnection(conn=conn, flush_timeout=timeout, linger=linger))

    def set_timer(self, timer: TimerId, at: float) -> None:
        self.timers[timer] = timer
        self.out.append(SetTimer(timer=timer, at=at))

    def cancel_timer(self, timer: TimerId) -> None:
        if self.timers.pop(timer, None) is not None:
            self.out.append(CancelTimer(timer=timer))

    def fired(self, timer: TimerId) -> TimerId | None:
        """A ``Wakeup`` for ``timer``: the (typed) id, forgotten, if it is still armed; None if
        it was cancelled after the driver had already queued its wakeup."""
        return self.timers.pop(timer, None)

    def http_date(self) -> bytes | None:
        """The ``Date`` field value now (RFC 9110 §6.6.1); None while the core has no clock."""
        return self.date.at(self.now)

    def defer(self, conn: int, work: Callable[[], None]) -> None:
        """Do ``work``, which concerns connection ``conn``, once the current event is handled
        (see the module docstring); a fault in it ends ``conn`` (``faults.py``)."""
        self.deferred.append((conn, work))

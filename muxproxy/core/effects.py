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
- asks for work to be done once the current event is handled (``defer``): finishing an
  exchange, closing a connection, releasing a backend. A part that ends something while it
  handles an input asks, and the owner (``ProxyCore``) applies the request after that input,
  so no part re-enters another that is still in the middle of its own handling (the way h11
  only returns events and never calls back).

``Effects`` knows no part of the core: it imports only commands, events, dates and flow.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ..config import Config
from .commands import CancelTimer, CloseConnection, Command, SendData, SetTimer
from .dates import HttpDate
from .events import TimerId
from .flow import BufferLimits

# The most bytes a driver reads from a socket in one go; the core's buffer bound relies on it.
READ_SIZE = 64 * 1024


class Effects:
    """The clock, the configuration, the command queue and the timers of one core."""

    def __init__(self, config: Config, *, read_size: int = READ_SIZE) -> None:
        self.now = 0.0
        """The time of the event being handled (``Event.now``)."""
        self._max_read_size = read_size
        self.config = config
        self.read_size = read_size
        """How many bytes the driver may read from a socket at once."""
        self.limits = BufferLimits.for_stream_buffer(config.limits.stream_buffer, read_size)
        self.apply(config)
        self.date = HttpDate()
        """The ``Date`` of responses, from the wall time the driver gives (``dates.py``)."""
        self.shutting_down = False
        """A graceful stop began (``shutdown.py``): no new requests are taken, no backend
        connection is kept for another."""
        self.out: list[Command] = []
        """Commands queued while the current event is handled."""
        self.timers: set[TimerId] = set()
        """Timers armed and not yet fired or cancelled."""
        self.deferred: deque[Callable[[], None]] = deque()
        """Work asked for while handling the current event (``defer``)."""

    def apply(self, config: Config) -> None:
        """A new configuration: its limits hold from the next event on."""
        self.config = config
        stream_buffer = config.limits.stream_buffer
        self.read_size = min(self._max_read_size, stream_buffer // 2)
        self.limits = BufferLimits.for_stream_buffer(stream_buffer, self.read_size)

    def emit(self, command: Command) -> None:
        self.out.append(command)

    def send(self, conn: int, data: bytes) -> None:
        self.out.append(SendData(conn=conn, data=data))

    def close(self, conn: int) -> None:
        """Close ``conn`` once its pending output is flushed, the flush bounded by
        ``timeouts.send`` (``CloseConnection.flush_timeout``)."""
        self.out.append(CloseConnection(conn=conn, flush_timeout=self.config.timeouts.send))

    def set_timer(self, timer: TimerId, at: float) -> None:
        self.timers.add(timer)
        self.out.append(SetTimer(timer=timer, at=at))

    def cancel_timer(self, timer: TimerId) -> None:
        if timer in self.timers:
            self.timers.discard(timer)
            self.out.append(CancelTimer(timer=timer))

    def fired(self, timer: TimerId) -> bool:
        """A ``Wakeup`` for ``timer``: True (and forgotten) if it is still armed, False if it
        was cancelled after the driver had already queued its wakeup."""
        if timer not in self.timers:
            return False
        self.timers.discard(timer)
        return True

    def http_date(self) -> bytes | None:
        """The ``Date`` field value now (RFC 9110 §6.6.1); None while the core has no clock."""
        return self.date.at(self.now)

    def defer(self, work: Callable[[], None]) -> None:
        """Do ``work`` once the current event is handled (see the module docstring)."""
        self.deferred.append(work)

    def take(self) -> list[Command]:
        """The commands queued so far, handed over once; the queue starts empty again."""
        out = self.out
        self.out = []
        return out

    def drop_commands_for(self, conn: int, kinds: tuple[type[Command], ...]) -> None:
        """Forget queued commands of ``kinds`` addressed to ``conn`` (``faults.py``)."""
        self.out = [c for c in self.out if not (isinstance(c, kinds) and c.conn == conn)]  # type: ignore[attr-defined]

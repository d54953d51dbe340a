"""The output of one client connection: bytes handed to the driver and not yet written.

What it obeys (``flow.py`` has the rules of every bound, the connection's marks included;
this module asks it and keeps the connection's bytes):

- ``pending`` counts the bytes of ``SendData`` commands not yet reported by ``DataSent``.
  With an HTTP/2 stream's send queue it is what an exchange measures for backpressure
  (``Downstream.buffered``).
- Above ``limits.connection_buffer`` every backend feeding the connection is stopped
  (``_stall_all``), and none resumes while the output is above half of that (``congested``); at
  ``low_water`` the stopped ones resume, least served first (``resume``). Bound: once
  ``pending`` exceeds ``connection_buffer`` every backend is paused, and a paused backend
  delivers at most the one read it had in flight; the write that crossed the bound is one
  read's output too. So ``pending <= connection_buffer + (streams + 1) * out(read_size)``,
  where ``out(n)`` is n body bytes plus their HTTP/2 frame headers, plus control frames
  (bounded by the h2 guard's budgets). WINDOW_UPDATEs do not release queued stream data
  meanwhile (``Downstream._flush_blocked`` waits while congested).
- The ``send`` timer bounds a client that takes no bytes: ``timeouts.send`` without write
  progress closes the connection (``timed_out``). Lazy: armed when output starts waiting,
  moved only when it fires, so a write costs no timer command.
- Nothing is written once the connection is closing or closed (``ClientState.protocol``):
  the driver takes no ``SendData`` after its ``CloseConnection``, and the close flushes what
  the HTTP/2 connection holds (its GOAWAY) before it.

Tunnels, which hold no backend ``upstream``, keep their own per-stream bound and are left to
it. The owner is read for its state and its exchanges only (``Owner``).
"""

from __future__ import annotations

from typing import Protocol

from muxproxy.core.client import downstream_states
from muxproxy.core.client.downstream_states import ClientState
from muxproxy.core.effects import Effects
from muxproxy.core.ports import ClientStream
from muxproxy.core.timers import ClientTimer

_CLOSED = downstream_states.Protocol.CLOSED


class Owner(Protocol):
    """What the output reads of its client connection."""

    state: ClientState
    exchanges: dict[int, ClientStream]


class Output:
    """The bytes one client connection handed the driver, and what bounds them."""

    def __init__(self, fx: Effects, conn: int, owner: Owner) -> None:
        self.fx = fx
        self.conn = conn
        self.owner = owner
        self.timer = (ClientTimer.SEND, conn)
        self.pending = 0
        self.last_progress = fx.now
        """When the driver last reported bytes written (or output started waiting). This and
        ``pending`` follow each ``DataSent`` in ``Downstream.on_sent`` itself: no call per
        write on the per-token path."""
        self.timer_armed = False
        self.stalled: set[ClientStream] = set()
        """Exchanges whose backend reading is paused because this side is behind: those whose
        ``response_flow`` (or tunnel's ``backend_flow``) is stopped (``flow.py``)."""
        self.windowed: set[int] = set()
        """HTTP/2 streams among them stopped for their closed window (``windowwait.py``): the
        connection's drain does not resume them, a WINDOW_UPDATE that empties their queue
        does (``WindowWaits.reopened``)."""

    def write(self, data: bytes) -> None:
        """Hand ``data`` to the driver (dropped once the connection is closing)."""
        if not data or self.owner.state.protocol is _CLOSED:
            return
        fx = self.fx
        if not self.pending:
            self.last_progress = fx.now
            if not self.timer_armed:
                self.timer_armed = True
                fx.set_timer(self.timer, fx.now + fx.config.timeouts.send)
        self.pending += len(data)
        fx.send(self.conn, data)
        # ``BufferLimits.connection_full``, without a call on the per-token path.
        if self.pending > fx.limits.connection_high:
            self._stall_all()

    def _stall_all(self) -> None:
        for exchange in self.owner.exchanges.values():
            # Each resumes by its own flow (``Exchange.client_drained``), not while congested.
            if exchange.client_stalled():
                self.stalled.add(exchange)

    def resume(self) -> None:
        """The stalled exchanges, once the output is at ``low_water``.

        Least served first: the backends resumed first are read first (the driver reads ready
        sockets in the order they became ready), and they may fill the connection again
        before the others get a read. In a fixed order the same streams of a busy connection
        would win every time and the last ones would starve."""
        if self.stalled and self.fx.limits.connection_drained(self.pending):
            windowed = self.windowed
            for exchange in sorted(self.stalled, key=_bytes_out):
                if exchange.stream not in windowed:
                    exchange.client_drained()

    @property
    def congested(self) -> bool:
        """Above half of ``limits.connection_buffer`` while some backend is stalled: stalled
        backends stay paused and queued HTTP/2 data stays queued."""
        return bool(self.stalled) and self.fx.limits.congested(self.pending)

    def timed_out(self) -> bool:
        """The ``send`` timer fired: True if the client took no byte for ``timeouts.send``
        (the connection is to close); otherwise the timer is moved to the next deadline."""
        fx = self.fx
        self.timer_armed = False
        if not self.pending:
            return False
        due = self.last_progress + fx.config.timeouts.send
        if fx.now < due:
            self.timer_armed = True
            fx.set_timer(self.timer, due)
            return False
        return True


def _bytes_out(exchange: ClientStream) -> int:
    return exchange.bytes_out

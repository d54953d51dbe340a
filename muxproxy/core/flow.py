"""Flow control: when a source is stopped and when it may go on (design §4).

Every direction the proxy relays has a source (a backend, a client, a tunnel's side) and a sink
that holds what the source delivered until the sink's socket took it. The proxy bounds what a
sink holds by stopping the source: an HTTP/1.1 source by ``PauseReading`` (the driver stops
reading its socket), an HTTP/2 source by withholding its WINDOW_UPDATEs (RFC 9113 §6.9: the
peer may send no more than the window we opened; we never acknowledge on arrival, so its
window for that one stream closes and the others go on).

The rule, one for every direction:

- A source is stopped once what its sink holds reaches ``high_water`` and resumed only once
  that is down to ``low_water``; in between it stays as it is (hysteresis: without the gap a
  source near the mark would be paused and resumed for every read).
- A stopped source can still deliver what one read already brought (the driver reads at most
  ``read_size`` bytes at a time; a peer's HTTP/2 window is at most ``read_size`` too), and it
  is checked after every delivery, so before one it held less than ``high_water``. So a sink
  never holds more than ``high_water + read_size`` = ``limits.stream_buffer`` bytes
  (``BufferLimits``).
- Each stop and each resume is reported exactly once (the edge), so the command that carries
  it out (``PauseReading`` / ``ResumeReading``, a WINDOW_UPDATE) goes out once per crossing,
  and stop and resume alternate.

``Flow`` is the state of one source: stopped or not, and the HTTP/2 credit (flow-controlled
bytes) withheld from it meanwhile. What a sink holds is measured by its owner and handed in
(``filled``, ``drained``), because every owner measures it differently (a connection's unsent
output plus an HTTP/2 stream queue, a request body's unsent part plus a backend connection's
output); the thresholds are handed in too, as the ``BufferLimits`` in force, so that a reload
applies to the streams already running as it always did. The users:

- ``Exchange``: the request (client to backend, credit to the client) and the response
  (backend to client: ``response_flow``, which ``Downstream`` also stops, see below);
- ``Tunnel``: both directions, as an exchange's;
- ``H2Stream``: the withheld credit of an HTTP/2 backend stream, stopped and resumed by its
  exchange (or by the client connection);
- ``Downstream``: above ``limits.connection_buffer`` it stops every response source it feeds
  (``Flow.stop`` of each exchange's ``response_flow``), and it lets none resume while its
  output is above half of that (``Downstream.congested``); each one resumes by its own flow,
  and the connection asks them to once its output is down to ``low_water``. The connection's
  marks are here too (``BufferLimits.connection_full``, ``congested``, ``connection_drained``),
  so that every stop and resume of the proxy is decided in this one module; ``output.py``
  only asks (asked only while a source is stopped; per write it reads ``connection_high``,
  the one comparison of ``connection_full``, without a call).

The hot path (one SSE chunk) calls ``filled`` once: one method call, no allocation.
"""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class BufferLimits:
    """Per-stream buffer bounds derived from ``limits.stream_buffer``.

    A source is stopped at ``high_water``. It can still deliver what one read already brought
    (the driver reads at most ``read_size`` bytes at a time), so a stream never holds more than
    ``high_water + read_size`` = ``stream_buffer`` bytes.
    """

    high_water: int
    low_water: int
    connection_high: int = 2**62
    """A client connection's output above this (``limits.connection_buffer``) stops every
    source it feeds."""
    connection_congested: int = 2**62
    """Above this (half of ``connection_buffer``) a stopped source of the connection stays
    stopped, and its queued HTTP/2 data queued."""

    @classmethod
    def for_stream_buffer(
        cls, stream_buffer: int, read_size: int, connection_buffer: int = 2**62
    ) -> BufferLimits:
        high = stream_buffer - read_size
        # Half: a resumed source has half the buffer to fill before it is stopped again, and
        # the sink half of it to send meanwhile.
        return cls(
            high_water=high,
            low_water=high // 2,
            connection_high=connection_buffer,
            # Half, for the same reason as ``low_water``, with the stream's own resume below.
            connection_congested=connection_buffer // 2,
        )

    def connection_full(self, held: int) -> bool:
        """A client connection's output holds ``held`` bytes: every source it feeds stops."""
        return held > self.connection_high

    def congested(self, held: int) -> bool:
        """The output holds ``held`` bytes, and some source is stopped for it: that one stays
        stopped (the gap between the connection's stop and its resume)."""
        return held > self.connection_congested

    def connection_drained(self, held: int) -> bool:
        """The output went down to ``held`` bytes, and some sources are stopped for it: they
        resume (each by its own flow), once it is at ``low_water``."""
        return held <= self.low_water


@attrs.define
class Flow:
    """One source's flow state. ``stopped``: we stopped it and have not resumed it;
    ``withheld``: HTTP/2 flow-controlled bytes taken from it and not yet acknowledged."""

    stopped: bool = False
    withheld: int = 0

    def filled(self, held: int, limits: BufferLimits) -> bool:
        """The sink now holds ``held`` bytes: True exactly when this stops the source (it was
        running and ``held`` reached high water); the caller stops it."""
        if held >= limits.high_water and not self.stopped:
            self.stopped = True
            return True
        return False

    def drained(self, held: int, limits: BufferLimits) -> bool:
        """The sink now holds ``held`` bytes: True exactly when this resumes the source (it
        was stopped and ``held`` fell to low water); the caller resumes it."""
        if self.stopped and held <= limits.low_water:
            self.stopped = False
            return True
        return False

    def stop(self) -> bool:
        """Stop the source whatever its sink holds (a connection over its own bound): True
        when it was running; the caller stops it."""
        if self.stopped:
            return False
        self.stopped = True
        return True

    def resume(self) -> bool:
        """Resume the source whatever its sink holds (an ending; the one that stopped it is
        gone): True when it was stopped; the caller resumes it, if it still can."""
        if not self.stopped:
            return False
        self.stopped = False
        return True

    def hold(self, flow_len: int) -> None:
        """HTTP/2 credit for ``flow_len`` bytes the source sent: acknowledged by ``release``."""
        self.withheld += flow_len

    def release(self) -> int:
        """The credit to acknowledge now: all that is withheld while the source runs, nothing
        while it is stopped (RFC 9113 §6.9: its window opens only once the bytes moved on)."""
        if self.stopped:
            return 0
        withheld = self.withheld
        self.withheld = 0
        return withheld

    def take(self) -> int:
        """All the withheld credit, stopped or not (the stream ends: give everything back)."""
        withheld = self.withheld
        self.withheld = 0
        return withheld

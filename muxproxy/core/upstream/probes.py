"""Active health checks: a periodic ``GET <path>`` to every server of a group that has one.

A probe borrows a backend connection from the pool like an exchange does, and the pool talks to
it through the same few methods (``upstream_ready``, ``response_head``, ``response_body``,
``response_end``, ``upstream_failed``), so probing uses the very code path requests use. A
probe passes when the expected status arrives within ``timeout``; the group's ``GroupRouter``
turns results into up/down by its thresholds (``passes``, ``fails``).

``loadpoll.py``'s ``LoadPoll`` is a probe of another kind: the same way to the server and
the same timers, on the group's ``load_report`` path, with its body read and its result
handed to the router as the engine's load.

A probe's phases (``ProbeState``) and what moves them (``ProbeInput``) are one table,
``TRANSITIONS`` (``states.py``). A retired probe has left the core's table of probes, so no
timer and no connection reaches it any more: anything that does is a bug. What comes after a
check ended (its timeout timer on its way, a connection that opened after all) is ignored, and
a connection it offers is handed back.
"""

from __future__ import annotations

import enum

from muxproxy.config import HealthCheck, Upstream
from muxproxy.core.commands import Log, Origin
from muxproxy.core.effects import Effects
from muxproxy.core.messages import Headers, ResponseHead
from muxproxy.core.ports import ProbeHost, UpstreamStream
from muxproxy.core.states import IGNORED, ILLEGAL, Transitions, step
from muxproxy.core.timers import ProbeTimer


class ProbeState(enum.Enum):
    IDLE = "idle"
    """Waiting for the next interval."""
    RUNNING = "running"
    RETIRED = "retired"
    """A new configuration replaced it (``retire``); it does nothing more."""


class ProbeInput(enum.Enum):
    INTERVAL = "interval"
    """The interval timer fired: a check starts."""
    TIMEOUT = "timeout"
    """The check's ``timeout`` passed."""
    READY = "ready"
    """The pool gives the check its connection (``upstream_ready``)."""
    RESPONSE_END = "response_end"
    """The response is complete: the check is judged."""
    FAILED = "failed"
    """The connection failed (``upstream_failed``)."""
    RETIRE = "retire"
    """A new configuration or a stop replaces it."""


_S = ProbeState
_I = ProbeInput
TRANSITIONS: Transitions[ProbeState, ProbeInput] = {
    (_S.IDLE, _I.INTERVAL): _S.RUNNING,
    (_S.IDLE, _I.TIMEOUT): IGNORED,  # the check ended as its timer was on its way
    (_S.IDLE, _I.READY): IGNORED,  # the connection is handed back
    (_S.IDLE, _I.RESPONSE_END): IGNORED,
    (_S.IDLE, _I.FAILED): IGNORED,
    (_S.IDLE, _I.RETIRE): _S.RETIRED,
    (_S.RUNNING, _I.INTERVAL): ILLEGAL,  # armed again only once the check ended
    (_S.RUNNING, _I.TIMEOUT): _S.IDLE,
    (_S.RUNNING, _I.READY): _S.RUNNING,
    (_S.RUNNING, _I.RESPONSE_END): _S.IDLE,
    (_S.RUNNING, _I.FAILED): _S.IDLE,
    (_S.RUNNING, _I.RETIRE): _S.RETIRED,  # the check in flight is dropped
    # RETIRED: out of ``ProxyCore.probes``, its timers cancelled, its connection closed or
    # forgotten by the pool.
    (_S.RETIRED, _I.INTERVAL): ILLEGAL,
    (_S.RETIRED, _I.TIMEOUT): ILLEGAL,
    (_S.RETIRED, _I.READY): ILLEGAL,
    (_S.RETIRED, _I.RESPONSE_END): ILLEGAL,
    (_S.RETIRED, _I.FAILED): ILLEGAL,
    (_S.RETIRED, _I.RETIRE): ILLEGAL,
}
del _S, _I


class Probe:
    USER_AGENT = b"muxproxy-health"

    def __init__(
        self, fx: Effects, host: ProbeHost, group: Upstream, index: int, ident: int
    ) -> None:
        self.fx = fx
        self.host = host
        self.group = group
        self.path, self.interval, self.timeout = self._schedule_of(group)
        self.index = index
        self.ident = ident
        server = group.servers[index]
        self.origin = Origin.of(server)
        self.state = ProbeState.IDLE
        """Changed by ``move`` alone, as ``TRANSITIONS`` says (and by fault isolation)."""
        self.upstream: UpstreamStream | None = None
        self.status = 0

    def move(self, input: ProbeInput) -> ProbeState | None:
        """Take ``input`` as ``TRANSITIONS`` says: the state after it, None where ignored."""
        before = self.state
        target = step(TRANSITIONS, "Probe", before, input)
        if target is not None:
            self.state = target
        if self.fx.moves is not None:
            self.fx.moves.record(self, before, input, self.state)
        return target

    def _schedule_of(self, group: Upstream) -> tuple[bytes, float, float]:
        """The path, interval and timeout of this kind of probe in ``group``."""
        check: HealthCheck | None = group.health_check
        assert check is not None
        self.check = check
        return check.path.encode(), check.interval, check.timeout

    def schedule(self, delay: float) -> None:
        self.fx.set_timer((ProbeTimer.PROBE, self.ident), self.fx.now + delay)

    def retire(self) -> None:
        """A new configuration replaces this probe: its timers go, a check in flight is
        dropped, and no result of it reaches the group's router."""
        running = self.state is ProbeState.RUNNING
        self.move(ProbeInput.RETIRE)
        fx = self.fx
        fx.cancel_timer((ProbeTimer.PROBE, self.ident))
        fx.cancel_timer((ProbeTimer.PROBE_TIMEOUT, self.ident))
        if running:
            self._drop_check()

    def _drop_check(self) -> None:
        """Close the check's backend connection, or give up waiting for one."""
        if self.upstream is not None:
            self.upstream.exchange = None
            self.upstream.close()
            self.upstream = None
        else:
            self.host.pool.forget(self)

    def timer_fired(self, kind: ProbeTimer) -> None:
        if kind is ProbeTimer.PROBE:
            if self.move(ProbeInput.INTERVAL) is not None:
                self.status = 0
                self.fx.set_timer(
                    (ProbeTimer.PROBE_TIMEOUT, self.ident), self.fx.now + self.timeout
                )
                self.host.pool.acquire(self.origin, self.group, self)
        elif self.move(ProbeInput.TIMEOUT) is not None:
            self._done(False, "timeout")

    # -- the pool's side -------------------------------------------------------------------

    def upstream_ready(self, upstream: UpstreamStream) -> None:
        if self.move(ProbeInput.READY) is None:
            upstream.exchange = None
            upstream.close()
            return
        self.upstream = upstream
        headers = [(b"host", str(self.origin).encode()), (b"user-agent", self.USER_AGENT)]
        upstream.send_head(0, b"GET", self.path, headers)
        upstream.send_end([])

    def upstream_drained(self) -> None:
        pass

    def response_head(self, head: ResponseHead) -> None:
        self.status = head.status

    def response_body(self, data: bytes) -> None:
        pass

    def response_end(self, trailers: Headers) -> None:
        upstream = self.upstream
        self.upstream = None
        if upstream is not None:
            upstream.exchange = None
            upstream.release()
        if self.move(ProbeInput.RESPONSE_END) is not None:
            self._ended()

    def _ended(self) -> None:
        """The response is complete (the probe is IDLE again): judge it."""
        ok = self.status == self.check.expect_status
        self._done(ok, f"status {self.status}")

    def upstream_failed(self, reason: str, *, timeout: bool = False, stale: bool = False) -> None:
        if self.move(ProbeInput.FAILED) is not None:
            self._done(False, reason)

    # -- result ----------------------------------------------------------------------------

    def _done(self, ok: bool, detail: str) -> None:
        """The check ended (the probe moved to IDLE): its result, and the next check."""
        fx = self.fx
        fx.cancel_timer((ProbeTimer.PROBE_TIMEOUT, self.ident))
        self._drop_check()
        self._result(ok, detail)
        self.schedule(self.interval)

    def _result(self, ok: bool, detail: str) -> None:
        """Hand the check's result to the group's router, and log a change of health."""
        fx = self.fx
        router = self.host.router(self.group)
        if router.probe_result(self.index, ok):
            fx.emit(
                Log(
                    event="health",
                    fields={
                        "upstream": self.group.name,
                        "server": str(self.origin),
                        "up": router.probes.up(self.index) if router.probes else True,
                        "detail": detail,
                    },
                )
            )
            self.host.room_freed(router)  # a server came up (or went): who waits may go

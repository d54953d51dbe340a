"""The phases of an active health check as data: ``core/upstream/probes.py``'s ``TRANSITIONS``
and the ``Probe`` that obeys it.

In the manner of h2's ``test_state_machines.py``: Hypothesis draws every (state, input) pair.
A real ``ProxyCore`` with a health-checked group brings the probe into the state (waiting for
its interval; its check's connect under way; retired by a new configuration); the input is
then given by the entry point that delivers it (a timer, the pool, the backend's bytes), and
the probe must take exactly the table's transition: the new state, nothing done where the
table ignores it, ``IllegalTransition`` where it refuses it. A connection offered to a probe
with no check running cannot come by the pool (it forgets such a probe): it is offered by
hand.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import h11
from hypothesis import given, settings
from hypothesis import strategies as st
from machines import take
from playbook import H1BackendPeer, Playbook, default_config

from muxproxy.config import Config, HealthCheck, Server, Upstream
from muxproxy.core.events import ConfigChanged
from muxproxy.core.states import IGNORED, ILLEGAL, Verdict, missing
from muxproxy.core.timers import ProbeTimer
from muxproxy.core.upstream.probes import TRANSITIONS, Probe, ProbeInput, ProbeState

_S = ProbeState
_I = ProbeInput
CHECK = HealthCheck(interval=5.0, timeout=2.0, passes=2, fails=2)
EVERY_PAIR = settings(max_examples=200, deadline=None)


class Offered:
    """A connection offered to a probe that has no check running: the pool forgets such a
    probe, so none comes by it; only what a hand-back touches."""

    def __init__(self, probe: Probe) -> None:
        self.exchange: object = probe
        self.closed = False

    def close(self) -> None:
        self.closed = True


def checked() -> Config:
    group = Upstream(name="default", servers=(Server(address="127.0.0.1:9001"),))
    return default_config(upstreams={"default": attrs.evolve(group, health_check=CHECK)})


def test_table_lists_every_pair_once_and_retired_is_final() -> None:
    assert missing(TRANSITIONS, ProbeState, ProbeInput) == []
    assert len(TRANSITIONS) == len(ProbeState) * len(ProbeInput)
    for target in TRANSITIONS.values():
        assert isinstance(target, (ProbeState, Verdict))
    assert {TRANSITIONS[(_S.RETIRED, i)] for i in ProbeInput} == {ILLEGAL}


def probe_in(state: ProbeState) -> tuple[Playbook, Probe]:
    """The group's probe in ``state``: waiting for its interval; its check's connect under way;
    or retired by a new configuration."""
    pb = Playbook(checked())
    pb.feed(ConfigChanged(now=pb.now, config=pb.core.config))
    probe = pb.core.probes[1]
    if state is _S.RUNNING:
        probe.timer_fired(ProbeTimer.PROBE)
    elif state is _S.RETIRED:
        pb.feed(ConfigChanged(now=pb.now, config=checked()))
    assert probe.state is state
    return pb, probe


def answered(pb: Playbook, backend: H1BackendPeer) -> None:
    """The backend answers the check 200."""
    head = backend.conn.send(h11.Response(status_code=200, headers=[("Content-Length", "0")]))
    pb.receive(-1, (head or b"") + (backend.conn.send(h11.EndOfMessage()) or b""))


def inputs(pb: Playbook, probe: Probe, input: ProbeInput) -> Callable[[], object]:
    """How ``input`` reaches ``probe``; for a running check's answer or failure its
    connection opens first (``READY``, before the input is watched)."""
    running = probe.state is _S.RUNNING
    if running and input in (_I.RESPONSE_END, _I.FAILED):
        pb.opened(-1)
        backend = H1BackendPeer()
        backend.events(pb.take(-1))
        return (
            (lambda: answered(pb, backend)) if input is _I.RESPONSE_END else (lambda: pb.closed(-1))
        )
    return {
        _I.INTERVAL: lambda: probe.timer_fired(ProbeTimer.PROBE),
        _I.TIMEOUT: lambda: probe.timer_fired(ProbeTimer.PROBE_TIMEOUT),
        # RUNNING: the connect under way opens; else no connection comes by the pool.
        _I.READY: (lambda: pb.opened(-1))
        if running
        else (lambda: probe.upstream_ready(Offered(probe))),  # type: ignore[arg-type]
        _I.RESPONSE_END: lambda: probe.response_end([]),
        _I.FAILED: lambda: probe.upstream_failed("x"),
        _I.RETIRE: probe.retire,
    }[input]


@EVERY_PAIR
@given(pair=st.sampled_from([(s, i) for s in ProbeState for i in ProbeInput]))
def test_probe_takes_every_pair_as_its_table_says(pair: tuple[ProbeState, ProbeInput]) -> None:
    state, input = pair
    pb, probe = probe_in(state)
    deliver = inputs(pb, probe, input)
    out = len(pb.core.fx.out)
    take(TRANSITIONS, probe, state, input, deliver)
    if TRANSITIONS[pair] is IGNORED:
        assert len(pb.core.fx.out) == out  # an ignored input does nothing


def test_a_check_that_ended_hands_back_a_connection_offered_late() -> None:
    """The pool forgets a check that ended, so this cannot come by it; should a connection be
    offered anyway, the probe closes it rather than leave it open."""
    _, probe = probe_in(_S.RUNNING)
    probe.timer_fired(ProbeTimer.PROBE_TIMEOUT)
    assert probe.state is _S.IDLE

    offered = Offered(probe)
    probe.upstream_ready(offered)  # type: ignore[arg-type]  # only what a hand-back touches
    assert offered.closed and offered.exchange is None
    assert probe.state is _S.IDLE

"""``flow.Flow``: a source is stopped at high water and resumed only at low water, each edge
reported once, so a sink holds at most ``high_water + read_size`` = ``stream_buffer`` bytes
(design §4)."""

from __future__ import annotations

import attrs
import h2.settings
from hypothesis import given, settings
from hypothesis import strategies as st
from playbook import BACKEND, H1BackendPeer, H2ClientPeer, Playbook, h2_sse_stream

from muxproxy.config import Limits, quick_config
from muxproxy.core.commands import PauseReading, ResumeReading
from muxproxy.core.flow import BufferLimits, Flow

LIMITS = BufferLimits(high_water=1000, low_water=500)


def test_limits_leave_one_read_above_high_water() -> None:
    limits = BufferLimits.for_stream_buffer(256 * 1024, 16 * 1024)
    assert limits.high_water + 16 * 1024 == 256 * 1024
    assert 0 < limits.low_water < limits.high_water


def test_connection_stops_above_its_bound_and_resumes_at_low_water_with_a_gap() -> None:
    limits = BufferLimits.for_stream_buffer(256 * 1024, 16 * 1024, 1024 * 1024)
    assert not limits.connection_full(1024 * 1024)
    assert limits.connection_full(1024 * 1024 + 1)
    # Stopped sources stay stopped above half the bound.
    assert limits.congested(512 * 1024 + 1)
    assert not limits.congested(512 * 1024)
    # They are asked to resume only at the stream's low water, below the congestion mark.
    assert limits.low_water < 512 * 1024
    assert not limits.connection_drained(limits.low_water + 1)
    assert limits.connection_drained(limits.low_water)


def test_filled_stops_once_at_high_water() -> None:
    flow = Flow()
    assert not flow.filled(999, LIMITS)
    assert not flow.stopped
    assert flow.filled(1000, LIMITS)
    assert flow.stopped
    # Still full, or fuller: the stop was reported already.
    assert not flow.filled(1000, LIMITS)
    assert not flow.filled(5000, LIMITS)
    assert flow.stopped


def test_drained_resumes_once_at_low_water_not_between() -> None:
    flow = Flow(stopped=True)
    # Between the marks a stopped source stays stopped: that is the hysteresis.
    assert not flow.drained(999, LIMITS)
    assert not flow.drained(501, LIMITS)
    assert flow.stopped
    assert flow.drained(500, LIMITS)
    assert not flow.stopped
    assert not flow.drained(0, LIMITS)
    # Running between the marks: it goes on, and is not stopped again before high water.
    assert not flow.filled(999, LIMITS)
    assert not flow.stopped


def test_drained_does_nothing_to_a_running_source() -> None:
    flow = Flow()
    assert not flow.drained(0, LIMITS)
    assert not flow.stopped


def test_forced_stop_and_resume_report_only_real_changes() -> None:
    flow = Flow()
    assert flow.stop()
    assert not flow.stop()
    # Stopped from outside, it resumes by the same rule: at low water.
    assert not flow.drained(600, LIMITS)
    assert flow.drained(100, LIMITS)
    assert not flow.resume()
    flow.stop()
    assert flow.resume()
    assert not flow.stopped


def test_credit_is_released_only_while_running() -> None:
    flow = Flow()
    flow.hold(10)
    assert flow.release() == 10
    assert flow.release() == 0
    flow.stop()
    flow.hold(20)
    flow.hold(5)
    # RFC 9113 §6.9: a stopped HTTP/2 source gets no WINDOW_UPDATE.
    assert flow.release() == 0
    assert flow.withheld == 25
    flow.resume()
    assert flow.release() == 25
    assert flow.withheld == 0


def test_take_gives_back_everything_even_when_stopped() -> None:
    flow = Flow(stopped=True)
    flow.hold(7)
    assert flow.take() == 7
    assert flow.withheld == 0
    assert flow.stopped  # taking the credit does not resume the source


# One step of a relay: a read from the source (at most ``read_size`` bytes, only while it
# runs), the sink's socket taking some of what it holds (a fraction of it), or either one
# landing exactly on a mark or next to it, where an off-by-one would show.
MARKS = ("low", "low+1", "high-1", "high")
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("read"), st.integers(min_value=1, max_value=10**6)),
        st.tuples(st.just("sent"), st.floats(min_value=0.0, max_value=1.0)),
        st.tuples(st.just("read_to"), st.sampled_from(MARKS)),
        st.tuples(st.just("sent_to"), st.sampled_from(MARKS)),
    ),
    max_size=300,
)


def mark(limits: BufferLimits, name: str) -> int:
    return {
        "low": limits.low_water,
        "low+1": limits.low_water + 1,
        "high-1": limits.high_water - 1,
        "high": limits.high_water,
    }[name]


@settings(max_examples=300, deadline=None)
@given(
    stream_buffer=st.integers(min_value=2048, max_value=1 << 20),
    read_size=st.integers(min_value=1, max_value=1 << 16),
    steps=STEPS,
)
def test_any_relay_holds_at_most_one_read_above_high_water(
    stream_buffer: int, read_size: int, steps: list[tuple[str, float | str]]
) -> None:
    # As ``ProxyCore`` derives them: a read is at most half the buffer.
    read_size = min(read_size, stream_buffer // 2)
    limits = BufferLimits.for_stream_buffer(stream_buffer, read_size)
    flow = Flow()
    held = 0
    edges: list[str] = []
    credit_in = credit_out = 0
    for kind, amount in steps:
        if kind in ("read", "read_to"):
            if flow.stopped:
                continue  # the driver reads no more from a stopped source
            if isinstance(amount, str):
                n = min(read_size, max(1, mark(limits, amount) - held))
            else:
                n = int(amount) % read_size + 1
            held += n
            flow.hold(n)
            credit_in += n
        elif isinstance(amount, str):
            held = min(held, mark(limits, amount))
        else:
            held -= int(held * amount)
        # What every user does after a change of level (``Exchange._check_request_flow``).
        if flow.filled(held, limits):
            assert held >= limits.high_water
            edges.append("stop")
        elif flow.drained(held, limits):
            assert held <= limits.low_water
            edges.append("resume")
        released = flow.release()
        assert not (released and flow.stopped)
        credit_out += released
        # The bound of design §4, and no crossing missed.
        # A read comes only while the source runs, so below high water: one read above it
        # at most, never the whole buffer.
        assert held < limits.high_water + read_size == stream_buffer
        if held >= limits.high_water:
            assert flow.stopped
        if held <= limits.low_water:
            assert not flow.stopped
        assert credit_in == credit_out + flow.withheld
    # Stop and resume alternate, beginning with a stop; the state is the last edge.
    assert edges == ["stop", "resume"] * (len(edges) // 2) + ["stop"] * (len(edges) % 2)
    assert flow.stopped == (edges[-1:] == ["stop"])


# -- through the core ----------------------------------------------------------------------


def test_retry_after_connection_stall_pauses_the_new_backend() -> None:
    """A backend stopped by the client connection's bound (``Output._stall_all``) while it
    owed its response head fails; the retry's backend starts running, and is stopped like any
    other while the connection is still over its bound, then resumed with the rest."""
    bound = 64 * 1024
    config = attrs.evolve(
        quick_config("127.0.0.1:8080", [BACKEND, "127.0.0.1:9002"]),
        limits=attrs.evolve(Limits(), connection_buffer=bound),
    )
    pb = Playbook(config)
    pb.accept(1)
    client = H2ClientPeer()
    # Wide windows: every byte goes to the socket at once, none waits in a stream queue.
    client.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
    client.conn.increment_flow_control_window(2**31 - 1 - 65535)
    _, streaming = h2_sse_stream(pb, client, data=client.preface())
    _, request = client.request(b"GET", b"/v1/stream")
    pb.receive(1, request)
    waiting = pb.opens()[-1].conn
    pb.opened(waiting)
    chunk = b"%x\r\n%s\r\n" % (16008, b"data: " + b"z" * 16000 + b"\n\n")
    down = pb.core.clients[1]
    paused: set[int] = set()
    while down.pending <= bound:
        paused |= {c.conn for c in pb.receive(streaming, chunk) if isinstance(c, PauseReading)}
    assert paused == {streaming, waiting}
    pb.closed(waiting, "connection reset")
    retry = pb.opens()[-1].conn
    assert retry != waiting
    pb.opened(retry)
    backend = H1BackendPeer()
    backend.events(pb.take(retry))
    commands = pb.receive(retry, backend.sse_head() + backend.chunk(b"data: one\n\n"))
    assert [c.conn for c in commands if isinstance(c, PauseReading)] == [retry]
    commands = pb.sent(1, down.pending)
    assert {c.conn for c in commands if isinstance(c, ResumeReading)} == {streaming, retry}

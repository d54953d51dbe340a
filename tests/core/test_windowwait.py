"""A stream whose HTTP/2 window stays closed costs nothing while it waits (``windowwait.py``).

Bytes only: a real h2 client that sets SETTINGS_INITIAL_WINDOW_SIZE to 0 (or a few bytes) and
never sends a WINDOW_UPDATE, an h11 backend that keeps producing SSE chunks. The backend is
paused at the first chunk that does not fit the window, what it still delivers makes no
command, no timer runs in a loop meanwhile, and the stream holds one chunk, not
``limits.stream_buffer``. A WINDOW_UPDATE that lets all of it out reads the backend again.

From the first chunk on, each test is a conversation: every command in order, timers included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import h2.events
import h2.settings
from checks import Check
from playbook import H2ClientPeer, Playbook, Sends, data, h2_sse_stream

from muxproxy.core.commands import (
    CancelTimer,
    Command,
    PauseReading,
    ResumeReading,
    SetTimer,
)
from muxproxy.core.events import Wakeup

CHUNK = b"data: " + b"t" * 200 + b"\n\n"
"""About one OpenAI chat.completion.chunk."""


def _stalled_stream(window: int) -> tuple[Playbook, H2ClientPeer, int, int, bytes]:
    """A client with stream window ``window`` and an SSE stream on it: (playbook, client,
    stream id, backend conn, one chunk on the backend's wire)."""
    pb = Playbook()
    pb.accept(1)
    client = H2ClientPeer()
    client.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
    sid, up = h2_sse_stream(pb, client, data=client.preface())
    client.events(pb.take(1))
    wire = b"%x\r\n" % len(CHUNK) + CHUNK + b"\r\n"  # one chunk of the backend's body
    return pb, client, sid, up, wire


def _armed(log: list[Command]) -> dict[object, float]:
    """The timers armed at the end of ``log``: id -> deadline."""
    timers: dict[object, float] = {}
    for command in log:
        if isinstance(command, SetTimer):
            timers[command.timer] = command.at
        elif isinstance(command, CancelTimer):
            timers.pop(command.timer, None)
    return timers


def _pauses(pb: Playbook, up: int, read: bytes) -> None:
    """Backend connection ``up`` sends ``read``, which does not fit the closed window: the
    window's deadline (``timeouts.send``) is armed and the backend paused, nothing written."""
    pb >> data(up, read)
    pb << SetTimer(timer=("window", 1), at=pb.now + 60.0)
    pb << PauseReading(conn=up)
    pb.done()


def _relays(sid: int, body: bytes) -> Check:
    """DATA on stream ``sid``: exactly ``body``, in one frame."""

    def check(events: Sequence[Any]) -> None:
        got = [(e.stream_id, e.data) for e in events if isinstance(e, h2.events.DataReceived)]
        assert got == [(sid, body)], events

    return check


def test_closed_window_pauses_the_backend_at_the_first_chunk_that_does_not_fit() -> None:
    pb, _, _, up, wire = _stalled_stream(0)
    _pauses(pb, up, wire)
    # What the paused backend had in flight (or sends anyway) makes no command at all: no
    # write, no timer, no second pause.
    for _ in range(200):
        pb >> data(up, wire)
        pb.done()


def test_stalled_stream_runs_no_timer_loop() -> None:
    pb, _, _, up, wire = _stalled_stream(0)
    _pauses(pb, up, wire)
    # Ten simulated seconds (well inside every timeout) with the backend's data still coming:
    # the core is woken for nothing but those reads, and arms no timer that would wake it.
    handled = 0
    for _ in range(100):
        pb.now += 0.1
        before = len(pb.log)
        pb >> data(up, wire)
        pb.done()
        handled += 1
        assert len(pb.log) == before
        due = [at for at in _armed(pb.log).values() if at <= pb.now]
        assert due == [], "a timer came due while the stream was stalled"
    assert handled == 100
    # The timers that are armed wake the core once, far away: the window's (``timeouts.send``)
    # and the backend's own; none within the ten seconds.
    assert min(_armed(pb.log).values()) >= pb.now + 10
    assert not any(isinstance(c, Wakeup) for c in pb.log)


def test_stalled_stream_holds_one_read_not_its_stream_buffer() -> None:
    pb, _, _, up, wire = _stalled_stream(0)
    # One read of the backend, many chunks: the window is closed at the first; the pause
    # comes after the read, which is all the stream holds.
    read = wire * (pb.core.read_size // len(wire))
    _pauses(pb, up, read)
    (stats,) = pb.core.statistics().streams
    assert stats.upstream_paused
    assert stats.response_buffered <= pb.core.read_size
    assert pb.core.read_size < pb.core.config.limits.stream_buffer


def test_window_update_that_lets_everything_out_reads_the_backend_again() -> None:
    pb, client, sid, up, wire = _stalled_stream(0)
    _pauses(pb, up, wire)
    # A window that lets out part of the queue: still stalled, nothing resumes.
    client.conn.increment_flow_control_window(10, stream_id=sid)
    pb >> data(1, client.conn.data_to_send())
    pb << Sends(1, client, _relays(sid, CHUNK[:10]))
    pb.done()  # no ResumeReading
    # One that lets out the rest: the backend is read again.
    client.conn.increment_flow_control_window(1 << 16, stream_id=sid)
    pb >> data(1, client.conn.data_to_send())
    pb << ResumeReading(conn=up)
    pb << Sends(1, client, _relays(sid, CHUNK[10:]))
    pb.done()

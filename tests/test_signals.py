"""The signals' table (``muxproxy/process/signals.py``), every handled signal in both states,
and :func:`obey` acting on a real signal stream's numbers in order."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator

import pytest
import trio

from muxproxy.process.signals import (
    HANDLED_SIGNALS,
    WORKER_SIGNALS,
    Action,
    action_of,
    obey,
)

EXPECTED = {
    # signal: (serving, stopping)
    signal.SIGTERM: (Action.STOP, Action.CUT),
    signal.SIGINT: (Action.STOP, Action.CUT),
    signal.SIGQUIT: (Action.STOP, Action.KEEP_STOPPING),
    signal.SIGHUP: (Action.RELOAD, Action.REFUSE),
    signal.SIGUSR1: (Action.REOPEN_LOGS, Action.REOPEN_LOGS),
    signal.SIGUSR2: (Action.RESTART, Action.REFUSE),
}


def test_every_handled_signal_has_its_action_serving_and_stopping() -> None:
    assert set(HANDLED_SIGNALS) == set(EXPECTED)
    for signum, (serving, stopping) in EXPECTED.items():
        assert action_of(signum, stopping=False) is serving, signum.name
        assert action_of(signum, stopping=True) is stopping, signum.name


def test_a_worker_takes_only_the_signals_that_stop_and_cut() -> None:
    for signum in WORKER_SIGNALS:
        assert action_of(signum, stopping=False) is Action.STOP
        assert action_of(signum, stopping=True) is Action.CUT


def test_a_signal_muxproxy_does_not_handle_is_an_error() -> None:
    with pytest.raises(ValueError, match="not one muxproxy handles"):
        action_of(signal.SIGWINCH, stopping=False)


class Recorder:
    """A process that records what its signals did; a stop makes it stopping."""

    def __init__(self) -> None:
        self.did: list[str] = []
        self.is_stopping = False

    def stopping(self) -> bool:
        return self.is_stopping

    async def on_stop(self, signum: signal.Signals, *, cut: bool) -> None:
        self.is_stopping = True
        self.did.append(f"{'cut' if cut else 'stop'} {signum.name}")

    async def on_keep_stopping(self, signum: signal.Signals) -> None:
        self.did.append(f"keep stopping {signum.name}")

    async def on_reload(self) -> None:
        self.did.append("reload")

    async def on_reopen_logs(self) -> None:
        self.did.append("reopen logs")

    async def on_restart(self) -> None:
        self.did.append("restart")

    async def on_refused(self, signum: signal.Signals) -> None:
        self.did.append(f"refused {signum.name}")


async def test_obey_acts_on_each_signal_in_order_and_the_stop_changes_what_follows() -> None:
    async def received() -> AsyncIterator[int]:
        for signum in (
            signal.SIGHUP,
            signal.SIGUSR2,
            signal.SIGUSR1,
            signal.SIGQUIT,
            signal.SIGQUIT,
            signal.SIGHUP,
            signal.SIGUSR1,
            signal.SIGTERM,
        ):
            yield int(signum)

    host = Recorder()
    with trio.fail_after(5):
        await obey(received(), host)
    assert host.did == [
        "reload",
        "restart",
        "reopen logs",
        "stop SIGQUIT",
        "keep stopping SIGQUIT",
        "refused SIGHUP",
        "reopen logs",
        "cut SIGTERM",
    ]

"""The signals a serving process obeys, and what each one does: one table for every process.

One process (``process/cli.py``), the supervisor of ``--workers N`` (``process/workers.py``)
and each of its workers (``process/worker.py``) take their signals here, so they cannot drift
apart: an operator sends the same signal to either kind of process and gets the same
behaviour (nginx's, which operators of LLM fleets expect):

- **SIGTERM, SIGINT (Ctrl-C), SIGQUIT** stop gracefully: no new connection or request; the
  running streams get ``timeouts.shutdown_grace`` to finish. Repeated during the stop, SIGTERM
  or SIGINT cuts what still runs (as a second Ctrl-C does); a repeated SIGQUIT, nginx's
  graceful stop, stays graceful.
- **SIGHUP** reloads the configuration file; **SIGUSR1** reopens the access log after log
  rotation renamed it (nginx's USR1); **SIGUSR2** is the rolling restart of ``--workers``
  (one process has no workers to restart, and says so). While stopping, a reload or a
  restart is refused with a log line (nothing new starts in a process on its way out); the
  access log is still reopened, since a drain of long streams can outlast a log rotation.
- A signal left unhandled would end the process and cut every stream, so every process
  subscribes to every signal of :data:`HANDLED_SIGNALS` (workers: to the stop signals, the
  rest reach them from their supervisor as control messages).

:func:`action_of` is the table, pure (tested with data); :func:`obey` reads the signals and
calls the process's :class:`SignalHost` for each action.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import AsyncIterator
from typing import Protocol, assert_never

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
"""Signals that stop gracefully, as nginx's: no new connection or request; running streams
get ``timeouts.shutdown_grace`` to finish."""
CUT_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""Stop signals that, repeated during a graceful stop, cut what still runs (as a second
Ctrl-C does); a repeated SIGQUIT, nginx's graceful stop, stays graceful."""
RELOAD_SIGNAL = signal.SIGHUP
"""Reloads the configuration file (nginx's HUP)."""
REOPEN_LOG_SIGNAL = signal.SIGUSR1
"""Reopens the access log file at its path, after log rotation renamed it (nginx's USR1);
a reload (SIGHUP) does it too."""
RESTART_SIGNAL = signal.SIGUSR2
"""The rolling restart of ``--workers N``: each worker replaced in turn, no stream dropped."""
HANDLED_SIGNALS = (*STOP_SIGNALS, RELOAD_SIGNAL, RESTART_SIGNAL, REOPEN_LOG_SIGNAL)
"""Every signal a serving process (one process, or a supervisor) takes."""
WORKER_SIGNALS = CUT_SIGNALS
"""The signals a worker of ``--workers N`` takes itself: a Ctrl-C reaches the terminal's
whole process group, so its workers stop (and, repeated, cut) with their supervisor; every
other signal reaches a worker from its supervisor, as a control message."""


class Action(enum.Enum):
    """What one signal does, given whether the process is already stopping."""

    STOP = "stop"
    """Stop gracefully."""
    CUT = "cut"
    """Cut what still runs (a stop signal of :data:`CUT_SIGNALS`, repeated)."""
    KEEP_STOPPING = "keep stopping"
    """A repeated graceful stop (SIGQUIT): the stop goes on as it was."""
    RELOAD = "reload"
    REOPEN_LOGS = "reopen logs"
    RESTART = "restart"
    REFUSE = "refuse"
    """A reload or a restart while stopping: nothing new starts."""


def action_of(signum: int, *, stopping: bool) -> Action:
    """The action of ``signum`` (one of :data:`HANDLED_SIGNALS`) in a process that is
    ``stopping`` or not."""
    if signum in STOP_SIGNALS:
        if not stopping:
            return Action.STOP
        return Action.CUT if signum in CUT_SIGNALS else Action.KEEP_STOPPING
    if signum == REOPEN_LOG_SIGNAL:
        return Action.REOPEN_LOGS
    if stopping:
        return Action.REFUSE
    if signum == RELOAD_SIGNAL:
        return Action.RELOAD
    if signum == RESTART_SIGNAL:
        return Action.RESTART
    raise ValueError(f"signal {signum} is not one muxproxy handles")


class SignalHost(Protocol):
    """A process as its signals act on it."""

    def stopping(self) -> bool:
        """Whether a stop has begun."""
        ...

    async def on_stop(self, signum: signal.Signals, *, cut: bool) -> None:
        """Stop gracefully, or (``cut``) cut what still runs; say so in the log."""
        ...

    async def on_keep_stopping(self, signum: signal.Signals) -> None: ...

    async def on_reload(self) -> None: ...

    async def on_reopen_logs(self) -> None: ...

    async def on_restart(self) -> None: ...

    async def on_refused(self, signum: signal.Signals) -> None:
        """``signum`` arrived while stopping: log that it is ignored."""
        ...


async def obey(signals: AsyncIterator[int], host: SignalHost) -> None:
    """Act on each signal received, in order, until ``signals`` ends."""
    async for signum in signals:
        received = signal.Signals(signum)
        action = action_of(received, stopping=host.stopping())
        match action:
            case Action.STOP:
                await host.on_stop(received, cut=False)
            case Action.CUT:
                await host.on_stop(received, cut=True)
            case Action.KEEP_STOPPING:
                await host.on_keep_stopping(received)
            case Action.RELOAD:
                await host.on_reload()
            case Action.REOPEN_LOGS:
                await host.on_reopen_logs()
            case Action.RESTART:
                await host.on_restart()
            case Action.REFUSE:
                await host.on_refused(received)
            case _:
                assert_never(action)

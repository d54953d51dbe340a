"""A ``python -m muxproxy serve`` process as a user runs it, for end-to-end tests.

:func:`proxy_process` starts one and yields once it printed its listening lines (and its
``muxproxy admin on ...`` line, when asked); its stdout and stderr are collected line by line
as they come (:class:`Output`), so a test waits for a line, never for a while.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio

START_TIMEOUT = 30.0
"""Seconds for a ``python -m muxproxy`` process to start listening (imports on a busy box)."""
STOP_TIMEOUT = 10.0
"""Seconds for a process sent its stop signal at the end of a test to exit."""
LISTENING = "muxproxy listening on "
ADMIN = "muxproxy admin on "


@attrs.define
class Output:
    """The lines a process writes on one pipe, collected as they come."""

    lines: list[str] = attrs.Factory(list)
    closed: bool = False
    _changed: trio.Event = attrs.Factory(trio.Event)

    async def pump(self, stream: trio.abc.ReceiveStream) -> None:
        pending = b""
        while chunk := await stream.receive_some(65536):
            pending += chunk
            *complete, pending = pending.split(b"\n")
            self.lines.extend(line.decode() for line in complete)
            self._notify()
        self.closed = True
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, predicate: Callable[[str], bool], start: int = 0) -> str:
        """The first line from index ``start`` on that satisfies ``predicate``."""
        while True:
            for line in self.lines[start:]:
                if predicate(line):
                    return line
            assert not self.closed, f"closed without the line; got {self.lines}"
            await self._changed.wait()

    async def wait_closed(self) -> None:
        """Until the pipe is closed (every line is in ``lines``)."""
        while not self.closed:
            await self._changed.wait()

    def text(self) -> str:
        return "\n".join(self.lines)


@attrs.define
class ProxyProcess:
    process: trio.Process
    config: Path
    stdout: Output
    stderr: Output

    def ports(self) -> list[int]:
        """Each listening line's port, in the order printed."""
        return [int(url.rsplit(":", 1)[1]) for url in self.urls(LISTENING)]

    def urls(self, prefix: str = LISTENING) -> list[str]:
        """The URL of each stdout line starting with ``prefix``, in the order printed."""
        return [line.removeprefix(prefix) for line in self.stdout.lines if line.startswith(prefix)]

    @property
    def url(self) -> str:
        """The first listener's URL (``http://127.0.0.1:PORT``)."""
        return self.urls(LISTENING)[0]

    @property
    def admin_url(self) -> str:
        """The admin API's URL, from the ``muxproxy admin on ...`` line."""
        return self.urls(ADMIN)[0]

    def send(self, signum: signal.Signals) -> None:
        self.process.send_signal(signum)

    async def wait_exit(self) -> int:
        return await self.process.wait()

    async def wait_log(self, text: str, start: int = 0) -> str:
        """The message of the first error-log line holding ``text``."""
        return log_message(await self.stderr.wait_for(lambda line: text in line, start))

    def log_messages(self, text: str) -> list[str]:
        """The messages of the error-log lines so far holding ``text``."""
        return [log_message(line) for line in self.stderr.lines if text in line]


def log_message(line: str) -> str:
    """An error-log line without its ``<timestamp> <LEVEL> `` prefix."""
    stamp, level, message = line.split(" ", 2)
    assert stamp.endswith("Z") and level.isupper(), line
    return message


@asynccontextmanager
async def proxy_process(
    nursery: trio.Nursery,
    *args: str,
    config: Path | None = None,
    listeners: int = 1,
    admin: bool = False,
    env: Mapping[str, str] | None = None,
    stop: signal.Signals | None = None,
) -> AsyncIterator[ProxyProcess]:
    """``python -m muxproxy serve`` (``--config`` when given), once its ``listeners`` listening
    lines are printed (and, with ``admin``, its admin line); ``env``: its whole environment
    (default: this process's). At the end, if it is still running, it is sent ``stop`` and
    given ``STOP_TIMEOUT`` seconds to exit (no ``stop``: none), then killed."""
    command = [sys.executable, "-m", "muxproxy", "serve", *args]
    if config is not None:
        command += ["--config", str(config)]
    process = await trio.lowlevel.open_process(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=None if env is None else dict(env),
    )
    assert process.stdout is not None and process.stderr is not None
    running = ProxyProcess(
        process=process, config=config or Path(), stdout=Output(), stderr=Output()
    )
    nursery.start_soon(running.stdout.pump, process.stdout)
    nursery.start_soon(running.stderr.pump, process.stderr)
    try:
        with trio.fail_after(START_TIMEOUT):
            while len(running.ports()) < listeners:
                await running.stdout.wait_for(
                    lambda line: line.startswith(LISTENING), start=len(running.stdout.lines)
                )
            if admin:
                await running.stdout.wait_for(lambda line: line.startswith(ADMIN))
        yield running
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None and stop is not None:
                process.send_signal(stop)
                with trio.move_on_after(STOP_TIMEOUT):
                    await process.wait()
            if process.returncode is None:
                process.kill()
            await process.wait()

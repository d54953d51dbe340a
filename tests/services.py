"""Real services for tests: a ``redis-server`` process and a headless Chromium.

Registered by ``tests/conftest.py`` (``pytest_plugins``); fixtures ``redis_server``,
``redis_sentinel`` (a Sentinel of that server), ``chromium`` (one browser for the session)
and ``browser_page`` (a fresh page per test).

They obey the suite's rules for peers: real processes on 127.0.0.1, readiness known by an
event, never by a wait of a fixed length, and a missing tool fails the test that needs it, with
the command that installs it (``scripts/test``), instead of skipping it.

Redis. Each ``redis_server`` is its own process on a free port, with nothing persisted
(``--save '' --appendonly no``), so a kill loses everything, as a crash of a cache does. It is
run with ``--supervised systemd`` and a ``NOTIFY_SOCKET`` of ours: Redis sends ``READY=1`` to
that datagram socket once it accepts connections (sd_notify(3)), so the fixture waits on a
message, racing the process's exit (a taken port), under ``fail_after``. Tests may ``kill()``
it mid-test (SIGKILL: the port is closed when ``kill()`` returns) and ``restart()`` it on the
same port. A ``redis_sentinel`` is the same process started as ``redis-server <conf>
--sentinel`` with a configuration file of its own (Sentinel rewrites it), ready once it names
the primary it monitors (``SENTINEL get-master-addr-by-name``).

Chromium. Playwright's API runs on asyncio, which cannot share a thread with Trio, so one
asyncio loop runs in a thread of its own for the whole session and holds the browser (Debian's
``/usr/bin/chromium``; Playwright downloads none). Trio tests await coroutines on that loop
through :meth:`AsyncioThread.run`: the Trio task waits on a ``trio.Event`` set from the loop,
and a cancelled Trio wait (``fail_after``) cancels the asyncio task, so a page that never
reaches a condition fails its test at the test's own deadline.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import coredis
import pytest
import trio

if TYPE_CHECKING:
    from playwright.async_api import Browser, Page, Playwright

T = TypeVar("T")

INSTALL_HINT = "run scripts/test, which installs it (or apt-get install {package})"

REDIS_SERVER = "redis-server"
REDIS_START_TIMEOUT = 10.0
"""Seconds for ``redis-server`` to accept connections (it takes milliseconds; a busy box)."""
SENTINEL_SERVICE = "mymaster"
"""The name a ``redis_sentinel`` monitors its primary by (``sentinel monitor``)."""
REDIS_STOP_TIMEOUT = 10.0
"""Seconds for a SIGKILLed ``redis-server`` to be reaped."""
PORT_ATTEMPTS = 5
"""Free ports tried in turn: another process may take the one we found before Redis binds it."""

CHROMIUM = "/usr/bin/chromium"
BROWSER_TIMEOUT = 60.0
"""Seconds for Playwright to start its driver and launch, or close, Chromium (a cold box)."""
PAGE_TIMEOUT = 30.0
"""A safety bound on one page operation; a test's own ``fail_after`` is meant to be shorter."""


# --- Redis -------------------------------------------------------------------------------------


class RedisStartError(Exception):
    """``redis-server`` exited before it was ready; ``log`` is what it wrote meanwhile."""

    def __init__(self, port: int, log: str) -> None:
        super().__init__(f"redis-server on port {port} exited before it was ready:\n{log}")
        self.port = port
        self.log = log


@attrs.define
class RedisServer:
    """A running ``redis-server`` on ``127.0.0.1:port``, which a test may kill and restart."""

    port: int
    directory: Path
    """Its working directory: the notify socket and ``redis.log`` (its stdout and stderr)."""
    sentinel_of: int | None = None
    """For a Sentinel (``redis-server <conf> --sentinel``): the port of the primary it monitors
    as :data:`SENTINEL_SERVICE`."""
    _process: trio.Process | None = None

    @property
    def url(self) -> str:
        if self.sentinel_of is not None:
            return f"redis+sentinel://127.0.0.1:{self.port}/{SENTINEL_SERVICE}"
        return f"redis://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @classmethod
    async def start(cls, directory: Path, sentinel_of: int | None = None) -> RedisServer:
        """A server on a free port, once it accepts connections (a Sentinel of the primary on
        port ``sentinel_of``, once it names that primary).

        Raises :class:`RedisStartError` if it exits before that on every port tried.
        """
        for attempt in range(PORT_ATTEMPTS):
            server = cls(port=_free_port(), directory=directory, sentinel_of=sentinel_of)
            try:
                await server.restart()
            except RedisStartError as error:
                if "Address already in use" not in error.log or attempt == PORT_ATTEMPTS - 1:
                    raise
            else:
                return server
        raise AssertionError("unreachable")

    async def kill(self) -> None:
        """SIGKILL, as a crash (nothing is saved); returns once it is gone and its port closed.

        Killing a server that is not running does nothing.
        """
        process, self._process = self._process, None
        if process is None:
            return
        process.kill()
        with trio.CancelScope(shield=True), trio.fail_after(REDIS_STOP_TIMEOUT):
            await process.wait()

    async def restart(self) -> None:
        """Kill it if it runs, then start it again on the same port, empty.

        Returns once it accepts connections; raises :class:`RedisStartError` if it exits first
        (the port was taken meanwhile).
        """
        await self.kill()
        if self.sentinel_of is None:
            self._process = await _launch_redis(self.port, self.directory)
            return
        # Sentinel rewrites its configuration file (its id, what it learns): ours, writable.
        conf = self.directory / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\n"
            f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {self.sentinel_of} 1\n"
            f"sentinel down-after-milliseconds {SENTINEL_SERVICE} 1000\n"
        )
        self._process = await _launch_redis(self.port, self.directory, sentinel_conf=conf)
        try:
            await _expect_primary(self.port, self.sentinel_of)
        except BaseException:
            await self.kill()
            raise


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def _launch_redis(
    port: int, directory: Path, *, sentinel_conf: Path | None = None
) -> trio.Process:
    notify_path = directory / "notify"
    notify_path.unlink(missing_ok=True)
    log_path = directory / "redis.log"
    log_start = log_path.stat().st_size if log_path.exists() else 0
    sentinel = [] if sentinel_conf is None else [str(sentinel_conf), "--sentinel"]
    command = [
        REDIS_SERVER, *sentinel,
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--save", "",
        "--appendonly", "no",
        "--dir", str(directory),
        "--supervised", "systemd",
    ]  # fmt: skip
    with trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        await notify.bind(str(notify_path))
        with log_path.open("ab") as log:
            process = await trio.lowlevel.open_process(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "NOTIFY_SOCKET": str(notify_path)},
            )
        try:
            with trio.fail_after(REDIS_START_TIMEOUT):
                ready = await _wait_ready(process, notify)
        except BaseException:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()
            raise
    if not ready:
        with log_path.open("rb") as log:
            log.seek(log_start)
            raise RedisStartError(port, log.read().decode(errors="replace"))
    await _expect_pong(port)
    return process


async def _wait_ready(process: trio.Process, notify: trio.socket.SocketType) -> bool:
    """True at the ``READY=1`` notification; False if the process exits first."""
    ready = False

    async def wait_notification() -> None:
        nonlocal ready
        while b"READY=1" not in (await notify.recv(4096)).split(b"\n"):
            pass
        ready = True
        nursery.cancel_scope.cancel()

    async def wait_exit() -> None:
        await process.wait()
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_notification)
        nursery.start_soon(wait_exit)
    return ready


async def _expect_pong(port: int) -> None:
    """One inline PING: the server on the port is a Redis that answers (not a retry loop)."""
    with trio.fail_after(REDIS_START_TIMEOUT):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"PING\r\n")
            reply = b""
            while not reply.endswith(b"\r\n"):
                chunk = await stream.receive_some(64)
                assert chunk, f"redis-server on port {port} closed the connection at PING"
                reply += chunk
    assert reply == b"+PONG\r\n", f"redis-server on port {port} answered PING with {reply!r}"


async def _expect_primary(port: int, primary_port: int) -> None:
    """Until the Sentinel on ``port`` answers ``SENTINEL get-master-addr-by-name`` with the
    primary (it knows it from its configuration: at once, but asked, not assumed)."""
    with trio.fail_after(REDIS_START_TIMEOUT):
        async with coredis.Redis(
            "127.0.0.1", port, decode_responses=True, verify_version=False
        ) as client:
            while True:
                answer = await client.sentinel_get_master_addr_by_name(SENTINEL_SERVICE)
                if answer is not None:
                    break
                await trio.sleep(0.01)
    assert answer == ("127.0.0.1", primary_port), f"Sentinel on port {port} names {answer!r}"


@pytest.fixture
async def redis_server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RedisServer]:
    """A fresh ``redis-server`` for the test, killed at its end; fails when none is installed."""
    if shutil.which(REDIS_SERVER) is None:
        pytest.fail(
            f"{REDIS_SERVER} is not installed; " + INSTALL_HINT.format(package="redis-server")
        )
    # A short path: the notify socket's must fit in sockaddr_un (108 bytes).
    server = await RedisServer.start(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        await server.kill()


# --- Chromium ----------------------------------------------------------------------------------


async def lifespan(receive: Any, send: Any) -> None:
    """The ASGI lifespan protocol for a test's Hypercorn app: start, then shut down."""
    while (await receive())["type"] == "lifespan.startup":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


class AsyncioThread:
    """An asyncio event loop running in a daemon thread of its own, for Playwright."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="asyncio-playwright", daemon=True
        )
        self._thread.start()

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coroutine`` on the loop and block this (non-Trio) thread for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the loop; from Trio, cancellable (cancels the asyncio task)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        future.add_done_callback(lambda _: token.run_sync_soon(done.set))
        try:
            await done.wait()
        finally:
            # Only succeeds while the task still runs (we were cancelled); it then cancels it.
            future.cancel()
        return future.result()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(BROWSER_TIMEOUT)
        if not self._thread.is_alive():
            self._loop.close()


@attrs.define
class BrowserPage:
    """A page in a context of its own; every method awaits Playwright on the asyncio thread."""

    _thread: AsyncioThread
    _page: Page
    console: list[str] = attrs.Factory(list)
    """The page's console messages and uncaught errors so far (``"<type>: <text>"``)."""

    async def goto(self, url: str) -> int | None:
        """Load ``url`` (until its ``load`` event); the response's status (None: ``data:``)."""

        async def goto() -> int | None:
            response = await self._page.goto(url, timeout=PAGE_TIMEOUT * 1000)
            return None if response is None else response.status

        return await self._thread.run(goto())

    async def evaluate(self, expression: str, arg: Any = None) -> Any:
        """The JSON value of a JavaScript expression or function (``page.evaluate``)."""
        return await self._thread.run(self._page.evaluate(expression, arg))

    async def wait_for(self, expression: str, arg: Any = None) -> Any:
        """Until ``expression`` is truthy in the page (polled each animation frame); its value."""

        async def wait() -> Any:
            handle = await self._page.wait_for_function(
                expression, arg=arg, timeout=PAGE_TIMEOUT * 1000
            )
            return await handle.json_value()

        return await self._thread.run(wait())

    async def call(self, action: Callable[[Page], Awaitable[T]]) -> T:
        """Any other Playwright call: ``await page.call(lambda p: p.click("#go"))``."""

        async def act() -> T:
            return await action(self._page)

        return await self._thread.run(act())

    async def close(self) -> None:
        await self._thread.run(self._page.context.close())


@attrs.define
class Chromium:
    """The session's headless Chromium; :meth:`new_page` from a Trio test."""

    _thread: AsyncioThread
    _browser: Browser

    @property
    def version(self) -> str:
        return self._browser.version

    async def new_page(self) -> BrowserPage:
        console: list[str] = []

        async def open_page() -> Page:
            context = await self._browser.new_context()
            page = await context.new_page()
            page.on("console", lambda message: console.append(f"{message.type}: {message.text}"))
            page.on("pageerror", lambda error: console.append(f"pageerror: {error}"))
            return page

        return BrowserPage(self._thread, await self._thread.run(open_page()), console)


@pytest.fixture(scope="session")
def chromium() -> Iterator[Chromium]:
    """One headless Chromium for the session; fails when it or Playwright is missing."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is not installed; " + INSTALL_HINT.format(package="chromium"))
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        pytest.fail("the playwright package is not installed; run scripts/test, which installs it")

    async def launch() -> tuple[Playwright, Browser]:
        playwright = await async_playwright().start()
        try:
            return playwright, await playwright.chromium.launch(
                executable_path=CHROMIUM, headless=True
            )
        except BaseException:
            await playwright.stop()
            raise

    thread = AsyncioThread()
    try:
        playwright, browser = thread.call(launch(), BROWSER_TIMEOUT)
        try:
            yield Chromium(thread, browser)
        finally:
            thread.call(browser.close(), BROWSER_TIMEOUT)
            thread.call(playwright.stop(), BROWSER_TIMEOUT)
    finally:
        thread.close()


@pytest.fixture
async def browser_page(chromium: Chromium) -> AsyncIterator[BrowserPage]:
    """A fresh page (in a context of its own) of the session's Chromium, closed at the end."""
    page = await chromium.new_page()
    try:
        yield page
    finally:
        with trio.CancelScope(shield=True):
            await page.close()


@pytest.fixture
async def redis_sentinel(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RedisServer]:
    """A Redis Sentinel monitoring ``redis_server`` as :data:`SENTINEL_SERVICE`, killed at the
    test's end; its ``url`` is the ``redis+sentinel://`` store URL. Fails when none is
    installed (as ``redis_server``)."""
    sentinel = await RedisServer.start(
        tmp_path_factory.mktemp("sentinel"), sentinel_of=redis_server.port
    )
    try:
        yield sentinel
    finally:
        await sentinel.kill()

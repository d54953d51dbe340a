"""Shared fixtures: fake LLM backends and a proxy, all on 127.0.0.1 with port 0.

Real services (``redis_server``, ``chromium``, ``browser_page``) are in ``tests/services.py``.

Every ``ProxyCore`` of the suite, in this process and in ``python -m muxproxy`` subprocesses
(which inherit the environment), re-raises internal errors instead of isolating them, so a bug
fails its test. Tests of the isolation itself pass ``raise_errors=False``.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import pytest
import trio

import muxproxy.compiled
from muxproxy.config import Config, Limits, Timeouts, quick_config
from muxproxy.core.raising import RAISE_ERRORS_ENV
from muxproxy.testing.fakellm import FakeLLM, serve_fakellm
from muxproxy.trio.server import ProxyServer

os.environ[RAISE_ERRORS_ENV] = "1"

pytest_plugins = ["services"]

EXPECT_COMPILED_ENV = "MUXPROXY_EXPECT_COMPILED"
"""Set to 1 (CI's second run, after ``scripts/compile --require``): the session fails at once
unless every module of the compiled build is imported compiled."""


def pytest_report_header() -> str:
    return f"muxproxy build: {muxproxy.compiled.build()}"


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get(EXPECT_COMPILED_ENV) == "1":
        build = muxproxy.compiled.build()
        if build != "compiled":
            raise pytest.UsageError(
                f"{EXPECT_COMPILED_ENV}=1 but the muxproxy build is {build} "
                f"(compiled: {muxproxy.compiled.compiled_modules()}); run scripts/compile"
            )


@attrs.define
class RunningProxy:
    server: ProxyServer
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


StartBackend = Callable[..., Awaitable[tuple[FakeLLM, int]]]
StartProxy = Callable[..., Awaitable[RunningProxy]]


@pytest.fixture
def start_backend(nursery: trio.Nursery) -> StartBackend:
    """``fake, port = await start_backend(backend_id="gpu0", tokens=4, delay=0.01)``."""

    async def start(**options: Any) -> tuple[FakeLLM, int]:
        fake = FakeLLM(**options)
        port = await nursery.start(serve_fakellm, fake)
        return fake, port

    return start


@pytest.fixture
def start_proxy(nursery: trio.Nursery) -> StartProxy:
    """``proxy = await start_proxy([port1, port2], timeouts=Timeouts(...), limits=...)``.

    Or ``await start_proxy(config=Config(...))`` for a full configuration.
    ``raise_errors=False``: contain internal errors as in production (tests of that alone).
    """

    async def start(
        backend_ports: list[int] | None = None,
        *,
        config: Config | None = None,
        timeouts: Timeouts | None = None,
        limits: Limits | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        raise_errors: bool | None = None,
    ) -> RunningProxy:
        if config is None:
            config = quick_config(
                "127.0.0.1:0",
                [f"127.0.0.1:{p}" for p in backend_ports or []],
                tls_cert=tls_cert,
                tls_key=tls_key,
            )
            config = attrs.evolve(
                config, timeouts=timeouts or config.timeouts, limits=limits or config.limits
            )
        server = ProxyServer(config, raise_errors=raise_errors)
        addresses = await nursery.start(server.run)
        return RunningProxy(server=server, port=addresses[0][1])

    return start

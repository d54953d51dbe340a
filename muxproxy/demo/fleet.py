"""The demo's fleet: fake GPU backends that can be killed, and the proxy with its admin API.

Everything listens on 127.0.0.1, port 0. Each backend is a
:class:`~muxproxy.testing.fakellm.FakeLLM` served in a cancel scope of its own: cancelling
it makes Hypercorn close the listener and every live connection at once, as a crashed GPU
server would (new connects are refused, streams stop without their last chunk).

The proxy is configured from a table, exactly what a ``muxproxy.toml`` would hold
(:func:`config_table`), checked by :func:`~muxproxy.config.parse_config` as ``muxproxy
check`` checks a file.
"""

from __future__ import annotations

import logging
import sys
from functools import partial
from typing import Any

import attrs
import trio

from muxproxy.config import Config, parse_config
from muxproxy.testing.fakellm import FakeLLM, serve_fakellm
from muxproxy.trio.local import serve_control
from muxproxy.trio.server import ProxyServer

GROUP = "gpus"
CHAT_PATH = "/v1/chat/completions"
SESSION_HEADER = "X-Chat-ID"


@attrs.define
class FakeGPU:
    """One fake backend, killable."""

    fake: FakeLLM
    port: int
    scope: trio.CancelScope
    stopped: trio.Event

    @property
    def name(self) -> str:
        return self.fake.backend_id

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def kill(self) -> None:
        """Close its listener and every connection; returns once they are closed."""
        self.scope.cancel()
        await self.stopped.wait()


async def start_gpu(nursery: trio.Nursery, fake: FakeLLM) -> FakeGPU:
    """Serve ``fake`` on a free port, in a cancel scope of its own."""
    scope = trio.CancelScope()
    stopped = trio.Event()

    async def serve(task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with scope:
                await serve_fakellm(fake, task_status=task_status)
        finally:
            stopped.set()

    port: int = await nursery.start(serve)
    return FakeGPU(fake=fake, port=port, scope=scope, stopped=stopped)


def config_table(
    gpus: list[tuple[FakeGPU, int]], token: str, health_interval: float
) -> dict[str, Any]:
    """The proxy's configuration as a TOML table: one group of ``gpus`` (each with its
    starting weight), sticky by the ``X-Chat-ID`` header, retried and continued on failure,
    actively health-checked; one OpenAI route; the admin API guarded by ``token``."""
    return {
        "listeners": [{"address": "127.0.0.1:0"}],
        "admin": {"address": "127.0.0.1:0", "token": token},
        "log": {"access": "off"},
        "upstreams": {
            GROUP: {
                "servers": [{"address": gpu.address, "weight": weight} for gpu, weight in gpus],
                "sticky": {"sources": [f"header:{SESSION_HEADER}"]},
                "next_upstream": {
                    "on": ["error", "timeout", "http_502", "http_503"],
                    "tries": 3,
                    "tries_timeout": 10,
                },
                "health_check": {
                    "path": "/health",
                    "interval": health_interval,
                    "timeout": health_interval / 2,
                },
                "timeouts": {"connect": 2, "first_token": 10},
            }
        },
        "routes": [
            {
                "prefix": "/v1/",
                "upstream": GROUP,
                "retry_until_first_event": True,
                "continue_on_failure": True,
                "api": "openai",
            }
        ],
    }


def build_config(table: dict[str, Any]) -> Config:
    """The checked configuration (``MUXPROXY_ADMIN_TOKEN`` ignored: the demo prints its
    own token). Raises ``ConfigError``: a bug in the demo's table."""
    return parse_config(table, environ={})


@attrs.frozen(kw_only=True)
class Proxy:
    server: ProxyServer
    port: int
    admin_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"


async def start_proxy(nursery: trio.Nursery, config: Config) -> Proxy:
    """Start the proxy and its admin listener. The proxy's own error log prints errors
    only: the demo shows the rest itself (``server.driver.on_log`` sees every record)."""
    quiet_error_log()
    server = ProxyServer(config)
    ((_, port), *_) = await nursery.start(server.run)
    admin = await nursery.start(partial(serve_control, server))
    return Proxy(server=server, port=port, admin_port=admin[1])


def quiet_error_log() -> None:
    """Give the ``muxproxy`` logger a handler for errors only (and so none of its own
    stderr handler: ``configure_error_log`` leaves a configured logger alone)."""
    log = logging.getLogger("muxproxy")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.ERROR)
        log.addHandler(handler)
        log.propagate = False

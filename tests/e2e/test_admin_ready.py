"""``GET /ready`` of the admin API: open on every address, 503 from the start of a graceful stop.

The rules on a proxy in this process (``serve_local``, its admin listener on port 0): the
answer and its status, no token on an address that is not loopback (``0.0.0.0``, reached on
127.0.0.1, as the other admin tests do), GET only. The stop on real processes, as a user runs
them: ``python -m muxproxy serve`` and ``serve --workers 2`` sent SIGTERM while a backend in
this process holds a stream open; readiness must turn 503 while the stream still runs and
``/status`` still answers, and (the supervisor) stay 200 through a rolling restart.

Every wait is on a condition (an event, an output line, a response) under ``trio.fail_after``.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import h11
import httpx
import pytest
import trio
from peers import open_tcp, serve_raw
from processes import ProxyProcess, proxy_process

from muxproxy.config import load_config
from muxproxy.trio.admin import READY_PATH
from muxproxy.trio.local import serve_local

if TYPE_CHECKING:
    from conftest import StartBackend

TOKEN = "ready-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
READY = {"ready": True}
STOPPING = {"ready": False, "reason": "stopping"}
TEST_TIMEOUT = 60
"""Seconds for a test with real processes (worker interpreters start and import twice)."""


def write_config(path: Path, port: int, *, admin_address: str = "127.0.0.1:0") -> Path:
    path.write_text(
        '[[listeners]]\naddress = "127.0.0.1:0"\n'
        f'[upstreams.llm]\nservers = ["127.0.0.1:{port}"]\n'
        f'[admin]\naddress = "{admin_address}"\ntoken = "{TOKEN}"\n'
    )
    return path


@asynccontextmanager
async def running(config_path: Path) -> AsyncIterator[tuple[str, httpx.AsyncClient]]:
    """``serve_local`` for ``config_path``: its admin URL (on 127.0.0.1) and a client."""
    async with trio.open_nursery() as nursery, httpx.AsyncClient(timeout=5) as client:
        _, admin = await nursery.start(serve_local, load_config(config_path))
        yield f"http://127.0.0.1:{admin[1]}", client
        nursery.cancel_scope.cancel()


@attrs.define
class HeldStream:
    """An HTTP/1.1 backend whose SSE stream sends one event, then waits for ``release``."""

    release: trio.Event = attrs.field(factory=trio.Event)
    started: trio.Event = attrs.field(factory=trio.Event)

    async def handle(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        while not isinstance(event := conn.next_event(), h11.EndOfMessage):
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
        head = h11.Response(status_code=200, headers=[("content-type", "text/event-stream")])
        await stream.send_all(conn.send(head) + conn.send(h11.Data(data=b"data: one\n\n")))
        self.started.set()
        await self.release.wait()
        await stream.send_all(conn.send(h11.Data(data=b"data: two\n\n")))
        await stream.send_all(conn.send(h11.EndOfMessage()))
        await stream.aclose()


async def answer(client: httpx.AsyncClient, url: str) -> tuple[int, Any]:
    response = await client.get(url)
    return response.status_code, response.json()


async def stop_during_a_stream(
    client: httpx.AsyncClient, served: ProxyProcess, held: HeldStream, stopping_line: str
) -> dict[str, Any]:
    """Hold a stream open through ``served``, send SIGTERM, and once ``stopping_line`` is
    logged check readiness and the proxy port; release the stream, which must end whole.
    Returns ``/status`` as it answered during the drain."""
    admin = served.admin_url
    async with client.stream("GET", f"{served.url}/v1/events") as stream:
        chunks = stream.aiter_bytes()
        received = [await anext(chunks)]
        await held.started.wait()
        served.send(signal.SIGTERM)
        await served.stderr.wait_for(lambda line: stopping_line in line)
        assert await answer(client, f"{admin}{READY_PATH}") == (503, STOPPING)
        status = await client.get(f"{admin}/status")
        assert status.status_code == 200, status.text
        # A second look: it stays not-ready for the rest of the drain.
        assert await answer(client, f"{admin}{READY_PATH}") == (503, STOPPING)
        held.release.set()
        received.extend([chunk async for chunk in chunks])
    assert b"".join(received) == b"data: one\n\ndata: two\n\n"
    document: dict[str, Any] = status.json()
    return document


async def test_ready_is_200_and_needs_no_token_on_a_non_loopback_address(
    start_backend: StartBackend, tmp_path: Path
) -> None:
    _, port = await start_backend(backend_id="gpu0")
    config = write_config(tmp_path / "muxproxy.toml", port, admin_address="0.0.0.0:0")
    with trio.fail_after(10):
        async with running(config) as (admin, client):
            response = await client.get(f"{admin}{READY_PATH}")
            assert (response.status_code, response.json()) == (200, READY)
            assert response.headers["content-type"] == "application/json"
            assert response.headers["cache-control"] == "no-store"
            # The rule it is exempt from still holds for the other reads.
            assert (await client.get(f"{admin}/status")).status_code == 401
            # A token, even a wrong one, changes nothing: readiness ignores it.
            wrong = {"Authorization": "Bearer wrong"}
            assert (await client.get(f"{admin}{READY_PATH}", headers=wrong)).status_code == 200


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
async def test_ready_takes_only_get(
    start_backend: StartBackend, tmp_path: Path, method: str
) -> None:
    _, port = await start_backend(backend_id="gpu0")
    config = write_config(tmp_path / "muxproxy.toml", port)
    with trio.fail_after(10):
        async with running(config) as (admin, client):
            response = await client.request(method, f"{admin}{READY_PATH}", headers=AUTH)
            assert response.status_code == 405
            assert response.headers["allow"] == "GET"
            assert "takes GET" in response.json()["error"]
            assert await answer(client, f"{admin}{READY_PATH}") == (200, READY)


async def test_ready_turns_503_when_a_graceful_stop_begins_while_status_answers(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    held = HeldStream()
    config = write_config(tmp_path / "muxproxy.toml", await serve_raw(nursery, held.handle))
    with trio.fail_after(TEST_TIMEOUT):
        async with (
            trio.open_nursery() as pumps,
            proxy_process(pumps, config=config, admin=True, stop=signal.SIGTERM) as served,
            httpx.AsyncClient(timeout=10) as client,
        ):
            assert await answer(client, f"{served.admin_url}{READY_PATH}") == (200, READY)
            status = await stop_during_a_stream(client, served, held, "stopping: 1 stream")
            assert status["streams"] == 1
            assert await served.wait_exit() == 0
        # The admin listener went with the process, not before.
        with pytest.raises(OSError):
            await open_tcp(int(served.admin_url.rsplit(":", 1)[1]))


async def test_the_supervisor_stays_ready_through_a_rolling_restart_but_not_a_stop(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    held = HeldStream()
    config = write_config(tmp_path / "muxproxy.toml", await serve_raw(nursery, held.handle))
    args = ("--workers", "2")
    with trio.fail_after(TEST_TIMEOUT):
        async with (
            trio.open_nursery() as pumps,
            proxy_process(pumps, *args, config=config, admin=True, stop=signal.SIGTERM) as served,
            httpx.AsyncClient(timeout=30) as client,
        ):
            ready_url = f"{served.admin_url}{READY_PATH}"
            assert await answer(client, ready_url) == (200, READY)
            # Asked back to back while every worker is replaced, one slot after the other.
            seen: list[tuple[int, Any]] = []
            restarted = trio.Event()

            async def probe() -> None:
                while not restarted.is_set():
                    seen.append(await answer(client, ready_url))

            async with trio.open_nursery() as probing:
                probing.start_soon(probe)
                response = await client.post(f"{served.admin_url}/reload?restart=1", headers=AUTH)
                restarted.set()
            assert response.status_code == 200, response.text
            assert seen and all(each == (200, READY) for each in seen), seen
            status = await stop_during_a_stream(client, served, held, "workers drain")
            assert status["streams"] == 1
            assert await served.wait_exit() == 0

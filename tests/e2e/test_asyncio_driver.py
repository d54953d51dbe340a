"""``examples/asyncio_driver.py``: the core on asyncio streams, as a process a user runs.

The example driver runs as ``python examples/asyncio_driver.py --listen 127.0.0.1:0
--upstream ...`` in front of the fake LLM backend; the tests wait for its listening line and
then stream through it with httpx over HTTP/1.1 and HTTP/2 with prior knowledge (h2c), check
that every token arrives in order, that a client going away mid-stream reaches the backend
as a disconnect, and that SIGTERM lets a running stream finish before the process exits.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import h2.errors
import httpx
import trio
from peers import open_h2
from processes import LISTENING, Output

if TYPE_CHECKING:
    from conftest import StartBackend

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "asyncio_driver.py"
START_TIMEOUT = 30.0
"""Seconds for the process to import muxproxy and listen (a busy machine)."""
CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@attrs.define
class DriverProcess:
    process: trio.Process
    stdout: Output
    stderr: Output

    @property
    def url(self) -> str:
        line = next(line for line in self.stdout.lines if line.startswith(LISTENING))
        return line.removeprefix(LISTENING)


@asynccontextmanager
async def asyncio_driver(nursery: trio.Nursery, backend_port: int) -> AsyncIterator[DriverProcess]:
    """The example driver in front of the backend on ``backend_port``, once listening; killed
    at the end if still running."""
    command = [
        sys.executable,
        str(EXAMPLE),
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        f"127.0.0.1:{backend_port}",
    ]
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout is not None and process.stderr is not None
    running = DriverProcess(process=process, stdout=Output(), stderr=Output())
    nursery.start_soon(running.stdout.pump, process.stdout)
    nursery.start_soon(running.stderr.pump, process.stderr)
    try:
        with trio.fail_after(START_TIMEOUT):
            await running.stdout.wait_for(lambda line: line.startswith(LISTENING))
        yield running
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
            await process.wait()


def tokens_of(lines: list[str]) -> list[str]:
    """The content of every ``data:`` chunk, ``[DONE]`` as itself."""
    out = []
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", line
            continue
        payload = line.removeprefix("data: ")
        if payload == "[DONE]":
            out.append(payload)
            continue
        delta = json.loads(payload)["choices"][0]["delta"]
        if delta.get("content"):
            out.append(delta["content"])
    return out


async def stream_tokens(client: httpx.AsyncClient, url: str) -> tuple[str, list[str]]:
    """One streamed completion: (HTTP version, its tokens in order of arrival)."""
    async with client.stream("POST", url + CHAT, json=BODY) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in response.aiter_lines()]
        return response.http_version, tokens_of(lines)


def expected(n: int) -> list[str]:
    return [f"tok{i} " for i in range(n)] + ["[DONE]"]


async def test_h1_sse_tokens_arrive_in_order(
    nursery: trio.Nursery, start_backend: StartBackend
) -> None:
    _, port = await start_backend(tokens=12, delay=0.005)
    async with asyncio_driver(nursery, port) as proxy:
        with trio.fail_after(15):
            async with httpx.AsyncClient() as client:
                for _ in range(2):  # the second one on the kept-alive connection
                    version, tokens = await stream_tokens(client, proxy.url)
                    assert version == "HTTP/1.1"
                    assert tokens == expected(12)


async def test_h2_prior_knowledge_streams_arrive_whole_and_in_order(
    nursery: trio.Nursery, start_backend: StartBackend
) -> None:
    _, port = await start_backend(tokens=10, delay=0.005)
    async with asyncio_driver(nursery, port) as proxy:
        with trio.fail_after(15):
            async with httpx.AsyncClient(http1=False, http2=True) as client:
                results: list[tuple[str, list[str]]] = []

                async def one() -> None:
                    results.append(await stream_tokens(client, proxy.url))

                async with trio.open_nursery() as streams:  # concurrent, on one connection
                    for _ in range(4):
                        streams.start_soon(one)
    assert [version for version, _ in results] == ["HTTP/2"] * 4
    assert all(tokens == expected(10) for _, tokens in results)


async def read_two_tokens_then_leave(client: httpx.AsyncClient, url: str) -> None:
    async with client.stream("POST", url + CHAT, json=BODY) as response:
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data: ")
            if seen == 2:
                return  # leaving the block closes the response mid-stream


async def test_h1_client_that_leaves_mid_stream_disconnects_the_backend(
    nursery: trio.Nursery, start_backend: StartBackend
) -> None:
    fake, port = await start_backend(tokens=10_000, delay=0.01)
    async with asyncio_driver(nursery, port) as proxy:
        with trio.fail_after(15):
            async with httpx.AsyncClient() as client:
                await read_two_tokens_then_leave(client, proxy.url)
            await fake.wait_disconnect()
    assert fake.streams_completed == 0


async def test_h2_stream_reset_disconnects_the_backend_and_the_other_stream_goes_on(
    nursery: trio.Nursery, start_backend: StartBackend
) -> None:
    # A raw h2 peer: httpx drops an HTTP/2 response closed early without RST_STREAM.
    fake, port = await start_backend(delay=0.01)
    body = json.dumps(BODY).encode()
    async with asyncio_driver(nursery, port) as proxy:
        with trio.fail_after(15):
            async with open_h2(int(proxy.url.rsplit(":", 1)[1])) as peer:
                json_type = ("content-type", "application/json")
                doomed = await peer.request(
                    "POST", CHAT, [json_type, ("x-fake-tokens", "10000")], body
                )
                other = await peer.request("POST", CHAT, [json_type, ("x-fake-tokens", "8")], body)
                await peer.wait_until(lambda: len(peer.streams[doomed].frames) >= 2)
                await peer.reset(doomed, h2.errors.ErrorCodes.CANCEL)
                await fake.wait_disconnect()
                state = await peer.wait_done(other)
    assert state.ended and state.reset is None and state.status == 200
    assert tokens_of(state.body.decode().split("\n")) == expected(8)
    assert fake.disconnects == 1


async def test_sigterm_lets_the_running_stream_finish_then_exits(
    nursery: trio.Nursery, start_backend: StartBackend
) -> None:
    fake, port = await start_backend(tokens=20, delay=0.02)
    lines: list[str] = []
    async with asyncio_driver(nursery, port) as proxy:
        with trio.fail_after(15):
            async with (
                httpx.AsyncClient() as client,
                client.stream("POST", proxy.url + CHAT, json=BODY) as response,
            ):
                async for line in response.aiter_lines():
                    lines.append(line)
                    if len(lines) == 1:  # the first token is through: stop now
                        assert line.startswith("data: ")
                        proxy.process.send_signal(signal.SIGTERM)
            assert tokens_of(lines) == expected(20)
            assert await proxy.process.wait() == 0
            await proxy.stderr.wait_closed()
    events = [json.loads(line)["event"] for line in proxy.stderr.lines if line.startswith("{")]
    assert "shutdown_started" in events and "drained" in events
    assert fake.streams_completed == 1


async def test_example_imports_no_trio() -> None:
    probe = (
        "import runpy, sys; runpy.run_path(sys.argv[1], run_name='asyncio_driver');"
        " assert 'trio' not in sys.modules, sorted(m for m in sys.modules if 'trio' in m)"
    )
    with trio.fail_after(START_TIMEOUT):
        result = await trio.run_process(
            [sys.executable, "-c", probe, str(EXAMPLE)], capture_stderr=True, check=False
        )
    assert result.returncode == 0, result.stderr.decode()

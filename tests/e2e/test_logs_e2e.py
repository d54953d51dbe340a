"""The access and error logs of a real ``python -m muxproxy serve`` process, and X-Request-ID
end to end: through httpx and curl, to the fake LLM backend and back."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import httpx
import trio
from peers import closed_port
from processes import Output, ProxyProcess, proxy_process

from muxproxy.testing.fakellm import FakeLLM

if TYPE_CHECKING:
    from conftest import StartBackend

STAMP = re.compile(r"\A\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z\Z")
CHAT = "/v1/chat/completions"
BODY = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})


@attrs.define
class Serving:
    proxy: ProxyProcess

    @property
    def port(self) -> int:
        return self.proxy.ports()[0]

    async def line_with(self, text: str, timeout: float = 10) -> str:
        """The first stderr line containing ``text``, once there is one."""
        with trio.fail_after(timeout):
            return await self.proxy.stderr.wait_for(lambda line: text in line)

    async def stop(self) -> str:
        """SIGTERM, then everything it wrote to stderr."""
        self.proxy.send(signal.SIGTERM)
        with trio.fail_after(10):
            await self.proxy.stderr.wait_closed()
            await self.proxy.wait_exit()
        return self.proxy.stderr.text()


@asynccontextmanager
async def serve(tmp_path: Path, config: str, *flags: str) -> AsyncIterator[Serving]:
    """``python -m muxproxy serve --config FILE FLAGS``, its listening line read; stopped
    (SIGTERM) at the end."""
    path = tmp_path / "muxproxy.toml"
    path.write_text(config)
    async with (
        trio.open_nursery() as nursery,
        proxy_process(nursery, *flags, config=path, stop=signal.SIGTERM) as proxy,
    ):
        assert proxy.url.startswith("http://127.0.0.1:"), proxy.stdout.lines
        yield Serving(proxy)


def config(servers: list[int], log: str) -> str:
    listed = ", ".join(f'"127.0.0.1:{port}"' for port in servers)
    return (
        '[[listeners]]\naddress = "127.0.0.1:0"\n'
        f"[upstreams.gpus]\nservers = [{listed}]\n"
        f"[log]\n{log}\n"
    )


def fields_of(line: str) -> dict[str, str]:
    """A text access line: the timestamp under "time", then its key=value fields."""
    stamp, rest = line.split(" ", 1)
    fields = dict(re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', rest))
    return {
        "time": stamp,
        **{k: json.loads(v) if v.startswith('"') else v for k, v in fields.items()},
    }


async def stream_chat(port: int, headers: dict[str, str]) -> tuple[httpx.Response, bytes]:
    async with (
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
        client.stream("POST", CHAT, content=BODY, headers=headers) as response,
    ):
        body = b"".join([chunk async for chunk in response.aiter_bytes()])
    return response, body


async def test_text_access_line_on_stderr_and_the_request_id_round_trip(
    tmp_path: Path, start_backend: StartBackend
) -> None:
    fake, backend = await start_backend(tokens=3, delay=0.005, first_delay=0.05, role_chunk=True)
    async with serve(tmp_path, config([backend], 'format = "text"')) as proxy:
        with trio.fail_after(10):
            response, body = await stream_chat(proxy.port, {"X-Request-ID": "e2e-text-1"})
            line = await proxy.line_with("request_id=e2e-text-1")
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "e2e-text-1"
    assert isinstance(fake, FakeLLM) and fake.last_request_headers is not None
    assert fake.last_request_headers["x-request-id"] == "e2e-text-1"
    fields = fields_of(line)
    assert STAMP.match(fields["time"]), line
    assert list(fields)[1] == "request_id"  # the documented order
    assert fields["method"] == "POST" and fields["target"] == CHAT
    assert fields["version"] == "1.1" and fields["upstream_version"] == "1.1"
    assert fields["status"] == "200" and fields["group"] == "gpus" and fields["tries"] == "1"
    assert fields["server"] == f"127.0.0.1:{backend}"
    assert fields["events"] == "6"  # role-only, 3 tokens, finish, [DONE]
    assert fields["bytes_out"] == str(len(body)) and fields["bytes_in"] == str(len(BODY))
    assert fields["outcome"] == "ok" and fields["session"] == "-"
    # The role-only chunk came at once, the first token after first_delay: TTFT is the token's.
    assert float(fields["ttfh"]) < 0.05 <= float(fields["ttft"]) <= float(fields["duration"])


async def test_json_access_line_and_a_generated_request_id_through_curl(
    tmp_path: Path, start_backend: StartBackend
) -> None:
    _, backend = await start_backend(tokens=2, delay=0, role_chunk=True)
    async with serve(tmp_path, config([backend], 'format = "json"')) as proxy:
        with trio.fail_after(10):
            result = await trio.run_process(
                [
                    *("curl", "-sS", "-N", "-D", "-", "-H", "Content-Type: application/json"),
                    *("--data", BODY, f"http://127.0.0.1:{proxy.port}{CHAT}"),
                ],
                capture_stdout=True,
            )
            head = result.stdout.decode().split("\r\n\r\n", 1)[0]
            (sent,) = re.findall(r"(?im)^x-request-id: (\S+)$", head)
            record: dict[str, Any] = json.loads(await proxy.line_with(f'"request_id": "{sent}"'))
    assert re.fullmatch(r"[0-9a-f]{12}-1", sent)
    assert STAMP.match(record["time"])
    assert record["status"] == 200 and record["events"] == 5 and record["ttft"] is not None
    assert record["session"] is None and record["server_id"] is not None


@asynccontextmanager
async def access_pipe(path: Path) -> AsyncIterator[Output]:
    """A named pipe at ``path`` for the proxy's access "file", and the lines it writes there,
    collected as they come: the proxy opens and appends to it as to a file (line-buffered),
    so each line arrives when its exchange ends, and a test waits for it, not for a while."""
    os.mkfifo(path)
    # Opened for reading first, so the proxy's open for writing does not block; and once for
    # writing here, so the reader sees no end of file before the proxy has opened it.
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    writer = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    lines = Output()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lines.pump, trio.lowlevel.FdStream(reader))
            yield lines
            nursery.cancel_scope.cancel()
    finally:
        os.close(writer)


async def test_access_file_and_the_error_log_level_flag(
    tmp_path: Path, start_backend: StartBackend
) -> None:
    _, backend = await start_backend(tokens=1, delay=0)
    dead = await closed_port()
    access = tmp_path / "access.log"
    log = f'access = "{access}"\nformat = "json"\nlevel = "error"'
    # The file says "error"; the flag lets the retry warnings through.
    async with (
        access_pipe(access) as access_lines,
        serve(tmp_path, config([dead, backend], log), "--log-level", "warning") as proxy,
    ):
        with trio.fail_after(10):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{proxy.port}") as client:
                for _ in range(2):  # round robin: one of them goes to the dead server first
                    response = await client.get("/v1/models")
                    assert response.status_code == 200
            retry = await proxy.line_with(" WARNING retry ")
            health = await proxy.line_with(" WARNING health ")
            # The proxy writes each line after its response: wait for the second one.
            await access_lines.wait_for(lambda line: True, start=1)
            stderr = await proxy.stop()
    assert f"server=127.0.0.1:{dead}" in retry and "condition=error" in retry
    assert STAMP.match(retry.split(" ", 1)[0])
    assert "up=false" in health
    records = [json.loads(line) for line in access_lines.lines]
    assert sorted(r["tries"] for r in records) == [1, 2]
    assert "outcome=" not in stderr  # access lines went to the file only

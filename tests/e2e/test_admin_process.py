"""The admin API of a real ``python -m muxproxy serve`` process, and ``muxproxy admin``.

The proxy runs as a user runs it, from a configuration file with an ``[admin]`` section on
127.0.0.1 port 0 (its ``muxproxy admin on http://...`` line gives the port), in front of real
``FakeLLM`` backends in this process. ``muxproxy admin`` runs as a subprocess too, so its
output and exit status are what a user sees. A restarted process must keep the weights set
before (the state file).

Every wait is on an output line or a process exit under ``trio.fail_after``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import httpx
import trio
from peers import closed_port
from processes import ProxyProcess, proxy_process

from muxproxy.config import ADMIN_TOKEN_ENV

if TYPE_CHECKING:
    from conftest import StartBackend

TOKEN = "process-token"
START_TIMEOUT = 15
"""Seconds for ``python -m muxproxy admin`` to run."""
TEST_TIMEOUT = 90
"""Seconds for a whole test: a few processes started and a few ``muxproxy admin`` runs."""


def write_config(path: Path, ports: list[int]) -> Path:
    servers = ", ".join(f'"127.0.0.1:{port}"' for port in ports)
    path.write_text(
        "[[listeners]]\n"
        'address = "127.0.0.1:0"\n'
        "[upstreams.llm]\n"
        f"servers = [{servers}]\n"
        "[admin]\n"
        'address = "127.0.0.1:0"\n'
        f'token = "{TOKEN}"\n'
        'state_file = "state.json"\n'
    )
    return path


def environment(token: str | None) -> dict[str, str]:
    """This process's environment with ``token`` as the admin token (None: without one)."""
    env = {key: value for key, value in os.environ.items() if key != ADMIN_TOKEN_ENV}
    if token is not None:
        env[ADMIN_TOKEN_ENV] = token
    return env


@asynccontextmanager
async def serve(
    config: Path | None, *flags: str, token: str | None = None
) -> AsyncIterator[ProxyProcess]:
    """``python -m muxproxy serve --config CONFIG`` (or ``serve FLAGS``, ``config`` None),
    once it printed its listening and admin lines; ``token``: in the environment."""
    async with (
        trio.open_nursery() as nursery,
        proxy_process(nursery, *flags, config=config, admin=True, env=environment(token)) as served,
    ):
        assert served.url.startswith("http://127.0.0.1:"), served.stdout.lines
        assert served.admin_url.startswith("http://127.0.0.1:"), served.stdout.lines
        yield served


@attrs.frozen
class Ran:
    status: int
    out: str
    err: str


async def admin(url: str, *args: str, token: str | None = TOKEN) -> Ran:
    """``python -m muxproxy admin --url URL ARGS`` (the token from the environment)."""
    with trio.fail_after(START_TIMEOUT):
        done = await trio.run_process(
            [sys.executable, "-m", "muxproxy", "admin", "--url", url, *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=environment(token),
        )
    return Ran(done.returncode, done.stdout.decode(), done.stderr.decode())


async def refused_reload(url: str) -> str:
    """``muxproxy admin reload`` of a file the proxy refuses: exit status 1 and the 422 that
    says the running configuration stays; returns all it printed on stderr."""
    ran = await admin(url, "reload")
    assert ran.status == 1
    assert "POST /reload: 422 Unprocessable" in ran.err
    assert "the running configuration stays" in ran.err
    return ran.err


async def backends_seen(url: str, n: int = 4) -> set[str]:
    async with httpx.AsyncClient(timeout=5) as client:
        responses = [await client.get(f"{url}/health") for _ in range(n)]
    assert all(response.status_code == 200 for response in responses)
    return {response.headers["x-backend-id"] for response in responses}


async def test_admin_status_prints_a_table_of_the_servers(
    start_backend: StartBackend, tmp_path: Path
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        _, p0 = await start_backend(backend_id="gpu0")
        _, p1 = await start_backend(backend_id="gpu1")
        async with serve(write_config(tmp_path / "muxproxy.toml", [p0, p1])) as served:
            ran = await admin(served.admin_url, "status", token=None)
        assert ran.status == 0, ran.err
        lines = ran.out.splitlines()
        assert lines[0].startswith(f"generation 1; workers: {served.process.pid} (generation 1)")
        assert f"listening on {served.url.removeprefix('http://')}" in lines
        header = lines.index("upstream llm (round_robin)")
        assert lines[header + 1].split() == [
            "SERVER",
            "ID",
            "WEIGHT",
            "STATE",
            "HEALTH",
            "ACTIVE",
            "FAILURES",
            "WORK",
        ]
        rows = [line.split() for line in lines[header + 2 : header + 4]]
        assert [(row[0], row[2], row[3], row[4], row[5]) for row in rows] == [
            (f"127.0.0.1:{p0}", "1", "up", "healthy", "0"),
            (f"127.0.0.1:{p1}", "1", "up", "healthy", "0"),
        ]


async def test_admin_weight_and_drain_change_routing_and_a_restart_keeps_them(
    start_backend: StartBackend, tmp_path: Path
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        _, p0 = await start_backend(backend_id="gpu0")
        _, p1 = await start_backend(backend_id="gpu1")
        config = write_config(tmp_path / "muxproxy.toml", [p0, p1])
        async with serve(config) as served:
            assert await backends_seen(served.url) == {"gpu0", "gpu1"}
            ran = await admin(served.admin_url, "weight", "llm", f"127.0.0.1:{p0}", "0")
            assert ran.status == 0, ran.err
            assert ran.out.strip() == (
                f"upstream llm: server 127.0.0.1:{p0}: weight 0 (configured 1), draining,"
                " healthy, 0 active"
            )
            assert await backends_seen(served.url) == {"gpu1"}
            ran = await admin(served.admin_url, "status")
            assert f"127.0.0.1:{p0}" in ran.out
            row = next(line.split() for line in ran.out.splitlines() if f":{p0} " in line)
            assert row[2:5] == ["0", "(1)", "draining"]
        async with serve(config) as served:
            # A new process: the state file brought the weight back before the first request.
            assert await backends_seen(served.url) == {"gpu1"}
            ran = await admin(served.admin_url, "weight", "llm", f"127.0.0.1:{p0}", "2")
            assert ran.status == 0, ran.err
            ran = await admin(served.admin_url, "drain", "llm", f"127.0.0.1:{p1}")
            assert ran.status == 0, ran.err
            assert "draining" in ran.out
            assert await backends_seen(served.url) == {"gpu0"}
            ran = await admin(served.admin_url, "undrain", "llm", f"127.0.0.1:{p1}")
            assert ran.status == 0, ran.err
            ran = await admin(served.admin_url, "down", "llm", f"127.0.0.1:{p0}")
            assert (ran.status, "down" in ran.out) == (0, True), ran.err
            assert await backends_seen(served.url) == {"gpu1"}
            ran = await admin(served.admin_url, "up", "llm", f"127.0.0.1:{p0}")
            assert (ran.status, " up," in ran.out) == (0, True), ran.err
            assert await backends_seen(served.url) == {"gpu0", "gpu1"}


async def test_admin_refusals_print_the_message_and_exit_non_zero(
    start_backend: StartBackend, tmp_path: Path
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        _, p0 = await start_backend(backend_id="gpu0")
        async with serve(write_config(tmp_path / "muxproxy.toml", [p0])) as served:
            ran = await admin(served.admin_url, "weight", "llm", f"127.0.0.1:{p0}", "3", token=None)
            assert ran.status == 1
            assert "401 Unauthorized: missing token" in ran.err
            assert ADMIN_TOKEN_ENV in ran.err
            ran = await admin(served.admin_url, "drain", "llm", f"127.0.0.1:{p0}", token="nope")
            assert ran.status == 1
            assert "401 Unauthorized: wrong token" in ran.err
            ran = await admin(served.admin_url, "down", "llm", "10.9.9.9:80")
            assert ran.status == 1
            assert "404 Not Found: upstream group 'llm' has no server '10.9.9.9:80'" in ran.err
            ran = await admin(served.admin_url, "weight", "llm", f"127.0.0.1:{p0}", "-1")
            assert ran.status == 2
            assert "expected an integer from 0 to 1000000" in ran.err
            ran = await admin(served.admin_url, "status")
            assert " 1 " in next(line for line in ran.out.splitlines() if f":{p0} " in line)
        ran = await admin(f"http://127.0.0.1:{await closed_port()}", "status")
        assert ran.status == 1
        assert "connection refused" in ran.err
        ran = await admin("ftp://127.0.0.1:1", "status")
        assert ran.status == 2
        assert "--url" in ran.err


async def test_admin_reload_applies_the_file_or_prints_its_problems(
    start_backend: StartBackend, tmp_path: Path
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        _, p0 = await start_backend(backend_id="gpu0")
        _, p1 = await start_backend(backend_id="gpu1")
        config = write_config(tmp_path / "muxproxy.toml", [p0])
        async with serve(config) as served:
            assert await backends_seen(served.url) == {"gpu0"}
            write_config(config, [p0, p1])
            ran = await admin(served.admin_url, "reload")
            assert (ran.status, ran.out) == (0, "reloaded: generation 2\n"), ran.err
            assert await backends_seen(served.url) == {"gpu0", "gpu1"}
            config.write_text(config.read_text().replace("servers = [", "servers = 3 #["))
            assert "upstreams.llm.servers: expected" in await refused_reload(served.admin_url)
            ran = await admin(served.admin_url, "reload", "--restart")
            assert ran.status == 1
            assert "400 Bad Request: a rolling restart needs worker processes" in ran.err
            ran = await admin(served.admin_url, "status")
            assert ran.out.startswith("generation 2;")
            assert await backends_seen(served.url) == {"gpu0", "gpu1"}


async def test_serve_admin_flag_opens_the_admin_api_of_a_quick_proxy(
    start_backend: StartBackend, tmp_path: Path
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        _, p0 = await start_backend(backend_id="gpu0")
        _, p1 = await start_backend(backend_id="gpu1")
        flags = ["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"]
        flags += ["--upstream", f"127.0.0.1:{p0}", "--upstream", f"127.0.0.1:{p1}"]
        async with serve(None, *flags, token=TOKEN) as served:
            ran = await admin(served.admin_url, "down", "default", f"127.0.0.1:{p1}")
            assert ran.status == 0, ran.err
            assert await backends_seen(served.url) == {"gpu0"}
            ran = await admin(served.admin_url, "reload")
            assert ran.status == 1
            assert "nothing to reload" in ran.err


async def test_a_weight_past_its_range_is_refused_and_metrics_still_answer(
    start_backend: StartBackend, tmp_path: Path
) -> None:
    """2**64, 1e330 (JSON's infinity) and a 331-digit integer: each a 400 naming the field
    and the range, nothing changed, and ``/metrics`` (which prints weights) still 200."""
    with trio.fail_after(TEST_TIMEOUT):
        _, p0 = await start_backend(backend_id="gpu0")
        async with serve(write_config(tmp_path / "muxproxy.toml", [p0])) as served:
            server = f"{served.admin_url}/upstreams/llm/servers/127.0.0.1:{p0}"
            auth = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
            async with httpx.AsyncClient(timeout=10) as client:
                for weight in (str(2**64), "1e330", "1" + "0" * 330):
                    body = '{"weight": ' + weight + "}"
                    answer = await client.patch(server, content=body, headers=auth)
                    assert answer.status_code == 400, (weight, answer.text)
                    error = answer.json()["error"]
                    assert error.startswith(
                        "weight: expected an integer from 0 to 1000000 (weights are relative"
                        " shares) or null (the configured weight), got "
                    ), error
                    metrics = await client.get(f"{served.admin_url}/metrics")
                    assert metrics.status_code == 200, metrics.text
                top = await client.patch(server, json={"weight": 10**6}, headers=auth)
                assert top.status_code == 200, top.text
                assert (await client.get(f"{served.admin_url}/metrics")).status_code == 200
            ran = await admin(served.admin_url, "weight", "llm", f"127.0.0.1:{p0}", str(10**6 + 1))
            assert ran.status == 2
            assert "expected an integer from 0 to 1000000" in ran.err
            ran = await admin(served.admin_url, "status")
            row = next(line.split() for line in ran.out.splitlines() if f":{p0} " in line)
            assert row[2:4] == ["1000000", "(1)"]


async def test_admin_reload_with_a_number_past_its_range_keeps_the_running_configuration(
    start_backend: StartBackend, tmp_path: Path
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        _, p0 = await start_backend(backend_id="gpu0")
        _, p1 = await start_backend(backend_id="gpu1")
        config = write_config(tmp_path / "muxproxy.toml", [p0])
        async with serve(config) as served:
            text = config.read_text()
            config.write_text(
                text.replace(
                    f'"127.0.0.1:{p0}"', f'{{ address = "127.0.0.1:{p1}", weight = {2**64} }}'
                )
            )
            assert (
                "upstreams.llm.servers[0].weight: expected 0 to 1000000 (weights are relative"
                f" shares), got {2**64}; lower it to 1000000 or less"
            ) in await refused_reload(served.admin_url)
            ran = await admin(served.admin_url, "status")
            assert ran.out.startswith("generation 1;")
            assert await backends_seen(served.url) == {"gpu0"}

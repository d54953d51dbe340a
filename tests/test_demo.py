"""``muxproxy demo`` as a user runs it: a real subprocess, exit status and its report."""

from __future__ import annotations

import subprocess
import sys

import trio


async def test_demo_streams_through_the_proxy_and_exits_zero() -> None:
    with trio.fail_after(60):
        result = await trio.run_process(
            [sys.executable, "-m", "muxproxy", "demo", "--tokens", "4", "--delay", "0.01"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    out = result.stdout.decode()
    assert result.returncode == 0, out + result.stderr.decode()
    assert "all streams complete" in out
    rows = [line for line in out.splitlines() if line.startswith(("h1/", "h2/"))]
    table = [line for line in rows if "HTTP/" in line]
    assert len(table) == 5
    assert {line.split()[2] for line in table} <= {"gpu0", "gpu1", "gpu2"}
    assert all(line.split()[3] == "4" for line in table)


def test_demo_help_runs_without_starting_anything() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "muxproxy", "demo", "--help"], capture_output=True, check=False
    )
    assert result.returncode == 0
    assert b"--tokens" in result.stdout

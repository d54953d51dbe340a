"""``muxproxy demo`` as a user runs it: a real subprocess, its exit status and its report.

The demo runs its fleet, its proxy and its clients on real sockets, in real time; the tests
wait only for the process to end (under ``trio.fail_after``) and read what it printed: the
events as they happened (``--plain``), then the summary tables, whose columns are two or more
spaces apart. The live view is run on a pseudo-terminal, as in a user's terminal.
"""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import termios

import trio
import trio.lowlevel

DEMO = [sys.executable, "-m", "muxproxy", "demo"]
FAST = ["--tokens", "8", "--delay", "0.02"]
"""Short answers, quick tokens: a turn takes about a quarter of a second."""


def table(out: str, title: str) -> list[dict[str, str]]:
    """The rows of the summary table under the line ``title``, by column name."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip() == title)
    header = re.split(r"\s{2,}", lines[at + 1].strip())
    rows = []
    for line in lines[at + 2 :]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows.append(dict(zip(header, cells, strict=False)))
    return rows


async def run_demo(*args: str) -> tuple[int, str]:
    with trio.fail_after(60):
        result = await trio.run_process(
            [*DEMO, *args], capture_stdout=True, capture_stderr=True, check=False
        )
    out = result.stdout.decode()
    assert result.stderr == b"", result.stderr.decode()
    return result.returncode, out


async def test_a_killed_backend_and_a_gray_release_fail_no_request() -> None:
    status, out = await run_demo("--plain", "--duration", "8", *FAST)
    print(out)  # pytest shows it when an assertion below fails
    assert status == 0
    lines = out.splitlines()

    # The kill happened, and cost nothing: the stream before its first token was retried,
    # the one mid-answer continued by another server as one stream.
    (killed,) = [
        re.search(r"phase: (gpu\d) killed", line)
        for line in lines
        if "killed" in line and "phase:" in line
    ]
    assert killed is not None
    victim = killed.group(1)
    assert any(f"killing {victim}: its listener and every connection closed" in x for x in lines)
    assert any(
        re.search(rf"retry: chat-\d+\.\d+ failed on {victim} before its first", x) for x in lines
    )
    assert any(re.search(rf"continue: chat-\d+\.\d+ cut mid-answer on {victim}", x) for x in lines)
    assert any(
        re.search(rf"one stream for the client: \d+ tokens? from {victim} \+", x) for x in lines
    )
    assert not [line for line in lines if "FAILED" in line]

    backends = {row["backend"]: row for row in table(out, "backends")}
    assert set(backends) == {"gpu0", "gpu1", "gpu2", "gpu3", "total"}
    assert all(row["failed"] == "0" for row in backends.values())
    assert backends[victim]["state"] == "killed"
    assert int(backends[victim]["retried"]) >= 1 and int(backends[victim]["continued"]) >= 1
    assert all(int(row["requests"]) > 0 for name, row in backends.items() if name != victim)

    # v2 had no conversation before its weight went up, then new ones; every one once v1
    # went to weight 0, while the conversations on v1 stayed there.
    phases = {row["phase"]: row for row in table(out, "phases")}
    assert list(phases)[:2] == ["steady", f"{victim} killed"]
    assert phases["steady"]["on v2"] == phases[f"{victim} killed"]["on v2"] == "0"
    gray = [row for name, row in phases.items() if name.startswith("gray release")]
    assert len(gray) == 4
    assert sum(int(row["on v2"]) for row in gray) > 0
    last = phases["gray release: v1 weight 0"]
    assert int(last["new convs"]) > 0 and last["on v1"] == "0"
    assert all(row["follow-ups"] == row["stayed"] for row in gray), gray
    (moved,) = [line for line in lines if line.startswith("stickiness:")]
    assert "moved otherwise" not in moved
    (line,) = [line for line in lines if "new conversations on v2" in line]
    stayed = re.search(r"(\d+) of (\d+) follow-up turns of v1 conversations stayed on v1", line)
    assert stayed is not None and stayed.group(1) == stayed.group(2) and int(stayed.group(2)) > 0

    (result,) = [line for line in lines if line.startswith("result:")]
    counts = re.fullmatch(
        r"result: (\d+) requests, (\d+) complete with every token, 0 failed", result
    )
    assert (
        counts is not None and counts.group(1) == counts.group(2) == backends["total"]["requests"]
    )


async def test_the_live_view_draws_in_a_terminal() -> None:
    """On a pseudo-terminal (no ``--plain``) the rich view is drawn, redrawn, then the summary."""
    master, slave = pty.openpty()
    termios.tcsetwinsize(slave, (50, 140))
    env = {**os.environ, "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    env.pop("COLUMNS", None)
    try:
        process = await trio.lowlevel.open_process(
            [*DEMO, "--duration", "4", *FAST], stdin=slave, stdout=slave, stderr=slave, env=env
        )
    finally:
        os.close(slave)
    output = bytearray()
    with trio.fail_after(60):
        async with trio.lowlevel.FdStream(master) as terminal:
            while True:
                try:
                    data = await terminal.receive_some(65536)
                except trio.BrokenResourceError:  # EIO: the demo, its last holder, closed it
                    break
                if not data:
                    break
                output += data
        status = await process.wait()
    out = output.decode(errors="replace")
    assert status == 0, out
    assert "\x1b[" in out  # drawn with terminal control sequences
    assert out.count("muxproxy demo") >= 2  # drawn more than once
    assert "TTFT p50 ms" in out and "tokens/s" in out and "events" in out
    assert re.search(r"phase: \S*gpu\d killed", out)
    assert re.search(r"result: (\d+) requests, \1 complete with every token, 0 failed", out)


def test_help_lists_the_options_and_starts_nothing() -> None:
    result = subprocess.run([*DEMO, "--help"], capture_output=True, text=True, check=False)
    assert result.returncode == 0
    for option in ("--duration", "--plain", "--keep", "--tokens", "--delay"):
        assert option in result.stdout

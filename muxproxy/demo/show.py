"""Running the demo: the script under the live view or the plain lines, then the summary.

Exit status 0 when every request completed with every token, 1 otherwise (also when none
was made: a demo that showed nothing did not work).
"""

from __future__ import annotations

import json
import sys

import trio
from rich.console import Console, RenderableType
from rich.live import Live

from muxproxy.demo.fleet import CHAT_PATH, GROUP, SESSION_HEADER
from muxproxy.demo.script import run_script, wait_for_interrupt
from muxproxy.demo.stage import Demo, Settings, start_demo, watch_status
from muxproxy.demo.view import Traffic, event_line, live_view, print_summary
from muxproxy.testing.fakellm import MODEL

REFRESH = 0.25
"""Seconds between two frames of the live view."""
PLAIN_WIDTH = 120
"""Columns of the plain summary (a pipe has no width of its own; rich would take 80)."""


def make_console(live: bool) -> Console:
    """A terminal's console for the live view, else a plain one: no colour, no markup
    guessing, a fixed width."""
    if live:
        return Console()
    return Console(
        file=sys.stdout, width=PLAIN_WIDTH, force_terminal=False, no_color=True, highlight=False
    )


def frame(demo: Demo) -> RenderableType:
    """The live view now."""
    proxy = demo.proxy
    traffic = Traffic(
        h2_open=demo.h2.open_streams,
        h2_peak=demo.h2.peak_streams,
        h1_connections=sum(c.connects for c in demo.h1_clients),
    )
    return live_view(
        demo.board,
        demo.now(),
        duration=demo.settings.duration,
        urls=f"proxy {proxy.url}   admin API {proxy.admin_url} (token {demo.token})",
        traffic=traffic,
    )


def intro_lines(demo: Demo) -> list[str]:
    """The plain mode's first lines: what runs where."""
    settings = demo.settings
    fleet = ", ".join(
        f"{name} ({b.version}, weight {1 if b.version == 'v1' else 0})"
        for name, b in demo.board.backends.items()
    )
    h2 = settings.conversations // 2
    return [
        f"muxproxy demo, {settings.duration:g}s: fake GPU backends {fleet}",
        f"  proxy {demo.proxy.url}, admin API {demo.proxy.admin_url}",
        f"  {settings.conversations} conversations at a time, {settings.conversations - h2}"
        f" over HTTP/1.1 and {h2} on one HTTP/2 connection, sticky by their X-Chat-ID header",
    ]


def print_event(at: float, text: str) -> None:
    print(event_line(at, text), flush=True)


async def _run_live(demo: Demo, console: Console) -> None:
    with Live(
        console=console, auto_refresh=False, redirect_stdout=False, redirect_stderr=False
    ) as view:

        async def redraw() -> None:
            while True:
                view.update(frame(demo), refresh=True)
                await trio.sleep(REFRESH)

        async with trio.open_nursery() as drawing:
            drawing.start_soon(redraw)
            await run_script(demo)
            drawing.cancel_scope.cancel()
        view.update(frame(demo), refresh=True)


async def _run_plain(demo: Demo) -> None:
    for line in intro_lines(demo):
        print(line, flush=True)
    demo.board.on_event = print_event
    await run_script(demo)


async def run_demo(settings: Settings, *, live: bool, keep: bool, console: Console) -> int:
    """The whole demo; returns the exit status."""
    async with trio.open_nursery() as nursery:
        demo = await start_demo(nursery, settings)
        nursery.start_soon(watch_status, demo)
        if live:
            await _run_live(demo, console)
        else:
            await _run_plain(demo)
        board = demo.board
        print_summary(console, board, boxed=live)
        ok = bool(board.turns) and not board.failed
        if keep:
            board.on_event = print_event  # retries and health changes of what you send
            console.print()
            for line in keep_lines(demo):
                console.print(line, markup=False, highlight=False, soft_wrap=True)
            await wait_for_interrupt()
        nursery.cancel_scope.cancel()
    return 0 if ok else 1


def keep_lines(demo: Demo) -> list[str]:
    """What ``--keep`` prints: where everything is, and what to try."""
    proxy, token = demo.proxy, demo.token
    body = json.dumps(
        {
            "model": MODEL,
            "stream": True,
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "hi"}],
        }
    )
    gpu = demo.v2[0]
    change = json.dumps({"weight": 2})
    return [
        "the fleet and the proxy keep running; Ctrl-C stops them",
        f"  proxy  {proxy.url}  (group {GROUP}: "
        + ", ".join(f"{g.name} {g.address}" for g in demo.gpus.values())
        + ")",
        f"  admin  {proxy.admin_url}  token {token}",
        "  try:",
        f"    curl -N {proxy.url}{CHAT_PATH} -H 'Content-Type: application/json'"
        f" -H '{SESSION_HEADER}: my-chat' -d '{body}'",
        f"    curl -s {proxy.admin_url}/status",
        f"    curl -s -X PATCH -H 'Authorization: Bearer {token}' -d '{change}'"
        f" {proxy.admin_url}/upstreams/{GROUP}/servers/{gpu.address}",
        f"    muxproxy admin --url {proxy.admin_url} status",
    ]

"""What the demo shows: the live view (rich), the plain event lines, and the summary.

The live view is redrawn from the board a few times a second by a Trio task (rich's own
refresh thread would read the board while Trio tasks change it). The summary is the same
tables in both modes; on a plain console (not a terminal) they come without colour or box
lines, one row a line, columns at least two spaces apart, so CI logs and tests can read them.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from muxproxy.demo.board import BackendFigures, Board, Stickiness, percentile, plural

EVENTS_SHOWN = 10
"""Event log lines in the live view."""
STATE_STYLES = {"up": "green", "draining": "yellow"}
"""How a backend's state is shown; any other (down, killed) is bold red."""


@attrs.frozen(kw_only=True)
class Traffic:
    """The clients' connections, for the live view's traffic line."""

    h2_open: int
    """Streams open now on the shared HTTP/2 connection."""
    h2_peak: int
    h1_connections: int


def event_line(at: float, text: str) -> str:
    return f"[{at:5.1f}s] {text}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _state(figures: BackendFigures) -> str:
    backend = figures.backend
    return "killed" if backend.killed_at is not None else backend.state


def _styled_state(figures: BackendFigures) -> Text:
    state = _state(figures)
    return Text(state, style=STATE_STYLES.get(state, "bold red"))


def _table(columns: tuple[str, ...], *, boxed: bool, title: str | None = None) -> Table:
    """A table whose first columns (up to the first numeric one) are left-aligned."""
    table = Table(
        box=box.SIMPLE_HEAD if boxed else None,
        pad_edge=False,
        title=title,
        title_justify="left",
        title_style="bold" if boxed else None,
    )
    for name in columns:
        table.add_column(name, justify="left" if name in _TEXT_COLUMNS else "right")
    return table


_TEXT_COLUMNS = frozenset({"backend", "version", "state", "phase"})


# -- the live view ----------------------------------------------------------------------


def backends_table(board: Board, now: float) -> Table:
    columns = (
        "backend",
        "version",
        "weight",
        "state",
        "conversations",
        "streams",
        "served",
        "TTFT p50 ms",
        "tokens/s",
        "retried",
        "continued",
    )
    table = _table(columns, boxed=True)
    for row in board.backend_figures(now):
        table.add_row(
            row.backend.name,
            row.backend.version,
            str(row.backend.weight),
            _styled_state(row),
            str(row.conversations),
            str(row.running),
            str(row.requests),
            _ms(row.ttft_p50),
            f"{row.tokens_per_second:.0f}",
            str(row.retried),
            str(row.continued),
        )
    return table


def stickiness_text(sticky: Stickiness) -> Text:
    text = Text(
        f"stickiness: {sticky.stayed} of {sticky.follow_ups} follow-up turns on the same backend"
    )
    if sticky.forced_moves:
        text.append(f", {sticky.forced_moves} moved off the killed backend")
    if sticky.other_moves:
        text.append(f", {sticky.other_moves} moved otherwise", style="bold red")
    return text


def traffic_text(board: Board, traffic: Traffic) -> Text:
    running = sum(t.running for t in board.turns)
    going = sum(not c.ended for c in board.conversations.values())
    text = Text(f"conversations {len(board.conversations)} ({going} going on); ")
    text.append(
        f"streams now {running}: {traffic.h2_open} multiplexed on one HTTP/2 connection"
        f" (peak {traffic.h2_peak}), {running - traffic.h2_open} on"
        f" {traffic.h1_connections} HTTP/1.1 connections\n"
    )
    text.append_text(stickiness_text(board.stickiness()))
    for row in board.phase_figures()[-1:]:
        shares = ", ".join(f"{n} on {v}" for v, n in sorted(row.new_by_version.items()))
        text.append(
            f"\nthis phase: {plural(row.new, 'new conversation')} ({shares or 'none yet'}),"
        )
        text.append(f" {row.stayed} of {row.follow_ups} follow-up turns on the same backend")
    failed = len(board.failed)
    text.append("\nfailed requests: ")
    text.append(str(failed), style="bold red" if failed else "bold green")
    return text


def live_view(
    board: Board, now: float, *, duration: float, urls: str, traffic: Traffic
) -> RenderableType:
    title = Text()
    title.append("muxproxy demo", style="bold")
    title.append(f"  {min(now, duration):4.1f}/{duration:g}s  phase: ")
    title.append(board.phase, style="bold cyan")
    title.append(f"\n{urls}", style="dim")
    events = Text()
    for at, line in list(board.events)[-EVENTS_SHOWN:]:
        events.append(event_line(at, line) + "\n", style="bold red" if "FAILED" in line else "")
    return Group(
        title,
        backends_table(board, now),
        traffic_text(board, traffic),
        Text("\nevents", style="bold"),
        events,
    )


# -- the summary ------------------------------------------------------------------------


def summary(board: Board, *, boxed: bool) -> Iterator[RenderableType]:
    """The backends' figures, the phases' figures, then the verdict lines."""
    yield summary_backends(board, boxed=boxed)
    yield summary_phases(board, boxed=boxed)
    yield Text("\n".join(verdict_lines(board)))


def summary_backends(board: Board, *, boxed: bool) -> Table:
    columns = (
        "backend",
        "version",
        "requests",
        "failed",
        "retried",
        "continued",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "tokens",
        "state",
    )
    table = _table(columns, boxed=boxed, title="backends")
    rows = board.backend_figures(float("inf"))
    for row in rows:
        table.add_row(
            row.backend.name,
            row.backend.version,
            str(row.requests),
            str(row.failed),
            str(row.retried),
            str(row.continued),
            _ms(row.ttft_p50),
            _ms(row.ttft_p99),
            str(row.tokens),
            _styled_state(row),
        )
    finished = board.finished
    ttfts = [t.ttft for t in finished if t.ttft is not None]
    table.add_row(
        "total",
        "all",
        str(len(finished)),
        str(len(board.failed)),
        str(sum(r.retried for r in rows)),
        str(sum(r.continued for r in rows)),
        _ms(percentile(ttfts, 50)),
        _ms(percentile(ttfts, 99)),
        str(sum(r.tokens for r in rows)),
        "-",
    )
    return table


def summary_phases(board: Board, *, boxed: bool) -> Table:
    columns = ("phase", "new convs", "on v1", "on v2", "follow-ups", "stayed", "moved off killed")
    table = _table(columns, boxed=boxed, title="phases")
    for row in board.phase_figures():
        table.add_row(
            row.phase,
            str(row.new),
            str(row.new_by_version.get("v1", 0)),
            str(row.new_by_version.get("v2", 0)),
            str(row.follow_ups),
            str(row.stayed),
            str(row.forced_moves),
        )
    return table


def verdict_lines(board: Board) -> list[str]:
    sticky = board.stickiness()
    line = (
        f"stickiness: {sticky.kept:.1f}% kept ({sticky.stayed} of {sticky.follow_ups} follow-up"
        " turns on the same backend"
    )
    if sticky.forced_moves:
        line += f"; {sticky.forced_moves} moved off the killed backend"
    line += f"; {sticky.other_moves} moved otherwise)" if sticky.other_moves else ")"
    finished, failed = board.finished, board.failed
    complete = len(finished) - len(failed)
    return [
        line,
        gray_line(board),
        f"result: {len(finished)} requests, {complete} complete with every token,"
        f" {len(failed)} failed",
    ]


def gray_line(board: Board) -> str:
    """Where the gray release sent new conversations, and where existing ones stayed."""
    gray = [row for row in board.phase_figures() if row.phase.startswith("gray release")]
    new = sum(row.new for row in gray)
    on_v2 = sum(row.new_by_version.get("v2", 0) for row in gray)
    last = f" ({gray[-1].new_by_version.get('v2', 0)} of {gray[-1].new} in the last step)"
    pairs = [
        (before, turn)
        for before, turn in board.follow_ups()
        if turn.phase.startswith("gray release") and board.version_of(before.final_backend) == "v1"
    ]
    stayed = sum(board.stayed(before, turn) for before, turn in pairs)
    return (
        f"gray release: {on_v2} of {new} new conversations on v2{last if gray else ''};"
        f" {stayed} of {len(pairs)} follow-up turns of v1 conversations stayed on v1"
    )


def print_summary(console: Console, board: Board, *, boxed: bool) -> None:
    for part in summary(board, boxed=boxed):
        console.print()
        console.print(part, soft_wrap=isinstance(part, Text))

"""A pytest plugin that prints a core test's run as the lines of a conversation.

Obeys: it changes no result. It wraps ``Playbook.feed`` for the session and prints, for each
event fed, a ``pb >> ...`` line and the commands it returned as ``pb << ...`` lines (a run
of ``SendData`` to one connection as one ``Sends(conn, ?)``, its first bytes in a comment),
so turning a test that drives the core by hand into a conversation starts from what the
core really did::

    PYTHONPATH=$PWD:$PWD/tests/core python -m pytest -p trace -s tests/core/test_x.py::test_y

The printed lines are a draft: each ``Sends`` still needs its peer and its check, and a
value the core chose (a connection id) may want a ``Capture``.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs
import playbook

from muxproxy.core import commands, events

_EVENTS: dict[type[events.Event], str] = {
    events.DataReceived: "data",
    events.ConnectionOpened: "opened",
    events.ConnectionClosed: "closed",
    events.DataSent: "sent",
    events.Wakeup: "wakeup",
    events.ConnectionAccepted: "accepted",
    events.OpenFailed: "open_failed",
}


def _value(value: Any) -> str:
    """A field as a test writes it: a timer as ``("kind", ident)``, an origin without its
    defaults."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], enum.Enum):
        return f'("{value[0].value}", {value[1]!r})'
    if isinstance(value, commands.Origin):
        fields = attrs.fields(commands.Origin)
        shown = [
            f"{f.name}={getattr(value, f.name)!r}"
            for f in fields
            if getattr(value, f.name) != f.default
        ]
        return f"Origin({', '.join(shown)})"
    return repr(value)


def _command(command: commands.Command) -> str:
    shown = [
        f"{f.name}={_value(getattr(command, f.name))}"
        for f in attrs.fields(type(command))
        if f.eq
        and (
            f.name == "conn" or f.default is attrs.NOTHING or getattr(command, f.name) != f.default
        )
    ]
    return f"{type(command).__name__}({', '.join(shown)})"


def _event(event: events.Event) -> str:
    name = _EVENTS.get(type(event), type(event).__name__)
    if isinstance(event, events.Wakeup):
        kind, ident = event.timer
        return f'{name}("{kind.value}", {ident!r})'
    args = [repr(getattr(event, "conn", None))]
    if isinstance(event, events.DataReceived):
        args.append(f"<{len(event.data)} bytes {event.data[:40]!r}>")
    return f"{name}({', '.join(args)})"


def _lines(event: events.Event, out: list[commands.Command]) -> list[str]:
    lines = [f"    pb >> {_event(event)}  # now={event.now}"]
    run_to: int | None = None  # the connection of the run of SendData being printed
    for command in out:
        if isinstance(command, commands.SendData):
            if command.conn != run_to:
                run_to = command.conn
                lines.append(f"    pb << Sends({command.conn}, ?)  # {command.data[:50]!r}")
            continue
        run_to = None
        lines.append(f"    pb << {_command(command)}")
    return lines


_feed = playbook.Playbook.feed


def _traced_feed(self: playbook.Playbook, event: events.Event) -> list[commands.Command]:
    out = _feed(self, event)
    print("\n" + "\n".join(_lines(event, out)))
    return out


def pytest_configure(config: Any) -> None:
    playbook.Playbook.feed = _traced_feed  # type: ignore[method-assign]  # for this run only


def pytest_unconfigure(config: Any) -> None:
    playbook.Playbook.feed = _feed  # type: ignore[method-assign]

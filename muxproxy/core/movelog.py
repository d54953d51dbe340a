"""Recorded moves: where a test sees each part's state moves, without replacing any method.

The state-table tests check that a part moves as its table says: the state before, the input,
the state after, of every ``move`` an event causes. Wrapping the part's ``move`` would record
that in the pure-Python build only: a class compiled by mypyc (``compiled.py``) refuses new
attributes, methods included. A ``MoveLog`` is the seam instead, beside the fault plan
(``faultplan.py``): ``record_moves(fx)`` hangs one on a core's ``Effects`` (``Effects.moves``),
and each part that moves by a table hands it (part, before, input, after) as it moves.

Rules: no log, no cost but one ``is None`` test per move (``Effects.moves`` is None in
production; nothing in muxproxy sets it). A move the table refuses raises before anything is
recorded (``IllegalTransition``); an ignored input is recorded with the state unchanged, as
the part took it. This module imports nothing of the core, so any part may record to a log.
"""

from __future__ import annotations

from typing import Any, Protocol

Move = tuple[Any, Any, Any]
"""(state before, input, state after) of one move."""


class MoveLog:
    """The moves of one core's parts, in the order they were made."""

    def __init__(self) -> None:
        self.moves: list[tuple[object, Any, Any, Any]] = []
        """(part, state before, input, state after), every part's."""
        self._watched: list[tuple[object, type[Any], list[Move]]] = []

    def record(self, part: object, before: Any, input: Any, after: Any) -> None:
        """Called by ``part`` as it moves (its ``move``, or its ``advance``)."""
        self.moves.append((part, before, input, after))
        for watched, inputs, moves in self._watched:
            if watched is part and isinstance(input, inputs):
                moves.append((before, input, after))

    def of(self, part: object, inputs: type[Any] = object) -> list[Move]:
        """``part``'s moves by an input of type ``inputs`` (one of its tables; any, by
        default) from now on: a list that grows as it moves."""
        moves: list[Move] = []
        self._watched.append((part, inputs, moves))
        return moves


class Recorded(Protocol):
    """What carries a log for the parts that move (a core's ``Effects``)."""

    moves: MoveLog | None


def record_moves(fx: Recorded) -> MoveLog:
    """The log ``fx``'s parts record to, made and hung on it on first use."""
    log = fx.moves
    if log is None:
        log = fx.moves = MoveLog()
    return log

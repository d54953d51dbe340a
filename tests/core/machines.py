"""Helpers for the state-table tests: record every move a machine makes."""

from __future__ import annotations

from typing import Any

Moves = list[tuple[Any, Any, Any]]
"""(state before, input, state after) of each ``move``."""


def spy(machine: Any, attr: str = "state") -> Moves:
    """Record each ``move`` of ``machine`` as (``attr`` before, input, ``attr`` after); the
    real ``move`` still runs."""
    moves: Moves = []
    real = machine.move

    def move(input: Any) -> bool:
        before = getattr(machine, attr)
        taken: bool = real(input)
        moves.append((before, input, getattr(machine, attr)))
        return taken

    machine.move = move
    return moves

"""Helpers for the state-table tests: record every move a machine makes, and check one input
against its table."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from muxproxy.core.states import IGNORED, ILLEGAL, IllegalTransition, Transitions

S = TypeVar("S", bound=enum.Enum)
In = TypeVar("In", bound=enum.Enum)

Moves = list[tuple[Any, Any, Any]]
"""(state before, input, state after) of each ``move``."""


def spy(machine: Any, attr: str = "state") -> Moves:
    """Record each ``move`` of ``machine`` as (``attr`` before, input, ``attr`` after); the
    real ``move`` still runs."""
    moves: Moves = []
    real = machine.move

    def move(input: Any) -> object:
        before = getattr(machine, attr)
        taken: object = real(input)
        moves.append((before, input, getattr(machine, attr)))
        return taken

    machine.move = move
    return moves


def take(
    table: Transitions[S, In],
    machine: Any,
    state: S,
    input: In,
    deliver: Callable[[], object],
    *,
    unreachable: bool = False,
) -> Moves:
    """Give ``machine`` (in ``state``) ``input`` and check it does what ``table`` says."""
    assert machine.state is state
    moves = spy(machine)
    act: Callable[[], object] = (lambda: machine.move(input)) if unreachable else deliver
    target = table[(state, input)]
    if target is ILLEGAL:
        with pytest.raises(IllegalTransition) as refused:
            act()
        assert (refused.value.state, refused.value.input) == (state, input)
        assert machine.state is state
        return moves
    act()
    assert moves, f"{input.name} moved nothing"
    assert moves[0] == (state, input, state if target is IGNORED else target)
    for before, later, after in moves[1:]:
        then = table[(before, later)]
        assert then is not ILLEGAL
        assert after is (before if then is IGNORED else then), (before, later, after)
    return moves

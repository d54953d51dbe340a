"""Helpers for the state-table tests: record every move a machine makes, and check one input
against its table."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from muxproxy.core.http2.h2 import H2Server
from muxproxy.core.movelog import record_moves
from muxproxy.core.states import IGNORED, ILLEGAL, IllegalTransition, Transitions
from muxproxy.core.upstream.h2pool import H2Stream

S = TypeVar("S", bound=enum.Enum)
In = TypeVar("In", bound=enum.Enum)

Moves = list[tuple[Any, Any, Any]]
"""(state before, input, state after) of each ``move``."""


def spy(machine: Any, inputs: type[Any] = object) -> Moves:
    """Each move ``machine`` makes from now on by an input of type ``inputs`` (one of its
    tables; any, by default), as (state before, input, state after): what it records to its
    core's move log (``movelog.py``). A list that grows as it moves; nothing of ``machine`` is
    replaced, so the compiled build runs this too."""
    # An HTTP/2 adapter has no ``Effects`` of its own, only what its connection gave it; a
    # backend stream has its connection's.
    if isinstance(machine, H2Server):
        fx = machine.watch
    elif isinstance(machine, H2Stream):
        fx = machine.upstream.fx
    else:
        fx = machine.fx
    return record_moves(fx).of(machine, inputs)


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
    moves = spy(machine, type(next(iter(table))[1]))  # the inputs of this table alone
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

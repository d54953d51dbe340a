"""Connection states as data: a transition table per part, and the refusal of an illegal input.

A part whose life has states (``h2.H2Server``, ``pool.UpstreamConn``, ``h2pool.H2Upstream``)
names them in an ``enum.Enum``, names what changes them (its inputs) in another, and lists
every (state, input) pair in a ``Transitions`` table (after h2's ``H2ConnectionStateMachine``
and h11's ``_state.py``). Each pair says one of three things:

- a state: the input is acted on and the part is in that state afterwards (the same state for
  an input that is acted on and changes nothing, a PING on an open connection, say);
- ``IGNORED``: legal, and nothing happens. The input comes late or again (a driver event
  already on its way when the part closed, a second ``ConnectionOpened``, a close of what is
  closed), or it comes from the peer, who may send anything at any time;
- ``ILLEGAL``: it cannot happen unless muxproxy has a bug. ``step`` raises
  ``IllegalTransition``, which, as any exception escaping ``ProxyCore.handle``, fails the test
  that caused it (``raise_errors``) and in production ends the one connection it concerns,
  logged (``faults.py``).

Rules: a table lists every pair (the tests check that it is total), so that adding a state or
an input makes its author decide each new pair. A part changes its ``state`` through ``step``
and its table only (fault isolation, which drops a part a bug left half-updated, sets CLOSED
itself: ``faults.py``), and before it calls out, so a call that comes back in sees the new
state. ``IGNORED`` means nothing is done; a pair that names its own state is acted on and
leaves the state as it was (bytes read on an open connection). Whether a table has such pairs
is its own: the connection tables of ``h2``, ``pool`` and ``h2pool`` have none (their tests
check it), those of ``Downstream`` and ``Exchange`` do. A lookup hashes two enum members, so it
is kept off the per-token path.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeAlias, TypeVar

S = TypeVar("S", bound=enum.Enum)
In = TypeVar("In", bound=enum.Enum)


class Verdict(enum.Enum):
    """What a table says of a pair that moves the part nowhere."""

    IGNORED = "ignored"
    ILLEGAL = "illegal"


IGNORED = Verdict.IGNORED
ILLEGAL = Verdict.ILLEGAL

Transitions: TypeAlias = Mapping[tuple[S, In], S | Verdict]
"""(state, input) -> the next state, ``IGNORED`` or ``ILLEGAL``."""


class IllegalTransition(Exception):
    """``input`` reached a part in a state where the table says it cannot: a muxproxy bug."""

    def __init__(self, part: str, state: enum.Enum, input: enum.Enum) -> None:
        super().__init__(f"{part}: {input.name} is illegal in state {state.name}")
        self.part = part
        self.state = state
        self.input = input


def step(table: Transitions[S, In], part: str, state: S, input: In) -> S | None:
    """The state ``input`` moves ``state`` to, or None where the table ignores it; raises
    ``IllegalTransition`` where the table says ``ILLEGAL`` (``part`` names the machine)."""
    target = table[(state, input)]
    if isinstance(target, Verdict):
        if target is ILLEGAL:
            raise IllegalTransition(part, state, input)
        return None
    return target


def missing(table: Transitions[S, In], states: type[S], inputs: type[In]) -> list[tuple[S, In]]:
    """The pairs ``table`` does not list (none, for a table that is total)."""
    return [(s, i) for s in states for i in inputs if (s, i) not in table]

"""Receiving past a GOAWAY, for both HTTP/2 adapters (``h2.H2Server``, ``h2client.H2Client``).

RFC 9113 §6.8: a GOAWAY only ends the opening of new streams; the streams up to its
last-stream-id may finish, so the frames that come after it (WINDOW_UPDATEs, DATA, trailers,
resets of those streams) are still to be processed. python-h2 moves its connection state
machine to CLOSED on any GOAWAY it receives and then refuses every later frame, those in the
same read included, with a ``ProtocolError`` that loses every event of that read.

``receive_data`` feeds a read through a state machine that leaves its state where it was on a
GOAWAY received (a subclass of h2's public ``H2ConnectionStateMachine``, put in place of the
connection's public ``state_machine`` for that call only). Only for that call: the subclass
costs a Python call on every input of the machine, and every DATA frame sent (the token path)
is one; a read pays for two attribute swaps instead. A GOAWAY we send still closes h2's state
(the adapters set it back themselves when theirs is graceful).
"""

from __future__ import annotations

import h2.connection
import h2.events

_RECV_GOAWAY = h2.connection.ConnectionInputs.RECV_GOAWAY


class _GoawayKeepsOpen(h2.connection.H2ConnectionStateMachine):
    """h2's connection state machine, except that a GOAWAY received leaves it where it was."""

    def process_input(self, input_: h2.connection.ConnectionInputs) -> list[h2.events.Event]:
        if input_ is not _RECV_GOAWAY:
            return super().process_input(input_)
        before = self.state
        events = super().process_input(input_)
        self.state = before
        return events


class GoawayTolerantReceiver:
    """Feeds reads to one ``H2Connection`` so that a GOAWAY in them loses no frame after it."""

    __slots__ = ("_machine",)

    def __init__(self) -> None:
        self._machine = _GoawayKeepsOpen()

    def receive_data(self, conn: h2.connection.H2Connection, data: bytes) -> list[h2.events.Event]:
        """``conn.receive_data(data)``; raises what it raises."""
        plain = conn.state_machine
        machine = self._machine
        machine.state = plain.state
        conn.state_machine = machine
        try:
            events: list[h2.events.Event] = conn.receive_data(data)
        finally:
            plain.state = machine.state
            conn.state_machine = plain
        return events

"""A simulated driver: the driver contract of ``docs/embedding.md`` with no sockets and no clock.

``SimDriver`` runs one ``ProxyCore`` the way ``muxproxy/trio/driver.py`` does, minus IO:
commands in, the events a well-behaved network would cause out, queued and fed after the batch
that caused them (``handle`` is never re-entered). Time moves only when a timer fires. The fuzz
harness (``fuzz/harness.py``) plays whole conversations through it; tests and embedders use it
to see what a correct driver feeds, and to check what the core asks of one.

What it simulates, per command:

- ``SendData``: the kernel takes every byte at once (``DataSent`` follows); bytes for a
  backend connection go to a well-behaved HTTP/1.1 backend (an h11 server answering every
  complete request ``200 ok``) when ``answer_backends`` is set;
- ``OpenConnection``: the connect succeeds (``ConnectionOpened``);
- ``CloseConnection``: ``ConnectionClosed`` follows, once per connection;
- ``PauseReading`` / ``ResumeReading``: ``deliver`` reads no paused connection;
- ``SetTimer`` / ``CancelTimer``: kept in a table; ``fire_timers`` fires the due ones in time
  order, moving the clock;
- ``Log``: kept in ``logs``;
- ``BudgetReserve``: answered by ``budget_store`` (the fleet store's simulated side: it
  returns the ``BudgetAnswered`` to feed after the batch, or None to answer later, kept in
  ``unanswered``); without one it is kept in ``unanswered`` too. ``BudgetSettle`` and
  ``SessionsRemembered`` are kept in ``settles`` and ``remembered``.

It asserts the contract the core must keep towards a driver (an ``AssertionError`` names the
one that broke): no ``SendData`` after ``CloseConnection`` or ``ShutdownWrite`` for that
connection; every stream's buffered bytes within ``limits.stream_buffer``; a conversation
settles (at most ``max_events`` events). And it keeps the driver's side: reads of at most
``core.read_size`` bytes, none of a paused, ended or closed connection; ``InputEnded`` once on
a peer's end; ``ConnectionClosed`` exactly once per connection.

Only the standard library, h11 and muxproxy: no atheris, no trio.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable

import h11

from muxproxy.core.commands import (
    BudgetReserve,
    BudgetSettle,
    CancelTimer,
    CloseConnection,
    Command,
    Log,
    OpenConnection,
    PauseReading,
    ResumeReading,
    SendData,
    SessionsRemembered,
    SetTimer,
    ShutdownWrite,
)
from muxproxy.core.events import (
    BudgetAnswered,
    ConnectionAccepted,
    ConnectionClosed,
    ConnectionOpened,
    DataReceived,
    DataSent,
    Event,
    InputEnded,
    ShutdownRequested,
    TimerId,
    Wakeup,
)
from muxproxy.core.proxy import ProxyCore

MAX_EVENTS = 20_000
"""Events one conversation may cause by default; a well-formed one needs a few hundred."""
MAX_TIMER_ROUNDS = 50
"""Timers ``fire_timers`` fires at most (re-armed lazy timers fire again)."""


class SimDriver:
    """Drives ``core`` like a driver on a perfect network would (see the module docstring)."""

    def __init__(
        self,
        core: ProxyCore,
        *,
        answer_backends: bool = False,
        max_events: int = MAX_EVENTS,
        budget_store: Callable[[BudgetReserve, float], BudgetAnswered | None] | None = None,
    ) -> None:
        self.core = core
        self.answer_backends = answer_backends
        """Backend connections get an h11 server that answers ``200 ok`` (``respond``)."""
        self.budget_store = budget_store
        """The fleet store's answer to a reservation, given the command and the clock; None
        (or no store): no answer yet, the command stays in ``unanswered``."""
        self.unanswered: list[BudgetReserve] = []
        self.settles: list[BudgetSettle] = []
        self.remembered: list[SessionsRemembered] = []
        self.max_events = max_events
        self.now = 0.0
        self.queue: collections.deque[Event] = collections.deque()
        """Events caused by commands, fed by ``settle`` after the batch."""
        self.clients: list[int] = []
        """Client connections accepted (``accept``), in order."""
        self.backends: list[int] = []
        """Backend connections the core opened, in order."""
        self.closed: set[int] = set()
        """Connections the core closed (``CloseConnection``)."""
        self.gone: set[int] = set()
        """Connections for which ``ConnectionClosed`` was delivered."""
        self.shut: set[int] = set()
        """Connections whose write side the core shut down (``ShutdownWrite``)."""
        self.ended: set[int] = set()
        """Connections whose peer ended its side (``InputEnded`` fed)."""
        self.paused: set[int] = set()
        self.timers: dict[TimerId, float] = {}
        self.logs: list[Log] = []
        self.sent: dict[int, bytearray] = collections.defaultdict(bytearray)
        """Every byte the core sent, per connection."""
        self.responders: dict[int, h11.Connection] = {}
        self.events = 0
        self.stop: float | None = None
        """A graceful stop (its grace, seconds) to request after the next ``deliver``'s first
        read; None: none pending."""

    # -- the core's side ------------------------------------------------------------------

    def feed(self, event: Event) -> None:
        """Hand ``event`` to the core, carry out its commands, check the buffer bounds."""
        self.events += 1
        assert self.events < self.max_events, "the conversation does not settle"
        for command in self.core.handle(event):
            self.apply(command)
        limit = self.core.config.limits.stream_buffer
        for stream in self.core.statistics().streams:
            assert stream.response_buffered <= limit, f"response buffer over limit: {stream}"
            assert stream.request_buffered <= limit, f"request buffer over limit: {stream}"

    def apply(self, command: Command) -> None:
        """Carry out one command; what it causes is queued for ``settle``."""
        if isinstance(command, SendData):
            assert command.conn not in self.closed, f"SendData after CloseConnection: {command}"
            assert command.conn not in self.shut, f"SendData after ShutdownWrite: {command}"
            if command.conn in self.gone:
                return  # the peer went away; the driver drops it (a race, not a bug)
            self.sent[command.conn] += command.data
            self.queue.append(DataSent(now=self.now, conn=command.conn, nbytes=len(command.data)))
            if command.conn in self.responders:
                self.respond(command.conn, command.data)
        elif isinstance(command, CloseConnection):
            if command.conn not in self.closed and command.conn not in self.gone:
                self.queue.append(ConnectionClosed(now=self.now, conn=command.conn))
            self.closed.add(command.conn)
        elif isinstance(command, OpenConnection):
            self.backends.append(command.conn)
            if self.answer_backends:
                self.responders[command.conn] = h11.Connection(h11.SERVER)
            self.queue.append(ConnectionOpened(now=self.now, conn=command.conn))
        elif isinstance(command, ShutdownWrite):
            self.shut.add(command.conn)
        elif isinstance(command, PauseReading):
            self.paused.add(command.conn)
        elif isinstance(command, ResumeReading):
            self.paused.discard(command.conn)
        elif isinstance(command, SetTimer):
            self.timers[command.timer] = command.at
        elif isinstance(command, CancelTimer):
            self.timers.pop(command.timer, None)
        elif isinstance(command, Log):
            self.logs.append(command)
        elif isinstance(command, BudgetReserve):
            answer = None if self.budget_store is None else self.budget_store(command, self.now)
            if answer is None:
                self.unanswered.append(command)
            else:
                self.queue.append(answer)
        elif isinstance(command, BudgetSettle):
            self.settles.append(command)
        elif isinstance(command, SessionsRemembered):
            self.remembered.append(command)

    def settle(self) -> None:
        """Feed what the commands caused until nothing is left; each close once."""
        while self.queue:
            event = self.queue.popleft()
            if isinstance(event, ConnectionClosed):
                if event.conn in self.gone:
                    continue
                self.gone.add(event.conn)
            self.feed(event)

    # -- peers ----------------------------------------------------------------------------

    def accept(self, conn: int, *, peer: tuple[str, int] = ("10.0.0.7", 5555)) -> None:
        """A client connects as ``conn`` (positive)."""
        self.clients.append(conn)
        self.feed(ConnectionAccepted(now=self.now, conn=conn, listener="l", peer=peer))
        self.settle()

    def respond(self, conn: int, data: bytes) -> None:
        """A well-behaved HTTP/1.1 backend: ``200 ok`` to every complete request."""
        server = self.responders[conn]
        try:
            server.receive_data(data)
            while True:
                event = server.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    return
                if type(event) is h11.EndOfMessage:
                    out = server.send(
                        h11.Response(status_code=200, headers=[(b"content-length", b"2")])
                    )
                    out = (out or b"") + (server.send(h11.Data(data=b"ok")) or b"")
                    out += server.send(h11.EndOfMessage()) or b""
                    server.start_next_cycle()
                    self.queue.append(DataReceived(now=self.now, conn=conn, data=out))
        except h11.ProtocolError:
            # Not something an h11 server accepts (the proxy's bug would show in its tests):
            # hang up like a real backend would.
            del self.responders[conn]
            self.queue.append(ConnectionClosed(now=self.now, conn=conn))

    def deliver(self, conn: int, data: bytes, splits: list[int] = []) -> None:  # noqa: B006
        """``data`` from the peer on ``conn``, in reads cut at ``splits`` (taken modulo
        the data's length) and at ``read_size``. Reading stops while ``conn`` is paused,
        ended or closed, as a driver's would."""
        cuts = sorted({s % (len(data) + 1) for s in splits} | {0, len(data)})
        reads = 0
        for start, end in itertools.pairwise(cuts):
            for i in range(start, end, self.core.read_size):
                self.settle()
                if reads == 1:
                    self.request_stop()
                reads += 1
                if (
                    conn in self.paused
                    or conn in self.gone
                    or conn in self.closed
                    or conn in self.ended
                ):
                    return  # the driver does not read a paused or closed socket
                piece = data[i : min(end, i + self.core.read_size)]
                self.feed(DataReceived(now=self.now, conn=conn, data=piece))
        self.settle()
        self.request_stop()

    def request_stop(self) -> None:
        """Feed the pending graceful stop (``stop``), if any, once."""
        if self.stop is not None:
            grace, self.stop = self.stop, None
            self.feed(ShutdownRequested(now=self.now, deadline=self.now + grace))
            self.settle()

    def fire_timers(self, rounds: int = MAX_TIMER_ROUNDS) -> None:
        """Fire up to ``rounds`` timers, earliest first, moving the clock to each."""
        for _ in range(rounds):
            self.settle()
            if not self.timers:
                return
            timer, at = min(self.timers.items(), key=lambda item: item[1])
            del self.timers[timer]
            self.now = max(self.now, at)
            self.feed(Wakeup(now=self.now, timer=timer))
        self.settle()

    def end_input(self, conn: int) -> None:
        """The peer on ``conn`` ends its side (EOF), as a driver reports it."""
        if conn not in self.gone and conn not in self.closed and conn not in self.ended:
            self.ended.add(conn)
            self.queue.append(InputEnded(now=self.now, conn=conn))
        self.settle()

    def close_everything(self) -> None:
        """A second on, every peer ends its side, then every connection closes."""
        self.now += 1.0
        conns = [*self.clients, *self.backends]
        for conn in conns:
            self.end_input(conn)
        for conn in conns:
            if conn not in self.gone:
                self.queue.append(ConnectionClosed(now=self.now, conn=conn))
        self.settle()

"""The driver's own rules (``muxproxy/trio/driver.py``) over the reactor: where the core's
commands go, when the events they cause are fed, and the timers.

A :class:`ScriptedCore` is a ``ProxyCore`` whose ``handle`` answers with the commands a test
gives it: the batches these rules are about (two timers due at one instant, a close after a
send) are not ones the real core can be steered into on demand. Connections are real TCP
pairs on 127.0.0.1, served by the driver's reactor; timers run under ``MockClock``
(pytest-trio's ``autojump_clock``), so a deadline is met exactly, in no real time.

"The core is never re-entered from its own commands": ``ScriptedCore.handle`` returns a list
that knows when the driver is taking commands from it, and any ``handle`` while one is, is
recorded. A ``Log`` command in the batch shows the check is live: ``Driver.on_log`` sees it
while the batch is being carried out.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager

import attrs
import pytest
import trio
import trio.testing
from recording import receive, receive_to_eof

from muxproxy.config import quick_config
from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    Command,
    Log,
    PauseReading,
    ResumeReading,
    SendData,
    SetTimer,
)
from muxproxy.core.events import (
    ConnectionClosed,
    DataReceived,
    DataSent,
    Event,
    TimerId,
    Wakeup,
)
from muxproxy.core.proxy import ProxyCore
from muxproxy.trio.driver import Driver
from muxproxy.trio.reactor import tune

TIMEOUT = 10
VIRTUAL_TIMEOUT = 100
"""Seconds of virtual time (``MockClock``) a timer test may take: past its last deadline."""


@attrs.frozen(kw_only=True)
class Script(Event):
    """Fed by a test: the core answers with ``commands``."""

    commands: tuple[Command, ...]


class Batch(list[Command]):
    """One ``handle``'s commands: the core counts as executing them while the driver takes
    them, until the last one is taken."""

    def __init__(self, core: ScriptedCore, commands: Iterable[Command]) -> None:
        super().__init__(commands)
        self._core = core

    def __iter__(self) -> Iterator[Command]:
        self._core.executing += 1
        try:
            yield from super().__iter__()
        finally:
            self._core.executing -= 1


class ScriptedCore(ProxyCore):
    """Answers a :class:`Script` with its commands and any other event with ``respond``'s;
    records every event, and every ``handle`` made while a batch is carried out."""

    def __init__(self) -> None:
        super().__init__(quick_config("127.0.0.1:0", ["127.0.0.1:9"]), raise_errors=True)
        self.respond: Callable[[Event], Iterable[Command]] = lambda event: ()
        self.seen: list[Event] = []
        self.reentered: list[Event] = []
        self.executing = 0
        self._changed = trio.Event()

    def handle(self, event: Event) -> list[Command]:
        if self.executing:
            self.reentered.append(event)
        self.seen.append(event)
        commands = event.commands if isinstance(event, Script) else self.respond(event)
        self._changed.set()
        self._changed = trio.Event()
        return Batch(self, commands)

    async def until(self, done: Callable[[], bool]) -> None:
        while not done():
            await self._changed.wait()

    def wakeups(self) -> list[tuple[TimerId, float]]:
        return [(e.timer, e.now) for e in self.seen if isinstance(e, Wakeup)]

    def closes(self, conn: int) -> list[ConnectionClosed]:
        return [e for e in self.seen if isinstance(e, ConnectionClosed) and e.conn == conn]


@attrs.define
class Driving:
    core: ScriptedCore
    driver: Driver
    listener: socket.socket
    peers: list[socket.socket] = attrs.Factory(list)
    released: dict[int, trio.Event] = attrs.Factory(dict)

    def pair(self, ident: int, *, linger: bool = False) -> socket.socket:
        """A TCP connection the driver serves as ``ident`` (its reactor); its peer."""
        peer = socket.create_connection(self.listener.getsockname())
        ours, _ = self.listener.accept()
        tune(ours)
        peer.setblocking(False)
        self.peers.append(peer)
        released = self.released[ident] = trio.Event()
        self.driver.add_socket(ident, ours, released.set, linger=linger)
        return peer

    def run(self, *commands: Command) -> None:
        """Hand the driver ``commands`` as the core's answer to an event."""
        self.driver.feed(Script(now=trio.current_time(), commands=commands))


@asynccontextmanager
async def driving() -> AsyncIterator[Driving]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        core = ScriptedCore()
        async with trio.open_nursery() as nursery:
            driver = Driver(core, nursery)
            assert driver.reactor is not None, "the reactor needs epoll (Linux)"
            driver.start()
            setup = Driving(core=core, driver=driver, listener=listener)
            try:
                yield setup
            finally:
                nursery.cancel_scope.cancel()
                for peer in setup.peers:
                    peer.close()
    assert core.reentered == [], core.reentered


@pytest.fixture
async def setup() -> AsyncIterator[Driving]:
    async with driving() as setup:
        yield setup


# -- commands -------------------------------------------------------------------------------


async def test_commands_reach_their_connections_in_order(setup: Driving) -> None:
    one = setup.pair(1)
    two = setup.pair(2)
    setup.run(
        SendData(conn=1, data=b"a1"),
        SendData(conn=2, data=b"b1"),
        SendData(conn=1, data=b"a2"),
        SendData(conn=99, data=b"for a connection that is not there"),
        SendData(conn=2, data=b"b2"),
        SendData(conn=1, data=b"a3"),
    )
    with trio.fail_after(TIMEOUT):
        assert await receive(one, 6) == b"a1a2a3"
        assert await receive(two, 4) == b"b1b2"
    sent = sorted((e.conn, e.nbytes) for e in setup.core.seen if isinstance(e, DataSent))
    assert sent == [(1, 6), (2, 4)]


async def test_pause_and_resume_reading_reach_their_connection(setup: Driving) -> None:
    held = setup.pair(1)
    canary = setup.pair(2)
    core = setup.core

    def data(conn: int) -> bytes:
        return b"".join(e.data for e in core.seen if isinstance(e, DataReceived) and e.conn == conn)

    setup.run(PauseReading(conn=1))
    held.send(b"held")
    canary.send(b"tweet")
    with trio.fail_after(TIMEOUT):
        await core.until(lambda: data(2) == b"tweet")
    assert data(1) == b""
    setup.run(ResumeReading(conn=1))
    with trio.fail_after(TIMEOUT):
        await core.until(lambda: data(1) == b"held")


async def test_what_commands_cause_is_fed_after_their_batch_bytes_first(
    setup: Driving,
) -> None:
    for ident in (1, 2, 3, 4, 5):
        setup.pair(ident)
    core = setup.core
    executing_at_log: list[int] = []
    setup.driver.on_log = lambda log: executing_at_log.append(core.executing)

    def respond(event: Event) -> Iterable[Command]:
        if isinstance(event, DataReceived) and event.conn == 1:  # from the reactor's round
            return [SendData(conn=5, data=b"answer"), CloseConnection(conn=5), Log(event="b")]
        return ()

    core.respond = respond
    # From outside a round (as a timer's batch): 3 closes at once, 4 once flushed.
    setup.run(
        Log(event="a"),
        SendData(conn=2, data=b"token"),
        CloseConnection(conn=3),
        SendData(conn=4, data=b"last"),
        CloseConnection(conn=4),
    )
    after = [(type(e), getattr(e, "conn", None)) for e in core.seen[1:]]
    assert sorted(after, key=repr) == sorted(
        [(DataSent, 2), (DataSent, 4), (ConnectionClosed, 3), (ConnectionClosed, 4)], key=repr
    )
    assert after.index((DataSent, 4)) < after.index((ConnectionClosed, 4))
    mark = len(core.seen)
    setup.peers[0].send(b"request")
    with trio.fail_after(TIMEOUT):
        await core.until(lambda: bool(core.closes(5)))
    kinds = [(type(e), getattr(e, "conn", None)) for e in core.seen[mark:]]
    assert kinds == [(DataReceived, 1), (DataSent, 5), (ConnectionClosed, 5)]
    assert executing_at_log == [1, 1], "the re-entry check was live"
    # (``driving`` fails the test on a handle() made while a batch was carried out.)


async def test_connection_closed_comes_once_whatever_the_core_sends_after(
    setup: Driving,
) -> None:
    client = setup.pair(1, linger=True)
    setup.pair(2)
    core = setup.core
    setup.run(SendData(conn=1, data=b"bye"), CloseConnection(conn=1, flush_timeout=1.0))
    with trio.fail_after(TIMEOUT):
        assert await receive_to_eof(client) == b"bye"
        await core.until(lambda: bool(core.closes(1)))
    assert 1 not in setup.driver.conns, "told it closed, it lingers without taking commands"
    setup.run(CloseConnection(conn=2), CloseConnection(conn=2), SendData(conn=2, data=b"x"))
    # Told, the core would not, but the connection takes no command any more.
    setup.run(
        SendData(conn=1, data=b"late"),
        PauseReading(conn=1),
        ResumeReading(conn=1),
        CloseConnection(conn=1),
    )
    client.send(b"the client still talks")  # read and dropped while the socket lingers
    client.shutdown(socket.SHUT_WR)
    with trio.fail_after(TIMEOUT):
        await setup.released[1].wait()
        await setup.released[2].wait()
    assert len(core.closes(1)) == 1 and len(core.closes(2)) == 1


# -- timers --------------------------------------------------------------------------------


async def test_wakeups_come_in_the_order_of_their_deadlines(
    setup: Driving, autojump_clock: trio.testing.MockClock
) -> None:
    setup.run(
        SetTimer(timer=("t", 3), at=3.0),
        SetTimer(timer=("t", 1), at=1.0),
        SetTimer(timer=("t", 2), at=2.0),
    )
    with trio.fail_after(VIRTUAL_TIMEOUT):
        await setup.core.until(lambda: len(setup.core.wakeups()) == 3)
    assert setup.core.wakeups() == [(("t", 1), 1.0), (("t", 2), 2.0), (("t", 3), 3.0)]


async def test_a_cancelled_timer_never_fires(
    setup: Driving, autojump_clock: trio.testing.MockClock
) -> None:
    a, b, c, last = ("a", 0), ("b", 0), ("c", 0), ("last", 0)

    def respond(event: Event) -> Iterable[Command]:
        # a and b are due together: whichever wakes first cancels the other.
        if isinstance(event, Wakeup) and event.timer in (a, b):
            return [CancelTimer(timer=b if event.timer == a else a)]
        return ()

    setup.core.respond = respond
    setup.run(
        SetTimer(timer=a, at=1.0),
        SetTimer(timer=b, at=1.0),
        SetTimer(timer=c, at=2.0),
        SetTimer(timer=last, at=10.0),
        CancelTimer(timer=c),
    )
    with trio.fail_after(VIRTUAL_TIMEOUT):
        await setup.core.until(lambda: (last, 10.0) in setup.core.wakeups())
    assert setup.core.wakeups() == [(a, 1.0), (last, 10.0)]


async def test_a_timer_set_again_fires_once_at_its_last_deadline(
    setup: Driving, autojump_clock: trio.testing.MockClock
) -> None:
    later, sooner, again, last = ("later", 0), ("sooner", 0), ("again", 0), ("last", 0)
    setup.run(
        SetTimer(timer=later, at=1.0),
        SetTimer(timer=later, at=5.0),
        SetTimer(timer=sooner, at=6.0),
        SetTimer(timer=sooner, at=2.0),
        SetTimer(timer=again, at=3.0),
        CancelTimer(timer=again),
        SetTimer(timer=again, at=3.0),
        SetTimer(timer=last, at=10.0),
    )
    with trio.fail_after(VIRTUAL_TIMEOUT):
        await setup.core.until(lambda: (last, 10.0) in setup.core.wakeups())
    assert setup.core.wakeups() == [(sooner, 2.0), (again, 3.0), (later, 5.0), (last, 10.0)]


async def test_a_sooner_timer_wakes_the_timers_task_waiting_for_a_later_one(
    setup: Driving, autojump_clock: trio.testing.MockClock
) -> None:
    setup.run(SetTimer(timer=("later", 0), at=10.0))
    with trio.fail_after(VIRTUAL_TIMEOUT):
        await trio.testing.wait_all_tasks_blocked()  # the timers' task waits until 10
    setup.run(SetTimer(timer=("sooner", 0), at=1.0))
    with trio.fail_after(VIRTUAL_TIMEOUT):
        await setup.core.until(lambda: len(setup.core.wakeups()) == 2)
    assert setup.core.wakeups() == [(("sooner", 0), 1.0), (("later", 0), 10.0)]


async def test_deadlines_survive_a_timer_set_again_many_times(
    setup: Driving, autojump_clock: trio.testing.MockClock
) -> None:
    # Each setting leaves an entry in the deadline heap; past a bound the heap is rebuilt
    # from the timers that are set. The rebuilt heap must keep each one's last deadline.
    busy, first, between = ("busy", 0), ("first", 0), ("between", 0)
    setup.run(
        SetTimer(timer=first, at=4.0),
        *(SetTimer(timer=busy, at=100.0 + i) for i in range(500)),
        SetTimer(timer=between, at=5.0),
        *(SetTimer(timer=busy, at=600.0 + i) for i in range(500)),
        SetTimer(timer=busy, at=3.0),
    )
    setup.run(SetTimer(timer=("last", 0), at=50.0))
    with trio.fail_after(VIRTUAL_TIMEOUT):
        await setup.core.until(lambda: len(setup.core.wakeups()) == 4)
    assert setup.core.wakeups() == [(busy, 3.0), (first, 4.0), (between, 5.0), (("last", 0), 50.0)]

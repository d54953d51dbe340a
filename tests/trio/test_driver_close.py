"""The Trio driver bounds the flush before a close by ``CloseConnection.flush_timeout``.

A scripted core (``ProxyCore`` whose ``handle`` returns given commands) hands the driver a
close of a connection whose peer reads nothing, with a send timeout in the configuration far
longer than the command's bound: the close must come at the command's bound, on the reactor
(plain sockets) and on the task-per-connection path (``StreamConn``, as for TLS) alike.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import attrs
import pytest
import trio
import trio.testing

from muxproxy.config import Timeouts, quick_config
from muxproxy.core.commands import CloseConnection, Command, SendData
from muxproxy.core.events import ConnectionClosed, Event, Wakeup
from muxproxy.core.proxy import ProxyCore
from muxproxy.trio.driver import Driver
from muxproxy.trio.reactor import tune

PAYLOAD = b"x" * (32 * 1024 * 1024)
"""More than loopback's socket buffers hold: the flush cannot finish while nothing is read."""


class ScriptedCore(ProxyCore):
    """Answers each event with the next scripted batch; records every event."""

    def __init__(self, script: list[list[Command]]) -> None:
        config = quick_config("127.0.0.1:0", ["127.0.0.1:9"])
        super().__init__(attrs.evolve(config, timeouts=Timeouts(send=600.0)), raise_errors=True)
        self.script = script
        self.seen: list[Event] = []
        self.closed = trio.Event()

    def handle(self, event: Event) -> list[Command]:
        self.seen.append(event)
        if isinstance(event, ConnectionClosed):
            self.closed.set()
        return self.script.pop(0) if self.script else []


@pytest.fixture
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(ours, peer): a connected TCP pair on 127.0.0.1 with small buffers."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        peer = socket.socket()
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        peer.connect(listener.getsockname())
        ours, _ = listener.accept()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    try:
        yield ours, peer
    finally:
        peer.close()
        ours.close()


@pytest.mark.parametrize("path", ["reactor", "tasks"])
async def test_close_flush_is_bounded_by_the_command(
    path: str, tcp_pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, _peer = tcp_pair
    ident = 1
    core = ScriptedCore(
        [[SendData(conn=ident, data=PAYLOAD), CloseConnection(conn=ident, flush_timeout=0.2)]]
    )
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            driver = Driver(core, nursery)
            if path == "tasks":
                driver.reactor = None
            driver.start()
            if path == "reactor":
                assert driver.reactor is not None
                tune(ours)
                driver.add_socket(ident, ours)
            else:
                stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
                nursery.start_soon(driver.run_connection, driver.register(ident, stream))
                await trio.testing.wait_all_tasks_blocked()
            began = trio.current_time()
            driver.feed(Wakeup(now=began, timer=("script", 0)))
            await core.closed.wait()
            took = trio.current_time() - began
            nursery.cancel_scope.cancel()
    closes = [e for e in core.seen if isinstance(e, ConnectionClosed)]
    assert [e.conn for e in closes] == [ident]
    # Cut at the command's 0.2 s, not at the configuration's 600 s.
    assert 0.15 <= took < 5

"""The shared fuzz harness: drive one ``ProxyCore`` like the Trio driver would, assert invariants.

``run_case(kind, data, splits, stop=None)`` plays one conversation:

- ``client_h1`` / ``client_h2``: ``data`` is what a client sends on a plain listener, delivered
  in pieces cut at ``splits``; a well-behaved HTTP/1.1 backend (an h11 server) answers every
  request the proxy forwards with ``200 ok``.
- ``backend_h1`` / ``backend_h2``: a well-formed HTTP/1.1 client request, then ``data`` is what
  the backend (HTTP/1.1, or h2c with prior knowledge) answers, cut at ``splits``.

With ``stop`` (seconds, from the input's first byte: ``stop_of``), a graceful stop
(``ShutdownRequested`` with its deadline ``stop`` seconds on; 0 cuts at once) comes after the
first read of the fuzzed bytes, so the fuzzer also drives the stop through every state a
connection can be in.

A peer's end is fed as the Trio driver feeds it: ``InputEnded`` (its EOF), then
``ConnectionClosed`` once the core closes the connection. Then every timer fires in time order
and every connection ends its side, then closes. Invariants (an
``AssertionError`` names the one that broke; any other exception escaped ``handle``, which is a
bug by ``proxy.py``'s contract; the core runs with ``raise_errors``, so fault isolation does
not hide it):

1. no ``SendData`` for a connection after the core's ``CloseConnection`` or ``ShutdownWrite``
   for it;
2. every stream's buffered bytes (``statistics()``) stay within ``limits.stream_buffer``;
3. every exchange that started ends exactly once: one ``Log(event="access")`` each, and none
   is left in ``core.exchanges`` once all connections are closed;
4. the driver contract holds: reads are at most ``core.read_size``, a paused connection is not
   read, and the conversation settles (no endless event loop);
5. after a stop, once every connection is closed, ``core.drained`` holds.

Only the standard library, h11, h2 and muxproxy: the test suite replays the seed corpus through
this module without atheris.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

import attrs
import h11

from muxproxy.config import Config, Server, quick_config
from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    Command,
    Log,
    OpenConnection,
    PauseReading,
    ResumeReading,
    SendData,
    SetTimer,
    ShutdownWrite,
)
from muxproxy.core.events import (
    ConnectionAccepted,
    ConnectionClosed,
    ConnectionOpened,
    DataReceived,
    DataSent,
    Event,
    InputEnded,
    ShutdownRequested,
    Wakeup,
)
from muxproxy.core.proxy import ProxyCore

KINDS = ("client_h1", "client_h2", "backend_h1", "backend_h2")
CLIENT = 1
BACKEND = "127.0.0.1:9001"
# Events one case may cause; a well-formed conversation needs a few hundred.
MAX_EVENTS = 20_000
# Timer rounds at the end: each fires every due timer once (re-armed lazy timers fire again).
MAX_TIMER_ROUNDS = 50

CLIENT_REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: proxy.example\r\n"
    b"content-type: application/json\r\ncontent-length: 15\r\n\r\n"
    b'{"stream":true}'
)


def decode(buf: bytes) -> tuple[bytes, list[int]]:
    """An atheris input as (data, splits): byte 0 counts the splits (mod 8), two bytes each
    (big-endian, taken modulo the data's length), then the data."""
    if not buf:
        return b"", []
    count = buf[0] % 8
    raw = buf[1 : 1 + 2 * count]
    data = buf[1 + 2 * count :]
    splits = [int.from_bytes(raw[i : i + 2], "big") for i in range(0, len(raw) - 1, 2)]
    return data, splits


def stop_of(buf: bytes) -> float | None:
    """The graceful stop an atheris input asks for: bit 3 of byte 0 set means a stop, whose
    grace is bits 4-5 (0 to 3 seconds; 0 cuts at once); None: no stop."""
    if not buf or not buf[0] & STOP_BIT:
        return None
    return float((buf[0] >> 4) & 3)


STOP_BIT = 0x08


def encode(
    data: bytes,
    splits: list[int] = [],  # noqa: B006 - never mutated
    stop: int | None = None,
) -> bytes:
    """The inverse of ``decode`` and ``stop_of`` (for the seed corpus)."""
    splits = splits[:7]
    first = len(splits) if stop is None else len(splits) | STOP_BIT | (stop & 3) << 4
    return bytes([first]) + b"".join(s.to_bytes(2, "big") for s in splits) + data


def config_for(kind: str) -> Config:
    config = quick_config("127.0.0.1:8080", [BACKEND])
    if kind == "backend_h2":
        group = config.upstreams["default"]
        group = attrs.evolve(group, servers=(Server(address=BACKEND, protocol="h2"),))
        config = attrs.evolve(config, upstreams={"default": group})
    return config


class Driver:
    """What ``muxproxy/trio/driver.py`` does, minus sockets: commands in, events out."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.config = config_for(kind)
        # A bug must crash the case, not be contained as one connection's internal error.
        self.core = ProxyCore(self.config, raise_errors=True)
        self.now = 0.0
        self.queue: collections.deque[Event] = collections.deque()
        self.closed: set[int] = set()
        """Connections the core closed (``CloseConnection``)."""
        self.gone: set[int] = set()
        """Connections for which ``ConnectionClosed`` was delivered."""
        self.shut: set[int] = set()
        """Connections whose write side the core shut down (``ShutdownWrite``)."""
        self.ended: set[int] = set()
        """Connections whose peer ended its side (``InputEnded`` fed)."""
        self.paused: set[int] = set()
        self.timers: dict[tuple[str, int], float] = {}
        self.logs: list[Log] = []
        self.backends: list[int] = []
        self.responders: dict[int, h11.Connection] = {}
        self.events = 0
        self.stop: float | None = None
        """The graceful stop still to request during the next ``deliver`` (its grace)."""

    # -- the core's side ------------------------------------------------------------------

    def feed(self, event: Event) -> None:
        self.events += 1
        assert self.events < MAX_EVENTS, "the conversation does not settle"
        for command in self.core.handle(event):
            self.apply(command)
        limit = self.config.limits.stream_buffer
        for stream in self.core.statistics().streams:
            assert stream.response_buffered <= limit, f"response buffer over limit: {stream}"
            assert stream.request_buffered <= limit, f"request buffer over limit: {stream}"

    def apply(self, command: Command) -> None:
        if isinstance(command, SendData):
            assert command.conn not in self.closed, f"SendData after CloseConnection: {command}"
            assert command.conn not in self.shut, f"SendData after ShutdownWrite: {command}"
            if command.conn in self.gone:
                return  # the peer went away; the driver drops it (a race, not a bug)
            self.queue.append(DataSent(now=self.now, conn=command.conn, nbytes=len(command.data)))
            if command.conn in self.responders:
                self.respond(command.conn, command.data)
        elif isinstance(command, CloseConnection):
            if command.conn not in self.closed and command.conn not in self.gone:
                self.queue.append(ConnectionClosed(now=self.now, conn=command.conn))
            self.closed.add(command.conn)
        elif isinstance(command, OpenConnection):
            self.backends.append(command.conn)
            if self.kind.startswith("client"):
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

    def settle(self) -> None:
        while self.queue:
            event = self.queue.popleft()
            if isinstance(event, ConnectionClosed):
                if event.conn in self.gone:
                    continue
                self.gone.add(event.conn)
            self.feed(event)

    # -- peers ----------------------------------------------------------------------------

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

    def deliver(self, conn: int, data: bytes, splits: list[int]) -> None:
        """``data`` from the peer on ``conn``, in reads cut at ``splits`` (and ``read_size``)."""
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
                    or (conn in self.ended)
                ):
                    return  # the driver does not read a paused or closed socket
                piece = data[i : min(end, i + self.core.read_size)]
                self.feed(DataReceived(now=self.now, conn=conn, data=piece))
        self.settle()
        self.request_stop()

    def request_stop(self) -> None:
        """Feed the pending graceful stop, if any (once)."""
        if self.stop is not None:
            grace, self.stop = self.stop, None
            self.feed(ShutdownRequested(now=self.now, deadline=self.now + grace))
            self.settle()

    def fire_timers(self) -> None:
        for _ in range(MAX_TIMER_ROUNDS):
            self.settle()
            if not self.timers:
                return
            timer, at = min(self.timers.items(), key=lambda item: item[1])
            del self.timers[timer]
            self.now = max(self.now, at)
            self.feed(Wakeup(now=self.now, timer=timer))
        self.settle()

    def end_input(self, conn: int) -> None:
        """The peer on ``conn`` ends its side (EOF), as the driver reports it."""
        if conn not in self.gone and conn not in self.closed and conn not in self.ended:
            self.ended.add(conn)
            self.queue.append(InputEnded(now=self.now, conn=conn))
        self.settle()

    def close_everything(self) -> None:
        self.now += 1.0
        for conn in [CLIENT, *self.backends]:
            self.end_input(conn)
        for conn in [CLIENT, *self.backends]:
            if conn not in self.gone:
                self.queue.append(ConnectionClosed(now=self.now, conn=conn))
        self.settle()


def run_case(kind: str, data: bytes, splits: list[int], stop: float | None = None) -> None:
    """Play one conversation (see the module docstring); raise AssertionError on a broken
    invariant."""
    assert kind in KINDS, kind
    driver = Driver(kind)
    driver.feed(ConnectionAccepted(now=0.0, conn=CLIENT, listener="l", peer=("10.0.0.7", 5555)))
    if kind.startswith("client"):
        driver.stop = stop
        driver.deliver(CLIENT, data, splits)
    else:
        driver.deliver(CLIENT, CLIENT_REQUEST, [])
        driver.stop = stop
        if driver.backends:
            driver.deliver(driver.backends[0], data, splits)
            # The backend ends: h11's read-until-close framing, a truncation, or (in a
            # tunnel) one direction's end.
            driver.end_input(driver.backends[0])
    driver.request_stop()  # no backend was reached: the stop comes all the same
    driver.fire_timers()
    driver.close_everything()
    driver.fire_timers()
    check_endings(driver)
    if stop is not None:
        assert driver.core.drained, "stopped, every connection closed, yet not drained"


def check_endings(driver: Driver) -> None:
    core: Any = driver.core
    started = core._next_exchange
    accessed = [log for log in driver.logs if log.event == "access"]
    assert not core.exchanges, f"exchanges left after every connection closed: {core.exchanges}"
    assert len(accessed) == started, f"{started} exchanges, {len(accessed)} access logs"
    stats = core.statistics()
    assert stats.client_connections == 0, "a client connection outlived its close"

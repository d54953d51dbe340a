"""A Playbook for the sans-IO core: feed events, assert commands, decode bytes with real peers.

Tests build every input with real h11/h2 peer objects and decode every output with them too,
so no test hand-writes HTTP/2 frames or HPACK.

Conversations (after mitmproxy's ``test/mitmproxy/proxy/tutils.py``) are checked in order::

    pb >> data(1, request)            # feed an event; its commands join a queue
    pb << OpenConnection(conn=up.slot, origin=ANY)   # the next command must match
    pb << Sends(up.value, backend)    # the next run of SendData to it, decoded by a peer
    pb.done()                         # nothing else came out

The rules:

- ``pb << expected`` takes the next command of the queue. A ``Command`` must equal it field
  by field, where a field may hold ``ANY``, a ``Capture``'s ``slot`` (which takes the value
  on first match and must equal it afterwards) or ``subset({...})`` (a dict holding these
  items); a field outside the command's equality (``eq=False``) is not compared. A
  ``Matcher`` (``Sends``, ``Where``) decides for itself.
- Commands of the types in ``ignore`` never enter the queue; they stay in ``pb.log``. The
  default ignores ``Log``: a test that asserts log records passes ``ignore=()``.
- ``pb >> event`` first asserts that the queue is empty: every command an event caused is
  asserted before the next event, so a conversation cannot skip an unexpected command.
  ``pb.rest()`` takes what is left without asserting it, for a test that checks it apart.
- The older helpers (``accept``, ``receive``, ``opened``, ...) feed events without queueing
  their commands; a test may set up with them and then converse.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import attrs
import h2.config
import h2.connection
import h2.events
import h2.settings
import h11

from muxproxy.config import Config, quick_config
from muxproxy.core.commands import Command, Log, OpenConnection, SendData
from muxproxy.core.events import (
    ConnectionAccepted,
    ConnectionClosed,
    ConnectionOpened,
    DataReceived,
    DataSent,
    Event,
    OpenFailed,
    Wakeup,
)
from muxproxy.core.http.forwarded import Network
from muxproxy.core.proxy import ProxyCore
from muxproxy.core.timers import (
    BackendTimer,
    ClientTimer,
    CoreTimer,
    ExchangeTimer,
    ProbeTimer,
    ResumeTimer,
    TimerKind,
)

BACKEND = "127.0.0.1:9001"
CHAT = b"/v1/chat/completions"


def default_config(**changes: Any) -> Config:
    return attrs.evolve(quick_config("127.0.0.1:8080", [BACKEND]), **changes)


T = TypeVar("T")


# -- matching --------------------------------------------------------------------------------


class _Anything:
    def __eq__(self, other: object) -> bool:
        return True

    def __repr__(self) -> str:
        return "ANY"


ANY: Any = _Anything()
"""A field value that matches any value."""


class Capture(Generic[T]):
    """A value the core chooses (a connection id, a request id): ``slot`` in an expected
    command takes it on the first match; later matches must see the same value."""

    def __init__(self, name: str = "capture") -> None:
        self.name = name
        self._value: T | None = None
        self.bound = False

    @property
    def slot(self) -> Any:
        return _Slot(self)

    @property
    def value(self) -> T:
        assert self.bound, f"{self.name} was never matched"
        return self._value  # type: ignore[return-value]  # bound: set by a match

    def offer(self, value: Any) -> bool:
        if not self.bound:
            self._value, self.bound = value, True
            return True
        return bool(self._value == value)


@attrs.frozen
class _Slot:
    capture: Capture[Any]

    def __repr__(self) -> str:
        shown = repr(self.capture._value) if self.capture.bound else "?"
        return f"<{self.capture.name}={shown}>"


@attrs.frozen
class _Subset:
    items: dict[str, Any]

    def __repr__(self) -> str:
        return f"subset({self.items!r})"


def subset(items: dict[str, Any]) -> Any:
    """A dict field (``Log.fields``) that holds at least these items (values may be ``ANY``)."""
    return _Subset(items)


def _field_matches(expected: Any, actual: Any) -> bool:
    if isinstance(expected, _Slot):
        return expected.capture.offer(actual)
    if isinstance(expected, _Subset):
        return isinstance(actual, dict) and all(
            key in actual and _field_matches(value, actual[key])
            for key, value in expected.items.items()
        )
    return bool(expected == actual)


def _command_matches(expected: Command, actual: Command) -> bool:
    if type(expected) is not type(actual):
        return False
    # Fields the command keeps out of its equality (``eq=False``) are left out here too.
    return all(
        _field_matches(getattr(expected, f.name), getattr(actual, f.name))
        for f in attrs.fields(type(expected))
        if f.eq
    )


class Matcher(Protocol):
    """Takes what it matches from the front of ``queue``; raises AssertionError if it cannot."""

    def take(self, queue: list[Command]) -> None: ...


class Decoder(Protocol):
    def events(self, data: bytes) -> Sequence[Any]: ...


class Sends:
    """The next run of ``SendData`` to ``conn`` (one command or several in a row), decoded
    by ``peer``; ``check`` gets the decoded events and asserts (or returns False).
    The events are kept in ``self.events`` for later assertions."""

    def __init__(
        self,
        conn: int,
        peer: Decoder,
        check: Callable[[Sequence[Any]], bool | None] | None = None,
    ) -> None:
        self.conn = conn
        self.peer = peer
        self.check = check
        self.events: Sequence[Any] = ()
        self.data = b""

    def take(self, queue: list[Command]) -> None:
        run = 0
        while (
            run < len(queue) and isinstance(cmd := queue[run], SendData) and cmd.conn == self.conn
        ):
            run += 1
        assert run, f"expected SendData to {self.conn}, got {queue[:1] or 'nothing'}"
        sends = queue[:run]
        del queue[:run]
        self.data = b"".join(c.data for c in sends if isinstance(c, SendData))
        self.events = self.peer.events(self.data)
        if self.check is not None:
            assert self.check(self.events) is not False, f"{self!r} rejected {self.events}"

    def __repr__(self) -> str:
        return f"Sends(conn={self.conn})"


class Where:
    """The next command, if it is a ``kind`` and ``check`` accepts it (asserts or returns
    a bool)."""

    def __init__(self, kind: type[Command], check: Callable[[Any], bool | None]) -> None:
        self.kind = kind
        self.check = check

    def take(self, queue: list[Command]) -> None:
        assert queue, f"expected a {self.kind.__name__}, got nothing"
        cmd = queue[0]
        assert isinstance(cmd, self.kind), f"expected a {self.kind.__name__}, got {cmd}"
        assert self.check(cmd) is not False, f"{cmd} rejected"
        del queue[0]


# -- events in shorthand: each takes the playbook's clock when fed ---------------------------

Step = Callable[[float], Event]


def accepted(conn: int = 1, *, tls: bool = False, alpn: str | None = None) -> Step:
    return lambda now: ConnectionAccepted(
        now=now, conn=conn, listener="l", peer=("10.0.0.7", 5555), tls=tls, alpn=alpn
    )


def data(conn: int, payload: bytes) -> Step:
    return lambda now: DataReceived(now=now, conn=conn, data=payload)


def opened(conn: int) -> Step:
    return lambda now: ConnectionOpened(now=now, conn=conn)


def open_failed(conn: int, reason: str = "refused") -> Step:
    return lambda now: OpenFailed(now=now, conn=conn, reason=reason)


def sent(conn: int, nbytes: int) -> Step:
    return lambda now: DataSent(now=now, conn=conn, nbytes=nbytes)


def closed(conn: int, error: str | None = None) -> Step:
    return lambda now: ConnectionClosed(now=now, conn=conn, error=error)


def wakeup(kind: str, ident: int) -> Step:
    return lambda now: Wakeup(now=now, timer=(timer_kind(kind), ident))


class Playbook:
    """Drives one ``ProxyCore``; remembers every command; time moves only when told."""

    def __init__(
        self,
        config: Config | None = None,
        *,
        split: int = 0,
        ignore: tuple[type[Command], ...] = (Log,),
    ) -> None:
        self.core = ProxyCore(config or default_config())
        self.now = 0.0
        self.log: list[Command] = []
        self.split = split
        """Feed DataReceived in pieces of this many bytes (0: whole)."""
        self.ignore = ignore
        self.queue: list[Command] = []
        """Commands of ``>>`` events not yet asserted by ``<<``."""

    def __rshift__(self, event: Event | Step) -> Playbook:
        self.done()
        if not isinstance(event, Event):
            event = event(self.now)
        if isinstance(event, DataReceived) and self.split:
            commands = self.receive(event.conn, event.data)
        else:
            commands = self.feed(event)
        self.queue += [c for c in commands if not isinstance(c, self.ignore)]
        return self

    def __lshift__(self, expected: Command | Matcher) -> Playbook:
        if isinstance(expected, Command):
            assert self.queue, f"expected {expected}, got nothing"
            actual = self.queue[0]
            assert _command_matches(expected, actual), (
                f"expected {expected}\n     got {actual}\n    then {self.queue[1:]}"
            )
            del self.queue[0]
        else:
            expected.take(self.queue)
        return self

    def done(self) -> None:
        """Assert that every queued command was asserted."""
        assert not self.queue, f"commands not asserted: {self.queue}"

    def rest(self) -> list[Command]:
        """Take the queued commands without asserting them."""
        rest, self.queue = self.queue, []
        return rest

    def feed(self, event: Event) -> list[Command]:
        commands = self.core.handle(event)
        self.log.extend(commands)
        return commands

    def accept(
        self,
        conn: int = 1,
        *,
        tls: bool = False,
        alpn: str | None = None,
        wall: float | None = None,
        peer: tuple[str, int] = ("10.0.0.7", 5555),
        trusted_proxies: tuple[Network, ...] = (),
    ) -> None:
        """A client connection; ``wall``: the wall-clock time the driver tells the core;
        ``trusted_proxies``: the listener's."""
        self.feed(
            ConnectionAccepted(
                now=self.now,
                conn=conn,
                listener="l",
                peer=peer,
                tls=tls,
                alpn=alpn,
                trusted_proxies=trusted_proxies,
                wall=wall,
            )
        )

    def receive(self, conn: int, data: bytes) -> list[Command]:
        """Feed ``data`` (in pieces of ``split`` bytes if set); return all commands."""
        step = self.split or len(data) or 1
        out: list[Command] = []
        for i in range(0, len(data), step):
            out += self.feed(DataReceived(now=self.now, conn=conn, data=data[i : i + step]))
        return out

    def opened(self, conn: int) -> list[Command]:
        return self.feed(ConnectionOpened(now=self.now, conn=conn))

    def sent(self, conn: int, nbytes: int) -> list[Command]:
        return self.feed(DataSent(now=self.now, conn=conn, nbytes=nbytes))

    def closed(self, conn: int, error: str | None = None) -> list[Command]:
        return self.feed(ConnectionClosed(now=self.now, conn=conn, error=error))

    def wakeup(self, kind: str, ident: int) -> list[Command]:
        return self.feed(Wakeup(now=self.now, timer=(timer_kind(kind), ident)))

    def take(self, conn: int, commands: Iterable[Command] | None = None) -> bytes:
        """All bytes sent to ``conn`` by ``commands`` (default: everything so far)."""
        source = self.log if commands is None else commands
        return b"".join(c.data for c in source if isinstance(c, SendData) and c.conn == conn)

    def opens(self) -> list[OpenConnection]:
        return [c for c in self.log if isinstance(c, OpenConnection)]


# -- peers ---------------------------------------------------------------------------------


class H1ClientPeer:
    def __init__(self) -> None:
        self.conn = h11.Connection(h11.CLIENT)

    def request(
        self,
        method: str = "GET",
        target: str = "/v1/models",
        headers: list[tuple[str, str]] | None = None,
        body: bytes | None = None,
    ) -> bytes:
        hdrs = [("Host", "proxy.example"), *(headers or [])]
        if body is not None:
            hdrs.append(("Content-Length", str(len(body))))
        out = self.conn.send(h11.Request(method=method, target=target, headers=hdrs)) or b""
        if body:
            out += self.conn.send(h11.Data(data=body)) or b""
        out += self.conn.send(h11.EndOfMessage()) or b""
        return out

    def events(self, data: bytes) -> list[Any]:
        self.conn.receive_data(data)
        out = []
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return out
            out.append(event)
            if type(event) is h11.ConnectionClosed:
                return out


class H1BackendPeer:
    """An HTTP/1.1 server peer playing the GPU backend."""

    def __init__(self) -> None:
        self.conn = h11.Connection(h11.SERVER)

    def events(self, data: bytes) -> list[Any]:
        self.conn.receive_data(data)
        out = []
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return out
            out.append(event)

    def sse_head(self) -> bytes:
        return (
            self.conn.send(
                h11.Response(
                    status_code=200,
                    headers=[("Content-Type", "text/event-stream"), ("X-Backend-Id", "gpu0")],
                )
            )
            or b""
        )

    def chunk(self, data: bytes) -> bytes:
        return self.conn.send(h11.Data(data=data)) or b""

    def reply(self, body: bytes, *, close: bool = False) -> bytes:
        """A whole 200 response with a Content-Length (and ``Connection: close``)."""
        headers = [("Content-Length", str(len(body)))]
        if close:
            headers.append(("Connection", "close"))
        out = self.conn.send(h11.Response(status_code=200, headers=headers)) or b""
        out += self.conn.send(h11.Data(data=body)) or b""
        return out + (self.conn.send(h11.EndOfMessage()) or b"")

    def end(self) -> bytes:
        return self.conn.send(h11.EndOfMessage()) or b""


def is_request(target: bytes) -> Callable[[Sequence[Any]], None]:
    """A ``Sends`` check for an ``H1BackendPeer``: one whole request for ``target``."""

    def check(events: Sequence[Any]) -> None:
        assert isinstance(events[0], h11.Request)
        assert events[0].target == target
        assert isinstance(events[-1], h11.EndOfMessage)

    return check


class H2ClientPeer:
    def __init__(self) -> None:
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self.conn = h2.connection.H2Connection(config=config)
        self.conn.initiate_connection()

    def preface(self) -> bytes:
        return self.conn.data_to_send()

    def request(
        self,
        method: bytes = b"GET",
        path: bytes = b"/v1/models",
        *,
        headers: list[tuple[bytes, bytes]] | None = None,
        body: bytes | None = None,
    ) -> tuple[int, bytes]:
        sid = self.conn.get_next_available_stream_id()
        hdrs = [
            (b":method", method),
            (b":scheme", b"http"),
            (b":authority", b"proxy.example"),
            (b":path", path),
            *(headers or []),
        ]
        self.conn.send_headers(sid, hdrs, end_stream=body is None)
        if body is not None:
            self.conn.send_data(sid, body, end_stream=True)
        return sid, self.conn.data_to_send()

    def request_as_is(self, block: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:
        """A request whose whole header block is ``block``, sent without h2's checks and
        normalisation of outbound headers: a malformed request, to see the proxy refuse it."""
        sid = self.conn.get_next_available_stream_id()
        config = self.conn.config
        checks = (config.validate_outbound_headers, config.normalize_outbound_headers)
        config.validate_outbound_headers = config.normalize_outbound_headers = False
        try:
            self.conn.send_headers(sid, block, end_stream=True)
        finally:
            config.validate_outbound_headers, config.normalize_outbound_headers = checks
        return sid, self.conn.data_to_send()

    def events(self, data: bytes) -> list[h2.events.Event]:
        events = self.conn.receive_data(data)
        for event in events:
            if isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        return events


def h2_request_as_is(
    block: list[tuple[bytes, bytes]],
) -> tuple[Playbook, H2ClientPeer, int, list[h2.events.Event]]:
    """Client connection 1 (TLS, ALPN h2) whose first request is ``block``, sent as is (see
    ``H2ClientPeer.request_as_is``): the playbook, the client, the request's stream id and
    what the client decoded of the proxy's answer."""
    pb = Playbook()
    pb.accept(1, tls=True, alpn="h2")
    client = H2ClientPeer()
    pb.receive(1, client.preface())
    sid, data = client.request_as_is(block)
    pb.receive(1, data)
    return pb, client, sid, client.events(pb.take(1))


def stream_resets(events: Iterable[h2.events.Event]) -> list[tuple[int, int]]:
    """(stream id, error code) of each RST_STREAM among ``events``."""
    return [(e.stream_id, e.error_code) for e in events if isinstance(e, h2.events.StreamReset)]


class H2BackendPeer:
    """An h2 server peer playing the GPU backend on backend connection ``conn``.

    ``max_streams``, ``connect`` (RFC 8441 §3 extended CONNECT) and ``window`` go into its
    SETTINGS when given; ``ack``: whether ``read`` acknowledges received DATA at once (the
    flow-control tests leave it to the test). A test decodes with ``read`` (what
    ``pb.log`` holds) or with ``Sends`` (which calls ``events``), not both.
    """

    def __init__(
        self,
        pb: Playbook,
        conn: int,
        *,
        max_streams: int | None = None,
        connect: bool | None = None,
        window: int | None = None,
        ack: bool = True,
    ) -> None:
        self.pb = pb
        self.conn_id = conn
        self.ack = ack
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        self.conn = h2.connection.H2Connection(config=config)
        codes = h2.settings.SettingCodes
        values = {
            codes.MAX_CONCURRENT_STREAMS: max_streams,
            codes.ENABLE_CONNECT_PROTOCOL: None if connect is None else int(connect),
            codes.INITIAL_WINDOW_SIZE: window,
        }
        self.conn.local_settings = h2.settings.Settings(
            client=False, initial_values={k: v for k, v in values.items() if v is not None}
        )
        self.conn.initiate_connection()
        self.seen = 0

    def read(self) -> list[h2.events.Event]:
        """Decode what the proxy sent to this backend since the last read."""
        sends = [c for c in self.pb.log if isinstance(c, SendData) and c.conn == self.conn_id]
        data = b"".join(c.data for c in sends[self.seen :])
        self.seen = len(sends)
        return self.events(data) if data else []

    def events(self, data: bytes) -> list[h2.events.Event]:
        """Decode ``data`` (for ``Sends``; ``read`` is for tests that look at ``pb.log``)."""
        events = self.conn.receive_data(data)
        if self.ack:
            for event in events:
                if isinstance(event, h2.events.DataReceived):
                    self.conn.acknowledge_received_data(
                        event.flow_controlled_length, event.stream_id
                    )
        return events

    def output(self) -> bytes:
        """What this peer has to send: feed it with ``pb >> data(conn, backend.output())``."""
        return self.conn.data_to_send()

    def flush(self) -> list[Command]:
        data = self.conn.data_to_send()
        return self.pb.receive(self.conn_id, data) if data else []


class H2Client:
    """An h2 client peer on client connection ``conn`` of the playbook (accepted here),
    reading what the proxy sent it with ``read``; ``peer`` may be a subclass of
    ``H2ClientPeer`` (one that reads past a GOAWAY, say)."""

    def __init__(self, pb: Playbook, conn: int, peer: H2ClientPeer | None = None) -> None:
        self.pb = pb
        self.conn_id = conn
        self.peer = peer or H2ClientPeer()
        self.seen = 0
        pb.accept(conn)
        pb.receive(conn, self.peer.preface())

    def request(
        self,
        path: bytes = b"/v1/chat/completions",
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> int:
        """A POST of ``{}`` to ``path``; returns its stream id."""
        sid, data = self.peer.request(b"POST", path, headers=headers, body=b"{}")
        self.pb.receive(self.conn_id, data)
        return sid

    def read(self, *, ack: bool = True) -> list[h2.events.Event]:
        """Decode what the proxy sent to this client since the last read; ``ack``: give the
        window back for received DATA."""
        sends = [c for c in self.pb.log if isinstance(c, SendData) and c.conn == self.conn_id]
        data = b"".join(c.data for c in sends[self.seen :])
        self.seen = len(sends)
        if not data:
            return []
        if ack:
            return self.peer.events(data)
        return self.peer.conn.receive_data(data)

    def send(self) -> None:
        data = self.peer.conn.data_to_send()
        if data:
            self.pb.receive(self.conn_id, data)


def h2_sse_stream(
    pb: Playbook, client: H2ClientPeer, path: bytes = b"/v1/stream", *, data: bytes = b""
) -> tuple[int, int]:
    """Open a stream of ``client`` on connection 1 (``data`` sent before it: the preface, say)
    whose HTTP/1.1 backend answered with an SSE head; return (stream id, backend conn)."""
    before = len(pb.opens())
    sid, request = client.request(b"GET", path)
    pb.receive(1, data + request)
    up = pb.opens()[before].conn
    pb.opened(up)
    backend = H1BackendPeer()
    backend.events(pb.take(up))
    pb.receive(up, backend.sse_head())
    return sid, up


def timer_kind(name: str) -> TimerKind:
    """The timer kind named ``name`` ("read", "idle", ...), as the core's enums spell it (a
    compiled core takes nothing else for a timer)."""
    for kinds in (ExchangeTimer, ClientTimer, BackendTimer, ProbeTimer, CoreTimer, ResumeTimer):
        for kind in kinds:
            if kind.value == name:
                return kind
    raise ValueError(f"no timer kind {name!r}")

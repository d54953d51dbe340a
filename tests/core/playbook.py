"""A Playbook for the sans-IO core: feed events, collect commands, decode bytes with real peers.

Tests build every input with real h11/h2 peer objects and decode every output with them too,
so no test hand-writes HTTP/2 frames or HPACK.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import h2.config
import h2.connection
import h2.events
import h11

from muxproxy.config import Config, quick_config
from muxproxy.core.commands import Command, OpenConnection, SendData
from muxproxy.core.events import (
    ConnectionAccepted,
    ConnectionClosed,
    ConnectionOpened,
    DataReceived,
    DataSent,
    Event,
    Wakeup,
)
from muxproxy.core.proxy import ProxyCore

BACKEND = "127.0.0.1:9001"


def default_config(**changes: Any) -> Config:
    import attrs

    return attrs.evolve(quick_config("127.0.0.1:8080", [BACKEND]), **changes)


class Playbook:
    """Drives one ``ProxyCore``; remembers every command; time moves only when told."""

    def __init__(self, config: Config | None = None, *, split: int = 0) -> None:
        self.core = ProxyCore(config or default_config())
        self.now = 0.0
        self.log: list[Command] = []
        self.split = split
        """Feed DataReceived in pieces of this many bytes (0: whole)."""

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
    ) -> None:
        """A client connection; ``wall``: the wall-clock time the driver tells the core."""
        self.feed(
            ConnectionAccepted(
                now=self.now,
                conn=conn,
                listener="l",
                peer=("10.0.0.7", 5555),
                tls=tls,
                alpn=alpn,
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
        return self.feed(Wakeup(now=self.now, timer=(kind, ident)))

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

    def end(self) -> bytes:
        return self.conn.send(h11.EndOfMessage()) or b""


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

    def events(self, data: bytes) -> list[h2.events.Event]:
        events = self.conn.receive_data(data)
        for event in events:
            if isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        return events


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

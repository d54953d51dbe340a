"""The floors of the short-request path: HTTP relays on Trio + h11 (+ h2) with no proxy logic.

What a short request costs a Python proxy on muxproxy's libraries when its own code costs
nothing: no routing, no pool policy, no admission, no access log, no timers, no metrics. Two
relays, one per client protocol (``bench/short_requests.py`` runs them beside muxproxy, the
variants ``h11-relay`` and ``h2-relay``):

* ``--proto h1``: an ``h11`` server connection per client connection, and with it one ``h11``
  client connection to the backend, opened on the first request and kept alive: each request
  is relayed as it arrives (head, body, end), then the answer the same way, one ``send_all``
  per socket read on either side.
* ``--proto h2``: an ``h2`` server connection per client connection (h2c, prior knowledge);
  each complete request stream is relayed by a task of its own over an ``h11`` client
  connection taken from one process-wide pool of idle keep-alive connections to the backend
  (a new one when none is idle), the answer sent back as HEADERS and DATA with END_STREAM.

What it obeys, and why so little: HTTP/1.1 framing and HTTP/2 framing, flow control and header
validation are h11's and h2's, with their defaults, so that the floor does the protocol work
muxproxy must do and nothing else. Hop-by-hop fields (RFC 9110 §7.6.1) are dropped towards an
h2 client (RFC 9113 §8.2.2 forbids them) and ``:authority`` becomes ``host`` towards the
backend (RFC 9113 §8.3.1). A malformed peer ends its own connection (the relay is not a test of
error handling); a backend that closes a pooled connection ends the requests on it.

Usage: ``python bench/h11_relay.py --proto h1 --listen 127.0.0.1:8002 --upstream
127.0.0.1:8001`` (prints ``ready`` once listening; SIGINT or SIGTERM ends it).
"""

from __future__ import annotations

import argparse
import resource
import socket

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h11
import trio

READ_SIZE = 64 * 1024
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"upgrade",
        b"te",
        b"trailer",
    }
)
"""RFC 9110 §7.6.1 / RFC 9113 §8.2.2: fields that describe one hop, not the message."""
PEER_ERRORS = (
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    OSError,
    h11.RemoteProtocolError,
    h2.exceptions.ProtocolError,
)
"""What a misbehaving or vanished peer raises: it ends that peer's connection only."""


def nodelay(stream: trio.SocketStream) -> None:
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)


async def open_backend(host: str, port: int) -> trio.SocketStream:
    stream = await trio.open_tcp_stream(host, port)
    nodelay(stream)
    return stream


class Backend:
    """One keep-alive HTTP/1.1 connection to the backend: a request in, its answer's events out."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)

    def reusable(self) -> bool:
        return self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE

    async def next_events(self) -> list[h11.Event]:
        """Every event the next read completes (at least one), for one ``send_all`` onwards."""
        events: list[h11.Event] = []
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                if events:
                    return events
                data = await self.stream.receive_some(READ_SIZE)
                if not data:
                    raise trio.BrokenResourceError("the backend closed the connection")
                self.conn.receive_data(data)
                continue
            if event is h11.PAUSED:
                return events
            assert isinstance(event, h11.Event)
            events.append(event)
            if isinstance(event, h11.EndOfMessage):
                return events


# --- HTTP/1.1 client ------------------------------------------------------------------------


async def serve_h1(client: trio.SocketStream, host: str, port: int) -> None:
    """Relay every request of one HTTP/1.1 client connection over its own backend connection."""
    nodelay(client)
    conn = h11.Connection(h11.SERVER)
    backend: Backend | None = None
    try:
        while True:
            # The request: each read's events go to the backend in one write.
            out = b""
            done = False
            while not done:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    if out:
                        assert backend is not None
                        await backend.stream.send_all(out)
                        out = b""
                    conn.receive_data(await client.receive_some(READ_SIZE))
                    continue
                if isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                    return
                if isinstance(event, h11.Request):
                    if backend is None:
                        backend = Backend(await open_backend(host, port))
                    request = h11.Request(
                        method=event.method, target=event.target, headers=event.headers
                    )
                    out += backend.conn.send(request) or b""
                elif isinstance(event, h11.Data):
                    assert backend is not None
                    out += backend.conn.send(h11.Data(data=event.data)) or b""
                elif isinstance(event, h11.EndOfMessage):
                    assert backend is not None
                    out += backend.conn.send(h11.EndOfMessage()) or b""
                    done = True
            assert backend is not None
            await backend.stream.send_all(out)
            # The answer: each backend read's events go to the client in one write.
            finished = False
            while not finished:
                out = b""
                for event in await backend.next_events():
                    if isinstance(event, h11.Response):
                        response = h11.Response(
                            status_code=event.status_code,
                            headers=event.headers,
                            reason=event.reason,
                        )
                        out += conn.send(response) or b""
                    elif isinstance(event, h11.Data):
                        out += conn.send(h11.Data(data=event.data)) or b""
                    elif isinstance(event, h11.EndOfMessage):
                        out += conn.send(h11.EndOfMessage()) or b""
                        finished = True
                await client.send_all(out)
            if not backend.reusable() or conn.our_state is not h11.DONE:
                return
            backend.conn.start_next_cycle()
            conn.start_next_cycle()
    except PEER_ERRORS:
        return
    finally:
        if backend is not None:
            await backend.stream.aclose()
        await client.aclose()


# --- h2c client -----------------------------------------------------------------------------


class Pool:
    """The process's idle keep-alive connections to the backend, most recently used first."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.idle: list[Backend] = []

    async def take(self) -> Backend:
        if self.idle:
            return self.idle.pop()
        return Backend(await open_backend(self.host, self.port))

    def give_back(self, backend: Backend) -> None:
        backend.conn.start_next_cycle()
        self.idle.append(backend)


class H2Client:
    """One h2c client connection: the h2 state, the socket, and a lock so that the writes of
    concurrent streams go out whole and in the order h2 produced them."""

    def __init__(self, stream: trio.SocketStream, pool: Pool) -> None:
        self.stream = stream
        self.pool = pool
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        self.conn = h2.connection.H2Connection(config=config)
        self.write_lock = trio.Lock()
        self.window_opened = trio.Event()
        self.requests: dict[int, tuple[list[tuple[bytes, bytes]], list[bytes]]] = {}
        """Stream id: the request's h1 headers and its body so far, until END_STREAM."""

    async def flush(self) -> None:
        async with self.write_lock:
            data = self.conn.data_to_send()
            if data:
                await self.stream.send_all(data)

    async def run(self) -> None:
        self.conn.initiate_connection()
        await self.flush()
        async with trio.open_nursery() as nursery:
            while True:
                data = await self.stream.receive_some(READ_SIZE)
                if not data:
                    nursery.cancel_scope.cancel()
                    return
                for event in self.conn.receive_data(data):
                    self.on_event(event, nursery)
                await self.flush()

    def on_event(self, event: h2.events.Event, nursery: trio.Nursery) -> None:
        if isinstance(event, h2.events.RequestReceived):
            self.requests[event.stream_id] = (h1_request_headers(event.headers), [])
        elif isinstance(event, h2.events.DataReceived):
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            request = self.requests.get(event.stream_id)
            if request is not None:
                request[1].append(event.data)
        elif isinstance(event, h2.events.StreamEnded):
            # Also reported as RequestReceived.stream_ended / DataReceived.stream_ended: the
            # request is whole here, whichever frame ended it.
            self.dispatch(event.stream_id, nursery)
        elif isinstance(event, h2.events.StreamReset):
            self.requests.pop(event.stream_id, None)
        elif isinstance(event, h2.events.WindowUpdated):
            self.window_opened.set()
            self.window_opened = trio.Event()
        elif isinstance(event, h2.events.ConnectionTerminated):
            nursery.cancel_scope.cancel()

    def dispatch(self, stream_id: int, nursery: trio.Nursery) -> None:
        request = self.requests.pop(stream_id, None)
        if request is not None:
            nursery.start_soon(self.relay, stream_id, request[0], b"".join(request[1]))

    async def relay(self, stream_id: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """One request over a pooled backend connection, its answer back on ``stream_id``."""
        try:
            backend = await self.pool.take()
        except OSError:
            self.conn.reset_stream(stream_id)
            await self.flush()
            return
        try:
            method, target = headers.pop(0)[1], headers.pop(0)[1]
            out = backend.conn.send(h11.Request(method=method, target=target, headers=headers))
            if body:
                out = (out or b"") + (backend.conn.send(h11.Data(data=body)) or b"")
            out = (out or b"") + (backend.conn.send(h11.EndOfMessage()) or b"")
            await backend.stream.send_all(out)
            finished = False
            while not finished:
                for event in await backend.next_events():
                    if isinstance(event, h11.Response):
                        fields = [(b":status", str(event.status_code).encode())]
                        fields += [(k, v) for k, v in event.headers if k not in HOP_BY_HOP]
                        self.conn.send_headers(stream_id, fields)
                    elif isinstance(event, h11.Data):
                        await self.send_data(stream_id, bytes(event.data))
                    elif isinstance(event, h11.EndOfMessage):
                        self.conn.end_stream(stream_id)
                        finished = True
                await self.flush()
        except h2.exceptions.StreamClosedError:
            pass  # the client reset the stream; the connection goes on
        except PEER_ERRORS:
            pass
        finally:
            # Back to the pool only between two whole exchanges (also after a reset stream
            # whose answer was read whole); otherwise closed, also when cancelled.
            if backend.reusable():
                self.pool.give_back(backend)
            else:
                backend.stream.socket.close()

    async def send_data(self, stream_id: int, data: bytes) -> None:
        """RFC 9113 §6.9: never more than the peer's window allows; wait for it to open."""
        while data:
            window = min(
                self.conn.local_flow_control_window(stream_id), self.conn.max_outbound_frame_size
            )
            if window <= 0:
                opened = self.window_opened
                await self.flush()
                await opened.wait()
                continue
            self.conn.send_data(stream_id, data[:window])
            data = data[window:]


def h1_request_headers(fields: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The h2 request's fields as h1: (":method", m), (":path", p) first, then ``host`` from
    ``:authority`` (RFC 9113 §8.3.1), then the regular fields."""
    pseudo = {k: v for k, v in fields if k.startswith(b":")}
    out = [(b":method", pseudo.get(b":method", b"GET")), (b":path", pseudo.get(b":path", b"/"))]
    authority = pseudo.get(b":authority")
    if authority is not None:
        out.append((b"host", authority))
    out += [(k, v) for k, v in fields if not k.startswith(b":")]
    return out


async def serve_h2(client: trio.SocketStream, pool: Pool) -> None:
    nodelay(client)
    try:
        await H2Client(client, pool).run()
    except PEER_ERRORS:
        pass
    finally:
        await client.aclose()


async def main(args: argparse.Namespace) -> None:
    lhost, _, lport = args.listen.rpartition(":")
    uhost, _, uport = args.upstream.rpartition(":")
    listeners = await trio.open_tcp_listeners(int(lport), host=lhost, backlog=4096)
    print("ready", flush=True)
    pool = Pool(uhost, int(uport))

    async def handle(client: trio.SocketStream) -> None:
        if args.proto == "h1":
            await serve_h1(client, uhost, int(uport))
        else:
            await serve_h2(client, pool)

    await trio.serve_listeners(handle, listeners)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proto", choices=("h1", "h2"), required=True, help="client protocol")
    parser.add_argument("--listen", required=True, metavar="HOST:PORT")
    parser.add_argument("--upstream", required=True, metavar="HOST:PORT")
    return parser.parse_args()


if __name__ == "__main__":
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        trio.run(main, parse_args())
    except* KeyboardInterrupt:
        pass

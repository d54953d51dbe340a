"""A bare Trio TCP byte relay: the floor of muxproxy's stack (Trio + Python), no HTTP at all.

Each accepted connection gets its own connection to the upstream and two tasks, one per
direction, each looping ``receive_some`` -> ``send_all``; TCP_NODELAY on both sockets. When one
direction ends, the other side's write half is closed (or the pair is closed on an error).

With ``--epoll`` it is the floor of muxproxy's reactor design instead (``muxproxy/trio/
reactor.py``): the relayed sockets sit in one epoll set that Trio waits on, and one task moves
the bytes of every ready socket per wake-up (``recv``, then ``send`` to the other side at once;
what the other side does not take waits for ``EPOLLOUT`` while the source is not read). Still
no HTTP at all. ``--work-us N`` makes it spend N µs of CPU on every read before relaying it,
standing in for the HTTP work a proxy does per token: the tail latency of this design as a
function of that work alone.

Usage: ``python bench/trio_relay.py --listen 127.0.0.1:8002 --upstream 127.0.0.1:8001``
(prints ``ready`` once listening; Ctrl-C / SIGINT ends it).
"""

from __future__ import annotations

import argparse
import resource
import select
import socket
import time

import trio

READ_SIZE = 64 * 1024


def nodelay(stream: trio.SocketStream) -> None:
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)


async def pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
    try:
        while True:
            data = await src.receive_some(READ_SIZE)
            if not data:
                break
            await dst.send_all(data)
        await dst.send_eof()
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        await src.aclose()
        await dst.aclose()


async def handle(client: trio.SocketStream, host: str, port: int) -> None:
    nodelay(client)
    try:
        upstream = await trio.open_tcp_stream(host, port)
    except OSError:
        await client.aclose()
        return
    nodelay(upstream)
    async with client, upstream, trio.open_nursery() as nursery:
        nursery.start_soon(pump, client, upstream)
        nursery.start_soon(pump, upstream, client)


class Side:
    """One socket of a relayed pair, in the epoll relay."""

    __slots__ = ("peer", "pending", "sock")

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.peer: Side | None = None
        self.pending = b""
        """Bytes read from ``peer`` that this socket did not take yet."""


def spin(seconds: float) -> None:
    """Use ``seconds`` of this thread's CPU time (time the process has no CPU does not count)."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


class EpollRelay:
    def __init__(self, work: float = 0.0) -> None:
        self.work = work
        """CPU seconds spent on each read before its bytes are relayed (``--work-us``)."""
        self.epoll = select.epoll()
        self.sides: dict[int, Side] = {}

    def add_pair(self, a: socket.socket, b: socket.socket) -> None:
        left, right = Side(a), Side(b)
        left.peer, right.peer = right, left
        for side in (left, right):
            self.sides[side.sock.fileno()] = side
            self.epoll.register(side.sock.fileno(), select.EPOLLIN)

    def watch(self, side: Side) -> None:
        """EPOLLIN unless the peer has bytes pending; EPOLLOUT while this side has some."""
        assert side.peer is not None
        mask = 0 if side.peer.pending else select.EPOLLIN
        if side.pending:
            mask |= select.EPOLLOUT
        self.epoll.modify(side.sock.fileno(), mask)

    def close(self, side: Side) -> None:
        for s in (side, side.peer):
            if s is not None and self.sides.pop(s.sock.fileno(), None) is not None:
                s.sock.close()

    def on_ready(self, side: Side, events: int) -> None:
        peer = side.peer
        assert peer is not None
        try:
            if events & select.EPOLLOUT and side.pending:
                sent = side.sock.send(side.pending)
                side.pending = side.pending[sent:]
                if not side.pending:
                    self.watch(side)
                    self.watch(peer)
            if events & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) and not peer.pending:
                data = side.sock.recv(READ_SIZE)
                if not data:
                    self.close(side)
                    return
                if self.work:
                    spin(self.work)
                try:
                    sent = peer.sock.send(data)
                except BlockingIOError:
                    sent = 0
                if sent < len(data):
                    peer.pending = data[sent:]
                    self.watch(peer)
                    self.watch(side)
        except BlockingIOError:
            pass
        except OSError:
            self.close(side)

    async def run(self) -> None:
        fileno = self.epoll.fileno()
        while True:
            await trio.lowlevel.wait_readable(fileno)
            for fd, events in self.epoll.poll(0):
                side = self.sides.get(fd)
                if side is not None:
                    self.on_ready(side, events)


async def serve_epoll(
    listeners: list[trio.SocketListener], host: str, port: int, work: float
) -> None:
    relay = EpollRelay(work)

    async def accept_loop(listener: trio.SocketListener) -> None:
        while True:
            client = await listener.accept()
            try:
                upstream = await trio.open_tcp_stream(host, port)
            except OSError:
                await client.aclose()
                continue
            pair = []
            for stream in (client, upstream):
                nodelay(stream)
                sock = stream.socket
                kind = (sock.family, sock.type, sock.proto)
                pair.append(socket.socket(*kind, fileno=sock.detach()))
            relay.add_pair(pair[0], pair[1])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.run)
        for listener in listeners:
            nursery.start_soon(accept_loop, listener)


async def main(args: argparse.Namespace) -> None:
    lhost, _, lport = args.listen.rpartition(":")
    uhost, _, uport = args.upstream.rpartition(":")
    listeners = await trio.open_tcp_listeners(int(lport), host=lhost, backlog=4096)
    print("ready", flush=True)
    if args.epoll:
        await serve_epoll(listeners, uhost, int(uport), args.work_us / 1e6)
    else:
        await trio.serve_listeners(lambda stream: handle(stream, uhost, int(uport)), listeners)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, metavar="HOST:PORT")
    parser.add_argument("--upstream", required=True, metavar="HOST:PORT")
    parser.add_argument(
        "--epoll", action="store_true", help="one task and one epoll set for every socket"
    )
    parser.add_argument(
        "--work-us",
        type=float,
        default=0.0,
        help="with --epoll: µs of CPU spent on every read before relaying it",
    )
    return parser.parse_args()


if __name__ == "__main__":
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        trio.run(main, parse_args())
    except* KeyboardInterrupt:
        pass

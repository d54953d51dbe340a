"""A bare Trio TCP byte relay: the floor of muxproxy's stack (Trio + Python), no HTTP at all.

Each accepted connection gets its own connection to the upstream and two tasks, one per
direction, each looping ``receive_some`` -> ``send_all``; TCP_NODELAY on both sockets. When one
direction ends, the other side's write half is closed (or the pair is closed on an error).

Usage: ``python bench/trio_relay.py --listen 127.0.0.1:8002 --upstream 127.0.0.1:8001``
(prints ``ready`` once listening; Ctrl-C / SIGINT ends it).
"""

from __future__ import annotations

import argparse
import resource
import socket

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


async def main(args: argparse.Namespace) -> None:
    lhost, _, lport = args.listen.rpartition(":")
    uhost, _, uport = args.upstream.rpartition(":")
    listeners = await trio.open_tcp_listeners(int(lport), host=lhost, backlog=4096)
    print("ready", flush=True)
    await trio.serve_listeners(lambda stream: handle(stream, uhost, int(uport)), listeners)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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

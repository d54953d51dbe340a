"""TTFB with and without the fleet store: what a budget's reservation in Redis costs a request.

Two ``python -m muxproxy serve`` processes in front of one fake LLM backend (in this process)
on loopback, with the same tenant budget (``rate_limit``, large enough never to refuse):
one enforces it in the process, one fleet-wide through a ``redis-server`` started here
(``[fleet] store``: one ``EVALSHA`` per request before it is sent). Requests go one at a
time, alternating between the two, over kept-alive HTTP/1.1 connections; TTFB is from the
request's first byte sent to the response head's first byte read (the backend answers at
once, so the proxy's own time is what differs). Prints the medians side by side::

    python bench/fleet_ttfb.py [--requests 500]

Needs ``redis-server`` on the PATH. Takes well under two minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h11
import trio

from muxproxy.testing.fakellm import FakeLLM, serve_fakellm

BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
     "stream": True}
).encode()  # fmt: skip
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\nauthorization: Bearer t\r\n"
    b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY)
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def config(directory: Path, name: str, backend: int, store: str | None) -> tuple[Path, int]:
    port = free_port()
    text = (
        f'[[listeners]]\naddress = "127.0.0.1:{port}"\n'
        f'[upstreams.gpus]\nservers = ["127.0.0.1:{backend}"]\n'
        'tenant = "header:authorization"\n'
        "[upstreams.gpus.rate_limit]\ntokens_per_minute = 1000000000\nmax_concurrent = 1000\n"
    )
    if store is not None:
        text += f'[fleet]\nstore = "{store}"\n'
    path = directory / f"{name}.toml"
    path.write_text(text)
    return path, port


async def ttfb(stream: trio.SocketStream, conn: h11.Connection) -> float:
    """One request's time to the response's first byte; reads the whole response."""
    began = time.perf_counter()
    await stream.send_all(REQUEST)
    data = await stream.receive_some(65536)
    first = time.perf_counter() - began
    conn.receive_data(data)
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            more = await stream.receive_some(65536)
            assert more, "the proxy closed the connection"
            conn.receive_data(more)
        elif isinstance(event, h11.Response):
            assert event.status_code == 200, event
        elif isinstance(event, h11.EndOfMessage):
            conn.start_next_cycle()
            _client_sent(conn)
            return first


def _client() -> h11.Connection:
    """A client-side h11 parser; the request's bytes are sent as they are (``REQUEST``)."""
    conn = h11.Connection(h11.CLIENT)
    _client_sent(conn)
    return conn


def _client_sent(conn: h11.Connection) -> None:
    """The next request is on its way, as far as the parser is concerned."""
    headers = [("host", "bench"), ("content-length", str(len(BODY)))]
    conn.send(h11.Request(method="POST", target="/v1/chat/completions", headers=headers))
    conn.send(h11.Data(data=BODY))
    conn.send(h11.EndOfMessage())


async def wait_listening(port: int) -> trio.SocketStream:
    with trio.fail_after(30):
        while True:
            try:
                return await trio.open_tcp_stream("127.0.0.1", port)
            except OSError:
                await trio.sleep(0.05)


async def run(requests: int) -> dict[str, float]:
    redis_port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        redis = subprocess.Popen(
            ["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"],
            cwd=tmp,
            stdout=subprocess.DEVNULL,
        )
        procs: list[subprocess.Popen[bytes]] = [redis]
        try:
            async with trio.open_nursery() as nursery:
                fake = FakeLLM(tokens=4, delay=0.0)
                backend = await nursery.start(serve_fakellm, fake)
                ports = {}
                for name, store in (
                    ("local", None),
                    ("store", f"redis://127.0.0.1:{redis_port}"),
                ):
                    path, ports[name] = config(directory, name, backend, store)
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "muxproxy", "serve", "--config", str(path)],
                            env={**os.environ, "MUXPROXY_RAISE_ERRORS": "1"},
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                        )
                    )
                streams = {name: await wait_listening(port) for name, port in ports.items()}
                times: dict[str, list[float]] = {name: [] for name in streams}
                peers = {name: _client() for name in streams}
                for name, stream in streams.items():  # warm up: connections, scripts loaded
                    for _ in range(20):
                        await ttfb(stream, peers[name])
                for _ in range(requests):
                    for name, stream in streams.items():
                        times[name].append(await ttfb(stream, peers[name]))
                nursery.cancel_scope.cancel()
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=10)
    return {name: statistics.median(values) * 1000 for name, values in times.items()} | {
        f"{name}_p90": statistics.quantiles(values, n=10)[-1] * 1000
        for name, values in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        sys.exit("fleet_ttfb: redis-server is not on the PATH")
    result = trio.run(run, args.requests)
    print(f"requests per variant: {args.requests} (sequential, kept-alive HTTP/1.1, loopback)")
    print(f"{'':14}{'median ms':>10}{'p90 ms':>10}")
    for name, label in (("local", "budget local"), ("store", "fleet store")):
        print(f"{label:14}{result[name]:>10.3f}{result[name + '_p90']:>10.3f}")
    print(f"added by the store (median): {result['store'] - result['local']:.3f} ms")


if __name__ == "__main__":
    main()

"""muxproxy with a once-a-second monitor line: event-loop lag, exchanges by phase, backpressure.

A diagnostic for load tests, not part of the benchmark table. It runs the same
``ProxyServer`` as ``muxproxy serve --listen A --upstream B`` in this process and prints one
JSON line per second::

    python bench/proxy_monitor.py --listen 127.0.0.1:8000 --upstream 127.0.0.1:8001

Fields: ``lag_s`` (how late a 1 s ``trio.sleep`` woke up: the event loop's backlog), ``cpu_s``
(CPU used in that second), client / upstream connections, connects in flight, exchanges by
phase, exchanges whose backend reading is paused, and ``buffered_per_client_kib`` (the largest
response backlog of one client connection: unsent bytes plus HTTP/2 send queues).
With ``--access-log``, the core's access log lines (status, outcome, durations) go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from collections import Counter

import trio

from muxproxy.config import quick_config
from muxproxy.trio.server import ProxyServer


async def monitor(server: ProxyServer) -> None:
    while True:
        t0 = time.monotonic()
        c0 = time.process_time()
        await trio.sleep(1)
        lag = time.monotonic() - t0 - 1
        stats = server.core.statistics()
        per_client: dict[int, int] = {}
        for s in stats.streams:
            # For HTTP/2 every stream of a connection reports the connection's unsent bytes plus
            # its own queue: take the largest, which is at least the connection's backlog.
            per_client[s.conn] = max(per_client.get(s.conn, 0), s.response_buffered)
        driver = server.driver
        line = {
            "t": round(time.monotonic(), 2),
            "lag_s": round(lag, 3),
            "cpu_s": round(time.process_time() - c0, 2),
            "clients": stats.client_connections,
            "upstreams": stats.upstream_connections,
            "connecting": len(driver.connecting) if driver is not None else None,
            "phases": dict(Counter(s.phase for s in stats.streams)),
            "upstream_paused": sum(1 for s in stats.streams if s.upstream_paused),
            "buffered_per_client_kib": max(per_client.values(), default=0) // 1024,
        }
        print(json.dumps(line), flush=True)


async def main(args: argparse.Namespace) -> None:
    server = ProxyServer(quick_config(args.listen, args.upstream))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        nursery.start_soon(monitor, server)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, metavar="HOST:PORT")
    parser.add_argument("--upstream", action="append", required=True, metavar="HOST:PORT")
    parser.add_argument("--access-log", action="store_true")
    args = parser.parse_args()
    if args.access_log:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        trio.run(main, args)
    except* KeyboardInterrupt:
        pass

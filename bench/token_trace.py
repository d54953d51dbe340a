"""Where a token's time inside muxproxy goes, from the kernel's receive timestamps.

Runs ``muxproxy`` (the package of the working directory, like ``python -m muxproxy``) with its
reactor instrumented. Every backend socket the reactor connects gets ``SO_TIMESTAMPNS``, so each
read of a backend knows when the kernel had its bytes; the reactor's rounds and writes are timed
around it. The time from the kernel's receive to the end of the ``send`` to the client is split
into:

- **wait for the round**: kernel receive -> the start of the round that read it. The loop was
  asleep and waking up, or busy with an earlier round, or the process had no CPU;
- **before its read**: the start of that round -> its ``recv``: the other ready sockets the
  round served first;
- **own**: its ``recv`` -> the end of the first ``send`` after it (its client's, at paced load
  with one kind of client): muxproxy's work for this read, and for an HTTP/2 client the wait
  for the end of the round, where its streams share one ``send``.

The rounds are counted too, with the backend reads each served and the ``send`` calls that
wrote to clients: for an HTTP/2 client whose streams share one ``send`` per round, the reads
per client send is how much the round batched, which sets the syscalls per token.

Every collection of the cyclic garbage collector is timed too (``gc.callbacks``). At exit
(SIGINT) a JSON summary goes to ``--out``; reads in the first ``--skip`` seconds after the
first one (the ramp) are left out. The instrumentation costs a few µs per read.

    python bench/token_trace.py --out trace.json serve --listen 127.0.0.1:8080 --upstream ...
    python bench/sse_bench.py --streams 100 --variants muxproxy-h1 --trace   # one stream count
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
ANCILLARY = socket.CMSG_SPACE(16)


class Trace:
    def __init__(self) -> None:
        self.reads: list[tuple[float, float, float, float]] = []
        """Per backend read: kernel receive, round start, recv done, client send done."""
        self.unsent: list[tuple[float, float, float]] = []
        self.round_start = 0.0
        self.round_reads: list[int] = []
        """Backend reads (with data) of each round."""
        self.client_sends = 0
        """``send`` calls that wrote to a client (a socket that is not a backend's)."""
        self.collections: list[tuple[int, float, float]] = []
        """Per collection: its generation, when it ended, how long it took."""
        self._gc_start = 0.0

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.time()
        else:
            now = time.time()
            self.collections.append((info["generation"], now, now - self._gc_start))


TRACE = Trace()


class TimedSocket(socket.socket):
    """A backend socket whose ``recv`` notes the kernel's receive time of what it read."""

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        data, ancillary, _, _ = self.recvmsg(bufsize, ANCILLARY, flags)
        if data:
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    sec, nsec = struct.unpack("qq", payload[:16])
                    TRACE.unsent.append((sec + nsec / 1e9, TRACE.round_start, time.time()))
            if TRACE.round_reads:
                TRACE.round_reads[-1] += 1
        return data


def instrument() -> None:
    from muxproxy.trio.reactor import Reactor

    connect, serve_round, flush = Reactor.connect, Reactor._serve_round, Reactor._flush

    def timed_connect(self: Reactor, ident: int, host: str, port: int) -> Any:
        conn = connect(self, ident, host, port)
        conn.sock = TimedSocket(fileno=conn.sock.detach())
        conn.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        return conn

    def timed_round(self: Reactor, *args: Any) -> int:
        TRACE.round_start = time.time()
        TRACE.round_reads.append(0)
        return serve_round(self, *args)

    def timed_flush(self: Reactor, conn: Any) -> None:
        before = len(conn.pending)
        flush(self, conn)
        if len(conn.pending) < before and not isinstance(conn.sock, TimedSocket):
            TRACE.client_sends += 1
        if TRACE.unsent:
            done = time.time()
            TRACE.reads.extend((*read, done) for read in TRACE.unsent)
            TRACE.unsent.clear()

    Reactor.connect = timed_connect  # type: ignore[method-assign]
    Reactor._serve_round = timed_round  # type: ignore[method-assign]
    Reactor._flush = timed_flush  # type: ignore[method-assign]
    gc.callbacks.append(TRACE.on_gc)


def quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summary(skip: float) -> dict[str, Any]:
    reads = TRACE.reads
    since = reads[0][0] + skip if reads else 0.0
    reads = [r for r in reads if r[0] > since]
    parts: list[tuple[float, float, float, float]] = []
    for rx, round_start, read_at, sent in reads:
        start = max(rx, round_start)  # a read that arrived during the round waited for nothing
        ms = (sent - rx, start - rx, read_at - start, sent - read_at)
        parts.append((ms[0] * 1e3, ms[1] * 1e3, ms[2] * 1e3, ms[3] * 1e3))
    parts.sort()
    worst = parts[-max(1, len(parts) // 100) :]

    def split(rows: list[tuple[float, float, float, float]]) -> dict[str, float]:
        names = ("total", "wait for the round", "before its read", "own")
        if not rows:
            return {}
        return {name: sum(r[i] for r in rows) / len(rows) for i, name in enumerate(names)}

    totals = [p[0] for p in parts]
    collections: dict[str, dict[str, float]] = {}
    for generation, ended, seconds in TRACE.collections:
        if ended < since:
            continue
        entry = collections.setdefault(
            f"gen{generation}", {"count": 0, "max_ms": 0.0, "total_ms": 0.0}
        )
        entry["count"] += 1
        entry["max_ms"] = max(entry["max_ms"], seconds * 1e3)
        entry["total_ms"] += seconds * 1e3
    rounds = sorted(n for n in TRACE.round_reads if n)
    all_reads = sum(rounds)
    return {
        "reads": len(parts),
        "rounds_with_reads": len(rounds),
        "reads_per_round": {
            "mean": all_reads / len(rounds) if rounds else 0.0,
            **{f"p{q * 100:g}": quantile([float(n) for n in rounds], q) for q in (0.5, 0.9, 0.99)},
        },
        "client_sends": TRACE.client_sends,
        "reads_per_client_send": all_reads / TRACE.client_sends if TRACE.client_sends else 0.0,
        "total_ms": {f"p{q * 100:g}": quantile(totals, q) for q in (0.5, 0.9, 0.99, 0.999)},
        "mean_ms": split(parts),
        "worst_1pct_mean_ms": split(worst),
        "gc": collections,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where the JSON summary goes")
    parser.add_argument("--skip", type=float, default=2.0, help="seconds of reads left out")
    args, rest = parser.parse_known_args()
    sys.path.insert(0, os.getcwd())
    instrument()
    atexit.register(lambda: args.out.write_text(json.dumps(summary(args.skip), indent=1)))
    from muxproxy.process.cli import main as muxproxy_main

    raise SystemExit(muxproxy_main(rest))


if __name__ == "__main__":
    main()

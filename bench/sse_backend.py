"""A minimal, efficient SSE backend for the benchmarks (asyncio, raw protocols, no framework).

One process, one event loop. It speaks just enough HTTP/1.1 for the requests the bench client
sends (GET, no body, keep-alive) and answers every request with a chunked ``text/event-stream``
response. Each SSE event is one chunk carrying the backend's send time::

    data: {"t":<time.monotonic_ns() at write>,"i":<seq>,"id":"chatcmpl-bench",...}\\n\\n

CLOCK_MONOTONIC is system-wide, so a client on the same machine can compute arrival - ``t``.

Pacing: one shared ticker. A stream is put in one of ``--slots`` phase slots (round robin) when
it starts; every ``interval / slots`` the ticker writes one event to every stream of the next
slot, so each stream gets one event per ``--interval-ms`` and the writes are spread evenly over
the interval (``--slots 1``: every stream in the same tick, like a batched decode step). If the
ticker falls behind it catches up slot by slot (and the counters show it).

Request targets (query parameters, all optional):

* ``/sse`` or ``/sse?n=0``: events forever, first one at once (with the head).
* ``/sse?n=K``: K events (the first at once), then the final chunk; the connection stays open.
* ``/sse?idle=1``: the head and one SSE comment, then nothing but a comment every ``--hb`` s.
* ``/sse?burst=K``: saturation: no pacing, events back to back for as long as the client reads,
  K events (K chunks) per ``write``, as fast as the socket takes them (the writes stop while
  the transport's buffer is above its high-water mark and go on when it drains). The K events
  of one write are the same bytes: one send time stamp ``t`` (and ``i``) per write.
* ``POST /v1/chat/completions`` (a JSON body with Content-Length, like an OpenAI client):
  the shape of an LLM server for ``llm_load.py``. The backend waits ``"bench_ttft_ms"`` (time to
  first token), then streams ``"max_tokens"`` events paced by the ticker (one per
  ``--interval-ms``), then ``data: [DONE]`` and the final chunk; the connection stays open.
  Without those fields: a TTFT of 50-200 ms and 20-400 tokens, random with ``--seed``.
* ``/stats``: JSON counters (events written, ticks late, open streams) with Content-Length.

Usage: ``python bench/sse_backend.py --port 8001`` (prints ``ready`` once listening).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import resource
import signal
import socket
import sys
import time

HEAD = (
    b"HTTP/1.1 200 OK\r\n"
    b"content-type: text/event-stream\r\n"
    b"cache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n"
    b"\r\n"
)
# About the size of an OpenAI chat.completion.chunk carrying one token.
EVENT = (
    b'data: {"t":%d,"i":%d,"id":"chatcmpl-bench","object":"chat.completion.chunk",'
    b'"model":"bench","choices":[{"index":0,"delta":{"content":" token"},'
    b'"finish_reason":null}]}\n\n'
)
COMMENT_CHUNK = b": keep-alive\n\n"
COMMENT_CHUNK = b"%x\r\n%s\r\n" % (len(COMMENT_CHUNK), COMMENT_CHUNK)
END_CHUNK = b"0\r\n\r\n"
DONE_END = b"e\r\ndata: [DONE]\n\n\r\n" + END_CHUNK
BURST_ROUNDS = 64
"""A burst stream yields to the event loop after this many writes that did not fill the socket."""
BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"

monotonic_ns = time.monotonic_ns


class Stats:
    events = 0
    requests = 0
    late_ticks = 0
    max_lag_ms = 0.0
    streams = 0
    paused_skips = 0
    chat_requests = 0


class Backend:
    def __init__(self, interval_ms: float, slots: int, hb: float, seed: int) -> None:
        self.interval = interval_ms / 1000.0
        self.nslots = max(1, slots)
        self.slots: list[dict[SSEConnection, None]] = [{} for _ in range(self.nslots)]
        self.next_slot = 0
        self.tick_no = 0
        """The ticker's last tick: its slot is the one visited again a whole interval later."""
        self.hb = hb
        self.idle: dict[SSEConnection, None] = {}
        self.rng = random.Random(seed)

    def add(self, conn: SSEConnection, now: bool = False) -> None:
        """Pace ``conn``: round robin over the slots, or (``now``) its next event one interval
        after the event it has just been sent."""
        if now:
            slot = self.slots[self.tick_no % self.nslots]
        else:
            slot = self.slots[self.next_slot]
            self.next_slot = (self.next_slot + 1) % self.nslots
        slot[conn] = None
        conn.slot = slot
        Stats.streams += 1

    def remove(self, conn: SSEConnection) -> None:
        slot = conn.slot
        if slot is not None:
            conn.slot = None
            slot.pop(conn, None)
            Stats.streams -= 1
        self.idle.pop(conn, None)

    async def ticker(self) -> None:
        tick = self.interval / self.nslots
        start = time.monotonic()
        k = 0
        nslots = self.nslots
        slots = self.slots
        while True:
            k += 1
            target = start + k * tick
            delay = target - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                lag = -delay * 1000.0
                if lag > 1.0:
                    Stats.late_ticks += 1
                    if lag > Stats.max_lag_ms:
                        Stats.max_lag_ms = lag
                await asyncio.sleep(0)
            self.tick_no = k
            slot = slots[k % nslots]
            if slot:
                for conn in list(slot):
                    conn.tick()

    async def heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.hb)
            for conn in list(self.idle):
                conn.write(COMMENT_CHUNK)


class SSEConnection(asyncio.Protocol):
    backend: Backend

    __slots__ = ("buf", "burst", "end", "i", "n", "paused", "slot", "streaming", "transport")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.streaming = False
        self.slot: dict[SSEConnection, None] | None = None
        self.i = 0
        self.n = 0
        self.paused = False
        self.burst = 0
        self.end = END_CHUNK
        """What follows the last event of a response of ``n`` events."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.backend.remove(self)
        self.transport = None

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.burst:
            self.pump()

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._parse()

    def _parse(self) -> None:
        while not self.streaming:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > 65536 and self.transport is not None:
                    self.transport.close()
                return
            line, _, fields = self.buf[:end].partition(b"\r\n")
            try:
                method, target, _version = line.split(b" ", 2)
                length = body_length(fields) if method == b"POST" else 0
            except ValueError:
                self.write(BAD_REQUEST)
                if self.transport is not None:
                    self.transport.close()
                return
            if len(self.buf) < end + 4 + length:
                return  # the rest of the body is still on its way
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            self._request(target, body)

    def _request(self, target: bytes, body: bytes) -> None:
        Stats.requests += 1
        path, _, query = target.partition(b"?")
        if path == b"/v1/chat/completions":
            self._chat(body)
            return
        params = dict(p.partition(b"=")[::2] for p in query.split(b"&") if p)
        if path == b"/stats":
            body = json.dumps(stats_dict()).encode()
            self.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            return
        if params.get(b"idle") == b"1":
            self.streaming = True
            self.write(HEAD + COMMENT_CHUNK)
            self.backend.idle[self] = None
            return
        if params.get(b"burst"):
            self.streaming = True
            self.burst = max(1, int(params[b"burst"]))
            self.write(HEAD)
            self.pump()
            return
        self.n = int(params.get(b"n", b"0") or b"0")
        self.streaming = True
        self._first_event(now=False)  # n == 1: _parse() goes on with any pipelined request

    def _chat(self, body: bytes) -> None:
        """An OpenAI-style streamed chat completion: the first token after a TTFT, then paced."""
        Stats.chat_requests += 1
        try:
            req = json.loads(body) if body else {}
        except ValueError:
            req = {}
        rng = self.backend.rng
        ttft = req.get("bench_ttft_ms")
        ttft = rng.uniform(50.0, 200.0) if ttft is None else float(ttft)
        self.n = max(1, int(req.get("max_tokens") or rng.randint(20, 400)))
        self.end = DONE_END
        self.streaming = True
        asyncio.get_running_loop().call_later(ttft / 1000.0, self._first_token)

    def _first_token(self) -> None:
        if self.transport is not None:
            self._first_event(now=True)
            if not self.streaming and self.buf:
                self._parse()

    def _first_event(self, now: bool) -> None:
        """The head and the first event; then the ticker paces the rest (``Backend.add``), or
        with ``n == 1`` the response ends here."""
        self.i = 1
        event = EVENT % (monotonic_ns(), 1)
        Stats.events += 1
        if self.n == 1:
            self.write(b"%s%x\r\n%s\r\n%s" % (HEAD, len(event), event, self.end))
            self.streaming = False
            self.end = END_CHUNK
            return
        self.write(b"%s%x\r\n%s\r\n" % (HEAD, len(event), event))
        self.backend.add(self, now=now)

    def pump(self) -> None:
        """Burst stream: write ``burst`` events at a time until the transport pushes back."""
        transport = self.transport
        if transport is None:
            return
        k = self.burst
        for _ in range(BURST_ROUNDS):
            if self.paused or transport.is_closing():
                return
            self.i += k
            event = EVENT % (monotonic_ns(), self.i)
            transport.write((b"%x\r\n%s\r\n" % (len(event), event)) * k)
            Stats.events += k
        # The socket takes everything: let the other connections (and /stats) have a turn.
        asyncio.get_running_loop().call_soon(self.pump)

    def tick(self) -> None:
        transport = self.transport
        if transport is None:
            return
        if self.paused:
            # The peer does not read: skip instead of buffering without bound.
            Stats.paused_skips += 1
            return
        self.i += 1
        event = EVENT % (monotonic_ns(), self.i)
        Stats.events += 1
        if self.n and self.i >= self.n:
            transport.write(b"%x\r\n%s\r\n%s" % (len(event), event, self.end))
            self.backend.remove(self)
            self.streaming = False
            self.end = END_CHUNK
            if self.buf:
                self._parse()
        else:
            transport.write(b"%x\r\n%s\r\n" % (len(event), event))


def body_length(fields: bytes) -> int:
    """Content-Length of a request head (0 without one); a chunked body is refused."""
    lower = fields.lower()
    if b"transfer-encoding:" in lower:
        raise ValueError("chunked request bodies are not supported")
    i = lower.find(b"content-length:")
    if i < 0:
        return 0
    j = lower.find(b"\r\n", i)
    return int(lower[i + 15 : j if j >= 0 else None])


def stats_dict() -> dict[str, float]:
    t = os.times()
    return {
        "events": Stats.events,
        "requests": Stats.requests,
        "late_ticks": Stats.late_ticks,
        "max_lag_ms": round(Stats.max_lag_ms, 3),
        "streams": Stats.streams,
        "paused_skips": Stats.paused_skips,
        "chat_requests": Stats.chat_requests,
        "cpu_s": t.user + t.system,
        "monotonic": time.monotonic(),
    }


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def main(args: argparse.Namespace) -> None:
    backend = Backend(args.interval_ms, args.slots, args.hb, args.seed)
    SSEConnection.backend = backend
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        SSEConnection, args.host, args.port, backlog=4096, reuse_address=True
    )
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(backend.ticker()), asyncio.create_task(backend.heartbeats())]
    print("ready", flush=True)
    try:
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        server.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--interval-ms", type=float, default=20.0, help="per-stream event period")
    parser.add_argument("--slots", type=int, default=10, help="phase slots per interval")
    parser.add_argument("--hb", type=float, default=15.0, help="idle-stream heartbeat period (s)")
    parser.add_argument("--seed", type=int, default=0, help="chat requests without bench fields")
    return parser.parse_args(argv)


if __name__ == "__main__":
    raise_nofile()
    gc.freeze()
    try:
        asyncio.run(main(parse_args()))
    except KeyboardInterrupt:
        pass
    sys.exit(0)

"""The SSE load client of the benchmark: asyncio protocols, HTTP/1.1 by hand, HTTP/2 with ``h2``.

One run is one measurement against one target (the backend itself, or a proxy in front of it),
and prints one JSON object on stdout. Three modes:

``--mode load``
    Open ``--streams`` endless SSE streams (``GET /sse``; HTTP/1.1: one connection per stream;
    HTTP/2: ``--h2-per-conn`` streams per connection), wait until each got its first event,
    warm up for ``--warmup`` s, then measure for ``--duration`` s: events received, the latency
    of every event (arrival ``time.monotonic_ns()`` minus the send time the backend wrote into
    it), per-stream progress, the CPU time of the processes given with ``--pid`` (from
    ``/proc/PID/stat``), our own CPU time, and the backend's counters (``/stats``). During the
    window a separate keep-alive connection sends one short request (``/sse?n=1``) every
    ``--probe-interval`` s and records its time to first byte: request written -> first event.

``--mode idle``
    Measure the RSS of the ``--pid proxy=`` processes, open ``--streams`` idle SSE streams
    (head and one comment, then nothing), wait until all are established and ``--settle`` s
    more, measure again, and report the difference per stream.

``--mode saturation``
    Open ``--streams`` streams of back-to-back events (``GET /sse?burst=K``: the backend writes
    ``--burst`` events per write, as fast as the socket takes them), warm up, and count the
    events received in the window: occurrences of ``data: `` in the raw bytes (``bytes.count``,
    no chunk or JSON parsing; HTTP/2 frames are split by hand, without ``h2``'s event objects),
    plus the same CPU figures as ``load``. The result is the relay's throughput when nothing
    but the proxy (or the backend, or this client: see their CPU) limits it.

Not a general HTTP client: it expects what ``sse_backend.py`` sends (200, chunked, events
carrying ``"t":``), through whichever proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import socket
import subprocess
import sys
import time
from array import array
from collections import Counter
from collections.abc import Callable

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import hpack

monotonic_ns = time.monotonic_ns
READ_SIZE = 64 * 1024
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- measurement state ----------------------------------------------------------------------


class Rec:
    measuring = False
    events = 0
    """Events received on load streams (any time)."""
    latencies = array("q")
    """Latency (ns) of each load-stream event received inside the window."""
    errors: Counter[str] = Counter()


# --- stream state (shared by HTTP/1.1 and HTTP/2) -------------------------------------------


class Stream:
    """One SSE response: buffered body, events counted, first-event and end futures."""

    __slots__ = ("count", "done", "first", "kind", "sse", "t_first", "t_req")

    def __init__(self, kind: str) -> None:
        loop = asyncio.get_running_loop()
        self.kind = kind  # "load", "idle" or "probe"
        self.sse = bytearray()
        self.count = 0
        self.first: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        self.t_req = monotonic_ns()
        self.t_first = 0

    def body(self, data: bytes | bytearray, now: int) -> None:
        sse = self.sse
        sse += data
        pos = 0
        find = sse.find
        load = self.kind == "load"
        n = 0
        while True:
            end = find(b"\n\n", pos)
            if end < 0:
                break
            if load:
                k = find(b'"t":', pos, end)
                if k >= 0:
                    n += 1
                    if Rec.measuring:
                        Rec.latencies.append(now - int(sse[k + 4 : find(b",", k, end)]))
            else:
                n += 1
            pos = end + 2
        if pos:
            del sse[:pos]
        if n:
            self.count += n
            if load:
                Rec.events += n
            if not self.first.done():
                self.t_first = now
                self.first.set_result(None)

    def end(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def fail(self, why: str) -> None:
        Rec.errors[f"{self.kind}: {why}"] += 1
        for fut in (self.first, self.done):
            if not fut.done():
                fut.set_exception(ConnectionError(why))


def nodelay(transport: asyncio.Transport) -> None:
    transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# --- HTTP/1.1 ------------------------------------------------------------------------------


class H1Conn(asyncio.BufferedProtocol):
    """One HTTP/1.1 connection, one request at a time (keep-alive for probes).

    A BufferedProtocol: the loop receives into one preallocated buffer (``recv_into``), which
    saves an allocation per read.
    """

    def __init__(self, authority: bytes) -> None:
        self.authority = authority
        self.rbuf = memoryview(bytearray(READ_SIZE))
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.in_body = False
        self.chunk_left = -1  # -1: expecting a size line, -2: expecting trailers / end
        self.stream: Stream | None = None
        self.closed = False
        self.reusable = True
        """False once a response said ``connection: close``."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        nodelay(transport)

    def request(
        self, path: bytes, kind: str, body: bytes | None = None, stream: Stream | None = None
    ) -> Stream:
        """Send ``GET path`` (or ``POST path`` with a JSON ``body``), read into ``stream``."""
        assert self.transport is not None and self.stream is None
        stream = self.stream = stream or Stream(kind)
        if body is None:
            self.transport.write(
                b"GET %s HTTP/1.1\r\nhost: %s\r\naccept: text/event-stream\r\n\r\n"
                % (path, self.authority)
            )
        else:
            self.transport.write(
                b"POST %s HTTP/1.1\r\nhost: %s\r\naccept: text/event-stream\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (path, self.authority, len(body), body)
            )
        return stream

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.rbuf

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self.rbuf[:nbytes])

    def data_received(self, data: bytes | memoryview) -> None:
        now = monotonic_ns()
        buf = self.buf
        buf += data
        pos = 0
        find = buf.find
        stream = self.stream
        while stream is not None:
            if not self.in_body:
                i = find(b"\r\n\r\n", pos)
                if i < 0:
                    break
                head = bytes(buf[pos:i])
                pos = i + 4
                status_line, _, fields = head.partition(b"\r\n")
                parts = status_line.split(b" ", 2)
                if len(parts) < 2 or parts[1] != b"200":
                    stream.fail(f"status {status_line.decode('latin-1')!r}")
                    self.close()
                    return
                fields = fields.lower()
                if b"chunked" not in fields:
                    stream.fail("response not chunked")
                    self.close()
                    return
                if b"connection: close" in fields:
                    self.reusable = False
                self.in_body = True
                self.chunk_left = -1
                continue
            left = self.chunk_left
            if left >= 0:
                if len(buf) - pos < left + 2:
                    break
                stream.body(buf[pos : pos + left], now)
                pos += left + 2
                self.chunk_left = -1
            elif left == -1:
                i = find(b"\r\n", pos)
                if i < 0:
                    break
                size = int(buf[pos:i].split(b";", 1)[0], 16)
                pos = i + 2
                self.chunk_left = size if size else -2
            else:
                i = find(b"\r\n", pos)
                if i < 0:
                    break
                empty = i == pos
                pos = i + 2
                if empty:  # end of the response
                    self.in_body = False
                    self.stream = None
                    stream.end()
                    stream = None
        if pos:
            del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        if self.stream is not None and not self.stream.done.done():
            self.stream.fail("connection closed by peer" if exc is None else f"lost: {exc!r}")

    def close(self) -> None:
        self.stream = None  # a close we ask for is no error
        if self.transport is not None:
            self.transport.close()


# --- HTTP/2 ----------------------------------------------------------------------------------


def h2_client() -> h2.connection.H2Connection:
    """An h2c client connection (prior knowledge), preface queued, 16 MiB stream windows."""
    config = h2.config.H2Configuration(
        client_side=True,
        header_encoding=None,
        validate_outbound_headers=False,
        normalize_outbound_headers=False,
        validate_inbound_headers=False,
        normalize_inbound_headers=False,
    )
    conn = h2.connection.H2Connection(config=config)
    conn.local_settings = h2.settings.Settings(
        client=True,
        initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 24,
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
        },
    )
    conn.initiate_connection()
    conn.increment_flow_control_window((1 << 30) - 65535)
    return conn


def send_request(
    conn: h2.connection.H2Connection, sid: int, authority: bytes, path: bytes, body: bytes | None
) -> None:
    headers = [
        (b":method", b"GET" if body is None else b"POST"),
        (b":scheme", b"http"),
        (b":authority", authority),
        (b":path", path),
        (b"accept", b"text/event-stream"),
    ]
    if body is not None:
        headers += [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    conn.send_headers(sid, headers, end_stream=body is None)
    if body is not None:
        conn.send_data(sid, body, end_stream=True)


class H2Conn(asyncio.Protocol):
    """One h2c (prior knowledge) connection carrying many streams."""

    def __init__(self, authority: bytes) -> None:
        self.authority = authority
        self.conn = h2_client()
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, Stream] = {}
        self.all_streams: list[Stream] = []
        self.closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        nodelay(transport)
        self._flush()

    def _flush(self) -> None:
        out = self.conn.data_to_send()
        if out and self.transport is not None:
            self.transport.write(out)

    def request(
        self, path: bytes, kind: str, body: bytes | None = None, stream: Stream | None = None
    ) -> Stream:
        """Open a stream: ``GET path`` (or ``POST path`` with a JSON ``body``)."""
        conn = self.conn
        sid = conn.get_next_available_stream_id()
        stream = self.streams[sid] = stream or Stream(kind)
        self.all_streams.append(stream)
        send_request(conn, sid, self.authority, path, body)
        self._flush()
        return stream

    def data_received(self, data: bytes) -> None:
        now = monotonic_ns()
        conn = self.conn
        try:
            events = conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            Rec.errors[f"h2 protocol error: {exc}"] += 1
            self.close()
            return
        streams = self.streams
        DataReceived = h2.events.DataReceived
        for event in events:
            kind = type(event)
            if kind is DataReceived:
                sid = event.stream_id
                conn.acknowledge_received_data(event.flow_controlled_length, sid)
                stream = streams.get(sid)
                if stream is not None:
                    stream.body(event.data, now)
            elif kind is h2.events.ResponseReceived:
                status = dict(event.headers).get(b":status")
                if status != b"200":
                    stream = streams.pop(event.stream_id, None)
                    if stream is not None:
                        stream.fail(f"status {status!r}")
            elif kind is h2.events.StreamEnded:
                stream = streams.pop(event.stream_id, None)
                if stream is not None:
                    if stream.kind in ("probe", "llm"):
                        stream.end()
                    else:
                        stream.fail("stream ended early")
            elif kind is h2.events.StreamReset:
                stream = streams.pop(event.stream_id, None)
                if stream is not None:
                    stream.fail(f"stream reset ({event.error_code!r})")
            elif kind is h2.events.ConnectionTerminated and not self.closing:
                Rec.errors[f"GOAWAY {event.error_code!r}"] += 1
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.closing:
            for stream in self.streams.values():
                stream.fail("h2 connection closed by peer")
        self.streams.clear()

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()


# --- saturation: counting only ------------------------------------------------------------

DATA = b"data: "
SETTINGS_ACK = b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"
WINDOW_UPDATE_EVERY = 4 << 20


def count_data(tail: bytes, data: bytes | bytearray, start: int, stop: int) -> tuple[int, bytes]:
    """``data: `` occurrences in ``data[start:stop]``, those straddling the previous piece
    (``tail``, its last 5 bytes) included; and the new tail."""
    head = tail + data[start : min(start + 5, stop)]
    n = data.count(DATA, start, stop) + head.count(DATA)
    if stop - start >= 5:
        return n, bytes(data[stop - 5 : stop])
    return n, head[-5:]


class SatH1Conn(asyncio.Protocol):
    """One HTTP/1.1 connection, one endless burst response: counts ``data: `` in the raw bytes.

    No chunk parsing, no JSON: the status line is checked once, then every received byte is
    only scanned (``bytes.count``), so the client costs a few µs per read of up to 256 KiB.
    """

    def __init__(self, authority: bytes, path: bytes) -> None:
        self.request = b"GET %s HTTP/1.1\r\nhost: %s\r\naccept: text/event-stream\r\n\r\n" % (
            path,
            authority,
        )
        self.transport: asyncio.Transport | None = None
        self.head = True
        self.tail = b""
        self.count = 0
        self.closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        nodelay(transport)
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        if self.head:
            self.head = False
            if not data.startswith(b"HTTP/1.1 200"):
                Rec.errors[f"saturation: {data[:40]!r}"] += 1
                self.close()
                return
        n, self.tail = count_data(self.tail, data, 0, len(data))
        self.count += n
        Rec.events += n

    def counts(self) -> list[int]:
        return [self.count]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.closing:
            Rec.errors["saturation: connection closed by peer"] += 1

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()


class SatH2Conn(SatH1Conn):
    """One h2c connection carrying ``streams`` endless burst responses, read without ``h2``.

    ``h2`` writes the preface and the requests; what comes back is split into frames by hand:
    DATA payloads are scanned like the HTTP/1.1 bytes (per stream), HEADERS are HPACK-decoded
    (for ``:status``), SETTINGS and PING are acknowledged, and WINDOW_UPDATEs are sent every
    4 MiB. That keeps the client far cheaper per frame than ``h2``'s event objects.
    """

    def __init__(self, authority: bytes, path: bytes, streams: int = 1) -> None:
        super().__init__(authority, path)
        conn = h2_client()
        self.sids = []
        for _ in range(streams):
            sid = conn.get_next_available_stream_id()  # the next one once this one is used
            send_request(conn, sid, authority, path, None)
            self.sids.append(sid)
        self.request = conn.data_to_send()
        self.head = False
        self.buf = bytearray()
        self.stream_counts = dict.fromkeys(self.sids, 0)
        self.tails = dict.fromkeys(self.sids, b"")
        self.unacked = dict.fromkeys(self.sids, 0)
        self.unacked_conn = 0
        self.decoder = hpack.Decoder()
        self.block = bytearray()

    def counts(self) -> list[int]:
        return list(self.stream_counts.values())

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        size = len(buf)
        out = []
        total = 0
        while size - pos >= 9:
            length = int.from_bytes(buf[pos : pos + 3], "big")
            start = pos + 9
            stop = start + length
            if stop > size:
                break
            ftype = buf[pos + 3]
            flags = buf[pos + 4]
            sid = int.from_bytes(buf[pos + 5 : start], "big") & 0x7FFFFFFF
            pos = stop
            if ftype == 0:  # DATA
                self.unacked_conn += length
                if sid in self.unacked:
                    self.unacked[sid] += length
                    if flags & 0x8:  # PADDED
                        stop -= buf[start]
                        start += 1
                    n, self.tails[sid] = count_data(self.tails[sid], buf, start, stop)
                    self.stream_counts[sid] += n
                    total += n
                if flags & 0x1:
                    Rec.errors["saturation: h2 stream ended"] += 1
            elif ftype in (1, 9):  # HEADERS, CONTINUATION
                if ftype == 1:
                    if flags & 0x8:
                        stop -= buf[start]
                        start += 1
                    if flags & 0x20:  # PRIORITY
                        start += 5
                self.block += buf[start:stop]
                if flags & 0x4:  # END_HEADERS
                    status = dict(self.decoder.decode(bytes(self.block), raw=True)).get(b":status")
                    self.block.clear()
                    if status != b"200":
                        Rec.errors[f"saturation: h2 status {status!r}"] += 1
            elif ftype == 4 and not flags & 0x1:
                out.append(SETTINGS_ACK)
            elif ftype == 6 and not flags & 0x1:
                out.append(b"\x00\x00\x08\x06\x01\x00\x00\x00\x00" + bytes(buf[start:stop]))
            elif ftype == 3:
                Rec.errors["saturation: h2 RST_STREAM"] += 1
            elif ftype == 7:
                Rec.errors["saturation: h2 GOAWAY"] += 1
        if pos:
            del buf[:pos]
        self.count += total
        Rec.events += total
        if self.unacked_conn >= WINDOW_UPDATE_EVERY:
            out.append(window_update(0, self.unacked_conn))
            self.unacked_conn = 0
            for sid, n in self.unacked.items():
                if n:
                    out.append(window_update(sid, n))
                    self.unacked[sid] = 0
        if out and self.transport is not None:
            self.transport.write(b"".join(out))


def window_update(sid: int, increment: int) -> bytes:
    return b"\x00\x00\x04\x08\x00" + sid.to_bytes(4, "big") + increment.to_bytes(4, "big")


# --- helpers -----------------------------------------------------------------------------------


def proc_cpu(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` (whole thread groups), from /proc/PID/stat."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        fields = raw[raw.rfind(b")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def proc_rss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    total += int(line.split()[1])
    return total


def system_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine, all cores, from /proc/stat."""
    with open("/proc/stat", "rb") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # guest time is already inside user
    return (total - idle) / CLK_TCK, total / CLK_TCK


def loadavg() -> list[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def self_cpu() -> float:
    t = os.times()
    return t.user + t.system


async def backend_stats(host: str, port: int) -> dict[str, float]:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"GET /stats HTTP/1.1\r\nhost: bench\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        return json.loads(await reader.readexactly(length))
    finally:
        writer.close()


def percentile(sorted_values: list[int], q: float) -> float:
    if not sorted_values:
        return math.nan
    i = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[i]


def summary_ms(values_ns: list[int] | array[int]) -> dict[str, float]:
    values = sorted(values_ns)
    if not values:
        return {"count": 0}
    ms = 1e-6
    return {
        "count": len(values),
        "min": values[0] * ms,
        "p50": percentile(values, 0.50) * ms,
        "p90": percentile(values, 0.90) * ms,
        "p99": percentile(values, 0.99) * ms,
        "p999": percentile(values, 0.999) * ms,
        "max": values[-1] * ms,
        "mean": sum(values) / len(values) * ms,
    }


class Target:
    def __init__(self, args: argparse.Namespace) -> None:
        host, _, port = args.target.rpartition(":")
        self.host = host
        self.port = int(port)
        self.authority = args.target.encode()
        self.proto = args.proto
        self.per_conn = args.h2_per_conn

    async def connect(self, factory: type[H1Conn] | type[H2Conn]) -> H1Conn | H2Conn:
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(
            lambda: factory(self.authority), self.host, self.port
        )
        return proto

    async def open_streams(
        self, count: int, path: bytes, kind: str, batch: int, ramp_limit: float
    ) -> tuple[list[H1Conn | H2Conn], list[Stream]]:
        """Open ``count`` streams, ``batch`` at a time, each batch waiting for its first event.

        After ``ramp_limit`` seconds the remaining batches are opened without waiting (an
        overloaded proxy would otherwise make the ramp take minutes).
        """
        deadline = time.monotonic() + ramp_limit
        conns: list[H1Conn | H2Conn] = []
        streams: list[Stream] = []

        async def settle(batch_streams: list[Stream]) -> None:
            await wait_first(batch_streams, max(0.0, deadline - time.monotonic()))

        if self.proto == "h1":
            for start in range(0, count, batch):
                n = min(batch, count - start)
                opened = await asyncio.gather(
                    *(self.connect(H1Conn) for _ in range(n)), return_exceptions=True
                )
                batch_streams = []
                for conn in opened:
                    if isinstance(conn, BaseException):
                        Rec.errors[f"connect: {conn!r}"] += 1
                        continue
                    conns.append(conn)
                    batch_streams.append(conn.request(path, kind))
                streams.extend(batch_streams)
                await settle(batch_streams)
        else:
            remaining = count
            while remaining > 0:
                try:
                    conn = await self.connect(H2Conn)
                except OSError as exc:
                    Rec.errors[f"connect: {exc!r}"] += 1
                    break
                conns.append(conn)
                n = min(self.per_conn, remaining)
                remaining -= n
                for start in range(0, n, batch):
                    batch_streams = [conn.request(path, kind) for _ in range(min(batch, n - start))]
                    streams.extend(batch_streams)
                    await settle(batch_streams)
        return conns, streams


async def wait_first(streams: list[Stream], timeout: float) -> None:
    """Wait until each stream has its first event or failed, at most ``timeout`` s."""
    pending = [s.first for s in streams if not s.first.done()]
    if pending and timeout > 0:
        await asyncio.wait(pending, timeout=timeout)
    for s in streams:
        if s.first.done():
            s.first.exception()  # retrieved: failures are counted in Rec.errors already


def not_ready(streams: list[Stream]) -> int:
    return sum(1 for s in streams if not s.first.done() or s.first.exception() is not None)


class Prober:
    """Sequential short requests on one keep-alive connection: time to first event."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.conn: H1Conn | H2Conn | None = None
        self.ttfb_ns: list[int] = []
        self.failures = 0

    async def once(self, record: bool) -> None:
        conn = self.conn
        if conn is None or (isinstance(conn, H1Conn) and conn.closed) or conn.transport is None:
            conn = self.conn = await self.target.connect(
                H1Conn if self.target.proto == "h1" else H2Conn
            )
        stream = conn.request(b"/sse?n=1", "probe")
        try:
            await asyncio.wait_for(asyncio.shield(stream.done), 5.0)
            await stream.first
        except (TimeoutError, ConnectionError):
            self.failures += 1
            conn.close()
            self.conn = None
            return
        if record:
            self.ttfb_ns.append(stream.t_first - stream.t_req)

    async def loop(self, interval: float, deadline: float) -> None:
        next_at = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= deadline:
                return
            if next_at > now:
                await asyncio.sleep(min(next_at, deadline) - now)
                if time.monotonic() >= deadline:
                    return
            next_at += interval
            await self.once(record=True)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


class Meter:
    """CPU time and counters over one measurement window, from ``start()`` to ``stop()``.

    The CPU of the ``--pid`` processes (``/proc/PID/stat``), of this process, of the whole
    machine (``/proc/stat``), the backend's ``/stats`` counters, and ``count()`` (events
    received).
    """

    def __init__(self, pids: dict[str, list[int]], backend: str, count: Callable[[], int]) -> None:
        self.pids = pids
        host, _, port = backend.rpartition(":")
        self.backend = (host, int(port))
        self.count = count
        self.t0 = self.t1 = 0.0

    def snapshot(self) -> tuple[dict[str, float], float, tuple[float, float], int]:
        cpu = {name: proc_cpu(p) for name, p in self.pids.items()}
        return cpu, self_cpu(), system_cpu(), self.count()

    async def start(self) -> None:
        self.stats0 = await backend_stats(*self.backend)
        self.cpu0, self.me0, self.sys0, self.events0 = self.snapshot()
        self.t0 = time.monotonic()

    async def stop(self) -> None:
        self.t1 = time.monotonic()
        self.cpu1, self.me1, self.sys1, self.events1 = self.snapshot()
        self.stats1 = await backend_stats(*self.backend)

    @property
    def window(self) -> float:
        return self.t1 - self.t0

    @property
    def events(self) -> int:
        return self.events1 - self.events0

    def fields(self) -> dict[str, object]:
        """The window's measurements, for the result JSON."""
        window = self.window
        cpu_s = {name: self.cpu1[name] - self.cpu0[name] for name in self.pids}
        me = self.me1 - self.me0
        busy = self.sys1[0] - self.sys0[0]
        stats0, stats1 = self.stats0, self.stats1
        out: dict[str, object] = {
            "window_s": round(window, 3),
            "events": self.events,
            "client_cpu_pct": 100.0 * me / window,
            "cpu_pct": {name: 100.0 * cpu / window for name, cpu in cpu_s.items()},
            "cpu_s": cpu_s,
            "machine_busy_pct": 100.0 * busy / window,
            "machine_cores": round((self.sys1[1] - self.sys0[1]) / window, 2),
            "other_processes_cpu_pct": 100.0 * (busy - me - sum(cpu_s.values())) / window,
            "loadavg": loadavg(),
            "backend_events": stats1["events"] - stats0["events"],
            "backend_events_per_s": (stats1["events"] - stats0["events"]) / window,
            "backend_late_ticks": stats1["late_ticks"] - stats0["late_ticks"],
            "backend_paused_skips": stats1["paused_skips"] - stats0["paused_skips"],
            "backend_max_tick_lag_ms": stats1["max_lag_ms"],
        }
        if "proxy" in cpu_s and self.events:
            out["proxy_cpu_us_per_event"] = 1e6 * cpu_s["proxy"] / self.events
        return out


def parse_pids(specs: list[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for spec in specs:
        name, _, pids = spec.partition("=")
        out[name] = [int(p) for p in pids.split(",") if p]
    return out


# --- modes -------------------------------------------------------------------------------------


async def run_load(args: argparse.Namespace) -> dict[str, object]:
    target = Target(args)
    pids = parse_pids(args.pid)
    result: dict[str, object] = {"mode": "load", "proto": args.proto, "streams": args.streams}

    prober = Prober(target)
    await prober.once(record=False)
    t_ramp = time.monotonic()
    conns, streams = await target.open_streams(
        args.streams, b"/sse", "load", args.batch, args.ramp_limit
    )
    result["ramp_s"] = round(time.monotonic() - t_ramp, 3)
    try:
        await asyncio.sleep(args.warmup)
        result["streams_not_started"] = not_ready(streams)

        counts0 = [s.count for s in streams]
        profiler = None
        if args.profile_out and "proxy" in pids:
            profiler = subprocess.Popen(
                [
                    args.py_spy,
                    "record",
                    "--pid",
                    str(pids["proxy"][0]),
                    "--duration",
                    str(int(args.duration)),
                    "--rate",
                    str(args.profile_rate),
                    "--format",
                    args.profile_format,
                    "--output",
                    args.profile_out,
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        meter = Meter(pids, args.backend, lambda: Rec.events)
        await meter.start()
        Rec.measuring = True
        await prober.loop(args.probe_interval, meter.t0 + args.duration)
        remaining = meter.t0 + args.duration - time.monotonic()
        if remaining > 0:
            await asyncio.sleep(remaining)
        Rec.measuring = False
        await meter.stop()
        counts1 = [s.count for s in streams]
        if profiler is not None:
            try:
                profiler.wait(timeout=args.duration + 30)
            except subprocess.TimeoutExpired:
                profiler.kill()
                profiler.wait()
    finally:
        Rec.measuring = False
        prober.close()
        for conn in conns:
            conn.close()
        await asyncio.sleep(0.2)

    window = meter.window
    events = meter.events
    if args.proto == "h2":
        # Per connection: events in the window, and streams that got none (fairness check).
        index = {id(s): i for i, s in enumerate(streams)}
        by_conn = []
        for conn in conns:
            assert isinstance(conn, H2Conn)
            got = [counts1[index[id(s)]] - counts0[index[id(s)]] for s in conn.all_streams]
            by_conn.append({"events": sum(got), "streams": len(got), "zero": got.count(0)})
        result["h2_connections"] = by_conn
    per_stream = sorted(c1 - c0 for c0, c1 in zip(counts0, counts1, strict=True))
    result.update(
        events_per_s=events / window,
        expected_events_per_s=args.streams * 1000.0 / args.interval_ms,
        streams_open=len(streams),
        per_stream_events_min=per_stream[0] if per_stream else 0,
        per_stream_events_median=per_stream[len(per_stream) // 2] if per_stream else 0,
        streams_without_events=sum(1 for c in per_stream if c == 0),
        latency_ms=summary_ms(Rec.latencies),
        ttfb_ms=summary_ms(prober.ttfb_ns),
        probe_failures=prober.failures,
        **meter.fields(),
        errors=dict(Rec.errors),
    )
    return result


async def run_saturation(args: argparse.Namespace) -> dict[str, object]:
    """Back-to-back events (``/sse?burst=K``) on ``--streams`` streams: events per second."""
    target = Target(args)
    pids = parse_pids(args.pid)
    path = b"/sse?burst=%d" % args.burst
    loop = asyncio.get_running_loop()
    result: dict[str, object] = {
        "mode": "saturation",
        "proto": args.proto,
        "streams": args.streams,
        "burst": args.burst,
    }

    async def connect(streams: int) -> SatH1Conn | BaseException:
        try:
            if args.proto == "h1":
                _, conn = await loop.create_connection(
                    lambda: SatH1Conn(target.authority, path), target.host, target.port
                )
            else:
                _, conn = await loop.create_connection(
                    lambda: SatH2Conn(target.authority, path, streams), target.host, target.port
                )
        except OSError as exc:
            return exc
        return conn

    if args.proto == "h1":
        sizes = [1] * args.streams
    else:
        sizes = [
            min(args.h2_per_conn, args.streams - k)
            for k in range(0, args.streams, args.h2_per_conn)
        ]
    conns = []
    for conn in await asyncio.gather(*(connect(n) for n in sizes)):
        if isinstance(conn, BaseException):
            Rec.errors[f"connect: {conn!r}"] += 1
        else:
            conns.append(conn)

    def counts() -> list[int]:
        return [n for conn in conns for n in conn.counts()]

    try:
        await asyncio.sleep(args.warmup)
        counts0 = counts()
        meter = Meter(pids, args.backend, lambda: Rec.events)
        await meter.start()
        await asyncio.sleep(args.duration)
        await meter.stop()
        per_stream = sorted(c1 - c0 for c0, c1 in zip(counts0, counts(), strict=True))
    finally:
        for conn in conns:
            conn.close()
        await asyncio.sleep(0.2)
    events_per_s = meter.events / meter.window
    result.update(
        events_per_s=events_per_s,
        connections=len(conns),
        streams_open=len(per_stream),
        per_stream_events_min=per_stream[0] if per_stream else 0,
        per_stream_events_max=per_stream[-1] if per_stream else 0,
        streams_without_events=sum(1 for c in per_stream if c == 0),
        **meter.fields(),
        errors=dict(Rec.errors),
    )
    proxy_pct = result["cpu_pct"].get("proxy")  # type: ignore[attr-defined]
    if proxy_pct:
        result["events_per_s_per_proxy_core"] = events_per_s / (proxy_pct / 100.0)
    return result


async def run_idle(args: argparse.Namespace) -> dict[str, object]:
    target = Target(args)
    pids = parse_pids(args.pid)
    proxy = pids.get("proxy", [])
    result: dict[str, object] = {"mode": "idle", "proto": args.proto, "streams": args.streams}
    # Warm the proxy's code paths first, so the delta is the streams, not first-use costs.
    prober = Prober(target)
    for _ in range(5):
        await prober.once(record=False)
    prober.close()
    conns, _ = await target.open_streams(5, b"/sse?idle=1", "idle", args.batch, 30.0)
    for conn in conns:
        conn.close()
    await asyncio.sleep(args.settle)
    rss0 = proc_rss_kib(proxy) if proxy else 0
    conns, streams = await target.open_streams(
        args.streams, b"/sse?idle=1", "idle", args.batch, args.ramp_limit
    )
    try:
        await asyncio.sleep(args.settle)
        rss1 = proc_rss_kib(proxy) if proxy else 0
        ready = len(streams) - not_ready(streams)
    finally:
        for conn in conns:
            conn.close()
        await asyncio.sleep(0.5)
    rss2 = proc_rss_kib(proxy) if proxy else 0
    result.update(
        streams_ready=ready,
        connections=len(conns),
        rss_before_kib=rss0,
        rss_idle_kib=rss1,
        rss_after_close_kib=rss2,
        errors=dict(Rec.errors),
    )
    if proxy and ready:
        result["rss_per_stream_kib"] = (rss1 - rss0) / ready
    return result


def target_args(doc: str) -> argparse.ArgumentParser:
    """A parser with the options every client has: where to send, what to measure."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="HOST:PORT to send requests to")
    parser.add_argument("--backend", required=True, help="HOST:PORT of sse_backend (/stats)")
    parser.add_argument("--proto", choices=("h1", "h2"), default="h1")
    parser.add_argument("--h2-per-conn", type=int, default=100)
    parser.add_argument("--pid", action="append", default=[], help="NAME=PID[,PID...]")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = target_args(__doc__)
    parser.add_argument("--mode", choices=("load", "idle", "saturation"), default="load")
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--interval-ms", type=float, default=20.0, help="the backend's period")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--probe-interval", type=float, default=0.1)
    parser.add_argument("--burst", type=int, default=16, help="saturation: events per write")
    parser.add_argument("--batch", type=int, default=50, help="streams opened at a time")
    parser.add_argument(
        "--ramp-limit",
        type=float,
        default=30.0,
        help="seconds to wait for first events while opening streams",
    )
    parser.add_argument("--settle", type=float, default=1.0, help="idle mode: wait before RSS")
    parser.add_argument("--profile-out", help="run py-spy on the proxy during the window")
    parser.add_argument("--profile-format", default="raw")
    parser.add_argument("--profile-rate", type=int, default=200)
    parser.add_argument("--py-spy", default="py-spy")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    runner = {"load": run_load, "idle": run_idle, "saturation": run_saturation}[args.mode]
    result = asyncio.run(runner(args))
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()

"""The load LLM routers are benchmarked with: open-loop streamed chat completions.

The shape of vLLM's ``benchmarks/benchmark_serving.py`` and SGLang's ``bench_serving`` (what the
vllm-router and sglang-router projects measure with), against ``sse_backend.py`` directly or
through a proxy; one run prints one JSON object on stdout.

Workload (all of it drawn up front from ``random.Random(--seed)``, so every variant gets the
same requests at the same offsets):

* arrivals: a Poisson process at ``--rate`` requests/s (exponential gaps), ``--requests`` in
  all, sent open loop (at their time, whether or not earlier ones have finished);
* each request: ``POST /v1/chat/completions`` with a JSON body (``"stream": true``, a user
  message of ``--prompt-bytes`` bytes, ``"max_tokens"``, and ``"bench_ttft_ms"``, which tell the
  backend how long to "prefill" (``--ttft-ms``, uniform) and how many tokens to stream
  (``--tokens``, uniform); the backend then sends one token every ``--interval-ms`` of its own,
  then ``data: [DONE]``.
* connections: HTTP/1.1 through a keep-alive pool of at most ``--pool-limit`` connections
  (aiohttp's default: 100; a request waits for a free one, and that wait counts in its TTFT, as
  in those tools); HTTP/2: requests multiplexed on as few connections as the server's
  MAX_CONCURRENT_STREAMS (and ``--h2-per-conn``) allow.

Measured the way those tools do, on the client's clock: TTFT (request started -> first token
arrived), ITL (gap between two consecutive tokens of a request, on arrival; tokens that arrive in
the same read have a gap of 0), TPOT ((last - first token) / (tokens - 1) per request), E2E
latency (start -> end of response), requests completed / s and output tokens / s over the run
(first request sent -> last one finished), and failed requests (status, reset, fewer tokens than
asked for, timeout). Plus what ``sse_client.py`` measures: token latency (arrival - the send
time the backend wrote into the token), and the CPU of the ``--pid`` processes over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import sys
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import h2.exceptions
from sse_client import (
    H1Conn,
    H2Conn,
    Meter,
    Rec,
    Stream,
    Target,
    parse_pids,
    summary_ms,
    target_args,
)

PATH = b"/v1/chat/completions"
monotonic_ns = time.monotonic_ns


class LLMRec:
    itl = array("q")
    """Inter-token gaps (ns) on arrival, all measured requests."""
    token_latency = array("q")
    """Arrival - backend send time (ns) of each token."""


class LLMStream(Stream):
    """One streamed completion: tokens counted, each token's arrival recorded."""

    __slots__ = ("t_last",)

    def __init__(self) -> None:
        super().__init__("llm")
        self.t_last = 0

    def body(self, data: bytes | bytearray, now: int) -> None:
        self.sse += data
        *events, self.sse = self.sse.split(b"\n\n")
        tokens = 0
        for event in events:
            k = event.find(b'"t":')
            if k < 0:
                continue  # data: [DONE], comments
            tokens += 1
            LLMRec.token_latency.append(now - int(event[k + 4 : event.find(b",", k)]))
            if self.t_last:
                LLMRec.itl.append(now - self.t_last)
            else:
                self.t_first = now
            self.t_last = now
        if tokens:
            self.count += tokens
            Rec.events += tokens
            if not self.first.done():
                self.first.set_result(None)


@dataclass
class Request:
    at: float
    """Seconds after the start of the run."""
    tokens: int
    body: bytes


def chat_request(at: float, tokens: int, ttft_ms: float, prompt: str) -> Request:
    body = {
        "model": "bench",
        "stream": True,
        "max_tokens": tokens,
        "ignore_eos": True,
        "bench_ttft_ms": round(ttft_ms, 3),
        "messages": [{"role": "user", "content": prompt}],
    }
    return Request(at, tokens, json.dumps(body, separators=(",", ":")).encode())


def workload(args: argparse.Namespace) -> list[Request]:
    rng = random.Random(args.seed)
    filler = "lorem ipsum dolor sit amet " * 200
    out = []
    at = 0.0
    for _ in range(args.requests):
        at += rng.expovariate(args.rate) if args.rate != float("inf") else 0.0
        tokens = rng.randint(*args.tokens)
        ttft = rng.uniform(*args.ttft_ms)
        out.append(chat_request(at, tokens, ttft, filler[: rng.randint(*args.prompt_bytes)]))
    return out


class H1Pool:
    """Keep-alive HTTP/1.1 connections, at most ``limit`` (0: no limit), reused LIFO."""

    def __init__(self, target: Target, limit: int) -> None:
        self.target = target
        self.slots = asyncio.Semaphore(limit or 1 << 30)
        self.idle: list[H1Conn] = []
        self.all: list[H1Conn] = []
        self.waits = 0

    async def acquire(self) -> H1Conn:
        if self.slots.locked():
            self.waits += 1
        await self.slots.acquire()
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and conn.reusable:
                return conn
            conn.close()
        try:
            conn = await self.target.connect(H1Conn)
        except BaseException:
            self.slots.release()
            raise
        assert isinstance(conn, H1Conn)
        self.all.append(conn)
        return conn

    def release(self, conn: H1Conn, ok: bool) -> None:
        if ok and not conn.closed and conn.reusable:
            self.idle.append(conn)
        else:
            conn.close()
        self.slots.release()

    def close(self) -> None:
        for conn in self.all:
            conn.close()


class H2Pool:
    """h2c connections, each carrying up to the server's MAX_CONCURRENT_STREAMS streams."""

    def __init__(self, target: Target, per_conn: int) -> None:
        self.target = target
        self.per_conn = per_conn
        self.all: list[H2Conn] = []
        self.lock = asyncio.Lock()
        self.waits = 0

    def _free(self) -> H2Conn | None:
        for conn in self.all:
            cap = min(self.per_conn, conn.conn.remote_settings.max_concurrent_streams)
            if conn.transport is not None and not conn.closing and len(conn.streams) < cap:
                return conn
        return None

    async def acquire(self) -> H2Conn:
        conn = self._free()
        if conn is None:
            async with self.lock:  # one connect at a time; others then find room on it
                conn = self._free()
                if conn is None:
                    conn = await self.target.connect(H2Conn)
                    assert isinstance(conn, H2Conn)
                    self.all.append(conn)
        return conn

    def release(self, conn: H2Conn, ok: bool) -> None:
        pass

    def close(self) -> None:
        for conn in self.all:
            conn.close()


class Outcomes:
    def __init__(self) -> None:
        self.ttft: list[int] = []
        self.e2e: list[int] = []
        self.tpot: list[int] = []
        self.tokens = 0
        self.completed = 0
        self.failed: Counter[str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0


async def send(req: Request, pool: H1Pool | H2Pool, timeout: float, out: Outcomes | None) -> None:
    """One request, start to end; its measurements go to ``out`` (None: not measured)."""
    start = monotonic_ns()
    stream = LLMStream()
    conn: H1Conn | H2Conn | None = None
    if out is not None:
        out.in_flight += 1
        out.max_in_flight = max(out.max_in_flight, out.in_flight)
    why = ""
    try:
        conn = await pool.acquire()
        conn.request(PATH, "llm", req.body, stream)
        await asyncio.wait_for(asyncio.shield(stream.done), timeout)
    except TimeoutError:
        why = "timeout"
    except (ConnectionError, OSError, h2.exceptions.ProtocolError) as exc:
        why = str(exc) or type(exc).__name__
    finally:
        end = monotonic_ns()
        for fut in (stream.first, stream.done):
            if fut.done() and not fut.cancelled():
                fut.exception()  # retrieved; failures are counted below
        if conn is not None:
            pool.release(conn, ok=not why)  # type: ignore[arg-type]
        if out is not None:
            out.in_flight -= 1
    if out is None:
        return
    if not why and stream.count != req.tokens:
        why = "wrong token count"
    if why:
        out.failed[why] += 1
        return
    out.completed += 1
    out.tokens += stream.count
    out.ttft.append(stream.t_first - start)
    out.e2e.append(end - start)
    if stream.count > 1:
        out.tpot.append((stream.t_last - stream.t_first) // (stream.count - 1))


async def run(args: argparse.Namespace) -> dict[str, object]:
    target = Target(args)
    pids = parse_pids(args.pid)
    loop = asyncio.get_running_loop()
    pool = (
        H1Pool(target, args.pool_limit) if args.proto == "h1" else H2Pool(target, args.h2_per_conn)
    )
    requests = workload(args)
    out = Outcomes()
    try:
        # One request first, not measured (vLLM's "initial test run").
        await send(chat_request(0.0, 3, 10.0, "warm up"), pool, 10.0, None)
        LLMRec.itl = array("q")
        LLMRec.token_latency = array("q")
        meter = Meter(pids, args.backend, lambda: Rec.events)
        await meter.start()
        t0 = loop.time()
        lag = 0.0
        tasks = []
        for req in requests:
            delay = t0 + req.at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            lag = max(lag, loop.time() - t0 - req.at)
            tasks.append(asyncio.create_task(send(req, pool, args.timeout, out)))
        dispatch_s = loop.time() - t0
        _, pending = await asyncio.wait(tasks, timeout=args.drain) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await meter.stop()
        if pending:
            out.failed["unfinished at the end of the run"] += len(pending)
            await asyncio.wait(pending)
    finally:
        pool.close()
        await asyncio.sleep(0.2)
    window = meter.window
    return {
        "mode": "llm",
        "proto": args.proto,
        "rate": args.rate,
        "requests": len(requests),
        "completed": out.completed,
        "failed": sum(out.failed.values()),
        "failures": dict(out.failed),
        "duration_s": round(window, 3),
        "dispatch_s": round(dispatch_s, 3),
        "dispatch_lag_max_ms": round(lag * 1000.0, 3),
        "request_throughput": out.completed / window,
        "output_token_throughput": out.tokens / window,
        "tokens": out.tokens,
        "max_concurrency": out.max_in_flight,
        "connections": len(pool.all),
        "pool_waits": pool.waits,
        "ttft_ms": summary_ms(out.ttft),
        "itl_ms": summary_ms(LLMRec.itl),
        "tpot_ms": summary_ms(out.tpot),
        "e2e_ms": summary_ms(out.e2e),
        "token_latency_ms": summary_ms(LLMRec.token_latency),
        **meter.fields(),
        "errors": dict(Rec.errors),
    }


def pair(kind: type) -> Callable[[str], tuple[object, object]]:
    """An argparse ``type``: ``"MIN,MAX"`` (or ``"N"``: N, N) as two ``kind`` values."""

    def parse(text: str) -> tuple[object, object]:
        lo, _, hi = text.partition(",")
        return kind(lo), kind(hi or lo)

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = target_args(__doc__)
    parser.add_argument("--rate", type=float, default=20.0, help="requests/s (Poisson); inf")
    parser.add_argument("--requests", type=int, default=800)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttft-ms", type=pair(float), default=(50.0, 200.0), help="MIN,MAX")
    parser.add_argument("--tokens", type=pair(int), default=(20, 400), help="MIN,MAX per request")
    parser.add_argument("--prompt-bytes", type=pair(int), default=(200, 2000), help="MIN,MAX")
    parser.add_argument("--pool-limit", type=int, default=100, help="HTTP/1.1 connections")
    parser.add_argument("--timeout", type=float, default=60.0, help="per request (s)")
    parser.add_argument("--drain", type=float, default=60.0, help="after the last arrival (s)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    json.dump(asyncio.run(run(args)), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()

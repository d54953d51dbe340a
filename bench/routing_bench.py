"""Cost of one routing decision, in microseconds per request (CPU only, no I/O).

Measures, for groups of 8 and 64 servers: the smooth weighted round-robin pick,
least_streams, rendezvous_order for one key, the full decision for a keyed request
(session key from a cookie header + usable_servers + rendezvous_order), and
``GroupRouter.candidates`` itself: unkeyed, keyed, and keyed with the stream accounting that
fills the affinity memory. Each figure is the
median over ``--repeat`` runs of about ``--seconds`` each, timed with ``time.perf_counter_ns``.

    . .venv/bin/activate
    python bench/routing_bench.py            # prints a markdown table
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

from muxproxy.config import Server, SessionSource, Sticky, Upstream
from muxproxy.config.serverid import server_id
from muxproxy.routing.balancer import (
    SmoothWeightedRoundRobin,
    least_streams,
    rendezvous_order,
)
from muxproxy.routing.health import PassiveHealth, usable_servers
from muxproxy.routing.router import GroupRouter
from muxproxy.routing.sticky import session_key_from_head

SIZES = (8, 64)


def per_call_us(run: Callable[[int], object], seconds: float, repeat: int) -> float:
    """Median over ``repeat`` runs (each about ``seconds`` long) of one call, in microseconds."""
    calls = 100
    while True:  # calibrate (and warm up): enough calls for a run of about ``seconds``
        start = time.perf_counter_ns()
        run(calls)
        elapsed = (time.perf_counter_ns() - start) / 1e9
        if elapsed >= seconds / 4:
            calls = max(calls, int(calls * seconds / elapsed))
            break
        calls *= 4
    samples = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        run(calls)
        samples.append((time.perf_counter_ns() - start) / calls / 1000)
    return statistics.median(samples)


def cases(size: int) -> dict[str, Callable[[int], object]]:
    servers = [
        Server(address=f"10.0.{i // 256}.{i % 256}:8000", weight=1 + i % 4, backup=i == size - 1)
        for i in range(size)
    ]
    weights = [s.weight for s in servers]
    ids = [server_id("gpus", s.address, "secret") for s in servers]
    eligible = list(range(size))
    active = [(i * 7) % 5 for i in range(size)]
    passive = PassiveHealth(size)
    passive.failure(1, 0.0, servers[1])  # one server out, as in a fleet with a failure
    sources = [SessionSource(kind="cookie", name="session")]
    headers = [
        (b":authority", b"llm.example.com"),
        (b"content-type", b"application/json"),
        (b"accept", b"text/event-stream"),
        (b"authorization", b"Bearer sk-0123456789abcdef"),
        (b"user-agent", b"openai-python/1.30"),
        (b"cookie", b"theme=dark; session=conv-8c1f2a; muxproxy_server=0123456789abcdef"),
    ]
    target = b"/v1/chat/completions"
    rr = SmoothWeightedRoundRobin(size)

    def rr_pick(n: int) -> None:
        for _ in range(n):
            rr.pick(weights, eligible)

    def least(n: int) -> None:
        for _ in range(n):
            least_streams(weights, active, eligible, rr)

    def rendezvous(n: int) -> None:
        for k in range(n):
            rendezvous_order(b"conv-%d" % k, ids, weights, eligible)

    def full(n: int) -> None:
        for _ in range(n):
            key, _need_body = session_key_from_head(sources, headers, target)
            usable = usable_servers(servers, weights, passive, None, 5.0, for_new_sessions=True)
            rendezvous_order(key or b"", ids, weights, usable)

    group = Upstream(name="gpus", servers=tuple(servers), sticky=Sticky(sources=tuple(sources)))
    router = GroupRouter(group)
    router.failed(1, 0.0)

    def router_unkeyed(n: int) -> None:
        for _ in range(n):
            router.candidates(None, None, 5.0)

    def router_keyed(n: int) -> None:
        for k in range(n):
            router.candidates(b"conv-%d" % (k & 1023), None, 5.0)

    remembering = GroupRouter(group)
    remembering.failed(1, 0.0)

    def router_remembered(n: int) -> None:
        # A request's whole routing work: the decision, then the stream's accounting, which
        # remembers the key (from the second round on, every key is found in the memory).
        for k in range(n):
            key = b"conv-%d" % (k & 1023)
            index = remembering.candidates(key, None, 5.0)[0]
            remembering.stream_started(index, key, 5.0)
            remembering.stream_ended(index)

    return {
        "smooth weighted round-robin pick": rr_pick,
        "least_streams": least,
        "rendezvous_order (one key)": rendezvous,
        "full keyed decision (cookie key + usable_servers + rendezvous_order)": full,
        "GroupRouter.candidates, no key": router_unkeyed,
        "GroupRouter.candidates, 1,024 keys in turn": router_keyed,
        "candidates + stream_started/ended, 1,024 remembered keys": router_remembered,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seconds", type=float, default=0.2, help="length of one run (default 0.2)"
    )
    parser.add_argument("--repeat", type=int, default=7, help="runs per figure (default 7)")
    args = parser.parse_args()

    results: dict[int, dict[str, float]] = {}
    for size in SIZES:
        results[size] = {
            name: per_call_us(run, args.seconds, args.repeat) for name, run in cases(size).items()
        }
    names = list(results[SIZES[0]])
    print(
        f"Python {platform.python_version()} on {platform.machine()}, "
        f"median of {args.repeat} runs of ~{args.seconds} s, µs per request\n"
    )
    print("| decision | " + " | ".join(f"{size} servers" for size in SIZES) + " |")
    print("|---|" + "---:|" * len(SIZES))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{results[s][name]:.2f}" for s in SIZES) + " |")


if __name__ == "__main__":
    main()

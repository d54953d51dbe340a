"""LLM-aware balancing policies on fake inference engines, measured against round robin.

Four fake inference engines (``muxproxy fakellm`` with its engine model: ``--max-running``
slots, a prefix KV cache of ``--kv-blocks`` blocks that keeps prompts and generated tokens
alike, LRU eviction, a prefill cost per uncached prompt token, continuous batching in steps
of ``--prefill-chunk`` prefill tokens) behind one muxproxy per balancing policy, and a load
client in this process (Trio, HTTP/1.1 with h11)::

    python bench/llm_routing.py --quick          # a smoke test: ~2 minutes on 2 cores
    python bench/llm_routing.py                  # the full run (not part of CI)
    python bench/llm_routing.py --workloads chat --loads 0.5,0.9,1.3 --seeds 0,1,2,3

How it measures, and why:

1. **Capacity is measured, not computed.** Per workload, round robin runs the traces of
   ``--search-seeds`` (every seed by default; the quick mode: seed 0) at a rate searched for
   (up from a guess by ``--search-factor`` until it fails, then bisected ``--search-steps``
   times): the highest rate at which at least ``--capacity-share`` of their requests, pooled,
   have their first token within the TTFT SLO (``--slo``, 1 s). Loads
   (``--loads``) are fractions of that measured capacity: 1.0 is round robin's knee.
2. **One arrival trace per seed** (``llm_trace.py``), the same for every policy: Poisson
   arrivals, each a request fixed in advance (a conversation's history carries the reply the
   fake gives), scaled to the rate of the load.
3. **Only the requests arriving in the window are counted, and every one is waited for.**
   Requests arriving in the first ``--warmup`` seconds warm the caches; those arriving in the
   next ``--window`` seconds are counted, and the run waits for all of them (at most
   ``--drain`` seconds; one still unfinished then counts with its time so far, a lower bound,
   and is reported).
4. **Seeds are pooled** (``--seeds``, at least two): the requests of every seed together.
5. **Each ratio against round robin has a bootstrap interval** (``--bootstrap`` rounds):
   TTFT p50 and p99, and goodput (requests whose first token came within the SLO, per second
   of window). The engines' counters give the prefill tokens computed and the hit rate, per
   run; their ratio's spread is the range over seeds.

The processes start once: the engines and one proxy per policy, all on loopback. Every run
leads its system prompts with a run's own salt, so no block an earlier run cached can hit
(those blocks only take room, and the LRU evicts them first), and the affinity keys are new
too; between runs the engines are let drain. Measured per run from the engines' ``/metrics``
(vLLM's names) between the window's start and the last counted request's end: prompt tokens
looked up and found cached (hit rate), tokens prefilled (looked up less found); from the
client: TTFT (request sent -> first SSE event with content), the engine that answered
(``x-backend-id``), and from those the busiest engine's requests over the mean and the share
of a conversation's later turns served away from its turn before's engine ("turns moved",
over warm-up and window: each move leaves the history's cache behind).

Every engine publishes its KV-cache events (``--kv-events``), whichever policy runs, so that
the policy that follows them (``kv_events``) runs on the same engines as the others; its
proxy's ``/status`` counters (requests placed with known tokens, moved by the events) are in
the JSON.

Out: a markdown table per workload and load, and a JSON file of every run (``--out``).
Every process it starts is stopped at the end, also on errors (by PID).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import random
import shutil
import string
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import trio
from chat_client import NET_ERRORS, HttpConn, Outcome, chat
from llm_load import pair
from llm_trace import (
    Workload,
    fastest_reply,
    goodput,
    hit_ceiling,
    multi_turn_chat,
    percentile,
    ratio_interval,
    single_questions,
    ttft_quantile,
)
from prometheus_client.parser import text_string_to_metric_families
from sse_bench import ROOT, Proc, free_port, host_meta, markdown_header, wait_listening

ENGINE_SERIES = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "queries": "vllm:prefix_cache_queries_total",
    "hits": "vllm:prefix_cache_hits_total",
}


@dataclass(frozen=True)
class Policy:
    name: str
    label: str
    toml: str
    """The group's balancing keys, as they stand in ``[upstreams.engines]``."""
    admission: bool = False
    """Give every server ``max_streams`` = the engines' slots."""
    kv_events: bool = False
    """Follow every engine's KV-cache events (each server's own endpoint)."""


POLICIES = [
    Policy("round_robin", "round robin", 'balance = "round_robin"'),
    Policy("least_streams", "least streams", 'balance = "least_streams"'),
    Policy(
        "sticky",
        "sticky by user, round robin",
        'balance = "round_robin"\nsticky = { sources = ["header:X-User"] }',
    ),
    Policy("least_load", "least load", 'balance = "least_load"'),
    Policy("prefix", "least load + prefix", 'balance = "least_load"\naffinity = "prefix"'),
    Policy(
        "admission",
        "least load + prefix + admission",
        'balance = "least_load"\naffinity = "prefix"\n'
        "queue = { max = 1000, timeout = $queue_timeout }\n"
        'load_report = { path = "/metrics", interval = 1 }',
        admission=True,
    ),
    Policy(
        "kv_events",
        "least load + prefix + KV events",
        'balance = "least_load"\naffinity = "prefix"\nkv_events = {}',
        kv_events=True,
    ),
]
BY_NAME = {p.name: p for p in POLICIES}


def proxy_config(
    policy: Policy,
    args: argparse.Namespace,
    listen: int,
    admin: int,
    engines: list[int],
    kv_ports: list[int],
) -> str:
    limit = f", max_streams = {args.max_running}" if policy.admission else ""
    servers = ",\n".join(
        f'  {{ address = "127.0.0.1:{port}"{limit}'
        + (f', kv_events = "tcp://127.0.0.1:{kv}"' if policy.kv_events else "")
        + " }"
        for port, kv in zip(engines, kv_ports, strict=True)
    )
    group = string.Template(policy.toml).substitute(queue_timeout=f"{args.queue_timeout:g}")
    if 'affinity = "prefix"' in group:
        # The proxy's defaults unless asked otherwise: what a user who turns affinity on gets.
        options = []
        if args.balance_gap is not None:
            options.append(f"balance_gap = {args.balance_gap}")
        if args.prefix_length is not None:
            options.append(f"length = {args.prefix_length}")
        if args.load_factor is not None:
            options.append(f"load_factor = {args.load_factor:g}")
        if options:
            group += f"\nprefix = {{ {', '.join(options)} }}"
    return (
        f'[[listeners]]\naddress = "127.0.0.1:{listen}"\n\n'
        f'[admin]\naddress = "127.0.0.1:{admin}"\n\n'
        "[timeouts]\nshutdown_grace = 1\n\n"
        '[log]\naccess = "off"\n\n'
        f"[upstreams.engines]\nservers = [\n{servers},\n]\n{group}\n\n"
        '[[routes]]\nprefix = "/"\nupstream = "engines"\n'
    )


class Fleet:
    """The engines and one proxy per policy, listening; ``stop()`` ends each (by PID)."""

    def __init__(self, args: argparse.Namespace, policies: list[Policy], tmp: Path) -> None:
        options = {
            "--max-running": args.max_running,
            "--kv-blocks": args.kv_blocks,
            "--block-tokens": args.block_tokens,
            "--ttft-base": args.ttft_base,
            "--prefill-per-token": args.prefill_per_token,
            "--delay": args.delay,
            "--prefill-chunk": args.prefill_chunk,
        }
        engine_argv = [str(part) for option in options.items() for part in option]
        command = [sys.executable, "-m", "muxproxy"]  # -m: the package of this checkout (cwd)
        self.procs: list[Proc] = []
        self.proxies: dict[str, int] = {}
        self.admins: dict[str, int] = {}
        try:
            engines = []
            kv_ports = [free_port() for _ in range(args.engines)]
            for k in range(args.engines):
                port = free_port()
                argv = [*command, "fakellm", "--port", str(port), "--id", f"e{k}", *engine_argv]
                argv += ["--kv-events", str(kv_ports[k])]  # published for every policy alike
                engines.append(Proc(f"e{k}", argv, tmp / f"e{k}.log", port, cwd=ROOT))
            self.procs.extend(engines)
            self.engine_ports = [engine.port for engine in engines]
            for policy in policies:
                port, admin = free_port(), free_port()
                config = tmp / f"{policy.name}.toml"
                config.write_text(
                    proxy_config(policy, args, port, admin, self.engine_ports, kv_ports)
                )
                argv = [*command, "serve", "--config", str(config)]
                log = tmp / f"{policy.name}.log"
                self.procs.append(Proc("muxproxy", argv, log, port, cwd=ROOT))
                self.proxies[policy.name] = port
                self.admins[policy.name] = admin
            for proc in self.procs:
                wait_listening(proc.port, proc.proc)
        except BaseException:
            self.stop()
            raise

    def exited(self) -> dict[str, str]:
        return {p.log.name: p.log_tail() for p in self.procs if not p.alive()}

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


# --- one run ----------------------------------------------------------------------------------


def engine_values(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return {key: values.get(name, 0.0) for key, name in ENGINE_SERIES.items()}


async def engines_now(ports: list[int]) -> list[dict[str, float]]:
    out = []
    for port in ports:
        conn = HttpConn(port)
        try:
            out.append(engine_values((await conn.get(b"/metrics")).decode()))
        finally:
            await conn.close()
    return out


async def kv_counts(admin: int) -> dict[str, Any] | None:
    """The group's ``kv_events`` counters from the proxy's ``/status`` (None: not followed)."""
    conn = HttpConn(admin)
    try:
        document = json.loads(await conn.get(b"/status"))
    finally:
        await conn.close()
    counts: dict[str, Any] | None = document["groups"]["engines"].get("kv_events")
    return counts


async def engines_idle(ports: list[int], limit: float) -> None:
    """Return once no engine runs or queues a request (at most ``limit`` seconds)."""
    with trio.move_on_after(limit):
        while any(e["running"] + e["waiting"] for e in await engines_now(ports)):
            await trio.sleep(0.1)


async def one_request(
    port: int, idle: list[HttpConn], workload: Workload, index: int, salt: str, outcome: Outcome
) -> None:
    """Send one request of the trace and read its stream into ``outcome``."""
    arrival = workload.arrivals[index]
    conn = idle.pop() if idle else HttpConn(port)
    sent = workload.body_messages(arrival, salt)
    outcome.max_tokens = arrival.max_tokens
    start = trio.current_time()
    try:
        await chat(SimpleNamespace(uid=arrival.user, conn=conn), outcome, sent, None)
    except NET_ERRORS as exc:
        outcome.result = f"error: {type(exc).__name__}"
    finally:
        if outcome.e2e_s is None:  # cut at the end of the drain: its time so far
            outcome.e2e_s = trio.current_time() - start
        if outcome.result == "ok":
            idle.append(conn)
        else:
            with trio.CancelScope(shield=True):
                await conn.close()


async def drive(
    args: argparse.Namespace,
    fleet: Fleet,
    policy: str,
    workload: Workload,
    rate: float,
    salt: str,
) -> dict[str, Any]:
    """One run: the trace at ``rate`` through one policy's proxy; see the header."""
    port = fleet.proxies[policy]
    end = args.warmup + args.window
    counted: list[Outcome] = []
    every: list[Outcome] = []
    idle: list[HttpConn] = []
    counted_left = 0
    all_counted = trio.Event()
    before: list[dict[str, float]] = []
    overlapping = 0
    busy_until: dict[int, int] = {}

    async def send(index: int, outcome: Outcome, count: bool) -> None:
        nonlocal counted_left
        try:
            await one_request(port, idle, workload, index, salt, outcome)
        finally:
            busy_until[workload.arrivals[index].user] -= 1
            if count:
                counted_left -= 1
                if counted_left == 0 and t0 + end <= trio.current_time():
                    all_counted.set()

    async def window_start() -> None:
        await trio.sleep_until(t0 + args.warmup)
        before.extend(await engines_now(fleet.engine_ports))

    async with trio.open_nursery() as nursery:
        t0 = trio.current_time()
        nursery.start_soon(window_start)
        for index, arrival in enumerate(workload.arrivals):
            at = arrival.at / rate
            if at >= end:
                break
            await trio.sleep_until(t0 + at)
            outcome = Outcome(at=at, user=arrival.user, prompt=arrival.conversation)
            outcome.turn = arrival.turn
            every.append(outcome)
            overlapping += busy_until.get(arrival.user, 0) > 0
            busy_until[arrival.user] = busy_until.get(arrival.user, 0) + 1
            count = at >= args.warmup
            if count:
                counted.append(outcome)
                counted_left += 1
            nursery.start_soon(send, index, outcome, count)
        else:
            raise SystemExit(f"the trace of {workload.name} ends before the window does")
        await trio.sleep_until(t0 + end)
        if counted_left:
            with trio.move_on_after(args.drain):
                await all_counted.wait()
        after = await engines_now(fleet.engine_ports)
        kv_after = await kv_counts(fleet.admins[policy])
        nursery.cancel_scope.cancel()
    for conn in idle:
        await conn.close()
    queries = sum(b["queries"] - a["queries"] for a, b in zip(before, after, strict=True))
    hits = sum(b["hits"] - a["hits"] for a, b in zip(before, after, strict=True))
    served: dict[str, int] = {f"e{k}": 0 for k in range(len(fleet.engine_ports))}
    for o in counted:
        if o.engine:
            served[o.engine] = served.get(o.engine, 0) + 1
    mean = sum(served.values()) / len(served)
    return {
        "policy": policy,
        "workload": workload.name,
        "rate": rate,
        "requests": len(counted),
        "overlapping_turns": overlapping,
        "results": count_results(counted),
        "ttft_s": [ttft(o) for o in counted],
        "prefill_tokens": queries - hits,
        "queried_tokens": queries,
        "hit_rate": hits / queries if queries else None,
        "served": served,
        "busiest_over_mean": max(served.values()) / mean if mean else None,
        "moved_share": moved_share(every),
        "kv_events": kv_after,
    }


def moved_share(outcomes: list[Outcome]) -> float | None:
    """Of the later turns, the share served by another engine than the conversation's turn
    before (each move leaves the history cached where it was)."""
    last: dict[int, str] = {}
    later = moved = 0
    for o in outcomes:
        if o.engine is None:
            continue
        before = last.get(o.prompt)
        if before is not None:
            later += 1
            moved += before != o.engine
        last[o.prompt] = o.engine
    return moved / later if later else None


def ttft(outcome: Outcome) -> float:
    """Its TTFT; one cut before its first token at the end of the drain counts with its time
    so far (a lower bound), and a refusal or an error as never (outside any SLO)."""
    if outcome.ttft_s is not None:
        return outcome.ttft_s
    if outcome.result in ("unfinished", "timeout"):
        return outcome.e2e_s or 0.0
    return math.inf


def count_results(outcomes: list[Outcome]) -> dict[str, int]:
    results: dict[str, int] = {}
    for o in outcomes:
        results[o.result] = results.get(o.result, 0) + 1
    return results


async def run_once(
    args: argparse.Namespace, fleet: Fleet, policy: str, workload: Workload, rate: float
) -> dict[str, Any]:
    args.runs += 1
    await engines_idle(fleet.engine_ports, args.drain)
    result = await drive(args, fleet, policy, workload, rate, f"[run {args.runs}] ")
    exited = fleet.exited()
    if exited:
        raise SystemExit(f"exited during the run: {exited}")
    return result


# --- capacity ---------------------------------------------------------------------------------


def sustains(times: list[float], args: argparse.Namespace) -> bool:
    return bool(times) and sum(t <= args.slo for t in times) >= args.capacity_share * len(times)


async def measure_capacity(
    args: argparse.Namespace, fleet: Fleet, traces: list[Workload]
) -> tuple[float, list[dict[str, Any]]]:
    """The highest rate round robin sustains at the SLO over ``traces`` (one per seed of
    ``--search-seeds``, their requests pooled; see the header), and the probes."""
    probes: list[dict[str, Any]] = []

    async def probe(rate: float) -> bool:
        times = []
        for trace in traces:
            times += (await run_once(args, fleet, "round_robin", trace, rate))["ttft_s"]
        ok = sustains(times, args)
        share = sum(t <= args.slo for t in times) / max(len(times), 1)
        print(
            f"#   {traces[0].name}: round robin at {rate:.2f} req/s: {share:.0%} within "
            f"{args.slo:g} s ({'sustained' if ok else 'not sustained'})",
            file=sys.stderr,
        )
        probes.append({"rate": rate, "within_slo": share, "sustained": ok})
        return ok

    rate = args.capacity_guess
    low, high = (rate, None) if await probe(rate) else (None, rate)
    for _ in range(args.search_max):
        if low is not None and high is not None:
            break
        rate = rate * args.search_factor if high is None else rate / args.search_factor
        if await probe(rate):
            low = rate
        else:
            high = rate
    if low is None or high is None:
        raise SystemExit(f"{traces[0].name}: no knee between the rates probed: {probes}")
    for _ in range(args.search_steps):
        middle = math.sqrt(low * high)
        if await probe(middle):
            low = middle
        else:
            high = middle
    return low, probes


# --- the tables -------------------------------------------------------------------------------


def with_interval(point: float, low: float, high: float) -> str:
    return f"{point:.2f}x ({low:.2f}-{high:.2f})"


def group_table(
    args: argparse.Namespace, runs: list[dict[str, Any]], window_s: float, rng: random.Random
) -> list[str]:
    """One workload and load: a row per policy, its seeds pooled, ratios against round robin."""
    by_policy: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_policy.setdefault(run["policy"], []).append(run)
    base = by_policy.get("round_robin")
    cols = [
        "policy",
        "requests",
        "TTFT p50 / p99 (ms)",
        "p50 x rr",
        "p99 x rr",
        f"goodput ≤ {args.slo:g} s (req/s)",
        "goodput x rr",
        "prefill tokens / request",
        "prefill x rr (by seed)",
        "hit rate",
        "busiest / mean",
        "turns moved",
        "not ok",
    ]
    lines = markdown_header(cols)
    for policy in args.chosen:
        seeds = sorted(by_policy.get(policy.name, []), key=lambda r: r["seed"])
        if not seeds:
            continue
        ttfts = [r["ttft_s"] for r in seeds]
        pooled = [t for seed in ttfts for t in seed]
        requests = sum(r["requests"] for r in seeds)
        prefill = sum(r["prefill_tokens"] for r in seeds) / max(requests, 1)
        queried = sum(r["queried_tokens"] for r in seeds)
        hit = 1 - sum(r["prefill_tokens"] for r in seeds) / queried if queried else math.nan
        good = goodput(args.slo, window_s)(ttfts)
        cells = [
            f"{POLICIES.index(policy) + 1}. {policy.label}",
            str(requests),
            f"{percentile(pooled, 0.5) * 1000:,.0f} / {percentile(pooled, 0.99) * 1000:,.0f}",
        ]
        if base is None or policy.name == "round_robin":
            cells += ["", "", f"{good:.2f}", "", f"{prefill:,.0f}", ""]
        else:
            base_seeds = sorted(base, key=lambda r: r["seed"])
            base_ttfts = [r["ttft_s"] for r in base_seeds]
            for stat in (ttft_quantile(0.5), ttft_quantile(0.99)):
                cells.append(
                    with_interval(*ratio_interval(stat, ttfts, base_ttfts, args.bootstrap, rng))
                )
            cells.append(f"{good:.2f}")
            gp = ratio_interval(goodput(args.slo, window_s), ttfts, base_ttfts, args.bootstrap, rng)
            cells.append(with_interval(*gp))
            cells.append(f"{prefill:,.0f}")
            by_seed = [
                r["prefill_tokens"] / b["prefill_tokens"] if b["prefill_tokens"] else math.nan
                for r, b in zip(seeds, base_seeds, strict=False)
            ]
            spread = ", ".join(f"{x:.2f}" for x in by_seed)
            cells.append(f"{prefill_ratio(seeds, base_seeds):.2f}x ({spread})")
        busiest = [r["busiest_over_mean"] for r in seeds if r["busiest_over_mean"]]
        bad: dict[str, int] = {}
        for r in seeds:
            for result, n in r["results"].items():
                if result != "ok":
                    bad[result] = bad.get(result, 0) + n
        cells += [
            f"{hit:.1%}",
            f"{max(busiest):.2f}" if busiest else "-",
            moved_cell(seeds),
            ", ".join(f"{k} {v}" for k, v in sorted(bad.items())) or "0",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def moved_cell(seeds: list[dict[str, Any]]) -> str:
    """The share of later turns served away from the turn before's engine, by seed."""
    shares = [r.get("moved_share") for r in seeds]
    known = [x for x in shares if x is not None]
    return ", ".join(f"{x:.0%}" for x in known) if known else "-"


def prefill_ratio(seeds: list[dict[str, Any]], base: list[dict[str, Any]]) -> float:
    """Prefill tokens per request, pooled, over round robin's."""
    mine = sum(r["prefill_tokens"] for r in seeds) / max(sum(r["requests"] for r in seeds), 1)
    theirs = sum(r["prefill_tokens"] for r in base) / max(sum(r["requests"] for r in base), 1)
    return mine / theirs if theirs else math.nan


# --- the command line -------------------------------------------------------------------------


QUICK = {
    "warmup": 1.5,
    "window": 4.0,
    "drain": 10.0,
    "loads": "0.9",
    "seeds": "0,1",
    "policies": "round_robin,least_load,prefix",
    "search_steps": 0,
    "search_seeds": "0",
    "bootstrap": 300,
}
"""``--quick``: a smoke test of every part, bounded to about two minutes on two cores."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a smoke test: " + str(QUICK))
    parser.add_argument(
        "--policies",
        default="round_robin,least_streams,least_load,prefix,admission",
        help=f"comma-separated names or numbers 1-{len(POLICIES)} (round robin always runs)",
    )
    parser.add_argument("--workloads", default="single,chat", help="single, chat or both")
    parser.add_argument("--loads", default="0.5,0.9,1.3", help="fractions of the capacity")
    parser.add_argument("--seeds", default="0,1,2", help="at least two, comma-separated")
    parser.add_argument("--slo", type=float, default=1.0, help="TTFT SLO (s)")
    parser.add_argument("--window", type=float, default=30.0, help="counted arrivals (s)")
    parser.add_argument("--warmup", type=float, default=10.0, help="uncounted arrivals (s)")
    parser.add_argument("--drain", type=float, default=60.0, help="most s to wait after it")
    parser.add_argument("--bootstrap", type=int, default=2000, help="resampling rounds")
    search = parser.add_argument_group("the capacity search (round robin, seed 0)")
    search.add_argument("--capacity", type=str, help="WORKLOAD=REQ/S,...: skip the search")
    search.add_argument("--capacity-guess", type=float, default=10.0, help="first rate probed")
    search.add_argument(
        "--capacity-share",
        type=float,
        default=0.9,
        help="share of requests within the SLO that counts as sustained",
    )
    search.add_argument(
        "--search-seeds", help="the seeds whose traces the search runs (default: --seeds)"
    )
    search.add_argument("--search-factor", type=float, default=1.4)
    search.add_argument("--search-max", type=int, default=6, help="most probes to bracket")
    search.add_argument("--search-steps", type=int, default=2, help="bisections")
    work = parser.add_argument_group("the workloads")
    work.add_argument("--system-bytes", type=int, default=6000, help="single: its system prompt")
    work.add_argument("--users", type=int, default=96)
    work.add_argument("--prompts", type=int, default=8, help="chat: distinct system prompts")
    work.add_argument("--prompt-bytes", type=int, default=3600, help="chat: bytes each")
    work.add_argument("--zipf", type=float, default=0.8)
    work.add_argument("--turns", type=pair(int), default=(2, 8), help="MIN,MAX per conversation")
    work.add_argument("--user-bytes", type=pair(int), default=(100, 400))
    work.add_argument("--tokens", type=pair(int), default=(16, 128), help="MIN,MAX max_tokens")
    engine = parser.add_argument_group("the engines (muxproxy fakellm)")
    engine.add_argument("--engines", type=int, default=4)
    engine.add_argument("--max-running", type=int, default=8)
    engine.add_argument("--kv-blocks", type=int, default=1600)
    engine.add_argument("--block-tokens", type=int, default=16)
    engine.add_argument("--ttft-base", type=float, default=0.005)
    engine.add_argument("--prefill-per-token", type=float, default=0.0003)
    engine.add_argument("--delay", type=float, default=0.02, help="a step's decode (s)")
    engine.add_argument("--prefill-chunk", type=int, default=512)
    knobs = parser.add_argument_group("policy knobs (default: the proxy's own)")
    knobs.add_argument("--queue-timeout", type=float, default=30.0, help="policy 6's queue")
    knobs.add_argument("--load-factor", type=float)
    knobs.add_argument("--prefix-length", type=int)
    knobs.add_argument("--balance-gap", type=int)
    parser.add_argument("--out", type=Path, help="JSON results (default: bench/results/...)")
    parser.add_argument("--keep-tmp", action="store_true", help="keep configs and logs")
    args = parser.parse_args()
    if args.quick:
        given = {a.dest for a in parser._actions if f"--{a.dest.replace('_', '-')}" in sys.argv}
        for key, value in QUICK.items():
            if key not in given:
                setattr(args, key, value)
    chosen = [BY_NAME["round_robin"]]
    for item in filter(None, (s.strip() for s in args.policies.split(","))):
        number = int(item) if item.isdigit() else 0
        policy = POLICIES[number - 1] if 1 <= number <= len(POLICIES) else BY_NAME.get(item)
        if policy is None:
            parser.error(f"--policies: unknown {item!r}; choose from {list(BY_NAME)}")
        if policy not in chosen:
            chosen.append(policy)
    args.chosen = chosen
    args.workload_names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not set(args.workload_names) <= {"single", "chat"} or not args.workload_names:
        parser.error(f"--workloads: single, chat or both, got {args.workloads!r}")
    args.load_list = [float(x) for x in str(args.loads).split(",")]
    args.seed_list = [int(x) for x in str(args.seeds).split(",")]
    if len(set(args.seed_list)) < 2:
        parser.error("--seeds: at least two, to pool")
    args.search_list = [int(x) for x in str(args.search_seeds or args.seeds).split(",")]
    args.known_capacity = {}
    for item in filter(None, (args.capacity or "").split(",")):
        name, _, rate = item.partition("=")
        args.known_capacity[name] = float(rate)
    if args.out is None:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        args.out = Path(__file__).resolve().parent / "results" / f"llm-routing-{stamp}.json"
    args.runs = 0
    return args


def make_workload(args: argparse.Namespace, name: str, seed: int, horizon: float) -> Workload:
    """A trace long enough for ``horizon`` seconds at the highest rate it may run."""
    count = math.ceil(horizon * 1.3 + 50)
    if name == "single":
        return single_questions(seed, count, args.system_bytes, args.user_bytes, args.tokens)
    return multi_turn_chat(
        seed,
        count,
        users=args.users,
        prompts=args.prompts,
        prompt_bytes=args.prompt_bytes,
        zipf=args.zipf,
        turns=args.turns,
        user_bytes=args.user_bytes,
        tokens=args.tokens,
    )


async def bench(args: argparse.Namespace, fleet: Fleet) -> dict[str, Any]:
    out: dict[str, Any] = {"capacity": {}, "probes": {}, "runs": []}
    span = args.warmup + args.window
    for name in args.workload_names:
        top = args.capacity_guess * args.search_factor**args.search_max
        if name in args.known_capacity:
            capacity = args.known_capacity[name]
        else:
            print(f"# {name}: searching round robin's capacity", file=sys.stderr)
            probe_traces = [make_workload(args, name, k, span * top) for k in args.search_list]
            capacity, probes = await measure_capacity(args, fleet, probe_traces)
            out["probes"][name] = probes
        out["capacity"][name] = capacity
        top = capacity * max(args.load_list)
        traces = {seed: make_workload(args, name, seed, span * top) for seed in args.seed_list}
        for load in args.load_list:
            for seed in args.seed_list:
                for policy in args.chosen:
                    run = await run_once(args, fleet, policy.name, traces[seed], load * capacity)
                    run.update(load=load, seed=seed)
                    out["runs"].append(run)
                    ttfts = run["ttft_s"]
                    print(
                        f"#   {name} load {load:g} seed {seed} {policy.name}: "
                        f"{run['requests']} requests, p50 {percentile(ttfts, 0.5):.3f} s, "
                        f"hit rate {run['hit_rate'] or 0:.1%}",
                        file=sys.stderr,
                    )
    return out


def report(args: argparse.Namespace, out: dict[str, Any]) -> str:
    rng = random.Random(20261207)
    lines = []
    for name in args.workload_names:
        capacity = out["capacity"][name]
        for load in args.load_list:
            runs = [r for r in out["runs"] if r["workload"] == name and r["load"] == load]
            lines.append(
                f"\n**{name}**, load {load:g} of round robin's measured capacity "
                f"({capacity:.2f} req/s: {load * capacity:.2f} req/s), seeds "
                f"{','.join(map(str, args.seed_list))} pooled, {args.window:g} s counted each"
                f"; hit-rate ceiling {ceiling_of(args, name, capacity, load, timed=True):.1%}"
                f" ({ceiling_of(args, name, capacity, load, timed=False):.1%} with every reply"
                " cached before the next turn):\n"
            )
            lines += group_table(args, runs, args.window, rng)
    return "\n".join(lines)


def ceiling_of(
    args: argparse.Namespace, name: str, capacity: float, load: float, timed: bool
) -> float:
    """The hit rate the seeds' windows allow at most (``llm_trace.hit_ceiling``), the mean
    over the seeds; ``timed``: a reply cached once the engine could have ended it
    (``fastest_reply``), else before the next request whenever that comes (turns are sent
    on the trace's clock, some before their previous reply could exist)."""
    # The traces the runs used: drawn for the highest load's rate (``bench``).
    horizon = (args.warmup + args.window) * capacity * max(args.load_list)
    ceilings = [
        hit_ceiling(
            make_workload(args, name, seed, horizon),
            capacity * load,
            args.warmup,
            args.window,
            args.block_tokens,
            fastest_reply(args.ttft_base, args.delay) if timed else None,
        )
        for seed in args.seed_list
    ]
    return sum(ceilings) / len(ceilings)


def main() -> None:
    args = parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="llm-routing-"))
    fleet = Fleet(args, args.chosen, tmp)
    try:
        out = trio.run(bench, args, fleet)
    finally:
        fleet.stop()
        if args.keep_tmp:
            print(f"# configs and logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    params = {k: v for k, v in vars(args).items() if k not in ("chosen", "out")}
    meta = host_meta()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "params": params, **out}, indent=1, default=str))
    print(
        f"LLM routing: {args.engines} fake engines x {args.max_running} slots, "
        f"{args.kv_blocks} KV blocks of {args.block_tokens} tokens each; TTFT SLO {args.slo:g} s; "
        f"capacity (round robin, ≥ {args.capacity_share:.0%} within the SLO): "
        + ", ".join(f"{k} {v:.2f} req/s" for k, v in out["capacity"].items())
        + f"; commit {meta['git_commit']}."
    )
    print(report(args, out))
    print(
        "\nRatios are the policy's over round robin's (TTFT: below 1 is better; goodput: above"
        f" 1 is better), with a {args.bootstrap}-round bootstrap's 95 % interval."
    )
    print(f"\nresults: {args.out}")


if __name__ == "__main__":
    main()

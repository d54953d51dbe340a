"""LLM-aware balancing and admission on a multi-tenant chat workload, policy by policy.

Four fake inference engines (``muxproxy fakellm`` with its engine model: ``--max-running``
slots, a prefix KV cache of ``--kv-blocks`` blocks, a prefill cost per uncached prompt
token, and by default its step model, ``--prefill-chunk 512``: continuous batching, where a
cold prompt's prefill stretches the steps of every stream running on its engine; ``0``: each
request prefills on its own, slowing no other) behind one muxproxy, once per balancing
policy, each with fresh processes (cold caches), the same workload, and a load client in this
process (Trio, HTTP/1.1 with h11)::

    python bench/llm_routing.py                       # all six policies, ~8 minutes
    python bench/llm_routing.py --policies 1,5 --duration 30
    python bench/llm_routing.py --pool s0.json s1.json s2.json   # runs of several --seed

One seed's p99 is its two or three slowest requests, and moves with the seed's bursts more
than with the policy: compare policies over several seeds, pooled (``--pool``: each seed's
p99, and the percentiles of all the seeds' requests together, per load and policy variant).

The policies (``--policies``, names or numbers):

1. ``round_robin``    ``balance = "round_robin"``
2. ``least_streams``  ``balance = "least_streams"``
3. ``sticky``         round robin, ``sticky.sources = ["header:X-User"]`` (a user stays put)
4. ``least_load``     ``balance = "least_load"``
5. ``prefix``         ``least_load`` with ``affinity = "prefix"`` (length 1024:
   ``--prefix-length``, load 1.25, ``balance_gap`` a quarter of the engines' slots:
   ``--balance-gap``)
6. ``admission``      5, plus ``max_streams`` = the engines' slots on every server, ``queue``
   and ``load_report`` (the engines' ``/metrics`` every second)

The workload (``chat_client.py``, drawn from ``--seed``): ``--prompts`` system prompts of
``--prompt-bytes`` bytes (~900 tokens each to the engine), with the engines' caches sized to
hold about 6.5 of them (``--kv-blocks`` by default), not all; ``--users`` users, each with
one system prompt (Zipf popularity) and multi-turn conversations that send the whole
history every turn, with mixed ``max_tokens``. Requests arrive as a Poisson process at
``--rate`` (default ``--load`` x the fleet's capacity, which the script computes from the
engine options with every system prompt cached: ``chat_client.engine_capacity``, Little's law
over the engines' slots, where in the step model a step lasts longer the more of the engine's
time goes to prefill); each arrival is a turn of a user drawn at random who is not waiting
for a reply (the next free one if that one is), so at most ``--users`` requests are in
flight. Requests arriving in the first ``--warmup`` seconds warm the caches and are not
counted; those arriving in the next ``--duration`` seconds are, and the run waits at most
``--drain`` seconds for them to end.

Measured per policy, for the counted requests: TTFT (request sent -> first SSE event
carrying content; unfinished requests count with their time so far, a lower bound), the
gaps between content events (ITL), the time to the response head (the fake engine sends
its head at once, so for the proxy's admission this is the time queued), completed
requests/s, refusals (429) and other failures; from the engines' ``/metrics`` (vLLM names,
parsed with prometheus_client) polled every ``--poll`` seconds: the prefix-cache hit rate
over the window (hit tokens / queried tokens, all engines), the requests in each engine
(running + waiting) averaged over time, and the requests each engine served (its
``x-backend-id``); from the proxy's admin ``/metrics``: the p99 of
``muxproxy_queue_wait_seconds`` (the upper bound of its bucket), when it is exported.

Out: a markdown table, the targets and whether each holds, and a JSON file of the raw
results (``--out``; every counted request's record). Every process it starts is stopped at
the end, also on errors (by PID).
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
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from chat_client import (
    NET_ERRORS,
    TOKEN_BYTES,
    HttpConn,
    Outcome,
    User,
    capacity,
    make_users,
    service_seconds,
    system_prompts,
    turn,
)
from llm_load import pair
from prometheus_client.parser import text_string_to_metric_families
from sse_bench import (
    HERE,
    ROOT,
    Proc,
    fmt,
    free_port,
    host_meta,
    markdown_header,
    split_cpus,
    wait_listening,
)
from sse_client import proc_cpu, self_cpu, summary_ms, system_cpu

QUEUE_WAIT = "muxproxy_queue_wait_seconds"
"""The proxy's admission-queue wait histogram (admin ``/metrics``)."""
ENGINE_SERIES = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_usage": "vllm:kv_cache_usage_perc",
    "queries": "vllm:prefix_cache_queries_total",
    "hits": "vllm:prefix_cache_hits_total",
}


@dataclass(frozen=True)
class Policy:
    name: str
    label: str
    toml: str
    """The group's balancing keys, as they stand in ``[upstreams.engines]``
    (``$queue_timeout``: ``--queue-timeout``)."""
    admission: bool = False
    """Give every server ``max_streams`` = the engines' slots."""


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
]
BY_NAME = {p.name: p for p in POLICIES}


def proxy_config(
    policy: Policy, args: argparse.Namespace, listen: int, admin: int, engines: list[int]
) -> str:
    limit = f", max_streams = {args.max_running}" if policy.admission else ""
    servers = ",\n".join(f'  {{ address = "127.0.0.1:{port}"{limit} }}' for port in engines)
    group = string.Template(policy.toml).substitute(queue_timeout=f"{args.queue_timeout:g}")
    if 'affinity = "prefix"' in group:
        options = [f"balance_gap = {args.balance_gap}"] if args.balance_gap else []
        if args.prefix_length is not None:
            options.append(f"length = {args.prefix_length}")
        if args.load_factor is not None:
            options.append(f"load_factor = {args.load_factor:g}")
        if options:
            group += f"\nprefix = {{ {', '.join(options)} }}"
    return (
        f'[[listeners]]\naddress = "127.0.0.1:{listen}"\n\n'
        f'[admin]\naddress = "127.0.0.1:{admin}"\n\n'
        # Unfinished streams at the end of a run need not keep the proxy up.
        "[timeouts]\nshutdown_grace = 1\n\n"
        '[log]\naccess = "off"\n\n'
        f"[upstreams.engines]\nservers = [\n{servers},\n]\n{group}\n\n"
        '[[routes]]\nprefix = "/"\nupstream = "engines"\n'
    )


# --- one policy --------------------------------------------------------------------------------


@dataclass
class Run:
    """What one policy's load run collects."""

    outcomes: list[Outcome] = field(default_factory=list)
    gaps: array[int] = field(default_factory=lambda: array("q"))
    samples: list[tuple[float, list[dict[str, float]]]] = field(default_factory=list)
    """(seconds after the start, per engine: ENGINE_SERIES values), every ``--poll`` s."""
    dropped: int = 0
    """Arrivals that found every user waiting for a reply."""
    pending: int = 0
    window_over: bool = False
    all_done: trio.Event = field(default_factory=trio.Event)
    send_lag_max_s: float = 0.0

    def counted_ended(self) -> None:
        self.pending -= 1
        if self.pending == 0 and self.window_over:
            self.all_done.set()


def engine_values(text: str) -> dict[str, float]:
    """The ENGINE_SERIES of one engine's ``/metrics``, summed over label sets."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return {key: values.get(name, 0.0) for key, name in ENGINE_SERIES.items()}


def histogram(text: str, name: str) -> dict[float, float] | None:
    """Cumulative bucket counts (upper bound -> count, summed over label sets) of ``name``."""
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name + "_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
    return buckets or None


def histogram_quantile(
    before: dict[float, float] | None, after: dict[float, float] | None, q: float
) -> tuple[float | None, float]:
    """(upper bound of the bucket holding quantile ``q`` of what was observed between two
    snapshots, observations); (None, 0) without observations or without the histogram."""
    if after is None:
        return None, 0.0
    delta = {le: count - (before or {}).get(le, 0.0) for le, count in sorted(after.items())}
    total = delta.get(math.inf, 0.0)
    if total <= 0:
        return None, 0.0
    for le, count in delta.items():
        if count >= q * total:
            return le, total
    return math.inf, total


async def poll_engines(ports: list[int], run: Run, t0: float, interval: float) -> None:
    conns = [HttpConn(port) for port in ports]
    while True:
        try:
            values = [engine_values((await c.get(b"/metrics")).decode()) for c in conns]
            run.samples.append((trio.current_time() - t0, values))
        except NET_ERRORS:
            for c in conns:
                await c.close()
        await trio.sleep(interval)


async def proxy_metrics(admin_port: int) -> str:
    """The proxy's admin ``/metrics`` ("" if it cannot be read), on a connection of its own:
    the admin server closes idle keep-alive connections within seconds."""
    admin = HttpConn(admin_port)
    try:
        return (await admin.get(b"/metrics")).decode()
    except NET_ERRORS:
        return ""
    finally:
        await admin.close()


class CpuMeter:
    """CPU used by the processes we started, by this process and by the whole machine."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids = pids
        self.start: dict[str, float] = {}

    def read(self) -> dict[str, float]:
        busy, total = system_cpu()
        return {
            **{who: proc_cpu(pids) for who, pids in self.pids.items()},
            "client": self_cpu(),
            "machine_busy": busy,
            "machine_total": total,
            "wall": time.monotonic(),
        }

    def begin(self) -> None:
        self.start = self.read()

    def percent(self) -> dict[str, float]:
        """Percent of one core since ``begin()``; ``machine``: of all its cores."""
        now = self.read()
        used = {who: now[who] - self.start[who] for who in now}
        wall, total, busy = used.pop("wall"), used.pop("machine_total"), used.pop("machine_busy")
        out = {who: round(100 * cpu / wall, 1) for who, cpu in used.items()}
        out["machine"] = round(100 * busy / total, 1) if total else 0.0
        return out


async def drive(args: argparse.Namespace, users: list[User], fleet: Fleet) -> dict[str, Any]:
    """The load of one policy: arrivals for warm-up + window, then the drain."""
    run = Run()
    rng = random.Random(args.seed + 3)
    for user in users:
        user.conn = HttpConn(fleet.port)
    end = args.warmup + args.duration
    cpu = CpuMeter(fleet.pids())
    queue_before: list[dict[float, float] | None] = [None]

    async def window_start() -> None:
        await trio.sleep_until(t0 + args.warmup)
        cpu.begin()
        queue_before[0] = histogram(await proxy_metrics(fleet.admin), QUEUE_WAIT)

    async with trio.open_nursery() as nursery:
        t0 = trio.current_time()
        nursery.start_soon(poll_engines, fleet.engine_ports, run, t0, args.poll)
        nursery.start_soon(window_start)
        at = rng.expovariate(args.rate)
        while at < end:
            pick = rng.randrange(len(users))
            await trio.sleep_until(t0 + at)
            run.send_lag_max_s = max(run.send_lag_max_s, trio.current_time() - t0 - at)
            order = users[pick:] + users[:pick]
            free = next((u for u in order if not u.busy), None)
            counted = at >= args.warmup
            if free is None:
                run.dropped += counted
            else:
                free.busy = True
                outcome = Outcome(at=at, user=free.uid, prompt=free.prompt_index)
                if counted:
                    run.outcomes.append(outcome)
                    run.pending += 1
                    nursery.start_soon(turn, free, args, outcome, run.gaps, run.counted_ended)
                else:
                    nursery.start_soon(turn, free, args, outcome, None, lambda: None)
            at += rng.expovariate(args.rate)
        await trio.sleep_until(t0 + end)
        run.window_over = True
        window = [s for s in run.samples if s[0] >= args.warmup]
        cpu_pct = cpu.percent()
        if run.pending:
            with trio.move_on_after(args.drain):
                await run.all_done.wait()
        queue_after = histogram(await proxy_metrics(fleet.admin), QUEUE_WAIT)
        nursery.cancel_scope.cancel()
    for user in users:
        if user.conn is not None:
            await user.conn.close()
    queue_p99, queued = histogram_quantile(queue_before[0], queue_after, 0.99)
    return {
        **summarize(args, run, window, len(fleet.engine_ports)),
        "queue_wait_p99_s": queue_p99,
        "queue_waits_observed": queued,
        "cpu_pct": cpu_pct,
    }


def share(values: list[float]) -> float | None:
    """max / mean of the per-engine values; None when all are 0."""
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else None


def time_means(
    window: list[tuple[float, list[dict[str, float]]]], engines: int, *keys: str
) -> list[float]:
    """Per engine: the sum of ``keys`` averaged over the samples (taken every ``--poll`` s)."""
    if not window:
        return []
    return [
        sum(sum(values[k][key] for key in keys) for _, values in window) / len(window)
        for k in range(engines)
    ]


def summarize(
    args: argparse.Namespace,
    run: Run,
    window: list[tuple[float, list[dict[str, float]]]],
    engines: int,
) -> dict[str, Any]:
    outs = run.outcomes
    ns = 1_000_000_000
    results: dict[str, int] = {}
    for o in outs:
        results[o.result] = results.get(o.result, 0) + 1
    ok = [o for o in outs if o.result == "ok"]
    # A request cut before its first token (or head) has waited at least this long so far:
    # it counts with that, a lower bound. Refusals and errors have no first token.
    waited = ("ok", "unfinished", "timeout", "short")
    ttft = [
        int((o.ttft_s if o.ttft_s is not None else o.e2e_s or 0.0) * ns)
        for o in outs
        if o.result in waited
    ]
    heads = [int((o.head_s if o.head_s is not None else o.e2e_s or 0.0) * ns) for o in outs]
    served = {f"e{k}": 0 for k in range(engines)}
    for o in ok:
        served[o.engine] = served.get(o.engine, 0) + 1
    hit_rate = None
    if len(window) >= 2:
        first, last = window[0][1], window[-1][1]
        queries = sum(b["queries"] - a["queries"] for a, b in zip(first, last, strict=True))
        hits = sum(b["hits"] - a["hits"] for a, b in zip(first, last, strict=True))
        hit_rate = hits / queries if queries else None
    in_engine = time_means(window, engines, "running", "waiting")
    running = time_means(window, engines, "running")
    return {
        "offered_per_s": args.rate,
        "duration_s": args.duration,
        "arrivals": len(outs),
        "dropped_all_users_busy": run.dropped,
        "results": results,
        "completed_per_s": len(ok) / args.duration,
        "refused_429": results.get("http_429", 0),
        "ttft_ms": summary_ms(ttft),
        "itl_ms": summary_ms(run.gaps),
        "head_ms": summary_ms(heads),
        "e2e_ms": summary_ms([int(o.e2e_s * ns) for o in ok if o.e2e_s is not None]),
        "kv_hit_rate": hit_rate,
        "served_per_engine": served,
        "served_max_over_mean": share([float(v) for v in served.values()]),
        "in_engine_mean": [round(v, 2) for v in in_engine],
        "in_engine_max_over_mean": share(in_engine),
        "running_mean": [round(v, 2) for v in running],
        "send_lag_max_ms": round(run.send_lag_max_s * 1000, 1),
        "requests": [vars(o) for o in outs],
    }


class Fleet:
    """The engines and the proxy of one policy, listening; ``stop()`` ends each (by PID)."""

    def __init__(self, args: argparse.Namespace, policy: Policy, tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        options = {
            "--max-running": args.max_running,
            "--kv-blocks": args.kv_blocks,
            "--block-tokens": args.block_tokens,
            "--ttft-base": args.ttft_base,
            "--prefill-per-token": args.prefill_per_token,
            "--delay": args.delay,
        }
        if args.prefill_chunk:
            options["--prefill-chunk"] = args.prefill_chunk
        engine_argv = [str(part) for option in options.items() for part in option]
        command = [sys.executable, "-m", "muxproxy"]  # -m: the package of this checkout (cwd)
        self.engines: list[Proc] = []
        self.procs: list[Proc] = []
        try:
            for k in range(args.engines):
                port = free_port()
                argv = [*command, "fakellm", "--port", str(port), "--id", f"e{k}", *engine_argv]
                self.engines.append(Proc(f"e{k}", argv, tmp / f"e{k}.log", port, cwd=ROOT))
                self.procs.append(self.engines[-1])
            self.engine_ports = [engine.port for engine in self.engines]
            self.port, self.admin = free_port(), free_port()
            config = tmp / "muxproxy.toml"
            config.write_text(proxy_config(policy, args, self.port, self.admin, self.engine_ports))
            argv = [*command, "serve", "--config", str(config)]
            log = tmp / "muxproxy.log"
            self.proxy = Proc("muxproxy", argv, log, self.port, cwd=ROOT, cpus=args.proxy_cpu_set)
            self.procs.append(self.proxy)
            for proc in self.procs:
                wait_listening(proc.port, proc.proc)
        except BaseException:
            self.stop()
            raise

    def pids(self) -> dict[str, list[int]]:
        return {"proxy": [self.proxy.pid], "engines": [engine.pid for engine in self.engines]}

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def run_policy(
    args: argparse.Namespace, policy: Policy, prompts: list[str], tmp: Path
) -> dict[str, Any]:
    """One policy on fresh processes (cold caches) and fresh users (the same workload)."""
    fleet = Fleet(args, policy, tmp / policy.name)
    try:
        result = trio.run(drive, args, make_users(args, prompts), fleet)
        exited = {p.name: p.log_tail() for p in fleet.procs if not p.alive()}
        if exited:
            print(f"#   ERROR {policy.name}: exited during the run: {exited}", file=sys.stderr)
            result["exited"] = exited
    finally:
        fleet.stop()
    return {"policy": policy.name, "label": policy.label, **result}


# --- the table ---------------------------------------------------------------------------------


def pair_ms(summary: dict[str, float], a: str, b: str) -> str:
    if not summary.get("count"):
        return "-"
    return f"{summary[a]:,.0f} / {summary[b]:,.0f}"


def table(runs: list[dict[str, Any]]) -> str:
    cols = [
        "policy",
        "offered (arrived) req/s",
        "completed req/s",
        "TTFT p50 / p99 (ms)",
        "ITL p99 (ms)",
        "KV hit rate",
        "served max/mean",
        "in engine max/mean",
        "429",
        "unfinished",
        "queue wait p99 (s)",
        "head p99 (ms)",
    ]
    lines = markdown_header(cols)
    for r in runs:
        q = r["queue_wait_p99_s"]
        cells = [
            f"{POLICIES.index(BY_NAME[r['policy']]) + 1}. {r['label']}",
            f"{r['offered_per_s']:.2f} ({r['arrivals'] / r['duration_s']:.2f})",
            f"{r['completed_per_s']:.2f}",
            pair_ms(r["ttft_ms"], "p50", "p99"),
            fmt(r["itl_ms"].get("p99"), ".0f"),
            fmt(r["kv_hit_rate"], ".1%"),
            fmt(r["served_max_over_mean"], ".2f"),
            fmt(r["in_engine_max_over_mean"], ".2f"),
            str(r["refused_429"]),
            str(r["results"].get("unfinished", 0) + r["results"].get("timeout", 0)),
            "-" if q is None else f"≤ {q:g}",
            fmt(r["head_ms"].get("p99"), ",.0f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for r in runs:
        cpu = r["cpu_pct"]
        note = (
            f"{r['policy']}: CPU (% of a core) proxy {cpu['proxy']:.0f}, engines "
            f"{cpu['engines']:.0f}, client {cpu['client']:.0f}; machine {cpu['machine']:.0f} % busy"
        )
        if r["send_lag_max_ms"] > 50 or r["dropped_all_users_busy"]:
            note += (
                f"; ⚠ not quite open loop: a request sent up to {r['send_lag_max_ms']:.0f} ms "
                f"late, {r['dropped_all_users_busy']} arrivals found every user busy"
            )
        failures = {k: v for k, v in r["results"].items() if k != "ok"}
        if failures:
            note += f"; not ok: {failures}"
        if r.get("exited"):
            note += f"; ⚠ exited during the run: {sorted(r['exited'])}"
        lines.append(f"- {note}")
    return "\n".join(lines)


def targets(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    by = {r["policy"]: r for r in runs}
    out = []
    rr, px, adm = by.get("round_robin"), by.get("prefix"), by.get("admission")
    if rr and px and rr["ttft_ms"].get("count") and px["ttft_ms"].get("count"):
        ratio = rr["ttft_ms"]["p99"] / px["ttft_ms"]["p99"]
        out.append(
            f"- least load + prefix cuts TTFT p99 >= 2x against round robin: "
            f"{rr['ttft_ms']['p99']:,.0f} -> {px['ttft_ms']['p99']:,.0f} ms ({ratio:.2f}x): "
            f"{'holds' if ratio >= 2 else 'does not hold'}"
        )
    else:
        out.append("- TTFT p99 target: not measured (needs policies round_robin and prefix)")
    if px:
        for key, what in (
            ("served_max_over_mean", "requests served"),
            ("in_engine_max_over_mean", "requests in the engine, time-averaged"),
        ):
            v = px[key]
            verdict = "not measured" if v is None else ("holds" if v <= 1.3 else "does not hold")
            out.append(
                f"- least load + prefix: no engine above 1.3x the mean load ({what}): "
                f"{fmt(v, '.2f')}x: {verdict}"
            )
    if adm:
        q = adm["queue_wait_p99_s"]
        cut = adm["results"].get("unfinished", 0) + adm["results"].get("timeout", 0)
        if q is None:
            head = adm["head_ms"].get("p99")
            bound = f"not exported; time to the response head p99 {fmt(head, ',.0f')} ms"
            holds = head is not None and head / 1000 <= args.queue_timeout and not cut
        else:
            bound = f"p99 queue wait ≤ {q:g} s"
            holds = q <= args.queue_timeout and not cut
        out.append(
            f"- admission: no request waits unboundedly (p99 queue wait <= "
            f"{args.queue_timeout:g} s, none unfinished): {bound}, {adm['refused_429']} "
            f"refused (429), {cut} unfinished: {'holds' if holds else 'does not hold'}"
        )
    return out


# --- pooling runs of several seeds ------------------------------------------------------------


def waited_ns(run: dict[str, Any]) -> list[int]:
    """A run's TTFTs (ns) counted as ``summarize`` counts them: a request cut before its
    first token with its time so far; refusals and errors left out."""
    ns = 1_000_000_000
    return [
        int((r["ttft_s"] if r["ttft_s"] is not None else r["e2e_s"] or 0.0) * ns)
        for r in run["requests"]
        if r["result"] in ("ok", "unfinished", "timeout", "short")
    ]


def variant_of(run: dict[str, Any], params: dict[str, Any]) -> tuple[str, str]:
    """(policy name, the label of its variant) of a run, from the parameters it ran with."""
    label = f"{POLICIES.index(BY_NAME[run['policy']]) + 1}. {run['label']}"
    if run["policy"] in ("prefix", "admission") and "balance_gap" in params:
        gap = params["balance_gap"]
        label += f", balance_gap {gap}" if gap else ", balance_gap unset"
        if params.get("prefix_length") is not None:
            label += f", length {params['prefix_length']}"
    return run["policy"], label


def pooled(files: list[Path]) -> str:
    """Per load and policy variant, each seed's TTFT p99 and the pooled percentiles of all
    their requests, then the p99 cut against round robin over the same seeds."""
    groups: dict[tuple[float, str], dict[str, Any]] = {}
    for path in files:
        data = json.loads(path.read_text())
        params = data["params"]
        load = round(params["rate"] / params["capacity"], 2)
        for run in data["runs"]:
            policy, label = variant_of(run, params)
            group = groups.setdefault(
                (load, label), {"policy": policy, "label": label, "load": load, "seeds": {}}
            )
            if params["seed"] in group["seeds"]:
                raise SystemExit(f"{path}: seed {params['seed']} of {label!r} given twice")
            group["seeds"][params["seed"]] = run
    cols = ["load", "policy", "seeds", "TTFT p99 by seed (ms)", "pooled p50 / p90 / p99 (ms)"]
    cols += ["requests", "KV hit rate", "in engine max/mean"]
    lines = markdown_header(cols)
    order = sorted(groups.values(), key=lambda g: (g["load"], POLICIES.index(BY_NAME[g["policy"]])))
    for g in order:
        seeds = sorted(g["seeds"])
        runs = [g["seeds"][k] for k in seeds]
        every = summary_ms([t for r in runs for t in waited_ns(r)])
        hits = [r["kv_hit_rate"] for r in runs if r["kv_hit_rate"] is not None]
        loads = [r["in_engine_max_over_mean"] for r in runs if r["in_engine_max_over_mean"]]
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{g['load']:g}",
                    g["label"],
                    ",".join(map(str, seeds)),
                    ", ".join(f"{r['ttft_ms'].get('p99', 0):,.0f}" for r in runs),
                    f"{every['p50']:,.0f} / {every['p90']:,.0f} / {every['p99']:,.0f}",
                    str(every["count"]),
                    f"{min(hits):.0%}-{max(hits):.0%}" if hits else "-",
                    f"{min(loads):.2f}-{max(loads):.2f}" if loads else "-",
                ]
            )
            + " |"
        )
    lines.append("")
    for g in order:
        base = groups.get((g["load"], f"1. {BY_NAME['round_robin'].label}"))
        if base is None or g["policy"] == "round_robin":
            continue
        seeds = sorted(set(g["seeds"]) & set(base["seeds"]))
        if not seeds:
            continue
        p99 = [
            summary_ms([t for k in seeds for t in waited_ns(x["seeds"][k])])["p99"]
            for x in (base, g)
        ]
        lines.append(
            f"- load {g['load']:g}, {g['label']}: TTFT p99 against round robin over seeds "
            f"{','.join(map(str, seeds))}: {p99[0]:,.0f} -> {p99[1]:,.0f} ms "
            f"({p99[0] / p99[1]:.2f}x; target 2x)"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--policies",
        default=",".join(p.name for p in POLICIES),
        help="comma-separated names or numbers 1-6 (default: all)",
    )
    parser.add_argument("--duration", type=float, default=50.0, help="counted window (s)")
    parser.add_argument("--warmup", type=float, default=10.0, help="arrivals not counted (s)")
    parser.add_argument(
        "--drain",
        type=float,
        default=30.0,
        help="most seconds to wait for counted requests after the window",
    )
    parser.add_argument("--rate", type=float, help="requests/s (default: --load x capacity)")
    parser.add_argument("--load", type=float, default=0.9, help="fraction of the capacity")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=20, help="distinct system prompts")
    parser.add_argument("--prompt-bytes", type=int, default=3600, help="bytes per system prompt")
    parser.add_argument("--zipf", type=float, default=0.8, help="popularity exponent of prompts")
    parser.add_argument("--turns", type=pair(int), default=(1, 5), help="MIN,MAX per chat")
    parser.add_argument(
        "--user-bytes",
        type=pair(int),
        default=(100, 400),
        help="MIN,MAX bytes per user message",
    )
    parser.add_argument(
        "--tokens", type=pair(int), default=(16, 256), help="MIN,MAX max_tokens per request"
    )
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--poll", type=float, default=0.5, help="engine /metrics period (s)")
    engine = parser.add_argument_group("the engines (muxproxy fakellm)")
    engine.add_argument("--engines", type=int, default=4)
    engine.add_argument("--max-running", type=int, default=8)
    engine.add_argument(
        "--kv-blocks", type=int, help="default: 6.5 system prompts' worth of blocks"
    )
    engine.add_argument("--block-tokens", type=int, default=16)
    engine.add_argument("--ttft-base", type=float, default=0.005)
    engine.add_argument("--prefill-per-token", type=float, default=0.00075)
    engine.add_argument(
        "--delay", type=float, default=0.02, help="seconds between tokens (a step's decode)"
    )
    engine.add_argument(
        "--prefill-chunk",
        type=int,
        default=512,
        metavar="N",
        help="the engines' step model: prefill tokens per step (0: private prefill, no batching)",
    )
    parser.add_argument("--queue-timeout", type=float, default=30.0, help="policy 6's queue")
    parser.add_argument(
        "--load-factor",
        type=float,
        help="prefix.load_factor of policies 5 and 6 (default: the proxy's, 1.25)",
    )
    parser.add_argument(
        "--prefix-length",
        type=int,
        help="prefix.length of policies 5 and 6 (default: the proxy's, 1024 bytes)",
    )
    parser.add_argument(
        "--balance-gap",
        type=int,
        help="prefix.balance_gap of policies 5 and 6 (default: a quarter of --max-running;"
        " 0: unset, the load_factor bound alone)",
    )
    parser.add_argument(
        "--proxy-cpus",
        help="comma-separated CPUs for the proxy; the rest (engines, this client) on the others",
    )
    parser.add_argument("--out", type=Path, help="JSON results (default: bench/results/...)")
    parser.add_argument(
        "--pool",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="run nothing: pool the results of earlier runs (one per seed) and print each"
        " seed's p99 and the pooled percentiles per load and policy",
    )
    parser.add_argument("--keep-tmp", action="store_true", help="keep configs and logs")
    args = parser.parse_args()
    args.proxy_cpu_set = split_cpus(parser, args.proxy_cpus)
    if args.prefill_chunk < 0:
        parser.error(f"--prefill-chunk: expected 0 (no steps) or more, got {args.prefill_chunk}")
    chosen = []
    for item in filter(None, (s.strip() for s in args.policies.split(","))):
        policy = (
            POLICIES[int(item) - 1] if item.isdigit() and 1 <= int(item) <= 6 else BY_NAME.get(item)
        )
        if policy is None:
            parser.error(f"--policies: unknown {item!r}; choose from 1-6 or {list(BY_NAME)}")
        chosen.append(policy)
    args.chosen = chosen
    if args.balance_gap is None:
        args.balance_gap = max(args.max_running // 4, 1)
    if args.balance_gap < 0:
        parser.error(f"--balance-gap: expected 0 (unset) or more, got {args.balance_gap}")
    if args.kv_blocks is None:
        args.kv_blocks = round(6.5 * args.prompt_bytes / TOKEN_BYTES / args.block_tokens)
    args.capacity = capacity(args)
    if args.rate is None:
        args.rate = round(args.load * args.capacity, 2)
    if args.out is None:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        args.out = HERE / "results" / f"llm-routing-{stamp}.json"
    return args


def main() -> None:
    args = parse_args()
    if args.pool:
        print(pooled(args.pool))
        return
    prompts = system_prompts(args.prompts, args.prompt_bytes, args.seed)
    system_tokens = args.prompt_bytes // TOKEN_BYTES
    model = f"steps of {args.prefill_chunk} prefill tokens" if args.prefill_chunk else "no steps"
    print(
        f"# {args.engines} engines x {args.max_running} slots, {model}, {args.kv_blocks} KV blocks "
        f"of {args.block_tokens} tokens (~{args.kv_blocks * args.block_tokens / system_tokens:.1f}"
        f" system prompts); capacity {args.capacity:.2f} req/s (mean slot time "
        f"{service_seconds(args):.2f} s; {capacity(args, system_tokens):.2f} req/s with no "
        f"system prompt cached); offered {args.rate:.2f} req/s",
        file=sys.stderr,
    )
    tmp = Path(tempfile.mkdtemp(prefix="llm-routing-"))
    runs = []
    try:
        for policy in args.chosen:
            print(
                f"# {policy.name}: {args.warmup:g} s warm-up, {args.duration:g} s counted",
                file=sys.stderr,
            )
            runs.append(run_policy(args, policy, prompts, tmp))
    finally:
        if args.keep_tmp:
            print(f"# configs and logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    params = {k: v for k, v in vars(args).items() if k not in ("chosen", "proxy_cpu_set", "out")}
    meta = host_meta()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"meta": meta, "params": params, "runs": runs}, indent=1, default=str)
    )
    print(
        f"LLM routing: {args.engines} fake engines, {args.users} users, {args.prompts} system "
        f"prompts, {args.rate:.2f} req/s offered ({args.rate / args.capacity:.0%} of "
        f"{args.capacity:.2f}), {args.duration:g} s counted after {args.warmup:g} s warm-up; "
        f"commit {meta['git_commit']}.\n"
    )
    print(table(runs))
    print()
    print("\n".join(targets(runs, args)))
    print(f"\nresults: {args.out}")


if __name__ == "__main__":
    main()

"""A fleet on one machine: three muxproxy replicas, Redis, a DNS server and fake GPU engines.

    python examples/fleet.py                 # needs: pip install '.[test]' (dnslib), redis-server

It starts a ``redis-server`` (the fleet store), a DNS server (``muxproxy.testing.dnsserver``)
whose SRV records name four fake engines (two serving model "v1", two "v2"), and three ``muxproxy
serve`` replicas that discover the engines in that DNS and share one runtime state, one memory
of sessions and one set of budgets through Redis (``[fleet] store``, ``docs/fleet.md``). Then
it runs a gray release while multi-turn conversations stream, each turn sent to the next
replica (as a Service in front of them would spread them):

1. one ``muxproxy admin weights`` call per step, each on another replica: v2's share of new
   conversations 0 -> 25 -> 50 -> 100 %; the time until every replica applied it is printed;
2. half way, a fifth engine is added to the DNS answer (the engines scaled up): every replica
   finds it and ramps it in over ``slow_start``.

At the end it prints, per step, where new conversations landed, and per replica what it
served; it exits 0 when no turn failed and no conversation changed server while it was up.
Everything listens on 127.0.0.1 (free ports); every process it starts is stopped on exit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from muxproxy.testing.dnsserver import DnsServer, dns_server

TOKEN = "fleet-example-token"
SERVICE = "_http._tcp.engines.fleet.test"
REPLICAS = 3
STEPS = [(4, 0), (3, 1), (2, 2), (0, 4)]
"""(v1 weight, v2 weight) per step: v2's share 0, 25, 50, 100 %."""
TOKENS = 6


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@attrs.define
class Engine:
    name: str
    version: str
    port: int = attrs.field(factory=free_port)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@attrs.define
class Replica:
    number: int
    port: int = attrs.field(factory=free_port)
    admin: int = attrs.field(factory=free_port)
    turns: int = 0
    failed: int = 0
    final: dict[str, Any] = attrs.Factory(dict)
    """Its ``/status`` at the end."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin}"


@attrs.define
class Turn:
    conversation: str
    step: int
    replica: int
    backend: str
    version: str
    ok: bool


def config_text(replica: Replica, dns: DnsServer, redis_port: int) -> str:
    return f"""
[[listeners]]
address = "127.0.0.1:{replica.port}"

[admin]
address = "127.0.0.1:{replica.admin}"
token = "{TOKEN}"

[resolver]
nameservers = ["{dns.nameserver}"]
timeout = 1

[fleet]
store = "redis://127.0.0.1:{redis_port}/0"
sync_interval = 2

[upstreams.gpus]
discover = {{ srv = "{SERVICE}", interval = 1 }}
slow_start = 3

[upstreams.gpus.sticky]
sources = ["header:X-Chat-ID"]

[[routes]]
prefix = "/"
upstream = "gpus"
"""


@contextmanager
def process(command: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield child
    finally:
        child.terminate()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def publish(dns: DnsServer, engines: list[Engine]) -> None:
    """The DNS answer: one SRV record per engine, each target's A record."""
    for engine in engines:
        dns.set_a(f"{engine.name}.fleet.test", ["127.0.0.1"], ttl=1)
    dns.set_srv(SERVICE, [(0, 1, e.port, f"{e.name}.fleet.test") for e in engines], ttl=1)


async def status(client: httpx.AsyncClient, replica: Replica) -> dict[str, Any]:
    response = await client.get(f"{replica.admin_url}/status")
    response.raise_for_status()
    document: dict[str, Any] = response.json()
    return document


async def wait_until(what: str, check: Any, timeout: float = 20.0) -> float:
    """Poll ``check()`` until true; the seconds it took."""
    start = trio.current_time()
    with trio.move_on_after(timeout):
        while not await check():
            await trio.sleep(0.005)
        return trio.current_time() - start
    raise SystemExit(f"fleet: {what} did not happen within {timeout:g} s")


def servers(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["address"]: s for s in document["groups"]["gpus"]["servers"]}


async def weights_step(
    client: httpx.AsyncClient, replicas: list[Replica], via: Replica, weights: dict[str, int]
) -> None:
    """One ``muxproxy admin weights`` call on ``via``; then wait until every replica has it."""
    pairs = [f"{address}={weight}" for address, weight in weights.items()]
    command = [sys.executable, "-m", "muxproxy", "admin", "--url", via.admin_url]
    command += ["--token", TOKEN, "weights", "gpus", *pairs]
    started = trio.current_time()
    result = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    answered = trio.current_time() - started
    if result.returncode != 0:
        raise SystemExit(f"fleet: {' '.join(command[3:])} failed: {result.stderr.decode()}")
    version = (await status(client, via))["fleet"]["version"]
    print(f"  replica {via.number}: muxproxy admin weights gpus {' '.join(pairs)}")
    print(f"    answered in {answered * 1000:.0f} ms (the CLI's start included): version {version}")
    for other in replicas:
        if other is via:
            continue

        async def applied(other: Replica = other) -> bool:
            document = await status(client, other)
            return bool(document["fleet"]["version"] >= version)

        took = await wait_until(f"replica {other.number} applying version {version}", applied)
        print(f"    replica {other.number} applied it {took * 1000:.0f} ms after the answer")


async def turn(
    client: httpx.AsyncClient, replica: Replica, conversation: str, step: int, turns: list[Turn]
) -> None:
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-chat-id": conversation}
    backend = version = "none"
    ok = False
    try:
        async with client.stream(
            "POST", f"{replica.url}/v1/chat/completions", json=body, headers=headers
        ) as response:
            backend = response.headers.get("x-backend-id", "none")
            version = response.headers.get("x-model-version", "none")
            text = (await response.aread()).decode()
            chunks = [line for line in text.splitlines() if line.startswith("data: {")]
            ok = response.status_code == 200 and len(chunks) >= TOKENS and "[DONE]" in text
    except httpx.HTTPError:
        ok = False
    replica.turns += 1
    replica.failed += not ok
    turns.append(Turn(conversation, step, replica.number, backend, version, ok))


async def converse(
    client: httpx.AsyncClient,
    replicas: list[Replica],
    conversation: str,
    step: int,
    first: int,
    turns: list[Turn],
) -> None:
    """Three turns, each to the next replica, a little apart (a user reads the answer)."""
    for number in range(3):
        await turn(client, replicas[(first + number) % len(replicas)], conversation, step, turns)
        await trio.sleep(0.4)


async def gray_release(
    dns: DnsServer,
    engines: list[Engine],
    later: Engine,
    replicas: list[Replica],
    conversations: int,
) -> int:
    turns: list[Turn] = []
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        for engine in [*engines, later]:

            async def up(engine: Engine = engine) -> bool:
                try:
                    response = await client.get(f"http://{engine.address}/health")
                except httpx.HTTPError:
                    return False
                return response.status_code == 200

            await wait_until(f"engine {engine.name} answering", up)
        for replica in replicas:

            async def discovered(replica: Replica = replica) -> bool:
                try:
                    return len(servers(await status(client, replica))) == len(engines)
                except httpx.HTTPError:
                    return False

            # A start-up bound (three processes import and bind at once; a busy host is slow).
            await wait_until(
                f"replica {replica.number} discovering the engines", discovered, timeout=60.0
            )
        print(f"every replica discovered the {len(engines)} engines in {SERVICE}")
        v1 = [e for e in engines if e.version == "v1"]
        v2 = [e for e in engines if e.version == "v2"]
        async with trio.open_nursery() as nursery:
            for step, (w1, w2) in enumerate(STEPS):
                share = 100 * w2 // (w1 + w2)
                print(f"\nstep {step}: v2 gets {share} % of new conversations")
                if step == 2:
                    v2.append(later)  # scaled up at step 1: from now on in the steps
                weights = {e.address: w1 for e in v1} | {e.address: w2 for e in v2}
                await weights_step(client, replicas, replicas[step % REPLICAS], weights)
                for n in range(conversations):
                    nursery.start_soon(
                        converse, client, replicas, f"chat-{step}-{n}", step, n, turns
                    )
                if step == 1:
                    await trio.sleep(0.5)
                    await scale_up(client, dns, [*engines, later], replicas)
                await trio.sleep(1.0)
        for replica in replicas:
            replica.final = await status(client, replica)
    return report(turns, replicas, conversations)


async def scale_up(
    client: httpx.AsyncClient, dns: DnsServer, engines: list[Engine], replicas: list[Replica]
) -> None:
    """A fifth engine (v2c) joins the DNS answer; every replica finds it and ramps it in."""
    new = engines[-1]
    publish(dns, engines)
    print(f"  the engines scaled up: {new.name} ({new.address}) added to {SERVICE}")
    for replica in replicas:

        async def found(replica: Replica = replica) -> bool:
            return new.address in servers(await status(client, replica))

        took = await wait_until(f"replica {replica.number} finding {new.name}", found)
        entry = servers(await status(client, replica))[new.address]
        print(
            f"    replica {replica.number} found it {took * 1000:.0f} ms later; weight"
            f" {entry['weight']}, ramping: effective_weight {entry['effective_weight']:.3f}"
        )


def report(turns: list[Turn], replicas: list[Replica], conversations: int) -> int:
    print("\nstep  new conversations  first turn on v2  (v2's share)")
    for step, (w1, w2) in enumerate(STEPS):
        first_turns: dict[str, Turn] = {}
        for t in turns:
            if t.step == step and t.ok:
                first_turns.setdefault(t.conversation, t)  # a conversation's turns in order
        on_v2 = sum(t.version == "v2" for t in first_turns.values())
        share = 100 * w2 // (w1 + w2)
        print(f"{step:4d}  {len(first_turns):17d}  {on_v2:16d}  ({share} %)")
    print("\nreplica  turns served  failed  fleet version  servers  turns by backend")
    for replica in replicas:
        served = Counter(t.backend for t in turns if t.replica == replica.number)
        shown = ", ".join(f"{name} {count}" for name, count in sorted(served.items()))
        version = replica.final["fleet"]["version"]
        found = len(servers(replica.final))
        print(
            f"{replica.number:7d}  {replica.turns:12d}  {replica.failed:6d}  {version:13d}"
            f"  {found:7d}  {shown}"
        )
    backends: dict[str, set[str]] = {}
    for t in turns:
        if t.ok:
            backends.setdefault(t.conversation, set()).add(t.backend)
    moved = sum(len(seen) > 1 for seen in backends.values())
    failed = sum(not t.ok for t in turns)
    print(f"\nturns: {len(turns)}, failed: {failed}")
    print(f"conversations: {len(backends)}, that changed server while it was up: {moved}")
    expected = len(STEPS) * conversations * 3
    return 0 if failed == 0 and moved == 0 and len(turns) == expected else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=12, help="new ones per step")
    args = parser.parse_args()
    redis = shutil.which("redis-server")
    if redis is None:
        print("fleet: needs redis-server (Debian: apt-get install redis-server)", file=sys.stderr)
        return 1
    engines = [Engine("v1a", "v1"), Engine("v1b", "v1"), Engine("v2a", "v2"), Engine("v2b", "v2")]
    later = Engine("v2c", "v2")
    replicas = [Replica(number) for number in range(1, REPLICAS + 1)]
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="muxproxy-fleet-")))
        redis_port = free_port()
        stack.enter_context(
            process(
                [redis, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", ""],
                work / "redis.log",
            )
        )
        dns = stack.enter_context(dns_server())
        publish(dns, engines)
        for engine in [*engines, later]:
            command = [sys.executable, "-m", "muxproxy", "fakellm", "--port", str(engine.port)]
            command += ["--id", engine.name, "--model-version", engine.version]
            command += ["--tokens", str(TOKENS), "--delay", "0.02"]
            stack.enter_context(process(command, work / f"{engine.name}.log"))
        for replica in replicas:
            path = work / f"replica-{replica.number}.toml"
            path.write_text(config_text(replica, dns, redis_port))
            command = [sys.executable, "-m", "muxproxy", "serve", "--config", str(path)]
            stack.enter_context(process(command, work / f"replica-{replica.number}.log"))
        print(
            f"redis-server on 127.0.0.1:{redis_port}, DNS on {dns.nameserver}, engines"
            f" {', '.join(f'{e.name} ({e.version}) {e.address}' for e in engines)};"
            f" replicas on {', '.join(r.url for r in replicas)}"
        )
        started = time.monotonic()
        code = trio.run(gray_release, dns, engines, later, replicas, args.conversations)
        print(f"\n{time.monotonic() - started:.1f} s; logs were in {work}")
        if code and os.environ.get("MUXPROXY_FLEET_SHOW_LOGS"):
            for log in sorted(work.glob("replica-*.log")):
                print(f"--- {log.name}\n{log.read_text()[-3000:]}")
        return code


if __name__ == "__main__":
    sys.exit(main())

"""End to end: one runtime state for three replicas, through a real ``redis-server``.

Three ``python -m muxproxy serve`` processes (one of them ``--workers 2`` in its own test),
each from its own configuration file with ``[admin]`` and ``[fleet] store``, in front of
``FakeLLM`` backends in this process, share nothing but the Redis of ``tests/services.py``.
What is checked from the outside, through each replica's admin API and proxy listener:

* a weight changed on replica 1 is seen on replicas 2 and 3 within a second (the propagation
  time over 20 changes is measured and printed: p50 and max);
* a group change of several weights (``muxproxy admin weights``) is one version: every
  replica reaches it with every weight, and no replica's status ever shows half of it;
* ``redis-server`` killed while clients stream through every replica: no request fails, the
  replicas say the store is down, admin writes answer 503 with the reason; restarted empty,
  the store is seeded again from the replicas' last state and every replica reconciles;
* a replica of two workers applies a change made elsewhere in both of them.

Every wait is a poll of an observable condition (a status document, a response) under
``trio.fail_after``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import coredis
import httpx
import trio
from processes import ProxyProcess, proxy_process
from prometheus_client.parser import text_string_to_metric_families

from muxproxy.config import ADMIN_TOKEN_ENV
from muxproxy.fleet.state import STATE_KEY, document_from_hash

if TYPE_CHECKING:
    from conftest import StartBackend

    from tests.services import RedisServer

TOKEN = "fleet-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TEST_TIMEOUT = 55
"""Seconds for a whole test: three processes started, then its changes."""
PROPAGATION_LIMIT = 1.0
"""Seconds within which every replica must apply a change made on another."""
CHANGES = 20
STREAM = {
    "model": "fake",
    "messages": [{"role": "user", "content": "tell me a story"}],
    "stream": True,
}
STREAM_HEADERS = {"x-fake-tokens": "12", "x-fake-delay": "0.02"}


def write_config(directory: Path, ports: list[int], store: str) -> Path:
    directory.mkdir()
    servers = ", ".join(f'"127.0.0.1:{port}"' for port in ports)
    path = directory / "muxproxy.toml"
    path.write_text(
        "[[listeners]]\n"
        'address = "127.0.0.1:0"\n'
        "[upstreams.llm]\n"
        f"servers = [{servers}]\n"
        "[admin]\n"
        'address = "127.0.0.1:0"\n'
        f'token = "{TOKEN}"\n'
        f'state_file = "{directory / "state.json"}"\n'
        "[fleet]\n"
        f'store = "{store}"\n'
        "sync_interval = 2\n"
    )
    return path


@attrs.define
class Replica:
    process: ProxyProcess
    directory: Path

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def admin(self) -> str:
        return self.process.admin_url


@asynccontextmanager
async def fleet(
    tmp_path: Path, ports: list[int], store: str, workers: tuple[int, ...] = (1, 1, 1)
) -> AsyncIterator[list[Replica]]:
    """One replica per entry of ``workers`` (its ``--workers``), each with its own file."""
    env = {k: v for k, v in os.environ.items() if k != ADMIN_TOKEN_ENV}
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        replicas = []
        for index, count in enumerate(workers):
            directory = tmp_path / f"replica{index + 1}"
            config = write_config(directory, ports, store)
            flags = ("--workers", str(count)) if count > 1 else ()
            process = await stack.enter_async_context(
                proxy_process(nursery, *flags, config=config, admin=True, env=env)
            )
            replicas.append(Replica(process, directory))
        yield replicas
        await stack.aclose()
        nursery.cancel_scope.cancel()


async def status(client: httpx.AsyncClient, replica: Replica) -> dict[str, Any]:
    response = await client.get(replica.admin + "/status")
    assert response.status_code == 200, response.text
    document: dict[str, Any] = response.json()
    return document


def weights(document: dict[str, Any]) -> dict[str, int]:
    return {s["address"]: s["weight"] for s in document["groups"]["llm"]["servers"]}


async def wait_status(
    client: httpx.AsyncClient, replica: Replica, done: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """Poll ``replica``'s status until ``done`` holds; the document that made it hold."""
    while not done(document := await status(client, replica)):
        await trio.sleep(0.005)
    return document


async def patch(
    client: httpx.AsyncClient, replica: Replica, path: str, body: dict[str, Any]
) -> httpx.Response:
    return await client.patch(replica.admin + path, json=body, headers=AUTH)


async def fleet_ready(client: httpx.AsyncClient, replicas: list[Replica]) -> int:
    """Until every replica has synced with the store; the version they all hold."""
    versions = set()
    for replica in replicas:
        document = await wait_status(client, replica, lambda d: d["fleet"]["up"])
        versions.add(document["fleet"]["version"])
    (version,) = versions
    return version


async def test_a_weight_change_on_one_replica_is_applied_by_the_others_within_a_second(
    start_backend: StartBackend, redis_server: RedisServer, tmp_path: Path
) -> None:
    ports = [(await start_backend(backend_id=f"gpu{i}"))[1] for i in range(2)]
    target = f"127.0.0.1:{ports[0]}"
    path = f"/upstreams/llm/servers/{target}"
    with trio.fail_after(TEST_TIMEOUT):
        async with (
            fleet(tmp_path, ports, redis_server.url) as replicas,
            httpx.AsyncClient(timeout=5) as client,
        ):
            first, *others = replicas
            await fleet_ready(client, replicas)
            delays: list[float] = []
            versions = []
            for change in range(CHANGES):
                weight = 2 + change % 7
                sent = trio.current_time()
                response = await patch(client, first, path, {"weight": weight})
                answered = trio.current_time()
                assert response.status_code == 200, response.text
                assert response.json()["weight"] == weight
                versions.append(response.json()["version"])

                async def seen(
                    replica: Replica, weight: int = weight, answered: float = answered
                ) -> None:
                    await wait_status(client, replica, lambda d: weights(d)[target] == weight)
                    delays.append(trio.current_time() - answered)

                async with trio.open_nursery() as nursery:
                    for replica in others:
                        nursery.start_soon(seen, replica)
                assert answered - sent < PROPAGATION_LIMIT
            for replica in replicas:
                document = await status(client, replica)
                assert document["fleet"]["version"] == versions[-1]
                assert document["fleet"]["store"] == redis_server.url
                assert document["fleet"]["last_error"] is None
            saved = json.loads((others[-1].directory / "state.json").read_text())
    assert versions == list(range(versions[0], versions[0] + CHANGES))  # one version each
    assert [e["weight"] for e in saved["servers"] if e["address"] == target] == [weight]
    p50, top = statistics.median(delays), max(delays)
    print(
        f"\nfleet propagation over {CHANGES} changes x {len(others)} replicas:"
        f" p50 {p50 * 1000:.1f} ms, max {top * 1000:.1f} ms"
    )
    assert top < PROPAGATION_LIMIT


async def test_a_group_change_of_several_weights_is_one_version_on_every_replica(
    start_backend: StartBackend, redis_server: RedisServer, tmp_path: Path
) -> None:
    ports = [(await start_backend(backend_id=f"gpu{i}"))[1] for i in range(3)]
    a, b, c = (f"127.0.0.1:{port}" for port in ports)
    with trio.fail_after(TEST_TIMEOUT):
        async with (
            fleet(tmp_path, ports, redis_server.url) as replicas,
            httpx.AsyncClient(timeout=5) as client,
        ):
            before = await fleet_ready(client, replicas)
            old = {a: 1, b: 1, c: 1}
            new = {a: 3, b: 1, c: 0}
            seen: list[dict[str, int]] = []
            stop = trio.Event()

            async def watch(replica: Replica) -> None:
                while not stop.is_set():
                    document = await status(client, replica)
                    seen.append(weights(document))

            async with trio.open_nursery() as nursery:
                for replica in replicas:
                    nursery.start_soon(watch, replica)
                ran = await run_admin(
                    replicas[1].admin, "weights", "llm", f"{a}=3", f"{b}=1", f"{c}=0"
                )
                assert ran.returncode == 0, ran.stderr
                out = ran.stdout.decode()
                assert f"3 servers changed as one (fleet version {before + 1})" in out
                for replica in replicas:
                    document = await wait_status(
                        client, replica, lambda d: d["fleet"]["version"] == before + 1
                    )
                    assert weights(document) == new
                stop.set()
            # A bad entry refuses the whole change: nothing moves, no version is spent.
            refused = await patch(
                client, replicas[0], "/upstreams/llm", {"weights": {a: 5, "nowhere:1": 2}}
            )
            assert refused.status_code == 404, refused.text
            assert "nowhere:1" in refused.json()["error"]
            document = await status(client, replicas[2])
    assert {tuple(sorted(w.items())) for w in seen} <= {
        tuple(sorted(old.items())),
        tuple(sorted(new.items())),
    }  # never half a step
    assert weights(document) == new and document["fleet"]["version"] == before + 1


async def test_a_dead_store_costs_nothing_but_admin_writes_and_an_empty_one_is_seeded_again(
    start_backend: StartBackend, redis_server: RedisServer, tmp_path: Path
) -> None:
    ports = [(await start_backend(backend_id=f"gpu{i}"))[1] for i in range(2)]
    a, b = (f"127.0.0.1:{port}" for port in ports)
    with trio.fail_after(TEST_TIMEOUT):
        async with (
            fleet(tmp_path, ports, redis_server.url) as replicas,
            httpx.AsyncClient(timeout=10) as client,
        ):
            await fleet_ready(client, replicas)
            response = await patch(client, replicas[0], "/upstreams/llm", {"weights": {a: 4}})
            assert response.status_code == 200, response.text
            version = response.json()["version"]
            for replica in replicas:
                await wait_status(client, replica, lambda d: d["fleet"]["version"] == version)
            done = trio.Event()
            answers: dict[str, list[int]] = {replica.url: [] for replica in replicas}

            async def stream(replica: Replica) -> None:
                while not done.is_set():
                    async with client.stream(
                        "POST",
                        replica.url + "/v1/chat/completions",
                        json=STREAM,
                        headers=STREAM_HEADERS,
                    ) as reply:
                        body = await reply.aread()
                    assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
                    answers[replica.url].append(reply.status_code)

            async with trio.open_nursery() as nursery:
                for replica in replicas:
                    nursery.start_soon(stream, replica)
                at_kill = {url: len(codes) for url, codes in answers.items()}
                await redis_server.kill()
                for replica in replicas:
                    down = await wait_status(client, replica, lambda d: not d["fleet"]["up"])
                    assert down["fleet"]["last_error"]
                    assert weights(down)[a] == 4  # the last state, kept
                    refused = await patch(
                        client, replica, f"/upstreams/llm/servers/{b}", {"weight": 9}
                    )
                    assert refused.status_code == 503, refused.text
                    assert "fleet store" in refused.json()["error"]
                    assert "nothing changed" in refused.json()["error"]
                assert await fleet_metrics(client, replicas[1]) == {
                    "muxproxy_fleet_store_up": 0,
                    "muxproxy_fleet_state_version": version,
                }
                # Streams go on through every replica while the store is down.
                while any(len(answers[url]) < at_kill[url] + 2 for url in answers):
                    await trio.sleep(0.01)
                at_restart = {url: len(codes) for url, codes in answers.items()}
                await redis_server.restart()  # empty: nothing persisted
                for replica in replicas:
                    back = await wait_status(client, replica, lambda d: d["fleet"]["up"])
                    assert back["fleet"]["version"] == version
                    assert weights(back) == {a: 4, b: 1}
                async with coredis.Redis.from_url(redis_server.url) as store:
                    seeded = document_from_hash(await store.hgetall(STATE_KEY))
                assert seeded is not None and seeded.version == version
                assert seeded.state.get("llm", a).weight == 4
                assert (await fleet_metrics(client, replicas[1]))["muxproxy_fleet_store_up"] == 1
                # The fleet takes changes again, and every replica gets them.
                response = await patch(client, replicas[2], "/upstreams/llm", {"weights": {b: 2}})
                assert response.status_code == 200, response.text
                assert response.json()["version"] == version + 1
                for replica in replicas:
                    document = await wait_status(
                        client, replica, lambda d: d["fleet"]["version"] == version + 1
                    )
                    assert weights(document) == {a: 4, b: 2}
                while any(len(answers[url]) <= at_restart[url] for url in answers):
                    await trio.sleep(0.01)
                done.set()
    assert all(code == 200 for codes in answers.values() for code in codes)


async def test_a_replica_of_two_workers_applies_a_change_in_both(
    start_backend: StartBackend, redis_server: RedisServer, tmp_path: Path
) -> None:
    ports = [(await start_backend(backend_id=f"gpu{i}"))[1] for i in range(2)]
    a, b = (f"127.0.0.1:{port}" for port in ports)
    with trio.fail_after(TEST_TIMEOUT):
        async with (
            fleet(tmp_path, ports, redis_server.url, workers=(1, 2)) as replicas,
            httpx.AsyncClient(timeout=5) as client,
        ):
            single, pair = replicas
            await fleet_ready(client, replicas)
            assert len((await status(client, pair))["workers"]) == 2
            assert await backends_of(pair.url, 12) == {"gpu0", "gpu1"}
            response = await patch(client, single, f"/upstreams/llm/servers/{a}", {"weight": 0})
            assert response.status_code == 200, response.text
            await wait_status(client, pair, lambda d: weights(d)[a] == 0)
            # Each connection is new: SO_REUSEPORT spreads them over both workers.
            assert await backends_of(pair.url, 40) == {"gpu1"}
            # A change made through the supervisor reaches the single process.
            response = await patch(client, pair, "/upstreams/llm", {"weights": {a: 1, b: 0}})
            assert response.status_code == 200, response.text
            await wait_status(client, single, lambda d: weights(d) == {a: 1, b: 0})
            assert await backends_of(pair.url, 40) == {"gpu0"}
            assert await backends_of(single.url, 8) == {"gpu0"}


async def fleet_metrics(client: httpx.AsyncClient, replica: Replica) -> dict[str, float]:
    """The fleet's gauges in ``replica``'s ``/metrics`` (the sync's age left out: it moves)."""
    response = await client.get(replica.admin + "/metrics")
    assert response.status_code == 200
    return {
        family.name: family.samples[0].value
        for family in text_string_to_metric_families(response.text)
        if family.name in ("muxproxy_fleet_store_up", "muxproxy_fleet_state_version")
    }


async def backends_of(url: str, count: int) -> set[str]:
    """The backends that answered ``count`` requests, each on a connection of its own."""
    seen = set()
    for _ in range(count):
        async with httpx.AsyncClient(timeout=5) as client:
            response = await client.get(f"{url}/health")
        assert response.status_code == 200
        seen.add(response.headers["x-backend-id"])
    return seen


async def run_admin(url: str, *args: str) -> Any:
    env = {k: v for k, v in os.environ.items() if k != ADMIN_TOKEN_ENV}
    env[ADMIN_TOKEN_ENV] = TOKEN
    return await trio.run_process(
        [sys.executable, "-m", "muxproxy", "admin", "--url", url, *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env=env,
    )

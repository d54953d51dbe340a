"""The fleet of replicas that each run workers: two ``muxproxy serve --workers 2`` processes
share one real ``redis-server`` (``[fleet] store``), in front of fake backends in this process.

A replica of workers is one unit toward the fleet for the runtime state and the memory of
sessions (its supervisor follows the store and hands both to its workers), and four units for
the budgets (each worker admits, so each is its own client of the store and enforces its
share). Checked from the outside, every request over a fresh connection (so the kernel
spreads them over a replica's two workers):

* conversations begun on replica 1 keep their server when their next turns go to replica 2
  after a weight change made by one admin call (the state reaches every worker of both);
* a tenant's tokens-per-minute budget holds across 2 replicas x 2 workers under concurrent
  load (overspent by 5 % at most; the figure is printed), the store counts 4 replicas, and
  ``max_concurrent`` holds across the four processes;
* one group ``PATCH`` on one replica decides where new conversations land on every worker of
  every replica;
* ``redis-server`` killed while streams run through both replicas: none fails, admin writes
  answer 503; restarted empty: the state is seeded again, the memory of sessions and the
  budgets are the fleet's again;
* ``/status`` and ``/metrics`` of a replica of workers show the fleet's fields once, merged as
  one replica's (the replica count a max, the store's state the supervisor's).

Every wait is a poll of an observable condition under ``trio.fail_after``.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import coredis
import httpx
import trio
from conversations import AUTH, GROUP, admin, config_text, fresh_client, moved, turn, turns
from processes import ProxyProcess, proxy_process
from prometheus_client.parser import text_string_to_metric_families
from test_fleet_budgets_e2e import Peak, completion_tokens, request

from muxproxy.fleet.budgets import REPLICAS
from muxproxy.fleet.state import STATE_KEY, document_from_hash

if TYPE_CHECKING:
    from conftest import StartBackend
    from services import RedisServer

assert sys.platform == "linux", "--workers needs Linux (SO_REUSEPORT)"

TEST_TIMEOUT = 58.0
WORKERS = 2
PROCESSES = 2 * WORKERS
"""What admits requests in the fleet of two replicas: each worker."""
TENANT = {"authorization": "Bearer tenant-a"}
CONVERSATIONS = 80


@asynccontextmanager
async def fleet_of_workers(
    nursery: trio.Nursery, config: Path, count: int = 2
) -> AsyncIterator[list[ProxyProcess]]:
    """``count`` replicas of ``config``, each ``--workers 2``, once each follows the store."""
    async with AsyncExitStack() as stack:
        started: list[ProxyProcess] = []

        async def start() -> None:
            replica = await stack.enter_async_context(
                proxy_process(nursery, "--workers", str(WORKERS), config=config, admin=True)
            )
            started.append(replica)

        async with trio.open_nursery() as starting:
            for _ in range(count):
                starting.start_soon(start)
        for replica in started:
            await wait_status(replica, lambda d: d["fleet"]["up"])
        yield started


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "muxproxy.toml"
    path.write_text(text)
    return path


async def status(replica: ProxyProcess) -> dict[str, Any]:
    document = await admin(replica.admin_url, "GET", "/status")
    assert isinstance(document, dict)
    return document


async def wait_status(
    replica: ProxyProcess, done: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """Poll ``replica``'s status until ``done`` holds; the document that made it hold."""
    while not done(document := await status(replica)):
        await trio.sleep(0.02)
    return document


def weights(document: Mapping[str, Any]) -> dict[str, int]:
    return {s["address"]: s["weight"] for s in document["groups"][GROUP]["servers"]}


async def patch_group(replica: ProxyProcess, changes: Mapping[str, int]) -> httpx.Response:
    """One ``PATCH /upstreams/{group}`` of several weights (``{address: weight}``)."""
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.patch(
            f"{replica.admin_url}/upstreams/{GROUP}", json={"weights": changes}, headers=AUTH
        )


async def on_every_replica(replicas: list[ProxyProcess], version: int) -> None:
    for replica in replicas:
        await wait_status(replica, lambda d: d["fleet"]["version"] == version)


async def metrics_of(replica: ProxyProcess) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of ``replica``'s ``/metrics``: name -> [(labels, value)]."""
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(replica.admin_url + "/metrics", headers=AUTH)
    assert response.status_code == 200, response.text
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


async def gauge(replica: ProxyProcess, name: str) -> float | None:
    """The one sample (no labels) of ``name``; None when there is none."""
    found = (await metrics_of(replica)).get(name, [])
    assert len(found) <= 1, found
    return found[0][1] if found else None


async def wait_gauge(replica: ProxyProcess, name: str, ok: Callable[[float], bool]) -> float:
    while (value := await gauge(replica, name)) is None or not ok(value):
        await trio.sleep(0.05)
    return value


def addresses(ports: Mapping[str, int]) -> dict[str, str]:
    return {name: f"127.0.0.1:{port}" for name, port in ports.items()}


async def backends(proxy_url: str, prefix: str, count: int) -> dict[str, int]:
    """``count`` new conversations on ``proxy_url``, each turn on a fresh connection; how
    many each backend took."""
    keys = [f"{prefix}-{n}" for n in range(count)]
    async with fresh_client() as client:
        taken = await turns(client, [(key, proxy_url) for key in keys])
    counts: dict[str, int] = {}
    for backend in taken.values():
        counts[backend] = counts.get(backend, 0) + 1
    return counts


# -- 1. the memory of sessions, bridged by each supervisor ---------------------------------


async def test_conversations_keep_their_server_from_the_workers_of_one_replica_to_another(
    tmp_path: Path, nursery: trio.Nursery, start_backend: StartBackend, redis_server: RedisServer
) -> None:
    ports = {}
    for name in ("a", "b", "c", "d"):
        _, ports[name] = await start_backend(backend_id=name, tokens=2, delay=0.0)
    at = addresses(ports)
    config = write(tmp_path, config_text(ports, store=redis_server.url))
    keys = [f"chat-{n}" for n in range(CONVERSATIONS)]
    with trio.fail_after(TEST_TIMEOUT):
        async with fleet_of_workers(nursery, config) as (one, two), fresh_client() as client:
            first = await turns(client, [(key, one.url) for key in keys])
            # Both workers of replica 2 learn every conversation (from the store, through
            # their supervisor): the memory follows within milliseconds, a turn comes later.
            with trio.move_on_after(10):
                await wait_status(two, lambda d: d["sessions"]["learned"] >= WORKERS * len(keys))
            # One admin call, on replica 1: "a" takes most new sessions, "b" none.
            response = await patch_group(one, {at["a"]: 10, at["b"]: 0})
            assert response.status_code == 200, response.text
            await on_every_replica([one, two], response.json()["version"])
            second = await turns(client, [(key, two.url) for key in keys])
            sessions = (await status(two))["sessions"]
    print(f"\nsessions across replicas of workers: moved {len(moved(first, second))}", sessions)
    assert len(set(first.values())) == 4, first
    assert not moved(first, second), (len(moved(first, second)), moved(first, second)[:5])
    assert sessions["store"]["up"] and sessions["store"]["received"] >= len(keys), sessions


# -- 2. budgets: each worker enforces -------------------------------------------------------


async def test_a_token_budget_holds_across_two_replicas_of_two_workers(
    tmp_path: Path, nursery: trio.Nursery, start_backend: StartBackend, redis_server: RedisServer
) -> None:
    budget = 3000  # tokens a minute: 60 requests of 50 tokens when full
    _, port = await start_backend(backend_id="a", tokens=50, delay=0.0)
    config = write(
        tmp_path,
        config_text(
            {"a": port}, store=redis_server.url, rate_limit=f"tokens_per_minute = {budget}"
        ),
    )
    used = 0
    statuses: dict[int, int] = {}
    with trio.fail_after(TEST_TIMEOUT):
        async with fleet_of_workers(nursery, config) as replicas:
            for replica in replicas:
                await wait_gauge(replica, "muxproxy_fleet_replicas", lambda v: v == PROCESSES)
            async with coredis.Redis.from_url(redis_server.url, verify_version=False) as store:
                assert await store.zcard(REPLICAS) == PROCESSES

            async def client(index: int) -> None:
                nonlocal used
                url = replicas[index % 2].url + "/v1/chat/completions"
                async with fresh_client() as http:
                    while trio.current_time() < deadline:
                        response = await http.post(url, json=request(50), headers=TENANT)
                        code = response.status_code
                        statuses[code] = statuses.get(code, 0) + 1
                        if code == 200:
                            used += completion_tokens(response.text)
                        else:
                            assert code == 429, response.text

            began = trio.current_time()
            deadline = began + 5.0
            async with trio.open_nursery() as load:
                for index in range(12):
                    load.start_soon(client, index)
            elapsed = trio.current_time() - began
    allowed = budget + budget * elapsed / 60  # full at the start, refilled as it ran
    overspend = used / allowed - 1
    print(
        f"\n2 replicas x 2 workers: tokens used {used}, allowed {allowed:.0f}:"
        f" overspend {overspend:+.2%}; {statuses}"
    )
    assert statuses.get(429, 0) > 0  # the load went past the budget
    assert overspend <= 0.05
    assert used >= 0.9 * allowed - 50 * PROCESSES  # and the budget was not starved either


async def test_max_concurrent_holds_across_two_replicas_of_two_workers(
    tmp_path: Path, nursery: trio.Nursery, start_backend: StartBackend, redis_server: RedisServer
) -> None:
    fake, port = await start_backend(backend_id="a", tokens=20, delay=0.1)  # about 2 s each
    config = write(
        tmp_path, config_text({"a": port}, store=redis_server.url, rate_limit="max_concurrent = 3")
    )
    peak = Peak(fake)

    statuses: list[int] = []

    async def stream(url: str) -> None:
        async with fresh_client() as http:
            response = await http.post(
                url + "/v1/chat/completions", json=request(20), headers=TENANT
            )
        statuses.append(response.status_code)
        if response.status_code == 429:
            assert "3 requests in flight" in response.text, response.text

    with trio.fail_after(TEST_TIMEOUT):
        async with fleet_of_workers(nursery, config) as replicas, trio.open_nursery() as watching:
            for replica in replicas:
                await wait_gauge(replica, "muxproxy_fleet_replicas", lambda v: v == PROCESSES)
            watching.start_soon(peak.watch)
            async with trio.open_nursery() as clients:
                for index in range(12):
                    clients.start_soon(stream, replicas[index % 2].url)
            assert sorted(statuses) == [200] * 3 + [429] * 9
            assert peak.most == 3
            watching.cancel_scope.cancel()


# -- 3. the runtime state: one change, every worker of every replica -----------------------


async def test_one_group_change_decides_where_new_conversations_land_on_every_worker(
    tmp_path: Path, nursery: trio.Nursery, start_backend: StartBackend, redis_server: RedisServer
) -> None:
    ports = {}
    for name in ("a", "b", "c"):
        _, ports[name] = await start_backend(backend_id=name, tokens=2, delay=0.0)
    at = addresses(ports)
    config = write(tmp_path, config_text(ports, store=redis_server.url))
    with trio.fail_after(TEST_TIMEOUT):
        async with fleet_of_workers(nursery, config) as replicas:
            one, two = replicas
            assert len((await status(two))["workers"]) == WORKERS
            for step, (through, changes, only) in enumerate(
                [
                    (one, {at["a"]: 0, at["b"]: 0, at["c"]: 1}, "c"),
                    (two, {at["a"]: 2, at["b"]: 0, at["c"]: 0}, "a"),
                ]
            ):
                response = await patch_group(through, changes)
                assert response.status_code == 200, response.text
                version = response.json()["version"]
                await on_every_replica(replicas, version)
                for replica in replicas:
                    # 30 fresh connections: both workers take some (the kernel's hash).
                    assert await backends(replica.url, f"s{step}-{replica.url}", 30) == {only: 30}
                    assert weights(await status(replica)) == changes


# -- 4. the store killed and restarted under streams ---------------------------------------


async def test_a_dead_store_costs_only_admin_writes_and_an_empty_one_is_the_fleets_again(
    tmp_path: Path, nursery: trio.Nursery, start_backend: StartBackend, redis_server: RedisServer
) -> None:
    ports = {}
    for name in ("a", "b", "c"):
        _, ports[name] = await start_backend(backend_id=name, tokens=4, delay=0.01)
    at = addresses(ports)
    config = write(
        tmp_path,
        config_text(ports, store=redis_server.url, rate_limit="tokens_per_minute = 1000000"),
    )
    answers: dict[str, int] = {}
    done = trio.Event()
    with trio.fail_after(TEST_TIMEOUT):
        async with fleet_of_workers(nursery, config) as replicas, fresh_client() as client:
            one, two = replicas
            for replica in replicas:
                await wait_gauge(replica, "muxproxy_fleet_replicas", lambda v: v == PROCESSES)
            response = await patch_group(one, {at["a"]: 3})
            assert response.status_code == 200, response.text
            version = response.json()["version"]
            await on_every_replica(replicas, version)

            async def streams(replica: ProxyProcess, name: str) -> None:
                """Streams of the tenant without a session key (so that the memory of
                sessions holds the conversations below alone), each asserted whole."""
                body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": ""}]}
                url = replica.url + "/v1/chat/completions"
                while not done.is_set():
                    async with client.stream("POST", url, json=body, headers=TENANT) as reply:
                        text = await reply.aread()
                    assert reply.status_code == 200, text
                    assert text.rstrip().endswith(b"data: [DONE]"), text[-200:]
                    answers[name] = answers.get(name, 0) + 1

            async def progressed() -> None:
                """Until every stream loop has completed two more requests."""
                at_start = dict(answers)
                while len(answers) < 4 or any(answers[k] < at_start.get(k, 0) + 2 for k in answers):
                    await trio.sleep(0.02)

            async with trio.open_nursery() as load:
                for index, replica in enumerate(replicas * 2):
                    load.start_soon(streams, replica, f"load{index}")
                await progressed()
                await redis_server.kill()
                for replica in replicas:
                    down = await wait_status(
                        replica,
                        lambda d: not d["fleet"]["up"] and not d["sessions"]["store"]["up"],
                    )
                    assert weights(down)[at["a"]] == 3  # the last state, kept
                    refused = await patch_group(replica, {at["b"]: 5})
                    assert refused.status_code == 503, refused.text
                    assert "fleet store" in refused.json()["error"]
                for replica in replicas:  # counted by the workers, and by the supervisor
                    await wait_gauge(replica, "muxproxy_fleet_budget_store_errors_total", bool)
                    await wait_gauge(replica, "muxproxy_sessions_store_errors_total", bool)
                # Conversations begun while the store is down: kept, written on its return.
                during = [f"during-{n}" for n in range(30)]
                first = await turns(client, [(key, one.url) for key in during])
                await progressed()  # served on, each worker enforcing its share of the budget
                await redis_server.restart()  # empty: nothing persisted
                for replica in replicas:
                    back = await wait_status(
                        replica, lambda d: d["fleet"]["up"] and d["sessions"]["store"]["up"]
                    )
                    assert back["fleet"]["version"] == version and weights(back)[at["a"]] == 3
                async with coredis.Redis.from_url(redis_server.url, verify_version=False) as store:
                    seeded = document_from_hash(await store.hgetall(STATE_KEY))
                    assert seeded is not None and seeded.version == version
                    # Budgets: every worker announces itself again and reserves in the store.
                    for replica in replicas:
                        await wait_gauge(
                            replica, "muxproxy_fleet_replicas", lambda v: v == PROCESSES
                        )
                    while not await store.keys("muxproxy:fleet:budget:*"):
                        await trio.sleep(0.05)
                await progressed()
                done.set()
            # Sessions: conversations begun on replica 1, during the outage and after it, keep
            # their server on replica 2 across a weight change the fleet takes again.
            after = [f"after-{n}" for n in range(30)]
            first.update(await turns(client, [(key, one.url) for key in after]))
            with trio.move_on_after(10):  # each of replica 2's workers learns each of them
                await wait_status(two, lambda d: d["sessions"]["learned"] >= WORKERS * len(first))
            response = await patch_group(two, {at["a"]: 1, at["b"]: 6, at["c"]: 0})
            assert response.status_code == 200, response.text
            assert response.json()["version"] == version + 1
            await on_every_replica(replicas, version + 1)
            second = await turns(client, [(key, two.url) for key in first])
    assert not moved(first, second), (len(moved(first, second)), moved(first, second)[:5])
    print(f"\nstreams through a store's death and empty restart: {sum(answers.values())}, 0 failed")


# -- a worker killed ------------------------------------------------------------------------


async def test_a_worker_killed_is_replaced_with_the_fleets_state_memory_and_budgets(
    tmp_path: Path, nursery: trio.Nursery, start_backend: StartBackend, redis_server: RedisServer
) -> None:
    ports = {}
    for name in ("a", "b", "c", "d"):
        _, ports[name] = await start_backend(backend_id=name, tokens=2, delay=0.0)
    at = addresses(ports)
    config = write(
        tmp_path,
        config_text(ports, store=redis_server.url, rate_limit="tokens_per_minute = 1000000"),
    )
    keys = [f"chat-{n}" for n in range(40)]
    with trio.fail_after(TEST_TIMEOUT):
        async with fleet_of_workers(nursery, config) as (one, two), fresh_client() as client:
            response = await patch_group(one, {at["d"]: 0})
            assert response.status_code == 200, response.text
            await on_every_replica([one, two], response.json()["version"])
            first = await turns(client, [(key, one.url) for key in keys])
            assert "d" not in first.values()
            with trio.move_on_after(10):
                await wait_status(two, lambda d: d["sessions"]["learned"] >= WORKERS * len(keys))
            old = {worker["pid"] for worker in (await status(two))["workers"]}
            os.kill(min(old), signal.SIGKILL)
            await wait_status(
                two,
                lambda d: (
                    len(pids := {w["pid"] for w in d["workers"] if w["state"] == "serving"})
                    == WORKERS
                    and pids != old
                ),
            )
            # The new worker and the old one route by the fleet's state and memory: the
            # conversations stay where they were, a change made elsewhere reaches both.
            response = await patch_group(one, {at["a"]: 10, at["b"]: 0, at["d"]: 0})
            assert response.status_code == 200, response.text
            await on_every_replica([one, two], response.json()["version"])
            second = await turns(client, [(key, two.url) for key in keys])
            assert "d" not in (await backends(two.url, "new", 30))
            # Budgets: the new worker announces itself; the dead one leaves the count.
            await turn(client, two.url, "tenant", TENANT)
            for replica in (one, two):
                await wait_gauge(replica, "muxproxy_fleet_replicas", lambda v: v == PROCESSES)
            async with coredis.Redis.from_url(redis_server.url, verify_version=False) as store:
                assert await store.zcard(REPLICAS) == PROCESSES
    assert not moved(first, second), (len(moved(first, second)), moved(first, second)[:5])


# -- /status and /metrics of a replica of workers ------------------------------------------


async def test_status_and_metrics_show_the_fleet_once_for_a_replica_of_workers(
    tmp_path: Path, nursery: trio.Nursery, start_backend: StartBackend, redis_server: RedisServer
) -> None:
    _, port = await start_backend(backend_id="a", tokens=2, delay=0.0)
    config = write(
        tmp_path,
        config_text({"a": port}, store=redis_server.url, rate_limit="tokens_per_minute = 100000"),
    )
    with trio.fail_after(TEST_TIMEOUT):
        async with fleet_of_workers(nursery, config) as replicas:
            one, _ = replicas
            for replica in replicas:
                await wait_gauge(replica, "muxproxy_fleet_replicas", lambda v: v == PROCESSES)
            response = await patch_group(one, {f"127.0.0.1:{port}": 2})
            assert response.status_code == 200, response.text
            assert response.json()["version"] >= 1
            keys = [f"k-{n}" for n in range(20)]
            async with fresh_client() as client:
                await turns(client, [(key, one.url) for key in keys])
                await turn(client, one.url, "tenant", TENANT)
            # Until each worker holds the host's memory: what one remembered, the other
            # learned from the supervisor (one learning per entry).
            document = await wait_status(
                one,
                lambda d: (
                    d["sessions"]["host_remembered"] == len(keys) + 1
                    and d["sessions"]["learned"] >= len(keys) + 1
                ),
            )
            metrics = await metrics_of(one)
    fleet = document["fleet"]
    assert fleet["up"] and fleet["store"] == redis_server.url and fleet["last_error"] is None
    for name in (
        "muxproxy_fleet_store_up",
        "muxproxy_fleet_state_version",
        "muxproxy_fleet_sync_age_seconds",
        "muxproxy_fleet_replicas",
    ):
        assert len(metrics.get(name, [])) == 1, (name, metrics.get(name))
    assert metrics["muxproxy_fleet_store_up"][0][1] == 1  # the supervisor's, not summed
    assert metrics["muxproxy_fleet_state_version"][0][1] == fleet["version"]
    assert metrics["muxproxy_fleet_replicas"][0][1] == PROCESSES  # a max, not a sum
    # Each worker holds the host's memory: the host remembers each key once.
    sessions = document["sessions"]
    assert sessions["remembered"] == sessions["host_remembered"] == len(keys) + 1, sessions
    assert document["groups"][GROUP]["remembered_sessions"] == len(keys) + 1
    remembered = dict(
        (labels["group"], value) for labels, value in metrics["muxproxy_sessions_remembered"]
    )
    assert remembered == {GROUP: len(keys) + 1}, remembered

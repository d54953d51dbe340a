"""The fleet's runtime state against a real ``redis-server`` (``muxproxy/trio/fleetstate.py``
and the scripts of ``muxproxy/fleet/state.py``), several :class:`FleetSync` in one Trio run.

Each sync stands for a replica: its ``apply`` records the states it was given. What is checked:
the scripts' compare-and-set and seed rules as Redis runs them, that a change made through one
replica is applied by the others, that concurrent changes on two replicas both survive (the
loser computes its change again on the winner's state), that a store emptied under replicas
of different versions keeps the newest one's seed, and what a dead store does to a change.
Every wait is on a condition under ``trio.fail_after``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import attrs
import coredis
import pytest
import trio

from muxproxy.config.fleet import FleetSettings
from muxproxy.config.runtime import RuntimeState
from muxproxy.fleet.state import (
    CAS_SCRIPT,
    CHANNEL,
    SEED_SCRIPT,
    STATE_KEY,
    FleetDocument,
    StoreUnavailable,
    cas_outcome,
    document_from_hash,
    document_from_message,
)
from muxproxy.trio.fleetstate import FleetSync, shown_url

if TYPE_CHECKING:
    from tests.services import RedisServer

GROUP = "gpus"
A, B = "10.0.0.1:8000", "10.0.0.2:8000"


@attrs.define
class Replica:
    sync: FleetSync
    applied: list[RuntimeState] = attrs.Factory(list)
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)


@asynccontextmanager
async def replicas(
    url: str, *held: FleetDocument, interval: float = 5.0
) -> AsyncIterator[list[Replica]]:
    """One running :class:`FleetSync` per document in ``held`` (what it holds at start)."""
    async with trio.open_nursery() as nursery:
        started = []
        for document in held:
            replica = Replica(sync=None)  # type: ignore[arg-type]  # set just below

            async def apply(state: RuntimeState, replica: Replica = replica) -> None:
                replica.applied.append(state)

            settings = FleetSettings(store=url, sync_interval=interval)
            sync = FleetSync(settings, document.state, apply=apply, state_file=lambda: None)
            sync.held = document
            replica.sync = sync

            async def run(replica: Replica = replica) -> None:
                with replica.scope:
                    await replica.sync.run()

            nursery.start_soon(run)
            started.append(replica)
        yield started
        nursery.cancel_scope.cancel()


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await trio.sleep(0.01)


def weight(state: RuntimeState, address: str) -> int | None:
    return state.get(GROUP, address).weight


async def test_the_scripts_compare_and_set_and_seed_as_the_rules_say(
    redis_server: RedisServer,
) -> None:
    state = RuntimeState.empty().changed(GROUP, A, weight=3).to_json()
    with trio.fail_after(10):
        async with (
            coredis.Redis.from_url(redis_server.url) as client,
            client.pubsub(channels=[CHANNEL], ignore_subscribe_messages=True) as pubsub,
        ):
            cas = client.register_script(CAS_SCRIPT)
            seed = client.register_script(SEED_SCRIPT)
            text = FleetDocument(version=0, lineage="a", state=RuntimeState.from_json(state))
            json_state = text.state_json()

            async def published() -> FleetDocument:
                while (message := await pubsub.get_message()) is None:
                    pass
                return document_from_message(message["data"])

            # An empty store takes no change: it must be seeded first.
            empty = await cas(keys=[STATE_KEY], args=[0, "", json_state, CHANNEL])
            assert cas_outcome(empty) == (0, 0)
            assert await seed(keys=[STATE_KEY], args=[5, "aa", json_state, CHANNEL]) == 1
            seeded = await published()
            assert (seeded.version, seeded.lineage, seeded.seeded) == (5, "aa", True)
            # A lower or equal seed does not replace a seed; a higher one does.
            assert await seed(keys=[STATE_KEY], args=[4, "bb", json_state, CHANNEL]) == 0
            assert await seed(keys=[STATE_KEY], args=[5, "bb", json_state, CHANNEL]) == 0
            assert await seed(keys=[STATE_KEY], args=[7, "cc", json_state, CHANNEL]) == 1
            assert (await published()).lineage == "cc"
            # A change computed on another version or lineage is refused, with what is held.
            stale = await cas(keys=[STATE_KEY], args=[6, "cc", json_state, CHANNEL])
            assert cas_outcome(stale) == (-1, 7)
            other = await cas(keys=[STATE_KEY], args=[7, "aa", json_state, CHANNEL])
            assert cas_outcome(other) == (-1, 7)
            assert cas_outcome(
                await cas(keys=[STATE_KEY], args=[7, "cc", json_state, CHANNEL])
            ) == (
                1,
                8,
            )
            changed = await published()
            assert (changed.version, changed.lineage, changed.seeded) == (8, "cc", False)
            assert weight(changed.state, A) == 3
            # No seed, however high, replaces a change.
            assert await seed(keys=[STATE_KEY], args=[99, "dd", json_state, CHANNEL]) == 0
            stored = document_from_hash(await client.hgetall(STATE_KEY))
    assert stored == changed


async def test_a_change_through_one_replica_is_applied_by_the_others(
    redis_server: RedisServer,
) -> None:
    empty = FleetDocument.unsynced(RuntimeState.empty())
    with trio.fail_after(10):
        async with replicas(redis_server.url, empty, empty, empty) as (one, two, three):
            await until(lambda: all(r.sync.up for r in (one, two, three)))
            version = await one.sync.commit(lambda s: s.changed(GROUP, A, weight=5))
            for replica in (two, three):
                await until(lambda r=replica: r.sync.held.version == version)
                assert weight(replica.applied[-1], A) == 5
            status = two.sync.status()
    assert status["up"] is True and status["version"] == version
    assert status["last_error"] is None and status["synced_age_seconds"] >= 0


async def test_concurrent_changes_on_two_replicas_both_survive(
    redis_server: RedisServer,
) -> None:
    empty = FleetDocument.unsynced(RuntimeState.empty())
    with trio.fail_after(10):
        async with replicas(redis_server.url, empty, empty) as (one, two):
            await until(lambda: one.sync.up and two.sync.up)
            versions = []

            async def change(replica: Replica, address: str, value: int) -> None:
                for step in range(5):

                    def changed(state: RuntimeState, weight: int = value + step) -> RuntimeState:
                        return state.changed(GROUP, address, weight=weight)

                    versions.append(await replica.sync.commit(changed))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(change, one, A, 10)
                nursery.start_soon(change, two, B, 20)
            final = max(versions)
            await until(lambda: one.sync.held.version == two.sync.held.version == final)
    assert sorted(versions) == list(range(min(versions), final + 1))  # ten versions, no gap
    for replica in (one, two):
        assert weight(replica.sync.held.state, A) == 14
        assert weight(replica.sync.held.state, B) == 24


async def test_an_emptied_store_keeps_the_seed_of_the_newest_replica(
    redis_server: RedisServer,
) -> None:
    older = FleetDocument(
        version=3, lineage="ab", state=RuntimeState.empty().changed(GROUP, A, weight=2)
    )
    newer = FleetDocument(
        version=7, lineage="ab", state=RuntimeState.empty().changed(GROUP, A, weight=6)
    )
    with trio.fail_after(10):
        async with replicas(redis_server.url, older) as (first,):
            # The replica that knew less seeds the empty store first...
            await until(lambda: first.sync.up)
            async with coredis.Redis.from_url(redis_server.url) as client:
                stored = document_from_hash(await client.hgetall(STATE_KEY))
                assert stored is not None and (stored.version, stored.seeded) == (3, True)
                async with replicas(redis_server.url, newer) as (second,):
                    # ...and the one that knew more writes its own over that seed.
                    await until(lambda: second.sync.up)
                    await until(lambda: first.sync.held.version == 7)
                    stored = document_from_hash(await client.hgetall(STATE_KEY))
    assert stored is not None and stored.version == 7
    assert weight(stored.state, A) == 6
    assert weight(first.applied[-1], A) == 6
    assert second.applied == []  # it had the newest state already


async def test_a_change_while_the_store_is_down_is_refused_and_nothing_applied(
    redis_server: RedisServer,
) -> None:
    empty = FleetDocument.unsynced(RuntimeState.empty())
    with trio.fail_after(10):
        async with replicas(redis_server.url, empty) as (one,):
            await until(lambda: one.sync.up)
            await redis_server.kill()
            with pytest.raises(StoreUnavailable, match="nothing changed"):
                await one.sync.commit(lambda s: s.changed(GROUP, A, weight=4))
            await until(lambda: not one.sync.up)
            with pytest.raises(StoreUnavailable, match=r"fleet store redis://127\.0\.0\.1"):
                await one.sync.commit(lambda s: s.changed(GROUP, A, weight=4))
            assert one.applied == [] and one.sync.status()["last_error"]
            await redis_server.restart()
            await until(lambda: one.sync.up)
            version = await one.sync.commit(lambda s: s.changed(GROUP, A, weight=4))
    assert weight(one.applied[-1], A) == 4 and version == 1


async def test_the_store_is_never_shown_down_without_the_reason(
    redis_server: RedisServer,
) -> None:
    # Looked at after every step of every task: the moment the sync says the store is down,
    # its /status says why (a poll once landed between the two and saw no reason).
    empty = FleetDocument.unsynced(RuntimeState.empty())
    with trio.fail_after(10):
        async with replicas(redis_server.url, empty, interval=0.05) as (one,):
            await until(lambda: one.sync.up)
            await redis_server.kill()
            while one.sync.up:
                await trio.lowlevel.checkpoint()
            shown = one.sync.status()
            assert shown["up"] is False and shown["last_error"], shown


def test_a_store_url_is_shown_without_its_password() -> None:
    assert shown_url("redis://:secret@cache:6379/1") == "redis://:***@cache:6379/1"
    assert shown_url("rediss://user:pw@10.0.0.1") == "rediss://user:***@10.0.0.1"
    assert shown_url("redis://token@cache") == "redis://***@cache"
    assert shown_url("redis://cache:6379/0") == "redis://cache:6379/0"
    sentinel = "redis+sentinel://:pw@s1:26379,s2:26379/mymaster"
    assert shown_url(sentinel) == "redis+sentinel://:***@s1:26379,s2:26379/mymaster"

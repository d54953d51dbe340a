"""The fleet store's side of the shared memory of sessions (``trio/fleetsessions.py``) against
a real ``redis-server``: what one replica writes reaches another by the channel and by the
load at start, the newest entry wins in the store, and an outage costs no entry remembered
meanwhile: counted, logged once, written when Redis is back."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from muxproxy.core.commands import Log
from muxproxy.fleet.sessions import SessionEntry, entries_to_wire
from muxproxy.trio.fleetsessions import CHANNEL, StoreSessions
from muxproxy.trio.redis import client_of

if TYPE_CHECKING:
    from services import RedisServer

IDLE = {"g": 60.0}


def entry(key: int, address: str = "10.0.0.1:8000", age: float = 0.0) -> SessionEntry:
    return SessionEntry(group="g", key=key, address=address, at=time.time() - age)


class Replica:
    def __init__(self, url: str) -> None:
        self.learned: dict[int, str] = {}
        self.logs: list[Log] = []
        self.store = StoreSessions(url, IDLE, self.learn, self.logs.append)

    def learn(self, entries: list[SessionEntry]) -> None:
        for item in entries:
            self.learned[item.key] = item.address


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.02)


async def test_entries_reach_other_replicas_by_the_channel_and_by_the_load(
    nursery: trio.Nursery, redis_server: RedisServer
) -> None:
    one, two = Replica(redis_server.url), Replica(redis_server.url)
    nursery.start_soon(one.store.run)
    nursery.start_soon(two.store.run)
    await until(lambda: one.store.state.up and two.store.state.up)
    one.store.publish([entry(1), entry(2, "10.0.0.2:8000"), entry(3, age=120.0)])
    await until(lambda: 1 in two.learned and 2 in two.learned)
    assert one.learned == {}  # its own messages come back and are skipped
    # The newest wins in the store too: an older entry for key 1 changes nothing.
    two.store.publish([entry(1, "10.0.0.9:8000", age=30.0)])
    await until(lambda: two.store.state.written == 1)
    late = Replica(redis_server.url)
    nursery.start_soon(late.store.run)
    await until(lambda: late.store.state.loads == 1 and 2 in late.learned)
    assert late.learned == {1: "10.0.0.1:8000", 2: "10.0.0.2:8000"}  # key 3 had expired


async def test_an_outage_is_counted_logged_once_and_costs_no_entry(
    nursery: trio.Nursery, redis_server: RedisServer
) -> None:
    one, two = Replica(redis_server.url), Replica(redis_server.url)
    nursery.start_soon(one.store.run)
    nursery.start_soon(two.store.run)
    await until(lambda: one.store.state.up and two.store.state.up)
    await redis_server.kill()
    await until(lambda: not one.store.state.up and one.store.state.errors > 0)
    for key in range(10, 20):
        one.store.publish([entry(key)])  # remembered while Redis is down
    await until(lambda: one.store.state.errors >= 3)
    errors = [log for log in one.logs if log.event == "fleet_sessions_store_error"]
    assert len(errors) == 1 and errors[0].fields["store"] == redis_server.url
    await redis_server.restart()  # empty, as an ephemeral Redis comes back
    await until(lambda: all(key in two.learned for key in range(10, 20)))
    assert one.store.state.up and one.store.state.loads >= 2
    late = Replica(redis_server.url)
    nursery.start_soon(late.store.run)
    await until(lambda: late.store.state.loads == 1 and len(late.learned) == 10)


async def test_what_no_replica_publishes_is_counted_and_the_bridge_lives_on(
    nursery: trio.Nursery, redis_server: RedisServer
) -> None:
    replica = Replica(redis_server.url)
    nursery.start_soon(replica.store.run)
    await until(lambda: replica.store.state.up)
    good = json.dumps({"origin": "elsewhere", "entries": entries_to_wire([entry(7)])})
    async with client_of(redis_server.url) as client:
        # JSON nested past the parser's recursion limit; an integer time past every float.
        await client.publish(CHANNEL, b"[" * 100_000)
        huge_time = '{"origin":"x","entries":[["g","0000000000000001","a:1",1%s]]}' % ("0" * 400)
        await client.publish(CHANNEL, huge_time)
        await client.publish(CHANNEL, good)
    await until(lambda: 7 in replica.learned)
    assert replica.store.state.errors == 1 and 1 not in replica.learned

"""Three replicas share the memory of sessions through ``[fleet] store`` (a real ``redis-server``).

Three ``muxproxy serve`` processes with the same configuration and store, in front of the
same fake backends (each names itself in ``x-backend-id``), as three pods behind a Service.
Weights are changed through each replica's own admin API (the same change on every one), so
this tests the memory alone, not how a change reaches every replica.

- Conversations begun on replica 1 take their next turn on replicas 2 and 3 after a weight
  change that moves most keys' hashes: each stays on its server.
- A gray release 0 -> 25 -> 50 -> 100 % (v1 -> v2) with multi-turn conversations running,
  each turn on the next replica: every conversation's turns on one server (a server at
  weight 0 drains: it still takes the conversations it has), and new conversations follow
  the weights (none on v2 at 0 %, all at 100 %).

Between rounds of turns a test waits until the store has passed every entry on (each
replica's entries written, and received by the two others): a conversation's next turn comes
seconds after the last, the memory follows within milliseconds.
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
from conversations import admin, config_text, fresh_client, moved, set_weight, turns
from processes import ProxyProcess, proxy_process

if TYPE_CHECKING:
    from conftest import StartBackend
    from services import RedisServer

REPLICAS = 3
SETTLE_TIMEOUT = 10.0


async def replicas(
    stack: AsyncExitStack, nursery: trio.Nursery, config: Path
) -> list[ProxyProcess]:
    started = []
    for _ in range(REPLICAS):
        started.append(
            await stack.enter_async_context(proxy_process(nursery, config=config, admin=True))
        )
    return started


async def sessions_of(proxy: ProxyProcess) -> dict[str, Any]:
    """``/status``'s ``sessions`` ({} from a proxy that shares none)."""
    sessions = (await admin(proxy.admin_url, "GET", "/status")).get("sessions", {})
    assert isinstance(sessions, dict)
    return sessions


async def wait_settled(proxies: list[ProxyProcess]) -> None:
    """Until every entry each replica handed out is in the store and reached the others."""
    with trio.fail_after(SETTLE_TIMEOUT):
        while True:
            each = [await sessions_of(proxy) for proxy in proxies]
            if not any("store" in sessions for sessions in each):
                return  # nothing shared through a store: nothing to wait for
            stores = [sessions["store"] for sessions in each]
            written = sum(store["written"] for store in stores)
            if (
                all(store["up"] for store in stores)
                and all(s["store"]["written"] == s["sent_out"] for s in each)
                and sum(store["received"] for store in stores) == (REPLICAS - 1) * written
            ):
                return
            await trio.sleep(0.05)


async def weights_everywhere(proxies: list[ProxyProcess], ports: dict[str, int], **w: int) -> None:
    for proxy in proxies:
        for name, weight in w.items():
            await set_weight(proxy.admin_url, ports[name], weight)


async def test_conversations_keep_their_server_on_every_replica_after_a_weight_change(
    tmp_path: Path, nursery: trio.Nursery, start_backend: StartBackend, redis_server: RedisServer
) -> None:
    ports = {}
    for name in ("a", "b", "c", "d"):
        _, ports[name] = await start_backend(backend_id=name, tokens=2, delay=0.0)
    path = tmp_path / "muxproxy.toml"
    path.write_text(config_text(ports, store=redis_server.url))
    keys = [f"chat-{n}" for n in range(120)]
    with trio.fail_after(55):
        async with AsyncExitStack() as stack, fresh_client() as client:
            proxies = await replicas(stack, nursery, path)
            first = await turns(client, [(key, proxies[0].url) for key in keys])
            await wait_settled(proxies)
            await weights_everywhere(proxies, ports, a=10, b=0)
            routes = [(key, proxies[1 + n % 2].url) for n, key in enumerate(keys)]
            second = await turns(client, routes)
            status = [await sessions_of(proxy) for proxy in proxies]
    print("\nsessions across replicas:", json.dumps(status))
    assert len(set(first.values())) == 4, first
    assert not moved(first, second), (len(moved(first, second)), moved(first, second)[:5])
    # What replicas 2 and 3 routed by came from the store: they learned every key.
    assert all(s["learned"] >= len(keys) for s in status[1:]), status


async def test_gray_release_across_replicas_keeps_each_conversation_on_one_server(
    tmp_path: Path, nursery: trio.Nursery, start_backend: StartBackend, redis_server: RedisServer
) -> None:
    ports = {}
    for name in ("v1a", "v1b", "v2a", "v2b"):
        _, ports[name] = await start_backend(backend_id=name, tokens=2, delay=0.0)
    path = tmp_path / "muxproxy.toml"
    weights = {"v1a": 4, "v1b": 4, "v2a": 0, "v2b": 0}
    path.write_text(config_text(ports, weights=weights, store=redis_server.url))
    steps = [(4, 0), (3, 1), (2, 2), (0, 4)]  # v2's share: 0, 25, 50, 100 %
    per_step = 40
    history: dict[str, list[str]] = {}
    began: dict[int, list[str]] = {}
    rounds = 0
    with trio.fail_after(55):
        async with AsyncExitStack() as stack, fresh_client() as client:
            proxies = await replicas(stack, nursery, path)
            for step, (v1, v2) in enumerate(steps):
                await weights_everywhere(proxies, ports, v1a=v1, v1b=v1, v2a=v2, v2b=v2)
                new = [f"s{step}-chat-{n}" for n in range(per_step)]
                began[step] = new
                # Every conversation under way takes a turn, the new ones their first; each
                # turn on the next replica round the ring.
                keys = [*history, *new]
                routes = [(key, proxies[(rounds + n) % REPLICAS].url) for n, key in enumerate(keys)]
                for key, backend in (await turns(client, routes)).items():
                    history.setdefault(key, []).append(backend)
                rounds += 1
                await wait_settled(proxies)
    wandering = {key: seen for key, seen in history.items() if len(set(seen)) > 1}
    shares = [
        sum(history[key][0].startswith("v2") for key in began[step]) / per_step
        for step in range(len(steps))
    ]
    print("\ngray release across replicas:", json.dumps({"v2 share": shares}))
    assert not wandering, (len(wandering), list(wandering.items())[:5])
    assert sum(len(seen) for seen in history.values()) == per_step * (4 + 3 + 2 + 1)
    assert shares[0] == 0.0 and shares[-1] == 1.0, shares
    assert 0.05 <= shares[1] <= 0.5 and 0.25 <= shares[2] <= 0.75, shares

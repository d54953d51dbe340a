"""End to end: the operator's runtime server state through a real ``ProxyServer``.

Real sockets on 127.0.0.1, Hypercorn-served ``FakeLLM`` backends, httpx clients, and
``ProxyServer.apply_runtime`` feeding ``RuntimeChanged`` into the running core. What is
checked from the outside:

* while weights move, conversations (``X-Chat-ID``) already under way stay on their server,
  also on one that now drains, and new conversations follow the new weights exactly
  (weighted rendezvous hashing);
* a stream in flight on a server set down finishes whole; the next requests, keyed or not,
  go elsewhere; ``status()`` shows the stream while it runs.

Every wait is on a condition or a response, under ``trio.fail_after``.
"""

from __future__ import annotations

from collections import Counter

import httpx
import trio
from test_routing_e2e import (
    CHAT,
    GROUP,
    chat_body,
    group_router,
    make_config,
    sse_text,
    start_killable,
)

from muxproxy.config import SessionSource, Sticky
from muxproxy.config.runtime import RuntimeState
from muxproxy.routing.balancer import rendezvous_order
from muxproxy.testing.fakellm import reply_text

KEYED = Sticky(sources=(SessionSource(kind="header", name="x-chat-id"),))
QUICK = {"x-fake-tokens": "2", "x-fake-delay": "0"}


async def converse(client: httpx.AsyncClient, url: str, key: str | None) -> str:
    """One whole chat turn of conversation ``key`` (None: no key); the backend that answered."""
    headers = dict(QUICK) | ({"x-chat-id": key} if key is not None else {})
    response = await client.post(url + CHAT, content=chat_body(stream=False), headers=headers)
    assert response.status_code == 200, response.text
    return response.headers["x-backend-id"]


async def test_conversations_stay_while_weights_move_and_new_ones_follow_them(nursery, start_proxy):
    backends = [await start_killable(nursery, backend_id=f"b{i}") for i in range(3)]
    proxy = await start_proxy(config=make_config(backends, sticky=KEYED))
    router = group_router(proxy)

    def owner(key: str) -> str:
        order = rendezvous_order(key.encode(), router.ids, router.weights, range(3))
        return backends[order[0]].id

    old = [f"chat-{i}" for i in range(30)]
    new = [f"fresh-{i}" for i in range(90)]
    with trio.fail_after(20):
        async with httpx.AsyncClient(timeout=10) as client:
            before = {k: await converse(client, proxy.url, k) for k in old}
            assert before == {k: owner(k) for k in old}
            assert len(set(before.values())) == 3
            state = (
                RuntimeState.empty()
                .changed(GROUP, backends[0].address, weight=8)
                .changed(GROUP, backends[2].address, drain=True)
            )
            proxy.server.apply_runtime(state)
            assert router.weights == [8, 1, 0]
            moved_by_hashing = [k for k in old if owner(k) != before[k]]
            assert len(moved_by_hashing) >= 5  # the new weights would move these keys
            # Two more turns each: every conversation stays where its KV cache is.
            for _ in range(2):
                assert {k: await converse(client, proxy.url, k) for k in old} == before
            fresh = {k: await converse(client, proxy.url, k) for k in new}
    assert fresh == {k: owner(k) for k in new}  # new conversations follow the new weights
    shares = Counter(fresh.values())
    assert shares["b2"] == 0 and shares["b0"] > 3 * shares["b1"]
    assert {b.id: b.fake.requests for b in backends}["b2"] == sum(
        1 for k in old if before[k] == "b2"
    ) * 3


async def test_stream_on_a_server_set_down_finishes_and_the_next_requests_go_elsewhere(
    nursery, start_proxy
):
    backends = [await start_killable(nursery, backend_id=f"b{i}") for i in range(2)]
    proxy = await start_proxy(config=make_config(backends, sticky=KEYED))
    core = proxy.server.core
    tokens = 30
    headers = {"x-chat-id": "long-chat", "x-fake-tokens": str(tokens), "x-fake-delay": "0.01"}
    with trio.fail_after(20):
        async with httpx.AsyncClient(timeout=10) as client:
            async with client.stream(
                "POST", proxy.url + CHAT, content=chat_body(stream=True), headers=headers
            ) as response:
                assert response.status_code == 200
                serving = response.headers["x-backend-id"]
                index = [b.id for b in backends].index(serving)
                chunks = response.aiter_bytes()
                body = await anext(chunks)
                assert b"data: " in body  # the stream is under way
                proxy.server.apply_runtime(
                    RuntimeState.empty().changed(GROUP, backends[index].address, down=True)
                )
                servers = core.status()["groups"][GROUP]["servers"]
                assert (servers[index]["state"], servers[index]["active"]) == ("down", 1)
                async for chunk in chunks:
                    body += chunk
            text, done = sse_text(body)
            assert (text, done) == (reply_text(tokens), True)  # not cut, not moved
            other = backends[1 - index].id
            assert await converse(client, proxy.url, "long-chat") == other
            assert {await converse(client, proxy.url, None) for _ in range(3)} == {other}
            # Back up: the conversation stays where it went on; unkeyed requests spread again.
            proxy.server.apply_runtime(RuntimeState.empty())
            assert await converse(client, proxy.url, "long-chat") == other
            assert {await converse(client, proxy.url, None) for _ in range(4)} == {
                b.id for b in backends
            }
    assert core.status()["groups"][GROUP]["servers"][index]["active"] == 0
    assert backends[index].fake.streams_completed == 1

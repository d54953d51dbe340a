"""End to end: placement by the engines' own KV-cache events, with real ``muxproxy fakellm``
engines publishing them (``--kv-events``) and a real ``muxproxy serve`` following them.

A conversation's first turn is sent while its prefix key's home engine drains, so it runs
on the other engine, which publishes its blocks; the proxy learns the turn's tokens from
that engine's ``/tokenize``. The drain is lifted: the second turn goes where the events
show the conversation's blocks, not to the prefix key's home. Then the other engine's events
stop (the test cuts the relay they come through): the third turn is placed by the prefix
key again, and answered. Every request is answered 200.

Every wait is on an output line, a response or the proxy's ``/status``, under
``trio.fail_after``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio
from processes import Output, proxy_process

from muxproxy.config import parse_config
from muxproxy.config.serverid import server_id
from muxproxy.routing.llmrequest import read_request
from muxproxy.routing.load import bounded_order

TOKEN = "kv-token"
GROUP = "llm"
CHAT = "/v1/chat/completions"
TEST_TIMEOUT = 19
SYSTEM = "You answer questions about the weather in the harbour town, briefly and kindly. " * 2


async def relay(port: int, client: trio.SocketStream) -> None:
    """Carry one connection to ``127.0.0.1:port`` and back until either side ends."""

    async def pipe(source: trio.abc.Stream, sink: trio.abc.Stream) -> None:
        try:
            while data := await source.receive_some(65536):
                await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        nursery.cancel_scope.cancel()

    upstream = await trio.open_tcp_stream("127.0.0.1", port)
    async with client, upstream, trio.open_nursery() as nursery:
        nursery.start_soon(pipe, client, upstream)
        nursery.start_soon(pipe, upstream, client)


async def serve_relay(
    port: int, scope: trio.CancelScope, *, task_status: trio.TaskStatus[int]
) -> None:
    """A TCP relay to ``127.0.0.1:port`` until ``scope`` is cancelled (which cuts it all)."""
    with scope:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(partial(relay, port), listeners)


@asynccontextmanager
async def fakellm(nursery: trio.Nursery, name: str) -> AsyncIterator[tuple[int, int]]:
    """A ``muxproxy fakellm`` process publishing its cache's events: (HTTP port, events port)."""
    command = [
        sys.executable, "-m", "muxproxy", "fakellm", "--host", "127.0.0.1", "--port", "0",
        "--id", name, "--tokens", "2", "--delay", "0", "--kv-blocks", "4096",
        "--block-tokens", "4", "--kv-events", "0",
    ]  # fmt: skip
    process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE)
    assert process.stdout is not None
    output = Output()
    nursery.start_soon(output.pump, process.stdout)
    try:
        events = await output.wait_for(lambda line: " kv events on " in line)
        listening = await output.wait_for(lambda line: " listening on " in line)
        yield int(listening.rsplit(":", 1)[1]), int(events.rsplit(":", 1)[1])
    finally:
        with trio.CancelScope(shield=True):
            process.kill()
            await process.wait()


def config_text(servers: list[tuple[int, int]]) -> str:
    entries = ", ".join(
        f'{{ address = "127.0.0.1:{http}", kv_events = "tcp://127.0.0.1:{events}" }}'
        for http, events in servers
    )
    return "\n".join(
        [
            "[[listeners]]",
            'address = "127.0.0.1:0"',
            "[admin]",
            'address = "127.0.0.1:0"',
            f'token = "{TOKEN}"',
            f"[upstreams.{GROUP}]",
            f"servers = [{entries}]",
            'affinity = "prefix"',
            f"[upstreams.{GROUP}.kv_events]",
            'stale_after = "2s"',
        ]
    )


def turns(system: str, count: int) -> list[dict[str, str]]:
    """The messages of a conversation's turn ``count`` (1: the first question)."""
    messages = [{"role": "system", "content": system}]
    for turn in range(1, count + 1):
        if turn > 1:
            messages.append({"role": "assistant", "content": f"answer {turn - 1}"})
        messages.append({"role": "user", "content": f"question {turn} about the tides?"})
    return messages


def body(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": "fake", "messages": messages, "max_tokens": 2}


def home_of(text: str, document: dict[str, Any]) -> int:
    """The server the prefix key alone places ``document`` on, in an idle group."""
    group = parse_config(
        {"listeners": [{"address": "127.0.0.1:1"}], **_upstreams(text)}, environ={}
    ).upstreams[GROUP]
    key = read_request(document, source=group.prefix.source, length=group.prefix.length)
    assert key.prefix_key is not None
    ids = [server_id(GROUP, server.address, "") for server in group.servers]
    size = len(ids)
    options = group.prefix
    order = bounded_order(
        key.prefix_key, ids, [1] * size, [0] * size, range(size), options.load_factor,
        options.balance_gap,
    )  # fmt: skip
    return order[0]


def _upstreams(text: str) -> dict[str, Any]:
    return {"upstreams": tomllib.loads(text)["upstreams"]}


async def test_a_later_turn_follows_the_engines_events_and_falls_back_when_they_stop(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        async with (
            fakellm(nursery, "a") as (http_a, events_a),
            fakellm(nursery, "b") as (
                http_b,
                events_b,
            ),
        ):
            cut = trio.CancelScope()
            relayed = await nursery.start(serve_relay, events_b, cut)
            text = config_text([(http_a, events_a), (http_b, relayed)])
            path = tmp_path / "muxproxy.toml"
            path.write_text(text)
            # A conversation whose prefix key's home is engine a.
            system = next(
                f"{n} {SYSTEM}"
                for n in range(64)
                if home_of(text, body(turns(f"{n} {SYSTEM}", 2))) == 0
            )
            async with (
                proxy_process(nursery, config=path, admin=True) as proxy,
                httpx.AsyncClient(timeout=5) as client,
            ):
                auth = {"authorization": f"Bearer {TOKEN}"}

                async def status() -> dict[str, Any]:
                    answer = await client.get(proxy.admin_url + "/status", headers=auth)
                    group: dict[str, Any] = answer.json()["groups"][GROUP]
                    return group

                async def until(done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
                    while not done(group := await status()):
                        await trio.sleep(0.02)
                    return group

                async def drain(address: str, on: bool) -> None:
                    url = f"{proxy.admin_url}/upstreams/{GROUP}/servers/{address}"
                    answer = await client.patch(
                        url, headers=auth, content=json.dumps({"drain": on})
                    )
                    assert answer.status_code == 200, answer.text

                async def ask(turn: int) -> str:
                    answer = await client.post(
                        proxy.url + CHAT, content=json.dumps(body(turns(system, turn)))
                    )
                    assert answer.status_code == 200, answer.text
                    return answer.headers["x-backend-id"]

                await until(lambda g: all(s["kv_events"]["connected"] for s in g["servers"]))
                await drain(f"127.0.0.1:{http_a}", True)
                assert await ask(1) == "b"  # a drains: the first turn runs on b
                await until(
                    lambda g: (
                        g["kv_events"]["conversations"] >= 1
                        and g["servers"][1]["kv_events"]["blocks"] > 0
                    )
                )
                await drain(f"127.0.0.1:{http_a}", False)
                assert await ask(2) == "b"  # where its blocks are; the prefix key says a
                group = await status()
                assert group["kv_events"]["moved"] == 1
                assert group["servers"][0]["kv_events"]["blocks"] == 0
                cut.cancel()  # b's events stop
                await until(lambda g: not g["servers"][1]["kv_events"]["trusted"])
                assert await ask(3) == "a"  # the prefix key again, and answered
                group = await status()
                assert group["servers"][1]["kv_events"]["last_error"]

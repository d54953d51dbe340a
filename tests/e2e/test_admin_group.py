"""A group's PATCH on a real proxy in this process: several servers changed as one state.

The same ``serve_local`` proxy as ``test_admin.py`` (no fleet store: one process applies the
step atomically itself). What is checked from the outside: both body forms, the answer and the
state file; that one bad entry refuses the whole change (nothing moves, nothing is saved); and
that no request sees half a step: a step that swaps which server is down, made again and again
under a stream of requests, never leaves a moment with both down (every request is served).

Every wait is on a response under ``trio.fail_after``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio
from test_admin import (
    AUTH,
    TOKEN,
    Proxy,
    admin_client,
    backend_of,
    server_entry,
    start_fleet,
    status,
)
from test_admin import write_config as write_admin_config
from test_admin_process import admin

from muxproxy.config.runtime import RuntimeState, load_state
from muxproxy.config.serverid import server_id

if TYPE_CHECKING:
    from conftest import StartBackend


async def patch_group(
    client: httpx.AsyncClient, proxy: Proxy, body: Any, group: str = "llm"
) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await client.patch(f"{proxy.admin}/upstreams/{group}", content=content, headers=AUTH)


async def test_a_group_change_sets_every_server_as_one_state(
    start_backend: StartBackend, tmp_path: Path
) -> None:
    (_, p0), (_, p1), (_, p2) = await start_fleet(start_backend, 3)
    a, b, c = (f"127.0.0.1:{port}" for port in (p0, p1, p2))
    config = write_admin_config(tmp_path / "muxproxy.toml", [p0, p1, p2])
    with trio.fail_after(15):
        async with admin_client(config) as (proxy, client):
            response = await patch_group(client, proxy, {"weights": {a: 0, b: 3}})
            assert response.status_code == 200, response.text
            answer = response.json()
            assert (answer["ok"], answer["group"], answer["version"]) == (True, "llm", None)
            assert [(e["address"], e["weight"]) for e in answer["servers"]] == [(a, 0), (b, 3)]
            assert {await backend_of(client, proxy) for _ in range(6)} <= {"gpu1", "gpu2"}
            # The long form, with a server named by its id as /status shows it.
            c_id = server_id("llm", c, "").decode()
            body = {"servers": {a: {"weight": None, "drain": True}, c_id: {"down": True}}}
            response = await patch_group(client, proxy, body)
            assert response.status_code == 200, response.text
            entries = {e["address"]: e for e in response.json()["servers"]}
            assert entries[a]["state"] == "draining" and entries[a]["weight"] == 1
            assert entries[c]["state"] == "down"
            assert {await backend_of(client, proxy) for _ in range(6)} == {"gpu1"}
    assert load_state(tmp_path / "state.json") == (
        RuntimeState.empty()
        .changed("llm", a, drain=True)
        .changed("llm", b, weight=3)
        .changed("llm", c, down=True)
    )


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        ({"weights": {"A": 2, "127.0.0.1:1": 2}}, 404, "upstream group 'llm' has no server"),
        ({"weights": {"A": 2, "B": 1_000_001}}, 400, 'weights["B"]: expected an integer'),
        ({"weights": {"A": 2, "B": True}}, 400, 'weights["B"]: expected an integer'),
        ({"servers": {"A": {"weight": 2}, "B": {"drian": True}}}, 400, 'servers["B"].drian'),
        ({"servers": {"A": {"weight": 2}, "B": {}}}, 400, 'servers["B"]: empty object'),
        ({"servers": {"A": {"weight": 2}, "B": 3}}, 400, 'servers["B"]: expected a JSON object'),
        ({"weights": {"A": 2, "A-id": 3}}, 400, "names the server"),
        ({"weights": {}}, 400, "weights: expected an object naming at least one server"),
        ({"weights": {"A": 1}, "servers": {}}, 400, "body: expected"),
        ({"weight": 2}, 400, "body: expected"),
        (b"{", 400, "body: not JSON"),
    ],
)
async def test_a_group_change_with_one_bad_entry_changes_nothing(
    start_backend: StartBackend, tmp_path: Path, body: Any, code: int, message: str
) -> None:
    (_, p0), (_, p1) = await start_fleet(start_backend)
    a, b = f"127.0.0.1:{p0}", f"127.0.0.1:{p1}"
    names = {"A": a, "B": b, "A-id": server_id("llm", a, "").decode()}
    if isinstance(body, dict):
        body = {
            key: {names.get(k, k): v for k, v in value.items()}
            if isinstance(value, dict)
            else value
            for key, value in body.items()
        }
        message = message.replace('"B"', f'"{b}"')
    config = write_admin_config(tmp_path / "muxproxy.toml", [p0, p1])
    with trio.fail_after(10):
        async with admin_client(config) as (proxy, client):
            before = await status(client, proxy)
            response = await patch_group(client, proxy, body)
            assert response.status_code == code, response.text
            assert message in response.json()["error"], response.json()
            after = await status(client, proxy)
    assert server_entry(after, p0) == server_entry(before, p0)
    assert server_entry(after, p1) == server_entry(before, p1)
    assert not (tmp_path / "state.json").exists()  # nothing saved either


async def test_no_request_sees_half_a_step(start_backend: StartBackend, tmp_path: Path) -> None:
    (_, p0), (_, p1) = await start_fleet(start_backend)
    a, b = f"127.0.0.1:{p0}", f"127.0.0.1:{p1}"
    config = write_admin_config(tmp_path / "muxproxy.toml", [p0, p1])
    with trio.fail_after(30):
        async with admin_client(config) as (proxy, client):
            response = await patch_group(client, proxy, {"servers": {b: {"down": True}}})
            assert response.status_code == 200, response.text
            served: list[int] = []
            done = trio.Event()

            async def requests() -> None:
                async with httpx.AsyncClient(timeout=5) as own:
                    while not done.is_set():
                        served.append((await own.get(f"{proxy.url}/health")).status_code)

            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(requests)
                for step in range(30):
                    # Take one server down and bring the other up: one step, one state.
                    up, down = (a, b) if step % 2 else (b, a)
                    body = {"servers": {down: {"down": True}, up: {"down": False}}}
                    response = await patch_group(client, proxy, body)
                    assert response.status_code == 200, response.text
                    await trio.sleep(0.005)  # let requests run between the steps
                done.set()
    assert len(served) > 30
    assert set(served) == {200}


async def test_muxproxy_admin_weights_changes_a_group_or_says_what_is_wrong(
    start_backend: StartBackend, tmp_path: Path
) -> None:
    (_, p0), (_, p1) = await start_fleet(start_backend)
    a, b = f"127.0.0.1:{p0}", f"127.0.0.1:{p1}"
    config = write_admin_config(tmp_path / "muxproxy.toml", [p0, p1])
    with trio.fail_after(40):
        async with admin_client(config) as (proxy, client):
            ran = await admin(proxy.admin, "weights", "llm", f"{a}=4", f"{b}=0", token=TOKEN)
            assert ran.status == 0, ran.err
            assert "upstream llm: 2 servers changed as one\n" in ran.out  # no fleet store
            assert f"server {a}: weight 4 (configured 1)" in ran.out
            assert f"server {b}: weight 0 (configured 1)" in ran.out
            document = await status(client, proxy)
            for usage in ([a], [f"{a}=x"], [f"{a}=-1"], [f"{a}=1", f"{a}=2"], []):
                ran = await admin(proxy.admin, "weights", "llm", *usage, token=TOKEN)
                assert ran.status == 2, (usage, ran.err)
            ran = await admin(proxy.admin, "weights", "llm", f"{a}=2", "10.9.9.9:80=1", token=TOKEN)
            assert ran.status == 1
            assert "404 Not Found: upstream group 'llm' has no server '10.9.9.9:80'" in ran.err
            assert await status(client, proxy) == document  # nothing changed

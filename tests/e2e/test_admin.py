"""The admin API on a real proxy in this process: status, runtime changes, tokens, state file.

A ``serve_local`` proxy (the pieces ``muxproxy serve`` runs: a ``ProxyServer``, its saved
state, its admin listener) from a TOML file, the admin listener on 127.0.0.1 port 0, in front
of real backends that name themselves in ``x-backend-id`` (``FakeLLM``, and a raw HTTP/1.1
one that holds its stream open until told); httpx speaks to both listeners. What is checked
from the outside: the status document, that a weight, drain or down moves new requests but
not a stream in flight, that a missing or wrong token changes nothing, the messages of refused
bodies and requests, the state file, reloads and metrics. The command line and a real
``python -m muxproxy serve`` are in ``test_admin_process.py``.

Every wait is on a condition (an event, a response) under ``trio.fail_after``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import h11
import httpx
import pytest
import trio
from peers import open_tcp, read_until_eof, serve_raw
from prometheus_client.parser import text_string_to_metric_families

from muxproxy.config import ADMIN_TOKEN_ENV, load_config, parse_quick_config
from muxproxy.config.runtime import RuntimeState, load_state
from muxproxy.config.serverid import server_id
from muxproxy.testing.fakellm import FakeLLM
from muxproxy.trio.admin import serve_admin
from muxproxy.trio.control import LocalControl
from muxproxy.trio.local import serve_local
from muxproxy.trio.server import ProxyServer

if TYPE_CHECKING:
    from conftest import StartBackend

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def write_config(
    path: Path,
    ports: list[int],
    *,
    token: str | None = TOKEN,
    state_file: bool = True,
    admin_address: str = "127.0.0.1:0",
) -> Path:
    servers = ", ".join(f'"127.0.0.1:{port}"' for port in ports)
    lines = [
        "[[listeners]]",
        'address = "127.0.0.1:0"',
        "[upstreams.llm]",
        f"servers = [{servers}]",
        "[admin]",
        f'address = "{admin_address}"',
    ]
    if token is not None:
        lines.append(f'token = "{token}"')
    if state_file:
        lines.append('state_file = "state.json"')
    path.write_text("\n".join(lines) + "\n")
    return path


@attrs.define
class Proxy:
    url: str
    admin: str
    scope: trio.CancelScope


@asynccontextmanager
async def running(config_path: Path) -> AsyncIterator[Proxy]:
    """``serve_local`` for the file at ``config_path``, cancelled on leaving."""
    config = load_config(config_path)
    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()

        async def serve(task_status: trio.TaskStatus[Any]) -> None:
            with scope:
                await serve_local(config, config_path=config_path, task_status=task_status)

        bound, admin = await nursery.start(serve)
        yield Proxy(
            url=f"http://127.0.0.1:{bound[0][1]}", admin=f"http://127.0.0.1:{admin[1]}", scope=scope
        )
        scope.cancel()


@asynccontextmanager
async def admin_client(
    config_path: Path, timeout: float = 5
) -> AsyncIterator[tuple[Proxy, httpx.AsyncClient]]:
    """:func:`running`, with an httpx client (``timeout`` seconds) for both of its listeners."""
    async with running(config_path) as proxy, httpx.AsyncClient(timeout=timeout) as client:
        yield proxy, client


async def start_fleet(start_backend: StartBackend, n: int = 2) -> list[tuple[FakeLLM, int]]:
    return [await start_backend(backend_id=f"gpu{i}", tokens=3, delay=0.0) for i in range(n)]


async def backend_of(client: httpx.AsyncClient, proxy: Proxy) -> str:
    response = await client.get(f"{proxy.url}/health")
    assert response.status_code == 200, response.text
    return response.headers["x-backend-id"]


async def status(client: httpx.AsyncClient, proxy: Proxy) -> dict[str, Any]:
    response = await client.get(f"{proxy.admin}/status")
    assert response.status_code == 200, response.text
    document: dict[str, Any] = response.json()
    return document


def server_entry(document: dict[str, Any], port: int) -> dict[str, Any]:
    for entry in document["groups"]["llm"]["servers"]:
        if entry["address"] == f"127.0.0.1:{port}":
            return dict(entry)
    raise AssertionError(f"no server on port {port} in {document}")


async def patch(
    client: httpx.AsyncClient,
    proxy: Proxy,
    server: str,
    body: Any,
    *,
    headers: dict[str, str] | None = None,
    group: str = "llm",
) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await client.patch(
        f"{proxy.admin}/upstreams/{group}/servers/{server}",
        content=content,
        headers=AUTH if headers is None else headers,
    )


async def test_status_lists_groups_servers_listeners_and_workers(
    start_backend: StartBackend, tmp_path: Path
) -> None:
    (_, p0), (_, p1) = await start_fleet(start_backend)
    with trio.fail_after(10):
        config = write_config(tmp_path / "muxproxy.toml", [p0, p1])
        async with admin_client(config) as (proxy, client):
            document = await status(client, proxy)
    group = document["groups"]["llm"]
    assert group["balance"] == "round_robin"
    assert [entry["address"] for entry in group["servers"]] == [
        f"127.0.0.1:{p0}",
        f"127.0.0.1:{p1}",
    ]
    first = group["servers"][0]
    assert first == {
        "address": f"127.0.0.1:{p0}",
        "id": server_id("llm", f"127.0.0.1:{p0}").decode(),
        "weight": 1,
        "effective_weight": 1,
        "configured_weight": 1,
        "state": "up",
        "health": "healthy",
        "active": 0,
        "failures": 0,
        "max_streams": None,
        "work": 0,
        "reported": None,
    }
    assert group["queue"] == {"waiting": 0, "max": 1000}
    assert document["generation"] == 1
    assert document["workers"] == [{"pid": os.getpid(), "generation": 1}]
    assert document["listeners"]["configured"] == [{"address": "127.0.0.1:0", "tls": False}]
    assert document["listeners"]["bound"] == [proxy.url.removeprefix("http://")]
    assert {"clients", "upstream_connections", "streams"} <= set(document)


@attrs.define
class GatedBackend:
    """An HTTP/1.1 backend whose SSE stream sends one event, then waits for ``gate``."""

    gate: trio.Event = attrs.field(factory=trio.Event)
    started: trio.Event = attrs.field(factory=trio.Event)
    finished: trio.Event = attrs.field(factory=trio.Event)

    async def handle(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.EndOfMessage):
                break
        head = h11.Response(
            status_code=200,
            headers=[("content-type", "text/event-stream"), ("x-backend-id", "gated")],
        )
        await stream.send_all(conn.send(head) + conn.send(h11.Data(data=b"data: one\n\n")))
        self.started.set()
        await self.gate.wait()
        await stream.send_all(conn.send(h11.Data(data=b"data: two\n\n")))
        await stream.send_all(conn.send(h11.EndOfMessage()))
        self.finished.set()
        await stream.aclose()


@pytest.mark.parametrize(
    ("change", "state"),
    [({"weight": 0}, "draining"), ({"drain": True}, "draining"), ({"down": True}, "down")],
)
async def test_a_change_moves_new_requests_but_not_a_stream_in_flight(
    start_backend: StartBackend,
    nursery: trio.Nursery,
    tmp_path: Path,
    change: dict[str, Any],
    state: str,
) -> None:
    gated = GatedBackend()
    p0 = await serve_raw(nursery, gated.handle)
    _, p1 = await start_backend(backend_id="gpu1", tokens=3, delay=0.0)
    with trio.fail_after(15):
        config = write_config(tmp_path / "muxproxy.toml", [p0, p1])
        async with admin_client(config, timeout=10) as (proxy, client):
            # While gpu1 is down the stream goes to the gated backend, which holds it open.
            response = await patch(client, proxy, f"127.0.0.1:{p1}", {"down": True})
            assert response.status_code == 200, response.text
            async with client.stream("GET", f"{proxy.url}/events") as stream:
                assert stream.headers["x-backend-id"] == "gated"
                chunks = stream.aiter_bytes()
                received = [await anext(chunks)]
                await gated.started.wait()
                response = await patch(client, proxy, f"127.0.0.1:{p0}", change)
                assert response.status_code == 200, response.text
                assert (response.json()["state"], response.json()["active"]) == (state, 1)
                response = await patch(client, proxy, f"127.0.0.1:{p1}", {"down": False})
                assert response.status_code == 200, response.text
                served = [await backend_of(client, proxy) for _ in range(6)]
                assert served == ["gpu1"] * 6
                gated.gate.set()
                received.extend([chunk async for chunk in chunks])
            assert b"".join(received) == b"data: one\n\ndata: two\n\n"
            assert gated.finished.is_set()
            after = server_entry(await status(client, proxy), p0)
            assert (after["state"], after["active"]) == (state, 0)


async def test_a_server_is_named_by_address_encoded_or_not_or_by_its_id(
    start_backend: StartBackend, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="muxproxy.admin")
    (_, p0), (_, p1) = await start_fleet(start_backend)
    with trio.fail_after(10):
        config = write_config(tmp_path / "muxproxy.toml", [p0, p1])
        async with admin_client(config) as (proxy, client):
            ident = server_id("llm", f"127.0.0.1:{p1}").decode()
            for server, weight in ((f"127.0.0.1%3A{p0}", 3), (f"127.0.0.1:{p0}", 4), (ident, 5)):
                response = await patch(client, proxy, server, {"weight": weight})
                assert response.status_code == 200, response.text
            document = await status(client, proxy)
    assert server_entry(document, p0)["weight"] == 4
    assert server_entry(document, p0)["configured_weight"] == 1
    assert server_entry(document, p1)["weight"] == 5
    # Each change is logged with who made it (the client's address) and what it was.
    changes = [r.getMessage() for r in caplog.records if r.name == "muxproxy.admin"]
    assert len(changes) == 3
    assert all(message.startswith("admin: 127.0.0.1:") for message in changes)
    assert changes[2].endswith(f": upstream llm server 127.0.0.1:{p1}: weight=5")


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": "Bearer"},
    ],
)
async def test_a_missing_or_wrong_token_is_401_and_changes_nothing(
    start_backend: StartBackend,
    tmp_path: Path,
    headers: dict[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    (_, p0), (_, p1) = await start_fleet(start_backend)
    with trio.fail_after(10):
        config = write_config(tmp_path / "muxproxy.toml", [p0, p1])
        async with admin_client(config) as (proxy, client):
            before = await status(client, proxy)
            response = await patch(
                client, proxy, f"127.0.0.1:{p0}", {"down": True}, headers=headers
            )
            assert response.status_code == 401
            assert response.headers["www-authenticate"].startswith("Bearer")
            assert "token" in response.json()["error"]
            reload = await client.post(f"{proxy.admin}/reload", headers=headers)
            assert reload.status_code == 401
            assert await status(client, proxy) == before
            assert {await backend_of(client, proxy) for _ in range(4)} == {"gpu0", "gpu1"}
    assert not (tmp_path / "state.json").exists()
    refused = [r for r in caplog.records if r.name == "muxproxy.admin"]
    assert [r.levelname for r in refused] == ["WARNING", "WARNING"]
    assert "PATCH /upstreams/llm/servers/" in refused[0].getMessage()
    assert "POST /reload refused" in refused[1].getMessage()


async def test_without_a_token_changes_are_refused_and_reads_stay_open_on_loopback(
    start_backend: StartBackend, tmp_path: Path
) -> None:
    (_, p0), (_, p1) = await start_fleet(start_backend)
    config = write_config(tmp_path / "muxproxy.toml", [p0, p1], token=None)
    with trio.fail_after(10):
        async with admin_client(config) as (proxy, client):
            before = await status(client, proxy)
            response = await patch(client, proxy, f"127.0.0.1:{p0}", {"weight": 0})
            assert response.status_code == 403
            assert "[admin] token" in response.json()["error"]
            assert "MUXPROXY_ADMIN_TOKEN" in response.json()["error"]
            assert await status(client, proxy) == before


async def test_reads_on_a_non_loopback_address_need_the_token(
    start_backend: StartBackend, tmp_path: Path
) -> None:
    (_, p0), (_, p1) = await start_fleet(start_backend)
    config = write_config(tmp_path / "muxproxy.toml", [p0, p1], admin_address="0.0.0.0:0")
    with trio.fail_after(10):
        async with admin_client(config) as (proxy, client):
            for path in ("/status", "/metrics"):
                refused = await client.get(f"{proxy.admin}{path}")
                assert refused.status_code == 401, path
                assert refused.headers["www-authenticate"].startswith("Bearer")
                allowed = await client.get(f"{proxy.admin}{path}", headers=AUTH)
                assert allowed.status_code == 200, path


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "body: not JSON"),
        (b"[1, 2]", "body: expected a JSON object"),
        (b"{}", "body: empty object"),
        ({"wieght": 2}, "wieght: unknown field; expected weight, drain or down"),
        ({"weight": -1}, "weight: expected an integer from 0 to 1000000"),
        ({"weight": "2"}, "weight: expected an integer from 0 to 1000000"),
        ({"weight": 1.5}, "weight: expected an integer from 0 to 1000000"),
        ({"weight": True}, "weight: expected an integer from 0 to 1000000"),
        ({"weight": 2**64}, "weight: expected an integer from 0 to 1000000"),
        (b'{"weight": 1e330}', "weight: expected an integer from 0 to 1000000"),
        ({"drain": "yes"}, "drain: expected true or false"),
        ({"weight": 2, "down": 1}, "down: expected true or false"),
        (b"[" * 20_000, "body: larger than 16384 bytes"),
        (b"\xff\xfe", "body: not JSON"),
    ],
)
async def test_a_bad_body_is_refused_naming_the_field(
    start_backend: StartBackend, tmp_path: Path, body: Any, message: str
) -> None:
    (_, p0), (_, p1) = await start_fleet(start_backend)
    with trio.fail_after(10):
        config = write_config(tmp_path / "muxproxy.toml", [p0, p1])
        async with admin_client(config) as (proxy, client):
            before = await status(client, proxy)
            response = await patch(client, proxy, f"127.0.0.1:{p0}", body)
            assert response.status_code == (413 if "larger" in message else 400)
            assert response.json()["error"].startswith(message), response.json()
            assert await status(client, proxy) == before


async def test_an_unknown_group_or_server_is_404_naming_it(
    start_backend: StartBackend, tmp_path: Path
) -> None:
    (_, p0), (_, p1) = await start_fleet(start_backend)
    with trio.fail_after(10):
        config = write_config(tmp_path / "muxproxy.toml", [p0, p1])
        async with admin_client(config) as (proxy, client):
            response = await patch(client, proxy, f"127.0.0.1:{p0}", {"weight": 2}, group="gpus")
            assert response.status_code == 404
            assert "unknown upstream group 'gpus'" in response.json()["error"]
            assert "llm" in response.json()["error"]
            response = await patch(client, proxy, "10.0.0.9%3A8000", {"weight": 2})
            assert response.status_code == 404
            assert "no server '10.0.0.9:8000'" in response.json()["error"]
            response = await client.get(f"{proxy.admin}/upstreams", headers=AUTH)
            assert response.status_code == 404
            assert "GET /status" in response.json()["error"]
            response = await client.delete(f"{proxy.admin}/status", headers=AUTH)
            assert response.status_code == 405
            assert response.headers["allow"] == "GET"


async def test_the_state_file_is_replaced_whole_and_read_at_the_next_start(
    start_backend: StartBackend, tmp_path: Path
) -> None:
    (_, p0), (_, p1) = await start_fleet(start_backend)
    config = write_config(tmp_path / "muxproxy.toml", [p0, p1])
    state_file = tmp_path / "state.json"
    with trio.fail_after(15):
        async with admin_client(config) as (proxy, client):
            response = await patch(client, proxy, f"127.0.0.1:{p0}", {"weight": 0})
            assert response.status_code == 200, response.text
            response = await patch(client, proxy, f"127.0.0.1:{p1}", {"weight": 7, "drain": False})
            assert response.status_code == 200, response.text
            saved = json.loads(state_file.read_text())
            assert (
                saved
                == RuntimeState.empty()
                .changed("llm", f"127.0.0.1:{p0}", weight=0)
                .changed("llm", f"127.0.0.1:{p1}", weight=7)
                .to_json()
            )
            # Written through a temporary file that is renamed: none is left behind.
            assert sorted(os.listdir(tmp_path)) == ["muxproxy.toml", "state.json"]
        async with admin_client(config) as (proxy, client):
            document = await status(client, proxy)
            assert server_entry(document, p0)["weight"] == 0
            assert server_entry(document, p1)["weight"] == 7
            assert {await backend_of(client, proxy) for _ in range(4)} == {"gpu1"}
            # Back to the configured weight: the entry leaves the file.
            response = await patch(client, proxy, f"127.0.0.1:{p0}", {"weight": None})
            assert response.status_code == 200, response.text
            assert response.json()["weight"] == response.json()["configured_weight"] == 1
    assert load_state(state_file).servers.keys() == {("llm", f"127.0.0.1:{p1}")}


async def test_a_state_file_that_went_bad_stops_the_start_naming_it(
    start_backend: StartBackend, tmp_path: Path
) -> None:
    (_, p0), (_, p1) = await start_fleet(start_backend)
    config_file = write_config(tmp_path / "muxproxy.toml", [p0, p1])
    config = load_config(config_file)
    # Broken after the configuration was checked (muxproxy check reports it before that).
    (tmp_path / "state.json").write_text('{"version": 1, "servers": [{"group": 1}]}')
    with trio.fail_after(10), pytest.raises(OSError, match=r"admin\.state_file: .*servers\[0\]"):
        await serve_local(config, config_path=config_file)


async def test_malformed_requests_are_answered_and_the_proxy_goes_on(
    start_backend: StartBackend, tmp_path: Path
) -> None:
    (_, p0), (_, p1) = await start_fleet(start_backend)
    with trio.fail_after(10):
        config = write_config(tmp_path / "muxproxy.toml", [p0, p1])
        async with admin_client(config) as (proxy, client):
            port = int(proxy.admin.rsplit(":", 1)[1])
            head = b"GET /status HTTP/1.1\r\nhost: a\r\nx-pad: "
            for garbage, statuses in (
                (b"NOT HTTP AT ALL\r\n\r\n", (400,)),
                (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n", (400,)),  # TLS
                (head + b"a" * 20_000 + b"\r\n\r\n", (431,)),
                (head + b"a" * 30_000, (431,)),  # still incomplete past the bound
            ):
                async with await open_tcp(port) as stream:
                    await stream.send_all(garbage)
                    answer = await read_until_eof(stream)
                assert int(answer.split(b" ", 2)[1]) in statuses, answer[:80]
            assert await backend_of(client, proxy) in {"gpu0", "gpu1"}
            assert (await client.get(f"{proxy.admin}/status")).status_code == 200


async def test_reload_applies_a_valid_file_and_keeps_the_running_one_for_an_invalid_one(
    start_backend: StartBackend, tmp_path: Path
) -> None:
    (_, p0), (_, p1), (_, p2) = await start_fleet(start_backend, 3)
    config = write_config(tmp_path / "muxproxy.toml", [p0, p1])
    with trio.fail_after(15):
        async with admin_client(config) as (proxy, client):
            response = await patch(client, proxy, f"127.0.0.1:{p0}", {"weight": 0})
            assert response.status_code == 200, response.text
            write_config(config, [p0, p1, p2], token="rotated-token")
            response = await client.post(f"{proxy.admin}/reload", headers=AUTH)
            assert (response.status_code, response.json()) == (200, {"ok": True, "generation": 2})
            # The token of the new file guards the changes from now on.
            rotated = {"Authorization": "Bearer rotated-token"}
            response = await patch(client, proxy, f"127.0.0.1:{p1}", {"weight": 2})
            assert response.status_code == 401
            document = await status(client, proxy)
            assert document["generation"] == 2
            assert document["workers"] == [{"pid": os.getpid(), "generation": 2}]
            # The runtime weight outlives the reload; the new server takes requests.
            assert server_entry(document, p0)["weight"] == 0
            assert server_entry(document, p2)["state"] == "up"
            assert {await backend_of(client, proxy) for _ in range(6)} == {"gpu1", "gpu2"}

            config.write_text(config.read_text().replace('address = "127.0.0.1:0"', "adress = 1"))
            response = await client.post(f"{proxy.admin}/reload", headers=rotated)
            assert response.status_code == 422
            assert response.json()["ok"] is False
            assert response.json()["generation"] == 2
            assert any("adress: unknown key" in e for e in response.json()["errors"])
            after = await status(client, proxy)
            assert (after["generation"], after["groups"]) == (2, document["groups"])
            assert {await backend_of(client, proxy) for _ in range(6)} == {"gpu1", "gpu2"}

            response = await client.post(f"{proxy.admin}/reload?restart=1", headers=rotated)
            assert response.status_code == 400
            assert "--workers" in response.json()["error"]
            response = await client.post(f"{proxy.admin}/reload?restart=maybe", headers=rotated)
            assert response.status_code == 400
            assert response.json()["error"].startswith("restart: expected 1 or 0")


async def test_a_proxy_started_from_flags_has_nothing_to_reload(
    start_backend: StartBackend,
) -> None:
    _, p0 = await start_backend(backend_id="gpu0")
    config = parse_quick_config(
        "127.0.0.1:0", [f"127.0.0.1:{p0}"], admin="127.0.0.1:0", environ={ADMIN_TOKEN_ENV: TOKEN}
    )
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            _, admin = await nursery.start(serve_local, config)
            async with httpx.AsyncClient(timeout=5) as client:
                response = await client.post(f"http://127.0.0.1:{admin[1]}/reload", headers=AUTH)
                assert response.status_code == 400
                assert "--config FILE" in response.json()["error"]
                response = await client.patch(
                    f"http://127.0.0.1:{admin[1]}/upstreams/default/servers/127.0.0.1:{p0}",
                    json={"weight": 3},
                    headers=AUTH,
                )
                assert (response.status_code, response.json()["weight"]) == (200, 3)
            nursery.cancel_scope.cancel()


async def test_metrics_are_prometheus_text(start_backend: StartBackend, tmp_path: Path) -> None:
    (_, p0), (_, p1) = await start_fleet(start_backend)
    with trio.fail_after(10):
        config = write_config(tmp_path / "muxproxy.toml", [p0, p1])
        async with admin_client(config) as (proxy, client):
            for _ in range(4):
                await backend_of(client, proxy)
            response = await patch(client, proxy, f"127.0.0.1:{p1}", {"weight": 3})
            assert response.status_code == 200, response.text
            response = await client.get(f"{proxy.admin}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }
    requests = sum(
        value for (name, _), value in samples.items() if name == "muxproxy_requests_total"
    )
    assert requests == 4
    # The operator's weight shows in the exposition too.
    labels = (("group", "llm"), ("server", f"127.0.0.1:{p1}"))
    assert samples[("muxproxy_server_weight", labels)] == 3


async def test_a_body_that_does_not_arrive_in_time_is_408_and_changes_nothing(
    start_backend: StartBackend, nursery: trio.Nursery, tmp_path: Path
) -> None:
    (_, p0), (_, p1) = await start_fleet(start_backend)
    # serve_admin over a Control, on its own: how a supervisor of workers serves it too.
    server = ProxyServer(load_config(write_config(tmp_path / "muxproxy.toml", [p0, p1])))
    await nursery.start(server.run)
    control = LocalControl(server)
    _, port = await nursery.start(
        partial(serve_admin, "127.0.0.1:0", control, TOKEN, body_timeout=0.2)
    )
    head = (
        f"PATCH /upstreams/llm/servers/127.0.0.1:{p0} HTTP/1.1\r\nhost: admin\r\n"
        f"authorization: Bearer {TOKEN}\r\ncontent-length: 20\r\n\r\n"
    )
    with trio.fail_after(5):
        async with await open_tcp(port) as stream:
            await stream.send_all(head.encode() + b'{"wei')
            answer = await read_until_eof(stream)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
    assert b"body: not received within 0.2 seconds" in answer
    assert server_entry(await control.status(), p0)["weight"] == 1

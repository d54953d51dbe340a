"""Conversations through real ``muxproxy serve`` processes, for the tests of the shared memory
of sessions: each conversation has a session key (``X-Chat-ID``), each turn goes over a fresh
connection (so the kernel may hand it to any worker, and a test may send it to any replica),
and the fake backends say which server answered (``x-backend-id``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import trio

TOKEN = "sessions-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GROUP = "gpus"
CONCURRENCY = 25
"""Turns in flight at once."""
LEARN_TIMEOUT = 5.0
"""Seconds a test waits for the memory to reach every process (then it goes on regardless:
a process that never learns is what the test catches)."""


def config_text(
    ports: Mapping[str, int],
    *,
    weights: Mapping[str, int] | None = None,
    store: str | None = None,
    rate_limit: str | None = None,
) -> str:
    """A listener and an admin API on port 0; one group of the fake backends ``ports``
    (name -> port), keyed by ``X-Chat-ID``; ``[fleet] store`` when given; with ``rate_limit``
    (the table's lines), per tenant of the ``Authorization`` header."""
    servers = [
        f'  {{ address = "127.0.0.1:{port}", weight = {(weights or {}).get(name, 1)} }},'
        for name, port in ports.items()
    ]
    lines = [
        "[[listeners]]",
        'address = "127.0.0.1:0"',
        "[admin]",
        'address = "127.0.0.1:0"',
        f'token = "{TOKEN}"',
        "[log]",
        'access = "off"',
    ]
    if store is not None:
        lines += ["[fleet]", f'store = "{store}"']
    lines += [
        f"[upstreams.{GROUP}]",
        "servers = [",
        *servers,
        "]",
        *(() if rate_limit is None else ['tenant = "header:authorization"']),
        f"[upstreams.{GROUP}.sticky]",
        'sources = ["header:X-Chat-ID"]',
        "[[routes]]",
        'prefix = "/"',
        f'upstream = "{GROUP}"',
    ]
    if rate_limit is not None:
        lines += [f"[upstreams.{GROUP}.rate_limit]", rate_limit]
    lines.append("")
    return "\n".join(lines)


def fresh_client() -> httpx.AsyncClient:
    """A client that keeps no connection: every request opens one of its own."""
    limits = httpx.Limits(max_keepalive_connections=0)
    return httpx.AsyncClient(limits=limits, timeout=30, headers={"Connection": "close"})


async def turn(
    client: httpx.AsyncClient,
    proxy_url: str,
    key: str,
    headers: Mapping[str, str] | None = None,
) -> str:
    """One streamed turn of conversation ``key`` (``headers`` added to its own); the backend
    that answered it."""
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": key}]}
    async with client.stream(
        "POST",
        f"{proxy_url}/v1/chat/completions",
        json=body,
        headers={"X-Chat-ID": key, **(headers or {})},
    ) as response:
        assert response.status_code == 200, (key, response.status_code)
        text = b"".join([chunk async for chunk in response.aiter_bytes()])
        assert b"data: [DONE]" in text, (key, text[-200:])
        backend = response.headers.get("x-backend-id")
    assert backend is not None
    return str(backend)


async def turns(client: httpx.AsyncClient, routes: Sequence[tuple[str, str]]) -> dict[str, str]:
    """One turn of each ``(key, proxy_url)``, ``CONCURRENCY`` at a time; key -> backend."""
    answered: dict[str, str] = {}
    limiter = trio.CapacityLimiter(CONCURRENCY)

    async def one(key: str, url: str) -> None:
        async with limiter:
            answered[key] = await turn(client, url, key)

    async with trio.open_nursery() as nursery:
        for key, url in routes:
            nursery.start_soon(one, key, url)
    return answered


async def admin(admin_url: str, method: str, path: str, body: object = None) -> Any:
    async with httpx.AsyncClient(base_url=admin_url, timeout=10) as client:
        response = await client.request(method, path, json=body, headers=AUTH)
    assert response.status_code == 200, (method, path, response.text)
    return response.json()


async def set_weight(admin_url: str, port: int, weight: int) -> None:
    await admin(
        admin_url, "PATCH", f"/upstreams/{GROUP}/servers/127.0.0.1:{port}", {"weight": weight}
    )


async def sessions_status(admin_url: str) -> dict[str, Any]:
    """``/status``'s ``sessions`` (empty where the proxy has none)."""
    status = await admin(admin_url, "GET", "/status")
    sessions = status.get("sessions", {})
    assert isinstance(sessions, dict)
    return sessions


async def wait_learned(admin_url: str, at_least: int) -> int:
    """Poll ``/status`` until its ``sessions.learned`` reaches ``at_least`` or
    ``LEARN_TIMEOUT`` passes; the last count seen."""
    learned = 0
    with trio.move_on_after(LEARN_TIMEOUT):
        while (learned := (await sessions_status(admin_url)).get("learned", 0)) < at_least:
            await trio.sleep(0.05)
    return int(learned)


def moved(before: Mapping[str, str], after: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """The conversations whose turn went to another server: (key, before, after)."""
    return [(key, before[key], after[key]) for key in before if after[key] != before[key]]

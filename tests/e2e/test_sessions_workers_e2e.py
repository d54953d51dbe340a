"""``muxproxy serve --workers 2``: the workers of one host share the memory of sessions.

200 conversations, each keyed by ``X-Chat-ID``, take their first turn over fresh connections
(the kernel spreads them over both workers); then a weight change through the admin API
moves the rendezvous hash of many keys; then every conversation's second turn comes over a
fresh connection again, landing on either worker. Each worker must know where the other sent
a conversation (relayed through the supervisor, ``trio/fleetsessions.py``), so no
conversation changes server: it would lose its GPU's KV cache. Before, each worker
remembered only its own (63 of 200 conversations moved).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio
from conversations import (
    config_text,
    fresh_client,
    moved,
    sessions_status,
    set_weight,
    turns,
    wait_learned,
)
from processes import proxy_process

if TYPE_CHECKING:
    from conftest import StartBackend

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="--workers needs Linux (SO_REUSEPORT)"
)

CONVERSATIONS = 200
BACKENDS = ("a", "b", "c", "d")


async def test_workers_keep_every_conversation_on_its_server_across_a_weight_change(
    tmp_path: Path, nursery: trio.Nursery, start_backend: StartBackend
) -> None:
    ports = {}
    for name in BACKENDS:
        _, ports[name] = await start_backend(backend_id=name, tokens=2, delay=0.0)
    path = tmp_path / "muxproxy.toml"
    path.write_text(config_text(ports))
    keys = [f"conversation-{n}" for n in range(CONVERSATIONS)]
    with trio.fail_after(55):
        async with (
            proxy_process(nursery, "--workers", "2", config=path, admin=True) as proxy,
            fresh_client() as client,
        ):
            first = await turns(client, [(key, proxy.url) for key in keys])
            # Each worker learns what the other remembered: 200 entries learned in all.
            learned = await wait_learned(proxy.admin_url, CONVERSATIONS)
            # "a" takes most new sessions, "b" none: most keys hash elsewhere now.
            await set_weight(proxy.admin_url, ports["a"], 10)
            await set_weight(proxy.admin_url, ports["b"], 0)
            second = await turns(client, [(key, proxy.url) for key in keys])
            sessions = await sessions_status(proxy.admin_url)
    print(
        "\nsessions across workers:",
        json.dumps({"learned": learned, "moved": len(moved(first, second)), **sessions}),
    )
    assert len(set(first.values())) == len(BACKENDS), first  # every server had some
    assert not moved(first, second), (len(moved(first, second)), moved(first, second)[:5])

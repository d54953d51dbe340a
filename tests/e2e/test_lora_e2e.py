"""End to end: LoRA affinity through a real proxy, in front of fake engines that hold LoRA
adapters and report them as vLLM does (``vllm:lora_requests_info`` on ``/metrics``).

Real sockets on 127.0.0.1, Hypercorn-served backends, httpx as the client. Every wait is on
a condition (a proxy log record, a backend counter) under ``trio.fail_after``.
"""

from __future__ import annotations

from typing import Any

import httpx
import trio
from test_balancing_e2e import config
from test_routing_e2e import LogCapture

from muxproxy.config import LoadReporting
from muxproxy.testing.fakellm import MODEL
from muxproxy.testing.fakellm.lora import LoraSlots

CHAT = "/v1/chat/completions"
TEST_TIMEOUT = 20


async def served_by(client: httpx.AsyncClient, url: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    response = await client.post(url + CHAT, json=body)
    assert response.status_code == 200
    assert b"data: [DONE]" in response.content
    return response.headers["x-backend-id"]


async def test_adapters_go_where_they_are_held_and_new_ones_to_a_free_slot(
    start_backend: Any, start_proxy: Any
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        held = {"gpu0": (["x"], 1), "gpu1": (["y"], 2), "gpu2": (["z"], 1)}
        engines = {
            name: await start_backend(
                backend_id=name, tokens=2, delay=0, lora=LoraSlots.of(adapters, slots)
            )
            for name, (adapters, slots) in held.items()
        }
        ports = [port for _, port in engines.values()]
        proxy = await start_proxy(config=config(ports, load_report=LoadReporting(interval=0.2)))
        logs = LogCapture(proxy)
        await logs.wait_until(
            lambda: sum(r.event == "load_report" and r.fields["ok"] for r in logs.records) >= 3
        )
        async with httpx.AsyncClient() as client:
            url = proxy.url
            assert [await served_by(client, url, "x") for _ in range(4)] == ["gpu0"] * 4
            assert [await served_by(client, url, "z") for _ in range(4)] == ["gpu2"] * 4
            # A new adapter: gpu1 alone has a free slot, and loads it.
            assert await served_by(client, url, "w") == "gpu1"
            fake = engines["gpu1"][0]
            assert fake.lora is not None and list(fake.lora.held) == ["y", "w"]
            # The base model is not an adapter: round-robin as without LoRA.
            base = {await served_by(client, url, MODEL) for _ in range(3)}
            assert base == {"gpu0", "gpu1", "gpu2"}
        for name, (fake, _) in engines.items():
            assert fake.lora is not None
            assert fake.lora.loads == (1 if name == "gpu1" else 0)  # no adapter swapped in

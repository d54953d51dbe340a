"""The fake LLM backend's LoRA adapters (``muxproxy.testing.fakellm.lora``): held least
recently used first, loaded by a request naming one, and reported in ``/metrics`` as vLLM's
``lora_requests_info``, read back by the proxy's own load-report parser."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

import httpx
import pytest
import trio

from muxproxy.routing.loadreport import parse_load_report
from muxproxy.routing.lora import LoraReport
from muxproxy.testing.fakellm import MODEL
from muxproxy.testing.fakellm.knobs import add_arguments
from muxproxy.testing.fakellm.lora import LoraSlots
from muxproxy.testing.fakellm.server import run

if TYPE_CHECKING:
    from conftest import StartBackend

CHAT = "/v1/chat/completions"


def test_slots_evict_the_least_recently_used_adapter() -> None:
    slots = LoraSlots.of(["a", "b"], 2)
    assert slots is not None
    slots.use("a")  # now b is the least recently used
    slots.use("c")
    assert list(slots.held) == ["a", "c"]
    assert slots.loads == 1
    slots.use("c")
    assert (list(slots.held), slots.loads) == (["a", "c"], 1)
    assert slots.labels() == ("2", "", "a,c")


def test_slots_from_the_command_line() -> None:
    assert LoraSlots.of([], None) is None
    only_adapters = LoraSlots.of(["a", "b", "c"], None)
    assert only_adapters is not None and only_adapters.max_lora == 3
    empty = LoraSlots.of([], 2)
    assert empty is not None and (empty.max_lora, list(empty.held)) == (2, [])
    with pytest.raises(ValueError, match="more than --max-lora 1"):
        LoraSlots.of(["a", "b"], 1)


def test_the_lora_options_parse(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--lora-adapters", "a, b", "--max-lora", "2"])
    assert (args.lora_adapters, args.max_lora) == (["a", "b"], 2)
    for bad in (["--max-lora", "0"], ["--lora-adapters", " , "]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    too_many = parser.parse_args(["--lora-adapters", "a,b", "--max-lora", "1"])
    assert run(too_many) == 2
    assert "more than --max-lora 1" in capsys.readouterr().err


async def report(client: httpx.AsyncClient) -> LoraReport | None:
    response = await client.get("/metrics")
    assert response.status_code == 200
    parsed = parse_load_report(response.content)
    assert parsed.models == frozenset({MODEL})
    return parsed.lora


async def ask(client: httpx.AsyncClient, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": False}
    response = await client.post(CHAT, content=json.dumps(body))
    assert response.status_code == 200
    assert response.json()["model"] == model


async def test_requests_load_adapters_and_metrics_report_them(
    start_backend: StartBackend,
) -> None:
    fake, port = await start_backend(tokens=1, delay=0, lora=LoraSlots.of(["a", "b"], 2))
    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert await report(client) == LoraReport(loaded=frozenset({"a", "b"}), max_lora=2)
            await ask(client, "c")  # a, the least recently used, goes
            assert await report(client) == LoraReport(loaded=frozenset({"b", "c"}), max_lora=2)
            await ask(client, MODEL)  # the base model: no adapter
            await ask(client, "b")
            await ask(client, "d")  # c goes
            assert await report(client) == LoraReport(loaded=frozenset({"b", "d"}), max_lora=2)
    assert fake.lora is not None and fake.lora.loads == 2


async def test_without_lora_no_adapter_is_reported(start_backend: StartBackend) -> None:
    _, port = await start_backend(tokens=1, delay=0)
    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            await ask(client, "c")
            response = await client.get("/metrics")
    assert b"lora_requests_info" not in response.content

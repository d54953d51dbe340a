"""End to end: ``GET /v1/models`` answered by a real proxy, read by the official SDKs.

Two groups behind one proxy: ``listed`` names its models in the configuration, ``learning``
learns them from its fake LLM backends' own ``/v1/models`` (``fake-llm``). The OpenAI SDK's
``models.list()`` sees the union, each name once; ``models.retrieve()`` finds a learnt model
and gets ``NotFoundError`` (404, ``model_not_found``) for an unknown one; the Anthropic SDK's
``models.list()`` gets Anthropic's list; an HTTP/2 client gets the same answers (HEAD without
a body). Each SDK runs in a worker thread; the proxy's
learning is awaited on its log (``models_poll``), never on elapsed time.
"""

from __future__ import annotations

from typing import Any

import anthropic
import attrs
import httpx
import openai
import pytest
import trio
from test_routing_e2e import LogCapture

from muxproxy.config import Route, Server, Upstream, quick_config
from muxproxy.testing.fakellm import MODEL


async def test_sdks_list_the_union_of_configured_and_learnt_models(
    start_backend: Any, start_proxy: Any
) -> None:
    with trio.fail_after(15):
        _, port_a = await start_backend(backend_id="a")
        _, port_b = await start_backend(backend_id="b")
        listed = Upstream(
            name="listed",
            servers=(Server(address="127.0.0.1:9"),),  # never asked: its models are listed
            models=("llama-3.1-70b", MODEL),
        )
        learning = Upstream(
            name="learning",
            servers=(Server(address=f"127.0.0.1:{port_a}"), Server(address=f"127.0.0.1:{port_b}")),
            learn_models=True,
        )
        config = attrs.evolve(
            quick_config("127.0.0.1:0", ["127.0.0.1:9"]),
            upstreams={"listed": listed, "learning": learning},
            routes=(Route(prefix="/", upstream="learning"),),
        )
        proxy = await start_proxy(config=config)
        logs = LogCapture(proxy)
        await logs.wait_until(lambda: sum(1 for r in logs.records if r.event == "models_poll") >= 2)
        polls = [r.fields for r in logs.records if r.event == "models_poll"]
        assert all(p["ok"] and p["models"] == 1 for p in polls), polls
        base = proxy.url + "/v1"
        client = openai.OpenAI(base_url=base, api_key="x", timeout=5, max_retries=0)
        claude = anthropic.Anthropic(base_url=proxy.url, api_key="x", timeout=5, max_retries=0)

        def use_sdks() -> tuple[list[Any], Any, Any, list[Any]]:
            listed = list(client.models.list())
            found = client.models.retrieve(MODEL)
            with pytest.raises(openai.NotFoundError) as missing:
                client.models.retrieve("gpt-nothing")
            return listed, found, missing.value, list(claude.models.list())

        models, found, missing, claude_models = await trio.to_thread.run_sync(use_sdks)
        async with httpx.AsyncClient(http1=False, http2=True, base_url=proxy.url) as h2c:
            over_h2 = await h2c.get("/v1/models")
            head = await h2c.head("/v1/models/llama-3.1-70b")
    assert (over_h2.http_version, over_h2.status_code) == ("HTTP/2", 200)
    assert [m["id"] for m in over_h2.json()["data"]] == ["llama-3.1-70b", MODEL]
    assert (head.status_code, head.content) == (200, b"")
    assert [m.id for m in models] == ["llama-3.1-70b", MODEL]
    assert all(m.object == "model" for m in models)
    assert (found.id, found.owned_by) == (MODEL, "muxproxy")  # as fakellm says
    assert missing.status_code == 404
    assert missing.code == "model_not_found"
    assert [m.id for m in claude_models] == ["llama-3.1-70b", MODEL]
    assert all(m.type == "model" and m.display_name == m.id for m in claude_models)
    status = proxy.server.core.status()["groups"]
    assert status["listed"]["models"] == {
        "source": "configured",
        "models": ["llama-3.1-70b", MODEL],
    }
    learnt = status["learning"]["models"]
    assert learnt["source"] == "learnt" and learnt["models"] == [MODEL]
    for server in learnt["servers"].values():
        assert server["models"] == [MODEL] and server["last_error"] is None

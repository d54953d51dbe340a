"""End to end: a thinking model (long first delay) gets ``: keep-alive`` comments, events intact."""

from __future__ import annotations

import json

import attrs
import httpx
import pytest
import trio

from muxproxy.config import Route, quick_config
from muxproxy.testing.fakellm import MODEL, reply_text

TOKENS = 4


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "h2c-prior-knowledge"])
async def test_thinking_model_gets_keep_alive_comments_before_the_first_token(
    start_backend, start_proxy, http2
):
    fake, backend = await start_backend(first_delay=0.3, delay=0.005)
    config = quick_config("127.0.0.1:0", [f"127.0.0.1:{backend}"])
    config = attrs.evolve(
        config, routes=(Route(prefix="/", upstream="default", sse_heartbeat=0.05),)
    )
    proxy = await start_proxy(config=config)
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "think first"}],
        "stream": True,
        "max_tokens": TOKENS,
    }
    raw = b""
    with trio.fail_after(10):
        async with (
            httpx.AsyncClient(http1=not http2, http2=http2, timeout=5) as client,
            client.stream("POST", proxy.url + "/v1/chat/completions", json=request) as response,
        ):
            assert response.status_code == 200
            async for chunk in response.aiter_raw():
                raw += chunk
    assert response.http_version == ("HTTP/2" if http2 else "HTTP/1.1")

    text = raw.decode()
    before_first_token, _, _ = text.partition("data:")
    # 0.3 s of thinking at a 0.05 s interval: several comments, and nothing else yet.
    assert before_first_token.count(": keep-alive\n\n") >= 2
    assert before_first_token.replace(": keep-alive\n\n", "") == ""
    events = [block for block in text.split("\n\n") if block and block != ": keep-alive"]
    assert all(block.startswith("data: ") and "\n" not in block for block in events)
    assert events[-1] == "data: [DONE]"
    content = "".join(
        choice["delta"].get("content") or ""
        for block in events[:-1]
        for choice in json.loads(block[len("data: ") :])["choices"]
    )
    assert content == reply_text(TOKENS)
    assert fake.streams_completed == 1

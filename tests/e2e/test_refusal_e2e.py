"""End to end: the official SDKs see why the proxy refused a request (``x-muxproxy-reason``
and their API's own error object, ``core/exchange/refusal.py``).

A real proxy in front of the fake LLM server on 127.0.0.1, the ``openai`` and ``anthropic``
SDKs as clients (each in a worker thread, no retries); every wait under ``trio.fail_after``.
"""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest
import trio

from muxproxy.config import Config, Listener, RateLimit, Route, Server, Upstream

TEST_TIMEOUT = 15


def config(port: int, budget: RateLimit) -> Config:
    group = Upstream(name="llm", servers=(Server(address=f"127.0.0.1:{port}"),), rate_limit=budget)
    return Config(
        listeners=(Listener(address="127.0.0.1:0"),),
        upstreams={"llm": group},
        routes=(Route(prefix="/", upstream="llm"),),
    )


def clients(url: str) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    return (
        openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=10),
        anthropic.Anthropic(base_url=url, api_key="k", max_retries=0, timeout=10),
    )


def chat(client: openai.OpenAI, max_tokens: int = 4) -> Any:
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens
    )


def message(client: anthropic.Anthropic, max_tokens: int = 4) -> Any:
    return client.messages.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens
    )


async def test_both_sdks_see_a_rate_limited_refusal_with_its_reason(
    start_backend: Any, start_proxy: Any
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        fake, port = await start_backend(tokens=2, delay=0.001)
        proxy = await start_proxy(config=config(port, RateLimit(requests_per_minute=1)))
        to_openai, to_anthropic = clients(proxy.url)

        def use_sdks() -> tuple[Any, pytest.ExceptionInfo[Any], pytest.ExceptionInfo[Any]]:
            served = chat(to_openai)  # the minute's one request
            with pytest.raises(anthropic.RateLimitError) as by_anthropic:
                message(to_anthropic)
            with pytest.raises(openai.RateLimitError) as by_openai:
                chat(to_openai)
            return served, by_anthropic, by_openai

        served, by_anthropic, by_openai = await trio.to_thread.run_sync(use_sdks)
    assert served.choices[0].message.content
    refused = by_anthropic.value
    assert refused.status_code == 429
    assert refused.response.headers["x-muxproxy-reason"] == "rate_limited"
    assert int(refused.response.headers["retry-after"]) >= 1
    assert refused.body == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": refused.body["error"]["message"]},
    }
    assert "1 requests per minute" in str(refused)
    error = by_openai.value
    assert error.response.headers["x-muxproxy-reason"] == "rate_limited"
    assert error.code == "rate_limited" and error.type == "requests"
    assert fake.requests == 1  # the refused ones never reached the server


async def test_both_sdks_see_a_request_larger_than_its_token_budget(
    start_backend: Any, start_proxy: Any
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        fake, port = await start_backend(tokens=2, delay=0.001)
        proxy = await start_proxy(config=config(port, RateLimit(tokens_per_minute=100)))
        to_openai, to_anthropic = clients(proxy.url)

        def use_sdks() -> tuple[pytest.ExceptionInfo[Any], pytest.ExceptionInfo[Any]]:
            with pytest.raises(anthropic.RateLimitError) as by_anthropic:
                message(to_anthropic, max_tokens=1000)
            with pytest.raises(openai.RateLimitError) as by_openai:
                chat(to_openai, max_tokens=1000)
            return by_anthropic, by_openai

        by_anthropic, by_openai = await trio.to_thread.run_sync(use_sdks)
    for refused in (by_anthropic.value, by_openai.value):
        assert refused.response.headers["x-muxproxy-reason"] == "budget"
        assert refused.response.headers["x-ratelimit-limit-tokens"] == "100"
        assert "retry-after" not in refused.response.headers  # no wait makes it fit
    assert by_anthropic.value.body["error"]["type"] == "rate_limit_error"
    assert by_openai.value.code == "budget" and by_openai.value.type == "tokens"
    assert fake.requests == 0

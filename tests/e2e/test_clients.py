"""End to end: real HTTP clients through the proxy to the fake LLM backend.

httpx over HTTP/1.1, h2c (prior knowledge) and HTTP/2 over TLS (ALPN "h2", a CA and server
certificate made with trustme); curl with ``--http2-prior-knowledge`` and ``--http2`` over TLS;
the ``openai`` SDK, streaming and not. Each streamed reply must be exactly the fake's
``reply_text``: every token relayed, in order, nothing added.
"""

from __future__ import annotations

import json
import ssl
from pathlib import Path
from typing import Any

import attrs
import httpx
import openai
import pytest
import trio
import trustme

from muxproxy.core.events import ConnectionAccepted
from muxproxy.testing.fakellm import MODEL, reply_text

TOKENS = 6


def record_accepted(driver: Any) -> list[ConnectionAccepted]:
    """Every ``ConnectionAccepted`` the ``driver`` feeds its core from now on, as it comes."""
    assert driver is not None
    accepted: list[ConnectionAccepted] = []
    feed = driver.feed

    def counting_feed(event: Any) -> None:
        if isinstance(event, ConnectionAccepted):
            accepted.append(event)
        feed(event)

    driver.feed = counting_feed
    return accepted


def chat_request(tokens: int = TOKENS) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count for me"}],
        "stream": True,
        "max_tokens": tokens,
    }


def sse_text(lines: list[str]) -> tuple[str, int, bool]:
    """The content deltas of an SSE chat stream joined, how many carried text, and whether
    ``[DONE]`` ended it."""
    text = ""
    deltas = 0
    done = False
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            done = True
            continue
        assert not done, "data after [DONE]"
        for choice in json.loads(payload)["choices"]:
            content = choice["delta"].get("content")
            if content:
                text += content
                deltas += 1
    return text, deltas, done


@attrs.frozen
class Tls:
    cert: str
    key: str
    ca_pem: str
    ca: trustme.CA

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context()
        self.ca.configure_trust(context)
        return context


@pytest.fixture
def tls(tmp_path: Path) -> Tls:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    cert = tmp_path / "cert.pem"
    cert.write_bytes(b"".join(blob.bytes() for blob in server.cert_chain_pems))
    key = tmp_path / "key.pem"
    server.private_key_pem.write_to_path(str(key))
    ca_pem = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_pem))
    return Tls(cert=str(cert), key=str(key), ca_pem=str(ca_pem), ca=ca)


async def stream_chat(client: httpx.AsyncClient, url: str) -> tuple[str, str, int, bool]:
    """POST a streaming chat completion; (http version, text, token deltas, [DONE] seen)."""
    async with client.stream("POST", url + "/v1/chat/completions", json=chat_request()) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert "muxproxy" in r.headers["via"]
        lines = [line async for line in r.aiter_lines()]
        return (r.http_version, *sse_text(lines))


# -- httpx ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("http1", "http2", "version"),
    [(True, False, "HTTP/1.1"), (False, True, "HTTP/2")],
    ids=["http1", "h2c-prior-knowledge"],
)
async def test_httpx_plain(start_backend, start_proxy, http1, http2, version):
    fake, backend = await start_backend(delay=0.005)
    proxy = await start_proxy([backend])
    with trio.fail_after(20):
        async with httpx.AsyncClient(http1=http1, http2=http2, timeout=10) as client:
            got_version, text, deltas, done = await stream_chat(client, proxy.url)
    assert got_version == version
    assert text == reply_text(TOKENS)
    assert deltas == TOKENS
    assert done
    assert fake.streams_completed == 1


async def test_httpx_h2_multiplexed_streams(start_backend, start_proxy):
    fake, backend = await start_backend(delay=0.01)
    proxy = await start_proxy([backend])
    accepted = record_accepted(proxy.server.driver)
    results: list[tuple[str, str, int, bool]] = []
    with trio.fail_after(20):
        async with httpx.AsyncClient(http1=False, http2=True, timeout=10) as client:

            async def one() -> None:
                results.append(await stream_chat(client, proxy.url))

            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(one)
    assert results == [("HTTP/2", reply_text(TOKENS), TOKENS, True)] * 8
    assert fake.streams_completed == 8
    # One client connection carried all eight (h2 multiplexing).
    assert len(accepted) == 1 and accepted[0].alpn is None


@pytest.mark.parametrize("http2", [True, False], ids=["h2-alpn", "http1-alpn"])
async def test_httpx_tls(start_backend, start_proxy, tls, http2):
    _, backend = await start_backend(delay=0.005)
    proxy = await start_proxy([backend], tls_cert=tls.cert, tls_key=tls.key)
    url = f"https://127.0.0.1:{proxy.port}"
    with trio.fail_after(20):
        async with httpx.AsyncClient(
            http2=http2, verify=tls.client_context(), timeout=10
        ) as client:
            version, text, deltas, done = await stream_chat(client, url)
            models = await client.get(url + "/v1/models")
    assert version == ("HTTP/2" if http2 else "HTTP/1.1")
    assert (text, deltas, done) == (reply_text(TOKENS), TOKENS, True)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL


# -- curl -----------------------------------------------------------------------------------


async def run_curl(*args: str) -> tuple[str, str]:
    """Run curl on a streaming chat request; (SSE body, %{http_version})."""
    result = await trio.run_process(
        [
            "curl",
            "--silent",
            "--show-error",
            "--no-buffer",
            "--max-time",
            "10",
            "--header",
            "content-type: application/json",
            "--data-binary",
            json.dumps(chat_request()),
            "--write-out",
            "\n%{http_version}",
            *args,
        ],
        capture_stdout=True,
        capture_stderr=True,
    )
    body, _, version = result.stdout.decode().rpartition("\n")
    return body, version


async def test_curl_h2c_prior_knowledge(start_backend, start_proxy):
    _, backend = await start_backend(delay=0.005)
    proxy = await start_proxy([backend])
    with trio.fail_after(20):
        body, version = await run_curl(
            "--http2-prior-knowledge", proxy.url + "/v1/chat/completions"
        )
    assert version == "2"
    assert sse_text(body.splitlines()) == (reply_text(TOKENS), TOKENS, True)


async def test_curl_h2_over_tls(start_backend, start_proxy, tls):
    _, backend = await start_backend(delay=0.005)
    proxy = await start_proxy([backend], tls_cert=tls.cert, tls_key=tls.key)
    with trio.fail_after(20):
        body, version = await run_curl(
            "--http2",
            "--cacert",
            tls.ca_pem,
            f"https://localhost:{proxy.port}/v1/chat/completions",
        )
    assert version == "2"
    assert sse_text(body.splitlines()) == (reply_text(TOKENS), TOKENS, True)


# -- the openai SDK -------------------------------------------------------------------------


def openai_client(proxy: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=10)


async def test_openai_sdk_streaming(start_backend, start_proxy):
    _, backend = await start_backend(delay=0.005)
    proxy = await start_proxy([backend])

    def chat() -> list[str]:
        with openai_client(proxy) as client:
            stream = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "count for me"}],
                stream=True,
                max_tokens=TOKENS,
            )
            return [
                chunk.choices[0].delta.content or ""
                for chunk in stream
                if chunk.choices and chunk.choices[0].delta
            ]

    with trio.fail_after(20):
        deltas = await trio.to_thread.run_sync(chat, abandon_on_cancel=True)
    assert "".join(deltas) == reply_text(TOKENS)
    assert len([d for d in deltas if d]) == TOKENS


async def test_openai_sdk_non_streaming(start_backend, start_proxy):
    _, backend = await start_backend(delay=0.005)
    proxy = await start_proxy([backend])

    def chat() -> Any:
        with openai_client(proxy) as client:
            return client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "count for me"}],
                max_tokens=TOKENS,
            )

    with trio.fail_after(20):
        completion = await trio.to_thread.run_sync(chat, abandon_on_cancel=True)
    assert completion.choices[0].message.content == reply_text(TOKENS)
    assert completion.usage is not None and completion.usage.completion_tokens == TOKENS


async def test_openai_sdk_sees_backend_errors(start_backend, start_proxy):
    """A backend's own error status and JSON body pass through unchanged."""
    _, backend = await start_backend(status=429)
    proxy = await start_proxy([backend])

    def chat() -> None:
        with openai_client(proxy) as client:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )

    with trio.fail_after(20), pytest.raises(openai.RateLimitError) as info:
        await trio.to_thread.run_sync(chat, abandon_on_cancel=True)
    assert info.value.status_code == 429
    assert "fake status 429" in str(info.value)

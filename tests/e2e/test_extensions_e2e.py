"""The two extension examples (``examples/extensions/``) in a real proxy (``ProxyServer``)
before real fake-LLM backends, with httpx as the client.

- API keys: no key or an unknown one is 401 with the OpenAI error object and reaches no
  backend; a known key is served, and its tenant's token budget refuses it (429) once spent
  while another key's budget still admits.
- Header canary: ``x-canary: always`` lands on the canary group's backend, other requests on
  the route's.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from processes import proxy_process

from muxproxy.config import load_config
from muxproxy.testing.fakellm import MODEL
from muxproxy.trio.control import LocalControl

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "extensions"
TEST_TIMEOUT = 10.0


@pytest.fixture(autouse=True)
def examples_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))


def example(name: str, tmp_path: Path, ports: list[int], **replace: str) -> Path:
    """The example's TOML, listening on any port, with the backends at ``ports``, in
    ``tmp_path`` beside a copy of the key file (which it names relative to itself)."""
    text = (EXAMPLES / name).read_text().replace('"127.0.0.1:8080"', '"127.0.0.1:0"')
    for index, port in enumerate(ports):
        text = text.replace(f'"127.0.0.1:900{index + 1}"', f'"127.0.0.1:{port}"')
    for old, new in replace.items():
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text)
    (tmp_path / "keys.txt").write_text((EXAMPLES / "keys.txt").read_text())
    return path


def chat(max_tokens: int = 10) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
    }


async def test_api_keys_answer_401_serve_known_keys_and_budget_each_key(
    tmp_path: Path, start_backend: Any, start_proxy: Any
) -> None:
    fake, port = await start_backend(tokens=10, delay=0.0)
    path = example(
        "apikeys.toml", tmp_path, [port], **{"tokens_per_minute = 20000": "tokens_per_minute = 25"}
    )
    proxy = await start_proxy(config=load_config(path))
    url = proxy.url + "/v1/chat/completions"
    team_a = {"authorization": "Bearer sk-team-a-0123456789"}
    team_b = {"authorization": "Bearer sk-team-b-9876543210"}
    with trio.fail_after(TEST_TIMEOUT):
        async with httpx.AsyncClient() as client:
            for headers in ({}, {"authorization": "Bearer sk-wrong"}):
                refused = await client.post(url, json=chat(), headers=headers)
                assert refused.status_code == 401
                assert refused.json()["error"]["message"] == "invalid API key"
            assert fake.requests == 0
            # 25 tokens a minute, 10 a request: team a's third is refused, team b's served.
            statuses = [
                (await client.post(url, json=chat(), headers=team_a)).status_code for _ in range(3)
            ]
            assert statuses == [200, 200, 429]
            assert (await client.post(url, json=chat(), headers=team_b)).status_code == 200


async def test_header_canary_sends_always_to_the_canary_group(
    tmp_path: Path, start_backend: Any, start_proxy: Any
) -> None:
    stable, stable_port = await start_backend(backend_id="stable", tokens=2, delay=0.0)
    canary, canary_port = await start_backend(backend_id="canary", tokens=2, delay=0.0)
    path = example("header_canary.toml", tmp_path, [stable_port, canary_port])
    proxy = await start_proxy(config=load_config(path))
    url = proxy.url + "/v1/chat/completions"
    with trio.fail_after(TEST_TIMEOUT):
        async with httpx.AsyncClient() as client:
            for _ in range(3):
                response = await client.post(url, json=chat(), headers={"x-canary": "always"})
                assert response.status_code == 200
            response = await client.post(url, json=chat(), headers={"x-canary": "never"})
            assert response.status_code == 200
    assert (canary.requests, stable.requests) == (3, 1)


async def test_api_keys_in_muxproxy_serve_with_two_workers(
    tmp_path: Path, start_backend: Any
) -> None:
    """The example as an operator runs it: ``muxproxy serve --workers 2`` with the module on
    ``PYTHONPATH``. Each worker builds its own instance from the configuration it is sent,
    so every connection (whichever worker accepts it) is checked against the key file."""
    fake, port = await start_backend(tokens=2, delay=0.0)
    path = example("apikeys.toml", tmp_path, [port])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), *sys.path])}
    known = {"authorization": "Bearer sk-team-a-0123456789"}
    with trio.fail_after(3 * TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            async with proxy_process(
                nursery, "--workers", "2", config=path, env=env, stop=signal.SIGTERM
            ) as proxy:
                url = proxy.url + "/v1/chat/completions"
                for _ in range(4):  # fresh connections: the kernel spreads them over workers
                    async with httpx.AsyncClient() as client:
                        refused = await client.post(url, json=chat())
                        served = await client.post(url, json=chat(), headers=known)
                    assert refused.status_code == 401
                    assert served.status_code == 200
            nursery.cancel_scope.cancel()
    assert fake.requests == 4


async def test_a_reload_makes_the_extensions_again_and_a_bad_one_keeps_the_old(
    tmp_path: Path, start_backend: Any, start_proxy: Any
) -> None:
    """A reload (``LocalControl.reload``: the file read again, then ``ProxyServer.reload``)
    makes each extension afresh with its new settings; settings its constructor refuses
    refuse the reload, naming ``extensions[0]``, and the extensions running keep serving."""
    _, port = await start_backend(tokens=2, delay=0.0)
    path = example("apikeys.toml", tmp_path, [port])
    proxy = await start_proxy(config=load_config(path))
    control = LocalControl(proxy.server, config_path=path)
    url = proxy.url + "/v1/chat/completions"
    old_key = {"authorization": "Bearer sk-team-a-0123456789"}
    new_key = {"authorization": "Bearer sk-rotated-000"}
    (tmp_path / "rotated.txt").write_text("sk-rotated-000 team-c\n")
    text = path.read_text()
    with trio.fail_after(TEST_TIMEOUT):
        async with httpx.AsyncClient() as client:

            async def statuses() -> tuple[int, int]:
                old = await client.post(url, json=chat(), headers=old_key)
                new = await client.post(url, json=chat(), headers=new_key)
                return old.status_code, new.status_code

            assert await statuses() == (200, 401)
            path.write_text(text.replace('keys = "keys.txt"', 'keys = "rotated.txt"'))
            assert (await control.reload()).ok
            assert await statuses() == (401, 200)  # the new key file, read by a new instance
            path.write_text(text.replace('keys = "keys.txt"', 'keys = "missing.txt"'))
            refused = await control.reload()
            assert not refused.ok
            (problem,) = refused.errors
            assert "extensions[0].module" in problem and "missing.txt" in problem
            assert await statuses() == (401, 200)  # the running extension goes on

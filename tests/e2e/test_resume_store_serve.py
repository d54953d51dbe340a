"""``muxproxy serve`` processes sharing a real ``redis-server`` (``resume.store``): what the store
holds is checked before it reaches a client, and a replica that dies leaves no resume hanging.

- Records written straight into Redis (as anyone who can reach it could): a head with status
  999, a header value with CR LF, an event entry without its data. A resume of them gets a
  clean 502, and the error log names the stream and why.
- Two processes: the first owns a live stream and is killed with SIGKILL mid-stream; a
  reconnect through the second ends within about ``resume.lease`` seconds with the events
  the store holds and the documented resume error, instead of hanging for a minute.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import coredis
import httpx
import pytest
import trio
from processes import proxy_process

from muxproxy.config import RESUME_CREDENTIALS
from muxproxy.core.streams.resumebind import binding
from muxproxy.testing.fakellm import MODEL
from muxproxy.trio.resumestore import events_key, lease_key, meta_key

TOKEN = "T" * 22
NAMES = [name.encode() for name in RESUME_CREDENTIALS]
SSE = {"Accept": "text/event-stream"}
TOKENS = 40
REQUEST = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": TOKENS,
}


def config_file(tmp_path: Path, name: str, backend: int, store: str) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(
        '[[listeners]]\naddress = "127.0.0.1:0"\n\n'
        f'[upstreams.gpus]\nservers = ["127.0.0.1:{backend}"]\n\n'
        '[[routes]]\nprefix = "/"\nupstream = "gpus"\n'
        f'resume = {{ store = "{store}", linger = 30, lease = 1 }}\n'
    )
    return path


def good_meta(**changes: object) -> dict[bytes, object]:
    fields: dict[bytes, object] = {
        b"credential": binding([], NAMES),  # a resume with no credential matches it
        b"status": 200,
        b"headers": json.dumps([["content-type", "text/event-stream"]]),
        b"version": "1.1",
        b"state": "ended",
        b"first": 1,
        b"last": 2,
    }
    fields.update({name.encode(): value for name, value in changes.items()})
    return fields


@pytest.mark.parametrize(
    ("meta", "entries", "reason"),
    [
        (good_meta(status=999), [b"data: a\n\n"], "status 999"),
        (
            good_meta(headers=json.dumps([["x-a", "1\r\nx-injected: 1"]])),
            [b"data: a\n\n"],
            "control",
        ),
        (good_meta(), [b"x" * 10, None], "no data"),
    ],
)
async def test_a_bad_record_in_the_store_is_dropped_logged_and_answered_cleanly(
    tmp_path: Path, nursery: trio.Nursery, start_backend, redis_server, meta, entries, reason
) -> None:
    fake, backend = await start_backend(tokens=4)
    store = redis_server.url + "/0"
    async with coredis.Redis.from_url(store) as client:
        await client.hset(meta_key(TOKEN.encode()), meta)
        for seq, data in enumerate(entries, start=1):
            fields = {b"d": data} if data is not None else {b"other": b"1"}
            await client.xadd(events_key(TOKEN.encode()), fields, identifier=f"0-{seq}")
    config = config_file(tmp_path, "one", backend, store)
    async with proxy_process(nursery, config=config, stop=signal.SIGTERM) as proxy:
        url = proxy.url + "/v1/chat/completions"
        with trio.fail_after(20):
            async with httpx.AsyncClient() as client:
                headers = {"Last-Event-ID": f"{TOKEN}.0", **SSE}
                response = await client.get(url, headers=headers)
            assert response.status_code == 502
            assert "x-injected" not in response.headers
            line = await proxy.wait_log("resume_store_bad_record")
    assert f"stream={TOKEN}" in line and reason in line
    assert fake.streams_started == 0  # a resume is never a new generation


async def test_a_resume_on_another_process_after_the_owner_was_killed_ends_within_the_lease(
    tmp_path: Path, nursery: trio.Nursery, start_backend, redis_server
) -> None:
    _fake, backend = await start_backend(tokens=TOKENS, delay=0.25)  # 10 s of generation
    store = redis_server.url + "/0"
    one = config_file(tmp_path, "one", backend, store)
    two = config_file(tmp_path, "two", backend, store)
    async with (
        proxy_process(nursery, config=one, stop=signal.SIGTERM) as owner,
        proxy_process(nursery, config=two, stop=signal.SIGTERM) as other,
    ):
        path = "/v1/chat/completions"
        with trio.fail_after(30):
            before = ""
            async with (
                httpx.AsyncClient() as client,
                client.stream("POST", owner.url + path, json=REQUEST) as response,
            ):
                async for text in response.aiter_text():
                    before += text
                    if before.count("\n\n") >= 3:
                        break
                last = [line[4:] for line in before.split("\n") if line.startswith("id: ")][-1]
                token, seq = last.split(".")
                # Until the owner's appends (asynchronous) hold what the client read.
                async with coredis.Redis.from_url(store) as client:
                    while int(await client.hget(meta_key(token.encode()), b"last") or 0) < int(seq):
                        await trio.sleep(0.01)
                owner.send(signal.SIGKILL)  # mid-stream, its stream live in Redis
                await owner.wait_exit()
            async with coredis.Redis.from_url(store) as client:
                assert await client.hget(meta_key(token.encode()), b"state") == b"live"
            started = trio.current_time()
            async with httpx.AsyncClient() as client:
                resumed = await client.get(
                    other.url + path, headers={"Last-Event-ID": last, **SSE}, timeout=30
                )
            took = trio.current_time() - started
            async with coredis.Redis.from_url(store) as client:
                assert await client.exists([lease_key(token.encode())]) == 0
    assert resumed.status_code == 200
    # The events the store held after the id, then the documented resume error, then the end.
    assert resumed.text.endswith("\n\n")
    *events, error = resumed.text[:-2].split("\n\n")
    assert all(event.startswith("data: {") for event in events)
    assert error.startswith("event: error\ndata: ") and '"code": "resume_lost"' in error
    assert took < 5.0  # lease (1 s) + one blocking read (1 s) + margin; it hung 35-90 s

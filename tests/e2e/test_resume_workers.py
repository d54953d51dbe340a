"""``muxproxy serve --workers 2`` with ``resume.store``: a stream cut on one worker process is
resumed on the other, through a real ``redis-server``.

The kernel hands each connection to a worker (SO_REUSEPORT); ``/proc`` tells which one holds
a connection (``test_workers.accepting_worker``), so the reconnect is sent on a connection
the *other* worker accepted: the worker that owns the backend stream is never asked.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import h11
import pytest
import trio
from peers import h1_read_response, h1_request_bytes, open_tcp
from test_workers import MAX_CONNECTIONS, accepting_worker, supervisor

from muxproxy.testing.fakellm import MODEL, reply_text

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="--workers needs Linux (SO_REUSEPORT)"
)

TOKENS = 40
HOST = (b"host", b"proxy.test")
ID = re.compile(rb"^id: (\S+)$", re.M)
REQUEST = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
     "max_tokens": TOKENS}
).encode()  # fmt: skip


def text_of(body: bytes) -> str:
    text = ""
    for line in body.decode().splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[len("data: ") :])["choices"]:
                text += choice.get("delta", {}).get("content") or ""
    return text


async def test_a_stream_cut_on_one_worker_is_resumed_on_the_other(
    tmp_path: Path, start_backend, redis_server
) -> None:
    fake, backend_port = await start_backend(tokens=TOKENS, delay=0.02)
    config = tmp_path / "muxproxy.toml"
    config.write_text(
        '[[listeners]]\naddress = "127.0.0.1:0"\n\n'
        f'[upstreams.gpus]\nservers = ["127.0.0.1:{backend_port}"]\n\n'
        '[[routes]]\nprefix = "/"\nupstream = "gpus"\n'
        f'resume = {{ store = "{redis_server.url}/0", linger = 30 }}\n'
    )
    async with supervisor("--workers", "2", "--config", str(config)) as proxy:
        workers = proxy.workers()
        assert len(workers) == 2
        with trio.fail_after(30):
            # The first client: five events, then its connection is gone.
            async with await open_tcp(proxy.port) as stream:
                conn, data = h1_request_bytes(
                    b"/v1/chat/completions",
                    b"POST",
                    REQUEST,
                    [HOST, (b"content-type", b"application/json")],
                )
                await stream.send_all(data)
                before = b""
                owner = None
                while before.count(b"\n\n") < 5:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        conn.receive_data(await stream.receive_some(65536))
                    elif type(event) is h11.Response:
                        assert event.status_code == 200
                        owner = accepting_worker(
                            proxy.port, stream.socket.getsockname()[1], workers
                        )
                    elif type(event) is h11.Data:
                        before += bytes(event.data)
            before = before[: before.rindex(b"\n\n") + 2]  # the complete events read
            assert owner in workers
            last = ID.findall(before)[-1]

            # The reconnect, on a connection the other worker accepted.
            for _ in range(MAX_CONNECTIONS):
                async with await open_tcp(proxy.port) as stream:
                    conn, data = h1_request_bytes(b"/v1/models", headers=[HOST])
                    await stream.send_all(data)
                    response, _ = await h1_read_response(stream, conn)
                    assert response.status_code == 200
                    port = stream.socket.getsockname()[1]
                    if accepting_worker(proxy.port, port, workers) in (owner, None):
                        continue
                    conn.start_next_cycle()
                    headers = [HOST, (b"last-event-id", last), (b"accept", b"text/event-stream")]
                    data = conn.send(
                        h11.Request(method=b"GET", target=b"/v1/chat/completions", headers=headers)
                    )
                    await stream.send_all(data + conn.send(h11.EndOfMessage()))
                    response, after = await h1_read_response(stream, conn)
                    break
            else:
                raise AssertionError(f"{MAX_CONNECTIONS} connections, none to the other worker")
    # A busy machine may have handed the first client every event in one read: then the
    # stream is over and nothing is left, a 204 (``docs/resume.md``).
    assert response.status_code == (204 if b"data: [DONE]" in before else 200)
    events = (before + after).split(b"\n\n")[:-1]
    ids = [found for event in events for found in ID.findall(event)]
    token = last.split(b".")[0]
    assert ids == [b"%s.%d" % (token, n) for n in range(1, len(events) + 1)]
    assert text_of(before + after) == reply_text(TOKENS)
    assert fake.streams_started == 1
